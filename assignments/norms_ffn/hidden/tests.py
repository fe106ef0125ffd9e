"""Hidden tests of the normalisation and feed-forward assignment.

Expected values: PyTorch autograd in float64 (torch.nn.functional's layer_norm and gelu, RMSNorm and
SwiGLU written from their equations, RoPE as a complex rotation), and one property (the backward of
RoPE undoes its forward). ``check`` never imports the submission.
"""
import numpy as np

from refmath.assignments.checks import all_of, compare, hidden_test, normal, numpy_of, shapes, torch_tensors


def grads_of(forward, arrays, dout):
    """Gradients of sum(forward(*arrays) * dout) for each array, by torch autograd."""
    import torch
    tensors = torch_tensors(*arrays)
    (forward(*tensors) * torch.as_tensor(dout)).sum().backward()
    return [numpy_of(t.grad) for t in tensors]


def compare_all(function, out, names, expected, inputs, **options):
    return all_of(*(compare(function, n, out, e, inputs, **options) for n, e in zip(names, expected)))


# ---- LayerNorm, RMSNorm ------------------------------------------------------------------------

def _layernorm_test(seed, shape):
    x = normal(seed, shape) * 3 + 1
    gamma, beta, dout = normal(seed + 1, shape[-1:], shape[-1:], shape)

    def run():
        from refmath.norms import layernorm_backward, layernorm_forward
        _, cache = layernorm_forward(x, gamma, beta)
        dx, dgamma, dbeta = layernorm_backward(dout, cache)
        return {"dx": dx, "dgamma": dgamma, "dbeta": dbeta}

    def check(out):
        import torch.nn.functional as F
        expected = grads_of(lambda a, g, b: F.layer_norm(a, (shape[-1],), g, b, eps=1e-5),
                            (x, gamma, beta), dout)
        return compare_all("layernorm_backward", out, ("dx", "dgamma", "dbeta"), expected,
                           shapes(x=x, gamma=gamma))
    return run, check


@hidden_test("layernorm_backward: rows under three leading axes, every gradient (torch autograd)")
def layernorm_backward_batched():
    return _layernorm_test(1, (2, 3, 4, 10))


@hidden_test("layernorm_backward: large input, within the time limit (torch autograd)")
def layernorm_backward_large():
    return _layernorm_test(2, (8, 128, 64))


def torch_rmsnorm(x, gamma, eps=1e-6):
    import torch
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * gamma


@hidden_test("rmsnorm_backward: rows under three leading axes, every gradient (torch autograd)")
def rmsnorm_backward_batched():
    x = normal(3, (2, 2, 5, 12)) * 2
    gamma, dout = normal(4, (12,), (2, 2, 5, 12))

    def run():
        from refmath.norms import rmsnorm_backward, rmsnorm_forward
        _, cache = rmsnorm_forward(x, gamma)
        dx, dgamma = rmsnorm_backward(dout, cache)
        return {"dx": dx, "dgamma": dgamma}

    def check(out):
        expected = grads_of(torch_rmsnorm, (x, gamma), dout)
        return compare_all("rmsnorm_backward", out, ("dx", "dgamma"), expected, shapes(x=x, gamma=gamma))
    return run, check


@hidden_test("rmsnorm_backward: float32 in, float32 out (torch autograd)")
def rmsnorm_backward_float32():
    x, gamma, dout = normal(5, (6, 32), (32,), (6, 32), dtype=np.float32)

    def run():
        from refmath.norms import rmsnorm_backward, rmsnorm_forward
        _, cache = rmsnorm_forward(x, gamma)
        dx, dgamma = rmsnorm_backward(dout, cache)
        return {"dx": dx, "dgamma": dgamma}

    def check(out):
        expected = grads_of(torch_rmsnorm, (x, gamma), dout)
        return compare_all("rmsnorm_backward", out, ("dx", "dgamma"), expected,
                           shapes(x=x, gamma=gamma) + ", float32", tol=1e-5, dtype=np.float32)
    return run, check


# ---- GELU, SwiGLU ------------------------------------------------------------------------------

@hidden_test("gelu_backward: exact form, from -30 to 30 (torch autograd)")
def gelu_backward_exact():
    x = np.concatenate([normal(6, (40,)) * 3, [0.0, -8.0, 8.0, -30.0, 30.0, 1e-8]])
    dout = normal(7, x.shape)

    def run():
        from refmath.ffn import gelu_backward, gelu_forward
        _, cache = gelu_forward(x, approximate=False)
        return {"dx": gelu_backward(dout, cache)}

    def check(out):
        import torch.nn.functional as F
        (dx,) = grads_of(lambda a: F.gelu(a, approximate="none"), (x,), dout)
        return compare("gelu_backward", "dx", out, dx, shapes(x=x) + ", approximate=False")
    return run, check


def torch_swiglu(x, w_gate, w_up, w_down):
    import torch.nn.functional as F
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


