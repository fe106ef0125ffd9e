"""Hidden tests of the normalisation and feed-forward assignment.

Expected values: PyTorch autograd in float64 (torch.nn.functional's layer_norm and gelu, RMSNorm and
SwiGLU written from their equations, RoPE as a complex rotation), and one property (the backward of
RoPE undoes its forward). ``check`` never imports the submission; ``run``, whose source and inputs
alone reach the sandbox, imports the submission's functions itself.
"""
import numpy as np

from refmath.assignments import checks
from refmath.assignments.checks import (Case, all_of, compare, hidden_test, normal, numpy_of, shapes,
                                        torch_tensors)


def grads_of(forward, arrays, dout):
    """Gradients of sum(forward(*arrays) * dout) for each array, by torch autograd."""
    import torch
    tensors = torch_tensors(*arrays)
    (forward(*tensors) * torch.as_tensor(dout)).sum().backward()
    return [numpy_of(t.grad) for t in tensors]


# Each backward test also runs a large twin of its case (or, for the *_large tests, is large): its
# inputs have so many entries that a gradient by differences (one forward call or more per entry)
# cannot finish within cpu_s, while the analytic backward takes milliseconds. The row-wise
# functions (LayerNorm, RMSNorm) can be differentiated a column at a time for all rows at once (a
# complex step, or dual numbers): d forward calls, so their large inputs are 16384 wide, where d
# calls take far longer than cpu_s. RoPE needs only two such columns (its pairs do not mix), so its
# backward is held to a CPU budget instead: a few times the grader's own NumPy rotation.

def compare_all(function, out, names, expected, inputs, **options):
    return all_of(*(compare(function, n, out, e, inputs, **options) for n, e in zip(names, expected)))


def case_out(out, i):
    """The outputs of the i-th case of a run (keys ``"i:name"``) under their own names."""
    prefix = f"{i}:"
    return {key[len(prefix):]: value for key, value in out.items() if key.startswith(prefix)}


def cases_test(run, *cases):
    """A Case of several (inputs, check) cases: ``run(cases)`` returns ``"i:name"`` keys."""
    def check(out):
        return all_of(*(check_one(case_out(out, i)) for i, (_, check_one) in enumerate(cases)))
    return Case(run, dict(cases=[inputs for inputs, _ in cases]), check)


# ---- LayerNorm, RMSNorm ------------------------------------------------------------------------

def _layernorm_case(seed, shape):
    x = normal(seed, shape) * 3 + 1
    gamma, beta, dout = normal(seed + 1, shape[-1:], shape[-1:], shape)

    def check(out):
        import torch.nn.functional as F
        expected = grads_of(lambda a, g, b: F.layer_norm(a, (shape[-1],), g, b, eps=1e-5),
                            (x, gamma, beta), dout)
        return compare_all("layernorm_backward", out, ("dx", "dgamma", "dbeta"), expected,
                           shapes(x=x, gamma=gamma))
    return dict(x=x, gamma=gamma, beta=beta, dout=dout), check


def _layernorm_test(*cases):
    def run(cases):
        from refmath.norms import layernorm_backward, layernorm_forward
        out = {}
        for i, c in enumerate(cases):
            _, cache = layernorm_forward(c["x"], c["gamma"], c["beta"])
            out[f"{i}:dx"], out[f"{i}:dgamma"], out[f"{i}:dbeta"] = layernorm_backward(c["dout"], cache)
        return out
    return cases_test(run, *cases)


@hidden_test("layernorm_backward: rows under three leading axes, every gradient (torch autograd)")
def layernorm_backward_batched():
    return _layernorm_test(_layernorm_case(1, (2, 3, 4, 10)), _layernorm_case(31, (2, 32, 16384)))


@hidden_test("layernorm_backward: large input, within the time limit (torch autograd)")
def layernorm_backward_large():
    return _layernorm_test(_layernorm_case(2, (64, 16384)))


