r"""The modern decoder-only Transformer (catalogue M3): Pre-RMSNorm, RoPE, GQA, SwiGLU.

A layer maps the residual stream ``x`` (one row per token) to

.. math::
    x' = x + \operatorname{Attn}(\operatorname{RMSNorm}(x)),\qquad
    x'' = x' + \operatorname{SwiGLU}(\operatorname{RMSNorm}(x'))

and the network is token embedding, ``L`` such layers, a final RMSNorm and an output head
(untied by default), followed by the vocabulary softmax inside the cross-entropy. There are no
biases (except, with ``qkv_bias``, on the query, key and value projections, as in Qwen2) and no
learned or fixed position table: positions enter only through the rotation of queries and keys
(RoPE, N10) inside attention. The configuration also reshapes the block (:class:`DecoderConfig`):
attention and FFN side by side on one input (the parallel block of GPT-J, PaLM and Falcon, N21),
norms after the sublayers instead of before them (OLMo 2, N22), LayerNorm for RMSNorm and the plain
GELU FFN for SwiGLU (Falcon).

The attention sublayer is a parameter of the recurrence: an :class:`AttentionOps` bundles its
parameter shapes, its forward/backward pair and the per-layer tensors an inference cache keeps.
This module's attention is RoPE + grouped-query attention (:data:`ROPE_GQA`);
:mod:`refmath.models.mla` reuses everything else here with latent attention in its place.

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
    layers.{i}.ffn.w_up, w_down  (d, d_f), (d_f, d)   the plain FFN's two (ffn_gated False)
    ln_f.gamma                   (d,)
    lm_head                      (d, V)         absent when tie_embeddings (then W = tok_emb^T)

A LayerNorm (``norm="layernorm"``) adds its bias ``.beta`` ``(d,)`` beside every ``.gamma``;
``sandwich_norms`` adds ``layers.{i}.ln1_post`` and ``ln2_post`` (the norms after the sublayers),
``pre_norms`` False removes ``ln1`` and ``ln2``, and a parallel block with one norm has no
``ln2``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from refmath._validate import (check_choice, check_field, check_flag, check_int, check_real,
                               check_window_layers)
from refmath.attention import (ATTENTION_BACKENDS, CausalAttentionCache, causal_attention_backward,
                               causal_attention_forward, causal_attention_kv, merge_heads,
                               split_heads)
from refmath.embedding import EmbeddingCache, embedding_backward, embedding_forward
from refmath.ffn import LinearCache, linear_backward, linear_forward, swiglu_hidden_size
from refmath import ffn as ffn_ops
from refmath import moe as moe_ops
from refmath.moe import MoEConfig, as_moe_config
from refmath.losses import IGNORE_INDEX, CrossEntropyCache, cross_entropy_backward, cross_entropy_forward
from refmath.models import blocks
from refmath.models.blocks import (NORMS, SublayerCache, ffn_backward, ffn_forward, geglu_ffn_backward,
                                   norm_backward, parallel_backward, parallel_forward,
                                   plain_ffn_backward, plain_ffn_forward, post_normed,
                                   post_normed_backward, sublayer_backward, sublayer_forward)
from refmath.models.contract import ANY, allowed
from refmath.models.common import (AttentionOps, CacheSpec, TrainingRecipe, dropout_mask,
                                   prefixed, projections, sub_params)
from refmath.models.hf_layout import (MIXTRAL_EXPERTS, QWEN_MOE_EXPERTS, HFCheckpointError,
                                      interleaved_to_half, join_heads_columns, linear_out, refuse,
                                      refuse_common, require, rope_context, rope_from_hf,
                                      rope_to_hf, split_heads_columns, swiglu_layers_to_hf,
                                      fuse_phi3, take_ends, take_feed_forward_layer, take_head,
                                      take_phi3_layer, take_swiglu)
from refmath.models.params import check_param_dict
from refmath.models.batch import check_lm_batch, check_tokens
from refmath.norms import RMSNormCache, rmsnorm_backward, rmsnorm_forward
from refmath.positions import (ROPE_LAYOUTS, RoPECache, RopeScaling, as_rope_scaling,
                               rope_backward, rope_forward, rope_frequencies_change, rope_inv_freq)
from refmath.registry import OpCase, ParamCase, layer_case_ops, register_case


# ---- configuration -------------------------------------------------------------------------------


def check_shared_fields(config) -> None:
    """Validate the fields every decoder of this family has (M3 and M4 alike); ``moe`` given as a
    dict of its fields is made a :class:`refmath.moe.MoEConfig`."""
    for name in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "ffn_multiple_of"):
        check_field(config, name, check_int, 1)
    check_field(config, "d_ff", check_int, 1, optional=True)
    check_field(config, "rope_base", check_real, 1.0, low_open=True)
    check_field(config, "rope_layout", check_choice, ROPE_LAYOUTS)
    check_field(config, "norm_eps", check_real, 0.0, low_open=True)
    check_field(config, "dropout", check_real, 0.0, 1.0, high_open=True)
    check_field(config, "init_std", check_real, 0.0, low_open=True)
    check_field(config, "tie_embeddings", check_flag)
    check_field(config, "head_dim", check_int, 1, optional=True)
    check_field(config, "attention_backend", check_choice, ATTENTION_BACKENDS)
    # a dict of MoEConfig's fields (asdict's JSON form) becomes a MoEConfig
    object.__setattr__(config, "moe", as_moe_config(config.moe, f"{type(config).__name__}.moe"))
    if config.head_dim is None and config.d_model % config.n_heads:
        raise ValueError(f"{type(config).__name__}.d_model = {config.d_model} is not divisible by "
                         f"n_heads = {config.n_heads}; give head_dim explicitly")


def ffn_width(config) -> int:
    """The FFN's hidden width ``d_f``: ``d_ff`` if given, else, for the gated FFN, ``8d/3`` rounded
    up to a multiple of ``ffn_multiple_of`` (N7, :func:`refmath.ffn.swiglu_hidden_size`), about as
    many parameters as the plain FFN's ``4d`` (N5), which ``ffn_gated = False`` defaults to."""
    if config.d_ff is not None:
        return config.d_ff
    if not config.ffn_gated:
        return 4 * config.d_model
    return swiglu_hidden_size(config.d_model, config.ffn_multiple_of)


@dataclass(frozen=True, kw_only=True)
class FamilyConfig:
    """The fields every decoder of this family has (M3's :class:`DecoderConfig` and M4's
    :class:`refmath.models.mla.MLAConfig`), checked by :func:`check_shared_fields`, and the widths
    both derive from them. Keyword-only, so that each model adds its own fields in any order.

    ``moe`` (a :class:`refmath.moe.MoEConfig`, a dict of its fields, or None) makes the
    feed-forward of the layers it selects (``moe.is_moe_layer``) a mixture of experts (E1-E6); the
    other layers keep the dense SwiGLU of width ``d_f``.
    """

    vocab_size: int
    max_seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    head_dim: int | None = None
    d_ff: int | None = None
    ffn_multiple_of: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    dropout: float = 0.0
    init_std: float = 0.02
    rope_layout: str = "interleaved"
    attention_backend: str = "numpy"
    moe: MoEConfig | None = None

    @property
    def query_key_width(self) -> int:
        """The query/key width per head: ``head_dim``, or ``d_model // n_heads`` by default."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def d_f(self) -> int:
        """The FFN's hidden width (:func:`ffn_width`)."""
        return ffn_width(self)


QK_NORMS = ("head", "projection")  # where QK-norm's RMSNorm runs (N18)
# the FFN's activation: the gate of SwiGLU (N7) or GeGLU (N20), or the nonlinearity of the plain
# two-layer FFN (N5, N6: exact GELU for Falcon, tanh-GELU for GPT-J)
FFN_ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
GATED_ACTIVATIONS = ("silu", "gelu_tanh")
PLAIN_ACTIVATIONS = ("gelu", "gelu_tanh")


