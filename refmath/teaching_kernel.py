"""Build the teaching FlashAttention kernel of ``csrc/teaching`` and import it.

The kernel assignment's student writes one C++ function, ``online_softmax_tile``
(``csrc/teaching/flash_tile.cpp``); the given ``flash_forward_module.cpp`` loops over the tiles,
calls it, and is the pybind11 module. :func:`build` compiles the two separately and links them:
the given half includes pybind11 and takes several seconds to compile, so it is compiled once
(and kept in the build folder under a hash of its source, or taken ready-made from
``csrc/teaching/prebuilt/``, which is how the grader hands it to the sandbox); the student's
half has no pybind11 in it and compiles in well under a second.

.. code-block:: bash

    python -m refmath.teaching_kernel          # build, then compare with NumPy on a few shapes

It needs a C++17 compiler (``c++``, or ``CXX``) and pybind11, and the ``csrc/`` folder beside the
``refmath`` package: a checkout or a student tree (not a wheel).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

__all__ = ["BuildError", "sources", "compiler", "given_object", "private_folder", "build"]

MODULE = "flash_teaching"
GIVEN = "flash_forward_module.cpp"
STUDENT = "flash_tile.cpp"
HEADER = "flash_tile.h"
PREBUILT = "prebuilt"
COMPILE_SECONDS = 120


class BuildError(RuntimeError):
    """The compiler failed; the message holds its output."""


def sources() -> str:
    """``csrc/teaching`` beside the ``refmath`` package."""
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc",
                          "teaching")
    if not os.path.isfile(os.path.join(folder, STUDENT)):
        raise FileNotFoundError(f"no {STUDENT} in {folder}: the teaching kernel builds from a "
                                "checkout or a student tree, not from an installed wheel")
    return folder


def compiler() -> str:
    # g++ before c++: Debian's c++ is a link through /etc/alternatives, which a sandbox may lack
    found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not found:
        raise BuildError("no C++ compiler: install g++ (or set CXX)")
    return found


def _run(command: list[str], what: str) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_SECONDS)
    except subprocess.TimeoutExpired:
        raise BuildError(f"{what}: the compiler ran longer than {COMPILE_SECONDS} s") from None
    if done.returncode != 0:
        printed = (done.stdout + done.stderr).strip()
        # all of it to standard error (the grader quotes it), the first error in the message
        print(printed, file=sys.stderr)
        first = next((line for line in printed.splitlines() if "error" in line), printed[:200])
        raise BuildError(f"{what} failed: {first.strip()}")


def given_object(folder: str, out: str) -> str:
    """The compiled given half: ``folder/prebuilt/<module>.o`` if there, else compiled into ``out``
    (once per source: the file name holds the hash of its source and header)."""
    prebuilt = os.path.join(folder, PREBUILT, GIVEN.replace(".cpp", ".o"))
    if os.path.isfile(prebuilt):
        return prebuilt
    digest = hashlib.sha256()
    for name in (GIVEN, HEADER):
        with open(os.path.join(folder, name), "rb") as f:
            digest.update(f.read())
    target = os.path.join(out, f"given-{digest.hexdigest()[:16]}.o")
    if not os.path.isfile(target):
        import pybind11
        partial = target + f".{os.getpid()}.tmp"
        _run([compiler(), "-O2", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-c",
              f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}", f"-I{folder}",
              os.path.join(folder, GIVEN), "-o", partial], f"compiling {GIVEN}")
        os.replace(partial, target)
    return target


def private_folder() -> str:
    """A build folder that only this user can write: ``refmath-teaching-kernel-<uid>`` in the
    temporary folder, or a fresh one if that name is taken by someone else or open to others (a
    planted object file there would be linked into the module)."""
    folder = os.path.join(tempfile.gettempdir(), f"refmath-teaching-kernel-{os.getuid()}")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(folder)
    if not os.path.isdir(folder) or os.path.islink(folder) or info.st_uid != os.getuid() or \
            info.st_mode & 0o077:
        folder = tempfile.mkdtemp(prefix="refmath-teaching-kernel-")
    return folder


def build(out: str | None = None):
    """Compile the student's ``flash_tile.cpp``, link it with the given half and import the
    module (``flash_forward(q, k, v, causal, block_q, block_k, scale) -> (o, lse)``).

    ``out``: the build folder (default: :func:`private_folder`). Raises :class:`BuildError` with
    the compiler's output when a compilation fails."""
    folder = sources()
    out = out or private_folder()
    os.makedirs(out, exist_ok=True)
    given = given_object(folder, out)
    work = tempfile.mkdtemp(dir=out)  # a fresh module file: a loaded one cannot be reloaded
    student = os.path.join(work, "flash_tile.o")
    _run([compiler(), "-O2", "-std=c++17", "-fPIC", "-c", f"-I{folder}",
          os.path.join(folder, STUDENT), "-o", student], f"compiling {STUDENT}")
    library = os.path.join(work, MODULE + sysconfig.get_config_var("EXT_SUFFIX"))
    _run([compiler(), "-shared", given, student, "-o", library], "linking")
    spec = importlib.util.spec_from_file_location(MODULE, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shutil.rmtree(work, ignore_errors=True)  # the loaded library stays mapped
    return module


def _demo() -> int:
    import numpy as np

    module = build()
    rng = np.random.default_rng(0)
    worst = 0.0
    for causal in (False, True):
        for t_q, t_k, block in ((5, 5, 2), (37, 53, 16), (64, 64, 64)):
            q, k, v = (rng.standard_normal((2, t, 8)).astype(np.float32) for t in (t_q, t_k, t_k))
            o, _ = module.flash_forward(q, k, v, causal, block, block)
            s = q.astype(np.float64) @ np.swapaxes(k, -1, -2) / np.sqrt(8)
            if causal:
                s = np.where(np.tril(np.ones((t_q, t_k), bool), t_k - t_q), s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            expected = np.nan_to_num((p / p.sum(-1, keepdims=True)) @ v)
            worst = max(worst, float(np.abs(o - expected).max()))
    print(f"built {module.__file__}; worst difference from float64 NumPy: {worst:.2e}")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    try:
        sys.exit(_demo())
    except (BuildError, FileNotFoundError) as error:
        print(f"python -m refmath.teaching_kernel: error: {error}", file=sys.stderr)
        sys.exit(2)
