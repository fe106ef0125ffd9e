r"""Autoregressive generation without a cache (catalogue L7).

.. math:: a_{t+1} \sim p(\cdot \mid a_1, \ldots, a_t)

Every step runs the whole prefix through the model's ``logits`` and keeps only the last position:
:math:`O(T^2)` work over a generation of ``T`` tokens, which is what a KV cache removes (it is
added in :mod:`refmath.inference.kv_cache`; this file is the reference it must reproduce).

The next token is picked from the last position's logits by
:func:`refmath.inference.sampling.token_picker` (greedy, or seeded sampling with temperature,
top-k and top-p).
"""
from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np

from refmath import kernels
from refmath.fast.products import check_products, kernel_products
from refmath._validate import check_choice, check_flag, check_int, check_ndim
from refmath.inference import kv_cache
from refmath.inference.layer_formats import WEIGHTS, stored_model
from refmath.inference.sampling import token_picker
from refmath.inference.weight_layout import in_decode_layout
from refmath.models import DECODER_ONLY, MODELS, model_module

__all__ = ["generate", "generate_seq2seq"]

# ---- the decoding loop ---------------------------------------------------------------------------

def _check_ids(name: str, ids, vocab_size: int) -> np.ndarray:
    ids = np.asarray(ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{name} must be integer token ids, got dtype {ids.dtype} with shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{name} must lie in [0, {vocab_size}), got values in "
                         f"[{ids.min()}, {ids.max()}] (shape {ids.shape})")
    return ids


def _eos_ids(eos_id, vocab_size: int) -> np.ndarray:
    """``eos_id`` (None, one id or a sequence of ids, as Llama 3's configs list two) as a 1-D array
    of ids in ``[0, vocab_size)`` (empty for None)."""
    if eos_id is None:
        return np.zeros(0, dtype=np.int64)
    ids = np.asarray(eos_id)
    if ids.ndim > 1 or (ids.ndim == 1 and ids.size == 0):
        raise ValueError(f"eos_id must be a token id or a non-empty list of them, got {eos_id!r}")
    return _check_ids("eos_id", ids, vocab_size).reshape(-1).astype(np.int64)


def _decode_loop(next_logits, start: np.ndarray, max_new_tokens: int, pick, eos_ids: np.ndarray):
    """Append up to ``max_new_tokens`` tokens to each row of ``start`` ``(B, T0)``.

    ``next_logits(tokens)`` gives the ``(B, V)`` logits of the token after each row. A row that
    has produced one of ``eos_ids`` keeps repeating that id; the loop ends early once every row
    has.
    """
    tokens = start
    done = np.zeros(start.shape[0], dtype=bool)
    last = np.zeros(start.shape[0], dtype=start.dtype)
    for _ in range(max_new_tokens):
        z = next_logits(tokens)
        new = np.array([pick(row) for row in z], dtype=start.dtype)
        if eos_ids.size:
            new[done] = last[done]
            done |= np.isin(new, eos_ids)
            last = new
        tokens = np.concatenate([tokens, new[:, None]], axis=1)
        if done.all():
            break
    return tokens


def _resolve(model) -> ModuleType:
    if isinstance(model, str):
        if model not in DECODER_ONLY:
            seq2seq = model in MODELS and not MODELS[model].decoder_only
            hint = "; use generate_seq2seq for the encoder-decoder" if seq2seq else ""
            raise ValueError(f"model must be one of {', '.join(DECODER_ONLY)} or a model module, "
                             f"got {model!r}{hint}")
        return model_module(model)
    if not callable(getattr(model, "logits", None)):
        raise TypeError(f"model must be a model name or a module with logits(params, tokens, "
                        f"config), got {model!r}")
    return model


