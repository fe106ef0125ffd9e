"""Optimisers, clipping and schedules checked against their equations (catalogue O1-O7).

The comparisons with torch.optim live in test_optim_torch.py, which is skipped without torch.
"""
import numpy as np
import pytest

from refmath.optim import (
    SGD,
    Adam,
    AdamW,
    clip_grad_norm,
    takes_weight_decay,
    transformer_schedule,
    warmup_cosine,
)


def _params(rng, dtype=np.float64):
    shapes = {"layers.0.attn.w_q": (4, 4), "layers.0.ln1.gamma": (4,), "layers.0.ffn.b1": (8,),
              "tok_emb": (6, 4)}
    return {name: rng.standard_normal(shape).astype(dtype) for name, shape in shapes.items()}


def _grads(rng, params):
    return {name: rng.standard_normal(p.shape).astype(p.dtype) for name, p in params.items()}


# ---- O1, O2: Adam ----

def test_o2_constant_gradient_gives_exact_corrected_moments():
    g = np.random.default_rng(0).standard_normal(5)
    params = {"w": np.zeros(5)}
    opt = Adam(lr=1e-3)
    for _ in range(200):
        opt.step(params, {"w": g})
        m_hat, v_hat = opt.corrected_moments("w")
        # m_s = (1 - b1^s) g exactly in exact arithmetic; float64 adds a few ulps per step
        np.testing.assert_allclose(m_hat, g, rtol=1e-13)
        np.testing.assert_allclose(v_hat, g * g, rtol=1e-13)


def test_o1_first_steps_follow_the_recurrence():
    # step 1: m_hat = g1, v_hat = g1^2; step 2 from the recurrence written out by hand
    b1, b2, eps, lr = 0.8, 0.95, 1e-3, 0.1
    theta0, g1, g2 = np.array([1.0, -2.0]), np.array([0.5, 3.0]), np.array([-1.0, 1.0])
    params = {"w": theta0.copy()}
    opt = Adam(lr, betas=(b1, b2), eps=eps)
    opt.step(params, {"w": g1})
    theta1 = theta0 - lr * g1 / (np.abs(g1) + eps)
    np.testing.assert_allclose(params["w"], theta1, rtol=1e-15)
    opt.step(params, {"w": g2})
    m2 = b1 * (1 - b1) * g1 + (1 - b1) * g2
    v2 = b2 * (1 - b2) * g1**2 + (1 - b2) * g2**2
    theta2 = theta1 - lr * (m2 / (1 - b1**2)) / (np.sqrt(v2 / (1 - b2**2)) + eps)
    np.testing.assert_allclose(params["w"], theta2, rtol=1e-14)


# ---- O7: L2 vs decoupled decay ----

def test_o7_sgd_l2_is_multiplicative_decay():
    # dyadic numbers: every operation is exact, so the identity holds bit for bit
    lr, lam = 0.5, 0.25
    theta, g = np.array([1.0, -3.0, 0.75]), np.array([0.5, 2.0, -1.25])
    params = {"w": theta.copy()}
    SGD(lr, weight_decay=lam, decay_of=lambda name: lam).step(params, {"w": g})
    np.testing.assert_array_equal(params["w"], theta * (1 - lr * lam) - lr * g)
    # random values, many steps: equal up to rounding
    rng = np.random.default_rng(1)
    lr, lam = 0.03, 0.1
    params = {"w": rng.standard_normal(10)}
    theta = params["w"].copy()
    opt = SGD(lr, weight_decay=lam, decay_of=lambda name: lam)
    for _ in range(50):
        g = rng.standard_normal(10)
        opt.step(params, {"w": g})
        theta = theta * (1 - lr * lam) - lr * g
    np.testing.assert_allclose(params["w"], theta, rtol=1e-13)


def test_o7_adamw_decay_is_exactly_one_minus_lr_wd_on_a_zero_gradient():
    lr, wd = 0.01, 0.1
    theta = np.array([1.0, -2.0, 0.5])
    params = {"w": theta.copy()}
    opt = AdamW(lr, weight_decay=wd, decay_of=lambda name: wd)
    for _ in range(20):
        opt.step(params, {"w": np.zeros(3)})
        theta = theta * (1 - lr * wd)  # m_hat = 0, so the Adam term adds exactly 0
        np.testing.assert_array_equal(params["w"], theta)


