r"""The write-the-function exercises of lessons 9 and 11-16: the reference, the inputs, the
hint and the known slips of each, keyed by exercise number, so that each lesson's check cell is
one call (``check("12.3", my_split_decode)``) that shows the student no formula and no slip before
the attempt. (Lessons 1-8 and 10 keep theirs in their own files.)

Each block was the lesson's check cell, moved here as it was; the lesson's own variables it read
(the worked example, the random generator, the optimiser's settings) are named in ``uses`` and
read from the lesson when the check runs."""
from __future__ import annotations

import dataclasses

import numpy as np

from refmath.lessons.checks import catalogued
from refmath.lessons.table import function_exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; nothing here is called by name.
__all__ = []


# Lesson 9 --------------------------------------------------------------------------------------

def _without_the_crossing_token(probs, p):
    """A slip: the least probable kept token (the one whose mass reaches p) dropped as well,
    leaving nothing (0 / 0) when the first token alone reaches p."""
    from refmath.inference.sampling import top_p_filter

    kept = top_p_filter(probs, p) > 0
    kept[np.flatnonzero(kept)[np.argmin(probs[kept])]] = False
    with np.errstate(invalid="ignore"):
        return np.where(kept, probs, 0.0) / np.where(kept, probs, 0.0).sum()


@function_exercise("09.5", "your top-p filter", "the section 'L7: picking the next token'",
                   "sort, keep while the mass before is below p, renormalise, unsort",
                   uses=("pi", "pi4"))
def _top_p_filter(pi, pi4):
    from refmath.inference.sampling import top_p_filter

    top_p_inputs = [(pi, 0.8), (pi4, 0.6), (np.array([0.5, 0.3, 0.2]), 0.8),
                    (np.array([0.05, 0.7, 0.25]), 0.5), (np.array([0.125, 0.375, 0.5]), 1.0)]
    return dict(
        reference=top_p_filter, inputs=top_p_inputs, rtol=1e-14,
        slips={"the kept probabilities not renormalised to sum to one": lambda probs, p:
                   np.where(top_p_filter(probs, p) > 0, probs, 0.0),
               "the token whose mass crosses p dropped: it is the one that reaches p":
                   _without_the_crossing_token,
               "a token whose preceding mass equals p kept: the test is mass before < p, "
               "not <=": lambda probs, p: top_p_filter(probs, min(np.nextafter(p, 2.0), 1.0)),
               "left in sorted order, not put back at their tokens": lambda probs, p:
                   np.sort(top_p_filter(probs, p))[::-1]})


# Lesson 11 -------------------------------------------------------------------------------------

def _expanded_attention(q_c, q_r, c, k_r, w_uk, w_uv, scale=None):
    """The reference: each head's content keys c W_UK and values c W_UV built, then attention."""
    from refmath.softmax import softmax_forward

    keys = np.einsum("tc,hck->htk", c, w_uk)
    values = np.einsum("tc,hcv->htv", c, w_uv)
    scale = 1 / np.sqrt(q_c.shape[-1] + q_r.shape[-1]) if scale is None else scale
    scores = scale * (np.einsum("hk,htk->ht", q_c, keys) + q_r @ k_r.T)
    return np.einsum("ht,htv->hv", softmax_forward(scores)[0], values)


def _mla_decode_inputs():
    draw = np.random.default_rng(11)
    return [tuple(draw.standard_normal(shape) for shape in
                  ((h, d_k), (h, d_r), (t, d_c), (t, d_r), (h, d_c, d_k), (h, d_c, d_v)))
            for h, d_k, d_r, d_c, d_v, t in ((4, 8, 4, 16, 8, 5), (2, 3, 2, 6, 5, 1),
                                             (3, 4, 2, 5, 4, 9))]


@function_exercise("11.3", "your absorbed MLA decode",
                   "the section 'K9: decoupled RoPE, and what MLA caches'",
                   "q_hat = q_c W_UK^T per head; scale by 1/sqrt(d_k + d_R); W_UV after the sum")
