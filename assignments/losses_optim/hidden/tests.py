"""Hidden tests of the losses and optimisers assignment.

Expected values: torch.nn.functional.cross_entropy and its autograd (float64), torch.optim.Adam and
AdamW run for 300 steps on the same least-squares problem, torch's CosineAnnealingLR, and exact
properties (bias correction of a constant gradient, decoupled decay of a parameter without gradient).
``check`` never imports the submission. ``run``, whose source and inputs alone reach the sandbox,
builds the optimisers itself from plain values (lr, betas, weight decay, steps).
"""
import numpy as np

from refmath.assignments.checks import (Case, all_of, compare, exact, hidden_test, normal, numpy_of,
                                        shapes, torch_tensors)

IGNORE = -100


def targets_of(seed, shape, vocab, n_ignored=0):
    rng = np.random.default_rng(seed)
    targets = rng.integers(0, vocab, size=shape)
    flat = targets.reshape(-1)
    flat[rng.choice(flat.size, size=n_ignored, replace=False)] = IGNORE
    return targets


def torch_ce(logits, targets, smoothing=0.0):
    import torch
    import torch.nn.functional as F
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.as_tensor(targets.reshape(-1)),
                           ignore_index=IGNORE, label_smoothing=smoothing)


def case_out(out, i):
    """The outputs of the i-th case of a run (keys ``"i:name"``) under their own names."""
    prefix = f"{i}:"
    return {key[len(prefix):]: value for key, value in out.items() if key.startswith(prefix)}


# Each test of cross_entropy_backward also runs a large twin of its case: its logits have so many
# entries that a gradient by differences (one forward call or more per entry) cannot finish within
# cpu_s, while the analytic backward takes milliseconds.

def _ce_case(seed, shape, vocab, n_ignored=0, smoothing=0.0, backward=False, scale=1.0, what=""):
    """The inputs of one cross-entropy case, and the check of its outputs (torch); a backward's
    upstream gradient is 1.5."""
    logits = normal(seed, shape + (vocab,)) * scale
    targets = targets_of(seed + 1, shape, vocab, n_ignored)

    def check(out):
        (t,) = torch_tensors(logits)
        loss = torch_ce(t, targets, smoothing)
        inputs = shapes(logits=logits) + f", {n_ignored} ignored, label_smoothing={smoothing}{what}"
        verdicts = [compare("cross_entropy_forward", "loss", out, numpy_of(loss), inputs)]
        if backward:
            (loss * 1.5).backward()
            verdicts.append(compare("cross_entropy_backward", "dlogits", out, numpy_of(t.grad),
                                    inputs + ", dout=1.5"))
        return all_of(*verdicts)
    return (dict(logits=logits, targets=targets, options={"label_smoothing": smoothing},
                 dout=1.5 if backward else None), check)


def _ce_test(*cases):
    """One test of several cross-entropy cases, each ``(inputs, check)``: the inputs are the logits,
    the targets, the options of cross_entropy_forward and the upstream gradient (None: no backward)."""
    def run(cases):
        from refmath.losses import cross_entropy_backward, cross_entropy_forward
        out = {}
        for i, c in enumerate(cases):
            loss, cache = cross_entropy_forward(c["logits"], c["targets"], **c["options"])
            out[f"{i}:loss"] = loss
            if c["dout"] is not None:
                out[f"{i}:dlogits"] = cross_entropy_backward(np.float64(c["dout"]), cache)
        return out

    def check(out):
        return all_of(*(check_one(case_out(out, i)) for i, (_, check_one) in enumerate(cases)))
    return Case(run, dict(cases=[inputs for inputs, _ in cases]), check)


@hidden_test("cross_entropy_forward: batch of sequences (torch)")
def ce_forward_plain():
    return _ce_test(_ce_case(1, (3, 7), 11))


@hidden_test("cross_entropy_forward: ignore_index and label smoothing (torch)")
def ce_forward_ignore_smoothing():
    return _ce_test(_ce_case(2, (4, 6), 9, n_ignored=5, smoothing=0.1))


@hidden_test("cross_entropy_backward: ignore_index, label smoothing, upstream 1.5 (torch autograd)")
def ce_backward_ignore_smoothing():
    return _ce_test(_ce_case(3, (4, 6), 9, n_ignored=5, smoothing=0.2, backward=True),
                    _ce_case(13, (16, 64), 256, n_ignored=100, smoothing=0.2, backward=True))


@hidden_test("cross_entropy_backward: logits of size 1000, no overflow (torch autograd)")
def ce_extreme_logits():
    return _ce_test(_ce_case(4, (5,), 13, backward=True, scale=1000.0, what=", logits ~ 1000"),
                    _ce_case(14, (1024,), 256, backward=True, scale=1000.0, what=", logits ~ 1000"))


