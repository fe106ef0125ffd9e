r"""OLMo 2 (``olmo2``): Llama's decoder with these differences.

- **Norms after the sublayers, none before** (N22): each branch reads the residual stream itself
  and its output is RMS-normalised before it is added,

  .. math::
      x' = x + \operatorname{RMSNorm}(\operatorname{Attn}(x)),\qquad
      x'' = x' + \operatorname{RMSNorm}(\operatorname{SwiGLU}(x'))

- **QK-norm over the whole projections** (N18): the queries :math:`x W_Q` (``h d_h`` wide) and the
  keys :math:`x W_K` (``g d_h`` wide) are RMS-normalised, each with its own gain, before the
  heads split and before RoPE.

Everything else is Llama's: RoPE (N10) on grouped-query attention (A10), computed by Llama's own
sublayer (:data:`refmath.models.rope_attention.ROPE_GQA`, its ``"projection"`` QK-norm), the
SwiGLU FFN (N7), the final RMSNorm and the output head, no biases. The layer is the list of block
calls in :func:`block_forward`, its backward the mirror in :func:`layer_backward`.

Parameters (flat dict, row vectors ``x @ W``)::

    tok_emb                          (V, d)
    layers.{i}.attn.w_q, w_k, w_v    (d, h d_h), (d, g d_h), (d, g d_h)
    layers.{i}.attn.w_o              (h d_h, d)
    layers.{i}.attn.q_norm.gamma     (h d_h,)     QK-norm's gains over the whole projections
    layers.{i}.attn.k_norm.gamma     (g d_h,)
    layers.{i}.ln1_post.gamma        (d,)         the RMSNorm after the attention
    layers.{i}.ln2_post.gamma        (d,)         the RMSNorm after the FFN
    layers.{i}.ffn.w_gate, w_up      (d, d_f)
    layers.{i}.ffn.w_down            (d_f, d)
    ln_f.gamma                       (d,)
    lm_head                          (d, V)       absent when tie_embeddings (then W = tok_emb^T)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np

from refmath._validate import check_field, check_int
from refmath.ffn import matmul_rows_many, swiglu_hidden_size
from refmath.models import check_config
from refmath.models import blocks
from refmath.models import network
from refmath.models.cases import model_case_maker
from refmath.models.common import HeadDimHeads, TrainingRecipe, prefixed, sub_params
from refmath.models.decoder import rope_attention_inputs
from refmath.models.decoder_config import check_rope_fields, check_training_fields
from refmath.models.hf_layout import (ATTENTION_KEYS, GATED_FFN_KEYS, QK_NORM_KEYS,
                                      interleaved_to_half, layer_key_rows, linear_out,
                                      refuse_common, require, rope_context, rope_from_hf,
                                      rope_to_hf, take_head)
from refmath.models.params import init_llama_params
from refmath.models.network import embed  # Llama's: the table's rows, positions by RoPE only
from refmath.models.rope_attention import (  # Llama's attention, its options and hooks
    PlainAttentionOptions, cache_spec, cache_stale, rope_options, rope_attention_backward,
    rope_attention_cached, rope_attention_forward, rope_attention_shapes, rope_attention_state)
from refmath.positions import RopeScaling
from refmath.registry import OpCase, ParamCase, layer_case_ops, register_case

__all__ = [
    "OLMo2Config", "TRAINING_RECIPE", "param_shapes", "init_params", "layer_norm", "LayerCache",
    "block_forward", "layer_forward", "layer_backward", "network_forward",
    "network_backward", "forward", "backward", "logits", "layer_kv", "rope_options",
    "cache_stale", "cache_spec", "embed", "cached_layer", "head", "COMPILED_FIELDS",
    "compiled_layer_spec", "sizing_fields", "HF_MODEL_TYPES", "key_table", "config_from_hf",
    "params_from_hf", "to_hf"
]

# ---- configuration -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class OLMo2Config(HeadDimHeads, PlainAttentionOptions):
    """Sizes and options of OLMo 2. ``dataclasses.asdict`` round-trips through JSON. The defaults
    are Llama's (:class:`refmath.models.decoder.DecoderConfig`)."""

    vocab_size: int  # V, rows of the token table
    max_seq_len: int  # the longest sequence accepted (RoPE has no table: a contract, not a size)
    d_model: int  # d, the residual stream's width
    n_layers: int  # L, layers
    n_heads: int  # h query heads
    n_kv_heads: int | None = None  # g key/value heads (A10); None: h
    head_dim: int | None = None  # d_h, even (RoPE rotates pairs); None: d / h
    d_ff: int | None = None  # d_f, the SwiGLU's width; None: 8d/3 rounded up (ffn_multiple_of)
    ffn_multiple_of: int = 256  # the multiple the default d_f is rounded up to
    rope_base: float = 10000.0  # RoPE's base theta (N10)
    rope_layout: str = "interleaved"  # RoPE's pairs: (2i, 2i+1), or Hugging Face's "half"
    rope_scaling: RopeScaling | None = None  # a context-extension rule (N13-N17), or None
    norm_eps: float = 1e-6  # every RMSNorm's epsilon (QK-norm's too)
    tie_embeddings: bool = False  # the head is the token table transposed
    dropout: float = 0.0  # residual dropout on each branch's output, in training only
    init_std: float = 0.02  # sigma of every weight at init (residual outputs: sigma / sqrt(2L))
    attention_backend: str = "numpy"  # training's causal attention: NumPy or the "cpu" kernel

    # of Llama's attention options (PlainAttentionOptions), OLMo 2 has QK-norm over the projections
    qk_norm: ClassVar[str] = "projection"

    def __post_init__(self):
        for name in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads",
                     "ffn_multiple_of"):
            check_field(self, name, check_int, 1)
        for name in ("n_kv_heads", "head_dim", "d_ff"):
            check_field(self, name, check_int, 1, optional=True)
        check_rope_fields(self)
        check_training_fields(self)
        self.check_heads()

    @property
    def d_f(self) -> int:
        """The SwiGLU's width: ``d_ff``, or :func:`refmath.ffn.swiglu_hidden_size`'s."""
        return swiglu_hidden_size(self.d_model, self.ffn_multiple_of) if self.d_ff is None \
            else self.d_ff


