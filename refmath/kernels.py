"""The one door to the compiled kernels: ``refmath._C`` (C++/OpenMP) and ``refmath._cuda`` (CUDA).

No other module imports the compiled extensions. Each function here checks its input (dtype, rank,
layout) before any pointer reaches C++, then dispatches on where the array lives: NumPy arrays go to
the CPU module, CuPy arrays (anything with ``__cuda_array_interface__``) to the CUDA module, on
CuPy's current stream. CuPy is imported only when a GPU array arrives, so it stays optional.

The kernels compute the same equations as the NumPy reference (``refmath.softmax`` etc.) and the
tests hold them to it.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import NamedTuple

import numpy as np

from refmath._validate import (check_axis, check_choice, check_flag, check_int, check_ndim,
                               check_real, check_same_shape, float_array)

__all__ = ["BACKENDS", "cpu_available", "cuda_available", "cpu_vector_lanes", "cpu_instructions",
           "cpu_threads", "set_cpu_threads", "cpu_thread_limit", "cpu_last_team",
           "cpu_last_usable_threads",
           "backward_schedule", "stream_sum", "adamw_step", "rows_matmul", "rows_matmul_many",
           "format_rows_matmul", "DECODE_LAYER_NORMS", "DECODE_LAYER_FFNS", "decode_layers",
           "build_info", "cuda_build_info", "softmax_rows",
           "flash_attention_forward", "flash_attention_backward", "decode", "paged_decode",
           "FlashRung", "flash_ladder", "flash_versions"]

# How the kernels' idle OpenMP threads wait for the next parallel region. OpenMP's default keeps
# them spinning on their cores for a while (libgomp: about 3 ms) after each region; on a machine
# where another busy process wants those cores, the spinning threads take its turns and it takes
# theirs, and a 2-thread decode step that waits for both its threads at every product falls far
# below 1 thread. Passive threads sleep at once, so the scheduler gives the core to whoever can use
# it and wakes them promptly for the next region. The runtime reads its wait policy once, when it
# loads, so it is set here (in the environment, for the load of refmath._C only, then put back)
# unless the user chose one, or the runtime was already loaded by another library (torch's copy of
# libgomp, say), whose choice then holds for both. OPENMP_WAIT says which. (The decode step's
# products and attention share their work another way, which neither spins long nor waits for a
# late thread: see cpu_last_usable_threads.)
_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def _openmp_loaded() -> bool | None:
    """Whether an OpenMP runtime is already in this process (None where /proc cannot tell)."""
    try:
        with open("/proc/self/maps") as maps:
            return any(name in line for line in maps for name in ("libgomp", "libomp", "libiomp"))
    except OSError:
        return None


@contextlib.contextmanager
def _passive_wait_while_loading():
    chosen = [f"{name}={os.environ[name]}" for name in _WAIT_VARIABLES if os.environ.get(name)]
    if chosen:
        yield f"as the environment sets it ({', '.join(chosen)})"
        return
    if _openmp_loaded():
        yield ("the OpenMP runtime's own: it was loaded before refmath.kernels (set "
               "OMP_WAIT_POLICY=passive before Python starts to make it passive)")
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield "passive (set by refmath.kernels when it loaded the OpenMP runtime)"
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)


with _passive_wait_while_loading() as OPENMP_WAIT:
    try:
        from refmath import _C
    except ImportError as err:  # an install that skipped the build, or a checkout used via PYTHONPATH
        _C, _C_ERROR = None, err

try:
    from refmath import _cuda
except ImportError as err:  # no toolkit or no GPU at build time, REFMATH_CUDA=0, a failed CUDA compile
    _cuda, _CUDA_ERROR = None, err

try:
    from refmath._build_info import BUILD_INFO  # written by setup.py at build time
except ImportError:
    BUILD_INFO = None

_KERNEL_DTYPES = (np.float32, np.float64)
# Who computes attention, everywhere a backend is chosen (training, prefill, decode, the command
# line): the NumPy reference, the C++ kernels, or the CUDA kernels.
BACKENDS = ("numpy", "cpu", "cuda")


# ---- what is available ----

def cpu_available() -> bool:
    """True when the C++ module ``refmath._C`` was built and imports."""
    return _C is not None


@functools.cache
def _device_query() -> tuple[int, str]:
    # Asked once: the device count does not change within a process, and without a driver each
    # query makes the CUDA runtime look for one again.
    return _cuda.device_query() if _cuda is not None else (0, "refmath._cuda is not built")


def cuda_available() -> bool:
    """True when ``refmath._cuda`` was built AND the CUDA runtime sees at least one device."""
    return _device_query()[0] > 0


def cpu_vector_lanes(lanes: int | None = None) -> int:
    """The width, in float32 lanes, of the vectors the CPU kernels run with: 16 where the CPU has
    AVX-512 (x86-64-v4), else 8 (AVX2, or baseline instructions doing the same work).

    Each CPU kernel is compiled in both widths and picks one at run time. ``lanes=8`` makes a CPU
    with AVX-512 run the 8-lane copies (to test or time them); ``lanes=16`` goes back to the widest
    the CPU has. Returns the width now in use.
    """
    C = _cpu()
    if lanes is not None:
        if lanes not in (8, 16):
            raise ValueError(f"lanes must be 8 or 16 (or None to leave it), got {lanes!r}")
        C.set_wide_vectors(lanes == 16)
    return C.vector_lanes()


def cpu_instructions() -> str:
    """The instructions the CPU kernels run with now, in words: AVX-512 (16 lanes); AVX2 and FMA
    (8 lanes, the x86-64-v3 copies); the x86-64 baseline (SSE2, no fused multiply-add: the copies
    a CPU or virtual machine gets when it lacks any x86-64-v3 feature, about half as fast); or the
    build's own target, where the module has no run-time choice (not GCC on x86-64)."""
    C = _cpu()
    if C.vector_lanes() == 16:
        if (BUILD_INFO or {}).get("wide_on_avx2"):  # setup.py's REFMATH_WIDE_ON_AVX2 test build
            return "16 lanes as pairs of AVX2 vectors (a REFMATH_WIDE_ON_AVX2 test build)"
        return "AVX-512, 16 lanes"
    return {"x86-64-v3": "AVX2 and FMA, 8 lanes (x86-64-v3 copies)",
            "baseline": "x86-64 baseline, SSE2 without FMA (this CPU lacks an x86-64-v3 feature)",
            }.get(C.narrow_copy(), "the build's own target, 8 lanes")


def cpu_threads() -> int:
    """The number of OpenMP threads the CPU kernels use (1 without OpenMP): the count set by
    :func:`set_cpu_threads`, else OpenMP's own (``OMP_NUM_THREADS``, else one per core)."""
    return _cpu().max_threads()


def set_cpu_threads(threads: int | None) -> int | None:
    """Run every CPU kernel on ``threads`` OpenMP threads (an int >= 1), process-wide and from
    whichever Python thread calls it, or on OpenMP's own count (None). Returns the previous setting
    (None for OpenMP's own). A kernel still runs small calls on one thread (a quarter million
    multiply-adds or fewer), whatever the setting."""
    if threads is not None:
        threads = check_int("threads", threads, 1, 4096)
    before = _cpu().thread_limit()
    _cpu().set_threads(threads or 0)
    return before or None


