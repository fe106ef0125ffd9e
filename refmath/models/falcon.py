r"""Falcon (``falcon``), with PaLM's and GPT-J's parallel block: Llama's decoder with these
differences.

- **A parallel block** (N21): attention and the FFN read the block's input and add to the
  residual together, on one norm (Falcon-7B, PaLM, GPT-J) or two (Falcon-40B's ``ln_attn`` and
  ``ln_mlp``),

  .. math::
      x' = x + \operatorname{Attn}(N_1(x)) + \operatorname{FFN}(N_2(x)),\qquad N_2 = N_1
      \ \text{(one norm)}

  or, in Falcon's old sequential layout, Llama's two sublayers one after the other.
- **LayerNorm** (N1) with its bias :math:`\beta` for every norm (Falcon), or without one (PaLM);
  RMSNorm nowhere.
- **A plain two-layer FFN without biases** (N5, N6), :math:`\operatorname{GELU}(h W_1) W_2` with
  exact GELU (Falcon) or its tanh form (GPT-J), of width ``4d``; PaLM keeps Llama's SwiGLU (N7).

Everything else is Llama's: RoPE (N10) on grouped-query attention (A10) with the causal mask,
computed by Llama's own sublayer (:data:`refmath.models.rope_attention.ROPE_GQA`), no biases, an
output head tied to the token table or not. The layer is the list of block calls of
:mod:`refmath.models.blocks` in :func:`block_forward`, its backward the mirror in
:func:`layer_backward`.

Parameters (flat dict, row vectors ``x @ W``)::

    tok_emb                          (V, d)
    layers.{i}.ln1.gamma, ln1.beta   (d,), (d,)   the block's first norm (no beta without bias)
    layers.{i}.attn.w_q, w_k, w_v    (d, h d_h), (d, g d_h), (d, g d_h)
    layers.{i}.attn.w_o              (h d_h, d)
    layers.{i}.ln2.gamma, ln2.beta   (d,), (d,)   the FFN's own norm: absent with one norm
    layers.{i}.ffn.w_up, w_down      (d, d_f), (d_f, d)
    layers.{i}.ffn.w_gate            (d, d_f)     only with the SwiGLU (PaLM)
    ln_f.gamma, ln_f.beta            (d,), (d,)
    lm_head                          (d, V)       only when tie_embeddings is False
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from refmath._validate import check_choice, check_field, check_flag, check_int
from refmath.ffn import matmul_rows_many
from refmath.models import check_config
from refmath.models import blocks
from refmath.models import network
from refmath.models.cases import model_case_maker
from refmath.models.contract import ANY, allowed
from refmath.models.decoder_config import check_rope_fields, check_training_fields
from refmath.models.common import EvenHeads, TrainingRecipe, named_config, prefixed, sub_params
from refmath.models.hf_layout import (HFCheckpointError, interleaved_to_half, join_heads_columns,
                                      linear_out, refuse, refuse_common, rope_context,
                                      rope_from_hf, rope_to_hf, split_heads_columns, take_head)
from refmath.models.params import init_llama_params
from refmath.models.network import embed  # Llama's: the table's rows, positions by RoPE only
from refmath.models.rope_attention import (  # Llama's attention, its options and hooks
    PlainAttentionOptions, cache_spec, cache_stale, rope_options, rope_attention_backward,
    rope_attention_cached, rope_attention_forward, rope_attention_shapes, rope_attention_state)
from refmath.positions import RopeScaling
from refmath.registry import ParamCase, register_case

__all__ = [
    "FalconConfig", "NORMS", "FFNS", "PALM", "PRESETS", "preset", "TRAINING_RECIPE",
    "param_shapes", "init_params", "layer_norm", "ffn_forward", "LayerCache", "block_forward",
    "layer_forward", "layer_backward", "network_forward", "network_backward",
    "forward", "backward", "logits", "layer_kv", "rope_options", "cache_stale", "cache_spec",
    "embed", "cached_layer", "head", "COMPILED_FIELDS", "compiled_layer_spec", "sizing_fields",
    "HF_MODEL_TYPES", "key_table", "config_from_hf", "params_from_hf", "to_hf"
]

# ---- configuration -------------------------------------------------------------------------------

# the kinds of refmath.norms.NORM_KINDS and refmath.ffn.FFN_KINDS this family takes:
# LayerNorm with its bias (Falcon) or without (PaLM)
NORMS = ("layernorm", "layernorm_no_bias")
# the FFN: plain with exact GELU (Falcon) or tanh-GELU (GPT-J), or the SwiGLU (PaLM)
FFNS = ("gelu", "gelu_tanh", "swiglu")


@dataclass(frozen=True, kw_only=True)
class FalconConfig(EvenHeads, PlainAttentionOptions):
    """Sizes and options of Falcon and the parallel-block decoders. ``dataclasses.asdict``
    round-trips through JSON. The defaults are Llama's
    (:class:`refmath.models.decoder.DecoderConfig`) where both have the field."""

    vocab_size: int  # V, rows of the token table
    max_seq_len: int  # the longest sequence accepted (RoPE has no table: a contract, not a size)
    d_model: int  # d, the residual stream's width
    n_layers: int  # L, blocks
    n_heads: int  # h query heads, each d_h = d / h wide
    n_kv_heads: int | None = None  # g key/value heads (A10); None: h; 1: multi-query (Falcon-7B)
    d_ff: int | None = None  # d_f, the FFN's hidden width; None: 4d
    parallel_block: bool = True  # attention and FFN side by side (N21); False: one after the other
    parallel_norms: int = 1  # the parallel block's norms: 1 (shared) or 2 (ln_attn, ln_mlp)
    norm: str = "layernorm"  # one of NORMS, every norm of the blocks and the final one
    ffn: str = "gelu"  # one of FFNS
    norm_eps: float = 1e-6  # the LayerNorms' epsilon
    rope_base: float = 10000.0  # RoPE's base theta (N10)
    rope_layout: str = "interleaved"  # RoPE's pairs: (2i, 2i+1), or Hugging Face's "half"
    rope_scaling: RopeScaling | None = None  # a context-extension rule (N13-N17), or None
    tie_embeddings: bool = False  # the head is the token table transposed
    dropout: float = 0.0  # residual dropout on each branch's output, in training only
    init_std: float = 0.02  # sigma of every weight at init (residual outputs: sigma / sqrt(2L))
    attention_backend: str = "numpy"  # training's causal attention: NumPy or the "cpu" kernel

    def __post_init__(self):
        for name in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads"):
            check_field(self, name, check_int, 1)
        for name in ("n_kv_heads", "d_ff"):
            check_field(self, name, check_int, 1, optional=True)
        check_field(self, "parallel_block", check_flag)
        check_field(self, "parallel_norms", check_choice, (1, 2))
        check_field(self, "norm", check_choice, NORMS)
        check_field(self, "ffn", check_choice, FFNS)
        check_rope_fields(self)
        check_training_fields(self)
        if self.parallel_norms == 2 and not self.parallel_block:
            raise ValueError("FalconConfig.parallel_norms = 2 gives the FFN of a parallel block "
                             "its own norm; parallel_block is False")
        self.check_heads()

    @property
    def d_f(self) -> int:
        """The FFN's hidden width: ``d_ff``, or ``4d``."""
        return 4 * self.d_model if self.d_ff is None else self.d_ff


