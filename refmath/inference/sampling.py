r"""Turning a row of logits into the next token: greedy, or sampling with temperature, top-k and
top-p (catalogue L7).

For the last position's logits :math:`z \in \mathbb R^V`:

- greedy: :math:`\arg\max_v z_v` (the lowest id among ties);
- sampling: :math:`p = \operatorname{softmax}(z / \tau)` with temperature :math:`\tau > 0`, then
  optionally top-k (keep the ``k`` most probable ids) and then top-p (keep the smallest set of the
  most probable ids whose mass is at least ``p``), renormalise, and draw by inverting the
  cumulative distribution with one uniform number from a ``numpy.random.Generator``.

Greedy ignores the temperature, top-k and top-p, which cannot change the argmax. The same seed and
arguments give the same tokens. Both generators (:mod:`refmath.inference.generate` and the KV-cache
ones of :mod:`refmath.inference.kv_cache`) pick through :func:`token_picker`, so a seed gives the
same tokens with or without the cache.
"""
from __future__ import annotations

import numpy as np

from refmath._validate import check_flag, check_int, check_ndim, check_real, float_array

__all__ = [
    "check_sampling_args", "top_k_filter", "top_p_filter", "check_logits",
    "next_token_distribution", "sample_token", "token_picker"
]


# ---- turning logits into a distribution ----------------------------------------------------------

def check_sampling_args(temperature: float = 1.0, top_k: int | None = None,
                        top_p: float | None = None) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``temperature > 0`` (finite), ``top_k`` is None
    or an int ``>= 1``, and ``top_p`` is None or in ``(0, 1]`` (greedy decoding needs no
    temperature: pass ``greedy=True`` instead of a temperature of 0)."""
    check_real("temperature", temperature, 0.0, low_open=True)
    if top_k is not None:
        check_int("top_k", top_k, 1)
    if top_p is not None:
        check_real("top_p", top_p, 0.0, 1.0, low_open=True)


def _descending(probs: np.ndarray) -> np.ndarray:
    # A stable sort of -p: among equal probabilities the lower id comes first, so ties are broken
    # the same way every time (and the same way as np.argmax).
    return np.argsort(-probs, kind="stable")


def top_k_filter(probs, k: int) -> np.ndarray:
    """Keep the ``k`` largest entries of the distribution ``probs`` ``(V,)``, zero the rest and
    renormalise (the lower id wins a tie at the boundary; ``k >= V`` keeps everything)."""
    probs = float_array("probs", probs)
    check_ndim("probs", probs, 1, "(V,)")
    check_sampling_args(top_k=k)
    keep = np.zeros(probs.shape, dtype=bool)
    keep[_descending(probs)[:k]] = True
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def top_p_filter(probs, p: float) -> np.ndarray:
    r"""Nucleus filtering: keep the smallest set of most probable ids whose mass is at least ``p``.

    With the probabilities sorted in decreasing order, :math:`p_{(1)} \ge p_{(2)} \ge \ldots`, the
    kept ids are the first :math:`m` where :math:`m` is the least index with
    :math:`\sum_{i \le m} p_{(i)} \ge p`: id :math:`(i)` is kept exactly when the mass before it,
    :math:`\sum_{j < i} p_{(j)}`, is below ``p``. The most probable id is always kept; ``p = 1``
    keeps every id (also those whose mass rounding would drop). Returns the renormalised ``(V,)``.
    """
    probs = float_array("probs", probs)
    check_ndim("probs", probs, 1, "(V,)")
    check_sampling_args(top_p=p)
    if p == 1.0:
        return probs / probs.sum()
    order = _descending(probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros(probs.shape, dtype=bool)
    keep[order[mass_before < p * probs.sum()]] = True
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def check_logits(z: np.ndarray) -> None:
    """Raise ``ValueError`` unless the logits ``z`` ``(..., V)`` can define a distribution: no NaN,
    no ``+inf``, and at least one entry above ``-inf`` per row (``-inf`` excludes a token)."""
    bad = np.isnan(z) | np.isposinf(z)
    if bad.any():
        raise ValueError(f"logits hold {int(bad.sum())} NaN or +inf entries (shape {z.shape}); "
                         f"the model's output is not a number: are its parameters finite?")
    if np.isneginf(z).all(axis=-1).any():
        raise ValueError(f"every logit of a row is -inf (shape {z.shape}): no token can be chosen")


def next_token_distribution(logits, temperature: float = 1.0, top_k: int | None = None,
                            top_p: float | None = None) -> np.ndarray:
    r"""The distribution a sampler draws from: ``softmax(logits / temperature)`` ``(V,)`` in float64,
    then :func:`top_k_filter`, then :func:`top_p_filter` (the order of Hugging Face's samplers).

    The softmax subtracts the maximum first, so a small temperature does not overflow.
    """
    z = float_array("logits", logits).astype(np.float64)
    check_ndim("logits", z, 1, "(V,)")
    check_sampling_args(temperature, top_k, top_p)
    check_logits(z)
    scaled = z / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_k is not None:
        probs = top_k_filter(probs, top_k)
    if top_p is not None:
        probs = top_p_filter(probs, top_p)
    return probs


def sample_token(probs, rng: np.random.Generator) -> int:
    """Draw one id from ``probs`` ``(V,)`` by inverting the cumulative sum with ``u ~ U[0, 1)``.

    The id is the first ``v`` with ``cdf[v] > u * cdf[-1]``; ids of probability 0 are never drawn.
    """
    probs = float_array("probs", probs)
    check_ndim("probs", probs, 1, "(V,)")
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    cdf = np.cumsum(probs)
    v = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    # u * total can round up to total itself; fall back to the last id with positive probability.
    return min(v, int(np.flatnonzero(probs > 0)[-1]))


def token_picker(greedy: bool, temperature, top_k, top_p, seed):
    """``pick(z) -> int``, the next id from one row of logits ``z`` ``(V,)``: the argmax, or a draw
    from :func:`next_token_distribution` with one uniform number per call from ``seed`` (an int or
    a ``numpy.random.Generator``). Both refuse logits holding NaN (see :func:`check_logits`)."""
    check_sampling_args(temperature, top_k, top_p)
    if check_flag("greedy", greedy):
        def argmax(z):
            check_logits(z)  # np.argmax picks a NaN as readily as the largest logit
            return int(np.argmax(z))
        return argmax
    rng = np.random.default_rng(seed)  # a Generator passes through unchanged

    def pick(z):
        return sample_token(next_token_distribution(z, temperature, top_k, top_p), rng)
    return pick