@dataclass(frozen=True, kw_only=True)
class DecoderConfig(FamilyConfig):
    r"""Sizes and options of the M3 decoder. ``dataclasses.asdict`` round-trips through JSON.

    ``n_kv_heads`` (``g``) defaults to ``n_heads`` (MHA); ``g = 1`` is MQA, anything between that
    divides ``n_heads`` is GQA (A10). ``head_dim`` (``d_h``) defaults to ``d_model // n_heads`` and
    must be even (RoPE rotates coordinate pairs). ``d_ff`` overrides the SwiGLU width that
    ``ffn_multiple_of`` would give. ``max_seq_len`` is the longest sequence accepted; RoPE itself
    has no table, so it is a contract with the caller rather than a size. ``dropout`` (residual
    dropout on both sublayers' outputs, used only when ``train=True``) is 0 in modern recipes.
    ``init_std`` is the standard deviation of every weight at init (residual outputs scaled by
    ``1/sqrt(2L)``, see :func:`init_params`). ``rope_layout`` is RoPE's pairing of coordinates
    (:func:`refmath.positions.rope_forward`): ``"interleaved"`` or Hugging Face's ``"half"``.
    ``attention_backend`` computes the causal attention of training and evaluation
    (:func:`refmath.attention.causal_attention_forward`): ``"numpy"``, the reference, or ``"cpu"``,
    the FlashAttention kernel (float32 parameters). ``qkv_bias`` adds biases to the query, key and
    value projections (Qwen2's ``x W + b``; the output projection keeps none); they start at 0.
    ``sliding_window`` = ``w`` lets each query see only itself and the ``w - 1`` positions before
    it (A12, Mistral), in training, evaluation and the KV cache alike, on every backend.
    ``rope_scaling`` is a context-extension rule for RoPE's frequencies
    (:class:`refmath.positions.RopeScaling` or a dict of its fields: linear, dynamic NTK, Llama 3.1's
    llama3, YaRN, LongRoPE; N13-N17). ``qk_norm`` RMS-normalises queries and keys before RoPE
    (N18): ``"head"`` over each head's ``d_h`` coordinates with one gain of ``d_h`` shared by the
    heads (Qwen3, Gemma 3), ``"projection"`` over the whole query (``h d_h``) and key (``g d_h``)
    projections (OLMo 2); ``None`` (the default) normalises neither.

    Per-layer attention: with ``window_layers`` (one flag per layer) only the flagged layers slide
    their window of ``sliding_window``, the others attend to every earlier position (Gemma 2's
    alternation, Gemma 3's five local layers per global one, GPT-3's banded and dense layers);
    ``local_rope_base`` gives the sliding layers their own RoPE base, without ``rope_scaling``
    (Gemma 3). Gemma's options: ``norm_offset`` = 1 makes every RMSNorm gain ``1 + gamma`` (the
    stored gain starts at 0); ``embed_scale`` multiplies the embeddings by :math:`\sqrt d` (the
    tied head still reads the unscaled table); ``ffn_activation`` ``"gelu_tanh"`` makes the gated
    FFN a GeGLU; ``query_pre_attn_scalar`` = ``s`` scales the scores by :math:`1/\sqrt s` instead
    of :math:`1/\sqrt{d_h}`; ``attn_softcap`` and ``final_softcap`` = ``c`` cap the attention
    scores and the logits at :math:`c \tanh(x / c)` (Gemma 2); ``sandwich_norms`` adds an RMSNorm
    on each sublayer's output before the residual sum (Gemma 2 and 3).

    The block's shape: ``parallel_block`` makes attention and FFN read the same input and add to
    the residual together, :math:`x' = x + \operatorname{Attn}(N_1(x)) + \operatorname{FFN}(N_2(x))`
    (GPT-J, PaLM, Falcon; N21), with one norm :math:`N_2 = N_1` (``parallel_norms`` = 1: GPT-J,
    PaLM, Falcon-7B) or two (``parallel_norms`` = 2: Falcon-40B's ``ln_attn`` and ``ln_mlp``).
    ``pre_norms`` = False (with ``sandwich_norms``) drops the norms before the sublayers and keeps
    those after them, :math:`x' = x + \operatorname{RMSNorm}(F(x))` (OLMo 2; N22). ``norm`` is every
    layer norm of the blocks and the final one (QK-norm stays RMSNorm): ``"rmsnorm"``,
    ``"layernorm"`` (with its bias ``beta``, Falcon) or ``"layernorm_no_bias"`` (PaLM).
    ``ffn_gated`` = False makes the FFN the plain two-layer one without biases,
    :math:`\phi(x W_1) W_2` with ``ffn_activation`` :math:`\phi` ``"gelu"`` (exact, Falcon) or
    ``"gelu_tanh"`` (GPT-J), of default width ``4 d``.
    """

    n_kv_heads: int | None = None
    qkv_bias: bool = False
    sliding_window: int | None = None
    rope_scaling: RopeScaling | None = None
    qk_norm: str | None = None
    window_layers: tuple | None = None
    local_rope_base: float | None = None
    norm_offset: float = 0.0
    embed_scale: bool = False
    ffn_activation: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sandwich_norms: bool = False
    parallel_block: bool = False
    parallel_norms: int = 1
    pre_norms: bool = True
    norm: str = "rmsnorm"
    ffn_gated: bool = True

    def __post_init__(self):
        check_shared_fields(self)
        check_field(self, "n_kv_heads", check_int, 1, optional=True)
        check_field(self, "qkv_bias", check_flag)
        check_field(self, "sliding_window", check_int, 1, optional=True)
        check_window_layers(self)
        check_field(self, "local_rope_base", check_real, 1.0, low_open=True, optional=True)
        if self.local_rope_base is not None and self.window_layers is None:
            raise ValueError("DecoderConfig.local_rope_base is the RoPE base of the sliding layers "
                             "of window_layers, which is None")
        check_field(self, "norm_offset", check_real)
        check_field(self, "embed_scale", check_flag)
        check_field(self, "ffn_activation", check_choice, FFN_ACTIVATIONS)
        check_field(self, "sandwich_norms", check_flag)
        self._check_block()
        for name in ("query_pre_attn_scalar", "attn_softcap", "final_softcap"):
            check_field(self, name, check_real, 0.0, low_open=True, optional=True)
        object.__setattr__(self, "rope_scaling",
                           as_rope_scaling(self.rope_scaling, "DecoderConfig.rope_scaling"))
        check_field(self, "qk_norm", check_choice, QK_NORMS, optional=True)
        if self.n_heads % self.kv_heads:
            raise ValueError(f"DecoderConfig.n_kv_heads = {self.n_kv_heads} must divide "
                             f"n_heads = {self.n_heads} (each key/value head serves h/g query heads)")
        if self.d_h % 2:
            source = "head_dim" if self.head_dim is not None else "d_model // n_heads"
            raise ValueError(f"DecoderConfig: the head width {source} = {self.d_h} must be even "
                             f"for RoPE's coordinate pairs")

    def _check_block(self) -> None:
        """The fields of the block's shape (its norms, their place, the FFN), and their mixtures
        that no model has."""
        for name in ("parallel_block", "pre_norms", "ffn_gated"):
            check_field(self, name, check_flag)
        check_field(self, "parallel_norms", check_choice, (1, 2))
        check_field(self, "norm", check_choice, NORMS)
        if self.parallel_norms == 2 and not self.parallel_block:
            raise ValueError("DecoderConfig.parallel_norms = 2 gives the FFN of a parallel block "
                             "its own norm; parallel_block is False")
        if self.parallel_block and (self.sandwich_norms or not self.pre_norms):
            raise ValueError("DecoderConfig.parallel_block normalises the block's input only; "
                             f"sandwich_norms = {self.sandwich_norms} and pre_norms = "
                             f"{self.pre_norms} ask for norms after the sublayers")
        if not self.pre_norms and not self.sandwich_norms:
            raise ValueError("DecoderConfig.pre_norms = False moves the norms after the sublayers "
                             "(OLMo 2), which needs sandwich_norms = True")
        allowed = GATED_ACTIVATIONS if self.ffn_gated else PLAIN_ACTIVATIONS
        if self.ffn_activation not in allowed:
            kind = "gated FFN" if self.ffn_gated else "plain FFN (ffn_gated = False)"
            raise ValueError(f"DecoderConfig.ffn_activation = {self.ffn_activation!r} is not one "
                             f"of the {kind}'s: {', '.join(map(repr, allowed))}")

    @property
    def kv_heads(self) -> int:
        """``g``, the number of key/value heads."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def d_h(self) -> int:
        """The head width (queries, keys and values alike)."""
        return self.query_key_width

    @property
    def score_scale(self) -> float:
        r"""The factor of the attention scores: :math:`1/\sqrt{d_h}`, or
        :math:`1/\sqrt{s}` with ``query_pre_attn_scalar`` = ``s``."""
        return (self.d_h if self.query_pre_attn_scalar is None
                else self.query_pre_attn_scalar) ** -0.5


def gain(config, gamma):
    """An RMSNorm's gain as the model applies it: ``gamma``, or ``norm_offset + gamma`` (Gemma
    stores ``w`` and scales by ``1 + w``)."""
    offset = config.norm_offset
    return offset + gamma if offset else gamma


def attention_options(config) -> dict:
    """What a layer's attention is told besides ``q``, ``k``, ``v``: its ``window`` and, where
    the config sets them, Gemma's ``scale`` (``query_pre_attn_scalar``) and ``softcap``."""
    options = {"window": config.sliding_window}
    if config.query_pre_attn_scalar is not None:
        options["scale"] = config.score_scale
    if config.attn_softcap is not None:
        options["softcap"] = config.attn_softcap
    return options


def layer_config(config, layer: int):
    """The configuration layer ``layer`` computes with: ``config`` itself, or, with
    ``window_layers``, ``config`` with that layer's window (``sliding_window`` or None) and RoPE
    (``local_rope_base`` without scaling on a sliding layer). Built once per layer and kept."""
    if config.window_layers is None:
        return config
    return _layer_config(config, layer)


@functools.lru_cache(maxsize=1024)
def _layer_config(config, layer: int):
    slides = config.window_layers[layer]
    fields = dict(window_layers=None, local_rope_base=None,
                  sliding_window=config.sliding_window if slides else None)
    if slides and config.local_rope_base is not None:
        fields.update(rope_base=config.local_rope_base, rope_scaling=None)
    return dataclasses.replace(config, **fields)


# PaLM's block (Chowdhery et al. 2022, Sec. 2): attention and a SwiGLU FFN in parallel on one
# LayerNorm without bias, multi-query attention, no biases anywhere, the output projection shared
# with the input embedding. PaLM's weights were never released, so no checkpoint loads into it;
# refmath.sizing's "palm-540b" counts the published model.
_PALM = dict(parallel_block=True, n_kv_heads=1, norm="layernorm_no_bias", tie_embeddings=True)

PRESETS = {
    # For lessons and quick training runs on a CPU: byte-level vocabulary, GQA with g = h/2.
    "tiny": dict(vocab_size=256, max_seq_len=128, d_model=64, n_layers=2, n_heads=4,
                 n_kv_heads=2, ffn_multiple_of=16),
    # A Llama-recipe network of GPT-2-small size (about 125M parameters, d_f = 2048), not a
    # released checkpoint: 32k vocabulary, d_h = 64, GQA with g = 4 of h = 12.
    "llama-small": dict(vocab_size=32000, max_seq_len=1024, d_model=768, n_layers=12, n_heads=12,
                        n_kv_heads=4, ffn_multiple_of=256, norm_eps=1e-5),
    # PaLM's recipe at the size of "tiny": its SwiGLU is 4d wide (PaLM-540B's 73728 = 4 x 18432)
    "palm-tiny": dict(vocab_size=256, max_seq_len=128, d_model=64, n_layers=2, n_heads=4,
                      d_ff=256, norm_eps=1e-5, **_PALM),
}


