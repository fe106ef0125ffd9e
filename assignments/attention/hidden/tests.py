"""Hidden tests of the attention assignment.

Expected values come from PyTorch autograd in float64 (forward and gradients), from the head map's
definition, and from properties (a query with no visible key gets a zero row). Nothing here calls
the reference solution: ``check`` never imports refmath's attention, and ``run``, whose source and
inputs alone reach the sandbox, calls the submission's.
"""
import math

import numpy as np

from refmath.assignments.checks import (Case, all_of, compare, exact, hidden_test, normal,
                                        numpy_of, shapes, torch_tensors)

NEG_INF = -np.inf


def additive(allowed):
    """0 where a key is visible, -inf where it is not."""
    return np.where(allowed, 0.0, NEG_INF)


def causal(t_q, t_k):
    # query i is the (t_k - t_q + i)-th position; it sees keys up to there
    return additive(np.tril(np.ones((t_q, t_k), dtype=bool), k=t_k - t_q))


def torch_attention(q, k, v, mask=None, drop=None, scale=None):
    """softmax(q k^T * scale + mask) (times the dropout multiplier) @ v, in torch."""
    import torch
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + torch.as_tensor(mask, dtype=torch.float64)
    weights = torch.softmax(scores, dim=-1)
    if drop is not None:
        weights = weights * torch.as_tensor(drop, dtype=torch.float64)
    return torch.matmul(weights, v)


def torch_grads(forward, arrays, dout):
    """Gradients of sum(forward(*arrays) * dout) with respect to each array."""
    import torch
    tensors = torch_tensors(*arrays)
    out = forward(*tensors)
    (out * torch.as_tensor(dout)).sum().backward()
    return numpy_of(out), [numpy_of(t.grad) for t in tensors]


def case_out(out, i):
    """The outputs of the i-th case of a run (keys ``"i:name"``) under their own names."""
    prefix = f"{i}:"
    return {key[len(prefix):]: value for key, value in out.items() if key.startswith(prefix)}


# ---- sdpa_forward ------------------------------------------------------------------------------

@hidden_test("sdpa_forward: batched heads, no mask (torch)")
def sdpa_forward_plain():
    q, k, v = normal(1, (2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6))

    def run(q, k, v):
        from refmath.attention import sdpa_forward
        return {"o": sdpa_forward(q, k, v)[0]}

    def check(out):
        expected = numpy_of(torch_attention(*torch_tensors(q, k, v, grad=False)))
        return compare("sdpa_forward", "o", out, expected, shapes(q=q, k=k, v=v))
    return Case(run, dict(q=q, k=k, v=v), check)


@hidden_test("sdpa_forward: causal and padding masks, a query with no visible key (torch, property)")
def sdpa_forward_masks():
    q, k, v = normal(2, (2, 2, 6, 4), (2, 2, 6, 4), (2, 2, 6, 3))
    lengths = np.array([6, 4])
    allowed = np.arange(6)[None, :] < lengths[:, None]  # (B, t_k)
    mask = causal(6, 6)[None, None] + additive(allowed)[:, None, None, :]
    mask[1, 0, 5, :] = NEG_INF  # one query of one head sees nothing: its output row must be 0

    def run(q, k, v, mask):
        from refmath.attention import sdpa_forward
        return {"o": sdpa_forward(q, k, v, mask=mask)[0]}

    def check(out):
        expected = numpy_of(torch_attention(*torch_tensors(q, k, v, grad=False), mask=mask))
        expected = np.nan_to_num(expected, nan=0.0)  # torch gives NaN where refmath's contract says 0
        return compare("sdpa_forward", "o", out, expected,
                       shapes(q=q, k=k, v=v) + ", causal + padding mask, one fully masked row")
    return Case(run, dict(q=q, k=k, v=v, mask=mask), check)


