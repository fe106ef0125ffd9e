"""refmath.conformance: the oracle against the dense reference, the bound, the verdicts on bad
kernels, DLPack, and the kernels that must pass (refmath's C++ kernels, PyTorch's SDPA)."""
import math
import time

import numpy as np
import pytest

from refmath import conformance, kernels
from refmath.attention import gqa_head_map, sdpa_backward, sdpa_forward
from refmath.conformance import bounds, oracle
from refmath.conformance.arrays import describe, to_framework, to_host
from refmath.conformance.bugs import numpy_attention
from refmath.conformance.case import AttentionCase, make_inputs, sweep, visible
from refmath.conformance.precision import numpy_dtype, unit_roundoff
from refmath.conformance.run import check_attention, check_case

needs_cpu = pytest.mark.skipif(not kernels.cpu_available(), reason="refmath._C is not built")


def _dense_reference(case, inputs):
    """o, dq, dk, dv by refmath.attention's dense float64 ops, one sequence at a time."""
    heads = gqa_head_map(case.h, case.g)
    o = np.zeros_like(inputs.q)
    grads = [np.zeros_like(inputs.q), np.zeros_like(inputs.k), np.zeros_like(inputs.v)]
    for b in range(case.b):
        vis = visible(case, b)
        mask = np.where(vis, 0.0, -np.inf)
        if case.alibi:
            p = np.arange(case.t_q)[:, None] + case.t_k - case.t_q
            slopes = 2.0 ** (-8.0 * np.arange(1, case.h + 1) / case.h)
            mask = mask[None] - slopes[:, None, None] * np.abs(p - np.arange(case.t_k))[None]
        ob, cache = sdpa_forward(inputs.q[b:b + 1], inputs.k[b:b + 1][:, heads],
                                 inputs.v[b:b + 1][:, heads], mask=mask, scale=case.scale_value)
        o[b] = np.where(vis.any(axis=1)[None, :, None], ob[0], 0.0)
        if inputs.dout is not None:
            dq, dk, dv = sdpa_backward(inputs.dout[b:b + 1], cache)
            grads[0][b] = dq[0]
            for r in range(case.h):
                grads[1][b, heads[r]] += dk[0, r]
                grads[2][b, heads[r]] += dv[0, r]
    return o, grads


ORACLE_CASES = [
    AttentionCase("backward", "gqa causal", h=4, g=2, t_q=33, t_k=33, causal=True),
    AttentionCase("backward", "top-left Tq<Tk", t_q=9, t_k=40, causal=True, alignment="top-left"),
    AttentionCase("backward", "window left+right", t_q=30, t_k=30, window=(5, 3)),
    AttentionCase("backward", "padding", b=2, t_q=20, t_k=20, lengths=(20, 7)),
    AttentionCase("backward", "alibi", h=4, g=4, t_q=20, t_k=20, alibi=True, causal=True),
]


@pytest.mark.parametrize("case", ORACLE_CASES, ids=lambda c: c.label)
def test_the_oracle_equals_the_dense_reference_forward_and_backward(case):
    inputs = make_inputs(case)
    ref = oracle.attention(case, inputs)
    o, (dq, dk, dv) = _dense_reference(case, inputs)
    np.testing.assert_allclose(ref["o"], o, atol=1e-12)
    for name, want in (("dq", dq), ("dk", dk), ("dv", dv)):
        np.testing.assert_allclose(ref[name], want, atol=1e-11, err_msg=name)


def test_the_soft_cap_is_cap_tanh_of_the_scores_and_its_gradient_by_differences():
    case = AttentionCase("backward", "softcap", t_q=6, t_k=7, d=8, softcap=2.0, causal=True)
    inputs = make_inputs(case)
    ref = oracle.attention(case, inputs)
    s = 2.0 * np.tanh(case.scale_value * inputs.q[0, 0] @ inputs.k[0, 0].T / 2.0)
    s = np.where(visible(case), s, -np.inf)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    np.testing.assert_allclose(ref["o"][0, 0], (p / p.sum(axis=1, keepdims=True)) @ inputs.v[0, 0],
                               atol=1e-12)
    h = 1e-6  # central difference of sum(o * dout) in one coordinate of q
    q_plus, q_minus = inputs.q.copy(), inputs.q.copy()
    q_plus[0, 1, 3, 2] += h
    q_minus[0, 1, 3, 2] -= h
    f = [np.sum(oracle.attention(case.replace(contract="forward"),
                                 type(inputs)(qq, inputs.k, inputs.v))["o"] * inputs.dout)
         for qq in (q_plus, q_minus)]
    assert abs((f[0] - f[1]) / (2 * h) - ref["dq"][0, 1, 3, 2]) < 1e-7


