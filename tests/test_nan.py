"""NaN in gives NaN out: a property of every registered op, forward and backward.

Which outputs must turn NaN when one input entry is NaN? Exactly those that depend on that entry.
We find them without knowing the op: set the entry to a few different finite values and record every
output (and gradient) that changes. Each of those is a function of the entry, so with the entry NaN
it must be NaN, never a finite number. Outputs that did not change are left unconstrained: they may
not depend on the entry at all (a masked key, an ignored token), and reading such an entry may or
may not let its NaN through (``0 * NaN`` is NaN), which is no error either way.
"""
import numpy as np
import pytest

from refmath.flash import flash_attention_backward, flash_attention_forward
from refmath.gradcheck import all_cases
from refmath.registry import OpCase
from refmath.softmax import (online_softmax_block, online_softmax_empty, online_softmax_logsumexp,
                             online_softmax_merge, online_softmax_result)

# every single-function case: the ops and the attention executions (flash, RoPE and MLA attention)
CASES = [case for case in all_cases(None) if isinstance(case, OpCase)]
PROBES = 3  # finite values tried at each entry
ENTRIES = 4  # entries tried per input
# The MoE layer runs each expert's matrix products over the tokens routed to it. A probe that
# re-routes one token hands the other tokens of those experts to BLAS in a batch of another size,
# whose blocking can change their last bits although they do not depend on the probed entry. For
# these ops a change counts as a dependence only above ROUNDING times the largest magnitude of its
# array (the output or one gradient); a real dependence moves an entry by far more.
ROUTED_OPS = {"moe"}
ROUNDING = 1e-12


def _changed(a, b, tolerance=0.0):
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    if np.any(tolerance):
        same |= np.abs(a - b) <= tolerance
    return ~same


def assert_nan_propagates(run, arrays: dict, targets, label: str, rng,
                          rounding: float = 0.0) -> None:
    """For each ``(name, flat index)`` in ``targets``: every entry of ``run(arrays)`` (a flat float
    vector, or a list of arrays) that changes as ``arrays[name].flat[index]`` takes a few finite
    values must be NaN when that entry is NaN. With ``rounding``, a change of at most ``rounding``
    times the largest magnitude of its array is not a change."""
    def flat_run(a):
        parts = run(a)
        parts = [parts] if isinstance(parts, np.ndarray) else parts
        magnitudes = (np.concatenate([np.full(np.size(p), np.abs(p).max(initial=0.0))
                                      for p in parts]) if rounding else 0.0)
        return np.concatenate([np.ravel(p) for p in parts]), magnitudes

    for name, index in targets:
        trial = {k: (np.array(v, dtype=np.float64) if k == name else v) for k, v in arrays.items()}
        target = trial[name]
        probes, scale = [], 0.0
        for value in rng.standard_normal(PROBES):
            target.flat[index] = value
            values, magnitudes = flat_run(trial)
            probes.append(values)
            scale = np.maximum(scale, magnitudes)
        depends = np.zeros(probes[0].shape, dtype=bool)
        for other in probes[1:]:
            depends |= _changed(probes[0], other, rounding * scale)
        target.flat[index] = np.nan
        finite = depends & ~np.isnan(flat_run(trial)[0])
        assert not finite.any(), (
            f"{label}: NaN at {name}.flat[{index}] left {finite.sum()} of the {depends.sum()} "
            f"dependent outputs/gradients finite (e.g. flat {np.flatnonzero(finite)[:5]})"
        )


def _some_entries(arrays: dict, rng):
    """(name, flat index) pairs: a few entries of every floating-point array in ``arrays``."""
    return [(name, int(i)) for name, x in arrays.items()
            if isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.floating)
            for i in rng.choice(x.size, size=min(ENTRIES, x.size), replace=False)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_registered_op(case):
    inputs = case.make_inputs(np.random.default_rng(0))
    out, _ = case.forward(**inputs)
    arrays = dict(inputs, dout=np.random.default_rng(2).standard_normal(np.shape(out)))

    def run(a):
        a = dict(a)
        dout = a.pop("dout")
        out, cache = case.forward(**a)
        grads = case.grads_by_name(case.backward(dout, cache))
        return [np.asarray(out)] + [grads[name] for name in case.wrt]

    rng = np.random.default_rng(1)
    assert_nan_propagates(run, arrays, _some_entries(arrays, rng), case.name, rng,
                          rounding=ROUNDING if case.op in ROUTED_OPS else 0.0)


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, 3)])
def test_flash_reference(causal, window):
    # T_q = 5 queries against T_k = 7 keys in tiles of 2 and 3: partly masked tiles, skipped tiles,
    # GQA (H = 4 query heads on G = 2 key/value heads) and one row with no visible key (window).
    rng = np.random.default_rng(3)
    arrays = {"q": rng.standard_normal((1, 4, 5, 3)), "k": rng.standard_normal((1, 2, 7, 3)),
              "v": rng.standard_normal((1, 2, 7, 2)), "do": rng.standard_normal((1, 4, 5, 2))}
    options = dict(causal=causal, window=window, block_q=2, block_k=3)

    def run(a):
        o, lse = flash_attention_forward(a["q"], a["k"], a["v"], **options)
        grads = flash_attention_backward(a["do"], a["q"], a["k"], a["v"], o, lse, **options)
        return np.concatenate([o.ravel(), lse.ravel()] + [g.ravel() for g in grads])

    assert_nan_propagates(run, arrays, _some_entries(arrays, rng), "flash", rng)


def test_online_softmax_state_with_nan():
    scores = np.array([[0.5, np.nan, 1.0], [-np.inf, -np.inf, -np.inf]])
    state = online_softmax_block(scores, np.ones((3, 2)))
    assert np.isnan(online_softmax_result(state)[0]).all()
    assert np.isnan(online_softmax_logsumexp(state)[0])
    # the fully masked row is still the empty state: output 0, logsumexp -inf
    np.testing.assert_array_equal(online_softmax_result(state)[1], [0.0, 0.0])
    assert online_softmax_logsumexp(state)[1] == -np.inf
    merged = online_softmax_merge(online_softmax_empty(2, 2), state)
    assert np.isnan(online_softmax_result(merged)[0]).all()