# PaLM's block (Chowdhery et al. 2022, Sec. 2): attention and a SwiGLU FFN in parallel on one
# LayerNorm without bias, multi-query attention, no biases anywhere, the output projection shared
# with the input embedding. PaLM's weights were never released, so no checkpoint loads into it;
# refmath.sizing's "palm-540b" counts the published model.
PALM = dict(n_kv_heads=1, norm="layernorm_no_bias", ffn="swiglu", tie_embeddings=True)

PRESETS = {
    # PaLM's recipe at the size of the decoder's "tiny": its SwiGLU is 4d wide (PaLM-540B's
    # 73728 = 4 x 18432)
    "palm-tiny": dict(vocab_size=256, max_seq_len=128, d_model=64, n_layers=2, n_heads=4,
                      d_ff=256, norm_eps=1e-5, **PALM),
}


def preset(name: str, **overrides) -> FalconConfig:
    """A named configuration from :data:`PRESETS`, with any field overridden by keyword."""
    return named_config(FalconConfig, PRESETS, name, overrides)


# The default of `python -m refmath train`: Falcon-7B's block (multi-query attention, one
# LayerNorm) at the size of the decoder's recipe
TRAINING_RECIPE = TrainingRecipe(
    {"name": "chars", "seq_len": 64},
    dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=1, norm_eps=1e-5),
    steps=1000, batch_size=32, lr=3e-3, tasks=("chars", "reverse-lm"))


