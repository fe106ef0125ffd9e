"""The CUDA attention and decode kernels (refmath._cuda through refmath.kernels) against NumPy.

Each forward version of the ladder (v1, v2, v3, v4), the backward and the decode kernels run on a grid
of shapes (lengths 1, 7, 64, 100, 1000; D = 32, 64, 128; 1, 4 or 8 query heads per key/value
head; no mask, causal, sliding window; batches of more than one; lengths that no tile size
divides) and are held to the FlashAttention test suite's rule. For each output compute

* the float64 reference: ``refmath.flash`` for attention, ``refmath.inference.decode`` for decode,
  on the inputs as the kernel sees them (already rounded to the kernel's dtype);
* a plain dense computation in the inputs' precision: float32 NumPy for float32 inputs; for
  float16/bfloat16 inputs the same float32 arithmetic with every stored intermediate (the scaled
  queries, the scores, the weights, the outputs, the gradients) rounded to float16/bfloat16, which
  is what a plain PyTorch or cuBLAS implementation in that precision computes;

and require ``kernel error <= factor * (plain error) + floor`` (largest absolute differences from
the float64 reference), with factor 2 for forward outputs and 3 for gradients.

The floor is the part of the error no kernel can avoid: (1) rounding the exact answer to the
output's dtype (the kernels return o in the inputs' dtype), and (2) as in tests/test_kernels_cpu.py,
four float32 roundings of M, the largest sum of magnitudes that makes up one output entry
(``sum_j p_j |v_j|`` for o; ``1 + |lse|`` for lse; for the gradients the analogous sums times
``1 + max|lse|``, since the backward recomputes every weight from the float32 logsumexp; in
``dS = P (dP - delta)`` the difference also carries the rounding of the two dot products it
subtracts, measured by the magnitudes of their terms). On some
inputs the plain computation is exact by coincidence (a single visible key gives P = 1 and
dP - delta = 0 exactly), and the floor keeps the rule from then demanding exactness of a kernel
that sums in another order.

Everything here skips with a reason unless refmath._cuda is built, CuPy is installed and a GPU is
present (and fails instead with REFMATH_REQUIRE_GPU=1, as benchmarks/gpu_check.sh sets it); bfloat16 also needs CuPy's bfloat16 support (CuPy >= 14 with ml_dtypes). The first two
tests need only the built module. Each check prints its error as a fraction of its bound
(``pytest -s``), and the module prints the worst case at the end.
"""
import functools
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refmath import kernels
from refmath.attention import gqa_head_map
from _support import float32_rule, visible

U32 = 2.0**-24
FLOOR_ULPS = 4
ROOT = pathlib.Path(__file__).resolve().parents[1]
LADDER_TABLE = ROOT / "csrc" / "cuda" / "flash_ladder.h"


def ladder_in_source():
    """(name, needs, default, adds) of each RUNG(...) line of the ladder's table, as written."""
    line = r'^\s*RUNG\((\w+), (\w+), (true|false), "((?:[^"\\]|\\.)*)"\)'
    return [(m[1], m[2], m[3] == "true", m[4])
            for m in re.finditer(line, LADDER_TABLE.read_text(encoding="utf-8"), re.M)]


# The versions under test come from the ladder's one table: as compiled into the module, or where
# it is not built, as written (so that the compile-only tests below still run with nvcc alone).
RUNGS = {rung.name: rung for rung in kernels.flash_ladder()}
VERSIONS = tuple(RUNGS) or tuple(name for name, *_ in ladder_in_source())
TENSOR_CORE = (tuple(name for name, rung in RUNGS.items() if rung.tensor_cores) or
               tuple(name for name, needs, *_ in ladder_in_source() if needs == "kTensorCoreNeeds"))
DTYPES = ("float32", "float16", "bfloat16")


def takes(version, dtype, d):
    """Whether the rung `version` takes inputs of `dtype` with head width d."""
    return dtype in RUNGS[version].dtypes and RUNGS[version].takes_head_dim(d)

