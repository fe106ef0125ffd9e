r"""The mixture-of-experts feed-forward (catalogue E1-E7): a router picks ``k`` of ``E`` SwiGLU
experts for each token, and the token's output is their weighted sum, plus shared experts that
every token uses.

.. math::
    s = \sigma(x W_r),\qquad \mathcal T = \operatorname{TopK}(s + b, k),\qquad
    y = \sum_{e \in \mathcal T} g_e\, \operatorname{SwiGLU}_e(x)\ +\ \operatorname{SwiGLU}_s(x)

with :math:`\sigma` a softmax (Mixtral, DeepSeek-V2, Qwen-MoE) or an elementwise sigmoid
(DeepSeek-V3), :math:`b` DeepSeek-V3's selection bias (it picks, it never weights), and the gates
:math:`g_e = \rho\, s_e / (\sum_{\mathcal T} s)` or :math:`\rho\, s_e` (``norm_topk``, ``scaling``).

The ops, each a forward/backward pair:

- :func:`router_scores` (E1): the router's logits and scores;
- :func:`route` (E2, E3): the selection (greedy, group-limited, DeepSeek-V3's node-limited
  ``noaux_tc`` with its bias) and the gates; :func:`route_backward` takes the gates' gradient back
  to the scores;
- :func:`moe_forward` (E4): the whole feed-forward, routed and shared experts, with the auxiliary
  losses in its cache; :func:`moe_backward` includes their gradient;
- :func:`expert_balance_loss`, :func:`device_balance_loss`, :func:`router_z_loss` (E5): the
  auxiliary losses, and :func:`expert_load`, the tokens each expert receives;
- :func:`balance_bias_update` (E6): DeepSeek-V3's auxiliary-loss-free balancing, outside any
  gradient.

The routing matches Hugging Face ``transformers`` (``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``,
``DeepseekV2TopkRouter``, ``DeepseekV3TopkRouter``); ``tests/test_moe_torch.py`` runs their MoE
blocks on the same weights.

A NaN never picks an expert silently. A token whose choice scores hold a NaN has no ranking, so
where it would have gone is unknown: :func:`route` gives it NaN gates, :func:`moe_forward` weights
it by NaN in every expert (its output is NaN, and so is every gradient it could have reached), and
:func:`expert_load` reports every expert's load as NaN. (``torch.topk`` ranks a NaN first, so
transformers would send the token to the NaN experts and leave the others' gradients finite.)

Parameters of one MoE feed-forward (names relative to the layer's ``ffn.`` prefix)::

    router.w          (d, E)         router logits x W_r
    router.bias       (E,)           only with score_bias (DeepSeek-V3); not trained by gradient
    experts.w_gate    (E, d, d_e)    expert e's SwiGLU, stacked on the first axis
    experts.w_up      (E, d, d_e)
    experts.w_down    (E, d_e, d)
    shared.w_gate     (d, d_s)       the shared experts as one SwiGLU, only when d_s > 0
    shared.w_up       (d, d_s)
    shared.w_down     (d_s, d)
    shared_gate.w     (d, 1)         only with shared_gate (Qwen2-MoE: sigmoid(x w) times shared)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, NamedTuple

import numpy as np

from refmath._validate import (as_dataclass, check_axis, check_choice, check_field, check_flag,
                               check_int, check_min_ndim, check_ndim, check_real, float_array)
from refmath.ffn import matmul_rows, matmul_rows_many, sigmoid, swiglu_backward, swiglu_forward
from refmath.registry import OpCase, register_case
from refmath.softmax import SoftmaxCache, softmax_backward, softmax_forward

__all__ = ["MoEConfig", "as_moe_config", "moe_param_shapes", "RouterScoresCache", "router_scores",
           "router_scores_backward", "RouteCache", "route", "route_backward", "routing_margin",
           "expert_load", "ExpertBalanceLossCache", "expert_balance_loss",
           "expert_balance_loss_backward", "DeviceBalanceLossCache", "device_balance_loss",
           "device_balance_loss_backward", "RouterZLossCache", "router_z_loss",
           "router_z_loss_backward", "balance_bias_update", "ExpertCache", "MoECache",
           "moe_forward", "moe_backward"]

SCORINGS = ("softmax", "sigmoid")
# Hugging Face's topk_method names: plain top-k; DeepSeek-V2's groups ranked by their best score;
# DeepSeek-V3's groups ranked by the sum of their two best (biased) scores.
ROUTINGS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    r"""The mixture-of-experts feed-forward of a decoder. ``dataclasses.asdict`` round-trips.

    ``n_experts`` routed experts (``E``), each a SwiGLU of hidden width ``d_expert``; ``top_k``
    of them per token. ``scoring`` turns router logits into scores (``"softmax"`` over the
    experts or an elementwise ``"sigmoid"``). ``routing`` chooses the experts: ``"greedy"`` (the
    ``top_k`` best scores), ``"group_limited_greedy"`` (DeepSeek-V2: the experts split into
    ``n_groups`` equal groups, each ranked by its best score, only the ``topk_groups`` best groups
    eligible) or ``"noaux_tc"`` (DeepSeek-V3: groups ranked by the sum of their two best scores).
    ``norm_topk`` renormalises the chosen scores to sum to 1; every gate is then multiplied by
    ``scaling`` (``routed_scaling_factor``). ``score_bias`` adds DeepSeek-V3's per-expert bias to
    the scores for choosing only (auxiliary-loss-free balancing, updated outside the gradient).

    The shared experts are one SwiGLU of width ``d_shared`` (default ``n_shared * d_expert``,
    DeepSeek's ``n_shared_experts``); ``shared_gate`` multiplies its output by
    ``sigmoid(x w)`` (Qwen2-MoE). Layer ``i`` of the decoder is an MoE layer when
    ``i >= first_dense`` and ``i % every == 0`` (DeepSeek's ``first_k_dense_replace`` and
    ``moe_layer_freq``); the others keep the dense SwiGLU. ``balance_coef`` weights the
    expert-level load-balancing loss, ``device_balance_coef`` the device-level one over
    ``n_devices`` equal groups of experts, ``z_coef`` the router z-loss; all three are added to the
    training loss. ``bias_speed`` (:math:`\gamma`, with ``score_bias``) is how far training moves
    each selection bias after a step (:func:`balance_bias_update`; 0: the bias stays as loaded).
    """

    n_experts: int
    top_k: int
    d_expert: int
    scoring: str = "softmax"
    routing: str = "greedy"
    n_groups: int = 1
    topk_groups: int = 1
    norm_topk: bool = False
    scaling: float = 1.0
    n_shared: int = 0
    d_shared: int | None = None
    shared_gate: bool = False
    score_bias: bool = False
    first_dense: int = 0
    every: int = 1
    balance_coef: float = 0.0
    device_balance_coef: float = 0.0
    n_devices: int = 1
    z_coef: float = 0.0
    bias_speed: float = 0.0

    def __post_init__(self):
        for name in ("n_experts", "top_k", "d_expert", "n_groups", "topk_groups", "every",
                     "n_devices"):
            check_field(self, name, check_int, 1)
        for name in ("n_shared", "first_dense"):
            check_field(self, name, check_int, 0)
        check_field(self, "d_shared", check_int, 0, optional=True)
        check_field(self, "scoring", check_choice, SCORINGS)
        check_field(self, "routing", check_choice, ROUTINGS)
        for name in ("norm_topk", "shared_gate", "score_bias"):
            check_field(self, name, check_flag)
        check_field(self, "scaling", check_real, 0.0, low_open=True)
        for name in ("balance_coef", "device_balance_coef", "z_coef", "bias_speed"):
            check_field(self, name, check_real, 0.0)
        if self.bias_speed and not self.score_bias:
            raise ValueError(f"MoEConfig.bias_speed = {self.bias_speed} moves the selection bias, "
                             f"which needs score_bias")
        if self.top_k > self.n_experts:
            raise ValueError(f"MoEConfig.top_k = {self.top_k} is larger than n_experts = "
                             f"{self.n_experts}")
        if self.n_experts % self.n_groups:
            raise ValueError(f"MoEConfig.n_groups = {self.n_groups} does not divide n_experts = "
                             f"{self.n_experts} (the groups are equal)")
        if self.topk_groups > self.n_groups:
            raise ValueError(f"MoEConfig.topk_groups = {self.topk_groups} is larger than "
                             f"n_groups = {self.n_groups}")
        if self.routing != "greedy" and self.top_k > self.topk_groups * self.group_size:
            raise ValueError(f"MoEConfig.top_k = {self.top_k} is more than the "
                             f"topk_groups * n_experts / n_groups = "
                             f"{self.topk_groups * self.group_size} experts the kept groups hold")
        if self.routing == "noaux_tc" and self.group_size < 2:
            raise ValueError(f"MoEConfig.routing = 'noaux_tc' ranks each group by its two best "
                             f"scores; n_experts / n_groups = {self.group_size} is fewer than 2")
        if self.n_experts % self.n_devices:
            raise ValueError(f"MoEConfig.n_devices = {self.n_devices} does not divide n_experts = "
                             f"{self.n_experts}")
        if self.shared_gate and self.shared_width == 0:
            raise ValueError("MoEConfig.shared_gate gates the shared experts, but there are none "
                             "(n_shared = 0 and no d_shared)")

    @property
    def group_size(self) -> int:
        """Experts per group, ``E / n_groups``."""
        return self.n_experts // self.n_groups

    @property
    def shared_width(self) -> int:
        """``d_s``, the hidden width of the shared experts' SwiGLU (0: none)."""
        return self.n_shared * self.d_expert if self.d_shared is None else self.d_shared

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has this feed-forward, not the dense one."""
        return layer >= self.first_dense and layer % self.every == 0


def as_moe_config(value, name: str = "moe") -> MoEConfig | None:
    """``value`` as a :class:`MoEConfig`: one already, a dict of its fields, or None."""
    return as_dataclass(value, MoEConfig, name)


def moe_param_shapes(d_model: int, moe: MoEConfig) -> dict:
    """``{name: shape}`` of one MoE feed-forward's parameters (see the module docstring)."""
    d, e, f, s = d_model, moe.n_experts, moe.d_expert, moe.shared_width
    shapes = {"router.w": (d, e)}
    if moe.score_bias:
        shapes["router.bias"] = (e,)
    shapes.update({"experts.w_gate": (e, d, f), "experts.w_up": (e, d, f),
                   "experts.w_down": (e, f, d)})
    if s:
        shapes.update({"shared.w_gate": (d, s), "shared.w_up": (d, s), "shared.w_down": (s, d)})
    if moe.shared_gate:
        shapes["shared_gate.w"] = (d, 1)
    return shapes


def _config(moe) -> MoEConfig:
    moe = as_moe_config(moe)
    if moe is None:
        raise TypeError("moe must be a MoEConfig or a dict of its fields, got None")
    return moe


# ---- E1: router scores ---------------------------------------------------------------------------

class RouterScoresCache(NamedTuple):
    x: np.ndarray  # (..., d)
    w: np.ndarray  # (d, E)
    scoring: str
    scores: np.ndarray  # (..., E): what the backward of either scoring needs


def router_scores(x, w, scoring: str = "softmax", *, matmul=matmul_rows_many):
    r"""The router (catalogue E1): logits :math:`z = x W_r` and one score per expert.

    .. math::
        z = x W_r,\qquad
        s_e = \frac{e^{z_e}}{\sum_u e^{z_u}}\ \ (\text{softmax})\quad\text{or}\quad
        s_e = \sigma(z_e) = \frac{1}{1 + e^{-z_e}}\ \ (\text{sigmoid})

    The softmax (Mixtral, Qwen2-MoE, DeepSeek-V2) makes the experts compete for one unit of
    probability; the sigmoid (DeepSeek-V3) scores each expert on its own, in (0, 1), and leaves the
    normalising to the gates (:func:`route`). transformers computes the router in float32 whatever
    the model's dtype; here the dtype of ``x`` is kept, like every op of the library.

    Shapes: ``x`` ``(..., d)``, ``w`` ``(d, E)``; returns ``(logits, scores, cache)``, both
    ``(..., E)``. ``matmul``: how the product is computed, as in
    :func:`refmath.ffn.linear_forward`.
    """
    x = float_array("x", x)
    w = float_array("w", w)
    check_min_ndim("x", x, 1, "(..., d)")
    check_ndim("w", w, 2, "(d, n_experts)")
    check_axis("w", w, 0, x.shape[-1], f"x.shape = {x.shape} (d)")
    check_choice("scoring", scoring, SCORINGS)
    logits = matmul(x, (w,))[0]
    scores = softmax_forward(logits)[0] if scoring == "softmax" else sigmoid(logits)
    return logits, scores, RouterScoresCache(x, w, scoring, scores)


def router_scores_backward(dscores, cache: RouterScoresCache, dlogits=None):
    r"""Gradients of :func:`router_scores`: returns ``(dx, dw)``. ``dlogits``, if given, is a
    gradient that reaches the logits directly (the z-loss's) and is added before the product.

    .. math::
        dz_u = s_u \Big(ds_u - \sum_e s_e\, ds_e\Big)\ \ (\text{softmax, A5}),\qquad
        dz_e = ds_e\, s_e (1 - s_e)\ \ (\text{sigmoid}),\qquad
        dx = dz\, W_r^\top,\quad dW_r = \sum_{\text{rows}} x^\top dz
    """
    x, w, scoring, scores = cache
    if scoring == "softmax":
        dz = softmax_backward(dscores, SoftmaxCache(scores))
    else:
        dz = dscores * scores * (1.0 - scores)
    if dlogits is not None:
        dz = dz + dlogits
    dx = matmul_rows(dz, w.T)
    dw = x.reshape(-1, w.shape[0]).T @ dz.reshape(-1, w.shape[1])
    return dx, dw


# ---- E2, E3: selection and gates -----------------------------------------------------------------

# DeepSeek-V3's code in transformers adds 1e-20 to the sum of the chosen sigmoid scores before
# dividing by it, since k sigmoids can all underflow to 0 (logits below about -745 in float64).
# Mixtral's and Qwen2-MoE's divide the softmax's top k by their sum as it is. We do the same.
_SIGMOID_NORM_EPS = 1e-20


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Positions of the ``k`` largest entries of each row, largest first; equal values in the
    order of their positions (a stable sort of the negated values), a NaN after every number."""
    return np.argsort(-values, axis=-1, kind="stable")[..., :k]


def _group_scores(choice: np.ndarray, moe: MoEConfig) -> np.ndarray:
    """``(N, n_groups)``: each group's best choice score (DeepSeek-V2's group_limited_greedy) or
    the sum of its two best (DeepSeek-V3's noaux_tc)."""
    groups = choice.reshape(choice.shape[0], moe.n_groups, moe.group_size)
    if moe.routing == "group_limited_greedy":
        return groups.max(axis=-1)
    top_two = np.sort(groups, axis=-1)[..., -2:]  # ascending: [second, best]
    return top_two[..., 0] + top_two[..., 1]


def _eligible(choice: np.ndarray, moe: MoEConfig) -> np.ndarray:
    """The choice scores with the experts outside each token's kept groups set to -inf."""
    if moe.routing == "greedy":
        return choice
    kept = _top(_group_scores(choice, moe), moe.topk_groups)
    keep = np.zeros((choice.shape[0], moe.n_groups), dtype=bool)
    np.put_along_axis(keep, kept, True, axis=1)
    return np.where(np.repeat(keep, moe.group_size, axis=1), choice, -np.inf)


def _check_scores(scores, moe: MoEConfig, bias, name: str = "scores"):
    scores = float_array(name, scores)
    check_ndim(name, scores, 2, "(n_tokens, n_experts)")
    check_axis(name, scores, 1, moe.n_experts, f"moe.n_experts = {moe.n_experts}")
    if bias is None and moe.score_bias:
        raise ValueError("bias is None, but moe.score_bias is set: DeepSeek-V3's routing needs "
                         f"its per-expert bias, shape ({moe.n_experts},)")
    if bias is not None:
        if not moe.score_bias:
            raise ValueError(f"bias is given (shape {np.shape(bias)}), but moe.score_bias is "
                             "False: set it to route with a bias")
        bias = float_array("bias", bias)
        if bias.shape != (moe.n_experts,):
            raise ValueError(f"bias must have shape ({moe.n_experts},) to match moe.n_experts = "
                             f"{moe.n_experts}, got bias.shape = {bias.shape}")
    return scores, bias


class RouteCache(NamedTuple):
    indices: np.ndarray  # (N, k) the chosen experts
    chosen: np.ndarray  # (N, k) their (unbiased) scores
    denominator: np.ndarray | None  # (N, 1) the renormalisation's sum, None without norm_topk
    scaling: float
    invalid: np.ndarray  # (N,) bool: tokens whose choice scores held a NaN
    n_experts: int


def route(scores, moe, bias=None):
    r"""Top-k selection (catalogue E2) and the gates (E3); the worked example is E7.

    .. math::
        c = s + b,\qquad \mathcal T = \operatorname{TopK}_k(c\ \text{on the kept groups}),\qquad
        g_j = \rho\,\frac{s_{\mathcal T_j}}{\sum_{l} s_{\mathcal T_l} + \varepsilon}\ \
        (\text{norm\_topk})\quad\text{or}\quad g_j = \rho\, s_{\mathcal T_j}

    The choice scores :math:`c` are the scores plus DeepSeek-V3's bias (``bias``, only with
    ``moe.score_bias``); the gates use the scores themselves, so the bias steers the choice and
    never weights an output. ``moe.routing`` says which experts may be chosen:

    - ``"greedy"``: the ``k`` best of all ``E`` (Mixtral, Qwen2-MoE, DeepSeek-V2's default);
    - ``"group_limited_greedy"`` (DeepSeek-V2): the experts fall into ``n_groups`` equal groups
      (devices), each ranked by its best choice score; the ``k`` best of the ``topk_groups`` best
      groups;
    - ``"noaux_tc"`` (DeepSeek-V3's node-limited routing): the same with each group ranked by the
      sum of its two best choice scores.

    transformers' DeepSeek-V2 router writes 0 over the scores of the dropped groups, DeepSeek-V3's
    writes -inf; we write -inf for both. For V2's softmax probabilities, which are never negative,
    the two pick the same experts unless a kept probability underflows to exactly 0.

    The gates are the chosen scores, renormalised to sum to 1 when ``moe.norm_topk`` (Mixtral
    always; Qwen2-MoE's ``norm_topk_prob``; DeepSeek-V3), then times ``moe.scaling``
    (:math:`\rho`, DeepSeek's ``routed_scaling_factor``). :math:`\varepsilon` is 0 for softmax
    scores and 1e-20 for sigmoid scores, as in transformers' DeepSeek-V3.

    **Ties** are broken towards the lower index, for experts and for groups alike, like a stable
    sort: the result never depends on anything but the scores. ``torch.topk`` leaves the order of
    equal values unspecified, so only inputs without ties can be compared with transformers.
    Within a token the chosen experts come best first.

    **NaN.** A token whose choice scores hold a NaN has no ranking: its gates are NaN (its
    indices are still valid expert numbers, chosen as if the NaN ranked last, and mean nothing).

    Worked example (E7): logits :math:`\ln(4, 2, 1, 1)` give the probabilities
    :math:`(1/2, 1/4, 1/8, 1/8)`; the top two are experts 0 and 1, renormalised to gates
    :math:`(2/3, 1/3)`.

    Shapes: ``scores`` ``(N, E)``, ``bias`` ``(E,)``. Returns ``(indices, gates, cache)``:
    ``indices`` ``(N, k)`` int, ``gates`` ``(N, k)`` in the dtype of ``scores``.
    """
    moe = _config(moe)
    scores, bias = _check_scores(scores, moe, bias)
    choice = scores if bias is None else scores + bias
    invalid = np.isnan(choice).any(axis=-1)
    indices = _top(_eligible(choice, moe), moe.top_k)
    chosen = np.take_along_axis(scores, indices, axis=1)
    denominator = None
    gates = chosen
    if moe.norm_topk:
        denominator = chosen.sum(axis=-1, keepdims=True)
        if moe.scoring == "sigmoid":
            denominator = denominator + _SIGMOID_NORM_EPS
        gates = chosen / denominator
    gates = gates * moe.scaling
    gates[invalid] = np.nan
    return indices, gates, RouteCache(indices, chosen, denominator, moe.scaling, invalid,
                                      moe.n_experts)


def route_backward(dgates, cache: RouteCache):
    r"""Gradient of :func:`route`'s gates with respect to the scores (catalogue E3): returns
    ``dscores`` ``(N, E)``, dense, zero for every expert a token did not choose.

    Without renormalisation a gate is :math:`\rho` times its score. With it,
    :math:`g_j = \rho s_j / D` with :math:`D = \sum_l s_l + \varepsilon` over the chosen, so
    :math:`\partial g_j / \partial s_i = \rho(\delta_{ij}/D - s_j/D^2)` and

    .. math::
        ds_i = \frac{1}{D}\Big(\rho\, dg_i - \frac{1}{D}\sum_j \rho\, dg_j\, s_j\Big)
        \quad (i \in \mathcal T),\qquad ds_i = 0\quad (i \notin \mathcal T).

    **The selection has no gradient.** :math:`\mathcal T` is a piecewise-constant function of the
    scores (and of the bias): its derivative is zero wherever it is defined, which is everywhere
    except where two candidates tie (the k-th and (k+1)-th expert, or the last kept and the first
    dropped group). So the gates carry the whole gradient, and the bias gets none. At a tie the
    derivative does not exist (the output jumps as another expert comes in); we return the
    gradient of the selection actually made (ties broken towards the lower index), that is the
    one-sided derivative from the side where the same experts are chosen. A gradient check
    must therefore keep the inputs farther from every tie than the finite differences reach
    (:func:`routing_margin`). A token whose scores held a NaN gets a row of NaN.
    """
    indices, chosen, denominator, scaling, invalid, n_experts = cache
    dg = dgates * scaling
    if denominator is not None:
        dg = (dg - np.sum(dg * chosen, axis=-1, keepdims=True) / denominator) / denominator
    dscores = np.zeros((indices.shape[0], n_experts), dtype=dg.dtype)
    np.put_along_axis(dscores, indices, dg, axis=1)
    dscores[invalid] = np.nan
    return dscores


def routing_margin(scores, moe, bias=None) -> float:
    r"""How far the scores are from changing the selection: the smallest gap, over the tokens,
    between the last chosen and the first passed-over eligible choice score, and (grouped routing)
    between the last kept and the first dropped group's score (E2).

    A perturbation that moves every choice score by less than half this margin (a quarter, for
    DeepSeek-V3's group scores, sums of two) changes no selection; ``inf`` when nothing competes
    (``k = E``). The gradient-check cases draw their inputs with a margin beyond the reach of the
    finite differences.
    """
    moe = _config(moe)
    scores, bias = _check_scores(scores, moe, bias)
    choice = scores if bias is None else scores + bias
    gaps = [np.inf]
    ranked = -np.sort(-_eligible(choice, moe), axis=-1)
    if moe.top_k < moe.n_experts:
        gaps.append(float(np.min(ranked[:, moe.top_k - 1] - ranked[:, moe.top_k])))
    if moe.routing != "greedy" and moe.topk_groups < moe.n_groups:
        groups = -np.sort(-_group_scores(choice, moe), axis=-1)
        gaps.append(float(np.min(groups[:, moe.topk_groups - 1] - groups[:, moe.topk_groups])))
    return min(gaps)


# ---- E5: the auxiliary losses and the load -------------------------------------------------------

def expert_load(indices, n_experts: int, invalid=None) -> np.ndarray:
    """The number of tokens routed to each expert, ``(E,)`` float64 (what a training log shows
    and what the balance losses and :func:`balance_bias_update` read).

    ``invalid`` ``(N,)`` marks tokens whose scores held a NaN: where they went is unknown, so when
    there is one, every load is NaN.
    """
    n_experts = check_int("n_experts", n_experts, 1)
    indices = np.asarray(indices)
    if indices.dtype.kind not in "iu":
        raise TypeError(f"indices must be an integer array, got dtype {indices.dtype} with shape "
                        f"{indices.shape}")
    if indices.size and (indices.min() < 0 or indices.max() >= n_experts):
        raise ValueError(f"indices must lie in [0, {n_experts}), got values in "
                         f"[{indices.min()}, {indices.max()}] (shape {indices.shape})")
    load = np.bincount(indices.reshape(-1), minlength=n_experts).astype(np.float64)
    if invalid is not None and np.any(invalid):
        load[:] = np.nan
    return load


def _check_balance_inputs(probs, load, top_k):
    probs = float_array("probs", probs)
    check_ndim("probs", probs, 2, "(n_tokens, n_experts)")
    if probs.shape[0] == 0:
        raise ValueError(f"probs has no tokens (shape {probs.shape}): a balance loss averages "
                         "over them")
    load = float_array("load", load)
    if load.shape != (probs.shape[1],):
        raise ValueError(f"load must have shape ({probs.shape[1]},) to match probs.shape = "
                         f"{probs.shape} (n_experts), got load.shape = {load.shape}")
    top_k = check_int("top_k", top_k, 1, probs.shape[1])
    return probs, load, top_k


def _load_fractions(probs, load, top_k):
    """``f_i = E / (k N) * load_i``, in the dtype of ``probs``: 1 for every expert when the load is
    even."""
    n, e = probs.shape
    return (load * (e / (top_k * n))).astype(probs.dtype)


class ExpertBalanceLossCache(NamedTuple):
    f: np.ndarray  # (E,) the load fractions, constants of the loss
    n_tokens: int


def expert_balance_loss(probs, load, top_k: int):
    r"""DeepSeek's expert-level load-balancing loss (catalogue E5), without its coefficient.

    .. math::
        \mathcal L_{\text{ExpBal}} = \sum_{i=1}^{E} f_i P_i,\qquad
        f_i = \frac{E}{k N}\,\text{load}_i,\qquad P_i = \frac1N \sum_{n=1}^{N} p_{n,i}

    over ``N`` tokens, ``load_i`` the tokens routed to expert ``i`` (:func:`expert_load`) and
    :math:`p` the router's probabilities: the softmax scores, or for sigmoid scores those divided
    by their sum per token (the normalised scores of DeepSeek-V3's complementary balance loss).
    An even load gives every :math:`f_i = 1`, so with probabilities that sum to 1 per token the
    loss is then 1; it grows as probability and load pile on the same experts.

    Switch Transformer's and Mixtral's form, ``load_balancing_loss_func`` in transformers, is
    :math:`\frac{E}{N} \sum_i \text{load}_i P_i`, which is ``k`` times this
    (``tests/test_moe_torch.py`` checks the relation on the same logits).

    :math:`f` is a count of a selection, piecewise constant in the scores: no gradient flows
    through it, only through :math:`P`. Returns ``(loss, cache)``, ``loss`` a scalar of the dtype
    of ``probs`` ``(N, E)``; ``load`` is ``(E,)``.
    """
    probs, load, top_k = _check_balance_inputs(probs, load, top_k)
    f = _load_fractions(probs, load, top_k)
    loss = np.sum(f * probs.mean(axis=0))
    return loss, ExpertBalanceLossCache(f, probs.shape[0])


def expert_balance_loss_backward(dloss, cache: ExpertBalanceLossCache):
    r"""Gradient of :func:`expert_balance_loss`: ``dprobs`` ``(N, E)``,
    :math:`\partial \mathcal L / \partial p_{n,i} = f_i / N` for every token."""
    f, n = cache
    return np.broadcast_to(dloss * f / n, (n, f.shape[0])).copy()


class DeviceBalanceLossCache(NamedTuple):
    f_device: np.ndarray  # (D,) each device's mean load fraction
    group_size: int  # experts per device
    n_tokens: int


def device_balance_loss(probs, load, top_k: int, n_devices: int):
    r"""DeepSeek-V2's device-level balance loss (catalogue E5), without its coefficient: the
    experts split into ``n_devices`` equal groups of consecutive experts
    :math:`\mathcal E_1, \dots, \mathcal E_D`, one per device.

    .. math::
        \mathcal L_{\text{DevBal}} = \sum_{d=1}^{D} f'_d P'_d,\qquad
        f'_d = \frac{1}{|\mathcal E_d|} \sum_{i \in \mathcal E_d} f_i,\qquad
        P'_d = \sum_{i \in \mathcal E_d} P_i

    with :math:`f_i` and :math:`P_i` those of :func:`expert_balance_loss` (whose value this is at
    ``n_devices = E``). It evens the work of the devices and leaves the experts of one device free
    to specialise. As there, :math:`f` carries no gradient. Returns ``(loss, cache)``.
    """
    probs, load, top_k = _check_balance_inputs(probs, load, top_k)
    n_devices = check_int("n_devices", n_devices, 1)
    e = probs.shape[1]
    if e % n_devices:
        raise ValueError(f"n_devices = {n_devices} does not divide the {e} experts of probs "
                         f"(shape {probs.shape})")
    group = e // n_devices
    f_device = _load_fractions(probs, load, top_k).reshape(n_devices, group).mean(axis=1)
    p_device = probs.mean(axis=0).reshape(n_devices, group).sum(axis=1)
    loss = np.sum(f_device * p_device)
    return loss, DeviceBalanceLossCache(f_device, group, probs.shape[0])


def device_balance_loss_backward(dloss, cache: DeviceBalanceLossCache):
    r"""Gradient of :func:`device_balance_loss`: ``dprobs`` ``(N, E)``,
    :math:`\partial \mathcal L / \partial p_{n,i} = f'_{d(i)} / N` with :math:`d(i)` the device
    of expert ``i``."""
    f_device, group, n = cache
    per_expert = np.repeat(dloss * f_device / n, group)
    return np.broadcast_to(per_expert, (n, per_expert.shape[0])).copy()


class RouterZLossCache(NamedTuple):
    lse: np.ndarray  # (N, 1) logsumexp of each token's logits
    probs: np.ndarray  # (N, E) softmax of the logits


def router_z_loss(logits):
    r"""ST-MoE's router z-loss (catalogue E5), without its coefficient: the mean square of each
    token's log-partition function, which keeps the router's logits small (large logits round
    badly in low precision and make the softmax brittle).

    .. math::
        \mathcal L_z = \frac1N \sum_{n=1}^{N} \Big(\log \sum_{e=1}^{E} e^{z_{n,e}}\Big)^2

    ``logits`` ``(N, E)``; returns ``(loss, cache)``, ``loss`` a scalar of its dtype.
    """
    logits = float_array("logits", logits)
    check_ndim("logits", logits, 2, "(n_tokens, n_experts)")
    if logits.shape[0] == 0:
        raise ValueError(f"logits has no tokens (shape {logits.shape}): the z-loss averages over "
                         "them")
    m = logits.max(axis=-1, keepdims=True)
    lse = m + np.log(np.sum(np.exp(logits - m), axis=-1, keepdims=True))
    probs, _ = softmax_forward(logits)
    return np.mean(lse * lse), RouterZLossCache(lse, probs)


def router_z_loss_backward(dloss, cache: RouterZLossCache):
    r"""Gradient of :func:`router_z_loss`: ``dlogits``. The logsumexp's gradient is the softmax:

    .. math::
        \frac{\partial \mathcal L_z}{\partial z_{n,e}} = \frac{2}{N}\,
        \Big(\log \sum_u e^{z_{n,u}}\Big)\,\operatorname{softmax}(z_n)_e
    """
    lse, probs = cache
    return (dloss * 2.0 / lse.shape[0]) * lse * probs


def _token_normalise(scores):
    """Sigmoid scores divided by their sum per token, the probabilities the balance losses use."""
    total = scores.sum(axis=-1, keepdims=True)
    return scores / total, total


def _token_normalise_backward(dprobs, probs, total):
    """:math:`p = s / S`: :math:`ds_i = (dp_i - \\sum_j p_j dp_j) / S`."""
    return (dprobs - np.sum(probs * dprobs, axis=-1, keepdims=True)) / total


# ---- E6: the auxiliary-loss-free balancing -------------------------------------------------------

def balance_bias_update(bias, load, speed: float):
    r"""DeepSeek-V3's auxiliary-loss-free load balancing (catalogue E6): after each training step,
    lower the selection bias of every overloaded expert and raise that of every underloaded one.

    .. math::
        b_i \leftarrow b_i
            - \gamma\,\operatorname{sign}\!\big(\text{load}_i - \overline{\text{load}}\big)

    ``speed`` is the bias update speed :math:`\gamma` (0.001 for most of DeepSeek-V3's
    training), ``load`` the tokens each expert received in the step (:func:`expert_load`, or
    :attr:`MoECache.load`) and :math:`\overline{\text{load}}` their mean; an expert exactly at the
    mean keeps its bias. The bias only decides which experts are chosen (:func:`route`), a
    piecewise-constant function with no useful gradient, so it is steered by this rule instead,
    outside backpropagation (and is not handed to the optimiser). Returns the new bias, ``(E,)``
    in its dtype; a NaN load makes it NaN.
    """
    bias = float_array("bias", bias)
    check_ndim("bias", bias, 1, "(n_experts,)")
    load = float_array("load", load)
    if load.shape != bias.shape:
        raise ValueError(f"load must have the shape of bias, got load.shape = {load.shape} and "
                         f"bias.shape = {bias.shape}")
    speed = check_real("speed", speed, 0.0)
    step = np.sign(load - load.mean()).astype(bias.dtype)
    return bias - bias.dtype.type(speed) * step


# ---- E4: the MoE feed-forward --------------------------------------------------------------------

_LAYOUTS = {"router.w": "(d, n_experts)", "router.bias": "(n_experts,)",
            "experts.w_gate": "(n_experts, d, d_expert)",
            "experts.w_up": "(n_experts, d, d_expert)",
            "experts.w_down": "(n_experts, d_expert, d)", "shared.w_gate": "(d, d_shared)",
            "shared.w_up": "(d, d_shared)", "shared.w_down": "(d_shared, d)",
            "shared_gate.w": "(d, 1)"}


def _check_params(params, d: int, moe: MoEConfig) -> dict:
    """``params`` as a dict of float arrays with exactly the names and shapes of
    :func:`moe_param_shapes`."""
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict of arrays keyed like moe_param_shapes, got "
                        f"{type(params).__name__}")
    shapes = moe_param_shapes(d, moe)
    missing = [name for name in shapes if name not in params]
    unexpected = sorted(set(params) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"params must hold exactly {list(shapes)} for this MoEConfig; missing "
                         f"{missing}, unexpected {unexpected}")
    checked = {}
    for name, shape in shapes.items():
        value = float_array(f"params[{name!r}]", params[name])
        if value.shape != shape:
            raise ValueError(
                f"params[{name!r}] must have shape {_LAYOUTS[name]} = {shape} for x.shape[-1] = "
                f"{d}, n_experts = {moe.n_experts}, d_expert = {moe.d_expert}, d_shared = "
                f"{moe.shared_width}; got params[{name!r}].shape = {value.shape}")
        checked[name] = value
    return checked


