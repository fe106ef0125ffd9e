r"""The MLA decoder (catalogue M4): the M3 recurrence with DeepSeek-V2 style latent attention.

Everything but the attention sublayer (embedding, Pre-RMSNorm residual sublayers, SwiGLU, final
RMSNorm, output head, loss, dropout) is :mod:`refmath.models.decoder`'s; this module supplies the
multi-head latent attention as an :class:`~refmath.models.common.AttentionOps`.

Multi-head latent attention (K8, K9), for a token row :math:`x_j` and head :math:`r`:

.. math::
    c_j = x_j W_{DKV} \in \mathbb R^{d_c},\qquad
    k^C_{j,r} = c_j W_{UK,r},\qquad v_{j,r} = c_j W_{UV,r},\qquad
    k^R_j = \operatorname{RoPE}(x_j W_{KR}) \in \mathbb R^{d_R} \\
    q^C_{i,r} = u_i W_{UQ,r},\qquad q^R_{i,r} = \operatorname{RoPE}(u_i W_{QR,r}),\qquad
    u_i = x_i \text{ (no query compression) or } c^Q_i = x_i W_{DQ} \\
    s_{ij,r} = \frac{q^C_{i,r} (k^C_{j,r})^\top + q^R_{i,r} (k^R_j)^\top}{\sqrt{d_k + d_R}}
               + M_{ij},\qquad
    o_{i,r} = \sum_j \operatorname{softmax}_j(s_{i\cdot,r})_j\, v_{j,r},\qquad
    y_i = [o_{i,1} \cdots o_{i,h}]\, W_O

The content key and the value of every head are up-projections of one latent row :math:`c_j`, and
the positional key :math:`k^R_j` is one row shared by all heads, so an inference cache keeps only
:math:`c_j` and :math:`k^R_j`: :math:`d_c + d_R` numbers per token and layer (K9's
:math:`M_{\mathrm{MLA}} = BLT(d_c + d_R)b`). RoPE cannot act on :math:`k^C` (it would sit between
the query and :math:`W_{UK}` and depend on the key's position), hence the separate rotated part.
Only the expanded path is here: the absorbed form :math:`\hat q = q^C W_{UK}^\top` belongs to
the inference code.

The sum of the two score terms is one dot product of concatenations,
:math:`[q^C\ q^R] \cdot [k^C\ k^R]`, so the scores go through
:func:`refmath.attention.sdpa_forward` with keys and queries of width :math:`d_k + d_R` and its
default scale :math:`1/\sqrt{d_k + d_R}`; the values keep their own width :math:`d_v`.

Latent norms (``latent_norm``): DeepSeek-V2's released model code applies an RMSNorm with a learned
gain to the compressed query :math:`c^Q` and to the latent :math:`c` before their up-projections;
the paper's equations do not show them. They are off by default; when on, the cached latent is the
normalised one (the input of :math:`W_{UK}` and :math:`W_{UV}`).

Attention parameters, relative to ``layers.{i}.attn.`` (``rank`` = ``q_lora_rank``)::

    w_dkv (d, d_c)          [kv_norm.gamma (d_c,)]   w_uk (d_c, h d_k)   w_uv (d_c, h d_v)
    w_kr  (d, d_R)
    without query compression:  w_q (d, h d_k)       w_qr (d, h d_R)
    with query compression:     w_dq (d, rank)  [q_norm.gamma (rank,)]
                                w_uq (rank, h d_k)   w_qr (rank, h d_R)
    w_o   (h d_v, d)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np

from refmath._validate import check_field, check_flag, check_int, check_real
from refmath.attention import (SDPACache, causal_mask, merge_heads, sdpa_backward, sdpa_forward,
                               split_heads)
from refmath.ffn import LinearCache, linear_backward, linear_forward, matmul_rows_many
from refmath.models import check_config
from refmath.models import decoder
from refmath.models.hf_layout import (DEEPSEEK_EXPERTS, HFCheckpointError, join_heads_columns,
                                      linear_out, refuse, refuse_common, require, rope_from_hf,
                                      rope_to_hf, split_heads_columns, swiglu_layers_to_hf,
                                      take_ends, take_feed_forward_layer)
from refmath.moe import MoEConfig
from refmath.models.cases import model_case_maker, moe_case_maker
from refmath.models.common import AttentionOps, CacheSpec, TrainingRecipe, named_config
from refmath.models.decoder_config import FamilyConfig, check_shared_fields
from refmath.models.decoder import (DecoderCache, decoder_param_shapes, init_decoder_params,
                                    layer_states, lm_forward)
from refmath.norms import RMSNormCache, rmsnorm_backward, rmsnorm_forward
from refmath.positions import (RoPECache, RopeScaling, as_rope_scaling, rope_backward,
                               rope_forward, rope_inv_freq, rope_softmax_scale)
from refmath.registry import OpCase, ParamCase, layer_case_ops, register_case

__all__ = [
    "MLAConfig", "PRESETS", "preset", "TRAINING_RECIPE", "mla_rope", "mla_scale", "mla_forward",
    "mla_backward", "mla_state", "mla_cached", "MLA", "param_shapes", "init_params", "forward",
    "backward", "logits", "layer_latents", "cache_spec", "embed", "head", "cache_stale",
    "rope_options", "COMPILED_FIELDS", "compiled_layer_spec", "cached_layer", "sizing_fields",
    "HF_MODEL_TYPES", "config_from_hf", "params_from_hf", "to_hf"
]


@dataclass(frozen=True, kw_only=True)
class MLAConfig(FamilyConfig):
    r"""Sizes and options of the M4 decoder. ``dataclasses.asdict`` round-trips through JSON.

    ``d_c`` is the key/value latent width, ``d_rope`` the width :math:`d_R` of the rotary query and
    key parts (even). ``head_dim`` (:math:`d_k`, the content query/key width per head, read as
    :attr:`d_h`) defaults to ``d_model // n_heads``, ``v_head_dim`` (:math:`d_v`, read as
    :attr:`d_v`) to ``head_dim``. ``q_lora_rank`` is the width of the compressed query
    :math:`c^Q`, or None for queries projected straight from ``x``.
    ``latent_norm`` adds RMSNorms on the latents (see the module docstring), with epsilon
    ``latent_norm_eps`` (default: ``norm_eps``; DeepSeek-V2's released code fixes it at 1e-6
    whatever its other norms use). ``rope_scaling`` rescales the rotary part's frequencies
    (N13, N15, N16); with YaRN's ``mscale_all_dim`` it also multiplies the softmax scale
    :math:`1/\sqrt{d_k + d_R}` by :math:`\mu(s;\text{mscale\_all\_dim})^2`, DeepSeek's correction
    (:func:`refmath.positions.rope_softmax_scale`). The length-dependent rules (dynamic NTK,
    LongRoPE) are refused: the latent cache keeps rotated keys too. The other fields mean what they
    mean in :class:`refmath.models.decoder.DecoderConfig`.
    """

    d_c: int
    d_rope: int
    v_head_dim: int | None = None
    q_lora_rank: int | None = None
    latent_norm: bool = False
    latent_norm_eps: float | None = None
    rope_scaling: RopeScaling | None = None

    # M3's block, which M4 keeps as it is: the options of DecoderConfig that the shared layer code
    # (refmath.models.decoder) reads, fixed at Llama's values (class constants, not fields)
    norm_offset: ClassVar[float] = 0.0
    window_layers: ClassVar[tuple | None] = None

    def __post_init__(self):
        check_shared_fields(self)
        object.__setattr__(self, "rope_scaling",
                           as_rope_scaling(self.rope_scaling, "MLAConfig.rope_scaling"))
        if self.rope_scaling is not None and self.rope_scaling.length_dependent:
            raise ValueError(f"MLAConfig.rope_scaling: rope_type {self.rope_scaling.rope_type!r} "
                             f"depends on the sequence length, which MLA's cache of rotated keys "
                             f"does not follow; use 'linear', 'llama3' or 'yarn'")
        if self.attention_backend != "numpy":
            raise ValueError(f"MLAConfig.attention_backend = {self.attention_backend!r} is not "
                             f"available: MLA's keys (d_k + d_R wide) and values (d_v wide) differ "
                             f"in width, which the kernels do not take; use 'numpy'")
        check_field(self, "latent_norm_eps", check_real, 0.0, low_open=True, optional=True)
        for name in ("d_c", "d_rope"):
            check_field(self, name, check_int, 1)
        for name in ("v_head_dim", "q_lora_rank"):
            check_field(self, name, check_int, 1, optional=True)
        check_field(self, "latent_norm", check_flag)
        if self.d_rope % 2:
            raise ValueError(f"MLAConfig.d_rope = {self.d_rope} must be even for RoPE's "
                             f"coordinate pairs")

    @property
    def latent_eps(self) -> float:
        """The epsilon of the latent RMSNorms."""
        return self.norm_eps if self.latent_norm_eps is None else self.latent_norm_eps

    @property
    def d_v(self) -> int:
        """The value width per head."""
        return self.d_h if self.v_head_dim is None else self.v_head_dim


PRESETS = {
    # For lessons on a CPU: the latent (d_c = 32) plus rotary key (d_R = 8) is 40 numbers per token
    # and layer, against 2 h d_h = 128 for the same heads in MHA.
    "tiny": dict(vocab_size=256, max_seq_len=128, d_model=64, n_layers=2, n_heads=4, d_c=32,
                 d_rope=8, ffn_multiple_of=16),
    # DeepSeek-V2's ratios at a small width (d_c = 4 d_k, d_R = d_k / 2, query compression, latent
    # norms), not a released checkpoint.
    "small": dict(vocab_size=32000, max_seq_len=1024, d_model=768, n_layers=12, n_heads=12,
                  d_c=256, d_rope=32, q_lora_rank=384, latent_norm=True, ffn_multiple_of=256,
                  norm_eps=1e-5),
}


def preset(name: str, **overrides) -> MLAConfig:
    """A named configuration from :data:`PRESETS`, with any field overridden by keyword."""
    return named_config(MLAConfig, PRESETS, name, overrides)


# The default of `python -m refmath train` (as GPT's: about 2.5 min on two busy CPU cores).
TRAINING_RECIPE = TrainingRecipe(
    {"name": "chars", "seq_len": 64},
    # The latent norms, with deepseek_v3's epsilon (DEEPSEEK_LATENT_EPS): the run converts to it.
    dict(n_layers=2, d_model=64, n_heads=4, d_c=32, d_rope=8, ffn_multiple_of=16,
         latent_norm=True, latent_norm_eps=1e-6),
    steps=1000, batch_size=32, lr=3e-3, tasks=("chars", "reverse-lm"))


# ---- multi-head latent attention -------------------------------------------------------------------


class MLACache(NamedTuple):
    kv_down: LinearCache  # c = x W_DKV
    kv_norm: RMSNormCache | None
    k_up: LinearCache  # k^C = c W_UK; its input is the latent an inference cache keeps
    v_up: LinearCache  # v = c W_UV
    kr_proj: LinearCache  # x W_KR
    kr_rope: RoPECache
    q_down: LinearCache | None  # c^Q = x W_DQ, None without query compression
    q_norm: RMSNormCache | None
    qc_proj: LinearCache  # q^C = u W_UQ (or x W_Q)
    qr_proj: LinearCache  # u W_QR, before its rotation
    qr_rope: RoPECache
    attn: SDPACache  # queries [q^C q^R], keys [k^C k^R] (k^R repeated to every head), values v
    out: LinearCache  # [o_1 ... o_h] W_O


def mla_shapes(config: MLAConfig) -> dict:
    d, h, d_k, d_v = config.d_model, config.n_heads, config.d_h, config.d_v
    d_c, d_r, rank = config.d_c, config.d_rope, config.q_lora_rank
    shapes = {"w_dkv": (d, d_c)}
    if config.latent_norm:
        shapes["kv_norm.gamma"] = (d_c,)
    shapes.update(w_uk=(d_c, h * d_k), w_uv=(d_c, h * d_v), w_kr=(d, d_r))
    if rank is None:
        shapes.update(w_q=(d, h * d_k), w_qr=(d, h * d_r))
    else:
        shapes["w_dq"] = (d, rank)
        if config.latent_norm:
            shapes["q_norm.gamma"] = (rank,)
        shapes.update(w_uq=(rank, h * d_k), w_qr=(rank, h * d_r))
    shapes["w_o"] = (h * d_v, d)
    return shapes


def mla_rope(config: MLAConfig, offset: int = 0) -> dict:
    """``rope_forward``'s keyword arguments for the rotary part (width ``d_rope``): the plain
    rotation, or ``config.rope_scaling``'s frequencies and attention factor."""
    rope = dict(offset=offset, base=config.rope_base, layout=config.rope_layout)
    if config.rope_scaling is not None:
        inv_freq, factor = rope_inv_freq(config.d_rope, config.rope_base, config.rope_scaling)
        rope.update(inv_freq=inv_freq, attention_factor=factor)
    return rope