# ---- parameters ----------------------------------------------------------------------------------

def _norm_shapes(config: FalconConfig) -> dict:
    d = config.d_model
    return {"gamma": (d,), **({"beta": (d,)} if config.norm == "layernorm" else {})}


def param_shapes(config: FalconConfig) -> dict:
    """``{name: shape}`` of every parameter (see the module docstring), in order."""
    check_config("falcon", config)
    d, f = config.d_model, config.d_f
    ffn = {"w_up": (d, f), "w_down": (f, d)}
    if config.ffn == "swiglu":
        ffn = {"w_gate": (d, f), **ffn}
    norm = _norm_shapes(config)
    layer = {**prefixed("ln1", norm), **prefixed("attn", rope_attention_shapes(config))}
    if not config.parallel_block or config.parallel_norms == 2:
        layer.update(prefixed("ln2", norm))
    layer.update(prefixed("ffn", ffn))
    return network.param_shapes(config, lambda i: layer, norm)


def init_params(config: FalconConfig, seed=0, dtype=np.float64) -> dict:
    """Gains at 1, biases at 0, weights by :func:`refmath.models.params.init_llama_params`."""
    return init_llama_params(param_shapes(config), config, seed, dtype)


# ---- the layer: two norms or one, attention and FFN side by side or in turn ----------------------

def layer_norm(params: dict, name: str, config: FalconConfig):
    """The norm ``name`` (``"ln1"``, ``"ln_f"``, ...) as a function of the rows."""
    return lambda x: blocks.norm_forward(x, config.norm, params[name + ".gamma"],
                                         params.get(name + ".beta"), config.norm_eps)


def ffn_forward(h, params: dict, config: FalconConfig, matmul=matmul_rows_many):
    r"""The FFN branch on the normalised rows ``h``: :math:`\operatorname{GELU}(h W_1) W_2`
    (:func:`refmath.models.blocks.plain_ffn_forward`, exact or tanh GELU), or PaLM's SwiGLU
    (:func:`refmath.models.blocks.ffn_forward`). Returns ``(y, cache)``."""
    if config.ffn == "swiglu":
        return blocks.ffn_forward(h, params, matmul=matmul)
    return blocks.plain_ffn_forward(h, params, approximate=config.ffn == "gelu_tanh",
                                    matmul=matmul)


class LayerCache(NamedTuple):
    attn: blocks.SublayerCache  # its branch cache is the attention's
    ffn: blocks.SublayerCache  # its branch cache is the FFN's
    parallel: int  # 0: sequential sublayers; 1 or 2: a parallel block with that many norms
    swiglu: bool  # whether the FFN was the SwiGLU (else the plain GELU FFN)


def block_forward(x, params: dict, config: FalconConfig, attn_branch, ffn_branch,
                  drops=(None, None)):
    r"""The residual block around a layer's attention and FFN branches (each ``rows -> (rows,
    cache)``): the parallel block :math:`x + \operatorname{Attn}(N_1(x)) +
    \operatorname{FFN}(N_2(x))` (N21), or the two sublayers in turn, :math:`x' = x +
    \operatorname{Attn}(N_1(x))`, :math:`x'' = x' + \operatorname{FFN}(N_2(x'))` (N4). Returns
    ``(x'', attn, ffn)``, the branches' :class:`refmath.models.blocks.SublayerCache`\ s."""
    norm1 = layer_norm(params, "ln1", config)
    if not config.parallel_block:
        x, attn = blocks.sublayer_forward(x, norm1, attn_branch, drops[0])
        norm2 = layer_norm(params, "ln2", config)
        x, ffn = blocks.sublayer_forward(x, norm2, ffn_branch, drops[1])
        return x, attn, ffn
    norm2 = layer_norm(params, "ln2", config) if config.parallel_norms == 2 else None
    return blocks.parallel_forward(x, (norm1, norm2), (attn_branch, ffn_branch), drops)