class ExpertCache(NamedTuple):
    tokens: np.ndarray  # (n_e,) the rows of the flattened x this expert received
    gates: np.ndarray  # (n_e,) their gates
    out: np.ndarray  # (n_e, d) SwiGLU_e of those rows, before the gate (for the gate's gradient)
    swiglu: object  # refmath.ffn.SwiGLUCache


class MoECache(NamedTuple):
    """What :func:`moe_backward` needs, and what a training log reads: ``load`` (tokens per
    expert), ``aux_loss`` (the weighted auxiliary losses, to add to the model's loss),
    ``indices`` and ``gates`` (the routing of every token)."""

    moe: MoEConfig
    x_shape: tuple
    router: RouterScoresCache
    route: RouteCache
    indices: np.ndarray  # (N, k)
    gates: np.ndarray  # (N, k)
    experts: tuple  # ExpertCache per expert, None for an expert that received no token
    shared: object  # SwiGLUCache of the shared experts, or None
    shared_out: np.ndarray | None  # their output before the gate, (N, d), with shared_gate
    shared_gate: tuple | None  # (x rows, w, sigmoid(x w)) with shared_gate
    balance_probs: tuple | None  # (probs, per-token sums or None) when a balance loss is on
    aux: tuple  # ((coefficient, backward, cache, on the logits?), ...) of the losses that are on
    load: np.ndarray  # (E,) float: tokens routed to each expert (NaN: some token had a NaN score)
    aux_loss: object  # scalar of x's dtype: sum of coefficient * loss (0 when none is on)
    has_bias: bool


