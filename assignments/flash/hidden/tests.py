"""Hidden tests of the FlashAttention assignment.

Expected values: dense attention and its autograd in torch (float64), with the mask written from the
positions; exact properties of the online-softmax state (the empty state is the identity, merging
is associative and equals one pass over all keys); and the peak resident memory of all the test's
processes, read by the grader from the kernel, which must stay far below one T x T matrix.
``check`` never imports the submission; ``run``, whose source and inputs alone reach the sandbox,
imports the submission's functions itself.
"""
import numpy as np

from refmath.assignments.checks import (Case, all_of, compare, exact, hidden_test, normal, numpy_of,
                                        shapes, torch_tensors)


def visible(t_q, t_k, causal, window):
    """Boolean (t_q, t_k): query i sits at key position i + t_k - t_q."""
    pos = np.arange(t_q)[:, None] + (t_k - t_q)
    j = np.arange(t_k)[None, :]
    seen = np.ones((t_q, t_k), dtype=bool)
    if causal or window is not None:
        seen &= j <= pos
    if window is not None:
        seen &= j > pos - window
    return seen


def torch_dense(q, k, v, causal=False, window=None, scale=None):
    """(o, lse) of dense attention with grouped key/value heads, in torch."""
    import torch
    h, g = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    seen = torch.as_tensor(visible(q.shape[2], k.shape[2], causal, window))
    scores = torch.where(seen, scores, torch.tensor(-float("inf"), dtype=scores.dtype))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)  # no visible key: 0
    return torch.matmul(weights, v), lse


def case_out(out, i):
    """The outputs of the i-th case of a run (keys ``"i:name"``) under their own names."""
    prefix = f"{i}:"
    return {key[len(prefix):]: value for key, value in out.items() if key.startswith(prefix)}


# ---- the online-softmax merge ------------------------------------------------------------------

def _blocks(seed, n_rows, sizes, d_v):
    scores = [normal(seed + i, (n_rows, n)) * 3 for i, n in enumerate(sizes)]
    values = [normal(seed + 10 + i, (n, d_v)) for i, n in enumerate(sizes)]
    return scores, values


@hidden_test("online_softmax_merge: two blocks merge into the statistics of one pass (exact sums)")
def merge_equals_one_pass():
    scores, values = _blocks(1, 4, (5, 7), 3)
    scores[1][2] = -np.inf  # row 2 sees nothing in the second block

    def run(scores, values):
        from refmath.softmax import online_softmax_block, online_softmax_merge
        state = online_softmax_merge(*(online_softmax_block(s, v) for s, v in zip(scores, values)))
        return {"m": state.m, "l": state.l, "u": state.u}

    def check(out):
        s, v = np.concatenate(scores, axis=1), np.concatenate(values, axis=0)
        m = s.max(axis=1)
        weights = np.exp(s - m[:, None])
        inputs = "scores (4, 5) and (4, 7), values (5, 3) and (7, 3), one row masked in block 2"
        return all_of(exact("online_softmax_merge", "m", out, m, inputs),
                      compare("online_softmax_merge", "l", out, weights.sum(axis=1), inputs, tol=1e-14),
                      compare("online_softmax_merge", "u", out, weights @ v, inputs, tol=1e-14))
    return Case(run, dict(scores=scores, values=values), check)


@hidden_test("online_softmax_merge: the empty state is the identity; empty with empty stays empty")
def merge_empty_states():
    scores, values = _blocks(2, 3, (6,), 2)

    def run(scores, values):
        from refmath.softmax import online_softmax_block, online_softmax_empty, online_softmax_merge
        block = online_softmax_block(scores[0], values[0])
        empty = online_softmax_empty(3, 2)
        left, right = online_softmax_merge(empty, block), online_softmax_merge(block, empty)
        both = online_softmax_merge(empty, empty)
        return {"block_m": block.m, "block_l": block.l, "block_u": block.u,
                "left_m": left.m, "left_l": left.l, "left_u": left.u,
                "right_m": right.m, "right_l": right.l, "right_u": right.u,
                "both_m": both.m, "both_l": both.l, "both_u": both.u}

    def check(out):
        inputs = "a (3, 6)-score block and the empty state of 3 rows, d_v = 2"
        verdicts = [exact("online_softmax_merge", f"{side}_{part}", out, out.get(f"block_{part}"),
                          inputs + f" ({side})") for side in ("left", "right") for part in "mlu"]
        verdicts += [exact("online_softmax_merge", "both_m", out, np.full(3, -np.inf), inputs + " (both empty)"),
                     exact("online_softmax_merge", "both_l", out, np.zeros(3), inputs + " (both empty)"),
                     exact("online_softmax_merge", "both_u", out, np.zeros((3, 2)), inputs + " (both empty)")]
        return all_of(*verdicts)
    return Case(run, dict(scores=scores, values=values), check)