def preset(name: str, **overrides) -> DecoderConfig:
    """A named configuration from :data:`PRESETS`, with any field overridden by keyword."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return DecoderConfig(**{**PRESETS[name], **overrides})


# The default of `python -m refmath train` (as GPT's: about 2.5 min on two busy CPU cores).
TRAINING_RECIPE = TrainingRecipe(
    {"name": "chars", "seq_len": 64},
    dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_multiple_of=16),
    steps=1000, batch_size=32, lr=3e-3, tasks=("chars", "reverse-lm"))


# ---- the attention sublayer as a parameter of the recurrence ---------------------------------------


class RoPEAttentionCache(NamedTuple):
    q_proj: LinearCache  # x W_Q (the three projections share their input x)
    k_proj: LinearCache
    v_proj: LinearCache
    q_rope: RoPECache
    k_rope: RoPECache
    attn: CausalAttentionCache  # of the rotated queries and keys, and the values
    out: LinearCache  # [O_1 ... O_h] W_O
    n_heads: int
    q_norm: RMSNormCache | None = None  # QK-norm (N18), when the config has it
    k_norm: RMSNormCache | None = None
    qk_norm: str | None = None
    kv_heads: int | None = None


def rope_attention_shapes(config: DecoderConfig) -> dict:
    d, h, g, d_h = config.d_model, config.n_heads, config.kv_heads, config.d_h
    shapes = {"w_q": (d, h * d_h), "w_k": (d, g * d_h), "w_v": (d, g * d_h), "w_o": (h * d_h, d)}
    if config.qkv_bias:
        shapes.update({"b_q": (h * d_h,), "b_k": (g * d_h,), "b_v": (g * d_h,)})
    if config.qk_norm == "head":
        shapes.update({"q_norm.gamma": (d_h,), "k_norm.gamma": (d_h,)})
    elif config.qk_norm == "projection":
        shapes.update({"q_norm.gamma": (h * d_h,), "k_norm.gamma": (g * d_h,)})
    return shapes


def rope_options(config: DecoderConfig, offset: int, length: int) -> dict:
    """The keyword arguments of :func:`refmath.positions.rope_forward` for rows at positions
    ``offset..`` of a sequence ``length`` tokens long: the plain rotation, or the frequencies and
    attention factor of ``config.rope_scaling`` (N13-N17) at that length."""
    rope = dict(offset=offset, base=config.rope_base, layout=config.rope_layout)
    if config.rope_scaling is not None:
        inv_freq, factor = rope_inv_freq(config.d_h, config.rope_base, config.rope_scaling, length)
        rope.update(inv_freq=inv_freq, attention_factor=factor)
    return rope


def queries_keys(x, params: dict, config: DecoderConfig, offset: int = 0, length: int | None = None):
    r"""The rotated queries ``(B, h, n, d_h)`` and keys ``(B, g, n, d_h)`` of the rows ``x``
    ``(B, n, d)`` at positions ``offset..``, and what their backward needs.

    .. math::
        Q = X W_Q\,[+\,b_Q],\quad \hat Q = \operatorname{RMSNorm}_{\gamma_q}(Q)\ \text{(QK-norm,
        N18)},\quad \tilde Q = m\,\operatorname{RoPE}_{\omega'}(\hat Q)

    and the same for keys; ``length`` (default ``offset + n``) is the sequence length a
    length-dependent rope scaling sees. Returns ``(q, k, caches)`` with ``caches`` the tuple
    ``(q_proj, k_proj, q_norm, k_norm, q_rope, k_rope)``.
    """
    h, g, n = config.n_heads, config.kv_heads, x.shape[-2]
    q, q_proj = linear_forward(x, params["w_q"], params.get("b_q"))
    k, k_proj = linear_forward(x, params["w_k"], params.get("b_k"))
    q_norm = k_norm = None
    if config.qk_norm == "projection":  # OLMo 2: the whole projection, before the heads split
        q, q_norm = rmsnorm_forward(q, gain(config, params["q_norm.gamma"]), config.norm_eps)
        k, k_norm = rmsnorm_forward(k, gain(config, params["k_norm.gamma"]), config.norm_eps)
    q, k = split_heads(q, h), split_heads(k, g)
    if config.qk_norm == "head":  # Qwen3, Gemma 3: each head's d_h coordinates, one shared gain
        q, q_norm = rmsnorm_forward(q, gain(config, params["q_norm.gamma"]), config.norm_eps)
        k, k_norm = rmsnorm_forward(k, gain(config, params["k_norm.gamma"]), config.norm_eps)
    rope = rope_options(config, offset, offset + n if length is None else length)
    q, q_rope = rope_forward(q, **rope)
    k, k_rope = rope_forward(k, **rope)
    return q, k, (q_proj, k_proj, q_norm, k_norm, q_rope, k_rope)


def rope_attention_forward(x, params: dict, config: DecoderConfig):
    r"""Causal self-attention with RoPE and ``g`` shared key/value heads (A1, A2, A6, A10, N10).

    .. math::
        Q = X W_Q\,[+\,b_Q],\ K = X W_K\,[+\,b_K],\ V = X W_V\,[+\,b_V],\qquad
        \tilde Q_r = \operatorname{RoPE}(Q_r),\ \tilde K_u = \operatorname{RoPE}(K_u) \\
        O_r = \operatorname{softmax}\Big(\frac{\tilde Q_r \tilde K_{\pi(r)}^\top}{\sqrt{d_h}}
              + M_{\text{causal}}\Big) V_{\pi(r)},\qquad Y = [O_1 \cdots O_h]\, W_O

    RoPE rotates each head's queries and keys after the projections and before the scores; values
    are never rotated. :func:`refmath.attention.mha_forward` has no place for that rotation, so the
    sublayer is assembled here from the same ops. With ``config.qk_norm`` the queries and keys are
    RMS-normalised before the rotation (N18), and ``config.rope_scaling`` rotates them at rescaled
    frequencies, times its attention factor (N13-N17; :func:`queries_keys`). ``x`` is
    ``(B, T, d)``; returns ``(Y, cache)``.
    """
    h, g = config.n_heads, config.kv_heads
    q, k, (q_proj, k_proj, q_norm, k_norm, q_rope, k_rope) = queries_keys(x, params, config)
    v, v_proj = linear_forward(x, params["w_v"], params.get("b_v"))
    o, attn = causal_attention_forward(q, k, split_heads(v, g), config.attention_backend,
                                       **attention_options(config))
    y, out = linear_forward(merge_heads(o), params["w_o"])
    return y, RoPEAttentionCache(q_proj, k_proj, v_proj, q_rope, k_rope, attn, out, h, q_norm,
                                 k_norm, config.qk_norm, g)


def rope_attention_backward(dy, cache: RoPEAttentionCache):
    r"""Gradients of :func:`rope_attention_forward`: returns ``(dx, {"w_q", "w_k", "w_v", "w_o"})``,
    plus ``"b_q", "b_k", "b_v"`` when the projections have biases.

    The forward in reverse: output projection, attention (A8), the sum over each key/value head's
    group of query heads, the inverse rotation (RoPE's backward), QK-norm's RMSNorm backward (N2,
    its gain's gradient summed over heads and tokens), then the three projections, whose input
    gradients add up because all three read ``x``.
    """
    d_merged, dw_o, _ = linear_backward(dy, cache.out)
    dq, dk, dv = causal_attention_backward(split_heads(d_merged, cache.n_heads), cache.attn)
    dk = rope_backward(dk, cache.k_rope)
    dq = rope_backward(dq, cache.q_rope)
    grads = {}
    if cache.qk_norm == "head":
        dq, grads["q_norm.gamma"] = rmsnorm_backward(dq, cache.q_norm)
        dk, grads["k_norm.gamma"] = rmsnorm_backward(dk, cache.k_norm)
    dq, dk = merge_heads(dq), merge_heads(dk)
    if cache.qk_norm == "projection":
        dq, grads["q_norm.gamma"] = rmsnorm_backward(dq, cache.q_norm)
        dk, grads["k_norm.gamma"] = rmsnorm_backward(dk, cache.k_norm)
    dx_q, dw_q, db_q = linear_backward(dq, cache.q_proj)
    dx_k, dw_k, db_k = linear_backward(dk, cache.k_proj)
    dx_v, dw_v, db_v = linear_backward(merge_heads(dv), cache.v_proj)
    grads.update({"w_q": dw_q, "w_k": dw_k, "w_v": dw_v, "w_o": dw_o})
    if cache.q_proj.has_bias:
        grads.update({"b_q": db_q, "b_k": db_k, "b_v": db_v})
    return dx_q + dx_k + dx_v, grads


def rope_attention_state(cache: RoPEAttentionCache):
    """The layer's ``(k, v)``, each ``(B, g, T, d_h)``, keys already rotated at their positions (K3).

    These are the rows a KV cache stores.
    """
    return causal_attention_kv(cache.attn)


def rope_attention_cached(u, params: dict, config: DecoderConfig, slot, offset: int, **options):
    """M3's attention at inference (K2, K3): the new rows ``u`` ``(B, n, d)`` at positions
    ``offset..`` give queries and keys rotated there; ``slot.attend(q, k, v, offset, window)``
    appends the keys and values to the layer's cache and attends over every cached position (the
    last ``sliding_window`` of them, with a window). Returns
    ``(B, n, d)``.

    QK-norm and a rope scaling (N13-N18) go through :func:`queries_keys`. A length-dependent
    scaling whose frequencies change between ``offset`` and ``offset + n`` tokens makes the cached
    keys stale (they were rotated at other frequencies, K3): that raises ``ValueError``, and
    :func:`cache_stale` lets a decoding loop prefill afresh instead.
    """
    if cache_stale(config, offset, u.shape[-2]):
        raise ValueError(f"rope_scaling {config.rope_scaling.rope_type!r} changes RoPE's "
                         f"frequencies between {offset} and {offset + u.shape[-2]} tokens: the "
                         f"keys cached for positions 0..{offset - 1} are stale; prefill afresh")
    # BEGIN SOLUTION
    if config.qk_norm is not None or config.rope_scaling is not None:
        q, k, _ = queries_keys(u, params, config, offset)
        v = split_heads(linear_forward(u, params["w_v"], params.get("b_v"))[0], config.kv_heads)
        o = slot.attend(q, k, v, offset, **attention_options(config))
        return linear_forward(merge_heads(o), params["w_o"])[0]
    h, g = config.n_heads, config.kv_heads
    rope = dict(offset=offset, base=config.rope_base, layout=config.rope_layout)
    q, k, v = projections(u, params, "qkv")
    q, _ = rope_forward(split_heads(q, h), **rope)
    k, _ = rope_forward(split_heads(k, g), **rope)
    o = slot.attend(q, k, split_heads(v, g), offset, **attention_options(config))
    return linear_forward(merge_heads(o), params["w_o"])[0]
    # END SOLUTION


ROPE_GQA = AttentionOps(rope_attention_shapes, rope_attention_forward, rope_attention_backward,
                        rope_attention_state, rope_attention_cached)


def cache_stale(config, length: int, n: int) -> bool:
    """Whether appending ``n`` rows to a KV cache of ``length`` positions would mix keys rotated at
    different frequencies: true only for a length-dependent ``rope_scaling`` (dynamic NTK,
    LongRoPE) whose frequencies differ between the two lengths
    (:func:`refmath.positions.rope_frequencies_change`)."""
    scaling = config.rope_scaling
    return rope_frequencies_change(scaling, length, length + n)


# ---- parameters ----------------------------------------------------------------------------------

# the projections that write into the residual stream (a mixture of experts' routed and shared ones)
RESIDUAL_OUTPUTS = ("attn.w_o", "ffn.w_down", "ffn.experts.w_down", "ffn.shared.w_down")


def is_moe_layer(config, layer: int) -> bool:
    """Whether layer ``layer``'s feed-forward is ``config.moe``'s mixture of experts."""
    return config.moe is not None and config.moe.is_moe_layer(layer)


def ffn_shapes(config, layer: int) -> dict:
    """``{name: shape}`` of layer ``layer``'s feed-forward, relative to its ``ffn.`` prefix: the
    dense gated FFN's three matrices, the plain FFN's two (``ffn_gated`` False), or the mixture of
    experts' (:func:`refmath.moe.moe_param_shapes`)."""
    if is_moe_layer(config, layer):
        return moe_ops.moe_param_shapes(config.d_model, config.moe)
    d, d_f = config.d_model, config.d_f
    if not config.ffn_gated:
        return {"w_up": (d, d_f), "w_down": (d_f, d)}
    return {"w_gate": (d, d_f), "w_up": (d, d_f), "w_down": (d_f, d)}


def decoder_param_shapes(config, attention: AttentionOps) -> dict:
    """``{name: shape}`` of every parameter of a decoder with the given attention, in order."""
    d, vocab = config.d_model, config.vocab_size
    sandwich, pre = config.sandwich_norms, config.pre_norms
    # a parallel block with one norm has no ln2: its FFN reads ln1's output
    ffn_norm = pre and (not config.parallel_block or config.parallel_norms == 2)
    shapes = {"tok_emb": (vocab, d)}
    for i in range(config.n_layers):
        prefix = f"layers.{i}."
        if pre:
            shapes.update(norm_shapes(config, prefix + "ln1"))
        for name, shape in attention.shapes(config).items():
            shapes[prefix + "attn." + name] = shape
        if sandwich:
            shapes.update(norm_shapes(config, prefix + "ln1_post"))
        if ffn_norm:
            shapes.update(norm_shapes(config, prefix + "ln2"))
        if sandwich:
            shapes.update(norm_shapes(config, prefix + "ln2_post"))
        for name, shape in ffn_shapes(config, i).items():
            shapes[prefix + "ffn." + name] = shape
    shapes.update(norm_shapes(config, "ln_f"))
    if not config.tie_embeddings:
        shapes["lm_head"] = (d, vocab)
    return shapes


def init_decoder_params(config, seed, dtype, attention: AttentionOps) -> dict:
    r"""Draw the parameters of a decoder with the given attention (see :func:`init_params`)."""
    dtype = np.dtype(dtype)
    if not np.issubdtype(dtype, np.floating):
        raise TypeError(f"dtype must be a floating-point type, got {dtype}")
    rng = np.random.default_rng(seed)
    residual_std = config.init_std / math.sqrt(2 * config.n_layers)
    params = {}
    for name, shape in decoder_param_shapes(config, attention).items():
        if name.endswith(".gamma"):  # the applied gain starts at 1 (Gemma's stored w at 0)
            value = np.full(shape, 1.0 - config.norm_offset)
        elif len(shape) == 1:  # biases (a LayerNorm's too), a mixture of experts' selection bias
            value = np.zeros(shape)
        elif name.endswith(RESIDUAL_OUTPUTS):
            value = rng.normal(0.0, residual_std, shape)
        else:
            value = rng.normal(0.0, config.init_std, shape)
        # Drawn in float64 and then cast, so that float32 and float64 parameters share their values.
        params[name] = value.astype(dtype)
    return params


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
    _check_config(config)
    return init_decoder_params(config, seed, dtype, ROPE_GQA)


# ---- blocks: the norms, the residual sublayer, the parallel block, the FFN, a layer -------------


def norm_shapes(config, name: str) -> dict:
    """``{name.gamma: (d,)}`` of the layer norm ``name``, and ``name.beta`` for a LayerNorm with its
    bias."""
    shapes = {name + ".gamma": (config.d_model,)}
    if config.norm == "layernorm":
        shapes[name + ".beta"] = (config.d_model,)
    return shapes


def norm_forward(x, params: dict, name: str, config):
    """The layer norm ``name`` (``"ln1"``, ``"ln_f"``, ...) of ``params`` on the rows ``x``, of the
    kind ``config.norm`` (:func:`refmath.models.blocks.norm_forward`), its gain as :func:`gain`
    applies it. Returns ``(y, cache)``."""
    return blocks.norm_forward(x, config.norm, gain(config, params[name + ".gamma"]),
                               params.get(name + ".beta"), config.norm_eps)


def layer_norm(params: dict, name: str, config) -> Callable:
    """The layer norm ``name`` of ``params`` as a function of the rows: ``x -> (y, cache)``."""
    return lambda x: norm_forward(x, params, name, config)


def layer_ffn_forward(h, params: dict, config, layer: int):
    """Layer ``layer``'s feed-forward branch on the normalised rows ``h``: the dense gated FFN
    (SwiGLU, GeGLU), the plain GELU FFN (``ffn_gated`` False), or the mixture of experts
    (:func:`refmath.moe.moe_forward`) on a layer ``config.moe`` selects. Returns ``(y, cache)``."""
    if is_moe_layer(config, layer):
        return moe_ops.moe_forward(h, params, config.moe)
    activation = config.ffn_activation
    if not config.ffn_gated:
        return plain_ffn_forward(h, params, approximate=activation == "gelu_tanh")
    return ffn_forward(h, params, activation)


class LayerCache(NamedTuple):
    attn: SublayerCache  # its branch cache is the attention's cache
    ffn: SublayerCache  # its branch cache is a SwiGLUCache, or a mixture of experts' cache
    moe: bool = False  # whether the feed-forward was the mixture of experts
    sandwich: bool = False  # whether each branch ended in its own norm (PostNormCache)
    geglu: bool = False  # whether the dense FFN gated with tanh-GELU
    parallel: int = 0  # 0: sequential sublayers; 1 or 2: a parallel block with that many norms
    plain_ffn: bool = False  # whether the dense FFN was the plain GELU one (PlainFFNCache)


def block_forward(x, params: dict, config, attn_branch: Callable, ffn_branch: Callable,
                  drops=(None, None)):
    r"""The residual block around a layer's attention and FFN branches, with the norms where
    ``config`` places them: Pre-norm sublayers one after the other (N2, N4), each branch's output
    normalised too (``sandwich_norms``) or only that (``pre_norms`` False, N22), or a parallel
    block (N21). ``params`` are the layer's (without ``layers.{i}.``); each branch maps rows to
    ``(rows, cache)``. Returns ``(x'', attn, ffn)``, their :class:`SublayerCache`\ s.
    """
    if config.sandwich_norms:
        attn_branch = post_normed(attn_branch, layer_norm(params, "ln1_post", config))
        ffn_branch = post_normed(ffn_branch, layer_norm(params, "ln2_post", config))
    if config.parallel_block:
        ffn_norm = layer_norm(params, "ln2", config) if config.parallel_norms == 2 else None
        return parallel_forward(x, (layer_norm(params, "ln1", config), ffn_norm),
                                (attn_branch, ffn_branch), drops)
    pre = config.pre_norms
    x, attn = sublayer_forward(x, layer_norm(params, "ln1", config) if pre else None, attn_branch,
                               drops[0])
    x, ffn = sublayer_forward(x, layer_norm(params, "ln2", config) if pre else None, ffn_branch,
                              drops[1])
    return x, attn, ffn


def layer_forward(x, params: dict, layer: int, config, attention: AttentionOps,
                  drops=(None, None)):
    r"""Decoder layer ``layer``: :math:`x' = x + \operatorname{Attn}(\operatorname{RMSNorm}(x))`,
    then :math:`x'' = x' + \operatorname{FFN}(\operatorname{RMSNorm}(x'))` with the SwiGLU or, on
    a layer ``config.moe`` selects, the mixture of experts as FFN; the norms and the block's shape
    as ``config`` says (:func:`block_forward`).

    ``params`` are this layer's parameters without the ``layers.{i}.`` prefix; ``drops`` the two
    residual dropout multipliers. Returns ``(x'', cache)``.
    """
    config = layer_config(config, layer)
    attn_params, ffn_params = sub_params(params, "attn"), sub_params(params, "ffn")
    x, attn, ffn = block_forward(
        x, params, config, lambda h: attention.forward(h, attn_params, config),
        lambda h: layer_ffn_forward(h, ffn_params, config, layer), drops)
    moe = is_moe_layer(config, layer)
    plain = not moe and not config.ffn_gated
    geglu = not moe and not plain and config.ffn_activation == "gelu_tanh"
    parallel = config.parallel_norms if config.parallel_block else 0
    return x, LayerCache(attn, ffn, moe, config.sandwich_norms, geglu,
                         parallel, plain)


def layer_backward(dout, cache: LayerCache, attention: AttentionOps):
    """Gradients of :func:`layer_forward`: ``(dx, grads)`` with names relative to ``layers.{i}.``.

    A mixture of experts' backward also carries the gradient of its auxiliary losses, which
    :func:`lm_forward` added to the loss."""
    ffn_back = (moe_ops.moe_backward if cache.moe else plain_ffn_backward if cache.plain_ffn
                else geglu_ffn_backward if cache.geglu else ffn_backward)
    attn_back, post_grads = attention.backward, {}
    if cache.sandwich:
        ffn_back = post_normed_backward(ffn_back, post_grads, "ln2_post")
        attn_back = post_normed_backward(attn_back, post_grads, "ln1_post")
    if cache.parallel:
        dx, norm1, norm2, attn_grads, ffn_grads = parallel_backward(
            dout, cache.attn, cache.ffn, (attn_back, ffn_back), shared=cache.parallel == 1)
    else:
        dx, norm2, ffn_grads = sublayer_backward(dout, cache.ffn, ffn_back)
        dx, norm1, attn_grads = sublayer_backward(dx, cache.attn, attn_back)
    grads = {**prefixed("ln1", norm1), **prefixed("attn", attn_grads), **prefixed("ln2", norm2),
             **prefixed("ffn", ffn_grads), **post_grads}
    return dx, grads


# ---- the whole network ---------------------------------------------------------------------------


class DecoderCache(NamedTuple):
    attention: AttentionOps  # which attention ran, so that backward needs only the cache
    emb: EmbeddingCache
    layers: tuple  # one LayerCache per layer
    norm_f: object  # the final norm's cache (RMSNorm's or LayerNorm's)
    head: LinearCache  # its weight is lm_head, or tok_emb^T when tied
    tied: bool
    loss: CrossEntropyCache | None  # None when the cache came from a logits-only pass
    embed_scale: np.ndarray | None = None  # sqrt(d) times the embeddings (Gemma), or None
    softcap: object = None  # the final logits' soft-capping cache (Gemma 2), or None


def _dropout_masks(rng, shape, p: float, dtype, n_layers: int):
    """Two inverted-dropout multipliers per layer (attention and FFN outputs), drawn in order."""
    if rng is None:
        raise ValueError(f"train=True with dropout = {p} needs rng (a numpy.random.Generator) "
                         f"to draw the dropout masks")
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")

    return [(dropout_mask(rng, shape, p, dtype), dropout_mask(rng, shape, p, dtype))
            for _ in range(n_layers)]


def decoder_forward(params, tokens, config, attention: AttentionOps, train=False, rng=None):
    r"""Logits of a decoder of this family for checked ``tokens`` ``(B, T)``: ``(z, cache)``.

    .. math::
        x^{(0)} = E[a],\qquad x^{(\ell)} = \operatorname{Layer}_\ell(x^{(\ell-1)}),\qquad
        z = \operatorname{RMSNorm}(x^{(L)})\, W_{\text{out}}

    with :math:`W_{\text{out}}` = ``lm_head`` or :math:`E^\top` when tied. ``z`` is ``(B, T, V)``.
    Residual dropout masks are drawn from ``rng`` only when ``train`` and ``config.dropout > 0``.
    """
    table = params["tok_emb"]
    drops = [(None, None)] * config.n_layers
    if train and config.dropout > 0:
        shape = tokens.shape + (config.d_model,)
        drops = _dropout_masks(rng, shape, config.dropout, table.dtype, config.n_layers)
    x, emb = embedding_forward(tokens, table)
    scale = embedding_scale(config, table.dtype)
    if scale is not None:
        x = x * scale
    layers = []
    for i in range(config.n_layers):
        x, layer = layer_forward(x, sub_params(params, f"layers.{i}"), i, config, attention,
                                 drops[i])
        layers.append(layer)
    x, norm_f = norm_forward(x, params, "ln_f", config)
    w_out = table.T if config.tie_embeddings else params["lm_head"]
    z, head = linear_forward(x, w_out)
    cap = None
    if config.final_softcap is not None:
        z, cap = ffn_ops.softcap_forward(z, config.final_softcap)
    return z, DecoderCache(attention, emb, tuple(layers), norm_f, head, config.tie_embeddings, None,
                           scale, cap)


def embedding_scale(config, dtype):
    r"""The factor of the embeddings, :math:`\sqrt d` in the parameters' dtype (Gemma), or None."""
    if not config.embed_scale:
        return None
    return np.asarray(math.sqrt(config.d_model), dtype=dtype)


def decoder_backward(dz, cache: DecoderCache) -> dict:
    """Gradients of :func:`decoder_forward` given ``dz = dloss/dlogits``: a dict keyed like params.

    With tied embeddings the table gets both its lookup gradient and the head's (transposed).
    """
    if cache.softcap is not None:
        dz = ffn_ops.softcap_backward(dz, cache.softcap)
    dx, dw_out, _ = linear_backward(dz, cache.head)
    dx, norm_grads = norm_backward(dx, cache.norm_f)
    grads = prefixed("ln_f", norm_grads)
    for i in reversed(range(len(cache.layers))):
        dx, layer_grads = layer_backward(dx, cache.layers[i], cache.attention)
        grads.update(prefixed(f"layers.{i}", layer_grads))
    if cache.embed_scale is not None:
        dx = dx * cache.embed_scale
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
    loss, ce = cross_entropy_forward(z, targets, ignore_index=IGNORE_INDEX, loss_mask=loss_mask)
    if config.moe is not None:
        loss = (loss + moe_aux_loss(cache)).astype(loss.dtype)
    return loss, cache._replace(loss=ce)


def moe_aux_loss(cache: DecoderCache) -> float:
    """The auxiliary losses of every mixture-of-experts layer of a forward pass, summed (E5)."""
    return sum(float(layer.ffn.branch.aux_loss) for layer in cache.layers if layer.moe)


def expert_loads(cache: DecoderCache) -> dict:
    """``{layer: tokens routed to each expert}`` of a forward pass's mixture-of-experts layers:
    what a training log plots, and what DeepSeek-V3's bias balancing reads (E6)."""
    return {i: layer.ffn.branch.load for i, layer in enumerate(cache.layers) if layer.moe}


def layer_states(cache: DecoderCache) -> list:
    """Per layer, the tensors an inference cache keeps, as the attention defines them."""
    return [cache.attention.state(layer.attn.branch) for layer in cache.layers]


# ---- the M3 model: the contract's functions --------------------------------------------------------


def _check_config(config) -> None:
    if type(config) is not DecoderConfig:  # exactly: a subclass may add fields this file ignores
        raise TypeError(f"config must be a DecoderConfig (exactly that class, not a subclass), "
                        f"got {type(config).__name__}")


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
    _check_config(config)
    return lm_forward(params, batch, config, ROPE_GQA, train, rng)


def backward(cache: DecoderCache) -> dict:
    """Gradients of the loss of :func:`forward` with respect to every parameter (same keys).

    Works for any decoder of this family (M4 too): the cache records which attention ran.
    """
    if cache.loss is None:
        raise ValueError("this cache has no loss: backward needs the cache of forward(...)")
    return decoder_backward(cross_entropy_backward(1.0, cache.loss), cache)


def logits(params, tokens, config: DecoderConfig) -> np.ndarray:
    """Next-token logits ``(B, T, V)`` for int ``tokens`` ``(B, T)``, without dropout or loss."""
    _check_config(config)
    check_params(params, config, ROPE_GQA)
    tokens = check_tokens("tokens", tokens, config)
    return decoder_forward(params, tokens, config, ROPE_GQA)[0]


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
    shape = (config.n_layers, batch, config.kv_heads, max_len, config.d_h)
    windows = tuple(layer_config(config, i).sliding_window for i in range(config.n_layers))
    return CacheSpec("kv", (shape, shape),
                     windows=windows if any(w is not None for w in windows) else None)


def embed(params, tokens, config, offset: int) -> np.ndarray:
    """The new rows' embeddings ``(B, n, d)``; positions enter through RoPE only, so ``offset``
    changes nothing here."""
    x = embedding_forward(tokens, params["tok_emb"])[0]
    scale = embedding_scale(config, x.dtype)
    return x if scale is None else x * scale


def head(params, x, config) -> np.ndarray:
    """Final norm and output projection of the new rows: logits ``(B, n, V)``."""
    x, _ = norm_forward(x, params, "ln_f", config)
    w_out = params["tok_emb"].T if config.tie_embeddings else params["lm_head"]
    z = linear_forward(x, w_out)[0]
    if config.final_softcap is not None:
        z = ffn_ops.softcap_forward(z, config.final_softcap)[0]
    return z


def family_cached_layer(x, params, layer: int, config, attention: AttentionOps, slot, offset: int,
                        **options) -> np.ndarray:
    """Layer ``layer`` on the new rows ``x`` ``(B, n, d)`` at positions ``offset..``: the residual
    block of :func:`layer_forward`, with the attention's cached step (``attention.cached``)
    reading and extending the layer's cache through ``slot``. ``options`` go to that step."""
    config = layer_config(config, layer)
    p = sub_params(params, f"layers.{layer}")
    w, ffn = sub_params(p, "attn"), sub_params(p, "ffn")

    def attn_branch(u):
        return attention.cached(u, w, config, slot, offset, **options), None

    def ffn_branch(u):
        return layer_ffn_forward(u, ffn, config, layer)

    return block_forward(x, p, config, attn_branch, ffn_branch)[0]


def cached_layer(x, params, layer: int, config: DecoderConfig, slot, offset: int) -> np.ndarray:
    """One M3 layer at inference (see :func:`family_cached_layer`)."""
    return family_cached_layer(x, params, layer, config, ROPE_GQA, slot, offset)



# What the compiled decode layer (refmath.kernels.decode_layers, with this file's embed, head and
# rope_options around it) computes, field by field: any value of a field marked ANY, the listed
# values of the others. Anything else, and any field added to DecoderConfig without an entry here
# (refmath.models.contract checks that at import), keeps the NumPy step.
COMPILED_FIELDS = {
    # sizes, handed to the kernel as its shape (d_f from d_ff or ffn_multiple_of)
    "vocab_size": ANY, "max_seq_len": ANY, "d_model": ANY, "n_layers": ANY, "n_heads": ANY,
    "n_kv_heads": ANY, "head_dim": ANY, "d_ff": ANY, "ffn_multiple_of": ANY,
    # the norms: RMSNorm or LayerNorm (with or without its shift), eps, the gain as gain() applies it
    "norm": ANY, "norm_eps": ANY, "norm_offset": ANY,
    # RoPE: the rotation at each position comes from rope_options (a rope scaling included; a
    # length-dependent one is refused at a step where it changes, see cache_stale)
    "rope_base": ANY, "rope_layout": ANY, "rope_scaling": ANY,
    # attention: biases, and the score scale (query_pre_attn_scalar) as score_scale gives it
    "qkv_bias": ANY, "query_pre_attn_scalar": ANY,
    # the FFN: SwiGLU, or the plain FFN with exact or tanh GELU (not GeGLU)
    "ffn_gated": ANY,
    "ffn_activation": lambda config: not config.ffn_gated or config.ffn_activation == "silu",
    # outside the layers: embed (embed_scale) and head (tied table, final_softcap) run in NumPy
    "tie_embeddings": ANY, "embed_scale": ANY, "final_softcap": ANY,
    # training only: no decode step reads them
    "dropout": ANY, "init_std": ANY, "attention_backend": ANY,
    # the block: pre-norm sequential sublayers only
    "pre_norms": (True,), "sandwich_norms": (False,), "parallel_block": (False,),
    "parallel_norms": (1,),
    # not computed: every layer attends to every position with one dense FFN, no QK-norm, no cap
    "moe": (None,), "qk_norm": (None,), "sliding_window": (None,), "window_layers": (None,),
    "local_rope_base": (None,), "attn_softcap": (None,),
}


def compiled_layer_spec(params, config: DecoderConfig):
    """What :mod:`refmath.inference.compiled_step` runs of this model's layers in one compiled
    call (:func:`refmath.kernels.decode_layers`): ``(shape, layers)``, the sizes and options, and
    each layer's arrays by the kernel's names. None unless every field of ``config`` has a value
    :data:`COMPILED_FIELDS` lists (pre-norm sequential layers: RMSNorm or LayerNorm, SwiGLU or the
    plain GELU FFN, optional query/key/value biases, RoPE with or without a rope scaling). The
    gains are as :func:`gain` applies them and the score scale as :func:`attention_options` gives
    it; RoPE's rotation (with a rope scaling) is the caller's, at each position."""
    if type(config) is not DecoderConfig or not allowed(config, COMPILED_FIELDS):
        return None
    plain_ffn = not config.ffn_gated
    layers = []
    for i in range(config.n_layers):
        p = sub_params(params, f"layers.{i}")
        layer = {"norm1_gain": gain(config, p["ln1.gamma"]),
                 "norm2_gain": gain(config, p["ln2.gamma"])}
        if config.norm == "layernorm":
            layer.update(norm1_shift=p["ln1.beta"], norm2_shift=p["ln2.beta"])
        names = ("w_q", "w_k", "w_v", "w_o") + (("b_q", "b_k", "b_v") if config.qkv_bias else ())
        layer.update({name: p[f"attn.{name}"] for name in names})
        ffn_names = ("w_up", "w_down") if plain_ffn else ("w_gate", "w_up", "w_down")
        layer.update({name: p[f"ffn.{name}"] for name in ffn_names})
        layers.append(layer)
    if not plain_ffn:
        ffn = "swiglu"
    else:
        ffn = "gelu_tanh" if config.ffn_activation == "gelu_tanh" else "gelu_exact"
    shape = dict(d_model=config.d_model, heads=config.n_heads, kv_heads=config.kv_heads,
                 head_dim=config.d_h, d_ff=config.d_f,
                 norm="rms" if config.norm == "rmsnorm" else "layer", eps=config.norm_eps,
                 ffn=ffn, rope=config.rope_layout, scale=config.score_scale)
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
                qk_norm=config.qk_norm, moe=config.moe, norm=config.norm,
                mlp=(("geglu" if config.ffn_activation == "gelu_tanh" else "swiglu")
                     if config.ffn_gated else "gelu"),  # "gelu": the plain 2 d d_f FFN
                norms_per_layer=(config.parallel_norms if config.parallel_block else
                                 2 * config.pre_norms + 2 * config.sandwich_norms))


# ---- Hugging Face: llama, mistral, qwen2, qwen3, their mixtures of experts, gemma, olmo2, phi3 ----

# RoPE in the "half" layout; any of them with a rope scaling (N13-N17), qwen3 with QK-norm (N18);
# mixtral, qwen2_moe and qwen3_moe with mixture-of-experts feed-forwards (E1-E4);
# gemma, gemma2 and gemma3_text with Gemma's options; olmo2 with its norms after the sublayers
# and QK-norm on the projections; phi3 with its fused projections and LongRoPE; falcon with its
# parallel block of LayerNorms and its plain GELU MLP (its own section below)
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe",
                  "gemma", "gemma2", "gemma3_text", "olmo2", "phi3", "falcon")
GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
_EXPERT_LAYOUTS = {"mixtral": MIXTRAL_EXPERTS, "qwen2_moe": QWEN_MOE_EXPERTS,
                   "qwen3_moe": QWEN_MOE_EXPERTS}


def _hf_window(hf: dict) -> int | None:
    """Mistral's, Mixtral's and Phi-3's sliding window (every layer's), or None where it masks
    nothing."""
    window = hf.get("sliding_window")
    if hf["model_type"] not in ("mistral", "mixtral", "phi3") or not window:
        return None
    return int(window) if int(window) < int(hf["max_position_embeddings"]) else None


QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


def _qwen_windows(hf: dict) -> tuple:
    """``(sliding_window, window_layers)`` of a Qwen config: its window on the layers
    ``layer_types`` marks ``"sliding_attention"`` (as transformers derives them when the file has
    none: Qwen2 and Qwen3 slide the layers from ``max_window_layers`` on, Qwen2-MoE the even ones
    below it), on every layer of a Qwen3-MoE (whose attention reads no layer types), or
    ``(None, None)`` without ``use_sliding_window`` or where the window hides nothing."""
    window = hf.get("sliding_window")
    if not hf.get("use_sliding_window") or not window:
        return None, None
    window, layers, kind = int(window), int(hf["num_hidden_layers"]), hf["model_type"]
    if window >= rope_context(hf, rope_from_hf(hf)[1]):
        return None, None
    if kind == "qwen3_moe":
        return window, None
    first = int(hf.get("max_window_layers", 28))
    types = hf.get("layer_types") or [
        "sliding_attention" if (i >= first if kind != "qwen2_moe" else i < first and i % 2 == 0)
        else "full_attention" for i in range(layers)]
    if set(types) - {"sliding_attention", "full_attention"} or len(types) != layers:
        refuse(hf, "layer_types", types, "refmath reads one sliding_attention or full_attention "
               "per layer")
    slides = tuple(t == "sliding_attention" for t in types)
    if not any(slides):
        return None, None
    return window, None if all(slides) else slides


