"""Build an assignment: the student tree and the autograder bundle, with the leak check.

``build(manifest, out)`` writes

- ``out/student/``: an installable copy of refmath (pure Python: the compiled kernels are not what
  the assignments are about, so the copy installs in seconds) with exactly the manifest's functions
  stubbed as ``raise NotImplementedError``, the handout with its solution cells stripped, the
  public tests and a README;
- ``out/autograder/``: the same stubbed refmath (the grading machinery and the base a submission
  is laid over), the manifest and the hidden tests, Gradescope's ``setup.sh`` and
  ``run_autograder``, and ``gradescope.zip`` holding all of it.

Everything is first assembled in memory; the leak check then compares every line to be written
with the normalised lines of the solution regions, and only if none appears is anything written.
"""
from __future__ import annotations

import os
import shutil
import stat
import zipfile

from refmath import solutions
from refmath.assignments.extract import cpp_functions
from refmath.assignments.manifest import MANIFEST, Manifest

__all__ = ["LeakError", "library_files", "stub_library", "assemble", "build"]

# Lines this short ("return dx", "else:", '"""') say nothing about a solution and occur everywhere.
SHORTEST_SECRET = 10
# A solution line at least this long is also a leak when it is part of a longer line (quoted in a
# string, followed by a comment).
SHORTEST_QUOTED_SECRET = 20

STUDENT_PYPROJECT = """\
# The student copy of refmath: pure Python, installs in seconds (pip install -e .).
# The C++/CUDA kernels of the full project are not part of it; refmath.kernels says so if called.
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "refmath"
version = "0.1.0+{name}"
requires-python = ">=3.10"
dependencies = [{dependencies}]

[project.optional-dependencies]
test = ["pytest"]

[tool.setuptools.packages.find]
include = ["refmath", "refmath.*"]
"""

STUDENT_README = """\
# Assignment: {title}

Install this copy of refmath (pure Python, a few seconds) and run the public tests:

```bash
python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]"
python -m pytest -q tests
```

(or, without installing, `PYTHONPATH=$PWD python -m pytest -q tests`). Until you write them, the
tests of your functions fail with `NotImplementedError` (`RuntimeError` from a C++ function).

Read `handout.py` first (open it with jupytext / Jupyter, or read it as a script). You write:

{functions}

Submit these files, at these paths:

{files}

Only the functions listed above are taken from the files you submit: everything else in them is
graded as given, and your functions run in a module of their own beside the given code. Put any
helper function you write, and any import you add, inside the function that uses it. A function
with a decorator, a default value other than a literal or a name, or a body that sets attributes
of anything but its parameters and its own variables or uses reflection (`globals`, `setattr`,
`exec`, dunder attributes, `sys`, `gc`, `inspect`...) is refused and graded as the starter; the
handout lists the rules. Submit plain UTF-8 files (no links), each at most 1 MiB.

The hidden tests check more cases than the public ones, against values computed independently of
any solution, with tight tolerances and time limits. Your code runs in a sandbox with NumPy and
the standard library only (no network, no PyTorch).
"""

SETUP_SH = """\
#!/usr/bin/env bash
# Gradescope runs this once, as root, when the autograder image is built (Ubuntu).
set -euo pipefail
apt-get update
# g++ and python3-dev: the kernel assignment compiles C++ against Python's and pybind11's headers
apt-get install -y --no-install-recommends python3 python3-pip python3-venv python3-dev g++ \\
    bubblewrap
# What a submission may import, for every user (the sandbox runs it as an unprivileged uid).
python3 -m pip install numpy tqdm "tomli; python_version < '3.11'" ||
    python3 -m pip install --break-system-packages numpy tqdm "tomli; python_version < '3.11'"
# The grader's own environment: PyTorch (CPU), which computes the hidden tests' expected values,
# where no other user can read it.
python3 -m venv --system-site-packages /opt/refmath-grader
/opt/refmath-grader/bin/python -m pip install torch --index-url https://download.pytorch.org/whl/cpu
/opt/refmath-grader/bin/python -m pip install "pybind11>=2.12"
chmod 700 /opt/refmath-grader
"""

