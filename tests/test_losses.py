import math

import numpy as np
import pytest

from refmath.losses import cross_entropy_backward, cross_entropy_forward


def _softmax(z):
    # the plain textbook formula; fine for the moderate logits used here
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def test_loss_is_the_mean_negative_log_probability_of_the_targets_l2():
    rng = np.random.default_rng(0)
    logits, targets = rng.standard_normal((6, 5)), np.array([0, 4, 2, 2, 1, 3])
    loss, _ = cross_entropy_forward(logits, targets)
    p = _softmax(logits)
    expected = -np.mean(np.log(p[np.arange(6), targets]))
    np.testing.assert_allclose(loss, expected, rtol=1e-14)
    assert loss.shape == () and loss.dtype == np.float64


def test_uniform_logits_give_log_v():
    for smoothing in (0.0, 0.1):
        loss, _ = cross_entropy_forward(np.full((3, 7), 2.5), np.array([0, 3, 6]), label_smoothing=smoothing)
        np.testing.assert_allclose(loss, math.log(7), rtol=1e-15)


def test_gradient_is_p_minus_onehot_over_n_l3():
    rng = np.random.default_rng(1)
    logits, targets = rng.standard_normal((2, 3, 5)), np.array([[1, 0, 4], [4, 4, 2]])
    loss, cache = cross_entropy_forward(logits, targets)
    dlogits = cross_entropy_backward(np.array(1.0), cache)
    onehot = np.eye(5)[targets]
    np.testing.assert_allclose(dlogits, (_softmax(logits) - onehot) / 6, rtol=1e-13, atol=1e-17)
    # the scalar upstream gradient scales it
    np.testing.assert_allclose(cross_entropy_backward(np.array(-2.0), cache), -2 * dlogits, rtol=1e-15)


def test_3d_logits_equal_the_flattened_rows():
    rng = np.random.default_rng(2)
    logits, targets = rng.standard_normal((2, 4, 6)), rng.integers(0, 6, size=(2, 4))
    loss3, cache3 = cross_entropy_forward(logits, targets, label_smoothing=0.1)
    loss2, cache2 = cross_entropy_forward(logits.reshape(8, 6), targets.reshape(8), label_smoothing=0.1)
    np.testing.assert_allclose(loss3, loss2, rtol=1e-15)
    np.testing.assert_allclose(cross_entropy_backward(np.array(1.0), cache3).reshape(8, 6),
                               cross_entropy_backward(np.array(1.0), cache2), rtol=1e-15)


def test_sft_loss_counts_answer_tokens_only_l5():
    # one sequence of 7 targets: the first 4 belong to the prompt, the last 3 to the answer
    rng = np.random.default_rng(3)
    logits, targets = rng.standard_normal((7, 6)), np.array([5, 1, 0, 3, 2, 2, 4])
    answer = np.array([0, 0, 0, 0, 1, 1, 1])
    loss, cache = cross_entropy_forward(logits, targets, loss_mask=answer)
    logp = np.log(_softmax(logits))[np.arange(7), targets]
    # L5 is the sum over answer tokens; the function returns its mean over the 3 answer tokens
    np.testing.assert_allclose(loss * cache.n_counted, -logp[4:].sum(), rtol=1e-14)
    assert cache.n_counted == 3
    dlogits = cross_entropy_backward(np.array(1.0), cache)
    np.testing.assert_array_equal(dlogits[:4], 0.0)
    np.testing.assert_allclose(dlogits[4:], (_softmax(logits[4:]) - np.eye(6)[targets[4:]]) / 3, rtol=1e-13)
    # the prompt's logits do not matter at all
    changed = logits.copy()
    changed[:4] = 100.0 * rng.standard_normal((4, 6))
    np.testing.assert_array_equal(cross_entropy_forward(changed, targets, loss_mask=answer)[0], loss)
    # marking the prompt targets with ignore_index is the same thing
    ignored = np.where(answer == 1, targets, -100)
    loss_i, cache_i = cross_entropy_forward(logits, ignored)
    np.testing.assert_array_equal(loss_i, loss)
    np.testing.assert_array_equal(cross_entropy_backward(np.array(1.0), cache_i), dlogits)


