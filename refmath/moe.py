r"""The mixture-of-experts feed-forward (catalogue E1-E8): a router picks ``k`` of ``E`` SwiGLU
experts for each token, and the token's output is their weighted sum, plus shared experts that
every token uses.

.. math::
    s = \sigma(x W_r),\qquad \mathcal T = \operatorname{TopK}(s + b, k),\qquad
    y = \sum_{e \in \mathcal T} g_e\, \operatorname{SwiGLU}_e(x)\ +\ \operatorname{SwiGLU}_s(x)

with :math:`\sigma` a softmax (Mixtral, DeepSeek-V2, Qwen-MoE) or an elementwise sigmoid
(DeepSeek-V3), :math:`b` DeepSeek-V3's selection bias (it picks, it never weights), and the gates
:math:`g_e = \rho\, s_e / (\sum_{\mathcal T} s)` or :math:`\rho\, s_e` (``norm_topk``, ``scaling``).

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

from dataclasses import dataclass

from refmath._validate import check_choice, check_field, check_flag, check_int, check_real

SCORINGS = ("softmax", "sigmoid")
# Hugging Face's topk_method names: plain top-k; DeepSeek-V2's groups ranked by their best score;
# DeepSeek-V3's groups ranked by the sum of their two best (biased) scores.
ROUTINGS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """The mixture-of-experts feed-forward of a decoder. ``dataclasses.asdict`` round-trips.

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
    training loss.
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
        for name in ("balance_coef", "device_balance_coef", "z_coef"):
            check_field(self, name, check_real, 0.0)
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
    if value is None or isinstance(value, MoEConfig):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a MoEConfig, a dict of its fields or None, got "
                        f"{type(value).__name__}")
    unknown = sorted(set(value) - set(MoEConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"{name} has unknown field(s) {unknown}; the fields are "
                         f"{sorted(MoEConfig.__dataclass_fields__)}")
    return MoEConfig(**value)


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
