r"""The configuration of the decoder family (catalogue M3): :class:`DecoderConfig` and the fields
it shares with M4 (:class:`FamilyConfig`), the named presets, and what a layer computes with
(:func:`layer_config`, :func:`gain`, :func:`attention_options`).

Each field is documented in :class:`DecoderConfig`'s docstring; :mod:`refmath.models.decoder`
computes them.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import ClassVar

from refmath._validate import (check_choice, check_field, check_flag, check_int, check_real,
                               check_window_layers)
from refmath.attention import ATTENTION_BACKENDS
from refmath.ffn import swiglu_hidden_size
from refmath.models.common import HeadDimHeads, named_config
from refmath.moe import MoEConfig, as_moe_config
from refmath.positions import ROPE_LAYOUTS, RopeScaling, as_rope_scaling

__all__ = [
    "check_shared_fields", "ffn_width", "FamilyConfig", "QK_NORMS",
    "DecoderConfig", "gain", "attention_options", "layer_config", "PRESETS", "preset"
]


# ---- configuration -------------------------------------------------------------------------------


def check_rope_fields(config) -> None:
    """Validate Llama's RoPE fields, as every family that rotates by them has them: ``rope_base``
    above 1, ``rope_layout`` one of ``ROPE_LAYOUTS``; ``rope_scaling`` given as a dict of its fields
    (``asdict``'s JSON form) is made a :class:`refmath.positions.RopeScaling`."""
    check_field(config, "rope_base", check_real, 1.0, low_open=True)
    check_field(config, "rope_layout", check_choice, ROPE_LAYOUTS)
    object.__setattr__(config, "rope_scaling", as_rope_scaling(
        config.rope_scaling, f"{type(config).__name__}.rope_scaling"))


def check_training_fields(config) -> None:
    """Validate the fields of the norms' epsilon and of training that every Llama-like family has:
    ``norm_eps`` and ``init_std`` positive, ``tie_embeddings`` a flag, ``dropout`` in [0, 1),
    ``attention_backend`` one of ``ATTENTION_BACKENDS``."""
    for name in ("norm_eps", "init_std"):
        check_field(config, name, check_real, 0.0, low_open=True)
    check_field(config, "tie_embeddings", check_flag)
    check_field(config, "dropout", check_real, 0.0, 1.0, high_open=True)
    check_field(config, "attention_backend", check_choice, ATTENTION_BACKENDS)


def check_shared_fields(config) -> None:
    """Validate the fields every decoder of this family has (M3 and M4 alike); ``moe`` given as a
    dict of its fields is made a :class:`refmath.moe.MoEConfig`."""
    for name in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "ffn_multiple_of"):
        check_field(config, name, check_int, 1)
    check_field(config, "d_ff", check_int, 1, optional=True)
    check_field(config, "rope_base", check_real, 1.0, low_open=True)
    check_field(config, "rope_layout", check_choice, ROPE_LAYOUTS)
    check_training_fields(config)
    check_field(config, "head_dim", check_int, 1, optional=True)
    # a dict of MoEConfig's fields (asdict's JSON form) becomes a MoEConfig
    object.__setattr__(config, "moe", as_moe_config(config.moe, f"{type(config).__name__}.moe"))
    if config.head_dim is None and config.d_model % config.n_heads:
        raise ValueError(f"{type(config).__name__}.d_model = {config.d_model} is not divisible by "
                         f"n_heads = {config.n_heads}; give head_dim explicitly")


def ffn_width(config) -> int:
    """The FFN's hidden width ``d_f``: ``d_ff`` if given, else ``8d/3`` rounded up to a multiple of
    ``ffn_multiple_of`` (N7, :func:`refmath.ffn.swiglu_hidden_size`), about as many parameters as
    the plain FFN's ``4d`` (N5)."""
    if config.d_ff is not None:
        return config.d_ff
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
    def d_h(self) -> int:
        """The head width :math:`d_h` the layers compute with: ``head_dim``, or
        ``d_model // n_heads`` by default (MLA: the content query/key width, K9's :math:`d_k`)."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def d_f(self) -> int:
        """The FFN's hidden width (:func:`ffn_width`)."""
        return ffn_width(self)