# The default of `python -m refmath train`: the size of the decoder's recipe
TRAINING_RECIPE = TrainingRecipe(
    {"name": "chars", "seq_len": 64},
    dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_multiple_of=16),
    steps=1000, batch_size=32, lr=3e-3, tasks=("chars", "reverse-lm"))


# ---- parameters ----------------------------------------------------------------------------------

def param_shapes(config: OLMo2Config) -> dict:
    """``{name: shape}`` of every parameter (see the module docstring), in order."""
    check_config("olmo2", config)
    d, f = config.d_model, config.d_f
    layer = {**{"attn." + k: v for k, v in rope_attention_shapes(config).items()},
             "ln1_post.gamma": (d,), "ln2_post.gamma": (d,),
             "ffn.w_gate": (d, f), "ffn.w_up": (d, f), "ffn.w_down": (f, d)}
    return network.param_shapes(config, lambda i: layer, {"gamma": (d,)})


def init_params(config: OLMo2Config, seed=0, dtype=np.float64) -> dict:
    """Gains at 1, weights by :func:`refmath.models.params.init_llama_params`."""
    return init_llama_params(param_shapes(config), config, seed, dtype)


# ---- the layer: each branch on the residual stream, its output normalised ------------------------

def layer_norm(params: dict, name: str, config: OLMo2Config):
    """The RMSNorm ``name`` (``"ln1_post"``, ``"ln_f"``, ...) as a function of the rows."""
    return lambda x: blocks.norm_forward(x, "rmsnorm", params[name + ".gamma"], None,
                                         config.norm_eps)


class LayerCache(NamedTuple):
    attn: blocks.SublayerCache  # its branch cache is a PostNormCache of the attention's
    ffn: blocks.SublayerCache  # its branch cache is a PostNormCache of the SwiGLU's


def block_forward(x, params: dict, config: OLMo2Config, attn_branch, ffn_branch,
                  drops=(None, None)):
    r"""The two residual sublayers around a layer's branches (each ``rows -> (rows, cache)``), with
    no norm before them and an RMSNorm after each (N22): :math:`x' = x +
    \operatorname{RMSNorm}(\operatorname{Attn}(x))`, :math:`x'' = x' +
    \operatorname{RMSNorm}(\operatorname{FFN}(x'))`. Returns ``(x'', attn, ffn)``."""
    attn_branch = blocks.post_normed(attn_branch, layer_norm(params, "ln1_post", config))
    ffn_branch = blocks.post_normed(ffn_branch, layer_norm(params, "ln2_post", config))
    x, attn = blocks.sublayer_forward(x, None, attn_branch, drops[0])
    x, ffn = blocks.sublayer_forward(x, None, ffn_branch, drops[1])
    return x, attn, ffn


def layer_forward(x, params: dict, config: OLMo2Config, drops=(None, None)):
    """One layer on its ``params`` (without ``layers.{i}.``): Llama's RoPE attention with QK-norm
    on the projections and the SwiGLU, in :func:`block_forward`. Returns ``(x'', cache)``."""
    attn, ffn = sub_params(params, "attn"), sub_params(params, "ffn")
    x, attn_cache, ffn_cache = block_forward(
        x, params, config, lambda h: rope_attention_forward(h, attn, config),
        lambda h: blocks.ffn_forward(h, ffn), drops)
    return x, LayerCache(attn_cache, ffn_cache)