def test_sum_reduction_is_the_catalogue_sft_loss_and_its_gradient_is_p_minus_y_l5():
    # L5 as written: -sum of log p over the answer tokens, no division by their number
    rng = np.random.default_rng(6)
    logits, targets = rng.standard_normal((7, 6)), np.array([5, 1, 0, 3, 2, 2, 4])
    answer = np.array([0, 0, 0, 0, 1, 1, 1])
    total, cache = cross_entropy_forward(logits, targets, loss_mask=answer, reduction="sum")
    logp = np.log(_softmax(logits))[np.arange(7), targets]
    np.testing.assert_allclose(total, -logp[4:].sum(), rtol=1e-14)
    mean, _ = cross_entropy_forward(logits, targets, loss_mask=answer)
    np.testing.assert_allclose(total, 3 * mean, rtol=1e-14)
    dlogits = cross_entropy_backward(np.array(1.0), cache)
    np.testing.assert_array_equal(dlogits[:4], 0.0)
    np.testing.assert_allclose(dlogits[4:], _softmax(logits[4:]) - np.eye(6)[targets[4:]], rtol=1e-13,
                               atol=1e-17)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_both_reductions_match_central_differences(reduction, smoothing):
    rng = np.random.default_rng(7)
    logits, targets = rng.standard_normal((2, 3, 5)), np.array([[1, -100, 4], [0, 3, 3]])
    mask = np.array([[1, 1, 1], [0, 1, 1]])

    def loss(z):
        return float(cross_entropy_forward(z, targets, loss_mask=mask, label_smoothing=smoothing,
                                           reduction=reduction)[0])

    _, cache = cross_entropy_forward(logits, targets, loss_mask=mask, label_smoothing=smoothing,
                                     reduction=reduction)
    analytic = cross_entropy_backward(np.array(0.7), cache)
    numeric = np.zeros_like(logits)
    h = 1e-6
    for index in np.ndindex(logits.shape):
        up, down = logits.copy(), logits.copy()
        up[index] += h
        down[index] -= h
        numeric[index] = 0.7 * (loss(up) - loss(down)) / (2 * h)
    # central differences on losses of size ~1: truncation ~h^2, rounding ~1e-16/h = 1e-10
    np.testing.assert_allclose(analytic, numeric, rtol=0, atol=1e-9)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_both_reductions_equal_torch(reduction):
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle; install the 'oracle' extra")
    rng = np.random.default_rng(8)
    logits, targets = rng.standard_normal((6, 5)), np.array([1, -100, 4, 0, 3, 3])
    loss, cache = cross_entropy_forward(logits, targets, label_smoothing=0.1, reduction=reduction)
    z = torch.from_numpy(logits.copy()).requires_grad_(True)
    expected = torch.nn.functional.cross_entropy(z, torch.from_numpy(targets), label_smoothing=0.1,
                                                 reduction=reduction)
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-14)
    np.testing.assert_allclose(cross_entropy_backward(np.array(1.0), cache), z.grad.numpy(),
                               rtol=1e-12, atol=1e-16)


def test_ignore_index_excludes_tokens_from_the_mean_and_the_gradient():
    rng = np.random.default_rng(4)
    logits, targets = rng.standard_normal((5, 4)), np.array([1, 7, 3, 7, 0])
    loss, cache = cross_entropy_forward(logits, targets, ignore_index=7)
    kept = np.array([0, 2, 4])
    expected, _ = cross_entropy_forward(logits[kept], targets[kept])
    np.testing.assert_allclose(loss, expected, rtol=1e-15)
    dlogits = cross_entropy_backward(np.array(1.0), cache)
    np.testing.assert_array_equal(dlogits[[1, 3]], 0.0)
    np.testing.assert_allclose(dlogits[kept], (_softmax(logits[kept]) - np.eye(4)[targets[kept]]) / 3,
                               rtol=1e-13)