def moe_forward(x, params, moe, *, matmul=matmul_rows_many):
    r"""The mixture-of-experts feed-forward (catalogue E4), with its auxiliary losses (E5).

    .. math::
        y_n = \sum_{j=1}^{k} g_{n,j}\,E_{\mathcal T_{n,j}}(x_n)
              \;+\; \sigma(x_n w_g)\,S(x_n),\qquad
        E_e(x) = \big[\operatorname{SiLU}(x W^{(e)}_g) \odot (x W^{(e)}_u)\big] W^{(e)}_d

    with the router's scores (:func:`router_scores`, E1), the selection :math:`\mathcal T` and
    gates :math:`g` of :func:`route` (E2, E3), and the shared experts :math:`S`, one SwiGLU of
    width ``moe.shared_width`` that every token goes through (DeepSeek's ``n_shared_experts``
    experts side by side, Qwen2-MoE's ``shared_expert``). The factor :math:`\sigma(x w_g)` is
    Qwen2-MoE's shared-expert gate (``moe.shared_gate``); without it the shared output is added
    as it is. Each expert gathers the tokens routed to it, runs its SwiGLU on them alone, scales
    the result by their gates and adds it into their rows.

    **Auxiliary losses.** ``cache.aux_loss`` is

    .. math::
        \alpha_1 \mathcal L_{\text{ExpBal}} + \alpha_2 \mathcal L_{\text{DevBal}}
        + \alpha_z \mathcal L_z

    (``moe.balance_coef``, ``device_balance_coef``, ``z_coef``; a term whose coefficient is 0 is
    not computed), over the ``N`` tokens of ``x`` (all its leading axes; a sequence-wise loss is
    this op applied to one sequence). The balance losses read the load of the selection made and
    the router's probabilities: the softmax scores, or for sigmoid scoring the scores divided by
    their sum per token, as DeepSeek-V3's complementary sequence-wise loss does. The z-loss reads
    the logits. A model adds ``cache.aux_loss`` to its loss; :func:`moe_backward` includes its
    gradient.

    ``cache.load`` is the number of tokens routed to each expert (for the logs and for
    :func:`balance_bias_update`). A token whose router scores hold a NaN is weighted by NaN in
    every expert (see the module docstring): its output is NaN and the load is NaN.

    Shapes: ``x`` ``(..., d)``; ``params`` keyed as :func:`moe_param_shapes` (without the layer's
    prefix). Returns ``(y, cache)``, ``y`` of the shape of ``x``. ``matmul``: how the router's and
    the experts' products are computed, as in :func:`refmath.ffn.linear_forward`.
    """
    moe = _config(moe)
    x = float_array("x", x)
    check_min_ndim("x", x, 1, "(..., d)")
    d = x.shape[-1]
    params = _check_params(params, d, moe)
    n = math.prod(x.shape[:-1])
    rows = x.reshape(n, d)

    logits, scores, router = router_scores(rows, params["router.w"], moe.scoring,
                                           matmul=matmul)
    indices, gates, routing = route(scores, moe, params.get("router.bias"))
    # Which token goes to which expert, and with which gate. A token with no ranking (NaN
    # scores) goes to every expert, weighted by NaN: nothing it touches stays finite.
    sent = np.zeros((n, moe.n_experts), dtype=bool)
    np.put_along_axis(sent, indices, True, axis=1)
    sent[routing.invalid] = True
    weight = np.zeros((n, moe.n_experts), dtype=gates.dtype)
    np.put_along_axis(weight, indices, gates, axis=1)
    weight[routing.invalid] = np.nan

    w_gate, w_up = params["experts.w_gate"], params["experts.w_up"]
    w_down = params["experts.w_down"]
    y = np.zeros((n, d), dtype=np.result_type(rows, w_down, gates))
    experts = []
    for e in range(moe.n_experts):
        tokens = np.flatnonzero(sent[:, e])
        if tokens.size == 0:
            experts.append(None)
            continue
        out, swiglu = swiglu_forward(rows[tokens], w_gate[e], w_up[e], w_down[e],
                                     matmul=matmul)
        expert_gates = weight[tokens, e]
        y[tokens] += expert_gates[:, None] * out  # a token appears once per expert
        experts.append(ExpertCache(tokens, expert_gates, out, swiglu))

    shared = shared_out = shared_gate = None
    if moe.shared_width:
        shared_out, shared = swiglu_forward(rows, params["shared.w_gate"], params["shared.w_up"],
                                            params["shared.w_down"], matmul=matmul)
        if moe.shared_gate:
            w_g = params["shared_gate.w"]
            gate = sigmoid(matmul(rows, (w_g,))[0])  # (N, 1)
            y += gate * shared_out
            shared_gate = (rows, w_g, gate)
        else:
            y += shared_out
            shared_out = None  # only the gate's gradient needs it

    load = expert_load(indices, moe.n_experts, routing.invalid)
    aux_loss = y.dtype.type(0.0)
    aux, balance_probs = [], None
    if n and (moe.balance_coef or moe.device_balance_coef):
        probs, total = (scores, None) if moe.scoring == "softmax" else _token_normalise(scores)
        balance_probs = (probs, total)
        if moe.balance_coef:
            loss, cache = expert_balance_loss(probs, load, moe.top_k)
            aux.append((moe.balance_coef, expert_balance_loss_backward, cache, False))
            aux_loss = aux_loss + moe.balance_coef * loss
        if moe.device_balance_coef:
            loss, cache = device_balance_loss(probs, load, moe.top_k, moe.n_devices)
            aux.append((moe.device_balance_coef, device_balance_loss_backward, cache, False))
            aux_loss = aux_loss + moe.device_balance_coef * loss
    if n and moe.z_coef:
        loss, cache = router_z_loss(logits)
        aux.append((moe.z_coef, router_z_loss_backward, cache, True))
        aux_loss = aux_loss + moe.z_coef * loss

    cache = MoECache(moe, x.shape, router, routing, indices, gates, tuple(experts), shared,
                     shared_out, shared_gate, balance_probs, tuple(aux), load,
                     y.dtype.type(aux_loss), "router.bias" in params)
    return y.reshape(x.shape[:-1] + (d,)), cache


