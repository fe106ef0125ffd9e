r"""Lesson 3, attention without the $T \times T$ matrix, and decoding without recomputation
(``notebooks/03_flash_and_kv_cache.py``): the expected value and the known slips of each
exercise, computed from the library and from the lesson's inputs."""
from __future__ import annotations

import numpy as np

from refmath.lessons.checks import catalogued
from refmath.lessons.table import exercise, function_exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; nothing here is called by name.
__all__ = []


_F1 = "the section 'F1-F3: attention as a ratio of sums, merged block by block'"


@exercise("03.1", "(m, l) of the merge", _F1, "rescale each l by e^(its m - the larger m)",
          uses=("state_c", "state_d"))
def _merged_m_l(a, b):
    from refmath.softmax import online_softmax_merge

    merged = online_softmax_merge(a, b)
    smaller = min(a.m, b.m)
    return (merged.m, merged.l), {
        "the two l added as they are, neither rescaled to the larger m": (merged.m, a.l + b.l),
        "rescaled to the smaller m, not the larger":
            (smaller, merged.l * np.exp(merged.m - smaller))}


def _dq_by_hand(do, q, k, v, o, lse, offset):
    """03.3 written out: query i sees keys 0 .. i + offset (the lesson's alignment is offset 2,
    the number of keys beyond the queries; 0 is the mask of a square matrix, aligned top-left)."""
    q, k, v, o, do, lse = (np.asarray(x)[0, 0] for x in (q, k, v, o, do, lse))
    tau = 1 / np.sqrt(q.shape[-1])
    visible = np.arange(len(k))[None, :] <= np.arange(len(q))[:, None] + offset
    p = np.where(visible, np.exp(tau * q @ k.T - lse[:, None]), 0.0)
    ds = p * (do @ v.T - np.sum(do * o, axis=1, keepdims=True))
    return (tau * ds @ k)[None, None]


@exercise("03.3", "dQ from the logsumexp", "the section 'F4: the backward pass from the logsumexp'",
          "P = exp(S - lse) at visible pairs, 0 elsewhere; delta = rowsum(dO * O)",
          uses=("do_small", "q_small", "k_small", "v_small", "o_small", "lse_small"),
          rtol=1e-10, atol=1e-14)
def _dq_from_lse(do, q, k, v, o, lse):
    from refmath.flash import flash_attention_backward

    def dq():
        return flash_attention_backward(do, q, k, v, o, lse, causal=True, block_q=2, block_k=2)[0]
    return dq(), {
        **catalogued("flash: delta = rowsum(dO * O) left out", dq),
        **catalogued("flash: causal mask forgotten in the backward", dq),
        "the scale tau = 1/sqrt(d) missing from dQ (it is in S and in dQ)":
            np.sqrt(np.shape(q)[-1]) * dq(),
        "the causal mask aligned top-left (query i sees keys 0 .. i): with more keys than "
        "queries, the last query sits at the last key": _dq_by_hand(do, q, k, v, o, lse, 0)}


@exercise("03.4", "dense bytes at T = 2048",
          "the section 'F6: what the tiles save is traffic to slow memory'",
          "4 h T^2 for S and P (each written and read) plus 4 h T d_h for Q, K, V, O", rtol=0.0)
def _dense_bytes_2048():
    from refmath.flash import attention_memory_traffic

    total = attention_memory_traffic(1, 12, 2048, 2048, 64, bytes_per_element=2).total_bytes
    q_k_v_o = 4 * 12 * 2048 * 64 * 2  # Q, K, V and O, each read or written once, in bytes
    return total, {"elements, not bytes: the 2 bytes of each forgotten": total / 2,
                   "S and P only: the traffic of Q, K, V and O left out": total - q_k_v_o}


@exercise("03.5", "the tokens per sequence in 24 GiB",
          "the section 'K6-K7: what the cache costs in memory'",
          "one token of one sequence costs 2 (K and V) x L x g x d_h x bytes, with d_h = d / h and "
          "g the key/value heads; the batch shares the 24 x 2^30 bytes; round down", rtol=0.0)
def _tokens_that_fit():
    from refmath.sizing import kv_cache_bytes

    budget, d, layers, heads, kv_heads = 24 * 2**30, 5120, 40, 40, 8

    def fit(batch=8, kv=kv_heads, head_dim=d // heads, memory=budget):
        """The whole tokens per sequence: the budget over the bytes one token costs the batch."""
        return memory // kv_cache_bytes(batch=batch, layers=layers, tokens=1, kv_heads=kv,
                                        head_dim=head_dim, bytes_per_element=2)
    # one value for two slips: K and V counted once, or 1 byte per element for bf16's 2
    (halved,) = catalogued("kv cache: the factor 2 for K and V forgotten", fit).values()
    return fit(), {"the factor 2 for K and V forgotten, or 1 byte per element (bf16 is 2)": halved,
                   "rounded up: the last, partial token does not fit": fit() + 1,
                   "not rounded down to whole tokens": budget / kv_cache_bytes(
                       batch=8, layers=layers, tokens=1, kv_heads=kv_heads, head_dim=d // heads,
                       bytes_per_element=2),
                   "the 40 query heads cached, not the 8 key/value heads": fit(kv=heads),
                   "d_h taken as the width d, not d / h": fit(head_dim=d),
                   "GiB read as 10^9 bytes": fit(memory=24 * 10**9),
                   "the whole 24 GiB for one sequence (the batch of 8 forgotten)": fit(batch=1)}


def _merge_inputs(a, b, rng):
    """The lesson's blocks A and B, and four query rows split into 3 + 5 keys: row 0 sees all of
    them, row 1 only the first block, row 2 nothing, row 3 only the second block (drawn from the
    lesson's generator, as the lesson's own cells draw)."""
    from refmath.softmax import online_softmax_block

    first, second = rng.standard_normal((4, 3)), rng.standard_normal((4, 5))
    first[2:3], second[1:3] = -np.inf, -np.inf
    block_a = online_softmax_block(first, rng.standard_normal((3, 2)))
    block_b = online_softmax_block(second, rng.standard_normal((5, 2)))
    return [(a, b), (block_a, block_b), (block_b, block_a)]


def _nan_where_both_empty(state, a, b):
    both = np.isneginf(a.m) & np.isneginf(b.m)
    return state._replace(l=np.where(both, np.nan, state.l),
                          u=np.where(both[..., None], np.nan, state.u))


@function_exercise("03.2", "your online-softmax merge", _F1,
                   "rescale both sides to the larger m; guard m = -inf", uses=("a", "b", "rng"))
def _online_softmax_merge(a, b, rng):
    from refmath.softmax import OnlineSoftmaxState, online_softmax_merge

    return dict(
        # drawn only once the function is written, as the lesson's cell drew them
        reference=online_softmax_merge, inputs=lambda: _merge_inputs(a, b, rng),
        slips={"l and u added as they are, neither side rescaled to the larger m": lambda a, b:
                   OnlineSoftmaxState(np.maximum(a.m, b.m), a.l + b.l, a.u + b.u),
               "u added without rescaling (l is rescaled)": lambda a, b:
                   online_softmax_merge(a, b)._replace(u=a.u + b.u),
               "no guard for two empty sides: e^(-inf - (-inf)) is NaN": lambda a, b:
                   _nan_where_both_empty(online_softmax_merge(a, b), a, b)})