def generate(model, params, config, prompt_ids, max_new_tokens: int, *, greedy: bool = False,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             eos_id: int | Sequence[int] | None = None, seed=0, cache: bool = True,
             backend: str = "numpy", weights: str = "f32", products=None) -> np.ndarray:
    r"""Continue ``prompt_ids`` with a decoder-only model (L7).

    ``model`` is ``"gpt"``, ``"llama"``, ``"mla"`` or a module with
    ``logits(params, tokens, config)``. ``prompt_ids`` is ``(T0,)`` or a batch ``(B, T0)`` with
    ``1 <= T0 <= config.max_seq_len``. Once the sequence outgrows ``max_seq_len`` only its last
    ``max_seq_len`` tokens are fed (a sliding window). Generation stops after ``max_new_tokens``
    tokens, or as soon as every row has produced ``eos_id``: one id or a list of them, any of which
    ends a row, as transformers does (a finished row repeats the id it ended with).
    ``seed``: an int or a ``numpy.random.Generator`` (used only when sampling).

    With ``cache=True`` (the default, for refmath's three decoders) the prompt is prefilled once
    into a KV cache and each new token is one decode step on ``backend`` (``"numpy"``, ``"cpu"`` or
    ``"cuda"``, see :func:`refmath.inference.kv_cache.prefill`); when the window slides, the positions of every
    kept token change, so the window is prefilled afresh. ``cache=False`` recomputes the whole
    prefix at every step: the same tokens (up to rounding), at :math:`O(T^2)` cost (K4). On
    ``backend="cpu"`` with two or more OpenMP threads, the decode steps' products run on
    :func:`refmath.kernels.rows_matmul` (:func:`refmath.fast.products.kernel_products`; a call
    with ``products=blas_products`` keeps BLAS's), and on one thread too for parameters laid out by
    :func:`refmath.inference.weight_layout.decode_layout`, which streams the weights faster; there
    the decode steps of refmath's decoder and of GPT run every layer in one compiled call
    (:mod:`refmath.inference.compiled_step`), the NumPy layers' tokens at float32 rounding.

    ``weights``: ``"f32"`` (the parameters as they are), or ``"bf16"``, ``"f16"``, ``"q8_0"``
    (catalogue W1, W2): the layers' seven matrices and the output head are stored in that format
    (:func:`refmath.inference.layer_formats.stored_model`; the embedding, norms and biases stay
    float32). A tied head is rounded as a copy: the embedding lookup still reads the float32
    table, and only the head's product reads the rounded one. On ``backend="cpu"`` the compiled
    decode step reads the stored bytes, the head's product included
    (:func:`refmath.kernels.format_rows_matmul`'s kernel, summed in float32); everywhere else
    (the prefill, ``cache=False``, the other backends, a step the compiled step does not take) the
    NumPy model runs on the matrices explicitly dequantised, the reference. Only models whose
    compiled step takes their layers (refmath's decoder and GPT, within their
    ``COMPILED_FIELDS``) and whose head is ``norm(x) W_out`` alone
    (:data:`~refmath.inference.layer_formats.HEADS`) are accepted; any other raises
    ``ValueError`` naming ``weights``.

    ``products``: how the cached steps' products are computed,
    :func:`refmath.fast.products.blas_products` or :func:`~refmath.fast.products.kernel_products`
    (then on every backend); None (the default) takes the rule above. ``cache=False`` recomputes
    with the model's own forward, on BLAS's products whatever ``products`` says.

    Returns the prompt followed by the new tokens, in the prompt's shape but longer.
    """
    module = _resolve(model)
    prompt = _check_ids("prompt_ids", prompt_ids, config.vocab_size)
    check_ndim("prompt_ids", prompt, (1, 2), "(T0,) or (B, T0)")
    length = prompt.shape[-1]
    if not 1 <= length <= config.max_seq_len:
        raise ValueError(f"prompt_ids has {length} tokens (shape {prompt.shape}); it needs "
                         f"between 1 and max_seq_len = {config.max_seq_len}")
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 0)
    eos_ids = _eos_ids(eos_id, config.vocab_size)
    pick = token_picker(greedy, temperature, top_k, top_p, seed)
    window = config.max_seq_len
    stored = None
    if check_choice("weights", weights, WEIGHTS) != "f32":
        # a tied head comes back untied (its rounded copy as lm_head): the run uses that config
        params, config, stored = stored_model(module, params, config, weights)
    if check_products(products) is None:
        products = _decode_products(backend, params)
    if check_flag("cache", cache) and _has_kv_cache(module):
        next_logits = kv_cache.sliding_next_logits(module, params, config, window, backend,
                                                   stored, weights, products)
    else:
        def next_logits(tokens):
            return module.logits(params, tokens[:, -window:], config)[:, -1, :]

    out = _decode_loop(next_logits, np.atleast_2d(prompt).astype(np.int64), max_new_tokens, pick,
                       eos_ids)
    return out[0] if prompt.ndim == 1 else out


