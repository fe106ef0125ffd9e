r"""The decode layers' weight matrices and the output head in fewer bytes: bf16, f16 or Q8_0
(catalogue W1, W2), and the float32 parameters they stand for.

A decode step at batch 1 reads every weight once (N5, K13), so storing the layers' matrices in 2
bytes a weight (bf16, f16) or 34 bytes per 32 weights (Q8_0) divides the bytes a token reads by
nearly 2 or 4. :func:`stored_layer_weights` rounds the matrices that the compiled decode step
(:mod:`refmath.inference.compiled_step`) multiplies by, ``w_q``, ``w_k``, ``w_v``, ``w_o`` and the
FFN's ``w_gate``, ``w_up``, ``w_down`` of every layer, each as the rows of :math:`W^\top` (one row per
output, the layout :func:`refmath.kernels.format_rows_matmul` reads). :func:`stored_head` rounds the
output head :math:`W_{\text{out}}` (``d x V``) the same way: at batch 1 it is read once per token
like any layer matrix, and in a small model it is a large share of the bytes (at
:math:`V = 32000`, :math:`d = 768`, the float32 head was 93.75 MiB of the 238.8 MiB a token read
with bf16 layers). llama.cpp's converter rounds ``output.weight`` to the format likewise. The
embedding, the norms and the biases stay float32: a token reads one row of the table, and the
gains are a few kilobytes.

A tied head is the embedding table itself, :math:`W_{\text{out}} = E^\top`. Only the head's
product reads the rounded copy; the embedding lookup keeps reading the float32 table. The model is
then run untied: :func:`stored_model` gives a config with ``tie_embeddings=False`` and parameters
whose ``lm_head`` is the rounded table, restored and transposed, while ``tok_emb`` stays the float32
table. The two differ only in the rounding of the head (W1, W2), and the logits the model computes
are :math:`\operatorname{norm}(x)\, \tilde W_{\text{out}}`, summed in float32.

:func:`restored_params` is the reference: the same parameters with each of those matrices replaced
by the float32 numbers its stored form stands for (:func:`refmath.weight_formats.dequantize`,
explicitly). Every step of the NumPy model on them computes what the compiled step computes from
the stored bytes, up to float32 rounding: the prefill, any decode step the compiled step does not
take, and ``backend="numpy"`` all run on them.

Which models: those whose ``compiled_layer_spec(params, config)`` hands its layers over (refmath's
decoder and GPT, within their ``COMPILED_FIELDS``); for any other model or configuration
:func:`stored_layer_weights` refuses, naming the option. The head is stored only for the heads
:data:`HEADS` lists, those that compute :math:`\operatorname{norm}(x)\, W_{\text{out}}` with
:math:`W_{\text{out}}` = ``lm_head``, or ``tok_emb`` transposed where ``config.tie_embeddings``
(:func:`refmath.models.decoder.head`, which Phi-3 shares, and :func:`refmath.models.gpt.head`):
a head with anything more (a logit scale, a softcap) is refused by :func:`stored_head`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from refmath._validate import check_choice
from refmath.models import decoder, falcon, gpt, olmo2
from refmath.weight_formats import BLOCK, FORMATS, dequantize, quantize

__all__ = ["WEIGHTS", "LAYER_MATRICES", "HEAD", "HEADS", "stored_layer_weights", "stored_head",
           "restored_params", "StoredModel", "stored_model"]

WEIGHTS = ("f32",) + FORMATS  # what generate's weights= takes
LAYER_MATRICES = ("w_q", "w_k", "w_v", "w_o", "w_gate", "w_up", "w_down")
HEAD = "lm_head"  # the stored head's name: the untied head's parameter, tied or not
# The heads whose logits are norm(x) W_out, W_out = lm_head or tok_emb^T (tied), nothing more: the
# head product that stored_head rounds is then the whole of what follows the final norm. By
# identity, so that a model with a head of its own (a logit scale, a softcap) is not taken for one.
HEADS = (decoder.head, gpt.head, falcon.head, olmo2.head)


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
            stored[param] = _stored_rows(np.asarray(w).T, param, weights)
    return stored


def _stored_rows(rows, param: str, weights: str) -> np.ndarray:
    """``quantize(rows, weights)`` of the ``(out, in)`` rows of the float32 matrix ``param``: a
    ``TypeError`` for another dtype, a ``ValueError`` where Q8_0's 32-weight blocks do not tile
    each row's ``in`` inputs, both naming ``weights`` and ``param``."""
    if np.asarray(rows).dtype != np.float32:
        raise TypeError(f"weights={weights!r} rounds float32 matrices, got {param} of dtype "
                        f"{np.asarray(rows).dtype} and shape {np.shape(rows)} (out, in)")
    if weights == "q8_0" and np.shape(rows)[1] % BLOCK:
        raise ValueError(f"weights='q8_0' stores each output's inputs in whole {BLOCK}-weight "
                         f"blocks, got {param} with {np.shape(rows)[1]} inputs")
    return quantize(np.ascontiguousarray(rows), weights)