def _moe_from_hf(hf: dict) -> MoEConfig | None:
    """The mixture of experts of a mixtral, qwen2_moe or qwen3_moe config (None for the others).

    Mixtral renormalises its top-k softmax scores; the Qwen MoEs do so with ``norm_topk_prob``,
    and Qwen2-MoE adds one shared expert behind a sigmoid gate. The auxiliary-loss coefficient is a
    training choice, and transformers adds its loss (over all layers' routers at once) only with
    ``output_router_logits``: a loaded model's loss is the cross-entropy alone (``balance_coef``
    0).
    """
    kind = hf["model_type"]
    if kind not in _EXPERT_LAYOUTS:
        return None
    n = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
    if n < 1:
        refuse(hf, "num_local_experts", n, f"a {kind} checkpoint needs routed experts")
    moe = dict(n_experts=n, top_k=int(hf["num_experts_per_tok"]))
    if kind == "mixtral":
        if float(hf.get("router_jitter_noise") or 0.0):
            refuse(hf, "router_jitter_noise", hf["router_jitter_noise"], "refmath's router adds "
                   "no noise to its input (transformers does it only while training)")
        return MoEConfig(**moe, d_expert=int(hf["intermediate_size"]), norm_topk=True)
    step, only = int(hf.get("decoder_sparse_step", 1)), sorted(hf.get("mlp_only_layers") or [])
    if step != 1:
        refuse(hf, "decoder_sparse_step", step, "refmath places experts on every layer from "
               "its dense first ones on (decoder_sparse_step 1)")
    if only != list(range(len(only))):
        refuse(hf, "mlp_only_layers", only, "refmath's dense layers are the first ones")
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if kind == "qwen2_moe" else 0
    return MoEConfig(**moe, d_expert=int(hf["moe_intermediate_size"]),
                     norm_topk=bool(hf.get("norm_topk_prob", False)), first_dense=len(only),
                     d_shared=shared, shared_gate=shared > 0)


