r"""Phi-3 (``phi3``): Llama's decoder with these differences.

- **Fused projections in the checkpoint.** Hugging Face's Phi-3 stores the query, key and value
  projections as one matrix ``qkv_proj`` and the gate and up projections as one ``gate_up_proj``.
  Since :math:`x\,[W_Q\; W_K\; W_V] = [x W_Q,\; x W_K,\; x W_V]`, stacking the output columns
  changes no number: the key table (:data:`LAYER_KEYS`) splits them on the way in and stacks them
  on the way out, and the network keeps Llama's separate matrices.
- **LongRoPE** (N17) is its one rope scaling: a searched divisor per frequency pair, the short
  factors up to the trained context ``original_max_seq_len`` and the long ones past it, and the
  rotation scaled by :math:`m = \sqrt{1 + \ln s / \ln L}` (:func:`refmath.positions.rope_inv_freq`).
  Its factors are sized by the head width, which is always :math:`d / h`.
- **One window for every layer** (A12), or none, as Mistral's.

Everything else is Llama's, and so is the code that computes it: this file calls
:mod:`refmath.models.decoder`'s network (pre-RMSNorm sublayers, RoPE on grouped-query attention
with :data:`refmath.models.rope_attention.ROPE_GQA`, the SwiGLU, the final RMSNorm and the head),
its backward, its cached step and its compiled decode layer, and states only its configuration,
its checkpoint's key table and its gradient case.

Parameters (Llama's names; flat dict, row vectors ``x @ W``)::

    tok_emb                          (V, d)
    layers.{i}.ln1.gamma             (d,)
    layers.{i}.attn.w_q, w_k, w_v    (d, h d_h), (d, g d_h), (d, g d_h)   qkv_proj's three blocks
    layers.{i}.attn.w_o              (h d_h, d)
    layers.{i}.ln2.gamma             (d,)
    layers.{i}.ffn.w_gate, w_up      (d, d_f)                             gate_up_proj's two
    layers.{i}.ffn.w_down            (d_f, d)
    ln_f.gamma                       (d,)
    lm_head                          (d, V)       absent when tie_embeddings (then W = tok_emb^T)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from refmath._validate import check_field, check_int
from refmath.ffn import matmul_rows_many
from refmath.models import check_config
from refmath.models.cases import model_case_maker
from refmath.models.common import EvenHeads, TrainingRecipe
from refmath.models.contract import ANY
from refmath.models.decoder import (  # Llama's network, backward, cached step and sizes
    backward, cache_spec, decoder_logits, decoder_param_shapes, embed, family_cached_layer,
    head, init_decoder_params, layer_kv, llama_layers_spec, lm_forward, sizing_fields)
from refmath.models.decoder_config import check_rope_fields, check_training_fields
from refmath.models.hf_layout import (interleaved_to_half, linear_out, refuse, refuse_common,
                                      require, rope_context, rope_from_hf, rope_to_hf, take_head)
from refmath.models.rope_attention import (ROPE_GQA, PlainAttentionOptions,  # Llama's hooks
                                           cache_stale, rope_options)
from refmath.positions import RopeScaling
from refmath.registry import ParamCase, register_case

__all__ = [
    "Phi3Config", "TRAINING_RECIPE", "param_shapes", "init_params", "forward", "backward",
    "logits", "layer_kv", "rope_options", "cache_stale", "cache_spec", "embed", "cached_layer",
    "head", "COMPILED_FIELDS", "compiled_layer_spec", "sizing_fields", "HF_MODEL_TYPES",
    "LAYER_KEYS", "key_table", "config_from_hf", "params_from_hf", "to_hf"
]

# ---- configuration -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Phi3Config(EvenHeads, PlainAttentionOptions):
    """Sizes and options of Phi-3. ``dataclasses.asdict`` round-trips through JSON."""

    vocab_size: int  # V, rows of the token table
    max_seq_len: int  # the longest sequence accepted (RoPE has no table: a contract, not a size)
    d_model: int  # d, the residual stream's width
    n_layers: int  # L, layers
    n_heads: int  # h query heads, each d_h = d / h wide (even: RoPE rotates pairs)
    d_ff: int  # d_f, the SwiGLU's width (gate_up_proj holds 2 d_f rows)
    n_kv_heads: int | None = None  # g key/value heads (A10); None: h
    rope_base: float = 10000.0  # RoPE's base theta (N10)
    rope_layout: str = "interleaved"  # RoPE's pairs: (2i, 2i+1), or Hugging Face's "half"
    rope_scaling: RopeScaling | None = None  # LongRoPE (N17, rope_type "longrope"), or None
    sliding_window: int | None = None  # w: every layer attends to its last w positions (A12)
    norm_eps: float = 1e-5  # every RMSNorm's epsilon (Phi-3's default)
    tie_embeddings: bool = False  # the head is the token table transposed
    dropout: float = 0.0  # residual dropout on each branch's output, in training only
    init_std: float = 0.02  # sigma of every weight at init (residual outputs: sigma / sqrt(2L))
    attention_backend: str = "numpy"  # training's causal attention: NumPy or the "cpu" kernel

    # Llama's layer options that Phi-3 does not have, as Llama's code (refmath.models.decoder)
    # reads them: no experts, one window for every layer (class constants, not fields); its
    # attention's are PlainAttentionOptions, but for the window above
    moe: ClassVar[None] = None
    window_layers: ClassVar[None] = None

    def __post_init__(self):
        for name in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
            check_field(self, name, check_int, 1)
        for name in ("n_kv_heads", "sliding_window"):
            check_field(self, name, check_int, 1, optional=True)
        check_rope_fields(self)
        if self.rope_scaling is not None and self.rope_scaling.rope_type != "longrope":
            raise ValueError(f"Phi3Config.rope_scaling must be LongRoPE's (rope_type "
                             f"'longrope') or None, got rope_type "
                             f"{self.rope_scaling.rope_type!r}")
        check_training_fields(self)
        self.check_heads()

    @property
    def d_f(self) -> int:
        """The SwiGLU's width."""
        return self.d_ff

    @property
    def score_scale(self) -> float:
        r"""The factor of the attention scores: :math:`1/\sqrt{d_h}`."""
        return self.d_h ** -0.5


