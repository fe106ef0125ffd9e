"""Weights in bf16, f16 and Q8_0 (refmath.weight_formats, catalogue W1 and W2) and their compiled
product (refmath.kernels.format_rows_matmul), held to the NumPy reference that dequantises."""
import math
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refmath import kernels
from refmath import weight_formats as wf
from _support import float32_rule

PROPERTY = settings(max_examples=40, deadline=None)
needs_cpu = pytest.mark.skipif(not kernels.cpu_available(), reason="refmath._C is not built")


def random_weights(seed, n, k, scale=1.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, k)) * scale).astype(np.float32)


# ---- the formats: rounding, layout, bounds ----------------------------------------------------

def llama_cpp_q8_0_row(x):
    """A scalar transcription of llama.cpp's quantize_row_q8_0_ref (ggml-quants.c), one float32
    operation at a time, written apart from the vectorised module: the bytes of each 34-byte
    block, a little-endian float16 scale then 32 int8 codes."""
    f32 = np.float32
    out = b""
    for b in range(0, len(x), 32):
        amax = f32(0)
        for v in x[b:b + 32]:
            amax = max(amax, f32(abs(v)))
        d = f32(amax / f32(127))
        inv = f32(f32(1) / d) if d != 0 else f32(0)
        codes = []
        for v in x[b:b + 32]:
            t = float(f32(v * inv))
            codes.append(int(math.floor(t + 0.5)) if t >= 0 else -int(math.floor(-t + 0.5)))  # roundf
        out += struct.pack("<e", float(d)) + struct.pack("32b", *codes)
    return out


@pytest.mark.parametrize("seed, scale", [(0, 1.0), (1, 1e-3), (2, 300.0), (3, 1e-6)])
def test_q8_0_blocks_are_llama_cpps_bytes(seed, scale):
    w = random_weights(seed, 3, 128, scale)
    w[1, :32] = 0.0  # a block of zeros: scale 0, codes 0
    w[2, 40] = 0.0
    blocks = wf.quantize_q8_0(w)
    assert blocks.dtype.itemsize == 34 and blocks.shape == (3, 4)
    for r in range(3):
        assert blocks[r].tobytes() == llama_cpp_q8_0_row(w[r]), f"row {r}"


def test_q8_0_worked_example_ties_go_away_from_zero_w2():
    # max |w| = 127 gives d = 1 exactly: the codes are the weights rounded, halves away from zero
    # (NumPy's round would give 2, -2, 0, 0 for 2.5, -2.5, 0.5, -0.5).
    w = np.zeros((1, 32), np.float32)
    w[0, :7] = [127, 2.5, -2.5, 0.5, -0.5, 1.5, 0.49999997]
    blocks = wf.quantize_q8_0(w)
    assert blocks["d"][0, 0] == 1.0 and blocks.tobytes()[:2] == b"\x00\x3c"  # float16 1.0
    assert blocks["qs"][0, 0, :7].tolist() == [127, 3, -3, 1, -1, 2, 0]
    np.testing.assert_array_equal(wf.dequantize_q8_0(blocks)[0, :7], [127, 3, -3, 1, -1, 2, 0])


def test_bf16_is_torchs_round_to_nearest_even():
    torch = pytest.importorskip("torch")
    w = random_weights(4, 8, 300, 10.0)
    w[0, :6] = [1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 1e-40, 3.0e38, 0.0]  # ties, tiny, big
    theirs = torch.from_numpy(w).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(wf.to_bf16(w), theirs)
    np.testing.assert_array_equal(wf.from_bf16(theirs), torch.from_numpy(theirs.view(np.int16))
                                  .view(torch.bfloat16).float().numpy())


def test_f16_is_torchs_half():
    torch = pytest.importorskip("torch")
    w = random_weights(5, 8, 300, 100.0)
    w[0, :4] = [1e-7, -3e-6, 65504.0, 1.0 + 2 ** -11]  # subnormals, the largest, a tie
    np.testing.assert_array_equal(wf.to_f16(w).view(np.uint16),
                                  torch.from_numpy(w).half().numpy().view(np.uint16))