def moe_backward(dy, cache: MoECache, daux=1.0):
    r"""Gradients of :func:`moe_forward` (catalogue E4): returns ``(dx, grads)``, ``grads`` keyed
    like the parameters. ``daux`` is the gradient of the model's loss with respect to
    ``cache.aux_loss``: 1 when the aux loss is simply added to it (the default).

    Each expert is a SwiGLU applied to its tokens with their output scaled by the gates, so with
    :math:`o_{n} = E_e(x_n)`:

    .. math::
        do_n = g_{n,j}\, dy_n,\qquad
        dg_{n,j} = \langle dy_n,\, E_{\mathcal T_{n,j}}(x_n) \rangle

    and :math:`do` goes back through the expert's SwiGLU (N7) to its weights and to :math:`x_n`.
    The gates' gradient goes through :func:`route_backward` (the renormalisation's Jacobian; the
    selection itself has none) and :func:`router_scores_backward` to the router weight and
    :math:`x`, joined there by the auxiliary losses' gradients: :math:`\alpha f_i / N` on the
    probabilities (through the per-token normalisation for sigmoid scores) and the z-loss's on the
    logits. The shared experts' gate :math:`q = \sigma(x w_g)` gives
    :math:`dq_n = \langle dy_n, S(x_n)\rangle`, :math:`dw_g = \sum_n x_n^\top dq_n q_n (1 - q_n)`.

    ``router.bias`` gets a zero gradient: it changes only the selection, whose derivative is
    zero almost everywhere; :func:`balance_bias_update` moves it instead.
    """
    moe = cache.moe
    x_shape = cache.x_shape
    d = x_shape[-1]
    n = cache.indices.shape[0]
    dy = np.reshape(dy, (n, d))
    router = cache.router
    rows = router.x
    e_count = moe.n_experts
    dtype = np.result_type(dy, rows)

    grads = {"experts.w_gate": np.zeros((e_count, d, moe.d_expert), dtype=dtype),
             "experts.w_up": np.zeros((e_count, d, moe.d_expert), dtype=dtype),
             "experts.w_down": np.zeros((e_count, moe.d_expert, d), dtype=dtype)}
    dx = np.zeros((n, d), dtype=dtype)
    dweight = np.zeros((n, e_count), dtype=dtype)  # dg for every (token, expert) sent
    for e, expert in enumerate(cache.experts):
        if expert is None:
            continue
        dy_e = dy[expert.tokens]
        dweight[expert.tokens, e] = np.sum(dy_e * expert.out, axis=-1)
        dx_e, dw_g, dw_u, dw_d = swiglu_backward(expert.gates[:, None] * dy_e, expert.swiglu)
        dx[expert.tokens] += dx_e
        grads["experts.w_gate"][e] = dw_g
        grads["experts.w_up"][e] = dw_u
        grads["experts.w_down"][e] = dw_d

    dscores = route_backward(np.take_along_axis(dweight, cache.indices, axis=1), cache.route)
    dlogits = None
    for coefficient, backward, aux_cache, on_logits in cache.aux:
        grad = backward(daux * coefficient, aux_cache)
        if on_logits:  # the z-loss
            dlogits = grad
            continue
        probs, total = cache.balance_probs  # a balance loss: its gradient is on the probabilities
        if total is not None:  # sigmoid scores: back through their per-token normalisation
            grad = _token_normalise_backward(grad, probs, total)
        dscores = dscores + grad
    dx_router, dw_router = router_scores_backward(dscores, router, dlogits)
    dx += dx_router
    grads = {"router.w": dw_router, **grads}
    if cache.has_bias:
        grads["router.bias"] = np.zeros(e_count, dtype=dtype)

    if cache.shared is not None:
        dshared = dy
        if cache.shared_gate is not None:
            gate_rows, w_g, gate = cache.shared_gate
            dshared = gate * dy
            dz = np.sum(dy * cache.shared_out, axis=-1, keepdims=True) * gate * (1.0 - gate)
            grads["shared_gate.w"] = gate_rows.T @ dz
            dx += dz @ w_g.T
        dx_s, dw_g, dw_u, dw_d = swiglu_backward(dshared, cache.shared)
        dx += dx_s
        grads.update({"shared.w_gate": dw_g, "shared.w_up": dw_u, "shared.w_down": dw_d})
    order = moe_param_shapes(d, moe)
    return dx.reshape(x_shape), {name: grads[name] for name in order}


