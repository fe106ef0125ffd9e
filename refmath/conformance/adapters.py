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

__all__ = ["Adapter", "RefmathAdapter", "RefmathBackwardAdapter", "RefmathDecodeAdapter",
           "RefmathPagedAdapter", "NumpyAdapter", "SDPAAdapter", "FlashAttnAdapter",
           "FlashAttnVarlenAdapter", "FlashAttnKVCacheAdapter", "JaxAdapter",
           "OnnxAttentionAdapter", "OrtMultiHeadAttentionAdapter", "OrtGroupQueryAttentionAdapter",
           "TinygradAdapter", "ADAPTERS", "resolve_name", "load_adapter_class", "get_adapter"]


class Adapter:
    """The calling convention of one kind of kernel (see the module docstring)."""

    name = ""
    contracts: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ("float32",)
    conventions = Conventions()  # what the calling convention declares (empty rows, NaN rules)
    framework = "numpy"  # the arrays self.arrays makes: numpy, torch, cupy or jax
    varlen = False  # takes packed batches (a block-diagonal mask, or cu_seqlens)
    kv_dtypes: tuple[str, ...] = ()  # cache formats other than the queries' (fp8)
    inline = False  # call on the sweep's own thread (libraries with thread-bound state)

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
        """Call ``fn`` on the case's inputs in this convention; every adapter defines it."""
        raise NotImplementedError(f"{type(self).__name__} does not define call()")

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


def _visible_all(case: AttentionCase) -> np.ndarray:
    """Boolean ``(B, 1, T_q, T_k)``: which keys each query sees, every mask of the case in one."""
    return np.stack([visible(case, b) for b in range(case.b)])[:, None]


def _alibi_bias(case: AttentionCase) -> np.ndarray:
    """``(1, H, T_q, T_k)``: ALiBi's ``-slope_r |p_i - j|`` (flash-attention's form)."""
    p = np.arange(case.t_q)[:, None] + (case.t_k - case.t_q if case.alignment == "bottom-right" else 0)
    return (-alibi_slopes(case.h)[:, None, None] * np.abs(p - np.arange(case.t_k)[None, :]))[None]


class JaxAdapter(Adapter):
    """``jax.nn.dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
    is_causal=False, return_residual=False)`` on ``(B, T, N, H)`` JAX arrays (by DLPack).
    ``is_causal`` is top-left, so every other mask goes as a boolean ``mask`` ``(B, 1, T_q, T_k)``
    (True: attend) and ALiBi as a float ``bias``; the lse by ``return_residual=True`` (``(B, T,
    N)``); gradients by ``jax.vjp``. Its conventions, as its XLA path computes: the mask replaces
    the scores by one large negative value (an empty row gets the mean of ``V``), and masked
    weights of 0 multiply the values (a NaN in a masked value reaches the row)."""

    name = "jax"
    contracts = ("forward", "backward")
    dtypes = ("float32", "bfloat16", "float16")
    framework = "jax"
    varlen = True  # as a block-diagonal mask
    conventions = Conventions(empty_rows="mean-of-v", masked_nan_may_leak=True)

    def supports_options(self, case):
        if case.softcap is not None:
            return "jax.nn.dot_product_attention has no soft cap"
        return None

    def call(self, fn, case, inputs):
        import jax

        q, k, v = self.arrays(case, _bthd(inputs.q), _bthd(inputs.k), _bthd(inputs.v))
        kwargs = {"scale": case.scale_value}
        plain_causal = (case.causal and case.window is None and case.lengths is None
                        and case.varlen is None and (case.alignment == "top-left" or case.t_q == case.t_k))
        if plain_causal:
            kwargs["is_causal"] = True
        elif case.has_mask:
            kwargs["mask"] = jax.numpy.asarray(_visible_all(case))
        if case.alibi:
            (kwargs["bias"],) = self.arrays(case, _alibi_bias(case), strided=False)
        if case.contract == "backward":
            (do,) = self.arrays(case, _bthd(inputs.dout), strided=False)
            o, pull = jax.vjp(lambda a, b, c: fn(a, b, c, **kwargs), q, k, v)
            dq, dk, dv = pull(do)
            return {"dq": _bthd(self.result("dq", dq, _bthd(inputs.q).shape, case)),
                    "dk": _bthd(self.result("dk", dk, _bthd(inputs.k).shape, case)),
                    "dv": _bthd(self.result("dv", dv, _bthd(inputs.v).shape, case))}
        o, lse = fn(q, k, v, return_residual=True, **kwargs)
        got = {"o": _bthd(self.result("o", o, _bthd(inputs.q).shape, case))}
        lse = self.result("lse", lse, (case.b, case.t_q, case.h), case, dtype="any")
        got["lse"] = np.swapaxes(lse, 1, 2)
        return got