FUZZ = settings(max_examples=25, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
WORST = []  # (fraction of bound, label)

# (B, H, G, T_q, T_k, D, mask); "window" is a sliding window of WINDOW keys.
FORWARD_CASES = [
    (1, 1, 1, 1, 1, 64, "none"),
    (2, 4, 4, 7, 7, 32, "causal"),
    (2, 8, 2, 64, 64, 128, "window"),
    (1, 8, 1, 100, 100, 64, "causal"),
    (2, 4, 1, 100, 64, 64, "causal"),   # T_q > T_k: the first 36 queries see no key at all
    (1, 4, 4, 64, 100, 128, "none"),
    (2, 8, 2, 1000, 1000, 128, "causal"),
    (1, 8, 8, 1000, 1000, 64, "window"),
    (1, 2, 2, 1000, 1000, 32, "none"),
]
BACKWARD_CASES = [
    (1, 1, 1, 1, 1, 64, "none"),
    (2, 4, 4, 7, 7, 32, "causal"),
    (2, 8, 2, 64, 64, 128, "window"),
    (1, 8, 1, 100, 100, 64, "causal"),
    (2, 4, 1, 100, 64, 64, "causal"),
    (1, 4, 4, 64, 100, 128, "none"),
    (1, 4, 1, 1000, 1000, 64, "causal"),
]
WINDOW = 16

# benchmarks/gpu_check.sh sets REFMATH_REQUIRE_GPU=1: on the machine lent for that run a missing
# CUDA module, CuPy or GPU is the problem to report, and a skip would let the run say "ok".
REQUIRE_GPU = os.environ.get("REFMATH_REQUIRE_GPU", "").strip().lower() in ("1", "true", "yes", "on")


def skip_cuda(reason):
    """Skip for want of the CUDA module, CuPy, a GPU or a dtype; a failure under REFMATH_REQUIRE_GPU=1."""
    if REQUIRE_GPU:
        pytest.fail(f"REFMATH_REQUIRE_GPU=1, but {reason}", pytrace=False)
    pytest.skip(reason)


def import_cupy():
    try:
        import cupy
    except ImportError as err:
        skip_cuda(f"CuPy is not installed (pip install 'refmath[cuda]'): {err}")
    return cupy


def masks(name):
    """(causal, window) of a mask name."""
    return {"none": (False, None), "causal": (True, None), "window": (True, WINDOW)}[name]


def case_id(case):
    b, h, g, t_q, t_k, d, mask = case
    return f"B{b}-H{h}-G{g}-Tq{t_q}-Tk{t_k}-D{d}-{mask}"


@pytest.fixture(scope="module", autouse=True)
def report_worst_case():
    yield
    if WORST:
        fraction, label = max(WORST)
        print(f"\nworst CUDA kernel error over {len(WORST)} checks: {fraction:.2f} of its bound ({label})")


# ---- always (given the built module): the ladder is listed, bound and checks its arguments ----

def test_the_ladder_is_one_list():
    """csrc/cuda/flash_ladder.h's table is the ladder: a file flash_<name>.cu for each of its lines,
    and where the module is built, refmath.kernels lists exactly those lines (names, order,
    defaults, what each adds, which use the tensor cores), all bound as the one flash_forward."""
    source = ladder_in_source()
    names = [name for name, *_ in source]
    files = {p.stem.removeprefix("flash_") for p in (ROOT / "csrc" / "cuda").glob("flash_*.cu")}
    assert names and sorted(names) == sorted(files - {"backward"}), (names, files)
    if kernels._cuda is None:
        assert kernels.flash_versions() == () and kernels.flash_ladder() == ()
        skip_cuda(kernels.cuda_build_info())
    assert kernels.flash_versions() == tuple(names) == VERSIONS
    for rung, (name, needs, default, adds) in zip(kernels.flash_ladder(), source, strict=True):
        assert (rung.name, rung.default, rung.adds) == (name, default, adds)
        assert rung.tensor_cores == (needs == "kTensorCoreNeeds"), name
    assert sorted(kernels._cuda.flash_versions()[0]) == sorted(kernels.FlashRung._fields)
    assert not [n for n in dir(kernels._cuda) if n.startswith("flash_forward_")]  # one binding
    for name in ("flash_forward", "flash_backward", "paged_decode"):
        assert callable(getattr(kernels._cuda, name)), name


class _Query(NamedTuple):  # what kernels._cuda_rung reads of q, without CuPy or a GPU
    shape: tuple
    dtype: str


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 8, 32, 40, 64, 96, 128, 200, 256, 257, 300])
def test_python_checks_agree_with_the_launchers(dtype, d):
    """refmath.kernels refuses a version for a dtype or head width exactly where the C++ launcher
    does, both reading the ladder's table: with null pointers, a launcher that accepts them stops
    at the pointers (before any CUDA call, so this runs without a GPU)."""
    if kernels._cuda is None:
        skip_cuda(kernels.cuda_build_info())
    c = kernels._cuda
    code = {"float32": c.FLOAT32, "float16": c.FLOAT16, "bfloat16": c.BFLOAT16}[dtype]
    q = _Query((1, 2, 4, d), dtype)
    for version in VERSIONS:
        with pytest.raises(RuntimeError) as launcher:
            c.flash_forward(version, 0, 0, 0, 0, 0, 1, 2, 2, 4, 4, d, False, 0, 0.125, code, 0)
        accepted = "null pointer" in str(launcher.value)
        refusal = kernels._refusal(RUNGS[version], q)
        assert (refusal is None) == accepted == takes(version, dtype, d), (version, launcher.value, refusal)
        if not accepted:
            assert f"flash_forward_{version}: " in str(launcher.value)
            assert f"version {version!r}" in str(refusal)


def test_the_default_version_is_the_newest_default_rung_that_fits():
    if kernels._cuda is None:
        skip_cuda(kernels.cuda_build_info())
    pick = lambda dtype, d: kernels._cuda_rung(None, _Query((1, 1, 4, d), dtype)).name
    assert [pick("float16", 64), pick("bfloat16", 128), pick("float16", 96), pick("float32", 64),
            pick("float32", 256)] == ["v3", "v3", "v2", "v2", "v2"]
    with pytest.raises(ValueError, match=r"version 'v2' supports head widths up to D = 256, got D = 300"):
        pick("float16", 300)
    with pytest.raises(ValueError, match=r"version must be one of v1, v2, v3, v4 or None, got 'v5'"):
        kernels._cuda_rung("v5", _Query((1, 1, 4, 64), "float16"))
    with pytest.raises(ValueError, match=r"version must be one of v1, v2, v3, v4, got 'v5'"):
        kernels._cuda.flash_forward("v5", 0, 0, 0, 0, 0, 1, 2, 2, 4, 4, 64, False, 0, 0.125, 0, 0)


def test_bindings_refuse_bad_arguments_before_touching_the_device():
    # The launchers check sizes, dtypes, pointers and alignment on the host, before any CUDA call,
    # so these raise the same way with or without a GPU (nothing is dereferenced).
    if kernels._cuda is None:
        skip_cuda(kernels.cuda_build_info())
    c = kernels._cuda

    def forward(version="v2", ptr=0, b=1, h=2, g=2, t_q=4, t_k=4, d=64, window=0, dtype=c.FLOAT32):
        c.flash_forward(version, ptr, ptr, ptr, ptr, ptr, b, h, g, t_q, t_k, d, False, window, 0.125,
                        dtype, 0)

    with pytest.raises(RuntimeError, match=r"flash_forward_v2: .*G=3 must be >= 1 and divide the query heads H=2"):
        forward(g=3)
    with pytest.raises(RuntimeError, match=r"head width D=300 is outside \[1, 256\]"):
        forward(d=300)
    with pytest.raises(RuntimeError, match=r"window must be >= 0"):
        forward(window=-1)
    with pytest.raises(RuntimeError, match=r"flash_forward_v1: .*null pointer"):
        forward("v1")
    with pytest.raises(RuntimeError, match=r"dtype must be float32, float16 or bfloat16, got float64"):
        forward("v1", dtype=c.FLOAT64)
    with pytest.raises(RuntimeError, match=r"supports D = 64 or 128, got D=32"):
        forward("v3", d=32, dtype=c.FLOAT16)
    with pytest.raises(RuntimeError, match=r"v3: dtype must be float16 or bfloat16, got float32"):
        forward("v3", d=64, dtype=c.FLOAT32)
    with pytest.raises(RuntimeError, match=r"16-byte aligned"):
        forward("v3", ptr=8, d=64, dtype=c.BFLOAT16)
    with pytest.raises(RuntimeError, match=r"v4: .*supports D = 64 or 128, got D=96"):
        forward("v4", d=96, dtype=c.FLOAT16)
    with pytest.raises(RuntimeError, match=r"v4: dtype must be float16 or bfloat16, got float32"):
        forward("v4", d=128, dtype=c.FLOAT32)
    with pytest.raises(RuntimeError, match=r"flash_forward_v4: .*16-byte aligned"):
        forward("v4", ptr=8, d=128, dtype=c.FLOAT16)
    with pytest.raises(RuntimeError, match=r"flash_backward: .*null pointer"):
        c.flash_backward(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 1, 4, 4, 64, True, 0, 0.125, 0)

    def decode(n_pages=4, page_size=16, max_pages=2, splits=1, h=4, g=2, d=64, ptr=0):
        c.paged_decode(ptr, ptr, ptr, ptr, ptr, ptr, ptr, 2, h, g, d, n_pages, page_size, max_pages,
                       splits, 0.125, c.FLOAT16, 0)

    with pytest.raises(RuntimeError, match=r"splits must be in \[1, 1024\], got 0"):
        decode(splits=0)
    with pytest.raises(RuntimeError, match=r"page_size must be in \[1, 2\*\*30\], got 0"):
        decode(page_size=0)
    with pytest.raises(RuntimeError, match=r"G=3 must be >= 1 and divide the query heads H=4"):
        decode(g=3)
    with pytest.raises(RuntimeError, match=r"paged_decode: .*null pointer"):
        decode()