def mla_scale(config: MLAConfig) -> float:
    r"""The softmax scale :math:`1/\sqrt{d_k + d_R}`, times DeepSeek's YaRN correction (N16)."""
    return rope_softmax_scale(config.d_h + config.d_rope, config.rope_scaling)


def mla_forward(x, params: dict, config: MLAConfig):
    r"""Causal multi-head latent attention, expanded path (catalogue K8, K9; equations in the module
    docstring). ``x`` is ``(B, T, d)``; returns ``(Y, cache)`` with ``Y`` ``(B, T, d)``."""
    h, eps, rope = config.n_heads, config.latent_eps, mla_rope(config)
    # Keys and values: one latent row per token, expanded per head; one rotary key for all heads.
    c, kv_down = linear_forward(x, params["w_dkv"])
    kv_norm = None
    if config.latent_norm:
        c, kv_norm = rmsnorm_forward(c, params["kv_norm.gamma"], eps)
    k_c, k_up = linear_forward(c, params["w_uk"])
    v, v_up = linear_forward(c, params["w_uv"])
    k_r, kr_proj = linear_forward(x, params["w_kr"])
    k_r, kr_rope = rope_forward(k_r, **rope)  # (B, T, d_R): the sequence axis is -2
    # Queries, from x or from the compressed query.
    q_down = q_norm = None
    u = x
    if config.q_lora_rank is not None:
        u, q_down = linear_forward(x, params["w_dq"])
        if config.latent_norm:
            u, q_norm = rmsnorm_forward(u, params["q_norm.gamma"], eps)
    q_c, qc_proj = linear_forward(u, params["w_q" if config.q_lora_rank is None else "w_uq"])
    q_r, qr_proj = linear_forward(u, params["w_qr"])
    q_r, qr_rope = rope_forward(split_heads(q_r, h), **rope)
    # Scores (q^C k^C^T + q^R k^R^T) / sqrt(d_k + d_R) as one product of concatenations (K9).
    b, t, _ = x.shape
    q = np.concatenate([split_heads(q_c, h), q_r], axis=-1)
    k_r_heads = np.broadcast_to(k_r[:, None], (b, h, t, config.d_rope))
    k = np.concatenate([split_heads(k_c, h), k_r_heads], axis=-1)
    o, attn = sdpa_forward(q, k, split_heads(v, h), mask=causal_mask(t, dtype=x.dtype),
                           scale=mla_scale(config))
    y, out = linear_forward(merge_heads(o), params["w_o"])
    return y, MLACache(kv_down, kv_norm, k_up, v_up, kr_proj, kr_rope, q_down, q_norm, qc_proj,
                       qr_proj, qr_rope, attn, out)