@hidden_test("online_softmax_merge: associative, (a b) c = a (b c) (property)")
def merge_associative():
    scores, values = _blocks(3, 5, (4, 6, 3), 4)

    def run(scores, values):
        from refmath.softmax import online_softmax_block, online_softmax_merge
        a, b, c = (online_softmax_block(s, v) for s, v in zip(scores, values))
        first, second = online_softmax_merge(online_softmax_merge(a, b), c), online_softmax_merge(a, online_softmax_merge(b, c))
        return {"first_u": first.u, "first_l": first.l, "second_u": second.u, "second_l": second.l}

    def check(out):
        inputs = "three blocks of 5 rows (4, 6, 3 keys), d_v = 4"
        s, v = np.concatenate(scores, axis=1), np.concatenate(values, axis=0)
        weights = np.exp(s - s.max(axis=1, keepdims=True))
        return all_of(*(compare("online_softmax_merge", f"{order}_{part}", out, expected, inputs, tol=1e-14)
                        for order in ("first", "second")
                        for part, expected in (("u", weights @ v), ("l", weights.sum(axis=1)))))
    return Case(run, dict(scores=scores, values=values), check)


# ---- the tiled forward and backward ------------------------------------------------------------

def _forward_test(seed, b, h, g, t_q, t_k, d, causal=False, window=None, blocks=(16, 16),
                  dtype=np.float64, tol=1e-11):
    q, k, v = normal(seed, (b, h, t_q, d), (b, g, t_k, d), (b, g, t_k, d), dtype=dtype)
    options = dict(causal=causal, window=window, block_q=blocks[0], block_k=blocks[1])

    def run(q, k, v, options):
        from refmath.flash import flash_attention_forward
        o, lse = flash_attention_forward(q, k, v, **options)
        return {"o": o, "lse": lse}

    def check(out):
        o, lse = torch_dense(*torch_tensors(q, k, v, grad=False), causal=causal, window=window)
        inputs = shapes(q=q, k=k, v=v) + f", causal={causal}, window={window}, blocks {blocks}"
        kind = None if dtype == np.float64 else dtype
        return all_of(compare("flash_attention_forward", "o", out, numpy_of(o), inputs, tol=tol, dtype=kind),
                      compare("flash_attention_forward", "lse", out, numpy_of(lse), inputs, tol=tol))
    return Case(run, dict(q=q, k=k, v=v, options=options), check)


@hidden_test("flash_attention_forward: ragged lengths (37 queries, 53 keys), GQA (torch dense)")
def forward_ragged_gqa():
    return _forward_test(4, 2, 4, 2, 37, 53, 8)


@hidden_test("flash_attention_forward: causal sliding window, more queries than keys (torch dense)")
def forward_causal_window():
    return _forward_test(5, 1, 3, 1, 45, 40, 6, causal=True, window=7, blocks=(8, 16))


@hidden_test("flash_attention_forward: float32 in, float32 out (torch dense)")
def forward_float32():
    return _forward_test(6, 1, 2, 2, 33, 33, 16, causal=True, dtype=np.float32, tol=1e-5)


