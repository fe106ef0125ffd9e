"""The trainer: registry, learning, exact resume, atomic and checked checkpoints, the commands."""
import dataclasses
import json
import os
import shutil
import signal

import numpy as np
import pytest

from refmath import train as T
from refmath.commands import main
from refmath.models import MODELS, config_class, gpt, model_module, transformer
from refmath.models.gpt import GPTConfig
from refmath.models.transformer import TransformerConfig
from refmath.fast.flat_adamw import FlatAdamW
from refmath.optim import AdamW

CHARS = {"name": "chars", "seq_len": 16, "n_sentences": 300}
REVERSE = {"name": "reverse", "max_len": 4}


def tiny_gpt(dropout=0.0, d_model=16):
    return GPTConfig(vocab_size=32, max_seq_len=16, n_layers=1, d_model=d_model, n_heads=2,
                     d_ff=32, dropout=dropout)


def tiny_transformer():
    return TransformerConfig(vocab_size=14, max_seq_len=5, n_layers=1, d_model=16, n_heads=2,
                             d_ff=32, dropout=0.0, label_smoothing=0.0)


def run_gpt(directory, steps, dropout=0.0, **kwargs):
    kwargs.setdefault("eval_every", steps)
    return T.train("gpt", directory, steps=steps, batch_size=8, lr=2e-2, task=CHARS,
                   config=tiny_gpt(dropout), out=open(os.devnull, "w"), **kwargs)


# ---- the registry --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(MODELS))
def test_registry(name):
    module = model_module(name)
    for function in ("param_shapes", "init_params", "forward", "backward", "logits"):
        assert callable(getattr(module, function))
    task = T.make_task(T.recipe(name).task)
    config = T.default_config(name, task)
    assert isinstance(config, config_class(name))
    assert config.vocab_size == task.vocab_size
    assert json.loads(json.dumps(dataclasses.asdict(config))) == dataclasses.asdict(config)
    assert set(module.param_shapes(config)) == set(module.init_params(config, 0))
    with pytest.raises(ValueError, match="model must be one of"):
        T.recipe("bert")


def test_settings():
    s = T.TrainSettings(steps=50, batch_size=4, lr=1e-3)
    assert s.warmup == 5  # a tenth of the steps
    assert s.lr_at(5) == 1e-3 and s.lr_at(50) == pytest.approx(1e-4)
    for bad in (dict(steps=0), dict(lr=0.0), dict(warmup=50), dict(grad_clip=-1.0)):
        with pytest.raises(ValueError):
            T.TrainSettings(**{**dict(steps=50, batch_size=4, lr=1e-3), **bad})


# ---- learning ------------------------------------------------------------------------------------

def test_gpt_learns_beyond_the_unigram_baseline(tmp_path):
    # The unigram entropy (2.91 nats) is the best loss without context. Measured: after 60 steps
    # this run's validation loss is 2.19, starting from log 32 = 3.47 at initialisation; asserting
    # 0.3 nats below the baseline leaves room for BLAS rounding while still requiring that the
    # model uses the previous characters.
    result = run_gpt(tmp_path, 60)
    assert result.history["train_loss"][0] == pytest.approx(np.log(32), abs=0.05)
    assert result.final["val"] < result.unigram_entropy - 0.3
    assert result.final["train"] < result.unigram_entropy - 0.3
    assert result.history["train_loss"].dtype == np.float64 and len(result.history["lr"]) == 60


def test_transformer_learns_to_reverse(tmp_path):
    # Unigram entropy of the targets: 2.24 nats. Measured after 60 steps: 1.54 (validation).
    result = T.train("transformer", tmp_path, steps=60, batch_size=16, lr=1e-2, task=REVERSE,
                     config=tiny_transformer(), eval_every=60, accuracy_examples=50,
                     out=open(os.devnull, "w"))
    assert result.final["val"] < result.unigram_entropy - 0.4
    assert 0.0 <= result.accuracy <= 1.0


def test_a_decoder_learns_the_reversal_as_prompt_and_answer(tmp_path):
    # Task reverse-lm (L5): the loss counts the answer only. Unigram entropy of the answer
    # tokens: 2.24 nats; measured after 60 steps: 1.22 (validation), accuracy 17% on 100 sources.
    result = T.train("gpt", tmp_path, steps=60, batch_size=16, lr=2e-2,
                     task={"name": "reverse-lm", "max_len": 4}, eval_every=60, accuracy_examples=50,
                     config=GPTConfig(vocab_size=15, max_seq_len=10, n_layers=1, d_model=16,
                                      n_heads=2, d_ff=32, dropout=0.0), out=open(os.devnull, "w"))
    assert result.final["val"] < result.unigram_entropy - 0.5
    assert 0.0 <= result.accuracy <= 1.0
    with pytest.raises(ValueError, match="learns the tasks"):
        T.train("transformer", tmp_path / "t", task={"name": "chars"})


