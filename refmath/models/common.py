"""Plumbing the models share: parameter names under a prefix, dropout masks, the two shapes a
model fills in to plug into the rest of refmath (its attention, and its inference cache), and the
head sizes of the configurations whose heads split ``d_model`` (:class:`EvenHeads`, and
:class:`HeadDimHeads` where a ``head_dim`` field may set their width).

Parameters live in one flat dict with dotted names (``"layers.0.attn.w_q"``); a layer or sublayer
works on the entries under its prefix with the prefix removed (``"w_q"``), and hands its gradients
back under the same short names, which the caller prefixes again.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, NamedTuple

import numpy as np

from refmath.ffn import matmul_rows_many

__all__ = [
    "AttentionOps", "TrainingRecipe", "CacheSpec", "sub_params", "SplitParams", "projections",
    "prefixed", "dropout_mask", "layer_dropout_masks", "apply_mask", "EvenHeads",
    "HeadDimHeads", "named_config"
]


class AttentionOps(NamedTuple):
    """What a layer needs from its attention sublayer (GPT's biased MHA, M3's RoPE + GQA, M4's MLA).

    Parameter names here are relative to ``layers.{i}.attn.``.
    """

    shapes: Callable  # config -> {name: shape} of one layer's attention parameters
    forward: Callable  # (x, params, config) -> (y, cache); x is (B, T, d)
    backward: Callable  # (dy, cache) -> (dx, {name: gradient})
    state: Callable  # cache -> the per-layer tensors an inference (KV) cache would keep
    # (u, params, config, slot, offset, **options) -> y: the same attention at inference, on new
    # rows at positions offset.., with the layer's cache ``slot`` (refmath.inference.kv_cache)
    cached: Callable


class TrainingRecipe(NamedTuple):
    """How ``python -m refmath train`` trains a model by default (its module's
    ``TRAINING_RECIPE``)."""

    task: dict  # the task's settings (see refmath.data.make_task)
    config: dict  # configuration fields besides vocab_size and max_seq_len
    steps: int  # training defaults
    batch_size: int
    lr: float
    tasks: tuple  # the names of the tasks it can learn




class CacheSpec(NamedTuple):
    r"""The inference cache a decoder-only model keeps (``cache_spec(config, batch, max_len)``).

    ``kind`` is ``"kv"`` (keys and values per key/value head: a
    :class:`refmath.inference.kv_cache.KVCache`) or ``"latent"`` (one row per token, a latent of
    width ``latent_width`` and a shared rotary key: a
    :class:`refmath.inference.kv_cache.LatentCache`); ``shapes`` are the shapes of its arrays, for
    ``"kv"`` the keys' and the values' ``(L, B, g, max_len, d_h)`` as if every layer kept every
    position.

    ``windows`` (``"kv"`` only) gives each layer's sliding window ``w``, or None for a layer that
    attends to every earlier position; None for the whole tuple: no layer slides. A query of a
    sliding layer never reads a key more than ``w - 1`` positions back, so the layer keeps only
    ``min(w, max_len)`` rows (:meth:`layer_shapes`): the cache's bytes are
    :math:`\sum_l 2 B g d_h b \min(T_{\max}, w_l)`.
    """

    kind: str
    shapes: tuple
    latent_width: int | None = None
    windows: tuple | None = None

    def layer_shapes(self) -> tuple:
        """``"kv"``: ``(key_shapes, value_shapes)``, one ``(B, g, rows, d)`` per layer, with
        ``rows = min(w, max_len)`` for a sliding layer and ``max_len`` for the others."""
        windows = self.windows or (None,) * self.shapes[0][0]

        def per_layer(shape):
            _, batch, heads, max_len, width = shape
            return tuple((batch, heads, max_len if w is None else min(w, max_len), width)
                         for w in windows)

        return per_layer(self.shapes[0]), per_layer(self.shapes[1])


def sub_params(params: Mapping, prefix: str) -> dict:
    """The entries of ``params`` under ``prefix`` (a dotted name such as ``"layers.0"``), keyed by
    the rest of their names: ``sub_params(p, "layers.0")["attn.w_q"] is p["layers.0.attn.w_q"]``.
    A :class:`SplitParams` hands back the split it made the first time."""
    if isinstance(params, SplitParams):
        return params.under(prefix)
    return _entries_under(params, prefix)


def _entries_under(params: Mapping, prefix: str) -> dict:
    cut, start = len(prefix) + 1, prefix + "."
    return {name[cut:]: value for name, value in params.items() if name.startswith(start)}


class SplitParams(dict):
    """A copy of a parameter dict that keeps every :func:`sub_params` split made of it.

    A generation splits the same parameters at every decode step, once per layer and sublayer:
    scanning every name each time cost 0.3-0.4 ms of the 4 ms a token takes a 12-layer model of
    width 64, nearly all of which is Python (paired runs, 1 and 2 threads). A generator wraps its
    parameters in one of these for the length of one call, so each split is made once. It is
    a snapshot, to be read and not changed: entries set on the original dict afterwards are not
    in it, and changing it would leave its splits stale.
    """

    def __init__(self, params: Mapping):
        super().__init__(params)
        self._splits = {}

    def under(self, prefix: str) -> "SplitParams":
        """``sub_params(self, prefix)``, made on the first call and kept."""
        split = self._splits.get(prefix)
        if split is None:
            split = self._splits[prefix] = SplitParams(_entries_under(self, prefix))
        return split


def projections(u, params: dict, names: str, matmul=matmul_rows_many) -> list:
    """``u W_n (+ b_n)`` for each ``n`` in ``names`` (``"qkv"``: the query, key and value
    projections), as one grouped product of ``matmul`` (:func:`refmath.ffn.matmul_rows_many`'s
    signature; :func:`refmath.fast.products.kernel_products` makes it one pass of the kernel's
    threads over the three matrices)."""
    ys = matmul(u, [params[f"w_{n}"] for n in names])
    return [y + params[f"b_{n}"] if f"b_{n}" in params else y for n, y in zip(names, ys)]


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


def layer_dropout_masks(rng, shape, p: float, dtype, n_layers: int, train: bool) -> list:
    """Per layer, the residual dropout multipliers of its two branches (attention, FFN), drawn in
    that order from ``rng`` (:func:`dropout_mask`); ``(None, None)`` per layer unless ``train``
    and ``p > 0``, so that evaluation draws nothing."""
    if not train or p == 0:
        return [(None, None)] * n_layers
    if rng is None:
        raise ValueError(f"train=True with dropout = {p} needs rng (a numpy.random.Generator) "
                         f"to draw the dropout masks")
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    return [(dropout_mask(rng, shape, p, dtype), dropout_mask(rng, shape, p, dtype))
            for _ in range(n_layers)]


def apply_mask(x, mask):
    """``x * mask``, or ``x`` itself when there is no mask."""
    return x if mask is None else x * mask


def named_config(config_class: type, presets: dict, name: str, overrides: dict):
    """``config_class`` with the fields of the preset ``presets[name]``, any of them overridden by
    ``overrides``; a ``ValueError`` naming the presets for an unknown ``name``."""
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(presets)}")
    return config_class(**{**presets[name], **overrides})


class EvenHeads:
    """The heads of a configuration whose ``n_heads`` query heads split ``d_model`` into even
    widths :math:`d_h = d / h` (RoPE rotates pairs), and whose ``n_kv_heads`` key/value heads
    (None: ``n_heads``) each serve the same number of them (A10): Command-R's, Falcon's and
    Phi-3's. A dataclass that derives from it calls :meth:`check_heads` in its ``__post_init__``."""

    @property
    def kv_heads(self) -> int:
        """``g``, the number of key/value heads."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def d_h(self) -> int:
        """The head width, ``d / h``."""
        return self.d_model // self.n_heads

    def check_heads(self) -> None:
        """Raise ``ValueError`` naming the class and the fields unless the heads divide as said."""
        name = type(self).__name__
        self._check_head_width(name)
        if self.n_heads % self.kv_heads:
            raise ValueError(f"{name}.n_kv_heads = {self.n_kv_heads} must divide n_heads = "
                             f"{self.n_heads} (each key/value head serves h/g query heads)")

    def _check_head_width(self, name: str) -> None:
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"{name}: n_heads = {self.n_heads} must divide d_model = "
                             f"{self.d_model} into an even head width (RoPE rotates pairs)")


class HeadDimHeads(EvenHeads):
    """:class:`EvenHeads` of a configuration with a ``head_dim`` field, which sets the head width
    :math:`d_h` when it is given (Gemma's, OLMo 2's and the Llama family's may differ from
    :math:`d / h`); None keeps :math:`d / h`, which ``n_heads`` must then divide."""

    @property
    def d_h(self) -> int:
        """The head width: ``head_dim``, or ``d / h``."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    def _check_head_width(self, name: str) -> None:
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"{name}.d_model = {self.d_model} is not divisible by n_heads = "
                             f"{self.n_heads}; give head_dim explicitly")
        if self.d_h % 2:
            source = "d_model // n_heads" if self.head_dim is None else "head_dim"
            raise ValueError(f"{name}: the head width {source} = {self.d_h} must be even for "
                             f"RoPE's coordinate pairs")
