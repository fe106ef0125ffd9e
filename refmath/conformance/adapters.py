r"""Adapters: how the sweep calls a kernel of a known signature, so that most kernels need no glue.

An adapter knows one calling convention: the layout (``(B, H, T, D)`` or ``(B, T, H, D)``), how a
mask, a window, lengths and a page table are passed, the causal alignment the function uses, and
what it returns. It says which cases apply (:meth:`Adapter.supports` gives the reason a case does
not), makes the arrays (:mod:`refmath.conformance.arrays`), calls the function and returns its
outputs in the oracle's shapes, checking shape, dtype and device on the way
(:class:`~refmath.conformance.arrays.BadOutput` otherwise).

========================  ===================================================================
``sdpa``                  ``f(q, k, v, attn_mask=None, is_causal=False, scale=None,
                          enable_gqa=False)`` on ``(B, H, T, D)`` torch tensors, as
                          ``torch.nn.functional.scaled_dot_product_attention``; ``is_causal``
                          is top-left, so other masks go as a boolean ``attn_mask`` (ALiBi as
                          a float one); gradients by torch autograd
``flash_attn``            ``flash_attn_func(q, k, v, softmax_scale=, causal=, window_size=,
                          softcap=, alibi_slopes=, return_attn_probs=)`` on ``(B, T, H, D)``,
                          bottom-right; gradients by autograd
``flash_attn_varlen``     ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k, ...)`` on packed ``(total, H, D)``
``flash_attn_kvcache``    ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=,
                          block_table=, softmax_scale=)``: decode and paged decode
``refmath``               :func:`refmath.kernels.flash_attention_forward`:
                          ``f(q, k, v, causal, window, scale) -> (o, lse)`` on float32 NumPy
``refmath_backward``      :func:`refmath.kernels.flash_attention_backward`:
                          ``f(do, q, k, v, o, lse, causal, window, scale) -> (dq, dk, dv)``
``refmath_decode``        :func:`refmath.kernels.decode`: ``f(q, k_cache, v_cache, lengths, scale)``
``refmath_paged``         :func:`refmath.kernels.paged_decode`:
                          ``f(q, k_pages, v_pages, page_table, lengths, scale)``
``numpy``                 ``f(q, k, v, mask, scale) -> o`` on NumPy arrays of the case's dtype
                          (ml_dtypes for bfloat16), ``mask`` boolean ``(B, 1, T_q, T_k)``,
                          True where a key is visible, or None
========================  ===================================================================

To add one: subclass :class:`Adapter`, set ``name``, ``contracts``, ``dtypes`` and
``conventions`` (:class:`~refmath.conformance.conventions.Conventions`: what a row with no visible
key gives, which NaN rules the convention relaxes), write ``supports_options`` (the reason a case
does not apply, or None) and ``call``. Pass an instance as ``adapter=``, name it on the command line
as ``--adapter module:Class``, or add it to :data:`ADAPTERS`.

What ``call`` returns: a dict of float64 NumPy arrays in the oracle's layout, each through
:meth:`Adapter.result` (which checks shape, dtype and device): ``"o"`` ``(B, H, T_q, D)`` (decode
and paged: ``(B, H, 1, D)``), optionally ``"lse"`` ``(B, H, T_q)`` in natural log, and for the
backward ``"dq"`` ``(B, H, T_q, D)``, ``"dk"``, ``"dv"`` ``(B, G, T_k, D)``.
"""
from __future__ import annotations

import numpy as np

from refmath.conformance.arrays import BadOutput, describe, to_framework, to_host
from refmath.conformance.case import AttentionCase, Inputs, alibi_slopes, visible
from refmath.conformance.conventions import Conventions


