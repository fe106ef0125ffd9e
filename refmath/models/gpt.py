r"""GPT: a decoder-only Transformer with learned positions and GELU (catalogue M2).

The network, for input tokens :math:`a_{1:T}` (row vectors, one row per token):

.. math::
    H^{(0)} = \operatorname{drop}(E[a] + P_{1:T})                                   \qquad (N9)\\
    \text{Post-LN (GPT-1):}\quad X \leftarrow \operatorname{LN}(X + \operatorname{drop}(F(X)))\\
    \text{Pre-LN (GPT-2):}\quad  X \leftarrow X + \operatorname{drop}(F(\operatorname{LN}(X)))\\
    \text{logits} = \operatorname{LN}_f(H^{(L)})\, E^\top \quad(\text{no } \operatorname{LN}_f
    \text{ in Post-LN})                                                               \qquad (L2)

where each layer applies two residual sublayers in turn, ``F`` = causal multi-head self-attention
(with biases, weights dropped out after the softmax) and then ``F`` = the GELU FFN (with biases).
With ``sliding_window`` = ``w`` the attention of a sliding layer is banded (A12): query ``i`` sees
keys ``i - w + 1 .. i`` only; ``window_layers`` picks the sliding layers, so GPT-3's alternating
dense and locally banded layers are a configuration.
The loss is the mean next-token cross-entropy; the caller supplies inputs and targets, usually
``tokens = (BOS, a_1 .. a_{T-1})`` and ``targets = (a_1 .. a_T)``.

Every gradient comes from the ops' own backward functions; this file only wires them together in
reverse order and adds up the gradients where a tensor feeds two places (residual stream, tied
embedding).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from refmath.attention import (CausalAttentionCache, causal_attention_backward,
                               causal_attention_forward, causal_attention_kv, causal_mask,
                               local_window_mask, merge_heads, mha_backward, mha_forward,
                               split_heads)
from refmath.embedding import EmbeddingCache, embedding_backward, embedding_forward
from refmath.ffn import LinearCache, linear_backward, linear_forward, matmul_rows_many
from refmath.fast.fused import (BiasGELUCache, bias_gelu_backward, bias_gelu_forward, layernorm_backward,
                           layernorm_forward)
from refmath.losses import IGNORE_INDEX, CrossEntropyCache, cross_entropy_backward, cross_entropy_forward
from refmath.models.contract import ANY, allowed
from refmath.models.gpt_config import (GPT_CONFIGS, NORM_POSITIONS, GPTConfig, layer_config,
                                       layer_window)
from refmath.models.common import (AttentionOps, CacheSpec, TrainingRecipe, apply_mask, dropout_mask,
                                   projections, sub_params)
from refmath.models.hf_layout import HFCheckpointError, linear_out, refuse_common, require, take_head
from refmath.models.params import check_param_dict
from refmath.models.batch import check_lm_batch, check_tokens
from refmath.norms import LayerNormCache
from refmath.positions import (
    LearnedPositionsCache,
    learned_positions_backward,
    learned_positions_forward,
)
from refmath.registry import ParamCase, register_case

__all__ = [
    "TRAINING_RECIPE", "param_shapes", "init_params", "attention_sublayer_forward",
    "mha_attention_forward", "mha_attention_state", "KernelAttentionCache",
    "kernel_attention_forward", "kernel_attention_backward", "kernel_attention_state",
    "cached_attention", "MHA_ATTENTION", "KERNEL_ATTENTION", "attention_ops",
    "attention_sublayer_backward", "layer_forward", "layer_backward", "forward", "backward",
    "logits", "cache_spec", "embed", "cached_layer", "head", "cache_stale", "rope_options",
    "COMPILED_FIELDS", "compiled_layer_spec", "sizing_fields", "HF_MODEL_TYPES", "config_from_hf",
    "params_from_hf", "to_hf"
]

# The default of `python -m refmath train`: about 2.5 min on two busy CPU cores in float32 for a
# validation loss of 0.47 nats/char (2.91 for the unigram baseline, 0.42 for the entropy rate of
# the text); on task "reverse-lm", 100% exact match in 40 s. No dropout: the data is generated, so
# a short run sees little of it twice.
TRAINING_RECIPE = TrainingRecipe(
    {"name": "chars", "seq_len": 64},
    dict(n_layers=2, d_model=64, n_heads=4, d_ff=256, dropout=0.0),
    steps=1000, batch_size=32, lr=3e-3, tasks=("chars", "reverse-lm"))


# ---- parameters ----------------------------------------------------------------------------------

_FFN_KEYS = ("w1", "b1", "w2", "b2")
# The two projections that write into the residual stream (scaled at init, N11).
_RESIDUAL_OUTPUTS = ("attn.w_o", "ffn.w2")


def attention_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """One layer's attention parameters (relative to ``layers.{i}.attn.``): four ``(d, d)``
    projections, then their biases."""
    d = config.d_model
    shapes = {w: (d, d) for w in ("w_q", "w_k", "w_v", "w_o")}
    shapes.update({b: (d,) for b in ("b_q", "b_k", "b_v", "b_o")})
    return shapes


def param_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in a fixed order (the order ``init_params`` draws them)."""
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    shapes = {"tok_emb": (v, d), "pos_emb": (config.max_seq_len, d)}
    for i in range(config.n_layers):
        p = f"layers.{i}."
        shapes.update({p + "ln1.gamma": (d,), p + "ln1.beta": (d,)})
        shapes.update({p + "attn." + name: shape for name, shape in attention_shapes(config).items()})
        shapes.update({p + "ln2.gamma": (d,), p + "ln2.beta": (d,)})
        shapes.update({p + "ffn.w1": (d, f), p + "ffn.b1": (f,), p + "ffn.w2": (f, d), p + "ffn.b2": (d,)})
    if config.norm_position == "pre":
        shapes.update({"ln_f.gamma": (d,), "ln_f.beta": (d,)})
    if not config.tie_embeddings:
        shapes["lm_head"] = (d, v)
    return shapes


