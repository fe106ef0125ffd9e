"""The compiled kernels against the NumPy reference.

The rule for float32 is the FlashAttention test suite's: compute a float64 reference; the kernel's
worst error must be at most twice the worst error of a plain float32 NumPy computation of the same
thing, plus a floor of one float32 rounding (2**-24, half an ulp of 1.0) so that inputs on which
NumPy happens to be exact do not demand more than exactness from the kernel. Each check prints its
worst error as a fraction of its bound (``pytest -s`` shows them).

The CPU tests need ``refmath._C`` (built by ``pip install -e .``); the CUDA tests, marked ``cuda``,
skip with a reason unless ``refmath._cuda`` was built, CuPy is installed and a GPU is present, and
fail instead with ``REFMATH_REQUIRE_GPU=1`` (which ``benchmarks/gpu_check.sh`` sets).
"""
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refmath import kernels
from refmath.softmax import softmax_forward
from _support import float32_rule

PROPERTY = settings(max_examples=30, deadline=None)
REQUIRE_GPU = os.environ.get("REFMATH_REQUIRE_GPU", "").strip().lower() in ("1", "true", "yes", "on")


def skip_cuda(reason):
    """Skip for want of the CUDA module, CuPy or a GPU; a failure under REFMATH_REQUIRE_GPU=1 (as in
    tests/test_kernels_cuda.py)."""
    if REQUIRE_GPU:
        pytest.fail(f"REFMATH_REQUIRE_GPU=1, but {reason}", pytrace=False)
    pytest.skip(reason)
U32 = 2.0**-24  # unit roundoff of float32
U64 = 2.0**-53  # unit roundoff of float64


