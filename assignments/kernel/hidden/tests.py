"""Hidden tests of the kernel assignment.

Each test compiles the submission's ``flash_tile.cpp``, links it with the given module and calls
``flash_forward`` in float32. Expected values: dense attention written out in float64 NumPy here
(never refmath's kernels or flash code), judged by the kernel tests' float32 rule: the kernel's
worst error may be twice that of a plain float32 computation of the same thing, plus one float32
rounding. The plain computation is the one a loop written straight from the equations makes: each
sum (the dot products, the softmax's denominator, the weighted sum of values) added term by term
in float32, in index order, as the C++ does. (NumPy's float32 matrix products sum in blocks, more
accurately than any such loop: a bound from them would fail a correct kernel.) A query that sees
no key must give an output row of 0 and a logsumexp of -inf.
"""
import numpy as np

from refmath.assignments.checks import Case, all_of, float32_rule, hidden_test, normal, shapes


def dense(q, k, v, causal, scale, dtype):
    """(o, lse) of softmax(scale q k^T) v with bottom-right causal alignment, computed in dtype;
    rows that see no key give o = 0 and lse = -inf."""
    q, k, v = (np.asarray(a, dtype) for a in (q, k, v))
    s = (q @ np.swapaxes(k, -1, -2)) * dtype(scale)
    t_q, t_k = s.shape[-2:]
    if causal:
        s = np.where(np.tril(np.ones((t_q, t_k), dtype=bool), t_k - t_q), s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    seen = np.isfinite(m)
    p = np.exp(s - np.where(seen, m, 0))
    l = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.where(seen, (p @ v) / np.where(seen, l, 1), 0)
        lse = np.where(seen, m + np.log(np.where(seen, l, 1)), -np.inf)[..., 0]
    return o.astype(dtype), lse.astype(dtype)


def plain_float32(q, k, v, causal, scale):
    """(o, lse) of the same attention in float32, every sum taken term by term in index order."""
    q, k, v = (np.asarray(a, np.float32) for a in (q, k, v))
    s = np.zeros(q.shape[:-1] + k.shape[-2:-1], np.float32)
    for i in range(q.shape[-1]):
        s += q[..., :, None, i] * k[..., None, :, i]
    s *= np.float32(scale)
    t_q, t_k = s.shape[-2:]
    if causal:
        s = np.where(np.tril(np.ones((t_q, t_k), dtype=bool), t_k - t_q), s, np.float32(-np.inf))
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    seen = np.isfinite(m)
    p = np.exp(s - np.where(seen, m, np.float32(0)))
    l = np.zeros(m.shape, np.float32)
    u = np.zeros(q.shape[:-1] + v.shape[-1:], np.float32)
    for j in range(t_k):
        l += p[..., j:j + 1]
        u += p[..., j:j + 1] * v[..., j:j + 1, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.where(seen, u / np.where(seen, l, 1), np.float32(0))
        lse = np.where(seen, m + np.log(np.where(seen, l, 1)), -np.inf)[..., 0]
    return o.astype(np.float32), lse.astype(np.float32)


def flash_case(q, k, v, causal=False, block_q=16, block_k=16, scale=None, what=""):
    """A Case: the kernel on (q, k, v) in float32, checked against dense attention."""
    q, k, v = (np.asarray(a, np.float32) for a in (q, k, v))
    tau = 1 / np.sqrt(q.shape[-1]) if scale is None else scale

    def run(q, k, v, causal, block_q, block_k, scale):
        from refmath.teaching_kernel import build
        kernel = build()
        o, lse = kernel.flash_forward(q, k, v, causal, block_q, block_k, scale)
        return {"o": o, "lse": lse}

    def check(out):
        o64, lse64 = dense(q, k, v, causal, tau, np.float64)
        o32, lse32 = plain_float32(q, k, v, causal, tau)
        inputs = (shapes(q=q, k=k, v=v) + f", causal={causal}, blocks {block_q}x{block_k}" + what)
        return all_of(float32_rule("flash_forward", "o", out, o64, o32, inputs),
                      float32_rule("flash_forward", "lse", out, lse64, lse32, inputs))
    return Case(run, dict(q=q, k=k, v=v, causal=causal, block_q=block_q, block_k=block_k,
                          scale=scale), check)


@hidden_test("one head, no mask, lengths the blocks do not divide")
def forward_one_head():
    q, k, v = normal(1, (33, 16), (47, 16), (47, 8))
    return flash_case(q, k, v, block_q=8, block_k=8)


@hidden_test("causal, batch and heads, T_q != T_k (bottom-right), ragged tiles")
def forward_causal_ragged():
    q, k, v = normal(2, (2, 3, 37, 32), (2, 3, 53, 32), (2, 3, 53, 32))
    return flash_case(q, k, v, causal=True, block_q=16, block_k=16)


@hidden_test("block sizes 1 x 1 and larger than the sequence")
def forward_block_sizes():
    q, k, v = normal(3, (2, 20, 8), (2, 20, 8), (2, 20, 8))
    small = flash_case(q, k, v, causal=True, block_q=1, block_k=1, what=" (1 x 1)")
    large = flash_case(q, k, v, causal=True, block_q=64, block_k=128, what=" (64 x 128)")

    def run(small, large):
        from refmath.teaching_kernel import build
        kernel = build()
        out = {}
        for name, c in (("small", small), ("large", large)):
            out[f"{name}_o"], out[f"{name}_lse"] = kernel.flash_forward(
                c["q"], c["k"], c["v"], c["causal"], c["block_q"], c["block_k"], c["scale"])
        return out

    def check(out):
        def part(name):
            return {key: out[f"{name}_{key}"] for key in ("o", "lse") if f"{name}_{key}" in out}
        return all_of(small.check(part("small")), large.check(part("large")))
    return Case(run, dict(small=small.inputs, large=large.inputs), check)


@hidden_test("causal with T_q > T_k: the first queries see no key (o = 0, lse = -inf)")
def forward_rows_that_see_nothing():
    q, k, v = normal(4, (3, 10, 16), (3, 6, 16), (3, 6, 4))
    return flash_case(q, k, v, causal=True, block_q=3, block_k=4, what=", 4 rows see nothing")


@hidden_test("scores in the hundreds: no overflow (the running maximum)")
def forward_large_scores():
    q, k, v = normal(5, (2, 40, 16), (2, 40, 16), (2, 40, 16))
    return flash_case(30 * q, 30 * k, v, causal=True, block_q=8, block_k=8, what=", q and k x30")


@hidden_test("head width 64 for q and k, 96 for v, an explicit scale")
def forward_head_widths_and_scale():
    q, k, v = normal(6, (2, 24, 64), (2, 30, 64), (2, 30, 96))
    return flash_case(q, k, v, block_q=16, block_k=8, scale=0.3, what=", scale 0.3")


@hidden_test("B=2, H=8, T=256, d=64, causal: correct and within the time limit")
def forward_large():
    q, k, v = normal(7, (2, 8, 256, 64), (2, 8, 256, 64), (2, 8, 256, 64))
    return flash_case(q, k, v, causal=True, block_q=32, block_k=32)
