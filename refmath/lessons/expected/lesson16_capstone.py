r"""Lesson 16, the capstone, a GPT trained with your own backward passes
(``notebooks/16_capstone.py``): the expected value and the known slips of each exercise,
computed from the library and from the lesson's inputs."""
from __future__ import annotations

from refmath.lessons.table import exercise, flat_parameters


@exercise("16.5", "your model's gradients against the library's", "the section 'The whole "
          "model, checked'", "each of your four backward passes is checked above: fix the one "
          "whose check is not right", uses=("cache", "backward", "library"), rtol=1e-10,
          atol=1e-14, prepare=flat_parameters)
def _capstone_gradients(cache, backward, library):
    # the lesson's own backward through the model, with the library's four functions inside
    return flat_parameters(backward(cache, library)), {}