# ---- gradient-check cases ------------------------------------------------------------------------

# The stencil of refmath.gradcheck moves one input entry at a time, by up to 4 h = 4e-3 (h = 1e-3,
# its default step). The selection must not change within that reach, or the finite differences
# straddle a jump of the output. A routing case therefore draws inputs whose routing_margin exceeds
# what such a move can do to it:
# - one score moved by delta moves one choice score by delta (a route case's own input, or a bias);
# - one entry of x or of the router weight moved by delta moves each logit by at most |delta| L,
#   L the largest entry of the other factor, and a score by at most half of that (a softmax:
#   sum_e |ds_j / dz_e| = 2 s_j (1 - s_j) <= 1/2; a sigmoid: s (1 - s) <= 1/4).
# So no choice score moves by more than c = 4e-3 max(L / 2, 1); a gap between two of them by at
# most 2 c, and one between two sums of two (noaux_tc's group scores) by at most 4 c. A margin
# above 4 c keeps every selection of the case.
_REACH = 4e-3


def _required_margin(largest_factor: float = 0.0) -> float:
    """4 c with c the farthest a choice score can move (see above); ``largest_factor`` is L."""
    return 4.0 * _REACH * max(largest_factor / 2.0, 1.0)


def _draw_with_margin(rng, draw, margin_and_required, tries: int = 10_000) -> dict:
    """``draw(rng)`` again until ``margin_and_required(inputs)`` gives a margin above the required
    one; the returned inputs are asserted to have it."""
    for _ in range(tries):
        inputs = draw(rng)
        margin, required = margin_and_required(inputs)
        if margin > required:
            return inputs
    raise RuntimeError(f"no draw in {tries} had a routing margin above {required:.3g}")


