r"""Lesson 5, the loss and the optimiser (``notebooks/05_losses_and_optimisers.py``): the expected
value and the known slips of each exercise, computed from the library and from the lesson's
inputs."""
from __future__ import annotations

import numpy as np

from refmath.lessons.checks import catalogued
from refmath.lessons.table import exercise, function_exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; only the AdamW slips are
# called by name, by lesson 7's AdamW step.
__all__ = ["ADAMW_SLIPS", "adamw_slips"]


_L2 = "the section 'L2, L3: cross-entropy and its gradient'"
_L5 = "the section 'L5: the fine-tuning loss'"
_O1 = "the section 'O1, O2: Adam and its bias correction'"
_O4 = "the section 'O3, O4, O7: weight decay inside Adam or beside it'"
_O6 = "the section 'O6: learning-rate schedules'"


@exercise("05.1", "dloss/dlogits", _L2, "p - onehot(target), divided by the number of positions",
          uses=("logits", "targets"))
def _cross_entropy_gradient(logits, targets):
    from refmath.losses import cross_entropy_backward, cross_entropy_forward
    from refmath.softmax import softmax_forward

    _, cache = cross_entropy_forward(logits, targets)
    mean = cross_entropy_backward(1.0, cache)
    n = np.size(targets)
    return mean, {
        "not divided by the number of positions (the sum's gradient, not the mean's)": n * mean,
        "the one-hot target forgotten: p / T": softmax_forward(logits)[0] / n,
        "the sign flipped: y - p": -mean}


def _sft(logits, targets, mask, reduction):
    from refmath.losses import cross_entropy_forward

    return cross_entropy_forward(logits, targets, loss_mask=mask, reduction=reduction)


@exercise("05.2", "the summed SFT loss", _L5,
          "only the answer positions count, and nothing divides the sum",
          uses=("sft_logits", "sft_targets", "answer_mask"))
def _sft_sum(logits, targets, mask):
    from refmath.losses import cross_entropy_forward

    total = _sft(logits, targets, mask, "sum")[0]
    return total, {
        "the mean over the answer tokens, not the sum": _sft(logits, targets, mask, "mean")[0],
        "the prompt positions counted too": cross_entropy_forward(logits, targets, reduction="sum")[0],
        "the sign flipped: the sum of log p, not of -log p": -total}


@exercise("05.3", "the last row of dlogits (sum)", _L5,
          "p - y, with no division: the sum does not divide by the number of tokens",
          uses=("sft_logits", "sft_targets", "answer_mask"))
def _sft_last_row(logits, targets, mask):
    from refmath.losses import cross_entropy_backward

    row = cross_entropy_backward(1.0, _sft(logits, targets, mask, "sum")[1])[-1]
    mean_row = cross_entropy_backward(1.0, _sft(logits, targets, mask, "mean")[1])[-1]
    return row, {"divided by the answer tokens: that is the mean's gradient": mean_row,
                 "the sign flipped: y - p": -row}


def _adam_first_step(eps: float = 1e-8, **options):
    from refmath.optim import Adam

    w = {"w": np.array([1.0, -2.0])}
    Adam(lr=0.1, eps=eps, **options).step(w, {"w": np.array([0.3, -0.1])})
    return w["w"]


@exercise("05.5", "theta after one Adam step", _O1,
          "m_hat = g and v_hat = g^2 after one step, so the step is lr g / (|g| + eps)")
def _adam_step():
    plain = np.array([1.0, -2.0]) - 0.1 * np.array([0.3, -0.1])
    return _adam_first_step(), {
        **catalogued("adam: bias correction missing", _adam_first_step),
        # theta - lr sign(g) = (0.9, -1.9) would otherwise read as "a printed number copied"
        "eps left out of the denominator: lr g / |g| is not quite lr g / (|g| + eps)":
            np.array([1.0, -2.0]) - 0.1 * np.sign([0.3, -0.1]),
        "a plain gradient step, theta - lr g": plain}


@exercise("05.6", "v_hat after two steps", _O1,
          "v_2 = beta2 (1 - beta2) g_1^2 + (1 - beta2) g_2^2, then divide by 1 - beta2^2")
def _adam_second_moment():
    from refmath.optim import Adam

    adam, w = Adam(lr=0.1), {"w": np.array([1.0])}
    for g in (0.3, 0.5):
        adam.step(w, {"w": np.array([g])})
    m_hat, v_hat = (float(x[0]) for x in adam.corrected_moments("w"))
    raw = v_hat * (1 - 0.999**2)
    return v_hat, {
        "a centred variance, v_hat - m_hat^2: v is the raw second moment, nothing subtracts m":
            v_hat - m_hat**2,
        "the variance of the two gradients: v weighs g^2 and never subtracts the mean":
            float(np.var([0.3, 0.5])),
        "v_2 without its bias correction 1 - beta2^2": raw}


