r"""Lesson 12, from the equation to the kernel (``notebooks/12_from_equation_to_kernel.py``): the
expected value and the known slips of each exercise, computed from the library and from the
lesson's inputs."""
from __future__ import annotations

import numpy as np

from refmath.lessons.table import exercise, function_exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; the lesson imports only the
# split states and their merge by name, after exercise 12.3 (whose slips are built from them).
__all__ = ["merged", "split_states"]


def _forward_scratch_bytes(d: int, block_q: int = 128, block_k: int = 128, leave_out=()) -> int:
    """Bytes of one thread's scratch in the C++ forward pass (csrc/flash_cpu.cpp), padded to 16
    floats; tests/test_lessons_12_16.py holds the kernel's own expression to the same count."""
    parts = {"S": block_q * block_k, "U": block_q * d, "PV": block_q * d,
             "m, l, alpha": 3 * block_q, "KT": d * block_k, "Vs": block_k * d}
    floats = sum(n for name, n in parts.items() if name not in leave_out)
    return 4 * (-(-floats // 16) * 16)


@exercise("12.2", "scratch bytes per thread at D = 128",
          "the section 'F4: the scratch memory of a tile'", "six buffers; 4 bytes a float",
          rtol=0.0)
def _scratch_bytes():
    full = _forward_scratch_bytes(128)
    return full, {
        "float32 numbers, not bytes": full / 4,
        # at D = B_k = 128, U, PV, KT and Vs are all 128 x 128: the check cannot tell which one
        # is missing, so its name does not guess
        "one of the 128 x 128 buffers left out (U, PV, KT or Vs)":
            _forward_scratch_bytes(128, leave_out=("Vs",)),
        "m, l and alpha left out": _forward_scratch_bytes(128, leave_out=("m, l, alpha",)),
        "only the score tile S": 4 * 128 * 128,
        "D = 64's scratch": _forward_scratch_bytes(64)}


def _cpu_splits(batch: int, kv_heads: int, longest: int, threads: int) -> int:
    """choose_splits of csrc/decode_cpu.cpp for a contiguous cache (tests/test_lessons_12_16.py
    holds the kernel's choice to it)."""
    if threads == 1:
        return 1
    return max(1, min(-(-8 * threads // (batch * kv_heads)), longest // 512))


@exercise("12.4", "the splits chosen for (a) and (b)",
          "the section 'K2 and F3: a decode step, split across the cores'",
          "work items are the B G pairs, about 8 per thread; no split below 512 keys", rtol=0.0)
def _splits_chosen():
    return (_cpu_splits(3, 8, 32768, 16), _cpu_splits(1, 1, 4096, 16)), {
        "the 512-key floor ignored": (-(-8 * 16 // 24), 8 * 16),
        "rounded down: 128 / 24 = 5.33 needs 6 splits": (8 * 16 // 24, 8),
        "one work item per query head, not per key/value head":
            (_cpu_splits(3, 32, 32768, 16), _cpu_splits(1, 1, 4096, 16)),
        "one work item per thread, not 8": (-(-16 // 24), min(16, 4096 // 512))}


@exercise("12.1", "the rule's bound on o", "the section 'F4 in float32: how close is close "
          "enough'", "c = 2 for an output; the floor is 4 u max|v| with u = 2^-24",
          uses=("ref_o", "np32_o", "vg"))
def _float32_bound(ref_o, np32_o, vg):
    u = 2.0**-24  # float32's unit roundoff
    error = float(np.abs(np.asarray(np32_o, dtype=np.float64) - ref_o).max())
    big_v = float(np.abs(vg).max())
    return 2 * error + 4 * u * big_v, {
        "u = 2^-23: that is the gap after 1, the unit roundoff is half of it":
            2 * error + 4 * 2.0**-23 * big_v,
        "the floor 4 u M left out": 2 * error,
        "c = 1: an output's factor is 2": error + 4 * u * big_v,
        "c = 3, the factor of the gradients": 3 * error + 4 * u * big_v,
        "M = max |o|: the floor is set by the values summed, max |v|":
            2 * error + 4 * u * float(np.abs(ref_o).max()),
        "NumPy's error taken in float32, against the reference rounded to float32":
            2 * float(np.abs(np32_o - np.asarray(ref_o).astype(np.float32)).max()) + 4 * u * big_v}


def _dense_decode(q, k, v, splits):
    """The reference: q attends to all n keys at once (exactly, splits change nothing)."""
    from refmath.inference.decode import decode_attention

    return decode_attention(q[None, None], k[None, None], v[None, None], [len(k)])[0, 0]


def _split_decode_inputs():
    draw = np.random.default_rng(12)
    return [(draw.standard_normal(16), 3 * draw.standard_normal((n, 16)),  # 3 k: peaked rows
             draw.standard_normal((n, 16)), splits)
            for n, splits in ((1000, 4), (10, 4), (3, 4), (5, 1))]


def split_states(q, k, v, splits, chunk=None):
    """Each split's statistics ``(m_s, l_s, u_s)`` by the library's F2, for one query row ``q``
    (D,) over keys ``k`` and values ``v`` (n, D) with scale 1/sqrt(D): split s takes keys
    ``[min(n, s c), min(n, s c + c))``, c = ceil(n / splits) unless ``chunk`` is given (an empty
    split gives the empty state, m = -inf, l = 0, u = 0)."""
    from refmath.softmax import online_softmax_block

    n = len(k)
    chunk = -(-n // splits) if chunk is None else chunk
    cuts = [(min(n, s * chunk), min(n, s * chunk + chunk)) for s in range(splits)]
    return [online_softmax_block(k[lo:hi] @ q / np.sqrt(len(q)), v[lo:hi]) for lo, hi in cuts]


def merged(states):
    """The F3 merge of the splits' states in order, and its output o = u / l."""
    from refmath.softmax import online_softmax_merge, online_softmax_result

    state = states[0]
    for other in states[1:]:
        state = online_softmax_merge(state, other)
    return online_softmax_result(state)


def _remainder_dropped(q, k, v, splits):
    """A slip: chunks of n // splits keys, so the last n mod splits keys are never read, and with
    fewer keys than splits none is (every split empty: 0 / 0)."""
    chunk = len(k) // splits
    return merged(split_states(q, k, v, splits, chunk)) if chunk else np.full(len(q), np.nan)


def _nan_from_empty_splits(q, k, v, splits):
    """A slip: o_s = u_s / l_s first, then o = sum_s (e^(m_s - m) l_s / l) o_s, where an empty
    split's 0 / 0 is NaN."""
    states = split_states(q, k, v, splits)
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
                                    split_states(q, k, v, splits) if st.l > 0], axis=0),
               "u_s and l_s added without rescaling to the largest m":
                   lambda q, k, v, splits: sum(st.u for st in split_states(q, k, v, splits))
                   / sum(st.l for st in split_states(q, k, v, splits)),
               "an empty split's o_s = 0 / 0 reaches the merge": _nan_from_empty_splits,
               "no 1/sqrt(D) scale on the scores": lambda q, k, v, splits:
                   _dense_decode(q * np.sqrt(len(q)), k, v, splits)},
        refuse=(online_softmax_block, online_softmax_merge, online_softmax_result))