QK_NORMS = ("head",)  # where QK-norm's RMSNorm runs (N18): over each head (OLMo 2's: olmo2.py)


@dataclass(frozen=True, kw_only=True)
class DecoderConfig(FamilyConfig, HeadDimHeads):
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
    heads (Qwen3); ``None`` (the default) normalises neither. (OLMo 2's QK-norm over the
    whole projections is :mod:`refmath.models.olmo2`'s.)

    Per-layer attention: with ``window_layers`` (one flag per layer) only the flagged layers slide
    their window of ``sliding_window``, the others attend to every earlier position (Qwen2's and
    Qwen3's upper or lower layers).

    The parallel block of Falcon, PaLM and GPT-J, with LayerNorm and the plain GELU FFN, is
    :mod:`refmath.models.falcon`'s; OLMo 2's norms after the sublayers only (N22)
    :mod:`refmath.models.olmo2`'s, Gemma's options :mod:`refmath.models.gemma`'s.
    """

    n_kv_heads: int | None = None
    qkv_bias: bool = False
    sliding_window: int | None = None
    rope_scaling: RopeScaling | None = None
    qk_norm: str | None = None
    window_layers: tuple | None = None

    # what the attention sublayer (refmath.models.rope_attention) reads of Gemma's options: none
    norm_offset: ClassVar[float] = 0.0
    query_pre_attn_scalar: ClassVar[float | None] = None
    attn_softcap: ClassVar[float | None] = None

    def __post_init__(self):
        check_shared_fields(self)
        check_field(self, "n_kv_heads", check_int, 1, optional=True)
        check_field(self, "qkv_bias", check_flag)
        check_field(self, "sliding_window", check_int, 1, optional=True)
        check_window_layers(self)
        object.__setattr__(self, "rope_scaling",
                           as_rope_scaling(self.rope_scaling, "DecoderConfig.rope_scaling"))
        check_field(self, "qk_norm", check_choice, QK_NORMS, optional=True)
        self.check_heads()

    @property
    def score_scale(self) -> float:
        r"""The factor of the attention scores: :math:`1/\sqrt{d_h}`."""
        return self.d_h ** -0.5


def gain(config, gamma):
    """An RMSNorm's gain as the model applies it: ``gamma``, or ``norm_offset + gamma`` (Gemma,
    :mod:`refmath.models.gemma`, stores ``w`` and scales by ``1 + w``)."""
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
    ``window_layers``, ``config`` with that layer's window (``sliding_window`` or None). Built once
    per layer and kept."""
    if config.window_layers is None:
        return config
    return _layer_config(config, layer)


@functools.lru_cache(maxsize=1024)
def _layer_config(config, layer: int):
    slides = config.window_layers[layer]
    return dataclasses.replace(config, window_layers=None,
                               sliding_window=config.sliding_window if slides else None)


PRESETS = {
    # For lessons and quick training runs on a CPU: byte-level vocabulary, GQA with g = h/2.
    "tiny": dict(vocab_size=256, max_seq_len=128, d_model=64, n_layers=2, n_heads=4,
                 n_kv_heads=2, ffn_multiple_of=16),
    # A Llama-recipe network of GPT-2-small size (about 125M parameters, d_f = 2048), not a
    # released checkpoint: 32k vocabulary, d_h = 64, GQA with g = 4 of h = 12.
    "llama-small": dict(vocab_size=32000, max_seq_len=1024, d_model=768, n_layers=12, n_heads=12,
                        n_kv_heads=4, ffn_multiple_of=256, norm_eps=1e-5),
}


def preset(name: str, **overrides) -> DecoderConfig:
    """A named configuration from :data:`PRESETS`, with any field overridden by keyword."""
    return named_config(DecoderConfig, PRESETS, name, overrides)
