"""Training objectives: token-level cross-entropy with ignored tokens, loss masks and label smoothing.

One function covers the causal-LM loss (L2), its gradient (L3), the original Transformer's label
smoothing (L4) and the SFT loss that counts answer tokens only (L5), as a mean over the counted
tokens or as their sum (``reduction``).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from refmath._validate import check_choice, check_int, check_min_ndim, check_real, check_same_shape, float_array
from refmath.registry import OpCase, register_case
from refmath.softmax import log_softmax_forward

__all__ = ["CrossEntropyCache", "IGNORE_INDEX", "cross_entropy_forward", "cross_entropy_backward"]


class CrossEntropyCache(NamedTuple):
    probs: np.ndarray  # softmax(logits), (..., V)
    targets: np.ndarray  # (...), uncounted positions replaced by 0 so they index safely
    counted: np.ndarray  # bool (...), True where the token enters the loss
    n_counted: int
    label_smoothing: float
    reduction: str  # "mean" divides the sum by n_counted, "sum" does not

REDUCTIONS = ("mean", "sum")


IGNORE_INDEX = -100  # the default target value that is left out of the loss (padding)


def _check_targets(targets, logits, ignore_index):
    targets = np.asarray(targets)
    if not np.issubdtype(targets.dtype, np.integer):
        raise TypeError(
            f"targets must be an integer array, got dtype {targets.dtype} with shape {targets.shape}"
        )
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets.shape must equal logits.shape[:-1], got targets.shape = {targets.shape} "
            f"and logits.shape = {logits.shape}"
        )
    vocab = logits.shape[-1]
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if bad.any():
        raise ValueError(
            f"targets must lie in [0, {vocab}) or equal ignore_index={ignore_index}, got "
            f"{targets[bad].min()}..{targets[bad].max()} among the others (targets.shape = {targets.shape}, "
            f"logits.shape = {logits.shape})"
        )
    return targets


def cross_entropy_forward(logits, targets, ignore_index: int = IGNORE_INDEX, loss_mask=None,
                          label_smoothing: float = 0.0, reduction: str = "mean"):
    r"""Token cross-entropy of the softmax of ``logits``, mean or sum (catalogue L2, L4, L5).

    With :math:`\log p = \operatorname{log\,softmax}(z)` (stable, max subtracted) and the set
    :math:`C` of counted tokens, :math:`n = |C|`:

    .. math::
        \ell_{\text{sum}} = \sum_{t \in C} \Big[-(1-\varepsilon)\log p_{t,a_t}
               - \frac{\varepsilon}{V}\sum_{v} \log p_{t,v}\Big],\qquad
        \ell_{\text{mean}} = \frac1n\, \ell_{\text{sum}}

    ``reduction="mean"`` (the default, PyTorch's) returns :math:`\ell_{\text{mean}}`, which for
    :math:`\varepsilon = 0` and every token counted is the causal-LM loss
    :math:`-\tfrac1T \sum_t \log p_{t,a_t}` (L2); ``reduction="sum"`` returns
    :math:`\ell_{\text{sum}}`.

    A token is counted unless its target equals ``ignore_index`` (padding) or ``loss_mask`` is 0 at
    it. ``loss_mask`` (0/1 or bool, the shape of ``targets``) is how supervised fine-tuning scores
    answer tokens only (L5): set it to 0 on the prompt. L5 is written as a sum over answer tokens,
    :math:`-\sum_{t \in \text{answer}} \log p(a_t \mid q, a_{<t})`: that is
    ``reduction="sum"``. The mean gives each counted token the weight :math:`1/n`, the sum the
    weight 1, so the summed loss and its gradient grow with the number of answer tokens.

    Label smoothing follows PyTorch: the target distribution is
    :math:`q = (1-\varepsilon)\,\mathrm{onehot}(a) + \varepsilon/V`, so the true class gets
    :math:`1 - \varepsilon + \varepsilon/V` and every other class :math:`\varepsilon/V`. This is the
    form of Szegedy et al., which the original Transformer cites for its :math:`\varepsilon_{ls} =
    0.1` (the paper gives only that value): ``label_smoothing = eps_ls``. Implementations that
    spread :math:`\varepsilon_{ls}` over the other :math:`V-1` classes only (true class exactly
    :math:`1-\varepsilon_{ls}`) match ``label_smoothing = eps_ls * V / (V - 1)``.

    If no token is counted (all ignored or masked) the sum has no terms: the loss is 0 (for either
    reduction) and the gradient is zero, never NaN.

    Shapes: ``logits`` ``(..., V)`` floating point, e.g. ``(B, T, V)``; ``targets`` integers of shape
    ``(...)`` in ``[0, V)`` or equal to ``ignore_index``. Returns ``(loss, cache)`` with ``loss`` a
    0-d array of the logits' dtype.
    """
    logits = float_array("logits", logits)
    check_min_ndim("logits", logits, 1, "(..., V)")
    ignore_index = check_int("ignore_index", ignore_index)
    label_smoothing = check_real("label_smoothing", label_smoothing, 0.0, 1.0)
    reduction = check_choice("reduction", reduction, REDUCTIONS)
    targets = _check_targets(targets, logits, ignore_index)
    counted = targets != ignore_index
    if loss_mask is not None:
        loss_mask = np.asarray(loss_mask)
        check_same_shape("loss_mask", loss_mask, "targets", targets)
        if not np.all((loss_mask == 0) | (loss_mask == 1)):
            raise ValueError(f"loss_mask must hold only 0 and 1, got values {np.unique(loss_mask)[:10]} "
                             f"(loss_mask.shape = {loss_mask.shape})")
        counted &= loss_mask.astype(bool)

    # BEGIN SOLUTION
    n_counted = int(counted.sum())
    safe_targets = np.where(counted, targets, 0)
    logp, _ = log_softmax_forward(logits)
    per_token = -np.take_along_axis(logp, safe_targets[..., None], axis=-1)[..., 0]
    if label_smoothing:
        per_token = (1.0 - label_smoothing) * per_token - label_smoothing * logp.mean(axis=-1)
    # np.where, not a multiplication by 0: an uncounted row may hold anything (even inf logits)
    total = np.sum(np.where(counted, per_token, 0.0))
    loss = np.asarray(total / max(n_counted, 1) if reduction == "mean" else total, dtype=logits.dtype)
    cache = CrossEntropyCache(np.exp(logp), safe_targets, counted, n_counted, float(label_smoothing),
                              reduction)
    return loss, cache
    # END SOLUTION


def cross_entropy_backward(dout, cache: CrossEntropyCache):
    # BEGIN SOLUTION
    r"""Gradient of the token cross-entropy: returns ``dlogits`` (catalogue L3).

    Softmax followed by cross-entropy against a distribution :math:`q` has the famously simple
    gradient :math:`\partial \ell_t / \partial z_t = p_t - q_t`; the sum adds these, one per
    counted token, and the mean divides them by ``n``:

    .. math::
        \frac{\partial \ell_{\text{sum}}}{\partial z_t} = p_t - q_t,\qquad
        \frac{\partial \ell_{\text{mean}}}{\partial z_t} = \frac{p_t - q_t}{n}
        \qquad (t \in C;\ 0 \text{ for } t \notin C)

    with :math:`q_t` the one-hot target :math:`y_t`, or its smoothed version. ``dout`` is the scalar
    upstream gradient; the reduction is the forward's, kept in the cache.
    """
    probs, targets, counted, n_counted, eps, reduction = cache
    vocab = probs.shape[-1]
    grad = probs - eps / vocab
    at_target = np.take_along_axis(grad, targets[..., None], axis=-1) - (1.0 - eps)
    np.put_along_axis(grad, targets[..., None], at_target, axis=-1)
    scale = np.asarray(dout, dtype=probs.dtype)
    if reduction == "mean":
        scale = scale / max(n_counted, 1)
    return np.where(counted[..., None], grad * scale, np.zeros((), dtype=probs.dtype))
    # END SOLUTION


# ---- gradient-check cases ------------------------------------------------------------------------

def _ce_inputs(shape, vocab, n_ignored=0, prompt_len=0, **extra):
    """Logits and targets; ``n_ignored`` targets set to the ignore index, and a loss mask that hides
    the first ``prompt_len`` positions of each sequence when ``prompt_len`` > 0."""
    def make(rng):
        logits = 2.0 * rng.standard_normal((*shape, vocab))
        targets = rng.integers(0, vocab, size=shape)
        ignore_index = extra.get("ignore_index", -100)
        targets.flat[rng.choice(targets.size, size=n_ignored, replace=False)] = ignore_index
        inputs = {"logits": logits, "targets": targets, **extra}
        if prompt_len:
            mask = np.ones(shape, dtype=np.int64)
            mask[..., :prompt_len] = 0
            inputs["loss_mask"] = mask
        return inputs
    return make


def _ce_case(label, ids, make):
    register_case(OpCase("cross_entropy", label, ids, make,
                         cross_entropy_forward, cross_entropy_backward, ("logits",)))


_ce_case("(T, V) = (4, 6)", ("L2", "L3"), _ce_inputs((4,), 6))
_ce_case("ignore_index -100, 2 of 5 ignored", ("L2", "L3"), _ce_inputs((5,), 6, n_ignored=2))
_ce_case("loss_mask on a 2-token prompt, ignore_index -1", ("L5",),
         _ce_inputs((2, 5), 4, n_ignored=1, prompt_len=2, ignore_index=-1))
_ce_case("label smoothing 0.1", ("L4",), _ce_inputs((4,), 6, label_smoothing=0.1))
_ce_case("(B, T, V) = (2, 3, 5), smoothing 0.2, 1 ignored", ("L2", "L3", "L4"),
         _ce_inputs((2, 3), 5, n_ignored=1, label_smoothing=0.2))
# One counted token: the mean divides by n = 1 (a max(n, 2) would halve the gradient unseen with 3+)
_ce_case("one counted token of 4", ("L2", "L3"), _ce_inputs((4,), 6, n_ignored=3))
_ce_case("one counted token, smoothing 0.1", ("L3", "L4"), _ce_inputs((1,), 5, label_smoothing=0.1))
_ce_case("3 leading axes (2, 1, 3, V=4), loss mask, 1 ignored", ("L2", "L5"),
         _ce_inputs((2, 1, 3), 4, n_ignored=1, prompt_len=1))
_ce_case("V = 1", ("L2", "L3"), _ce_inputs((3,), 1))
# The SFT loss as the catalogue writes it: a sum over the answer tokens (no division by n)
_ce_case("reduction sum, loss_mask on a 2-token prompt", ("L5",),
         _ce_inputs((2, 4), 5, prompt_len=2, reduction="sum"))
_ce_case("reduction sum, smoothing 0.1, 1 ignored", ("L3", "L4"),
         _ce_inputs((4,), 6, n_ignored=1, label_smoothing=0.1, reduction="sum"))