# ---- exact resume --------------------------------------------------------------------------------

def test_resume_is_exact(tmp_path):
    # Dropout on, so the saved generator state matters; the stop falls between two evaluations.
    straight = run_gpt(tmp_path / "straight", 12, dropout=0.1, eval_every=4)
    first = run_gpt(tmp_path / "split", 12, dropout=0.1, eval_every=4, stop_after=6)
    assert first.step == 6 and first.final is None
    second = T.train(None, tmp_path / "split", resume=True, eval_every=4, out=open(os.devnull, "w"))
    assert second.step == 12
    for key in T.HISTORY_KEYS:
        np.testing.assert_array_equal(second.history[key], straight.history[key], err_msg=key)
    a = T.load_checkpoint(tmp_path / "straight")
    b = T.load_checkpoint(tmp_path / "split")
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name], err_msg=name)
        assert a.params[name].dtype == np.float32
    for key in a.optimizer:
        np.testing.assert_array_equal(a.optimizer[key], b.optimizer[key], err_msg=key)
    assert a.rng_state == b.rng_state and a.data_position == b.data_position == 12



def test_a_checkpoint_of_the_per_parameter_adamw_resumes_exactly_with_the_flat_one(
        tmp_path, monkeypatch):
    # Runs saved before training moved to FlatAdamW hold the per-parameter AdamW's state, under
    # the same keys. Here the first half of a run trains with that AdamW and the rest resumes with
    # FlatAdamW: as the two update bit for bit alike, the run equals one with FlatAdamW throughout.
    real_adamw, built = T._adamw, []

    def per_parameter(settings, params):
        built.append(AdamW)
        return AdamW(settings.lr, (settings.beta1, settings.beta2),
                     weight_decay=settings.weight_decay)

    def recorded(settings, params):
        optimizer = real_adamw(settings, params)
        built.append(type(optimizer))
        return optimizer

    monkeypatch.setattr(T, "_adamw", recorded)
    straight = run_gpt(tmp_path / "straight", 12, dropout=0.1, eval_every=4)
    monkeypatch.setattr(T, "_adamw", per_parameter)
    run_gpt(tmp_path / "split", 12, dropout=0.1, eval_every=4, stop_after=6)
    old = T.load_checkpoint(tmp_path / "split")
    assert old.step == 6
    assert sorted(old.optimizer) == sorted(["step"] + [f"{b}.{n}" for b in "mv" for n in old.params])
    monkeypatch.setattr(T, "_adamw", recorded)
    resumed = T.train(None, tmp_path / "split", resume=True, eval_every=4, out=open(os.devnull, "w"))
    assert built == [FlatAdamW, AdamW, FlatAdamW] and resumed.step == 12
    for key in T.HISTORY_KEYS:
        np.testing.assert_array_equal(resumed.history[key], straight.history[key], err_msg=key)
    a, b = T.load_checkpoint(tmp_path / "straight"), T.load_checkpoint(tmp_path / "split")
    for name in a.params:
        np.testing.assert_array_equal(b.params[name], a.params[name], err_msg=name)
    assert sorted(a.optimizer) == sorted(b.optimizer)
    for key in a.optimizer:
        np.testing.assert_array_equal(b.optimizer[key], a.optimizer[key], err_msg=key)