class Adapter:
    """The calling convention of one kind of kernel (see the module docstring)."""

    name = ""
    contracts: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ("float32",)
    conventions = Conventions()  # what the calling convention declares (empty rows, NaN rules)
    framework = "numpy"  # the arrays self.arrays makes: numpy, torch, cupy or jax
    varlen = False  # takes packed batches (a block-diagonal mask, or cu_seqlens)
    kv_dtypes: tuple[str, ...] = ()  # cache formats other than the queries' (fp8)

    def __init__(self, device: str = "cpu"):
        self.device = device
        legacy = getattr(type(self), "masked_rows", None)  # an older adapter's one convention
        if legacy is not None and legacy != self.conventions.empty_rows:
            self.conventions = self.conventions.replace(empty_rows=legacy)
        if self.framework == "numpy" and device != "cpu" and self.name.startswith("refmath"):
            # refmath's CUDA kernels: CuPy arrays, float32 and the 16-bit formats
            self.framework = "cupy"
            self.dtypes = ("float32", "float16", "bfloat16")

    def supports(self, case: AttentionCase) -> str | None:
        """None when the case applies, else the reason it does not."""
        if case.contract not in self.contracts:
            return f"the {self.name} adapter has no {case.contract} contract"
        if case.dtype not in self.dtypes:
            return f"the {self.name} adapter takes {', '.join(self.dtypes)}, not {case.dtype}"
        if case.kv_dtype is not None and case.kv_dtype not in self.kv_dtypes:
            return f"the {self.name} adapter takes no {case.kv_dtype} cache"
        if case.varlen is not None and not self.varlen:
            return "no variable-length packed batches in this convention"
        if case.strided and self.framework == "jax":
            return "JAX arrays have no strides: there is no non-contiguous view to pass"
        return self.supports_options(case)

    def supports_options(self, case: AttentionCase) -> str | None:
        return None

    def call(self, fn, case: AttentionCase, inputs: Inputs) -> dict:
        raise NotImplementedError

    # helpers shared by the adapters
    def arrays(self, case: AttentionCase, *xs, strided: bool | None = None, dtype: str | None = None):
        """``xs`` as the framework's arrays of ``dtype`` (default the case's; ``case.cache_dtype``
        for keys and values), on the adapter's device, strided if the case says so."""
        strided = case.strided if strided is None else strided
        dtype = case.dtype if dtype is None else dtype
        return [to_framework(x, dtype, self.framework, self.device, strided) for x in xs]

    def result(self, name: str, y, shape: tuple, case: AttentionCase, dtype: str | None = None) -> np.ndarray:
        """``y`` checked (an array, of ``shape``, of the case's dtype, on the inputs' device) and
        brought to the host in float64."""
        if not hasattr(y, "shape"):
            raise BadOutput(f"{name} is a {type(y).__name__}, not an array")
        if tuple(y.shape) != tuple(shape):
            raise BadOutput(f"{name} has shape {tuple(y.shape)}, expected {tuple(shape)}")
        got_dtype, got_device = describe(y)
        want = dtype or case.dtype
        if want != "any" and got_dtype != want:
            raise BadOutput(f"{name} has dtype {got_dtype}, expected {want}")
        want_device = "cpu" if self.device == "cpu" else self.device
        if got_device.split(":")[0] != want_device.split(":")[0]:
            raise BadOutput(f"{name} is on {got_device}, expected {want_device} (where the inputs are)")
        return to_host(y)


def _window_of(case: AttentionCase):
    """refmath's window ``w`` (keys ``p - w + 1 .. p``) of a left-only causal window."""
    if case.window is None:
        return None
    return case.window[0] + 1


class RefmathAdapter(Adapter):
    """:func:`refmath.kernels.flash_attention_forward`'s convention."""

    name = "refmath"
    contracts = ("forward",)

    def supports_options(self, case):
        if case.causal and case.alignment != "bottom-right" and case.t_q != case.t_k:
            return "refmath aligns causal masks bottom-right only"
        if case.window is not None and (case.window[1] != 0 or case.window[0] < 0):
            return "refmath's window is causal, left only"
        if case.lengths is not None:
            return "no padding lengths in this convention"
        if case.softcap is not None or case.alibi:
            return "no soft cap or ALiBi in this convention"
        return None

    def call(self, fn, case, inputs):
        q, k, v = self.arrays(case, inputs.q, inputs.k, inputs.v)
        out = fn(q, k, v, causal=case.causal, window=_window_of(case), scale=case.scale_value)
        o, lse = out if isinstance(out, tuple) else (out, None)
        got = {"o": self.result("o", o, inputs.q.shape, case)}
        if lse is not None:
            got["lse"] = self.result("lse", lse, inputs.q.shape[:3], case, dtype="any")
        return got