def init_params(config: GPTConfig, seed: int = 0, dtype=np.float64) -> dict[str, np.ndarray]:
    r"""GPT-2 style initialisation (catalogue N11).

    Weight matrices and both embedding tables :math:`\sim \mathcal N(0, 0.02^2)` (``init_std``);
    biases and LayerNorm shifts 0, LayerNorm gains 1. The residual output projections
    ``attn.w_o`` and ``ffn.w2`` get std :math:`0.02/\sqrt{2L}`: the residual stream is a sum of
    :math:`2L` branch outputs, so scaling each by :math:`1/\sqrt{2L}` keeps the variance of the sum
    roughly independent of depth at initialisation (treating the branches as uncorrelated).
    (OpenAI's released GPT-2 code draws the position table with std 0.01; we use 0.02 for both
    tables, as most reimplementations do.)

    Returns a flat dict ``name -> array`` in ``dtype`` (see :func:`param_shapes`).
    """
    rng = np.random.default_rng(seed)
    residual_std = config.init_std / math.sqrt(2 * config.n_layers)
    params = {}
    for name, shape in param_shapes(config).items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "gamma":
            value = np.ones(shape)
        elif len(shape) == 1:  # biases and LayerNorm shifts
            value = np.zeros(shape)
        else:
            std = residual_std if name.endswith(_RESIDUAL_OUTPUTS) else config.init_std
            value = rng.normal(0.0, std, size=shape)
        params[name] = value.astype(dtype)
    return params


def _check_params(params, config: GPTConfig) -> None:
    if type(config) is not GPTConfig:  # exactly: a subclass may add fields this file ignores
        raise TypeError(f"config must be a GPTConfig (exactly that class, not a subclass), "
                        f"got {type(config).__name__}")
    check_param_dict(params, param_shapes(config))


# ---- one residual sublayer (shared by attention and FFN) ------------------------------------------

class SublayerCache(NamedTuple):
    ln: LayerNormCache
    branch: object  # MHACache, KernelAttentionCache or GELUFFNCache
    drop: np.ndarray | None  # residual dropout multiplier, (B, T, d)


def _residual_forward(x, gamma, beta, branch, drop, config: GPTConfig):
    """Pre-LN ``x + drop(F(LN(x)))`` or Post-LN ``LN(x + drop(F(x)))``; ``branch(u) -> (F(u), cache)``."""
    if config.norm_position == "pre":
        u, ln = layernorm_forward(x, gamma, beta, config.norm_eps)
        y, branch_cache = branch(u)
        return x + apply_mask(y, drop), SublayerCache(ln, branch_cache, drop)
    y, branch_cache = branch(x)
    out, ln = layernorm_forward(x + apply_mask(y, drop), gamma, beta, config.norm_eps)
    return out, SublayerCache(ln, branch_cache, drop)


def _residual_backward(dout, cache: SublayerCache, branch_backward, norm_position: str):
    """Returns ``(dx, dgamma, dbeta, branch_grads)``; ``branch_backward(dy, cache) -> (du, grads)``.

    The residual input feeds two places (the skip path and the branch), so its gradient is the sum
    of both: ``dx = dout + J_branch^T ...`` for Pre-LN, ``dx = ds + ...`` after the LayerNorm for
    Post-LN.
    """
    ln, branch_cache, drop = cache
    if norm_position == "pre":
        du, branch_grads = branch_backward(apply_mask(dout, drop), branch_cache)
        dx_ln, dgamma, dbeta = layernorm_backward(du, ln)
        return dout + dx_ln, dgamma, dbeta, branch_grads
    ds, dgamma, dbeta = layernorm_backward(dout, ln)
    dx_branch, branch_grads = branch_backward(apply_mask(ds, drop), branch_cache)
    return ds + dx_branch, dgamma, dbeta, branch_grads


# ---- attention sublayer, FFN sublayer, layer -----------------------------------------------------

def attention_sublayer_forward(x, params: dict, layer: int, config: GPTConfig, rng=None):
    """Causal multi-head self-attention with biases as a residual sublayer (``ln1``, ``attn``),
    banded on a sliding layer (:func:`layer_config`).

    ``x`` is ``(B, T, d)``. With ``rng`` (train mode) draws the attention-weight mask
    ``(B, h, T, T)`` and then the residual-branch mask ``(B, T, d)``. The attention is
    :func:`attention_ops` of the config's backend. Returns ``(y, SublayerCache)``.
    """
    p = f"layers.{layer}."
    attn_params = sub_params(params, p + "attn")
    b, t, d = x.shape
    attn_drop = dropout_mask(rng, (b, config.n_heads, t, t), config.dropout, x.dtype)
    drop = dropout_mask(rng, (b, t, d), config.dropout, x.dtype)

    def branch(u):
        return attention_ops(config).forward(u, attn_params, layer_config(config, layer), attn_drop)

    return _residual_forward(x, params[p + "ln1.gamma"], params[p + "ln1.beta"], branch, drop, config)