def _gemma_from_hf(hf: dict) -> dict:
    r"""The DecoderConfig fields of a gemma, gemma2 or gemma3_text config (none for the others).

    Every Gemma scales its norms by ``1 + w`` and its embeddings by :math:`\sqrt d`, and gates
    its FFN with tanh-GELU (Gemma 1's legacy ``hidden_act="gelu"`` meant that too, as transformers
    reads it). Gemma 2 and 3 add the sandwich norms, ``query_pre_attn_scalar`` and local layers
    (``layer_types``, or the released alternation when absent); Gemma 2 caps its scores and logits,
    Gemma 3 normalises each head's queries and keys and gives its local layers their own RoPE.
    """
    kind = hf["model_type"]
    if kind not in GEMMA_TYPES:
        return {}
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu") or (act == "gelu" and kind != "gemma"):
        refuse(hf, "hidden_activation", act, "refmath's GeGLU gates with tanh-GELU")
    fields = dict(norm_offset=1.0, embed_scale=True, ffn_activation="gelu_tanh",
                  tie_embeddings=bool(hf.get("tie_word_embeddings", True)))
    if kind == "gemma":
        return fields
    if hf.get("use_bidirectional_attention"):
        refuse(hf, "use_bidirectional_attention", True, "refmath's decoder is causal")
    layers = int(hf["num_hidden_layers"])
    pattern = 2 if kind == "gemma2" else int(hf.get("sliding_window_pattern",
                                                     hf.get("_sliding_window_pattern", 6)))
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else
                                      "full_attention" for i in range(layers)]
    slides = tuple(t == "sliding_attention" for t in types)
    if set(types) - {"sliding_attention", "full_attention"} or len(types) != layers:
        refuse(hf, "layer_types", types, "refmath reads one sliding_attention or full_attention "
               "per layer")
    fields.update(sandwich_norms=True,
                  query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or
                                              int(hf.get("head_dim") or 256)),
                  attn_softcap=hf.get("attn_logit_softcapping"),
                  final_softcap=hf.get("final_logit_softcapping"))
    if any(slides):
        fields.update(sliding_window=int(hf["sliding_window"]),
                      window_layers=None if all(slides) else slides)
    if kind == "gemma3_text":
        fields["qk_norm"] = "head"
        rope = hf.get("rope_parameters") or {}
        if "sliding_attention" in rope:  # transformers 5: one rope per layer type
            local = rope_from_hf({**hf, "rope_parameters": rope["sliding_attention"]})
            fields["rope"] = rope_from_hf({**hf, "rope_parameters": rope["full_attention"]})
        else:
            local = (float(hf.get("rope_local_base_freq", 10000.0)), None)
            fields["rope"] = rope_from_hf(hf)
        if local[1] is not None:
            refuse(hf, "rope_parameters.sliding_attention", rope["sliding_attention"],
                   "refmath's local layers rotate at their own base without a scaling")
        if fields.get("window_layers") is not None:
            fields["local_rope_base"] = local[0]
        elif all(slides):  # every layer is local: the local rope is the rope
            fields["rope"] = local
    return fields


def config_from_hf(hf: dict) -> DecoderConfig:
    kind = hf["model_type"]
    refuse_common(hf, experts=kind in _EXPERT_LAYOUTS, softcap=kind in ("gemma2", "gemma3_text"))
    if kind == "falcon":
        return _falcon_from_hf(hf)
    gemma = _gemma_from_hf(hf)
    if not gemma:
        require(hf, "hidden_act", ("silu",), "silu", "refmath's SwiGLU gates with SiLU")
    if kind not in ("qwen2", "qwen2_moe"):
        require(hf, "attention_bias", (False,), False, "refmath's decoder has no bias on the "
                 "output projection (q/k/v biases alone are Qwen2's)")
    require(hf, "mlp_bias", (False,), False, "refmath's SwiGLU has no biases")
    heads = int(hf["num_attention_heads"])
    base, scaling = gemma.pop("rope", None) or rope_from_hf(hf)
    qkv_bias = kind == "qwen2" or (kind == "qwen2_moe" and bool(hf.get("qkv_bias", True)))
    fields = dict(qk_norm="head" if kind in ("qwen3", "qwen3_moe") else None,
                  tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                  sliding_window=_hf_window(hf))
    if kind in QWEN_TYPES:
        fields["sliding_window"], fields["window_layers"] = _qwen_windows(hf)
    fields.update(gemma)
    if kind == "olmo2":  # RMSNorm after each sublayer (none before), QK-norm on the projections
        fields.update(qk_norm="projection", sandwich_norms=True, pre_norms=False)
    return DecoderConfig(rope_scaling=scaling, moe=_moe_from_hf(hf), **fields,
        vocab_size=int(hf["vocab_size"]), max_seq_len=rope_context(hf, rope_from_hf(hf)[1]),
        d_model=int(hf["hidden_size"]), n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        d_ff=int(hf["intermediate_size"]), rope_base=base,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), dropout=0.0,
        rope_layout="half", qkv_bias=qkv_bias)


def params_from_hf(hf: dict, config: DecoderConfig, weights) -> dict:
    if hf["model_type"] == "falcon":
        return _falcon_params(config, weights)
    d = config.d_model
    widths = {"q": config.n_heads * config.d_h, "k": config.kv_heads * config.d_h,
              "v": config.kv_heads * config.d_h}
    params = {}
    for i in range(config.n_layers):
        h, p = f"model.layers.{i}.", f"layers.{i}."
        if hf["model_type"] == "phi3":  # its fused qkv_proj and gate_up_proj
            take_phi3_layer(weights, params, h, p, config)
            continue
        for name, width in widths.items():
            params[p + f"attn.w_{name}"] = weights.take(h + f"self_attn.{name}_proj.weight",
                                                        (width, d), transpose=True)
            if config.qkv_bias:
                params[p + f"attn.b_{name}"] = weights.take(h + f"self_attn.{name}_proj.bias",
                                                            (width,))
        params[p + "attn.w_o"] = weights.take(h + "self_attn.o_proj.weight", (d, widths["q"]),
                                              transpose=True)
        if config.qk_norm == "head":  # qwen3's q_norm and k_norm, one (d_h,) gain each
            for name in ("q", "k"):
                params[p + f"attn.{name}_norm.gamma"] = weights.take(
                    h + f"self_attn.{name}_norm.weight", (config.d_h,))
        elif config.qk_norm == "projection":  # olmo2's, over the whole projections
            for name in ("q", "k"):
                params[p + f"attn.{name}_norm.gamma"] = weights.take(
                    h + f"self_attn.{name}_norm.weight", (widths[name],))
        if not config.pre_norms:  # OLMo 2: its post_attention_layernorm is the attention's output
            for ours, theirs in (("ln1_post", "post_attention_layernorm"),
                                 ("ln2_post", "post_feedforward_layernorm")):
                params[p + ours + ".gamma"] = weights.take(h + theirs + ".weight", (d,))
            take_swiglu(weights, params, h, p, d, config.d_f)
        elif config.sandwich_norms:  # Gemma 2/3: post_attention_layernorm is the attention's output
            names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm")
            for ours, theirs in zip(("ln1", "ln1_post", "ln2", "ln2_post"), names):
                params[p + ours + ".gamma"] = weights.take(h + theirs + ".weight", (d,))
            take_swiglu(weights, params, h, p, d, config.d_f)
        else:
            take_feed_forward_layer(weights, params, h, p, config, i,
                                    _EXPERT_LAYOUTS.get(hf["model_type"]))
        # Older Llama files store RoPE's frequencies as a buffer: derived from rope_theta.
        if weights.has(h + "self_attn.rotary_emb.inv_freq"):
            weights.skip(h + "self_attn.rotary_emb.inv_freq")
    take_ends(weights, params, config)
    return params


def _moe_kind(config: DecoderConfig) -> str:
    """The Hugging Face type a decoder with a mixture of experts is written as: qwen2_moe (a gated
    shared expert), qwen3_moe (QK-norm) or mixtral; what none of them holds is refused."""
    moe = config.moe

    def refuse_moe(field, why):
        raise HFCheckpointError(f"a decoder with moe.{field} = {getattr(moe, field)!r} has no "
                                f"Hugging Face counterpart here: {why}")

    for field, plain, why in (("scoring", "softmax", "mixtral and the Qwen MoEs score by softmax"),
                              ("routing", "greedy", "mixtral and the Qwen MoEs route greedily"),
                              ("scaling", 1.0, "mixtral and the Qwen MoEs do not scale the gates"),
                              ("score_bias", False, "only deepseek_v3 biases the choice"),
                              ("every", 1, "mixtral and the Qwen MoEs put experts on every layer")):
        if getattr(moe, field) != plain:
            refuse_moe(field, why)
    if moe.shared_width and not moe.shared_gate:
        refuse_moe("n_shared", "only deepseek's shared experts are ungated (write it as mla)")
    if moe.shared_gate:
        if config.qk_norm or config.sliding_window:
            refuse_moe("shared_gate", "qwen2_moe has no QK-norm and slides only some layers")
        return "qwen2_moe"
    if config.qkv_bias:
        raise HFCheckpointError("a decoder with q/k/v biases and experts is written as "
                                "qwen2_moe, which also needs its gated shared expert "
                                "(moe.shared_gate)")
    if config.qk_norm:
        if config.sliding_window:
            raise HFCheckpointError("qwen3_moe slides only some layers; this config has "
                                    f"sliding_window = {config.sliding_window} on every layer")
        return "qwen3_moe"
    if not moe.norm_topk:
        refuse_moe("norm_topk", "mixtral renormalises its top-k scores")
    if moe.first_dense:
        refuse_moe("first_dense", "mixtral has no dense layers")
    return "mixtral"


def _gemma_kind(config: DecoderConfig) -> str | None:
    """gemma, gemma2 or gemma3_text for a config with Gemma's options (None without any of them);
    a mixture of Gemma's options and others no Gemma has is refused."""
    options = dict(norm_offset=config.norm_offset != 0.0, embed_scale=config.embed_scale,
                   ffn_activation=config.ffn_activation != "silu",
                   sandwich_norms=config.sandwich_norms,
                   query_pre_attn_scalar=config.query_pre_attn_scalar is not None,
                   attn_softcap=config.attn_softcap is not None,
                   final_softcap=config.final_softcap is not None,
                   local_rope_base=config.local_rope_base is not None)
    if not any(options.values()):
        return None
    kind = ("gemma3_text" if config.qk_norm == "head" else "gemma2" if config.sandwich_norms
            else "gemma")
    needed = dict(norm_offset=1.0, embed_scale=True, ffn_activation="gelu_tanh",
                  tie_embeddings=True, moe=None, qkv_bias=False)
    if kind == "gemma":
        needed.update(query_pre_attn_scalar=None, attn_softcap=None, final_softcap=None,
                      sliding_window=None)
    else:
        needed.update(sandwich_norms=True, qk_norm="head" if kind == "gemma3_text" else None)
    for field, value in needed.items():
        if getattr(config, field) != value:
            raise HFCheckpointError(f"a decoder with Gemma's options is written as {kind}, which "
                                    f"needs {field} = {value!r}; this config has "
                                    f"{getattr(config, field)!r}")
    return kind


def _gemma_to_hf(config: DecoderConfig, kind: str, hf: dict) -> None:
    """The fields a gemma, gemma2 or gemma3_text config adds to the Llama ones in ``hf``."""
    if kind == "gemma":
        hf.update(hidden_act="gelu_pytorch_tanh", attention_bias=False)
        return
    slides = config.window_layers or (config.sliding_window is not None,) * config.n_layers
    hf.pop("hidden_act")
    scalar = (config.d_h if config.query_pre_attn_scalar is None
              else config.query_pre_attn_scalar)
    hf.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False,
              # transformers' Gemma configs take an integer where it is one
              query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
              attn_logit_softcapping=config.attn_softcap,
              final_logit_softcapping=config.final_softcap,
              sliding_window=config.sliding_window or config.max_seq_len,
              layer_types=["sliding_attention" if f else "full_attention" for f in slides])
    if kind == "gemma3_text":
        local = config.rope_base if config.local_rope_base is None else config.local_rope_base
        hf.update(use_bidirectional_attention=False, rope_parameters={
            "full_attention": hf["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": local}})


_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                  "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "gemma": "GemmaForCausalLM",
                  "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                  "olmo2": "Olmo2ForCausalLM", "phi3": "Phi3ForCausalLM"}