def layer_backward(dout, cache: LayerCache):
    """Gradients of :func:`layer_forward`, the mirror: the FFN's sublayer (its output norm, then
    the SwiGLU), then the attention's. Returns ``(dx, grads)`` named relative to ``layers.{i}.``."""
    grads = {}
    dx, _, ffn_grads = blocks.sublayer_backward(
        dout, cache.ffn, blocks.post_normed_backward(blocks.ffn_backward, grads, "ln2_post"))
    dx, _, attn_grads = blocks.sublayer_backward(
        dx, cache.attn, blocks.post_normed_backward(rope_attention_backward, grads, "ln1_post"))
    return dx, {**prefixed("attn", attn_grads), **prefixed("ffn", ffn_grads), **grads}


# ---- the network ---------------------------------------------------------------------------------

# OLMo 2's network adds nothing of its own around its layers: the embedding, the layers in turn,
# the final RMSNorm and the head (refmath.models.network), with the next-token loss on top
network_forward, network_backward, forward, backward, logits = network.plain_network(
    layer_forward, layer_backward, layer_norm, param_shapes)


def layer_kv(cache: network.NetworkCache) -> list:
    """Per layer, the rotated keys and the values ``(B, g, T, d_h)`` a KV cache keeps."""
    return [rope_attention_state(layer.attn.branch.branch) for layer in cache.layers]


# ---- inference with a KV cache (K2, K3); embed, cache_spec and the two hooks are Llama's ---------

def cached_layer(x, params, layer: int, config: OLMo2Config, slot, offset: int, *,
                 matmul=matmul_rows_many) -> np.ndarray:
    """Layer ``layer`` on the new rows ``x`` at positions ``offset..``: :func:`block_forward`
    around Llama's cached attention step (it appends the new keys and values to the layer's cache
    and attends over every cached position) and the SwiGLU."""
    p = sub_params(params, f"layers.{layer}")
    attn, ffn = sub_params(p, "attn"), sub_params(p, "ffn")
    return block_forward(
        x, p, config,
        lambda h: (rope_attention_cached(h, attn, config, slot, offset, matmul=matmul), None),
        lambda h: blocks.ffn_forward(h, ffn, matmul=matmul))[0]


def head(params, x, config: OLMo2Config, *, matmul=matmul_rows_many) -> np.ndarray:
    """Final RMSNorm and output projection of the new rows: ``(B, n, V)``."""
    return network.head(params, x, layer_norm(params, "ln_f", config), config.tie_embeddings,
                        matmul=matmul)


COMPILED_FIELDS = None  # the compiled decode layer normalises before the sublayers: the NumPy step


def compiled_layer_spec(params, config: OLMo2Config) -> None:
    """None: the NumPy step runs every layer."""
    return None


def sizing_fields(config: OLMo2Config) -> dict:
    """What :mod:`refmath.sizing` counts of this model (its QK-norm's (h + g) d_h gains)."""
    return dict(n_layers=config.n_layers, d_model=config.d_model, n_heads=config.n_heads,
                kv_heads=config.kv_heads, head_dim=config.d_h, d_ff=config.d_f,
                vocab_size=config.vocab_size, tie_embeddings=config.tie_embeddings,
                qk_norm="projection", norm="rmsnorm", ffn="swiglu", norms_per_layer=2)


# ---- Hugging Face: one key table, read by params_from_hf and written by to_hf --------------------

HF_MODEL_TYPES = ("olmo2",)

# (Hugging Face's name under model.layers.{i}., refmath's under layers.{i}., stored transposed)
# Llama's rows (refmath.models.hf_layout), QK-norm's over the whole projection, and the two norms
# on the branches' outputs in place of Llama's two before them
LAYER_KEYS = ATTENTION_KEYS + QK_NORM_KEYS + (
    ("post_attention_layernorm.weight", "ln1_post.gamma", False),  # the attention's output norm
    ("post_feedforward_layernorm.weight", "ln2_post.gamma", False),
) + GATED_FFN_KEYS
# the columns (and QK-norm's gains) that Hugging Face's "half" RoPE layout permutes within a head
ROTATED = ("attn.w_q", "attn.w_k", "attn.q_norm.gamma", "attn.k_norm.gamma")


def key_table(config: OLMo2Config) -> list:
    """``[(Hugging Face name, refmath name, transposed)]`` of every parameter but ``lm_head``."""
    return ([("model.embed_tokens.weight", "tok_emb", False)]
            + layer_key_rows(config.n_layers, LAYER_KEYS)
            + [("model.norm.weight", "ln_f.gamma", False)])


