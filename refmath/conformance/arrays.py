"""How arrays cross between the sweep and a kernel: by DLPack, so torch, CuPy and JAX arrays go in
and out without a copy to the host until the comparison.

The sweep holds every input in float64 NumPy, each value exactly representable in the case's
dtype. :func:`to_framework` hands it to a kernel as the framework's own array in that dtype (for
torch, ``torch.from_dlpack`` of the float32 buffer, then ``.to(dtype, device)``: exact, since the
values are representable); :func:`to_host` brings a result back as float64 NumPy, after checking
that it is an array at all, and :func:`describe` names its dtype and device for the checks of
shape, dtype and device that every adapter makes.
"""
from __future__ import annotations

import numpy as np

from refmath.conformance.precision import numpy_dtype

__all__ = ["BadOutput", "torch_dtype", "to_framework", "describe", "to_host"]

FRAMEWORKS = ("numpy", "torch", "cupy", "jax")


class BadOutput(Exception):
    """A kernel's result that is not what its contract says (shape, dtype, device, kind)."""


def _torch():
    try:
        import torch
    except ImportError as err:
        raise ImportError("this adapter passes torch tensors: pip install torch") from err
    return torch


def torch_dtype(dtype: str):
    torch = _torch()
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}[dtype]


def to_framework(x: np.ndarray, dtype: str, framework: str = "numpy", device: str = "cpu",
                 strided: bool = False):
    """``x`` (float64, representable in ``dtype``) as a ``framework`` array of ``dtype``.

    ``strided``: the array arrives as a non-contiguous view of the same values: ``True`` its last
    two axes stored swapped (the head-width axis has a stride other than one element);
    ``"transposed"`` its axes 1 and 2 stored swapped, the ``(B, T, H, D).transpose(1, 2)`` view a
    model passes (arrays of three axes or fewer: as ``True``). ``framework="jax"``: a JAX array
    (no strides; ``strided`` is refused).
    """
    axes = _swapped_axes(np.ndim(x), strided)
    if framework == "numpy":
        out = np.asarray(x).astype(numpy_dtype(dtype))
        if axes:
            out = np.ascontiguousarray(np.swapaxes(out, *axes)).swapaxes(*axes)
        return out
    if framework == "cupy":  # refmath's CUDA kernels take CuPy arrays
        import cupy

        host = np.asarray(x).astype(numpy_dtype(dtype))
        if axes:
            return cupy.ascontiguousarray(cupy.asarray(np.swapaxes(host, *axes))).swapaxes(*axes)
        return cupy.asarray(host)
    if framework == "torch":
        torch = _torch()
        base = np.ascontiguousarray(x, dtype=np.float32)
        if axes:
            base = np.ascontiguousarray(np.swapaxes(base, *axes))
        t = torch.from_dlpack(base).to(device=device, dtype=torch_dtype(dtype))
        return t.transpose(*axes) if axes else t
    if framework == "jax":
        if strided:
            raise ValueError("JAX arrays have no strides: a strided case cannot be passed")
        try:
            import jax
        except ImportError as err:
            raise ImportError("this adapter passes JAX arrays: pip install jax") from err
        # by DLPack from the float32 buffer, then the dtype (exact: the values are representable)
        base = jax.dlpack.from_dlpack(np.ascontiguousarray(x, dtype=np.float32))
        out = base.astype(numpy_dtype(dtype))
        return jax.device_put(out, jax.devices(device.split(":")[0])[0]) if device != "cpu" else out
    raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")


def _swapped_axes(ndim: int, strided) -> tuple | None:
    if not strided:
        return None
    if strided == "transposed" and ndim >= 4:
        return (1, 2)
    return (-1, -2)


def describe(y) -> tuple[str, str]:
    """``(dtype, device)`` of an array of any framework, as strings (``"cpu"``, ``"cuda:0"``)."""
    dtype = str(getattr(y, "dtype", type(y).__name__)).replace("torch.", "")
    if type(y).__module__.startswith("jax"):  # JAX's devices: "cpu", "cuda:0" by their platform
        dev = next(iter(y.devices()))
        return dtype, "cpu" if dev.platform == "cpu" else f"cuda:{dev.id}"
    device = "cpu"
    try:
        kind, index = y.__dlpack_device__()
    except Exception:  # noqa: BLE001 - no DLPack device (e.g. torch's meta): say what it says
        if hasattr(y, "device"):
            device = str(y.device)
        return dtype, device
    device = {1: "cpu", 2: "cuda", 3: "cpu", 10: "rocm"}.get(int(kind), f"device type {int(kind)}")
    if device != "cpu":
        device = f"{device}:{index}"
    return dtype, device


def to_host(y) -> np.ndarray:
    """A kernel's result as float64 NumPy: by DLPack where the dtype allows (NumPy's DLPack has no
    bfloat16), else through the framework's own conversion to float32 (exact for 16-bit floats)."""
    if isinstance(y, np.ndarray):
        return y.astype(np.float64)
    if not hasattr(y, "__dlpack__"):
        raise BadOutput(f"returned a {type(y).__name__}, not an array")
    if type(y).__module__.startswith("torch"):
        return y.detach().to("cpu").float().numpy().astype(np.float64)
    try:
        return np.from_dlpack(y).astype(np.float64)
    except (TypeError, RuntimeError, BufferError):
        if hasattr(y, "get"):  # CuPy
            return np.asarray(y.astype("float32").get(), dtype=np.float64)
        return np.asarray(y, dtype=np.float64)  # JAX and others with __array__