class RefmathBackwardAdapter(RefmathAdapter):
    """:func:`refmath.kernels.flash_attention_backward`'s convention: the forward's ``o`` and
    ``lse`` come from the oracle (rounded to float32), so only the backward is under test."""

    name = "refmath_backward"
    contracts = ("backward",)

    def call(self, fn, case, inputs):
        from refmath.conformance.oracle import attention

        ref = attention(case.replace(contract="forward"), inputs)
        o, lse = ref["o"], ref["lse"]
        do, q, k, v, o = self.arrays(case, inputs.dout, inputs.q, inputs.k, inputs.v, o)
        (lse,) = self.arrays(case, lse, strided=False)
        dq, dk, dv = fn(do, q, k, v, o, lse, causal=case.causal, window=_window_of(case),
                        scale=case.scale_value)
        return {"dq": self.result("dq", dq, inputs.q.shape, case),
                "dk": self.result("dk", dk, inputs.k.shape, case),
                "dv": self.result("dv", dv, inputs.v.shape, case)}


class RefmathDecodeAdapter(Adapter):
    """:func:`refmath.kernels.decode`'s convention: ``q`` ``(B, H, D)``, caches ``(B, G, T, D)``."""

    name = "refmath_decode"
    contracts = ("decode",)

    def call(self, fn, case, inputs):
        q, k, v = self.arrays(case, inputs.q[:, :, 0], inputs.k, inputs.v)
        o = fn(q, k, v, np.asarray(case.lengths, dtype=np.int32), scale=case.scale_value)
        return {"o": self.result("o", o, inputs.q.shape[:2] + inputs.q.shape[3:], case)[:, :, None]}


class RefmathPagedAdapter(Adapter):
    """:func:`refmath.kernels.paged_decode`'s convention: the pool ``(n_pages, G, p, D)``."""

    name = "refmath_paged"
    contracts = ("paged",)

    def call(self, fn, case, inputs):
        q, kp, vp = self.arrays(case, inputs.q[:, :, 0], inputs.k_pages, inputs.v_pages)
        o = fn(q, kp, vp, inputs.page_table.copy(), np.asarray(case.lengths, dtype=np.int32),
               scale=case.scale_value)
        return {"o": self.result("o", o, inputs.q.shape[:2] + inputs.q.shape[3:], case)[:, :, None]}


class NumpyAdapter(Adapter):
    """A plain callable on NumPy arrays: ``f(q, k, v, mask, scale) -> o``."""

    name = "numpy"
    contracts = ("forward",)
    dtypes = ("float32", "bfloat16", "float16")
    varlen = True  # as a block-diagonal mask

    def supports_options(self, case):
        if case.softcap is not None or case.alibi:
            return "no soft cap or ALiBi in this convention"
        return None

    def call(self, fn, case, inputs):
        q, k, v = self.arrays(case, inputs.q, inputs.k, inputs.v)
        mask = None
        if case.has_mask:
            mask = np.stack([visible(case, b) for b in range(case.b)])[:, None]
        o = fn(q, k, v, mask=mask, scale=case.scale_value)
        return {"o": self.result("o", o, inputs.q.shape, case)}