RUN_AUTOGRADER = """\
#!/usr/bin/env bash
# Gradescope runs this for each submission, as root: the files are in /autograder/submission.
# The grader sandboxes every test: bubblewrap where the container lets it make namespaces, else a
# uid of its own, which must not read anything under /autograder (the hidden tests among it).
set -euo pipefail
chmod 700 /autograder
cd /autograder/source
/opt/refmath-grader/bin/python -I -c '
import sys
sys.path.insert(0, "/autograder/source")
from refmath.commands import main
sys.exit(main())' assignments grade {name} /autograder/submission \\
    --out /autograder/results/results.json
"""

# What of refmath/ the copies carry: the Python sources (not compiled modules or build records),
# less the catalogue of typical mistakes, which quotes the right line each mistake replaces
# (solutions included) and which nothing in the library imports.
_SKIP_DIRS = {"__pycache__"}

# refmath.fast.fused restates the GELU, SwiGLU and LayerNorm backward passes in an in-place form: a
# student reading it would read the answer. The copies get this module instead, whose functions
# delegate to the reference forms in refmath.ffn and refmath.norms (the ones the students write),
# with the same signatures; refmath.fast.flat_adamw likewise.
REFERENCE_FORMS = {"refmath/fast/fused.py": '''"""The models' fused blocks, delegating to the reference forms in refmath.ffn and refmath.norms.

(The full library computes these in place; this copy calls the reference functions.)
"""
from refmath.ffn import GELUCache as BiasGELUCache
from refmath.ffn import (geglu_backward, geglu_forward, gelu_backward, gelu_forward,
                         swiglu_backward, swiglu_forward)
from refmath.norms import layernorm_backward, layernorm_forward

__all__ = ["BiasGELUCache", "bias_gelu_forward", "bias_gelu_backward", "swiglu_forward",
           "swiglu_backward", "geglu_forward", "geglu_backward", "layernorm_forward",
           "layernorm_backward"]


def bias_gelu_forward(h, b, approximate):
    return gelu_forward(h if b is None else h + b, approximate)


def bias_gelu_backward(da, cache):
    return gelu_backward(da, cache)
''',
    # refmath.fast.flat_adamw's vectorised update spells out AdamW's (the losses_optim answer): the
    # copies train with the per-parameter AdamW the students write, behind the same interface.
    "refmath/fast/flat_adamw.py": '''"""FlatAdamW with the training code's interface, delegating to refmath.optim.AdamW.

(The full library updates one flat buffer in a few vectorised calls; this copy runs the
per-parameter AdamW on the parameters, so the update it runs is the one written in refmath.optim.)
"""
from refmath.optim import AdamW

__all__ = ["FlatAdamW"]


class FlatAdamW(AdamW):
    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                 decay_of=None, threads=1):
        super().__init__(lr, betas, eps, weight_decay, decay_of)
        self.params = params
'''}
_SKIP_FILES = {"_build_info.py", "mistakes.py"}
TEACHING = "csrc/teaching"


class LeakError(RuntimeError):
    """A line of a solution region would be written to the student tree or the autograder."""


def library_files(src_root: str) -> dict[str, str]:
    """The Python sources of ``src_root/refmath`` and the teaching kernel's C++ sources
    (``csrc/teaching``, the kernel assignment's) as ``{relative path: text}``."""
    files = {}
    for top, suffixes in (("refmath", (".py",)), (TEACHING, (".cpp", ".h"))):
        for folder, dirs, names in os.walk(os.path.join(src_root, top)):
            dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
            for name in sorted(n for n in names if n.endswith(suffixes) and n not in _SKIP_FILES):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    files[os.path.relpath(path, src_root).replace(os.sep, "/")] = f.read()
    files.update((path, text) for path, text in REFERENCE_FORMS.items() if path in files)
    return files


