"""The mixture-of-experts ops (catalogue E1-E7): the worked example, the selection rules, the
gradient's structure, the auxiliary losses, the bias update, NaN and bad input.

The gradients themselves are checked for every registered case (``moe_router``, ``moe_route``,
``moe_*_loss``, ``moe``) by tests/test_gradcheck.py and tests/test_torch_oracle.py, and against
transformers' own MoE blocks by tests/test_moe_torch.py.
"""
import math

import numpy as np
import pytest

from refmath.ffn import swiglu_forward
from refmath.gradcheck import check_param_gradients
from refmath.moe import (_REACH, MoEConfig, _draw_with_margin, _moe_inputs, _required_margin,
                         balance_bias_update, device_balance_loss, expert_balance_loss,
                         expert_load, moe_backward, moe_forward, moe_param_shapes, route,
                         route_backward, router_scores, router_z_loss, routing_margin)
from refmath.softmax import softmax_forward

# ---- E7: the worked example ----------------------------------------------------------------------

# Four tokens, four experts, top-2. Each row of exp(logits) sums to 8, so the softmax is
# exp(logits) / 8: row 0 is (4, 2, 1, 1) / 8 = (1/2, 1/4, 1/8, 1/8), and so on.
WORKED_LOGITS = np.log(np.array([[4.0, 2.0, 1.0, 1.0],
                                 [1.0, 1.0, 2.0, 4.0],
                                 [1.0, 3.0, 3.0, 1.0],
                                 [2.0, 2.0, 2.0, 2.0]]))
WORKED_PROBS = np.array([[4, 2, 1, 1], [1, 1, 2, 4], [1, 3, 3, 1], [2, 2, 2, 2]]) / 8.0


def test_e7_worked_example_top2_of_4_experts():
    # The router is the identity here (x = logits, W_r = I), so the scores are the softmax above.
    logits, probs, _ = router_scores(WORKED_LOGITS, np.eye(4), "softmax")
    np.testing.assert_allclose(probs, WORKED_PROBS, rtol=1e-15)
    mixtral = MoEConfig(n_experts=4, top_k=2, d_expert=1, norm_topk=True)
    indices, gates, _ = route(probs, mixtral)
    # Token 0: 1/2 and 1/4 win, renormalised by their sum 3/4 to (2/3, 1/3). Token 1: experts 3
    # and 2, the same gates. Token 2: 3/8 and 3/8, the two equal logits give equal scores, and the
    # lower index comes first: (1, 2), gates (1/2, 1/2). Token 3: a four-way tie; experts 0 and 1.
    np.testing.assert_array_equal(indices, [[0, 1], [3, 2], [1, 2], [0, 1]])
    np.testing.assert_allclose(gates, [[2 / 3, 1 / 3], [2 / 3, 1 / 3], [0.5, 0.5], [0.5, 0.5]],
                               rtol=1e-15)
    # Without renormalisation (Qwen2-MoE's default) the gates are the probabilities themselves.
    _, plain, _ = route(probs, MoEConfig(n_experts=4, top_k=2, d_expert=1))
    np.testing.assert_allclose(plain, [[1 / 2, 1 / 4], [1 / 2, 1 / 4], [3 / 8, 3 / 8],
                                       [1 / 4, 1 / 4]], rtol=1e-15)

    # Load: expert 0 gets tokens 0 and 3, expert 1 tokens 0, 2, 3, expert 2 tokens 1, 2, expert 3
    # token 1: (2, 3, 2, 1), N k = 8 in all.
    load = expert_load(indices, 4)
    np.testing.assert_array_equal(load, [2, 3, 2, 1])
    # f = E / (k N) load = (4 / 8) load = (1, 3/2, 1, 1/2). Every column of the probabilities
    # sums to 1, so P = (1/4, 1/4, 1/4, 1/4), and L_ExpBal = sum f / 4 = 4 / 4 = 1: an even
    # spread of probability makes the loss 1 whatever the load.
    loss, _ = expert_balance_loss(probs, load, 2)
    assert loss == pytest.approx(1.0, rel=1e-15)
    # Two devices {0, 1}, {2, 3}: f' = (5/4, 3/4), P' = (1/2, 1/2), L_DevBal = 5/8 + 3/8 = 1.
    loss, _ = device_balance_loss(probs, load, 2, 2)
    assert loss == pytest.approx(1.0, rel=1e-15)
    # Each row's logsumexp is ln 8 = 3 ln 2, so the z-loss is 9 (ln 2)^2.
    z, _ = router_z_loss(logits)
    assert z == pytest.approx(9 * math.log(2.0) ** 2, rel=1e-15)
    # Auxiliary-loss-free balancing, mean load 2: expert 1 (3) is overloaded and loses 0.001,
    # expert 3 (1) is underloaded and gains it, experts 0 and 2 sit at the mean and keep theirs.
    np.testing.assert_array_equal(balance_bias_update(np.zeros(4), load, 0.001),
                                  [0.0, -0.001, 0.0, 0.001])