def test_flash_backward_with_no_heads_is_refused_not_a_crash():
    """Issue 15: H = 0 and G = 0 passed every check and divided H by G on the host (SIGFPE: the
    Python process died). Run in a child process, so that a regression fails here instead of
    killing the test session."""
    if kernels._cuda is None:
        skip_cuda(kernels.cuda_build_info())
    code = ("import refmath._cuda as c\n"
            "try:\n"
            "    c.flash_backward(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 4, 4, 64, True, 0, 0.125, 0)\n"
            "except RuntimeError as err:\n"
            "    print(err)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=env, cwd=ROOT)
    assert run.returncode == 0, f"exit status {run.returncode} (a signal if negative): {run.stderr}"
    assert "G=0 must be >= 1" in run.stdout, run.stdout + run.stderr


def _cuda_entry_points(c):
    """name -> a call of each compiled entry point with sizes to fill in (null pointers: every call
    below must be refused before anything is dereferenced)."""
    def forward(version):
        return lambda b=1, h=2, g=2, t=4, d=64, window=0, dtype=c.FLOAT16: c.flash_forward(
            version, 0, 0, 0, 0, 0, b, h, g, t, t, d, False, window, 0.125, dtype, 0)

    def backward(b=1, h=2, g=2, t=4, d=64, window=0, dtype=None):
        c.flash_backward(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, b, h, g, t, t, d, True, window, 0.125, 0)

    def decode(b=1, h=2, g=2, t=4, d=64, window=0, dtype=c.FLOAT16):
        c.paged_decode(0, 0, 0, 0, 0, 0, 0, b, h, g, d, 4, 16, t, 1, 0.125, dtype, 0)

    return {**{version: forward(version) for version in VERSIONS}, "backward": backward,
            "paged_decode": decode}


@pytest.mark.parametrize("entry", [*VERSIONS, "backward", "paged_decode"])
@pytest.mark.parametrize("sizes, match", [
    (dict(h=0, g=0), r"G=0 must be >= 1"),
    (dict(h=2, g=0), r"G=0 must be >= 1"),
    (dict(h=2, g=-1), r"non-negative"),
    (dict(b=-1), r"non-negative"),
    (dict(h=-2), r"non-negative"),
    (dict(h=3, g=2), r"G=2 must be >= 1 and divide the query heads H=3"),
    (dict(b=2**31, h=1, g=1), r"at most 2\*\*31 - 1"),
    (dict(b=2**20, h=2**12, g=1), r"B\*H and B\*G must each be at most"),
    (dict(d=0), r"head width D=0"),
    (dict(t=-3), r"non-negative|T_q=-3|max_pages"),
], ids=["H0 G0", "G0", "G<0", "B<0", "H<0", "G!|H", "B>int", "B*H>int", "D0", "T<0"])
def test_every_cuda_entry_point_refuses_bad_sizes_before_the_device(entry, sizes, match):
    """Issue 15: each launcher checks the class of input that crashed flash_backward (zero or
    negative sizes, heads that do not divide) itself, before any CUDA call: these run without a GPU."""
    if kernels._cuda is None:
        skip_cuda(kernels.cuda_build_info())
    if entry in TENSOR_CORE and sizes.get("d") == 0:
        match = r"head width D=0|supports D = 64 or 128"
    with pytest.raises(RuntimeError, match=match):
        _cuda_entry_points(kernels._cuda)[entry](**sizes)


def test_cuda_softmax_refuses_bad_sizes_and_null_pointers():
    if kernels._cuda is None:
        skip_cuda(kernels.cuda_build_info())
    c = kernels._cuda
    with pytest.raises(ValueError, match="non-negative"):
        c.softmax_rows(0, 0, -1, 4, c.FLOAT32, 0)
    with pytest.raises(ValueError, match="null pointer"):
        c.softmax_rows(0, 0, 2, 4, c.FLOAT32, 0)
    c.softmax_rows(0, 0, 0, 4, c.FLOAT32, 0)  # nothing to do, nothing touched


@pytest.mark.parametrize("version", TENSOR_CORE)
def test_tensor_core_versions_built_for_an_old_arch_trap_instead_of_skipping_the_mma(version):
    """Issue 15: below sm_80 the mma bodies were empty, so v3 built with REFMATH_CUDA_ARCH=75 and
    run on an sm_90 GPU (which JIT-compiles the compute_75 PTX) returned garbage. Now the fallback
    traps, and the launcher refuses code compiled for less than compute_80 (check_compiled_for,
    reading the kernel's ptxVersion, which the GPU tests exercise). v4 adds cp.async (sm_80) and
    ldmatrix, under the same guard. Compile-only: needs nvcc."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        skip_cuda("nvcc is not on PATH")
    source = ROOT / "csrc" / "cuda" / f"flash_{version}.cu"
    # PTX for compute_75 only (about 35 s of one core); the compute_80+ code is the module's own
    # build, whose mma the GPU tests run.
    run = subprocess.run([nvcc, "-ptx", "-std=c++17", "-arch=compute_75", "-Icsrc/cuda", str(source),
                          "-o", "-"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr
    for sm80_only in ("mma.sync", "cp.async", "ldmatrix"):
        assert sm80_only not in run.stdout, sm80_only
    assert "trap;" in run.stdout
    assert f"check_compiled_for(flash_{version}_kernel<T, D>, 80" in source.read_text()



def test_flash_v4_compiles_for_sm_90_without_spills():
    """v4's register budget (__launch_bounds__(128, 2)) holds without spilling to local memory:
    ptxas -v through benchmarks/ptxas_spills.sh, sm_90 (about a minute of one core; needs nvcc)."""
    if shutil.which("nvcc") is None:
        skip_cuda("nvcc is not on PATH")
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "ptxas_spills.sh"), "csrc/cuda/flash_v4.cu"],
                         capture_output=True, text=True, cwd=ROOT, timeout=900,
                         env=dict(os.environ, REFMATH_CUDA_ARCH="90"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("flash_v4_kernel") == 4, run.stdout  # float16, bfloat16 x D = 64, 128
    assert "no kernel spills (sm_90)" in run.stdout


# ---- GPU fixtures and conversions ----

@pytest.fixture(scope="module")
def cp():
    cupy = import_cupy()
    if not kernels.cuda_available():
        skip_cuda(kernels.cuda_build_info())
    return cupy


@functools.cache
def _bfloat16():
    """NumPy's bfloat16 dtype (from ml_dtypes) if CuPy can hold it, else the reason it cannot."""
    try:
        import cupy
        import ml_dtypes
        dtype = np.dtype(ml_dtypes.bfloat16)
        # refmath.kernels converts bfloat16 <-> float32 with astype (the backward computes in float32)
        cupy.zeros(1, dtype=dtype).astype(cupy.float32).astype(dtype)
    except Exception as err:  # ImportError, or a CuPy without bfloat16 (before v14)
        return None, f"bfloat16 arrays are not available here: {type(err).__name__}: {err}"
    return dtype, ""


def need_dtype(dtype):
    if dtype == "bfloat16":
        found, why = _bfloat16()
        if found is None:
            skip_cuda(why)


def bf16_bits(x):
    """float32 -> the bits of the nearest bfloat16 (round to nearest even; NaN stays NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def bf16_value(bits):
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)


def round_to(x, dtype):
    """x rounded to ``dtype`` and returned as float32 (exactly representable values)."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    return bf16_value(bf16_bits(x))


def to_device(cp, x, dtype):
    """float32 values representable in ``dtype`` as a CuPy array of that dtype."""
    if dtype == "bfloat16":
        return cp.asarray(bf16_bits(x)).view(_bfloat16()[0])
    return cp.asarray(np.asarray(x, dtype=dtype))


def to_host(cp, a):
    """A CuPy array's values as float64."""
    if str(a.dtype) == "bfloat16":
        return bf16_value(cp.asnumpy(a.view(cp.uint16))).astype(np.float64)
    return cp.asnumpy(a).astype(np.float64)


# ---- the rule ----

def check_rule(label, kernel, ref64, plain, factor, magnitude, out_dtype):
    """Assert ``|kernel - ref| <= factor * |plain - ref| + floor`` (maxima over the entries): the
    shared float32 rule with this file's floor, the rounding of the exact answer to ``out_dtype``
    plus FLOOR_ULPS float32 roundings of ``magnitude``."""
    ref64 = np.asarray(ref64, dtype=np.float64)
    finite = np.isfinite(ref64)
    rounding = np.abs(round_to(ref64[finite], out_dtype) - ref64[finite]).max(initial=0.0)
    float32_rule(label, kernel, ref64, plain, factor, rounding + FLOOR_ULPS * U32 * magnitude, WORST)


# ---- references: float64, and the plain computation in the inputs' precision ----

def plain_attention(q, k, v, keep, scale, dtype, do=None):
    """Dense attention as a plain implementation in ``dtype`` computes it: float32 products and sums
    (as cuBLAS and PyTorch accumulate), every stored intermediate rounded to ``dtype``; for float32
    simply NumPy in float32. Returns (o, lse), and (dq, dk, dv) too when ``do`` is given."""
    r = functools.partial(round_to, dtype=dtype)
    h, g = q.shape[1], k.shape[1]
    heads = gqa_head_map(h, g)
    kh, vh = k[:, heads], v[:, heads]
    s = r(r(q * np.float32(scale)) @ np.swapaxes(kh, -1, -2))
    s = np.where(keep, s, np.float32(-np.inf))
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isneginf(m), np.float32(0), m)
    e = np.exp(s - m_safe)
    total = e.sum(axis=-1, keepdims=True)
    p = r(np.divide(e, total, out=np.zeros_like(e), where=total > 0))
    o = r(p @ vh)
    with np.errstate(divide="ignore"):
        lse = r((m_safe + np.log(total))[..., 0])
    if do is None:
        return o, lse
    dv_heads = r(np.swapaxes(p, -1, -2) @ do)
    dp = r(do @ np.swapaxes(vh, -1, -2))
    ds = r(p * (dp - (p * dp).sum(axis=-1, keepdims=True)))
    dq = r((ds @ kh) * np.float32(scale))
    dk_heads = r((np.swapaxes(ds, -1, -2) @ q) * np.float32(scale))
    dk = np.zeros_like(k)
    dv = np.zeros_like(v)
    for head in range(h):  # each query head's gradient goes to the key/value head it read
        dk[:, heads[head]] += dk_heads[:, head]
        dv[:, heads[head]] += dv_heads[:, head]
    return o, lse, dq, r(dk), r(dv)


