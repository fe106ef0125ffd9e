"""The command line as a whole: every command answers --help, says bad input in the one format, and
keeps argparse's usage errors under its own name. (Each command's own behaviour is tested beside
the library it drives: test_gradcheck, test_sizing, test_train, test_hf, test_assignments,
test_lessons, test_conformance.)"""
import ast
import importlib
import re
from pathlib import Path

import pytest

from refmath import commands
from refmath.commands import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
ACTIONS = {"assignments": ("list", "build", "grade"), "lessons": ("student",),
           "conformance": ("attention",)}


def test_the_package_lists_every_command_module_once():
    on_disk = sorted(p.stem for p in (ROOT / "refmath" / "commands").glob("*.py") if p.stem != "__init__")
    assert sorted(COMMANDS) == on_disk and len(set(COMMANDS)) == len(COMMANDS)
    for name in COMMANDS:
        module = importlib.import_module(f"refmath.commands.{name}")
        assert isinstance(module.HELP, str) and isinstance(module.DESCRIPTION, str), name
        assert callable(module.add_arguments) and callable(module.run), name


def test_the_commands_import_no_private_name():
    for path in sorted((ROOT / "refmath" / "commands").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name}:{node.lineno} imports {private} from {node.module}"


@pytest.mark.parametrize("argv", [[]] + [[name] for name in COMMANDS]
                         + [[name, action] for name, actions in ACTIONS.items() for action in actions])
def test_every_command_answers_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {' '.join([commands.PROG, *argv])} ")
    if len(argv) == 1:  # the description is the module's own
        module = importlib.import_module(f"refmath.commands.{argv[0]}")
        assert " ".join(module.DESCRIPTION.split()[:6]) in " ".join(out.split())


def _bad_inputs(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    return {
        "gradcheck": ["--max-coords", "0"],
        "sizes": ["--heads", "32"],
        "train": ["--steps", "2"],
        "generate": ["--checkpoint", str(tmp_path)],
        "convert": ["--to-hf", str(tmp_path / "no_run"), str(tmp_path / "out")],
        "assignments": ["build", "no_such_assignment", "--out", str(tmp_path / "built")],
        "lessons": ["student", "--out", str(a_file)],
        "conformance": ["attention", "no_such_module:attention", "--adapter", "numpy"],
    }


@pytest.mark.parametrize("name", COMMANDS)
def test_bad_input_of_every_command_is_one_line_in_the_one_format(name, tmp_path, capsys):
    argv = _bad_inputs(tmp_path)[name]
    assert main([name, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.fullmatch(rf"refmath {name}: \S[^\n]*\n", captured.err), captured.err
    assert not (tmp_path / "out").exists() and not (tmp_path / "built").exists()


@pytest.mark.parametrize("name", COMMANDS)
def test_usage_errors_are_argparses_under_the_commands_name(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--no-such-flag"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {commands.PROG} {name}") and f"{commands.PROG} {name}" in err
    assert re.search(rf"^{re.escape(commands.PROG)} {name}( \w+)?: error: ", err, re.M), err


# ---- generate --hf: the config's eos_token_id, and the model's context ----------------------------

def _tiny_hf_gpt(directory, **config_fields):
    import json

    import numpy as np

    pytest.importorskip("safetensors", reason="a Hugging Face directory needs safetensors")
    from refmath import hf
    from refmath.models import gpt

    config = gpt.GPTConfig(vocab_size=12, max_seq_len=8, n_layers=1, d_model=8, n_heads=2, d_ff=16)
    rng = np.random.default_rng(3)
    params = {k: v + 0.5 * rng.standard_normal(v.shape).astype(v.dtype)
              for k, v in gpt.init_params(config, seed=3).items()}
    hf.save_checkpoint(directory, "gpt", config, params)
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config_fields}))
    return gpt, config, params


def _generate_ids(directory, capsys, n=6):
    assert main(["generate", "--hf", str(directory), "--prompt-ids", "1", "--greedy",
                 "--max-new-tokens", str(n)]) == 0
    captured = capsys.readouterr()
    return [int(i) for i in captured.out.strip().split(",")], captured.err


def test_generate_hf_stops_at_any_listed_eos_and_ignores_an_unreachable_one(tmp_path, capsys):
    _tiny_hf_gpt(tmp_path, eos_token_id=None)
    free, _ = _generate_ids(tmp_path, capsys)
    assert len(free) == 7
    never = next(i for i in range(12) if i not in free)
    _tiny_hf_gpt(tmp_path, eos_token_id=[never, free[2]])  # a list, as Llama 3's configs have
    ids, err = _generate_ids(tmp_path, capsys)
    assert ids == free[:free.index(free[2], 1) + 1] and len(ids) < len(free)
    assert "warning" not in err

    _tiny_hf_gpt(tmp_path, eos_token_id=50256)  # GPT-2's default, outside a vocabulary of 12
    ids, err = _generate_ids(tmp_path, capsys)
    assert ids == free
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "eos_token_id 50256" in warnings[0] and "12 tokens" in warnings[0]


