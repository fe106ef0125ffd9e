r"""What a kernel may legitimately do differently: its declared conventions, each one named.

Two questions have more than one defensible answer, and kernels in wide use answer them
differently; the sweep asks the kernel (its adapter, or the caller) to declare its answer rather
than fail it for not sharing refmath's.

**A row that sees no key** (``empty_rows``). The softmax of no scores is ``0/0``; what comes out:

=============  ===========================================================================
``zero``       ``o = 0`` and zero gradients (flash-attention, refmath, PyTorch's fused paths)
``nan``        ``o = NaN`` (the math definition: every weight is ``0/0``); the gradient of the
               row's query is undefined (NaN, or what the library's softmax backward makes of
               it), and the key/value head it reads may be NaN in ``dk``, ``dv`` (every weight of
               the row is NaN, so every key it multiplies is): those entries are not compared
``unmasked``   the row attends as if it had no mask: ``softmax(s) v`` over every key of its
               sequence (a mask *added* as a finite fill such as ONNX Runtime's ``-10000``: every
               score moves by the same amount, which the softmax cancels); gradients likewise
``mean-of-v``  every weight ``1 / T_k``: the mean of ``V`` (a mask that *replaces* the scores by
               one finite value, as ``jnp.where(mask, s, big_negative)`` does); no gradient reaches
               ``q`` or ``k`` from the row, ``dv`` gets ``dout_i / T_k``
=============  ===========================================================================

The log-sum-exp of such a row is ``-inf``, NaN, or whatever the fill makes it; it is never
compared.

**NaN that a row should not see, and NaN that it should**: three rules, each its own flag.

* ``masked_nan_may_leak``: a NaN or inf in a key or value that the *mask* hides (causal, window,
  padding, another packed sequence) may reach the row. A kernel that adds the mask to the scores
  computes ``NaN + (-inf) = NaN``, and one that multiplies a weight of 0 by a value of NaN gets NaN:
  PyTorch's SDPA, ONNX Runtime and JAX do. Off by default; the ``sdpa`` adapter declares it.
* ``past_length_nan_may_leak``: a NaN in a cache slot past a sequence's decode length (or in a page
  it does not own) may reach it. A decode kernel that does so *reads memory it was told is not
  there*, a defect; the flag exists only so that the rest of a sweep can be seen past it. Either
  way the ``stale`` cases, whose slots past the length hold finite values, catch such a read by
  its error.
* ``visible_nan_may_vanish``: a NaN that the row does see may come out as a number. Off by
  default: NaN in must give NaN out (``DESIGN.md``); a kernel that loses it hides a corrupted input.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["EMPTY_ROWS", "RULES", "Conventions"]

EMPTY_ROWS = ("zero", "nan", "unmasked", "mean-of-v")

# The rule of each NaN flag, as a verdict names it, and the hint given when a case fails by it only.
RULES = {
    "masked_nan_may_leak": (
        "NaN from a key the mask hides",
        "the only failure of this case: if the kernel adds its mask to the scores (or multiplies "
        "masked weights of 0 by the values), declare it: --allow-masked-nan "
        "(masked_nan_may_leak=True)"),
    "past_length_nan_may_leak": (
        "NaN from a cache slot past the decode length, or a page the sequence does not own",
        "the only failure of this case: the kernel reads cache slots past a sequence's length (or "
        "pages it does not own), a defect in any decode kernel; --allow-past-length-nan shows the "
        "rest of the sweep, and the 'stale' cases still catch the read"),
    "visible_nan_may_vanish": (
        "a NaN the row sees came out as a number",
        "the only failure of this case: NaN in a visible key, value or query must reach the output; "
        "--allow-lost-nan (visible_nan_may_vanish=True) notes it instead"),
    "empty_rows": (
        "rows that see no key",
        "the only failure of this case is in rows that see no key: declare the kernel's convention "
        "with --empty-rows zero|nan|unmasked|mean-of-v (the located failure says which its rows "
        "match, if any)"),
}


@dataclass(frozen=True)
class Conventions:
    """A kernel's answers to the questions of the module docstring (defaults: refmath's)."""

    empty_rows: str = "zero"
    masked_nan_may_leak: bool = False
    past_length_nan_may_leak: bool = False
    visible_nan_may_vanish: bool = False

    def __post_init__(self):
        if self.empty_rows not in EMPTY_ROWS:
            raise ValueError(f"masked_rows (empty_rows) must be one of {EMPTY_ROWS}, "
                             f"got {self.empty_rows!r}")
        for name in ("masked_nan_may_leak", "past_length_nan_may_leak", "visible_nan_may_vanish"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def replace(self, **changes) -> "Conventions":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def describe(self) -> str:
        flags = [name for name in ("masked_nan_may_leak", "past_length_nan_may_leak",
                                   "visible_nan_may_vanish") if getattr(self, name)]
        return f"empty rows: {self.empty_rows}; NaN allowed: {', '.join(flags) or 'none'}"