def _llama_kind(config: DecoderConfig) -> str:
    """The Hugging Face type of a decoder without Gemma's options: llama, mistral (a window),
    qwen2 (q/k/v biases), qwen3 (QK-norm), phi3 (LongRoPE) or, with experts, mixtral or a Qwen
    MoE. Qwen2 and Qwen3 slide their window on the layers their ``layer_types`` name, so they
    take a window on every layer or on some (``window_layers``)."""
    if config.moe is not None:
        if config.window_layers is not None:
            raise HFCheckpointError("a decoder with experts is written here with one window for "
                                    "every layer or none; this config has window_layers = "
                                    f"{config.window_layers}")
        return _moe_kind(config)
    if config.qk_norm and config.qkv_bias:
        raise HFCheckpointError("a decoder with qk_norm is written as qwen3, which has no q/k/v "
                                "biases without an output bias; this config has qkv_bias = True")
    if config.window_layers is not None and not (config.qk_norm or config.qkv_bias):
        raise HFCheckpointError("window_layers (a window on some layers only) is written as "
                                "qwen2 (with qkv_bias), qwen3 (with qk_norm), or gemma2 and "
                                "gemma3_text (with Gemma's other options)")
    if (config.rope_scaling is not None and config.rope_scaling.rope_type == "longrope"
            and not config.qk_norm and not config.qkv_bias
            and config.d_h * config.n_heads == config.d_model):
        return "phi3"  # LongRoPE's home; phi3 sizes its factors by d_model / n_heads, else llama
    return ("qwen3" if config.qk_norm else "qwen2" if config.qkv_bias
            else "mistral" if config.sliding_window else "llama")


def _qwen_window_fields(config: DecoderConfig) -> dict:
    """The window fields of a qwen2 or qwen3 config: its layers' types, and, where the sliding
    layers are the upper ones, the first of them as ``max_window_layers``."""
    if config.sliding_window is None:
        return dict(use_sliding_window=False)
    slides = config.window_layers or (True,) * config.n_layers
    first = slides.index(True)
    fields = dict(use_sliding_window=True, sliding_window=config.sliding_window,
                  layer_types=["sliding_attention" if f else "full_attention" for f in slides])
    if all(slides[first:]):
        fields["max_window_layers"] = first
    return fields


def to_hf(config: DecoderConfig, params: dict):
    if config.parallel_block or config.norm != "rmsnorm" or not config.ffn_gated:
        return _falcon_to_hf(config, params)
    if not config.pre_norms:
        kind = "olmo2"
        _require_fields(config, kind, "norms after the sublayers only (pre_norms = False)",
                        dict(_LLAMA_PLAIN, qk_norm="projection", ffn_activation="silu"))
    elif config.qk_norm == "projection":
        raise HFCheckpointError("qk_norm = 'projection' is OLMo 2's, which normalises after the "
                                "sublayers only (sandwich_norms with pre_norms = False); this "
                                "config has its norms before them")
    else:
        kind = _gemma_kind(config) or _llama_kind(config)
    gemma = kind if kind in GEMMA_TYPES else None
    architecture = _ARCHITECTURES[kind]
    rope_parameters, context = rope_to_hf(config.rope_base, config.rope_scaling)
    hf = {"model_type": kind, "architectures": [architecture],
          "vocab_size": config.vocab_size,
          "max_position_embeddings": config.max_seq_len if context is None else context,
          "hidden_size": config.d_model, "num_hidden_layers": config.n_layers,
          "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads,
          "head_dim": config.d_h, "intermediate_size": config.d_f, "hidden_act": "silu",
          "rms_norm_eps": config.norm_eps,
          "rope_parameters": rope_parameters,
          "tie_word_embeddings": config.tie_embeddings}
    if kind in ("olmo2", "phi3"):  # their defaults name ids a small vocabulary may not have; a
        hf.update(_NO_TOKEN_IDS)   # tokenizer saved beside the weights sets them (save_tokenizer)
    if gemma:
        _gemma_to_hf(config, kind, hf)
    elif kind in ("llama", "olmo2"):
        hf.update(attention_bias=False, mlp_bias=False)
    elif kind == "phi3":
        hf.update(sliding_window=config.sliding_window,
                  original_max_position_embeddings=config.rope_scaling.original_max_seq_len)
    elif kind == "qwen3":
        hf.update(attention_bias=False, **_qwen_window_fields(config))
    elif kind == "mistral":
        hf.update(sliding_window=config.sliding_window)
    elif kind == "mixtral":
        hf.update(sliding_window=config.sliding_window, num_local_experts=config.moe.n_experts,
                  num_experts_per_tok=config.moe.top_k, intermediate_size=config.moe.d_expert,
                  router_jitter_noise=0.0, output_router_logits=False)
    elif kind in ("qwen2_moe", "qwen3_moe"):
        moe = config.moe
        hf.update(use_sliding_window=False, num_experts=moe.n_experts,
                  num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.d_expert,
                  norm_topk_prob=moe.norm_topk, decoder_sparse_step=1,
                  mlp_only_layers=list(range(moe.first_dense)), output_router_logits=False)
        if kind == "qwen2_moe":
            hf.update(qkv_bias=config.qkv_bias, shared_expert_intermediate_size=moe.shared_width)
        else:
            hf.update(attention_bias=False)
    else:
        hf.update(_qwen_window_fields(config))

    def rotated(w):  # the query and key columns in Hugging Face's "half" RoPE layout
        return w if config.rope_layout == "half" else interleaved_to_half(w, config.d_h)

    tensors = {}
    for i in range(config.n_layers):
        h, p = f"model.layers.{i}.self_attn.", f"layers.{i}.attn."
        tensors[h + "q_proj.weight"] = linear_out(rotated(params[p + "w_q"]))
        tensors[h + "k_proj.weight"] = linear_out(rotated(params[p + "w_k"]))
        tensors[h + "v_proj.weight"] = linear_out(params[p + "w_v"])
        tensors[h + "o_proj.weight"] = linear_out(params[p + "w_o"])
        if config.qkv_bias:
            tensors[h + "q_proj.bias"] = rotated(params[p + "b_q"])
            tensors[h + "k_proj.bias"] = rotated(params[p + "b_k"])
            tensors[h + "v_proj.bias"] = params[p + "b_v"]
        if config.qk_norm:  # a (d_h,) gain, permuted within the head like the columns it scales
            for name in ("q", "k"):
                tensors[h + f"{name}_norm.weight"] = rotated(params[p + f"{name}_norm.gamma"])
    swiglu_layers_to_hf(config, params, tensors, _EXPERT_LAYOUTS.get(kind))
    if kind == "phi3":
        fuse_phi3(tensors, config.n_layers)
    return hf, tensors


# ---- Hugging Face: Falcon ------------------------------------------------------------------------

# Falcon's activation names: exact GELU, or its tanh form under either of transformers' names
_FALCON_ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def _falcon_layout(config: DecoderConfig) -> dict:
    """The fields of a falcon config that fix its block and its ``query_key_value`` layout.

    transformers' new decoder architecture (Falcon-40B) groups the fused projection by key/value
    head, ``[q_1 .. q_{h/g}, k, v]`` per group, and runs the parallel block with one norm or two
    (``ln_attn``, ``ln_mlp``); the old one (Falcon-7B) lays it out as ``[q_1 .. q_h, k, v]``
    (``multi_query``, ``g = 1``) or ``[q, k, v]`` per head (``g = h``), and also runs the
    sequential block (``parallel_attn`` False). The two old layouts are the grouped one with
    ``g = 1`` and ``g = h``, so one rule reads them all.
    """
    old = not config.parallel_block or (config.kv_heads == 1 and config.parallel_norms == 1)
    return dict(new_decoder_architecture=not old, multi_query=config.kv_heads == 1,
                parallel_attn=config.parallel_block,
                num_ln_in_parallel_attn=None if old else config.parallel_norms)


def _falcon_norm_names(config: DecoderConfig) -> dict:
    """``{refmath norm: Falcon's}`` of one layer."""
    if not config.parallel_block:
        return {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"}
    if config.parallel_norms == 2:
        return {"ln1": "ln_attn", "ln2": "ln_mlp"}
    return {"ln1": "input_layernorm"}


def _falcon_from_hf(hf: dict) -> DecoderConfig:
    """A falcon config: the parallel block of LayerNorms and a plain GELU MLP, RoPE (``"half"``),
    no biases; ALiBi (Falcon-RW) and biased projections are refused."""
    if hf.get("alibi"):
        refuse(hf, "alibi", True, "refmath's decoder places positions by RoPE, not ALiBi's biases")
    if hf.get("bias"):
        refuse(hf, "bias", True, "refmath's Falcon has no biases on its projections and MLP")
    act = hf.get("activation", "gelu")
    if act not in _FALCON_ACTIVATIONS:
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
    return DecoderConfig(
        vocab_size=int(hf["vocab_size"]), max_seq_len=rope_context(hf, scaling), d_model=d,
        n_layers=int(hf["num_hidden_layers"]), n_heads=heads, n_kv_heads=kv_heads,
        d_ff=int(hf.get("ffn_hidden_size") or 4 * d), rope_base=base, rope_scaling=scaling,
        rope_layout="half", norm="layernorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        ffn_gated=False, ffn_activation=_FALCON_ACTIVATIONS[act], parallel_block=parallel,
        parallel_norms=norms if parallel else 1,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), dropout=0.0)