class Reference(NamedTuple):
    inputs: tuple  # float32 arrays whose values are representable in the dtype
    exact: dict  # float64 results of refmath.flash
    plain: dict  # the plain computation in the dtype
    magnitude: dict  # M of the floor, per output


def magnitudes(q, k, v, keep, scale, lse, do=None):
    """The M of the floor, from dense float64: max over entries of the sums of magnitudes."""
    heads = gqa_head_map(q.shape[1], k.shape[1])
    kh, vh = k[:, heads], v[:, heads]
    s = scale * q @ np.swapaxes(kh, -1, -2)
    lse_safe = np.where(np.isneginf(lse), np.inf, lse)[..., None]
    a = np.where(keep, np.exp(np.where(keep, s, -np.inf) - lse_safe), 0.0)
    out = {"o": (a @ np.abs(vh)).max(initial=0.0),
           "lse": 1.0 + np.abs(lse[np.isfinite(lse)]).max(initial=0.0)}
    if do is None:
        return out
    weight_error = 1.0 + np.abs(lse[np.isfinite(lse)]).max(initial=0.0)
    # dS = P (dP - delta). P carries the relative error of the weights (u (1 + |lse|)); dP - delta
    # subtracts two dot products, dO . v_j and dO . o, whose rounding scales with the magnitudes of
    # their terms, not with the (possibly cancelled) difference.
    dp_minus_delta = do @ np.swapaxes(vh, -1, -2) - (do * (a @ vh)).sum(axis=-1, keepdims=True)
    terms = np.abs(do) @ np.swapaxes(np.abs(vh), -1, -2) + (np.abs(do) * np.abs(a @ vh)).sum(axis=-1, keepdims=True)
    ds_abs = a * (weight_error * np.abs(dp_minus_delta) + terms)
    group = q.shape[1] // k.shape[1]

    def per_kv_head(x):  # the sum over the query heads that share a key/value head
        return x.reshape(x.shape[0], k.shape[1], group, *x.shape[2:]).sum(axis=2)

    out["dq"] = scale * (ds_abs @ np.abs(kh)).max(initial=0.0)
    out["dk"] = scale * per_kv_head(np.swapaxes(ds_abs, -1, -2) @ np.abs(q)).max(initial=0.0)
    out["dv"] = weight_error * per_kv_head(np.swapaxes(a, -1, -2) @ np.abs(do)).max(initial=0.0)
    return out


