r"""Autoregressive generation without a cache (catalogue L7).

.. math:: a_{t+1} \sim p(\cdot \mid a_1, \ldots, a_t)

Every step runs the whole prefix through the model's ``logits`` and keeps only the last position:
:math:`O(T^2)` work over a generation of ``T`` tokens, which is what a KV cache removes (it is
added in :mod:`refmath.inference.kv_cache`; this file is the reference it must reproduce).

How the next token is picked from the last position's logits :math:`z \in \mathbb R^V`:

- greedy: :math:`\arg\max_v z_v` (the lowest id among ties);
- sampling: :math:`p = \operatorname{softmax}(z / \tau)` with temperature :math:`\tau > 0`, then
  optionally top-k (keep the ``k`` most probable ids) and then top-p (keep the smallest set of the
  most probable ids whose mass is at least ``p``), renormalise, and draw by inverting the
  cumulative distribution with one uniform number from a ``numpy.random.Generator``.

Greedy ignores the temperature, top-k and top-p, which cannot change the argmax. The same seed and
arguments give the same tokens.
"""
from __future__ import annotations

from types import ModuleType

import numpy as np

from refmath._validate import check_flag, check_int, check_ndim, check_real, float_array
from refmath.models import DECODER_ONLY, MODELS, model_module



# ---- turning logits into a distribution ----------------------------------------------------------

