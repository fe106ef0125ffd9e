"""Input checks shared by every op.

Each check raises with the argument's name and its shape, so that a mistake in a lesson or a kernel
test points straight at the offending array instead of failing three calls deeper.
"""
from __future__ import annotations

import numpy as np


def float_array(name: str, x) -> np.ndarray:
    """Return ``x`` as an ndarray, raising ``TypeError`` unless its dtype is floating point."""
    if not isinstance(x, np.ndarray):
        x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
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
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {ids.dtype} with shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= high):
        raise ValueError(
            f"{name} must lie in [0, {high}), got values in [{ids.min()}, {ids.max()}] "
            f"(shape {ids.shape})"
        )
    return ids
