r"""The cases of the attention conformance sweep: what each one asks of a kernel, and its inputs.

A :class:`AttentionCase` is one call of a kernel under one contract:

* ``"forward"``: prefill/training attention, ``o = softmax(tau q k^T + bias, masked) v`` (and the
  log-sum-exp where the kernel returns one);
* ``"backward"``: its gradients ``dq, dk, dv`` for a given ``dout``;
* ``"decode"``: one query per sequence over a contiguous cache with per-sequence lengths;
* ``"paged"``: the same over a paged pool and block tables.

Which keys a query sees (catalogue A2, A10, A12). Query ``i`` of ``T_q`` sits at key position
``p_i = i + T_k - T_q`` under bottom-right alignment (flash-attention >= 2.1, refmath) and at
``p_i = i`` under top-left alignment (PyTorch's ``is_causal``); the two agree when ``T_q = T_k``.
``causal`` keeps ``j <= p_i``; a window ``(left, right)`` (flash-attention's ``window_size``, -1 for
unbounded) keeps ``p_i - left <= j <= p_i + right``; key lengths ``L_b`` keep ``j < L_b``. A row
that sees no key is *all masked*: its expected output is 0 (flash-attention, refmath) or NaN (the
math definition, 0/0), as the sweep is told.

The inputs are drawn to find bugs, not only ``randn``: large scores (a softmax without the max
subtraction overflows fp16 at ``s > 11``), near-ties, one dominant key, outliers in ``V``, inputs
in ``[0.5, 1]`` (where a wrong causal kernel passes ``atol = 0.5``), NaN in visible and in masked
positions, inf in masked positions, and lengths at every tile and page boundary. Every input is
rounded to the case's dtype *before* anything sees it, so the oracle and the kernel start from the
same numbers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from refmath.conformance.conventions import EMPTY_ROWS
from refmath.conformance.precision import DTYPES, round_to

__all__ = ["AttentionCase", "query_positions", "visible", "alibi_slopes", "Inputs", "make_inputs",
           "forward_cases", "backward_cases", "decode_cases", "paged_cases", "long_cases", "sweep"]

CONTRACTS = ("forward", "backward", "decode", "paged")
ALIGNMENTS = ("bottom-right", "top-left")
INPUTS = ("randn", "uniform", "large", "ties", "dominant", "outliers", "nan", "inf-masked", "stale")
STRIDED = (False, True, "transposed")
MASKED_ROWS = EMPTY_ROWS  # what a row with no visible key gives: conventions.py


@dataclass(frozen=True)
class AttentionCase:
    """One call of a kernel: the contract, the shapes, the mask, the options and the inputs' kind.

    ``b, h, g, t_q, t_k, d``: batch, query heads, key/value heads (``g`` divides ``h``; query head
    ``r`` reads key/value head ``r // (h / g)``), query and key lengths, head width. For decode
    ``t_q = 1`` and ``t_k`` is the cache capacity; ``lengths`` are the key lengths per sequence
    (padding for the forward, the cache lengths for decode). ``page_size``, ``shared_pages``: the
    paged pool (pages are always permuted, the last page of a sequence may be partial, and every
    slot and page no sequence owns is NaN). ``kv_dtype``: the format of the cached keys and values
    where it differs from the queries' (fp8 caches: ``float8_e4m3fn``, ``float8_e5m2``; their
    values are exactly representable in every wider format, so the oracle and the plain
    implementation work on them as they are). ``strided``: the arrays reach the kernel as
    non-contiguous views: ``True`` with the last two axes stored swapped (the head width's stride
    is not one element), ``"transposed"`` as a model passes them, a ``(B, T, H, D)`` array viewed
    as ``(B, H, T, D)`` by ``.transpose(1, 2)`` (the head width contiguous, the other axes not;
    for a ``(B, T, H, D)`` convention the other way round). ``varlen``: a variable-length packed
    batch, ``((T_q, T_k), ...)`` per sequence, packed back to back along the length axes of a batch of one (``t_q``, ``t_k`` are
    set to the totals); each sequence sees only its own keys, with its own alignment
    (flash-attention's ``cu_seqlens``: :attr:`cu_seqlens_q`, :attr:`cu_seqlens_k`).
    """

    contract: str
    label: str
    b: int = 1
    h: int = 2
    g: int = 2
    t_q: int = 64
    t_k: int = 64
    d: int = 64
    dtype: str = "float32"
    causal: bool = False
    alignment: str = "bottom-right"
    window: tuple[int, int] | None = None
    lengths: tuple[int, ...] | None = None
    varlen: tuple[tuple[int, int], ...] | None = None
    scale: float | None = None
    softcap: float | None = None
    alibi: bool = False
    inputs: str = "randn"
    strided: bool = False
    page_size: int | None = None
    shared_pages: bool = False
    kv_dtype: str | None = None
    seed: int = 0

    def __post_init__(self):
        if self.contract not in CONTRACTS:
            raise ValueError(f"contract must be one of {CONTRACTS}, got {self.contract!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.alignment not in ALIGNMENTS:
            raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {self.alignment!r}")
        if self.inputs not in INPUTS:
            raise ValueError(f"inputs must be one of {INPUTS}, got {self.inputs!r}")
        if self.inputs == "stale" and self.contract not in ("decode", "paged"):
            raise ValueError("inputs 'stale' (finite values past each length) is for decode and "
                             f"paged cases, got contract {self.contract!r}")
        if self.strided not in STRIDED:
            raise ValueError(f"strided must be one of {STRIDED}, got {self.strided!r}")
        if self.g < 1 or self.h % self.g:
            raise ValueError(f"g = {self.g} must divide h = {self.h}")
        if self.kv_dtype is not None and self.kv_dtype not in DTYPES:
            raise ValueError(f"kv_dtype must be one of {tuple(DTYPES)} or None, got {self.kv_dtype!r}")
        if self.varlen is not None:
            if self.b != 1 or self.lengths is not None or self.alibi:
                raise ValueError("varlen packs the batch into one sequence: b must be 1, with no "
                                 f"lengths or ALiBi, got b = {self.b}")
            object.__setattr__(self, "t_q", sum(q for q, _ in self.varlen))
            object.__setattr__(self, "t_k", sum(k for _, k in self.varlen))

    @property
    def cu_seqlens_q(self) -> np.ndarray:
        """Where each packed sequence's queries start, and the total: ``(n + 1,)`` int32."""
        return np.concatenate([[0], np.cumsum([q for q, _ in self.varlen])]).astype(np.int32)

    @property
    def cu_seqlens_k(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([k for _, k in self.varlen])]).astype(np.int32)

    @property
    def id(self) -> str:
        kv = f"+{self.kv_dtype}" if self.kv_dtype else ""
        return f"{self.contract}/{self.label}/{self.dtype}{kv}"

    @property
    def cache_dtype(self) -> str:
        """The format of ``k`` and ``v``: ``kv_dtype``, else ``dtype``."""
        return self.kv_dtype or self.dtype

    @property
    def scale_value(self) -> float:
        return 1.0 / np.sqrt(self.d) if self.scale is None else float(self.scale)

    @property
    def has_mask(self) -> bool:
        return (self.causal or self.window is not None or self.lengths is not None
                or self.varlen is not None)

    def describe(self) -> str:
        """The case in one line: shapes and every option that is set."""
        parts = [f"B={self.b} H={self.h} G={self.g} Tq={self.t_q} Tk={self.t_k} D={self.d}"]
        if self.causal:
            parts.append(f"causal {self.alignment}")
        if self.window is not None:
            parts.append(f"window {self.window}")
        if self.lengths is not None:
            parts.append(f"lengths {list(self.lengths)}")
        if self.varlen is not None:
            parts.append(f"varlen {[list(x) for x in self.varlen]}")
        if self.scale is not None:
            parts.append(f"scale {self.scale:g}")
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap:g}")
        if self.alibi:
            parts.append("alibi")
        if self.page_size is not None:
            parts.append(f"page {self.page_size}" + (" shared" if self.shared_pages else ""))
        if self.strided:
            parts.append("(B, T, H, D).transpose(1, 2) view" if self.strided == "transposed"
                         else "strided (last two axes swapped)")
        parts.append(self.inputs)
        return ", ".join(parts)

    def replace(self, **changes) -> "AttentionCase":
        return dataclasses.replace(self, **changes)