def mha_attention_forward(u, params: dict, config: GPTConfig, dropout_mask=None):
    r"""The attention branch in NumPy: :func:`refmath.attention.mha_forward` with a causal mask
    (the banded one of ``config.sliding_window`` = ``w``, A12) and, in training, ``dropout_mask``
    on the attention weights. Returns ``(y, MHACache)``.

    .. math::
        M_{ij} = 0 \text{ if } i - w < j \le i, \quad -\infty \text{ otherwise}

    The backward is that of any mask: a masked score has weight 0, so it gets gradient 0."""
    t = u.shape[1]
    mask = (causal_mask(t, dtype=u.dtype) if config.sliding_window is None
            else local_window_mask(t, config.sliding_window, dtype=u.dtype))
    return mha_forward(u, params, config.n_heads, mask=mask, dropout_mask=dropout_mask)


def mha_attention_state(cache):
    """The ``(k, v)`` of :func:`mha_attention_forward`, each ``(B, h, T, d_h)`` (GPT's ``g = h``)."""
    return cache.attn.k, cache.attn.v


class KernelAttentionCache(NamedTuple):
    qkv: LinearCache  # the one product u [W_q W_k W_v] + [b_q b_k b_v]
    attn: CausalAttentionCache
    out: LinearCache
    n_heads: int


def kernel_attention_forward(u, params: dict, config: GPTConfig, dropout_mask=None):
    """The attention branch with its causal attention on ``config.attention_backend`` (the
    FlashAttention kernel for ``"cpu"``, :func:`refmath.attention.causal_attention_forward`): the
    same function as :func:`refmath.attention.mha_forward` with a causal mask (banded with
    ``config.sliding_window``: the kernel skips the tiles outside the band) and no dropout.

    Q, K and V all read ``u``, so they come from one product with the three weight matrices side
    by side: one larger matrix product instead of three, and in the backward one for ``du``
    instead of three products and two sums. The kernel has no dropout on the attention weights
    (the config refuses a dropout rate with it), so ``dropout_mask`` must be None."""
    if dropout_mask is not None:
        raise ValueError("the attention kernel has no dropout on the attention weights: "
                         "dropout_mask must be None")
    h = config.n_heads
    w = np.concatenate([params["w_q"], params["w_k"], params["w_v"]], axis=1)  # (d, 3d)
    b = np.concatenate([params["b_q"], params["b_k"], params["b_v"]])
    y, qkv = linear_forward(u, w, b)
    batch, t, d = u.shape
    # (B, T, 3, h, d_h) -> (3, B, h, T, d_h): one copy gives the kernel its three head-major blocks
    q, k, v = np.ascontiguousarray(y.reshape(batch, t, 3, h, -1).transpose(2, 0, 3, 1, 4))
    o, attn = causal_attention_forward(q, k, v, config.attention_backend,
                                       window=config.sliding_window)
    y, out = linear_forward(merge_heads(o), params["w_o"], params["b_o"])
    return y, KernelAttentionCache(qkv, attn, out, h)


def kernel_attention_backward(dy, cache: KernelAttentionCache):
    """Gradients of :func:`kernel_attention_forward`: ``(du, dparams)``."""
    d_merged, dw_o, db_o = linear_backward(dy, cache.out)
    dq, dk, dv = causal_attention_backward(split_heads(d_merged, cache.n_heads), cache.attn)
    batch, h, t, d_h = dq.shape
    d_y = np.empty((batch, t, 3, h, d_h), dtype=dq.dtype)  # the gradient of u [W_q W_k W_v]
    for i, dh in enumerate((dq, dk, dv)):
        d_y[:, :, i] = dh.transpose(0, 2, 1, 3)
    du, dw, db = linear_backward(d_y.reshape(batch, t, 3 * h * d_h), cache.qkv)
    grads = {"w_o": dw_o, "b_o": db_o}
    for n, dw_n, db_n in zip("qkv", np.split(dw, 3, axis=1), np.split(db, 3)):
        # copied out of dw's column blocks: the optimiser's passes run faster on contiguous rows
        grads[f"w_{n}"], grads[f"b_{n}"] = np.ascontiguousarray(dw_n), db_n
    return du, grads


def kernel_attention_state(cache: KernelAttentionCache):
    """The ``(k, v)`` the kernel read, each ``(B, h, T, d_h)``."""
    return causal_attention_kv(cache.attn)


def cached_attention(u, params: dict, config: GPTConfig, slot, offset: int,
                     matmul=matmul_rows_many):
    """The attention branch at inference: ``slot.attend(q, k, v, offset, window)`` appends the new
    rows' keys and values to the layer's cache and attends over every cached position (the last
    ``sliding_window`` of them on a sliding layer). ``u`` is ``(B, n, d)``; returns
    ``(B, n, d)``. (GPT's positions enter at the embedding, so the projections need no
    ``offset``, and a window counts back from the absolute position of each query.)"""
    h = config.n_heads
    q, k, v = (split_heads(y, h) for y in projections(u, params, "qkv", matmul))
    o = slot.attend(q, k, v, offset, window=config.sliding_window)
    return linear_forward(merge_heads(o), params["w_o"], params["b_o"], matmul=matmul)[0]