# ---- outside oracles: torch's bfloat16 and float16, the gguf package's Q8_0 -------------------

def torch_or_skip():
    return pytest.importorskip("torch", reason="PyTorch is the oracle; install the 'oracle' extra")


def gguf_or_skip():
    return pytest.importorskip("gguf.quants", reason="the gguf package is the Q8_0 oracle; install "
                                                     "the 'dev' extra")


def f32_bits(bits) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


def bf16_ties_and_neighbours() -> np.ndarray:
    """Every float32 that lies exactly halfway between two bfloat16 neighbours (the top 16 bits of
    any finite pattern, then 0x8000), and the float32 one step either side of it: the ties decide
    round-to-nearest-even, the neighbours that a tie is recognised exactly. Both signs, float32's
    subnormals included (bfloat16 keeps float32's exponent, so they round like any other value)."""
    top = np.arange(2**16, dtype=np.uint32)
    top = top[(top & 0x7F80) != 0x7F80]  # finite patterns only
    bits = np.concatenate([(top << 16) | low for low in (0x7FFF, 0x8000, 0x8001)])
    return f32_bits(bits)


def test_bf16_rounding_is_torchs_on_every_tie_w1():
    torch = torch_or_skip()
    w = bf16_ties_and_neighbours()
    theirs = torch.from_numpy(w).to(torch.bfloat16).float().numpy()
    overflow = np.isinf(theirs)  # torch rounds past the largest bfloat16 to infinity
    # the tie above the largest finite value and its upper neighbour, of either sign
    assert overflow.sum() == 4
    assert np.all(np.abs(w[overflow]) >= (2 - 2 ** -8) * 2.0 ** 127)
    ours = wf.from_bf16(wf.to_bf16(w[~overflow].reshape(1, -1)))[0]
    np.testing.assert_array_equal(ours.view(np.uint32), theirs[~overflow].view(np.uint32))
    for big in w[overflow]:  # refmath refuses what would become infinity (the module's docstring)
        with pytest.raises(ValueError, match="round to infinity in bf16"):
            wf.to_bf16(np.full((1, 1), big, np.float32))


def f16_ties_and_neighbours() -> np.ndarray:
    """Every float32 halfway between two neighbouring finite float16 values (exact in float32: 12
    significant bits) and one float32 step either side of it, both signs, the subnormal range
    (spacing 2^-24, the smallest tie 2^-25) included."""
    h = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)  # 0 to 65504
    middle = ((h[:-1] + h[1:]) / 2).astype(np.float32)
    assert np.all(middle.astype(np.float64) == (h[:-1] + h[1:]) / 2)  # the ties are exact
    around = [np.nextafter(middle, np.float32(-np.inf)), middle,
              np.nextafter(middle, np.float32(np.inf))]
    w = np.concatenate(around)
    return np.concatenate([w, -w])