def make_logits(seed, rows, cols, scale, masked_fraction=0.0, dtype=np.float64):
    """Random scores; ``scale`` 100 would overflow exp without the max subtraction."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * scale
    x[rng.random((rows, cols)) < masked_fraction] = -np.inf
    return x.astype(dtype)


def reference(x):
    return softmax_forward(x)[0]


def assert_float32_rule(kernel_out, x32, label):
    """The shared float32 rule with a floor of one float32 rounding (u = 2**-24)."""
    assert kernel_out.dtype == np.float32
    float32_rule(f"{label} float32", kernel_out, reference(x32.astype(np.float64)), reference(x32),
                 2, U32)


def assert_float64_close(kernel_out, x, label):
    """float64 against float64: only rounding separates the two, so bound the rounding.

    Per entry, relative to the output: the kernel sums ``cols`` terms one after another (at most
    ``(cols - 1) u``), NumPy sums pairwise (at most ``(ceil(log2 cols) + 1) u``), and each side's exp
    and division add a few ``u``. Entries that are 0 in the reference (masked) must be exactly 0.
    """
    ref = reference(x)
    cols = x.shape[1]
    rtol = (cols + np.ceil(np.log2(max(cols, 1))) + 8) * U64
    # Relative to the output, but never to less than the smallest normal number: a subnormal
    # output carries fewer digits, and its error is judged as absolute.
    rel = np.abs(kernel_out - ref) / np.maximum(ref, np.finfo(np.float64).tiny)
    worst = rel.max(initial=0.0)
    print(f"{label}: float64 worst relative error {worst:.3g} = {worst / rtol:.2f} of bound {rtol:.3g}")
    assert kernel_out.dtype == np.float64
    assert worst <= rtol
    np.testing.assert_array_equal(kernel_out[ref == 0], 0.0)


def assert_close_to_reference(kernel_out, x, label):
    if x.dtype == np.float32:
        assert_float32_rule(kernel_out, x, label)
    else:
        assert_float64_close(kernel_out, x, label)


# ---- the CPU module ----

# Without refmath._C the test below fails once, plainly, and the kernel tests skip rather than
# repeat the same ImportError twenty times.
needs_cpu = pytest.mark.skipif(not kernels.cpu_available(), reason="refmath._C is not built")


def test_cpu_module_is_built():
    assert kernels.cpu_available(), "refmath._C is missing: run pip install -e . in the repository"


@needs_cpu
@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 40), cols=st.integers(1, 300),
       scale=st.sampled_from([1.0, 10.0, 100.0]), masked=st.sampled_from([0.0, 0.3]))
def test_cpu_float64_matches_reference(seed, rows, cols, scale, masked):
    x = make_logits(seed, rows, cols, scale, masked)
    assert_float64_close(kernels.softmax_rows(x), x, f"cpu {rows}x{cols}")


@needs_cpu
@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 40), cols=st.integers(1, 300),
       scale=st.sampled_from([1.0, 10.0, 100.0]), masked=st.sampled_from([0.0, 0.3]))
def test_cpu_float32_within_twice_numpy_float32_error(seed, rows, cols, scale, masked):
    x = make_logits(seed, rows, cols, scale, masked, np.float32)
    assert_float32_rule(kernels.softmax_rows(x), x, f"cpu {rows}x{cols}")


@needs_cpu
@pytest.mark.parametrize("rows, cols", [(1, 1), (5000, 1), (20000, 3), (3, 20000), (257, 129)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cpu_edge_and_large_shapes(rows, cols, dtype):
    # 20000 x 3 and 3 x 20000 are large enough for the OpenMP path; one column gives exactly 1.
    x = make_logits(rows * cols, rows, cols, 10.0, 0.1, dtype)
    out = kernels.softmax_rows(x)
    assert out.shape == x.shape
    assert_close_to_reference(out, x, f"cpu {rows}x{cols}")


@needs_cpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cpu_fully_masked_rows_give_zeros(dtype):
    x = make_logits(3, 6, 17, 5.0, 0.5, dtype)
    x[[1, 4]] = -np.inf
    out = kernels.softmax_rows(x)
    np.testing.assert_array_equal(out[[1, 4]], 0.0)  # zeros, not NaN
    np.testing.assert_array_equal(out[x == -np.inf], 0.0)  # masked entries carry no weight
    assert_close_to_reference(out, x, "cpu masked")


@needs_cpu
def test_cpu_empty_shapes_follow_the_reference():
    for shape in [(0, 5), (3, 0)]:
        x = np.zeros(shape)
        out = kernels.softmax_rows(x)
        assert out.shape == reference(x).shape == shape


@needs_cpu
def test_cpu_returns_a_new_array_of_the_input_dtype():
    x = make_logits(0, 4, 8, 1.0)
    out = kernels.softmax_rows(x)
    assert out.dtype == x.dtype and not np.shares_memory(out, x)


@needs_cpu
@pytest.mark.parametrize("view", ["every other column", "transpose", "fortran", "big-endian"])
def test_cpu_non_contiguous_and_foreign_layouts_are_copied(view):
    base = make_logits(1, 12, 10, 3.0)
    x = {"every other column": base[:, ::2], "transpose": base.T,
         "fortran": np.asfortranarray(base), "big-endian": base.astype(">f8")}[view]
    np.testing.assert_array_equal(kernels.softmax_rows(x), kernels.softmax_rows(np.array(x, np.float64)))


def test_cpu_bad_input_names_the_argument():
    with pytest.raises(TypeError, match=r"x must be a floating-point array, got dtype int64"):
        kernels.softmax_rows(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(TypeError, match=r"x must be float32 or float64.*float16 with shape \(2, 3\)"):
        kernels.softmax_rows(np.zeros((2, 3), dtype=np.float16))
    with pytest.raises(ValueError, match=r"x must have 2 dimensions \(rows, cols\), got shape \(6,\)"):
        kernels.softmax_rows(np.zeros(6))
    with pytest.raises(ValueError, match=r"got shape \(2, 3, 4\)"):
        kernels.softmax_rows(np.zeros((2, 3, 4)))


@needs_cpu
def test_cpu_binding_refuses_what_kernels_py_would_have_fixed():
    # The C++ side checks again, so a direct call cannot read past a strided buffer.
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels._C.softmax_rows(np.zeros((4, 6))[:, ::2])
    with pytest.raises(TypeError, match="float32 or float64"):
        kernels._C.softmax_rows(np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="2 dimensions"):
        kernels._C.softmax_rows(np.zeros(3))


# ---- build information and the CUDA module ----

def test_cpu_vector_lanes_switch_between_the_two_copies_and_refuse_other_widths():
    if not kernels.cpu_available():
        pytest.skip("refmath._C is not built")
    widest = kernels.cpu_vector_lanes()
    assert widest in (8, 16)
    try:
        assert kernels.cpu_vector_lanes(8) == 8
        # Asking for 16 gives 16 only where the CPU has AVX-512: back to the widest either way.
        assert kernels.cpu_vector_lanes(16) == widest
        with pytest.raises(ValueError, match="lanes must be 8 or 16"):
            kernels.cpu_vector_lanes(4)
    finally:
        kernels.cpu_vector_lanes(16)


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f
                         if line.startswith("flags")), set())
    except OSError:
        return set()


def test_cpu_instructions_name_the_copy_the_dispatcher_chose():
    if not kernels.cpu_available():
        pytest.skip("refmath._C is not built")
    try:
        kernels.cpu_vector_lanes(8)
        copy = kernels._cpu().narrow_copy()
        assert copy in ("x86-64-v3", "baseline", "build target")
        assert ("x86-64-v3" in kernels.cpu_instructions()) == (copy == "x86-64-v3")
        # libgcc's choice agrees with the features Linux lists: x86-64-v3's, v2's beneath them
        # (lzcnt is listed as abm, SSE3 as pni, LAHF/SAHF as lahf_lm).
        flags = _cpu_flags()
        if copy != "build target" and flags:
            v3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave", "cx16",
                  "lahf_lm", "popcnt", "pni", "ssse3", "sse4_1", "sse4_2"}
            assert (copy == "x86-64-v3") == (v3 <= flags), (copy, sorted(v3 - flags))
        kernels.cpu_vector_lanes(16)
        if kernels.cpu_vector_lanes() == 16:
            wide_on_avx2 = (kernels.BUILD_INFO or {}).get("wide_on_avx2")
            assert kernels.cpu_instructions().startswith(
                "16 lanes as pairs of AVX2" if wide_on_avx2 else "AVX-512, 16 lanes")
    finally:
        kernels.cpu_vector_lanes(16)


def test_build_info_says_what_was_built():
    info = kernels.build_info()
    assert info["cpu_module"] == kernels.cpu_available()
    assert info["cpu_vector_lanes"] == (kernels.cpu_vector_lanes() if info["cpu_module"] else None)
    assert info["cpu_instructions"] == (kernels.cpu_instructions() if info["cpu_module"] else None)
    assert info["cuda_module"] == (kernels._cuda is not None)
    summary = kernels.cuda_build_info()
    assert summary.startswith("refmath._cuda")
    assert ("is built" in summary) == info["cuda_module"]


def test_cuda_module_imports_and_counts_devices_without_a_gpu():
    # Linked against the static CUDA runtime, the module must import and answer on a machine with
    # no driver: zero devices and a reason, not a crash.
    if kernels._cuda is None:
        skip_cuda(kernels.cuda_build_info())
    count, status = kernels._cuda.device_query()
    assert kernels._cuda.device_count() == count >= 0
    assert kernels.cuda_available() == (count > 0)
    if count == 0:
        assert status != "ok" and status in kernels.cuda_build_info()


def test_cuda_binding_checks_its_arguments_and_reports_launch_errors():
    if kernels._cuda is None:
        skip_cuda(kernels.cuda_build_info())
    cuda = kernels._cuda
    with pytest.raises(ValueError, match="dtype_code"):
        cuda.softmax_rows(0, 0, 1, 4, 7, 0)
    with pytest.raises(ValueError, match="non-negative"):
        cuda.softmax_rows(0, 0, -1, 4, cuda.FLOAT32, 0)
    if kernels.cuda_available():
        return
    with pytest.raises(ValueError, match="null pointer"):
        cuda.softmax_rows(0, 0, 1, 4, cuda.FLOAT32, 0)
    # Without a device the launch itself fails: CUDA's message comes back as a RuntimeError (the
    # made-up pointers are never dereferenced, since nothing runs).
    with pytest.raises(RuntimeError, match=r"refmath._cuda.softmax_rows: .+"):
        cuda.softmax_rows(256, 512, 1, 4, cuda.FLOAT32, 0)


def _cupy_or_skip():
    try:
        import cupy as cp
    except ImportError as err:
        skip_cuda(f"CuPy is not installed (pip install 'refmath[cuda]'): {err}")
    if not kernels.cuda_available():
        skip_cuda(kernels.cuda_build_info())
    return cp


@pytest.mark.cuda
@pytest.mark.parametrize("rows, cols", [(1, 1), (7, 255), (64, 256), (33, 1000), (4096, 3), (2, 20000)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cuda_matches_reference(rows, cols, dtype):
    cp = _cupy_or_skip()
    x = make_logits(rows + cols, rows, cols, 10.0, 0.2, dtype)
    x[0] = -np.inf  # one fully masked row
    out = cp.asnumpy(kernels.softmax_rows(cp.asarray(x)))
    np.testing.assert_array_equal(out[0], 0.0)
    assert_close_to_reference(out, x, f"cuda {rows}x{cols}")


@pytest.mark.cuda
def test_cuda_runs_on_the_current_stream_and_copies_strided_input():
    cp = _cupy_or_skip()
    x = make_logits(5, 16, 40, 3.0)
    with cp.cuda.Stream(non_blocking=True) as stream:
        out = kernels.softmax_rows(cp.asarray(x)[:, ::2])
        stream.synchronize()
    assert_float64_close(cp.asnumpy(out), np.ascontiguousarray(x[:, ::2]), "cuda strided, own stream")


@pytest.mark.cuda
def test_cuda_bad_input_names_the_argument():
    cp = _cupy_or_skip()
    with pytest.raises(TypeError, match=r"x must be float32 or float64.*int32"):
        kernels.softmax_rows(cp.zeros((2, 3), dtype=cp.int32))
    with pytest.raises(ValueError, match=r"x must have 2 dimensions.*\(2, 3, 4\)"):
        kernels.softmax_rows(cp.zeros((2, 3, 4), dtype=cp.float32))


# ---- the helpers the benchmarks and the lessons use ------------------------------------------------

@needs_cpu
@pytest.mark.parametrize("order", [[4, 0, 3], [2, 2, 2, 1], [], list(range(37))[::-1]])
def test_stream_sum_reads_rows_in_the_given_order(order):
    # Pools of pages (n, G, page_size, D) with a row length that is not a multiple of the 32-float
    # step, so each row's tail is summed too; rows may repeat.
    pool = np.random.default_rng(2).standard_normal((37, 3, 5, 7)).astype(np.float32)
    want = pool[np.asarray(order, dtype=np.int64)].astype(np.float64).sum()
    np.testing.assert_allclose(kernels.stream_sum(pool, order), want, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(kernels.stream_sum(pool, np.asarray(order, np.int64)), want,
                               rtol=1e-5, atol=1e-3)


@needs_cpu
def test_stream_sum_order_refuses_what_is_not_a_row():
    pool = np.ones((4, 2, 3), np.float32)
    with pytest.raises(ValueError, match=r"order must hold rows of x, 0 to 3 \(x has shape \(4, 2, 3\)\), got entries from 0 to 4"):
        kernels.stream_sum(pool, [0, 4])
    with pytest.raises(ValueError, match="got entries from -1 to 2"):
        kernels.stream_sum(pool, [2, -1])
    with pytest.raises(TypeError, match=r"order must be a 1-D list of row numbers, got dtype float64"):
        kernels.stream_sum(pool, [0.5])
    with pytest.raises(TypeError, match=r"1-D.*shape \(1, 1\)"):
        kernels.stream_sum(pool, [[1]])
    with pytest.raises(ValueError, match="x must have at least one dimension"):
        kernels.stream_sum(np.float32(1.0), [0])
    # The binding checks for itself, for a direct caller.
    with pytest.raises(ValueError, match=r"order\[1\] = 9 is not a row of x, whose shape is \(4, 2, 3\)"):
        kernels._cpu().stream_sum_rows(pool, np.array([0, 9], np.int32))
    with pytest.raises(TypeError, match="order must be a native-byte-order int32 array"):
        kernels._cpu().stream_sum_rows(pool, np.array([0], np.int64))


@needs_cpu
def test_threads_stream_sum_and_backward_schedule():
    assert kernels.cpu_threads() >= 1
    x = np.random.default_rng(0).standard_normal(100_003).astype(np.float32)
    np.testing.assert_allclose(kernels.stream_sum(x), x.astype(np.float64).sum(), rtol=1e-5, atol=1e-3)
    with pytest.raises(TypeError, match="x must be float32, got dtype float64"):
        kernels.stream_sum(x.astype(np.float64))
    rng = np.random.default_rng(1)
    q, k, v, do = (rng.standard_normal((1, 2, 9, 8)).astype(np.float32) for _ in range(4))
    o, lse = kernels.flash_attention_forward(q, k, v, causal=True)
    grads = {}
    for name in ("one pass", "two passes", "auto"):
        with kernels.backward_schedule(name):
            grads[name] = kernels.flash_attention_backward(do, q, k, v, o, lse, causal=True)
    for one, two, auto in zip(*grads.values()):
        np.testing.assert_array_equal(one, two)
        np.testing.assert_array_equal(one, auto)
    with pytest.raises(ValueError, match="name must be one of 'auto', 'one pass', 'two passes'"):
        with kernels.backward_schedule("three passes"):
            pass