def _decode_products(backend: str, params):
    """Where the decode steps' products run when the caller named none: on ``backend="cpu"``,
    on :func:`refmath.kernels.rows_matmul` (:func:`refmath.fast.products.kernel_products`) with
    two or more OpenMP threads, or at any thread count for parameters in
    :func:`refmath.inference.weight_layout.decode_layout`, where each measured faster than BLAS
    (rows_matmul reads ``(in, out)`` rows slower than BLAS on one thread); otherwise None: BLAS's
    products, the compiled layers only for weights stored in a narrower format."""
    if (backend == "cpu" and kernels.cpu_available()
            and (kernels.cpu_threads() >= 2 or in_decode_layout(params))):
        return kernel_products
    return None


def _has_kv_cache(module) -> bool:
    return getattr(module, "__name__", "") in {MODELS[name].module for name in DECODER_ONLY}


def generate_seq2seq(params, config, src_ids, max_new_tokens: int, *, src_lengths=None,
                     greedy: bool = False, temperature: float = 1.0, top_k: int | None = None,
                     top_p: float | None = None, eos_id: int | Sequence[int] | None = None,
                     seed=0) -> np.ndarray:
    r"""Decode a target for ``src_ids`` with the encoder-decoder (L1, L7): :math:`y_{t+1} \sim
    p(\cdot \mid y_{\le t}, x)`, the decoder input starting with ``config.bos_id``.

    ``src_ids`` is ``(S,)`` or a batch ``(B, S)`` (then ``src_lengths`` ``(B,)`` marks the padding;
    default: no padding). The source is encoded once, and each step reruns the decoder on the whole
    target prefix. ``max_new_tokens`` is at most ``config.max_seq_len`` (the decoder input, BOS
    included, never exceeds it). Stops as :func:`generate` does.

    Returns the generated tokens only (without BOS): ``(n,)`` or ``(B, n)``.
    """
    from refmath.models import transformer

    src = _check_ids("src_ids", src_ids, config.vocab_size)
    check_ndim("src_ids", src, (1, 2), "(S,) or (B, S)")
    if not 1 <= src.shape[-1] <= config.max_seq_len:
        raise ValueError(f"src_ids has {src.shape[-1]} tokens (shape {src.shape}); it needs "
                         f"between 1 and max_seq_len = {config.max_seq_len}")
    src2 = np.atleast_2d(src)
    if src_lengths is None:
        src_lengths = np.full(src2.shape[0], src2.shape[1])
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 0)
    if max_new_tokens > config.max_seq_len:
        raise ValueError(f"max_new_tokens = {max_new_tokens} exceeds max_seq_len = "
                         f"{config.max_seq_len}, the longest decoder input")
    eos_ids = _eos_ids(eos_id, config.vocab_size)
    pick = token_picker(greedy, temperature, top_k, top_p, seed)
    memory = transformer.encode(params, src2, src_lengths, config)

    def next_logits(tokens):
        return transformer.decode(params, memory, src_lengths, tokens, config)[:, -1, :]

    start = np.full((src2.shape[0], 1), config.bos_id, dtype=np.int64)
    out = _decode_loop(next_logits, start, max_new_tokens, pick, eos_ids)[:, 1:]
    return out[0] if src.ndim == 1 else out
