"""Optimisers, gradient clipping and learning-rate schedules on flat parameter dicts.

Parameters and gradients are ``dict[str, np.ndarray]`` with dotted names (``"layers.0.attn.w_q"``),
as the models produce them. ``step(params, grads, lr=None)`` updates the parameter arrays in place,
so the dict the model holds is the dict that trains. The optimiser state is plain arrays keyed by
parameter name plus one step counter; ``state_dict()`` flattens it into ``{str: ndarray}`` so it can
be saved into the same ``.npz`` as the parameters, and ``load_state_dict`` restores it exactly.

One step counter ``s`` serves every parameter (the ``s`` of the catalogue): all parameters are
updated together, and the set of parameter names may not change once an optimiser holds state for
them (a parameter joining late would get the wrong Adam bias correction).

Weight decay per parameter (O5): by default only weight matrices decay (see
:func:`takes_weight_decay`); pass ``decay_of`` to choose the coefficient per name, or subclass and
override :meth:`Optimizer.decay_of`.

These classes update one parameter at a time, each equation one line: the form to read. Training
uses :class:`refmath.fast.flat_adamw.FlatAdamW`, the same AdamW bit for bit over one flat buffer.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping

import numpy as np

from refmath._validate import check_int, check_real, check_same_shape, float_array

__all__ = ["takes_weight_decay", "Optimizer", "SGD", "Adam", "AdamW", "clip_grad_norm",
           "transformer_schedule", "warmup_cosine"]

# ---- which parameters decay (O5) ----

# Last name component of a bias: "b", "b1", "b_q", or anything containing "bias".
_BIAS_LEAF = re.compile(r"b|b\d+|b_.*|.*bias.*")
_NORM_LEAVES = ("gamma", "beta")


def takes_weight_decay(name: str) -> bool:
    """The default rule for which parameters decay (catalogue O5).

    Split ``name`` at the dots. A parameter is **not** decayed when

    - its last component is a bias: ``b``, ``b`` followed by digits (``b1``), ``b_`` followed by
      anything (``b_q``), or anything containing ``bias``;
    - its last component is a norm gain or shift: exactly ``gamma`` or ``beta``;
    - any component contains ``emb`` or ``pos`` (token embeddings, position tables:
      ``tok_emb``, ``pos_emb``, ``embedding.weight``, ``positions``).

    Everything else (the weight matrices ``w_q``, ``w1``, ``lm_head`` ...) decays. Decaying a
    bias or a norm gain pulls it towards 0, which is not a "simpler" model, only a different one;
    embeddings are left alone because rare tokens' rows get few gradient updates and decay would
    erase them.
    """
    parts = name.split(".")
    leaf = parts[-1]
    if _BIAS_LEAF.fullmatch(leaf) or leaf in _NORM_LEAVES:
        return False
    return not any("emb" in part or "pos" in part for part in parts)


def _non_negative(name: str, value: float) -> float:
    return check_real(name, value, 0.0)


class Optimizer:
    r"""What SGD, Adam and AdamW share: checks, the step counter, decay per parameter, the state.

    ``state[buffer][param_name]`` holds one array per parameter and buffer (``"m"`` and ``"v"`` for
    Adam, ``"momentum"`` for SGD with momentum); subclasses write the update in :meth:`_update`.

    ``decay_of`` chooses each parameter's weight-decay coefficient :math:`\lambda` (O5):

    - ``None`` (default): ``weight_decay`` for names that :func:`takes_weight_decay` accepts, 0
      for the others;
    - a function ``name -> float``: its value is the coefficient (``weight_decay`` is then unused;
      ``decay_of=lambda name: 0.1`` decays everything, as torch does by default);
    - a mapping ``{name: float}``: explicit groups, every parameter must be listed, e.g.
      ``{n: wd for wd, names in [(0.1, matrices), (0.0, others)] for n in names}``.
    """

    def __init__(self, lr: float, weight_decay: float, decay_of, buffers: tuple[str, ...]):
        self.lr = _non_negative("lr", lr)
        self.weight_decay = _non_negative("weight_decay", weight_decay)
        if decay_of is not None and not (callable(decay_of) or isinstance(decay_of, Mapping)):
            raise TypeError(f"decay_of must be None, a function or a mapping, got {type(decay_of)}")
        self._decay_of = decay_of
        self.step_count = 0
        self.state: dict[str, dict[str, np.ndarray]] = {buffer: {} for buffer in buffers}

    def decay_of(self, name: str) -> float:
        """The weight-decay coefficient of parameter ``name`` (override to change the rule)."""
        if self._decay_of is None:
            return self.weight_decay if takes_weight_decay(name) else 0.0
        if isinstance(self._decay_of, Mapping):
            if name not in self._decay_of:
                raise ValueError(f"decay_of has no weight-decay entry for parameter {name!r}")
            return _non_negative(f"decay_of[{name!r}]", self._decay_of[name])
        return _non_negative(f"decay_of({name!r})", self._decay_of(name))

    def step(self, params: dict, grads: dict, lr: float | None = None) -> None:
        """Update every array of ``params`` in place from ``grads`` (same keys and shapes).

        ``lr`` overrides the learning rate for this step only, so a schedule can drive it.
        Everything is checked before anything changes, so a bad call leaves params and state as
        they were.
        """
        lr = self.lr if lr is None else _non_negative("lr", lr)
        grads = self._check(params, grads)
        decays = {name: self.decay_of(name) for name in params}
        self.step_count += 1
        for name, p in params.items():
            self._update(name, p, grads[name], lr, decays[name])

    def _update(self, name: str, p: np.ndarray, g: np.ndarray, lr: float, wd: float) -> None:
        raise NotImplementedError  # abstract: each optimiser defines its own update rule

    def _check(self, params, grads) -> dict[str, np.ndarray]:
        for name, p in params.items():
            if not isinstance(p, np.ndarray) or not np.issubdtype(p.dtype, np.floating):
                raise TypeError(
                    f"params[{name!r}] must be a floating-point ndarray (it is updated in place), "
                    f"got {type(p).__name__} {getattr(p, 'dtype', '')}"
                )
            if name not in grads:
                raise ValueError(f"grads has no entry for parameter {name!r} (shape {p.shape})")
        extra = sorted(set(grads) - set(params))
        if extra:
            raise ValueError(f"grads has entries for names that are not parameters: {extra}")
        grads = {name: float_array(f"grads[{name!r}]", grads[name]) for name in params}
        for name, p in params.items():
            check_same_shape(f"params[{name!r}]", p, f"grads[{name!r}]", grads[name])
        held = next((set(b) for b in self.state.values() if b), None)
        if held is not None and held != set(params):
            missing, new = sorted(held - set(params)), sorted(set(params) - held)
            raise ValueError(
                f"the parameters must stay the same across steps: missing {missing}, new {new}"
            )
        return grads

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copy of the state as ``{"step": s, "<buffer>.<param name>": array}`` (``.npz`` ready)."""
        out = {"step": np.array(self.step_count)}
        for buffer, arrays in self.state.items():
            out.update({f"{buffer}.{name}": a.copy() for name, a in arrays.items()})
        return out

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what :meth:`state_dict` returned (copies the arrays)."""
        if "step" not in state:
            raise ValueError("state has no 'step' entry")
        buffers: dict[str, dict[str, np.ndarray]] = {buffer: {} for buffer in self.state}
        for key, value in state.items():
            if key == "step":
                continue
            buffer, _, name = key.partition(".")
            if buffer not in buffers or not name:
                raise ValueError(
                    f"unknown state entry {key!r}: expected 'step' or '<buffer>.<name>' "
                    f"with a buffer in {list(buffers)}"
                )
            buffers[buffer][name] = np.array(value, copy=True)
        self.step_count = int(state["step"])
        self.state = buffers


class SGD(Optimizer):
    r"""Stochastic gradient descent with optional momentum and L2 weight decay (catalogue O7).

    .. math::
        g' = g + \lambda\theta,\qquad b_s = \mu\, b_{s-1} + g',\qquad \theta_s = \theta_{s-1} - \eta\, b_s

    with :math:`b_0 = 0` (so :math:`b_1 = g'`); without momentum (:math:`\mu = 0`),
    :math:`\theta_s = \theta_{s-1} - \eta g'`. That is the convention of ``torch.optim.SGD`` (no
    dampening, no Nesterov). The L2 term is added to the gradient; for plain SGD this *is*
    multiplicative decay, :math:`\theta - \eta(g + \lambda\theta) = (1-\eta\lambda)\theta - \eta g`
    (O7). With momentum the decay term accumulates in the buffer along with the gradient.

    ``lr`` is :math:`\eta`, ``momentum`` :math:`\mu`, ``weight_decay`` :math:`\lambda` (per
    parameter through ``decay_of``, see :class:`Optimizer`).
    """

    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, decay_of=None):
        self.momentum = _non_negative("momentum", momentum)
        super().__init__(lr, weight_decay, decay_of, ("momentum",) if self.momentum else ())

    def _update(self, name, p, g, lr, wd):
        if wd:
            g = g + wd * p  # L2 penalty (wd/2)|theta|^2 differentiated
        if self.momentum:
            buf = self.state["momentum"].setdefault(name, np.zeros_like(p))
            buf *= self.momentum
            buf += g
            g = buf
        p -= lr * g


class Adam(Optimizer):
    r"""Adam (catalogue O1) with L2 weight decay inside the gradient (O3).

    .. math::
        g' = g + \lambda\theta,\quad
        m_s = \beta_1 m_{s-1} + (1-\beta_1) g',\quad
        v_s = \beta_2 v_{s-1} + (1-\beta_2)\, g' \odot g',

        \hat m_s = \frac{m_s}{1-\beta_1^s},\quad \hat v_s = \frac{v_s}{1-\beta_2^s},\quad
        \theta_s = \theta_{s-1} - \eta\, \frac{\hat m_s}{\sqrt{\hat v_s} + \epsilon}

    with :math:`m_0 = v_0 = 0`; all operations elementwise. Because the L2 term enters both
    moments, its pull on :math:`\theta` is divided by :math:`\sqrt{\hat v}` like the gradient:
    coordinates with large gradients are barely decayed. :class:`AdamW` removes that coupling.

    The bias correction undoes the zero start: for a constant gradient
    :math:`m_s = (1-\beta_1^s) g` exactly, so :math:`\hat m_s = g` and :math:`\hat v_s = g \odot g`
    (O2; see :meth:`corrected_moments`).
    """

    decoupled = False  # AdamW sets True: decay outside the moments

    def __init__(self, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 decay_of=None):
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        self.betas = tuple(check_real(f"betas[{i}]", b, 0.0, 1.0, high_open=True)
                           for i, b in enumerate(betas))
        self.eps = check_real("eps", eps, 0.0, low_open=True)
        super().__init__(lr, weight_decay, decay_of, ("m", "v"))

    def corrected_moments(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        r"""The bias-corrected moments :math:`(\hat m_s, \hat v_s)` of parameter ``name`` after step ``s``."""
        if name not in self.state["m"]:
            raise ValueError(f"no moments for parameter {name!r}: it has not been stepped")
        # BEGIN SOLUTION
        beta1, beta2 = self.betas
        s = self.step_count
        return self.state["m"][name] / (1 - beta1**s), self.state["v"][name] / (1 - beta2**s)
        # END SOLUTION

    def _update(self, name, p, g, lr, wd):
        # BEGIN SOLUTION
        if wd and not self.decoupled:
            g = g + wd * p  # O3: the L2 gradient enters both moments
        beta1, beta2 = self.betas
        m = self.state["m"].setdefault(name, np.zeros_like(p))
        v = self.state["v"].setdefault(name, np.zeros_like(p))
        m *= beta1
        m += (1 - beta1) * g
        v *= beta2
        v += (1 - beta2) * (g * g)
        m_hat, v_hat = self.corrected_moments(name)
        if wd and self.decoupled:
            p *= 1 - lr * wd  # O4: decay scaled by the learning rate, before the Adam step
        p -= lr * m_hat / (np.sqrt(v_hat) + self.eps)
        # END SOLUTION


class AdamW(Adam):
    r"""AdamW: Adam with decoupled weight decay (catalogue O4).

    .. math::
        \theta_s = (1 - \eta\lambda)\,\theta_{s-1} - \eta\, \frac{\hat m_s}{\sqrt{\hat v_s} + \epsilon}

    where :math:`\hat m_s, \hat v_s` are Adam's bias-corrected moments (O1) of the *data* gradient
    only. The decay multiplies :math:`\theta` by :math:`1-\eta\lambda` (the convention of
    ``torch.optim.AdamW``: the decay follows the learning-rate schedule) and does not depend on
    the gradient history, unlike L2 inside Adam (O3, O7).
    """

    decoupled = True

    def __init__(self, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 decay_of=None):
        super().__init__(lr, betas, eps, weight_decay, decay_of)


# ---- gradient clipping ----

def clip_grad_norm(grads: dict, max_norm: float) -> float:
    r"""Scale all gradients in place so their global L2 norm is at most about ``max_norm``.

    .. math::
        n = \Big(\sum_{\text{tensors } t} \lVert g_t \rVert_2^2\Big)^{1/2},\qquad
        g_t \leftarrow g_t \cdot \min\Big(1, \frac{\text{max\_norm}}{n + 10^{-6}}\Big)

    The same formula as ``torch.nn.utils.clip_grad_norm_`` (its ``1e-6`` keeps the division
    finite when every gradient is zero, and leaves the clipped norm a hair below ``max_norm``).
    Returns :math:`n`, the norm *before* clipping (useful to log). A non-finite norm is not
    caught: the gradients become NaN, as in torch.
    """
    max_norm = _non_negative("max_norm", max_norm)
    grads = {name: float_array(f"grads[{name!r}]", g) for name, g in grads.items()}
    if not grads:
        return 0.0
    # norm of the per-tensor norms, as torch computes it
    total = float(np.linalg.norm([np.linalg.norm(g.ravel()) for g in grads.values()]))
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for g in grads.values():
            g *= scale
    return total


# ---- learning-rate schedules (functions of the optimiser step) ----

def transformer_schedule(step: int, d_model: int, warmup: int) -> float:
    r"""The original Transformer's learning rate (catalogue O6).

    .. math::
        \eta_s = d^{-1/2} \min\big(s^{-1/2},\; s\, w^{-3/2}\big)

    ``step`` is :math:`s`, counted from 1 (the first update uses ``step=1``); ``step=0`` gives 0,
    the limit of the linear branch (:math:`s^{-1/2}` is infinite there). The rate rises linearly
    for :math:`s \le w` and decays as :math:`s^{-1/2}` afterwards; the two branches meet at
    :math:`s = w` with the peak :math:`d^{-1/2} w^{-1/2}`.
    """
    step = check_int("step", step, 0)
    d_model = check_int("d_model", d_model, 1)
    warmup = check_int("warmup", warmup, 1)
    if step == 0:
        return 0.0
    return d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def warmup_cosine(step: int, max_lr: float, warmup: int, total: int, min_lr: float = 0.0) -> float:
    r"""Linear warmup to ``max_lr``, then half a cosine down to ``min_lr`` (catalogue O6).

    .. math::
        \eta_s = \begin{cases}
            \eta_{\max}\, s / w & s < w \\
            \eta_{\min} + \tfrac12(\eta_{\max}-\eta_{\min})
                \big(1 + \cos(\pi \tfrac{s-w}{T-w})\big) & w \le s < T \\
            \eta_{\min} & s \ge T
        \end{cases}

    Step counted as in :func:`transformer_schedule` (``step=0`` gives 0 when ``warmup > 0``);
    ``s = w`` gives exactly ``max_lr`` and ``s = T`` (``total``) exactly ``min_lr``.
    """
    step = check_int("step", step, 0)
    total = check_int("total", total, 1)
    warmup = check_int("warmup", warmup, 0, total - 1)
    max_lr = check_real("max_lr", max_lr, 0.0)
    min_lr = check_real("min_lr", min_lr, 0.0, max_lr)
    # BEGIN SOLUTION
    if step < warmup:
        return max_lr * step / warmup
    if step >= total:
        return float(min_lr)
    progress = (step - warmup) / (total - warmup)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    # END SOLUTION