def make_inputs(seed, b, h, g, t_q, t_k, d, dtype):
    rng = np.random.default_rng(seed)
    q, do = (round_to(rng.standard_normal((b, h, t_q, d)), dtype) for _ in range(2))
    k, v = (round_to(rng.standard_normal((b, g, t_k, d)), dtype) for _ in range(2))
    return q, k, v, do


@functools.lru_cache(maxsize=None)
def reference(case, dtype, grads=False, seed=0):
    from refmath import flash

    b, h, g, t_q, t_k, d, mask = case
    causal, window = masks(mask)
    scale = 1.0 / math.sqrt(d)
    q, k, v, do = make_inputs(seed, b, h, g, t_q, t_k, d, dtype)
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
    keep = visible(t_q, t_k, causal, window)
    # Large tiles: the same numbers as the default 16 x 16 (F3 is exact), fewer Python steps.
    o, lse = flash.flash_attention_forward(q64, k64, v64, causal=causal, window=window, scale=scale,
                                           block_q=256, block_k=256)
    exact = {"o": o, "lse": lse}
    if not grads:
        plain = dict(zip(("o", "lse"), plain_attention(q, k, v, keep, scale, dtype)))
        return Reference((q, k, v), exact, plain, magnitudes(q64, k64, v64, keep, scale, lse))
    exact.update(zip(("dq", "dk", "dv"), flash.flash_attention_backward(
        do64, q64, k64, v64, o, lse, causal=causal, window=window, scale=scale, block_q=256, block_k=256)))
    plain = dict(zip(("o", "lse", "dq", "dk", "dv"), plain_attention(q, k, v, keep, scale, dtype, do=do)))
    return Reference((q, k, v, do), exact, plain, magnitudes(q64, k64, v64, keep, scale, lse, do64))


# ---- forward ----

def check_forward(cp, version, dtype, case, seed=0):
    b, h, g, t_q, t_k, d, mask = case
    causal, window = masks(mask)
    ref = reference(case, dtype, seed=seed)
    q, k, v = (to_device(cp, x, dtype) for x in ref.inputs)
    o, lse = kernels.flash_attention_forward(q, k, v, causal=causal, window=window, version=version)
    assert o.shape == q.shape and str(o.dtype) == dtype
    assert lse.shape == (b, h, t_q) and lse.dtype == cp.float32
    label = f"{version} {dtype} {case_id(case)}"
    check_rule(f"{label} o", to_host(cp, o), ref.exact["o"], ref.plain["o"], 2, ref.magnitude["o"], dtype)
    check_rule(f"{label} lse", cp.asnumpy(lse), ref.exact["lse"], ref.plain["lse"], 2,
               ref.magnitude["lse"], "float32")


@pytest.mark.cuda
@pytest.mark.parametrize("case", FORWARD_CASES, ids=case_id)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("version", VERSIONS)
def test_forward_matches_reference(cp, version, dtype, case):
    if not takes(version, dtype, case[5]):
        pytest.skip(f"{version} does not take {dtype} with D = {case[5]} (the refusal is tested below)")
    need_dtype(dtype)
    check_forward(cp, version, dtype, case)


@pytest.mark.cuda
@FUZZ
@given(data=st.data())
def test_forward_on_random_shapes(cp, data):
    version = data.draw(st.sampled_from(VERSIONS), label="version")
    dtype = data.draw(st.sampled_from([t for t in DTYPES if t in RUNGS[version].dtypes]), label="dtype")
    need_dtype(dtype)
    d = data.draw(st.sampled_from([d for d in (8, 40, 64, 96, 128, 256) if takes(version, dtype, d)]),
                  label="D")
    g = data.draw(st.integers(1, 3), label="G")
    h = g * data.draw(st.sampled_from([1, 2, 5]), label="H/G")
    case = (data.draw(st.integers(1, 2), label="B"), h, g, data.draw(st.integers(1, 150), label="T_q"),
            data.draw(st.integers(0, 150), label="T_k"), d,
            data.draw(st.sampled_from(["none", "causal", "window"]), label="mask"))
    check_forward(cp, version, dtype, case, seed=data.draw(st.integers(0, 2**16), label="seed"))


@pytest.mark.cuda
@pytest.mark.parametrize("version", VERSIONS)
def test_forward_follows_the_current_stream_and_repeats_exactly(cp, version):
    case = (2, 4, 2, 100, 100, 64, "causal")
    ref = reference(case, "float16")
    q, k, v = (to_device(cp, x, "float16") for x in ref.inputs)
    first, _ = kernels.flash_attention_forward(q, k, v, causal=True, version=version)
    with cp.cuda.Stream(non_blocking=True) as stream:
        second, _ = kernels.flash_attention_forward(q, k, v, causal=True, version=version)
        stream.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(second), cp.asnumpy(first))


# ---- backward ----

