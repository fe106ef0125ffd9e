"""Input checks shared by every op.

Each check raises with the argument's name and its shape, so that a mistake in a lesson or a kernel
test points straight at the offending array instead of failing three calls deeper.
"""
from __future__ import annotations

import math
import numbers

import numpy as np


def float_array(name: str, x) -> np.ndarray:
    """Return ``x`` as an ndarray, raising ``TypeError`` unless its dtype is floating point."""
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if x.dtype.kind != "f":  # np.issubdtype(x.dtype, np.floating), at the cost of one attribute
        raise TypeError(
            f"{name} must be a floating-point array, got dtype {x.dtype} with shape {x.shape}"
        )
    return x


def check_ndim(name: str, x: np.ndarray, ndim, layout: str = "") -> None:
    """Require ``x.ndim`` to be ``ndim`` (an int) or one of ``ndim`` (a tuple of ints)."""
    allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if x.ndim not in allowed:
        want = " or ".join(str(n) for n in allowed)
        hint = f" {layout}" if layout else ""
        raise ValueError(f"{name} must have {want} dimensions{hint}, got shape {x.shape}")


def check_min_ndim(name: str, x: np.ndarray, ndim: int, layout: str = "") -> None:
    """Require at least ``ndim`` dimensions (leading batch dimensions are allowed)."""
    if x.ndim < ndim:
        hint = f" {layout}" if layout else ""
        raise ValueError(f"{name} must have at least {ndim} dimensions{hint}, got shape {x.shape}")


def check_axis(name: str, x: np.ndarray, axis: int, size: int, because: str) -> None:
    """Require ``x.shape[axis] == size``; ``because`` says which other argument fixes the size."""
    if x.shape[axis] != size:
        raise ValueError(
            f"{name}.shape[{axis}] must be {size} to match {because}, got {name}.shape = {x.shape}"
        )


def check_same_shape(name: str, x: np.ndarray, other_name: str, other: np.ndarray) -> None:
    """Require two arrays to have the same shape."""
    if x.shape != other.shape:
        raise ValueError(
            f"{name} and {other_name} must have the same shape, "
            f"got {name}.shape = {x.shape} and {other_name}.shape = {other.shape}"
        )


def check_broadcastable(name: str, x: np.ndarray, shape: tuple, target: str) -> None:
    """Require ``x`` to broadcast to ``shape`` (the shape of ``target``)."""
    try:
        np.broadcast_shapes(x.shape, shape)
    except ValueError:
        raise ValueError(
            f"{name} with shape {x.shape} does not broadcast against {target} with shape {shape}"
        ) from None


def int_array(name: str, ids, high: int) -> np.ndarray:
    """Return ``ids`` as an integer ndarray whose entries lie in ``[0, high)``."""
    if not isinstance(ids, np.ndarray):
        ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":  # np.issubdtype(ids.dtype, np.integer), signed or unsigned
        raise TypeError(f"{name} must be an integer array, got dtype {ids.dtype} with shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= high):
        raise ValueError(
            f"{name} must lie in [0, {high}), got values in [{ids.min()}, {ids.max()}] "
            f"(shape {ids.shape})"
        )
    return ids


# ---- scalar options ------------------------------------------------------------------------------
# One set of checks for every scalar option of the library (sizes, eps, rates, probabilities,
# switches). A value of the wrong kind raises TypeError, a value of the right kind out of its range
# ValueError; both name the argument and show the value. bool is rejected where a number is asked
# for: True is an int to Python, but never a meaningful width or learning rate.

def _range_text(low, high, low_open: bool, high_open: bool) -> str:
    low, high = (None if b is None else f"{b:g}" for b in (low, high))  # 0, not 0.0; 1e-05
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high}"
    return ""


def _outside(value, low, high, low_open: bool, high_open: bool) -> bool:
    if low is not None and (value <= low if low_open else value < low):
        return True
    return high is not None and (value >= high if high_open else value > high)


def check_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """Return ``value`` as an ``int``, raising unless it is an integer (not a bool) in
    ``[low, high]`` (either bound may be None)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    if _outside(value, low, high, False, False):
        raise ValueError(f"{name} must be an int {_range_text(low, high, False, False)}, got {value!r}")
    return int(value)


def check_real(name: str, value, low: float | None = None, high: float | None = None, *,
               low_open: bool = False, high_open: bool = False) -> float:
    """Return ``value`` as a ``float``, raising unless it is a finite real number (not a bool) in
    the interval from ``low`` to ``high`` (closed unless ``low_open``/``high_open``; either bound
    may be None)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} of type {type(value).__name__}")
    if not math.isfinite(value) or _outside(value, low, high, low_open, high_open):
        where = _range_text(low, high, low_open, high_open)
        raise ValueError(f"{name} must be a finite number{' ' + where if where else ''}, got {value!r}")
    return float(value)


def check_flag(name: str, value) -> bool:
    """Return ``value`` as a ``bool``, raising ``TypeError`` unless it is one (0 and 1 are not)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r} of type {type(value).__name__}")
    return bool(value)


def check_choice(name: str, value, choices):
    """Return ``value`` if it is one of ``choices`` (compared with ``==``), else raise ``ValueError``
    listing them (``TypeError`` if ``value`` is not even hashable)."""
    try:
        ok = value in choices
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return value


def check_field(config, name: str, check, *args, optional: bool = False, **kwargs) -> None:
    """Check the field ``config.<name>`` of a frozen dataclass with ``check`` (one of the checks
    above, given ``*args``/``**kwargs``), naming it ``Type.name`` in the message, and store the plain
    Python value that ``check`` returns, so that ``dataclasses.asdict`` is ready for JSON (no NumPy
    scalars). ``optional`` lets None through."""
    value = getattr(config, name)
    if value is None and optional:
        return
    object.__setattr__(config, name, check(f"{type(config).__name__}.{name}", value, *args, **kwargs))


def check_window_layers(config, where: str = "") -> None:
    """Require ``config.window_layers`` (None, or one bool per layer saying which layers slide
    ``config.sliding_window``) to fit ``config.n_layers`` and a window, and store it as a tuple
    (JSON gives a list; a tuple keeps the configuration hashable). ``where`` is added to the
    message (which configuration)."""
    if config.window_layers is None:
        return
    name, flags = type(config).__name__, tuple(config.window_layers)
    if len(flags) != config.n_layers or not all(isinstance(flag, bool) for flag in flags):
        raise ValueError(f"{name}.window_layers must hold one True/False per layer (n_layers = "
                         f"{config.n_layers}), got {len(flags)} entries {flags[:4]}{where}")
    if config.sliding_window is None:
        raise ValueError(f"{name}.window_layers flags the layers that slide sliding_window, "
                         f"which is None{where}")
    object.__setattr__(config, "window_layers", flags)


def as_dataclass(value, cls: type, name: str):
    """``value`` as a ``cls`` (a dataclass of options, such as a rope scaling or a mixture of
    experts): one already, a dict of its fields (as JSON gives it back), or None."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a {cls.__name__}, a dict of its fields or None, got "
                        f"{type(value).__name__}")
    unknown = sorted(set(value) - set(cls.__dataclass_fields__))
    if unknown:
        raise ValueError(f"{name} has unknown field(s) {unknown}; the fields are "
                         f"{sorted(cls.__dataclass_fields__)}")
    return cls(**value)