def mla_backward(dy, cache: MLACache):
    r"""Gradients of :func:`mla_forward`: returns ``(dx, {name: gradient})``.

    The score gradient splits at column :math:`d_k` into the content and rotary parts; the shared
    rotary key collects the sum over heads of its per-head gradients; the latent collects the
    gradients of both of its up-projections; ``x`` collects the key/value, rotary-key and query
    paths.
    """
    grads = {}
    d_merged, grads["w_o"], _ = linear_backward(dy, cache.out)
    h = cache.attn.q.shape[1]
    d_k = cache.k_up.w.shape[1] // h
    dq, dk, dv = sdpa_backward(split_heads(d_merged, h), cache.attn)
    # Queries.
    du, grads["w_uq" if cache.q_down is not None else "w_q"], _ = linear_backward(
        merge_heads(dq[..., :d_k]), cache.qc_proj)
    du_r, grads["w_qr"], _ = linear_backward(
        merge_heads(rope_backward(dq[..., d_k:], cache.qr_rope)), cache.qr_proj)
    dx = du + du_r
    if cache.q_down is not None:
        if cache.q_norm is not None:
            dx, grads["q_norm.gamma"] = rmsnorm_backward(dx, cache.q_norm)
        dx, grads["w_dq"], _ = linear_backward(dx, cache.q_down)
    # The rotary key, shared by every head.
    dk_r = rope_backward(dk[..., d_k:].sum(axis=1), cache.kr_rope)
    dx_r, grads["w_kr"], _ = linear_backward(dk_r, cache.kr_proj)
    # The latent and its two up-projections.
    dc_k, grads["w_uk"], _ = linear_backward(merge_heads(dk[..., :d_k]), cache.k_up)
    dc_v, grads["w_uv"], _ = linear_backward(merge_heads(dv), cache.v_up)
    dc = dc_k + dc_v
    if cache.kv_norm is not None:
        dc, grads["kv_norm.gamma"] = rmsnorm_backward(dc, cache.kv_norm)
    dx_c, grads["w_dkv"], _ = linear_backward(dc, cache.kv_down)
    return dx + dx_r + dx_c, grads


