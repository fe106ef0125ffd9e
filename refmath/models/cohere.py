r"""Cohere's Command-R (``cohere``): Llama's decoder with these differences.

- **A parallel block on one norm** (N21): attention and the SwiGLU FFN read the same normalised
  input and add to the residual together,

  .. math::
      h = \operatorname{LN}(x),\qquad x' = x + \operatorname{Attn}(h) + \operatorname{SwiGLU}(h)

- **LayerNorm without a bias** (N1 with :math:`\beta = 0`) for every norm, RMSNorm nowhere.
- **Interleaved RoPE** (N10): coordinates :math:`(2i, 2i+1)` rotate together.
- **Tied embeddings** and a **logit scale**: :math:`z = s\, \operatorname{LN}(x^{(L)})\, E^\top`
  with :math:`s` = ``logit_scale`` (1/16 in Command-R).
- **Optional QK-norm** (N18) as a LayerNorm over each head's :math:`d_h` coordinates with its own
  gain per head and coordinate, ``(h, d_h)`` for the queries and ``(g, d_h)`` for the keys, before
  RoPE.

Everything else is Llama's: grouped-query attention (A10) with the causal mask, no biases, no
dropout. The layer is written as the list of block calls of :mod:`refmath.models.blocks` below,
its backward as their mirror.

Parameters (flat dict, row vectors ``x @ W``)::

    tok_emb                          (V, d)
    layers.{i}.ln1.gamma             (d,)         the block's one LayerNorm (no bias)
    layers.{i}.attn.w_q, w_k, w_v    (d, h d_h), (d, g d_h), (d, g d_h)
    layers.{i}.attn.w_o              (h d_h, d)
    layers.{i}.attn.q_norm.gamma     (h, d_h)     only with qk_norm
    layers.{i}.attn.k_norm.gamma     (g, d_h)     only with qk_norm
    layers.{i}.ffn.w_gate, w_up      (d, d_f)
    layers.{i}.ffn.w_down            (d_f, d)
    ln_f.gamma                       (d,)
    lm_head                          (d, V)       only when tie_embeddings is False
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from refmath._validate import check_choice, check_field, check_flag, check_int, check_real
from refmath.attention import (ATTENTION_BACKENDS, CausalAttentionCache, causal_attention_backward,
                               causal_attention_forward, causal_attention_kv, merge_heads,
                               split_heads)
from refmath.embedding import EmbeddingCache, embedding_backward, embedding_forward
from refmath.ffn import LinearCache, linear_backward, linear_forward, matmul_rows_many
from refmath.losses import CrossEntropyCache
from refmath.models import check_config
from refmath.models import blocks
from refmath.models.batch import network_logits, network_loss, next_token_loss_backward
from refmath.models import network
from refmath.models.network import embed  # Llama's: the table's rows, positions by RoPE only
from refmath.models.network import layers_backward, layers_forward, table_gradients
from refmath.models.cases import model_case_maker
from refmath.models.common import EvenHeads, TrainingRecipe, prefixed, sub_params
from refmath.models.hf_layout import (ATTENTION_KEYS, GATED_FFN_KEYS, QK_NORM_KEYS, layer_key_rows,
                                      linear_out, refuse, refuse_common, require, rope_from_hf,
                                      take_head)
from refmath.models.params import init_llama_params
from refmath.models.rope_attention import cache_spec  # Llama's: g heads' keys and values a layer
from refmath.positions import RoPECache, rope_backward, rope_forward
from refmath.registry import ParamCase, register_case

__all__ = [
    "CohereConfig", "TRAINING_RECIPE", "param_shapes", "init_params", "head_norm_forward",
    "head_norm_backward", "rope_options", "cache_stale", "attention_forward", "attention_backward",
    "layer_forward", "layer_backward", "network_forward", "network_backward", "forward",
    "backward", "logits", "cache_spec", "embed", "cached_layer", "head", "COMPILED_FIELDS",
    "compiled_layer_spec", "sizing_fields", "HF_MODEL_TYPES", "key_table", "config_from_hf",
    "params_from_hf", "to_hf"
]

# ---- configuration -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CohereConfig(EvenHeads):
    """Sizes and options of Command-R. ``dataclasses.asdict`` round-trips through JSON."""

    vocab_size: int  # V, rows of the token table (tied to the head)
    max_seq_len: int  # the longest sequence accepted (RoPE has no table: a contract, not a size)
    d_model: int  # d, the residual stream's width
    n_layers: int  # L, parallel blocks
    n_heads: int  # h query heads, each d_h = d / h wide
    d_ff: int  # d_f, the SwiGLU's hidden width
    n_kv_heads: int | None = None  # g key/value heads (A10); None: h (multi-head attention)
    rope_base: float = 10000.0  # RoPE's base theta (N10)
    norm_eps: float = 1e-5  # the LayerNorms' epsilon
    logit_scale: float = 0.0625  # s: the logits are s times the head's output
    qk_norm: bool = False  # a per-head LayerNorm on queries and keys before RoPE (N18)
    tie_embeddings: bool = True  # the head is the token table transposed
    init_std: float = 0.02  # sigma of every weight at init (residual outputs: sigma / sqrt(2L))
    attention_backend: str = "numpy"  # training's causal attention: NumPy or the "cpu" kernel

    def __post_init__(self):
        for name in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
            check_field(self, name, check_int, 1)
        check_field(self, "n_kv_heads", check_int, 1, optional=True)
        for name in ("rope_base", "norm_eps", "logit_scale", "init_std"):
            check_field(self, name, check_real, 0.0, low_open=True)
        check_field(self, "qk_norm", check_flag)
        check_field(self, "tie_embeddings", check_flag)
        check_field(self, "attention_backend", check_choice, ATTENTION_BACKENDS)
        self.check_heads()


# The default of `python -m refmath train`: the size of the decoder's recipe.
TRAINING_RECIPE = TrainingRecipe(
    {"name": "chars", "seq_len": 64},
    dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=176),
    steps=1000, batch_size=32, lr=3e-3, tasks=("chars", "reverse-lm"))

_NORM = "layernorm_no_bias"


# ---- parameters ----------------------------------------------------------------------------------

def param_shapes(config: CohereConfig) -> dict:
    """``{name: shape}`` of every parameter (see the module docstring)."""
    check_config("cohere", config)
    d, h, g, d_h, f = config.d_model, config.n_heads, config.kv_heads, config.d_h, config.d_ff
    layer = {"ln1.gamma": (d,), "attn.w_q": (d, h * d_h), "attn.w_k": (d, g * d_h),
             "attn.w_v": (d, g * d_h), "attn.w_o": (h * d_h, d)}
    if config.qk_norm:
        layer.update({"attn.q_norm.gamma": (h, d_h), "attn.k_norm.gamma": (g, d_h)})
    layer.update({"ffn.w_gate": (d, f), "ffn.w_up": (d, f), "ffn.w_down": (f, d)})
    return network.param_shapes(config, lambda i: layer, {"gamma": (d,)})


def init_params(config: CohereConfig, seed=0, dtype=np.float64) -> dict:
    """Gains at 1, weights by :func:`refmath.models.params.init_llama_params`."""
    return init_llama_params(param_shapes(config), config, seed, dtype)


# ---- attention: grouped heads, per-head LayerNorm on queries and keys, interleaved RoPE -----------

class HeadNormCache(NamedTuple):
    norm: object  # the gain-free LayerNorm's cache (refmath.models.blocks.norm_forward)
    normed: np.ndarray  # its output x_hat, (B, heads, n, d_h)
    gamma: np.ndarray  # (heads, d_h)


def head_norm_forward(x, gamma, eps: float):
    r"""LayerNorm without bias over each head's :math:`d_h` coordinates of ``x`` ``(B, heads, n,
    d_h)``, with a gain per head and coordinate, ``gamma`` ``(heads, d_h)``:
    :math:`y_{b,r,t} = \gamma_r \odot \hat x_{b,r,t}`. Returns ``(y, cache)``."""
    normed, norm = blocks.norm_forward(x, _NORM, np.ones(x.shape[-1], x.dtype), None, eps)
    return gamma[:, None, :] * normed, HeadNormCache(norm, normed, gamma)


def head_norm_backward(dy, cache: HeadNormCache):
    r"""Gradients of :func:`head_norm_forward`: ``(dx, dgamma)``; :math:`d\gamma_r = \sum_{b,t}
    dy_{b,r,t} \odot \hat x_{b,r,t}`, and :math:`dx` is the LayerNorm's backward of
    :math:`\gamma_r \odot dy`."""
    dgamma = (dy * cache.normed).sum(axis=(0, 2))
    dx, _ = blocks.norm_backward(cache.gamma[:, None, :] * dy, cache.norm)
    return dx, dgamma


def rope_options(config: CohereConfig, offset: int, length: int) -> dict:
    """RoPE's arguments at positions ``offset..`` (the interleaved layout; ``length`` changes
    nothing: there is no rope scaling)."""
    return dict(offset=offset, base=config.rope_base, layout="interleaved")


def cache_stale(config: CohereConfig, length: int, n: int) -> bool:
    """Never: the rotation does not depend on the sequence length."""
    return False


def queries_keys_values(x, params: dict, config: CohereConfig, offset: int = 0,
                        matmul=matmul_rows_many):
    """The rotated queries ``(B, h, n, d_h)``, keys and values ``(B, g, n, d_h)`` of the rows
    ``x`` at positions ``offset..``, and the caches of their steps in order; ``matmul`` computes
    the projections (:func:`refmath.ffn.linear_forward`)."""
    q, q_proj = linear_forward(x, params["w_q"], matmul=matmul)
    k, k_proj = linear_forward(x, params["w_k"], matmul=matmul)
    v, v_proj = linear_forward(x, params["w_v"], matmul=matmul)
    q, k, v = split_heads(q, config.n_heads), split_heads(k, config.kv_heads), split_heads(
        v, config.kv_heads)
    q_norm = k_norm = None
    if config.qk_norm:
        q, q_norm = head_norm_forward(q, params["q_norm.gamma"], config.norm_eps)
        k, k_norm = head_norm_forward(k, params["k_norm.gamma"], config.norm_eps)
    rope = rope_options(config, offset, offset + x.shape[-2])
    q, q_rope = rope_forward(q, **rope)
    k, k_rope = rope_forward(k, **rope)
    return q, k, v, (q_proj, k_proj, v_proj, q_norm, k_norm, q_rope, k_rope)


class AttentionCache(NamedTuple):
    q_proj: LinearCache
    k_proj: LinearCache
    v_proj: LinearCache
    q_norm: HeadNormCache | None  # None without qk_norm
    k_norm: HeadNormCache | None
    q_rope: RoPECache
    k_rope: RoPECache
    attn: CausalAttentionCache
    out: LinearCache
    n_heads: int


def attention_forward(x, params: dict, config: CohereConfig):
    """Causal grouped-query attention of the normalised rows ``x`` ``(B, T, d)``: ``(y, cache)``."""
    q, k, v, caches = queries_keys_values(x, params, config)
    o, attn = causal_attention_forward(q, k, v, config.attention_backend)
    y, out = linear_forward(merge_heads(o), params["w_o"])
    return y, AttentionCache(*caches, attn, out, config.n_heads)


def attention_backward(dy, cache: AttentionCache):
    """Gradients of :func:`attention_forward`: ``(dx, {"w_q", ..., "q_norm.gamma", ...})``, the
    forward's steps in reverse; the three projections read ``x``, so their gradients add up."""
    d_merged, dw_o, _ = linear_backward(dy, cache.out)
    dq, dk, dv = causal_attention_backward(split_heads(d_merged, cache.n_heads), cache.attn)
    dq, dk = rope_backward(dq, cache.q_rope), rope_backward(dk, cache.k_rope)
    grads = {}
    if cache.q_norm is not None:
        dq, grads["q_norm.gamma"] = head_norm_backward(dq, cache.q_norm)
        dk, grads["k_norm.gamma"] = head_norm_backward(dk, cache.k_norm)
    dx_q, grads["w_q"], _ = linear_backward(merge_heads(dq), cache.q_proj)
    dx_k, grads["w_k"], _ = linear_backward(merge_heads(dk), cache.k_proj)
    dx_v, grads["w_v"], _ = linear_backward(merge_heads(dv), cache.v_proj)
    grads["w_o"] = dw_o
    return dx_q + dx_k + dx_v, grads