def _probs(rng, shape):
    return softmax_forward(2.0 * rng.standard_normal(shape))[0]


def _route_inputs(moe: MoEConfig, n_tokens: int = 5):
    def draw(rng):
        logits = 2.0 * rng.standard_normal((n_tokens, moe.n_experts))
        scores = softmax_forward(logits)[0] if moe.scoring == "softmax" else sigmoid(logits)
        bias = 0.1 * rng.standard_normal(moe.n_experts) if moe.score_bias else None
        return {"scores": scores, "moe": moe, "bias": bias}

    def margin(inputs):
        return routing_margin(inputs["scores"], moe, inputs["bias"]), _required_margin()
    return lambda rng: _draw_with_margin(rng, draw, margin)


def _route_case_forward(scores, moe, bias=None):
    _, gates, cache = route(scores, moe, bias)
    return gates, cache


def _route_case_backward(dgates, cache):
    dscores = route_backward(dgates, cache)
    # the bias only selects: its gradient is zero (the case checks it against the differences)
    return {"scores": dscores, "bias": np.zeros(cache.n_experts, dtype=dscores.dtype)}


def _moe_inputs(moe: MoEConfig, shape: tuple):
    d = shape[-1]

    def draw(rng):
        scale, down = 1.0 / math.sqrt(d), 1.0 / math.sqrt(moe.d_expert)
        params = {}
        for name, p_shape in moe_param_shapes(d, moe).items():
            fan_in = down if name == "experts.w_down" else scale
            if name == "shared.w_down":
                fan_in = 1.0 / math.sqrt(moe.shared_width)
            params[name] = fan_in * rng.standard_normal(p_shape)
        # logits of order 2 spread the scores, so that fewer draws fall near a tie
        params["router.w"] = 2.0 * scale * rng.standard_normal((d, moe.n_experts))
        if moe.score_bias:
            params["router.bias"] = 0.1 * rng.standard_normal(moe.n_experts)
        return {"x": rng.standard_normal(shape), "config": moe, **params}

    def margin(inputs):
        scores = router_scores(inputs["x"].reshape(-1, d), inputs["router.w"], moe.scoring)[1]
        largest = max(np.abs(inputs["x"]).max(), np.abs(inputs["router.w"]).max())
        return routing_margin(scores, moe, inputs.get("router.bias")), _required_margin(largest)
    return lambda rng: _draw_with_margin(rng, draw, margin)