@contextlib.contextmanager
def cpu_thread_limit(threads: int | None):
    """:func:`set_cpu_threads` for the length of a ``with`` block (None: leave the count as it
    is), as ``generate --threads N`` runs. Without the compiled module there is nothing to set."""
    if threads is not None:
        threads = check_int("threads", threads, 1, 4096)
    if threads is None or _C is None:
        yield
        return
    before = set_cpu_threads(threads)
    try:
        yield
    finally:
        set_cpu_threads(before)


def cpu_last_team() -> int:
    """The threads the last row product (:func:`rows_matmul`, :func:`format_rows_matmul`, the
    compiled decode step's products), :func:`decode` or :func:`stream_sum` was shared among: the
    thread setting, or 1 for a call too small to share. How a test sees that a thread setting
    reached the kernels (0 before any has run)."""
    return _cpu().last_team()


def cpu_last_usable_threads() -> int:
    """The threads that could take part in the last call shared among several: its share of the
    setting (:func:`cpu_last_team`), or fewer while other processes keep the cores busy.

    The decode-layout row products, the stored-format products and the decode attention cut their
    work into pieces, and the calling thread and helper threads take runs of them as they come
    (``csrc/piece_team.h``); a helper that is late finds nothing left and is not waited for. While
    other processes' runnable tasks (``/proc/loadavg``, counted at most every 10 ms, the larger of
    the last two counts) leave fewer cores free than the setting, fewer threads take part, so that
    two threads on a machine with another busy process run no slower than one. The results are the
    same bits whoever takes the pieces. 0 before the first such call; where ``/proc/loadavg``
    cannot be read, always the setting."""
    return _cpu().last_threads_used()


BACKWARD_SCHEDULES = {"auto": 0, "one pass": 1, "two passes": 2}


@contextlib.contextmanager
def backward_schedule(name: str):
    """Within the ``with`` block, the CPU FlashAttention backward uses one schedule: ``"one pass"``
    (each (batch, key/value head) item owns its dK, dV and its query heads' dQ), ``"two passes"``
    (dK and dV by key tiles, then dQ by query tiles) or ``"auto"`` (the default: one pass when the
    items fill the threads evenly). Both give the same bits for finite input; the lesson on the
    kernel and the tests use this to show it."""
    check_choice("name", name, tuple(BACKWARD_SCHEDULES))
    C = _cpu()
    C.set_backward_schedule(BACKWARD_SCHEDULES[name])
    try:
        yield
    finally:
        C.set_backward_schedule(0)


def stream_sum(x, order=None) -> float:
    """The sum of a C-contiguous float32 array read once by every CPU kernel thread: a probe of
    the memory bandwidth that a decode step, which reads the whole cache once, can reach.

    With ``order`` (integers), the sum of the rows ``x[order[0]], x[order[1]], ...`` along the
    first axis, read in that order, the list cut into one run per thread, each thread requesting
    its next row while it reads one: with a paged pool ``(n_pages, G, page_size, D)`` and its page
    table's row as the order, the read a paged decode makes of that pool, and nothing else.
    """
    x = float_array("x", x)
    if x.dtype != np.float32:
        raise TypeError(f"x must be float32, got dtype {x.dtype} with shape {x.shape}")
    if order is None:
        return _cpu().stream_sum(np.ascontiguousarray(x))
    order = np.asarray(order)
    if order.ndim != 1 or (order.size and not np.issubdtype(order.dtype, np.integer)):
        raise TypeError(f"order must be a 1-D list of row numbers, got dtype {order.dtype} with "
                        f"shape {order.shape}")
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension to take rows of, got a 0-d array")
    x = np.ascontiguousarray(x)
    if order.size and (order.min() < 0 or order.max() >= x.shape[0]):
        raise ValueError(f"order must hold rows of x, 0 to {x.shape[0] - 1} (x has shape "
                         f"{x.shape}), got entries from {order.min()} to {order.max()}")
    return _cpu().stream_sum_rows(x, np.ascontiguousarray(order, dtype=np.int32))


def adamw_step(p, g, m, v, shrink, scalars, threads: int = 1) -> None:
    r"""One AdamW step (catalogue O4) in place on flat buffers, in one pass over memory.

    .. math::
        m \leftarrow \beta_1 m + (1-\beta_1)\, g,\qquad
        v \leftarrow \beta_2 v + (1-\beta_2)\,(g \odot g),\qquad
        p \leftarrow \sigma_k\, p - \frac{\eta\,\big(m / (1-\beta_1^s)\big)}
            {\sqrt{v / (1-\beta_2^s)} + \epsilon}

    ``p``, ``m``, ``v``: 1-D contiguous float32 or float64 arrays of one length, updated in place.
    ``g``: a list of 1-D contiguous arrays of that dtype, laid end to end over ``p`` (their lengths
    add up to ``p``'s), each read where it lies; piece ``k`` is decayed by ``shrink[k]``, its
    :math:`\sigma_k = 1 - \eta\lambda_k` (1 for no decay). ``scalars``:
    :math:`(\beta_1, 1-\beta_1, \beta_2, 1-\beta_2, 1-\beta_1^s, 1-\beta_2^s, \eta, \epsilon)`.
    Every scalar is rounded to the arrays' dtype once, and every operation is done in that dtype in
    the order of :class:`refmath.fast.flat_adamw.FlatAdamW`'s NumPy form, each result rounded: the
    arrays come out bit for bit as that form (and :class:`refmath.optim.AdamW`) leaves them.
    ``threads`` (1 to 256) OpenMP threads share the elements. The arrays must not share memory.
    The C++ side checks every argument (dtype, rank, layout, lengths, overlap) and raises
    ``TypeError``/``ValueError`` naming it; nothing is copied, since ``p``, ``m`` and ``v`` are
    written in place.
    """
    g = [g] if isinstance(g, np.ndarray) else list(g)
    _cpu().adamw_step(p, g, m, v, [float(x) for x in shrink], [float(x) for x in scalars],
                      check_int("threads", threads, 1, 256))


def rows_matmul(x, w, out=None):
    r"""``x @ w`` for a few float32 rows, the weight read once by all the kernels' threads (N5).

    .. math::
        y_{rj} = \sum_{i=0}^{k-1} x_{ri}\, w_{ij}

    A decode step at batch 1 multiplies one row by every weight matrix: two FLOPs per weight read,
    so its time is the time to stream the weights. This kernel streams them on the threads of the
    decode kernels, so that a step's products and its attention share one team of threads
    (:func:`refmath.fast.products.kernel_products`): in the decode layout (``w`` the transpose of
    ``(n, k)`` rows) the team of :func:`cpu_last_usable_threads`, otherwise OpenMP's. ``x``: ``(m, k)`` float32, ``m`` a few rows
    (any ``m`` gives the product; the kernel is made for a decode step's one to four). ``w``:
    float32 ``(k, n)``, C-contiguous, or the transpose of a C-contiguous ``(n, k)`` array (a tied
    head's ``embedding.T``), read where it lies; any other layout is copied first. ``out``: an optional C-contiguous float32 ``(m, n)`` array to write. Returns
    ``(m, n)`` float32. Each output is a float32 sum over ``k`` with vector accumulators; with
    several threads a ``(k, n)`` matrix's rows are cut into one stretch per thread and the partial
    sums added in thread order, so the last bits can change with the thread count.
    """
    return rows_matmul_many(x, [w], None if out is None else [out])[0]


