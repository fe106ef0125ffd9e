"""Token embedding: a table lookup forward, a scatter-add backward."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from refmath._validate import check_flag, check_ndim, float_array, int_array
from refmath.registry import OpCase, register_case

__all__ = ["EmbeddingCache", "embedding_forward", "embedding_backward"]


class EmbeddingCache(NamedTuple):
    ids: np.ndarray  # integer token ids, any shape
    table_shape: tuple  # (vocab, d)
    scale: float  # sqrt(d) or 1
    dtype: np.dtype


def embedding_forward(ids, table, scale_by_sqrt_d: bool = False):
    r"""Look up one row of the embedding table per token (catalogue N12; the scaled form is N8's).

    .. math::
        y_{\ldots} = s\,E[a_{\ldots}],\qquad s = \sqrt d \text{ if scale\_by\_sqrt\_d else } 1

    The original Transformer multiplies by :math:`\sqrt d` before adding the sinusoidal positions;
    GPT-style models (learned positions) use ``s = 1``.

    Shapes: ``ids`` integers of any shape ``(...)`` with values in ``[0, vocab)``, ``table``
    ``(vocab, d)``. Returns ``(y, cache)`` with ``y`` of shape ``(..., d)`` in the table's dtype.
    """
    table = float_array("table", table)
    check_ndim("table", table, 2, "(vocab, d)")
    ids = int_array("ids", ids, table.shape[0])
    scale_by_sqrt_d = check_flag("scale_by_sqrt_d", scale_by_sqrt_d)
    scale = math.sqrt(table.shape[1]) if scale_by_sqrt_d else 1.0
    y = table[ids]
    if scale_by_sqrt_d:
        y = y * scale
    return y, EmbeddingCache(ids, table.shape, scale, table.dtype)


def embedding_backward(dout, cache: EmbeddingCache):
    r"""Gradient of the lookup: returns ``dtable``.

    Row :math:`v` of the table receives the sum of the output gradients of every position holding
    token :math:`v`; rows of tokens that do not occur get zero:

    .. math::
        dE[v] = s \sum_{n:\,a_n = v} dy_n

    ``np.add.at`` does the scatter-add; plain fancy-index assignment (``dE[ids] += dy``) would keep
    only one contribution per repeated id.
    """
    ids, table_shape, scale, dtype = cache
    dtable = np.zeros(table_shape, dtype=dtype)
    rows = dout.reshape(-1, table_shape[1])
    np.add.at(dtable, ids.reshape(-1), rows * scale if scale != 1.0 else rows)
    return dtable


# ---- gradient-check cases ------------------------------------------------------------------------

def _embedding_inputs(shape, vocab, d, scale_by_sqrt_d):
    def make(rng):
        ids = rng.integers(0, vocab, size=shape)
        ids.flat[0] = ids.flat[-1]  # at least one repeated id, whatever the draw
        return {"ids": ids, "table": rng.standard_normal((vocab, d)), "scale_by_sqrt_d": scale_by_sqrt_d}
    return make


register_case(OpCase("embedding", "ids (2, 5) vocab 7", ("N12",), _embedding_inputs((2, 5), 7, 4, False),
                     embedding_forward, embedding_backward, ("table",)))
register_case(OpCase("embedding", "scaled by sqrt(d), ids (6,) vocab 9", ("N8", "N12"),
                     _embedding_inputs((6,), 9, 4, True), embedding_forward, embedding_backward, ("table",)))
register_case(OpCase("embedding", "3-D ids (2, 1, 3), d = 1", ("N12",),
                     _embedding_inputs((2, 1, 3), 5, 1, False), embedding_forward, embedding_backward,
                     ("table",)))
