r"""Lesson 12, from the equation to the kernel (``notebooks/12_from_equation_to_kernel.py``): the
expected value and the known slips of each exercise, computed from the library and from the
lesson's inputs."""
from __future__ import annotations

import numpy as np

from refmath.lessons.table import exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; nothing here is called by name.
__all__ = []


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