# ---- the layer: one norm, attention and FFN side by side -----------------------------------------

def _norm(params: dict, name: str, config: CohereConfig):
    """The bias-free LayerNorm ``name`` as a function of the rows."""
    return lambda x: blocks.norm_forward(x, _NORM, params[name + ".gamma"], None, config.norm_eps)


def layer_forward(x, params: dict, config: CohereConfig):
    r"""One block, :math:`x + \operatorname{Attn}(\operatorname{LN}(x)) +
    \operatorname{SwiGLU}(\operatorname{LN}(x))`, on this layer's ``params`` (without
    ``layers.{i}.``). Returns ``(x', attn, ffn)``, the two branches' caches."""
    attn, ffn = sub_params(params, "attn"), sub_params(params, "ffn")
    return blocks.parallel_forward(
        x, (_norm(params, "ln1", config), None),
        (lambda h: attention_forward(h, attn, config), lambda h: blocks.ffn_forward(h, ffn)))


def layer_backward(dout, attn: blocks.SublayerCache, ffn: blocks.SublayerCache):
    """Gradients of :func:`layer_forward`, the mirror: both branches back to ``h``, their sum
    through the one norm, plus the identity path. Returns ``(dx, grads)``."""
    dx, norm_grads, _, attn_grads, ffn_grads = blocks.parallel_backward(
        dout, attn, ffn, (attention_backward, blocks.ffn_backward), shared=True)
    return dx, {**prefixed("ln1", norm_grads), **prefixed("attn", attn_grads),
                **prefixed("ffn", ffn_grads)}


