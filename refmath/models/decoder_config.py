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

from refmath._validate import (check_choice, check_field, check_flag, check_int, check_real,
                               check_window_layers)
from refmath.attention import ATTENTION_BACKENDS
from refmath.ffn import swiglu_hidden_size
from refmath.moe import MoEConfig, as_moe_config
from refmath.positions import ROPE_LAYOUTS, RopeScaling, as_rope_scaling

__all__ = [
    "check_shared_fields", "ffn_width", "FamilyConfig", "QK_NORMS", "FFN_ACTIVATIONS",
    "DecoderConfig", "gain", "attention_options", "layer_config", "PRESETS", "preset"
]


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
    def query_key_width(self) -> int:
        """The query/key width per head: ``head_dim``, or ``d_model // n_heads`` by default."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def d_f(self) -> int:
        """The FFN's hidden width (:func:`ffn_width`)."""
        return ffn_width(self)


QK_NORMS = ("head",)  # where QK-norm's RMSNorm runs (N18): over each head (OLMo 2's: olmo2.py)
# the gate of the FFN: SwiGLU's SiLU (N7) or GeGLU's tanh-GELU (N20)
FFN_ACTIVATIONS = ("silu", "gelu_tanh")


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
    heads (Qwen3, Gemma 3); ``None`` (the default) normalises neither. (OLMo 2's QK-norm over the
    whole projections is :mod:`refmath.models.olmo2`'s.)

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

    The parallel block of Falcon, PaLM and GPT-J, with LayerNorm and the plain GELU FFN, is
    :mod:`refmath.models.falcon`'s; OLMo 2's norms after the sublayers only (N22)
    :mod:`refmath.models.olmo2`'s.
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
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return DecoderConfig(**{**PRESETS[name], **overrides})