class SDPAAdapter(Adapter):
    """``torch.nn.functional.scaled_dot_product_attention``'s signature, on torch tensors."""

    name = "sdpa"
    contracts = ("forward", "backward")
    dtypes = ("float32", "bfloat16", "float16")
    framework = "torch"
    varlen = True  # as a block-diagonal attn_mask
    # PyTorch adds a boolean mask to the scores as -inf (NaN + -inf = NaN) and multiplies masked
    # weights of 0 by the values, so a NaN in a masked key reaches the row: its convention.
    conventions = Conventions(masked_nan_may_leak=True)

    def supports_options(self, case):
        if case.softcap is not None:
            return "SDPA has no soft cap"
        return None

    def _mask(self, case):
        """``(is_causal, attn_mask)``: is_causal where it means what the case means (top-left, or
        ``T_q = T_k``, and nothing else masked), else a boolean mask, or a float one for ALiBi."""
        torch = _torch()
        plain_causal = (case.causal and case.window is None and case.lengths is None
                        and case.varlen is None
                        and (case.alignment == "top-left" or case.t_q == case.t_k))
        if plain_causal and not case.alibi:
            return True, None
        if not case.has_mask and not case.alibi:
            return False, None
        vis = np.stack([visible(case, b) for b in range(case.b)])[:, None]  # (B, 1, Tq, Tk)
        if not case.alibi:
            return False, torch.from_dlpack(np.ascontiguousarray(vis)).to(self.device)
        p = np.arange(case.t_q)[:, None] + (case.t_k - case.t_q if case.alignment == "bottom-right" else 0)
        bias = -alibi_slopes(case.h)[:, None, None] * np.abs(p - np.arange(case.t_k)[None, :])
        bias = np.where(vis, bias[None], -np.inf)  # (B, H, Tq, Tk)
        return False, to_framework(bias, case.dtype, "torch", self.device)

    def call(self, fn, case, inputs):
        torch = _torch()
        q, k, v = self.arrays(case, inputs.q, inputs.k, inputs.v)
        is_causal, mask = self._mask(case)
        backward = case.contract == "backward"
        if backward:
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        kwargs = dict(attn_mask=mask, is_causal=is_causal, scale=case.scale_value)
        if case.g != case.h:
            kwargs["enable_gqa"] = True
        with torch.set_grad_enabled(backward):
            o = fn(q, k, v, **kwargs)
        got = {"o": self.result("o", o, inputs.q.shape, case)}
        if backward:
            (do,) = self.arrays(case, inputs.dout, strided=False)
            dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
            got = {"dq": self.result("dq", dq, inputs.q.shape, case),
                   "dk": self.result("dk", dk, inputs.k.shape, case),
                   "dv": self.result("dv", dv, inputs.v.shape, case)}
        return got


def _bthd(x):
    return np.swapaxes(x, 1, 2)


class FlashAttnAdapter(Adapter):
    """flash-attention's ``flash_attn_func``: ``(B, T, H, D)``, bottom-right causal,
    ``window_size=(left, right)``, ``softcap``, ``alibi_slopes``; the lse by
    ``return_attn_probs=True``; gradients by torch autograd."""

    name = "flash_attn"
    contracts = ("forward", "backward")
    dtypes = ("bfloat16", "float16")
    framework = "torch"

    def supports_options(self, case):
        if case.causal and case.alignment != "bottom-right" and case.t_q != case.t_k:
            return "flash-attention (>= 2.1) aligns causal masks bottom-right"
        if case.lengths is not None:
            return "padding goes through flash_attn_varlen_func"
        return None

    def call(self, fn, case, inputs):
        torch = _torch()
        q, k, v = self.arrays(case, _bthd(inputs.q), _bthd(inputs.k), _bthd(inputs.v))
        backward = case.contract == "backward"
        if backward:
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        window = case.window if case.window is not None else (-1, -1)
        kwargs = dict(softmax_scale=case.scale_value, causal=case.causal, window_size=tuple(window),
                      softcap=case.softcap or 0.0, return_attn_probs=not backward)
        if case.alibi:
            kwargs["alibi_slopes"] = torch.from_dlpack(alibi_slopes(case.h).astype(np.float32)).to(self.device)
        with torch.set_grad_enabled(backward):
            out = fn(q, k, v, **kwargs)
        o, lse = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
        shape = _bthd(inputs.q).shape
        if backward:
            (do,) = self.arrays(case, _bthd(inputs.dout), strided=False)
            dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
            return {"dq": _bthd(self.result("dq", dq, shape, case)),
                    "dk": _bthd(self.result("dk", dk, _bthd(inputs.k).shape, case)),
                    "dv": _bthd(self.result("dv", dv, _bthd(inputs.v).shape, case))}
        got = {"o": _bthd(self.result("o", o, shape, case))}
        if lse is not None:
            got["lse"] = self.result("lse", lse, inputs.q.shape[:3], case, dtype="any")
        return got


