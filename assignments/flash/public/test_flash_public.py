"""Public tests of the FlashAttention assignment: `python -m pytest -q tests`.

Your tiled functions against dense attention written out below (the equations A2 and A8: the
attention assignment's functions are not part of this tree) on a few shapes. The hidden tests use
more shapes and masks, an independent implementation, and measure memory.
"""
import numpy as np
import pytest

from refmath.flash import flash_attention_backward, flash_attention_forward
from refmath.softmax import online_softmax_block, online_softmax_merge, online_softmax_result

rng = np.random.default_rng(0)


def dense(q, k, v, do, causal):
    """softmax(Q K^T / sqrt(d)) V and its gradients dQ, dK, dV for the upstream gradient dO."""
    scale = 1 / np.sqrt(q.shape[-1])
    s = q @ np.swapaxes(k, -1, -2) * scale
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], dtype=bool)), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    return p @ v, (ds @ k * scale, np.swapaxes(ds, -1, -2) @ q * scale, np.swapaxes(p, -1, -2) @ do)


def test_merge_of_two_halves_is_softmax():
    s, v = rng.standard_normal((2, 6)), rng.standard_normal((6, 3))
    merged = online_softmax_merge(online_softmax_block(s[:, :2], v[:2]), online_softmax_block(s[:, 2:], v[2:]))
    weights = np.exp(s) / np.exp(s).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(online_softmax_result(merged), weights @ v)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_backward_match_dense(causal):
    q, k, v, do = (rng.standard_normal((1, 2, 21, 4)) for _ in range(4))
    o_dense, dense_grads = dense(q, k, v, do, causal)
    o, lse = flash_attention_forward(q, k, v, causal=causal, block_q=8, block_k=8)
    np.testing.assert_allclose(o, o_dense, rtol=1e-10, atol=1e-12)
    grads = flash_attention_backward(do, q, k, v, o, lse, causal=causal, block_q=8, block_k=8)
    for mine, expected in zip(grads, dense_grads):
        np.testing.assert_allclose(mine, expected, rtol=1e-10, atol=1e-12)