def test_chunks_of_query_rows_give_the_same_numbers(monkeypatch):
    case = AttentionCase("backward", "chunks", t_q=50, t_k=70, causal=True, inputs="nan")
    inputs = make_inputs(case)
    whole = oracle.attention(case, inputs)
    monkeypatch.setattr(oracle, "CHUNK_ELEMENTS", 70 * 7)  # seven rows per chunk
    chunked = oracle.attention(case, inputs)
    for name in ("o", "lse", "dq", "dk", "dv"):  # dk, dv sum the chunks: float64 rounding apart
        np.testing.assert_allclose(chunked[name], whole[name], rtol=1e-13, atol=1e-14, err_msg=name)
        np.testing.assert_array_equal(np.isnan(chunked[name]), np.isnan(whole[name]))


def test_nan_reaches_exactly_the_rows_that_see_it():
    case = AttentionCase("forward", "nan", t_q=20, t_k=20, causal=True, inputs="nan")
    inputs = make_inputs(case)
    ref = oracle.attention(case, inputs)
    k_bad = np.isnan(inputs.k[0, 0]).any(axis=1)
    sees_bad = (visible(case) & k_bad[None, :]).any(axis=1)
    assert sees_bad.any() and not sees_bad.all()
    np.testing.assert_array_equal(np.isnan(ref["o"][0, 0]).any(axis=1), sees_bad)


@pytest.fixture(scope="module")
def quick_results():
    """The quick sweep: the forward in every dtype through a plain NumPy kernel, and every contract
    through refmath's kernels (float32)."""
    runs = [(numpy_attention, "numpy", dtype) for dtype in ("float32", "bfloat16", "float16")]
    if kernels.cpu_available():
        runs += [(kernels.flash_attention_backward, "refmath_backward", "float32"),
                 (kernels.decode, "refmath_decode", "float32"),
                 (kernels.paged_decode, "refmath_paged", "float32")]
    return [r for fn, adapter, dtype in runs
            for r in check_attention(fn, adapter, quick=True, dtypes=(dtype,))]


def test_no_tolerance_is_below_half_an_ulp_of_its_outputs_largest_magnitude(quick_results):
    checked = 0
    for r in quick_results:
        dtype = r.case.dtype
        for c in r.checks:
            half_ulp = 0.5 * float(np.spacing(np.array(c.magnitude).astype(numpy_dtype(dtype))))
            assert c.tolerance >= half_ulp, (r.case.id, c)
            assert c.tolerance >= 2 * unit_roundoff(dtype) * c.magnitude
            checked += 1
    assert checked >= 90


def test_the_plain_numpy_kernel_passes_in_every_dtype(quick_results):
    numpy_runs = [r for r in quick_results if r.case.contract == "forward"]
    assert {r.case.dtype for r in numpy_runs} == {"float32", "bfloat16", "float16"}
    assert not [(r.case.id, r.reason) for r in numpy_runs if r.status == "fail"]


def test_tolerance_is_c_times_the_plain_error_or_the_ulp_floor():
    case = AttentionCase("forward", "x", dtype="bfloat16")
    assert bounds.tolerance(case, "o", 0.01, 1.0) == pytest.approx(2 * 0.01)
    assert bounds.tolerance(case, "dq", 0.01, 1.0) == pytest.approx(3 * 0.01)
    assert bounds.tolerance(case, "o", 0.0, 4.0) == pytest.approx(2 * 2**-8 * 4.0)


def test_the_a_priori_bound_holds_for_the_plain_implementation():
    for dtype in ("float32", "bfloat16", "float16"):
        for case in sweep(("forward",), (dtype,), quick=True)[:12]:
            inputs = make_inputs(case)
            ref, plain = oracle.attention(case, inputs), oracle.attention(case, inputs, dtype)
            bound = bounds.apriori(case, inputs, ref)
            err = np.nanmax(np.abs(plain["o"] - ref["o"]))
            assert err <= bound["o"], (case.id, err, bound)


