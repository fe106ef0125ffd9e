"""Every registered op against PyTorch autograd, the independent oracle.

For each case of the registry the same float64 inputs go through refmath and through a PyTorch
mirror written with torch's own layers and functions; the outputs and every input/parameter
gradient (for the same random upstream gradient) must agree to float64 rounding. PyTorch stores
linear weights as ``out x in``, so mirrors hand refmath's ``in x out`` weights to torch transposed.

torch is an optional test dependency (the ``oracle`` extra): without it this module is skipped.
"""
import numpy as np
import pytest

from refmath.gradcheck import all_cases

torch = pytest.importorskip("torch", reason="PyTorch is the oracle; install the 'oracle' extra")
F = torch.nn.functional

from _torch_moe import balance_loss, moe_route, torch_moe  # noqa: E402  (needs torch)


def _softmax(x):
    """On a row of only -inf torch.softmax gives NaN where refmath gives zeros with zero gradient:
    clamp -inf to the most negative float (clamp passes no gradient to clamped entries), then zero
    the masked entries."""
    return torch.softmax(x.clamp(min=torch.finfo(x.dtype).min), -1) * ~torch.isneginf(x)


def _sdpa(q, k, v, mask=None, dropout_mask=None, scale=None, softcap=None):
    """torch's own SDPA, which also gives a zero row to a query that sees no key. With a dropout
    mask or a logit cap the weights are formed explicitly, since torch would draw its own mask and
    has no cap; the cap is Gemma 2's eager attention in transformers: scores times the scale,
    divided by the cap, tanh, times the cap, and only then the mask."""
    if dropout_mask is None and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    weights = _softmax(scores + (0.0 if mask is None else mask))
    return weights @ v if dropout_mask is None else (weights * dropout_mask) @ v


def _mha(x, n_heads, n_kv_heads, context=None, mask=None, dropout_mask=None, **p):
    """Projections with F.linear (refmath's (in, out) weights transposed to torch's (out, in)),
    heads split as (..., T, n d_h) -> (..., n, T, d_h), each shared K/V head repeated for its h/g
    query heads with repeat_interleave, heads concatenated back and projected by W_O."""
    source = x if context is None else context
    if "w_qkv" in p:
        d_h = p["w_qkv"].shape[1] // (n_heads + 2 * n_kv_heads)
        q, k, v = F.linear(x, p["w_qkv"].T, p.get("b_qkv")).split(
            [n_heads * d_h, n_kv_heads * d_h, n_kv_heads * d_h], dim=-1)
    else:
        q = F.linear(x, p["w_q"].T, p.get("b_q"))
        k = F.linear(source, p["w_k"].T, p.get("b_k"))
        v = F.linear(source, p["w_v"].T, p.get("b_v"))

    def heads(t, n):
        return t.unflatten(-1, (n, -1)).transpose(-3, -2).repeat_interleave(n_heads // n, dim=-3)

    o = _sdpa(heads(q, n_heads), heads(k, n_kv_heads), heads(v, n_kv_heads), mask, dropout_mask)
    return F.linear(o.transpose(-3, -2).flatten(-2), p["w_o"].T, p.get("b_o"))


def _rope(x, offset=0, base=10000.0, positions=None, inv_freq=None, attention_factor=1.0):
    """RoPE as complex multiplication (LLaMA's formulation): the pair (x_2r, x_2r+1) is the complex
    number x_2r + i x_2r+1, multiplied by m e^{i p omega_r} with omega_r = base^(-2r/d_k) (or the
    given inv_freq of a context-extension rule, with its attention factor m)."""
    if positions is None:
        positions = torch.arange(offset, offset + x.shape[-2])
    omega = (1.0 / base ** (torch.arange(0, x.shape[-1], 2, dtype=x.dtype) / x.shape[-1])
             if inv_freq is None else inv_freq)
    rotation = torch.polar(torch.full((), attention_factor, dtype=x.dtype),
                           torch.outer(positions.to(x.dtype), omega))
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2))
    return torch.view_as_real(pairs * rotation).reshape(x.shape)


def _moe(x, config, **p):
    """The MoE layer's case output: y and the aux loss in one vector (see tests/_torch_moe.py)."""
    y, aux = torch_moe(x, config, p)
    return torch.cat([y.reshape(-1), aux.reshape(1)])


# ---- mirrors: op name -> function of the case's inputs (as torch tensors) returning the output ----