# ---- which keys each query sees ------------------------------------------------------------------

def query_positions(case: AttentionCase, t_q: int | None = None, t_k: int | None = None) -> np.ndarray:
    """``p_i``, the key position of each query under the case's alignment."""
    t_q = case.t_q if t_q is None else t_q
    t_k = case.t_k if t_k is None else t_k
    offset = t_k - t_q if case.alignment == "bottom-right" else 0
    return np.arange(t_q) + offset


def _packed_positions(case: AttentionCase):
    """For a varlen case: each query's sequence and key position within it, each key's sequence
    and position within it."""
    seq_q = np.repeat(np.arange(len(case.varlen)), [q for q, _ in case.varlen])
    seq_k = np.repeat(np.arange(len(case.varlen)), [k for _, k in case.varlen])
    j = np.arange(case.t_k) - case.cu_seqlens_k[seq_k]
    i = np.arange(case.t_q) - case.cu_seqlens_q[seq_q]
    if case.alignment == "bottom-right":
        lq, lk = np.diff(case.cu_seqlens_q), np.diff(case.cu_seqlens_k)
        i = i + (lk - lq)[seq_q]
    return seq_q, i, seq_k, j


def visible(case: AttentionCase, b: int = 0, rows: slice = slice(None), t_q: int | None = None,
            t_k: int | None = None) -> np.ndarray:
    """Boolean ``(rows, T_k)``: which keys the query rows ``rows`` of sequence ``b`` see."""
    t_k = case.t_k if t_k is None else t_k
    if case.varlen is not None:
        seq_q, p, seq_k, j = _packed_positions(case)
        keep = seq_q[rows][:, None] == seq_k[None, :]
        p, j = p[rows][:, None], j[None, :]
    else:
        p = query_positions(case, t_q, t_k)[rows][:, None]
        j = np.arange(t_k)[None, :]
        keep = np.ones((p.shape[0], t_k), dtype=bool)
    if case.causal:
        keep &= j <= p
    if case.window is not None:
        left, right = case.window
        if left >= 0:
            keep &= j >= p - left
        if right >= 0:
            keep &= j <= p + right
    if case.lengths is not None:
        keep &= j < case.lengths[b]
    return keep