def mla_state(cache: MLACache):
    """The layer's ``(c, k_r)``: latent ``(B, T, d_c)`` and rotated shared key ``(B, T, d_R)`` (K9).

    ``c`` is the input of the up-projections (after the latent norm when there is one).
    """
    d_k = cache.k_up.w.shape[1] // cache.attn.q.shape[1]
    return cache.k_up.x, cache.attn.k[:, 0, :, d_k:]


def mla_cached(u, w: dict, config: MLAConfig, slot, offset: int, mla_path: str = "absorbed",
               matmul=matmul_rows_many):
    r"""MLA at inference with a latent cache (K8, K9): the new rows ``u`` ``(B, n, d)`` at positions
    ``offset..`` append their ``c`` and ``k^R`` to the layer's cache ``slot`` (``slot.store(c, k_r,
    offset)`` gives back every filled row) and attend over all of them; returns ``(B, n, d)``.

    Absorbed: scores :math:`(\hat q_r c_j^\top + q^R_r (k^R_j)^\top)/\sqrt{d_k + d_R}` with
    :math:`\hat q_r = q^C_r W_{UK,r}^\top`, outputs :math:`(\sum_j a_j c_j) W_{UV,r}`. It is
    attention with ONE key/value head shared by all ``h`` query heads (like MQA): key
    :math:`[c_j\ k^R_j]`, value :math:`c_j`, widths :math:`d_c + d_R` and :math:`d_c`.
    Expanded: :math:`k^C = c W_{UK}`, :math:`v = c W_{UV}` for every cached row, then attention as
    in :func:`refmath.models.mla.mla_forward`. ``matmul`` computes the projections
    (:func:`refmath.ffn.linear_forward`). (A production kernel would also fold
    :math:`W_{UQ} W_{UK,r}^\top` and :math:`W_{UV,r} W_{O,r}` into single matrices offline.)
    """
    h, d_k, d_v, d_r = config.n_heads, config.d_h, config.d_v, config.d_rope
    eps = config.latent_eps
    rope = mla_rope(config, offset)
    n = u.shape[1]
    t = offset + n
    # The new rows' latents and rotary keys, stored; then the whole filled cache is read back.
    c, _ = linear_forward(u, w["w_dkv"], matmul=matmul)
    if config.latent_norm:
        c, _ = rmsnorm_forward(c, w["kv_norm.gamma"], eps)
    k_r, _ = rope_forward(linear_forward(u, w["w_kr"], matmul=matmul)[0], **rope)
    latents, rope_keys = slot.store(c, k_r, offset)
    # Queries: content part q^C and rotary part q^R, the latter rotated at positions offset.. .
    if config.q_lora_rank is not None:
        u, _ = linear_forward(u, w["w_dq"], matmul=matmul)
        if config.latent_norm:
            u, _ = rmsnorm_forward(u, w["q_norm.gamma"], eps)
    w_q = w["w_q" if config.q_lora_rank is None else "w_uq"]
    q_c = split_heads(linear_forward(u, w_q, matmul=matmul)[0], h)
    q_r, _ = rope_forward(split_heads(linear_forward(u, w["w_qr"], matmul=matmul)[0], h), **rope)

    b = u.shape[0]
    mask = causal_mask(n, t, dtype=u.dtype)
    scale = mla_scale(config)
    if mla_path == "absorbed":
        w_uk = w["w_uk"].reshape(-1, h, d_k)  # column block r of W_UK is W_UK,r (d_c x d_k)
        q_hat = np.einsum("bhnk,chk->bhnc", q_c, w_uk)  # q^C_r W_UK,r^T
        # Key [c_j k^R_j], value c_j, one stored row shared by every head: see _Slot.attend_latent.
        o_latent = slot.attend_latent(np.concatenate([q_hat, q_r], axis=-1), offset, scale)
        o = np.einsum("bhnc,chv->bhnv", o_latent, w["w_uv"].reshape(-1, h, d_v))
    else:
        shared_r = np.broadcast_to(rope_keys[:, None], (b, h, t, d_r))  # one rotary key, all heads
        k_c = split_heads(linear_forward(latents, w["w_uk"], matmul=matmul)[0], h)
        v = split_heads(linear_forward(latents, w["w_uv"], matmul=matmul)[0], h)
        o, _ = sdpa_forward(np.concatenate([q_c, q_r], axis=-1),
                            np.concatenate([k_c, shared_r], axis=-1), v, mask=mask, scale=scale)
    slot.record(mask)
    return linear_forward(merge_heads(o), w["w_o"], matmul=matmul)[0]


