"""refmath.conformance's verdicts: where a failing case fails and which question it raises, the
declared conventions (empty rows for outputs and gradients, the three NaN rules), the tolerance
that measures a kernel and not BLAS (two summation orders, row by row), and the command's
options for kernels of one's own (--adapter module:Class, --inline, JAX arrays)."""
import itertools
import json

import numpy as np
import pytest

from refmath import kernels
from refmath.conformance import Conventions, bugs, check_attention, check_case, report
from refmath.conformance.adapters import NumpyAdapter
from refmath.conformance.arrays import describe, to_framework, to_host
from refmath.conformance.case import AttentionCase, make_inputs, sweep
from refmath.conformance.oracle import attention

needs_cpu = pytest.mark.skipif(not kernels.cpu_available(), reason="refmath._C is not built")

try:
    import torch
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed (the conformance "
                                 "extra's kernels under test)")


# ---- where a failing case fails ------------------------------------------------------------------

@needs_cpu
def test_a_failure_names_its_worst_row_the_split_and_the_worst_rows_keys():
    case = AttentionCase("forward", "causal", t_q=40, t_k=40, causal=True)
    result = check_case(bugs.causal_off_by_one, "refmath", case)
    assert result.status == "fail"
    where = {w["output"]: w for w in result.where}["o"]
    assert set(where["worst"]) >= {"batch", "head", "row", "error"}
    assert where["split"]["see >= 1 key"][1] == 2 * 40 and where["split"]["see no key"] == [0, 0]
    assert where["worst_row_keys"].startswith("keys 0..")
    text = report.table([result])
    assert "Where the failing cases fail" in text and "worst (batch=" in text


def test_the_wrong_alignment_is_named_as_the_question():
    case = AttentionCase("forward", "causal Tq<Tk", t_q=20, t_k=50, causal=True)
    result = check_case(bugs.top_left_alignment, "refmath", case)
    questions = [w["question"] for w in result.where if w["question"]]
    assert questions and "top-left" in questions[0]


def _fill_attention(q, k, v, mask=None, scale=None, unmasked=False):
    """Textbook attention in float32 NumPy with the mask as a finite fill that replaces the scores
    (jnp.where's way: an empty row gets the mean of V), or (``unmasked``) with the rows that see
    no key left unmasked, as an additive fill such as ONNX Runtime's -10000 leaves them (up to
    the rounding of ``s - 10000``)."""
    heads = np.arange(q.shape[1]) // (q.shape[1] // k.shape[1])
    s = (q.astype(np.float32) @ np.swapaxes(k[:, heads].astype(np.float32), -1, -2)) * np.float32(scale)
    if mask is not None and unmasked:
        s = np.where(mask | ~mask.any(axis=-1, keepdims=True), s, -np.inf)
    elif mask is not None:
        s = np.where(mask, s, np.float32(-1e9))
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return ((p / p.sum(axis=-1, keepdims=True)) @ v[:, heads].astype(np.float32)).astype(q.dtype)


EMPTY = AttentionCase("forward", "causal Tq>Tk", t_q=50, t_k=20, causal=True)  # 30 rows see nothing


@pytest.mark.parametrize("convention, kernel", [
    ("mean-of-v", _fill_attention),
    ("unmasked", lambda *a, **kw: _fill_attention(*a, unmasked=True, **kw))])
def test_an_empty_row_convention_is_named_by_the_failure_and_passes_once_declared(convention, kernel):
    result = check_case(kernel, "numpy", EMPTY)  # refmath's convention: zero
    assert result.status == "fail"
    where = result.where[0]
    assert where["split"]["see no key"][0] == 2 * 30 and where["split"]["see >= 1 key"][0] == 0
    assert f"match '{convention}'" in where["question"]
    assert "--empty-rows" in result.hint
    assert check_case(kernel, "numpy", EMPTY, masked_rows=convention).status == "pass"


@needs_torch
@pytest.mark.parametrize("convention, fill", [("mean-of-v", "replace"), ("unmasked", "unmask"),
                                              ("nan", "-inf")])