def test_f16_rounding_is_torchs_on_every_tie_and_subnormal_w1():
    torch = torch_or_skip()
    w = f16_ties_and_neighbours()
    ours = wf.to_f16(w.reshape(1, -1))[0]
    theirs = torch.from_numpy(w).half().numpy()
    np.testing.assert_array_equal(ours.view(np.uint16), theirs.view(np.uint16))
    np.testing.assert_array_equal(wf.from_f16(ours.reshape(1, -1))[0],
                                  torch.from_numpy(theirs).float().numpy())
    # Past 65504 torch rounds to 65504 (below 65520) or to infinity; refmath refuses them all.
    for big in (65504.004, 65519.996, 65520.0, 1e6):
        assert torch.tensor([big]).half().float().item() in (65504.0, math.inf)
        with pytest.raises(ValueError, match="float16's range"):
            wf.to_f16(np.full((1, 1), big, np.float32))


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_every_16_bit_pattern_is_restored_as_torch_restores_it(fmt):
    torch = torch_or_skip()
    patterns = np.arange(2**16, dtype=np.uint16)
    if fmt == "bf16":
        ours = wf.from_bf16(patterns.reshape(1, -1))[0]
        theirs = torch.from_numpy(patterns.view(np.int16)).view(torch.bfloat16).float().numpy()
    else:
        ours = wf.from_f16(patterns.view(np.float16).reshape(1, -1))[0]
        theirs = torch.from_numpy(patterns.view(np.float16)).float().numpy()
    nan = np.isnan(theirs)
    assert nan.sum() == 2 * (2 ** (7 if fmt == "bf16" else 10) - 1)  # every NaN pattern
    np.testing.assert_array_equal(np.isnan(ours), nan)
    np.testing.assert_array_equal(ours[~nan].view(np.uint32), theirs[~nan].view(np.uint32))


@pytest.mark.parametrize("fmt, value", [("bf16", np.inf), ("bf16", np.nan), ("f16", -np.inf),
                                        ("f16", np.nan), ("q8_0", np.inf)])
def test_non_finite_weights_are_refused_where_torch_would_keep_them(fmt, value):
    # torch (and gguf) carry infinities and NaNs through the rounding; refmath refuses to store a
    # weight that is not a number, as its docstring says.
    w = np.ones((1, 32), np.float32)
    w[0, 5] = value
    with pytest.raises(ValueError, match="finite"):
        wf.quantize(w, fmt)


def q8_0_oracle_cases():
    rng = np.random.default_rng(21)
    w = rng.standard_normal((16, 512)).astype(np.float32)
    w *= np.float32(10.0) ** rng.integers(-6, 4, size=(16, 1)).astype(np.float32)  # rows of all scales
    w[0, :32] = 0.0                                              # a block of zeros: scale 0
    w[1, :32] = np.arange(-16, 16, dtype=np.float32) + np.float32(0.5)  # codes on ties
    w[1, 31] = 127.0                                             # (d = 1 exactly)
    w[2, :32] = 2.0 ** -20                                       # a scale below float16's normal range
    return w


def test_q8_0_quantise_and_dequantise_are_the_gguf_packages_w2():
    quants = gguf_or_skip()
    from gguf import GGMLQuantizationType

    w = q8_0_oracle_cases()
    theirs = quants.quantize(w, GGMLQuantizationType.Q8_0)  # uint8, (n, k / 32 * 34)
    ours = wf.quantize_q8_0(w)
    assert theirs.shape == (w.shape[0], ours.shape[1] * 34)
    np.testing.assert_array_equal(ours.view(np.uint8).reshape(theirs.shape), theirs)
    restored = quants.dequantize(theirs, GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(wf.dequantize_q8_0(ours), restored)


def test_bf16_is_the_gguf_packages_bf16():
    quants = gguf_or_skip()
    from gguf import GGMLQuantizationType

    w = bf16_ties_and_neighbours()
    w = w[np.abs(w) < (2 - 2 ** -8) * 2.0 ** 127].reshape(1, -1)  # those that stay finite
    theirs = quants.quantize(w, GGMLQuantizationType.BF16).view(np.uint16)
    np.testing.assert_array_equal(wf.to_bf16(w), theirs)
    np.testing.assert_array_equal(wf.from_bf16(theirs),
                                  quants.dequantize(theirs.view(np.uint8), GGMLQuantizationType.BF16))


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 6), blocks=st.integers(1, 6),
       exponent=st.integers(-30, 20), fmt=st.sampled_from(wf.FORMATS))