def torch_rmsnorm(x, gamma, eps=1e-6):
    import torch
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * gamma


def _rmsnorm_case(x, gamma, dout, what="", **options):
    def check(out):
        expected = grads_of(torch_rmsnorm, (x, gamma), dout)
        return compare_all("rmsnorm_backward", out, ("dx", "dgamma"), expected,
                           shapes(x=x, gamma=gamma) + what, **options)
    return dict(x=x, gamma=gamma, dout=dout), check


def _rmsnorm_test(*cases):
    def run(cases):
        from refmath.norms import rmsnorm_backward, rmsnorm_forward
        out = {}
        for i, c in enumerate(cases):
            _, cache = rmsnorm_forward(c["x"], c["gamma"])
            out[f"{i}:dx"], out[f"{i}:dgamma"] = rmsnorm_backward(c["dout"], cache)
        return out
    return cases_test(run, *cases)


@hidden_test("rmsnorm_backward: rows under three leading axes, every gradient (torch autograd)")
def rmsnorm_backward_batched():
    x = normal(3, (2, 2, 5, 12)) * 2
    gamma, dout = normal(4, (12,), (2, 2, 5, 12))
    large_x = normal(33, (2, 32, 16384)) * 2
    large_gamma, large_dout = normal(34, (16384,), (2, 32, 16384))
    return _rmsnorm_test(_rmsnorm_case(x, gamma, dout), _rmsnorm_case(large_x, large_gamma, large_dout))


@hidden_test("rmsnorm_backward: float32 in, float32 out (torch autograd)")
def rmsnorm_backward_float32():
    x, gamma, dout = normal(5, (6, 32), (32,), (6, 32), dtype=np.float32)
    large = normal(35, (64, 16384), (16384,), (64, 16384), dtype=np.float32)  # dgamma sums 64 rows
    return _rmsnorm_test(_rmsnorm_case(x, gamma, dout, ", float32", tol=1e-5, dtype=np.float32),
                         _rmsnorm_case(*large, ", float32", tol=1e-5, dtype=np.float32))


# ---- GELU, SwiGLU ------------------------------------------------------------------------------

def _gelu_case(x, dout, what=""):
    def check(out):
        import torch.nn.functional as F
        (dx,) = grads_of(lambda a: F.gelu(a, approximate="none"), (x,), dout)
        return compare("gelu_backward", "dx", out, dx, shapes(x=x) + ", approximate=False" + what)
    return dict(x=x, dout=dout), check


def _gelu_test(*cases):
    def run(cases):
        from refmath.ffn import gelu_backward, gelu_forward
        out = {}
        for i, c in enumerate(cases):
            _, cache = gelu_forward(c["x"], approximate=False)
            out[f"{i}:dx"] = gelu_backward(c["dout"], cache)
        return out
    return cases_test(run, *cases)


@hidden_test("gelu_backward: exact form, from -30 to 30 (torch autograd)")
def gelu_backward_exact():
    specials = [0.0, -8.0, 8.0, -30.0, 30.0, 1e-8]
    x = np.concatenate([normal(6, (40,)) * 3, specials])
    large = np.concatenate([normal(36, (65536,)) * 3, specials])
    return _gelu_test(_gelu_case(x, normal(7, x.shape)), _gelu_case(large, normal(37, large.shape)))


def torch_swiglu(x, w_gate, w_up, w_down):
    import torch.nn.functional as F
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


def _swiglu_case(seed, x_shape, d_f, d_out):
    d = x_shape[-1]
    x = normal(seed, x_shape)
    w_gate, w_up, w_down = (a / np.sqrt(a.shape[0]) for a in normal(seed + 1, (d, d_f), (d, d_f), (d_f, d_out)))
    dout = normal(seed + 2, x_shape[:-1] + (d_out,))

    def check(out):
        expected = grads_of(torch_swiglu, (x, w_gate, w_up, w_down), dout)
        return compare_all("swiglu_backward", out, ("dx", "dw_gate", "dw_up", "dw_down"), expected,
                           shapes(x=x, w_gate=w_gate, w_down=w_down))
    return dict(x=x, w_gate=w_gate, w_up=w_up, w_down=w_down, dout=dout), check


