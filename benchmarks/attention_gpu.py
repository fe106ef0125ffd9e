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

Every figure is many calls between one pair of CUDA events (the stream stays full), twice over:
the kernel alone (the compiled launcher with its outputs allocated once) and a loop over the public
function (its checks, allocations and any host synchronisation included), so that the cost of the
Python layer shows as the difference. Without PyTorch the baseline column says "missing".

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


def events_ms(record, sync, elapsed, fn, budget_s=1.0, min_calls=3, max_calls=200):
    """Milliseconds per call of fn(): one warm-up call, one timed call to size the run, then n calls
    between a single pair of events (as many as fit in about budget_s). The calls queue up on the
    stream, so the GPU never waits for Python between them: for a kernel-only fn the figure is the
    kernels' own time, for a public function it is what a loop calling it gets (its host work and
    any synchronisation included)."""
    fn()
    sync()
    start, end = record(), record()
    start.record()
    fn()
    end.record()
    end.synchronize()
    first = elapsed(start, end)
    calls = int(max(min_calls, min(max_calls, budget_s * 1e3 / max(first, 1e-3))))
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return elapsed(start, end) / calls


def gpu_time(cp, fn, budget_s=1.0):
    return events_ms(cp.cuda.Event, cp.cuda.get_current_stream().synchronize,
                     cp.cuda.get_elapsed_time, fn, budget_s)


def torch_time(torch, fn, budget_s=1.0):
    return events_ms(lambda: torch.cuda.Event(enable_timing=True), torch.cuda.synchronize,
                     lambda a, b: a.elapsed_time(b), fn, budget_s)


def table(title, header, rows):
    print(f"\n{title}")
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
    sys.stdout.flush()


def torch_flash_attention():
    """A function (q, k, v) -> o running PyTorch's FlashAttention backend, or (None, why). PyTorch is
    never installed for this (gpu_check.sh reports the baseline as missing instead)."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as err:
        return None, None, f"torch baseline missing: {type(err).__name__}: {err}"
    if not torch.cuda.is_available():
        return None, None, "torch baseline missing: PyTorch sees no GPU"

    def run(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return torch, run, ""


def raw_forward(cp, version, q, k, v, causal=True):
    """The CUDA launcher of one version with its outputs allocated once: the kernel alone, without
    refmath.kernels' checks and allocations."""
    module = kernels._cuda
    b, h, t_q, d = q.shape
    g, t_k = k.shape[1], k.shape[2]
    o = cp.empty_like(q)
    lse = cp.empty((b, h, t_q), dtype=cp.float32)
    code = kernels._dtype_code(module, q)
    stream = cp.cuda.get_current_stream().ptr
    return lambda: module.flash_forward(version, q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr,
                                        lse.data.ptr, b, h, g, t_q, t_k, d, causal, 0, d**-0.5, code,
                                        stream)


