r"""Lesson 16, the capstone, a GPT trained with your own backward passes
(``notebooks/16_capstone.py``): the expected value and the known slips of each exercise,
computed from the library and from the lesson's inputs."""
from __future__ import annotations

from refmath.lessons.checks import catalogued
from refmath.lessons.table import exercise, flat_parameters, function_exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; nothing here is called by name.
__all__ = []


@exercise("16.5", "your model's gradients against the library's", "the section 'The whole "
          "model, checked'", "each of your four backward passes is checked above: fix the one "
          "whose check is not right", uses=("cache", "backward", "library"), rtol=1e-10,
          atol=1e-14, prepare=flat_parameters)
def _capstone_gradients(cache, backward, library):
    # the lesson's own backward through the model, with the library's four functions inside
    def gradients():
        return flat_parameters(backward(cache, library))
    # a slip in one of the student's four functions, as the library with that slip applied (the
    # slips the functions' own checks name that change this model's gradients)
    slips = {}
    for mistake in ("softmax: the -a a^T term dropped (a * dout)", "softmax: sum over the wrong axis",
                    "layernorm: variance path dropped", "layernorm: dbeta averaged over rows",
                    "gelu tanh: the 3 of d(x^3)/dx forgotten"):
        slips.update(catalogued(mistake, gradients))
    return gradients(), slips


# The four backward passes of lessons 1, 2, 4 and 5 again, with fewer slips and, as before,
# no hint (the lessons that taught them are the place to look).

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