def rows_matmul_many(x, ws, outs=None) -> list:
    """``[x @ w for w in ws]`` in one call of :func:`rows_matmul`'s kernel: the threads stream
    every matrix in turn without waking and parting between them (a layer's query, key and value
    projections, or a gated FFN's two input matrices). ``outs``: optional output arrays, one per
    matrix. Returns the list of ``(m, n_j)`` float32 products."""
    x = np.ascontiguousarray(x)
    matrices, transposed = [], []
    for j, w in enumerate(ws):
        w = np.asarray(w)
        if x.dtype != np.float32 or w.dtype != np.float32:
            raise TypeError(f"rows_matmul takes float32 x and w, got x {x.dtype} {x.shape} and "
                            f"w[{j}] {w.dtype} {w.shape}")
        if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
            raise ValueError(f"rows_matmul needs x (m, k) and w (k, n), got x.shape = {x.shape} "
                             f"and w[{j}].shape = {w.shape}")
        if w.flags.c_contiguous:
            matrices.append(w)
            transposed.append(False)
        elif w.T.flags.c_contiguous:  # (n, k) read row by row: a dot product per output
            matrices.append(w.T)
            transposed.append(True)
        else:
            matrices.append(np.ascontiguousarray(w))
            transposed.append(False)
    if outs is None:
        outs = [np.empty((x.shape[0], w.shape[0 if t else 1]), np.float32)
                for w, t in zip(matrices, transposed)]
    _cpu().rows_matmul(x, matrices, transposed, list(outs))
    return list(outs)



def format_rows_matmul(x, w, fmt: str, out=None):
    r"""``x @ dequantize(w, fmt).T`` for a few float32 rows and weights stored in fewer bytes
    (catalogue W1, W2; :mod:`refmath.weight_formats` has the formats and the NumPy reference).

    .. math::
        y_{rj} = \sum_{i=0}^{k-1} x_{ri}\, \tilde w_{ji}

    ``x``: ``(m, k)`` float32 (copied if not C-contiguous). ``w``: the ``(n, k)`` matrix, one row
    per output, stored as ``fmt``: ``"bf16"`` (``uint16`` bit patterns, ``(n, k)``), ``"f16"``
    (``float16``, ``(n, k)``) or ``"q8_0"`` (:data:`refmath.weight_formats.Q8_0_BLOCK` blocks,
    ``(n, k / 32)``), C-contiguous (a weight matrix is never copied here: a strided one is refused).
    ``out``: an optional C-contiguous float32 ``(m, n)`` array to write. Returns ``(m, n)`` float32.
    Each weight is restored exactly to its float32 value (a Q8_0 block's 32 codes are multiplied by
    x first and their sum by the block's scale, :math:`d \sum_i q_i x_i`, as llama.cpp does) and
    every sum is float32 in one thread; each term passes through fewer than :math:`k`
    roundings, so the error is at most :math:`\gamma_k |x|\,|\tilde W|^\top`
    (:func:`refmath.weight_formats.product_error_bound`) and does not depend on the thread count.
    """
    from refmath.weight_formats import BLOCK, FORMATS, STORED_DTYPES

    check_choice("fmt", fmt, FORMATS)
    x = np.asarray(x)
    if x.dtype.type is not np.float32:
        raise TypeError(f"x must be float32 (the product is summed in float32), got dtype "
                        f"{x.dtype} with shape {x.shape}")
    check_ndim("x", x, 2, "(m, k)")
    w = np.asarray(w)
    if w.dtype != STORED_DTYPES[fmt]:
        raise TypeError(f"w in format {fmt!r} must have dtype {STORED_DTYPES[fmt]}, got dtype "
                        f"{w.dtype} with shape {w.shape}")
    check_ndim("w", w, 2, "(n, k / 32) blocks" if fmt == "q8_0" else "(n, k)")
    if not (w.flags.c_contiguous and w.flags.aligned):
        raise ValueError(f"w must be C-contiguous (a weight matrix is not copied for a product), "
                         f"got a strided view of shape {w.shape}; use np.ascontiguousarray once")
    per_row = w.shape[1] * (BLOCK if fmt == "q8_0" else 1)
    if x.shape[1] != per_row:
        raise ValueError(f"x.shape = {x.shape} does not fit w of shape {w.shape} in format "
                         f"{fmt!r}: its rows hold {per_row} weights")
    x = np.require(x, np.float32, ["C_CONTIGUOUS", "ALIGNED"])
    if out is None:
        out = np.empty((x.shape[0], w.shape[0]), np.float32)
    _cpu().format_rows_matmul(x, w, fmt, out)
    return out


# The norm and FFN kinds the compiled decode layer computes, in refmath's one vocabulary
# (refmath.norms.NORM_KINDS, refmath.ffn.FFN_KINDS), and the binding's names for them
# (csrc/bindings.cpp): translated here, once, so that no caller spells a kind the kernel's way.
DECODE_LAYER_NORMS = {"rmsnorm": "rms", "layernorm": "layer"}
DECODE_LAYER_FFNS = {"swiglu": "swiglu", "gelu_tanh": "gelu_tanh", "gelu": "gelu_exact"}


def decode_layers(batch: int, layers: list, *, d_model: int, heads: int, kv_heads: int,
                  head_dim: int, d_ff: int, norm: str, eps: float, ffn: str, rope: str,
                  scale: float, weights: str = "f32"):
    r"""Every layer of a decode step as one compiled object (K2, K3; used by
    :mod:`refmath.inference.compiled_step`, which builds its arguments from a model).

    Each entry of ``layers`` is a dict of one layer's float32 arrays: ``norm1_gain``,
    ``norm2_gain`` (and ``norm1_shift``, ``norm2_shift`` for ``norm="layernorm"``); ``w_q``,
    ``w_k``, ``w_v``, ``w_o`` as ``(in, out)`` matrices (C-contiguous, or in
    :func:`refmath.inference.weight_layout.decode_layout`), optional ``b_q``, ``b_k``, ``b_v``,
    ``b_o``; ``w_gate`` (``ffn="swiglu"`` only), ``w_up``, ``w_down`` and optional ``b_up``,
    ``b_down``; and the layer's cache blocks ``keys``, ``values`` ``(batch, kv_heads, T_max,
    head_dim)``, written in place. ``norm``: ``"rmsnorm"`` or ``"layernorm"``; ``ffn``:
    ``"swiglu"``, ``"gelu_tanh"`` or ``"gelu"`` (exact), the names of
    :data:`refmath.norms.NORM_KINDS` and :data:`refmath.ffn.FFN_KINDS`; ``rope``: ``"none"``,
    ``"interleaved"`` or ``"half"``.
    Every array is checked here, once; the object's ``step(x, position, cos, sin)`` then runs
    ``x`` ``(batch, d_model)`` through every layer in place, its key and value stored at row
    ``position``, with RoPE's ``cos`` and ``sin`` ``(head_dim / 2,)`` at that position. Raises
    ``ValueError``/``TypeError`` naming the array on a wrong shape, dtype or layout.

    ``weights``: ``"f32"``, or ``"bf16"``, ``"f16"``, ``"q8_0"`` for layers whose seven matrices
    are stored in that format as the rows of :math:`W^\top` (``quantize(W.T, weights)`` of
    :mod:`refmath.weight_formats`), multiplied by :func:`format_rows_matmul`'s kernel (W1, W2).
    """
    check_choice("weights", weights, ("f32", "bf16", "f16", "q8_0"))
    norm = DECODE_LAYER_NORMS[check_choice("norm", norm, tuple(DECODE_LAYER_NORMS))]
    ffn = DECODE_LAYER_FFNS[check_choice("ffn", ffn, tuple(DECODE_LAYER_FFNS))]
    return _cpu().DecodeLayers(batch=batch, d_model=d_model, heads=heads, kv_heads=kv_heads,
                               head_dim=head_dim, d_ff=d_ff, norm=norm, eps=eps, ffn=ffn,
                               rope=rope, scale=scale, layers=layers, weights=weights)