MLA = AttentionOps(mla_shapes, mla_forward, mla_backward, mla_state, mla_cached)


# ---- the M4 model: the contract's functions --------------------------------------------------------


def param_shapes(config: MLAConfig) -> dict:
    """``{name: shape}`` of every M4 parameter: M3's names with the attention of the module
    docstring."""
    return decoder_param_shapes(config, MLA)


def init_params(config: MLAConfig, seed=0, dtype=np.float64) -> dict:
    r"""Initial parameters of the M4 decoder: :math:`\mathcal N(0, \sigma^2)` weights and
    embeddings (``config.init_std``), :math:`\sigma/\sqrt{2L}` for ``attn.w_o`` and ``ffn.w_down``,
    gains 1 (as :func:`refmath.models.decoder.init_params`)."""
    check_config("mla", config)
    return init_decoder_params(config, seed, dtype, MLA)


def forward(params, batch, config: MLAConfig, train: bool = False, rng=None):
    """Loss of the M4 decoder on a batch: ``(loss, cache)``; batch, dropout and loss as in
    :func:`refmath.models.decoder.forward` (M4, L2, L5)."""
    check_config("mla", config)
    return lm_forward(params, batch, config, MLA, train, rng)


def backward(cache: DecoderCache) -> dict:
    """Gradients of the loss of :func:`forward` with respect to every parameter (same keys)."""
    return decoder.backward(cache)  # the cache records that MLA ran


def logits(params, tokens, config: MLAConfig) -> np.ndarray:
    """Next-token logits ``(B, T, V)`` for int ``tokens`` ``(B, T)``, without dropout or loss."""
    check_config("mla", config)
    return decoder.decoder_logits(params, tokens, config, MLA)


def layer_latents(cache: DecoderCache) -> list:
    """Per layer, ``(c, k_r)``: what an MLA inference cache stores (K9), see :func:`mla_state`."""
    return layer_states(cache)


# ---- inference with a latent cache: this model's side of refmath.inference.kv_cache (K8, K9) ------


def cache_spec(config: MLAConfig, batch: int, max_len: int) -> CacheSpec:
    r"""Per layer and token one row :math:`[c_j\ k^R_j]`: ``(L, B, max_len, d_c + d_R)``."""
    return CacheSpec("latent", ((config.n_layers, batch, max_len, config.d_c + config.d_rope),),
                     latent_width=config.d_c)


embed = decoder.embed  # the M3 embedding and head, as in training
head = decoder.head


def cache_stale(config: MLAConfig, length: int, n: int) -> bool:
    """Never: MLAConfig refuses the length-dependent rope scalings, so the cached rotary keys hold
    at every length (the hook of :mod:`refmath.models.contract`)."""
    return False


def rope_options(config: MLAConfig, offset: int, length: int) -> dict:
    """The rotation of the rotary part at positions ``offset..`` (:func:`mla_rope`; ``length``
    changes nothing, see :func:`cache_stale`)."""
    return mla_rope(config, offset)


COMPILED_FIELDS = None  # no compiled decode layer: latent attention runs in NumPy


def compiled_layer_spec(params, config: MLAConfig) -> None:
    """None: the compiled decode layer does not compute latent attention (the hook of
    :mod:`refmath.models.contract`)."""
    return None


def cached_layer(x, params, layer: int, config: MLAConfig, slot, offset: int,
                 mla_path: str = "absorbed", *, matmul=matmul_rows_many) -> np.ndarray:
    """One M4 layer at inference: M3's layer with :func:`mla_cached` as its attention step
    (``mla_path``: the absorbed or the expanded attention)."""
    return decoder.family_cached_layer(x, params, layer, config, MLA, slot, offset,
                                       mla_path=mla_path, matmul=matmul)


# ---- sizes: what refmath.sizing counts of this model ---------------------------------------------