def test_o7_adam_with_l2_differs_from_adamw():
    # theta = 1 with zero data gradient, one step. AdamW: theta = 1 - lr*wd = 0.999.
    # Adam + L2: g' = wd*theta = 0.1 enters the moments, m_hat = 0.1, v_hat = 0.01, so the step is
    # lr * 0.1 / (0.1 + eps) ~ lr: the normalisation turns the decay into a step of size ~lr
    # whatever wd is.
    lr, wd, eps = 0.01, 0.1, 1e-8
    decay_all = lambda name: wd  # noqa: E731
    adam, adamw = {"w": np.array([1.0])}, {"w": np.array([1.0])}
    Adam(lr, eps=eps, weight_decay=wd, decay_of=decay_all).step(adam, {"w": np.zeros(1)})
    AdamW(lr, eps=eps, weight_decay=wd, decay_of=decay_all).step(adamw, {"w": np.zeros(1)})
    np.testing.assert_allclose(adamw["w"], [1 - lr * wd], rtol=1e-15)
    np.testing.assert_allclose(adam["w"], [1 - lr * 0.1 / (np.sqrt(0.1**2) + eps)], rtol=1e-15)
    assert abs(adam["w"][0] - adamw["w"][0]) > 0.008
    # with a data gradient too, the two stay apart over a run
    rng = np.random.default_rng(2)
    a = {"w": rng.standard_normal(6)}
    b = {"w": a["w"].copy()}
    opt_a = Adam(lr, weight_decay=wd, decay_of=decay_all)
    opt_b = AdamW(lr, weight_decay=wd, decay_of=decay_all)
    for _ in range(30):
        g = rng.standard_normal(6)
        opt_a.step(a, {"w": g})
        opt_b.step(b, {"w": g})
    assert np.max(np.abs(a["w"] - b["w"])) > 1e-3


# ---- O5: parameter groups ----

@pytest.mark.parametrize("name, decays", [
    ("layers.0.attn.w_q", True), ("layers.3.ffn.w1", True), ("lm_head", True), ("w_o", True),
    ("layers.0.attn.b_q", False), ("layers.0.ffn.b1", False), ("head.b", False),
    ("proj.bias", False), ("layers.0.ln1.gamma", False), ("ln_f.beta", False),
    ("tok_emb", False), ("pos_emb", False), ("embedding.weight", False), ("positions.table", False),
    ("layers.0.beta_w", True), ("layers.0.bw", True),
])
def test_o5_default_rule(name, decays):
    assert takes_weight_decay(name) is decays


def test_o5_groups_choose_the_decay_per_parameter():
    wd, lr = 0.5, 0.1
    names = ["layers.0.attn.w_q", "layers.0.ln1.gamma", "layers.0.ffn.b1", "tok_emb"]
    zero = {n: np.zeros(2) for n in names}

    def run(**kwargs):
        params = {n: np.ones(2) for n in names}
        AdamW(lr, weight_decay=wd, **kwargs).step(params, zero)
        return {n: params[n][0] for n in names}

    shrunk = 1 - lr * wd
    assert run() == {names[0]: shrunk, names[1]: 1.0, names[2]: 1.0, names[3]: 1.0}
    assert run(decay_of=lambda n: wd) == dict.fromkeys(names, shrunk)
    explicit = {names[0]: 0.0, names[1]: wd, names[2]: 0.0, names[3]: 2 * wd}
    assert run(decay_of=explicit) == {names[0]: 1.0, names[1]: shrunk, names[2]: 1.0,
                                      names[3]: 1 - lr * 2 * wd}
    with pytest.raises(ValueError, match=r"decay_of has no weight-decay entry for parameter 'tok_emb'"):
        run(decay_of={n: wd for n in names[:3]})

    class DecayEverything(AdamW):
        def decay_of(self, name):
            return self.weight_decay

    params = {n: np.ones(2) for n in names}
    DecayEverything(lr, weight_decay=wd).step(params, zero)
    assert all(p[0] == shrunk for p in params.values())