def _absorbed_attention():
    from refmath.softmax import softmax_forward

    expanded = _expanded_attention
    return dict(
        reference=expanded, inputs=_mla_decode_inputs, rtol=1e-12, allow=(softmax_forward,),
        reference_name="the expanded attention (keys and values built per head)",
        slips={"the scale 1/sqrt(d_k): the rotary width counts too": lambda q_c, q_r, c, k_r,
                   w_uk, w_uv: expanded(q_c, q_r, c, k_r, w_uk, w_uv, scale=1 / np.sqrt(q_c.shape[-1])),
               "the rotary part left out of the scores": lambda q_c, q_r, c, k_r, w_uk, w_uv:
                   expanded(q_c, 0 * q_r, c, k_r, w_uk, w_uv,
                            scale=1 / np.sqrt(q_c.shape[-1] + q_r.shape[-1])),
               "W_UV forgotten: the weighted sum of the latents, not of the values":
                   lambda q_c, q_r, c, k_r, w_uk, w_uv: expanded(
                       q_c, q_r, c, k_r, w_uk, np.broadcast_to(np.eye(c.shape[1]),
                                                               (len(q_c),) + (c.shape[1],) * 2))})


# Lesson 12 -------------------------------------------------------------------------------------

def _dense_decode(q, k, v, splits):
    """The reference: q attends to all n keys at once (exactly, splits change nothing)."""
    from refmath.inference.decode import decode_attention

    return decode_attention(q[None, None], k[None, None], v[None, None], [len(k)])[0, 0]


def _split_decode_inputs():
    draw = np.random.default_rng(12)
    return [(draw.standard_normal(16), 3 * draw.standard_normal((n, 16)),  # 3 k: peaked rows
             draw.standard_normal((n, 16)), splits)
            for n, splits in ((1000, 4), (10, 4), (3, 4), (5, 1))]


