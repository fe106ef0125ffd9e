"""Mutation score: how many of the catalogued mistakes (refmath.mistakes) each check kills.

For every mistake, a fresh copy of the package (``refmath/``, ``tests/``, ``pyproject.toml``) gets
the one-line edit written into its source file, and two checks run on the copy in subprocesses:

- the gradient-check command, ``python -m refmath gradcheck --op GLOB`` with the mistake's glob (the
  cases that exercise the edited function; the full command runs those and more, so this is a lower
  bound on its kill rate). Optimiser and schedule mistakes have no gradient, so the command cannot
  kill them; they are counted, not skipped;
- the test suite, restricted to the test files of the edited module (``RELEVANT_TESTS``: the
  module's own file, the gradient-check and PyTorch-oracle files for ops, the model's two files for
  models), stopping at the first failure. ``tests/test_mistakes.py`` is left out: it re-applies the
  catalogue and would fail on any edited copy, a kill that proves nothing.

A mutant is killed when the check exits non-zero. The unedited copy is run first: both checks must
pass there, or the figures would count broken checks as kills.

    python benchmarks/mutation_score.py            # every mistake, ~10-20 min on 2 cores
    python benchmarks/mutation_score.py --only 'layernorm*' --no-suite

Prints one row per mistake and the kill rates; timings are not asserted.
"""
from __future__ import annotations

import argparse
import ast
import fnmatch
import importlib
import inspect
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from refmath.mistakes import MISTAKES, Mistake  # noqa: E402

_OP_FILES = ["tests/test_gradcheck.py", "tests/test_torch_oracle.py"]
RELEVANT_TESTS = {
    "refmath.softmax": ["tests/test_softmax.py", "tests/test_attention.py"] + _OP_FILES,
    "refmath.norms": ["tests/test_norms.py"] + _OP_FILES,
    "refmath.ffn": ["tests/test_ffn.py"] + _OP_FILES,
    "refmath.attention": ["tests/test_attention.py"] + _OP_FILES,
    "refmath.positions": ["tests/test_positions.py"] + _OP_FILES,
    "refmath.embedding": ["tests/test_embedding.py"] + _OP_FILES,
    "refmath.losses": ["tests/test_losses.py"] + _OP_FILES,
    "refmath.flash": ["tests/test_flash.py", "tests/test_gradcheck.py"],
    "refmath.optim": ["tests/test_optim.py", "tests/test_optim_torch.py"],
    "refmath.models.gpt": ["tests/models/test_gpt.py", "tests/models/test_gpt_torch.py"],
    "refmath.models.decoder": ["tests/models/test_decoder.py", "tests/models/test_decoder_torch.py",
                               "tests/test_gradcheck.py"],
    "refmath.models.mla": ["tests/models/test_mla.py", "tests/models/test_mla_torch.py",
                           "tests/test_gradcheck.py"],
    "refmath.models.transformer": ["tests/models/test_transformer.py",
                                   "tests/models/test_transformer_torch.py"],
    "refmath.moe": ["tests/test_moe.py", "tests/test_moe_torch.py"] + _OP_FILES,
    "refmath.sizing": ["tests/test_sizing.py"],
}
# The files the models are written in, each tested through the models that use it: the blocks
# and the RoPE attention through the decoder (and Cohere, Falcon, OLMo 2, Gemma), the configurations, checkpoint tables
# and gradient cases through their model's files.
_DECODER = RELEVANT_TESTS["refmath.models.decoder"]
_COHERE = ["tests/models/test_cohere.py", "tests/test_gradcheck.py"]
_FALCON = ["tests/models/test_falcon.py", "tests/models/test_falcon_hf.py",
           "tests/models/test_decoder_torch.py", "tests/test_gradcheck.py"]
_OLMO2 = ["tests/models/test_olmo2.py", "tests/models/test_olmo2_hf.py",
          "tests/models/test_decoder_torch.py", "tests/test_gradcheck.py"]
_GEMMA = ["tests/models/test_gemma.py", "tests/models/test_gemma_hf.py",
          "tests/models/test_decoder_torch.py", "tests/test_gradcheck.py"]
RELEVANT_TESTS.update({
    "refmath.models.blocks": _DECODER + _COHERE + _FALCON + _OLMO2 + _GEMMA,
    "refmath.models.rope_attention": _DECODER + _FALCON + _OLMO2 + _GEMMA,
    "refmath.models.decoder_config": _DECODER + ["tests/models/test_config_perturbation.py"],
    "refmath.models.decoder_hf": ["tests/test_hf.py", "tests/models/test_decoder.py"],
    "refmath.models.cases": _DECODER + RELEVANT_TESTS["refmath.models.mla"] + _COHERE,
    "refmath.models.gpt_config": RELEVANT_TESTS["refmath.models.gpt"],
    "refmath.models.contract": ["tests/models/test_contract.py",
                                "tests/models/test_config_perturbation.py"],
    "refmath.models.cohere": _COHERE + ["tests/models/test_config_perturbation.py"],
    "refmath.models.falcon": _FALCON + ["tests/models/test_config_perturbation.py"],
    "refmath.models.olmo2": _OLMO2 + ["tests/models/test_config_perturbation.py"],
    "refmath.models.gemma": _GEMMA + ["tests/models/test_config_perturbation.py"],
})