class FlashAttnVarlenAdapter(Adapter):
    """flash-attention's ``flash_attn_varlen_func``: ``q`` ``(total_q, H, D)``, ``k``/``v``
    ``(total_k, G, D)``, ``cu_seqlens_q``/``cu_seqlens_k`` int32, ``max_seqlen_q``/``_k``; each
    sequence bottom-right aligned; the lse ``(H, total_q)`` by ``return_attn_probs=True``."""

    name = "flash_attn_varlen"
    contracts = ("forward",)
    dtypes = ("bfloat16", "float16")
    framework = "torch"
    varlen = True

    def supports_options(self, case):
        if case.varlen is None:
            return "flash_attn_varlen_func takes packed batches (the varlen cases)"
        if case.causal and case.alignment != "bottom-right":
            return "flash-attention (>= 2.1) aligns causal masks bottom-right"
        return None

    def call(self, fn, case, inputs):
        torch = _torch()
        q, k, v = self.arrays(case, _bthd(inputs.q)[0], _bthd(inputs.k)[0], _bthd(inputs.v)[0])
        cu_q, cu_k = (torch.from_dlpack(x).to(self.device) for x in (case.cu_seqlens_q, case.cu_seqlens_k))
        window = case.window if case.window is not None else (-1, -1)
        out = fn(q, k, v, cu_q, cu_k, max(a for a, _ in case.varlen), max(b for _, b in case.varlen),
                 softmax_scale=case.scale_value, causal=case.causal, window_size=tuple(window),
                 softcap=case.softcap or 0.0, return_attn_probs=True)
        o, lse = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
        got = {"o": _bthd(self.result("o", o, _bthd(inputs.q).shape[1:], case)[None])}
        if lse is not None:
            got["lse"] = self.result("lse", lse, inputs.q.shape[1:3], case, dtype="any")[None]
        return got


class FlashAttnKVCacheAdapter(Adapter):
    """flash-attention's ``flash_attn_with_kvcache`` for decode: ``q`` ``(B, 1, H, D)``, the cache
    ``(B, T, G, D)`` or paged ``(n_pages, p, G, D)`` with ``block_table``; ``cache_seqlens``."""

    name = "flash_attn_kvcache"
    contracts = ("decode", "paged")
    dtypes = ("bfloat16", "float16")
    framework = "torch"

    def call(self, fn, case, inputs):
        torch = _torch()
        (q,) = self.arrays(case, _bthd(inputs.q))
        lengths = torch.tensor(case.lengths, dtype=torch.int32, device=self.device)
        kwargs = dict(cache_seqlens=lengths, softmax_scale=case.scale_value)
        if case.contract == "paged":
            k, v = self.arrays(case, _bthd(inputs.k_pages), _bthd(inputs.v_pages), dtype=case.cache_dtype)
            kwargs["block_table"] = torch.from_dlpack(inputs.page_table.copy()).to(self.device)
        else:
            k, v = self.arrays(case, _bthd(inputs.k), _bthd(inputs.v), dtype=case.cache_dtype)
        o = fn(q, k, v, **kwargs)
        return {"o": _bthd(self.result("o", o, _bthd(inputs.q).shape, case))}


def _torch():
    import torch

    return torch


ADAPTERS = {a.name: a for a in (SDPAAdapter, FlashAttnAdapter, FlashAttnVarlenAdapter,
                                FlashAttnKVCacheAdapter, RefmathAdapter,
                                RefmathBackwardAdapter, RefmathDecodeAdapter, RefmathPagedAdapter,
                                NumpyAdapter)}


def load_adapter_class(spec: str) -> type:
    """The :class:`Adapter` subclass named ``module:Class`` (imported here, so that a custom
    adapter is named on the command line as the built-in ones are)."""
    import importlib

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"a custom adapter is named module:Class, got {spec!r}")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"adapter {spec!r}: cannot import {module_name!r}: {err}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"adapter {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Adapter)):
        raise ValueError(f"adapter {spec!r} is not a subclass of "
                         "refmath.conformance.adapters.Adapter")
    return obj


def get_adapter(name: str, device: str = "cpu") -> Adapter:
    """The adapter called ``name`` (a key of :data:`ADAPTERS`, or ``module:Class`` for one of
    one's own), for arrays on ``device``."""
    if not isinstance(device, str) or not device:
        raise TypeError(f"device must be a device name such as 'cpu' or 'cuda', got {device!r}")
    if isinstance(name, str) and ":" in name:
        return load_adapter_class(name)(device)
    if name not in ADAPTERS:
        raise ValueError(f"adapter must be one of {', '.join(ADAPTERS)} or module:Class, "
                         f"got {name!r}")
    return ADAPTERS[name](device)