def test_generate_weights_are_the_apis_and_a_format_that_cannot_hold_them_is_one_line(
        tmp_path, capsys):
    import numpy as np

    from refmath.inference.generate import generate

    gpt, config, params = _tiny_hf_gpt(tmp_path, eos_token_id=None)
    params = {name: value.astype(np.float32) for name, value in params.items()}  # as --hf loads
    for backend in ("numpy", "cpu"):
        assert main(["generate", "--hf", str(tmp_path), "--prompt-ids", "1", "--greedy",
                     "--max-new-tokens", "6", "--weights", "bf16", "--backend", backend]) == 0
        captured = capsys.readouterr()
        ids = [int(i) for i in captured.out.strip().split(",")]
        assert ids == generate("gpt", params, config, np.array([1]), 6, greedy=True,
                               weights="bf16").tolist()
        assert "bf16 weights (layers and head)" in captured.err
    # d_model = 8: a row of 8 inputs cannot be whole 32-weight Q8_0 blocks
    assert main(["generate", "--hf", str(tmp_path), "--prompt-ids", "1", "--weights", "q8"]) == 2
    err = capsys.readouterr().err.splitlines()  # the loading bar, then the one line
    assert re.fullmatch(r"refmath generate: weights='q8_0' stores .* whole 32-weight blocks.*",
                        err[-1]), err
    assert sum("refmath generate" in line for line in err) == 1


def test_generate_says_once_that_the_sequence_outgrew_the_context(tmp_path, capsys):
    _tiny_hf_gpt(tmp_path, eos_token_id=None)
    ids, err = _generate_ids(tmp_path, capsys, n=7)  # 8 tokens: exactly the context
    assert "context" not in err
    ids, err = _generate_ids(tmp_path, capsys, n=12)
    assert len(ids) == 13 and err.count("outgrew the model's context of 8 tokens") == 1


# ---- Ctrl-C: one line and exit status 130, whatever the command -------------------------------

# For each command, arguments that parse; its run is replaced by one that is interrupted.
_RUNNABLE = {"gradcheck": [], "sizes": [], "train": ["--model", "gpt"], "generate": ["--checkpoint", "run"],
             "convert": ["--to-hf", "run", "out"], "assignments": ["list"],
             "lessons": ["student", "--out", "out"],
             "conformance": ["attention", "m:f", "--adapter", "numpy"]}


@pytest.mark.parametrize("name", COMMANDS)
def test_ctrl_c_in_any_command_is_one_line_and_status_130(name, monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(f"refmath.commands.{name}"), "run", interrupted)
    assert main([name, *_RUNNABLE[name]]) == 130
    out, err = capsys.readouterr()
    assert out == "" and err == f"refmath {name}: interrupted\n"


def test_a_real_sigint_stops_gradcheck_with_one_line_and_130():
    import signal
    import subprocess
    import sys

    # A shell starts background jobs with SIGINT ignored, and Python then leaves it ignored: give
    # the child the default disposition, as a terminal's foreground command has.
    process = subprocess.Popen([sys.executable, "-u", "-m", "refmath", "gradcheck"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for _ in range(3):  # the header and the first rows: it is checking gradients now
            assert process.stdout.readline(), process.stderr.read()
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130 and err == "refmath gradcheck: interrupted\n", err


def test_generate_says_which_prompt_is_missing_or_doubled(tmp_path, capsys):
    assert main(["generate", "--hf", str(tmp_path)]) == 2
    assert capsys.readouterr().err == ("refmath generate: give the prompt: --prompt TEXT (needs "
                                       "DIR/tokenizer.json) or --prompt-ids 1,2,3 (token ids)\n")
    assert main(["generate", "--hf", str(tmp_path), "--prompt", "a", "--prompt-ids", "1"]) == 2
    assert capsys.readouterr().err == "refmath generate: give --prompt or --prompt-ids, not both\n"


def test_train_and_convert_help_name_the_models_of_the_registry(capsys):
    # The lists of models in the help are read from refmath.models.MODELS, so a new model shows.
    from refmath.models import MODELS, model_module
    from refmath.train import expert_models

    def help_text(name):
        with pytest.raises(SystemExit):
            main([name, "--help"])
        return " ".join(capsys.readouterr().out.split())

    train_help = help_text("train")
    assert "four" not in train_help
    for name in MODELS:
        assert f"{name}:" in train_help or f"{name}," in train_help, name
    assert f"{', '.join(expert_models())}: make every feed-forward" in train_help
    assert set(expert_models()) == {"llama", "mla"}  # the configurations with a moe field today
    writers = [name for name in MODELS if model_module(name).HF_MODEL_TYPES]
    assert f"such a type: {', '.join(writers)}." in help_text("convert")


def test_conformance_help_says_what_the_numpy_adapter_calls(capsys):
    with pytest.raises(SystemExit):
        main(["conformance", "attention", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "numpy: f(q, k, v, mask=None, scale=None) -> o" in text and "True = may attend" in text