def layer_forward(x, params: dict, config: FalconConfig, drops=(None, None)):
    """One layer on its ``params`` (without ``layers.{i}.``): Llama's RoPE attention and the FFN
    in :func:`block_forward`. ``drops``: the two branches' residual dropout multipliers. Returns
    ``(x', cache)``."""
    attn, ffn = sub_params(params, "attn"), sub_params(params, "ffn")
    x, attn_cache, ffn_cache = block_forward(
        x, params, config, lambda h: rope_attention_forward(h, attn, config),
        lambda h: ffn_forward(h, ffn, config), drops)
    parallel = config.parallel_norms if config.parallel_block else 0
    return x, LayerCache(attn_cache, ffn_cache, parallel, config.ffn == "swiglu")


def layer_backward(dout, cache: LayerCache):
    """Gradients of :func:`layer_forward`, the mirror: in a parallel block both branches back to
    their input and through the norm(s), plus the identity path; sequentially the FFN's sublayer,
    then the attention's. Returns ``(dx, grads)`` named relative to ``layers.{i}.``."""
    backwards = (rope_attention_backward,
                 blocks.ffn_backward if cache.swiglu else blocks.plain_ffn_backward)
    if cache.parallel:
        dx, norm1, norm2, attn_grads, ffn_grads = blocks.parallel_backward(
            dout, cache.attn, cache.ffn, backwards, shared=cache.parallel == 1)
    else:
        dx, norm2, ffn_grads = blocks.sublayer_backward(dout, cache.ffn, backwards[1])
        dx, norm1, attn_grads = blocks.sublayer_backward(dx, cache.attn, backwards[0])
    return dx, {**prefixed("ln1", norm1), **prefixed("attn", attn_grads),
                **prefixed("ln2", norm2), **prefixed("ffn", ffn_grads)}


# ---- the network ---------------------------------------------------------------------------------

# Falcon's network adds nothing of its own around its layers: the embedding, the layers in turn,
# the final norm and the head (refmath.models.network), with the next-token loss on top
network_forward, network_backward, forward, backward, logits = network.plain_network(
    layer_forward, layer_backward, layer_norm, param_shapes)


def layer_kv(cache: network.NetworkCache) -> list:
    """Per layer, the rotated keys and the values ``(B, g, T, d_h)`` a KV cache keeps."""
    return [rope_attention_state(layer.attn.branch) for layer in cache.layers]


# ---- inference with a KV cache (K2, K3); embed, cache_spec and the two hooks are Llama's ---------

def cached_layer(x, params, layer: int, config: FalconConfig, slot, offset: int, *,
                 matmul=matmul_rows_many) -> np.ndarray:
    """Layer ``layer`` on the new rows ``x`` at positions ``offset..``: :func:`block_forward`
    with Llama's cached attention step, which appends the keys and values to the layer's cache
    and attends over every cached position."""
    p = sub_params(params, f"layers.{layer}")
    attn, ffn = sub_params(p, "attn"), sub_params(p, "ffn")
    return block_forward(
        x, p, config,
        lambda h: (rope_attention_cached(h, attn, config, slot, offset, matmul=matmul), None),
        lambda h: ffn_forward(h, ffn, config, matmul=matmul))[0]


def head(params, x, config: FalconConfig, *, matmul=matmul_rows_many) -> np.ndarray:
    """Final LayerNorm and output projection of the new rows: ``(B, n, V)``."""
    return network.head(params, x, layer_norm(params, "ln_f", config), config.tie_embeddings,
                        matmul=matmul)


# What the compiled decode layer (refmath.kernels.decode_layers) computes of these layers, field by
# field (refmath.models.contract): its layer is two pre-norm sublayers in turn, so Falcon's old
# sequential layout, with any of the norms and FFNs; the parallel block keeps the NumPy step.
COMPILED_FIELDS = {
    # sizes, handed to the kernel as its shape
    "vocab_size": ANY, "max_seq_len": ANY, "d_model": ANY, "n_layers": ANY, "n_heads": ANY,
    "n_kv_heads": ANY, "d_ff": ANY,
    # the block: sequential only (parallel_norms is then 1, which __post_init__ enforces)
    "parallel_block": (False,), "parallel_norms": (1,),
    # LayerNorm with its bias, or without (PaLM's): a zero shift, which adds exactly nothing
    "norm": ANY, "norm_eps": ANY,
    # the plain FFN with exact or tanh GELU and no biases, or the SwiGLU
    "ffn": ANY,
    # RoPE: the rotation at each position comes from rope_options, as Llama's
    "rope_base": ANY, "rope_layout": ANY, "rope_scaling": ANY,
    # outside the layers: embed and head run in NumPy
    "tie_embeddings": ANY,
    # training only: no decode step reads them
    "dropout": ANY, "init_std": ANY, "attention_backend": ANY,
}