def test_ctrl_c_finishes_the_step_saves_and_resumes_exactly(tmp_path, monkeypatch):
    straight = run_gpt(tmp_path / "straight", 8, dropout=0.1, eval_every=4)
    real_forward, calls = gpt.forward, []

    def forward_with_ctrl_c(params, batch, config, train=False, rng=None):
        if train:
            calls.append(1)
            if len(calls) == 3:
                signal.raise_signal(signal.SIGINT)  # the user presses Ctrl-C during step 3
        return real_forward(params, batch, config, train, rng)

    monkeypatch.setattr(gpt, "forward", forward_with_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        run_gpt(tmp_path / "split", 8, dropout=0.1, eval_every=4)
    monkeypatch.setattr(gpt, "forward", real_forward)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    assert T.load_checkpoint(tmp_path / "split").step == 3  # step 3 was completed, then saved
    resumed = T.train(None, tmp_path / "split", resume=True, eval_every=4, out=open(os.devnull, "w"))
    np.testing.assert_array_equal(resumed.history["train_loss"], straight.history["train_loss"])


def test_resume_checks_its_arguments(tmp_path):
    run_gpt(tmp_path, 4, stop_after=2)
    with pytest.raises(T.CheckpointError, match="--lr 0.5 differs"):
        T.train(None, tmp_path, resume=True, lr=0.5)
    with pytest.raises(T.CheckpointError, match="not 'llama'"):
        T.train("llama", tmp_path, resume=True)
    with pytest.raises(T.CheckpointError, match="already holds a run"):
        run_gpt(tmp_path, 4)


# ---- atomic checkpoints --------------------------------------------------------------------------

def test_a_failed_write_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    run_gpt(tmp_path, 6, stop_after=3, eval_every=3)
    before = T.load_checkpoint(tmp_path)
    real_savez = np.savez

    def savez_then_crash(file, **arrays):
        real_savez(file, **arrays)  # the whole archive lands in the temporary file ...
        file.truncate(file.tell() // 2)  # ... then half of it is lost, and the process "dies"
        raise RuntimeError("simulated crash during the write")

    monkeypatch.setattr(np, "savez", savez_then_crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        T.train(None, tmp_path, resume=True, eval_every=3, out=open(os.devnull, "w"))
    monkeypatch.setattr(np, "savez", real_savez)

    after = T.load_checkpoint(tmp_path)
    assert after.step == before.step == 3
    for name in before.params:
        np.testing.assert_array_equal(after.params[name], before.params[name])
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]  # the temporary is gone
    # and the run still resumes from there
    assert T.train(None, tmp_path, resume=True, out=open(os.devnull, "w")).step == 6


# ---- bad checkpoints -----------------------------------------------------------------------------

@pytest.fixture
def saved_run(tmp_path):
    run_gpt(tmp_path / "run", 2)
    return tmp_path / "run"


def _as_written_before(run, field: str, value) -> None:
    """Make ``run`` a run as an older refmath wrote it: its GPT configuration's ``ffn`` saved as
    ``field`` = ``value`` in both config.json and the copy the checkpoint embeds."""
    def old(meta):
        config = {k: v for k, v in meta["config"].items() if k != "ffn"}
        return {**meta, "config": {**config, field: value}}

    config_path, path = run / "config.json", run / "checkpoint.npz"
    config_path.write_text(json.dumps(old(json.loads(config_path.read_text())), indent=2))
    with np.load(path) as npz:
        arrays = dict(npz)
    arrays["meta"] = np.array(json.dumps(old(json.loads(str(arrays["meta"]))), sort_keys=True))
    np.savez(path, **arrays)


@pytest.mark.parametrize("saved, ffn", [(True, "gelu_tanh"), (False, "gelu")])
def test_a_run_saved_with_gelu_approximate_still_loads_and_resumes(tmp_path, saved, ffn):
    # GPTConfig.gelu_approximate became ffn ("gelu_tanh" / "gelu"): refmath.models.
    # RETIRED_CONFIG_FIELDS translates it
    saved_run = tmp_path / "run"
    run_gpt(saved_run, 2, stop_after=1)
    before = T.load_checkpoint(saved_run)
    _as_written_before(saved_run, "gelu_approximate", saved)
    assert "gelu_approximate" in json.loads((saved_run / "config.json").read_text())["config"]
    loaded = T.load_checkpoint(saved_run)
    assert loaded.config == dataclasses.replace(before.config, ffn=ffn)
    for name, value in before.params.items():
        np.testing.assert_array_equal(loaded.params[name], value)
    assert T.train(None, saved_run, resume=True, out=open(os.devnull, "w")).step == 2
    assert T.load_checkpoint(saved_run).config.ffn == ffn  # the file keeps its old field
    _as_written_before(saved_run, "gelu_approximate", "tanh")  # never a flag's value: refused
    with pytest.raises(T.CheckpointError, match=r"invalid configuration.*ffn must be one of"):
        T.load_checkpoint(saved_run)


def test_truncated_or_corrupt_checkpoint(saved_run):
    path = saved_run / "checkpoint.npz"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(T.CheckpointError, match=r"checkpoint\.npz: truncated or corrupt"):
        T.load_checkpoint(saved_run)
    path.write_bytes(b"not a zip file at all")
    with pytest.raises(T.CheckpointError, match=r"checkpoint\.npz: truncated or corrupt"):
        T.load_checkpoint(saved_run)
    path.unlink()
    with pytest.raises(T.CheckpointError, match=r"checkpoint\.npz: no such file"):
        T.load_checkpoint(saved_run)


def test_bad_config_file(saved_run):
    config = saved_run / "config.json"
    config.write_text("{ not json")
    with pytest.raises(T.CheckpointError, match=r"config\.json: not valid JSON"):
        T.load_checkpoint(saved_run)
    config.unlink()
    with pytest.raises(T.CheckpointError, match=r"config\.json: no such file"):
        T.load_checkpoint(saved_run)


def test_checkpoint_of_another_model_or_config(saved_run, tmp_path):
    with pytest.raises(T.CheckpointError, match=r"config\.json: the checkpoint is of model 'gpt', not 'mla'"):
        T.load_checkpoint(saved_run, model="mla")
    with pytest.raises(T.CheckpointError, match=r"d_model: 16 vs 24"):
        T.load_checkpoint(saved_run, config=tiny_gpt(d_model=24))
    # A checkpoint.npz of another run next to this run's config.json
    other = tmp_path / "other"
    T.train("gpt", other, steps=1, batch_size=8, lr=1e-2, task=CHARS, config=tiny_gpt(d_model=24),
            out=open(os.devnull, "w"))
    shutil.copy(other / "checkpoint.npz", saved_run / "checkpoint.npz")
    with pytest.raises(T.CheckpointError, match="describe different runs.*d_model"):
        T.load_checkpoint(saved_run)


def test_parameters_that_do_not_fit_the_config(saved_run):
    path = saved_run / "checkpoint.npz"
    with np.load(path) as npz:
        arrays = dict(npz)
    arrays["params.pos_emb"] = arrays["params.pos_emb"][:8]
    np.savez(path, **arrays)
    with pytest.raises(T.CheckpointError, match=r"pos_emb \(8, 16\) \(config says \(16, 16\)\)"):
        T.load_checkpoint(saved_run)
    del arrays["params.pos_emb"]
    np.savez(path, **arrays)
    with pytest.raises(T.CheckpointError, match=r"missing \['pos_emb'\]"):
        T.load_checkpoint(saved_run)
    del arrays["rng_state"]
    np.savez(path, **arrays)
    with pytest.raises(T.CheckpointError, match=r"missing entries \['rng_state'\]"):
        T.load_checkpoint(saved_run)


# ---- the commands --------------------------------------------------------------------------------

@pytest.fixture
def small_defaults(monkeypatch):
    """The commands' code paths with tiny default models, so that they run in a blink."""
    monkeypatch.setattr(gpt, "TRAINING_RECIPE", gpt.TRAINING_RECIPE._replace(
        task=CHARS, config=dict(n_layers=1, d_model=16, n_heads=2, d_ff=32, dropout=0.0)))
    monkeypatch.setattr(transformer, "TRAINING_RECIPE", transformer.TRAINING_RECIPE._replace(
        task=REVERSE, config=dict(n_layers=1, d_model=16, n_heads=2, d_ff=32, dropout=0.0,
                                  label_smoothing=0.0)))


def test_train_and_generate_commands_for_a_decoder(tmp_path, capsys, small_defaults):
    out = tmp_path / "gpt"
    args = ["train", "--model", "gpt", "--steps", "2", "--eval-every", "1",
            "--out", str(out), "--no-progress"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "validation" in printed and "unigram-entropy baseline" in printed
    assert "entropy rate of the generated text" in printed
    args = ["generate", "--checkpoint", str(out), "--prompt", "the ",
            "--max-new-tokens", "12", "--top-k", "5"]
    assert main(args) == 0
    captured = capsys.readouterr()
    text = captured.out
    # 12 new tokens; a barely trained model may still pick a special id, printed as its name
    assert text.startswith("the ") and len(text) >= len("the ") + 12 + 1  # + print's newline
    assert "(12 tokens in" in captured.err and "tokens/s; KV cache on numpy" in captured.err
    # the C++ kernels and plain recomputation give the same greedy text as the NumPy cache
    texts = {}
    for flags in ([], ["--backend", "cpu"], ["--no-cache"]):
        args = ["generate", "--checkpoint", str(out), "--prompt", "the ",
                "--max-new-tokens", "30", "--greedy", *flags]
        assert main(args) == 0
        texts[" ".join(flags)] = capsys.readouterr().out
    assert len(set(texts.values())) == 1, texts
    args = ["generate", "--checkpoint", str(out), "--prompt", "THE"]
    assert main(args) == 2
    assert "'T' at position 0" in capsys.readouterr().err
    args = ["generate", "--checkpoint", str(out), "--temperature", "0"]
    assert main(args) == 2
    assert "temperature" in capsys.readouterr().err
    # resuming a finished run changes nothing and reports again
    args = ["train", "--out", str(out), "--resume", "--no-progress"]
    assert main(args) == 0
    assert "finished at step 2 of 2: nothing left to do" in capsys.readouterr().out


def test_train_and_generate_commands_for_the_transformer(tmp_path, capsys, small_defaults):
    out = tmp_path / "transformer"
    args = ["train", "--model", "transformer", "--steps", "1", "--out", str(out),
            "--no-progress"]
    assert main(args) == 0
    assert "exact-match accuracy of greedy decoding" in capsys.readouterr().out
    args = ["generate", "--checkpoint", str(out), "--prompt", "1234", "--greedy"]
    assert main(args) == 0
    assert capsys.readouterr().out.startswith("1234 -> ")
    # trained on at most 4 digits (REVERSE): a longer prompt is named as the problem
    assert main(["generate", "--checkpoint", str(out), "--prompt", "12345"]) == 2
    assert capsys.readouterr().err == ("refmath generate: --prompt has 5 digits, but this model "
                                       "was trained on at most 4: give 1 to 4 digits\n")
    assert main(["generate", "--checkpoint", str(out), "--prompt", "12", "--max-new-tokens", "9"]) == 2
    assert "--max-new-tokens must be at most 5 for this model (its longest output: 4 digits and <eos>)" \
        in capsys.readouterr().err


def test_generate_command_for_the_reversal_by_a_decoder(tmp_path, capsys, small_defaults):
    out = tmp_path / "rlm"
    args = ["train", "--model", "gpt", "--task", "reverse-lm", "--steps", "1",
            "--out", str(out), "--no-progress"]
    assert main(args) == 0
    assert "exact-match accuracy" in capsys.readouterr().out
    args = ["generate", "--checkpoint", str(out), "--prompt", "123", "--greedy"]
    assert main(args) == 0
    assert capsys.readouterr().out.startswith("123 -> ")
    assert main(["generate", "--checkpoint", str(out), "--prompt", "123456789"]) == 2
    assert "--prompt has 9 digits, but this model was trained on at most 8" in capsys.readouterr().err


def test_resume_keeps_the_evaluation_interval(tmp_path):
    run_gpt(tmp_path, 6, stop_after=2, eval_every=2)
    result = T.train(None, tmp_path, resume=True, out=open(os.devnull, "w"))
    np.testing.assert_array_equal(result.history["eval_step"], [2, 4, 6])
    with pytest.raises(T.CheckpointError, match="--eval-every 3 differs from the run's 2"):
        T.train(None, tmp_path, resume=True, eval_every=3)


def test_command_errors(tmp_path, capsys):
    args = ["train", "--steps", "2"]
    assert main(args) == 2
    assert f"give --model, one of {', '.join(sorted(MODELS))}" in capsys.readouterr().err
    args = ["train", "--resume"]
    assert main(args) == 2
    assert "--resume needs the run directory: --out DIR" in capsys.readouterr().err
    for flag, value, message in (("--steps", "0", "--steps must be an int >= 1, got 0"),
                                 ("--lr", "-1", "--lr must be a finite number > 0, got -1.0"),
                                 ("--lr", "nan", "--lr must be a finite number > 0, got nan"),
                                 ("--eval-every", "0", "--eval-every must be an int >= 1, got 0")):
        args = ["train", "--model", "gpt", "--out", str(tmp_path / "x"), flag, value]
        assert main(args) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    args = ["train", "--model", "gpt", "--out", "/proc/refmath_x"]
    assert main(args) == 2
    assert "cannot write the run directory /proc/refmath_x" in capsys.readouterr().err
    args = ["train", "--out", str(tmp_path / "none"), "--resume"]
    assert main(args) == 2
    assert "no such file" in capsys.readouterr().err
    args = ["generate", "--checkpoint", str(tmp_path)]
    assert main(args) == 2


def _rewrite_meta(directory, change):
    """Apply ``change`` to a run's metadata in config.json and in the copy checkpoint.npz embeds."""
    meta = json.loads((directory / "config.json").read_text())
    change(meta)
    (directory / "config.json").write_text(json.dumps(meta))
    with np.load(directory / "checkpoint.npz") as npz:
        arrays = dict(npz)
    arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
    np.savez(directory / "checkpoint.npz", **arrays)


def test_a_run_records_its_tokenizer_so_generate_need_not_rebuild_the_corpus(
        saved_run, capsys, monkeypatch):
    from refmath.data import make_task

    meta = json.loads((saved_run / "config.json").read_text())
    task = make_task(CHARS)
    assert meta["tokenizer"] == {"alphabet": task.tokenizer.alphabet}
    assert T.load_tokenizer(saved_run).alphabet == task.tokenizer.alphabet

    def no_corpus(settings):
        raise AssertionError("the task was rebuilt")
    with monkeypatch.context() as patched:
        patched.setattr(T, "make_task", no_corpus)
        patched.setattr("refmath.data.make_task", no_corpus)
        assert main(["generate", "--checkpoint", str(saved_run), "--greedy",
                     "--max-new-tokens", "5"]) == 0
    recorded = capsys.readouterr().out

    # a run written before config.json held the tokenizer: rebuilt from the task, same text
    _rewrite_meta(saved_run, lambda meta: meta.pop("tokenizer"))
    assert T.load_tokenizer(saved_run).alphabet == task.tokenizer.alphabet
    assert main(["generate", "--checkpoint", str(saved_run), "--greedy",
                 "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out == recorded


def test_a_run_without_a_recorded_tokenizer_resumes_as_it_was_written(tmp_path):
    run_gpt(tmp_path, 4, stop_after=2, eval_every=2)
    _rewrite_meta(tmp_path, lambda meta: meta.pop("tokenizer"))
    T.train(None, tmp_path, resume=True, out=open(os.devnull, "w"))
    # the checkpoint written on resuming embeds config.json as it is, so the pair still loads
    assert T.load_checkpoint(tmp_path).step == 4
    assert "tokenizer" not in json.loads((tmp_path / "config.json").read_text())


def test_a_recorded_tokenizer_that_does_not_fit_is_refused(saved_run, capsys):
    _rewrite_meta(saved_run, lambda meta: meta.update(tokenizer={"alphabet": "ab"}))
    with pytest.raises(T.CheckpointError, match="6 ids do not match the configuration's vocab_size 32"):
        T.load_tokenizer(saved_run)
    _rewrite_meta(saved_run, lambda meta: meta.update(tokenizer={"alphabet": "aa"}))
    with pytest.raises(T.CheckpointError, match="must not repeat characters"):
        T.load_tokenizer(saved_run)
    assert main(["generate", "--checkpoint", str(saved_run)]) == 2
    assert capsys.readouterr().err.startswith("refmath generate: ")


def test_progress_bar_and_plot(tmp_path, capsys):
    pytest.importorskip("tqdm", reason="the progress bar needs tqdm")
    run_gpt(tmp_path, 3, progress=True)
    assert "3/3" in capsys.readouterr().err
    pytest.importorskip("matplotlib", reason="the loss plot needs matplotlib")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- a run that diverges -------------------------------------------------------------------------

def test_a_diverging_run_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    # lr = 1e6 drives the tiny GPT to NaN within a few steps; evaluations every 2 steps checkpoint
    # the last finite state. Nothing of the NaN steps may reach the disk or the history.
    with np.errstate(all="ignore"), pytest.raises(T.TrainingDiverged) as err:
        T.train("gpt", tmp_path, steps=40, batch_size=8, lr=1e6, task=CHARS, config=tiny_gpt(),
                eval_every=2, out=open(os.devnull, "w"))
    message = str(err.value)
    assert "is nan" in message or "is inf" in message or "NaN or inf" in message, message
    assert "learning rate" in message or "evaluation loss" in message, message
    saved = T.load_checkpoint(tmp_path)  # loading checks that every parameter is finite
    assert f"the checkpoint of step {saved.step} in {tmp_path} is untouched" in message
    assert np.isfinite(saved.history["train_loss"]).all()


def test_a_non_finite_gradient_norm_stops_before_the_update(tmp_path, monkeypatch):
    run_gpt(tmp_path, 6, stop_after=2, eval_every=2)
    before = T.load_checkpoint(tmp_path)
    monkeypatch.setattr(T, "clip_grad_norm", lambda grads, max_norm: float("nan"))
    with pytest.raises(T.TrainingDiverged, match=r"step 3: the gradient norm is nan at learning "
                       r"rate .*the checkpoint of step 2 .* is untouched"):
        T.train(None, tmp_path, resume=True, out=open(os.devnull, "w"))
    after = T.load_checkpoint(tmp_path)
    for name in before.params:
        np.testing.assert_array_equal(after.params[name], before.params[name])


def test_a_checkpoint_with_nan_parameters_is_refused(saved_run, capsys):
    path = saved_run / "checkpoint.npz"
    with np.load(path) as npz:
        arrays = dict(npz)
    arrays["params.pos_emb"][0, 0] = np.nan
    np.savez(path, **arrays)
    with pytest.raises(T.CheckpointError, match=r"1 parameter array holds NaN or inf \(first: 'pos_emb'\)"):
        T.load_checkpoint(saved_run)
    args = ["generate", "--checkpoint", str(saved_run)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "NaN or inf" in err


def test_nan_logits_are_refused_by_greedy_and_sampled_decoding():
    from refmath.inference.sampling import token_picker

    logits = np.array([0.5, np.nan, 1.0])
    for greedy in (True, False):
        with pytest.raises(ValueError, match="NaN or \\+inf"):
            token_picker(greedy, 1.0, None, None, 0)(logits)


# ---- every default run converts to Hugging Face ----------------------------------------------------

@pytest.mark.parametrize("name", [n for n in sorted(MODELS) if model_module(n).HF_MODEL_TYPES])
def test_a_default_run_of_every_model_that_has_a_hf_type_converts(name, tmp_path, capsys):
    """``train --model NAME`` with the recipe's configuration, then ``convert --to-hf``: the
    converted directory loads back as the same function (same logits, up to float32 rounding:
    the RoPE layout may be permuted on the way)."""
    pytest.importorskip("safetensors", reason="convert writes safetensors: pip install 'refmath[hf]'")
    pytest.importorskip("tokenizers", reason="convert writes tokenizer.json: pip install 'refmath[hf]'")
    from refmath import hf

    run = T.train(name, tmp_path / "run", steps=1, accuracy_examples=0, out=open(os.devnull, "w"))
    assert run.step == 1
    assert main(["convert", "--to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0, \
        capsys.readouterr().err
    ckpt = T.load_checkpoint(tmp_path / "run")
    loaded, config, params = hf.load_checkpoint(tmp_path / "hf", dtype=np.float32)
    assert loaded == name
    tokens = np.random.default_rng(0).integers(0, ckpt.config.vocab_size, (2, 12))
    module = model_module(name)
    np.testing.assert_allclose(module.logits(params, tokens, config),
                               module.logits(ckpt.params, tokens, ckpt.config), rtol=0, atol=1e-5)


# ---- a run without a progress bar is never silent for long ----------------------------------------

def test_without_a_bar_a_status_line_comes_every_status_every_seconds_and_resume_says_its_step(
        tmp_path):
    import io

    out = io.StringIO()
    T.train("gpt", tmp_path, steps=6, batch_size=4, lr=2e-2, task=CHARS, config=tiny_gpt(),
            eval_every=3, status_every=0.0, stop_after=4, out=out)
    lines = out.getvalue().splitlines()
    assert [line.split()[:4] for line in lines if "loss" in line] == [
        ["step", "1", "of", "6"], ["step", "2", "of", "6"], ["step", "4", "of", "6"]]
    assert sum(line.split()[:2] == ["step", "3"] and "val" in line for line in lines) == 1
    out = io.StringIO()
    T.train(None, tmp_path, resume=True, status_every=3600.0, out=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == f"resuming the run in {tmp_path} at step 4 of 6"
    assert not any("loss" in line for line in lines)  # nothing but evaluations within an hour
    with pytest.raises(ValueError, match="status_every"):
        T.train("gpt", tmp_path / "other", steps=1, status_every=-1.0)


# ---- mixtures of experts -------------------------------------------------------------------------

def tiny_llama(**fields):
    from refmath.models.decoder import DecoderConfig

    return DecoderConfig(vocab_size=32, max_seq_len=16, d_model=16, n_layers=2, n_heads=2,
                         n_kv_heads=1, d_ff=32, **fields)


def test_a_decoder_with_experts_learns_logs_its_balance_and_resumes_exactly(tmp_path):
    """--experts: the log shows the balance loss and the busiest expert's load, the losses are
    cross-entropies (the auxiliary loss left out, it is added only to what is minimised), and a
    resumed run is the straight run bit for bit."""
    config = T.with_experts(tiny_llama(), 4, top_k=2)
    assert config.moe.n_experts == 4 and config.moe.d_expert == 16  # d_f / k, a multiple of 8
    log = tmp_path / "log"
    with open(log, "w") as out:
        straight = T.train("llama", tmp_path / "straight", steps=30, batch_size=8, lr=2e-2,
                           task=CHARS, config=config, eval_every=10, out=out)
    lines = [line for line in log.read_text().splitlines() if line.startswith("step")]
    assert len(lines) == 3 and all("aux 0.0" in line and "busiest expert" in line
                                   for line in lines)
    assert straight.history["eval_val"][-1] < straight.unigram_entropy
    T.train("llama", tmp_path / "split", steps=30, batch_size=8, lr=2e-2, task=CHARS,
            config=config, eval_every=10, stop_after=20, out=open(os.devnull, "w"))
    resumed = T.train(None, tmp_path / "split", resume=True, out=open(os.devnull, "w"))
    for key in T.HISTORY_KEYS:
        np.testing.assert_array_equal(resumed.history[key], straight.history[key], err_msg=key)
    saved = T.load_checkpoint(tmp_path / "split")
    assert saved.config.moe == config.moe  # the experts round-trip through config.json


def test_the_selection_bias_moves_against_the_load_after_each_step(tmp_path):
    """DeepSeek-V3's auxiliary-loss-free balancing (E6): the optimiser leaves the bias alone (its
    gradient is zero), and each step moves it by bias_speed against that step's load; without a
    speed it stays where it started."""
    from refmath.moe import balance_bias_update

    moe = dict(n_experts=4, top_k=2, d_expert=16, scoring="sigmoid", routing="noaux_tc",
               n_groups=2, topk_groups=1, norm_topk=True, score_bias=True)
    for speed in (0.0, 1e-3):
        config = tiny_llama(moe=dict(moe, bias_speed=speed))
        directory = tmp_path / f"speed{speed}"
        T.train("llama", directory, steps=3, batch_size=8, lr=1e-2, task=CHARS, config=config,
                eval_every=3, out=open(os.devnull, "w"))
        bias = T.load_checkpoint(directory).params["layers.0.ffn.router.bias"]
        if speed == 0.0:
            assert not bias.any()
        else:  # three steps of +-speed, or 0 at exactly the mean load
            steps = np.round(bias / np.float32(speed))
            assert np.allclose(bias, steps * np.float32(speed), atol=1e-9) and np.abs(steps).max() <= 3
            assert np.abs(steps).max() >= 1
    # the rule itself: over- and underloaded experts, one exactly at the mean
    np.testing.assert_array_equal(
        balance_bias_update(np.zeros(3, np.float32), np.array([5.0, 1.0, 3.0]), 0.5),
        np.array([-0.5, 0.5, 0.0], np.float32))


def test_the_experts_flag(tmp_path, capsys):
    out = tmp_path / "moe"
    assert main(["train", "--model", "gpt", "--experts", "4", "--out", str(out),
                 "--no-progress"]) == 2
    assert "--experts: a GPTConfig has no mixture-of-experts layers" in capsys.readouterr().err
    assert main(["train", "--model", "llama", "--experts", "4", "--top-k", "5", "--out", str(out),
                 "--no-progress"]) == 2
    assert "top_k = 5 is larger than n_experts = 4" in capsys.readouterr().err
    assert main(["train", "--model", "llama", "--experts", "0", "--out", str(out),
                 "--no-progress"]) == 2
    assert "--experts" in capsys.readouterr().err


# ---- threads -------------------------------------------------------------------------------------

@pytest.mark.parametrize("threads", [1, 2])
def test_threads_sets_the_kernels_openmp_threads_for_the_run_and_restores_them(
        tmp_path, monkeypatch, threads):
    from refmath import kernels

    if not kernels.cpu_available():
        pytest.skip("the C++ module is not built")
    seen = []  # the kernels' thread count at every call of the FlashAttention kernel
    forward = kernels.flash_attention_forward

    def watched(*args, **kwargs):
        seen.append(kernels.cpu_threads())
        return forward(*args, **kwargs)

    monkeypatch.setattr(kernels, "flash_attention_forward", watched)
    before = kernels.set_cpu_threads(3)  # a setting of the caller's, different from both
    try:
        T.train("gpt", tmp_path, steps=2, batch_size=4, lr=2e-2, task=CHARS,
                config=dataclasses.replace(tiny_gpt(), attention_backend="cpu"), eval_every=2,
                threads=threads, out=open(os.devnull, "w"))
        assert seen and set(seen) == {threads}  # training steps and the evaluation alike
        assert kernels.cpu_threads() == 3  # the caller's setting is back
        seen.clear()
        T.train("gpt", tmp_path / "default", steps=1, batch_size=4, lr=2e-2, task=CHARS,
                config=dataclasses.replace(tiny_gpt(), attention_backend="cpu"), eval_every=1,
                out=open(os.devnull, "w"))
        assert seen and set(seen) == {3}  # no threads given: the count is left as it is
    finally:
        kernels.set_cpu_threads(before)
