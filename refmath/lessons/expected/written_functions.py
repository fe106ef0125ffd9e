r"""The write-the-function exercises of lessons 6-8: the reference, the inputs, the hint and the
known slips of each, keyed by exercise number, so that each lesson's check cell is one call
(``check("07.8", my_adamw_step)``) that shows the student no formula and no slip before the
attempt. (Every other lesson keeps its own in its own file, next to its other exercises.)

Each block was the lesson's check cell, moved here as it was; the lesson's own variables it read
(the worked example, the random generator, the optimiser's settings) are named in ``uses`` and
read from the lesson when the check runs."""
from __future__ import annotations

import numpy as np

from refmath.lessons.checks import catalogued
from refmath.lessons.table import function_exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; nothing here is called by name.
__all__ = []


# Lesson 6 --------------------------------------------------------------------------------------

def _torch_cross_entropy(logits, targets, ignore_index=-100, loss_mask=None, label_smoothing=0.0,
                         reduction="mean"):
    """The oracle (used only where torch is installed): torch's cross_entropy, with the loss
    mask written as ignored targets."""
    import torch

    if loss_mask is not None:
        targets = torch.where(loss_mask.bool(), targets, ignore_index)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index,
        label_smoothing=label_smoothing, reduction=reduction)


def _tensor2tensor_target(dout, cache):
    """A slip: 1 - eps on the right token and eps / (V - 1) on each other one."""
    from refmath.losses import cross_entropy_backward

    vocab = cache.probs.shape[-1]
    eps = cache.label_smoothing * vocab / max(vocab - 1, 1)
    return cross_entropy_backward(dout, cache._replace(label_smoothing=eps))


@function_exercise("06.5", "your smoothed cross-entropy backward",
                   "the section 'L4: label smoothing, three conventions'",
                   "p - q with q = (1 - eps) onehot + eps / V, on the counted rows")
def _smoothed_cross_entropy_backward():
    from refmath.losses import cross_entropy_backward

    return dict(
        reference=cross_entropy_backward, case="cross_entropy[*", oracle=_torch_cross_entropy,
        slips={**catalogued("cross-entropy: label smoothing left out of the gradient",
                            cross_entropy_backward),
               "no smoothing at all: the one-hot target, p - y": lambda dout, cache:
                   cross_entropy_backward(dout, cache._replace(label_smoothing=0.0)),
               "tensor2tensor's target: eps / (V - 1) on the wrong tokens": _tensor2tensor_target,
               **catalogued("cross-entropy: ignored tokens get a gradient", cross_entropy_backward),
               **catalogued("cross-entropy: mean over max(n, 2)", cross_entropy_backward),
               **catalogued("cross-entropy: 1 - eps dropped from the smoothed target",
                            cross_entropy_backward)})


# Lesson 7 --------------------------------------------------------------------------------------

def _adamw_inputs():
    draw = np.random.default_rng(7)
    scales = np.array([1e-4, 1e-2, 1.0, 3.0, 0.1, 1e-3])
    inputs = []
    for name, s in (("layers.0.attn.w_q", 1), ("layers.0.attn.w_q", 5), ("layers.1.ln1.gamma", 3),
                    ("tok_emb", 2), ("layers.1.ffn.b1", 4)):
        g = scales * draw.standard_normal(6)
        m = 0.0 if s == 1 else 0.5 * scales * draw.standard_normal(6)
        v = 0.0 if s == 1 else (scales * draw.standard_normal(6)) ** 2
        inputs.append((name, draw.standard_normal(6), g, np.zeros(6) + m, np.zeros(6) + v, s))
    return inputs


@function_exercise("07.8", "your AdamW step", "the section 'O5: which parameters take weight decay'",
                   "bias-correct both moments with beta^s; decay (1 - lr wd) only where "
                   "takes_weight_decay says so", uses=("LR", "BETAS", "EPS", "WD"))
def _gpt_adamw_step(LR, BETAS, EPS, WD):
    from refmath.optim import AdamW, takes_weight_decay

    def library_adamw_step(name, theta, g, m, v, s):
        """refmath's AdamW, its moments set to m, v and its counter to s - 1, taking one step."""
        optimiser = AdamW(LR, BETAS, EPS, weight_decay=WD)
        optimiser.state["m"][name], optimiser.state["v"][name] = m, v
        optimiser.step_count = s - 1
        params = {name: theta}
        optimiser.step(params, {name: g})
        return params[name], optimiser.state["m"][name], optimiser.state["v"][name]

    def torch_adamw_step(name, theta, g, m, v, s):
        """The oracle (used only where torch is installed): torch.optim.AdamW from the same state."""
        import torch

        p = torch.tensor(theta, requires_grad=True)
        optimiser = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS,
                                      weight_decay=WD if takes_weight_decay(name) else 0.0)
        optimiser.state[p] = {"step": torch.tensor(float(s - 1)), "exp_avg": torch.tensor(m),
                              "exp_avg_sq": torch.tensor(v)}
        p.grad = torch.tensor(g)
        optimiser.step()
        state = optimiser.state[p]
        return p.detach().numpy(), state["exp_avg"].numpy(), state["exp_avg_sq"].numpy()

    def decay_everything(name, theta, g, m, v, s):
        """A slip: the decay applied to biases, norm gains and embeddings too."""
        return library_adamw_step("layers.0.attn.w_q", theta, g, m, v, s)

    return dict(
        reference=library_adamw_step, inputs=_adamw_inputs, outputs=("theta", "m", "v"),
        oracle=torch_adamw_step, reference_name="refmath's AdamW",
        oracle_name="torch.optim.AdamW", rtol=1e-12,
        slips={**catalogued("adam: bias correction missing", library_adamw_step),
               **catalogued("adam: bias correction with beta instead of beta^s",
                            library_adamw_step),
               **catalogued("adam: eps inside the square root", library_adamw_step),
               **catalogued("adamw: decay not scaled by the learning rate", library_adamw_step),
               **catalogued("adamw: decay also inside the moments", library_adamw_step),
               "the decay applied to every parameter (biases, gains, embeddings too)":
                   decay_everything,
               "the bias correction one step ahead, beta^(s + 1): s counts this step":
                   lambda name, theta, g, m, v, s: library_adamw_step(name, theta, g, m, v,
                                                                      s + 1)})


# Lesson 8 --------------------------------------------------------------------------------------

def _torch_swiglu(x, w_gate, w_up, w_down):
    """The oracle (used only where torch is installed): SwiGLU in torch, differentiated by autograd."""
    import torch

    return (torch.nn.functional.silu(x @ w_gate) * (x @ w_up)) @ w_down


@function_exercise("08.1", "your SwiGLU backward", "the section 'M3: the layer'",
                   "du = dm * SiLU(g), dg = dm * u * SiLU'(g); weight gradients sum over every row")
def _swiglu_backward():
    from refmath.ffn import swiglu_backward

    return dict(
        reference=swiglu_backward, case="swiglu[*", oracle=_torch_swiglu,
        slips={**catalogued("swiglu: du uses the gate's input, not SiLU of it", swiglu_backward),
               **catalogued("silu: product rule forgotten", swiglu_backward),
               **catalogued("swiglu: gate and up weight gradients swapped", swiglu_backward),
               **catalogued("swiglu: dx from the gate's path only", swiglu_backward)})