@hidden_test("sdpa_forward: float32 in, float32 out (torch)")
def sdpa_forward_float32():
    q, k, v = normal(3, (3, 8, 16), (3, 10, 16), (3, 10, 8), dtype=np.float32)
    mask = causal(8, 10)

    def run(q, k, v, mask):
        from refmath.attention import sdpa_forward
        return {"o": sdpa_forward(q, k, v, mask=mask)[0]}

    def check(out):
        expected = numpy_of(torch_attention(*torch_tensors(q, k, v, grad=False), mask=mask))
        return compare("sdpa_forward", "o", out, expected, shapes(q=q, k=k, v=v) + ", float32",
                       tol=1e-5, dtype=np.float32)
    return Case(run, dict(q=q, k=k, v=v, mask=mask), check)


# ---- sdpa_backward -----------------------------------------------------------------------------

def _sdpa_backward_case(seed, q_shape, k_shape, v_shape, mask=None, drop=None, scale=None, what=""):
    """The inputs of one sdpa_backward case, and the check of its outputs (torch autograd)."""
    q, k, v = normal(seed, q_shape, k_shape, v_shape)
    dout = normal(seed + 100, q_shape[:-1] + v_shape[-1:])

    def check(out):
        _, (dq, dk, dv) = torch_grads(
            lambda a, b, c: torch_attention(a, b, c, mask=mask, drop=drop, scale=scale),
            (q, k, v), dout)
        inputs = shapes(q=q, k=k, v=v) + what
        return all_of(*(compare("sdpa_backward", n, out, e, inputs)
                        for n, e in (("dq", dq), ("dk", dk), ("dv", dv))))
    return dict(q=q, k=k, v=v, dout=dout, mask=mask, drop=drop, scale=scale), check


def _sdpa_backward_test(*cases):
    """One test of several sdpa_backward cases (each a ``_sdpa_backward_case``)."""
    def run(cases):
        from refmath.attention import sdpa_backward, sdpa_forward
        out = {}
        for i, c in enumerate(cases):
            _, cache = sdpa_forward(c["q"], c["k"], c["v"], mask=c["mask"], dropout_mask=c["drop"],
                                    scale=c["scale"])
            out[f"{i}:dq"], out[f"{i}:dk"], out[f"{i}:dv"] = sdpa_backward(c["dout"], cache)
        return out

    def check(out):
        return all_of(*(check_one(case_out(out, i)) for i, (_, check_one) in enumerate(cases)))
    return Case(run, dict(cases=[inputs for inputs, _ in cases]), check)


def _masked_dropout_case(seed, b, h, t_q, t_k, d, d_v, lengths):
    """A causal + padding mask and a dropout mask (keep 0.8) for (b, h, t_q, d) queries."""
    allowed = np.arange(t_k)[None, :] < np.asarray(lengths)[:, None]
    mask = causal(t_q, t_k)[None, None] + additive(allowed)[:, None, None, :]
    keep = np.random.default_rng(seed - 1).random((b, h, t_q, t_k)) > 0.2
    return _sdpa_backward_case(seed, (b, h, t_q, d), (b, h, t_k, d), (b, h, t_k, d_v), mask=mask,
                               drop=keep / 0.8, what=", causal + padding mask, dropout mask")


# Each backward test also runs a large twin of its case: its inputs have so many entries that a
# gradient by differences (one forward call or more per entry) cannot finish within cpu_s, while
# the analytic backward takes milliseconds.

@hidden_test("sdpa_backward: causal + padding mask and a dropout mask (torch autograd)")
def sdpa_backward_masked_dropout():
    return _sdpa_backward_test(_masked_dropout_case(5, 2, 3, 5, 7, 4, 6, [7, 5]),
                               _masked_dropout_case(15, 2, 4, 160, 192, 32, 48, [192, 150]))


@hidden_test("sdpa_backward: an explicit scale, unbatched (torch autograd)")
def sdpa_backward_scale():
    return _sdpa_backward_test(
        _sdpa_backward_case(6, (4, 5), (6, 5), (6, 3), scale=0.7, what=", scale=0.7"),
        _sdpa_backward_case(16, (512, 64), (640, 64), (640, 48), scale=0.7, what=", scale=0.7"))


@hidden_test("sdpa_backward: large input, within the time limit (torch autograd)")
def sdpa_backward_large():
    return _sdpa_backward_test(_sdpa_backward_case(7, (2, 4, 192, 32), (2, 4, 192, 32),
                                                   (2, 4, 192, 32), mask=causal(192, 192),
                                                   what=", causal"))