def cpp_function_regions(text: str, where: str) -> dict[str, list[solutions.Region]]:
    """The C++ regions of ``text`` grouped by the file-scope function that holds them."""
    spans = cpp_functions(text)
    grouped: dict[str, list[solutions.Region]] = {}
    for region in solutions.find_regions(text, where):
        name = next((n for n, (a, b) in spans.items() if a < region.begin < b), "")
        grouped.setdefault(name, []).append(region)
    return grouped


def stub_message(function: str, manifest: Manifest) -> str:
    return f"{function}: see the handout {manifest.name} ({manifest.handout})"


def stub_library(files: dict[str, str], manifest: Manifest, strict: bool = True):
    """``(stubbed files, secret lines)``: every solution region of the library stubbed, and the
    normalised lines of what was removed.

    The manifest's functions become ``raise NotImplementedError`` pointing to its handout; the
    functions of other assignments are stubbed too (a tree holds no assignment's solution),
    except those in its ``[uses]``, whose regions lose their markers and keep their code.

    ``strict``: every listed function must hold a region (building). Grading from an autograder
    bundle, whose copy is already stubbed, passes ``strict=False``.
    """
    out = dict(files)
    secrets: set[str] = set()
    for file in {**manifest.functions, **manifest.uses}:
        if file not in files:
            raise ValueError(f"assignment {manifest.name}: {file} is not a file of refmath")
    for file, text in files.items():
        functions = manifest.functions.get(file, [])
        kept = manifest.uses.get(file, [])
        grouped = (cpp_function_regions(text, file) if file.endswith((".cpp", ".h"))
                   else solutions.function_regions(text, file))
        missing = [f for f in functions + kept if f not in grouped]
        if missing and strict:
            raise ValueError(f"assignment {manifest.name}: no '# BEGIN SOLUTION' region in "
                             f"{', '.join(missing)} of {file} (functions with regions: "
                             f"{', '.join(sorted(n for n in grouped if n)) or 'none'})")
        only_docstrings = [f for f in functions if f in grouped and
                           all(solutions.is_docstring_region(text, r) for r in grouped[f])]
        if only_docstrings and strict:
            raise ValueError(f"assignment {manifest.name}: {', '.join(only_docstrings)} of {file} "
                             "has only a docstring region: the student's copy would not raise")
        by_region = {r: f for f, regions in grouped.items() for r in regions}
        if not by_region:
            continue
        secrets.update(solutions.region_lines(text, [r for r, f in by_region.items()
                                                     if f not in kept]))
        lines = text.splitlines()

        def stub(region, by_region=by_region, functions=functions, kept=kept, lines=lines,
                 text=text):
            function = by_region[region]
            if function in kept:
                return lines[region.begin + 1:region.end]
            message = (stub_message(function, manifest) if function in functions
                       else f"{function or 'this part'}: not part of assignment {manifest.name}")
            if region.kind == "cpp":
                return [f'{region.indent}throw std::logic_error("{message}");']
            if solutions.is_docstring_region(text, region):
                return [f'{region.indent}"""{message}."""']
            return [f"{region.indent}raise NotImplementedError({message!r})"]
        out[file] = solutions.strip_regions(text, list(by_region), stub)
    return out, secrets


def public_lines(files: dict[str, str], manifest: Manifest) -> set[str]:
    """Normalised lines the library holds outside the manifest's regions: the student gets those
    anyway, so they cannot count as leaks (a blank line, ``import numpy as np``...)."""
    stubbed, _ = stub_library(files, manifest, strict=False)
    return {solutions.normalise(line) for text in stubbed.values() for line in text.splitlines()}


def secret_lines(region_lines, public: set[str]) -> set[str]:
    """The region lines that give something away: long enough, and not already in the library
    outside the regions (as a whole line, or inside one)."""
    candidates = {line for line in region_lines if len(line) >= SHORTEST_SECRET} - public
    public_text = "\n".join(public)
    return {line for line in candidates
            if len(line) < SHORTEST_QUOTED_SECRET or line not in public_text}


def _leaks(line: str, secrets: set[str], quoted: list[str]) -> bool:
    line = solutions.normalise(line)
    return line in secrets or any(secret in line for secret in quoted)