# ---- optimiser mechanics ----

def test_lr_override_equals_that_learning_rate():
    rng = np.random.default_rng(3)
    params = _params(rng)
    a, b = {n: p.copy() for n, p in params.items()}, {n: p.copy() for n, p in params.items()}
    opt_a, opt_b = AdamW(1.0, weight_decay=0.1), AdamW(0.02, weight_decay=0.1)
    for _ in range(5):
        grads = _grads(rng, params)
        opt_a.step(a, grads, lr=0.02)
        opt_b.step(b, grads)
    for n in params:
        np.testing.assert_array_equal(a[n], b[n])


@pytest.mark.parametrize("make", [
    lambda: SGD(0.1, momentum=0.9, weight_decay=0.01),
    lambda: Adam(0.01, weight_decay=0.01),
    lambda: AdamW(0.01),
])
def test_state_round_trips_exactly_through_npz(make, tmp_path):
    rng = np.random.default_rng(4)
    params = _params(rng)
    stream = [_grads(rng, params) for _ in range(10)]
    opt = make()
    for grads in stream[:5]:
        opt.step(params, grads)
    np.savez(tmp_path / "ckpt.npz", **opt.state_dict())
    with np.load(tmp_path / "ckpt.npz") as saved:
        restored = make()
        restored.load_state_dict(dict(saved))
    state, again = opt.state_dict(), restored.state_dict()
    assert state.keys() == again.keys() and int(again["step"]) == 5
    for key in state:
        np.testing.assert_array_equal(state[key], again[key])
    copy = {n: p.copy() for n, p in params.items()}
    for grads in stream[5:]:
        opt.step(params, grads)
        restored.step(copy, grads)
    for n in params:
        np.testing.assert_array_equal(params[n], copy[n])


@pytest.mark.parametrize("make", [lambda: SGD(0.1, momentum=0.9), lambda: AdamW(0.01)])
def test_float32_stays_float32(make):
    rng = np.random.default_rng(5)
    params = _params(rng, np.float32)
    opt = make()
    opt.step(params, _grads(rng, params))
    assert all(p.dtype == np.float32 for p in params.values())
    assert all(a.dtype == np.float32 for k, a in opt.state_dict().items() if k != "step")


def test_bad_input_names_the_parameter_and_shapes():
    with pytest.raises(ValueError, match=r"lr must be a finite number >= 0, got -0.1"):
        AdamW(-0.1)
    with pytest.raises(ValueError, match=r"lr must be a finite number >= 0, got -1.0"):
        SGD(0.1).step({"w": np.ones(2)}, {"w": np.ones(2)}, lr=-1.0)
    with pytest.raises(ValueError, match=r"betas\[1\] must be a finite number in \[0, 1\), got 1.0"):
        Adam(0.1, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"betas\[0\] must be a finite number in \[0, 1\), got -0.1"):
        AdamW(0.1, betas=(-0.1, 0.999))
    with pytest.raises(ValueError, match=r"weight_decay must be a finite number >= 0, got -1.0"):
        SGD(0.1, weight_decay=-1.0)
    opt = AdamW(0.1)
    params = {"layers.0.attn.w_q": np.ones((4, 4)), "layers.0.ffn.b1": np.ones(8)}
    missing_b1 = r"grads has no entry for parameter 'layers.0.ffn.b1' \(shape \(8,\)\)"
    with pytest.raises(ValueError, match=missing_b1):
        opt.step(params, {"layers.0.attn.w_q": np.ones((4, 4))})
    with pytest.raises(ValueError, match=r"params\['layers.0.attn.w_q'\].*\(4, 4\).*\(4, 3\)"):
        opt.step(params, {"layers.0.attn.w_q": np.ones((4, 3)), "layers.0.ffn.b1": np.ones(8)})
    with pytest.raises(ValueError, match=r"not parameters: \['stray'\]"):
        opt.step(params, {"layers.0.attn.w_q": np.ones((4, 4)), "layers.0.ffn.b1": np.ones(8),
                          "stray": np.ones(1)})
    with pytest.raises(TypeError, match=r"grads\['layers.0.ffn.b1'\] must be a floating-point array"):
        opt.step(params, {"layers.0.attn.w_q": np.ones((4, 4)), "layers.0.ffn.b1": np.ones(8, int)})
    # the failed calls changed nothing; a new parameter after the first step is refused
    assert opt.step_count == 0 and np.all(params["layers.0.ffn.b1"] == 1)
    opt.step(params, {n: np.ones_like(p) for n, p in params.items()})
    params["extra.w"] = np.ones(3)
    with pytest.raises(ValueError, match=r"stay the same across steps: missing \[\], new \['extra.w'\]"):
        opt.step(params, {n: np.ones_like(p) for n, p in params.items()})
    with pytest.raises(ValueError, match=r"unknown state entry 'q.w'"):
        AdamW(0.1).load_state_dict({"step": np.array(1), "q.w": np.ones(2)})