# ---- the network ---------------------------------------------------------------------------------

class CohereCache(NamedTuple):
    emb: EmbeddingCache
    layers: tuple  # (attn, ffn) per layer
    norm_f: object
    head: LinearCache  # its weight is tok_emb^T, or lm_head
    logit_scale: float
    tied: bool
    loss: CrossEntropyCache | None = None


def network_forward(params, tokens, config: CohereConfig):
    r"""Logits ``(B, T, V)`` of checked ``tokens``: :math:`z = s\,\operatorname{LN}(x^{(L)})\,
    W_{\text{out}}` after the embedding and the ``L`` blocks. Returns ``(z, cache)``."""
    x, emb = embedding_forward(tokens, params["tok_emb"])
    x, layers = layers_forward(x, params, config.n_layers,
                               lambda i, x, p: _layer_pair(layer_forward(x, p, config)))
    x, norm_f = _norm(params, "ln_f", config)(x)
    w_out = params["tok_emb"].T if config.tie_embeddings else params["lm_head"]
    z, head_cache = linear_forward(x, w_out)
    return z * config.logit_scale, CohereCache(emb, layers, norm_f, head_cache,
                                               config.logit_scale, config.tie_embeddings)


def _layer_pair(out):
    """``(x, (attn, ffn))`` from :func:`layer_forward`'s ``(x, attn, ffn)``."""
    x, attn, ffn = out
    return x, (attn, ffn)


