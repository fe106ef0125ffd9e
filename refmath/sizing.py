"""Back-of-the-envelope sizes: KV cache, weights and training memory, parameter counts, FLOPs.

Every calculator is a small pure function on integers, so a learner can check each figure by hand
and a test can compare exact byte counts. Units: bytes are plain integers; the printed tables use
binary units (1 KiB = 1024 bytes, 1 MiB = 1024 KiB, 1 GiB = 1024 MiB), as the worked examples do.

Catalogue IDs: K6, K7 (cache size and its worked table), K8, K9 (MLA cache and projections), K12
(quantised cache bytes), N7 (SwiGLU parameter count, dense and per expert), S1 (inference rule
of thumb), S2 (AdamW training memory), S3 (cache ratios), A13 (what grouping saves), K13 (decode
bytes, arithmetic intensity, the bandwidth bound). For a mixture of experts (:mod:`refmath.moe`):
the active parameters per token, the experts' memory against one token's FLOPs, and the
all-to-all traffic of expert parallelism. ``python -m refmath sizes`` prints them
(:mod:`refmath.commands.sizes`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from refmath._validate import (check_choice, check_field, check_flag, check_int, check_real,
                               check_window_layers)
from refmath.ffn import FFN_KINDS, GATED_FFN_KINDS, ffn_parameter_count
from refmath.hf import config_from_hf
from refmath.models import model_module
from refmath.moe import MoEConfig, as_moe_config
from refmath.norms import NORM_KINDS

__all__ = ["kv_cache_bytes_per_token", "kv_cache_bytes", "mla_cache_bytes_per_token",
           "mla_cache_bytes", "QuantizedCacheBytes", "quantized_kv_cache_bytes", "weights_bytes",
           "InferenceMemory", "inference_memory_rule_of_thumb", "TrainingMemory",
           "adamw_training_memory", "ModelConfig", "PRESETS", "ParamCounts",
           "attention_parameter_count", "mla_attention_parameter_count", "MoEParamCounts",
           "moe_parameter_count", "parameter_counts", "ActiveParams", "active_parameters",
           "kept_positions", "cache_bytes_by_layer", "model_cache_bytes", "FlopCount",
           "prefill_flops", "decode_step_flops", "AttentionDesignCost", "attention_design_cost",
           "StepTraffic", "decode_step_traffic", "prefill_traffic", "decode_time_lower_bound",
           "MemoryAgainstCompute", "memory_against_compute", "expert_parallel_bytes",
           "ExpertParallelTraffic", "expert_parallel_traffic", "CacheRow", "attention_cache_rows",
           "format_bytes", "sizing_config", "hf_parameter_count", "own_design", "save_cache_plot"]


def _check_kv_heads_divide(heads: int, kv_heads: int) -> None:
    # Each key/value head serves exactly heads / kv_heads query heads (catalogue A10).
    if kv_heads > heads or heads % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads}) must divide heads ({heads})")


# ---- KV cache (K6, K7, K9, K12) -----------------------------------------------------------------

def kv_cache_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_element: int,
                             value_dim: int | None = None) -> int:
    # BEGIN SOLUTION
    r"""Bytes of K and V cached for one token of one sequence (catalogue K6).

    .. math:: 2\,L\,g\,d_h\,b \qquad\text{(general form: } L\,g\,(d_k + d_v)\,b\text{)}

    ``head_dim`` is the key width :math:`d_k`; ``value_dim`` is :math:`d_v` (default: equal to
    ``head_dim``, which gives the factor 2). MHA, GQA and MQA differ only in ``kv_heads``
    (:math:`g = h`, :math:`1 < g < h`, :math:`g = 1`). Result in bytes.
    """
    # END SOLUTION
    layers = check_int("layers", layers, 1)
    kv_heads = check_int("kv_heads", kv_heads, 1)
    head_dim = check_int("head_dim", head_dim, 1)
    bytes_per_element = check_int("bytes_per_element", bytes_per_element, 1)
    value_dim = head_dim if value_dim is None else check_int("value_dim", value_dim, 1)
    # BEGIN SOLUTION
    return layers * kv_heads * (head_dim + value_dim) * bytes_per_element
    # END SOLUTION


def kv_cache_bytes(batch: int, layers: int, tokens: int, kv_heads: int, head_dim: int,
                   bytes_per_element: int, value_dim: int | None = None) -> int:
    # BEGIN SOLUTION
    r"""Bytes of an unsharded KV cache for ``batch`` sequences of ``tokens`` tokens (K6, K7).

    .. math:: M_{KV} = 2\,B\,L\,T\,g\,d_h\,b

    (general form :math:`B L T g (d_k + d_v) b` when ``value_dim`` differs from ``head_dim``).
    Weights, activations, allocator overhead and quantisation metadata are not included.
    Worked example (K7): ``B=1, L=32, T=8192, d_h=128, b=2`` gives 4 GiB for ``g=32`` (MHA),
    1 GiB for ``g=8`` (GQA) and 128 MiB for ``g=1`` (MQA). Result in bytes.
    """
    # END SOLUTION
    batch = check_int("batch", batch, 1)
    tokens = check_int("tokens", tokens, 1)
    per_token = kv_cache_bytes_per_token(layers, kv_heads, head_dim, bytes_per_element, value_dim)
    # BEGIN SOLUTION
    return batch * tokens * per_token
    # END SOLUTION


def mla_cache_bytes_per_token(layers: int, latent_dim: int, rope_dim: int,
                              bytes_per_element: int) -> int:
    # BEGIN SOLUTION
    r"""Bytes of MLA state cached for one token (catalogue K9): :math:`L\,(d_c + d_R)\,b`.

    Each depth keeps the latent row :math:`c_j` (width :math:`d_c`) and the positional key
    :math:`\tilde k^R_j` (width :math:`d_R`, shared by all heads), instead of expanded K and V.
    """
    # END SOLUTION
    layers = check_int("layers", layers, 1)
    latent_dim = check_int("latent_dim", latent_dim, 1)
    rope_dim = check_int("rope_dim", rope_dim, 1)
    bytes_per_element = check_int("bytes_per_element", bytes_per_element, 1)
    # BEGIN SOLUTION
    return layers * (latent_dim + rope_dim) * bytes_per_element
    # END SOLUTION


def mla_cache_bytes(batch: int, layers: int, tokens: int, latent_dim: int, rope_dim: int,
                    bytes_per_element: int) -> int:
    r"""Idealised MLA cache size in bytes (catalogue K9).

    .. math:: M_{MLA} = B\,L\,T\,(d_c + d_R)\,b

    Compare with :func:`kv_cache_bytes`: MLA wins when :math:`d_c + d_R` is small next to the
    expanded width :math:`2 g d_h`.
    """
    batch = check_int("batch", batch, 1)
    tokens = check_int("tokens", tokens, 1)
    return batch * tokens * mla_cache_bytes_per_token(layers, latent_dim, rope_dim, bytes_per_element)


class QuantizedCacheBytes(NamedTuple):
    payload: int  # the quantised integers, densely packed
    scales: int   # one scale per group
    total: int


def quantized_kv_cache_bytes(batch: int, layers: int, tokens: int, kv_heads: int, head_dim: int,
                             bits: int, group_size: int, scale_bytes: int = 2) -> QuantizedCacheBytes:
    r"""Bytes of a KV cache stored with a ``bits``-bit symmetric quantiser (catalogue K12).

    .. math:: \text{payload} = \left\lceil 2\,B\,L\,T\,g\,d_h\,\tfrac{q}{8} \right\rceil,\qquad
              \text{scales} = 2\,B\,L\,T\,g\,\lceil d_h / G \rceil\, b_s

    Each cached key or value vector (one token, depth and KV head: :math:`d_h` numbers) is split
    into groups of ``group_size`` :math:`G` consecutive elements, each with its own scale of
    ``scale_bytes`` :math:`b_s` bytes (a symmetric quantiser has no zero point). The payload
    assumes dense bit packing (the ceiling only matters for odd totals); real layouts may pad.
    """
    batch = check_int("batch", batch, 1)
    layers = check_int("layers", layers, 1)
    tokens = check_int("tokens", tokens, 1)
    kv_heads = check_int("kv_heads", kv_heads, 1)
    head_dim = check_int("head_dim", head_dim, 1)
    bits = check_int("bits", bits, 1)
    group_size = check_int("group_size", group_size, 1)
    scale_bytes = check_int("scale_bytes", scale_bytes, 1)
    vectors = 2 * batch * layers * tokens * kv_heads  # the 2 counts keys and values
    payload = -(-vectors * head_dim * bits // 8)
    scales = vectors * -(-head_dim // group_size) * scale_bytes
    return QuantizedCacheBytes(payload, scales, payload + scales)


# ---- weights and optimiser memory (S1, S2) ------------------------------------------------------

def weights_bytes(params: int, bytes_per_param: int = 2) -> int:
    """Bytes of the weights alone: ``params * bytes_per_param`` (2 for bf16/fp16)."""
    return check_int("params", params, 1) * check_int("bytes_per_param", bytes_per_param, 1)


class InferenceMemory(NamedTuple):
    weights: int       # 2P bytes for bf16/fp16
    allowance: float   # the rough extra for activations and KV cache
    total: float


def inference_memory_rule_of_thumb(params: int, bytes_per_param: int = 2,
                                   overhead: float = 0.20) -> InferenceMemory:
    r"""Inference memory by the cheat sheet's RULE OF THUMB (catalogue S1), not a measurement.

    .. math:: M \approx 2P\,(1 + 0.2)\ \text{bytes}

    The weights take ``bytes_per_param * P`` bytes; about 20% more is set aside for activations and
    the KV cache. The real cache can be far larger than 20% at long contexts or large batches:
    compute it with :func:`kv_cache_bytes` instead of trusting the allowance.
    """
    weights = weights_bytes(params, bytes_per_param)
    overhead = check_real("overhead", overhead, 0.0)
    allowance = weights * overhead
    return InferenceMemory(weights, allowance, weights + allowance)


class TrainingMemory(NamedTuple):
    weights_fp16: int      # 2P
    grads_fp16: int        # 2P
    master_fp32: int       # 4P
    adam_moments_fp32: int # 8P: m and v, 4 bytes each
    total: int             # 16P


def adamw_training_memory(params: int) -> TrainingMemory:
    r"""Bytes of model state for full AdamW mixed-precision training (catalogue S2).

    .. math:: 16P = \underbrace{2P}_{\text{fp16 weights}} + \underbrace{2P}_{\text{fp16 grads}}
              + \underbrace{4P}_{\text{fp32 master}} + \underbrace{8P}_{\text{fp32 } m, v}

    Activations (which grow with batch and sequence length) are not included.
    """
    p = check_int("params", params, 1)
    return TrainingMemory(2 * p, 2 * p, 4 * p, 8 * p, 16 * p)


# ---- model configurations and presets -----------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """The sizes of a Transformer that matter for counting; validated on construction.

    The fields that the models' configurations have too carry their names (``n_layers``,
    ``n_heads``, ``vocab_size``, ``tie_embeddings``, ``d_c``, ``d_rope``, ``q_lora_rank``,
    ``v_head_dim``, ``latent_norm``, ``moe``, ``norm``, ``ffn``; ``kv_heads`` and ``head_dim`` are
    the resolved widths, a model config's ``kv_heads`` and ``d_h``), so a model's
    ``sizing_fields`` passes them through as they are. ``ffn`` and ``norm`` take the one vocabulary
    of the models (:data:`refmath.ffn.FFN_KINDS`, :data:`refmath.norms.NORM_KINDS`). ``n_layers``
    counts the layers that hold a KV cache (the decoder's).
    ``encoder_layers > 0`` makes an encoder-decoder with one embedding shared by source, target and
    (if tied) output, as in the original Transformer. ``d_c``/``d_rope`` make the attention MLA
    (catalogue K8, K9): ``head_dim`` is then its content query/key width :math:`d_k`,
    ``v_head_dim`` its value width :math:`d_v` (default :math:`d_k`), ``q_lora_rank`` the width of
    its compressed query (None: queries projected from :math:`x`), and ``latent_norm`` adds the
    RMSNorm gains of the latents (:math:`d_c`, and ``q_lora_rank`` with it), as
    :class:`refmath.models.mla.MLAConfig` has them. ``moe`` makes the feed-forward of some layers a
    mixture of experts (:class:`refmath.moe.MoEConfig` or a dict of its fields; None: every layer
    dense): its ``is_moe_layer`` picks the layers, the others keep the dense ``d_ff``.
    ``norms_per_layer`` is the number of norms in each layer: 2 for the usual Pre-LN (or Post-LN)
    layer, 1 for a parallel block whose attention and MLP read one norm (GPT-J, Falcon-7B, PaLM), 4
    for Gemma 2's norms before and after both sublayers. ``d_ff``/``vocab_size`` may be ``None`` for
    a preset that only describes its attention (``d_ff`` also when every layer is an MoE layer).
    ``sliding_window`` = ``w`` makes the attention of some layers local (A12): a query sees only
    itself and the ``w - 1`` positions before it, and the layer's cache keeps only the last ``w``
    tokens. ``window_layers`` (one True/False per layer, as :class:`refmath.models.decoder.
    DecoderConfig` has it) says which layers slide; None: every layer does (Mistral).
    :attr:`layer_windows` is each layer's window, and the cache, decode and prefill calculators
    count layer by layer with it.
    ``context`` is the sequence length the model was trained for, where its source gives one.
    ``published_params`` and ``published_active`` are the total and the active parameters per
    token as published, as strings (see :func:`active_parameters`).
    """

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    kv_heads: int
    head_dim: int
    d_ff: int | None = None
    vocab_size: int | None = None
    ffn: str = "swiglu"              # of FFN_KINDS: "swiglu"/"geglu" 3 d d_f; the others 2 d d_f
    norm: str = "rmsnorm"            # of NORM_KINDS: "rmsnorm" d gains; "layernorm" d gains + d
                                     # biases; "layernorm_no_bias" d gains (PaLM)
    attention_bias: bool = False     # biases on Q, K, V and the output projection (GPT-2)
    qkv_bias: bool = False           # biases on Q, K and V only (Qwen2)
    ffn_bias: bool = False           # biases on the FFN's layers (GPT-2, original Transformer)
    tie_embeddings: bool = False     # the output projection reuses the embedding matrix
    learned_positions: int = 0       # rows of a learned position table (GPT-2: 1024)
    final_norm: bool = True          # one norm after the last layer (Pre-LN models)
    encoder_layers: int = 0
    d_c: int | None = None           # MLA's latent width
    d_rope: int | None = None        # MLA's rotary key width d_R
    sliding_window: int | None = None  # w: a sliding layer's query sees the last w positions
    window_layers: tuple | None = None  # which layers slide w; None: all, when w is given
    context: int | None = None       # trained context length, as published
    published_params: str = ""       # the total as published, e.g. "6.74e9"; "" if not compared
    source: str = ""
    qk_norm: str | None = None       # QK-norm gains per layer: "head" 2 d_h (Qwen3), "projection"
                                     # (h + g) d_h (OLMo 2), None: none
    norms_per_layer: int = 2         # 1: a parallel block (Falcon-7B, PaLM); 4: Gemma 2's sandwich
    q_lora_rank: int | None = None   # MLA's compressed-query width; None: W_Q straight from x
    v_head_dim: int | None = None    # MLA's value width d_v; None: head_dim
    latent_norm: bool = False        # MLA's RMSNorm gains on the latents (d_c, q_lora_rank)
    moe: MoEConfig | None = None     # the mixture-of-experts feed-forward; None: dense
    published_active: str = ""       # active parameters per token as published, e.g. "37e9"

    def __post_init__(self):
        for field in ("n_layers", "d_model", "n_heads", "kv_heads", "head_dim"):
            check_field(self, field, check_int, 1)
        for field in ("d_ff", "vocab_size", "d_c", "d_rope", "sliding_window", "context",
                      "q_lora_rank", "v_head_dim"):
            check_field(self, field, check_int, 1, optional=True)
        for field in ("learned_positions", "encoder_layers", "norms_per_layer"):
            check_field(self, field, check_int, 0)
        _check_kv_heads_divide(self.n_heads, self.kv_heads)
        check_window_layers(self, f" (config {self.name!r})")
        if (self.d_c is None) != (self.d_rope is None):
            raise ValueError("d_c and d_rope must be given together (an MLA cache holds both)")
        check_field(self, "ffn", check_choice, FFN_KINDS)
        check_field(self, "norm", check_choice, NORM_KINDS)
        check_field(self, "qk_norm", check_choice, ("head", "projection"), optional=True)
        check_field(self, "latent_norm", check_flag)
        object.__setattr__(self, "moe", as_moe_config(self.moe, "ModelConfig.moe"))
        self._check_mla()
        self._check_moe()

    @property
    def layer_windows(self) -> tuple:
        """Each layer's sliding window: ``sliding_window`` on the layers ``window_layers`` flags
        (on every layer when it is None), None on the layers that attend to every position."""
        flags = self.window_layers or (True,) * self.n_layers
        return tuple(self.sliding_window if slides else None for slides in flags)

    def _check_mla(self) -> None:
        if not self.is_mla:
            mla_only = [f for f in ("q_lora_rank", "v_head_dim") if getattr(self, f) is not None]
            mla_only += ["latent_norm"] if self.latent_norm else []
            if mla_only:
                raise ValueError(f"ModelConfig.{mla_only[0]} describes MLA attention; give d_c "
                                 f"and d_rope too (config {self.name!r})")
            return
        # The counts are written for DeepSeek's MLA: plain projections, one stack.
        for field in ("attention_bias", "qkv_bias", "qk_norm", "encoder_layers"):
            if getattr(self, field):
                raise ValueError(f"ModelConfig.{field} = {getattr(self, field)!r} is not counted "
                                 f"for MLA attention (d_c = {self.d_c}); config {self.name!r}")

    def _check_moe(self) -> None:
        if self.moe is None:
            return
        if self.ffn != "swiglu" or self.ffn_bias:
            raise ValueError(f"ModelConfig.moe: the experts are SwiGLUs without biases "
                             f"(refmath.moe), so ffn must be 'swiglu' and ffn_bias False; got "
                             f"ffn = {self.ffn!r}, ffn_bias = {self.ffn_bias} "
                             f"(config {self.name!r})")
        if self.encoder_layers:
            raise ValueError(f"ModelConfig.moe is written for decoder-only models; config "
                             f"{self.name!r} has encoder_layers = {self.encoder_layers}")

    @property
    def is_mla(self) -> bool:
        return self.d_c is not None

    @property
    def d_v(self) -> int:
        """The value width per head: MLA's ``v_head_dim`` if given, else ``head_dim``."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def moe_layers(self) -> int:
        """How many of the ``n_layers`` layers have the mixture-of-experts feed-forward."""
        if self.moe is None:
            return 0
        return sum(self.moe.is_moe_layer(i) for i in range(self.n_layers))


def _local_and_global(n_layers: int, period: int) -> tuple:
    """``window_layers`` of a stack whose every ``period``-th layer (the ``period``-th, the
    ``2 period``-th, ...) attends globally and the others slide: Gemma 2's period 2 (alternating,
    the first layer local), Gemma 3's 6 (five local layers for each global one)."""
    return tuple((i + 1) % period != 0 for i in range(n_layers))


# Published configurations. Only numbers from the cited paper or model card; the published total
# is kept as a string so that a test can read how many figures it was rounded to.
PRESETS: dict[str, ModelConfig] = {
    p.name: p for p in (
        # Vaswani et al. 2017, "Attention Is All You Need": Table 3 (base: N=6, d_model=512,
        # d_ff=2048, h=8, d_k=64, 65e6 parameters), Sec. 5.1 (shared BPE vocabulary of "about
        # 37000" tokens), Sec. 3.4 (embeddings shared with the pre-softmax projection). Sec. 3.3
        # writes the FFN with biases (x W1 + b1) and the attention projections as plain matrices
        # (Q W^Q), as refmath.models.transformer builds them: 63,045,632 parameters with 37,000
        # tokens. The paper's 65e6 needs about 3,800 more vocabulary rows; it does not say more.
        ModelConfig("transformer-base", n_layers=6, encoder_layers=6, d_model=512, n_heads=8,
                    kv_heads=8, head_dim=64, d_ff=2048, vocab_size=37000, ffn="relu",
                    norm="layernorm", ffn_bias=True, tie_embeddings=True, final_norm=False,
                    published_params="65e6", source="Vaswani et al. 2017, Table 3"),
        # Radford et al. 2019 (GPT-2) with the released hparams: n_layer=12, n_embd=768,
        # n_head=12, n_ctx=1024, vocab 50257; the model card (openai-community/gpt2) says 124M.
        ModelConfig("gpt2-small", n_layers=12, d_model=768, n_heads=12, kv_heads=12, head_dim=64,
                    d_ff=3072, vocab_size=50257, ffn="gelu", norm="layernorm", attention_bias=True,
                    ffn_bias=True, tie_embeddings=True, learned_positions=1024, context=1024,
                    published_params="124e6",
                    source="GPT-2 model card (openai-community/gpt2)"),
        # Llama 2 paper (Touvron et al. 2023b) and params.json: dim 4096, 32 layers, 32 heads,
        # no GQA at 7B, SwiGLU width 11008, vocab 32000, untied output, context 4096 (the paper's
        # Table 1: 4k). 6.74e9 is the released checkpoint's count (the LLaMA-1 paper lists this
        # same shape as 6.7B).
        ModelConfig("llama-2-7b", n_layers=32, d_model=4096, n_heads=32, kv_heads=32, head_dim=128,
                    d_ff=11008, vocab_size=32000, context=4096, published_params="6.74e9",
                    source="Llama 2 paper / model card (meta-llama/Llama-2-7b)"),
        # Llama 3 model card and params.json: dim 4096, 32 layers, 32 heads, 8 KV heads,
        # d_ff 14336 (ffn_dim_multiplier 1.3, multiple_of 1024), vocab 128256, context 8k;
        # 8.03e9 parameters.
        ModelConfig("llama-3-8b", n_layers=32, d_model=4096, n_heads=32, kv_heads=8, head_dim=128,
                    d_ff=14336, vocab_size=128256, context=8192, published_params="8.03e9",
                    source="Llama 3 model card (meta-llama/Meta-Llama-3-8B)"),
        # Jiang et al. 2023, "Mistral 7B", Table 1: dim 4096, 32 layers, head_dim 128, hidden 14336,
        # 32 heads, 8 KV heads, window 4096, context_len 8192, vocab 32000. "7.3B" is Mistral AI's
        # announcement.
        ModelConfig("mistral-7b", n_layers=32, d_model=4096, n_heads=32, kv_heads=8, head_dim=128,
                    d_ff=14336, vocab_size=32000, sliding_window=4096, context=8192,
                    published_params="7.3e9",
                    source="Mistral 7B paper, Table 1"),
        # Llama 3.1 model card and config.json (meta-llama/Llama-3.1-8B): the Llama 3 8B shape
        # (dim 4096, 32 layers, 32 heads, 8 KV heads, d_ff 14336, vocab 128256, untied) with
        # rope_scaling llama3 (factor 8, low/high frequency factors 1 and 4, original context
        # 8192) and max_position_embeddings 131072, the 128K context of the card; the Hub lists
        # 8.03B parameters.
        ModelConfig("llama-3.1-8b", n_layers=32, d_model=4096, n_heads=32, kv_heads=8,
                    head_dim=128, d_ff=14336, vocab_size=128256, context=131072,
                    published_params="8.03e9",
                    source="Llama 3.1 model card / config.json (meta-llama/Llama-3.1-8B)"),
        # Qwen3 model card and config.json (Qwen/Qwen3-8B): hidden 4096, 36 layers, 32 query and
        # 8 KV heads of head_dim 128, intermediate 12288, vocab 151936, untied, QK-norm on every
        # head; the card: 8.2B parameters (6.95B non-embedding), 32,768 tokens natively (131,072
        # with YaRN).
        ModelConfig("qwen3-8b", n_layers=36, d_model=4096, n_heads=32, kv_heads=8, head_dim=128,
                    d_ff=12288, vocab_size=151936, context=32768, qk_norm="head",
                    published_params="8.2e9", source="Qwen3-8B model card (Qwen/Qwen3-8B)"),
        # Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1 (GPT-3 175B): 96
        # layers, d_model 12288, 96 heads of 128, d_ff = 4 d_model, context 2048; Sec. 2.1: the
        # GPT-2 architecture (learned positions, Pre-LN LayerNorm, GELU, biases, tied output, the
        # 50257-token vocabulary) with dense and locally banded sparse attention alternating in
        # the layers, which changes which keys are attended, not the parameter counts.
        # 174,604,259,328. The paper does not give the width of the bands, so every layer is
        # counted here as dense (no window_layers): the cache, decode and prefill figures are
        # upper bounds for the banded half of the layers.
        ModelConfig("gpt-3-175b", n_layers=96, d_model=12288, n_heads=96, kv_heads=96,
                    head_dim=128, d_ff=4 * 12288, vocab_size=50257, ffn="gelu", norm="layernorm",
                    attention_bias=True, ffn_bias=True, tie_embeddings=True,
                    learned_positions=2048, context=2048, published_params="175e9",
                    source="Brown et al. 2020, Table 2.1"),
        # Qwen2.5-7B model card and config.json (Qwen/Qwen2.5-7B): hidden 3584, 28 layers, 28
        # query and 4 KV heads of 128, intermediate 18944, vocab 152064, biases on Q, K, V only,
        # untied, context 131,072. The card says 7.61B (6.53B non-embedding); the count is
        # 7,615,616,512, which rounds to 7.62B: the card's total is truncated, its non-embedding
        # 6,525,621,760 rounds to 6.53B as it should.
        ModelConfig("qwen2.5-7b", n_layers=28, d_model=3584, n_heads=28, kv_heads=4, head_dim=128,
                    d_ff=18944, vocab_size=152064, qkv_bias=True, context=131072,
                    published_params="7.61e9", source="Qwen2.5-7B model card (Qwen/Qwen2.5-7B)"),
        # Falcon-7B model card and config.json (tiiuae/falcon-7b): hidden 4544, 32 layers, 71
        # heads of 64, multi-query attention (one key/value head), a 4 d = 18176 GELU MLP, vocab
        # 65024, rotary positions, context 2048; attention and MLP in parallel on the output of
        # ONE LayerNorm (with bias) per layer, no biases in the linear layers, tied output. The
        # card says 7B; the count is 6,921,720,704 (6.92B).
        ModelConfig("falcon-7b", n_layers=32, d_model=4544, n_heads=71, kv_heads=1, head_dim=64,
                    d_ff=4 * 4544, vocab_size=65024, ffn="gelu", norm="layernorm",
                    norms_per_layer=1, tie_embeddings=True, context=2048, published_params="7e9",
                    source="Falcon-7B model card (tiiuae/falcon-7b)"),
        # Gemma 2 report (Gemma Team 2024, arXiv:2408.00118), Tables 1-2, and config.json
        # (google/gemma-2-9b): d_model 3584, 42 layers, 16 query and 8 KV heads of 256, GeGLU
        # of width 14336 (three matrices; Table 1's "28672" counts gate and up together), tied
        # embeddings, RMSNorm before and after both sublayers (4 per layer), context 8192. Every
        # other layer, from the first on, slides a 4096-token window (config.json's
        # sliding_window; layer_types alternate sliding and full attention), which changes no
        # parameter count but halves those layers' caches at 8192 tokens. Table 2's
        # 8,324,201,984 non-embedding parameters are this
        # count exactly; its embedding, 917,962,752, has Table 1's 256,128 rows, while
        # config.json's table has 256,000 (used here): 9.24B either way.
        ModelConfig("gemma-2-9b", n_layers=42, d_model=3584, n_heads=16, kv_heads=8, head_dim=256,
                    d_ff=14336, vocab_size=256000, ffn="geglu", norms_per_layer=4,
                    tie_embeddings=True, context=8192, sliding_window=4096,
                    window_layers=_local_and_global(42, 2), published_params="9.24e9",
                    source="Gemma 2 report, Tables 1-2 (google/gemma-2-9b)"),
        # Gemma 3 report (Gemma Team 2025, arXiv:2503.19786) and the text config of config.json
        # (google/gemma-3-12b-pt): d_model 3840, 48 layers, 16 query and 8 KV heads of 256,
        # GeGLU of width 15360, QK-norm on every head, Gemma 2's four RMSNorms a layer, tied
        # embeddings of 262,208 rows, context 128K (131,072). Five local layers for every global
        # one, the first local, each local layer sliding a 1024-token window: 40 of the 48
        # layers keep at most 1024 tokens, so the cache at 128K is 8.3 GiB instead of 48 GiB in
        # bf16. The published 12B includes the vision encoder, which is not counted here (no
        # published_params); the count's 10,759,155,456 parameters besides the embedding are the
        # report's "10,759M" non-embedding parameters.
        ModelConfig("gemma-3-12b", n_layers=48, d_model=3840, n_heads=16, kv_heads=8,
                    head_dim=256, d_ff=15360, vocab_size=262208, ffn="geglu", norms_per_layer=4,
                    qk_norm="head", tie_embeddings=True, context=131072, sliding_window=1024,
                    window_layers=_local_and_global(48, 6),
                    source="Gemma 3 report / config.json (google/gemma-3-12b-pt)"),
        # The text config of config.json (google/gemma-3-4b-pt): d_model 2560, 34 layers, 8 query
        # and 4 KV heads of 256, GeGLU of width 10240, Gemma 3's local and global layers (five
        # local ones of 1024 tokens per global one) and norms, tied embeddings of 262,208 rows,
        # context 128K. The published 4B includes the vision encoder (not counted: no
        # published_params); the count's 3,209,010,688 parameters besides the embedding are the
        # Gemma 3 report's "3,209M" non-embedding parameters.
        ModelConfig("gemma-3-4b", n_layers=34, d_model=2560, n_heads=8, kv_heads=4,
                    head_dim=256, d_ff=10240, vocab_size=262208, ffn="geglu", norms_per_layer=4,
                    qk_norm="head", tie_embeddings=True, context=131072, sliding_window=1024,
                    window_layers=_local_and_global(34, 6),
                    source="Gemma 3 report / config.json (google/gemma-3-4b-pt)"),
        # Falcon-40B's config.json (tiiuae/falcon-40b): hidden 8192, 60 layers, 128 query heads of
        # 64 and 8 key/value heads ("new decoder architecture": the grouped fused layout), a
        # 4 d = 32768 GELU MLP, vocab 65024, context 2048; attention and MLP in parallel, each
        # on its own LayerNorm (ln_attn, ln_mlp, with biases), no biases in the linear layers,
        # tied output. The card's "40B" does not round from the count, 41,303,293,952 (41.3B,
        # 3% more): the name rounds down (tests/test_sizing.py says by how much).
        ModelConfig("falcon-40b", n_layers=60, d_model=8192, n_heads=128, kv_heads=8,
                    head_dim=64, d_ff=4 * 8192, vocab_size=65024, ffn="gelu", norm="layernorm",
                    norms_per_layer=2, tie_embeddings=True, context=2048, published_params="40e9",
                    source="Falcon-40B model card (tiiuae/falcon-40b)"),
        # Chowdhery et al. 2022, "PaLM", Table 1 and Sec. 2: 118 layers, d_model 18432, 48 heads
        # of 256, multi-query attention, SwiGLU of width 4 d_model, "parallel" layers (attention
        # and MLP read one LayerNorm), no biases in the dense layers or the layer norms, a 256k
        # SentencePiece vocabulary (256,000) shared by input and output, context 2048. The
        # weights were never released. Table 1 says 540.35B; the exact count is 540,356,474,880
        # (540.36B), and 540,354,281,472 (540.35B) without the 119 layer-norm scales: the paper's
        # totals leave those out (its 8.63B and 62.50B come out either way).
        ModelConfig("palm-540b", n_layers=118, d_model=18432, n_heads=48, kv_heads=1,
                    head_dim=256, d_ff=4 * 18432, vocab_size=256000, norm="layernorm_no_bias",
                    norms_per_layer=1, tie_embeddings=True, context=2048,
                    published_params="540.35e9", source="Chowdhery et al. 2022, Table 1"),
        # Mixtral of experts (Jiang et al. 2024) and config.json (mistralai/Mixtral-8x7B-v0.1):
        # Mistral 7B's attention (hidden 4096, 32 layers, 32 query and 8 KV heads of 128, vocab
        # 32000, untied, rope_theta 1e6, no sliding window) with, in every layer, 8 SwiGLU experts
        # of width 14336 and a softmax router choosing 2; context 32768. Mistral AI's announcement:
        # 46.7B total, 12.9B used per token (the paper rounds them to 47B and 13B).
        ModelConfig("mixtral-8x7b", n_layers=32, d_model=4096, n_heads=32, kv_heads=8,
                    head_dim=128, d_ff=14336, vocab_size=32000, context=32768,
                    moe=MoEConfig(n_experts=8, top_k=2, d_expert=14336, norm_topk=True),
                    published_params="46.7e9", published_active="12.9e9",
                    source="Mixtral paper / config.json (mistralai/Mixtral-8x7B-v0.1)"),
        # DeepSeek-V2 report (arXiv:2405.04434), Sec. 3.1, and config.json (deepseek-ai/
        # DeepSeek-V2): 60 layers, d=5120, vocab 102400, untied; MLA with 128 heads of d_k = d_v =
        # 128, d_R = 64, d_c = 512, q_lora_rank 1536, RMSNorms on both latents; layer 0 dense
        # (intermediate 12288), the other 59 DeepSeekMoE: 2 shared and 160 routed experts of
        # width 1536, 6 chosen per token from the best 3 of 8 groups; context 128K (the
        # abstract). Published: 236B total, 21B activated per token.
        ModelConfig("deepseek-v2", n_layers=60, d_model=5120, n_heads=128, kv_heads=128,
                    head_dim=128, v_head_dim=128, d_c=512, d_rope=64, q_lora_rank=1536,
                    latent_norm=True, d_ff=12288, vocab_size=102400, context=128 * 1024,
                    moe=MoEConfig(n_experts=160, top_k=6, d_expert=1536, n_shared=2,
                                  routing="group_limited_greedy", n_groups=8, topk_groups=3,
                                  first_dense=1),
                    published_params="236e9", published_active="21e9",
                    source="DeepSeek-V2 report, Sec. 3.1 / config.json"),
        # DeepSeek-V3 report (arXiv:2412.19437), Sec. 4.2, and config.json (deepseek-ai/
        # DeepSeek-V3): 61 layers, d=7168, vocab 129280, untied; MLA as DeepSeek-V2's (128 heads,
        # d_k = d_v = 128, d_R = 64, d_c = 512, q_lora_rank 1536, latent norms); layers 0-2 dense
        # (intermediate 18432), the other 58 with 1 shared and 256 routed experts of width 2048,
        # 8 chosen per token by sigmoid scores plus the selection bias, from at most 4 of 8 groups
        # (node-limited routing: each group is a node). The context is extended to 128K (Sec.
        # 4.3); config.json's max_position_embeddings 163840 is YaRN's factor 40 over 4096.
        # Published: 671B total and 37B activated per token, the main model only: the Hub's
        # 685B adds the multi-token-prediction module (one more MoE layer and its projection;
        # "14B" in the repository's README, 11.5B of its own in README_WEIGHTS.md, which shares
        # the embedding and output head), which is not counted here.
        ModelConfig("deepseek-v3", n_layers=61, d_model=7168, n_heads=128, kv_heads=128,
                    head_dim=128, v_head_dim=128, d_c=512, d_rope=64, q_lora_rank=1536,
                    latent_norm=True, d_ff=18432, vocab_size=129280, context=128 * 1024,
                    moe=MoEConfig(n_experts=256, top_k=8, d_expert=2048, n_shared=1,
                                  scoring="sigmoid", routing="noaux_tc", n_groups=8,
                                  topk_groups=4, norm_topk=True, scaling=2.5, score_bias=True,
                                  first_dense=3),
                    published_params="671e9", published_active="37e9",
                    source="DeepSeek-V3 report, Sec. 4.2 / config.json"),
    )
}


# ---- parameter counts (N7 and the shapes of M1-M3) ----------------------------------------------

class ParamCounts(NamedTuple):
    embedding: int   # token embedding V x d
    positions: int   # learned position table (0 for sinusoidal or RoPE)
    attention: int   # every attention block, cross-attention included
    ffn: int         # every feed-forward, MoE routers and experts included
    norms: int
    output: int      # untied output projection d x V (0 when tied)
    total: int


def attention_parameter_count(d_model: int, heads: int, kv_heads: int, head_dim: int,
                              bias: bool = False) -> int:
    r"""Parameters of one attention block with GQA widths (catalogue A6, A9, A10).

    .. math:: \underbrace{d\,h d_h}_{W_Q} + \underbrace{2\,d\,g d_h}_{W_K, W_V}
              + \underbrace{h d_h\,d}_{W_O}\quad(+\ h d_h + 2 g d_h + d \text{ biases})
    """
    d = check_int("d_model", d_model, 1)
    h = check_int("heads", heads, 1)
    g = check_int("kv_heads", kv_heads, 1)
    dh = check_int("head_dim", head_dim, 1)
    _check_kv_heads_divide(h, g)
    count = d * h * dh + 2 * d * g * dh + h * dh * d
    if bias:
        count += h * dh + 2 * g * dh + d
    return count


def mla_attention_parameter_count(d_model: int, heads: int, head_dim: int, value_dim: int,
                                  latent_dim: int, rope_dim: int, q_lora_rank: int | None = None,
                                  latent_norm: bool = False) -> int:
    r"""Parameters of one multi-head latent attention block (catalogue K8, K9).

    With :math:`d_k` = ``head_dim`` (content query/key width), :math:`d_v` = ``value_dim``,
    :math:`d_c` = ``latent_dim``, :math:`d_R` = ``rope_dim`` and :math:`r` = ``q_lora_rank``:

    .. math::
        \underbrace{d\,(d_c + d_R)}_{W_{DKV},\,W_{KR}}
        + \underbrace{d_c\,h\,(d_k + d_v)}_{W_{UK},\,W_{UV}}
        + \underbrace{h\,d_v\,d}_{W_O}
        + \begin{cases} d\,h\,(d_k + d_R) & W_Q,\,W_{QR}\ \text{(no query compression)}\\
                        d\,r + r\,h\,(d_k + d_R) & W_{DQ},\,W_{UQ},\,W_{QR} \end{cases}
        \ \big(+\ d_c\ [+\ r]\ \text{latent RMSNorm gains}\big)

    the shapes of :func:`refmath.models.mla.param_shapes` (DeepSeek's checkpoints store
    :math:`W_{DKV}` and :math:`W_{KR}` as one ``kv_a_proj_with_mqa`` of width :math:`d_c + d_R`, and
    :math:`W_{UK}, W_{UV}` as one ``kv_b_proj``: the same numbers). ``latent_norm`` adds the gains
    of the RMSNorms on :math:`c` and :math:`c^Q`. MLA has no biases.
    """
    d = check_int("d_model", d_model, 1)
    h = check_int("heads", heads, 1)
    d_k = check_int("head_dim", head_dim, 1)
    d_v = check_int("value_dim", value_dim, 1)
    d_c = check_int("latent_dim", latent_dim, 1)
    d_r = check_int("rope_dim", rope_dim, 1)
    latent_norm = check_flag("latent_norm", latent_norm)
    count = d * (d_c + d_r) + d_c * h * (d_k + d_v) + h * d_v * d
    if q_lora_rank is None:
        count += d * h * (d_k + d_r)
    else:
        r = check_int("q_lora_rank", q_lora_rank, 1)
        count += d * r + r * h * (d_k + d_r) + (r if latent_norm else 0)
    return count + (d_c if latent_norm else 0)


class MoEParamCounts(NamedTuple):
    router: int   # d E router weights, + E selection biases with score_bias
    routed: int   # the E routed experts, 3 d d_e each
    shared: int   # the shared experts' SwiGLU 3 d d_s, + d for its gate
    total: int


def moe_parameter_count(d_model: int, moe: MoEConfig) -> MoEParamCounts:
    r"""Parameters of one mixture-of-experts feed-forward (:mod:`refmath.moe`; N7 per expert).

    .. math:: \underbrace{d E\ (+E)}_{\text{router (+ selection bias)}}
              + \underbrace{E \cdot 3 d d_e}_{\text{routed experts}}
              + \underbrace{3 d d_s\ (+d)}_{\text{shared SwiGLU (+ its gate)}}

    equal to the sizes of :func:`refmath.moe.moe_param_shapes`. The selection bias of
    DeepSeek-V3 (``score_bias``: :math:`E` numbers, updated outside the gradient) counts as a
    parameter: the checkpoint stores it (``e_score_correction_bias``) and refmath's parameter dict
    holds it; transformers registers it as a buffer instead, so its ``model.parameters()`` has
    :math:`E` fewer per MoE layer (DeepSeek-V3: 14,848 fewer of 671,026,419,200; both 671B).
    """
    d = check_int("d_model", d_model, 1)
    if not isinstance(moe, MoEConfig):
        raise TypeError(f"moe must be a refmath.moe.MoEConfig, got {type(moe).__name__}")
    e = moe.n_experts
    router = d * e + (e if moe.score_bias else 0)
    routed = e * 3 * d * moe.d_expert
    shared = 3 * d * moe.shared_width + (d if moe.shared_gate else 0)
    return MoEParamCounts(router, routed, shared, router + routed + shared)


def _norm_count(config: ModelConfig) -> int:
    return config.d_model * (2 if config.norm == "layernorm" else 1)


def _require_sizes(config: ModelConfig, what: str) -> None:
    dense_layers = config.n_layers - config.moe_layers + config.encoder_layers
    if config.vocab_size is None or (config.d_ff is None and dense_layers):
        raise ValueError(f"{what} needs d_ff and vocab_size; config {config.name!r} describes only "
                         f"its attention (d_ff={config.d_ff}, vocab_size={config.vocab_size})")


def _attention_count(config: ModelConfig) -> int:
    # One self-attention block's weights and biases; MLA's latent norm gains go to the norms.
    if config.is_mla:
        return mla_attention_parameter_count(config.d_model, config.n_heads, config.head_dim,
                                             config.d_v, config.d_c, config.d_rope,
                                             config.q_lora_rank)
    attn = attention_parameter_count(config.d_model, config.n_heads, config.kv_heads,
                                     config.head_dim, config.attention_bias)
    if config.qkv_bias:
        attn += (config.n_heads + 2 * config.kv_heads) * config.head_dim
    return attn


def parameter_counts(config: ModelConfig) -> ParamCounts:
    r"""Parameters of a decoder (or the original encoder-decoder), by component (catalogue N7).

    Per decoder layer: attention (:func:`attention_parameter_count`, or
    :func:`mla_attention_parameter_count` for MLA), a feed-forward and ``norms_per_layer`` norms
    (:math:`d` each for RMSNorm or a LayerNorm without bias, :math:`2d` for LayerNorm). The
    feed-forward is the dense MLP (:math:`3 d d_f` for SwiGLU and GeGLU, :math:`2 d d_f` for
    GELU/ReLU, via :func:`refmath.ffn.ffn_parameter_count`) or, in the layers ``moe`` picks, the
    mixture of experts of :func:`moe_parameter_count`. An encoder-decoder adds, per decoder layer, a
    cross-attention block and one more norm, and per encoder layer one attention, one MLP and
    ``norms_per_layer`` norms. Plus :math:`V d` for the embedding, the learned position table, a
    final norm per stack when ``final_norm``, and :math:`d V` for an untied output projection.
    ``norms`` also holds QK-norm's and MLA's latent gains; ``ffn`` holds every feed-forward,
    routers and experts included.
    """
    _require_sizes(config, "parameter_counts")
    d, L = config.d_model, config.n_layers
    attn = _attention_count(config)
    ffn = 0
    if config.d_ff is not None:
        ffn = ffn_parameter_count(d, config.d_ff, gated=config.ffn in GATED_FFN_KINDS,
                                  biases=config.ffn_bias)
    norm = _norm_count(config)

    attention = L * attn
    moe_layers = config.moe_layers
    ffns = (L - moe_layers) * ffn
    if moe_layers:
        ffns += moe_layers * moe_parameter_count(d, config.moe).total
    norms = L * config.norms_per_layer * norm
    if config.qk_norm == "head":  # one gain of d_h for the queries, one for the keys (N18)
        norms += L * 2 * config.head_dim
    elif config.qk_norm == "projection":
        norms += L * (config.n_heads + config.kv_heads) * config.head_dim
    if config.latent_norm:  # MLA's RMSNorms on c (d_c) and on c^Q (q_lora_rank)
        norms += L * (config.d_c + (config.q_lora_rank or 0))
    if config.encoder_layers:
        # Decoder layers add cross-attention and its norm; encoder layers are self-attention + MLP.
        attention += L * attn + config.encoder_layers * attn
        ffns += config.encoder_layers * ffn
        norms += L * norm + config.encoder_layers * config.norms_per_layer * norm
    stacks = 2 if config.encoder_layers else 1
    norms += stacks * norm if config.final_norm else 0

    embedding = config.vocab_size * d
    positions = config.learned_positions * d
    output = 0 if config.tie_embeddings else d * config.vocab_size
    total = embedding + positions + attention + ffns + norms + output
    return ParamCounts(embedding, positions, attention, ffns, norms, output, total)


class ActiveParams(NamedTuple):
    total: int    # every parameter: parameter_counts(config).total
    active: int   # what one token's forward reads: all but the routed experts it does not choose
    matmul: int   # the weights one token multiplies by, logits included: 2 x matmul FLOPs a token


def active_parameters(config: ModelConfig) -> ActiveParams:
    r"""Total and active parameters per token of a mixture-of-experts model (any model: dense
    ones are all active; catalogue E8).

    .. math::
        P_{\text{active}} = P - L_{\text{MoE}}\,(E - k)\,3 d d_e,\qquad
        \text{matmul} = P_{\text{matmul}} + d V
                      = P_{\text{active}} - V d - \text{(positions, norm gains, biases)}

    :math:`P_{\text{active}}` is the convention of the published "active" counts: everything but
    the :math:`E - k` routed experts a token does not choose in each of the :math:`L_{\text{MoE}}`
    MoE layers, the whole embedding table and output matrix included, though a token reads one
    row of the embedding (a lookup, no arithmetic). ``matmul`` is what a token multiplies
    by: :math:`P_{\text{matmul}}`, the layers' matrices (attention's, the router, the token's
    :math:`k` experts and the shared ones), plus the logits' :math:`d V` (the embedding matrix
    itself when tied), so one token costs :math:`2\,(P_{\text{matmul}} + d V)` FLOPs of weights.

    Against the published figures (each string's last digit is its rounding): Mixtral-8x7B's
    12.9B is :math:`P_{\text{active}}` = 12,879,925,248 (the matmul count, 12,748,587,008, would
    be 12.7B), and DeepSeek-V2's 21B is either (21.38B, 20.85B). DeepSeek-V3's 37B is not
    :math:`P_{\text{active}}` = 37,552,297,472 rounded (that is 38B): it is ``matmul`` =
    36,624,596,992 rounded, or :math:`P_{\text{active}}` cut off. DeepSeek's weights README says
    36.7B including the embedding and output head, close to neither. So no one convention
    reproduces every published figure; ``active`` keeps the one that Mixtral's, the only figure
    given to three digits, needs.
    """
    if config.encoder_layers:
        raise ValueError(f"active_parameters is written for decoder-only models; {config.name!r} "
                         f"has an encoder")
    total = parameter_counts(config).total
    unchosen = 0
    if config.moe_layers:
        moe = config.moe
        expert = 3 * config.d_model * moe.d_expert
        unchosen = config.moe_layers * (moe.n_experts - moe.top_k) * expert
    matmul = _weight_macs_per_token(config) + config.d_model * config.vocab_size
    return ActiveParams(total, total - unchosen, matmul)


# ---- a model's cache, layer by layer (K6, A12) -------------------------------------------------

def _windows_per_layer(windows, layers: int) -> tuple:
    # One window (an int >= 1) or None per layer; None for the whole: no layer slides.
    if windows is None:
        return (None,) * layers
    windows = tuple(windows)
    if len(windows) != layers:
        raise ValueError(f"windows must give one window (or None) per layer: {layers} layers, "
                         f"got {len(windows)}")
    return tuple(None if w is None else check_int(f"windows[{i}]", w, 1)
                 for i, w in enumerate(windows))


def kept_positions(tokens: int, windows) -> int:
    r"""Positions one sequence of ``tokens`` tokens leaves in the cache, summed over the layers
    (K6 with A12): a layer that slides a window :math:`w_l` keeps only the last :math:`w_l`.

    .. math:: \sum_{l=1}^{L} \min(T, w_l)\qquad (w_l = \infty \text{ where a layer does not slide})

    ``windows`` holds one window or None per layer. It is :math:`L T` without windows, and it is
    also the number of keys a decode step at context :math:`T` reads, summed over the layers.
    """
    tokens = check_int("tokens", tokens, 1)
    return sum(tokens if w is None else min(tokens, w) for w in windows)


def _layer_groups(tokens: int, windows) -> dict:
    # {positions kept: how many layers keep that many}; Gemma 2 at 8192: {4096: 21, 8192: 21}
    groups = {}
    for w in windows:
        kept = tokens if w is None else min(tokens, w)
        groups[kept] = groups.get(kept, 0) + 1
    return groups


def cache_bytes_by_layer(config: ModelConfig, tokens: int, batch: int = 1,
                         bytes_per_element: int = 2) -> tuple:
    r"""Bytes of each layer's cache for ``batch`` sequences of ``tokens`` tokens (K6, K9, A12).

    .. math:: M_l = B \min(T, w_l)\, g\,(d_k + d_v)\, b
              \quad\text{or, for MLA,}\quad B \min(T, w_l)\,(d_c + d_R)\, b

    a layer that slides a window :math:`w_l` (:attr:`ModelConfig.layer_windows`) keeping only its
    last :math:`w_l` tokens, as :class:`refmath.inference.kv_cache.KVCache` does (its
    ``keys[l].nbytes + values[l].nbytes``). The decoder's self-attention only (an encoder-decoder's
    cross-attention keeps the encoder's keys and values besides).
    """
    batch = check_int("batch", batch, 1)
    tokens = check_int("tokens", tokens, 1)
    b = check_int("bytes_per_element", bytes_per_element, 1)
    sizes = []
    for w in config.layer_windows:
        kept = tokens if w is None else min(tokens, w)
        if config.is_mla:
            sizes.append(mla_cache_bytes(batch, 1, kept, config.d_c, config.d_rope, b))
        else:
            sizes.append(kv_cache_bytes(batch, 1, kept, config.kv_heads, config.head_dim, b,
                                        config.d_v))
    return tuple(sizes)


def model_cache_bytes(config: ModelConfig, tokens: int, batch: int = 1,
                      bytes_per_element: int = 2) -> int:
    r"""Bytes of the whole cache of ``config`` for ``batch`` sequences of ``tokens`` tokens: the
    sum of :func:`cache_bytes_by_layer`,

    .. math:: M_{KV} = \sum_{l=1}^{L} 2\,B \min(T, w_l)\, g\, d_h\, b

    which is :func:`kv_cache_bytes` (:math:`2 B L T g d_h b`) when no layer slides. Gemma 2 9B
    at :math:`T = 8192` in bf16: 21 layers keep 4096 tokens and 21 keep 8192, 1.97 GiB instead
    of the 2.62 GiB of a cache that kept every token in every layer.
    """
    return sum(cache_bytes_by_layer(config, tokens, batch, bytes_per_element))


# ---- FLOPs ---------------------------------------------------------------------------------------

class FlopCount(NamedTuple):
    weights: int    # matmuls with weight matrices (projections, MLP, vocabulary logits)
    attention: int  # scores q k^T and weighted sums a V
    total: int


def _attention_macs(config: ModelConfig) -> int:
    # Multiply-adds of one token through one attention block's weight matrices (no biases, norms).
    d, h, g, dh = config.d_model, config.n_heads, config.kv_heads, config.head_dim
    if config.is_mla:
        # Each matrix once: in the absorbed decode too, W_UK acts on the query, W_UV on the output.
        return mla_attention_parameter_count(d, h, dh, config.d_v, config.d_c,
                                             config.d_rope, config.q_lora_rank)
    return d * h * dh + 2 * d * g * dh + h * dh * d


def _ffn_macs(config: ModelConfig, experts: int | None = None) -> int:
    # Multiply-adds of the feed-forwards of all layers for one token, with `experts` routed experts
    # per MoE layer (default top_k: one token's; a batch reads more, see _matrix_weight_bytes).
    d = config.d_model
    dense_layers = config.n_layers - config.moe_layers
    macs = 0
    if dense_layers:
        macs += dense_layers * (3 if config.ffn in GATED_FFN_KINDS else 2) * d * config.d_ff
    if config.moe_layers:
        moe = config.moe
        experts = moe.top_k if experts is None else experts
        per_layer = (d * moe.n_experts + experts * 3 * d * moe.d_expert
                     + 3 * d * moe.shared_width + (d if moe.shared_gate else 0))
        macs += config.moe_layers * per_layer
    return macs


def _weight_macs_per_token(config: ModelConfig) -> int:
    # Multiply-adds of every weight matmul for one token through all layers (logits excluded).
    return config.n_layers * _attention_macs(config) + _ffn_macs(config)


def _causal_pairs(tokens: int, window: int | None) -> int:
    # sum_{i=1}^{T} min(i, w) in closed form: T(T+1)/2 while T <= w, then w more pairs per token.
    if window is None or tokens <= window:
        return tokens * (tokens + 1) // 2
    return window * (window + 1) // 2 + (tokens - window) * window


def _decoder_only(config: ModelConfig, what: str) -> None:
    _require_sizes(config, what)
    if config.encoder_layers:
        raise ValueError(f"{what} is written for decoder-only models; {config.name!r} has an encoder")
    if config.is_mla:
        raise ValueError(f"{what} does not count MLA attention ({config.name!r}): its scores run "
                         f"on the latent cache, which these formulas do not model; "
                         f"active_parameters counts its weights")


def prefill_flops(config: ModelConfig, tokens: int, batch: int = 1,
                  all_logits: bool = False) -> FlopCount:
    r"""FLOPs of a causal prefill over ``tokens`` prompt tokens (catalogue K5).

    Convention: 2 FLOPs per multiply-add. Counted: the weight matmuls (Q, K, V, O projections, the
    MLP, and the vocabulary logits: for the last position only, as generation needs, or for all
    positions with ``all_logits``) and, separately, attention's scores :math:`q k^\top` and value
    sums :math:`a V`, each :math:`2 d_h` FLOPs per head per allowed query-key pair. A causal
    implementation skips masked pairs, so a prompt of :math:`T` tokens has :math:`T(T+1)/2` pairs
    (fewer in a layer that slides a window :math:`w_l`: :attr:`ModelConfig.layer_windows`). Not
    counted: softmax, norms, activations, RoPE, residual adds, biases, the embedding lookup. With a
    mixture of experts :math:`P_{\text{matmul}}` holds the router, the :math:`k` experts each
    token chooses and the shared ones (the active weights of :func:`active_parameters`); MLA
    attention is refused.

    .. math:: \text{weights} = 2\,B\,T\,P_{\text{matmul}} + 2\,B\,d\,V,\qquad
              \text{attention} = 4\,B\,h\,d_h \sum_{l=1}^{L} \sum_{i=1}^{T} \min(i, w_l)
    """
    _decoder_only(config, "prefill_flops")
    tokens = check_int("tokens", tokens, 1)
    batch = check_int("batch", batch, 1)
    logit_rows = tokens if all_logits else 1
    weights = 2 * batch * (tokens * _weight_macs_per_token(config)
                           + logit_rows * config.d_model * config.vocab_size)
    pairs = sum(_causal_pairs(tokens, w) for w in config.layer_windows)  # over the layers
    attention = 4 * batch * config.n_heads * config.head_dim * pairs
    return FlopCount(weights, attention, weights + attention)


def decode_step_flops(config: ModelConfig, context: int, batch: int = 1) -> FlopCount:
    r"""FLOPs of one decode step whose new query attends to ``context`` keys (cache + itself) (K5).

    Same convention as :func:`prefill_flops`: one token through every weight matmul plus its
    logits, and :math:`4 h d_h t` FLOPs of attention per layer for :math:`t` attended keys, the
    :math:`O(t h d_h)` per layer of catalogue K5; a layer that slides a window :math:`w_l` attends
    :math:`\min(t, w_l)` keys (:func:`kept_positions` sums them).
    """
    _decoder_only(config, "decode_step_flops")
    context = check_int("context", context, 1)
    batch = check_int("batch", batch, 1)
    weights = 2 * batch * (_weight_macs_per_token(config) + config.d_model * config.vocab_size)
    keys = kept_positions(context, config.layer_windows)  # summed over the layers
    attention = 4 * batch * config.n_heads * config.head_dim * keys
    return FlopCount(weights, attention, weights + attention)


# ---- what GQA saves and what it does not (A13) --------------------------------------------------

class AttentionDesignCost(NamedTuple):
    q_o_projection_flops: int   # x W_Q and O W_O for one new token
    kv_projection_flops: int    # x W_K and x W_V for one new token
    score_flops: int            # q k^T and a V against the attended keys
    cache_bytes: int            # keys and values read from the cache
    kv_parameters: int          # entries of W_K and W_V


def attention_design_cost(d_model: int, heads: int, kv_heads: int, head_dim: int, context: int,
                          bytes_per_element: int = 2) -> AttentionDesignCost:
    r"""One decode step of one attention layer, for one sequence: what grouping changes (A13).

    With :math:`h` query heads, :math:`g` key/value heads of width :math:`d_h` and :math:`t`
    attended keys, counting 2 FLOPs per multiply-add:

    .. math::
        \text{Q, O projections} = 4\,d\,h d_h,\qquad
        \text{K, V projections} = 4\,d\,g d_h,\qquad
        \text{scores and values} = 4\,h\,d_h\,t,\qquad
        \text{cache read} = 2\,t\,g\,d_h\,b

    Every query head still scores every key, so the score arithmetic does not depend on
    :math:`g`: grouped-query attention divides the K/V projections, their parameters
    (:math:`2 d g d_h`) and the cache by :math:`h/g`, and nothing else.
    """
    d = check_int("d_model", d_model, 1)
    h = check_int("heads", heads, 1)
    g = check_int("kv_heads", kv_heads, 1)
    dh = check_int("head_dim", head_dim, 1)
    t = check_int("context", context, 1)
    b = check_int("bytes_per_element", bytes_per_element, 1)
    _check_kv_heads_divide(h, g)
    return AttentionDesignCost(q_o_projection_flops=4 * d * h * dh,
                               kv_projection_flops=4 * d * g * dh,
                               score_flops=4 * h * dh * t,
                               cache_bytes=2 * t * g * dh * b,
                               kv_parameters=2 * d * g * dh)


# ---- decode is bound by memory bandwidth (K13) --------------------------------------------------

class StepTraffic(NamedTuple):
    flops: int            # as prefill_flops / decode_step_flops count them
    weight_bytes: int     # every weight matrix the step multiplies by, read once
    cache_bytes: int      # KV cache read (decode) or written (prefill)
    total_bytes: int
    intensity: float      # flops / total_bytes: FLOPs per byte moved


def _matrix_weight_bytes(config: ModelConfig, bytes_per_element: int, tokens: int) -> int:
    # The weight matrices a step of `tokens` tokens passes through, logits included, each read once.
    # Dense: the weight FLOPs / 2 of one token. MoE: each token reads its own top_k experts, so the
    # step reads k experts per MoE layer for one token and at most min(E, tokens k) for more.
    experts = None if config.moe is None else min(config.moe.n_experts, tokens * config.moe.top_k)
    macs = config.n_layers * _attention_macs(config) + _ffn_macs(config, experts)
    return bytes_per_element * (macs + config.d_model * config.vocab_size)


def decode_step_traffic(config: ModelConfig, context: int, batch: int = 1,
                        bytes_per_element: int = 2) -> StepTraffic:
    r"""FLOPs and bytes of one decode step of ``batch`` sequences at ``context`` keys (K13).

    The weights are read once per step, whatever the batch; each sequence reads its own cache,
    :math:`\min(t, w_l)` tokens in a layer that slides a window :math:`w_l` and :math:`t` in the
    others (:func:`model_cache_bytes` at :math:`T = t`):

    .. math::
        \text{bytes} = b\,\Big(P_{\text{matmul}} + d V\Big)
          + B \sum_{l=1}^{L} \min(t, w_l)\; 2 g d_h b,\qquad
        I = \frac{\text{FLOPs}}{\text{bytes}}
          \approx \frac{2 B P_{\text{matmul}}}{b P_{\text{matmul}}} = \frac{2B}{b}

    while the weights dominate the bytes (the cache, read once per sequence, pulls :math:`I` below
    :math:`2B/b` at long contexts and large batches). So at batch 1 in 16 bits a decode step does
    about one FLOP per byte, far below what a processor can do per byte of memory traffic: its time
    is bounded by bandwidth (see :func:`decode_time_lower_bound`). Activations and norm gains are
    not counted.

    With a mixture of experts, :math:`P_{\text{matmul}}` holds the experts the step reads: at
    batch 1 the :math:`k` chosen in each MoE layer (the active weights of
    :func:`active_parameters`); a batch reads the union of its tokens' choices, counted here at
    its most, :math:`\min(E, B k)` experts a layer (every token choosing others; up to all
    :math:`E`), which balanced routing approaches at large batches. The fewest is :math:`k` (all
    tokens agreeing), so for :math:`B > 1` the bytes are a worst case, not a lower bound. The
    FLOPs are each token's own :math:`k` experts either way.
    """
    _decoder_only(config, "decode_step_traffic")
    b = check_int("bytes_per_element", bytes_per_element, 1)
    flops = decode_step_flops(config, context, batch).total
    weights = _matrix_weight_bytes(config, b, batch)
    cache = model_cache_bytes(config, check_int("context", context, 1), batch, b)
    return StepTraffic(flops, weights, cache, weights + cache, flops / (weights + cache))


def prefill_traffic(config: ModelConfig, tokens: int, batch: int = 1,
                    bytes_per_element: int = 2) -> StepTraffic:
    r"""FLOPs and bytes of a prefill of ``batch`` prompts of ``tokens`` tokens (K13).

    The weights are read once for all :math:`B T` tokens and the cache the prompt leaves is
    written once (:func:`model_cache_bytes`: a layer that slides a window :math:`w_l` keeps only
    :math:`\min(T, w_l)` of its tokens), so the intensity grows with the prompt:

    .. math::
        I = \frac{2 B T P_{\text{matmul}} + \dots}{b P_{\text{matmul}} + B T\, 2 L g d_h b}
          \approx \frac{2 B T}{b}\quad(\text{for a short prompt})

    A mixture of experts reads at most :math:`\min(E, B T k)` experts a layer (see
    :func:`decode_step_traffic`): all of them for any but the shortest prompts.
    """
    _decoder_only(config, "prefill_traffic")
    b = check_int("bytes_per_element", bytes_per_element, 1)
    flops = prefill_flops(config, tokens, batch).total
    weights = _matrix_weight_bytes(config, b, batch * tokens)
    cache = model_cache_bytes(config, tokens, batch, b)
    return StepTraffic(flops, weights, cache, weights + cache, flops / (weights + cache))


def decode_time_lower_bound(traffic: StepTraffic, bandwidth: float,
                            peak_flops: float | None = None) -> float:
    r"""Seconds a step needs at least: its bytes over the memory bandwidth (K13, the roofline).

    .. math:: t \;\ge\; \max\!\Big(\frac{\text{weight bytes} + \text{cache bytes}}{\beta},\;
              \frac{\text{FLOPs}}{\pi}\Big)

    with :math:`\beta` the bandwidth in bytes/s and :math:`\pi` the peak FLOP rate (optional; a
    decode step at a small batch is always on the bandwidth side, :math:`I < \pi / \beta`).
    """
    if not isinstance(traffic, StepTraffic):
        raise TypeError(f"traffic must be a StepTraffic (from decode_step_traffic or "
                        f"prefill_traffic), got {type(traffic).__name__}")
    bandwidth = check_real("bandwidth", bandwidth, 0.0, low_open=True)
    memory_time = traffic.total_bytes / bandwidth
    if peak_flops is None:
        return memory_time
    peak_flops = check_real("peak_flops", peak_flops, 0.0, low_open=True)
    return max(memory_time, traffic.flops / peak_flops)


# ---- a mixture of experts: memory against compute, expert-parallel traffic ----------------------

class MemoryAgainstCompute(NamedTuple):
    total: int            # parameters held
    active: int           # parameters one token's forward reads (active_parameters)
    weight_bytes: int     # every parameter at b bytes: what the devices must hold
    expert_bytes: int     # the routed experts' share of weight_bytes
    token_flops: int      # FLOPs of one token through the weights: 2 x active matmul weights
    bytes_per_flop: float  # weight_bytes / token_flops


def memory_against_compute(config: ModelConfig, bytes_per_element: int = 2) -> MemoryAgainstCompute:
    r"""The weights a model must hold against the arithmetic of one token (any model; the gap is
    a mixture of experts'; catalogue E9).

    .. math::
        M = b\,P,\qquad M_{\text{experts}} = b\,L_{\text{MoE}}\,E\cdot 3 d d_e,\qquad
        F_{\text{token}} = 2\,(P_{\text{matmul}} + d V)

    with the counts of :func:`active_parameters` (attention scores are not in
    :math:`F_{\text{token}}`: they depend on the context). A dense model holds about
    :math:`b/2` bytes of weights per FLOP of a token; a mixture of experts holds every expert but
    computes with :math:`k` of them (DeepSeek-V3 in bf16: 1.22 TiB of weights, 7.3e10 FLOPs a
    token, 18 bytes per FLOP, against 1.07 for Llama-3-8B).
    """
    b = check_int("bytes_per_element", bytes_per_element, 1)
    counts = active_parameters(config)
    experts = 0
    if config.moe_layers:
        experts = config.moe_layers * moe_parameter_count(config.d_model, config.moe).routed
    flops = 2 * counts.matmul
    return MemoryAgainstCompute(counts.total, counts.active, b * counts.total, b * experts, flops,
                                b * counts.total / flops)


def expert_parallel_bytes(d_model: int, top_k: int, devices: int, bytes_per_element: int = 2,
                          max_devices: int | None = None) -> float:
    r"""All-to-all bytes one token sends and receives in one MoE layer under expert parallelism
    (catalogue E10).

    The experts are spread evenly over :math:`D` devices and the token's hidden row (:math:`d`
    numbers of :math:`b` bytes) lives on one of them. Dispatch sends the row to each chosen expert
    on another device, and combine sends that expert's :math:`d`-wide output back. The token's
    device is the device of a given chosen expert with probability :math:`1/D` (uniform routing,
    or a token on a uniformly chosen device), so the expected traffic is

    .. math:: 2\,k\,\Big(1 - \frac{1}{D}\Big)\,d\,b \quad\text{bytes per MoE layer.}

    ``max_devices`` :math:`M` is group-limited routing with one group of experts on each device
    (:class:`refmath.moe.MoEConfig`'s ``topk_groups`` of ``n_groups``: DeepSeek-V2's
    device-limited routing, :math:`M = 3`; DeepSeek-V3's node-limited routing, 4 of 8 nodes): the
    token's experts lie on at most :math:`M` devices, and it is sent once to each of them, its
    outputs there summed before they come back, so the traffic is at most

    .. math:: 2\,\min(k, M)\,\Big(1 - \frac{1}{D}\Big)\,d\,b

    (exactly this when its experts span :math:`\min(k, M)` devices; fewer devices, less). Not
    counted: the expert indices and gate weights that travel with the row, padding to a fixed
    capacity, the token's own device's copy. DeepSeek-V3 dispatches in FP8 and combines in BF16,
    which is :math:`b = 1` one way and 2 the other.
    """
    d = check_int("d_model", d_model, 1)
    k = check_int("top_k", top_k, 1)
    D = check_int("devices", devices, 1)
    b = check_int("bytes_per_element", bytes_per_element, 1)
    sends = k
    if max_devices is not None:
        M = check_int("max_devices", max_devices, 1, D)
        sends = min(k, M)
    return 2 * sends * (1 - 1 / D) * d * b


class ExpertParallelTraffic(NamedTuple):
    devices: int               # D
    max_devices: int | None    # M, node-limited routing's cap (None: none)
    per_layer: float           # bytes of one token in one MoE layer (expert_parallel_bytes)
    per_token: float           # bytes of one token through all its MoE layers


def expert_parallel_traffic(config: ModelConfig, devices: int | None = None,
                            bytes_per_element: int = 2,
                            node_limited: bool = False) -> ExpertParallelTraffic:
    r""":func:`expert_parallel_bytes` for ``config``'s mixture of experts, per layer and per token
    (:math:`L_{\text{MoE}}` layers).

    ``devices`` defaults to :math:`E`, one expert on each device. ``node_limited`` takes the
    routing's groups as the devices (:math:`D` = ``n_groups``) and caps the devices a token
    reaches at :math:`M` = ``topk_groups``, as DeepSeek-V3's node-limited routing does with nodes
    (8 nodes, at most 4 a token) and DeepSeek-V2's with devices (at most 3); the routing must then
    be group-limited.
    """
    if config.moe is None:
        raise ValueError(f"expert_parallel_traffic needs a mixture of experts; config "
                         f"{config.name!r} has moe = None")
    moe = config.moe
    node_limited = check_flag("node_limited", node_limited)
    if node_limited:
        if moe.routing == "greedy":
            raise ValueError(f"node_limited needs group-limited routing; config {config.name!r} "
                             f"has moe.routing = 'greedy'")
        if devices is not None and devices != moe.n_groups:
            raise ValueError(f"node_limited puts each of the n_groups = {moe.n_groups} groups on "
                             f"its own device; devices = {devices} differs")
        devices, cap = moe.n_groups, moe.topk_groups
    else:
        devices = moe.n_experts if devices is None else check_int("devices", devices, 1)
        cap = None
    per_layer = expert_parallel_bytes(config.d_model, moe.top_k, devices, bytes_per_element, cap)
    return ExpertParallelTraffic(devices, cap, per_layer, config.moe_layers * per_layer)


# ---- comparing attention choices (S3) -----------------------------------------------------------

class CacheRow(NamedTuple):
    kind: str             # "MHA", "GQA", "MQA" or "MLA"
    label: str            # e.g. "GQA (g=8)"
    bytes_per_token: int  # one sequence, all layers: a token that every layer holds (K6)
    total: int            # batch x tokens, a sliding layer holding at most its window


def attention_cache_rows(layers: int, heads: int, kv_heads: int, head_dim: int, tokens: int,
                         batch: int = 1, bytes_per_element: int = 2, latent_dim: int | None = None,
                         rope_dim: int | None = None, windows=None) -> list[CacheRow]:
    r"""KV cache of MHA, GQA, MQA and MLA at one shape, for comparison (catalogue K7, K9, S3).

    MHA has :math:`g = h`, MQA :math:`g = 1`, and the GQA row (shown when :math:`1 < g < h`) uses
    ``kv_heads``. The MLA row uses ``latent_dim`` and ``rope_dim`` when given; otherwise DeepSeek-V2's
    proportions :math:`d_c = 4 d_h` and :math:`d_R = d_h / 2`, i.e. the same bytes as GQA with 2.25
    KV heads.

    ``windows`` (one sliding window or None per layer, as :attr:`ModelConfig.layer_windows`) makes
    each row's ``total`` count :math:`\min(T, w_l)` tokens in layer :math:`l`
    (:func:`kept_positions`); the windows cap what every design keeps, whatever it keeps per token.
    ``bytes_per_token`` stays the K6 figure of a token that every layer holds.
    """
    layers = check_int("layers", layers, 1)
    heads = check_int("heads", heads, 1)
    kv_heads = check_int("kv_heads", kv_heads, 1)
    head_dim = check_int("head_dim", head_dim, 1)
    tokens = check_int("tokens", tokens, 1)
    _check_kv_heads_divide(heads, kv_heads)
    groups = _layer_groups(tokens, _windows_per_layer(windows, layers))  # {tokens kept: layers}
    if latent_dim is None:
        latent_dim = 4 * head_dim
    if rope_dim is None:
        rope_dim = max(1, head_dim // 2)

    rows = []
    choices = [("MHA", f"MHA (g=h={heads})", heads)]
    if 1 < kv_heads < heads:
        choices.append(("GQA", f"GQA (g={kv_heads})", kv_heads))
    if heads > 1:
        choices.append(("MQA", "MQA (g=1)", 1))
    for kind, label, g in choices:
        per_token = kv_cache_bytes_per_token(layers, g, head_dim, bytes_per_element)
        total = sum(kv_cache_bytes(batch, n, kept, g, head_dim, bytes_per_element)
                    for kept, n in groups.items())
        rows.append(CacheRow(kind, label, per_token, total))
    per_token = mla_cache_bytes_per_token(layers, latent_dim, rope_dim, bytes_per_element)
    total = sum(mla_cache_bytes(batch, n, kept, latent_dim, rope_dim, bytes_per_element)
                for kept, n in groups.items())
    rows.append(CacheRow("MLA", f"MLA (d_c={latent_dim}, d_R={rope_dim})", per_token, total))
    return rows


# ---- printing and plotting -----------------------------------------------------------------------

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """Human-readable size in binary units (1 KiB = 1024 B): ``format_bytes(2**30) == '1.00 GiB'``."""
    if n < 1024:
        return f"{n:.0f} B"
    value, unit = float(n), 0
    while value >= 1024 and unit < len(_BINARY_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{value:.2f} {_BINARY_UNITS[unit]}"


# ---- a Hugging Face config's sizes ----------------------------------------------------------------

def sizing_config(hf: dict) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face config dict, for ``sizes --hf``: the refmath
    model it loads into (the same refusals as :func:`refmath.hf.load_checkpoint`), described by
    that model's own ``sizing_fields``, with the context the config was trained for."""
    name, config = config_from_hf(hf)
    fields = model_module(name).sizing_fields(config)
    context = int(hf.get("max_position_embeddings", hf.get("n_positions", config.max_seq_len)))
    return ModelConfig(name=hf["model_type"], context=context, source="config.json", **fields)


def hf_parameter_count(hf: dict, buffers: bool = False) -> int:
    """Parameters of the refmath model a Hugging Face config loads into, as transformers counts
    them: every tensor's size but DeepSeek-V3's routing biases (``router.bias``, the checkpoint's
    ``e_score_correction_bias``), which no gradient trains and transformers keeps as buffers.
    ``buffers=True`` counts those too (every tensor the checkpoint stores)."""
    name, config = config_from_hf(hf)
    return sum(math.prod(shape) for key, shape in model_module(name).param_shapes(config).items()
               if buffers or not key.endswith("router.bias"))


def own_design(config: ModelConfig) -> str:
    """The attention design of ``config``: the kind of its row in :func:`attention_cache_rows`."""
    if config.is_mla:
        return "MLA"
    return "MHA" if config.kv_heads == config.n_heads else "MQA" if config.kv_heads == 1 else "GQA"


def save_cache_plot(path, config: ModelConfig, tokens: int, batch: int = 1,
                    bytes_per_element: int = 2, latent_dim: int | None = None,
                    rope_dim: int | None = None) -> None:
    """Save a figure of cache size against context length (1..``tokens``) for MHA/GQA/MQA/MLA.

    matplotlib is imported here, with the Agg canvas and no pyplot, so that importing refmath never
    needs it and no global backend is changed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    latent_dim = config.d_c if latent_dim is None else latent_dim
    rope_dim = config.d_rope if rope_dim is None else rope_dim

    # Log-log axes: every choice is a line of slope 1 (the cache is linear in T) until T passes a
    # sliding layer's window, where it bends flatter (that layer stops growing); the vertical gap
    # between two lines is their constant ratio, visible even when one is 100x smaller.
    lengths = sorted({2**k for k in range(tokens.bit_length()) if 2**k <= tokens} | {tokens})
    series = {}
    for t in lengths:
        for row in attention_cache_rows(config.n_layers, config.n_heads, config.kv_heads,
                                        config.head_dim, t, batch, bytes_per_element, latent_dim,
                                        rope_dim, config.layer_windows):
            series.setdefault((row.kind, row.label), []).append(row.total / 2**30)

    own = own_design(config)
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for (kind, label), sizes in series.items():
        if kind == own:  # the model as it is: a thick line, on top
            ax.plot(lengths, sizes, label=f"{label}: {config.name} itself", linewidth=3, zorder=3)
        else:
            ax.plot(lengths, sizes, label=f"{label}: same shape, other attention", linestyle="--")
    ax.set_xlabel("context length T (tokens)")
    ax.set_ylabel("KV cache (GiB, binary: 2^30 bytes)")
    ax.set_title(f"{config.name}: KV cache of L={config.n_layers} layers, h={config.n_heads} heads "
                 f"of d_h={config.head_dim}\nbatch B={batch}, {bytes_per_element} bytes per element")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
