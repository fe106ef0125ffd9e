"""The check every model (and the KV cache) makes of a parameter dict before using it."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from refmath._validate import float_array


def check_param_dict(params, shapes: dict) -> np.dtype:
    """Require exactly the names of ``shapes``, each a floating NumPy array of its shape, all of
    one dtype; return that dtype. ``shapes`` maps each name to the shape the config gives it."""
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict of arrays, got {type(params).__name__}")
    missing = [name for name in shapes if name not in params]
    extra = sorted(set(params) - set(shapes))
    if missing or extra:
        raise ValueError(f"params do not match the config: missing {missing[:6]}"
                         f"{' ...' if len(missing) > 6 else ''}, unexpected {extra[:6]}")
    first, dtype = None, None
    for name, shape in shapes.items():
        value = params[name]
        if not isinstance(value, np.ndarray):
            raise TypeError(f"params[{name!r}] must be a NumPy array, got {type(value).__name__}")
        float_array(f"params[{name!r}]", value)
        if value.shape != tuple(shape):
            raise ValueError(f"params[{name!r}] must have shape {tuple(shape)} for this config, "
                             f"got {value.shape}")
        if dtype is None:
            first, dtype = name, value.dtype
        elif value.dtype != dtype:
            raise TypeError(f"every parameter must have the same dtype: params[{name!r}] is "
                            f"{value.dtype}, params[{first!r}] is {dtype}")
    return dtype