# The default of `python -m refmath train`: the decoder's recipe (its d_f of 176 given here)
TRAINING_RECIPE = TrainingRecipe(
    {"name": "chars", "seq_len": 64},
    dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=176),
    steps=1000, batch_size=32, lr=3e-3, tasks=("chars", "reverse-lm"))


# ---- Llama's network on a Phi3Config -------------------------------------------------------------

def param_shapes(config: Phi3Config) -> dict:
    """``{name: shape}`` of every parameter (see the module docstring), in order."""
    check_config("phi3", config)  # exactly: a subclass may add fields Llama's code ignores
    return decoder_param_shapes(config, ROPE_GQA)


def init_params(config: Phi3Config, seed=0, dtype=np.float64) -> dict:
    """Llama's initialisation (:func:`refmath.models.decoder.init_params`)."""
    check_config("phi3", config)
    return init_decoder_params(config, seed, dtype, ROPE_GQA)


def forward(params, batch, config: Phi3Config, train: bool = False, rng=None):
    """Mean next-token cross-entropy of a batch, ``(loss, cache)``: Llama's
    (:func:`refmath.models.decoder.forward`); :func:`backward` is Llama's too."""
    check_config("phi3", config)
    return lm_forward(params, batch, config, ROPE_GQA, train, rng)


def logits(params, tokens, config: Phi3Config) -> np.ndarray:
    """Next-token logits ``(B, T, V)`` for int ``tokens`` ``(B, T)``, without dropout or loss."""
    check_config("phi3", config)
    return decoder_logits(params, tokens, config, ROPE_GQA)


