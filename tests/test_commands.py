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