def _library_adamw_step(theta, g, m, v, s, lr, betas, eps, weight_decay):
    """refmath's AdamW on one weight array, its moments set to m, v and its counter to s - 1:
    (new theta, new m, new v)."""
    from refmath.optim import AdamW

    optimiser = AdamW(lr, betas, eps, weight_decay=weight_decay, decay_of=lambda name: weight_decay)
    optimiser.state["m"]["w"], optimiser.state["v"]["w"] = m, v
    optimiser.step_count = s - 1
    params = {"w": theta}
    optimiser.step(params, {"w": g})
    return params["w"], optimiser.state["m"]["w"], optimiser.state["v"]["w"]


def _torch_adamw_step(theta, g, m, v, s, lr, betas, eps, weight_decay):
    """The independent oracle: torch.optim.AdamW from the same state (ImportError without torch,
    and the check skips it)."""
    import torch

    p = torch.tensor(theta, requires_grad=True)
    optimiser = torch.optim.AdamW([p], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    optimiser.state[p] = {"step": torch.tensor(float(s - 1)), "exp_avg": torch.tensor(m),
                          "exp_avg_sq": torch.tensor(v)}
    p.grad = torch.tensor(g)
    optimiser.step()
    return (p.detach().numpy(), optimiser.state[p]["exp_avg"].numpy(),
            optimiser.state[p]["exp_avg_sq"].numpy())


def _adamw_inputs():
    """Five (theta, g, m, v, s, lr, betas, eps, weight_decay): a first step and later ones,
    gradients from 1e-4 to 3 (so that eps matters), decay 0 and not, several betas."""
    draw = np.random.default_rng(11)
    scales = np.array([1e-4, 1e-2, 1.0, 3.0, 0.1, 1e-3])
    inputs = []
    for s, lr, betas, eps, weight_decay in ((1, 0.1, (0.9, 0.999), 1e-8, 0.1),
                                            (2, 0.01, (0.9, 0.95), 1e-8, 0.1),
                                            (5, 0.001, (0.8, 0.99), 1e-6, 0.0),
                                            (40, 0.03, (0.9, 0.999), 1e-8, 0.5),
                                            (3, 0.1, (0.5, 0.9), 1e-3, 0.01)):
        g = scales * draw.standard_normal(6)
        m = np.zeros(6) if s == 1 else 0.5 * scales * draw.standard_normal(6)
        v = np.zeros(6) if s == 1 else (scales * draw.standard_normal(6)) ** 2
        inputs.append((draw.standard_normal(6), g, m, v, s, lr, betas, eps, weight_decay))
    return inputs


def _corrected_moments_kept(theta, g, m, v, s, lr, betas, eps, weight_decay):
    """The slip: m_hat and v_hat returned as the new moments."""
    new_theta, new_m, new_v = _library_adamw_step(theta, g, m, v, s, lr, betas, eps, weight_decay)
    return new_theta, new_m / (1 - betas[0] ** s), new_v / (1 - betas[1] ** s)


def _adam_with_l2(theta, g, m, v, s, lr, betas, eps, weight_decay):
    """The slip the section is about: Adam with L2, the decay's gradient lambda theta added to g
    before the moments, and no decoupled decay."""
    return _library_adamw_step(theta, g + weight_decay * theta, m, v, s, lr, betas, eps, 0.0)


def _decay_after_the_step(theta, g, m, v, s, lr, betas, eps, weight_decay):
    """The slip: the decay applied after the Adam step, so that it shrinks the step as well."""
    new_theta, new_m, new_v = _library_adamw_step(theta, g, m, v, s, lr, betas, eps, 0.0)
    return (1 - lr * weight_decay) * new_theta, new_m, new_v


# The catalogued AdamW slips every write-the-step exercise recognises (05.7 here, 07.8 in GPT's)
ADAMW_SLIPS = ("adam: bias correction missing", "adam: bias correction with beta instead of beta^s",
               "adam: eps inside the square root", "adamw: decay not scaled by the learning rate",
               "adamw: decay also inside the moments")


def adamw_slips(step) -> dict:
    """The slips of :data:`ADAMW_SLIPS`, each as :func:`refmath.lessons.checks.catalogued` makes
    it from the reference ``step``."""
    return {name: slip for mistake in ADAMW_SLIPS
            for name, slip in catalogued(mistake, step).items()}


@function_exercise("05.7", "your AdamW step", _O4,
                   "m and v are running means of g and g^2; divide them by 1 - beta^s for the "
                   "step only; the decay multiplies the old theta by 1 - lr lambda")
def _adamw_step():
    return dict(
        reference=_library_adamw_step, inputs=_adamw_inputs, outputs=("theta", "m", "v"),
        oracle=_torch_adamw_step, reference_name="refmath's AdamW",
        oracle_name="torch.optim.AdamW", rtol=1e-12,
        slips={**adamw_slips(_library_adamw_step),
               "Adam + L2 (O3), not AdamW: lambda theta added to the gradient, inside the "
               "moments, instead of the decay (1 - lr lambda) beside the step": _adam_with_l2,
               "m_hat and v_hat kept as the moments: the next step needs the raw m and v":
                   _corrected_moments_kept,
               "the decay applied after the Adam step: (1 - lr lambda) multiplies the old theta, "
               "not the step": _decay_after_the_step})


ADAMW_STEPS = 200


def _adamw_path(steps: int, optimiser=None):
    from refmath.optim import AdamW

    # decay_of: by default AdamW decays matrices only, and this weight is a vector
    optimiser = optimiser or AdamW(lr=0.1, weight_decay=0.1, decay_of=lambda name: 0.1)
    p, path = {"w": np.array([1.0])}, [1.0]
    for _ in range(steps):
        optimiser.step(p, {"w": np.array([0.0])})
        path.append(float(p["w"][0]))
    return np.array(path)


@exercise("05.8", f"AdamW's weight after {ADAMW_STEPS} steps", _O4,
          "each step multiplies by (1 - lr * weight_decay); m_hat stays 0")
def _adamw_after():
    path = _adamw_path(ADAMW_STEPS)
    return path[-1], {
        "(1 - lr lambda)^(n - 1): one step too few": path[-2],
        **catalogued("adamw: decay not scaled by the learning rate",
                     lambda: _adamw_path(ADAMW_STEPS)[-1]),
        **catalogued("adamw: decay also inside the moments", lambda: _adamw_path(ADAMW_STEPS)[-1])}


@exercise("05.9", "(peak, half-way rate)", _O6,
          "at s = w both branches equal d^-1/2 w^-1/2; cos(pi/2) = 0")
def _schedule_values():
    from refmath.optim import transformer_schedule, warmup_cosine

    peak = transformer_schedule(4000, d_model=512, warmup=4000)
    return (peak, warmup_cosine(11000, max_lr=3e-4, warmup=2000, total=20000, min_lr=3e-5)), {
        **catalogued("warmup-cosine: progress measured over the whole run", lambda: (
            peak, warmup_cosine(11000, max_lr=3e-4, warmup=2000, total=20000, min_lr=3e-5))),
        "the floor forgotten: half of max_lr, not half-way from min_lr to max_lr":
            (peak, 0.5 * 3e-4),
        "the warm-up not subtracted: the cosine's phase is (s - w) / (S - w), not s / S":
            (peak, 3e-5 + 0.5 * (3e-4 - 3e-5) * (1 + np.cos(np.pi * 11000 / 20000)))}


def _torch_cross_entropy(logits, targets, ignore_index=-100, loss_mask=None, reduction="mean"):
    """The oracle of 05.4 (used only where torch is installed): torch's cross_entropy, with the
    loss mask written as ignored targets."""
    import torch

    if loss_mask is not None:
        targets = torch.where(loss_mask.bool(), targets, ignore_index)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1), ignore_index=ignore_index,
                                             reduction=reduction)