def compiled_layer_spec(params, config: FalconConfig):
    """What :mod:`refmath.inference.compiled_step` runs of this model's layers in one compiled
    call (:func:`refmath.kernels.decode_layers`): ``(shape, layers)``, or None unless every field
    of ``config`` has a value :data:`COMPILED_FIELDS` lists (the sequential layout)."""
    if type(config) is not FalconConfig or not allowed(config, COMPILED_FIELDS):
        return None
    layers = []
    for i in range(config.n_layers):
        p = sub_params(params, f"layers.{i}")
        layer = {}
        for norm in ("1", "2"):
            gamma = p[f"ln{norm}.gamma"]
            layer[f"norm{norm}_gain"] = gamma
            layer[f"norm{norm}_shift"] = p.get(f"ln{norm}.beta", np.zeros_like(gamma))
        layer.update({name: p[f"attn.{name}"] for name in ("w_q", "w_k", "w_v", "w_o")})
        names = ("w_gate", "w_up", "w_down") if config.ffn == "swiglu" else ("w_up", "w_down")
        layer.update({name: p[f"ffn.{name}"] for name in names})
        layers.append(layer)
    shape = dict(d_model=config.d_model, heads=config.n_heads, kv_heads=config.kv_heads,
                 head_dim=config.d_h, d_ff=config.d_f, norm="layernorm", eps=config.norm_eps,
                 ffn=config.ffn, rope=config.rope_layout,
                 scale=1.0 / math.sqrt(config.d_h))
    return shape, layers


def sizing_fields(config: FalconConfig) -> dict:
    """What :mod:`refmath.sizing` counts of this model."""
    return dict(n_layers=config.n_layers, d_model=config.d_model, n_heads=config.n_heads,
                kv_heads=config.kv_heads, head_dim=config.d_h, d_ff=config.d_f,
                vocab_size=config.vocab_size, tie_embeddings=config.tie_embeddings,
                norm=config.norm, ffn=config.ffn,
                norms_per_layer=config.parallel_norms if config.parallel_block else 2)


# ---- Hugging Face: one key table, read by params_from_hf and written by to_hf --------------------

HF_MODEL_TYPES = ("falcon",)

# Falcon's activation names: exact GELU, or its tanh form under either of transformers' names
_ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}

# (Hugging Face's name under transformer.h.{i}., refmath's under layers.{i}.), linear weights
# stored transposed
LAYER_LINEARS = (("self_attention.dense.weight", "attn.w_o"),
                 ("mlp.dense_h_to_4h.weight", "ffn.w_up"),
                 ("mlp.dense_4h_to_h.weight", "ffn.w_down"))
# the one tensor that is not a table row: w_q, w_k and w_v fused, grouped by key/value head
QKV = "self_attention.query_key_value.weight"


