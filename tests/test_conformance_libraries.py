"""Other libraries' attention through refmath.conformance's adapters (the conformance-libraries
extra): ONNX Runtime's Attention, MultiHeadAttention and GroupQueryAttention, JAX, tinygrad. Each
passes apart from its pinned defects, and each defect is pinned here as the sweep reports it
(docs/kernels.md, "What the suite found in ONNX Runtime"). Tests skip where a package is absent."""
import numpy as np
import pytest

from refmath.conformance import check_attention, check_case
from refmath.conformance.case import AttentionCase, sweep


@pytest.fixture(scope="module")
def ort():
    pytest.importorskip("onnx", reason="the conformance-libraries extra is not installed")
    return pytest.importorskip("onnxruntime", reason="the conformance-libraries extra is not "
                               "installed").InferenceSession


def _failed(results):
    return {r.case.id: r for r in results if r.status == "fail"}


def test_onnx_attention_passes_the_forward_and_reads_past_decode_lengths(ort):
    results = check_attention(ort, "onnx_attention", quick=True)
    failed = _failed(results)
    assert not [i for i in failed if i.startswith("forward/")]
    # Pinned: nonpad_kv_seqlen masks the slots past each length additively, so their NaN reaches
    # the output (finite stale slots are masked away: the read, not the arithmetic, is the fault).
    past = [r for r in failed.values() if "past the decode length" in r.reason]
    assert len(past) >= 3 and all("--allow-past-length-nan" in r.hint for r in past)
    assert "decode/stale slots/float32" not in failed
    # and an empty sequence gives NaN: a convention, named as such
    assert "empty rows" in failed["decode/empty sequence/float32"].where[0]["question"]


def test_ort_multi_head_attention_unidirectional_with_fewer_queries_is_pinned(ort):
    """Pinned: with unidirectional=1 and T_q < T_k (no past), rows 0..T_q-2 are masked top-left and
    the last row sees every key, so under top-left only the last row of each head fails."""
    case = AttentionCase("forward", "causal Tq<Tk top-left", t_q=37, t_k=129, causal=True,
                         alignment="top-left")
    result = check_case(ort, "ort_mha", case)
    assert result.status == "fail"
    where = result.where[0]
    assert where["worst"]["row"] == 36 and where["failing_rows"] == case.h
    assert where["worst_row_keys"] == "keys 0..36: 37 of 129"
    assert 0.3 < where["worst"]["error"] < 0.5


def test_ort_group_query_attention_loses_a_visible_nan_in_float32_only(ort):
    case = AttentionCase("forward", "nan causal", t_q=65, t_k=65, causal=True, inputs="nan")
    f32 = check_case(ort, "ort_gqa", case)
    assert f32.status == "fail" and "--allow-lost-nan" in f32.hint  # pinned: NaN row comes out 0
    assert f32.where[0]["split"]["see >= 1 key"][0] == 0
    assert check_case(ort, "ort_gqa", case.replace(dtype="float16")).status == "pass"


def test_ort_group_query_attention_decode_at_8k_keys_passes(ort):
    """It failed at 1.27x of a tolerance measured against BLAS's sum alone."""
    (case,) = [c for c in sweep(("decode",)) if c.t_k >= 8192]
    result = check_case(ort, "ort_gqa", case)
    assert result.status == "pass", result.reason


def test_jax_dot_product_attention_passes_under_its_declared_conventions():
    jax = pytest.importorskip("jax", reason="the conformance-libraries extra is not installed")
    cases = [c for c in sweep(("forward", "backward"), quick=True)
             if c.label in ("causal Tq>Tk bottom-right", "nan padding", "gqa ratio 3", "causal")]
    results = check_attention(jax.nn.dot_product_attention, "jax", cases=cases)
    assert not _failed(results), [(r.case.id, r.reason) for r in _failed(results).values()]
    assert sum(r.status == "pass" for r in results) == len(cases)


def _tinygrad_with_a_compiler():
    """tinygrad, or a skip naming what is missing: its CPU backend compiles each kernel with a C
    compiler (``$CC``, clang by default), so the package alone cannot run anything."""
    import os
    import shutil

    need = "tinygrad (the conformance-libraries extra) and a C compiler for its CPU backend"
    try:
        import tinygrad
    except ImportError:
        pytest.skip(f"needs {need}: tinygrad is not installed")
    compiler = os.environ.get("CC", "clang")
    if shutil.which(compiler) is None:
        pytest.skip(f"needs {need}: no {compiler!r} on PATH (apt-get install clang, or set CC)")
    return tinygrad


def test_tinygrad_passes_under_its_declared_conventions():
    """Forward and gradients (by ``loss.gradient``), a masked NaN key allowed to leak (its -inf
    mask is added, so 0 * NaN reaches the row), GQA with a group ratio of 3."""
    tinygrad = _tinygrad_with_a_compiler()
    cases = [c for c in sweep(("forward", "backward"), quick=True)
             if c.label in ("causal Tq>Tk bottom-right", "gqa ratio 3", "causal", "nan causal")]
    assert {c.contract for c in cases} == {"forward", "backward"}
    results = check_attention(tinygrad.Tensor.scaled_dot_product_attention, "tinygrad", cases=cases)
    assert not _failed(results), [(r.case.id, r.reason) for r in _failed(results).values()]
    assert [r.status for r in results] == ["pass"] * len(cases)


def test_ort_multi_head_attention_with_a_past_but_no_present_outputs_is_pinned(ort):
    """Pinned (found while writing the adapter, outside the sweep's contracts): MultiHeadAttention
    given past_key/past_value attends over past + new keys only when the present outputs are
    requested; without them it returns another answer, silently: finite and far off, or, in some
    runs (onnxruntime 1.32, the same inputs), NaN throughout."""
    from onnx import TensorProto, helper

    b, n, d, s, p = 1, 2, 16, 3, 5
    rng = np.random.default_rng(0)
    feeds = {"query": rng.standard_normal((b, s, n * d)), "key": rng.standard_normal((b, s, n * d)),
             "value": rng.standard_normal((b, s, n * d)), "past_key": rng.standard_normal((b, n, p, d)),
             "past_value": rng.standard_normal((b, n, p, d))}
    feeds = {k: x.astype(np.float32) for k, x in feeds.items()}

    def run(present):
        outs = ["output"] + (["present_key", "present_value"] if present else [])
        node = helper.make_node("MultiHeadAttention", ["query", "key", "value", "", "", "",
                                                       "past_key", "past_value"], outs,
                                domain="com.microsoft", num_heads=n)
        graph = helper.make_graph(
            [node], "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(x.shape))
                          for k, x in feeds.items()],
            [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                        helper.make_opsetid("com.microsoft", 1)])
        return ort(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]

    heads = lambda x: x.reshape(b, -1, n, d).transpose(0, 2, 1, 3).astype(np.float64)  # noqa: E731
    k = np.concatenate([feeds["past_key"], heads(feeds["key"])], axis=2)
    v = np.concatenate([feeds["past_value"], heads(feeds["value"])], axis=2)
    sc = heads(feeds["query"]) @ np.swapaxes(k, -1, -2) / np.sqrt(d)
    w = np.exp(sc - sc.max(axis=-1, keepdims=True))
    want = ((w / w.sum(axis=-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(b, s, n * d)
    assert np.abs(run(True) - want).max() < 1e-5
    # Wrong either way: some entry off by more than 0.1, or not a number (NaN fails every
    # comparison, so 'all within 0.1' is the claim to refute, not 'some entry beyond it').
    assert not np.all(np.abs(run(False) - want) <= 0.1)