def stored_head(module, params: Mapping, config, weights: str) -> np.ndarray:
    r"""The output head :math:`W_{\text{out}}` ``(d, V)`` stored as ``quantize(W_out.T, weights)``:
    ``(V, d)`` bf16/f16 or ``(V, d / 32)`` Q8_0 blocks, one row per logit (the layout
    :func:`refmath.kernels.format_rows_matmul` reads). :math:`W_{\text{out}}` is ``lm_head``, or
    ``tok_emb`` transposed where ``config.tie_embeddings`` (then ``tok_emb`` itself is the rows: no
    copy is made before the rounding).

    Raises ``ValueError`` naming ``weights`` for a model whose ``head`` is not one of :data:`HEADS`
    or whose head's inputs are not whole 32-weight blocks in Q8_0, ``TypeError`` for a head that is
    not float32."""
    check_choice("weights", weights, FORMATS)
    name = getattr(module, "__name__", repr(module))
    if getattr(module, "head", None) not in HEADS:
        raise ValueError(f"weights={weights!r} stores the output head of models whose logits are "
                         f"norm(x) W_out alone (refmath's decoder, Phi-3, GPT, Falcon and OLMo 2); "
                         f"{name}'s head is not one of them: use weights='f32'")
    tied = config.tie_embeddings
    w_out_t = params["tok_emb"] if tied else np.asarray(params["lm_head"]).T
    param = "tok_emb (the tied head, transposed)" if tied else "lm_head"
    return _stored_rows(w_out_t, param, weights)


def restored_params(params: Mapping, stored: Mapping, weights: str) -> dict:
    """A copy of ``params`` whose matrices named in ``stored`` are the float32 numbers the stored
    forms stand for, explicitly dequantised (each an ``(in, out)`` view of the ``(out, in)`` rows, the
    decode layout of :mod:`refmath.inference.weight_layout`); every other entry is the same array.
    A stored :data:`HEAD` becomes ``lm_head`` ``(d, V)`` whether or not ``params`` has one (a tied
    model's: run it with ``tie_embeddings=False``, as :func:`stored_model` does)."""
    check_choice("weights", weights, FORMATS)
    out = dict(params)
    for name, s in stored.items():
        if name not in out and name != HEAD:
            raise ValueError(f"stored holds {name!r}, which params does not")
        out[name] = dequantize(s, weights).T
    return out


class StoredModel(NamedTuple):
    """A model with its layers' matrices and its head stored in a weight format
    (:func:`stored_model`)."""
    params: dict  # float32: the stored matrices restored (the NumPy reference runs on these)
    config: Any  # the config, untied where the head was the embedding table
    stored: dict  # {name: stored matrix}: every layer matrix, and the head under HEAD


def stored_model(module, params: Mapping, config, weights: str) -> StoredModel:
    """Everything ``generate(..., weights=weights)`` reads: the layers' seven matrices
    (:func:`stored_layer_weights`) and the output head (:func:`stored_head`, under :data:`HEAD`)
    stored in ``weights``, the parameters they stand for (:func:`restored_params`), and the config
    to run those with: ``config`` itself for an untied head, or a copy with
    ``tie_embeddings=False`` for a tied one, whose restored ``lm_head`` is the rounded table
    while ``tok_emb``, which the embedding reads, stays float32 (see the module's docstring)."""
    stored = stored_layer_weights(module, params, config, weights)
    stored[HEAD] = stored_head(module, params, config, weights)
    if config.tie_embeddings:
        config = dataclasses.replace(config, tie_embeddings=False)
    return StoredModel(restored_params(params, stored, weights), config, stored)