def test_rounding_error_within_the_bound_w1_w2(seed, n, blocks, exponent, fmt):
    w = random_weights(seed, n, 32 * blocks, 2.0 ** exponent)
    if fmt != "bf16":  # f16 and Q8_0's float16 scale have a range: stay inside it
        w = np.clip(w, -60000, 60000)
    restored = wf.dequantize(wf.quantize(w, fmt), fmt)
    assert restored.dtype == np.float32 and restored.shape == w.shape
    error = np.abs(restored.astype(np.float64) - w)
    assert np.all(error <= wf.rounding_bound(w, fmt))


@pytest.mark.parametrize("fmt, fraction", [("bf16", 0.9), ("f16", 0.9), ("q8_0", 0.85)])
def test_the_rounding_bounds_are_nearly_reached(fmt, fraction):
    # The bounds are tight: over many weights some error comes close (half a step for Q8_0, whose
    # scale's own rounding adds a little on top, so 0.5 / 0.5621 of the bound is the usual worst).
    w = random_weights(6, 64, 1024)
    error = np.abs(wf.dequantize(wf.quantize(w, fmt), fmt).astype(np.float64) - w)
    assert (error / wf.rounding_bound(w, fmt)).max() > fraction


def test_bytes_per_weight():
    assert [wf.bytes_per_weight(f) for f in ("f32", "bf16", "f16", "q8_0")] == [4, 2, 2, 34 / 32]
    assert wf.quantize_q8_0(np.zeros((5, 64), np.float32)).nbytes == 5 * 64 * 34 // 32


@pytest.mark.parametrize("fmt, w, error, words", [
    ("bf16", np.zeros((2, 3), np.float64), TypeError, "float32"),
    ("f16", np.zeros(3, np.float32), ValueError, "dimensions"),
    ("q8_0", np.zeros((2, 33), np.float32), ValueError, "multiple of 32"),
    ("f16", np.full((1, 2), 70000.0, np.float32), ValueError, "float16's range"),
    ("q8_0", np.full((1, 32), 127 * 70000.0, np.float32), ValueError, "float16's range"),
    ("bf16", np.full((1, 2), np.inf, np.float32), ValueError, "finite"),
    ("q8_0", np.full((1, 32), np.nan, np.float32), ValueError, "finite"),
    ("int4", np.zeros((1, 32), np.float32), ValueError, "fmt"),
])
def test_weights_a_format_cannot_hold_are_refused(fmt, w, error, words):
    with pytest.raises(error, match=words):
        wf.quantize(w, fmt)


def test_stored_weights_of_the_wrong_dtype_are_refused():
    with pytest.raises(TypeError, match="blocks in format q8_0 must have dtype"):
        wf.dequantize(np.zeros((2, 34), np.uint8), "q8_0")
    with pytest.raises(TypeError, match="bits in format bf16 must have dtype uint16"):
        wf.from_bf16(np.zeros((2, 2), np.float16))


# ---- the compiled product ------------------------------------------------------------------------

def check_kernel(x, stored, fmt, label):
    """The kernel against the float64 product of the restored weights: within the float32 rule
    (twice a plain float32 NumPy product's error on the same restored weights) and within the
    derived bound gamma_k |x| |W~|^T. The rule's floor is one float32 rounding of the largest sum
    of |terms|, u max(|x| |W~|^T): under cancellation a dot product's error is set by its terms,
    not its result, and with few outputs the plain product may land on the correctly rounded
    result by the luck of its order (a 32-term sum of 2.49 from terms adding up to about 20: the
    kernel 2 ulps of the result away, BLAS within one)."""
    y = kernels.format_rows_matmul(x, stored, fmt)
    restored = wf.dequantize(stored, fmt)
    exact = x.astype(np.float64) @ restored.astype(np.float64).T
    plain = wf.rows_product(x, stored, fmt)
    assert y.dtype == np.float32 and y.shape == exact.shape
    terms = np.abs(x.astype(np.float64)) @ np.abs(restored.astype(np.float64)).T
    float32_rule(label, y, exact, plain, factor=2, floor=wf.U32 * terms.max(initial=0.0))
    assert np.all(np.abs(y - exact) <= wf.product_error_bound(x, stored, fmt)), label
    return y