def _norm_names(config: FalconConfig) -> tuple:
    """``((refmath's norm, Falcon's), ...)`` of one layer."""
    if not config.parallel_block:
        return (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm"))
    if config.parallel_norms == 2:
        return (("ln1", "ln_attn"), ("ln2", "ln_mlp"))
    return (("ln1", "input_layernorm"),)


def key_table(config: FalconConfig) -> list:
    """``[(Hugging Face name, refmath name, transposed)]`` of every parameter but the fused
    ``query_key_value`` (:data:`QKV`) and ``lm_head``."""
    rows = [("transformer.word_embeddings.weight", "tok_emb", False)]
    for i in range(config.n_layers):
        t, p = f"transformer.h.{i}.", f"layers.{i}."
        for ours, theirs in _norm_names(config):
            rows += [(t + theirs + ".weight", p + ours + ".gamma", False),
                     (t + theirs + ".bias", p + ours + ".beta", False)]
        rows += [(t + theirs, p + ours, True) for theirs, ours in LAYER_LINEARS]
    return rows + [("transformer.ln_f.weight", "ln_f.gamma", False),
                   ("transformer.ln_f.bias", "ln_f.beta", False)]


def _qkv_widths(config: FalconConfig) -> tuple:
    """Per key/value group of the fused projection: its ``h/g`` queries, its key, its value.

    transformers' new decoder architecture (Falcon-40B) groups it so; the old one (Falcon-7B) lays
    it out as ``[q_1 .. q_h, k, v]`` (``multi_query``, ``g = 1``) or ``[q, k, v]`` per head
    (``g = h``), which are the grouped layout with ``g = 1`` and ``g = h``: one rule reads all."""
    d_h = config.d_h
    return ((config.n_heads // config.kv_heads) * d_h, d_h, d_h)


def config_from_hf(hf: dict) -> FalconConfig:
    """A :class:`FalconConfig` from a ``falcon`` ``config.json``: the parallel block of LayerNorms
    (or the old sequential one) and a plain GELU MLP, RoPE (``"half"``), no biases; ALiBi
    (Falcon-RW), biased projections and another activation are refused."""
    refuse_common(hf)
    if hf.get("alibi"):
        refuse(hf, "alibi", True, "refmath's decoder places positions by RoPE, not ALiBi's biases")
    if hf.get("bias"):
        refuse(hf, "bias", True, "refmath's Falcon has no biases on its projections and MLP")
    act = hf.get("activation", "gelu")
    if act not in _ACTIVATIONS:
        refuse(hf, "activation", act, "refmath's plain FFN takes GELU, exact or tanh")
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    new, parallel = bool(hf.get("new_decoder_architecture")), bool(hf.get("parallel_attn", True))
    norms = hf.get("num_ln_in_parallel_attn")
    if new:
        if not parallel:
            refuse(hf, "parallel_attn", False, "the new decoder architecture runs the parallel "
                   "block only (transformers builds no post_attention_layernorm for it)")
        norms = 2 if norms is None else int(norms)
        if norms not in (1, 2):
            refuse(hf, "num_ln_in_parallel_attn", norms, "a parallel block has one norm or two")
        kv_heads = int(hf.get("num_kv_heads") or heads)
    else:
        if norms not in (None, 1):
            refuse(hf, "num_ln_in_parallel_attn", norms, "transformers' old decoder "
                   "architecture reads input_layernorm alone")
        norms = 1
        kv_heads = 1 if hf.get("multi_query", True) else heads
        if kv_heads == heads and int(hf.get("num_kv_heads") or heads) != heads:
            refuse(hf, "num_kv_heads", hf["num_kv_heads"], "the old decoder architecture "
                   "without multi_query has a key and a value per head")
    base, scaling = rope_from_hf(hf)
    return FalconConfig(
        vocab_size=int(hf["vocab_size"]), max_seq_len=rope_context(hf, scaling), d_model=d,
        n_layers=int(hf["num_hidden_layers"]), n_heads=heads, n_kv_heads=kv_heads,
        d_ff=int(hf.get("ffn_hidden_size") or 4 * d), rope_base=base, rope_scaling=scaling,
        rope_layout="half", norm="layernorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        ffn=_ACTIVATIONS[act], parallel_block=parallel, parallel_norms=norms if parallel else 1,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), dropout=0.0)


def params_from_hf(hf: dict, config: FalconConfig, weights) -> dict:
    """Every parameter, read through :func:`key_table`; the fused ``query_key_value`` split by
    key/value group into ``w_q``, ``w_k``, ``w_v`` (:func:`_qkv_widths`)."""
    shapes, params = param_shapes(config), {}
    for theirs, ours, transposed in key_table(config):
        shape = shapes[ours][::-1] if transposed else shapes[ours]
        params[ours] = weights.take(theirs, shape, transpose=transposed)
    widths, g = _qkv_widths(config), config.kv_heads
    for i in range(config.n_layers):
        fused = weights.take(f"transformer.h.{i}.{QKV}", (g * sum(widths), config.d_model),
                             transpose=True)
        p = f"layers.{i}.attn."
        params[p + "w_q"], params[p + "w_k"], params[p + "w_v"] = split_heads_columns(fused, g,
                                                                                      widths)
    take_head(weights, config.tie_embeddings, params, config.vocab_size, config.d_model)
    return params


def _writable(config: FalconConfig) -> None:
    """Refuse what no ``falcon`` checkpoint holds: PaLM's norm and SwiGLU, and a sequential block
    with grouped key/value heads (the old decoder architecture has 1 or ``h``)."""
    for field, written in (("norm", ("layernorm",)), ("ffn", ("gelu", "gelu_tanh"))):
        if getattr(config, field) not in written:
            raise HFCheckpointError(f"a FalconConfig is written as falcon, which needs {field} = "
                                    f"{' or '.join(map(repr, written))}; this config has "
                                    f"{getattr(config, field)!r}")
    if not config.parallel_block and config.kv_heads not in (1, config.n_heads):
        raise HFCheckpointError(f"falcon's sequential block (the old decoder architecture) has "
                                f"one key/value head or n_heads; this config has n_kv_heads = "
                                f"{config.kv_heads}")


def to_hf(config: FalconConfig, params: dict):
    """``(config.json fields, {name: tensor})`` of a ``FalconForCausalLM``, through the same
    :func:`key_table` the reader reads; an ``"interleaved"`` RoPE layout is permuted to Hugging
    Face's (:func:`refmath.models.hf_layout.interleaved_to_half`)."""
    _writable(config)
    # the old architecture where it suffices (a sequential block, or Falcon-7B's multi-query one)
    old = not config.parallel_block or (config.kv_heads == 1 and config.parallel_norms == 1)
    rope_parameters, context = rope_to_hf(config.rope_base, config.rope_scaling)
    hf = {"model_type": "falcon", "architectures": ["FalconForCausalLM"],
          "vocab_size": config.vocab_size, "hidden_size": config.d_model,
          "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
          "num_kv_heads": config.kv_heads, "new_decoder_architecture": not old,
          "multi_query": config.kv_heads == 1, "parallel_attn": config.parallel_block,
          "num_ln_in_parallel_attn": None if old else config.parallel_norms, "alibi": False,
          "bias": False, "activation": "gelu" if config.ffn == "gelu" else "gelu_pytorch_tanh",
          "ffn_hidden_size": config.d_f, "layer_norm_epsilon": config.norm_eps,
          "rope_parameters": rope_parameters,
          "max_position_embeddings": config.max_seq_len if context is None else context,
          "tie_word_embeddings": config.tie_embeddings,
          "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}

    def rotated(w):  # the query and key columns in Hugging Face's "half" RoPE layout
        return w if config.rope_layout == "half" else interleaved_to_half(w, config.d_h)

    tensors = {theirs: linear_out(params[ours]) if transposed else params[ours]
               for theirs, ours, transposed in key_table(config)}
    for i in range(config.n_layers):
        p = f"layers.{i}.attn."
        tensors[f"transformer.h.{i}.{QKV}"] = linear_out(join_heads_columns(
            [rotated(params[p + "w_q"]), rotated(params[p + "w_k"]), params[p + "w_v"]],
            config.kv_heads))
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = linear_out(params["lm_head"])
    return hf, tensors


# ---- gradient-check cases ------------------------------------------------------------------------

# init_std ~ 1/sqrt(d): gradients far above the stencil's noise
_TINY = dict(vocab_size=11, max_seq_len=8, d_model=16, n_layers=2, n_heads=4, init_std=0.25)
_CASES = {
    "Falcon-7B: parallel block, one LayerNorm, MQA, exact-GELU MLP, tied": (dict(
        n_kv_heads=1, tie_embeddings=True), ("N21", "N1", "N6"), False),
    "Falcon-40B: parallel block, two LayerNorms, GQA, tanh-GELU MLP, dropout 0.25": (dict(
        n_kv_heads=2, parallel_norms=2, ffn="gelu_tanh", d_ff=24, dropout=0.25),
        ("N21", "N1", "N6"), True),
    # the SwiGLU 48 wide, as 8d/3 rounded up to a multiple of 8 gives it
    "PaLM: parallel block, MQA, SwiGLU, LayerNorm without bias, tied": (
        dict(PALM, d_ff=48), ("N21", "N1", "N7"), False),
    "Falcon's sequential block: two LayerNorms in turn, MHA": (
        dict(parallel_block=False), ("N4", "N1", "N6"), False),
}
for _label, (_fields, _ids, _train) in _CASES.items():
    register_case(ParamCase("falcon", _label, ("M3", *_ids),
                            model_case_maker(forward, init_params,
                                             FalconConfig(**_TINY, **_fields), train=_train),
                            backward, max_coords=2, step=2.5e-4))