def leak_check(trees: dict[str, dict[str, str]], secrets: set[str]) -> None:
    """Raise :class:`LeakError` listing every written line that is, or quotes, a solution line."""
    quoted = [s for s in secrets if len(s) >= SHORTEST_QUOTED_SECRET]
    found = []
    for tree, files in trees.items():
        for path, text in files.items():
            for number, line in enumerate(text.splitlines(), 1):
                if _leaks(line, secrets, quoted):
                    found.append(f"{tree}/{path}:{number}: {line.strip()}")
    if found:
        shown = "\n  ".join(found[:20])
        more = f"\n  ... and {len(found) - 20} more" if len(found) > 20 else ""
        raise LeakError(f"{len(found)} solution line(s) would be written; nothing was written:\n  "
                        f"{shown}{more}")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def assemble(manifest: Manifest, src_root: str) -> tuple[dict[str, str], dict[str, str], set[str]]:
    """The student tree, the autograder tree (``{relative path: text}``) and the secret lines."""
    library = library_files(src_root)
    stubbed, secrets = stub_library(library, manifest)

    handout_text = _read(manifest.path(manifest.handout))
    handout_regions = solutions.find_regions(handout_text, manifest.path(manifest.handout))
    region_lines = secrets | set(solutions.region_lines(handout_text, handout_regions))
    handout = solutions.strip_regions(handout_text, handout_regions, solutions.default_replacement)
    secrets = secret_lines(region_lines, public_lines(library, manifest))

    listing = "\n".join(f"- `{f}` in `{file}`" for file, fs in manifest.functions.items() for f in fs)
    student = dict(stubbed)
    # the kernel assignment's module is compiled against pybind11's headers
    needs = ["numpy", "tqdm"] + (["pybind11>=2.12"] if any(f.endswith(".cpp") for f in manifest.files)
                                 else [])
    student["pyproject.toml"] = STUDENT_PYPROJECT.format(
        name=manifest.name, dependencies=", ".join(f'"{n}"' for n in needs))
    student["README.md"] = STUDENT_README.format(
        title=manifest.title, functions=listing,
        files="\n".join(f"- `{f}`" for f in manifest.files))
    student["handout.py"] = handout
    for test in manifest.public_tests:
        student[f"tests/{os.path.basename(test)}"] = _read(manifest.path(test))

    autograder = dict(stubbed)
    here = f"assignments/{manifest.name}"
    autograder[f"{here}/{MANIFEST}"] = _read(manifest.path(MANIFEST))
    autograder[f"{here}/{manifest.hidden_tests}"] = _read(manifest.path(manifest.hidden_tests))
    autograder["setup.sh"] = SETUP_SH
    autograder["run_autograder"] = RUN_AUTOGRADER.format(name=manifest.name)
    return student, autograder, secrets


def _write_tree(root: str, files: dict[str, str]) -> None:
    for path, text in files.items():
        target = os.path.join(root, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
        if path in ("setup.sh", "run_autograder"):
            os.chmod(target, os.stat(target).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def build(manifest: Manifest, out: str, src_root: str) -> dict[str, int]:
    """Write ``out/student`` and ``out/autograder`` (replacing earlier builds of them); return the
    number of files of each. Raises :class:`LeakError` before writing anything if a solution line
    would be written."""
    student, autograder, secrets = assemble(manifest, src_root)
    leak_check({"student": student, "autograder": autograder}, secrets)
    for tree in ("student", "autograder"):
        shutil.rmtree(os.path.join(out, tree), ignore_errors=True)
    _write_tree(os.path.join(out, "student"), student)
    _write_tree(os.path.join(out, "autograder"), autograder)
    # Gradescope wants setup.sh and run_autograder at the root of the zip; the rest lands beside
    # them in /autograder/source.
    with zipfile.ZipFile(os.path.join(out, "autograder", "gradescope.zip"), "w",
                         zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(autograder):
            info = zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if path in ("setup.sh", "run_autograder") else 0o644) << 16
            zf.writestr(info, autograder[path], zipfile.ZIP_DEFLATED)
    return {"student": len(student), "autograder": len(autograder) + 1}
