import math

import numpy as np
import pytest

from refmath.embedding import embedding_backward, embedding_forward


def test_lookup_returns_the_table_rows_n12():
    table = np.arange(12.0).reshape(4, 3)
    y, _ = embedding_forward(np.array([[3, 0], [0, 1]]), table)
    np.testing.assert_array_equal(y, [[[9, 10, 11], [0, 1, 2]], [[0, 1, 2], [3, 4, 5]]])


def test_repeated_ids_accumulate_in_the_backward_n12():
    ids = np.array([[2, 0, 2], [2, 1, 0]])  # token 2 three times, token 0 twice, token 3 never
    _, cache = embedding_forward(ids, np.zeros((4, 2)))
    dout = np.arange(12.0).reshape(2, 3, 2)  # row n of dout is (2n, 2n + 1)
    dtable = embedding_backward(dout, cache)
    # row 2 gets rows 0, 2, 3 of dout: (0+4+6, 1+5+7); row 0 gets rows 1, 5; row 1 gets row 4
    np.testing.assert_array_equal(dtable, [[2 + 10, 3 + 11], [8, 9], [10, 13], [0, 0]])


def test_sqrt_d_scaling_of_the_original_transformer_n8():
    rng = np.random.default_rng(0)
    d, table, ids = 8, rng.standard_normal((5, 8)), np.array([4, 1, 1])
    y, cache = embedding_forward(ids, table, scale_by_sqrt_d=True)
    np.testing.assert_allclose(y, math.sqrt(d) * table[ids], rtol=1e-15)
    # the backward carries the same factor: token 1 appears twice
    dtable = embedding_backward(np.ones((3, d)), cache)
    np.testing.assert_allclose(dtable[1], 2 * math.sqrt(d), rtol=1e-15)
    np.testing.assert_allclose(dtable[4], math.sqrt(d), rtol=1e-15)


def test_float32_table_stays_float32():
    y, cache = embedding_forward(np.array([0, 1]), np.ones((3, 4), dtype=np.float32), scale_by_sqrt_d=True)
    assert y.dtype == np.float32
    assert embedding_backward(np.ones_like(y), cache).dtype == np.float32


def test_bad_ids_name_ids_and_the_range():
    table = np.zeros((5, 3))
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 5\), got values in \[0, 5\] \(shape \(2,\)\)"):
        embedding_forward(np.array([0, 5]), table)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 5\), got values in \[-1, 2\]"):
        embedding_forward(np.array([[-1, 2]]), table)
    with pytest.raises(TypeError, match=r"ids must be an integer array, got dtype float64 with shape \(2,\)"):
        embedding_forward(np.array([0.0, 1.0]), table)
    with pytest.raises(TypeError, match=r"table must be a floating-point array"):
        embedding_forward(np.array([0]), np.zeros((5, 3), dtype=np.int64))
    with pytest.raises(ValueError, match=r"table must have 2 dimensions \(vocab, d\), got shape \(5,\)"):
        embedding_forward(np.array([0]), np.zeros(5))