def _loss_mask_case(seed, batch, t, vocab, n_prompt):
    logits = normal(seed, (batch, t, vocab))
    targets = targets_of(seed + 1, (batch, t), vocab)
    loss_mask = np.ones((batch, t), dtype=int)
    loss_mask[:, :n_prompt] = 0  # the prompt

    def check(out):
        (t_,) = torch_tensors(logits)
        loss = torch_ce(t_, np.where(loss_mask == 1, targets, IGNORE))
        loss.backward()
        inputs = shapes(logits=logits) + f", loss_mask 0 on the first {n_prompt} tokens"
        return all_of(compare("cross_entropy_forward", "loss", out, numpy_of(loss), inputs),
                      compare("cross_entropy_backward", "dlogits", out, numpy_of(t_.grad), inputs))
    return dict(logits=logits, targets=targets, options={"loss_mask": loss_mask}, dout=1.0), check


@hidden_test("cross_entropy: loss_mask counts the answer tokens only (torch, masked as ignored)")
def ce_loss_mask():
    return _ce_test(_loss_mask_case(5, 2, 8, 10, 3), _loss_mask_case(15, 16, 64, 256, 16))


def _one_counted_case(logits, targets):
    def check(out):
        (t,) = torch_tensors(logits)
        loss = torch_ce(t, targets)
        loss.backward()
        inputs = shapes(logits=logits) + f", one target counted, {targets.size - 1} ignored"
        return all_of(compare("cross_entropy_forward", "loss", out, numpy_of(loss), inputs),
                      compare("cross_entropy_backward", "dlogits", out, numpy_of(t.grad), inputs))
    return dict(logits=logits, targets=targets, options={}, dout=1.0), check


@hidden_test("cross_entropy_backward: a single counted token, the mean of one (torch autograd)")
def ce_single_counted_token():
    large = np.full(1024, IGNORE)
    large[700] = 31
    return _ce_test(_one_counted_case(normal(8, (4, 7)), np.array([IGNORE, 3, IGNORE, IGNORE])),
                    _one_counted_case(normal(18, (1024, 256)), large))


def _nothing_counted_case(logits):
    targets = np.full(logits.shape[0], IGNORE)

    def check(out):
        inputs = shapes(logits=logits) + ", every target ignored"
        return all_of(exact("cross_entropy_forward", "loss", out, np.float64(0.0), inputs),
                      exact("cross_entropy_backward", "dlogits", out, np.zeros(logits.shape), inputs))
    return dict(logits=logits, targets=targets, options={}, dout=1.0), check


@hidden_test("cross_entropy: nothing counted gives loss 0 and gradient 0, never NaN (property)")
def ce_nothing_counted():
    return _ce_test(_nothing_counted_case(normal(7, (3, 5))),
                    _nothing_counted_case(normal(17, (1024, 256))))


# ---- Adam, AdamW -------------------------------------------------------------------------------

STEPS, LR, BETAS, WD = 300, 0.02, (0.9, 0.99), 0.1


def problem():
    """A fixed least-squares problem: y ~ a @ w + b."""
    a, y, w, b = normal(20, (32, 5), (32, 3), (5, 3), (3,))
    return a, y, {"w": w, "b": b}


def torch_trajectory(kind):
    """Parameters after STEPS steps of torch's optimiser; w decays, the bias b does not."""
    import torch
    a, y, params = problem()
    w, b = torch_tensors(params["w"], params["b"])
    groups = [{"params": [w], "weight_decay": WD}, {"params": [b], "weight_decay": 0.0}]
    optimiser = (torch.optim.Adam if kind == "adam" else torch.optim.AdamW)(groups, lr=LR, betas=BETAS)
    ta, ty = torch.as_tensor(a), torch.as_tensor(y)
    for _ in range(STEPS):
        optimiser.zero_grad()
        (0.5 * ((ta @ w + b - ty) ** 2).sum() / y.size).backward()
        optimiser.step()
    return {"w": numpy_of(w), "b": numpy_of(b)}


