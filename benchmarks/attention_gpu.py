"""FlashAttention and decode on the GPU: each CUDA version of refmath beside PyTorch's own kernel.

Prints tables, asserts nothing (the tests check correctness; this only measures).

* Forward, causal, bfloat16, D = 128, H = 16, B * T = 16384 tokens, T from 512 to 8192: refmath's
  v1 (one thread per query row), v2 (tiles in shared memory), v3 (tensor cores) and
  ``torch.nn.functional.scaled_dot_product_attention`` restricted to its FlashAttention backend, in
  TFLOP/s counting 4 B H T^2 D / 2 floating-point operations (two matrix products, half of the
  score matrix hidden by the causal mask).
* Decode, bfloat16, D = 128, 32 query heads sharing 8 key/value heads: contiguous and paged caches
  (16-token pages in shuffled order), in GB/s of cache read, beside the device-to-device copy
  bandwidth measured here with CuPy (bytes read + bytes written per second): decode is a pure
  read of the cache, so the copy rate is its practical ceiling.

``--smoke`` instead runs every kernel once on a tiny case with CuPy's memory pool off (so that each
array is its own allocation, whose ends compute-sanitizer can see); benchmarks/gpu_check.sh runs it
under ``compute-sanitizer --tool memcheck`` and ``--tool racecheck``.

Usage: ``python benchmarks/attention_gpu.py [--smoke] [--quick]``
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from refmath import kernels

FORWARD_LENGTHS = (512, 1024, 2048, 4096, 8192)
TOKENS = 16384  # B * T in the forward table
HEADS = 16
DIM = 128


def bfloat16_or_none():
    try:
        import cupy as cp
        import ml_dtypes

        dtype = np.dtype(ml_dtypes.bfloat16)
        cp.zeros(1, dtype=dtype).astype(cp.float32).astype(dtype)
        return dtype
    except Exception:
        return None


def gpu_time(cp, fn, budget_s=1.0, min_reps=3, max_reps=50):
    """Median milliseconds of fn() on the current stream, by CUDA events, after one warm-up call;
    as many repetitions as fit in about budget_s."""
    fn()
    cp.cuda.get_current_stream().synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    fn()
    end.record()
    end.synchronize()
    first = cp.cuda.get_elapsed_time(start, end)
    reps = int(max(min_reps, min(max_reps, budget_s * 1e3 / max(first, 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def torch_time(torch, fn, budget_s=1.0, min_reps=3, max_reps=50):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    first = start.elapsed_time(end)
    reps = int(max(min_reps, min(max_reps, budget_s * 1e3 / max(first, 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def table(title, header, rows):
    print(f"\n{title}")
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
    sys.stdout.flush()


def torch_flash_attention():
    """A function (q, k, v) -> o running PyTorch's FlashAttention backend, or (None, why)."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as err:
        return None, None, f"PyTorch unavailable: {err}"
    if not torch.cuda.is_available():
        return None, None, "PyTorch sees no GPU"

    def run(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return torch, run, ""


def forward_table(cp, dtype, lengths, budget_s):
    torch, torch_sdpa, why_not = torch_flash_attention()
    dtype_name = str(np.dtype(dtype)) if dtype is not None else "float16"
    cp_dtype = dtype if dtype is not None else cp.float16
    rows = []
    for t in lengths:
        b = max(1, TOKENS // t)
        flops = 4 * b * HEADS * t * t * DIM / 2
        q, k, v = (cp.random.standard_normal((b, HEADS, t, DIM), dtype=cp.float32).astype(cp_dtype)
                   for _ in range(3))
        row = [t, b]
        for version in kernels.flash_versions():
            def run(version=version):
                return kernels.flash_attention_forward(q, k, v, causal=True, version=version)
            try:
                ms = gpu_time(cp, run, budget_s)
                row.append(f"{flops / ms / 1e9:.1f}")
            except Exception as err:  # a refusal or a failed launch: say so in the table
                row.append(f"error: {str(err)[:40]}")
        if torch_sdpa is not None:
            tdtype = torch.bfloat16 if dtype is not None else torch.float16
            tq, tk, tv = (torch.randn(b, HEADS, t, DIM, device="cuda", dtype=tdtype) for _ in range(3))
            try:
                ms = torch_time(torch, lambda: torch_sdpa(tq, tk, tv), budget_s)
                row.append(f"{flops / ms / 1e9:.1f}")
            except Exception as err:
                row.append(f"error: {str(err)[:40]}")
        rows.append(row)
        del q, k, v
    header = ["T", "B", *(f"{v} TFLOP/s" for v in kernels.flash_versions())]
    if torch_sdpa is not None:
        header.append("torch flash TFLOP/s")
    table(f"Causal FlashAttention forward, {dtype_name}, H={HEADS}, D={DIM}, B*T={TOKENS}"
          + ("" if torch_sdpa is not None else f" ({why_not})"), header, rows)


def copy_bandwidth(cp):
    """Device-to-device copy of 1 GiB, in GB/s of bytes read plus bytes written."""
    n = 1 << 30
    src = cp.empty(n, dtype=cp.uint8)
    dst = cp.empty_like(src)
    src.fill(1)
    ms = gpu_time(cp, lambda: cp.copyto(dst, src), 1.0)
    del src, dst
    return 2 * n / ms / 1e6


def decode_table(cp, dtype, budget_s):
    cp_dtype = dtype if dtype is not None else cp.float16
    itemsize = np.dtype(cp_dtype).itemsize
    copy = copy_bandwidth(cp)
    rng = np.random.default_rng(0)
    h, g, d, page = 32, 8, DIM, 16
    rows = []
    for b, length in ((1, 32768), (8, 8192), (64, 2048), (256, 512)):
        q = cp.random.standard_normal((b, h, d), dtype=cp.float32).astype(cp_dtype)
        k_cache, v_cache = (cp.random.standard_normal((b, g, length, d), dtype=cp.float32).astype(cp_dtype)
                            for _ in range(2))
        lengths = cp.full((b,), length, dtype=cp.int32)
        cache_bytes = 2 * b * g * length * d * itemsize
        contiguous_ms = gpu_time(cp, lambda: kernels.decode(q, k_cache, v_cache, lengths), budget_s)
        # The same tokens in a shuffled pool of pages: (n_pages, G, page, D).
        pages_per_seq = length // page
        n_pages = b * pages_per_seq
        order = cp.asarray(rng.permutation(n_pages).astype(np.int32))
        table_ = order.reshape(b, pages_per_seq)
        k_pages, v_pages = (cp.empty((n_pages, g, page, d), dtype=cp_dtype) for _ in range(2))
        bits = cp.uint16 if itemsize == 2 else cp.uint32  # move raw elements: no bfloat16 kernels needed
        for cache, pages in ((k_cache, k_pages), (v_cache, v_pages)):
            chunks = cache.view(bits).reshape(b, g, pages_per_seq, page, d).transpose(0, 2, 1, 3, 4)
            pages.view(bits)[order] = chunks.reshape(n_pages, g, page, d)
        paged_ms = gpu_time(cp, lambda: kernels.paged_decode(q, k_pages, v_pages, table_, lengths), budget_s)
        rows.append([b, length, f"{cache_bytes / 2**20:.0f}",
                     f"{cache_bytes / contiguous_ms / 1e6:.0f}", f"{cache_bytes / contiguous_ms / 1e6 / copy:.0%}",
                     f"{cache_bytes / paged_ms / 1e6:.0f}", f"{cache_bytes / paged_ms / 1e6 / copy:.0%}"])
        del q, k_cache, v_cache, k_pages, v_pages
    dtype_name = str(np.dtype(cp_dtype))
    table(f"Decode, {dtype_name}, H={h}, G={g}, D={d}, automatic splits; device copy bandwidth "
          f"{copy:.0f} GB/s (read + write)",
          ["B", "length", "cache MiB", "contiguous GB/s", "of copy", "paged GB/s", "of copy"], rows)


def smoke(cp):
    """Every kernel once on a tiny case, CuPy's memory pool off (for compute-sanitizer)."""
    cp.cuda.set_allocator(None)
    rng = np.random.default_rng(0)
    bf16 = bfloat16_or_none()
    dtypes = [np.float32, np.float16] + ([bf16] if bf16 is not None else [])

    def arr(shape, dtype):
        return cp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    calls = 0
    for dtype in dtypes:
        for version in kernels.flash_versions():
            for d in (64, 128) if version == "v3" else (40, 128):
                if version == "v3" and dtype == np.float32:
                    continue
                # T_q > T_k, a window and GQA: every masking and bounds path in one small call.
                q, k, v = arr((2, 4, 70, d), dtype), arr((2, 2, 67, d), dtype), arr((2, 2, 67, d), dtype)
                kernels.flash_attention_forward(q, k, v, causal=True, window=20, version=version)
                kernels.flash_attention_forward(q, k, v, version=version)
                calls += 2
        q, k = arr((3, 8, 64), dtype), arr((3, 2, 50, 64), dtype)
        kernels.decode(q, k, k, cp.asarray(np.array([0, 17, 50], np.int32)), splits=3)
        pages = arr((9, 2, 8, 64), dtype)
        table_ = cp.asarray(np.array([[4, 1, 7, -1], [0, 2, 3, 8], [5, -1, -1, -1]], np.int32))
        kernels.paged_decode(q, pages, pages, table_, np.array([20, 32, 3]), splits=2)
        calls += 2
    for (b, h, g, t_q, t_k, d), causal, window in (((2, 4, 2, 70, 67, 40), True, 20),
                                                   ((1, 2, 1, 33, 33, 128), False, None)):
        q, do = arr((b, h, t_q, d), np.float32), arr((b, h, t_q, d), np.float32)
        k, v = arr((b, g, t_k, d), np.float32), arr((b, g, t_k, d), np.float32)
        o, lse = kernels.flash_attention_forward(q, k, v, causal=causal, window=window, version="v2")
        kernels.flash_attention_backward(do, q, k, v, o, lse, causal=causal, window=window)
        calls += 2
    cp.cuda.get_current_stream().synchronize()
    print(f"smoke: {calls} kernel calls done ({', '.join(str(np.dtype(x)) for x in dtypes)})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="run every kernel once on a tiny case")
    parser.add_argument("--quick", action="store_true", help="shorter timing budget, T up to 4096")
    args = parser.parse_args()
    try:
        import cupy as cp
    except ImportError:
        print("CuPy is not installed: nothing to measure")
        return
    if not kernels.cuda_available():
        print(f"no GPU to measure on: {kernels.cuda_build_info()}")
        return
    if args.smoke:
        smoke(cp)
        return
    dtype = bfloat16_or_none()
    if dtype is None:
        print("CuPy without bfloat16 (needs CuPy >= 14 and ml_dtypes): measuring float16 instead")
    device = cp.cuda.Device()
    print(f"{cp.cuda.runtime.getDeviceProperties(device.id)['name'].decode()}, "
          f"{device.attributes['MultiProcessorCount']} SMs; {kernels.cuda_build_info()}")
    started = time.time()
    budget = 0.3 if args.quick else 0.6
    lengths = FORWARD_LENGTHS[:-1] if args.quick else FORWARD_LENGTHS
    forward_table(cp, dtype, lengths, budget)
    decode_table(cp, dtype, budget)
    print(f"\n(measured in {time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
