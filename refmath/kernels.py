"""The one door to the compiled kernels: ``refmath._C`` (C++/OpenMP) and ``refmath._cuda`` (CUDA).

No other module imports the compiled extensions. Each function here checks its input (dtype, rank,
layout) before any pointer reaches C++, then dispatches on where the array lives: NumPy arrays go to
the CPU module, CuPy arrays (anything with ``__cuda_array_interface__``) to the CUDA module, on
CuPy's current stream. CuPy is imported only when a GPU array arrives, so it stays optional.

The kernels compute the same equations as the NumPy reference (``refmath.softmax`` etc.) and the
tests hold them to it.
"""
from __future__ import annotations

import functools

import numpy as np

from refmath._validate import check_ndim, float_array

try:
    from refmath import _C
except ImportError as err:  # an install that skipped the build, or a checkout used via PYTHONPATH
    _C, _C_ERROR = None, err

try:
    from refmath import _cuda
except ImportError as err:  # no CUDA toolkit at build time, REFMATH_CUDA=0, or a failed CUDA compile
    _cuda, _CUDA_ERROR = None, err

try:
    from refmath._build_info import BUILD_INFO  # written by setup.py at build time
except ImportError:
    BUILD_INFO = None

_KERNEL_DTYPES = (np.float32, np.float64)


# ---- what is available ----

def cpu_available() -> bool:
    """True when the C++ module ``refmath._C`` was built and imports."""
    return _C is not None


@functools.cache
def _device_query() -> tuple[int, str]:
    # Asked once: the device count does not change within a process, and without a driver each
    # query makes the CUDA runtime look for one again.
    return _cuda.device_query() if _cuda is not None else (0, "refmath._cuda is not built")


def cuda_available() -> bool:
    """True when ``refmath._cuda`` was built AND the CUDA runtime sees at least one device."""
    return _device_query()[0] > 0


def build_info() -> dict:
    """What was compiled and what it can use: OpenMP, the CUDA module, the devices present."""
    info = dict(BUILD_INFO or {})
    info.update(cpu_module=cpu_available(), cuda_module=_cuda is not None,
                cuda_devices=_device_query()[0], cuda_summary=cuda_build_info())
    return info


def cuda_build_info() -> str:
    """One line: was the CUDA module built, and if so does it see a device; if not, why not."""
    if _cuda is not None:
        count, status = _device_query()
        arch = (BUILD_INFO or {}).get("cuda_arch")
        where = f" for arch {arch}" if arch else ""
        devices = f"{count} CUDA device(s)" if count else f"no usable CUDA device ({status})"
        return f"refmath._cuda is built{where}; {devices}"
    if BUILD_INFO and BUILD_INFO.get("cuda_built"):
        return f"refmath._cuda was built but does not import: {_CUDA_ERROR}"
    if BUILD_INFO:
        return f"refmath._cuda was not built: {BUILD_INFO.get('cuda_reason') or 'unknown reason'}"
    return "refmath._cuda was not built (no build record: reinstall with pip install -v -e . to see why)"


def _cpu():
    if _C is None:
        raise ImportError(
            "refmath was installed without its compiled extension (refmath._C); "
            "run pip install -e . in the repository"
        ) from _C_ERROR
    return _C


def _gpu():
    if _cuda is None:
        raise ImportError(f"cannot run a kernel on a GPU array: {cuda_build_info()}")
    return _cuda


# ---- kernels ----

def softmax_rows(x):
    """Softmax over the last axis of a 2-D float32/float64 array (catalogue A2, A11).

    The same function as ``refmath.softmax.softmax_forward`` on a ``(rows, cols)`` array, run by
    the C++ module for a NumPy array and by the CUDA module for a CuPy array; returns a new array
    of the same kind, shape and dtype. Fully masked rows (all ``-inf``) give zeros. A
    non-contiguous input is copied to a contiguous one first.
    """
    if hasattr(x, "__cuda_array_interface__"):
        return _softmax_rows_cuda(x)
    x = float_array("x", x)
    _check_kernel_dtype("x", x)
    check_ndim("x", x, 2, "(rows, cols)")
    # Native byte order, C order, aligned: the layout the C++ loop indexes directly.
    x = np.require(x, np.dtype(x.dtype.type), ["C_CONTIGUOUS", "ALIGNED"])
    return _cpu().softmax_rows(x)


def _check_kernel_dtype(name, x):
    if x.dtype.type not in _KERNEL_DTYPES:  # by type, so a byte-swapped float64 passes
        raise TypeError(
            f"{name} must be float32 or float64 for the compiled kernels, "
            f"got dtype {x.dtype} with shape {x.shape}"
        )


def _cupy():
    try:
        import cupy
    except ImportError as err:
        raise ImportError("GPU arrays need CuPy: pip install 'refmath[cuda]'") from err
    return cupy


def _softmax_rows_cuda(x):
    cp = _cupy()
    x = cp.asarray(x)  # a CuPy view of any __cuda_array_interface__ object, no copy
    _check_kernel_dtype("x", x)
    check_ndim("x", x, 2, "(rows, cols)")
    module = _gpu()
    with x.device:  # launch on the GPU that holds x
        x = cp.ascontiguousarray(x)
        out = cp.empty_like(x)
        module.softmax_rows(
            x.__cuda_array_interface__["data"][0],
            out.__cuda_array_interface__["data"][0],
            x.shape[0],
            x.shape[1],
            module.FLOAT32 if x.dtype == np.float32 else module.FLOAT64,
            cp.cuda.get_current_stream().ptr,
        )
    return out
