"""The check every model (and the KV cache) makes of a parameter dict before using it, and the
initial draw the decoders share."""
from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from refmath._validate import float_array

__all__ = ["check_param_dict", "draw_params", "init_llama_params"]


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


def draw_params(shapes: dict, seed, dtype, init_std: float, n_layers: int,
                residual_outputs: tuple, gain: float = 1.0) -> dict:
    r"""Initial parameters of the names and shapes ``shapes``, in their order: every ``.gamma``
    at ``gain``, the other vectors (biases) at 0, the matrices :math:`\mathcal N(0, \sigma^2)`
    with :math:`\sigma` = ``init_std``, those whose names end in ``residual_outputs`` (the
    projections that write into the residual stream) at :math:`\sigma/\sqrt{2L}` (N11), so that
    the variance the ``2L`` residual branches add stays independent of depth. Drawn in float64
    and then cast, so that float32 and float64 parameters share their values."""
    dtype = np.dtype(dtype)
    if not np.issubdtype(dtype, np.floating):
        raise TypeError(f"dtype must be a floating-point type, got {dtype}")
    rng = np.random.default_rng(seed)
    residual_std = init_std / math.sqrt(2 * n_layers)
    params = {}
    for name, shape in shapes.items():
        if name.endswith(".gamma"):
            value = np.full(shape, gain)
        elif len(shape) == 1:  # biases (a LayerNorm's too), a mixture of experts' selection bias
            value = np.zeros(shape)
        elif name.endswith(residual_outputs):
            value = rng.normal(0.0, residual_std, shape)
        else:
            value = rng.normal(0.0, init_std, shape)
        params[name] = value.astype(dtype)
    return params


def init_llama_params(shapes: dict, config, seed, dtype) -> dict:
    r""":func:`draw_params` as the Llama-like families initialise: :math:`\sigma` =
    ``config.init_std``, and the two projections that write into the residual stream, ``attn.w_o``
    and ``ffn.w_down``, at :math:`\sigma/\sqrt{2L}` for ``config.n_layers`` layers (N11)."""
    return draw_params(shapes, seed, dtype, config.init_std, config.n_layers,
                       ("attn.w_o", "ffn.w_down"))