def test_empty_row_conventions_hold_the_gradients_too(convention, fill):
    """A torch attention whose empty rows follow each convention, through the sdpa adapter's
    backward: it passes under its convention and fails under refmath's zero."""
    def kernel(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
        s = (q @ k.transpose(-1, -2)) * scale
        if fill == "replace":
            s = s.masked_fill(~attn_mask, -1e9)
        elif fill == "unmask":  # rows that see nothing left unmasked
            s = s.masked_fill(~(attn_mask | ~attn_mask.any(dim=-1, keepdim=True)), float("-inf"))
        else:
            s = s.masked_fill(~attn_mask, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    case = AttentionCase("backward", "causal Tq>Tk", t_q=40, t_k=16, causal=True)
    assert check_case(kernel, "sdpa", case, masked_rows=convention).status == "pass"
    assert check_case(kernel, "sdpa", case, masked_rows="zero").status == "fail"


def test_the_oracles_empty_rows_are_the_conventions_definitions():
    case = AttentionCase("backward", "e", t_q=12, t_k=5, causal=True)  # rows 0..6 see nothing
    inputs = make_inputs(case)
    mean = attention(case, inputs, empty_rows="mean-of-v")
    np.testing.assert_allclose(mean["o"][0, 0, 0], inputs.v[0, 0].mean(axis=0), atol=1e-14)
    assert not mean["dq"][0, :, :7].any()  # the scores were replaced: no gradient reaches q
    full = attention(case.replace(causal=False), inputs)
    unmasked = attention(case, inputs, empty_rows="unmasked")
    np.testing.assert_allclose(unmasked["o"][0, :, :7], full["o"][0, :, :7], atol=1e-14)
    np.testing.assert_allclose(unmasked["dq"][0, :, :7], full["dq"][0, :, :7], atol=1e-13)


# ---- the three NaN rules -------------------------------------------------------------------------

@needs_cpu
@pytest.mark.parametrize("flags", list(itertools.product((False, True), repeat=3)),
                         ids=lambda f: "".join("MPV"[i] if x else "-" for i, x in enumerate(f)))
def test_a_decode_read_past_the_length_is_caught_under_every_nan_option(flags):
    conv = Conventions(masked_nan_may_leak=flags[0], past_length_nan_may_leak=flags[1],
                       visible_nan_may_vanish=flags[2])
    for fn, adapter in ((bugs.decode_reads_one_past, "refmath_decode"),
                        (bugs.stale_slot_read, "refmath_paged")):
        results = check_attention(fn, adapter, quick=True, conventions=conv)
        stale = [r for r in results if "stale" in r.case.label]
        assert stale and all(r.status == "fail" and "error" in r.reason for r in stale)


@needs_cpu
def test_a_kernel_that_fails_only_by_the_past_length_rule_gets_that_hint():
    case = AttentionCase("decode", "nan", b=2, h=4, g=2, t_q=1, t_k=64, lengths=(64, 33), inputs="nan")
    result = check_case(bugs.decode_reads_one_past, "refmath_decode", case)
    assert result.status == "fail" and "past the decode length" in result.reason
    assert "--allow-past-length-nan" in result.hint


def test_a_visible_nan_that_vanishes_fails_unless_declared():
    def nan_to_zero(q, k, v, mask=None, scale=None):
        return np.nan_to_num(bugs.numpy_attention(q, k, v, mask, scale), nan=0.0)

    case = AttentionCase("forward", "nan", t_q=33, t_k=33, causal=True, inputs="nan")
    result = check_case(nan_to_zero, "numpy", case)
    assert result.status == "fail" and "--allow-lost-nan" in result.hint
    assert check_case(nan_to_zero, "numpy", case,
                      conventions=Conventions(visible_nan_may_vanish=True)).status == "pass"


# ---- the tolerance: two summation orders, and row by row -----------------------------------------

def _long_decode():
    return [c for c in sweep(("decode",)) if c.t_k >= 8192]


def test_a_correct_in_order_float32_kernel_passes_at_8k_keys_and_a_bf16_accumulator_fails():
    (case,) = _long_decode()
    ok = check_case(bugs.in_order_decode, "refmath_decode", case)
    assert ok.status == "pass", ok.reason
    inputs = make_inputs(case)  # it would not pass against BLAS's sum alone
    ref = attention(case, inputs)
    blas = np.nanmax(np.abs(attention(case, inputs, "float32")["o"] - ref["o"]))
    loop = np.nanmax(np.abs(attention(case, inputs, "float32", order="in-order")["o"] - ref["o"]))
    assert loop > 2 * blas
    bad = check_case(bugs.bf16_accumulator_decode, "refmath_decode", case)
    assert bad.status == "fail" and bad.worst.ratio > 100


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_an_error_in_a_few_rows_is_caught_row_by_row_under_the_output_wide_bound(dtype):
    results = check_attention(bugs.low_precision_tail_rows, "numpy", quick=True, dtypes=(dtype,))
    caught = [r for r in results if r.status == "fail"]
    assert caught
    by_rows = [r for r in caught if "rows exceed their own tolerance" in r.reason]
    assert by_rows and all(r.worst.ratio <= 1 for r in by_rows)  # under the output-wide bound
    assert all(w["worst"]["row"] >= 64 for r in by_rows for w in r.where)  # in the tail rows


def test_an_lse_error_in_the_rows_of_small_magnitude_is_caught_row_by_row():
    """The lse held row by row: in a case whose rows differ in magnitude (large scores), an error
    of 0.8 of the output-wide tolerance in the quarter of rows of smallest |lse| passes that
    tolerance, which the largest rows set, and fails the rows' own."""
    (case,) = [c for c in sweep(("forward",)) if c.label == "large causal" and c.dtype == "float32"]
    honest = check_case(kernels.flash_attention_forward, "refmath", case)
    assert honest.status == "pass"
    tol = {c.name: c.tolerance for c in honest.checks}["lse"]

    def small_rows_off(q, k, v, causal=False, window=None, scale=None):
        o, lse = kernels.flash_attention_forward(q, k, v, causal, window, scale)
        lse = lse.copy()
        small = np.abs(lse) < np.quantile(np.abs(lse), 0.25)
        lse[small] += np.float32(0.8 * tol)
        return o, lse

    result = check_case(small_rows_off, "refmath", case)
    assert result.status == "fail" and result.worst.name == "lse"
    assert result.worst.error < result.worst.tolerance  # under the output-wide bound
    assert "lse: " in result.reason and "rows exceed their own tolerance" in result.reason


# ---- the report ----------------------------------------------------------------------------------

@needs_cpu
def test_the_reports_carry_what_was_run_and_where_it_failed(tmp_path):
    cases = [AttentionCase("forward", "causal", t_q=40, t_k=40, causal=True),
             AttentionCase("forward", "mha", t_q=16, t_k=16)]
    results = check_attention(bugs.causal_off_by_one, "refmath", cases=cases)
    for name in ("r.md", "r.json", "r.png"):
        report.write(results, tmp_path / name, kernel="refmath.conformance.bugs:causal_off_by_one",
                     adapter="refmath", dtypes=["float32"])
    md = (tmp_path / "r.md").read_text()
    for words in ("kernel: refmath.conformance.bugs:causal_off_by_one", "adapter: refmath",
                  "dtypes: float32", "conventions: empty rows: zero", "versions: python",
                  "B=1 H=2 G=2 Tq=40 Tk=40 D=64, causal bottom-right", "## Where the failing"):
        assert words in md, words
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["versions"]["numpy"] == np.__version__ and doc["conventions"]["empty_rows"] == "zero"
    failed = doc["cases"][0]
    assert failed["parameters"]["t_q"] == 40 and failed["where"][0]["worst"]["batch"] == 0


# ---- adapters of one's own, inline calls, JAX arrays ---------------------------------------------

class ThreadBoundAdapter(NumpyAdapter):
    """The numpy convention, for a kernel that works only on the thread that imported it."""

    name = "thread-bound numpy"


def test_the_command_takes_an_adapter_as_module_class_and_runs_inline(capsys, monkeypatch):
    import threading

    from refmath.commands import main

    main_thread = threading.main_thread()

    def thread_bound(q, k, v, mask=None, scale=None):
        if threading.current_thread() is not main_thread:
            raise RuntimeError("called from another thread")
        return bugs.numpy_attention(q, k, v, mask, scale)

    monkeypatch.setattr(bugs, "thread_bound", thread_bound, raising=False)
    args = ["conformance", "attention", "refmath.conformance.bugs:thread_bound", "--adapter",
            f"{__name__}:ThreadBoundAdapter", "--quick", "--contract", "forward"]
    assert main(args + ["--fail-fast"]) == 1  # on the sweep's thread: it raises
    assert "called from another thread" in capsys.readouterr().out
    assert main(args + ["--inline"]) == 0


def test_a_bad_custom_adapter_is_refused_in_one_line(capsys):
    from refmath.commands import main

    assert main(["conformance", "attention", "refmath.conformance.bugs:numpy_attention",
                 "--adapter", "refmath.conformance.bugs:numpy_attention"]) == 2
    assert "not a subclass" in capsys.readouterr().err


def test_the_help_says_what_the_numpy_adapter_calls(capsys):
    from refmath.commands import main

    with pytest.raises(SystemExit):
        main(["conformance", "attention", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "f(q, k, v, mask=None, scale=None) -> o" in out and "module:Class" in out


def test_jax_arrays_go_in_by_dlpack_and_come_back():
    jax = pytest.importorskip("jax", reason="jax is not installed (the conformance extra's "
                                            "adapters test it where it is)")
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 4))
    for dtype in ("float32", "bfloat16", "float16"):
        exact = to_host(to_framework(x, dtype))
        y = to_framework(exact, dtype, "jax")
        assert isinstance(y, jax.Array) and describe(y) == (dtype, "cpu")
        np.testing.assert_array_equal(to_host(y), exact)
