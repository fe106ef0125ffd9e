r"""RoPE attention with grouped key/value heads, as an :class:`refmath.models.common.AttentionOps`
(A1, A2, A6, A10, N10; QK-norm N18, rope scalings N13-N17): the attention sublayer of the decoder
family (:data:`ROPE_GQA`), its cached step at inference (K2, K3), and the hooks a decoding loop asks
about RoPE (:func:`rope_options`, :func:`cache_stale`).
"""
from __future__ import annotations

from typing import ClassVar, NamedTuple

from refmath.attention import (CausalAttentionCache, causal_attention_backward,
                               causal_attention_forward, causal_attention_kv, merge_heads,
                               split_heads)
from refmath.ffn import LinearCache, linear_backward, linear_forward, matmul_rows_many
from refmath.models.common import AttentionOps, CacheSpec, projections
from refmath.norms import RMSNormCache, rmsnorm_backward, rmsnorm_forward
from refmath.positions import (RoPECache, rope_backward, rope_forward, rope_frequencies_change,
                               rope_inv_freq)
from refmath.models.decoder_config import DecoderConfig, attention_options, gain

__all__ = [
    "RoPEAttentionCache", "rope_attention_shapes", "rope_options", "queries_keys",
    "rope_attention_forward", "rope_attention_backward", "rope_attention_state",
    "rope_attention_cached", "ROPE_GQA", "cache_spec", "cache_stale", "PlainAttentionOptions"
]


# ---- the attention sublayer as a parameter of the recurrence ---------------------------------------


class PlainAttentionOptions:
    r"""The options this sublayer reads at the values that leave Llama's attention plain: no biases
    on the projections, no QK-norm, every position attended (no sliding window), the scores scaled
    by :math:`1/\sqrt{d_h}` and not capped, the norms' gains as stored. A family's configuration
    that has none of them as fields derives from it, as class constants (not fields), and sets
    again only those it has (OLMo 2's QK-norm, Phi-3's window)."""
    qkv_bias: ClassVar[bool] = False
    qk_norm: ClassVar[str | None] = None
    sliding_window: ClassVar[int | None] = None
    query_pre_attn_scalar: ClassVar[float | None] = None
    attn_softcap: ClassVar[float | None] = None
    norm_offset: ClassVar[float] = 0.0


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


def queries_keys(x, params: dict, config: DecoderConfig, offset: int = 0, length: int | None = None,
                 matmul=matmul_rows_many):
    r"""The rotated queries ``(B, h, n, d_h)`` and keys ``(B, g, n, d_h)`` of the rows ``x``
    ``(B, n, d)`` at positions ``offset..``, and what their backward needs.

    .. math::
        Q = X W_Q\,[+\,b_Q],\quad \hat Q = \operatorname{RMSNorm}_{\gamma_q}(Q)\ \text{(QK-norm,
        N18)},\quad \tilde Q = m\,\operatorname{RoPE}_{\omega'}(\hat Q)

    and the same for keys; ``length`` (default ``offset + n``) is the sequence length a
    length-dependent rope scaling sees; ``matmul`` computes the projections
    (:func:`refmath.ffn.linear_forward`). Returns ``(q, k, caches)`` with ``caches`` the tuple
    ``(q_proj, k_proj, q_norm, k_norm, q_rope, k_rope)``.
    """
    h, g, n = config.n_heads, config.kv_heads, x.shape[-2]
    q, q_proj = linear_forward(x, params["w_q"], params.get("b_q"), matmul=matmul)
    k, k_proj = linear_forward(x, params["w_k"], params.get("b_k"), matmul=matmul)
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


def rope_attention_cached(u, params: dict, config: DecoderConfig, slot, offset: int, *,
                          matmul=matmul_rows_many, **options):
    """M3's attention at inference (K2, K3): the new rows ``u`` ``(B, n, d)`` at positions
    ``offset..`` give queries and keys rotated there; ``slot.attend(q, k, v, offset, window)``
    appends the keys and values to the layer's cache and attends over every cached position (the
    last ``sliding_window`` of them, with a window). Returns
    ``(B, n, d)``.

    QK-norm and a rope scaling (N13-N18) go through :func:`queries_keys`. A length-dependent
    scaling whose frequencies change between ``offset`` and ``offset + n`` tokens makes the cached
    keys stale (they were rotated at other frequencies, K3): that raises ``ValueError``, and
    :func:`cache_stale` lets a decoding loop prefill afresh instead. ``matmul`` computes the
    projections (:func:`refmath.ffn.matmul_rows_many`'s signature, :mod:`refmath.models.contract`).
    """
    if cache_stale(config, offset, u.shape[-2]):
        raise ValueError(f"rope_scaling {config.rope_scaling.rope_type!r} changes RoPE's "
                         f"frequencies between {offset} and {offset + u.shape[-2]} tokens: the "
                         f"keys cached for positions 0..{offset - 1} are stale; prefill afresh")
    # BEGIN SOLUTION
    if config.qk_norm is not None or config.rope_scaling is not None:
        q, k, _ = queries_keys(u, params, config, offset, matmul=matmul)
        v = linear_forward(u, params["w_v"], params.get("b_v"), matmul=matmul)[0]
        o = slot.attend(q, k, split_heads(v, config.kv_heads), offset, **attention_options(config))
        return linear_forward(merge_heads(o), params["w_o"], matmul=matmul)[0]
    h, g = config.n_heads, config.kv_heads
    rope = dict(offset=offset, base=config.rope_base, layout=config.rope_layout)
    q, k, v = projections(u, params, "qkv", matmul)
    q, _ = rope_forward(split_heads(q, h), **rope)
    k, _ = rope_forward(split_heads(k, g), **rope)
    o = slot.attend(q, k, split_heads(v, g), offset, **attention_options(config))
    return linear_forward(merge_heads(o), params["w_o"], matmul=matmul)[0]
    # END SOLUTION


ROPE_GQA = AttentionOps(rope_attention_shapes, rope_attention_forward, rope_attention_backward,
                        rope_attention_state, rope_attention_cached)


def cache_spec(config, batch: int, max_len: int, windows=None) -> CacheSpec:
    """What a KV cache keeps of this attention in every layer: the rotated keys and the values of
    its ``g`` heads, ``(L, B, g, max_len, d_h)`` each; ``windows`` (one per layer, None: the whole
    length) lets a sliding layer keep only its window's rows."""
    shape = (config.n_layers, batch, config.kv_heads, max_len, config.d_h)
    return CacheSpec("kv", (shape, shape), windows=windows)


def cache_stale(config, length: int, n: int) -> bool:
    """Whether appending ``n`` rows to a KV cache of ``length`` positions would mix keys rotated at
    different frequencies: true only for a length-dependent ``rope_scaling`` (dynamic NTK,
    LongRoPE) whose frequencies differ between the two lengths
    (:func:`refmath.positions.rope_frequencies_change`)."""
    scaling = config.rope_scaling
    return rope_frequencies_change(scaling, length, length + n)