def network_backward(dz, cache: CohereCache) -> dict:
    """Gradients of :func:`network_forward` given ``dz``; the tied table gets both its lookup's
    and the head's gradient."""
    dx, dw_out, _ = linear_backward(dz * cache.logit_scale, cache.head)
    dx, norm_grads = blocks.norm_backward(dx, cache.norm_f)
    dx, grads = layers_backward(dx, cache.layers, lambda dx, pair: layer_backward(dx, *pair))
    return {**prefixed("ln_f", norm_grads), **grads,
            **table_gradients(embedding_backward(dx, cache.emb), dw_out, cache.tied)}


def forward(params, batch, config: CohereConfig, train: bool = False, rng=None):
    """Mean next-token cross-entropy of a batch (L2, L5): ``(loss, cache)``; the batch as
    :func:`refmath.models.decoder.forward` takes it. Command-R has no dropout, so ``train`` and
    ``rng`` change nothing."""
    return network_loss(params, batch, config, param_shapes(config),
                        lambda tokens: network_forward(params, tokens, config))


def backward(cache: CohereCache) -> dict:
    """Gradients of the loss of :func:`forward` with respect to every parameter (same keys)."""
    return next_token_loss_backward(cache, network_backward)


def logits(params, tokens, config: CohereConfig) -> np.ndarray:
    """Next-token logits ``(B, T, V)`` for int ``tokens`` ``(B, T)``."""
    return network_logits(params, tokens, config, param_shapes(config),
                          lambda tokens: network_forward(params, tokens, config))