@needs_cpu
@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(1, 5), n=st.integers(1, 40),
       blocks=st.integers(1, 20), extra=st.integers(0, 31), fmt=st.sampled_from(wf.FORMATS))
def test_the_kernel_is_the_reference_product(seed, m, n, blocks, extra, fmt):
    # k crosses the kernel's 256-weight chunks; bf16 and f16 take any k, Q8_0 whole blocks
    k = 32 * blocks + (0 if fmt == "q8_0" else extra)
    w = random_weights(seed, n, k)
    x = random_weights(seed + 1, m, k)
    check_kernel(x, wf.quantize(w, fmt), fmt, f"{fmt} m={m} n={n} k={k}")


@needs_cpu
@pytest.mark.parametrize("fmt", wf.FORMATS)
def test_a_large_product_within_the_rule_and_the_same_on_any_thread_count(fmt):
    w = random_weights(7, 1030, 2048)  # over a quarter million multiply-adds: shared by threads
    x = random_weights(8, 2, 2048)
    stored = wf.quantize(w, fmt)
    results = []
    for threads in (1, 2, 3):
        with kernels.cpu_thread_limit(threads):
            results.append(check_kernel(x, stored, fmt, f"{fmt} on {threads} threads"))
            assert kernels.cpu_last_team() == threads
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])  # each output summed by one thread
    # and against the float32 weights it was made from: the rounding's bound added
    exact32 = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.all(np.abs(results[0] - exact32) <= wf.product_error_bound(x, stored, fmt, w=w))


@needs_cpu
@pytest.mark.parametrize("fmt", wf.FORMATS)
def test_the_product_against_the_float32_weights_within_its_bound_row_by_row(fmt):
    # W1/W2's bound on the product, |y - x W^T| <= gamma_k |x| |W~|^T + |x| (rounding bound)^T,
    # checked row by row on random rows whose sizes span twelve orders of magnitude (one row of
    # zeros), for the compiled product and the NumPy reference that dequantises. Each row's worst
    # error is printed as a fraction of its bound (pytest -s): the roundings have random signs, so
    # the sum of their worst cases is rarely approached (about 0.05 here, for k = 1024).
    rng = np.random.default_rng(31)
    n, k = 96, 1024
    w = random_weights(32, n, k, 0.05)
    x = rng.standard_normal((9, k)).astype(np.float32)
    x *= (np.float32(10.0) ** np.arange(-6, 3, dtype=np.float32))[:, None]
    x[4] = 0.0
    stored = wf.quantize(w, fmt)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    bound = wf.product_error_bound(x, stored, fmt, w=w)
    for name, y in (("kernel", kernels.format_rows_matmul(x, stored, fmt)),
                    ("numpy", wf.rows_product(x, stored, fmt))):
        error = np.abs(y.astype(np.float64) - exact)
        for r in range(x.shape[0]):
            if not bound[r].any():
                np.testing.assert_array_equal(error[r], 0.0)  # a zero row gives exact zeros
                continue
            fraction = (error[r] / bound[r]).max()
            print(f"{fmt} {name} row {r} (|x| ~ 1e{r - 6}): {fraction:.3f} of the bound")
            assert fraction <= 1.0, f"{fmt} {name} row {r}"


