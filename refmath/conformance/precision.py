r"""The number formats of the sweep: rounding to them in NumPy (ml_dtypes for the ones NumPy lacks)
and their unit roundoff.

The unit roundoff of a format with ``t`` bits of significand (the implicit bit counted) is
:math:`u = 2^{-t}`: round to nearest makes :math:`|fl(x) - x| \le u |x|`, and one ulp of a number
in :math:`[2^e, 2^{e+1})` is :math:`2u \cdot 2^e`, so :math:`2 u |x| \ge \mathrm{ulp}(x)`.

=========  =====  ==========  =============================================
format     t      u           where
=========  =====  ==========  =============================================
float64    53     2^-53       the oracle
float32    24     2^-24       accumulation in every kernel; the CPU kernels
bfloat16   8      2^-8        GPU inputs and outputs
float16    11     2^-11       GPU inputs and outputs (max 65504)
e4m3       4      2^-4        fp8 caches (max 448)
e5m2       3      2^-3        fp8 caches (max 57344)
=========  =====  ==========  =============================================
"""
from __future__ import annotations

import numpy as np

__all__ = ["DTYPES", "unit_roundoff", "numpy_dtype", "round_to", "round32"]


def _ml_dtypes():
    try:
        import ml_dtypes
    except ImportError as err:  # pragma: no cover - a dev install has it
        raise ImportError("bfloat16 and fp8 need ml_dtypes: pip install ml_dtypes") from err
    return ml_dtypes


DTYPES = {"float32": 24, "bfloat16": 8, "float16": 11, "float8_e4m3fn": 4, "float8_e5m2": 3}
U32 = 2.0**-24


def unit_roundoff(dtype: str) -> float:
    """:math:`u = 2^{-t}` of ``dtype`` (a name from :data:`DTYPES`)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    return 2.0 ** -DTYPES[dtype]


def numpy_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype of a format name: float32/float16 NumPy's own, the rest ml_dtypes'."""
    if dtype in ("float32", "float16", "float64"):
        return np.dtype(dtype)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    return np.dtype(getattr(_ml_dtypes(), dtype))


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (to nearest, ties to even) and returned in float64."""
    if dtype == "float64":
        return np.asarray(x, dtype=np.float64)
    return np.asarray(x).astype(numpy_dtype(dtype)).astype(np.float64)


def round32(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` and held in float32 (the emulated kernels compute in float32)."""
    if dtype == "float32":
        return np.asarray(x, dtype=np.float32)
    return np.asarray(x).astype(numpy_dtype(dtype)).astype(np.float32)