def layer_kv(cache: CohereCache) -> list:
    """Per layer, the rotated keys and the values ``(B, g, T, d_h)`` a KV cache keeps."""
    return [causal_attention_kv(attn.branch.attn) for attn, _ in cache.layers]


# ---- inference with a KV cache (K2, K3) -----------------------------------------------------------

def cached_layer(x, params, layer: int, config: CohereConfig, slot, offset: int, *,
                 matmul=matmul_rows_many) -> np.ndarray:
    """Block ``layer`` on the new rows ``x`` at positions ``offset..``, its attention appending
    the keys and values to the layer's cache and attending over every cached position."""
    p = sub_params(params, f"layers.{layer}")
    w, ffn = sub_params(p, "attn"), sub_params(p, "ffn")

    def attn(h):
        q, k, v, _ = queries_keys_values(h, w, config, offset, matmul=matmul)
        o = merge_heads(slot.attend(q, k, v, offset))
        return linear_forward(o, w["w_o"], matmul=matmul)[0], None

    return blocks.parallel_forward(x, (_norm(p, "ln1", config), None),
                                   (attn, lambda h: blocks.ffn_forward(h, ffn, matmul=matmul)))[0]


def head(params, x, config: CohereConfig, *, matmul=matmul_rows_many) -> np.ndarray:
    """Final norm, output projection and logit scale of the new rows: ``(B, n, V)``."""
    return network.head(params, x, _norm(params, "ln_f", config), config.tie_embeddings,
                        matmul=matmul) * config.logit_scale


COMPILED_FIELDS = None  # the compiled decode layer has no parallel block: the NumPy step runs


def compiled_layer_spec(params, config: CohereConfig) -> None:
    """None: the compiled decode layer computes sequential blocks only."""
    return None


def sizing_fields(config: CohereConfig) -> dict:
    """What :mod:`refmath.sizing` counts of this model (its QK-norm's (h + g) d_h gains count as
    a norm of the projections)."""
    return dict(n_layers=config.n_layers, d_model=config.d_model, n_heads=config.n_heads,
                kv_heads=config.kv_heads, head_dim=config.d_h, d_ff=config.d_ff,
                vocab_size=config.vocab_size, tie_embeddings=config.tie_embeddings,
                qk_norm="projection" if config.qk_norm else None, norm=_NORM, ffn="swiglu",
                norms_per_layer=1)


# ---- Hugging Face: one key table, read by params_from_hf and written by to_hf ---------------------

HF_MODEL_TYPES = ("cohere",)

# (Hugging Face's name under model.layers.{i}., refmath's under layers.{i}., stored transposed)
# Llama's rows (refmath.models.hf_layout) with the one norm of the parallel block, and QK-norm's
# per-head gains when qk_norm
LAYER_KEYS = ((("input_layernorm.weight", "ln1.gamma", False),) + ATTENTION_KEYS + QK_NORM_KEYS
              + GATED_FFN_KEYS)
END_KEYS = (("model.embed_tokens.weight", "tok_emb", False), ("model.norm.weight", "ln_f.gamma", False))


def key_table(config: CohereConfig) -> list:
    """``[(Hugging Face name, refmath name, transposed)]`` of every parameter but ``lm_head``."""
    shapes = param_shapes(config)
    return list(END_KEYS) + [row for row in layer_key_rows(config.n_layers, LAYER_KEYS)
                             if row[1] in shapes]


