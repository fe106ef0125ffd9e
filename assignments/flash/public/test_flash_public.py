"""Public tests of the FlashAttention assignment: `python -m pytest -q tests`.

Your tiled functions against the dense reference of the library (`refmath.attention`, given) on a
few shapes. The hidden tests use more shapes and masks, an independent implementation, and measure
memory.
"""
import numpy as np
import pytest

from refmath.attention import causal_mask, sdpa_backward, sdpa_forward
from refmath.flash import flash_attention_backward, flash_attention_forward
from refmath.softmax import online_softmax_block, online_softmax_merge, online_softmax_result

rng = np.random.default_rng(0)


def test_merge_of_two_halves_is_softmax():
    s, v = rng.standard_normal((2, 6)), rng.standard_normal((6, 3))
    merged = online_softmax_merge(online_softmax_block(s[:, :2], v[:2]), online_softmax_block(s[:, 2:], v[2:]))
    weights = np.exp(s) / np.exp(s).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(online_softmax_result(merged), weights @ v)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_backward_match_dense(causal):
    q, k, v, do = (rng.standard_normal((1, 2, 21, 4)) for _ in range(4))
    mask = causal_mask(21) if causal else None
    o_dense, cache = sdpa_forward(q, k, v, mask=mask)
    o, lse = flash_attention_forward(q, k, v, causal=causal, block_q=8, block_k=8)
    np.testing.assert_allclose(o, o_dense, rtol=1e-10, atol=1e-12)
    grads = flash_attention_backward(do, q, k, v, o, lse, causal=causal, block_q=8, block_k=8)
    for mine, dense in zip(grads, sdpa_backward(do, cache)):
        np.testing.assert_allclose(mine, dense, rtol=1e-10, atol=1e-12)