def _split_states(q, k, v, splits, chunk=None):
    """Each split's statistics by the library's F2 (an empty split gives the empty state)."""
    from refmath.softmax import online_softmax_block

    n = len(k)
    chunk = -(-n // splits) if chunk is None else chunk
    cuts = [(min(n, s * chunk), min(n, s * chunk + chunk)) for s in range(splits)]
    return [online_softmax_block(k[lo:hi] @ q / np.sqrt(len(q)), v[lo:hi]) for lo, hi in cuts]


def _merged(states):
    from refmath.softmax import online_softmax_merge, online_softmax_result

    state = states[0]
    for other in states[1:]:
        state = online_softmax_merge(state, other)
    return online_softmax_result(state)


def _remainder_dropped(q, k, v, splits):
    """A slip: chunks of n // splits keys, so the last n mod splits keys are never read, and with
    fewer keys than splits none is (every split empty: 0 / 0)."""
    chunk = len(k) // splits
    return _merged(_split_states(q, k, v, splits, chunk)) if chunk else np.full(len(q), np.nan)


def _nan_from_empty_splits(q, k, v, splits):
    """A slip: o_s = u_s / l_s first, then o = sum_s (e^(m_s - m) l_s / l) o_s, where an empty
    split's 0 / 0 is NaN."""
    states = _split_states(q, k, v, splits)
    weights = np.array([np.exp(st.m - max(s.m for s in states)) * st.l for st in states])
    with np.errstate(invalid="ignore"):
        return (weights / weights.sum()) @ np.array([st.u / st.l for st in states])


@function_exercise("12.3", "your split-K decode",
                   "the section 'K2 and F3: a decode step, split across the cores'",
                   "chunk = ceil(n / splits); rescale each split by e^(m_s - m); an empty split "
                   "adds nothing")
def _split_decode():
    from refmath.softmax import online_softmax_block, online_softmax_merge, online_softmax_result

    return dict(
        reference=_dense_decode, inputs=_split_decode_inputs, rtol=1e-12,
        reference_name="dense attention over all the keys",
        slips={"the last keys dropped: chunks of n // splits keys": _remainder_dropped,
               "the splits' outputs averaged: each must weigh e^(m_s - m) l_s": lambda q, k, v,
                   splits: np.mean([online_softmax_result(st) for st in
                                    _split_states(q, k, v, splits) if st.l > 0], axis=0),
               "u_s and l_s added without rescaling to the largest m":
                   lambda q, k, v, splits: sum(st.u for st in _split_states(q, k, v, splits))
                   / sum(st.l for st in _split_states(q, k, v, splits)),
               "an empty split's o_s = 0 / 0 reaches the merge": _nan_from_empty_splits,
               "no 1/sqrt(D) scale on the scores": lambda q, k, v, splits:
                   _dense_decode(q * np.sqrt(len(q)), k, v, splits)},
        refuse=(online_softmax_block, online_softmax_merge, online_softmax_result))


# Lesson 13 -------------------------------------------------------------------------------------

def _undo_interleaved_to_half(w, head_dim):
    """The reference: the inverse of the library's permutation, found by applying it to 0, 1, ..."""
    from refmath import hf

    moved = hf.interleaved_to_half(np.arange(w.shape[-1]), head_dim)  # half column j <- moved[j]
    return w[..., np.argsort(moved)]


@function_exercise("13.3", "your half_to_interleaved", "the section 'Two RoPE layouts, one function'",
                   "within each head, interleaved coordinate 2r is half coordinate r, 2r + 1 is "
                   "r + head_dim / 2", uses=("q_proj", "k_proj", "d_h", "rng"))
def _half_to_interleaved(q_proj, k_proj, d_h, rng):
    from refmath import hf

    layout_inputs = [(q_proj.T, d_h), (k_proj.T, d_h), (rng.standard_normal(3 * 4), 4),
                     (rng.standard_normal((5, 16)), 16), (rng.standard_normal((2, 3, 24)), 12)]
    return dict(
        reference=_undo_interleaved_to_half, inputs=layout_inputs, rtol=0,
        reference_name="the inverse of hf.interleaved_to_half",
        slips={"interleaved_to_half itself, not its inverse": hf.interleaved_to_half,
               "the permutation taken over the whole width, not within each head":
                   lambda w, head_dim: _undo_interleaved_to_half(w, w.shape[-1]),
               "the columns left in the half layout": lambda w, head_dim: w})


# Lesson 14 -------------------------------------------------------------------------------------

@function_exercise("14.3", "your cache bytes",
                   "the section 'The cost of one decode step, all together'",
                   "2 B T' L g d_h numbers; T' = min(T, w); int: bits/8 a number plus 2 bytes a group")
def _cache_bytes():
    from refmath.lessons.expected.lesson14_synthesis import (
        cache_bytes_reference, cache_bytes_scales_left_out, cache_bytes_with_float32_scales)
    from refmath.sizing import PRESETS

    llama, mistral, gpt2 = PRESETS["llama-3-8b"], PRESETS["mistral-7b"], PRESETS["gpt2-small"]
    cache_inputs = [(dataclasses.replace(llama, kv_heads=32), 8192, 16), (llama, 8192, 16),
                    (llama, 8192, 16, 8), (llama, 8192, 16, 4), (mistral, 8192, 4),
                    (mistral, 2048, 4, 4), (gpt2, 1024, 1)]
    return dict(
        reference=cache_bytes_reference, inputs=cache_inputs, rtol=1e-12,
        reference_name="decode_step_traffic and quantized_kv_cache_bytes",
        slips={"K or V only: the factor 2 forgotten": lambda *args: cache_bytes_reference(*args) / 2,
               "the sliding window ignored": lambda shape, *rest: cache_bytes_reference(
                   dataclasses.replace(shape, sliding_window=None), *rest),
               "the query heads counted, not the key/value heads": lambda shape, *rest:
                   cache_bytes_reference(dataclasses.replace(shape, kv_heads=shape.n_heads), *rest),
               "the quantisation scales left out": cache_bytes_scales_left_out,
               "4-byte (float32) scales: refmath's are 2 bytes a group":
                   cache_bytes_with_float32_scales})


# Lesson 15 -------------------------------------------------------------------------------------

def _torch_gates(scores, moe, bias=None):
    """The oracle: the gates in torch, with torch's own top-k (the cases have no ties)."""
    import torch

    choice = scores.detach()
    if moe.routing == "group_limited_greedy":
        best = choice.view(choice.shape[0], moe.n_groups, -1).amax(dim=-1)
        kept = torch.zeros_like(best, dtype=torch.bool)
        kept.scatter_(1, best.topk(moe.topk_groups, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(moe.group_size, dim=1), -torch.inf)
    chosen = scores.gather(1, choice.topk(moe.top_k, dim=-1).indices)
    if moe.norm_topk:
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return moe.scaling * chosen


def _outer_sum_forgotten(dgates, cache):
    """The slip that leaves the outer 1/D off the renormalised gates' backward."""
    from refmath.moe import route_backward

    dscores = route_backward(dgates, cache)
    if cache.denominator is None:
        return dscores
    return dscores * cache.denominator


@function_exercise("15.6", "your gates backward", "the section 'E3, E4: the gates carry the gradient'",
                   "scale by rho; with D, ds_i = (dg_i - sum_j dg_j s_j / D) / D on the chosen; "
                   "put the result at cache.indices")
def _route_backward():
    from refmath.moe import route_backward

    return dict(
        reference=route_backward, case=["moe_route[greedy*", "moe_route[group-limited*"],
        oracle=_torch_gates,
        slips={**catalogued("moe route: renormalisation's Jacobian dropped", route_backward),
               **catalogued("moe route: scaling left out of the backward", route_backward),
               "the outer 1/D forgotten: (dg - sum dg s / D), not divided by D again":
                   _outer_sum_forgotten})


# Lesson 16: the four backward passes of lessons 1, 2, 4 and 5 again, with fewer slips and, as
# before, no hint (the lessons that taught them are the place to look) ------------------------

_MINE = "the section 'Your four backward passes'"


@function_exercise("16.1", "your softmax backward", _MINE, "")
def _capstone_softmax_backward():
    from refmath.softmax import softmax_backward

    return dict(reference=softmax_backward, case="softmax[*",
                slips={**catalogued("softmax: the -a a^T term dropped (a * dout)", softmax_backward),
                       **catalogued("softmax: sum over the wrong axis", softmax_backward),
                       **catalogued("softmax: a mean for the sum in <a, dout>",
                                    softmax_backward)})


@function_exercise("16.2", "your LayerNorm backward", _MINE,
                   "")
def _capstone_layernorm_backward():
    from refmath.norms import layernorm_backward

    return dict(reference=layernorm_backward, case="layernorm[*",
                slips={**catalogued("layernorm: variance path dropped", layernorm_backward),
                       **catalogued("layernorm: dbeta averaged over rows", layernorm_backward),
                       **catalogued("layernorm: gamma left out of dx", layernorm_backward)})


@function_exercise("16.3", "your GELU backward", _MINE,
                   "")
def _capstone_gelu_backward():
    from refmath.ffn import gelu_backward

    return dict(reference=gelu_backward, case="gelu[*",
                slips={**catalogued("gelu exact: x phi(x) term dropped", gelu_backward),
                       **catalogued("gelu tanh: the 3 of d(x^3)/dx forgotten", gelu_backward)})


@function_exercise("16.4", "your cross-entropy backward", _MINE,
                   "")
def _capstone_cross_entropy_backward():
    from refmath.losses import cross_entropy_backward

    return dict(
        reference=cross_entropy_backward,
        case=["cross_entropy[(T, V) = (4, 6)]", "cross_entropy[ignore_index -100, 2 of 5 ignored]",
              "cross_entropy[one counted token of 4]",
              "cross_entropy[reduction sum, loss_mask on a 2-token prompt]"],
        slips={**catalogued("cross-entropy: mean over max(n, 2)", cross_entropy_backward),
               **catalogued("cross-entropy: ignored tokens get a gradient",
                            cross_entropy_backward),
               **catalogued("cross-entropy: mean over every position, ignored ones too",
                            cross_entropy_backward)})
