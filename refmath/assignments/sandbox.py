"""Run one hidden test on a submission in its own limited process.

The process gets a fresh temporary directory holding only the submission laid over the stubbed
library, the hidden-test module and a small driver; a minimal environment with one BLAS/OpenMP
thread; ``resource.setrlimit`` limits on CPU time, address space, file size and core dumps (set by
the driver before it imports anything of the submission); its own
session (so a wall-clock timeout kills everything it started); and its output goes to a file whose
size is capped. The driver runs the test's ``run()`` and saves the returned arrays as ``out.npz``;
the grader, in its own process, loads them without pickle and checks them.

What this does not stop (see the README, "For instructors"): network access, reading files the
grading user can read, forking further processes within the limits. Run the grader in a container
(Gradescope does) for those.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import NamedTuple

from refmath.assignments.manifest import Limits

# Runs inside the limited process, from the temporary directory. It imports the hidden-test module,
# builds the named test (inputs are made from fixed seeds, so the grader rebuilds the same ones),
# runs the student's side and saves the arrays it returns. Any exception, SystemExit included,
# becomes one line of result.json; where in refmath/ it happened is kept for the feedback.
DRIVER = r'''
import resource
# The limits first, before anything of the submission is imported. Soft and hard limits are equal
# (CPU: one second apart, so SIGXCPU comes first), and a process cannot raise its hard limits.
cpu, memory, size = (int(a) for a in __import__("sys").argv[2:5])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

import json, os, sys, traceback
sys.path.insert(0, os.getcwd())
here = os.getcwd()
# The assignments are NumPy: an autograd library would compute the gradients for the student.
# (This stops an accidental or casual import; code set on it can still undo it.)
for blocked in ("torch", "jax", "tensorflow", "autograd"):
    sys.modules[blocked] = None

def finish(**result):
    with open(os.path.join(here, "result.json"), "w") as f:
        json.dump(result, f)

try:
    import numpy as np
    import hidden_tests
    run, _ = getattr(hidden_tests, sys.argv[1])()
    import refmath
    if not os.path.abspath(refmath.__file__).startswith(here):
        raise RuntimeError(f"grader set-up: refmath imported from {refmath.__file__}, not the "
                           "submission; grade where refmath is not installed")
    out = run()
    if not isinstance(out, dict):
        raise TypeError(f"the test's run() returned {type(out).__name__}, not a dict of arrays")
    arrays = {}
    for key, value in out.items():
        value = np.asarray(value)
        if value.dtype == object:
            raise TypeError(f"{key} is not a numeric array (got an object array)")
        arrays[key] = value
    np.savez(os.path.join(here, "out.npz"), **arrays)
    finish(status="ok")
except BaseException as error:
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if os.path.abspath(f.filename).startswith(os.path.join(here, "refmath"))]
    where = (f"{os.path.relpath(frames[-1].filename, here)}:{frames[-1].lineno} in "
             f"{frames[-1].name}") if frames else ""
    message = str(error).splitlines()[0][:300] if str(error) else ""
    if isinstance(error, SystemExit):
        message = f"called exit({error.code!r})"
    finish(status="error", error=type(error).__name__, message=message, where=where)
'''


class Outcome(NamedTuple):
    status: str  # "ok", "error" (an exception), "killed" (limits, crash, exit), "timeout"
    message: str  # one line for the student; empty when status is "ok"
    output: str  # the head of what the process printed
    seconds: float


def _limit_arguments(limits: Limits) -> list[str]:
    """The driver's arguments: CPU seconds, bytes of address space, bytes a file may reach.

    The driver sets the limits itself, as its first statements: ``preexec_fn`` would do it before
    exec, but is unsafe when the grader runs tests from several threads (``--jobs``).
    """
    cpu = max(1, int(limits.cpu_s))
    memory = limits.memory_mb * 1024 * 1024
    # Files the process writes: its output (capped lower, after the run) and out.npz.
    size = max(limits.output_kb * 1024 * 4, 64 * 1024 * 1024)
    return [str(cpu), str(memory), str(size)]


def limited_env(directory: str) -> dict[str, str]:
    """A minimal environment: no inherited PYTHONPATH, one thread for BLAS and OpenMP."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": directory, "TMPDIR": directory,
           "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
           "MPLBACKEND": "Agg"}
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                 "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS"):
        env[name] = "1"
    return env


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def run_test(directory: str, test: str, limits: Limits) -> Outcome:
    """Run hidden test ``test`` in ``directory`` (prepared by the grader) under ``limits``."""
    with open(os.path.join(directory, "_grader_driver.py"), "w") as f:
        f.write(DRIVER)
    output_path = os.path.join(directory, "_output.txt")
    start = time.perf_counter()
    timed_out = False
    with open(output_path, "wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-E", "-s", "-B", "_grader_driver.py", test, *_limit_arguments(limits)],
            cwd=directory, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
            env=limited_env(directory), start_new_session=True)
        try:
            returncode = process.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(process.pid, signal.SIGKILL)
            returncode = process.wait()
    seconds = time.perf_counter() - start
    # Whatever it started in its session goes too (a child left sleeping, say).
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass

    cap = limits.output_kb * 1024
    printed = os.path.getsize(output_path)
    with open(output_path, "rb") as f:
        head = f.read(min(cap, 2000)).decode("utf-8", "replace")

    if timed_out:
        return Outcome("timeout", f"timed out: still running after {limits.wall_s:g} s "
                       "(wall-clock limit); an infinite loop or a very slow method?", head, seconds)
    if printed > cap:
        return Outcome("killed", f"printed {printed / 1024:.0f} KB or more; the limit is "
                       f"{limits.output_kb} KB of output", head[:500], seconds)
    if returncode < 0:
        name = _signal_name(-returncode)
        why = {"SIGXCPU": f"used more than {limits.cpu_s:g} s of CPU time (the limit)",
               "SIGKILL": f"was killed (CPU time above {limits.cpu_s:g} s or out of memory)",
               "SIGSEGV": "crashed with a segmentation fault",
               "SIGABRT": "aborted (SIGABRT)", "SIGBUS": "crashed (bus error)",
               "SIGFPE": "crashed (floating-point exception)"}.get(name, f"was killed by {name}")
        return Outcome("killed", why, head, seconds)
    result_path = os.path.join(directory, "result.json")
    try:
        with open(result_path) as f:
            result = json.load(f)
        status = result["status"]
    except (OSError, ValueError, KeyError, TypeError):
        return Outcome("killed", f"the process ended (exit status {returncode}) before the test "
                       "finished: os._exit(), a crash, or an exit from native code", head, seconds)
    if status == "ok" and returncode == 0:
        return Outcome("ok", "", head, seconds)
    if status == "ok":
        return Outcome("killed", f"exit status {returncode} after the test ran", head, seconds)
    error, message = str(result.get("error", "?")), str(result.get("message", ""))
    where = str(result.get("where", ""))
    if error == "MemoryError":
        message = f"ran out of memory (limit {limits.memory_mb} MB of address space)"
    text = f"raised {error}" + (f": {message}" if message else "") + (f" ({where})" if where else "")
    if error == "SystemExit":
        text = message + (f" ({where})" if where else "")
    return Outcome("error", text, head, seconds)