@pytest.mark.cuda
@pytest.mark.parametrize("case", BACKWARD_CASES, ids=case_id)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_reference(cp, dtype, case):
    need_dtype(dtype)
    b, h, g, t_q, t_k, d, mask = case
    causal, window = masks(mask)
    ref = reference(case, dtype, grads=True)
    q, k, v, do = (to_device(cp, x, dtype) for x in ref.inputs)
    # o and lse as the forward hands them over: o in the inputs' dtype, lse in float32.
    o = to_device(cp, round_to(ref.exact["o"], dtype), dtype)
    lse = cp.asarray(ref.exact["lse"].astype(np.float32))
    grads = kernels.flash_attention_backward(do, q, k, v, o, lse, causal=causal, window=window)
    label = f"backward {dtype} {case_id(case)}"
    for name, grad, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert grad.shape == like.shape and str(grad.dtype) == dtype, name
        check_rule(f"{label} {name}", to_host(cp, grad), ref.exact[name], ref.plain[name], 3,
                   ref.magnitude[name], dtype)


@pytest.mark.cuda
def test_backward_is_deterministic(cp):
    # dK and dV are summed over the GQA group inside one block, dQ in a second kernel: no atomics,
    # so two runs agree to the bit.
    case = (2, 8, 2, 100, 100, 64, "causal")
    ref = reference(case, "float32", grads=True)
    q, k, v, do = (cp.asarray(x) for x in ref.inputs)
    o, lse = (cp.asarray(ref.exact[n].astype(np.float32)) for n in ("o", "lse"))
    first = kernels.flash_attention_backward(do, q, k, v, o, lse, causal=True)
    second = kernels.flash_attention_backward(do, q, k, v, o, lse, causal=True)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(cp.asnumpy(a), cp.asnumpy(b))


# ---- decode ----

def check_decode(label, o, q, keys, values, lengths, scale, dtype):
    """o (B, H, D) against the float64 decode of each sequence's first lengths[b] keys, the plain
    computation in ``dtype``, and the floor; keys/values[b] are (G, L_b, D) float32 arrays."""
    from refmath.inference.decode import decode_attention

    b, h, _ = q.shape
    exact = np.zeros((b, h, q.shape[2]))
    plain = np.zeros((b, h, q.shape[2]), dtype=np.float32)
    magnitude = 0.0
    for i in range(b):
        if lengths[i] == 0:
            continue
        # refmath's decode of this one sequence in float64; M = max sum_j p_j |v_j| is the same
        # decode with |v| for the values.
        q64, k64, v64 = (x.astype(np.float64)[None] for x in (q[i], keys[i], values[i]))
        exact[i] = decode_attention(q64, k64, v64, [lengths[i]], scale)[0]
        magnitude = max(magnitude, decode_attention(q64, k64, np.abs(v64), [lengths[i]], scale).max())
        keep = np.ones((1, lengths[i]), dtype=bool)
        plain[i] = plain_attention(q[i][None, :, None], keys[i][None], values[i][None], keep, scale, dtype)[0][0, :, 0]
    check_rule(label, o, exact, plain, 2, magnitude, dtype)
    return exact


DECODE_CASES = [  # (B, H, G, D, lengths, T_max)
    (3, 8, 2, 64, (0, 37, 100), 100),
    (4, 8, 1, 128, (1, 64, 99, 1000), 1000),
    (2, 4, 4, 32, (7, 1000), 1024),
    (2, 4, 2, 40, (5, 77), 80),   # 16-byte copies for float32 and float16 (40 % 8 == 0), D < D_MAX
    (2, 6, 3, 20, (33, 64), 64),  # 16-byte copies for float32 only (20 % 8 != 0)
    (1, 2, 1, 7, (70,), 70),      # rows that never start on 16 bytes: element copies
    (2, 6, 1, 256, (45, 9), 64),  # D_MAX = 256; 6 of a block's 8 heads; tiles ending mid-slice
]


@pytest.mark.cuda
@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"B{c[0]}-H{c[1]}-G{c[2]}-D{c[3]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_contiguous_decode_matches_reference(cp, dtype, case, splits):
    from refmath.inference.decode import decode_attention

    need_dtype(dtype)
    b, h, g, d, lengths, t_max = case
    rng = np.random.default_rng(7)
    q = round_to(rng.standard_normal((b, h, d)), dtype)
    k_cache, v_cache = (round_to(rng.standard_normal((b, g, t_max, d)), dtype) for _ in range(2))
    for i, length in enumerate(lengths):  # slots past a length must never be read
        k_cache[i, :, length:] = np.nan
        v_cache[i, :, length:] = np.nan
    scale = 1.0 / math.sqrt(d)
    lengths = np.array(lengths, dtype=np.int32)
    o = kernels.decode(to_device(cp, q, dtype), to_device(cp, k_cache, dtype), to_device(cp, v_cache, dtype),
                       cp.asarray(lengths), splits=splits)
    assert o.shape == q.shape and str(o.dtype) == dtype
    label = f"decode {dtype} B{b} H{h} G{g} D{d} splits={splits}"
    exact = check_decode(label, to_host(cp, o), q, [k_cache[i, :, :n] for i, n in enumerate(lengths)],
                         [v_cache[i, :, :n] for i, n in enumerate(lengths)], lengths, scale, dtype)
    # The same-signature NumPy reference agrees (it never reads the NaN slots either).
    np.testing.assert_allclose(decode_attention(q.astype(np.float64), k_cache.astype(np.float64),
                                                v_cache.astype(np.float64), lengths, scale=scale),
                               exact, rtol=1e-12, atol=1e-12)
    # and the backend choice reaches the same kernel
    o_backend = decode_attention(to_device(cp, q, dtype), to_device(cp, k_cache, dtype),
                                 to_device(cp, v_cache, dtype), cp.asarray(lengths), backend="cuda")
    assert cp.array_equal(o_backend, kernels.decode(to_device(cp, q, dtype), to_device(cp, k_cache, dtype),
                                                    to_device(cp, v_cache, dtype), cp.asarray(lengths)))



