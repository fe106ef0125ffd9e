"""The conformance sweep on the GPU: refmath's CUDA kernels (every FlashAttention rung, decode and
paged decode, on CuPy arrays) and PyTorch's SDPA on CUDA (as dispatched, and forced onto its
flash backend), each through the default sweep. Prints one summary line per kernel and the failed
cases; exits 1 if any case failed. Run by benchmarks/gpu_check.sh.

Usage: python benchmarks/conformance_gpu.py [--quick]
"""
from __future__ import annotations

import functools
import sys
import time

from refmath import kernels
from refmath.conformance import check_attention, sweep
from refmath.conformance.report import summary


def report(label, results) -> bool:
    print(f"{label}: {summary(results)}")
    for r in results:
        if r.status == "fail":
            print(f"   FAIL {r.case.id} ({r.case.describe()}): {r.reason}")
    return not any(r.status == "fail" for r in results)


def main(quick: bool) -> int:
    ok = True
    start = time.perf_counter()
    if kernels.cuda_available():
        for version in kernels.flash_versions():
            fn = functools.partial(kernels.flash_attention_forward, version=version)
            dtypes = ("float16",) if version in ("v3", "v4") else ("float32", "float16")
            cases = [c for c in sweep(("forward",), dtypes, quick)
                     if version not in ("v3", "v4") or c.d in (64, 128)]
            ok &= report(f"refmath CUDA flash {version}",
                         check_attention(fn, "refmath", device="cuda", cases=cases))
        for fn, adapter in ((kernels.flash_attention_backward, "refmath_backward"),
                            (kernels.decode, "refmath_decode"), (kernels.paged_decode, "refmath_paged")):
            ok &= report(f"refmath CUDA {adapter}", check_attention(
                fn, adapter, device="cuda", quick=quick, dtypes=("float32", "float16")))
    else:
        print(f"refmath CUDA: not run: {kernels.cuda_build_info()}")
        ok = False
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as err:
        print(f"torch SDPA on CUDA: not run: {err}")
        return 1
    if not torch.cuda.is_available():
        print("torch SDPA on CUDA: not run: torch sees no CUDA device")
        return 1
    ok &= report("torch SDPA (cuda, as dispatched)", check_attention(
        F.scaled_dot_product_attention, "sdpa", device="cuda", quick=quick,
        dtypes=("bfloat16", "float16"), allow_nan_leaks=True))

    def flash_sdpa(*args, **kwargs):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(*args, **kwargs)

    # The flash backend takes no attn_mask: the cases it can be asked (no mask, or is_causal).
    cases = [c for c in sweep(("forward", "backward"), ("bfloat16", "float16"), quick)
             if not c.alibi and c.window is None and c.lengths is None and c.varlen is None
             and (not c.causal or c.t_q == c.t_k or c.alignment == "top-left")]
    ok &= report("torch SDPA (cuda, flash backend)", check_attention(
        flash_sdpa, "sdpa", device="cuda", cases=cases, allow_nan_leaks=True))
    print(f"conformance on the GPU: {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main("--quick" in sys.argv[1:]))