# GPT's attention, as the decoders of refmath.models.decoder have theirs: in NumPy or in the kernel
# for training and evaluation, and one cached step for inference.
MHA_ATTENTION = AttentionOps(attention_shapes, mha_attention_forward, mha_backward,
                             mha_attention_state, cached_attention)
KERNEL_ATTENTION = AttentionOps(attention_shapes, kernel_attention_forward,
                                kernel_attention_backward, kernel_attention_state, cached_attention)


def attention_ops(config: GPTConfig) -> AttentionOps:
    """The attention of ``config.attention_backend``: :data:`MHA_ATTENTION` for ``"numpy"``,
    :data:`KERNEL_ATTENTION` for the kernel."""
    return MHA_ATTENTION if config.attention_backend == "numpy" else KERNEL_ATTENTION


def attention_sublayer_backward(dout, cache: SublayerCache, layer: int, config: GPTConfig):
    """Returns ``(dx, grads)`` with ``grads`` keyed by full parameter names of this sublayer."""
    dx, dgamma, dbeta, attn = _residual_backward(dout, cache, attention_ops(config).backward,
                                                 config.norm_position)
    p = f"layers.{layer}."
    grads = {p + "ln1.gamma": dgamma, p + "ln1.beta": dbeta}
    grads.update({p + "attn." + k: g for k, g in attn.items()})
    return dx, grads


class GELUFFNCache(NamedTuple):
    first: LinearCache  # h = u W_1 (the bias b_1 is added by the fused GELU)
    act: BiasGELUCache
    second: LinearCache  # y = a W_2 + b_2


def ffn_sublayer_forward(x, params: dict, layer: int, config: GPTConfig, rng=None,
                         matmul=matmul_rows_many):
    r"""GELU FFN with biases as a residual sublayer (``ln2``, ``ffn``); ``x`` is ``(B, T, d)``.

    The branch is :func:`refmath.ffn.ffn_forward`'s
    :math:`\operatorname{GELU}(u W_1 + b_1) W_2 + b_2` (the tanh form for ``ffn="gelu_tanh"``, the
    exact one for ``"gelu"``), with the bias and the GELU fused
    (:func:`refmath.fast.fused.bias_gelu_forward`: the same numbers, fewer passes over memory).
    """
    p = f"layers.{layer}."
    w1, b1, w2, b2 = (params[p + "ffn." + k] for k in _FFN_KEYS)
    drop = dropout_mask(rng, x.shape, config.dropout, x.dtype)

    def branch(u):
        h, first = linear_forward(u, w1, matmul=matmul)
        a, act = bias_gelu_forward(h, b1, config.ffn == "gelu_tanh")
        y, second = linear_forward(a, w2, b2, matmul=matmul)
        return y, GELUFFNCache(first, act, second)

    return _residual_forward(x, params[p + "ln2.gamma"], params[p + "ln2.beta"], branch, drop, config)


def _ffn_branch_backward(dy, cache: GELUFFNCache):
    da, dw2, db2 = linear_backward(dy, cache.second)
    dh = bias_gelu_backward(da, cache.act)
    du, dw1, _ = linear_backward(dh, cache.first)
    db1 = dh.reshape(-1, dh.shape[-1]).sum(axis=0)
    return du, dict(zip(_FFN_KEYS, (dw1, db1, dw2, db2)))


def ffn_sublayer_backward(dout, cache: SublayerCache, layer: int, config: GPTConfig):
    """Returns ``(dx, grads)`` with ``grads`` keyed by full parameter names of this sublayer."""
    dx, dgamma, dbeta, ffn = _residual_backward(dout, cache, _ffn_branch_backward, config.norm_position)
    p = f"layers.{layer}."
    grads = {p + "ln2.gamma": dgamma, p + "ln2.beta": dbeta}
    grads.update({p + "ffn." + k: g for k, g in ffn.items()})
    return dx, grads


class LayerCache(NamedTuple):
    attn: SublayerCache
    ffn: SublayerCache


def layer_forward(x, params: dict, layer: int, config: GPTConfig, rng=None):
    """One Transformer layer: attention sublayer, then FFN sublayer. Returns ``(y, LayerCache)``."""
    x, attn = attention_sublayer_forward(x, params, layer, config, rng)
    x, ffn = ffn_sublayer_forward(x, params, layer, config, rng)
    return x, LayerCache(attn, ffn)


def layer_backward(dout, cache: LayerCache, layer: int, config: GPTConfig):
    """Returns ``(dx, grads)`` for one layer, the FFN sublayer first (reverse order)."""
    dx, grads = ffn_sublayer_backward(dout, cache.ffn, layer, config)
    dx, attn_grads = attention_sublayer_backward(dx, cache.attn, layer, config)
    grads.update(attn_grads)
    return dx, grads


# ---- the whole network ---------------------------------------------------------------------------

