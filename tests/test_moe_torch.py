"""The MoE feed-forward against Hugging Face transformers' own MoE blocks (catalogue E1-E5).

Each family's block (``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``, ``DeepseekV2Moe``,
``DeepseekV3MoE``) is built from a tiny config, given refmath's weights, and run on the same
tokens; its output and, through torch autograd, the gradients of the tokens and of every weight
must equal refmath's to float64 rounding. This is the evidence that the routing (the softmax or
sigmoid, the groups, the bias, the renormalisation and the scaling) is theirs.

transformers computes the router in float32 whatever the model's dtype (``.float()``,
``softmax(dtype=torch.float)``, ``.type(torch.float32)``, float32 router weights and bias). The
blocks are built and run under :class:`Float32AsFloat64`, a torch function mode that turns each
of those requests into float64, so the comparison is at float64 rounding rather than at float32's.
Their code is otherwise untouched.

transformers 5 stores the experts as 3-D tensors: ``gate_up_proj`` ``(E, 2 d_e, d)`` (the gate's
rows, then the up projection's) and ``down_proj`` ``(E, d, d_e)``, each applied as
``F.linear(x, W)``, that is ``x W^T``; refmath's ``(E, d, d_e)`` and ``(E, d_e, d)`` are their
transposes. The router's ``weight`` is ``(E, d)``, refmath's ``router.w`` transposed.
"""
import numpy as np
import pytest

from refmath.moe import (MoEConfig, _moe_inputs, expert_balance_loss, expert_load, moe_backward,
                         moe_forward, route)
from refmath.softmax import softmax_forward

torch = pytest.importorskip(
    "torch", reason="PyTorch runs the transformers blocks: install the 'oracle' extra")
pytest.importorskip(
    "transformers", reason="the blocks under test are transformers' own: pip install 'transformers>=5'")
from torch.overrides import TorchFunctionMode  # noqa: E402
from transformers import (DeepseekV2Config, DeepseekV3Config, MixtralConfig,  # noqa: E402
                          Qwen2MoeConfig)
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import (MixtralSparseMoeBlock,  # noqa: E402
                                                          load_balancing_loss_func)
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock  # noqa: E402

D, SHAPE = 8, (2, 3, 8)
# float64 rounding: every output and gradient entry is a short sum (d = 8, d_e <= 6, k <= 3
# terms) of products of O(1) numbers, so the two computations differ by a few units of 2.2e-16
# of the largest entry; 1e-14 is some 45 of them.
TOLERANCE = 1e-14


class Float32AsFloat64(TorchFunctionMode):
    """Every torch call made under this mode that asks for float32 gets float64 instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        def wider(value):
            return torch.float64 if value is torch.float32 else value

        if func is torch.Tensor.float:
            func = torch.Tensor.double
        return func(*[wider(a) for a in args], **{k: wider(v) for k, v in (kwargs or {}).items()})


@pytest.fixture
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with Float32AsFloat64():
            yield
    finally:
        torch.set_default_dtype(previous)


def _block(module_class, config):
    """The block running the experts' loop of its own modeling file (``"eager"``), not another
    implementation of transformers' experts interface."""
    config._experts_implementation = "eager"
    return module_class(config)


def _tensor(array):
    return torch.from_numpy(np.ascontiguousarray(array))


def _set(parameter, array):
    parameter.data = _tensor(array)


def _load(block, params):
    """refmath's parameters into a transformers MoE block (the module docstring's layouts)."""
    experts = block.experts
    _set(experts.gate_up_proj, np.concatenate([params["experts.w_gate"], params["experts.w_up"]],
                                              axis=2).transpose(0, 2, 1))
    _set(experts.down_proj, params["experts.w_down"].transpose(0, 2, 1))
    _set(block.gate.weight, params["router.w"].T)
    if "router.bias" in params:
        block.gate.e_score_correction_bias = _tensor(params["router.bias"])
    shared = getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)
    if shared is not None:
        _set(shared.gate_proj.weight, params["shared.w_gate"].T)
        _set(shared.up_proj.weight, params["shared.w_up"].T)
        _set(shared.down_proj.weight, params["shared.w_down"].T)
    if "shared_gate.w" in params:
        _set(block.shared_expert_gate.weight, params["shared_gate.w"].T)


def _gradients(block, params):
    """The gradients of a block's weights, in refmath's names and layouts."""
    f = params["experts.w_gate"].shape[2]
    gate_up = block.experts.gate_up_proj.grad.numpy().transpose(0, 2, 1)
    grads = {"router.w": block.gate.weight.grad.numpy().T, "experts.w_gate": gate_up[..., :f],
             "experts.w_up": gate_up[..., f:],
             "experts.w_down": block.experts.down_proj.grad.numpy().transpose(0, 2, 1)}
    shared = getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)
    if shared is not None:
        grads.update({"shared.w_gate": shared.gate_proj.weight.grad.numpy().T,
                      "shared.w_up": shared.up_proj.weight.grad.numpy().T,
                      "shared.w_down": shared.down_proj.weight.grad.numpy().T})
    if "shared_gate.w" in params:
        grads["shared_gate.w"] = block.shared_expert_gate.weight.grad.numpy().T
    return grads