def config_from_hf(hf: dict) -> CohereConfig:
    """A :class:`CohereConfig` from a ``cohere`` ``config.json``; what refmath does not compute
    (a rope scaling, attention biases, another activation or head width) is refused."""
    refuse_common(hf)
    require(hf, "hidden_act", ("silu",), "silu", "Command-R's FFN is SwiGLU")
    require(hf, "attention_bias", (False,), False, "refmath's Command-R has no attention biases")
    base, scaling = rope_from_hf(hf)
    if scaling is not None:
        refuse(hf, "rope_parameters", hf.get("rope_parameters"), "no rope scaling here")
    d, h = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if hf.get("head_dim") not in (None, d // h):
        refuse(hf, "head_dim", hf["head_dim"], "Command-R's heads are d / h wide")
    if hf.get("logit_scale") is None:
        refuse(hf, "logit_scale", None, "Command-R scales its logits")
    return CohereConfig(vocab_size=int(hf["vocab_size"]), max_seq_len=int(hf["max_position_embeddings"]),
                        d_model=d, n_layers=int(hf["num_hidden_layers"]), n_heads=h,
                        n_kv_heads=int(hf.get("num_key_value_heads") or h),
                        d_ff=int(hf["intermediate_size"]), rope_base=float(base),
                        norm_eps=float(hf.get("layer_norm_eps", 1e-5)),
                        logit_scale=float(hf["logit_scale"]), qk_norm=bool(hf.get("use_qk_norm")),
                        tie_embeddings=bool(hf.get("tie_word_embeddings", True)))


def params_from_hf(hf: dict, config: CohereConfig, weights) -> dict:
    """Every parameter, read through :func:`key_table` (``lm_head``: the token table's copy when
    tied)."""
    shapes, params = param_shapes(config), {}
    for theirs, ours, transposed in key_table(config):
        shape = shapes[ours][::-1] if transposed else shapes[ours]
        params[ours] = weights.take(theirs, shape, transpose=transposed)
    take_head(weights, config.tie_embeddings, params, config.vocab_size, config.d_model)
    return params


def to_hf(config: CohereConfig, params: dict):
    """``(config.json fields, {name: tensor})`` of a ``CohereForCausalLM``, through the same
    :func:`key_table` the reader reads."""
    hf = {"model_type": "cohere", "architectures": ["CohereForCausalLM"],
          "vocab_size": config.vocab_size, "hidden_size": config.d_model,
          "intermediate_size": config.d_ff, "num_hidden_layers": config.n_layers,
          "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads,
          "max_position_embeddings": config.max_seq_len, "layer_norm_eps": config.norm_eps,
          "logit_scale": config.logit_scale, "use_qk_norm": config.qk_norm,
          "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu",
          "attention_bias": False, "rope_parameters": {"rope_type": "default",
                                                       "rope_theta": config.rope_base},
          "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    tensors = {theirs: linear_out(params[ours]) if transposed else params[ours]
               for theirs, ours, transposed in key_table(config)}
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = linear_out(params["lm_head"])
    return hf, tensors


# ---- gradient-check cases ------------------------------------------------------------------------

# init_std ~ 1.5/sqrt(d) and a logit scale of 2 make logits and gradients of order 1, so that the
# check's bound (the stencil's error over the typical gradient) stays well below 1e-8
_TINY = dict(vocab_size=11, max_seq_len=8, d_model=16, n_layers=2, n_heads=4, d_ff=24,
             logit_scale=2.0)
register_case(ParamCase("cohere", "GQA h=4 g=2, tied, logit scale", ("M5", "N21", "N1", "N7"),
                        model_case_maker(forward, init_params,
                                         CohereConfig(**_TINY, n_kv_heads=2, init_std=0.35),
                                         train=False),
                        backward, max_coords=3))
register_case(ParamCase("cohere", "per-head QK LayerNorm, untied", ("M5", "N21", "N18"),
                        model_case_maker(forward, init_params,
                                         CohereConfig(**_TINY, qk_norm=True, tie_embeddings=False,
                                                      init_std=0.5), train=False),
                        backward, max_coords=3))