class GPTCache(NamedTuple):
    config: GPTConfig
    param_names: tuple  # the keys of params, in order: the keys of the gradient dict
    tok: EmbeddingCache
    pos: LearnedPositionsCache
    emb_drop: np.ndarray | None  # dropout multiplier on E[a] + P, (B, T, d)
    layers: tuple  # one LayerCache per layer
    ln_f: LayerNormCache | None  # Pre-LN only
    head: LinearCache  # logits = h W_out, W_out = tok_emb^T (tied) or lm_head
    loss: CrossEntropyCache | None  # None when only logits were asked for


def _logits_forward(params: dict, tokens: np.ndarray, config: GPTConfig, rng=None):
    """Embedding, layers, final norm and output projection. Returns ``(logits, partial GPTCache)``."""
    x, tok = embedding_forward(tokens, params["tok_emb"])
    x, pos = learned_positions_forward(x, params["pos_emb"])
    emb_drop = dropout_mask(rng, x.shape, config.dropout, x.dtype)
    x = apply_mask(x, emb_drop)
    layers = []
    for i in range(config.n_layers):
        x, layer_cache = layer_forward(x, params, i, config, rng)
        layers.append(layer_cache)
    ln_f = None
    if config.norm_position == "pre":
        x, ln_f = layernorm_forward(x, params["ln_f.gamma"], params["ln_f.beta"], config.norm_eps)
    w_out = params["tok_emb"].T if config.tie_embeddings else params["lm_head"]
    logits, head = linear_forward(x, w_out)
    cache = GPTCache(config, tuple(params), tok, pos, emb_drop, tuple(layers), ln_f, head, None)
    return logits, cache


def forward(params: dict, batch: dict, config: GPTConfig, train: bool = False, rng=None):
    r"""Mean next-token cross-entropy of a batch (catalogue M2, L2, L5).

    ``batch``: ``"tokens"`` int ``(B, T)`` with ``T <= max_seq_len``, ``"targets"`` int ``(B, T)``
    (``-100`` = not counted), optional ``"loss_mask"`` ``(B, T)`` of 0/1 (0 = prompt token, not
    counted; L5). With ``train=True`` and ``config.dropout > 0``, dropout masks are drawn from
    ``rng`` (a ``np.random.Generator``, required then) in a fixed order and kept in the cache, so
    :func:`backward` is exact and the same seed gives the same masks.

    Returns ``(loss, cache)``: ``loss`` is a 0-d array in the parameters' dtype.
    """
    _check_params(params, config)
    tokens, targets, loss_mask = check_lm_batch(batch, config)
    if train and config.dropout > 0:
        if not isinstance(rng, np.random.Generator):
            raise ValueError(f"train=True with dropout = {config.dropout} needs rng, a "
                             f"np.random.Generator, to draw the dropout masks; got {rng!r}")
    else:
        rng = None  # no dropout: nothing is drawn
    logits, cache = _logits_forward(params, tokens, config, rng)
    loss, ce = cross_entropy_forward(logits, targets, ignore_index=IGNORE_INDEX, loss_mask=loss_mask)
    return loss, cache._replace(loss=ce)


def backward(cache: GPTCache) -> dict[str, np.ndarray]:
    """Gradients of the loss of :func:`forward`: a dict with exactly the keys of ``params``."""
    config = cache.config
    if cache.loss is None:
        raise ValueError("this cache holds no loss (it came from logits only); run forward()")
    dlogits = cross_entropy_backward(1.0, cache.loss)
    dx, dw_out, _ = linear_backward(dlogits, cache.head)
    grads = {}
    if config.norm_position == "pre":
        dx, grads["ln_f.gamma"], grads["ln_f.beta"] = layernorm_backward(dx, cache.ln_f)
    for i in reversed(range(config.n_layers)):
        dx, layer_grads = layer_backward(dx, cache.layers[i], i, config)
        grads.update(layer_grads)
    dx = apply_mask(dx, cache.emb_drop)
    dx, grads["pos_emb"] = learned_positions_backward(dx, cache.pos)
    grads["tok_emb"] = embedding_backward(dx, cache.tok)
    if config.tie_embeddings:
        # The tied table is used twice, as the input lookup and as the output projection
        # (W_out = E^T), so its gradient is the sum of both contributions; dW_out is (d, V).
        grads["tok_emb"] = grads["tok_emb"] + dw_out.T
    else:
        grads["lm_head"] = dw_out
    return {name: grads[name] for name in cache.param_names}


def logits(params: dict, tokens, config: GPTConfig) -> np.ndarray:
    """Next-token logits ``(B, T, vocab_size)`` for int ``tokens`` ``(B, T)``, evaluation mode."""
    _check_params(params, config)
    tokens = check_tokens("tokens", tokens, config)
    return _logits_forward(params, tokens, config)[0]


# ---- inference with a KV cache: this model's side of refmath.inference.kv_cache (K2) -------------


def cache_spec(config: GPTConfig, batch: int, max_len: int) -> CacheSpec:
    """Keys and values of every head per layer (``g = h``): ``(L, B, h, max_len, d_h)`` each, of
    which a banded layer keeps only its window's rows (:func:`layer_window`)."""
    shape = (config.n_layers, batch, config.n_heads, max_len, config.d_h)
    windows = tuple(layer_window(config, i) for i in range(config.n_layers))
    return CacheSpec("kv", (shape, shape),
                     windows=windows if any(w is not None for w in windows) else None)


