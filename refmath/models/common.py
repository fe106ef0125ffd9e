"""Plumbing the models share: parameter names under a prefix, and dropout masks.

Parameters live in one flat dict with dotted names (``"layers.0.attn.w_q"``); a layer or sublayer
works on the entries under its prefix with the prefix removed (``"w_q"``), and hands its gradients
back under the same short names, which the caller prefixes again.
"""
from __future__ import annotations

from collections.abc import Mapping


def sub_params(params: Mapping, prefix: str) -> dict:
    """The entries of ``params`` under ``prefix`` (a dotted name such as ``"layers.0"``), keyed by
    the rest of their names: ``sub_params(p, "layers.0")["attn.w_q"] is p["layers.0.attn.w_q"]``."""
    cut = len(prefix) + 1
    return {name[cut:]: value for name, value in params.items() if name.startswith(prefix + ".")}


def prefixed(prefix: str, grads: Mapping) -> dict:
    """The inverse of :func:`sub_params`: ``{prefix.name: value}`` for every entry of ``grads``."""
    return {f"{prefix}.{name}": value for name, value in grads.items()}


def dropout_mask(rng, shape, p: float, dtype):
    r"""An inverted-dropout multiplier :math:`D` of ``shape``: 0 with probability ``p``, else
    :math:`1/(1-p)`, so that :math:`E[D] = 1` and evaluation needs no rescaling. ``None`` (no
    dropout) when ``p`` is 0 or ``rng`` is None, so that evaluation draws no random numbers."""
    if rng is None or p == 0.0:
        return None
    return ((rng.random(shape) >= p) / (1.0 - p)).astype(dtype)


def apply_mask(x, mask):
    """``x * mask``, or ``x`` itself when there is no mask."""
    return x if mask is None else x * mask