MIRRORS = {
    "layernorm": lambda x, gamma, beta: F.layer_norm(x, x.shape[-1:], gamma, beta, eps=1e-5),
    "rmsnorm": lambda x, gamma: F.rms_norm(x, x.shape[-1:], gamma, eps=1e-6),
    # ---- softmax and attention mirrors ----
    "softmax": _softmax,
    # refmath: -inf at masked entries (constants, no gradient), zeros on fully masked rows
    "log_softmax": lambda x: torch.where(
        torch.isneginf(x).all(-1, keepdim=True), 0.0,
        torch.where(torch.isneginf(x), -torch.inf,
                    torch.log_softmax(x.clamp(min=torch.finfo(x.dtype).min), -1))),
    "sdpa": _sdpa,
    "mha": _mha,
    # ---- ffn, positions, embedding and loss mirrors ----
    "linear": lambda x, w, b: F.linear(x, w.T, b),
    "relu": lambda x: F.relu(x),
    "gelu": lambda x, approximate: F.gelu(x, approximate="tanh" if approximate else "none"),
    "silu": lambda x: F.silu(x),
    # the FFN as two nn.Linear-style F.linear calls around torch's own activation
    "ffn": lambda x, w1, b1, w2, b2, activation: F.linear(
        {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
         "identity": lambda h: h}[activation](F.linear(x, w1.T, b1)), w2.T, b2),
    "swiglu": lambda x, w_gate, w_up, w_down: F.linear(
        F.silu(F.linear(x, w_gate.T)) * F.linear(x, w_up.T), w_down.T),
    # Gemma's MLP: down(gelu_pytorch_tanh(gate(x)) * up(x))
    "geglu": lambda x, w_gate, w_up, w_down: F.linear(
        F.gelu(F.linear(x, w_gate.T), approximate="tanh") * F.linear(x, w_up.T), w_down.T),
    "softcap": lambda x, cap: torch.tanh(x / cap) * cap,
    "learned_positions": lambda x, table, offset: x + table[offset:offset + x.shape[-2]],
    "rope": _rope,
    "embedding": lambda ids, table, scale_by_sqrt_d: F.embedding(ids, table) * (
        table.shape[-1] ** 0.5 if scale_by_sqrt_d else 1.0),
    # ---- mixture of experts ----
    "moe_router": lambda x, w, scoring: (torch.softmax(x @ w, -1) if scoring == "softmax"
                                         else torch.sigmoid(x @ w)),
    "moe_route": lambda scores, moe, bias=None: moe_route(scores, moe, bias)[1],
    "moe_balance_loss": balance_loss,
    "moe_device_balance_loss": balance_loss,
    "moe_z_loss": lambda logits: (torch.logsumexp(logits, -1) ** 2).mean(),
    "moe": _moe,
    # a loss mask is the same as marking the masked targets with ignore_index
    "cross_entropy": lambda logits, targets, ignore_index=-100, loss_mask=None, label_smoothing=0.0,
                            reduction="mean": (
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                        (targets if loss_mask is None
                         else torch.where(loss_mask.bool(), targets, ignore_index)).reshape(-1),
                        ignore_index=ignore_index, label_smoothing=label_smoothing,
                        reduction=reduction)),
}


def _to_torch(name, value, wrt):
    if isinstance(value, np.ndarray):
        tensor = torch.from_numpy(value.copy())
        if name in wrt:
            tensor.requires_grad_(True)
        return tensor
    return value


CASES = all_cases()


def test_every_op_has_a_mirror():
    missing = sorted({case.op for case in CASES} - set(MIRRORS))
    assert not missing, f"ops without a PyTorch mirror: {missing}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_and_gradients_match_torch(case):
    if case.op not in MIRRORS:
        pytest.fail(f"no PyTorch mirror for {case.op}")
    rng = np.random.default_rng(1)
    inputs = case.make_inputs(rng)
    out, cache = case.forward(**inputs)
    dout = rng.standard_normal(np.shape(out))
    grads = case.grads_by_name(case.backward(dout, cache))

    tensors = {name: _to_torch(name, value, case.wrt) for name, value in inputs.items()}
    torch_out = MIRRORS[case.op](**tensors)
    np.testing.assert_allclose(out, torch_out.detach().numpy(), rtol=1e-10, atol=1e-12,
                               err_msg=f"{case.name}: forward")
    torch_out.backward(torch.from_numpy(dout))
    for name in case.wrt:
        torch_grad = tensors[name].grad
        expected = np.zeros_like(inputs[name]) if torch_grad is None else torch_grad.numpy()
        np.testing.assert_allclose(grads[name], expected, rtol=1e-9, atol=1e-12,
                                   err_msg=f"{case.name}: gradient of {name}")
