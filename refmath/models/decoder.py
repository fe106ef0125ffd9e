r"""The modern decoder-only Transformer (catalogue M3): Pre-RMSNorm, RoPE, GQA, SwiGLU.

A layer maps the residual stream ``x`` (one row per token) to

.. math::
    x' = x + \operatorname{Attn}(\operatorname{RMSNorm}(x)),\qquad
    x'' = x' + \operatorname{SwiGLU}(\operatorname{RMSNorm}(x'))

and the network is token embedding, ``L`` such layers, a final RMSNorm and an output head
(untied by default), followed by the vocabulary softmax inside the cross-entropy. There are no
biases (except, with ``qkv_bias``, on the query, key and value projections, as in Qwen2) and no
learned or fixed position table: positions enter only through the rotation of queries and keys
(RoPE, N10) inside attention. The parallel block of Falcon, PaLM and GPT-J is
:mod:`refmath.models.falcon`'s, OLMo 2's norms after the sublayers only
:mod:`refmath.models.olmo2`'s, Gemma's options :mod:`refmath.models.gemma`'s; Phi-3, this network
with its checkpoint's fused projections and LongRoPE, is :mod:`refmath.models.phi3`'s.

The attention sublayer is a parameter of the recurrence: an :class:`AttentionOps` bundles its
parameter shapes, its forward/backward pair and the per-layer tensors an inference cache keeps.
This module's attention is RoPE + grouped-query attention (:data:`ROPE_GQA`);
:mod:`refmath.models.mla` reuses everything else here with latent attention in its place.

The model is written over five files: the configuration (:mod:`refmath.models.decoder_config`),
the blocks a layer is made of, which read no configuration (:mod:`refmath.models.blocks`), the
RoPE attention (:mod:`refmath.models.rope_attention`), the Hugging Face key tables
(:mod:`refmath.models.decoder_hf`), and this file: the layer, the network, the cached step and the
hooks of the model contract (:mod:`refmath.models.contract`), which offers the others' public
names too, so that ``refmath.models.decoder.DecoderConfig`` and the rest keep their paths.

Parameters (flat dict, row vectors ``x @ W`` with ``W`` shaped ``d_in x d_out``)::

    tok_emb                      (V, d)
    layers.{i}.ln1.gamma         (d,)           RMSNorm before attention
    layers.{i}.attn.w_q          (d, h d_h)
    layers.{i}.attn.w_k          (d, g d_h)
    layers.{i}.attn.w_v          (d, g d_h)
    layers.{i}.attn.w_o          (h d_h, d)
    layers.{i}.attn.b_q, b_k, b_v  (h d_h,), (g d_h,), (g d_h,)   only with qkv_bias (Qwen2)
    layers.{i}.ln2.gamma         (d,)           RMSNorm before the FFN
    layers.{i}.ffn.w_gate        (d, d_f)
    layers.{i}.ffn.w_up          (d, d_f)
    layers.{i}.ffn.w_down        (d_f, d)
    layers.{i}.ffn.router.w, ...  on a mixture-of-experts layer (moe), instead of the three above:
                                 the router and experts of refmath.moe
    ln_f.gamma                   (d,)
    lm_head                      (d, V)         absent when tie_embeddings (then W = tok_emb^T)
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np

from refmath.embedding import EmbeddingCache, embedding_backward, embedding_forward
from refmath.ffn import LinearCache, linear_backward, linear_forward, matmul_rows_many
from refmath import moe as moe_ops
from refmath.losses import IGNORE_INDEX, CrossEntropyCache
from refmath.models import check_config
from refmath.models import blocks, network, rope_attention
# the family's blocks, configuration, attention, checkpoint tables and gradient-case makers, offered
# under this module's name too (their paths before the split)
from refmath.models.blocks import (SublayerCache, ffn_backward, ffn_forward, norm_backward,
                                   sublayer_backward, sublayer_forward)
from refmath.models.cases import (SelectionChanged, case_batch, case_params, model_case_maker,
                                   moe_case_maker, routed_experts, routing_margin)
from refmath.models.contract import ANY, allowed
from refmath.models.decoder_config import (PRESETS, QK_NORMS, DecoderConfig,
                                           FamilyConfig, attention_options, check_shared_fields,
                                           ffn_width, gain, layer_config, preset)
from refmath.models.feed_forward import FeedForward, mixture_of_experts, swiglu
from refmath.models.decoder_hf import (HF_MODEL_TYPES, QWEN_TYPES, config_from_hf,
                                       params_from_hf, to_hf)
from refmath.models.network import embed  # the table's rows; positions enter by RoPE only
from refmath.models.rope_attention import (ROPE_GQA, RoPEAttentionCache, cache_stale,
                                           queries_keys, rope_attention_backward,
                                           rope_attention_cached, rope_attention_forward,
                                           rope_attention_shapes, rope_attention_state,
                                           rope_options)
from refmath.models.common import (AttentionOps, CacheSpec, TrainingRecipe, layer_dropout_masks,
                                   prefixed, sub_params)
from refmath.models.params import check_param_dict, draw_params
from refmath.models.batch import (check_lm_batch, check_tokens, next_token_loss,
                                  next_token_loss_backward)
from refmath.registry import OpCase, ParamCase, layer_case_ops, register_case

__all__ = [
    "TRAINING_RECIPE", "is_moe_layer", "feed_forward", "decoder_param_shapes", "init_decoder_params",
    "param_shapes", "init_params", "norm_forward", "layer_norm", "LayerCache", "block_forward",
    "layer_forward", "layer_backward", "DecoderCache", "decoder_forward", "decoder_backward",
    "lm_forward", "moe_aux_loss", "expert_loads", "layer_states", "forward", "backward",
    "decoder_logits", "logits", "layer_kv", "cache_spec", "embed", "head", "family_cached_layer",
    "cached_layer", "COMPILED_FIELDS", "compiled_layer_spec", "llama_layers_spec",
    "sizing_fields", "rope_attention_inputs"
]


# The default of `python -m refmath train` (as GPT's: about 2.5 min on two busy CPU cores).
TRAINING_RECIPE = TrainingRecipe(
    {"name": "chars", "seq_len": 64},
    dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_multiple_of=16),
    steps=1000, batch_size=32, lr=3e-3, tasks=("chars", "reverse-lm"))


# ---- parameters ----------------------------------------------------------------------------------

# the projections that write into the residual stream (a mixture of experts' routed and shared ones)
RESIDUAL_OUTPUTS = ("attn.w_o", "ffn.w_down", "ffn.experts.w_down", "ffn.shared.w_down")


def is_moe_layer(config, layer: int) -> bool:
    """Whether layer ``layer``'s feed-forward is ``config.moe``'s mixture of experts."""
    return config.moe is not None and config.moe.is_moe_layer(layer)


def feed_forward(config, layer: int) -> FeedForward:
    """Layer ``layer``'s feed-forward branch: the mixture of experts of ``config.moe`` on a layer it
    selects, the SwiGLU of width ``d_f`` on the others. The one place a layer's kind is decided:
    the parameters, the forward, the backward and the loss take it from here."""
    if is_moe_layer(config, layer):
        return mixture_of_experts(config.d_model, config.moe)
    return swiglu(config.d_model, config.d_f)


def decoder_param_shapes(config, attention: AttentionOps) -> dict:
    """``{name: shape}`` of every parameter of a decoder with the given attention, in order."""
    d, vocab = config.d_model, config.vocab_size
    shapes = {"tok_emb": (vocab, d)}
    for i in range(config.n_layers):
        prefix = f"layers.{i}."
        shapes.update(norm_shapes(config, prefix + "ln1"))
        for name, shape in attention.shapes(config).items():
            shapes[prefix + "attn." + name] = shape
        shapes.update(norm_shapes(config, prefix + "ln2"))
        for name, shape in feed_forward(config, i).shapes.items():
            shapes[prefix + "ffn." + name] = shape
    shapes.update(norm_shapes(config, "ln_f"))
    if not config.tie_embeddings:
        shapes["lm_head"] = (d, vocab)
    return shapes


def init_decoder_params(config, seed, dtype, attention: AttentionOps) -> dict:
    r"""Draw the parameters of a decoder with the given attention (see :func:`init_params`)."""
    return draw_params(decoder_param_shapes(config, attention), seed, dtype, config.init_std,
                       config.n_layers, RESIDUAL_OUTPUTS)


def check_params(params, config, attention: AttentionOps) -> None:
    """Require exactly the expected keys, each a floating array of the expected shape, one dtype."""
    check_param_dict(params, decoder_param_shapes(config, attention))


def param_shapes(config: DecoderConfig) -> dict:
    """``{name: shape}`` of every M3 parameter (see the module docstring for the names)."""
    return decoder_param_shapes(config, ROPE_GQA)


def init_params(config: DecoderConfig, seed=0, dtype=np.float64) -> dict:
    r"""Initial parameters of the M3 decoder (a flat dict, see the module docstring).

    Every weight matrix and the embedding table are drawn from :math:`\mathcal N(0, \sigma^2)` with
    :math:`\sigma` = ``config.init_std`` (0.02, the GPT-2/Llama choice); the two projections that
    write into the residual stream (``attn.w_o``, ``ffn.w_down``) use :math:`\sigma/\sqrt{2L}`
    (N11), our documented choice so that the variance added by ``2L`` residual branches stays
    independent of depth (with ``moe``: each expert's and the shared experts' ``w_down`` too).
    RMSNorm gains start at 1, biases (``qkv_bias``, a router's selection bias) at 0.
    """
    check_config("llama", config)
    return init_decoder_params(config, seed, dtype, ROPE_GQA)


# ---- blocks: the norms, the residual sublayer, the FFN, a layer ----------------------------------


def norm_shapes(config, name: str) -> dict:
    """``{name.gamma: (d,)}`` of the RMSNorm ``name``."""
    return {name + ".gamma": (config.d_model,)}


def norm_forward(x, params: dict, name: str, config):
    """The RMSNorm ``name`` (``"ln1"``, ``"ln_f"``, ...) of ``params`` on the rows ``x``
    (:func:`refmath.models.blocks.norm_forward`), its gain as :func:`gain` applies it. Returns
    ``(y, cache)``."""
    return blocks.norm_forward(x, "rmsnorm", gain(config, params[name + ".gamma"]), None,
                               config.norm_eps)


def layer_norm(params: dict, name: str, config) -> Callable:
    """The layer norm ``name`` of ``params`` as a function of the rows: ``x -> (y, cache)``."""
    return lambda x: norm_forward(x, params, name, config)


class LayerCache(NamedTuple):
    attn: SublayerCache  # its branch cache is the attention's cache
    ffn: SublayerCache  # its branch cache is the feed-forward's cache
    feed_forward: FeedForward  # which feed-forward ran, so that backward needs only the cache


def block_forward(x, params: dict, config, attn_branch: Callable, ffn_branch: Callable,
                  drops=(None, None)):
    r"""The residual block around a layer's attention and FFN branches: Pre-norm sublayers one
    after the other (N2, N4). ``params`` are the layer's (without ``layers.{i}.``); each branch
    maps rows to ``(rows, cache)``. Returns ``(x'', attn, ffn)``, their :class:`SublayerCache`\ s.
    """
    x, attn = sublayer_forward(x, layer_norm(params, "ln1", config), attn_branch, drops[0])
    x, ffn = sublayer_forward(x, layer_norm(params, "ln2", config), ffn_branch, drops[1])
    return x, attn, ffn


def layer_forward(x, params: dict, layer: int, config, attention: AttentionOps,
                  drops=(None, None)):
    r"""Decoder layer ``layer``: :math:`x' = x + \operatorname{Attn}(\operatorname{RMSNorm}(x))`,
    then :math:`x'' = x' + \operatorname{FFN}(\operatorname{RMSNorm}(x'))` with the SwiGLU or, on
    a layer ``config.moe`` selects, the mixture of experts as FFN (:func:`block_forward`).

    ``params`` are this layer's parameters without the ``layers.{i}.`` prefix; ``drops`` the two
    residual dropout multipliers. Returns ``(x'', cache)``.
    """
    config = layer_config(config, layer)
    attn_params, ffn_params = sub_params(params, "attn"), sub_params(params, "ffn")
    ffn_ops = feed_forward(config, layer)
    x, attn, ffn = block_forward(
        x, params, config, lambda h: attention.forward(h, attn_params, config),
        lambda h: ffn_ops.forward(h, ffn_params), drops)
    return x, LayerCache(attn, ffn, ffn_ops)


def layer_backward(dout, cache: LayerCache, attention: AttentionOps):
    """Gradients of :func:`layer_forward`: ``(dx, grads)`` with names relative to ``layers.{i}.``.

    A mixture of experts' backward also carries the gradient of its auxiliary losses, which
    :func:`lm_forward` added to the loss."""
    dx, norm2, ffn_grads = sublayer_backward(dout, cache.ffn, cache.feed_forward.backward)
    dx, norm1, attn_grads = sublayer_backward(dx, cache.attn, attention.backward)
    grads = {**prefixed("ln1", norm1), **prefixed("attn", attn_grads), **prefixed("ln2", norm2),
             **prefixed("ffn", ffn_grads)}
    return dx, grads


# ---- the whole network ---------------------------------------------------------------------------


class DecoderCache(NamedTuple):
    attention: AttentionOps  # which attention ran, so that backward needs only the cache
    emb: EmbeddingCache
    layers: tuple  # one LayerCache per layer
    norm_f: object  # the final RMSNorm's cache
    head: LinearCache  # its weight is lm_head, or tok_emb^T when tied
    tied: bool
    loss: CrossEntropyCache | None  # None when the cache came from a logits-only pass


def decoder_forward(params, tokens, config, attention: AttentionOps, train=False, rng=None):
    r"""Logits of a decoder of this family for checked ``tokens`` ``(B, T)``: ``(z, cache)``.

    .. math::
        x^{(0)} = E[a],\qquad x^{(\ell)} = \operatorname{Layer}_\ell(x^{(\ell-1)}),\qquad
        z = \operatorname{RMSNorm}(x^{(L)})\, W_{\text{out}}

    with :math:`W_{\text{out}}` = ``lm_head`` or :math:`E^\top` when tied. ``z`` is ``(B, T, V)``.
    Residual dropout masks are drawn from ``rng`` only when ``train`` and ``config.dropout > 0``.
    """
    table = params["tok_emb"]
    drops = layer_dropout_masks(rng, tokens.shape + (config.d_model,), config.dropout, table.dtype,
                                config.n_layers, train)
    x, emb = embedding_forward(tokens, table)
    layers = []
    for i in range(config.n_layers):
        x, layer = layer_forward(x, sub_params(params, f"layers.{i}"), i, config, attention,
                                 drops[i])
        layers.append(layer)
    x, norm_f = norm_forward(x, params, "ln_f", config)
    w_out = table.T if config.tie_embeddings else params["lm_head"]
    z, head = linear_forward(x, w_out)
    return z, DecoderCache(attention, emb, tuple(layers), norm_f, head, config.tie_embeddings, None)


def decoder_backward(dz, cache: DecoderCache) -> dict:
    """Gradients of :func:`decoder_forward` given ``dz = dloss/dlogits``: a dict keyed like params.

    With tied embeddings the table gets both its lookup gradient and the head's (transposed).
    """
    dx, dw_out, _ = linear_backward(dz, cache.head)
    dx, norm_grads = norm_backward(dx, cache.norm_f)
    grads = prefixed("ln_f", norm_grads)
    for i in reversed(range(len(cache.layers))):
        dx, layer_grads = layer_backward(dx, cache.layers[i], cache.attention)
        grads.update(prefixed(f"layers.{i}", layer_grads))
    dtable = embedding_backward(dx, cache.emb)
    if cache.tied:
        grads["tok_emb"] = dtable + dw_out.T
    else:
        grads["tok_emb"] = dtable
        grads["lm_head"] = dw_out
    return grads


def lm_forward(params, batch, config, attention: AttentionOps, train=False, rng=None):
    """Mean cross-entropy of the next-token predictions (L2, L5), plus the auxiliary losses of
    the mixture-of-experts layers (E5, weighted by ``config.moe``'s coefficients; 0 without):
    ``(loss, cache)``."""
    check_params(params, config, attention)
    tokens, targets, loss_mask = check_lm_batch(batch, config)
    z, cache = decoder_forward(params, tokens, config, attention, train, rng)
    loss, cache = next_token_loss(z, cache, targets, loss_mask)
    if config.moe is not None:  # (adding the dense layers' 0 would change nothing but the dtype)
        loss = (loss + moe_aux_loss(cache)).astype(loss.dtype)
    return loss, cache


def moe_aux_loss(cache: DecoderCache) -> float:
    """The auxiliary losses of a forward pass's layers, summed (E5): each feed-forward's own, 0
    for a dense one."""
    return sum(layer.feed_forward.aux_loss(layer.ffn.branch) for layer in cache.layers)


def expert_loads(cache: DecoderCache) -> dict:
    """``{layer: tokens routed to each expert}`` of a forward pass's mixture-of-experts layers:
    what a training log plots, and what DeepSeek-V3's bias balancing reads (E6)."""
    return {i: layer.ffn.branch.load for i, layer in enumerate(cache.layers)
            if isinstance(layer.ffn.branch, moe_ops.MoECache)}


def layer_states(cache: DecoderCache) -> list:
    """Per layer, the tensors an inference cache keeps, as the attention defines them."""
    return [cache.attention.state(layer.attn.branch) for layer in cache.layers]


# ---- the M3 model: the contract's functions --------------------------------------------------------


def forward(params, batch, config: DecoderConfig, train: bool = False, rng=None):
    r"""Loss of the M3 decoder on a batch: ``(loss, cache)`` (catalogue M3, L2, L5).

    ``batch``: ``tokens`` int ``(B, T)`` with ``T <= max_seq_len``, ``targets`` int ``(B, T)``
    (``targets[:, t]`` is the token after ``tokens[:, t]``; :data:`IGNORE_INDEX` = -100 is not
    counted) and optionally ``loss_mask`` ``(B, T)`` of 0/1 (L5: 0 on prompt tokens). Position
    ``t`` sees tokens ``0..t`` only (the causal mask), so one pass scores every prefix (L6):

    .. math::
        \ell = -\frac1n \sum_{(b,t)\ \text{counted}} \log p(\text{targets}_{b,t} \mid
               \text{tokens}_{b,0..t})

    ``loss`` is a 0-d array of the parameters' dtype. With ``train=True`` and ``config.dropout > 0``
    the residual dropout masks are drawn from ``rng`` (a ``numpy.random.Generator``) and kept in the
    cache, so :func:`backward` is exact for them.
    """
    check_config("llama", config)
    return lm_forward(params, batch, config, ROPE_GQA, train, rng)


def backward(cache: DecoderCache) -> dict:
    """Gradients of the loss of :func:`forward` with respect to every parameter (same keys).

    Works for any decoder of this family (M4 too): the cache records which attention ran.
    """
    return next_token_loss_backward(cache, decoder_backward)


def decoder_logits(params, tokens, config, attention: AttentionOps) -> np.ndarray:
    """Next-token logits ``(B, T, V)`` of a decoder of this family with the given attention, for
    int ``tokens`` ``(B, T)``, without dropout or loss (parameters and tokens checked)."""
    check_params(params, config, attention)
    tokens = check_tokens("tokens", tokens, config)
    return decoder_forward(params, tokens, config, attention)[0]


def logits(params, tokens, config: DecoderConfig) -> np.ndarray:
    """Next-token logits ``(B, T, V)`` for int ``tokens`` ``(B, T)``, without dropout or loss."""
    check_config("llama", config)
    return decoder_logits(params, tokens, config, ROPE_GQA)


def layer_kv(cache: DecoderCache) -> list:
    """Per layer, ``(k, v)`` each ``(B, g, T, d_h)``: rotated keys and (never rotated) values.

    These are what a KV cache stores (K2, K3); causality makes row ``t`` depend on tokens ``0..t``
    only (K1).
    """
    return layer_states(cache)


# ---- inference with a KV cache: this family's side of refmath.inference.kv_cache (K2, K3) ----------


def cache_spec(config: DecoderConfig, batch: int, max_len: int) -> CacheSpec:
    """Keys and values of ``g`` heads per layer: ``(L, B, g, max_len, d_h)`` each, of which a
    sliding layer keeps only its window's rows (its ``sliding_window`` of :func:`layer_config`)."""
    windows = tuple(layer_config(config, i).sliding_window for i in range(config.n_layers))
    return rope_attention.cache_spec(config, batch, max_len,
                                     windows if any(w is not None for w in windows) else None)


def head(params, x, config, *, matmul=matmul_rows_many) -> np.ndarray:
    """Final norm and output projection of the new rows: logits ``(B, n, V)``, the projection
    computed by ``matmul`` (:mod:`refmath.models.contract`)."""
    return network.head(params, x, layer_norm(params, "ln_f", config), config.tie_embeddings,
                        matmul=matmul)


def family_cached_layer(x, params, layer: int, config, attention: AttentionOps, slot, offset: int,
                        *, matmul=matmul_rows_many, **options) -> np.ndarray:
    """Layer ``layer`` on the new rows ``x`` ``(B, n, d)`` at positions ``offset..``: the residual
    block of :func:`layer_forward`, with the attention's cached step (``attention.cached``)
    reading and extending the layer's cache through ``slot``. ``options`` go to that step;
    ``matmul`` computes every product of the layer (:mod:`refmath.models.contract`)."""
    config = layer_config(config, layer)
    p = sub_params(params, f"layers.{layer}")
    w, ffn = sub_params(p, "attn"), sub_params(p, "ffn")

    def attn_branch(u):
        return attention.cached(u, w, config, slot, offset, matmul=matmul, **options), None

    def ffn_branch(u):
        return feed_forward(config, layer).forward(u, ffn, matmul=matmul)

    return block_forward(x, p, config, attn_branch, ffn_branch)[0]


def cached_layer(x, params, layer: int, config: DecoderConfig, slot, offset: int, *,
                 matmul=matmul_rows_many) -> np.ndarray:
    """One M3 layer at inference (see :func:`family_cached_layer`)."""
    return family_cached_layer(x, params, layer, config, ROPE_GQA, slot, offset, matmul=matmul)



# What the compiled decode layer (refmath.kernels.decode_layers, with this file's embed, head and
# rope_options around it) computes, field by field: any value of a field marked ANY, the listed
# values of the others. Anything else, and any field added to DecoderConfig without an entry here
# (refmath.models.contract checks that at import), keeps the NumPy step.
COMPILED_FIELDS = {
    # sizes, handed to the kernel as its shape (d_f from d_ff or ffn_multiple_of)
    "vocab_size": ANY, "max_seq_len": ANY, "d_model": ANY, "n_layers": ANY, "n_heads": ANY,
    "n_kv_heads": ANY, "head_dim": ANY, "d_ff": ANY, "ffn_multiple_of": ANY,
    # the RMSNorms: eps
    "norm_eps": ANY,
    # RoPE: the rotation at each position comes from rope_options (a rope scaling included; a
    # length-dependent one is refused at a step where it changes, see cache_stale)
    "rope_base": ANY, "rope_layout": ANY, "rope_scaling": ANY,
    # attention: biases
    "qkv_bias": ANY,
    # outside the layers: embed and head (tied table) run in NumPy
    "tie_embeddings": ANY,
    # training only: no decode step reads them
    "dropout": ANY, "init_std": ANY, "attention_backend": ANY,
    # not computed: every layer attends to every position with one dense FFN, no QK-norm
    "moe": (None,), "qk_norm": (None,), "sliding_window": (None,), "window_layers": (None,),
}


def compiled_layer_spec(params, config: DecoderConfig):
    """What :mod:`refmath.inference.compiled_step` runs of this model's layers in one compiled
    call (:func:`refmath.kernels.decode_layers`): :func:`llama_layers_spec` with this model's
    allow-list :data:`COMPILED_FIELDS`, or None."""
    if type(config) is not DecoderConfig:
        return None
    return llama_layers_spec(params, config, COMPILED_FIELDS)


def llama_layers_spec(params, config, fields: dict):
    """Llama's layers as the compiled decode layer runs them, for any model whose layers are
    these (this one, :mod:`refmath.models.phi3`): ``(shape, layers)``, the sizes and options, and
    each layer's arrays by the kernel's names. None unless every field of ``config`` has a value
    the allow-list ``fields`` lists (pre-norm sequential layers: RMSNorm, SwiGLU, optional
    query/key/value biases, RoPE with or without a rope scaling). The
    gains are as :func:`gain` applies them and the score scale as :func:`attention_options` gives
    it; RoPE's rotation (with a rope scaling) is the caller's, at each position."""
    if not allowed(config, fields):
        return None
    layers = []
    for i in range(config.n_layers):
        p = sub_params(params, f"layers.{i}")
        layer = {"norm1_gain": gain(config, p["ln1.gamma"]),
                 "norm2_gain": gain(config, p["ln2.gamma"])}
        names = ("w_q", "w_k", "w_v", "w_o") + (("b_q", "b_k", "b_v") if config.qkv_bias else ())
        layer.update({name: p[f"attn.{name}"] for name in names})
        layer.update({name: p[f"ffn.{name}"] for name in ("w_gate", "w_up", "w_down")})
        layers.append(layer)
    shape = dict(d_model=config.d_model, heads=config.n_heads, kv_heads=config.kv_heads,
                 head_dim=config.d_h, d_ff=config.d_f,
                 norm="rmsnorm", eps=config.norm_eps, ffn="swiglu", rope=config.rope_layout,
                 scale=config.score_scale)
    return shape, layers

# ---- sizes: what refmath.sizing counts of this model ---------------------------------------------

def sizing_fields(config: DecoderConfig) -> dict:
    """The fields of a :class:`refmath.sizing.ModelConfig` that describe this model (without its
    name and source): what the parameter, memory and FLOP calculators need to know of it."""
    return dict(n_layers=config.n_layers, d_model=config.d_model, n_heads=config.n_heads,
                kv_heads=config.kv_heads, head_dim=config.d_h, d_ff=config.d_f,
                vocab_size=config.vocab_size, qkv_bias=config.qkv_bias,
                tie_embeddings=config.tie_embeddings,
                sliding_window=config.sliding_window, window_layers=config.window_layers,
                qk_norm=config.qk_norm, moe=config.moe, norm="rmsnorm", ffn="swiglu",
                norms_per_layer=2)


# ---- gradient-check cases ------------------------------------------------------------------------

def rope_attention_inputs(config, b=2, t=5):
    """``make(rng)`` of an OpCase of the RoPE attention sublayer at ``config``: rows ``x`` ``(b, t,
    d)`` and its weights drawn at ``1/sqrt(d)``."""
    def make(rng):
        scale = 1.0 / math.sqrt(config.d_model)
        params = {name: scale * rng.standard_normal(shape)
                  for name, shape in rope_attention_shapes(config).items()}
        return {"x": rng.standard_normal((b, t, config.d_model)), "config": config, **params}
    return make


_TINY = dict(vocab_size=11, max_seq_len=8, d_model=16, n_layers=2, n_heads=4, ffn_multiple_of=8,
             init_std=0.25)  # init_std ~ 1/sqrt(d): gradients far above the stencil's noise
for _g in (4, 2, 1):
    register_case(OpCase("rope_attention", f"h=4 g={_g} causal (2, 5, 16)", ("N10", "A10", "A8"),
                         rope_attention_inputs(DecoderConfig(**{**_TINY, "n_kv_heads": _g})),
                         *layer_case_ops(rope_attention_forward, rope_attention_backward),
                         ("x", "w_q", "w_k", "w_v", "w_o"), group="attention execution",
                         max_coords=12))
register_case(OpCase("rope_attention", "h=4 g=2 causal (2, 5, 16), q/k/v biases", ("N10", "A10", "A8"),
                     rope_attention_inputs(DecoderConfig(**_TINY, n_kv_heads=2, qkv_bias=True)),
                     *layer_case_ops(rope_attention_forward, rope_attention_backward),
                     ("x", "w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v"),
                     group="attention execution", max_coords=12))
register_case(OpCase("rope_attention", "h=4 g=2 causal (2, 5, 16), sliding window 3",
                     ("N10", "A10", "A8", "A12"),
                     rope_attention_inputs(DecoderConfig(**_TINY, n_kv_heads=2, sliding_window=3)),
                     *layer_case_ops(rope_attention_forward, rope_attention_backward),
                     ("x", "w_q", "w_k", "w_v", "w_o"), group="attention execution",
                     max_coords=12))
register_case(ParamCase("decoder", "GQA h=4 g=2, 2 layers, dropout 0.25, tied, loss mask", ("M3",),
                        model_case_maker(forward, init_params,
                                         DecoderConfig(**_TINY, n_kv_heads=2, dropout=0.25,
                                                       tie_embeddings=True), train=True),
                        backward, max_coords=2, step=2.5e-4))
# QK-norm (N18) and the context-extension rules (N13-N17) as options of the same sublayer
_OPTIONS = {
    "QK-norm per head (Qwen3)": (dict(qk_norm="head"), ("N18", "N2")),
    "linear scaling s=2": (dict(rope_scaling=dict(rope_type="linear", factor=2.0)), ("N13",)),
    "dynamic NTK past 3 tokens": (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0,
                                                         original_max_seq_len=3)), ("N14",)),
    "llama3 scaling": (dict(rope_scaling=dict(rope_type="llama3", factor=8.0,
                                              original_max_seq_len=4)), ("N15",)),
    "YaRN with temperature, QK-norm": (dict(qk_norm="head", rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_seq_len=4, beta_fast=4.0, beta_slow=0.5)),
        ("N16", "N18")),
}
for _label, (_fields, _ids) in _OPTIONS.items():
    _config = DecoderConfig(**_TINY, n_kv_heads=2, **_fields)
    register_case(OpCase("rope_attention", f"h=4 g=2 causal (2, 5, 16), {_label}",
                         ("N10", "A10", "A8", *_ids), rope_attention_inputs(_config),
                         *layer_case_ops(rope_attention_forward, rope_attention_backward),
                         ("x", *rope_attention_shapes(_config)), group="attention execution",
                         max_coords=12))
