r"""Lesson 6, the encoder-decoder Transformer (``notebooks/06_encoder_decoder.py``): the expected
value and the known slips of each exercise, computed from the library and from the lesson's
inputs."""
from __future__ import annotations

import numpy as np

from refmath.lessons.checks import catalogued
from refmath.lessons.table import exercise, function_exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; nothing here is called by name.
__all__ = []


def _tensor2tensor_target(z, y):
    """tensor2tensor's target for eps = 0.1 at one position, and refmath's own target for the same
    eps (a slip of 06.3: the first row of the lesson's table taken for the second)."""
    from refmath.losses import cross_entropy_backward, cross_entropy_forward
    from refmath.softmax import softmax_forward

    vocab, eps = np.shape(z)[-1], 0.1
    target = np.full(vocab, eps / (vocab - 1))
    target[int(y[0])] = 1 - eps
    # refmath's own target for the same eps: q = p - dloss/dlogits (the gradient is p - q)
    ours = softmax_forward(z)[0] - cross_entropy_backward(1.0, cross_entropy_forward(
        z, y, label_smoothing=eps)[1])
    return target, ours[0]


def _as_one_row(answer, width: int) -> np.ndarray:
    """The gradient of one row of logits, given as (width,) or as z's own shape (1, width): both
    are it (any other size is left as it is, and the check names its shape)."""
    answer = np.asarray(answer, dtype=np.float64)
    return answer.reshape(width) if answer.size == width else answer


@exercise("06.3", "dloss/dz for tensor2tensor's target",
          "the section 'L4: label smoothing, three conventions'",
          "d/dz_u of -sum_v q_v (z_v - log sum_w e^(z_w)) is p_u - q_u, as sum_v q_v = 1; q has "
          "1 - eps on y and eps / (V - 1) on each other token", uses=("z", "y"),
          prepare=lambda answer: _as_one_row(answer, 5))
def _tensor2tensor_gradient(z, y):
    from refmath.losses import cross_entropy_backward, cross_entropy_forward
    from refmath.softmax import softmax_forward

    target, ours = _tensor2tensor_target(z, y)
    probs = softmax_forward(z)[0][0]
    one_hot = cross_entropy_backward(1.0, cross_entropy_forward(z, y)[1])[0]
    return probs - target, {
        "tensor2tensor's target q itself, not the gradient p - q": target,
        "q - p: the gradient of -sum q log p is p - q": target - probs,
        "refmath's target for eps = 0.1, eps / V on every token: tensor2tensor puts eps / (V - 1) "
        "on the others and nothing extra on y": probs - ours,
        "lesson 5's one-hot gradient p - onehot(y): the smoothing left out": one_hot,
        "p - q without the softmax: the logits z used for p": np.asarray(z)[0] - target}


_L1 = "the section 'L1: the decoder reads the target shifted right by one'"


@exercise("06.1", "shifted decoder input", _L1,
          "a column of BOS ids in front, the last target token dropped",
          uses=("targets_2", "bos"), rtol=0.0)
def _shifted_decoder_input(targets, bos):
    from refmath.models import transformer

    targets = np.asarray(targets)
    return transformer.shift_right(targets, bos_id=bos), {
        "the targets themselves, not shifted": targets,
        "shifted the wrong way: the first target dropped, BOS put last":
            np.concatenate([targets[:, 1:], np.full((len(targets), 1), bos)], axis=1),
        "the first target token dropped, not the last: position t must read y_1 .. y_{t-1}, so "
        "y_1 stays and y_m goes": np.concatenate([np.full((len(targets), 1), bos), targets[:, 1:]],
                                                 axis=1)}


@exercise("06.2", "p(y | x)", _L1, "p[0, t, tgt[0, t]] is the factor of position t",
          uses=("loss", "z", "tgt", "dec_in"))
def _target_probability(loss, z, tgt, dec_in):
    from refmath.softmax import softmax_forward

    tgt = np.asarray(tgt)
    probs = softmax_forward(z)[0][0]
    factors = probs[np.arange(tgt.shape[1]), tgt[0]]
    return np.exp(-tgt.shape[1] * float(loss)), {
        "the factors read at the decoder input, not at the target: position t is scored on y_t, "
        "the token after the one it reads": float(
            probs[np.arange(tgt.shape[1]), np.asarray(dec_in)[0]].prod()),
        "the mean of the probabilities, not their product": float(np.mean(factors)),
        "the loss exp(-l) of the mean, not of the sum over the tokens": np.exp(-float(loss))}