def _onnx_session(fn, node, feeds: dict, opset: int, domain: str = ""):
    """Run one ONNX node on ``feeds`` (name -> NumPy array; an empty name skips an optional input)
    through ``fn``, an ``onnxruntime.InferenceSession``-like constructor on the CPU; returns the
    node's outputs as NumPy arrays."""
    import onnx
    from onnx import helper

    kinds = {np.dtype(np.float32): onnx.TensorProto.FLOAT, np.dtype(np.float16): onnx.TensorProto.FLOAT16,
             np.dtype(np.int32): onnx.TensorProto.INT32, np.dtype(np.int64): onnx.TensorProto.INT64,
             np.dtype(bool): onnx.TensorProto.BOOL}
    graph_inputs = [helper.make_tensor_value_info(n, kinds[x.dtype], list(x.shape))
                    for n, x in feeds.items()]
    out_kind = kinds[next(iter(feeds.values())).dtype]  # the outputs come in the queries' type
    outputs = [helper.make_tensor_value_info(n, out_kind, None) for n in node.output if n]
    graph = helper.make_graph([node], "attention", graph_inputs, outputs)
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    session = fn(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


class OnnxAttentionAdapter(Adapter):
    """The ONNX ``Attention`` operator (opsets 23 to 25) run by ``fn``, an
    ``onnxruntime.InferenceSession``: ``Q (B, N, T_q, D)``, ``K, V (B, G, T_k, D)`` (GQA by the
    head counts), ``is_causal`` only where it means the case's mask (``T_q = T_k``), every other
    mask a boolean ``attn_mask`` ``(B, 1, T_q, T_k)`` (True: attend), ALiBi a float one, ``softcap``
    an attribute; decode with ``nonpad_kv_seqlen`` (opset 24). ``fn`` is called as
    ``fn(model_bytes, providers=["CPUExecutionProvider"])`` and must return an object with
    ``run(None, feeds)``."""

    name = "onnx_attention"
    contracts = ("forward", "decode")
    dtypes = ("float32", "float16")
    framework = "numpy"
    opset = 24
    varlen = True  # as a block-diagonal mask
    conventions = Conventions(masked_nan_may_leak=True)

    def supports_options(self, case):
        if case.strided:
            return "ONNX Runtime copies its inputs from contiguous buffers: no strided views"
        return None

    def call(self, fn, case, inputs):
        from onnx import helper

        dt = np.float32 if case.dtype == "float32" else np.float16
        names, feeds = ["Q", "K", "V"], {}
        if case.contract == "decode":
            feeds.update(Q=inputs.q, K=inputs.k, V=inputs.v)
            names += ["", "", "", "nonpad_kv_seqlen"]
        else:
            feeds.update(Q=inputs.q, K=inputs.k, V=inputs.v)
        feeds = {n: np.ascontiguousarray(x.astype(dt)) for n, x in feeds.items()}
        attrs = {"scale": float(case.scale_value)}
        if case.softcap is not None:
            attrs["softcap"] = float(case.softcap)
        if case.contract == "decode":
            feeds["nonpad_kv_seqlen"] = np.asarray(case.lengths, dtype=np.int64)
        elif case.alibi:
            bias = np.where(_visible_all(case), _alibi_bias(case), -np.inf)
            feeds["attn_mask"] = np.ascontiguousarray(bias.astype(dt))
            names.append("attn_mask")
        elif case.causal and case.t_q == case.t_k and case.window is None and case.lengths is None \
                and case.varlen is None:
            attrs["is_causal"] = 1
        elif case.has_mask:
            feeds["attn_mask"] = np.ascontiguousarray(_visible_all(case))
            names.append("attn_mask")
        node = helper.make_node("Attention", names, ["Y"], **attrs)
        (y,) = _onnx_session(fn, node, feeds, self.opset)
        if case.contract == "decode":
            return {"o": self.result("o", y, inputs.q.shape, case, dtype="any")}
        return {"o": self.result("o", y, inputs.q.shape, case, dtype="any")}


def _packed(x):
    """``(B, H, T, D)`` as ``(B, T, H * D)``, the 3-D layout of ONNX Runtime's contrib ops."""
    b, h, t, d = x.shape
    return np.ascontiguousarray(np.swapaxes(x, 1, 2).reshape(b, t, h * d))


def _unpacked(y, h):
    b, t, hd = y.shape
    return np.swapaxes(y.reshape(b, t, h, hd // h), 1, 2)


class OrtMultiHeadAttentionAdapter(OnnxAttentionAdapter):
    """ONNX Runtime's ``com.microsoft.MultiHeadAttention``: ``query``, ``key``, ``value``
    ``(B, T, N * D)``, ``num_heads``, ``scale``; causal by ``unidirectional=1`` where that is the
    only mask and it means the case's alignment (top-left, or ``T_q = T_k``), padding lengths by ``key_padding_mask`` ``(B,)`` (masked by adding
    ``mask_filter_value = -10000``), every other mask an ``attention_bias`` ``(B, 1, T_q, T_k)`` of
    0 and -10000, as the op's own padding mask is made. The additive finite fill is its convention
    for a row that sees no key: unmasked attention."""

    name = "ort_mha"
    contracts = ("forward",)
    dtypes = ("float32",)
    varlen = True
    conventions = Conventions(empty_rows="unmasked", masked_nan_may_leak=True)

    def supports_options(self, case):
        if case.g != case.h:
            return "MultiHeadAttention has as many key/value heads as query heads"
        if case.softcap is not None:
            return "MultiHeadAttention has no soft cap"
        return super().supports_options(case)

    def call(self, fn, case, inputs):
        from onnx import helper

        feeds = {"query": _packed(inputs.q), "key": _packed(inputs.k), "value": _packed(inputs.v)}
        feeds = {n: x.astype(np.float32) for n, x in feeds.items()}
        names = ["query", "key", "value", ""]
        attrs = {"num_heads": case.h, "scale": float(case.scale_value)}
        # unidirectional is PyTorch's top-left mask (with no past): only where that is the case's
        only_causal = (case.causal and case.window is None and case.lengths is None
                       and case.varlen is None and not case.alibi
                       and (case.alignment == "top-left" or case.t_q == case.t_k))
        if only_causal:
            attrs["unidirectional"] = 1
        elif case.lengths is not None and not case.causal and case.window is None and not case.alibi:
            names.append("key_padding_mask")
            feeds["key_padding_mask"] = np.asarray(case.lengths, dtype=np.int32)
        elif case.has_mask or case.alibi:
            bias = np.where(_visible_all(case), 0.0, -10000.0)
            if case.alibi:
                bias = bias + _alibi_bias(case)
            names += ["", "attention_bias"]
            feeds["attention_bias"] = np.ascontiguousarray(bias.astype(np.float32))
        node = helper.make_node("MultiHeadAttention", names, ["output"], domain="com.microsoft", **attrs)
        (y,) = _onnx_session(fn, node, feeds, 21, "com.microsoft")
        return {"o": _unpacked(self.result("o", y, feeds["query"].shape, case, dtype="any"), case.h)}


class OrtGroupQueryAttentionAdapter(OnnxAttentionAdapter):
    """ONNX Runtime's ``com.microsoft.GroupQueryAttention``: ``query`` ``(B, T, N * D)``,
    ``key``/``value`` ``(B, T, G * D)``, always causal (bottom-right over the past),
    ``local_window_size`` the left window, ``softcap``; ``seqlens_k`` is each sequence's total length
    minus one and ``total_sequence_length`` the longest. Prefill: the whole sequence with no past
    (``T_q = T_k``). Decode: the last cached key and value as the new token, the slots before it as
    ``past_key``/``past_value`` ``(B, G, T_max, D)`` (which hold NaN past each length, as the
    sweep's caches do). A sequence of length 0 cannot be expressed."""

    name = "ort_gqa"
    contracts = ("forward", "decode")
    dtypes = ("float32", "float16")
    varlen = False
    conventions = Conventions(masked_nan_may_leak=True)

    def supports_options(self, case):
        if case.contract == "forward" and not (case.causal and case.t_q == case.t_k):
            return "GroupQueryAttention's prefill is causal self-attention (T_q = T_k)"
        if case.lengths is not None and (case.contract == "forward" or min(case.lengths) == 0):
            return "no padding lengths in prefill, and no empty sequence in decode"
        if case.alibi or (case.window is not None and case.window[1] != 0):
            return "no ALiBi, and the window is left only"
        return super().supports_options(case)

    def call(self, fn, case, inputs):
        from onnx import helper

        dt = np.float32 if case.dtype == "float32" else np.float16
        attrs = {"num_heads": case.h, "kv_num_heads": case.g, "scale": float(case.scale_value)}
        if case.window is not None:
            attrs["local_window_size"] = int(case.window[0]) + 1  # keys p - w + 1 .. p
        if case.softcap is not None:
            attrs["softcap"] = float(case.softcap)
        if case.contract == "forward":
            feeds = {"query": _packed(inputs.q), "key": _packed(inputs.k), "value": _packed(inputs.v)}
            names = ["query", "key", "value", "", ""]
            seqlens = np.full(case.b, case.t_k - 1, dtype=np.int32)
            total = case.t_k
        else:
            last = np.asarray(case.lengths) - 1
            rows = np.arange(case.b)
            feeds = {"query": _packed(inputs.q),
                     "key": _packed(inputs.k[rows, :, last][:, :, None]),
                     "value": _packed(inputs.v[rows, :, last][:, :, None]),
                     "past_key": np.ascontiguousarray(inputs.k),
                     "past_value": np.ascontiguousarray(inputs.v)}
            names = ["query", "key", "value", "past_key", "past_value"]
            seqlens = last.astype(np.int32)
            total = int(max(case.lengths))
        feeds = {n: x.astype(dt) for n, x in feeds.items()}
        feeds["seqlens_k"] = seqlens
        feeds["total_sequence_length"] = np.array([total], dtype=np.int32)
        names += ["seqlens_k", "total_sequence_length"]
        node = helper.make_node("GroupQueryAttention", names, ["output", "present_key", "present_value"],
                                domain="com.microsoft", **attrs)
        y = _onnx_session(fn, node, feeds, 21, "com.microsoft")[0]
        return {"o": _unpacked(self.result("o", y, feeds["query"].shape, case, dtype="any"), case.h)}


class TinygradAdapter(Adapter):
    """tinygrad's ``Tensor.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False,
    enable_gqa=False)`` on ``(B, H, T, D)`` tinygrad tensors (made from NumPy, brought back by
    ``.numpy()``); ``is_causal`` is top-left, every other mask a boolean ``attn_mask`` (True:
    attend), ALiBi a float one; gradients by ``loss.gradient(q, k, v)``. It has no scale argument (always
    ``1/sqrt(D)``). Its conventions: the mask is added as ``-inf``, so a row that sees no key is
    ``0/0 = NaN`` and a NaN in a masked key reaches the row. Called on the sweep's own thread
    (tinygrad's compile cache is bound to the thread that made it)."""

    name = "tinygrad"
    contracts = ("forward", "backward")
    dtypes = ("float32", "float16")
    varlen = True
    inline = True
    conventions = Conventions(empty_rows="nan", masked_nan_may_leak=True)

    def supports_options(self, case):
        if case.scale is not None:
            return "tinygrad's scaled_dot_product_attention has no scale argument"
        if case.softcap is not None:
            return "no soft cap in this convention"
        if case.strided:
            return "tinygrad copies NumPy input into its own buffers: no strided view reaches it"
        return None

    def call(self, fn, case, inputs):
        from tinygrad import Tensor

        q, k, v = (Tensor(x) for x in self.arrays(case, inputs.q, inputs.k, inputs.v))
        backward = case.contract == "backward"
        kwargs = {"enable_gqa": case.g != case.h}
        plain_causal = (case.causal and case.window is None and case.lengths is None
                        and case.varlen is None and (case.alignment == "top-left" or case.t_q == case.t_k))
        if plain_causal and not case.alibi:
            kwargs["is_causal"] = True
        elif case.alibi:
            (bias,) = self.arrays(case, np.where(_visible_all(case), _alibi_bias(case), -np.inf),
                                  strided=False)
            kwargs["attn_mask"] = Tensor(bias)
        elif case.has_mask:
            kwargs["attn_mask"] = Tensor(_visible_all(case))
        o = fn(q, k, v, **kwargs)
        if not backward:
            return {"o": self.result("o", o.numpy(), inputs.q.shape, case)}
        (do,) = self.arrays(case, inputs.dout, strided=False)
        # tinygrad >= 0.10 differentiates functionally: loss.gradient(*targets), no requires_grad_()
        dq, dk, dv = (o * Tensor(do)).sum().gradient(q, k, v)
        return {"dq": self.result("dq", dq.numpy(), inputs.q.shape, case),
                "dk": self.result("dk", dk.numpy(), inputs.k.shape, case),
                "dv": self.result("dv", dv.numpy(), inputs.v.shape, case)}


ADAPTERS = {a.name: a for a in (SDPAAdapter, FlashAttnAdapter, FlashAttnVarlenAdapter,
                                FlashAttnKVCacheAdapter, RefmathAdapter,
                                RefmathBackwardAdapter, RefmathDecodeAdapter, RefmathPagedAdapter,
                                NumpyAdapter, JaxAdapter, OnnxAttentionAdapter,
                                OrtMultiHeadAttentionAdapter, OrtGroupQueryAttentionAdapter,
                                TinygradAdapter)}


def resolve_name(spec: str, form: str = "module:Class"):
    """The object that ``spec``, written ``module:attr`` (``attr`` may be dotted, as in
    ``module:Class.method``), names; a ``ValueError`` in one line when it names nothing. ``form``
    is how the message spells what was expected."""
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected {form}, got {spec!r}")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"cannot import {module_name!r}: {err}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def load_adapter_class(spec: str) -> type:
    """The :class:`Adapter` subclass named ``module:Class`` (imported here, so that a custom
    adapter is named on the command line as the built-in ones are)."""
    try:
        obj = resolve_name(spec, "a custom adapter as module:Class")
    except ValueError as err:
        raise ValueError(f"adapter {spec!r}: {err}") from None
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