def _relative(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _assert_block_matches(block, moe: MoEConfig, seed: int):
    inputs = _moe_inputs(moe, SHAPE)(np.random.default_rng(seed))  # routing margins, as the cases
    x = inputs.pop("x")
    inputs.pop("config")
    params = inputs
    y, cache = moe_forward(x, params, moe)
    dy = np.random.default_rng(seed + 1).standard_normal(y.shape)
    dx, grads = moe_backward(dy, cache)

    _load(block, params)
    x_t = _tensor(x).requires_grad_(True)
    y_t = block(x_t)
    assert _relative(y, y_t.detach().numpy()) <= TOLERANCE
    (y_t * _tensor(dy)).sum().backward()
    assert _relative(dx, x_t.grad.numpy()) <= TOLERANCE, "dx"
    theirs = _gradients(block, params)
    for name, grad in theirs.items():
        assert _relative(grads[name], grad) <= TOLERANCE, name
    # the bias only selects: transformers keeps it as a buffer, refmath gives it a zero gradient
    assert set(grads) - set(theirs) <= {"router.bias"}
    if "router.bias" in grads:
        assert not np.any(grads["router.bias"])


def test_mixtral_block_softmax_top2_renormalised(float64):
    config = MixtralConfig(hidden_size=D, intermediate_size=6, num_local_experts=8,
                           num_experts_per_tok=2, router_jitter_noise=0.0)
    moe = MoEConfig(n_experts=8, top_k=2, d_expert=6, norm_topk=True)
    _assert_block_matches(_block(MixtralSparseMoeBlock, config), moe, seed=0)


@pytest.mark.parametrize("norm_topk", [False, True])
def test_qwen2_moe_block_with_its_gated_shared_expert(float64, norm_topk):
    config = Qwen2MoeConfig(hidden_size=D, moe_intermediate_size=4,
                            shared_expert_intermediate_size=6, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=norm_topk)
    moe = MoEConfig(n_experts=8, top_k=2, d_expert=4, d_shared=6, shared_gate=True,
                    norm_topk=norm_topk)
    _assert_block_matches(_block(Qwen2MoeSparseMoeBlock, config), moe, seed=1)


@pytest.mark.parametrize("routing", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_block_scaled_with_shared_experts(float64, routing):
    config = DeepseekV2Config(hidden_size=D, num_attention_heads=2, moe_intermediate_size=4,
                              n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
                              topk_method=routing, n_group=4, topk_group=2,
                              routed_scaling_factor=16.0)
    moe = MoEConfig(n_experts=8, top_k=3, d_expert=4, routing=routing, n_groups=4,
                    topk_groups=2, n_shared=2, scaling=16.0)
    _assert_block_matches(_block(DeepseekV2Moe, config), moe, seed=2)


@pytest.mark.parametrize("norm_topk", [True, False])
def test_deepseek_v3_block_sigmoid_noaux_tc_with_bias(float64, norm_topk):
    config = DeepseekV3Config(hidden_size=D, num_attention_heads=2, moe_intermediate_size=4,
                              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                              n_group=4, topk_group=2, norm_topk_prob=norm_topk,
                              routed_scaling_factor=2.5)
    moe = MoEConfig(n_experts=8, top_k=2, d_expert=4, scoring="sigmoid", routing="noaux_tc",
                    n_groups=4, topk_groups=2, norm_topk=norm_topk, scaling=2.5, n_shared=1,
                    score_bias=True)
    _assert_block_matches(_block(DeepseekV3MoE, config), moe, seed=3)


def test_the_bias_changes_the_choice_in_both(float64):
    """A bias that favours one expert strongly makes every token choose it, in refmath and in
    transformers alike, while the gates still come from the unbiased scores."""
    config = DeepseekV3Config(hidden_size=D, num_attention_heads=2, moe_intermediate_size=4,
                              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                              n_group=4, topk_group=2, norm_topk_prob=True,
                              routed_scaling_factor=2.5)
    moe = MoEConfig(n_experts=8, top_k=2, d_expert=4, scoring="sigmoid", routing="noaux_tc",
                    n_groups=4, topk_groups=2, norm_topk=True, scaling=2.5, n_shared=1,
                    score_bias=True)
    inputs = _moe_inputs(moe, SHAPE)(np.random.default_rng(4))
    inputs["router.bias"] = np.where(np.arange(8) == 5, 2.0, 0.0)  # sigmoids lie in (0, 1)
    x = inputs.pop("x")
    inputs.pop("config")
    _, cache = moe_forward(x, inputs, moe)
    assert (cache.indices == 5).any(axis=-1).all()
    block = _block(DeepseekV3MoE, config)
    _load(block, inputs)
    _, _, theirs = block.gate(_tensor(x))
    np.testing.assert_array_equal(np.sort(cache.indices, axis=-1), np.sort(theirs.numpy(), axis=-1))


def test_expert_balance_loss_is_mixtrals_load_balancing_loss_over_k(float64):
    """transformers' Switch/Mixtral loss is E/N sum_i load_i P_i; DeepSeek's L_ExpBal divides the
    load by k as well (f_i = E/(kN) load_i), so on the same logits theirs is k times ours."""
    rng = np.random.default_rng(5)
    n, e, k = 40, 8, 2
    logits = 2.0 * rng.standard_normal((n, e))
    probs, _ = softmax_forward(logits)
    indices, _, _ = route(probs, MoEConfig(n_experts=e, top_k=k, d_expert=1))
    ours, _ = expert_balance_loss(probs, expert_load(indices, e), k)
    theirs = load_balancing_loss_func((_tensor(logits),), num_experts=e, top_k=k)
    assert float(theirs) == pytest.approx(k * float(ours), rel=TOLERANCE)
