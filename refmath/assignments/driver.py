"""The program the sandbox runs for one hidden test: ``python -I -S driver.py ARGS``.

It is copied, with :mod:`refmath.assignments.wire`, into the sandbox's read-only folder and runs
there with the standard library and NumPy only. In order:

1. drops to the sandbox user when started as root (``--uid``), then sets the limits (CPU time,
   address space, file size, processes, no core dumps), all before any student code exists in the
   process; a process cannot raise its hard limits;
2. keeps standard output for the result and sends what the student's code prints to standard error
   (the grader caps and quotes it);
3. reads the test's inputs, the source of its student-side ``run`` and nothing else;
4. puts the submission's refmath first on ``sys.path`` and calls ``run(**inputs)``;
5. writes one message (see :mod:`~refmath.assignments.wire`): ``{"status": "ok"}`` with the
   arrays, or ``{"status": "error", ...}`` with the exception's one-line description.

Nothing it writes is trusted: the student's code runs in this process and could write anything to
the result pipe; the grader bounds and checks what it reads.
"""
import argparse
import os
import resource
import sys
import traceback

__all__ = ["main"]


def _arguments():
    parser = argparse.ArgumentParser()
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--library", required=True)
    parser.add_argument("--site", required=True)
    parser.add_argument("--cpu", type=int, required=True)
    parser.add_argument("--memory", type=int, required=True)
    parser.add_argument("--file-size", type=int, required=True)
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--uid", type=int, default=None)
    parser.add_argument("--unreadable", nargs="*", default=[])
    parser.add_argument("--tag", default="")  # names the grader's sandbox; unused here
    return parser.parse_args()


def _drop_to(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise RuntimeError(f"could not drop to uid {uid}")


def _limit(args) -> None:
    # CPU: soft one second below hard, so SIGXCPU (reported as the CPU limit) comes first.
    resource.setrlimit(resource.RLIMIT_CPU, (args.cpu, args.cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (args.memory, args.memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (args.file_size, args.file_size))
    resource.setrlimit(resource.RLIMIT_NPROC, (args.processes, args.processes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _send(channel, wire, header, value=None) -> None:
    channel.write(wire.encode(header, value))
    channel.flush()


def _describe(error: BaseException, library: str) -> dict:
    """The exception in one line, and where in the submission's refmath it was raised."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if os.path.abspath(f.filename).startswith(os.path.join(library, "refmath"))]
    where = (f"{os.path.relpath(frames[-1].filename, library)}:{frames[-1].lineno} in "
             f"{frames[-1].name}") if frames else ""
    message = str(error).splitlines()[0][:300] if str(error) else ""
    if isinstance(error, SystemExit):
        message = f"called exit({error.code!r})"
    return {"error": type(error).__name__, "message": message, "where": where}


def main() -> None:
    args = _arguments()
    if args.uid is not None:
        _drop_to(args.uid)
    _limit(args)
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, args.site]
    import wire
    sys.path.remove(here)
    try:
        # Where no namespace hides the grader's files, the grader names the ones that must be out
        # of reach; the user this runs as must not be able to read any of them.
        readable = [p for p in args.unreadable if os.access(p, os.R_OK)]
        if readable:
            raise RuntimeError(f"the sandbox user can read {readable[0]}")
        import numpy as np
        with open(args.inputs, "rb") as f:
            head, inputs = wire.decode(f.read())
        sys.path.insert(0, args.library)
    except BaseException as error:
        _send(channel, wire, {"status": "setup", **_describe(error, args.library)})
        return
    try:
        namespace = {"np": np, "__name__": "hidden_test"}
        exec(compile(head["source"], "<hidden test>", "exec"), namespace)
        import refmath
        if not os.path.abspath(refmath.__file__).startswith(args.library):
            raise RuntimeError(f"grader set-up: refmath imported from {refmath.__file__}, not the "
                               "submission")
        out = namespace[head["function"]](**inputs)
        if not isinstance(out, dict):
            raise TypeError(f"the test's run() returned {type(out).__name__}, not a dict of arrays")
        arrays = {}
        for key, value in out.items():
            value = np.asarray(value)
            if value.dtype == object:
                raise TypeError(f"{key} is not a numeric array (got an object array)")
            arrays[str(key)] = value
        message = wire.encode({"status": "ok"}, arrays)
    except BaseException as error:
        message = wire.encode({"status": "error", **_describe(error, args.library)})
    channel.write(message)
    channel.flush()


if __name__ == "__main__":
    main()