def _moe_case_forward(x, config, **params):
    """The layer's output and its aux loss as one array, so that the check sees both."""
    y, cache = moe_forward(x, params, config)
    return np.concatenate([y.reshape(-1), np.reshape(cache.aux_loss, 1)]), cache


def _moe_case_backward(dout, cache):
    dx, grads = moe_backward(dout[:-1].reshape(cache.x_shape), cache, daux=dout[-1])
    return {"x": dx, **grads}


def _router_case_forward(x, w, scoring):
    _, scores, cache = router_scores(x, w, scoring)
    return scores, cache


def _balance_inputs(n_tokens, n_experts, top_k, **extra):
    def make(rng):
        probs = _probs(rng, (n_tokens, n_experts))
        load = expert_load(_top(probs, top_k), n_experts)
        return {"probs": probs, "load": load, "top_k": top_k, **extra}
    return make


for _scoring in SCORINGS:
    register_case(OpCase("moe_router", f"{_scoring} (2, 3, 8) -> 8 experts", ("E1",),
                         lambda rng: {"x": rng.standard_normal((2, 3, 8)),
                                      "w": 0.7 * rng.standard_normal((8, 8)), "scoring": _scoring},
                         _router_case_forward, router_scores_backward, ("x", "w")))

_ROUTES = {
    "greedy top-2 of 8, renormalised (Mixtral)": MoEConfig(n_experts=8, top_k=2, d_expert=1,
                                                           norm_topk=True),
    "greedy top-3 of 8, scaled by 16 (DeepSeek-V2)": MoEConfig(n_experts=8, top_k=3, d_expert=1,
                                                               scaling=16.0),
    "group-limited top-3 of 8 in 4 groups, 2 kept": MoEConfig(
        n_experts=8, top_k=3, d_expert=1, routing="group_limited_greedy", n_groups=4,
        topk_groups=2),
    "noaux_tc sigmoid with bias, top-2 of 8 in 4 groups, 2 kept, renormalised, scaled by 2.5":
        MoEConfig(n_experts=8, top_k=2, d_expert=1, scoring="sigmoid", routing="noaux_tc",
                  n_groups=4, topk_groups=2, norm_topk=True, scaling=2.5, score_bias=True),
}
for _label, _moe in _ROUTES.items():
    register_case(OpCase("moe_route", _label, ("E2", "E3"), _route_inputs(_moe),
                         _route_case_forward, _route_case_backward,
                         ("scores", "bias") if _moe.score_bias else ("scores",)))

