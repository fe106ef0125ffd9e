r"""The decode layers' weight matrices in fewer bytes: bf16, f16 or Q8_0 (catalogue W1, W2), and the
float32 parameters they stand for.

A decode step at batch 1 reads every weight once (N5, K13), so storing the layers' matrices in 2
bytes a weight (bf16, f16) or 34 bytes per 32 weights (Q8_0) divides the bytes a token reads by
nearly 2 or 4. :func:`stored_layer_weights` rounds the matrices that the compiled decode step
(:mod:`refmath.inference.compiled_step`) multiplies by, ``w_q``, ``w_k``, ``w_v``, ``w_o`` and the
FFN's ``w_gate``, ``w_up``, ``w_down`` of every layer, each as the rows of :math:`W^\top` (one row per
output, the layout :func:`refmath.kernels.format_rows_matmul` reads). The embedding, the norms, the
biases and the head stay float32.

:func:`restored_params` is the reference: the same parameters with each of those matrices replaced
by the float32 numbers its stored form stands for (:func:`refmath.weight_formats.dequantize`,
explicitly). Every step of the NumPy model on them computes what the compiled step computes from
the stored bytes, up to float32 rounding: the prefill, any decode step the compiled step does not
take, and ``backend="numpy"`` all run on them.

Which models: those whose ``compiled_layer_spec(params, config)`` hands its layers over (refmath's
decoder and GPT, within their ``COMPILED_FIELDS``); for any other model or configuration
:func:`stored_layer_weights` refuses, naming the option.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from refmath._validate import check_choice
from refmath.weight_formats import BLOCK, FORMATS, dequantize, quantize

__all__ = ["WEIGHTS", "LAYER_MATRICES", "stored_layer_weights", "restored_params"]

WEIGHTS = ("f32",) + FORMATS  # what generate's weights= takes
LAYER_MATRICES = ("w_q", "w_k", "w_v", "w_o", "w_gate", "w_up", "w_down")


def stored_layer_weights(module, params: Mapping, config, weights: str) -> dict:
    """``{parameter name: stored matrix}`` for every layer matrix the compiled decode step of
    ``module`` multiplies by, each ``(in, out)`` float32 matrix stored as ``quantize(W.T, weights)``:
    ``(out, in)`` bf16/f16, or ``(out, in / 32)`` Q8_0 blocks.

    Raises ``ValueError`` naming ``weights`` where the model hands over no compiled layers for this
    ``config`` (``compiled_layer_spec`` returns None) or a layer matrix is not one of ``params``'
    entries, and ``TypeError`` for matrices that are not float32."""
    check_choice("weights", weights, FORMATS)
    name = getattr(module, "__name__", repr(module))
    found = module.compiled_layer_spec(params, config)
    if found is None:
        raise ValueError(f"weights={weights!r} stores the layers that the compiled decode step "
                         f"runs (refmath's decoder and GPT within their COMPILED_FIELDS); {name} "
                         f"with this config hands over none: use weights='f32'")
    names = {id(value): key for key, value in params.items()}
    stored = {}
    for i, layer in enumerate(found[1]):
        for key in LAYER_MATRICES:
            if key not in layer:
                continue
            w = layer[key]
            param = names.get(id(w))
            if param is None:
                raise ValueError(f"weights={weights!r}: layer {i}'s {key} of {name} is not an "
                                 f"entry of params, so it has no name to be stored under")
            if np.asarray(w).dtype != np.float32:
                raise TypeError(f"weights={weights!r} rounds float32 matrices, got {param} of "
                                f"dtype {np.asarray(w).dtype} and shape {np.shape(w)}")
            if weights == "q8_0" and np.shape(w)[0] % BLOCK:
                raise ValueError(f"weights='q8_0' stores each output's inputs in whole {BLOCK}-"
                                 f"weight blocks, got {param} of shape {np.shape(w)} (in, out)")
            stored[param] = quantize(np.ascontiguousarray(np.asarray(w).T), weights)
    return stored


def restored_params(params: Mapping, stored: Mapping, weights: str) -> dict:
    """A copy of ``params`` whose matrices named in ``stored`` are the float32 numbers the stored
    forms stand for, explicitly dequantised (each an ``(in, out)`` view of the ``(out, in)`` rows, the
    decode layout of :mod:`refmath.inference.weight_layout`); every other entry is the same array."""
    check_choice("weights", weights, FORMATS)
    out = dict(params)
    for name, s in stored.items():
        if name not in out:
            raise ValueError(f"stored holds {name!r}, which params does not")
        out[name] = dequantize(s, weights).T
    return out