@exercise("06.4", "its loss through refmath", "the section 'L4: label smoothing, three conventions'",
          "label_smoothing = eps V / (V - 1)", uses=("z", "y"))
def _tensor2tensor_loss(z, y):
    from refmath.losses import cross_entropy_forward
    from refmath.softmax import softmax_forward

    target = _tensor2tensor_target(z, y)[0]
    return float(-(target * np.log(softmax_forward(z)[0][0])).sum()), {
        "label_smoothing = eps itself: refmath's eps / V on every token, not tensor2tensor's "
        "target": float(cross_entropy_forward(z, y, label_smoothing=0.1)[0])}


@exercise("06.7", "dE", "the section 'N12: the embedding lookup, and repeated tokens in its "
          "backward'", "each token's gradient is added to its row: np.add.at(dE, ids, dy)",
          uses=("dy", "emb_cache"), rtol=0.0)
def _embedding_gradient(dy, cache):
    from refmath.embedding import embedding_backward

    return embedding_backward(dy, cache), catalogued(
        "embedding: repeated ids keep one contribution", lambda: embedding_backward(dy, cache))


_W_Q = "encoder.layers.0.self_attn.w_q"


def _both_or_unwritten(answer):
    """The pair (numeric, analytic) as a (2, 4) array; ``...`` while either is unwritten."""
    if answer is Ellipsis or any(part is Ellipsis or part is None for part in answer):
        return Ellipsis
    return np.stack([np.asarray(part, dtype=np.float64).reshape(-1) for part in answer])


@exercise("06.6", "(numeric, analytic) dW_Q at coords_wq", "the section 'M1: the original "
          "encoder-decoder, forward and backward'",
          "numerical_gradient(phi, params[name], coords_wq), and grads[name].reshape(-1)[coords_wq]",
          uses=("phi", "params", "cache", "coords_wq"), prepare=_both_or_unwritten)
def _gradient_check_of_w_q(phi, params, cache, coords):
    from refmath.gradcheck import numerical_gradient
    from refmath.models import transformer

    # Each half against its own recomputation: central differences agree with the hand-written
    # backward to about 1e-10, so a copy of one half into the other is told apart at rtol 1e-12.
    numeric = numerical_gradient(phi, params[_W_Q], coords)
    analytic = transformer.backward(cache)[_W_Q].reshape(-1)[coords]
    return np.stack([numeric, analytic]), {
        "the numerical gradient copied as the analytic one: read the hand-written backward's "
        "values out of grads": np.stack([numeric, numeric])}


# The write-the-function exercise ----------------------------------------------------------

def _torch_cross_entropy(logits, targets, ignore_index=-100, loss_mask=None, label_smoothing=0.0,
                         reduction="mean"):
    """The oracle (used only where torch is installed): torch's cross_entropy, with the loss
    mask written as ignored targets."""
    import torch

    if loss_mask is not None:
        targets = torch.where(loss_mask.bool(), targets, ignore_index)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index,
        label_smoothing=label_smoothing, reduction=reduction)


def _tensor2tensor_target_backward(dout, cache):
    """A slip: 1 - eps on the right token and eps / (V - 1) on each other one."""
    from refmath.losses import cross_entropy_backward

    vocab = cache.probs.shape[-1]
    eps = cache.label_smoothing * vocab / max(vocab - 1, 1)
    return cross_entropy_backward(dout, cache._replace(label_smoothing=eps))


@function_exercise("06.5", "your smoothed cross-entropy backward",
                   "the section 'L4: label smoothing, three conventions'",
                   "p - q with q = (1 - eps) onehot + eps / V, on the counted rows")
def _smoothed_cross_entropy_backward():
    from refmath.losses import cross_entropy_backward

    return dict(
        reference=cross_entropy_backward, case="cross_entropy[*", oracle=_torch_cross_entropy,
        slips={**catalogued("cross-entropy: label smoothing left out of the gradient",
                            cross_entropy_backward),
               "no smoothing at all: the one-hot target, p - y": lambda dout, cache:
                   cross_entropy_backward(dout, cache._replace(label_smoothing=0.0)),
               "tensor2tensor's target: eps / (V - 1) on the wrong tokens": _tensor2tensor_target_backward,
               **catalogued("cross-entropy: ignored tokens get a gradient", cross_entropy_backward),
               **catalogued("cross-entropy: mean over max(n, 2)", cross_entropy_backward),
               **catalogued("cross-entropy: 1 - eps dropped from the smoothed target",
                            cross_entropy_backward)})
