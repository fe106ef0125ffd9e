r"""Lesson 16, the capstone, a GPT trained with your own backward passes
(``notebooks/16_capstone.py``): the expected value and the known slips of each exercise,
computed from the library and from the lesson's inputs."""
from __future__ import annotations

from refmath.lessons.checks import catalogued
from refmath.lessons.table import exercise, flat_parameters

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
