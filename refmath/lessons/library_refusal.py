"""The library refused as an answer: whether a student's function is, wraps or calls the refmath
function its exercise asks for, seen by tracing the calls it makes (``sys.setprofile``)."""
from __future__ import annotations

from typing import Any, Callable

from refmath.lessons.trials import call_on_copy

__all__ = ["library_used"]

# The checks themselves (this package) are not the library: they call the functions they compare.
_CHECKS = __name__.rpartition(".")[0]


def _code_of(func: Any):
    """The code object a callable runs (a function, a bound method, a partial's function), or None."""
    import functools

    while isinstance(func, functools.partial):
        func = func.func
    func = getattr(func, "__func__", func)
    return getattr(func, "__code__", None)


def _library_module(frame) -> str | None:
    """The refmath module a frame runs in, or None outside refmath (the checks themselves, in
    refmath.lessons, count as outside: they call the functions being compared)."""
    module = frame.f_globals.get("__name__", "")
    ours = module == _CHECKS or module.startswith(_CHECKS + ".")
    if (module == "refmath" or module.startswith("refmath.")) and not ours:
        return module
    return None


def _qualified(code, module: str) -> str:
    return f"{module}.{getattr(code, 'co_qualname', code.co_name)}"


class _CallTrace:
    """While active (a ``with`` block), records the Python functions called whose code is in
    ``watched`` (``sys.setprofile``: one look-up per call, so the student's function runs at
    nearly its own speed); with ``watched=None``, records instead every refmath function entered
    from outside refmath (the library functions a computation is made of)."""

    def __init__(self, watched: dict | None):
        self.watched, self.found = watched, {}

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if self.watched is not None:
            if code in self.watched and code not in self.found:
                self.found[code] = self.watched[code]
            return
        module = _library_module(frame)
        # a constructor (AdamW(...)) is not what an exercise asks for: the method called next is
        if module is not None and code not in self.found and code.co_name != "__init__" and (
                frame.f_back is None or _library_module(frame.f_back) is None):
            self.found[code] = _qualified(code, module)

    def __enter__(self):
        import sys

        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        import sys

        sys.setprofile(self._previous)
        return False


def _answer_functions(reference: Callable, trial) -> dict:
    """The library functions whose result the exercise asks for: ``reference`` itself when it is a
    refmath function, else the refmath functions it enters from outside refmath on ``trial``
    (a lesson's own reference, ``lambda ...: AdamW(...).step(...)``, names AdamW's ``step``),
    as code object -> ``refmath.module.name``."""
    code = _code_of(reference)
    module = getattr(reference, "__module__", "") or ""
    ours = module == _CHECKS or module.startswith(_CHECKS + ".")
    if code is not None and module.startswith("refmath.") and not ours:
        return {code: f"{module}.{getattr(code, 'co_qualname', code.co_name)}"}
    with _CallTrace(None) as trace:
        try:
            call_on_copy(reference, trial)
        except Exception:
            pass  # the reference's own failure is reported where it is evaluated
    return trace.found


def library_used(func: Callable, reference: Callable, trial, also: tuple = (),
                 allowed: tuple = ()) -> str | None:
    """How the student's ``func`` uses the library function the exercise asks for (see
    :func:`_answer_functions`; ``also`` adds more library functions, ``allowed`` takes some
    away) in place of writing it:
    ``"is refmath.softmax.softmax_backward"``, ``"wraps ..."`` or ``"calls ..."``; None when it
    writes the computation itself. ``func`` is called once on ``trial`` under a call trace."""
    answers = _answer_functions(reference, trial)
    own = _code_of(reference)
    if own is not None and own not in answers:  # a lesson's own reference, copied or called
        answers[own] = (f"the check's reference, {getattr(reference, '__module__', '?')}."
                        f"{getattr(own, 'co_qualname', own.co_name)}")
    for extra in also:
        code = _code_of(extra)
        if code is not None:
            answers[code] = (f"{getattr(extra, '__module__', '?')}."
                             f"{getattr(code, 'co_qualname', code.co_name)}")
    for permitted in allowed:
        answers.pop(_code_of(permitted), None)
    if not answers:
        return None
    wrapped, seen = func, set()
    while wrapped is not None and id(wrapped) not in seen:  # functools.wraps chains, partials
        seen.add(id(wrapped))
        if _code_of(wrapped) in answers:
            return ("is " if wrapped is func else "wraps ") + answers[_code_of(wrapped)]
        wrapped = getattr(wrapped, "__wrapped__", None)
    with _CallTrace(answers) as trace:
        try:
            call_on_copy(func, trial)
        except Exception:
            pass  # a failing function is diagnosed by the check itself
    found = sorted(trace.found.values(), key=lambda name: name.startswith("the check's"))
    return "calls " + found[0] if found else None  # the library's name first, if it was reached