def test_label_smoothing_target_distribution_l4():
    # with one token and dout = 1 the gradient is p - q, so q = p - gradient
    logits, eps, vocab = np.array([[0.3, -1.2, 2.0, 0.1, 0.7]]), 0.1, 5
    loss, cache = cross_entropy_forward(logits, np.array([2]), label_smoothing=eps)
    p = _softmax(logits)
    q = p - cross_entropy_backward(np.array(1.0), cache)
    expected_q = np.array([[0.02, 0.02, 0.92, 0.02, 0.02]])  # (1 - eps) onehot + eps / V
    np.testing.assert_allclose(q, expected_q, rtol=1e-13)
    np.testing.assert_allclose(loss, -np.sum(expected_q * np.log(p)), rtol=1e-14)
    # spreading eps_ls over the V - 1 other classes only is label_smoothing = eps_ls V / (V - 1)
    _, cache = cross_entropy_forward(logits, np.array([2]), label_smoothing=eps * vocab / (vocab - 1))
    q = p - cross_entropy_backward(np.array(1.0), cache)
    np.testing.assert_allclose(q, [[0.025, 0.025, 0.9, 0.025, 0.025]], rtol=1e-13)


def test_no_counted_token_gives_zero_loss_and_zero_gradient():
    logits = np.random.default_rng(5).standard_normal((2, 3, 4)).astype(np.float32)
    cases = [dict(targets=np.full((2, 3), -100)),
             dict(targets=np.zeros((2, 3), dtype=np.int64), loss_mask=np.zeros((2, 3), dtype=bool))]
    for kwargs in cases:
        with np.errstate(all="raise"):
            loss, cache = cross_entropy_forward(logits, label_smoothing=0.1, **kwargs)
            dlogits = cross_entropy_backward(np.array(1.0, dtype=np.float32), cache)
        assert loss == 0.0 and loss.dtype == np.float32
        assert cross_entropy_forward(logits, reduction="sum", **kwargs)[0] == 0.0
        np.testing.assert_array_equal(dlogits, 0.0)
        assert dlogits.dtype == np.float32


def test_huge_logits_do_not_overflow():
    logits = np.array([[1000.0, 999.0, 0.0], [-1000.0, 5.0, 4.0]])
    with np.errstate(over="raise", invalid="raise"):
        loss, _ = cross_entropy_forward(logits, np.array([1, 2]))
    # both targets sit 1 below their row's maximum, the third entry is e^-1000 ~ 0 relative to it:
    # -log p = log(e^0 + e^-1 + e^-1000) + 1 = 1 + log(1 + e^-1) for each row
    # log-softmax subtracts the row maximum first, so only roundings at magnitude ~1 remain
    np.testing.assert_allclose(loss, 1.0 + math.log1p(math.exp(-1.0)), rtol=4e-16)


def test_bad_inputs_name_the_arguments_and_shapes():
    logits = np.zeros((2, 3, 5))
    with pytest.raises(TypeError, match=r"logits must be a floating-point array, got dtype int64"):
        cross_entropy_forward(np.zeros((2, 5), dtype=np.int64), np.array([0, 1]))
    with pytest.raises(TypeError, match=r"targets must be an integer array, got dtype float64 with shape \(2, 3\)"):
        cross_entropy_forward(logits, np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"targets.shape must equal logits.shape\[:-1\].*\(3, 2\).*\(2, 3, 5\)"):
        cross_entropy_forward(logits, np.zeros((3, 2), dtype=np.int64))
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 5\) or equal ignore_index=-100, got 5..7"):
        cross_entropy_forward(logits, np.array([[0, 5, 7], [1, -100, 2]]))
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 5\).*got -1..-1"):
        cross_entropy_forward(logits, np.array([[0, 1, 2], [3, 4, -1]]))
    targets = np.zeros((2, 3), dtype=np.int64)
    with pytest.raises(ValueError, match=r"loss_mask and targets must have the same shape.*\(3,\).*\(2, 3\)"):
        cross_entropy_forward(logits, targets, loss_mask=np.ones(3))
    with pytest.raises(ValueError, match=r"loss_mask must hold only 0 and 1"):
        cross_entropy_forward(logits, targets, loss_mask=np.full((2, 3), 2))
    with pytest.raises(ValueError, match=r"label_smoothing must be a finite number in \[0, 1\], got 1.5"):
        cross_entropy_forward(logits, targets, label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"reduction must be one of 'mean', 'sum', got 'none'"):
        cross_entropy_forward(logits, targets, reduction="none")
    with pytest.raises(ValueError, match=r"reduction must be one of 'mean', 'sum', got \['sum'\]"):
        cross_entropy_forward(logits, targets, reduction=["sum"])