def cached_layer(x, params, layer: int, config: Phi3Config, slot, offset: int, *,
                 matmul=matmul_rows_many) -> np.ndarray:
    """Layer ``layer`` on the new rows at positions ``offset..``: Llama's cached step
    (:func:`refmath.models.decoder.family_cached_layer`)."""
    return family_cached_layer(x, params, layer, config, ROPE_GQA, slot, offset, matmul=matmul)


# What the compiled decode layer computes of a Phi3Config, field by field (refmath.models.contract):
# Llama's layers, RoPE's rotation (LongRoPE's included) handed to it by rope_options at each step
COMPILED_FIELDS = {
    "vocab_size": ANY, "max_seq_len": ANY, "d_model": ANY, "n_layers": ANY, "n_heads": ANY,
    "n_kv_heads": ANY, "d_ff": ANY, "norm_eps": ANY, "rope_base": ANY, "rope_layout": ANY,
    "rope_scaling": ANY, "tie_embeddings": ANY,
    "dropout": ANY, "init_std": ANY, "attention_backend": ANY,  # training only
    "sliding_window": (None,),  # not computed: every layer attends to every position
}


def compiled_layer_spec(params, config: Phi3Config):
    """Llama's compiled layers (:func:`refmath.models.decoder.llama_layers_spec`) where every
    field has a value :data:`COMPILED_FIELDS` lists, else None."""
    if type(config) is not Phi3Config:
        return None
    return llama_layers_spec(params, config, COMPILED_FIELDS)


# ---- Hugging Face: one key table, read by params_from_hf and written by to_hf --------------------

HF_MODEL_TYPES = ("phi3",)

# (Hugging Face's name under model.layers.{i}., refmath's names under layers.{i}., stored
# transposed): a fused matrix's rows are the blocks of refmath's names stacked in this order
LAYER_KEYS = (
    ("input_layernorm.weight", ("ln1.gamma",), False),
    ("self_attn.qkv_proj.weight", ("attn.w_q", "attn.w_k", "attn.w_v"), True),
    ("self_attn.o_proj.weight", ("attn.w_o",), True),
    ("post_attention_layernorm.weight", ("ln2.gamma",), False),
    ("mlp.gate_up_proj.weight", ("ffn.w_gate", "ffn.w_up"), True),
    ("mlp.down_proj.weight", ("ffn.w_down",), True),
)
END_KEYS = (("model.embed_tokens.weight", ("tok_emb",), False),
            ("model.norm.weight", ("ln_f.gamma",), False))
# the columns that Hugging Face's "half" RoPE layout permutes within a head
ROTATED = ("attn.w_q", "attn.w_k")


def key_table(config: Phi3Config) -> list:
    """``[(Hugging Face name, refmath names, transposed)]`` of every parameter but ``lm_head``."""
    rows = list(END_KEYS)
    for i in range(config.n_layers):
        rows += [(f"model.layers.{i}.{theirs}", tuple(f"layers.{i}.{n}" for n in ours),
                  transposed) for theirs, ours, transposed in LAYER_KEYS]
    return rows


def config_from_hf(hf: dict) -> Phi3Config:
    """A :class:`Phi3Config` from a ``phi3`` ``config.json``. A rope scaling other than LongRoPE
    (transformers reads Phi-3's legacy ``"su"`` and ``"yarn"`` as LongRoPE), another activation or
    a head width other than ``d / h`` is refused."""
    refuse_common(hf)
    require(hf, "hidden_act", ("silu",), "silu", "refmath's SwiGLU gates with SiLU")
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if hf.get("head_dim") not in (None, d // heads):
        refuse(hf, "head_dim", hf["head_dim"], "Phi-3's heads are hidden_size / "
               "num_attention_heads wide")
    base, scaling = rope_from_hf(hf)
    if scaling is not None and scaling["rope_type"] != "longrope":
        refuse(hf, "rope_parameters.rope_type", scaling["rope_type"], "Phi-3's rope scaling is "
               "LongRoPE ('longrope'), which refmath reads under that name only")
    window = hf.get("sliding_window")  # one that hides nothing is none
    window = int(window) if window and int(window) < int(hf["max_position_embeddings"]) else None
    return Phi3Config(
        vocab_size=int(hf["vocab_size"]), max_seq_len=rope_context(hf, scaling), d_model=d,
        n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads), d_ff=int(hf["intermediate_size"]),
        rope_base=base, rope_layout="half", rope_scaling=scaling, sliding_window=window,
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dropout=0.0)