def sizing_fields(config: MLAConfig) -> dict:
    """The fields of a :class:`refmath.sizing.ModelConfig` that describe this model (without its
    name and source): what the parameter, memory and FLOP calculators need to know of it."""
    return dict(n_layers=config.n_layers, d_model=config.d_model, n_heads=config.n_heads,
                kv_heads=config.n_heads, head_dim=config.d_h, v_head_dim=config.d_v,
                d_ff=config.d_f, vocab_size=config.vocab_size,
                tie_embeddings=config.tie_embeddings, d_c=config.d_c, d_rope=config.d_rope,
                q_lora_rank=config.q_lora_rank, latent_norm=config.latent_norm,
                moe=config.moe)


# ---- Hugging Face: deepseek_v2 and deepseek_v3 (refmath.hf reads and writes the files) ------------

# with their mixtures of experts (E1-E4) after the first_k_dense_replace dense layers
HF_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")

# DeepSeek's released code builds its two latent RMSNorms with this epsilon whatever rms_norm_eps is.
DEEPSEEK_LATENT_EPS = 1e-6


def _moe_from_hf(hf: dict) -> MoEConfig | None:
    """DeepSeek's mixture of experts after its ``first_k_dense_replace`` dense layers (None when
    every layer is dense), as transformers computes it.

    V2 scores by softmax and routes greedily or group-limited (groups ranked by their best score),
    never renormalising; V3 scores by sigmoid, chooses with ``e_score_correction_bias`` among the
    ``topk_group`` groups of best top-2 sum, and renormalises with ``norm_topk_prob``. Both scale
    the gates by ``routed_scaling_factor`` and add ``n_shared_experts`` always-on experts. The
    released configs' ``scoring_func``, ``topk_method`` and ``moe_layer_freq`` must say what
    transformers does; the auxiliary-loss weights are training choices, 0 here.
    """
    layers, dense = int(hf["num_hidden_layers"]), int(hf.get("first_k_dense_replace") or 0)
    n = int(hf.get("n_routed_experts") or 0)
    if dense >= layers or n == 0:
        return None
    v3 = hf["model_type"] == "deepseek_v3"
    require(hf, "moe_layer_freq", (1, None), 1, "transformers puts experts on every layer from "
            "first_k_dense_replace on")
    require(hf, "scoring_func", ("sigmoid" if v3 else "softmax", None), None,
            f"transformers' {hf['model_type']} scores by {'sigmoid' if v3 else 'softmax'}")
    if v3:
        require(hf, "topk_method", ("noaux_tc", None), None, "transformers' deepseek_v3 routes "
                "by noaux_tc (biased choice among the best groups)")
        routing = "noaux_tc"
    else:
        routing = require(hf, "topk_method", ("greedy", "group_limited_greedy"), "greedy",
                          "transformers' deepseek_v2 routes greedy or group_limited_greedy")
        require(hf, "norm_topk_prob", (False, None), False, "transformers' deepseek_v2 never "
                "renormalises the chosen scores")
    grouped = routing != "greedy"
    return MoEConfig(n_experts=n, top_k=int(hf["num_experts_per_tok"]),
                     d_expert=int(hf["moe_intermediate_size"]),
                     scoring="sigmoid" if v3 else "softmax", routing=routing,
                     n_groups=int(hf["n_group"]) if grouped else 1,
                     topk_groups=int(hf["topk_group"]) if grouped else 1,
                     norm_topk=v3 and bool(hf.get("norm_topk_prob", False)),
                     scaling=float(hf.get("routed_scaling_factor") or 1.0),
                     n_shared=int(hf.get("n_shared_experts") or 0), score_bias=v3,
                     first_dense=dense)