def embed(params, tokens, config: GPTConfig, offset: int) -> np.ndarray:
    """The new rows ``(B, n, d)``: token embeddings plus rows ``offset..`` of the learned position
    table (N9)."""
    x, _ = embedding_forward(tokens, params["tok_emb"])
    x, _ = learned_positions_forward(x, params["pos_emb"], offset=offset)
    return x


def cached_layer(x, params, layer: int, config: GPTConfig, slot, offset: int, *,
                 matmul=matmul_rows_many) -> np.ndarray:
    """Layer ``layer`` on the new rows ``x`` at positions ``offset..``: the attention sublayer with
    :func:`cached_attention` reading and extending the layer's cache through ``slot`` (with the
    layer's window), then the FFN sublayer (per token, as in training)."""
    p = f"layers.{layer}."
    attn_params = sub_params(params, p + "attn")

    def branch(u):
        return cached_attention(u, attn_params, layer_config(config, layer), slot, offset,
                                matmul=matmul), None

    x, _ = _residual_forward(x, params[p + "ln1.gamma"], params[p + "ln1.beta"], branch, None,
                             config)
    return ffn_sublayer_forward(x, params, layer, config, matmul=matmul)[0]


def head(params, x, config: GPTConfig, *, matmul=matmul_rows_many) -> np.ndarray:
    """Final LayerNorm (Pre-LN only) and output projection of the new rows: ``(B, n, V)``."""
    if config.norm_position == "pre":
        x, _ = layernorm_forward(x, params["ln_f.gamma"], params["ln_f.beta"], config.norm_eps)
    w_out = params["tok_emb"].T if config.tie_embeddings else params["lm_head"]
    return linear_forward(x, w_out, matmul=matmul)[0]



def cache_stale(config: GPTConfig, length: int, n: int) -> bool:
    """Never: GPT's positions are a learned table, so a cached key does not depend on the length
    (the hook of :mod:`refmath.models.contract`)."""
    return False


def rope_options(config: GPTConfig, offset: int, length: int) -> None:
    """None: positions enter at the embedding, not by RoPE (the hook of
    :mod:`refmath.models.contract`)."""
    return None


# What the compiled decode layer (refmath.kernels.decode_layers, with embed and head around it)
# computes, field by field (see refmath.models.contract): anything else keeps the NumPy step.
COMPILED_FIELDS = {
    # sizes, handed to the kernel as its shape; the embedding and the head run in NumPy
    "vocab_size": ANY, "max_seq_len": ANY, "n_layers": ANY, "d_model": ANY, "n_heads": ANY,
    "d_ff": ANY, "tie_embeddings": ANY, "norm_eps": ANY,
    "ffn": ANY,  # exact or tanh GELU
    # training only: no decode step reads them
    "dropout": ANY, "init_std": ANY, "attention_backend": ANY,
    # not computed: Post-LN, sliding windows
    "norm_position": ("pre",), "sliding_window": (None,), "window_layers": (None,),
}


def compiled_layer_spec(params, config: GPTConfig):
    """What :mod:`refmath.inference.compiled_step` runs of this model's layers in one compiled
    call (:func:`refmath.kernels.decode_layers`): ``(shape, layers)``, the sizes and options, and
    each layer's arrays by the kernel's names (the pre-LN block, biases everywhere, the GELU FFN;
    positions enter at the embedding). None unless every field has a value
    :data:`COMPILED_FIELDS` lists."""
    if type(config) is not GPTConfig or not allowed(config, COMPILED_FIELDS):
        return None
    layers = []
    for i in range(config.n_layers):
        p = sub_params(params, f"layers.{i}")
        layer = {"norm1_gain": p["ln1.gamma"], "norm1_shift": p["ln1.beta"],
                 "norm2_gain": p["ln2.gamma"], "norm2_shift": p["ln2.beta"]}
        layer.update({name: p[f"attn.{name}"] for name in
                      ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")})
        layer.update(w_up=p["ffn.w1"], b_up=p["ffn.b1"], w_down=p["ffn.w2"], b_down=p["ffn.b2"])
        layers.append(layer)
    shape = dict(d_model=config.d_model, heads=config.n_heads, kv_heads=config.n_heads,
                 head_dim=config.d_h, d_ff=config.d_ff, norm="layernorm",
                 eps=config.norm_eps,
                 ffn=config.ffn, rope="none",
                 scale=1.0 / math.sqrt(config.d_h))
    return shape, layers

# ---- sizes: what refmath.sizing counts of this model ---------------------------------------------

def sizing_fields(config: GPTConfig) -> dict:
    """The fields of a :class:`refmath.sizing.ModelConfig` that describe this model (without its
    name and source): what the parameter, memory and FLOP calculators need to know of it."""
    return dict(n_layers=config.n_layers, d_model=config.d_model, n_heads=config.n_heads,
                kv_heads=config.n_heads, head_dim=config.d_h, d_ff=config.d_ff,
                vocab_size=config.vocab_size, ffn=config.ffn, norm="layernorm", attention_bias=True,
                ffn_bias=True, tie_embeddings=config.tie_embeddings,
                learned_positions=config.max_seq_len, final_norm=config.norm_position == "pre",
                sliding_window=config.sliding_window, window_layers=config.window_layers)


# ---- Hugging Face: gpt2 and openai-gpt (refmath.hf reads and writes the files) -------------------

HF_MODEL_TYPES = ("gpt2", "openai-gpt")  # Pre-LN GPT-2; Post-LN GPT-1, always tied


def config_from_hf(hf: dict) -> GPTConfig:
    refuse_common(hf)
    d = int(hf["n_embd"])
    if hf["model_type"] == "gpt2":
        act = require(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh", "gelu"),
                       "gelu_new", "refmath's GPT uses GELU (tanh or exact)")
        require(hf, "scale_attn_weights", (True,), True, "refmath scales scores by 1/sqrt(d_h)")
        require(hf, "scale_attn_by_inverse_layer_idx", (False,), False,
                 "refmath does not scale scores by the layer index")
        return GPTConfig(vocab_size=int(hf["vocab_size"]), max_seq_len=int(hf["n_positions"]),
                             n_layers=int(hf["n_layer"]), d_model=d, n_heads=int(hf["n_head"]),
                             d_ff=int(hf.get("n_inner") or 4 * d), norm_position="pre",
                             tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                             ffn="gelu" if act == "gelu" else "gelu_tanh", dropout=0.0,
                             norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)))
    # OpenAI GPT: transformers' "gelu" for this model is the tanh form (gelu_new); always tied.
    require(hf, "afn", ("gelu",), "gelu", "refmath's GPT uses GELU")
    require(hf, "tie_word_embeddings", (True,), True, "OpenAI GPT's head is its token table")
    return GPTConfig(vocab_size=int(hf["vocab_size"]), max_seq_len=int(hf["n_positions"]),
                         n_layers=int(hf["n_layer"]), d_model=d, n_heads=int(hf["n_head"]),
                         d_ff=4 * d, norm_position="post", tie_embeddings=True,
                         ffn="gelu_tanh", dropout=0.0,
                         norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)))