def test_the_wrong_causal_kernel_of_mlir_air_1427_passes_atol_half_but_fails_here():
    from refmath.conformance.bugs import causal_ignored

    case = AttentionCase("forward", "mlir-air", t_q=64, t_k=64, causal=True, inputs="uniform")
    inputs = make_inputs(case)
    q, k, v = (x.astype(np.float32) for x in (inputs.q, inputs.k, inputs.v))
    o, _ = causal_ignored(q, k, v, causal=True)
    ref = oracle.attention(case, inputs)["o"]
    assert np.allclose(o, ref, atol=0.5)  # the test that let it through
    assert np.corrcoef(o.ravel(), ref.ravel())[0, 1] < 0.5  # and yet nothing like the reference
    result = check_case(causal_ignored, "refmath", case)
    assert result.status == "fail" and "error" in result.reason


# ---- the kernels that must pass ------------------------------------------------------------------

@needs_cpu
@pytest.mark.parametrize("fn, adapter", [
    (kernels.flash_attention_forward, "refmath"), (kernels.flash_attention_backward, "refmath_backward"),
    (kernels.decode, "refmath_decode"), (kernels.paged_decode, "refmath_paged")],
    ids=["forward", "backward", "decode", "paged"])
def test_refmath_cpu_kernels_pass_every_applicable_case(fn, adapter):
    # The quick sweep keeps the suite fast; `python -m refmath conformance attention
    # refmath.kernels:flash_attention_forward --adapter refmath` runs the default one.
    results = check_attention(fn, adapter, quick=True)
    failed = [(r.case.id, r.reason) for r in results if r.status == "fail"]
    assert not failed
    assert sum(r.status == "pass" for r in results) >= 6
    assert all(r.deterministic for r in results if r.status == "pass")
    print(conformance.report.summary(results))


try:
    import torch
except ImportError:
    torch = None


@pytest.fixture(scope="module")
def sdpa():
    if torch is None:
        pytest.skip("torch is not installed (CI installs it: its SDPA is a kernel under test)")
    import torch.nn.functional as F

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield F.scaled_dot_product_attention
    torch.set_num_threads(threads)


def test_torch_sdpa_passes_every_applicable_case_under_its_declared_conventions(sdpa):
    # The sdpa adapter declares that masked-key NaN may leak: the README's command passes as written.
    results = check_attention(sdpa, "sdpa", quick=True, dtypes=("float32", "bfloat16"))
    assert not [(r.case.id, r.reason) for r in results if r.status == "fail"]
    assert sum(r.status == "pass" for r in results) > 60


def test_torch_sdpa_leaks_nan_from_masked_keys_and_the_strict_sweep_says_so(sdpa):
    """PyTorch adds a boolean mask to the scores as -inf (NaN + -inf = NaN), and its backward
    multiplies masked weights of 0 by NaN keys: the only cases it fails, and for that reason."""
    strict = conformance.conventions.Conventions()
    results = check_attention(sdpa, "sdpa", quick=True, dtypes=("float32",), conventions=strict)
    failed = {r.case.id: r for r in results if r.status == "fail"}
    assert set(failed) == {"forward/nan padding/float32", "backward/nan causal/float32"}
    assert all("NaN from a key the mask hides" in r.reason for r in failed.values())
    assert all("--allow-masked-nan" in r.hint for r in failed.values())  # the flag is named


def test_dlpack_round_trip_with_torch_cpu_tensors(sdpa):
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 4)).astype(np.float32)
    t = torch.from_dlpack(x)  # what to_framework does with the float32 buffer
    assert t.data_ptr() == x.ctypes.data  # no copy either way
    back = np.from_dlpack(t)
    assert back.ctypes.data == x.ctypes.data
    for dtype in ("float32", "bfloat16", "float16"):
        exact = x.astype(numpy_dtype(dtype)).astype(np.float64)
        tt = to_framework(exact, dtype, "torch")
        assert describe(tt) == (dtype, "cpu")
        np.testing.assert_array_equal(to_host(tt), exact)
        strided = to_framework(exact, dtype, "torch", strided=True)
        assert not strided.is_contiguous()
        np.testing.assert_array_equal(to_host(strided), exact)


# ---- bad kernels: a failed case with the reason, never a crash -----------------------------------