def build_info() -> dict:
    """What was compiled and what it can use: OpenMP and how its idle threads wait, the CPU
    kernels' vector width, the CUDA module, the devices present."""
    info = dict(BUILD_INFO or {})
    info.update(cpu_module=cpu_available(), openmp_wait=OPENMP_WAIT,
                cpu_vector_lanes=cpu_vector_lanes() if cpu_available() else None,
                cpu_instructions=cpu_instructions() if cpu_available() else None,
                cuda_module=_cuda is not None,
                cuda_devices=_device_query()[0], cuda_summary=cuda_build_info())
    return info


def cuda_build_info() -> str:
    """One line: was the CUDA module built, and if so does it see a device; if not, why not."""
    if _cuda is not None:
        count, status = _device_query()
        arch = (BUILD_INFO or {}).get("cuda_arch")
        where = f" for arch {arch}" if arch else ""
        devices = f"{count} CUDA device(s)" if count else f"no usable CUDA device ({status})"
        return f"refmath._cuda is built{where}; {devices}"
    if BUILD_INFO and BUILD_INFO.get("cuda_built"):
        return f"refmath._cuda was built but does not import: {_CUDA_ERROR}"
    if BUILD_INFO:
        return f"refmath._cuda was not built: {BUILD_INFO.get('cuda_reason') or 'unknown reason'}"
    return "refmath._cuda was not built (no build record: reinstall with pip install -v -e . to see why)"


def _cpu():
    if _C is None:
        raise ImportError(
            "refmath was installed without its compiled extension (refmath._C); "
            "run pip install -e . in the repository"
        ) from _C_ERROR
    return _C


def _gpu():
    if _cuda is None:
        raise ImportError(f"cannot run a kernel on a GPU array: {cuda_build_info()}")
    return _cuda


# ---- kernels ----

def softmax_rows(x):
    """Softmax over the last axis of a 2-D float32/float64 array (catalogue A2, A11).

    The same function as ``refmath.softmax.softmax_forward`` on a ``(rows, cols)`` array, run by
    the C++ module for a NumPy array and by the CUDA module for a CuPy array; returns a new array
    of the same kind, shape and dtype. Fully masked rows (all ``-inf``) give zeros. A
    non-contiguous input is copied to a contiguous one first.
    """
    if hasattr(x, "__cuda_array_interface__"):
        return _softmax_rows_cuda(x)
    x = float_array("x", x)
    _check_kernel_dtype("x", x)
    check_ndim("x", x, 2, "(rows, cols)")
    # Native byte order, C order, aligned: the layout the C++ loop indexes directly.
    x = np.require(x, np.dtype(x.dtype.type), ["C_CONTIGUOUS", "ALIGNED"])
    return _cpu().softmax_rows(x)


def _check_kernel_dtype(name, x):
    if x.dtype.type not in _KERNEL_DTYPES:  # by type, so a byte-swapped float64 passes
        raise TypeError(
            f"{name} must be float32 or float64 for the compiled kernels, "
            f"got dtype {x.dtype} with shape {x.shape}"
        )


def _cupy():
    try:
        import cupy
    except ImportError as err:
        raise ImportError("GPU arrays need CuPy: pip install 'refmath[cuda]'") from err
    return cupy


def _softmax_rows_cuda(x):
    cp = _cupy()
    x = cp.asarray(x)  # a CuPy view of any __cuda_array_interface__ object, no copy
    _check_kernel_dtype("x", x)
    check_ndim("x", x, 2, "(rows, cols)")
    module = _gpu()
    with x.device:  # launch on the GPU that holds x
        x = cp.ascontiguousarray(x)
        out = cp.empty_like(x)
        module.softmax_rows(
            x.__cuda_array_interface__["data"][0],
            out.__cuda_array_interface__["data"][0],
            x.shape[0],
            x.shape[1],
            module.FLOAT32 if x.dtype == np.float32 else module.FLOAT64,
            cp.cuda.get_current_stream().ptr,
        )
    return out


# ---- attention and decode (catalogue F1-F5, A10, A12, K10) ----
#
# One set of checks serves both kinds of array; only the dtypes differ. The CPU kernels take float32
# (and accumulate in float32); on a GPU the arrays may be float32, float16 or bfloat16, as each CUDA
# version supports. Arrays that are not C-contiguous (slices, transposes, other byte orders) are
# copied into C order, not rejected: the kernels index raw buffers. Lengths and page tables are
# checked on the host (a small copy for GPU arrays), so that no id a kernel reads is out of range.

_GPU_FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def flash_attention_forward(q, k, v, causal: bool = False, window: int | None = None,
                            scale: float | None = None, version: str | None = None,
                            softcap: float | None = None):
    r"""Exact attention by tiles with an online softmax (catalogue F1-F5, A10, A12): ``(o, lse)``.

    .. math::
        o = \operatorname{softmax}(\tau\, q k^\top + M)\, v,\qquad
        \mathrm{lse}_i = \log \sum_j e^{\tau\, q_i \cdot k_j + M_{ij}}

    ``q`` is ``(B, H, T_q, D)``, ``k`` and ``v`` are ``(B, G, T_k, D)`` with ``G`` dividing ``H``
    (query head ``r`` reads key/value head ``r // (H // G)``). Queries are aligned to the end of the
    keys: query ``i`` sits at key position ``p_i = i + T_k - T_q``. ``causal`` keeps keys
    ``j <= p_i``; ``window = w`` keeps ``p_i - w + 1 <= j <= p_i`` (and implies causal). ``tau`` is
    ``scale``, :math:`1/\sqrt{D}` by default. A row with no visible key gives ``o = 0`` and
    ``lse = -inf``. The reference is :func:`refmath.flash.flash_attention_forward`.

    NumPy arrays (float32) run on the CPU kernel; CuPy arrays on the CUDA kernel named by
    ``version`` (see :func:`flash_versions`; ``None`` picks the default). The CPU has one kernel,
    so a ``version`` given with NumPy arrays is refused rather than ignored. Returns ``o`` like ``q`` and ``lse`` ``(B, H, T_q)`` float32, as the same kind of array.
    A ``softcap`` is refused: the kernels do not cap scores (the reference does).
    """
    gpu = _on_gpu(q=q, k=k, v=v)
    _refuse_softcap(softcap, gpu)
    q, k, v = _float_inputs(gpu, q=q, k=k, v=v)
    _check_attention_shapes(q, k, v)
    causal, window, scale = _attention_options(causal, window, scale, q.shape[-1])
    if version is not None and not isinstance(version, str):
        raise TypeError(f"version must be a version name such as 'v2' or None, got {version!r}")
    if gpu:
        return _cuda_flash_forward(q, k, v, causal, window, scale, version)
    if version is not None:
        raise ValueError(f"version={version!r} picks one of the CUDA kernels, for CuPy arrays; "
                         f"NumPy arrays run on the CPU's one kernel: leave version out")
    return _cpu().flash_forward(q, k, v, causal, window or 0, scale)