def config_from_hf(hf: dict) -> MLAConfig:
    refuse_common(hf, experts=True)
    layers = int(hf["num_hidden_layers"])
    require(hf, "hidden_act", ("silu",), "silu", "refmath's SwiGLU gates with SiLU")
    require(hf, "attention_bias", (False,), False, "refmath's MLA has no biases")
    require(hf, "mlp_bias", (False,), False, "refmath's SwiGLU has no biases")
    # V2 rotates interleaved pairs (complex multiplication); V3 too unless rope_interleave is false.
    interleaved = hf["model_type"] == "deepseek_v2" or hf.get("rope_interleave", True)
    base, scaling = rope_from_hf(hf)
    if scaling is not None and scaling["rope_type"] in ("dynamic", "longrope"):
        refuse(hf, "rope_parameters.rope_type", scaling["rope_type"],
               "refmath's MLA takes the length-independent scalings (linear, llama3, yarn)")
    return MLAConfig(rope_scaling=scaling, moe=_moe_from_hf(hf),
        vocab_size=int(hf["vocab_size"]), max_seq_len=int(hf["max_position_embeddings"]),
        d_model=int(hf["hidden_size"]), n_layers=layers, n_heads=int(hf["num_attention_heads"]),
        d_c=int(hf["kv_lora_rank"]), d_rope=int(hf["qk_rope_head_dim"]),
        head_dim=int(hf["qk_nope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
        q_lora_rank=None if hf.get("q_lora_rank") is None else int(hf["q_lora_rank"]),
        latent_norm=True, d_ff=int(hf["intermediate_size"]), rope_base=base,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dropout=0.0,
        rope_layout="interleaved" if interleaved else "half", latent_norm_eps=DEEPSEEK_LATENT_EPS)


def params_from_hf(hf: dict, config: MLAConfig, weights) -> dict:
    d, h = config.d_model, config.n_heads
    d_c, d_r, d_k, d_v = config.d_c, config.d_rope, config.d_h, config.d_v
    params = {}
    for i in range(config.n_layers):
        s, p = f"model.layers.{i}.self_attn.", f"layers.{i}.attn."
        kv_a = weights.take(s + "kv_a_proj_with_mqa.weight", (d_c + d_r, d), transpose=True)
        params[p + "w_dkv"] = np.ascontiguousarray(kv_a[:, :d_c])
        params[p + "w_kr"] = np.ascontiguousarray(kv_a[:, d_c:])
        params[p + "kv_norm.gamma"] = weights.take(s + "kv_a_layernorm.weight", (d_c,))
        kv_b = weights.take(s + "kv_b_proj.weight", (h * (d_k + d_v), d_c), transpose=True)
        params[p + "w_uk"], params[p + "w_uv"] = split_heads_columns(kv_b, h, (d_k, d_v))
        if config.q_lora_rank is None:
            q = weights.take(s + "q_proj.weight", (h * (d_k + d_r), d), transpose=True)
            params[p + "w_q"], params[p + "w_qr"] = split_heads_columns(q, h, (d_k, d_r))
        else:
            rank = config.q_lora_rank
            params[p + "w_dq"] = weights.take(s + "q_a_proj.weight", (rank, d), transpose=True)
            params[p + "q_norm.gamma"] = weights.take(s + "q_a_layernorm.weight", (rank,))
            q = weights.take(s + "q_b_proj.weight", (h * (d_k + d_r), rank), transpose=True)
            params[p + "w_uq"], params[p + "w_qr"] = split_heads_columns(q, h, (d_k, d_r))
        params[p + "w_o"] = weights.take(s + "o_proj.weight", (d, h * d_v), transpose=True)
        take_feed_forward_layer(weights, params, f"model.layers.{i}.", f"layers.{i}.", config, i,
                                DEEPSEEK_EXPERTS)
    take_ends(weights, params, config)
    return params


def to_hf(config: MLAConfig, params: dict):
    if not config.latent_norm:
        raise HFCheckpointError("an MLA model is written as deepseek_v3, whose latents are always "
                                "RMS-normalised; this config has latent_norm = False")
    if config.latent_eps != DEEPSEEK_LATENT_EPS:
        raise HFCheckpointError(f"deepseek_v3's latent RMSNorms use epsilon "
                                f"{DEEPSEEK_LATENT_EPS}; this config has latent_norm_eps = "
                                f"{config.latent_eps}")
    kind = "deepseek_v3" if config.moe is None else _deepseek_kind(config)
    h = config.n_heads
    hf = {"model_type": kind,
          "architectures": ["DeepseekV3ForCausalLM" if kind == "deepseek_v3"
                            else "DeepseekV2ForCausalLM"],
          "vocab_size": config.vocab_size, "max_position_embeddings": config.max_seq_len,
          "hidden_size": config.d_model, "num_hidden_layers": config.n_layers,
          "num_attention_heads": h, "num_key_value_heads": h,
          "kv_lora_rank": config.d_c, "q_lora_rank": config.q_lora_rank,
          "qk_rope_head_dim": config.d_rope, "qk_nope_head_dim": config.d_h,
          "v_head_dim": config.d_v, "intermediate_size": config.d_f, "hidden_act": "silu",
          "first_k_dense_replace": config.n_layers, "rms_norm_eps": config.norm_eps,
          "rope_parameters": rope_to_hf(config.rope_base, config.rope_scaling)[0],
          "rope_interleave": config.rope_layout == "interleaved", "attention_bias": False,
          "tie_word_embeddings": config.tie_embeddings}
    if config.moe is not None:
        moe = config.moe
        hf.update(first_k_dense_replace=moe.first_dense, n_routed_experts=moe.n_experts,
                  num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.d_expert,
                  n_shared_experts=moe.n_shared, routed_scaling_factor=moe.scaling,
                  norm_topk_prob=moe.norm_topk, topk_method=moe.routing,
                  n_group=moe.n_groups, topk_group=moe.topk_groups, output_router_logits=False)
    tensors = {}
    for i in range(config.n_layers):
        s, p = f"model.layers.{i}.self_attn.", f"layers.{i}.attn."
        tensors[s + "kv_a_proj_with_mqa.weight"] = linear_out(
            np.concatenate([params[p + "w_dkv"], params[p + "w_kr"]], axis=1))
        tensors[s + "kv_a_layernorm.weight"] = params[p + "kv_norm.gamma"]
        tensors[s + "kv_b_proj.weight"] = linear_out(
            join_heads_columns([params[p + "w_uk"], params[p + "w_uv"]], h))
        if config.q_lora_rank is None:
            tensors[s + "q_proj.weight"] = linear_out(
                join_heads_columns([params[p + "w_q"], params[p + "w_qr"]], h))
        else:
            tensors[s + "q_a_proj.weight"] = linear_out(params[p + "w_dq"])
            tensors[s + "q_a_layernorm.weight"] = params[p + "q_norm.gamma"]
            tensors[s + "q_b_proj.weight"] = linear_out(
                join_heads_columns([params[p + "w_uq"], params[p + "w_qr"]], h))
        tensors[s + "o_proj.weight"] = linear_out(params[p + "w_o"])
    swiglu_layers_to_hf(config, params, tensors, DEEPSEEK_EXPERTS)
    return hf, tensors


def _deepseek_kind(config: MLAConfig) -> str:
    """deepseek_v3 for a sigmoid-scored, bias-chosen mixture of experts, deepseek_v2 for a
    softmax-scored one; what neither computes is refused."""
    moe = config.moe
    v3 = moe.scoring == "sigmoid"
    wanted = (dict(routing="noaux_tc", score_bias=True) if v3 else
              dict(score_bias=False, norm_topk=False, shared_gate=False))
    wanted.update(every=1, shared_gate=False, d_shared=None)
    for field, value in wanted.items():
        if getattr(moe, field) != value:
            raise HFCheckpointError(
                f"an MLA decoder with moe.scoring = {moe.scoring!r} is written as "
                f"{'deepseek_v3' if v3 else 'deepseek_v2'}, which needs moe.{field} = {value!r}; "
                f"this config has {getattr(moe, field)!r}")
    if not v3 and moe.routing == "noaux_tc":
        raise HFCheckpointError("moe.routing = 'noaux_tc' is deepseek_v3's, which scores by "
                                "sigmoid; this config scores by softmax")
    if not v3 and config.rope_layout != "interleaved":
        raise HFCheckpointError("deepseek_v2 rotates interleaved pairs; this config has "
                                f"rope_layout = {config.rope_layout!r}")
    return "deepseek_v3" if v3 else "deepseek_v2"


# ---- gradient-check cases ------------------------------------------------------------------------

def _mla_inputs(config, b=2, t=5):
    def make(rng):
        params = {}
        for name, shape in mla_shapes(config).items():
            params[name] = (1.0 + 0.2 * rng.standard_normal(shape) if name.endswith("gamma")
                            else rng.standard_normal(shape) / np.sqrt(shape[0]))
        return {"x": rng.standard_normal((b, t, config.d_model)), "config": config, **params}
    return make


# d_k = 4, d_v = 3, d_R = 4, d_c = 6: every width distinct, so a mixed-up axis cannot pass
_TINY = dict(vocab_size=11, max_seq_len=8, d_model=16, n_layers=2, n_heads=2, d_c=6, d_rope=4,
             head_dim=4, v_head_dim=3, ffn_multiple_of=8, init_std=0.25)
for _label, _extra in (("queries from x", {}),
                       ("query compression, latent norms", dict(q_lora_rank=5, latent_norm=True))):
    _config = MLAConfig(**_TINY, **_extra)
    register_case(OpCase("mla_attention", f"{_label} (2, 5, 16)", ("K8", "K9", "A8"),
                         _mla_inputs(_config), *layer_case_ops(mla_forward, mla_backward),
                         ("x",) + tuple(mla_shapes(_config)), group="attention execution",
                         max_coords=12))
register_case(ParamCase("mla", "query compression, latent norms, 2 layers, dropout 0.25", ("M4",),
                        model_case_maker(forward, init_params,
                                                 MLAConfig(**_TINY, q_lora_rank=5, latent_norm=True,
                                                           dropout=0.25), train=True),
                        backward, max_coords=1, step=2.5e-4))
# DeepSeek's YaRN: rescaled rotary frequencies, and mscale_all_dim's correction of the softmax scale
_YARN = dict(rope_type="yarn", factor=40.0, original_max_seq_len=4, beta_fast=4.0, beta_slow=0.5,
             mscale=0.707, mscale_all_dim=0.5)
register_case(ParamCase("mla", "DeepSeek-V3's experts: sigmoid, 2 of 4 groups chosen with a "
                        "bias, shared expert, dense first layer, balance losses", ("M4", "E4", "E5"),
                        moe_case_maker(forward, init_params, MLAConfig(
                            **_TINY, q_lora_rank=5, latent_norm=True, moe=dict(
                                n_experts=8, top_k=2, d_expert=6, scoring="sigmoid",
                                routing="noaux_tc", n_groups=4, topk_groups=2, n_shared=1,
                                norm_topk=True, scaling=2.5, score_bias=True, first_dense=1,
                                balance_coef=0.05, device_balance_coef=0.05, n_devices=2))),
                        backward, max_coords=2, step=2.5e-4))
register_case(ParamCase("mla", "DeepSeek-V2's experts: softmax, group-limited, two shared "
                        "experts, scaled", ("M4", "E4"),
                        moe_case_maker(forward, init_params, MLAConfig(
                            **_TINY, latent_norm=True, moe=dict(
                                n_experts=8, top_k=3, d_expert=6,
                                routing="group_limited_greedy", n_groups=4, topk_groups=2,
                                n_shared=2, scaling=1.5))),
                        backward, max_coords=2, step=2.5e-4))
register_case(OpCase("mla_attention", "YaRN with DeepSeek's mscale terms (2, 5, 16)",
                     ("K8", "K9", "A8", "N16"),
                     _mla_inputs(MLAConfig(**_TINY, rope_scaling=_YARN)),
                     *layer_case_ops(mla_forward, mla_backward),
                     ("x",) + tuple(mla_shapes(MLAConfig(**_TINY))), group="attention execution",
                     max_coords=12))