def forward_table(cp, dtype, lengths, budget_s):
    torch, torch_sdpa, why_not = torch_flash_attention()
    dtype_name = str(np.dtype(dtype)) if dtype is not None else "float16"
    cp_dtype = dtype if dtype is not None else cp.float16
    versions = kernels.flash_versions()
    rows = []
    for t in lengths:
        b = max(1, TOKENS // t)
        flops = 4 * b * HEADS * t * t * DIM / 2
        q, k, v = (cp.random.standard_normal((b, HEADS, t, DIM), dtype=cp.float32).astype(cp_dtype)
                   for _ in range(3))
        row = [t, b]
        for version in versions:
            try:
                ms = gpu_time(cp, raw_forward(cp, version, q, k, v), budget_s)
                row.append(f"{flops / ms / 1e9:.1f}")
            except Exception as err:  # a refusal or a failed launch: say so in the table
                row.append(f"error: {str(err)[:40]}")
        try:  # the public function, default version: checks, allocation and launch per call
            ms = gpu_time(cp, lambda: kernels.flash_attention_forward(q, k, v, causal=True), budget_s)
            row.append(f"{flops / ms / 1e9:.1f}")
        except Exception as err:
            row.append(f"error: {str(err)[:40]}")
        if torch_sdpa is not None:
            tdtype = torch.bfloat16 if dtype is not None else torch.float16
            tq, tk, tv = (torch.randn(b, HEADS, t, DIM, device="cuda", dtype=tdtype) for _ in range(3))
            try:
                ms = torch_time(torch, lambda: torch_sdpa(tq, tk, tv), budget_s)
                row.append(f"{flops / ms / 1e9:.1f}")
            except Exception as err:
                row.append(f"error: {str(err)[:40]}")
            del tq, tk, tv
        else:
            row.append("missing")
        rows.append(row)
        del q, k, v
    header = ["T", "B", *(f"{v} kernel" for v in versions), "call", "torch flash"]
    table(f"Causal FlashAttention forward, {dtype_name}, H={HEADS}, D={DIM}, B*T={TOKENS}, TFLOP/s: "
          f"each version's kernel alone, then a loop over kernels.flash_attention_forward (default "
          f"version), then PyTorch's flash backend" + ("" if torch_sdpa is not None else f" ({why_not})"),
          header, rows)


def copy_bandwidth(cp):
    """Device-to-device copy of 1 GiB, in GB/s of bytes read plus bytes written."""
    n = 1 << 30
    src = cp.empty(n, dtype=cp.uint8)
    dst = cp.empty_like(src)
    src.fill(1)
    ms = gpu_time(cp, lambda: cp.copyto(dst, src), 1.0)
    del src, dst
    return 2 * n / ms / 1e6


def raw_decode(cp, q, k_pages, v_pages, table_, lengths):
    """The CUDA decode launcher with its workspace and output allocated once, table and lengths
    already int32 on the device: the two kernels alone."""
    module = kernels._cuda
    b, h, d = q.shape
    n_pages, g, page_size, _ = k_pages.shape
    max_pages = table_.shape[1]
    splits = kernels._auto_splits(cp, b, g, h // g, max_pages * page_size)
    partials = cp.empty((b, h, splits, d + 2), dtype=cp.float32)
    o = cp.empty_like(q)
    code = kernels._dtype_code(module, q)
    stream = cp.cuda.get_current_stream().ptr
    return lambda: module.paged_decode(
        q.data.ptr, k_pages.data.ptr, v_pages.data.ptr, table_.data.ptr, lengths.data.ptr,
        partials.data.ptr, o.data.ptr, b, h, g, d, n_pages, page_size, max_pages, splits, d**-0.5,
        code, stream)


def decode_table(cp, dtype, budget_s, quick=False):
    cp_dtype = dtype if dtype is not None else cp.float16
    itemsize = np.dtype(cp_dtype).itemsize
    copy = copy_bandwidth(cp)
    rng = np.random.default_rng(0)
    h, g, d, page = 32, 8, DIM, 16
    shapes = ((1, 32768), (8, 8192), (64, 2048), (256, 512))
    if not quick:
        shapes = ((1, 131072), *shapes)
    rows = []
    for b, length in shapes:
        q = cp.random.standard_normal((b, h, d), dtype=cp.float32).astype(cp_dtype)
        k_cache, v_cache = (cp.random.standard_normal((b, g, length, d), dtype=cp.float32).astype(cp_dtype)
                            for _ in range(2))
        lengths = cp.full((b,), length, dtype=cp.int32)
        cache_bytes = 2 * b * g * length * d * itemsize
        # A contiguous cache is the paged layout with one page of `length` slots per sequence.
        contiguous = cp.arange(b, dtype=cp.int32).reshape(b, 1)
        figures = {
            "contiguous kernel": raw_decode(cp, q, k_cache, v_cache, contiguous, lengths),
            "contiguous call": lambda: kernels.decode(q, k_cache, v_cache, lengths),
        }
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
        figures["paged kernel"] = raw_decode(cp, q, k_pages, v_pages, table_, lengths)
        figures["paged call"] = lambda: kernels.paged_decode(q, k_pages, v_pages, table_, lengths)
        row = [b, length, f"{cache_bytes / 2**20:.0f}"]
        for fn in figures.values():
            rate = cache_bytes / gpu_time(cp, fn, budget_s) / 1e6
            row += [f"{rate:.0f}", f"{rate / copy:.0%}"]
        rows.append(row)
        del q, k_cache, v_cache, k_pages, v_pages
    dtype_name = str(np.dtype(cp_dtype))
    header = ["B", "length", "cache MiB"]
    for name in figures:
        header += [f"{name} GB/s", "of copy"]
    table(f"Decode, {dtype_name}, H={h}, G={g}, D={d}, automatic splits, GB/s of cache read: the "
          f"kernels alone, and a loop over the public function (its checks and allocations "
          f"included); device copy bandwidth {copy:.0f} GB/s (read + write)", header, rows)


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
        for rung in kernels.flash_ladder():
            if str(np.dtype(dtype)) not in rung.dtypes:
                continue
            version = rung.name
            # Two head widths each rung takes; where it pads, one between its compiled widths.
            for d in (40, 128) if rung.pads_head_dim else rung.head_dims:
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
    except ImportError as err:
        print(f"FAILED: CuPy is not installed, nothing to measure ({err})")
        sys.exit(1)  # a measurement that did not happen is not a success (gpu_check.sh)
    if not kernels.cuda_available():
        print(f"FAILED: no GPU to measure on: {kernels.cuda_build_info()}")
        sys.exit(1)
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
    decode_table(cp, dtype, budget, quick=args.quick)
    print(f"\n(measured in {time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