@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_of_a_misaligned_cache_copies_elements_to_the_same_result(cp, dtype):
    """The decode kernel copies 16-byte pieces of the cache when its rows start on 16 bytes, and
    one element per lane otherwise (a cache that is a view at an odd offset). Both copies move the
    same values into the same tile, so the results are identical, not just close."""
    need_dtype(dtype)
    b, h, g, d, t_max = 2, 8, 2, 64, 300
    rng = np.random.default_rng(11)
    q = to_device(cp, round_to(rng.standard_normal((b, h, d)), dtype), dtype)
    size = b * g * t_max * d
    flat = [to_device(cp, round_to(rng.standard_normal(size + 1), dtype), dtype) for _ in range(2)]
    k_odd, v_odd = (x[1:].reshape(b, g, t_max, d) for x in flat)  # 2 or 4 bytes past 16-byte alignment
    assert k_odd.data.ptr % 16 != 0 and k_odd.flags.c_contiguous
    k_even, v_even = cp.ascontiguousarray(k_odd.copy()), cp.ascontiguousarray(v_odd.copy())
    assert k_even.data.ptr % 16 == 0
    lengths = cp.asarray(np.array([300, 123], np.int32))
    for splits in (1, 4):
        aligned = kernels.decode(q, k_even, v_even, lengths, splits=splits)
        misaligned = kernels.decode(q, k_odd, v_odd, lengths, splits=splits)
        assert cp.array_equal(aligned, misaligned), splits

def build_paged_cache(rng, dtype, n_pages, page_size, g, d, lengths):
    """A PagedKVCache (float64, holding values representable in ``dtype``) with the sequences'
    tokens appended in interleaved chunks (so their pages are scattered over the pool), a shared
    prefix (sequence 1 forked from sequence 0 before both grew), and NaN in every unused slot."""
    from refmath.inference.paged import PagedKVCache

    cache = PagedKVCache(n_pages, page_size, g, d, dtype=np.float64)

    def tokens(t):
        return tuple(round_to(rng.standard_normal((t, g, d)), dtype).astype(np.float64) for _ in range(2))

    cache.add_sequence(0)
    shared = min(lengths[0], lengths[1], page_size + 3)  # a full shared page and a partial one
    cache.append(0, *tokens(shared))
    cache.fork(0, 1)
    for seq in range(2, len(lengths)):
        cache.add_sequence(seq)
    remaining = [n - (shared if seq < 2 else 0) for seq, n in enumerate(lengths)]
    while any(remaining):
        for seq, left in enumerate(remaining):
            if left:
                t = min(left, int(rng.integers(1, page_size + 2)))
                cache.append(seq, *tokens(t))
                remaining[seq] -= t
    return cache


PAGED_CASES = [  # (B, H, G, D, page_size, lengths)
    (4, 8, 2, 64, 16, (40, 37, 0, 100)),
    (3, 16, 2, 128, 32, (1000, 515, 64)),   # 8 query heads per key/value head
    (3, 4, 1, 32, 5, (23, 61, 7)),
]