def test_e7_groups_and_the_bias_on_the_worked_example():
    probs = WORKED_PROBS
    # Experts {0, 1} and {2, 3} are two groups, one kept per token. Token 2's groups tie at their
    # best score 3/8, so the lower group wins: experts 1 and 0 (3/8 and 1/8, renormalised to
    # 3/4 and 1/4), where greedy routing took experts 1 and 2.
    grouped = MoEConfig(n_experts=4, top_k=2, d_expert=1, routing="group_limited_greedy",
                        n_groups=2, topk_groups=1, norm_topk=True)
    indices, gates, _ = route(probs, grouped)
    np.testing.assert_array_equal(indices, [[0, 1], [3, 2], [1, 0], [0, 1]])
    np.testing.assert_allclose(gates[2], [3 / 4, 1 / 4], rtol=1e-15)
    # noaux_tc ranks groups by the sum of their two best: token 2's are 1/8 + 3/8 = 1/2 each, a tie
    # again. A bias of 0.3 on expert 2 lifts group {2, 3} to 0.8 and its expert 2 to 0.675: the
    # token now takes experts 2 and 3, and the gates are their unbiased scores 3/8 and 1/8,
    # renormalised to (3/4, 1/4): the bias picks, it never weights.
    biased = MoEConfig(n_experts=4, top_k=2, d_expert=1, routing="noaux_tc", n_groups=2,
                       topk_groups=1, norm_topk=True, score_bias=True)
    indices, gates, _ = route(probs, biased, bias=np.array([0.0, 0.0, 0.3, 0.0]))
    np.testing.assert_array_equal(indices[2], [2, 3])
    np.testing.assert_allclose(gates[2], [3 / 4, 1 / 4], rtol=1e-15)
    np.testing.assert_array_equal(indices[[0, 1, 3]], [[0, 1], [2, 3], [2, 3]])


# ---- E2: the selection ---------------------------------------------------------------------------

def test_e2_ties_go_to_the_lower_index():
    scores = np.array([[0.2, 0.3, 0.3, 0.2]])
    for k, expected in ((1, [1]), (2, [1, 2]), (3, [1, 2, 0]), (4, [1, 2, 0, 3])):
        indices, _, _ = route(scores, MoEConfig(n_experts=4, top_k=k, d_expert=1))
        np.testing.assert_array_equal(indices, [expected])
    # the groups {0, 1} and {2, 3} tie on their best (0.3): the lower group is kept
    grouped = MoEConfig(n_experts=4, top_k=2, d_expert=1, routing="group_limited_greedy",
                        n_groups=2, topk_groups=1)
    np.testing.assert_array_equal(route(scores, grouped)[0], [[1, 0]])