@needs_cpu
@pytest.mark.parametrize("fmt", wf.FORMATS)
def test_the_8_and_16_lane_copies_sum_in_the_same_order(fmt):
    # Every output's sum is spelled out lane by lane (16 lanes: one AVX-512 vector or two AVX2
    # ones), so both copies give the same bits wherever both fuse their multiply-adds (x86-64-v3
    # and v4); a baseline copy without fused multiply-adds is held to the rule only. Shapes cross
    # the 256-weight chunks, the 4- and 2-output groups, 1 to 5 rows of x and k % 16 tails.
    if kernels.cpu_vector_lanes() != 16:
        pytest.skip("the CPU runs only the 8-lane copy")
    try:
        fused = kernels.cpu_vector_lanes(8) == 8 and kernels._cpu().narrow_copy() == "x86-64-v3"
        for seed, (m, n, k) in enumerate([(1, 37, 800), (4, 11, 544), (5, 9, 96), (3, 2, 23)]):
            k = k // 32 * 32 if fmt == "q8_0" else k
            stored = wf.quantize(random_weights(seed, n, k), fmt)
            x = random_weights(seed + 100, m, k)
            kernels.cpu_vector_lanes(8)
            narrow = check_kernel(x, stored, fmt, f"{fmt} 8 lanes m={m} n={n} k={k}")
            kernels.cpu_vector_lanes(16)
            wide = check_kernel(x, stored, fmt, f"{fmt} 16 lanes m={m} n={n} k={k}")
            if fused:
                np.testing.assert_array_equal(narrow, wide)
    finally:
        kernels.cpu_vector_lanes(16)


@needs_cpu
def test_every_16_bit_pattern_is_restored_exactly():
    # k = 1 and x = 1: each output is one restored weight, every bit pattern of both formats once
    patterns = np.arange(2**16, dtype=np.uint16).reshape(-1, 1)
    one = np.ones((1, 1), np.float32)
    # (a sum that starts at 0 turns -0 into +0, which compare equal; NaN stays NaN)
    y = kernels.format_rows_matmul(one, patterns, "bf16")[0]
    np.testing.assert_array_equal(y, (patterns[:, 0].astype(np.uint32) << 16).view(np.float32))
    y = kernels.format_rows_matmul(one, patterns.view(np.float16), "f16")[0]
    np.testing.assert_array_equal(y, patterns[:, 0].view(np.float16).astype(np.float32))
    assert np.isinf(y).sum() == 2 and np.isnan(y).sum() == 2 * 1023


@needs_cpu
def test_every_finite_q8_0_scale_and_code_is_restored_exactly():
    scales = np.arange(2**16, dtype=np.uint16).view(np.float16)
    scales = scales[np.isfinite(scales)]
    blocks = np.zeros((scales.size, 1), wf.Q8_0_BLOCK)
    blocks["d"][:, 0] = scales
    blocks["qs"][:, 0, :] = np.arange(-128, 128, 8, dtype=np.int8)  # 32 codes, -128 to 120
    x = np.zeros((2, 32), np.float32)
    x[0, 0] = 1.0   # picks the code -128
    x[1, 31] = 1.0  # picks the code 120
    y = kernels.format_rows_matmul(x, blocks, "q8_0")
    np.testing.assert_array_equal(y[0], -128 * scales.astype(np.float32))
    np.testing.assert_array_equal(y[1], 120 * scales.astype(np.float32))


@needs_cpu
def test_out_is_written_and_returned():
    w = wf.to_f16(random_weights(9, 5, 40))
    x = random_weights(10, 2, 40)
    out = np.full((2, 5), np.nan, np.float32)
    assert kernels.format_rows_matmul(x, w, "f16", out=out) is out
    np.testing.assert_array_equal(out, kernels.format_rows_matmul(x, w, "f16"))


# ---- bad input: every argument named ---------------------------------------------------------

def good(fmt, n=3, k=64):
    return random_weights(11, 2, k), wf.quantize(random_weights(12, n, k), fmt)


@needs_cpu
@PROPERTY
@given(fmt=st.sampled_from(wf.FORMATS), k=st.integers(1, 8).map(lambda b: 32 * b),
       dk=st.integers(-40, 40).filter(lambda d: d != 0), m=st.integers(0, 4))