def _hf_names(hf: dict, weights) -> dict:
    """Hugging Face's names for GPT-2 and OpenAI GPT (with or without the ``transformer.``
    prefix that ``*LMHeadModel`` adds)."""
    gpt2 = hf["model_type"] == "gpt2"
    tok, pos = ("wte", "wpe") if gpt2 else ("tokens_embed", "positions_embed")
    prefix = "transformer." if weights.has(f"transformer.{tok}.weight") else ""
    return {"prefix": prefix, "tok": prefix + tok + ".weight", "pos": prefix + pos + ".weight"}


def params_from_hf(hf: dict, config: GPTConfig, weights) -> dict:
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    names = _hf_names(hf, weights)
    params = {"tok_emb": weights.take(names["tok"], (v, d)),
              "pos_emb": weights.take(names["pos"], (config.max_seq_len, d))}
    for i in range(config.n_layers):
        h, p = f"{names['prefix']}h.{i}.", f"layers.{i}."
        # Conv1D weights are (in, out) already; c_attn holds [W_Q W_K W_V] side by side.
        w_qkv = weights.take(h + "attn.c_attn.weight", (d, 3 * d))
        b_qkv = weights.take(h + "attn.c_attn.bias", (3 * d,))
        for j, name in enumerate(("q", "k", "v")):
            params[p + f"attn.w_{name}"] = np.ascontiguousarray(w_qkv[:, j * d:(j + 1) * d])
            params[p + f"attn.b_{name}"] = b_qkv[j * d:(j + 1) * d].copy()
        params[p + "attn.w_o"] = weights.take(h + "attn.c_proj.weight", (d, d))
        params[p + "attn.b_o"] = weights.take(h + "attn.c_proj.bias", (d,))
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            params[p + f"{ours}.gamma"] = weights.take(h + f"{theirs}.weight", (d,))
            params[p + f"{ours}.beta"] = weights.take(h + f"{theirs}.bias", (d,))
        params[p + "ffn.w1"] = weights.take(h + "mlp.c_fc.weight", (d, f))
        params[p + "ffn.b1"] = weights.take(h + "mlp.c_fc.bias", (f,))
        params[p + "ffn.w2"] = weights.take(h + "mlp.c_proj.weight", (f, d))
        params[p + "ffn.b2"] = weights.take(h + "mlp.c_proj.bias", (d,))
        # The causal mask that older GPT-2 files store as buffers: derived, not parameters.
        for buffer in ("attn.bias", "attn.masked_bias"):
            if weights.has(h + buffer):
                weights.skip(h + buffer)
    if config.norm_position == "pre":
        params["ln_f.gamma"] = weights.take(names["prefix"] + "ln_f.weight", (d,))
        params["ln_f.beta"] = weights.take(names["prefix"] + "ln_f.bias", (d,))
    take_head(weights, config.tie_embeddings, params, v, d)
    return params