def _optimiser_test(kind):
    a, y, params = problem()

    def run(kind, a, y, params, steps, lr, betas, weight_decay):
        from refmath.optim import Adam, AdamW
        optimiser = (Adam if kind == "adam" else AdamW)(lr=lr, betas=tuple(betas),
                                                        weight_decay=weight_decay)
        for _ in range(steps):
            # the gradient of 0.5 * sum((a w + b - y)^2) / y.size
            residual = (a @ params["w"] + params["b"] - y) / y.size
            optimiser.step(params, {"w": a.T @ residual, "b": residual.sum(axis=0)})
        return params

    def check(out):
        expected = torch_trajectory(kind)
        inputs = f"{STEPS} steps, lr={LR}, betas={BETAS}, weight_decay={WD} on w (not on the bias b)"
        name = "Adam (L2 in the gradient)" if kind == "adam" else "AdamW (decoupled decay)"
        # 300 steps of rounding, each divided by sqrt(v): a little looser than a single op
        return all_of(*(compare(name, key, out, expected[key], inputs, tol=1e-9) for key in ("w", "b")))
    return Case(run, dict(kind=kind, a=a, y=y, params=params, steps=STEPS, lr=LR, betas=BETAS,
                          weight_decay=WD), check)


@hidden_test("Adam with L2 weight decay: 300 steps against torch.optim.Adam")
def adam_l2_against_torch():
    return _optimiser_test("adam")


@hidden_test("AdamW: 300 steps against torch.optim.AdamW")
def adamw_against_torch():
    return _optimiser_test("adamw")


@hidden_test("Adam.corrected_moments: a constant gradient gives m_hat = g and v_hat = g*g (property)")
def adam_bias_correction():
    g = normal(21, (4, 3))

    def run(g):
        from refmath.optim import Adam
        params = {"w": np.zeros((4, 3))}
        optimiser = Adam(lr=1e-3, betas=(0.8, 0.95))
        out = {}
        for step in range(1, 6):
            optimiser.step(params, {"w": g.copy()})
            out[f"m_hat_{step}"], out[f"v_hat_{step}"] = optimiser.corrected_moments("w")
        return out

    def check(out):
        return all_of(*(compare("Adam.corrected_moments", f"{which}_hat_{step}", out,
                                g if which == "m" else g * g, f"g {g.shape} constant, step {step}",
                                tol=1e-13)
                        for step in range(1, 6) for which in ("m", "v")))
    return Case(run, dict(g=g), check)


@hidden_test("adam_and_adamw_differ: AdamW shrinks a parameter without gradient by (1 - lr wd) per step")
def adam_and_adamw_differ():
    p0 = normal(22, (6,))

    def run(p0):
        from refmath.optim import Adam, AdamW
        out = {}
        for name, kind in (("adamw", AdamW), ("adam", Adam)):
            params = {"w": p0.copy()}
            optimiser = kind(lr=0.01, weight_decay=0.5)
            for _ in range(20):
                optimiser.step(params, {"w": np.zeros(6)})
            out[name] = params["w"]
        return out

    def check(out):
        import torch
        inputs = f"w {p0.shape}, zero gradient, 20 steps, lr=0.01, weight_decay=0.5"
        (w,) = torch_tensors(p0)
        optimiser = torch.optim.Adam([w], lr=0.01, weight_decay=0.5)
        for _ in range(20):
            w.grad = torch.zeros(6, dtype=torch.float64)
            optimiser.step()
        return all_of(compare("AdamW", "adamw", out, p0 * (1 - 0.01 * 0.5) ** 20, inputs, tol=1e-13),
                      compare("Adam (L2)", "adam", out, numpy_of(w), inputs))
    return Case(run, dict(p0=p0), check)


# ---- the schedule ------------------------------------------------------------------------------

@hidden_test("warmup_cosine: every step of a schedule, against torch's CosineAnnealingLR")
def warmup_cosine_against_torch():
    max_lr, min_lr, warmup, total = 3e-3, 1e-4, 10, 60

    def run(max_lr, min_lr, warmup, total):
        from refmath.optim import warmup_cosine
        return {"lr": np.array([warmup_cosine(s, max_lr, warmup, total, min_lr) for s in range(total + 6)])}

    def check(out):
        import torch
        # the warmup is a straight line from 0; the cosine part is torch's annealing from max_lr
        ramp = np.arange(warmup) / warmup * max_lr
        w = torch.zeros(1, requires_grad=True)
        optimiser = torch.optim.SGD([w], lr=max_lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, T_max=total - warmup,
                                                              eta_min=min_lr)
        cosine = []
        for _ in range(total - warmup):
            cosine.append(optimiser.param_groups[0]["lr"])
            optimiser.step()
            schedule.step()
        expected = np.concatenate([ramp, cosine, np.full(6, min_lr)])
        return compare("warmup_cosine", "lr", out, expected,
                       f"steps 0..{total + 5}, max_lr={max_lr}, min_lr={min_lr}, warmup={warmup}, "
                       f"total={total}", tol=1e-12)
    return Case(run, dict(max_lr=max_lr, min_lr=min_lr, warmup=warmup, total=total), check)