def config_from_hf(hf: dict) -> OLMo2Config:
    """An :class:`OLMo2Config` from an ``olmo2`` ``config.json``; another activation and biases
    are refused."""
    refuse_common(hf)
    require(hf, "hidden_act", ("silu",), "silu", "refmath's SwiGLU gates with SiLU")
    require(hf, "attention_bias", (False,), False, "refmath's OLMo 2 has no attention biases")
    require(hf, "mlp_bias", (False,), False, "refmath's SwiGLU has no biases")
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    base, scaling = rope_from_hf(hf)
    return OLMo2Config(
        vocab_size=int(hf["vocab_size"]), max_seq_len=rope_context(hf, scaling), d_model=d,
        n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or d // heads), d_ff=int(hf["intermediate_size"]),
        rope_base=base, rope_scaling=scaling, rope_layout="half",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dropout=0.0)


def params_from_hf(hf: dict, config: OLMo2Config, weights) -> dict:
    """Every parameter, read through :func:`key_table`."""
    shapes, params = param_shapes(config), {}
    for theirs, ours, transposed in key_table(config):
        shape = shapes[ours][::-1] if transposed else shapes[ours]
        params[ours] = weights.take(theirs, shape, transpose=transposed)
    for i in range(config.n_layers):  # older files keep RoPE's frequencies as a buffer
        if weights.has(f"model.layers.{i}.self_attn.rotary_emb.inv_freq"):
            weights.skip(f"model.layers.{i}.self_attn.rotary_emb.inv_freq")
    take_head(weights, config.tie_embeddings, params, config.vocab_size, config.d_model)
    return params


def to_hf(config: OLMo2Config, params: dict):
    """``(config.json fields, {name: tensor})`` of an ``Olmo2ForCausalLM``, through the same
    :func:`key_table` the reader reads; an ``"interleaved"`` RoPE layout is permuted to Hugging
    Face's (:func:`refmath.models.hf_layout.interleaved_to_half`)."""
    rope_parameters, context = rope_to_hf(config.rope_base, config.rope_scaling)
    hf = {"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"],
          "vocab_size": config.vocab_size,
          "max_position_embeddings": config.max_seq_len if context is None else context,
          "hidden_size": config.d_model, "num_hidden_layers": config.n_layers,
          "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads,
          "head_dim": config.d_h, "intermediate_size": config.d_f, "hidden_act": "silu",
          "rms_norm_eps": config.norm_eps, "rope_parameters": rope_parameters,
          "tie_word_embeddings": config.tie_embeddings, "attention_bias": False,
          "mlp_bias": False, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}

    def tensor(ours, transposed):
        w = params[ours]
        if ours.endswith(ROTATED) and config.rope_layout == "interleaved":
            w = interleaved_to_half(w, config.d_h)
        return linear_out(w) if transposed else w

    tensors = {theirs: tensor(ours, transposed) for theirs, ours, transposed in key_table(config)}
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = linear_out(params["lm_head"])
    return hf, tensors


# ---- gradient-check cases ------------------------------------------------------------------------

# init_std ~ 1/sqrt(d): gradients far above the stencil's noise
_TINY = dict(vocab_size=11, max_seq_len=8, d_model=16, n_layers=2, n_heads=4, ffn_multiple_of=8,
             init_std=0.25)
register_case(ParamCase("olmo2", "OLMo 2: RMSNorm after each sublayer only, QK-norm on the "
                        "projections", ("M3", "N22", "N18"),
                        model_case_maker(forward, init_params, OLMo2Config(**_TINY, n_kv_heads=2),
                                         train=False),
                        backward, max_coords=2, step=2.5e-4))
register_case(ParamCase("olmo2", "OLMo 2: tied, dropout 0.25, linear rope scaling",
                        ("M3", "N22", "N13"),
                        model_case_maker(forward, init_params, OLMo2Config(
                            **_TINY, n_kv_heads=1, tie_embeddings=True, dropout=0.25,
                            rope_scaling=dict(rope_type="linear", factor=2.0)), train=True),
                        backward, max_coords=2, step=2.5e-4))
# Llama's attention sublayer with OLMo 2's QK-norm over the projections (N18)
_ATTENTION = OLMo2Config(**_TINY, n_kv_heads=2)
register_case(OpCase("rope_attention", "h=4 g=2 causal (2, 5, 16), QK-norm on the projections "
                     "(OLMo 2)", ("N10", "A10", "A8", "N18", "N2"),
                     rope_attention_inputs(_ATTENTION),
                     *layer_case_ops(rope_attention_forward, rope_attention_backward),
                     ("x", *rope_attention_shapes(_ATTENTION)), group="attention execution",
                     max_coords=12))