def to_hf(config: GPTConfig, params: dict):
    d = config.d_model
    if config.sliding_window is not None:
        where = "every layer" if config.window_layers is None else "the layers of window_layers"
        raise HFCheckpointError(f"gpt2 and openai-gpt attend to every earlier position on every "
                                f"layer; this config has sliding_window = {config.sliding_window} "
                                f"on {where}")
    if config.norm_position == "pre":
        hf = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": d,
              "n_layer": config.n_layers, "n_head": config.n_heads, "n_positions": config.max_seq_len,
              "n_inner": config.d_ff, "vocab_size": config.vocab_size,
              "activation_function": "gelu_new" if config.ffn == "gelu_tanh" else "gelu",
              "layer_norm_epsilon": config.norm_eps,
              "tie_word_embeddings": config.tie_embeddings}
        prefix, tok, pos = "transformer.", "wte", "wpe"
    else:
        why = [f"{field} = {value!r}" for field, value, ok in (
            ("tie_embeddings", config.tie_embeddings, config.tie_embeddings),
            ("d_ff", config.d_ff, config.d_ff == 4 * d),
            ("ffn", config.ffn, config.ffn == "gelu_tanh")) if not ok]
        if why:
            raise HFCheckpointError(f"a Post-LN GPT is written as openai-gpt, which has a tied "
                                    f"head, d_ff = 4 d_model and tanh GELU; this config has "
                                    f"{', '.join(why)}")
        hf = {"model_type": "openai-gpt", "architectures": ["OpenAIGPTLMHeadModel"], "n_embd": d,
              "n_layer": config.n_layers, "n_head": config.n_heads,
              "n_positions": config.max_seq_len, "vocab_size": config.vocab_size, "afn": "gelu",
              "layer_norm_epsilon": config.norm_eps, "tie_word_embeddings": True}
        prefix, tok, pos = "transformer.", "tokens_embed", "positions_embed"
    tensors = {f"{prefix}{tok}.weight": params["tok_emb"], f"{prefix}{pos}.weight": params["pos_emb"]}
    for i in range(config.n_layers):
        h, p = f"{prefix}h.{i}.", f"layers.{i}."
        tensors[h + "attn.c_attn.weight"] = np.concatenate(
            [params[p + f"attn.w_{n}"] for n in "qkv"], axis=1)
        tensors[h + "attn.c_attn.bias"] = np.concatenate([params[p + f"attn.b_{n}"] for n in "qkv"])
        tensors[h + "attn.c_proj.weight"] = params[p + "attn.w_o"]
        tensors[h + "attn.c_proj.bias"] = params[p + "attn.b_o"]
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            tensors[h + f"{theirs}.weight"] = params[p + f"{ours}.gamma"]
            tensors[h + f"{theirs}.bias"] = params[p + f"{ours}.beta"]
        tensors[h + "mlp.c_fc.weight"] = params[p + "ffn.w1"]
        tensors[h + "mlp.c_fc.bias"] = params[p + "ffn.b1"]
        tensors[h + "mlp.c_proj.weight"] = params[p + "ffn.w2"]
        tensors[h + "mlp.c_proj.bias"] = params[p + "ffn.b2"]
    if config.norm_position == "pre":
        tensors[prefix + "ln_f.weight"] = params["ln_f.gamma"]
        tensors[prefix + "ln_f.bias"] = params["ln_f.beta"]
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = linear_out(params["lm_head"])
    return hf, tensors


# ---- gradient-check case -------------------------------------------------------------------------

def _case_make(config):
    """Parameters away from the initialisation (random gains, shifts and biases, weights of
    1/sqrt(fan-in)) so that every path carries a signal of order 1, and a batch with a loss mask
    and an ignored target; dropout masks from a generator seeded afresh at every call."""
    def make(rng):
        params = {}
        for name, shape in param_shapes(config).items():
            if name.endswith("gamma"):
                params[name] = 1.0 + 0.2 * rng.standard_normal(shape)
            elif len(shape) == 1:
                params[name] = 0.2 * rng.standard_normal(shape)
            elif name in ("tok_emb", "pos_emb"):
                params[name] = 0.5 * rng.standard_normal(shape)
            else:
                params[name] = rng.standard_normal(shape) / math.sqrt(shape[0])
        b, t = 2, 5
        batch = {"tokens": rng.integers(0, config.vocab_size, (b, t)),
                 "targets": rng.integers(0, config.vocab_size, (b, t)),
                 "loss_mask": np.ones((b, t), np.int64)}
        batch["targets"][1, -1] = IGNORE_INDEX
        batch["loss_mask"][:, 0] = 0

        def loss(p):
            return forward(p, batch, config, train=True, rng=np.random.default_rng(5))
        return params, loss
    return make


# The models' loss has a larger fifth derivative than a single op (|D(2h) - D(h)| / 15 ~ 2e-9 at
# h = 1e-3), so the step is 2.5e-4, where truncation is below the rounding term again (the test
# measures it).
register_case(ParamCase(
    "gpt", "pre-LN, tied, 2 layers, dropout 0.2, loss mask", ("M2",),
    _case_make(GPTConfig(vocab_size=13, max_seq_len=8, n_layers=2, d_model=8, n_heads=2, d_ff=12,
                         dropout=0.2, norm_position="pre", tie_embeddings=True)),
    backward, max_coords=1, step=2.5e-4))
# GPT-3's pattern (dense, then banded) on a sequence of 5 tokens: a window of 2 hides 6 of the 15
# causal pairs of the banded layer, so the band changes the function being differentiated (the
# torch oracle in tests/models/test_gpt_torch.py checks that it is the right function).
register_case(ParamCase(
    "gpt", "GPT-3-like: dense then banded layer (window 2), pre-LN, dropout 0.2", ("M2", "A12"),
    _case_make(GPTConfig(vocab_size=13, max_seq_len=8, n_layers=2, d_model=8, n_heads=2, d_ff=12,
                         dropout=0.2, norm_position="pre", tie_embeddings=True, sliding_window=2,
                         window_layers=(False, True))),
    backward, max_coords=1, step=2.5e-4))