def _swiglu_test(*cases):
    def run(cases):
        from refmath.ffn import swiglu_backward, swiglu_forward
        out = {}
        for i, c in enumerate(cases):
            _, cache = swiglu_forward(c["x"], c["w_gate"], c["w_up"], c["w_down"])
            (out[f"{i}:dx"], out[f"{i}:dw_gate"], out[f"{i}:dw_up"],
             out[f"{i}:dw_down"]) = swiglu_backward(c["dout"], cache)
        return out
    return cases_test(run, *cases)


@hidden_test("swiglu_backward: batched, every gradient (torch autograd)")
def swiglu_backward_batched():
    return _swiglu_test(_swiglu_case(8, (2, 3, 6), 10, 5), _swiglu_case(38, (2, 3, 128, 96), 256, 80))


@hidden_test("swiglu_backward: large input, within the time limit (torch autograd)")
def swiglu_backward_large():
    return _swiglu_test(_swiglu_case(9, (8, 64, 128), 344, 128))


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

    def run(x):
        from refmath.positions import rope_forward
        return {"y": rope_forward(x, offset=3)[0]}

    def check(out):
        y = torch_rope(*torch_tensors(x, grad=False), np.arange(3, 10))
        return compare("rope_forward", "y", out, numpy_of(y), shapes(x=x) + ", offset=3")
    return Case(run, dict(x=x), check)


@hidden_test("rope_forward: half layout, explicit positions, base 500 (torch, complex rotation)")
def rope_forward_half_positions():
    x = normal(11, (4, 6))
    positions = np.array([5, 0, 2, 9])

    def run(x, positions):
        from refmath.positions import rope_forward
        return {"y": rope_forward(x, positions=positions, base=500.0, layout="half")[0]}

    def check(out):
        y = torch_rope(*torch_tensors(x, grad=False), positions, base=500.0, layout="half")
        return compare("rope_forward", "y", out, numpy_of(y),
                       shapes(x=x) + ", layout='half', positions [5, 0, 2, 9], base=500")
    return Case(run, dict(x=x, positions=positions), check)


def _rope_case(x, dout, offset):
    def check(out):
        positions = np.arange(offset, offset + x.shape[-2])
        return all_of(*(compare("rope_backward", f"dx_{layout}", out,
                                grads_of(lambda a: torch_rope(a, positions, layout=layout),
                                         (x,), dout)[0],
                                shapes(x=x) + f", offset={offset}, layout={layout!r}")
                        for layout in ("interleaved", "half")))
    return dict(x=x, dout=dout, offset=offset), check


def _rope_backward_test(*cases):
    def run(cases):
        from refmath.positions import rope_backward, rope_forward
        out = {}
        for i, c in enumerate(cases):
            for layout in ("interleaved", "half"):
                cache = rope_forward(c["x"], offset=c["offset"], layout=layout)[1]
                out[f"{i}:dx_{layout}"] = rope_backward(c["dout"], cache)
        return out
    return cases_test(run, *cases)