# ---- clipping ----

def test_clip_grad_norm_scales_to_max_norm():
    rng = np.random.default_rng(6)
    grads = {"a": rng.standard_normal((3, 4)), "b": rng.standard_normal(5)}
    before = {n: g.copy() for n, g in grads.items()}
    norm = np.sqrt(sum(np.sum(g * g) for g in before.values()))
    total = clip_grad_norm(grads, 0.5)
    np.testing.assert_allclose(total, norm, rtol=1e-15)
    for n in grads:
        np.testing.assert_allclose(grads[n], before[n] * 0.5 / (norm + 1e-6), rtol=1e-15)
    clipped = np.sqrt(sum(np.sum(g * g) for g in grads.values()))
    assert clipped < 0.5 and np.isclose(clipped, 0.5, rtol=1e-5)
    # already small enough: untouched, bit for bit
    same = {n: g.copy() for n, g in grads.items()}
    clip_grad_norm(same, 1.0)
    for n in grads:
        np.testing.assert_array_equal(same[n], grads[n])
    assert clip_grad_norm({"z": np.zeros(3)}, 1.0) == 0.0


# ---- O6: schedules ----

def test_o6_transformer_schedule_peaks_at_warmup():
    d, w = 512, 4000
    steps = np.arange(1, 3 * w)
    lr = np.array([transformer_schedule(s, d, w) for s in steps])
    assert transformer_schedule(0, d, w) == 0.0
    np.testing.assert_allclose(lr.max(), d**-0.5 * w**-0.5, rtol=1e-15)
    assert steps[lr.argmax()] == w
    assert np.all(np.diff(lr[:w]) > 0) and np.all(np.diff(lr[w - 1:]) < 0)
    np.testing.assert_allclose(lr[: w - 1], d**-0.5 * steps[: w - 1] * w**-1.5, rtol=1e-14)
    np.testing.assert_allclose(lr[w:], d**-0.5 * steps[w:] ** -0.5, rtol=1e-14)
    with pytest.raises(ValueError, match="warmup must be an int >= 1, got 0"):
        transformer_schedule(1, d, 0)


def test_o6_warmup_cosine_endpoints():
    max_lr, min_lr, w, total = 3e-4, 3e-5, 100, 1000
    lr = np.array([warmup_cosine(s, max_lr, w, total, min_lr) for s in range(total + 50)])
    assert lr[0] == 0.0 and lr[w] == max_lr and lr[total] == min_lr and np.all(lr[total:] == min_lr)
    np.testing.assert_allclose(lr[: w + 1], max_lr * np.arange(w + 1) / w, rtol=1e-15)
    np.testing.assert_allclose(lr[(w + total) // 2], (max_lr + min_lr) / 2, rtol=1e-14)
    assert np.all(np.diff(lr[: w + 1]) > 0) and np.all(np.diff(lr[w : total + 1]) < 0)
    assert warmup_cosine(0, max_lr, 0, total) == max_lr
    with pytest.raises(ValueError, match=r"warmup must be an int in \[0, 9\], got 10"):
        warmup_cosine(5, max_lr, 10, 10)