def flash_attention_backward(do, q, k, v, o, lse, causal: bool = False, window: int | None = None,
                             scale: float | None = None, softcap: float | None = None):
    r"""Gradients of :func:`flash_attention_forward`, FlashAttention-2 style: ``(dq, dk, dv)``
    (catalogue F4, A8).

    With :math:`P = e^{\tau q k^\top + M - \mathrm{lse}}` recomputed tile by tile from the saved
    logsumexp and :math:`\delta_i = dO_i \cdot O_i`:

    .. math::
        dV = P^\top dO,\quad dS = P \odot (dO\, V^\top - \delta),\quad
        dQ = \tau\, dS\, K,\quad dK = \tau\, dS^\top Q

    with each key/value head receiving the sum over the query heads that read it (GQA). ``do`` and
    ``o`` are ``(B, H, T_q, D)``, ``lse`` ``(B, H, T_q)`` (float32 also for half-precision GPU
    inputs), the rest and the options as given to the forward. The reference is
    :func:`refmath.flash.flash_attention_backward`. A ``softcap`` is refused, as in the forward.
    """
    gpu = _on_gpu(do=do, q=q, k=k, v=v, o=o, lse=lse)
    _refuse_softcap(softcap, gpu)
    do, q, k, v, o = _float_inputs(gpu, do=do, q=q, k=k, v=v, o=o)
    (lse,) = _float_inputs(gpu, float32_only=True, lse=lse)
    _check_attention_shapes(q, k, v)
    check_same_shape("q", q, "do", do)
    check_same_shape("q", q, "o", o)
    check_ndim("lse", lse, 3, "(B, H, T_q)")
    if lse.shape != q.shape[:3]:
        raise ValueError(f"lse must have shape (B, H, T_q) = {q.shape[:3]} from q.shape = {q.shape}, "
                         f"got lse.shape = {lse.shape}")
    causal, window, scale = _attention_options(causal, window, scale, q.shape[-1])
    if gpu:
        return _cuda_flash_backward(do, q, k, v, o, lse, causal, window, scale)
    return _cpu().flash_backward(do, q, k, v, o, lse, causal, window or 0, scale)


def decode(q, k_cache, v_cache, lengths, scale: float | None = None, splits: int | None = None,
           softcap: float | None = None):
    r"""One decode step over contiguous caches: each sequence's query attends to its cached keys
    (catalogue A10, F3).

    .. math::
        o_{b,r} = \operatorname{softmax}\big(\tau\, q_{b,r} K_{b,\pi(r)}[{:}L_b]^\top\big)\,
        V_{b,\pi(r)}[{:}L_b]

    ``q`` is ``(B, H, D)``, the caches ``(B, G, T_max, D)`` with ``G`` dividing ``H`` and ``pi``
    the GQA head map; ``lengths`` holds ``B`` integers in ``[0, T_max]`` (a length of 0 gives
    ``o = 0``). Slots past a sequence's length are never read, whatever they hold. ``splits`` cuts
    each context into that many chunks reduced in parallel and merged by the online-softmax rule
    (F3), so that one long sequence keeps every core busy; ``None`` chooses (on the CPU: enough
    chunks for eight per thread, none shorter than 512 keys). The CPU kernel uses at most as many
    splits as the longest sequence has keys (pages, for :func:`paged_decode`), and at most 1024;
    the result does not depend on the count beyond rounding. Returns ``(B, H, D)``.
    On the GPU, ``lengths`` given as a CuPy array are checked by the kernel rather than copied back
    (see :func:`paged_decode`): a length outside ``[0, T_max]`` gives that sequence NaN rows.
    The reference is :func:`refmath.attention.sdpa_forward` over each sequence's first ``L_b`` keys.
    A ``softcap`` is refused: the kernels do not cap scores (the reference does).
    """
    gpu = _on_gpu(q=q, k_cache=k_cache, v_cache=v_cache)
    _refuse_softcap(softcap, gpu)
    q, k_cache, v_cache = _float_inputs(gpu, q=q, k_cache=k_cache, v_cache=v_cache)
    _check_decode_query(q)
    check_ndim("k_cache", k_cache, 4, "(B, G, T_max, D)")
    check_same_shape("k_cache", k_cache, "v_cache", v_cache)
    check_axis("k_cache", k_cache, 0, q.shape[0], f"the batch size B of q.shape = {q.shape}")
    check_axis("k_cache", k_cache, 3, q.shape[2], f"the head width D of q.shape = {q.shape}")
    _check_groups(q.shape[1], k_cache.shape[1], q, "k_cache", k_cache)
    t_max = k_cache.shape[2]
    why = f"T_max = {t_max} of k_cache.shape = {k_cache.shape}"
    scale = _scale(scale, q.shape[-1])
    splits = _splits(splits)
    if gpu and _is_device_array(lengths):
        # Checked by the kernel, not here: copying them back would synchronise every decode step.
        _check_device_ints("lengths", lengths, 1, "(B,)", q.shape[0])
    else:
        lengths = _host_lengths(lengths, q.shape[0], t_max, why)
    if gpu:
        cp = _cupy()
        with q.device:
            return _cuda_decode(q, k_cache, v_cache, _device_int32(cp, lengths), scale, splits)
    return _cpu().decode(q, k_cache, v_cache, lengths, scale, splits or 0)