def _swiglu_test(seed, x_shape, d_f, d_out):
    d = x_shape[-1]
    x = normal(seed, x_shape)
    w_gate, w_up, w_down = (a / np.sqrt(a.shape[0]) for a in normal(seed + 1, (d, d_f), (d, d_f), (d_f, d_out)))
    dout = normal(seed + 2, x_shape[:-1] + (d_out,))

    def run():
        from refmath.ffn import swiglu_backward, swiglu_forward
        _, cache = swiglu_forward(x, w_gate, w_up, w_down)
        dx, dw_gate, dw_up, dw_down = swiglu_backward(dout, cache)
        return {"dx": dx, "dw_gate": dw_gate, "dw_up": dw_up, "dw_down": dw_down}

    def check(out):
        expected = grads_of(torch_swiglu, (x, w_gate, w_up, w_down), dout)
        return compare_all("swiglu_backward", out, ("dx", "dw_gate", "dw_up", "dw_down"), expected,
                           shapes(x=x, w_gate=w_gate, w_down=w_down))
    return run, check


@hidden_test("swiglu_backward: batched, every gradient (torch autograd)")
def swiglu_backward_batched():
    return _swiglu_test(8, (2, 3, 6), 10, 5)


@hidden_test("swiglu_backward: large input, within the time limit (torch autograd)")
def swiglu_backward_large():
    return _swiglu_test(9, (4, 64, 64), 172, 64)


# ---- RoPE --------------------------------------------------------------------------------------

def torch_rope(x, positions, base=10000.0, layout="interleaved"):
    """Rotate each coordinate pair as a complex number: (a + i b) e^{i p w_r}, w_r = base^(-2r/d)."""
    import torch
    d = x.shape[-1]
    freq = base ** (-2.0 * torch.arange(d // 2, dtype=torch.float64) / d)
    theta = torch.as_tensor(np.asarray(positions, dtype=np.float64))[:, None] * freq
    turn = torch.polar(torch.ones_like(theta), theta)
    if layout == "interleaved":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous()) * turn
        return torch.view_as_real(z).reshape(x.shape)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * turn
    return torch.cat([z.real, z.imag], dim=-1)


@hidden_test("rope_forward: interleaved pairs, offset 3 (torch, complex rotation)")
def rope_forward_interleaved():
    x = normal(10, (2, 3, 7, 8))

    def run():
        from refmath.positions import rope_forward
        return {"y": rope_forward(x, offset=3)[0]}

    def check(out):
        y = torch_rope(*torch_tensors(x, grad=False), np.arange(3, 10))
        return compare("rope_forward", "y", out, numpy_of(y), shapes(x=x) + ", offset=3")
    return run, check


@hidden_test("rope_forward: half layout, explicit positions, base 500 (torch, complex rotation)")
def rope_forward_half_positions():
    x = normal(11, (4, 6))
    positions = np.array([5, 0, 2, 9])

    def run():
        from refmath.positions import rope_forward
        return {"y": rope_forward(x, positions=positions, base=500.0, layout="half")[0]}

    def check(out):
        y = torch_rope(*torch_tensors(x, grad=False), positions, base=500.0, layout="half")
        return compare("rope_forward", "y", out, numpy_of(y),
                       shapes(x=x) + ", layout='half', positions [5, 0, 2, 9], base=500")
    return run, check


@hidden_test("rope_backward: both layouts (torch autograd)")
def rope_backward_autograd():
    x = normal(12, (2, 5, 10))
    dout = normal(13, (2, 5, 10))

    def run():
        from refmath.positions import rope_backward, rope_forward
        return {f"dx_{layout}": rope_backward(dout, rope_forward(x, offset=2, layout=layout)[1])
                for layout in ("interleaved", "half")}

    def check(out):
        return all_of(*(compare("rope_backward", f"dx_{layout}", out,
                                grads_of(lambda a: torch_rope(a, np.arange(2, 7), layout=layout),
                                         (x,), dout)[0],
                                shapes(x=x) + f", offset=2, layout={layout!r}")
                        for layout in ("interleaved", "half")))
    return run, check


@hidden_test("rope_backward undoes rope_forward: a rotation's inverse is its transpose (property)")
def rope_inverse_property():
    x = normal(14, (3, 16, 32))

    def run():
        from refmath.positions import rope_backward, rope_forward
        y, cache = rope_forward(x, offset=100)
        return {"x_back": rope_backward(y, cache), "y_norm": np.linalg.norm(y, axis=-1)}

    def check(out):
        inputs = shapes(x=x) + ", offset=100"
        return all_of(compare("rope_backward(rope_forward(x))", "x_back", out, x, inputs, tol=1e-13),
                      compare("rope_forward", "y_norm", out, np.linalg.norm(x, axis=-1), inputs,
                              tol=1e-13))
    return run, check