# Mixtures of experts (E1-E5) as the decoder's feed-forward, their auxiliary losses in the loss
_EXPERT_CASES = {
    "Mixtral: 4 experts, top 2 renormalised, balance and z-losses": dict(moe=dict(
        n_experts=4, top_k=2, d_expert=8, norm_topk=True, balance_coef=0.05, z_coef=0.01)),
    "Qwen2-MoE: gated shared expert, dense first layer, q/k/v biases": dict(qkv_bias=True, moe=dict(
        n_experts=4, top_k=2, d_expert=8, d_shared=12, shared_gate=True, first_dense=1,
        balance_coef=0.05)),
}
for _label, _fields in _EXPERT_CASES.items():
    register_case(ParamCase("decoder", f"GQA h=4 g=2, 2 layers, {_label}", ("M3", "E4", "E5"),
                            moe_case_maker(forward, init_params,
                                           DecoderConfig(**_TINY, n_kv_heads=2, **_fields)),
                            backward, max_coords=2, step=2.5e-4))
register_case(ParamCase("decoder", "GQA h=4 g=2, QK-norm, YaRN, 2 layers", ("M3", "N16", "N18"),
                        model_case_maker(forward, init_params,
                                         DecoderConfig(**_TINY, n_kv_heads=2, qk_norm="head",
                                                       rope_scaling=dict(
                                                           rope_type="yarn", factor=4.0,
                                                           original_max_seq_len=4)),
                                         train=False),
                        backward, max_coords=2, step=2.5e-4))
