"""refmath.optim against torch.optim and torch.nn.utils.clip_grad_norm_ (the independent oracle).

The same float64 parameters and the same stream of random gradients go through both for a few
hundred steps; the parameters must agree to rounding. torch stores the per-parameter weight decay
in param groups, so the groups are built from refmath's own decay rule.
"""
import numpy as np
import pytest

from refmath.fast.flat_adamw import FlatAdamW
from refmath.optim import SGD, Adam, AdamW, clip_grad_norm, takes_weight_decay, warmup_cosine

torch = pytest.importorskip("torch", reason="PyTorch is the oracle; install the 'oracle' extra")

STEPS = 300
SHAPES = {"layers.0.attn.w_q": (4, 4), "layers.0.attn.b_q": (4,), "layers.0.ln1.gamma": (4,),
          "layers.0.ffn.w1": (4, 8), "layers.0.ffn.b1": (8,), "tok_emb": (6, 4)}


def _setup(seed):
    rng = np.random.default_rng(seed)
    params = {n: rng.standard_normal(s) for n, s in SHAPES.items()}
    # a slowly drifting mean makes the moments matter; scales differ per tensor
    stream = [{n: rng.standard_normal(s) * (1 + i) + 0.01 * k for i, (n, s) in enumerate(SHAPES.items())}
              for k in range(STEPS)]
    mirror = {n: torch.nn.Parameter(torch.from_numpy(p.copy())) for n, p in params.items()}
    return params, stream, mirror


def _groups(mirror, wd):
    """torch param groups with the same decay as refmath's default rule."""
    decayed = [p for n, p in mirror.items() if takes_weight_decay(n)]
    plain = [p for n, p in mirror.items() if not takes_weight_decay(n)]
    assert decayed and plain  # both groups exercised
    return [{"params": decayed, "weight_decay": wd}, {"params": plain, "weight_decay": 0.0}]


def _run(opt, torch_opt, params, stream, mirror, schedule=None, max_norm=None):
    for s, grads in enumerate(stream, start=1):
        grads = {n: g.copy() for n, g in grads.items()}
        for n, p in mirror.items():
            p.grad = torch.from_numpy(grads[n].copy())
        if max_norm is not None:
            total = clip_grad_norm(grads, max_norm)
            torch_total = torch.nn.utils.clip_grad_norm_(list(mirror.values()), max_norm)
            np.testing.assert_allclose(total, torch_total.item(), rtol=1e-12)
        lr = None
        if schedule is not None:
            lr = schedule(s)
            for group in torch_opt.param_groups:
                group["lr"] = lr
        opt.step(params, grads, lr=lr)
        torch_opt.step()
    for n, p in params.items():
        np.testing.assert_allclose(p, mirror[n].detach().numpy(), rtol=1e-10, atol=1e-13, err_msg=n)


def test_sgd_momentum_and_weight_decay_match_torch():
    params, stream, mirror = _setup(0)
    _run(SGD(0.01, momentum=0.9, weight_decay=0.05),
         torch.optim.SGD(_groups(mirror, 0.05), lr=0.01, momentum=0.9),
         params, stream, mirror)


def test_adam_with_l2_matches_torch():
    params, stream, mirror = _setup(1)
    _run(Adam(3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1),
         torch.optim.Adam(_groups(mirror, 0.1), lr=3e-3, betas=(0.8, 0.99), eps=1e-7),
         params, stream, mirror)


def test_adamw_matches_torch():
    params, stream, mirror = _setup(2)
    _run(AdamW(3e-3, weight_decay=0.1),
         torch.optim.AdamW(_groups(mirror, 0.1), lr=3e-3),
         params, stream, mirror)


def test_adamw_decay_everything_matches_torch_default():
    params, stream, mirror = _setup(3)
    _run(AdamW(1e-3, weight_decay=0.3, decay_of=lambda name: 0.3),
         torch.optim.AdamW(list(mirror.values()), lr=1e-3, weight_decay=0.3),
         params, stream, mirror)


def test_clipped_scheduled_adamw_matches_torch():
    # clipping every step (the stream's norm is ~20, so it is active) and the lr from a schedule
    params, stream, mirror = _setup(4)
    _run(AdamW(0.0, weight_decay=0.1),
         torch.optim.AdamW(_groups(mirror, 0.1), lr=0.0),
         params, stream, mirror,
         schedule=lambda s: warmup_cosine(s, 1e-2, 30, STEPS, 1e-3), max_norm=1.0)



@pytest.mark.parametrize("threads", [1, 2])
def test_flat_adamw_matches_torch(threads):
    # FlatAdamW is AdamW bit for bit (test_optim.py); here against the oracle directly, with the
    # decay groups, a schedule and clipping as in training.
    params, stream, mirror = _setup(6)
    _run(FlatAdamW(params, 0.0, weight_decay=0.1, threads=threads),
         torch.optim.AdamW(_groups(mirror, 0.1), lr=0.0),
         params, stream, mirror,
         schedule=lambda s: warmup_cosine(s, 1e-2, 30, STEPS, 1e-3), max_norm=1.0)


def test_flat_adamw_matches_torch_in_float32():
    # float32, as training runs. The two sides round differently (torch's fused kernel evaluates
    # the same update as another sequence of operations), so each step's new parameter may be
    # rounded to the neighbouring float: at most one ulp of difference per step, added up over
    # the steps in the worst case (measured: 4 ulps after 50 steps).
    steps = 50
    params, stream, _ = _setup(7)
    params = {n: p.astype(np.float32) for n, p in params.items()}
    mirror = {n: torch.nn.Parameter(torch.from_numpy(p.copy())) for n, p in params.items()}
    opt = FlatAdamW(params, 3e-3, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(_groups(mirror, 0.1), lr=3e-3, fused=True)
    for grads in stream[:steps]:
        grads = {n: g.astype(np.float32) for n, g in grads.items()}
        for n, p in mirror.items():
            p.grad = torch.from_numpy(grads[n].copy())
        opt.step(params, grads)
        torch_opt.step()
    for n, p in params.items():
        np.testing.assert_array_max_ulp(p, mirror[n].detach().numpy(), maxulp=steps)

def test_clip_grad_norm_matches_torch():
    rng = np.random.default_rng(5)
    for max_norm in (0.1, 1.0, 100.0):
        grads = {n: rng.standard_normal(s) for n, s in SHAPES.items()}
        tensors = [torch.from_numpy(g.copy()) for g in grads.values()]
        ghosts = [torch.nn.Parameter(torch.zeros_like(t)) for t in tensors]
        for ghost, t in zip(ghosts, tensors):
            ghost.grad = t
        total = clip_grad_norm(grads, max_norm)
        torch_total = torch.nn.utils.clip_grad_norm_(ghosts, max_norm)
        np.testing.assert_allclose(total, torch_total.item(), rtol=1e-14)
        for g, ghost in zip(grads.values(), ghosts):
            np.testing.assert_allclose(g, ghost.grad.numpy(), rtol=1e-14)