# ---- gqa_head_map ------------------------------------------------------------------------------

@hidden_test("gqa_head_map: MHA, GQA and MQA head maps (definition)")
def gqa_head_map_values():
    cases = [(8, 8), (8, 2), (8, 1), (6, 3), (12, 4)]

    def run(cases):
        from refmath.attention import gqa_head_map
        return {f"map_{h}_{g}": np.asarray(gqa_head_map(h, g)) for h, g in cases}

    def check(out):
        # consecutive blocks of h/g query heads share one key/value head
        return all_of(*(exact("gqa_head_map", f"map_{h}_{g}", out, np.repeat(np.arange(g), h // g),
                              f"h={h}, g={g}") for h, g in cases))
    return Case(run, dict(cases=cases), check)


# ---- mha_forward / mha_backward ----------------------------------------------------------------

def mha_params(seed, d, h, g, d_h, d_ctx=None, biases=True, fused=False):
    d_ctx = d if d_ctx is None else d_ctx
    rng = np.random.default_rng(seed)

    def w(*shape):
        return rng.standard_normal(shape) / math.sqrt(shape[0])
    if fused:
        params = {"w_qkv": w(d, (h + 2 * g) * d_h), "w_o": w(h * d_h, d)}
        if biases:
            params.update(b_qkv=w((h + 2 * g) * d_h), b_o=w(d))
        return params
    params = {"w_q": w(d, h * d_h), "w_k": w(d_ctx, g * d_h), "w_v": w(d_ctx, g * d_h),
              "w_o": w(h * d_h, d)}
    if biases:
        params.update(b_q=w(h * d_h), b_k=w(g * d_h), b_v=w(g * d_h), b_o=w(d))
    return params


def torch_mha(x, params, h, g, context=None, mask=None):
    """Multi-head attention with g key/value heads, written with torch from the equations."""
    import torch
    if x.dim() == 2:  # unbatched (T, d)
        return torch_mha(x[None], params, h, g, None if context is None else context[None], mask)[0]
    z = x if context is None else context

    def lin(inp, w, b):
        return inp @ params[w] + (params[b] if b in params else 0.0)
    fused = "w_qkv" in params
    if fused:
        qkv = lin(x, "w_qkv", "b_qkv")
        d_h = qkv.shape[-1] // (h + 2 * g)
        q, k, v = torch.split(qkv, [h * d_h, g * d_h, g * d_h], dim=-1)
    else:
        q, k, v = lin(x, "w_q", "b_q"), lin(z, "w_k", "b_k"), lin(z, "w_v", "b_v")
        d_h = q.shape[-1] // h
    b, t, s = x.shape[0], x.shape[1], z.shape[1]
    qh = q.reshape(b, t, h, d_h).transpose(1, 2)
    # key/value head u serves the h/g consecutive query heads u*h/g ... (u+1)*h/g - 1
    kh = k.reshape(b, s, g, d_h).transpose(1, 2).repeat_interleave(h // g, dim=1)
    vh = v.reshape(b, s, g, d_h).transpose(1, 2).repeat_interleave(h // g, dim=1)
    o = torch_attention(qh, kh, vh, mask=mask)
    return lin(o.transpose(1, 2).reshape(b, t, h * d_h), "w_o", "b_o")


def _mha_forward_test(seed, x_shape, h, g, d_h, ctx_shape=None, mask=None, what=""):
    x = normal(seed, x_shape)
    context = None if ctx_shape is None else normal(seed + 1, ctx_shape)
    params = mha_params(seed + 2, x_shape[-1], h, g, d_h, None if ctx_shape is None else ctx_shape[-1])

    def run(x, params, h, g, context, mask):
        from refmath.attention import mha_forward
        return {"y": mha_forward(x, params, n_heads=h, n_kv_heads=g, context=context, mask=mask)[0]}

    def check(out):
        import torch
        tp = {key: torch.as_tensor(value) for key, value in params.items()}
        tc = None if context is None else torch.as_tensor(context)
        expected = numpy_of(torch_mha(torch.as_tensor(x), tp, h, g, tc, mask))
        return compare("mha_forward", "y", out, expected,
                       shapes(x=x, **({} if context is None else {"context": context}))
                       + f", h={h}, g={g}, d_h={d_h}{what}")
    return Case(run, dict(x=x, params=params, h=h, g=g, context=context, mask=mask), check)


@hidden_test("mha_forward: GQA self-attention with biases and a causal mask (torch)")
def mha_forward_gqa():
    return _mha_forward_test(10, (2, 5, 8), 4, 2, 3, mask=causal(5, 5), what=", causal")


@hidden_test("mha_forward: cross-attention, MQA (torch)")
def mha_forward_cross():
    return _mha_forward_test(11, (2, 4, 6), 3, 1, 2, ctx_shape=(2, 7, 5))


def _mha_backward_case(seed, x_shape, h, g, d_h, fused=False, biases=True, mask=None, what=""):
    """The inputs of one mha_backward case, and the check of its outputs (torch autograd)."""
    x = normal(seed, x_shape)
    params = mha_params(seed + 2, x_shape[-1], h, g, d_h, biases=biases, fused=fused)
    dy = normal(seed + 3, x_shape)
    keys = list(params)

    def check(out):
        import torch
        tensors = torch_tensors(x, *(params[key] for key in keys))
        y = torch_mha(tensors[0], dict(zip(keys, tensors[1:])), h, g, mask=mask)
        (y * torch.as_tensor(dy)).sum().backward()
        inputs = shapes(x=x) + f", h={h}, g={g}, d_h={d_h}{what}"
        # the key bias's gradient is zero in exact arithmetic: measure it against the others
        floor = max(float(np.max(np.abs(numpy_of(t.grad)))) for t in tensors)
        return all_of(compare("mha_backward", "dx", out, numpy_of(tensors[0].grad), inputs),
                      *(compare("mha_backward", f"dparams[{key!r}]",
                                {f"dparams[{key!r}]": out[f"d{key}"]} if f"d{key}" in out else {},
                                numpy_of(t.grad), inputs, floor=floor)
                        for key, t in zip(keys, tensors[1:])))
    return dict(x=x, params=params, h=h, g=g, dy=dy, mask=mask), check


def _mha_backward_test(*cases):
    """One test of several mha_backward cases (each a ``_mha_backward_case``)."""
    def run(cases):
        from refmath.attention import mha_backward, mha_forward
        out = {}
        for i, c in enumerate(cases):
            _, cache = mha_forward(c["x"], c["params"], n_heads=c["h"], n_kv_heads=c["g"],
                                   mask=c["mask"])
            dx, grads = mha_backward(c["dy"], cache)
            out[f"{i}:dx"] = dx
            out.update({f"{i}:d{key}": grads[key] for key in c["params"] if key in grads})
        return out

    def check(out):
        return all_of(*(check_one(case_out(out, i)) for i, (_, check_one) in enumerate(cases)))
    return Case(run, dict(cases=[inputs for inputs, _ in cases]), check)


@hidden_test("mha_backward: GQA with biases and a causal mask, every gradient (torch autograd)")
def mha_backward_gqa():
    return _mha_backward_test(
        _mha_backward_case(20, (2, 5, 8), 6, 2, 3, mask=causal(5, 5), what=", causal"),
        _mha_backward_case(30, (4, 128, 96), 6, 2, 16, mask=causal(128, 128), what=", causal"))


@hidden_test("mha_backward: fused QKV weights, MQA, unbatched (torch autograd)")
def mha_backward_fused():
    return _mha_backward_test(
        _mha_backward_case(21, (6, 8), 4, 1, 2, fused=True, what=", fused w_qkv"),
        _mha_backward_case(31, (256, 128), 8, 1, 16, fused=True, what=", fused w_qkv"))


@hidden_test("mha_backward: large input, within the time limit (torch autograd)")
def mha_backward_large():
    return _mha_backward_test(_mha_backward_case(22, (4, 128, 128), 8, 2, 16,
                                                 mask=causal(128, 128), what=", causal"))