def paged_decode(q, k_pages, v_pages, page_table, lengths, scale: float | None = None,
                 splits: int | None = None, softcap: float | None = None):
    r"""One decode step over a paged cache (catalogue K10, A10, F3): :func:`decode` with each
    sequence's keys and values found through its page table.

    ``k_pages`` and ``v_pages`` are the pool of :class:`refmath.inference.paged.PagedKVCache`,
    ``(n_pages, G, p, D)``; ``page_table`` is ``(B, max_pages)``, row ``b`` the physical pages of
    sequence ``b`` in logical order, padded with -1 (``PagedKVCache.page_table_array`` makes it);
    token ``j`` of sequence ``b`` is slot ``j % p`` of page ``page_table[b, j // p]``. Every entry a
    length needs must lie in ``[0, n_pages)``; pages may be shared between sequences, and only the
    filled slots of a page are read. ``q``, ``lengths``, ``scale``, ``splits`` and the result are as
    in :func:`decode` (the splits cut the page list). The reference is
    :func:`refmath.inference.paged.paged_decode`.

    On the GPU, a ``page_table`` and ``lengths`` that are both CuPy arrays are not copied back to be
    checked (that would synchronise every decode step): the kernel checks each entry it reads, and a
    sequence with a page id outside ``[0, n_pages)`` or a length outside
    ``[0, max_pages * page_size]`` gets NaN output rows. NumPy tables and lengths are checked here
    first, as on the CPU, with a ``ValueError`` naming the entry. A ``softcap`` is refused, as in
    :func:`decode`.
    """
    gpu = _on_gpu(q=q, k_pages=k_pages, v_pages=v_pages)
    _refuse_softcap(softcap, gpu)
    q, k_pages, v_pages = _float_inputs(gpu, q=q, k_pages=k_pages, v_pages=v_pages)
    _check_decode_query(q)
    check_ndim("k_pages", k_pages, 4, "(n_pages, G, page_size, D)")
    check_same_shape("k_pages", k_pages, "v_pages", v_pages)
    check_axis("k_pages", k_pages, 3, q.shape[2], f"the head width D of q.shape = {q.shape}")
    _check_groups(q.shape[1], k_pages.shape[1], q, "k_pages", k_pages)
    n_pages, page_size = k_pages.shape[0], k_pages.shape[2]
    if page_size < 1:
        raise ValueError(f"k_pages must have pages of at least one slot, got k_pages.shape = {k_pages.shape}")
    if n_pages > np.iinfo(np.int32).max:
        raise ValueError(f"the kernels address at most 2**31 - 1 pages, got {n_pages}")
    scale = _scale(scale, q.shape[-1])
    splits = _splits(splits)
    if gpu and _is_device_array(page_table) and _is_device_array(lengths):
        # A serving loop calls this every step with its tables already on the GPU: they are checked
        # by the kernel as it reads them (a bad page id or length gives that sequence NaN), since
        # checking them here would copy them back and synchronise every call.
        _check_device_ints("page_table", page_table, 2, "(B, max_pages)", q.shape[0])
        _check_device_ints("lengths", lengths, 1, "(B,)", q.shape[0])
        cp = _cupy()
        with q.device:
            return _cuda_paged_decode(q, k_pages, v_pages, _device_int32(cp, page_table),
                                      _device_int32(cp, lengths), scale, splits)
    table = _host_ints("page_table", page_table)
    check_ndim("page_table", table, 2, "(B, max_pages)")
    check_axis("page_table", table, 0, q.shape[0], f"the batch size B of q.shape = {q.shape}")
    max_pages = table.shape[1]
    lengths = _host_lengths(lengths, q.shape[0], max_pages * page_size,
                            f"max_pages * page_size = {max_pages} * {page_size} of page_table.shape = "
                            f"{table.shape} and k_pages.shape = {k_pages.shape}")
    # The entries each length needs: logical pages 0 .. ceil(L / p) - 1 of its row.
    needed = np.arange(max_pages)[None, :] < -(-lengths // page_size)[:, None]
    bad = needed & ((table < 0) | (table >= n_pages))
    if bad.any():
        b, i = np.argwhere(bad)[0]
        raise ValueError(
            f"page_table[{b}, {i}] = {table[b, i]} is not a page id in [0, n_pages = {n_pages}), but "
            f"sequence {b} of length {lengths[b]} reads it (page_table.shape = {table.shape})")
    table = np.where(needed, table, -1).astype(np.int32)  # unneeded entries may hold anything
    if gpu:
        cp = _cupy()
        with q.device:
            return _cuda_paged_decode(q, k_pages, v_pages, cp.asarray(table), cp.asarray(lengths),
                                      scale, splits)
    return _cpu().paged_decode(q, k_pages, v_pages, table, lengths, scale, splits or 0)


class FlashRung(NamedTuple):
    """One rung of the CUDA FlashAttention forward ladder, as its table in
    ``csrc/cuda/flash_ladder.h`` gives it (through ``refmath._cuda.flash_versions()``).

    ``name`` (``"v1"``: the file ``csrc/cuda/flash_v1.cu``, run with ``version="v1"``); ``adds``,
    what it adds to the rung before, in a line; ``dtypes``, the GPU dtypes it takes;
    ``head_dims``, the head widths its kernel is compiled for, and ``pads_head_dim``, whether any
    ``D`` up to the widest runs (on the next width up) or only those widths; ``compute_capability``,
    the major version it needs (0: any); ``alignment``, the bytes that ``q``, ``k``, ``v`` and
    ``o`` must be aligned to; ``tensor_cores``, whether its products run on the tensor cores;
    ``default``, whether ``version=None`` may choose it (the newest such rung that takes the input).
    """

    name: str
    adds: str
    dtypes: tuple[str, ...]
    head_dims: tuple[int, ...]
    pads_head_dim: bool
    compute_capability: int
    alignment: int
    tensor_cores: bool
    default: bool

    def takes_head_dim(self, d: int) -> bool:
        """Whether this rung runs inputs of head width ``d``."""
        return d in self.head_dims or (self.pads_head_dim and 1 <= d <= max(self.head_dims))


def flash_ladder() -> tuple[FlashRung, ...]:
    """The rungs of the CUDA FlashAttention forward ladder built into ``refmath._cuda``, oldest
    first (see :class:`FlashRung`); empty without the CUDA module.

    The list lives in one place, the table in ``csrc/cuda/flash_ladder.h``, and is read from the
    module. Without it there is deliberately no copy here: a version can be run, and a version
    name is checked, only on the GPU path, which needs the module (a GPU array without it fails
    first, with an ImportError that says why it was not built); on the CPU ``version`` is ignored.
    A Python copy of the names would be the second list that drifts from the C++ one, and would
    list as available rungs that this install cannot run."""
    return _flash_ladder()


@functools.cache
def _flash_ladder() -> tuple[FlashRung, ...]:
    # Read once: the table is compiled into the module, and the GPU path consults it every call.
    return () if _cuda is None else tuple(FlashRung(**rung) for rung in _cuda.flash_versions())


def flash_versions() -> tuple[str, ...]:
    """The names of the CUDA FlashAttention versions built into ``refmath._cuda``, oldest first
    (for example ``("v1", "v2", "v3", "v4")``; :func:`flash_ladder` gives what each takes and adds);
    empty without the CUDA module. The CPU has one kernel and no versions."""
    return tuple(rung.name for rung in flash_ladder())


def _on_gpu(**arrays) -> bool:
    """True for CuPy arrays, False for host arrays; a mixture is a TypeError naming both sides."""
    on_gpu = {name: hasattr(x, "__cuda_array_interface__") for name, x in arrays.items()}
    if len(set(on_gpu.values())) > 1:
        gpu = [n for n, g in on_gpu.items() if g]
        host = [n for n, g in on_gpu.items() if not g]
        raise TypeError(f"{', '.join(gpu)} are GPU arrays but {', '.join(host)} are not: pass them "
                        f"all as CuPy arrays or all as NumPy arrays")
    return any(on_gpu.values())


def _float_inputs(gpu: bool, float32_only: bool = False, **arrays):
    """The arrays, checked for dtype and made C-contiguous, in the order given."""
    if gpu:
        cp = _cupy()
        out = {n: cp.asarray(x) for n, x in arrays.items()}
        allowed = ("float32",) if float32_only else _GPU_FLOAT_DTYPES
        for n, x in out.items():
            if str(x.dtype) not in allowed:
                raise TypeError(f"{n} must be {' or '.join(allowed)} on the GPU, got dtype {x.dtype} "
                                f"with shape {x.shape}")
        if len({str(x.dtype) for x in out.values()}) > 1:
            found = ", ".join(f"{n}: {x.dtype}" for n, x in out.items())
            raise TypeError(f"{', '.join(out)} must share one dtype, got {found}")
        with next(iter(out.values())).device:
            return tuple(cp.ascontiguousarray(x) for x in out.values())
    checked = []
    for n, x in arrays.items():
        if (type(x) is np.ndarray and x.dtype == np.float32 and x.flags.c_contiguous
                and x.flags.aligned):
            checked.append(x)  # already the kernels' layout: the usual case, with nothing to do
            continue
        x = float_array(n, x)
        if x.dtype.type is not np.float32:  # by type, so that a byte-swapped float32 passes
            raise TypeError(f"{n} must be float32 for the CPU kernels (they compute in float32), got "
                            f"dtype {x.dtype} with shape {x.shape}; convert with .astype(np.float32)")
        checked.append(np.require(x, np.float32, ["C_CONTIGUOUS", "ALIGNED"]))
    return tuple(checked)


def _check_groups(h: int, g: int, q, kv_name: str, kv) -> None:
    if g == 0 or h % g:
        raise ValueError(f"the key/value heads G = {g} ({kv_name}.shape = {kv.shape}) must divide the "
                         f"query heads H = {h} (q.shape = {q.shape})")


def _check_attention_shapes(q, k, v) -> None:
    check_ndim("q", q, 4, "(B, H, T_q, D)")
    check_ndim("k", k, 4, "(B, G, T_k, D)")
    check_same_shape("k", k, "v", v)
    check_axis("k", k, 0, q.shape[0], f"the batch size B of q.shape = {q.shape}")
    check_axis("k", k, 3, q.shape[3], f"the head width D of q.shape = {q.shape}")
    _check_groups(q.shape[1], k.shape[1], q, "k", k)


def _check_decode_query(q) -> None:
    check_ndim("q", q, 3, "(B, H, D)")


def _scale(scale, d: int) -> float:
    if d < 1:
        raise ValueError(f"the head width D must be at least 1, got D = {d}")
    return 1.0 / math.sqrt(d) if scale is None else check_real("scale", scale)


def _attention_options(causal, window, scale, d: int):
    """``(causal, window, scale)`` checked: a window implies causal (A12); scale defaults to 1/sqrt(D)."""
    causal = check_flag("causal", causal)
    if window is not None:
        window = check_int("window", window, 1)
    return causal or window is not None, window, _scale(scale, d)


def _refuse_softcap(softcap, gpu: bool) -> None:
    """The compiled kernels have no logit soft-capping (catalogue N19): a cap is refused rather than
    ignored, since ignoring it would give other numbers than the reference without a word."""
    if softcap is not None:
        backend = "cuda" if gpu else "cpu"
        raise ValueError(f"softcap = {softcap!r} is not supported on backend={backend!r} (the "
                         f"compiled kernels do not cap scores); use backend='numpy'")


def _splits(splits) -> int | None:
    return None if splits is None else check_int("splits", splits, 1)


_INT32_MAX = int(np.iinfo(np.int32).max)


def _host_ints(name: str, x) -> np.ndarray:
    """An integer array in host memory (GPU arrays are copied: they are small)."""
    if hasattr(x, "__cuda_array_interface__"):
        x = _cupy().asnumpy(x)
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {x.dtype} with shape {x.shape}")
    return x


def _is_device_array(x) -> bool:
    return hasattr(x, "__cuda_array_interface__")


def _check_device_ints(name: str, x, ndim: int, layout: str, batch: int) -> None:
    """The checks of a GPU integer array that need no copy to the host: dtype, rank, batch size."""
    if not np.issubdtype(np.dtype(x.dtype), np.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {x.dtype} with shape {x.shape}")
    check_ndim(name, x, ndim, layout)
    check_axis(name, x, 0, batch, "the batch size B of q")


def _device_int32(cp, x):
    """int32 on the device, as the CUDA kernels read it. Values beyond int32 are clipped, not
    wrapped, so that an out-of-range entry stays out of range and the kernel refuses it."""
    x = cp.asarray(x)
    if x.dtype != cp.int32:
        info = np.iinfo(np.int32)
        x = cp.clip(x, info.min, info.max).astype(cp.int32)
    return cp.ascontiguousarray(x)


def _host_lengths(lengths, batch: int, most: int, why: str) -> np.ndarray:
    lengths = _host_ints("lengths", lengths)
    check_ndim("lengths", lengths, 1, "(B,)")
    check_axis("lengths", lengths, 0, batch, "the batch size B of q")
    low, high = (int(lengths.min()), int(lengths.max())) if lengths.size else (0, 0)
    if low < 0 or high > most:
        b = int(np.argmax((lengths < 0) | (lengths > most)))
        raise ValueError(f"lengths must lie in [0, {most}] ({why}), got lengths[{b}] = {lengths[b]}")
    # Every compiled kernel reads lengths as int32 (like the page table): narrow once, here.
    top = _INT32_MAX
    if high > top:
        b = int(np.argmax(lengths > top))
        raise ValueError(f"lengths must fit in int32 (at most {top}) for the compiled kernels, got "
                         f"lengths[{b}] = {lengths[b]} (lengths.shape = {lengths.shape})")
    return np.ascontiguousarray(lengths, dtype=np.int32)


# ---- CUDA dispatch for attention and decode ----
# The public functions above validate every argument, then hand CuPy arrays to the helpers below.
#
# The kernels are in csrc/cuda/: the forward as a ladder of versions, each a file flash_<name>.cu
# that says what it changes and why it is faster, all listed in one table, flash_ladder.h (what
# each takes, needs and adds; flash_ladder() reads it), and bound as one
# flash_forward(version, ...); flash_backward.cu and paged_decode.cu (split-K plus a merge kernel). Each helper allocates its outputs and workspace with CuPy on the inputs' device
# and queues the kernels on CuPy's current stream; the launchers check the arguments again and a
# refusal or a failed launch comes back as a RuntimeError.

_CUDA_MAX_HEAD_DIM = 256  # the backward and decode: any D up to this
_DECODE_HEADS_PER_BLOCK = 8  # query heads of one GQA group that a decode block serves (paged_decode.cu)
_DECODE_BLOCKS_PER_SM = 10  # the automatic split count aims at this many decode blocks per multiprocessor


def _dtype_code(module, x) -> int:
    return {"float32": module.FLOAT32, "float16": module.FLOAT16, "bfloat16": module.BFLOAT16}[str(x.dtype)]


def _stream(cp) -> int:
    return cp.cuda.get_current_stream().ptr


def _or(names) -> str:
    """"a", "a or b", "a, b or c"."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _refusal(rung: FlashRung, q) -> Exception | None:
    """Why ``rung`` cannot take ``q`` (its dtype or head width), or None: the launcher's own checks
    (csrc/cuda/flash_forward.cuh), made here with the array's shape in the message."""
    d, dtype = q.shape[-1], str(q.dtype)
    if dtype not in rung.dtypes:
        others = [f"{r.name!r}" for r in flash_ladder() if dtype in r.dtypes]
        what = " (tensor cores)" if rung.tensor_cores else ""
        return TypeError(f"version {rung.name!r}{what} takes {_or(rung.dtypes)} inputs, got dtype "
                         f"{dtype} with q.shape = {q.shape}" +
                         (f"; use {_or(others)} for {dtype}" if others else ""))
    if not rung.takes_head_dim(d):
        others = [f"{r.name!r}" for r in flash_ladder() if r.takes_head_dim(d) and dtype in r.dtypes]
        widths = (f"head widths up to D = {max(rung.head_dims)}" if rung.pads_head_dim else
                  f"the head widths D = {' and '.join(map(str, rung.head_dims))} only")
        return ValueError(f"version {rung.name!r} supports {widths}, got D = {d} (q.shape = {q.shape})" +
                          (f"; use {_or(others)}" if others else ""))
    return None


def _cuda_rung(version, q) -> FlashRung:
    """The rung to run: the one asked for, checked against what it takes, or the default, the
    newest rung marked default that takes q (v3 for float16/bfloat16 with D = 64 or 128, else v2).
    The names, what each takes and which are defaults come from the ladder, :func:`flash_ladder`."""
    rungs = {rung.name: rung for rung in flash_ladder()}
    if version is None:
        defaults = [rung for rung in reversed(flash_ladder()) if rung.default]
        for rung in defaults:
            if _refusal(rung, q) is None:
                return rung
        raise _refusal(defaults[-1], q)  # why the oldest, most general default cannot take it
    if version not in rungs:
        raise ValueError(f"version must be one of {', '.join(rungs)} or None, got {version!r}")
    error = _refusal(rungs[version], q)
    if error is not None:
        raise error
    return rungs[version]


def _aligned(x, alignment: int):
    # The rung's alignment: 16 bytes for v3 and v4, which move 16-byte vectors. A fresh CuPy
    # allocation always qualifies, an offset view may not.
    return x if x.data.ptr % alignment == 0 else x.copy()


def _cuda_flash_forward(q, k, v, causal, window, scale, version):
    cp, module = _cupy(), _gpu()
    rung = _cuda_rung(version, q)
    b, h, t_q, d = q.shape
    g, t_k = k.shape[1], k.shape[2]
    with q.device:
        q, k, v = (_aligned(x, rung.alignment) for x in (q, k, v))
        o = cp.empty(q.shape, dtype=q.dtype)
        lse = cp.empty((b, h, t_q), dtype=cp.float32)
        module.flash_forward(
            rung.name, q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr, b, h, g, t_q,
            t_k, d, bool(causal), window or 0, scale, _dtype_code(module, q), _stream(cp))
    return o, lse


def _cuda_flash_backward(do, q, k, v, o, lse, causal, window, scale):
    """The backward kernels compute in float32: float16/bfloat16 inputs are converted to float32
    first and the gradients converted back, so dq, dk, dv have the inputs' dtype."""
    cp, module = _cupy(), _gpu()
    d = q.shape[-1]
    if d > _CUDA_MAX_HEAD_DIM:
        raise ValueError(f"the CUDA backward supports head widths up to D = {_CUDA_MAX_HEAD_DIM}, got "
                         f"D = {d} (q.shape = {q.shape})")
    dtype = q.dtype
    b, h, t_q, _ = q.shape
    g, t_k = k.shape[1], k.shape[2]
    with q.device:
        do, q, k, v, o = (cp.ascontiguousarray(x, dtype=cp.float32) for x in (do, q, k, v, o))
        lse = cp.ascontiguousarray(lse, dtype=cp.float32)
        dq, dk, dv = cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)
        delta = cp.empty((b, h, t_q), dtype=cp.float32)  # rowsum(dO * O), workspace
        module.flash_backward(
            do.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr, dq.data.ptr,
            dk.data.ptr, dv.data.ptr, delta.data.ptr, b, h, g, t_q, t_k, d, bool(causal), window or 0,
            scale, _stream(cp))
        if dtype != cp.float32:
            dq, dk, dv = (x.astype(dtype) for x in (dq, dk, dv))
    return dq, dk, dv


def _cuda_decode(q, k_cache, v_cache, lengths, scale, splits):
    """A contiguous cache (B, G, T_max, D) is a paged pool whose page b, of T_max slots, holds
    sequence b: decode is paged decode with the page table [[0], [1], ..., [B - 1]]."""
    cp = _cupy()
    b, t_max = k_cache.shape[0], k_cache.shape[2]
    with q.device:
        if t_max == 0:  # every length is 0: nothing to attend to
            return cp.zeros(q.shape, dtype=q.dtype)
        table = cp.arange(b, dtype=cp.int32).reshape(b, 1)
    return _cuda_paged_decode(q, k_cache, v_cache, table, lengths, scale, splits)


@functools.cache
def _multiprocessors(device_id: int) -> int:
    return int(_cupy().cuda.Device(device_id).attributes["MultiProcessorCount"])


def _auto_splits(cp, batch: int, kv_heads: int, group: int, capacity: int) -> int:
    """Enough split-K chunks to give each multiprocessor about ten blocks (each keeps one 32-key
    tile of loads in flight, and it takes several to cover the memory latency), but none shorter
    than 256 tokens (where the merge would start to cost more than the parallelism buys), and at
    most 256. Registers bound how many decode blocks run at once (csrc/cuda/paged_decode.cu,
    ``kMinBlocks``: 10 at D = 32, 7 at D = 64, 6 at D = 128, 4 at D = 256), so at the wider heads
    the ten per multiprocessor run in waves."""
    blocks = batch * kv_heads * -(-group // _DECODE_HEADS_PER_BLOCK)
    wanted = -(-_DECODE_BLOCKS_PER_SM * _multiprocessors(cp.cuda.Device().id) // max(blocks, 1))
    return int(max(1, min(wanted, -(-capacity // 256), 256)))


def _cuda_paged_decode(q, k_pages, v_pages, page_table, lengths, scale, splits):
    cp, module = _cupy(), _gpu()
    b, h, d = q.shape
    n_pages, g, page_size, _ = k_pages.shape
    max_pages = page_table.shape[1]
    if d > _CUDA_MAX_HEAD_DIM:
        raise ValueError(f"the CUDA decode supports head widths up to D = {_CUDA_MAX_HEAD_DIM}, got "
                         f"D = {d} (q.shape = {q.shape})")
    if max_pages * page_size > 2**30:
        raise ValueError(f"the CUDA decode addresses at most 2**30 tokens per sequence, got "
                         f"max_pages * page_size = {max_pages} * {page_size}")
    with q.device:
        if splits is None:
            splits = _auto_splits(cp, b, g, h // g, max_pages * page_size)
        if splits > module.MAX_DECODE_SPLITS:
            raise ValueError(f"splits must be at most {module.MAX_DECODE_SPLITS} on the GPU, got {splits}")
        table = cp.ascontiguousarray(page_table, dtype=cp.int32)
        lengths = cp.ascontiguousarray(lengths, dtype=cp.int32)
        o = cp.empty(q.shape, dtype=q.dtype)
        partials = cp.empty((b, h, splits, d + 2), dtype=cp.float32)  # (m, l, u) of each split
        module.paged_decode(
            q.data.ptr, k_pages.data.ptr, v_pages.data.ptr, table.data.ptr, lengths.data.ptr,
            partials.data.ptr, o.data.ptr, b, h, g, d, n_pages, page_size, max_pages, splits, scale,
            _dtype_code(module, q), _stream(cp))
    return o