def dense_numpy(q, k, v, causal, window):
    """(o, lse) by the dense formulas in NumPy: the backward's inputs, made without your forward."""
    h, g = q.shape[1], k.shape[1]
    k, v = np.repeat(k, h // g, axis=1), np.repeat(v, h // g, axis=1)
    scores = (q @ np.swapaxes(k, -1, -2)) / np.sqrt(q.shape[-1])
    scores = np.where(visible(q.shape[2], k.shape[2], causal, window), scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - top)
    total = weights.sum(axis=-1, keepdims=True)
    return (weights / total) @ v, (top + np.log(total))[..., 0]


def _backward_case(seed, b, h, g, t_q, t_k, d, causal=False, window=None, blocks=(16, 16)):
    """The inputs of one flash_attention_backward case, and the check of its outputs. The backward's
    o and lse are made here, by the dense formulas, without the submission's forward."""
    q, k, v = normal(seed, (b, h, t_q, d), (b, g, t_k, d), (b, g, t_k, d))
    do = normal(seed + 1, (b, h, t_q, d))
    o, lse = dense_numpy(q, k, v, causal, window)
    options = dict(causal=causal, window=window, block_q=blocks[0], block_k=blocks[1])

    def check(out):
        import torch
        tensors = torch_tensors(q, k, v)
        o, _ = torch_dense(*tensors, causal=causal, window=window)
        (o * torch.as_tensor(do)).sum().backward()
        inputs = shapes(q=q, k=k, v=v) + f", causal={causal}, window={window}, blocks {blocks}"
        return all_of(*(compare("flash_attention_backward", name, out, numpy_of(t.grad), inputs)
                        for name, t in zip(("dq", "dk", "dv"), tensors)))
    return dict(do=do, q=q, k=k, v=v, o=o, lse=lse, options=options), check


def _backward_test(*cases):
    """One test of several flash_attention_backward cases (each a ``_backward_case``)."""
    def run(cases):
        from refmath.flash import flash_attention_backward
        out = {}
        for i, c in enumerate(cases):
            out[f"{i}:dq"], out[f"{i}:dk"], out[f"{i}:dv"] = flash_attention_backward(
                c["do"], c["q"], c["k"], c["v"], c["o"], c["lse"], **c["options"])
        return out

    def check(out):
        return all_of(*(check_one(case_out(out, i)) for i, (_, check_one) in enumerate(cases)))
    return Case(run, dict(cases=[inputs for inputs, _ in cases]), check)


# Each backward test also runs a large twin of its case: its inputs have so many entries that a
# gradient by differences (one forward call or more per entry) cannot finish within cpu_s, while
# the tiled backward takes a fraction of a second.

@hidden_test("flash_attention_backward: ragged lengths, GQA, o and lse given (torch autograd)")
def backward_ragged_gqa():
    return _backward_test(_backward_case(7, 1, 4, 2, 37, 53, 16),
                          _backward_case(17, 1, 4, 2, 517, 709, 32))


@hidden_test("flash_attention_backward: causal sliding window (torch autograd)")
def backward_causal_window():
    return _backward_test(_backward_case(8, 2, 2, 1, 41, 41, 8, causal=True, window=9, blocks=(8, 16)),
                          _backward_case(18, 2, 2, 1, 1501, 1501, 16, causal=True, window=9,
                                         blocks=(8, 16)))


@hidden_test("flash attention: peak resident memory far below one T x T matrix (kernel-measured)")
def memory_is_linear_in_length():
    # At this length one T x T score matrix of float64 for the 2 heads is 1 GiB: a dense
    # computation cannot stay under a quarter of it, a tiled one needs a few MiB beyond Python's.
    t, h, d, block = 8192, 2, 16, 64
    q, k, v, do = normal(9, (1, h, t, d), (1, h, t, d), (1, h, t, d), (1, h, t, d))

    def run(q, k, v, do, block):
        from refmath.flash import flash_attention_backward, flash_attention_forward
        o, lse = flash_attention_forward(q, k, v, causal=True, block_q=block, block_k=block)
        dq, dk, dv = flash_attention_backward(do, q, k, v, o, lse, causal=True, block_q=block,
                                              block_k=block)
        return {"o_sum": np.sum(o), "dq_sum": np.sum(dq)}

    def check(out):
        from refmath.assignments.checks import Verdict
        # read by the grader from the kernel (wait4 and /proc), for all the test's processes:
        # nothing the student's code reports about itself
        peak = float(out.get("grader:peak_rss", np.nan))
        scores = h * t * t * 8
        ok = peak < scores / 4
        return Verdict(ok, f"flash_attention_forward + backward: peak resident memory "
                       f"{peak / 2**20:.0f} MiB at T={t} (all the test's processes, measured by "
                       f"the kernel), must be < {scores / 4 / 2**20:.0f} MiB, a quarter of one "
                       f"T x T float64 score matrix per head; q (1, {h}, T, {d}), blocks {block}")
    return Case(run, dict(q=q, k=k, v=v, do=do, block=block), check)