def _wrong_shape(q, k, v, **kw):
    return q[..., :-1]


def _wrong_dtype(q, k, v, **kw):
    return numpy_attention(q, k, v, **kw).astype(np.float64)


def _raises(q, k, v, **kw):
    raise RuntimeError("kernel launch failed")


def _hangs(q, k, v, **kw):
    time.sleep(5)
    return numpy_attention(q, k, v, **kw)


def _not_an_array(q, k, v, **kw):
    return "done"


@pytest.mark.parametrize("fn, words", [(_wrong_shape, "shape"), (_wrong_dtype, "dtype float64"),
                                       (_raises, "raised RuntimeError: kernel launch failed"),
                                       (_hangs, "did not return within"), (_not_an_array, "not an array")])
def test_a_bad_kernel_fails_its_cases_with_the_reason(fn, words):
    cases = sweep(("forward",), ("float32",), quick=True)[:2]
    # A short limit only for the one that hangs: on a busy machine a working call may take a while.
    results = check_attention(fn, "numpy", cases=cases, timeout=1.0 if fn is _hangs else 60.0)
    assert [r.status for r in results] == ["fail", "fail"]
    assert all(words in r.reason for r in results), [r.reason for r in results]


def test_a_result_on_another_device_fails_its_case(sdpa):
    def on_meta(q, k, v, **kw):
        return torch.empty(q.shape, dtype=q.dtype, device="meta")

    result = check_case(on_meta, "sdpa", AttentionCase("forward", "meta"))
    assert result.status == "fail" and "is on meta" in result.reason


def test_a_nondeterministic_kernel_fails_the_determinism_check():
    calls = []

    def jitter(q, k, v, **kw):
        calls.append(1)
        o = numpy_attention(q, k, v, **kw)
        return (o * np.float32(1 + 2**-23 * (len(calls) % 2))).astype(o.dtype)

    result = check_case(jitter, "numpy", AttentionCase("forward", "x"))
    assert result.status == "fail" and result.deterministic is False


def test_the_all_masked_row_convention_is_selectable():
    case = AttentionCase("forward", "empty rows", t_q=20, t_k=8, causal=True)  # 12 rows see nothing
    assert check_case(numpy_attention, "numpy", case).status == "pass"
    result = check_case(numpy_attention, "numpy", case, masked_rows="nan")
    assert result.status == "fail" and "should be NaN" in result.reason


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="contract"):
        AttentionCase("prefill", "x")
    with pytest.raises(ValueError, match="g = 3 must divide h = 4"):
        AttentionCase("forward", "x", h=4, g=3)
    with pytest.raises(ValueError, match="adapter must be one of"):
        conformance.get_adapter("flashinfer")
    with pytest.raises(TypeError, match="fn must be a callable"):
        check_attention("not a kernel", "numpy")
    with pytest.raises(ValueError, match="masked_rows"):
        check_case(numpy_attention, "numpy", AttentionCase("forward", "x"), masked_rows="inf")
    with pytest.raises(ValueError, match="dtypes"):
        sweep(dtypes=("float128",))


@pytest.mark.parametrize("case", conformance.cases("numpy", quick=True)[:3])
def test_the_pytest_helper_runs_a_kernel_through_one_case(case):
    result = conformance.assert_conforms(numpy_attention, "numpy", case)
    assert result.status == "pass" and result.checks


def test_the_report_writes_markdown_json_and_a_figure(tmp_path):
    import json

    results = check_attention(numpy_attention, "numpy", cases=sweep(("forward",), quick=True)[:4]
                              + [AttentionCase("forward", "alibi", alibi=True)])
    for name in ("r.md", "r.json", "r.png"):
        conformance.report.write(results, tmp_path / name, kernel="numpy_attention")
    md = (tmp_path / "r.md").read_text()
    assert "| forward/mha/float32 | B=2 H=4 G=4 Tq=128 Tk=128 D=64, randn | pass |" in md
    assert "not applicable" in md
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["kernel"] == "numpy_attention" and len(doc["cases"]) == 5
    assert doc["cases"][0]["checks"][0]["error"] <= doc["cases"][0]["checks"][0]["tolerance"]
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert math.isfinite(results[0].worst.ratio)


# ---- the command ---------------------------------------------------------------------------------