@pytest.mark.cuda
@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("case", PAGED_CASES, ids=lambda c: f"B{c[0]}-H{c[1]}-G{c[2]}-D{c[3]}-p{c[4]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_matches_reference(cp, dtype, case, splits):
    need_dtype(dtype)
    b, h, g, d, page_size, lengths = case
    rng = np.random.default_rng(11)
    n_pages = sum(-(-n // page_size) for n in lengths) + 3
    cache = build_paged_cache(rng, dtype, n_pages, page_size, g, d, lengths)
    table, lens = cache.page_table_array(range(b))
    assert np.isnan(cache.k_pages).any()  # unused slots really hold NaN
    q = round_to(rng.standard_normal((b, h, d)), dtype)
    scale = 1.0 / math.sqrt(d)
    o = kernels.paged_decode(to_device(cp, q, dtype), to_device(cp, cache.k_pages, dtype),
                             to_device(cp, cache.v_pages, dtype), cp.asarray(table), cp.asarray(lens),
                             splits=splits)
    assert o.shape == q.shape and str(o.dtype) == dtype
    gathered = [cache.gather(i) for i in range(b)]
    keys = [kk.transpose(1, 0, 2).astype(np.float32) for kk, _ in gathered]  # (G, L, D)
    values = [vv.transpose(1, 0, 2).astype(np.float32) for _, vv in gathered]
    label = f"paged decode {dtype} {case} splits={splits}"
    exact = check_decode(label, to_host(cp, o), q, keys, values, lens, scale, dtype)
    # The module's own reference, which walks the pages, gives the same float64 numbers.
    np.testing.assert_allclose(cache.decode(q.astype(np.float64), range(b), scale=scale),
                               exact, rtol=1e-12, atol=1e-12)


# ---- bad input ----

def _bad_calls(cp):
    """(exception, message pattern, call) for input the CUDA path must refuse."""
    f16, f32 = cp.float16, cp.float32
    q = cp.zeros((1, 4, 8, 64), f16)
    k = cp.zeros((1, 2, 8, 64), f16)
    q32, k32 = q.astype(f32), k.astype(f32)
    fwd = kernels.flash_attention_forward
    qd, kc = cp.zeros((2, 4, 64), f16), cp.zeros((2, 2, 10, 64), f16)
    pages = cp.zeros((3, 2, 4, 64), f16)
    table = cp.asarray(np.array([[0, 1], [2, -1]], dtype=np.int32))
    return [
        (ValueError, r"version must be one of v1, v2, v3, v4", lambda: fwd(q, k, k, version="v5")),
        (TypeError, r"version", lambda: fwd(q, k, k, version=3)),
        (TypeError, r"'v3' .* float16 or bfloat16", lambda: fwd(q32, k32, k32, version="v3")),
        (ValueError, r"'v3' supports the head widths D = 64 and 128 only, got D = 32",
         lambda: fwd(q[..., :32], k[..., :32], k[..., :32], version="v3")),
        (TypeError, r"'v4' .* float16 or bfloat16", lambda: fwd(q32, k32, k32, version="v4")),
        (ValueError, r"'v4' supports the head widths D = 64 and 128 only, got D = 32",
         lambda: fwd(q[..., :32], k[..., :32], k[..., :32], version="v4")),
        (ValueError, r"up to D = 256, got D = 300",
         lambda: fwd(cp.zeros((1, 1, 2, 300), f32), cp.zeros((1, 1, 2, 300), f32),
                     cp.zeros((1, 1, 2, 300), f32), version="v2")),
        (TypeError, r"float64", lambda: fwd(q.astype(cp.float64), k.astype(cp.float64), k.astype(cp.float64))),
        (TypeError, r"int32", lambda: fwd(q.astype(cp.int32), k.astype(cp.int32), k.astype(cp.int32))),
        (TypeError, r"share one dtype", lambda: fwd(q, k32, k32)),
        (TypeError, r"GPU arrays .* are not", lambda: fwd(q, np.zeros((1, 2, 8, 64), np.float16), k)),
        (ValueError, r"must divide", lambda: fwd(q, cp.zeros((1, 3, 8, 64), f16), cp.zeros((1, 3, 8, 64), f16))),
        (ValueError, r"head width D", lambda: fwd(q, k[..., :32], k[..., :32])),
        (ValueError, r"window", lambda: fwd(q, k, k, window=0)),
        (ValueError, r"lengths must lie in \[0, 10\]",
         lambda: kernels.decode(qd, kc, kc, cp.asarray(np.array([3, 11], np.int32)))),
        (ValueError, r"lengths must lie", lambda: kernels.decode(qd, kc, kc, np.array([-1, 2]))),
        (ValueError, r"splits", lambda: kernels.decode(qd, kc, kc, np.array([3, 4]), splits=0)),
        (ValueError, r"splits must be at most 1024",
         lambda: kernels.decode(qd, kc, kc, np.array([3, 4]), splits=5000)),
        (ValueError, r"page_table\[1, 1\] = -1",
         lambda: kernels.paged_decode(qd, pages, pages, table, np.array([8, 5]))),
        (ValueError, r"page_table\[0, 1\] = 7",
         lambda: kernels.paged_decode(qd, pages, pages, cp.asarray(np.array([[0, 7], [2, -1]], np.int32)),
                                      np.array([5, 1]))),
        (TypeError, r"page_table must be an integer array",
         lambda: kernels.paged_decode(qd, pages, pages, table.astype(f32), np.array([1, 1]))),
    ]


@pytest.mark.cuda
def test_bad_input_raises_naming_the_problem(cp):
    for error, pattern, call in _bad_calls(cp):
        with pytest.raises(error, match=pattern):
            call()


# ---- NaN in gives NaN out (issue 9), as tests/test_kernels_nan.py checks the CPU kernels ----

NAN_CASES = [  # (H, G, T_q, T_k, D, causal, window): tiles of every version cut by the mask
    (2, 1, 70, 70, 64, True, 0),
    (2, 2, 150, 130, 64, True, 0),
    (1, 1, 100, 100, 64, True, 20),
    (2, 1, 40, 90, 64, False, 0),
]


@pytest.mark.cuda
@pytest.mark.parametrize("where", ["q", "k", "v", "do"])
@pytest.mark.parametrize("case", NAN_CASES, ids=lambda c: "-".join(map(str, c)))
def test_attention_nan_pattern_matches_the_reference(cp, case, where):
    from test_kernels_nan import assert_same_nans, attention_reference

    h, g, t_q, t_k, d, causal, window = case
    rng = np.random.default_rng(t_q + t_k)
    for trial in range(3):
        q, k, v, do = (round_to(rng.standard_normal(s), "float16") for s in
                       ((1, h, t_q, d), (1, g, t_k, d), (1, g, t_k, d), (1, h, t_q, d)))
        x = {"q": q, "k": k, "v": v, "do": do}[where].reshape(-1)
        x[rng.integers(x.size)] = np.nan
        ref = attention_reference(q, k, v, do, causal, window, d**-0.5)
        for version in VERSIONS:
            dtype = "float32" if "float32" in RUNGS[version].dtypes else "float16"
            o, lse = kernels.flash_attention_forward(
                to_device(cp, q, dtype), to_device(cp, k, dtype), to_device(cp, v, dtype),
                causal=causal, window=window or None, version=version)
            label = f"{version} NaN in {where}, trial {trial}, case {case}"
            assert_same_nans(f"o ({label})", to_host(cp, o), ref[0])
            assert_same_nans(f"lse ({label})", to_host(cp, lse), ref[1])
        grads = kernels.flash_attention_backward(
            *(cp.asarray(x) for x in (do, q, k, v)), cp.asarray(to_host(cp, o).astype(np.float32)),
            lse, causal=causal, window=window or None)
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref[2:]):
            assert_same_nans(f"{name} (NaN in {where}, trial {trial}, case {case})", to_host(cp, got), want)


@pytest.mark.cuda
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_decode_nan_pattern_matches_the_reference(cp, where):
    from test_kernels_nan import assert_same_nans, decode_nan_reference

    rng = np.random.default_rng(3)
    b, h, g, d, t_max = 3, 8, 2, 64, 300
    lengths = np.array([0, 17, 300])
    for trial in range(4):
        q = rng.standard_normal((b, h, d)).astype(np.float32)
        k, v = (rng.standard_normal((b, g, t_max, d)).astype(np.float32) for _ in range(2))
        x = {"q": q, "k": k, "v": v}[where].reshape(-1)
        x[rng.integers(x.size)] = np.nan
        ref = decode_nan_reference(q, k, v, lengths, d**-0.5)
        for splits in (1, 4):
            o = kernels.decode(cp.asarray(q), cp.asarray(k), cp.asarray(v), cp.asarray(lengths),
                               splits=splits)
            assert_same_nans(f"decode NaN in {where}, trial {trial}, splits {splits}", to_host(cp, o), ref)


@pytest.mark.cuda
def test_paged_decode_checks_device_tables_on_the_device(cp):
    """A page table and lengths already on the GPU are not copied back to be checked (no
    synchronisation per call): a bad entry makes that sequence's rows NaN, the others are untouched."""
    rng = np.random.default_rng(5)
    q = cp.asarray(rng.standard_normal((3, 4, 32)).astype(np.float32))
    pages = cp.asarray(rng.standard_normal((6, 2, 8, 32)).astype(np.float32))
    good = np.array([[0, 1], [2, 3], [4, 5]], np.int32)
    lengths = np.array([16, 9, 12])
    expected = to_host(cp, kernels.paged_decode(q, pages, pages, good, lengths))
    for table, lens, bad_row in ((np.array([[0, 1], [2, 9], [4, 5]]), lengths, 1),
                                 (good, np.array([16, 9, 17]), 2),
                                 (good, np.array([-1, 9, 12]), 0)):
        o = to_host(cp, kernels.paged_decode(q, pages, pages, cp.asarray(table), cp.asarray(lens)))
        assert np.isnan(o[bad_row]).all()
        keep = [i for i in range(3) if i != bad_row]
        np.testing.assert_array_equal(o[keep], expected[keep])