def alibi_slopes(h: int) -> np.ndarray:
    """ALiBi's per-head slopes ``2^{-8 r / h}``, ``r = 1..h`` (Press et al.; the bias of query
    ``i`` and key ``j`` is ``-slope * |p_i - j|``, as flash-attention adds it)."""
    return 2.0 ** (-8.0 * np.arange(1, h + 1) / h)


# ---- the inputs ----------------------------------------------------------------------------------

@dataclass
class Inputs:
    """A case's arrays in float64, every value exactly representable in the case's dtype.

    ``q`` ``(B, H, T_q, D)``, ``k``/``v`` ``(B, G, T_k, D)``, ``dout`` like ``q`` (backward only).
    For decode and paged decode ``q`` is ``(B, H, 1, D)`` here (the adapters drop the axis) and the
    caches ``(B, G, T_max, D)`` hold NaN past each length; ``k_pages``/``v_pages`` and
    ``page_table`` are the paged form of the same keys and values.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray | None = None
    k_pages: np.ndarray | None = None
    v_pages: np.ndarray | None = None
    page_table: np.ndarray | None = None
    extra: dict = field(default_factory=dict)


def make_inputs(case: AttentionCase) -> Inputs:
    """The arrays of ``case``, drawn from its seed (the same case gives the same arrays)."""
    rng = np.random.default_rng([case.seed, case.t_q, case.t_k, case.d, case.h, case.g])
    b, h, g, t_q, t_k, d = case.b, case.h, case.g, case.t_q, case.t_k, case.d
    q = rng.standard_normal((b, h, t_q, d))
    k = rng.standard_normal((b, g, t_k, d))
    v = rng.standard_normal((b, g, t_k, d))
    kind = case.inputs
    if kind == "uniform":  # mlir-air #1427: a wrong causal kernel passed atol=0.5 on these
        q, k, v = (rng.uniform(0.5, 1.0, x.shape) for x in (q, k, v))
    elif kind == "large":  # scores of tens: exp without the max subtraction overflows fp16 (S4)
        q, k = q * 3.0, k * 3.0
    elif kind == "ties":  # every key nearly the same: the weights are flat, to a few ulps
        k = k[:, :, :1] + 1e-3 * k
    elif kind == "dominant":  # one key aligned with every query outweighs the rest
        j = rng.integers(0, t_k)
        m = q.reshape(b, g, -1, d).mean(axis=2)  # each group's average query
        k[:, :, j] = 4.0 * m / m.std()
    elif kind == "outliers":  # a few entries of V a thousand times the rest
        spots = rng.random(v.shape) < 0.01
        v = np.where(spots, 1000.0 * np.sign(v), v)
    q = round_to(q, case.dtype)
    k, v = (round_to(round_to(x, case.dtype), case.cache_dtype) for x in (k, v))
    if kind == "nan":
        _plant_nan(case, rng, q, k, v)
    elif kind == "inf-masked":
        _plant_masked(case, k, v, np.inf)
    dout = round_to(rng.standard_normal(q.shape), case.dtype) if case.contract == "backward" else None
    inputs = Inputs(q, k, v, dout)
    if case.contract in ("decode", "paged"):
        _fill_past_lengths(case, inputs)
    if case.contract == "paged":
        _page(case, inputs, rng)
    return inputs


def _plant_nan(case: AttentionCase, rng, q, k, v) -> None:
    """NaN in one key seen by some queries only (it must reach exactly those rows), one query row
    (it must stay in its row), and NaN in keys and values no query sees (it must reach none)."""
    seen = visible(case, 0).any(axis=0)
    partly = visible(case, 0).any(axis=0) & ~visible(case, 0).all(axis=0)
    candidates = np.flatnonzero(partly) if partly.any() else np.flatnonzero(seen)
    if candidates.size:
        j = candidates[rng.integers(candidates.size)]
        k[0, 0, j, rng.integers(case.d)] = np.nan
    if case.contract not in ("decode", "paged"):
        q[-1, -1, rng.integers(case.t_q), 0] = np.nan
    _plant_masked(case, k, v, np.nan)


def _plant_masked(case: AttentionCase, k, v, value) -> None:
    """``value`` in every key and value that no query of its sequence sees."""
    for b in range(case.b):
        hidden = ~visible(case, b).any(axis=0)
        k[b, :, hidden] = value
        v[b, :, hidden] = value


def _fill_past_lengths(case: AttentionCase, inputs: Inputs) -> None:
    """Slots past each sequence's length hold NaN, as vLLM's tests fill them (vLLM #641); under
    ``inputs="stale"`` finite values instead, keys like the others and values near 10, as a
    previous sequence leaves them: a kernel that reads them moves its output far, so the read is
    caught by its error whatever NaN rules are declared."""
    rng = np.random.default_rng([case.seed, 7])
    for b, n in enumerate(case.lengths):
        if case.inputs == "stale":
            shape = inputs.k[b, :, n:].shape
            inputs.k[b, :, n:] = round_to(round_to(rng.standard_normal(shape), case.dtype),
                                          case.cache_dtype)
            inputs.v[b, :, n:] = round_to(round_to(10.0 + rng.standard_normal(shape), case.dtype),
                                          case.cache_dtype)
        else:
            inputs.k[b, :, n:] = np.nan
            inputs.v[b, :, n:] = np.nan


def _page(case: AttentionCase, inputs: Inputs, rng) -> None:
    """The caches as a pool of pages ``(n_pages, G, p, D)`` and a table ``(B, max_pages)``.

    Page 0 is NaN and owned by nobody; the table's unneeded entries point at it, so that a kernel
    that reads a page its length does not need reads NaN. The pages are handed out in a random
    order; with ``shared_pages`` sequence 1 shares sequence 0's full first pages (a shared prefix,
    K11), which the inputs make true by giving it the same keys and values there.
    """
    p = case.page_size
    b, g, t_max, d = inputs.k.shape
    max_pages = -(-t_max // p)
    lengths = np.asarray(case.lengths)
    need = -(-lengths // p)
    shared = 0
    if case.shared_pages and b > 1:
        shared = int(min(lengths[0], lengths[1]) // p)
        inputs.k[1, :, :shared * p] = inputs.k[0, :, :shared * p]
        inputs.v[1, :, :shared * p] = inputs.v[0, :, :shared * p]
    n_pages = 1 + int(need.sum()) - shared
    ids = 1 + rng.permutation(n_pages - 1)
    k_pages = np.full((n_pages, g, p, d), np.nan)
    v_pages = np.full((n_pages, g, p, d), np.nan)
    table = np.zeros((b, max_pages), dtype=np.int32)
    nxt = 0
    for s in range(b):
        for i in range(need[s]):
            if s == 1 and i < shared:
                table[s, i] = table[0, i]
                continue
            page = ids[nxt]
            nxt += 1
            table[s, i] = page
            # the whole page: its slots past the length hold what the cache holds there (NaN, or
            # a previous sequence's values under inputs="stale")
            n = min(p, t_max - i * p)
            k_pages[page, :, :n] = inputs.k[s, :, i * p:i * p + n]
            v_pages[page, :, :n] = inputs.v[s, :, i * p:i * p + n]
    inputs.k_pages, inputs.v_pages, inputs.page_table = k_pages, v_pages, table


# ---- the sweep -----------------------------------------------------------------------------------

TILES = (16, 32, 64, 128)  # tile sizes of the kernels in common use: lengths straddle each


def _boundary_lengths(quick: bool) -> list[int]:
    tiles = (16, 64) if quick else TILES
    out = {1}
    for t in tiles:
        out.update((t - 1, t, t + 1))
    return sorted(out)


def forward_cases(dtype: str, quick: bool = False) -> list[AttentionCase]:
    """The prefill/training attention cases in one dtype."""
    F = lambda label, **kw: AttentionCase("forward", label, dtype=dtype, **kw)  # noqa: E731
    cases = [
        F("mha", b=2, h=4, g=4, t_q=128, t_k=128),
        F("causal", b=2, h=4, g=4, t_q=128, t_k=128, causal=True),
        F("causal Tq<Tk bottom-right", t_q=37, t_k=129, causal=True),
        F("causal Tq<Tk top-left", t_q=37, t_k=129, causal=True, alignment="top-left"),
        F("causal Tq>Tk bottom-right", t_q=129, t_k=37, causal=True),
        F("causal Tq>Tk top-left", t_q=129, t_k=37, causal=True, alignment="top-left"),
        F("gqa", h=8, g=2, t_q=96, t_k=96, causal=True),
        F("mqa", h=4, g=1, t_q=80, t_k=80),
        F("window left", t_q=150, t_k=150, window=(31, 0), causal=True),
        F("window left Tq<Tk", t_q=40, t_k=150, window=(16, 0), causal=True),
        F("window left+right", t_q=150, t_k=150, window=(20, 7)),
        F("padding", b=3, t_q=70, t_k=70, lengths=(70, 33, 0)),
        F("scale", t_q=64, t_k=64, scale=0.3),
        F("scale causal gqa", h=4, g=2, t_q=50, t_k=50, scale=0.09, causal=True),
        F("softcap", t_q=64, t_k=64, softcap=5.0, inputs="large", causal=True),
        F("alibi", h=4, g=4, t_q=64, t_k=64, alibi=True, causal=True),
        F("strided", b=2, t_q=70, t_k=70, causal=True, strided=True),
        F("transposed view", b=2, h=4, g=2, t_q=70, t_k=70, causal=True, strided="transposed"),
        F("gqa ratio 3", h=6, g=2, t_q=40, t_k=40, causal=True),
    ]
    if not quick:  # group ratios a power-of-two head map gets wrong
        cases += [F("gqa ratio 6", h=6, g=1, t_q=40, t_k=40),
                  F("gqa ratio 7", h=14, g=2, t_q=33, t_k=33, causal=True)]
    for d in ((64, 80, 128) if quick else (32, 64, 80, 96, 128, 256)):
        cases.append(F(f"head dim {d}", t_q=33, t_k=33, d=d, causal=True))
    for t in _boundary_lengths(quick):
        cases.append(F(f"T={t}", h=4, g=2, t_q=t, t_k=t, causal=True))
        if not quick:
            cases.append(F(f"Tk={t}", h=4, g=2, t_q=17, t_k=t, causal=False))
    kinds = ("uniform", "large", "ties", "dominant", "outliers", "nan", "inf-masked")
    for kind in kinds:
        cases.append(F(f"{kind} causal", t_q=65, t_k=65, causal=True, inputs=kind))
    cases.append(F("nan padding", b=2, t_q=33, t_k=33, lengths=(33, 17), inputs="nan"))
    cases += [F("varlen", h=4, g=2, varlen=((5, 5), (17, 17), (64, 64), (1, 1), (30, 30))),
              F("varlen causal", h=4, g=2, varlen=((5, 5), (17, 17), (65, 65), (1, 1)), causal=True),
              F("varlen causal Tq!=Tk", varlen=((3, 20), (16, 16), (33, 70)), causal=True)]
    if not quick:
        cases.append(F("varlen window", varlen=((40, 40), (70, 70)), window=(15, 0), causal=True))
        for kind in ("large", "nan"):
            cases.append(F(f"{kind} window", t_q=65, t_k=65, window=(15, 0), causal=True, inputs=kind))
        cases.append(F("long", b=1, h=2, g=1, t_q=2048, t_k=2048, causal=True))
        cases.append(F("long non-causal", b=1, h=1, g=1, t_q=1024, t_k=4096))
    return cases


def backward_cases(dtype: str, quick: bool = False) -> list[AttentionCase]:
    """The gradient cases: dq, dk, dv for a random dout."""
    B = lambda label, **kw: AttentionCase("backward", label, dtype=dtype, **kw)  # noqa: E731
    cases = [
        B("mha", b=2, h=2, g=2, t_q=64, t_k=64),
        B("causal", t_q=70, t_k=70, causal=True),
        B("gqa causal", h=4, g=2, t_q=65, t_k=65, causal=True),
        B("causal Tq<Tk", t_q=33, t_k=97, causal=True),
        B("window left", t_q=80, t_k=80, window=(15, 0), causal=True),
        B("head dim 80", t_q=40, t_k=40, d=80, causal=True),
        B("scale", t_q=48, t_k=48, scale=0.3, causal=True),
        B("nan causal", t_q=33, t_k=33, causal=True, inputs="nan"),
        B("transposed view", h=4, g=2, t_q=40, t_k=40, causal=True, strided="transposed"),
        B("gqa ratio 3", h=6, g=2, t_q=33, t_k=33, causal=True),
    ]
    if not quick:
        cases += [B("mqa", h=4, g=1, t_q=63, t_k=63),
                  B("causal Tq>Tk", t_q=97, t_k=33, causal=True),
                  B("large causal", t_q=65, t_k=65, causal=True, inputs="large"),
                  B("T=129", t_q=129, t_k=129, causal=True),
                  B("head dim 128", t_q=40, t_k=40, d=128),
                  B("strided", t_q=40, t_k=40, causal=True, strided=True)]
    return cases


def decode_cases(dtype: str, quick: bool = False) -> list[AttentionCase]:
    """One query per sequence over a contiguous cache, lengths at tile boundaries and 0."""
    D = lambda label, **kw: AttentionCase("decode", label, dtype=dtype, t_q=1, **kw)  # noqa: E731
    lengths = (1, 15, 16, 17, 63, 64, 65, 300) if not quick else (1, 16, 17, 65)
    cases = [
        D("gqa", b=len(lengths), h=8, g=2, t_k=320, lengths=lengths),
        D("mha", b=3, h=4, g=4, t_k=128, lengths=(128, 1, 77)),
        D("mqa head dim 128", b=2, h=8, g=1, t_k=100, d=128, lengths=(100, 31)),
        D("empty sequence", b=2, h=2, g=1, t_k=40, lengths=(0, 40)),
        D("large", b=2, h=4, g=2, t_k=64, lengths=(64, 33), inputs="large"),
        D("nan", b=2, h=4, g=2, t_k=64, lengths=(64, 33), inputs="nan"),
        D("stale slots", b=3, h=4, g=2, t_k=80, lengths=(80, 33, 1), inputs="stale"),
        D("transposed view", b=2, h=6, g=2, t_k=70, lengths=(70, 21), strided="transposed"),
    ]
    if dtype in ("bfloat16", "float16"):  # fp8 caches under 16-bit queries
        cases += [D("fp8 cache", b=3, h=8, g=2, t_k=100, lengths=(100, 17, 64), kv_dtype=kv)
                  for kv in ("float8_e4m3fn", "float8_e5m2")]
    if not quick:
        cases.append(D("long", b=2, h=4, g=1, t_k=8192, lengths=(8192, 5000)))
        cases.append(D("head dim 256", b=2, h=4, g=2, t_k=70, d=256, lengths=(70, 9)))
        cases += [D("gqa ratio 7", b=2, h=7, g=1, t_k=50, lengths=(50, 17)),
                  D("strided", b=2, h=4, g=2, t_k=70, lengths=(70, 21), strided=True)]
    return cases


def paged_cases(dtype: str, quick: bool = False) -> list[AttentionCase]:
    """Paged decode: page sizes 1 to 64, permuted and shared pages, a partial last page, NaN in
    every slot and page no sequence owns."""
    P = lambda label, **kw: AttentionCase("paged", label, dtype=dtype, t_q=1, **kw)  # noqa: E731
    cases = [
        P("page 16", b=4, h=8, g=2, t_k=128, page_size=16, lengths=(1, 16, 17, 128)),
        P("page 16 shared", b=3, h=4, g=2, t_k=96, page_size=16, lengths=(70, 90, 5),
          shared_pages=True),
        P("page 1", b=2, h=2, g=1, t_k=20, page_size=1, lengths=(20, 7)),
        P("page 64 partial", b=2, h=4, g=4, t_k=200, page_size=64, lengths=(200, 65)),
        P("empty sequence", b=2, h=2, g=2, t_k=32, page_size=16, lengths=(0, 32)),
        P("nan", b=2, h=4, g=2, t_k=64, page_size=16, lengths=(64, 21), inputs="nan"),
        P("stale slots", b=2, h=4, g=2, t_k=64, page_size=16, lengths=(64, 21), inputs="stale"),
        P("transposed view", b=2, h=6, g=2, t_k=64, page_size=16, lengths=(64, 21),
          strided="transposed"),
    ]
    if dtype in ("bfloat16", "float16"):
        cases += [P("fp8 cache", b=2, h=4, g=2, t_k=64, page_size=16, lengths=(64, 21), kv_dtype=kv)
                  for kv in ("float8_e4m3fn", "float8_e5m2")]
    if not quick:
        cases += [P("page 256", b=2, h=4, g=1, t_k=1024, page_size=256, lengths=(1024, 257)),
                  P("page 32 head dim 128", b=3, h=8, g=2, t_k=128, d=128, page_size=32,
                    lengths=(127, 128, 33), shared_pages=True),
                  P("large", b=2, h=4, g=2, t_k=64, page_size=16, lengths=(64, 33), inputs="large"),
                  P("gqa ratio 6", b=2, h=12, g=2, t_k=48, page_size=16, lengths=(48, 20)),
                  P("strided", b=2, h=4, g=2, t_k=64, page_size=16, lengths=(64, 21), strided=True)]
    return cases


_BUILDERS = {"forward": forward_cases, "backward": backward_cases, "decode": decode_cases,
             "paged": paged_cases}


LONG = 32768


def long_cases(dtype: str) -> dict[str, list[AttentionCase]]:
    """``T = 32k``: the lengths of long-context prefill and decode (the oracle takes about ten
    seconds for the causal forward on one core)."""
    return {"forward": [AttentionCase("forward", "T=32k causal", dtype=dtype, h=1, g=1, t_q=LONG, t_k=LONG,
                             causal=True)],
            "decode": [AttentionCase("decode", "T=32k", dtype=dtype, b=2, h=8, g=1, t_q=1, t_k=LONG,
                            lengths=(LONG, LONG // 2 + 1))]}


def sweep(contracts=CONTRACTS, dtypes=("float32",), quick: bool = False,
          long: bool = False) -> list[AttentionCase]:
    """Every case of the sweep for the given contracts and dtypes (``quick``: a subset that still
    crosses every kind of boundary, for a fast first look and for tests; ``long``: add the
    ``T = 32k`` cases)."""
    for c in contracts:
        if c not in CONTRACTS:
            raise ValueError(f"contracts must be drawn from {CONTRACTS}, got {c!r}")
    for dt in dtypes:
        if dt not in DTYPES:
            raise ValueError(f"dtypes must be drawn from {tuple(DTYPES)}, got {dt!r}")
    cases = [case for c in contracts for dt in dtypes for case in _BUILDERS[c](dt, quick)]
    if long:
        cases += [case for dt in dtypes for c in contracts for case in long_cases(dt).get(c, [])]
    return cases