_WITHOUT_SMOOTHING = [f"cross_entropy[{label}]" for label in (
    "(T, V) = (4, 6)", "ignore_index -100, 2 of 5 ignored",
    "loss_mask on a 2-token prompt, ignore_index -1", "one counted token of 4",
    "3 leading axes (2, 1, 3, V=4), loss mask, 1 ignored", "V = 1",
    "reduction sum, loss_mask on a 2-token prompt")]


@function_exercise("05.4", "your cross-entropy backward", _L5,
                   "p - y on the counted rows, 0 elsewhere; the mean divides by n_counted")
def _cross_entropy_backward():
    from refmath.losses import cross_entropy_backward

    return dict(
        reference=cross_entropy_backward, case=_WITHOUT_SMOOTHING, oracle=_torch_cross_entropy,
        slips={**catalogued("cross-entropy: mean over max(n, 2)", cross_entropy_backward),
               **catalogued("cross-entropy: mean over every position, ignored ones too",
                            cross_entropy_backward),
               **catalogued("cross-entropy: ignored tokens get a gradient", cross_entropy_backward),
               "the mean not divided by n (the sum's gradient)": lambda dout, cache:
                   cross_entropy_backward(dout, cache._replace(reduction="sum")),
               "the upstream gradient dout left out: dlogits is dout times p - y": lambda dout,
                   cache: cross_entropy_backward(np.ones_like(np.asarray(dout, dtype=float)), cache)})