def numpy_rotation(x, positions, layout, base=10000.0):
    """RoPE's rotation by -theta in plain NumPy: the grader's own computation of a backward, timed
    for the cost budget (its values come from torch)."""
    d = x.shape[-1]
    theta = np.asarray(positions, np.float64)[:, None] * base ** (-2.0 * np.arange(d // 2) / d)
    c, s = np.cos(theta), np.sin(theta)
    a, b = (x[..., 0::2], x[..., 1::2]) if layout == "interleaved" else (x[..., :d // 2], x[..., d // 2:])
    rotated = np.empty_like(x)
    first, second = (rotated[..., 0::2], rotated[..., 1::2]) if layout == "interleaved" else \
        (rotated[..., :d // 2], rotated[..., d // 2:])
    first[...], second[...] = a * c + b * s, b * c - a * s
    return rotated


ROPE_REPEAT = 8  # backward calls on the costed input, each layout


@hidden_test("rope_backward: both layouts (torch autograd), within a CPU budget")
def rope_backward_autograd():
    x = normal(12, (2, 5, 10))
    dout = normal(13, (2, 5, 10))
    cases = [_rope_case(x, dout, 2), _rope_case(*normal(39, (16, 512, 64), (16, 512, 64)), 2)]
    large_x, large_dout = normal(41, (8, 2048, 128), (8, 2048, 128))
    positions = np.arange(2048)
    # the same calls as run(), in plain NumPy: two rotations (forward, backward) per small case and
    # layout, and per layout one forward and ROPE_REPEAT backwards on the costed input (timed once
    # and counted ROPE_REPEAT + 1 times: the grader's time is everyone's)
    small_s = checks.reference_cpu_seconds(lambda: [
        numpy_rotation(a, np.arange(2, 2 + a.shape[-2]), layout)
        for layout in ("interleaved", "half") for c in cases for a in (c[0]["x"], c[0]["dout"])])
    large_s = checks.reference_cpu_seconds(lambda: [numpy_rotation(large_dout, positions, layout)
                                                    for layout in ("interleaved", "half")])
    reference_s = small_s + (ROPE_REPEAT + 1) * large_s

    def run(cases, large_x, large_dout, repeat):
        from refmath.positions import rope_backward, rope_forward
        out = {}
        for i, c in enumerate(cases):
            for layout in ("interleaved", "half"):
                cache = rope_forward(c["x"], offset=c["offset"], layout=layout)[1]
                out[f"{i}:dx_{layout}"] = rope_backward(c["dout"], cache)
        for layout in ("interleaved", "half"):
            cache = rope_forward(large_x, layout=layout)[1]
            for _ in range(repeat):
                dx = rope_backward(large_dout, cache)
            out[f"large:{layout}"] = dx[:1, :4]
        return out

    def check(out):
        correct = all_of(*(check_one(case_out(out, i)) for i, (_, check_one) in enumerate(cases)),
                         *(compare("rope_backward", f"large:{layout}", out,
                                   numpy_rotation(large_dout, positions, layout)[:1, :4],
                                   shapes(x=large_x) + f", layout={layout!r}")
                           for layout in ("interleaved", "half")))
        if not correct.passed:
            return correct
        return checks.within_cost("rope_backward", out, reference_s,
                                  f"{2 * ROPE_REPEAT} backward calls on x {large_x.shape}")
    return Case(run, dict(cases=[inputs for inputs, _ in cases], large_x=large_x,
                          large_dout=large_dout, repeat=ROPE_REPEAT), check, costed=True)


def _rope_inverse_case(x, offset):
    def check(out):
        inputs = shapes(x=x) + f", offset={offset}"
        return all_of(compare("rope_backward(rope_forward(x))", "x_back", out, x, inputs, tol=1e-13),
                      compare("rope_forward", "y_norm", out, np.linalg.norm(x, axis=-1), inputs,
                              tol=1e-13))
    return dict(x=x, offset=offset), check


@hidden_test("rope_backward undoes rope_forward: a rotation's inverse is its transpose (property)")
def rope_inverse_property():
    def run(cases):
        from refmath.positions import rope_backward, rope_forward
        out = {}
        for i, c in enumerate(cases):
            y, cache = rope_forward(c["x"], offset=c["offset"])
            out[f"{i}:x_back"], out[f"{i}:y_norm"] = rope_backward(y, cache), np.linalg.norm(y, axis=-1)
        return out
    return cases_test(run, _rope_inverse_case(normal(14, (3, 16, 32)), 100),
                      _rope_inverse_case(normal(40, (16, 512, 64)), 100))