def make_copy(dest: Path) -> None:
    for name in ("refmath", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")


def defining_module(mistake: Mistake) -> str:
    """The module whose source defines the mistake's function: a model module may offer a function
    that it imports (``refmath.models.decoder`` offers ``sublayer_backward`` from ``blocks``)."""
    obj = importlib.import_module(mistake.module)
    for part in mistake.qualname.split("."):
        obj = getattr(obj, part)
    return inspect.getmodule(obj).__name__


def write_mistake(copy: Path, mistake: Mistake) -> None:
    """Edit the copy's source file: replace ``old`` by ``new`` inside the function's lines only."""
    path = copy / (defining_module(mistake).replace(".", "/") + ".py")
    text = path.read_text()
    node = ast.parse(text)
    for part in mistake.qualname.split("."):
        node = next(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    lines = text.splitlines(keepends=True)
    start, end = node.lineno - 1, node.end_lineno
    body = "".join(lines[start:end])
    if body.count(mistake.old) != 1:
        raise ValueError(f"{mistake.name}: the text to replace occurs {body.count(mistake.old)} times")
    lines[start:end] = [body.replace(mistake.old, mistake.new)]
    path.write_text("".join(lines))


def run(cmd: list[str], cwd: Path, timeout: int) -> tuple[int, float]:
    env = dict(os.environ, PYTHONPATH=str(cwd), PYTHONDONTWRITEBYTECODE="1")
    start = time.perf_counter()
    try:
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = -1
    return rc, time.perf_counter() - start


def command_for(mistake: Mistake) -> list[str] | None:
    if mistake.check != "gradcheck":
        return None  # nothing for the gradient check to look at
    return [sys.executable, "-m", "refmath", "gradcheck", "--op", mistake.cases]


def suite_for(mistake: Mistake) -> list[str]:
    files = RELEVANT_TESTS[mistake.module] + RELEVANT_TESTS[defining_module(mistake)]
    files = sorted(set(files))
    return [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *files]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="*", help="glob over mistake names")
    parser.add_argument("--no-suite", action="store_true", help="run the gradient-check command only")
    args = parser.parse_args()
    mistakes = [m for m in MISTAKES if fnmatch.fnmatch(m.name, args.only)]

    with tempfile.TemporaryDirectory() as tmp:
        clean = Path(tmp) / "clean"
        make_copy(clean)
        # The baseline: every command and test selection used below passes on the right code.
        commands = {tuple(c) for m in mistakes if (c := command_for(m))}
        suites = set() if args.no_suite else {tuple(suite_for(m)) for m in mistakes}
        for cmd in sorted(commands | suites):
            rc, _ = run(list(cmd), clean, timeout=900)
            if rc != 0:
                print(f"baseline fails, figures would be meaningless: {' '.join(cmd[1:])}")
                return 2

        print(f"{'mistake':<66} {'command':>8} {'suite':>8}")
        killed_cmd = killed_suite = n_grad = 0
        start = time.perf_counter()
        for k, mistake in enumerate(mistakes):
            copy = Path(tmp) / f"m{k}"
            make_copy(copy)
            write_mistake(copy, mistake)
            cmd = command_for(mistake)
            if cmd is None:
                cmd_verdict = "n/a"
            else:
                n_grad += 1
                rc, _ = run(cmd, copy, timeout=600)
                killed_cmd += rc != 0
                cmd_verdict = "killed" if rc != 0 else "SURVIVED"
            suite_verdict = "-"
            if not args.no_suite:
                rc, _ = run(suite_for(mistake), copy, timeout=900)
                killed_suite += rc != 0
                suite_verdict = "killed" if rc != 0 else "SURVIVED"
            print(f"{mistake.name[:66]:<66} {cmd_verdict:>8} {suite_verdict:>8}", flush=True)
            shutil.rmtree(copy)

    n = len(mistakes)
    print(f"\n{n} mistakes ({n_grad} in gradients, {n - n_grad} in optimisers and schedules), "
          f"{time.perf_counter() - start:.0f} s")
    print(f"gradient-check command alone: {killed_cmd}/{n_grad} gradient mistakes killed "
          f"({killed_cmd}/{n} of all: it has no gradient to check in an optimiser)")
    if not args.no_suite:
        print(f"test suite (relevant files, see RELEVANT_TESTS): {killed_suite}/{n} killed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
