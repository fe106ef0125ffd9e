"""Public tests of the losses and optimisers assignment: `python -m pytest -q tests`.

Small hand-checkable cases and central differences. The hidden tests compare with PyTorch over
more cases and 300 optimiser steps.
"""
import math

import numpy as np

from refmath.losses import cross_entropy_backward, cross_entropy_forward
from refmath.optim import Adam, AdamW, warmup_cosine


def test_uniform_logits_give_log_v():
    loss, _ = cross_entropy_forward(np.zeros((3, 4)), np.array([0, 1, 2]))
    assert math.isclose(float(loss), math.log(4))


def test_ignored_tokens_are_left_out():
    logits = np.array([[0.0, 0.0], [5.0, -5.0]])
    loss, _ = cross_entropy_forward(logits, np.array([0, -100]))
    assert math.isclose(float(loss), math.log(2))


def test_backward_matches_central_differences():
    rng = np.random.default_rng(0)
    z, targets = rng.standard_normal((4, 5)), np.array([1, -100, 3, 0])
    _, cache = cross_entropy_forward(z, targets, label_smoothing=0.1)
    grad = cross_entropy_backward(np.float64(1.0), cache)
    numeric = np.zeros_like(z)
    for i in np.ndindex(z.shape):
        plus, minus = z.copy(), z.copy()
        plus[i] += 1e-6
        minus[i] -= 1e-6
        numeric[i] = (float(cross_entropy_forward(plus, targets, label_smoothing=0.1)[0])
                      - float(cross_entropy_forward(minus, targets, label_smoothing=0.1)[0])) / 2e-6
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-9)


def test_first_adam_step_moves_by_lr():
    # after bias correction, the first step is lr * g / (|g| + eps): lr in the direction of -g
    params = {"w": np.array([1.0, -2.0])}
    Adam(lr=0.1).step(params, {"w": np.array([3.0, -0.5])})
    np.testing.assert_allclose(params["w"], [0.9, -1.9], rtol=1e-6)


def test_adamw_decays_without_gradient():
    params = {"w": np.array([2.0])}
    AdamW(lr=0.1, weight_decay=0.5).step(params, {"w": np.array([0.0])})
    np.testing.assert_allclose(params["w"], [2.0 * (1 - 0.1 * 0.5)])


def test_schedule_corners():
    assert warmup_cosine(0, 1.0, 10, 110) == 0.0
    assert math.isclose(warmup_cosine(10, 1.0, 10, 110), 1.0)
    assert math.isclose(warmup_cosine(60, 1.0, 10, 110, 0.2), 0.6)
    assert warmup_cosine(200, 1.0, 10, 110, 0.2) == 0.2