@pytest.mark.parametrize("routing", ["group_limited_greedy", "noaux_tc"])
def test_e2_grouped_routing_chooses_only_from_the_kept_groups(routing):
    rng = np.random.default_rng(0)
    moe = MoEConfig(n_experts=12, top_k=3, d_expert=1, routing=routing, n_groups=4,
                    topk_groups=2, scoring="sigmoid", score_bias=routing == "noaux_tc")
    scores = rng.uniform(size=(50, 12))
    bias = 0.2 * rng.standard_normal(12) if moe.score_bias else None
    indices, _, _ = route(scores, moe, bias)
    choice = (scores + (0.0 if bias is None else bias)).reshape(50, 4, 3)
    # each group's value computed here from its definition, then the two best groups per token
    value = (choice.max(-1) if routing == "group_limited_greedy"
             else np.sort(choice, -1)[..., 1:].sum(-1))
    kept = np.argsort(-value, axis=-1)[:, :2]
    assert all(set(row // 3) <= set(k) for row, k in zip(indices, kept))
    # and within them the best three choice scores, by brute force over the six kept experts
    for n in range(50):
        allowed = np.concatenate([np.arange(3 * g, 3 * g + 3) for g in kept[n]])
        best = allowed[np.argsort(-choice.reshape(50, 12)[n, allowed])[:3]]
        assert set(indices[n]) == set(best)


def test_e2_the_margin_helper_draws_inputs_whose_selection_survives_the_stencil():
    """The registered cases draw inputs whose routing_margin beats the stencil's reach; moving
    any one entry of x, the router weight or the bias by +-4 h then changes no expert's set of
    tokens (checked here by moving every entry)."""
    moe = MoEConfig(n_experts=8, top_k=2, d_expert=4, scoring="sigmoid", routing="noaux_tc",
                    n_groups=4, topk_groups=2, norm_topk=True, score_bias=True)
    inputs = _moe_inputs(moe, (2, 3, 8))(np.random.default_rng(0))
    x, w, bias = inputs["x"].reshape(6, 8), inputs["router.w"], inputs["router.bias"]
    largest = max(np.abs(x).max(), np.abs(w).max())
    assert routing_margin(router_scores(x, w, "sigmoid")[1], moe, bias) > _required_margin(largest)

    def chosen(x, w, bias):
        return np.sort(route(router_scores(x, w, "sigmoid")[1], moe, bias)[0], axis=-1)

    reference = chosen(x, w, bias)
    for array in (x, w, bias):
        for i in range(array.size):
            for step in (-_REACH, _REACH):
                saved = array.flat[i]
                array.flat[i] = saved + step
                np.testing.assert_array_equal(chosen(x, w, bias), reference)
                array.flat[i] = saved
    with pytest.raises(RuntimeError, match="routing margin"):
        _draw_with_margin(np.random.default_rng(0), lambda rng: {}, lambda _: (0.0, 1.0), tries=3)


# ---- E3: the gates and their gradient ------------------------------------------------------------

def test_e3_unchosen_experts_get_exactly_zero_gradient():
    rng = np.random.default_rng(1)
    scores = softmax_forward(rng.standard_normal((7, 8)))[0]
    for moe in (MoEConfig(n_experts=8, top_k=3, d_expert=1),
                MoEConfig(n_experts=8, top_k=3, d_expert=1, norm_topk=True, scaling=2.0)):
        indices, gates, cache = route(scores, moe)
        dscores = route_backward(rng.standard_normal(gates.shape), cache)
        chosen = np.zeros_like(dscores, dtype=bool)
        np.put_along_axis(chosen, indices, True, axis=1)
        assert not dscores[~chosen].any() and dscores[chosen].all()


def test_e3_renormalised_gates_sum_to_the_scaling_so_a_uniform_gradient_vanishes():
    # sum_j g_j = rho for every score vector: its derivative is 0, i.e. route_backward of a
    # gradient that is the same for every gate gives ds = (rho c / D)(1 - sum_j s_j / D) = 0.
    rng = np.random.default_rng(2)
    scores = softmax_forward(rng.standard_normal((5, 8)))[0]
    _, gates, cache = route(scores, MoEConfig(n_experts=8, top_k=3, d_expert=1, norm_topk=True,
                                              scaling=2.5))
    np.testing.assert_allclose(gates.sum(-1), 2.5, rtol=1e-15)
    dscores = route_backward(np.full(gates.shape, 0.7), cache)
    assert np.abs(dscores).max() < 1e-14
    # without renormalisation it is rho times the upstream gradient at the chosen experts
    indices, _, cache = route(scores, MoEConfig(n_experts=8, top_k=3, d_expert=1, scaling=2.5))
    np.testing.assert_array_equal(np.take_along_axis(route_backward(np.ones((5, 3)), cache),
                                                     indices, 1), 2.5)


def test_e3_sigmoid_renormalisation_adds_transformers_guard():
    # DeepSeek-V3's 1e-20: chosen sigmoid scores that underflow to 0 give gates of 0, not NaN
    moe = MoEConfig(n_experts=4, top_k=2, d_expert=1, scoring="sigmoid", norm_topk=True)
    _, scores, _ = router_scores(np.array([[-800.0, -900.0, -1000.0, -1100.0]]), np.eye(4),
                                 "sigmoid")
    _, gates, _ = route(scores, moe)
    np.testing.assert_array_equal(gates, [[0.0, 0.0]])


# ---- E4: the layer -------------------------------------------------------------------------------

FAMILIES = {
    "mixtral": MoEConfig(n_experts=8, top_k=2, d_expert=6, norm_topk=True),
    "qwen2_moe": MoEConfig(n_experts=8, top_k=2, d_expert=4, d_shared=6, shared_gate=True,
                           balance_coef=0.1, z_coef=0.01),
    "deepseek_v2": MoEConfig(n_experts=8, top_k=3, d_expert=4, routing="group_limited_greedy",
                             n_groups=4, topk_groups=2, n_shared=2, scaling=2.0,
                             balance_coef=0.05, device_balance_coef=0.05, n_devices=4),
    "deepseek_v3": MoEConfig(n_experts=8, top_k=2, d_expert=4, scoring="sigmoid",
                             routing="noaux_tc", n_groups=4, topk_groups=2, norm_topk=True,
                             scaling=2.5, n_shared=1, score_bias=True, balance_coef=0.1),
}


def _layer_inputs(moe, shape=(2, 3, 8), seed=0):
    inputs = _moe_inputs(moe, shape)(np.random.default_rng(seed))
    inputs.pop("config")
    return inputs.pop("x"), inputs


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_e4_output_is_each_tokens_gated_sum_of_its_experts(family):
    """An independent statement of E4, token by token with refmath.ffn.swiglu_forward."""
    moe = FAMILIES[family]
    x, params = _layer_inputs(moe)
    y, cache = moe_forward(x, params, moe)
    rows = x.reshape(-1, 8)
    for n, row in enumerate(rows):
        expected = np.zeros(8)
        for e, g in zip(cache.indices[n], cache.gates[n]):
            expert = [params[f"experts.{name}"][e] for name in ("w_gate", "w_up", "w_down")]
            expected += g * swiglu_forward(row, *expert)[0]
        if moe.shared_width:
            shared = swiglu_forward(row, params["shared.w_gate"], params["shared.w_up"],
                                    params["shared.w_down"])[0]
            if moe.shared_gate:
                shared = shared / (1.0 + np.exp(-row @ params["shared_gate.w"]))
            expected += shared
        np.testing.assert_allclose(y.reshape(-1, 8)[n], expected, rtol=1e-13, atol=1e-15)
    # the load counts the tokens of each expert: N k in all
    np.testing.assert_array_equal(cache.load, np.bincount(cache.indices.ravel(), minlength=8))
    assert cache.load.sum() == rows.shape[0] * moe.top_k


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v2", "deepseek_v3"])
def test_e4_the_backward_includes_the_aux_loss_gradient(family):
    """With no gradient from the output (dy = 0) moe_backward is the gradient of cache.aux_loss
    alone: the router weight's matches central differences of the aux loss, the experts' are 0."""
    moe = FAMILIES[family]
    x, params = _layer_inputs(moe)
    y, cache = moe_forward(x, params, moe)
    assert cache.aux_loss > 0
    dx, grads = moe_backward(np.zeros_like(y), cache)
    router = {"router.w": params["router.w"]}  # checked in place: the loss reads it afresh

    def aux_loss(p):
        return float(moe_forward(x, {**params, **p}, moe)[1].aux_loss)

    result = check_param_gradients(aux_loss, {"router.w": grads["router.w"]}, router,
                                   max_coords=None)
    assert result.passed, (result.errors, result.bound)
    for name in ("experts.w_gate", "experts.w_up", "experts.w_down"):
        assert not grads[name].any()
    # daux scales it: twice the aux loss, twice the gradient
    _, doubled = moe_backward(np.zeros_like(y), cache, daux=2.0)
    np.testing.assert_allclose(doubled["router.w"], 2.0 * grads["router.w"], rtol=1e-15)


def test_e4_router_bias_gets_a_zero_gradient_and_steers_only_the_choice():
    moe = FAMILIES["deepseek_v3"]
    x, params = _layer_inputs(moe)
    y, cache = moe_forward(x, params, moe)
    _, grads = moe_backward(np.ones_like(y), cache)
    np.testing.assert_array_equal(grads["router.bias"], np.zeros(8))
    assert list(grads) == list(moe_param_shapes(8, moe))
    # the gates are the unbiased scores of the chosen experts, renormalised and scaled
    scores = 1.0 / (1.0 + np.exp(-x.reshape(-1, 8) @ params["router.w"]))
    chosen = np.take_along_axis(scores, cache.indices, 1)
    np.testing.assert_allclose(cache.gates, 2.5 * chosen / chosen.sum(-1, keepdims=True),
                               rtol=1e-14)


# ---- E5: the auxiliary losses --------------------------------------------------------------------

def test_e5_device_balance_at_one_device_is_one_and_at_e_devices_the_expert_loss():
    rng = np.random.default_rng(3)
    probs = softmax_forward(rng.standard_normal((9, 8)))[0]
    indices, _, _ = route(probs, MoEConfig(n_experts=8, top_k=2, d_expert=1))
    load = expert_load(indices, 8)
    # one device: f' = mean f = (E / (k N)) (N k) / E = 1 and P' = sum_i P_i = 1
    assert device_balance_loss(probs, load, 2, 1)[0] == pytest.approx(1.0, rel=1e-15)
    assert (device_balance_loss(probs, load, 2, 8)[0]
            == pytest.approx(expert_balance_loss(probs, load, 2)[0], rel=1e-15))


def test_e5_sigmoid_scores_are_normalised_per_token_for_the_balance_loss():
    moe = FAMILIES["deepseek_v3"]
    x, params = _layer_inputs(moe)
    _, cache = moe_forward(x, params, moe)
    scores = 1.0 / (1.0 + np.exp(-x.reshape(-1, 8) @ params["router.w"]))
    expected, _ = expert_balance_loss(scores / scores.sum(-1, keepdims=True), cache.load, 2)
    assert cache.aux_loss == pytest.approx(0.1 * expected, rel=1e-14)


def test_e5_z_loss_of_equal_logits_is_the_square_of_their_logsumexp():
    # E equal logits c: logsumexp = c + ln E
    logits = np.full((3, 8), 0.5)
    assert router_z_loss(logits)[0] == pytest.approx((0.5 + math.log(8.0)) ** 2, rel=1e-15)


# ---- E6: the auxiliary-loss-free bias update -----------------------------------------------------

def test_e6_bias_update_moves_against_the_load_and_keeps_the_dtype():
    bias = np.array([0.5, -0.25, 0.0, 0.125], dtype=np.float32)
    new = balance_bias_update(bias, np.array([10.0, 2.0, 4.0, 0.0]), 0.01)  # mean 4
    assert new.dtype == np.float32
    np.testing.assert_array_equal(new, bias - np.float32(0.01) * np.array([1, -1, 0, -1],
                                                                           dtype=np.float32))
    np.testing.assert_array_equal(balance_bias_update(bias, np.full(4, 3.0), 1.0), bias)
    assert np.isnan(balance_bias_update(bias, np.full(4, np.nan), 0.01)).all()


# ---- NaN: never a silent choice ------------------------------------------------------------------

def test_a_nan_score_gives_nan_gates_and_never_a_silent_choice():
    """torch.topk ranks a NaN above every number, so transformers would route the token to its
    NaN experts with finite-looking bookkeeping; here its gates and gradient are NaN instead."""
    rng = np.random.default_rng(4)
    scores = softmax_forward(rng.standard_normal((4, 8)))[0]
    moe = MoEConfig(n_experts=8, top_k=2, d_expert=1, norm_topk=True)
    _, clean, _ = route(scores, moe)
    scores[2, 5] = np.nan
    indices, gates, cache = route(scores, moe)
    assert np.isnan(gates[2]).all() and np.isfinite(gates[[0, 1, 3]]).all()
    np.testing.assert_array_equal(gates[[0, 1, 3]], clean[[0, 1, 3]])
    dscores = route_backward(np.ones_like(gates), cache)
    assert np.isnan(dscores[2]).all() and np.isfinite(dscores[[0, 1, 3]]).all()
    assert np.isnan(expert_load(indices, 8, cache.invalid)).all()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_nan_token_poisons_its_output_every_expert_and_the_load(family):
    moe = FAMILIES[family]
    x, params = _layer_inputs(moe, shape=(6, 8))
    y_clean, _ = moe_forward(x, params, moe)
    x[4, 3] = np.nan
    y, cache = moe_forward(x, params, moe)
    assert np.isnan(y[4]).all()
    np.testing.assert_allclose(np.delete(y, 4, 0), np.delete(y_clean, 4, 0), rtol=1e-14)
    assert np.isnan(cache.load).all()
    assert np.isnan(cache.aux_loss) == bool(moe.balance_coef or moe.z_coef)
    dx, grads = moe_backward(np.ones_like(y), cache)
    for name in ("router.w", "experts.w_gate", "experts.w_up", "experts.w_down"):
        assert np.isnan(grads[name]).all(), name  # every expert might have had the token
    # the other tokens' gradients depend on this one only through a balance loss's load
    others = np.delete(dx, 4, 0)
    if moe.balance_coef:
        assert np.isnan(others).all()
    else:
        assert np.isfinite(others).all()


# ---- bad input -----------------------------------------------------------------------------------

def test_bad_parameters_are_named_with_their_shapes():
    moe = FAMILIES["deepseek_v3"]
    x, params = _layer_inputs(moe)
    with pytest.raises(ValueError, match=r"params\['router.w'\] must have shape \(d, n_experts\) "
                                         r"= \(8, 8\).*got params\['router.w'\].shape = \(7, 8\)"):
        moe_forward(x, {**params, "router.w": params["router.w"][:7]}, moe)
    with pytest.raises(ValueError, match=r"params\['experts.w_down'\].*\(8, 4, 8\).*\(8, 5, 8\)"):
        moe_forward(x, {**params, "experts.w_down": np.zeros((8, 5, 8))}, moe)
    with pytest.raises(ValueError, match=r"params\['router.bias'\].*\(8,\).*\(7,\)"):
        moe_forward(x, {**params, "router.bias": np.zeros(7)}, moe)
    missing = dict(params)
    del missing["shared.w_up"]
    with pytest.raises(ValueError, match=r"missing \['shared.w_up'\]"):
        moe_forward(x, missing, moe)
    with pytest.raises(ValueError, match=r"unexpected \['shared_gate.w'\]"):
        moe_forward(x, {**params, "shared_gate.w": np.zeros((8, 1))}, moe)
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        moe_forward(np.ones((2, 8), dtype=np.int64), params, moe)
    with pytest.raises(TypeError, match="moe must be a MoEConfig"):
        moe_forward(x, params, None)


def test_bad_routing_input_is_named_with_its_shape():
    moe = MoEConfig(n_experts=4, top_k=2, d_expert=1)
    with pytest.raises(ValueError, match=r"scores.shape\[1\] must be 4 to match moe.n_experts"):
        route(np.ones((3, 5)), moe)
    with pytest.raises(ValueError, match="scores must have 2 dimensions"):
        route(np.ones(4), moe)
    with pytest.raises(ValueError, match="bias is given.*score_bias is False"):
        route(np.ones((3, 4)), moe, bias=np.zeros(4))
    biased = MoEConfig(n_experts=4, top_k=2, d_expert=1, score_bias=True)
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\).*got bias.shape = \(3,\)"):
        route(np.ones((3, 4)), biased, bias=np.zeros(3))
    with pytest.raises(ValueError, match="bias is None, but moe.score_bias is set"):
        route(np.ones((3, 4)), biased)
    with pytest.raises(ValueError, match=r"w.shape\[0\] must be 3 to match x.shape = \(2, 3\)"):
        router_scores(np.ones((2, 3)), np.ones((4, 4)))
    with pytest.raises(ValueError, match="scoring must be one of"):
        router_scores(np.ones((2, 3)), np.ones((3, 4)), "relu")


def test_bad_loss_and_update_input_is_named():
    probs = np.full((3, 4), 0.25)
    with pytest.raises(ValueError, match=r"load must have shape \(4,\).*\(5,\)"):
        expert_balance_loss(probs, np.ones(5), 2)
    with pytest.raises(ValueError, match="top_k must be an int in"):
        expert_balance_loss(probs, np.ones(4), 5)
    with pytest.raises(ValueError, match="n_devices = 3 does not divide the 4 experts"):
        device_balance_loss(probs, np.ones(4), 2, 3)
    with pytest.raises(ValueError, match="probs has no tokens"):
        expert_balance_loss(np.ones((0, 4)), np.ones(4), 2)
    with pytest.raises(ValueError, match="logits must have 2 dimensions"):
        router_z_loss(np.ones(4))
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 4\)"):
        expert_load(np.array([[0, 4]]), 4)
    with pytest.raises(ValueError, match="load must have the shape of bias"):
        balance_bias_update(np.zeros(4), np.ones(3), 0.1)
    with pytest.raises(ValueError, match="speed must be a finite number >= 0"):
        balance_bias_update(np.zeros(4), np.ones(4), -0.1)