register_case(OpCase("moe_balance_loss", "expert level, top-2 of 8, 6 tokens", ("E5",),
                     _balance_inputs(6, 8, 2), expert_balance_loss, expert_balance_loss_backward,
                     ("probs",)))
register_case(OpCase("moe_device_balance_loss", "4 devices, top-2 of 8, 6 tokens", ("E5",),
                     _balance_inputs(6, 8, 2, n_devices=4), device_balance_loss,
                     device_balance_loss_backward, ("probs",)))
register_case(OpCase("moe_z_loss", "6 tokens, 8 experts", ("E5",),
                     lambda rng: {"logits": 2.0 * rng.standard_normal((6, 8))}, router_z_loss,
                     router_z_loss_backward, ("logits",)))

_LAYERS = {
    "Mixtral: softmax top-2 of 8, renormalised (2, 3, 8)": (
        MoEConfig(n_experts=8, top_k=2, d_expert=6, norm_topk=True), (2, 3, 8)),
    "Qwen2-MoE: softmax top-2 of 8, gated shared expert, balance and z-loss (6, 8)": (
        MoEConfig(n_experts=8, top_k=2, d_expert=4, d_shared=6, shared_gate=True,
                  balance_coef=0.1, z_coef=0.01), (6, 8)),
    "DeepSeek-V2: group-limited top-3 of 8, 2 shared, scaled by 2, expert and device balance "
    "(1, 2, 3, 8)": (
        MoEConfig(n_experts=8, top_k=3, d_expert=4, routing="group_limited_greedy", n_groups=4,
                  topk_groups=2, n_shared=2, scaling=2.0, balance_coef=0.05,
                  device_balance_coef=0.05, n_devices=4), (1, 2, 3, 8)),
    "DeepSeek-V3: sigmoid noaux_tc with bias, top-2 of 8, renormalised, scaled by 2.5, 1 shared, "
    "balance (2, 3, 8)": (
        MoEConfig(n_experts=8, top_k=2, d_expert=4, scoring="sigmoid", routing="noaux_tc",
                  n_groups=4, topk_groups=2, norm_topk=True, scaling=2.5, n_shared=1,
                  score_bias=True, balance_coef=0.1), (2, 3, 8)),
}
for _label, (_moe, _shape) in _LAYERS.items():
    _aux = _moe.balance_coef or _moe.device_balance_coef or _moe.z_coef
    register_case(OpCase("moe", _label, ("E1", "E2", "E3", "E4") + (("E5",) if _aux else ()),
                         _moe_inputs(_moe, _shape), _moe_case_forward, _moe_case_backward,
                         ("x", *moe_param_shapes(_shape[-1], _moe)), max_coords=12))