def params_from_hf(hf: dict, config: Phi3Config, weights) -> dict:
    """Every parameter, read through :func:`key_table`: a fused matrix is split into its blocks'
    columns (after the transpose, ``(d, sum of widths)``)."""
    shapes, params = param_shapes(config), {}
    for theirs, ours, transposed in key_table(config):
        if len(ours) == 1:
            shape = shapes[ours[0]]
            params[ours[0]] = weights.take(theirs, shape[::-1] if transposed else shape,
                                           transpose=transposed)
            continue
        widths = [shapes[name][1] for name in ours]
        fused = weights.take(theirs, (sum(widths), shapes[ours[0]][0]), transpose=True)
        edges = np.cumsum([0] + widths)
        for name, a, b in zip(ours, edges[:-1], edges[1:]):
            params[name] = np.ascontiguousarray(fused[:, a:b])
    take_head(weights, config.tie_embeddings, params, config.vocab_size, config.d_model)
    return params


def to_hf(config: Phi3Config, params: dict):
    """``(config.json fields, {name: tensor})`` of a ``Phi3ForCausalLM``, through the same
    :func:`key_table` the reader reads: each fused matrix the blocks' columns side by side,
    stored transposed; an ``"interleaved"`` RoPE layout is permuted to Hugging Face's
    (:func:`refmath.models.hf_layout.interleaved_to_half`)."""
    check_config("phi3", config)
    rope_parameters, _ = rope_to_hf(config.rope_base, config.rope_scaling)
    scaling = config.rope_scaling
    hf = {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
          "vocab_size": config.vocab_size, "max_position_embeddings": config.max_seq_len,
          "original_max_position_embeddings": config.max_seq_len if scaling is None
          else scaling.original_max_seq_len,
          "hidden_size": config.d_model, "num_hidden_layers": config.n_layers,
          "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads,
          "intermediate_size": config.d_f, "hidden_act": "silu", "rms_norm_eps": config.norm_eps,
          "rope_parameters": rope_parameters, "sliding_window": config.sliding_window,
          "tie_word_embeddings": config.tie_embeddings,
          # its defaults name ids a small vocabulary may not have; a tokenizer saved beside the
          # weights sets them (refmath.hf.save_tokenizer)
          "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}

    def block(name):
        w = params[name]
        return interleaved_to_half(w, config.d_h) if (
            name.endswith(ROTATED) and config.rope_layout == "interleaved") else w

    tensors = {}
    for theirs, ours, transposed in key_table(config):
        w = np.concatenate([block(name) for name in ours], axis=1) if len(ours) > 1 \
            else block(ours[0])
        tensors[theirs] = linear_out(w) if transposed else w
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = linear_out(params["lm_head"])
    return hf, tensors


# ---- gradient-check case -------------------------------------------------------------------------

# Llama's backward on a Phi3Config: LongRoPE's long factors past 4 of the case's 5 tokens, a window
# of 3; init_std ~ 1/sqrt(d): gradients far above the stencil's noise
register_case(ParamCase("phi3", "Phi-3: LongRoPE past 4 tokens, window 3, GQA h=4 g=2",
                        ("M3", "N17", "A12"),
                        model_case_maker(forward, init_params, Phi3Config(
                            vocab_size=11, max_seq_len=8, d_model=16, n_layers=2, n_heads=4,
                            n_kv_heads=2, d_ff=48, init_std=0.25, sliding_window=3,
                            rope_scaling=dict(rope_type="longrope", factor=4.0,
                                              original_max_seq_len=4, short_factor=(1.0, 2.0),
                                              long_factor=(1.5, 5.0))), train=False),
                        backward, max_coords=2, step=2.5e-4))