def test_a_mismatched_width_names_both_shapes(fmt, k, dk, m):
    x = np.ones((m, max(1, k + dk)), np.float32)
    if x.shape[1] == k:
        return
    stored = wf.quantize(random_weights(13, 3, k), fmt)
    with pytest.raises(ValueError, match=r"x\.shape = .* does not fit w of shape"):
        kernels.format_rows_matmul(x, stored, fmt)


@needs_cpu
@PROPERTY
@given(fmt=st.sampled_from(wf.FORMATS),
       dtype=st.sampled_from([np.float64, np.float16, np.int32, np.uint16, np.int8]))
def test_wrong_dtypes_are_refused_naming_the_argument(fmt, dtype):
    x, stored = good(fmt)
    with pytest.raises(TypeError, match="x must be float32"):
        kernels.format_rows_matmul(x.astype(dtype), stored, fmt)
    if np.dtype(dtype) != wf.STORED_DTYPES[fmt]:
        wrong = np.zeros(stored.shape, dtype)
        with pytest.raises(TypeError, match=f"w in format '{fmt}' must have dtype"):
            kernels.format_rows_matmul(x, wrong, fmt)


@needs_cpu
@pytest.mark.parametrize("fmt", wf.FORMATS)
def test_bad_layouts_and_options_are_refused(fmt):
    x, stored = good(fmt)
    with pytest.raises(ValueError, match="w must be C-contiguous"):
        kernels.format_rows_matmul(x, np.asfortranarray(np.concatenate([stored] * 2, 1))[:, ::2], fmt)
    with pytest.raises(ValueError, match="w must have 2 dimensions"):
        kernels.format_rows_matmul(x, stored[0], fmt)
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        kernels.format_rows_matmul(x[0], stored, fmt)
    with pytest.raises(ValueError, match="fmt must be one of"):
        kernels.format_rows_matmul(x, stored, "q4_0")
    with pytest.raises(ValueError, match=r"out must have shape \(2, 3\)"):
        kernels.format_rows_matmul(x, stored, fmt, out=np.empty((3, 2), np.float32))
    with pytest.raises(TypeError, match="out must be a native-byte-order float32"):
        kernels.format_rows_matmul(x, stored, fmt, out=np.empty((2, 3), np.float64))
    # x not contiguous is copied, as the other kernels do: the result is the product
    wide = np.repeat(x, 2, axis=1)[:, ::2]
    np.testing.assert_array_equal(kernels.format_rows_matmul(wide, stored, fmt),
                                  kernels.format_rows_matmul(x, stored, fmt))


@needs_cpu
def test_the_compiled_module_checks_on_its_own():
    # Called directly, past refmath.kernels' checks: still an exception, never a read past the end.
    from refmath import _C

    x, stored = good("q8_0")
    out = np.empty((2, 3), np.float32)
    with pytest.raises(ValueError, match="format must be"):
        _C.format_rows_matmul(x, stored, "q4", out)
    with pytest.raises(ValueError, match="does not fit x"):
        _C.format_rows_matmul(x[:, :32].copy(), stored, "q8_0", out)
    with pytest.raises(TypeError, match="34-byte items"):
        _C.format_rows_matmul(x, np.zeros((3, 64), np.uint16), "q8_0", out)
    with pytest.raises(ValueError, match="shares memory"):
        _C.format_rows_matmul(x, stored, "q8_0", x.reshape(-1)[:6].reshape(2, 3))


@needs_cpu
@pytest.mark.parametrize("fmt", wf.FORMATS)
@pytest.mark.parametrize("m, n, k", [(0, 3, 64), (2, 0, 64), (2, 3, 0)])
def test_empty_products(fmt, m, n, k):
    w = wf.quantize(np.ones((n, k), np.float32), fmt)
    y = kernels.format_rows_matmul(np.ones((m, k), np.float32), w, fmt)
    assert y.shape == (m, n) and y.dtype == np.float32
    np.testing.assert_array_equal(y, np.zeros((m, n)))  # an empty sum is 0