def check_sampling_args(temperature: float = 1.0, top_k: int | None = None,
                        top_p: float | None = None) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``temperature > 0`` (finite), ``top_k`` is None
    or an int ``>= 1``, and ``top_p`` is None or in ``(0, 1]`` (greedy decoding needs no
    temperature: pass ``greedy=True`` instead of a temperature of 0)."""
    check_real("temperature", temperature, 0.0, low_open=True)
    if top_k is not None:
        check_int("top_k", top_k, 1)
    if top_p is not None:
        check_real("top_p", top_p, 0.0, 1.0, low_open=True)


def _descending(probs: np.ndarray) -> np.ndarray:
    # A stable sort of -p: among equal probabilities the lower id comes first, so ties are broken
    # the same way every time (and the same way as np.argmax).
    return np.argsort(-probs, kind="stable")


def top_k_filter(probs, k: int) -> np.ndarray:
    """Keep the ``k`` largest entries of the distribution ``probs`` ``(V,)``, zero the rest and
    renormalise (the lower id wins a tie at the boundary; ``k >= V`` keeps everything)."""
    probs = float_array("probs", probs)
    check_ndim("probs", probs, 1, "(V,)")
    check_sampling_args(top_k=k)
    keep = np.zeros(probs.shape, dtype=bool)
    keep[_descending(probs)[:k]] = True
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def top_p_filter(probs, p: float) -> np.ndarray:
    r"""Nucleus filtering: keep the smallest set of most probable ids whose mass is at least ``p``.

    With the probabilities sorted in decreasing order, :math:`p_{(1)} \ge p_{(2)} \ge \ldots`, the
    kept ids are the first :math:`m` where :math:`m` is the least index with
    :math:`\sum_{i \le m} p_{(i)} \ge p`: id :math:`(i)` is kept exactly when the mass before it,
    :math:`\sum_{j < i} p_{(j)}`, is below ``p``. The most probable id is always kept; ``p = 1``
    keeps every id (also those whose mass rounding would drop). Returns the renormalised ``(V,)``.
    """
    probs = float_array("probs", probs)
    check_ndim("probs", probs, 1, "(V,)")
    check_sampling_args(top_p=p)
    if p == 1.0:
        return probs / probs.sum()
    order = _descending(probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros(probs.shape, dtype=bool)
    keep[order[mass_before < p * probs.sum()]] = True
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def check_logits(z: np.ndarray) -> None:
    """Raise ``ValueError`` unless the logits ``z`` ``(..., V)`` can define a distribution: no NaN,
    no ``+inf``, and at least one entry above ``-inf`` per row (``-inf`` excludes a token)."""
    bad = np.isnan(z) | np.isposinf(z)
    if bad.any():
        raise ValueError(f"logits hold {int(bad.sum())} NaN or +inf entries (shape {z.shape}); "
                         f"the model's output is not a number: are its parameters finite?")
    if np.isneginf(z).all(axis=-1).any():
        raise ValueError(f"every logit of a row is -inf (shape {z.shape}): no token can be chosen")


def next_token_distribution(logits, temperature: float = 1.0, top_k: int | None = None,
                            top_p: float | None = None) -> np.ndarray:
    r"""The distribution a sampler draws from: ``softmax(logits / temperature)`` ``(V,)`` in float64,
    then :func:`top_k_filter`, then :func:`top_p_filter` (the order of Hugging Face's samplers).

    The softmax subtracts the maximum first, so a small temperature does not overflow.
    """
    z = float_array("logits", logits).astype(np.float64)
    check_ndim("logits", z, 1, "(V,)")
    check_sampling_args(temperature, top_k, top_p)
    check_logits(z)
    scaled = z / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if top_k is not None:
        probs = top_k_filter(probs, top_k)
    if top_p is not None:
        probs = top_p_filter(probs, top_p)
    return probs


def sample_token(probs, rng: np.random.Generator) -> int:
    """Draw one id from ``probs`` ``(V,)`` by inverting the cumulative sum with ``u ~ U[0, 1)``.

    The id is the first ``v`` with ``cdf[v] > u * cdf[-1]``; ids of probability 0 are never drawn.
    """
    probs = float_array("probs", probs)
    check_ndim("probs", probs, 1, "(V,)")
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    cdf = np.cumsum(probs)
    v = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    # u * total can round up to total itself; fall back to the last id with positive probability.
    return min(v, int(np.flatnonzero(probs > 0)[-1]))


# ---- the decoding loop ---------------------------------------------------------------------------

def _check_ids(name: str, ids, vocab_size: int) -> np.ndarray:
    ids = np.asarray(ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{name} must be integer token ids, got dtype {ids.dtype} with shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{name} must lie in [0, {vocab_size}), got values in "
                         f"[{ids.min()}, {ids.max()}] (shape {ids.shape})")
    return ids


def _decode_loop(next_logits, start: np.ndarray, max_new_tokens: int, pick, eos_id):
    """Append up to ``max_new_tokens`` tokens to each row of ``start`` ``(B, T0)``.

    ``next_logits(tokens)`` gives the ``(B, V)`` logits of the token after each row. A row that
    has produced ``eos_id`` keeps repeating it; the loop ends early once every row has.
    """
    tokens = start
    done = np.zeros(start.shape[0], dtype=bool)
    for _ in range(max_new_tokens):
        z = next_logits(tokens)
        new = np.array([pick(row) for row in z], dtype=start.dtype)
        if eos_id is not None:
            new[done] = eos_id
            done |= new == eos_id
        tokens = np.concatenate([tokens, new[:, None]], axis=1)
        if done.all():
            break
    return tokens


def token_picker(greedy: bool, temperature, top_k, top_p, seed):
    """``pick(z) -> int``, the next id from one row of logits ``z`` ``(V,)``: the argmax, or a draw
    from :func:`next_token_distribution` with one uniform number per call from ``seed`` (an int or
    a ``numpy.random.Generator``). Both refuse logits holding NaN (see :func:`check_logits`)."""
    check_sampling_args(temperature, top_k, top_p)
    if check_flag("greedy", greedy):
        def argmax(z):
            check_logits(z)  # np.argmax picks a NaN as readily as the largest logit
            return int(np.argmax(z))
        return argmax
    rng = np.random.default_rng(seed)  # a Generator passes through unchanged

    def pick(z):
        return sample_token(next_token_distribution(z, temperature, top_k, top_p), rng)
    return pick


def _resolve(model) -> ModuleType:
    if isinstance(model, str):
        if model not in DECODER_ONLY:
            hint = "; use generate_seq2seq for the encoder-decoder" if model == "transformer" else ""
            raise ValueError(f"model must be one of {', '.join(DECODER_ONLY)} or a model module, "
                             f"got {model!r}{hint}")
        return model_module(model)
    if not callable(getattr(model, "logits", None)):
        raise TypeError(f"model must be a model name or a module with logits(params, tokens, "
                        f"config), got {model!r}")
    return model


def generate(model, params, config, prompt_ids, max_new_tokens: int, *, greedy: bool = False,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             eos_id: int | None = None, seed=0, cache: bool = True,
             backend: str = "numpy") -> np.ndarray:
    r"""Continue ``prompt_ids`` with a decoder-only model (L7).

    ``model`` is ``"gpt"``, ``"llama"``, ``"mla"`` or a module with
    ``logits(params, tokens, config)``. ``prompt_ids`` is ``(T0,)`` or a batch ``(B, T0)`` with
    ``1 <= T0 <= config.max_seq_len``. Once the sequence outgrows ``max_seq_len`` only its last
    ``max_seq_len`` tokens are fed (a sliding window). Generation stops after ``max_new_tokens``
    tokens, or as soon as every row has produced ``eos_id`` (a finished row repeats ``eos_id``).
    ``seed``: an int or a ``numpy.random.Generator`` (used only when sampling).

    With ``cache=True`` (the default, for refmath's three decoders) the prompt is prefilled once
    into a KV cache and each new token is one decode step on ``backend`` (``"numpy"``, ``"cpu"`` or
    ``"cuda"``, see :func:`refmath.inference.kv_cache.prefill`); when the window slides, the positions of every
    kept token change, so the window is prefilled afresh. ``cache=False`` recomputes the whole
    prefix at every step: the same tokens (up to rounding), at :math:`O(T^2)` cost (K4).

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
    if eos_id is not None:
        _check_ids("eos_id", eos_id, config.vocab_size)
    pick = token_picker(greedy, temperature, top_k, top_p, seed)
    window = config.max_seq_len
    if check_flag("cache", cache) and _has_kv_cache(module):
        next_logits = _cached_next_logits(module, params, config, window, backend)
    else:
        def next_logits(tokens):
            return module.logits(params, tokens[:, -window:], config)[:, -1, :]

    out = _decode_loop(next_logits, np.atleast_2d(prompt).astype(np.int64), max_new_tokens, pick,
                       eos_id)
    return out[0] if prompt.ndim == 1 else out


def _has_kv_cache(module) -> bool:
    return getattr(module, "__name__", "") in {MODELS[name].module for name in DECODER_ONLY}


def _cached_next_logits(module, params, config, window: int, backend: str):
    """``next_logits(tokens)`` for :func:`_decode_loop` through a KV cache: one decode step while
    the cache holds every token but the newest, a fresh prefill of the last ``window`` tokens
    otherwise (the first call, and every call once the window slides)."""
    from refmath.inference import kv_cache  # it uses this module's sampling rule

    state = {"cache": None}

    def next_logits(tokens):
        cache = state["cache"]
        if cache is not None and cache.length == tokens.shape[1] - 1 < window:
            return kv_cache.decode_step(module, params, config, cache, tokens[:, -1])
        z, state["cache"] = kv_cache.prefill(module, params, config, tokens[:, -window:],
                                             backend=backend)
        return z

    return next_logits


def generate_seq2seq(params, config, src_ids, max_new_tokens: int, *, src_lengths=None,
                     greedy: bool = False, temperature: float = 1.0, top_k: int | None = None,
                     top_p: float | None = None, eos_id: int | None = None, seed=0) -> np.ndarray:
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
    if eos_id is not None:
        _check_ids("eos_id", eos_id, config.vocab_size)
    pick = token_picker(greedy, temperature, top_k, top_p, seed)
    memory = transformer.encode(params, src2, src_lengths, config)

    def next_logits(tokens):
        return transformer.decode(params, memory, src_lengths, tokens, config)[:, -1, :]

    start = np.full((src2.shape[0], 1), config.bos_id, dtype=np.int64)
    out = _decode_loop(next_logits, start, max_new_tokens, pick, eos_id)[:, 1:]
    return out[0] if src.ndim == 1 else out