def test_the_command_exits_0_when_every_case_passes_and_writes_the_reports(tmp_path, capsys):
    from refmath.commands import main

    md, js = tmp_path / "r.md", tmp_path / "r.json"
    status = main(["conformance", "attention", "refmath.conformance.bugs:numpy_attention",
                   "--adapter", "numpy", "--quick", "--report", str(md), str(js)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "forward/causal Tq<Tk bottom-right/float32" in out and "0 failed" in out
    assert md.exists() and js.exists()


@needs_cpu
def test_the_command_exits_1_when_a_case_fails(capsys):
    from refmath.commands import main

    status = main(["conformance", "attention", "refmath.conformance.bugs:scale_one_over_d",
                   "--adapter", "refmath", "--quick", "--fail-fast"])
    out = capsys.readouterr().out
    assert status == 1 and "FAIL" in out and "1 failed" in out


@pytest.mark.parametrize("spec, words", [("refmath.conformance.bugs", "MODULE:FUNCTION"),
                                         ("refmath.conformance.bugs:no_such", "no attribute"),
                                         ("refmath.conformance.bugs:BUGS", "not a callable")])
def test_the_command_refuses_a_kernel_it_cannot_load(spec, words, capsys):
    from refmath.commands import main

    assert main(["conformance", "attention", spec, "--adapter", "numpy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("refmath conformance: ") and words in err


# ---- an adapter of one's own: a decode kernel over fp8 caches ------------------------------------

class Fp8DecodeAdapter(conformance.adapters.Adapter):
    """``f(q, k_cache, v_cache, lengths) -> o``: q bfloat16 ``(B, H, D)``, caches fp8."""

    name = "fp8 decode"
    contracts = ("decode",)
    dtypes = ("bfloat16",)
    kv_dtypes = ("float8_e4m3fn", "float8_e5m2")

    def call(self, fn, case, inputs):
        (q,) = self.arrays(case, inputs.q[:, :, 0])
        k, v = self.arrays(case, inputs.k, inputs.v, dtype=case.cache_dtype)
        o = fn(q, k, v, np.asarray(case.lengths))
        return {"o": self.result("o", o, inputs.q.shape[:2] + inputs.q.shape[3:], case)[:, :, None]}


def _fp8_decode(q, k_cache, v_cache, lengths, query_in_cache_format=False):
    """Dequantise each sequence's cached keys and values and attend in float32; the bug variant
    rounds the query to the cache's fp8 format first (scores computed in fp8)."""
    out = np.zeros(q.shape, dtype=np.float32)
    heads = gqa_head_map(q.shape[1], k_cache.shape[1])
    for b, n in enumerate(lengths):
        qb = q[b].astype(k_cache.dtype) if query_in_cache_format else q[b]
        k, v = (x[b, heads, :n].astype(np.float32) for x in (k_cache, v_cache))
        s = np.einsum("hd,hjd->hj", qb.astype(np.float32), k) / np.float32(math.sqrt(q.shape[-1]))
        if n:
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[b] = np.einsum("hj,hjd->hd", p / p.sum(axis=1, keepdims=True), v)
    return out.astype(q.dtype)


def test_an_adapter_of_ones_own_runs_the_fp8_cache_cases():
    adapter = Fp8DecodeAdapter()
    results = check_attention(_fp8_decode, adapter, quick=True, dtypes=("bfloat16",))
    ran = [r for r in results if r.status != "skip"]
    assert {r.case.kv_dtype for r in ran} == {None, "float8_e4m3fn", "float8_e5m2"}
    assert all(r.status == "pass" for r in ran), [(r.case.id, r.reason) for r in ran]

    def scores_in_fp8(*args):
        return _fp8_decode(*args, query_in_cache_format=True)

    caught = check_attention(scores_in_fp8, adapter, quick=True, dtypes=("bfloat16",))
    fp8 = [r for r in caught if r.case.kv_dtype]
    assert fp8 and all(r.status == "fail" and "error" in r.reason for r in fp8)


def test_the_command_refuses_a_sweep_where_no_case_applies(capsys):
    from refmath.commands import main

    assert main(["conformance", "attention", "refmath.conformance.bugs:numpy_attention",
                 "--adapter", "numpy", "--quick", "--contract", "decode"]) == 2
    assert "nothing was checked" in capsys.readouterr().err