def _falcon_params(config: DecoderConfig, weights) -> dict:
    d, h, g, d_h, f = config.d_model, config.n_heads, config.kv_heads, config.d_h, config.d_f
    params = {}
    for i in range(config.n_layers):
        t, p = f"transformer.h.{i}.", f"layers.{i}."
        for ours, theirs in _falcon_norm_names(config).items():
            params[p + ours + ".gamma"] = weights.take(t + theirs + ".weight", (d,))
            params[p + ours + ".beta"] = weights.take(t + theirs + ".bias", (d,))
        fused = weights.take(t + "self_attention.query_key_value.weight", ((h + 2 * g) * d_h, d),
                             transpose=True)
        # per key/value group: its h/g queries, then its key and its value (_falcon_layout)
        params[p + "attn.w_q"], params[p + "attn.w_k"], params[p + "attn.w_v"] = \
            split_heads_columns(fused, g, ((h // g) * d_h, d_h, d_h))
        params[p + "attn.w_o"] = weights.take(t + "self_attention.dense.weight", (d, h * d_h),
                                              transpose=True)
        params[p + "ffn.w_up"] = weights.take(t + "mlp.dense_h_to_4h.weight", (f, d),
                                              transpose=True)
        params[p + "ffn.w_down"] = weights.take(t + "mlp.dense_4h_to_h.weight", (d, f),
                                                transpose=True)
    params["tok_emb"] = weights.take("transformer.word_embeddings.weight", (config.vocab_size, d))
    params["ln_f.gamma"] = weights.take("transformer.ln_f.weight", (d,))
    params["ln_f.beta"] = weights.take("transformer.ln_f.bias", (d,))
    take_head(weights, config.tie_embeddings, params, config.vocab_size, d)
    return params


def _require_fields(config: DecoderConfig, kind: str, why: str, needed: dict) -> None:
    """Refuse to write ``config`` as ``kind`` unless each field has its value in ``needed``."""
    for field, value in needed.items():
        if getattr(config, field) != value:
            raise HFCheckpointError(f"a decoder with {why} is written as {kind}, which needs "
                                    f"{field} = {value!r}; this config has "
                                    f"{getattr(config, field)!r}")


# Special-token ids are the tokenizer's to give: None rather than a type's defaults
_NO_TOKEN_IDS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)

# What only the Gemmas, the Qwens, Mistral and the mixtures of experts have: the plain value that
# the types without it need
_LLAMA_PLAIN = dict(qkv_bias=False, qk_norm=None, sliding_window=None, window_layers=None,
                    moe=None, norm_offset=0.0, embed_scale=False, query_pre_attn_scalar=None,
                    attn_softcap=None, final_softcap=None)


def _falcon_to_hf(config: DecoderConfig, params: dict):
    why = "a parallel block, LayerNorm or the plain GELU FFN"
    _require_fields(config, "falcon", why, dict(
        _LLAMA_PLAIN, norm="layernorm", ffn_gated=False, sandwich_norms=False, pre_norms=True))
    if config.d_h * config.n_heads != config.d_model:
        raise HFCheckpointError(f"falcon's heads are d_model / n_heads wide; this config has "
                                f"head_dim = {config.d_h} with d_model = {config.d_model} and "
                                f"n_heads = {config.n_heads}")
    if not config.parallel_block and config.kv_heads not in (1, config.n_heads):
        raise HFCheckpointError(f"falcon's sequential block (the old decoder architecture) has "
                                f"one key/value head or n_heads; this config has n_kv_heads = "
                                f"{config.kv_heads}")
    rope_parameters, context = rope_to_hf(config.rope_base, config.rope_scaling)
    activation = "gelu" if config.ffn_activation == "gelu" else "gelu_pytorch_tanh"
    hf = {"model_type": "falcon", "architectures": ["FalconForCausalLM"],
          "vocab_size": config.vocab_size, "hidden_size": config.d_model,
          "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
          "num_kv_heads": config.kv_heads, **_falcon_layout(config), "alibi": False,
          "bias": False, "activation": activation, "ffn_hidden_size": config.d_f,
          "layer_norm_epsilon": config.norm_eps, "rope_parameters": rope_parameters,
          "max_position_embeddings": config.max_seq_len if context is None else context,
          "tie_word_embeddings": config.tie_embeddings, **_NO_TOKEN_IDS}

    def rotated(w):  # the query and key columns in Hugging Face's "half" RoPE layout
        return w if config.rope_layout == "half" else interleaved_to_half(w, config.d_h)

    tensors = {}
    for i in range(config.n_layers):
        t, p = f"transformer.h.{i}.", f"layers.{i}."
        for ours, theirs in _falcon_norm_names(config).items():
            tensors[t + theirs + ".weight"] = params[p + ours + ".gamma"]
            tensors[t + theirs + ".bias"] = params[p + ours + ".beta"]
        blocks = [rotated(params[p + "attn.w_q"]), rotated(params[p + "attn.w_k"]),
                  params[p + "attn.w_v"]]
        tensors[t + "self_attention.query_key_value.weight"] = linear_out(
            join_heads_columns(blocks, config.kv_heads))
        tensors[t + "self_attention.dense.weight"] = linear_out(params[p + "attn.w_o"])
        tensors[t + "mlp.dense_h_to_4h.weight"] = linear_out(params[p + "ffn.w_up"])
        tensors[t + "mlp.dense_4h_to_h.weight"] = linear_out(params[p + "ffn.w_down"])
    tensors["transformer.word_embeddings.weight"] = params["tok_emb"]
    tensors["transformer.ln_f.weight"] = params["ln_f.gamma"]
    tensors["transformer.ln_f.bias"] = params["ln_f.beta"]
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = linear_out(params["lm_head"])
    return hf, tensors


# ---- gradient-check cases ------------------------------------------------------------------------

def case_params(init_params, config, rng) -> dict:
    """``init_params`` with the norm gains moved off 1 and LayerNorm biases off 0, so that their
    gradients are generic too."""
    params = init_params(config, seed=int(rng.integers(1 << 31)))
    for name, value in params.items():
        if name.endswith(".gamma"):
            params[name] = 1.0 + 0.2 * rng.standard_normal(value.shape)
        elif name.endswith(".beta"):
            params[name] = 0.2 * rng.standard_normal(value.shape)
    return params


def case_batch(rng, vocab: int, b: int = 2, t: int = 5, prompt: int = 1) -> dict:
    """Tokens holding every id (every embedding row gets a gradient), one ignored target and a
    loss mask on the first ``prompt`` positions."""
    ids = np.concatenate([np.arange(vocab), rng.integers(0, vocab, max(b * t - vocab, 0))])
    batch = {"tokens": rng.permutation(ids[: b * t]).reshape(b, t),
             "targets": rng.integers(0, vocab, (b, t)), "loss_mask": np.ones((b, t), np.int64)}
    batch["targets"][0, -1] = IGNORE_INDEX
    batch["loss_mask"][:, :prompt] = 0
    return batch


def model_case_maker(model_forward, model_init_params, config, train: bool):
    """``make(rng) -> (params, forward)`` for a ParamCase of a decoder-family model; with ``train``
    every forward draws the same dropout masks from a generator seeded afresh."""
    def make(rng):
        params = case_params(model_init_params, config, rng)
        batch = case_batch(rng, config.vocab_size)

        def loss(p):
            return model_forward(p, batch, config, train=train,
                                 rng=np.random.default_rng(7) if train else None)
        return params, loss
    return make


def routed_experts(cache: DecoderCache) -> tuple:
    """The experts every mixture-of-experts layer of a forward pass chose, per token."""
    return tuple(layer.ffn.branch.indices for layer in cache.layers if layer.moe)


def routing_margin(cache: DecoderCache, params: dict) -> float:
    """The smallest routing margin (:func:`refmath.moe.routing_margin`) of a forward pass's
    mixture-of-experts layers: how near its selection is to changing."""
    return min(moe_ops.routing_margin(layer.ffn.branch.router.scores, layer.ffn.branch.moe,
                                      params.get(f"layers.{i}.ffn.router.bias"))
               for i, layer in enumerate(cache.layers) if layer.moe)


class SelectionChanged(RuntimeError):
    """A gradient check's probe changed an expert selection: its finite differences would straddle
    a jump of the loss."""


def moe_case_maker(model_forward, model_init_params, config, margin: float = 0.01):
    """:func:`model_case_maker` for a decoder with experts: the selection is piecewise constant,
    so the check must not probe across a change of it. The parameters are drawn again until every
    router's margin exceeds ``margin`` (the stencil moves one entry by at most 1e-3, which moves a
    router logit by 1e-3 times an entry of the other factor, normalised rows of order 1, and a
    score by at most half that), and every probe is compared with the selection at the drawn
    point: a probe that changes it raises :class:`SelectionChanged` rather than give a wrong
    difference, so a passing check never straddled a jump."""
    base = model_case_maker(model_forward, model_init_params, config, train=False)

    def make(rng):
        for _ in range(200):
            params, loss = base(rng)
            cache = loss(params)[1]
            if routing_margin(cache, params) > margin:
                break
        else:
            raise RuntimeError(f"no draw in 200 had a routing margin above {margin}")
        chosen = routed_experts(cache)

        def checked(p):
            value, cache = loss(p)
            if any(not np.array_equal(a, b) for a, b in zip(routed_experts(cache), chosen)):
                raise SelectionChanged("a probe of the gradient check changed an expert "
                                       "selection; draw the case with a larger margin")
            return value, cache
        return params, checked
    return make


def _rope_attention_inputs(config, b=2, t=5):
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
                         _rope_attention_inputs(DecoderConfig(**{**_TINY, "n_kv_heads": _g})),
                         *layer_case_ops(rope_attention_forward, rope_attention_backward),
                         ("x", "w_q", "w_k", "w_v", "w_o"), group="attention execution",
                         max_coords=12))
register_case(OpCase("rope_attention", "h=4 g=2 causal (2, 5, 16), q/k/v biases", ("N10", "A10", "A8"),
                     _rope_attention_inputs(DecoderConfig(**_TINY, n_kv_heads=2, qkv_bias=True)),
                     *layer_case_ops(rope_attention_forward, rope_attention_backward),
                     ("x", "w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v"),
                     group="attention execution", max_coords=12))
register_case(OpCase("rope_attention", "h=4 g=2 causal (2, 5, 16), sliding window 3",
                     ("N10", "A10", "A8", "A12"),
                     _rope_attention_inputs(DecoderConfig(**_TINY, n_kv_heads=2, sliding_window=3)),
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
    "QK-norm on the projections (OLMo 2)": (dict(qk_norm="projection"), ("N18", "N2")),
    "linear scaling s=2": (dict(rope_scaling=dict(rope_type="linear", factor=2.0)), ("N13",)),
    "dynamic NTK past 3 tokens": (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0,
                                                         original_max_seq_len=3)), ("N14",)),
    "llama3 scaling": (dict(rope_scaling=dict(rope_type="llama3", factor=8.0,
                                              original_max_seq_len=4)), ("N15",)),
    "YaRN with temperature, QK-norm": (dict(qk_norm="head", rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_seq_len=4, beta_fast=4.0, beta_slow=0.5)),
        ("N16", "N18")),
    "Gemma 2's score scale and cap": (dict(query_pre_attn_scalar=6.0, attn_softcap=1.5),
                                      ("N19",)),
}
for _label, (_fields, _ids) in _OPTIONS.items():
    _config = DecoderConfig(**_TINY, n_kv_heads=2, **_fields)
    register_case(OpCase("rope_attention", f"h=4 g=2 causal (2, 5, 16), {_label}",
                         ("N10", "A10", "A8", *_ids), _rope_attention_inputs(_config),
                         *layer_case_ops(rope_attention_forward, rope_attention_backward),
                         ("x", *rope_attention_shapes(_config)), group="attention execution",
                         max_coords=12))
# Gemma's options (N19, N20): the whole network, its capped logits and local layers included
_GEMMA = dict(norm_offset=1.0, embed_scale=True, ffn_activation="gelu_tanh", tie_embeddings=True,
              sandwich_norms=True, sliding_window=3)
register_case(ParamCase("decoder", "Gemma 2: GeGLU, (1 + w) and sandwich norms, caps, a local "
                        "layer", ("M3", "N19", "N20", "A12"),
                        model_case_maker(forward, init_params, DecoderConfig(
                            **_TINY, **_GEMMA, n_kv_heads=2, query_pre_attn_scalar=6.0,
                            attn_softcap=1.5, final_softcap=2.0, window_layers=(True, False)),
                            train=False),
                        backward, max_coords=2, step=2.5e-4))
register_case(ParamCase("decoder", "Gemma 3: QK-norm, the local layer's own RoPE base, linear "
                        "scaling on the global one", ("M3", "N13", "N18", "N20"),
                        model_case_maker(forward, init_params, DecoderConfig(
                            **_TINY, **_GEMMA, n_kv_heads=2, qk_norm="head",
                            window_layers=(False, True), local_rope_base=100.0,
                            rope_scaling=dict(rope_type="linear", factor=4.0)), train=False),
                        backward, max_coords=2, step=2.5e-4))

# The block's shapes: parallel (N21) and normalised after the sublayers (N22), with LayerNorm (N1)
# and the plain GELU FFN (N5, N6)
_BLOCKS = {
    "Falcon-7B: parallel block, one LayerNorm, MQA, exact-GELU MLP, tied": (dict(
        n_kv_heads=1, parallel_block=True, norm="layernorm", ffn_gated=False,
        ffn_activation="gelu", tie_embeddings=True), ("N21", "N1", "N6"), False),
    "Falcon-40B: parallel block, two LayerNorms, GQA, tanh-GELU MLP, dropout 0.25": (dict(
        n_kv_heads=2, parallel_block=True, parallel_norms=2, norm="layernorm", ffn_gated=False,
        ffn_activation="gelu_tanh", d_ff=24, dropout=0.25), ("N21", "N1", "N6"), True),
    "PaLM: parallel block, MQA, SwiGLU, LayerNorm without bias, tied": (
        _PALM, ("N21", "N1", "N7"), False),
    "OLMo 2: RMSNorm after each sublayer only, QK-norm on the projections": (dict(
        n_kv_heads=2, sandwich_norms=True, pre_norms=False, qk_norm="projection"),
        ("N22", "N18"), False),
}
for _label, (_fields, _ids, _train) in _BLOCKS.items():
    register_case(ParamCase("decoder", _label, ("M3", *_ids),
                            model_case_maker(forward, init_params,
                                             DecoderConfig(**{**_TINY, **_fields}), train=_train),
                            backward, max_coords=2, step=2.5e-4))

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
