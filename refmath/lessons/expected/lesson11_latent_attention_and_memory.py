r"""Lesson 11, latent attention, shared pages, and memory
(``notebooks/11_latent_attention_and_memory.py``): the expected value and the known slips of
each exercise, computed from the library and from the lesson's inputs."""
from __future__ import annotations

import numpy as np

from refmath.lessons.table import exercise, function_exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; nothing here is called by name.
__all__ = []


_K8 = "the section 'K8: weight absorption, scoring against the cache without expanding it'"


@exercise("11.2", "the smallest exact latent widths", _K8,
          "W_K = W_DKV W_UK holds exactly only if d_c >= rank(W_K): np.linalg.matrix_rank",
          uses=("mha_w_k", "factored_w_k"), rtol=0.0)
def _smallest_latent(w_k, factored):
    ranks = [int(np.linalg.matrix_rank(np.asarray(w, dtype=np.float64))) for w in (w_k, factored)]
    width = np.shape(w_k)[1]
    return ranks, {"the widths of the matrices, not their ranks: a product through 6 numbers has "
                   "rank at most 6": [width, np.shape(factored)[1]],
                   "one head's key width: the latent is shared by every head, so it must hold "
                   "all of their keys": [width // 4, width // 4]}


@exercise("11.1", "absorbed scores", _K8, "q_hat = q W_UK^T (width d_c), then q_hat c_j^T",
          uses=("q_c", "c_lat", "W_UK"), rtol=0.0)
def _absorbed_scores(q_c, c_lat, w_uk):
    scores = q_c @ (c_lat @ w_uk).T
    return scores, {"the scores scaled by 1/sqrt(d_k): the exercise asks for q_hat c_j^T":
                    scores / np.sqrt(np.shape(w_uk)[1])}


_S3 = "the section 'S3: how much each attention design saves, computed'"


def _deepseek_v2_numbers(kind: str) -> float:
    """Numbers cached per token and layer by DeepSeek-V2's attention shape, as MLA or as MHA."""
    from refmath.sizing import PRESETS, attention_cache_rows

    ds = PRESETS["deepseek-v2"]
    rows = {r.kind: r for r in attention_cache_rows(ds.n_layers, ds.n_heads, ds.kv_heads,
                                                    ds.head_dim, 8192, latent_dim=ds.d_c,
                                                    rope_dim=ds.d_rope)}
    return rows[kind].bytes_per_token / (ds.n_layers * 2)


@exercise("11.4a", "MLA numbers per token and layer", _S3, "the latent d_c and the rotary key d_R",
          rtol=0.0)
def _mla_numbers():
    mla = _deepseek_v2_numbers("MLA")
    return mla, {"the latent alone: the shared rotary key (64 numbers) is cached too": mla - 64,
                 "x2 for K and V: MLA caches one latent for both": 2 * mla}


@exercise("11.4b", "MHA numbers per token and layer", _S3, "2 (K and V) x h x d_h", rtol=0.0)
def _mha_numbers():
    mha = _deepseek_v2_numbers("MHA")
    return mha, {"K or V only: the cache holds both, a factor 2": mha / 2}


@exercise("11.4c", "GQA key/value heads that cache as much as MLA", _S3,
          "GQA caches 2 g d_h numbers per token and layer: set that equal to d_c + d_R")
def _kv_heads_like_mla():
    import math

    from refmath.sizing import PRESETS

    ds = PRESETS["deepseek-v2"]
    mla, mha = _deepseek_v2_numbers("MLA"), _deepseek_v2_numbers("MHA")
    per_kv_head = mha / ds.n_heads  # GQA's count is g of MHA's h equal shares (the calculator's rows)
    g = mla / per_kv_head
    slips = {
        "the factor 2 forgotten: GQA caches a key and a value per head, 2 g d_h": 2 * mla / per_kv_head,
        "the rotary key left out: MLA caches d_c + d_R": ds.d_c / per_kv_head,
        "the ratio MHA / MLA: the question is the g with 2 g d_h = d_c + d_R": mha / mla}
    # g is not whole here (2.25 for DeepSeek-V2), and a student who rounds it to whole heads, as a
    # real GQA model would have to, gives the whole number on either side. Rounded down it is also
    # d_c / (2 d_h), the rotary key left out (512 / 256 = 2): one value, so one slip naming both.
    for whole, way in ((math.floor(g), "down"), (math.ceil(g), "up")):
        if whole == g or whole < 1:
            continue
        label = f"g rounded {way} to whole heads (g need not be whole here)"
        same = [other for other, value in slips.items() if value == whole]
        for other in same:
            label = f"{label}, or {other}"
            del slips[other]
        slips[label] = float(whole)
    return g, slips


_K11 = "the section 'K11: sharing a prompt between sequences, and copying on write'"


def _pages_used(shared: bool) -> int:
    """Pages in use after 16 samples of a 1000-token prompt (pages of 16 tokens) each append one
    token: forked from one prompt (the original appends last), or each with its own copy."""
    from refmath.inference.paged import PagedKVCache

    def kv(values):
        x = np.repeat(np.asarray(values, dtype=float)[:, None, None], 2, axis=2)
        return x, -x
    cache = PagedKVCache(n_pages=1100, page_size=16, n_kv_heads=1, head_dim=2)
    if shared:
        cache.add_sequence(0)
        cache.append(0, *kv(np.arange(1000)))
        for child in range(1, 16):
            cache.fork(0, child)
    for seq in range(15, -1, -1):
        if not shared:
            cache.add_sequence(seq)
            cache.append(seq, *kv(np.arange(1000)))
        cache.append(seq, *kv([1000 + seq]))
    return cache.pages_used


@exercise("11.5a", "pages with sharing", _K11,
          "the full prompt pages once, its part-full last page, and one copy per fork", rtol=0.0)
def _pages_shared():
    used = _pages_used(shared=True)
    return used, {"no copy on write: the forks' tokens taken to fit in the shared last page":
                  used - 15,
                  "a copy for every sample, the original too": used + 1}


@exercise("11.5b", "pages without sharing", _K11,
          "each sample holds the whole prompt: 16 x ceil(1000 / 16)", rtol=0.0)
def _pages_unshared():
    used = _pages_used(shared=False)
    return used, {"a new page for each sample's token: the last prompt page holds 8 tokens, "
                  "with room to spare": used + 16,
                  "16 x floor(1000 / 16): each sample's last, part-full page of the prompt "
                  "forgotten": 16 * (1000 // 16)}


_S1 = "the section 'S1 and S2: memory for serving and for training'"


# 11.6a's answer is a count of parameters, which a student may round down to a whole one: that
# moves it by under 1 in 3e10, so the tolerance is 1e-9 rather than the default 1e-12
@exercise("11.6a", "the largest P served on 80 GB", _S1,
          "the rule of thumb's bytes, 2 P x 1.2, equal to 80e9: solve for P", rtol=1e-9)
def _largest_served():
    from refmath.sizing import inference_memory_rule_of_thumb

    per_parameter = inference_memory_rule_of_thumb(1).total  # bytes a parameter, allowance included
    return 80e9 / per_parameter, {
        "the 20% allowance forgotten: 80e9 / 2": 80e9 / inference_memory_rule_of_thumb(1).weights,
        "80 GiB (2^30 bytes), not 80 GB (10^9)": 80 * 2**30 / per_parameter,
        "the allowance taken off, not added: 2 P x 0.8":
            80e9 / (0.8 * inference_memory_rule_of_thumb(1).weights),
        "1 byte a parameter: bf16 takes 2": 2 * 80e9 / per_parameter,
        # the figure as it is said aloud, "33 billion": P is the count of parameters itself
        "P given in billions: the answer is the count of parameters, not the count / 1e9":
            80e9 / per_parameter / 1e9}


@exercise("11.6b", "AdamW training state with bf16 moments", _S1,
          "weights 2, gradients 2, master copy 4, and now 2 + 2 for m and v", rtol=0.0)
def _train_bytes_bf16_moments():
    from refmath.sizing import adamw_training_memory

    state = adamw_training_memory(1000)
    fp32 = state.weights_fp16 + state.grads_fp16 + state.master_fp32  # unchanged
    return fp32 + state.adam_moments_fp32 / 2, {
        "the fp32 moments, as in the 16 P above": state.total,
        "m and v counted as one moment: 2 bytes in all": fp32 + state.adam_moments_fp32 / 4,
        "the fp32 master copy dropped as well": fp32 - state.master_fp32
        + state.adam_moments_fp32 / 2}


# ---- 11.3b: the absorbed decode forms no per-head key or value ----------------------------------
#
# 11.3's check compares values, and the expanded computation (keys c W_UK and values c W_UV built
# per head) has the same values: it would pass as the absorbed step. This one runs the student's
# function on inputs whose widths all differ and records the shape of every array a NumPy ufunc
# (``@`` and ``np.exp`` included) or array function (``np.einsum``...) makes from them: an array
# with both a cache axis (T) and a key or value axis (d_k or d_v) is a key or value formed.

_H, _D_K, _D_R, _D_C, _D_V, _T = 3, 5, 2, 7, 4, 6


class _Traced(np.ndarray):
    """An array that records the shape of every array computed from it (``formed``)."""

    formed: list = []

    @staticmethod
    def _plain(x):
        if isinstance(x, _Traced):
            return x.view(np.ndarray)
        if isinstance(x, (list, tuple)):
            return type(x)(_Traced._plain(y) for y in x)
        return x

    @staticmethod
    def _traced(x):
        if isinstance(x, np.ndarray) and not isinstance(x, _Traced):
            _Traced.formed.append(x.shape)
            return x.view(_Traced)
        if isinstance(x, tuple):
            return tuple(_Traced._traced(y) for y in x)
        return x

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        out = getattr(ufunc, method)(*self._plain(inputs), **{k: self._plain(v) for k, v in kwargs.items()})
        return self._traced(out)

    def __array_function__(self, func, types, args, kwargs):
        out = func(*self._plain(args), **{k: self._plain(v) for k, v in kwargs.items()})
        return self._traced(out)


def _keys_or_values_formed(func):
    """1 when ``func`` (11.3's decode step) makes an array with a cache axis and a key or value
    axis, else 0; ``...`` while the function is not written."""
    if func is Ellipsis or func is None:
        return Ellipsis
    draw = np.random.default_rng(5)
    args = [draw.standard_normal(shape).view(_Traced) for shape in
            ((_H, _D_K), (_H, _D_R), (_T, _D_C), (_T, _D_R), (_H, _D_C, _D_K), (_H, _D_C, _D_V))]
    _Traced.formed = []
    out = func(*args)
    if out is Ellipsis:
        return Ellipsis
    expanded = [shape for shape in _Traced.formed
                if _T in shape and (_D_K in shape or _D_V in shape)]
    return float(bool(expanded))


@exercise("11.3b", "your absorbed decode, without a per-head key or value", _K8,
          "score q_hat = q_c W_UK^T against the latents c themselves, and apply W_UV to the "
          "weighted sum of the latents", prepare=_keys_or_values_formed, rtol=0.0)
def _no_expanded_keys():
    return 0.0, {"keys c W_UK or values c W_UV built from the cache: the expanded computation, "
                 "which the absorbed step exists to avoid": 1.0}


def _expanded_attention(q_c, q_r, c, k_r, w_uk, w_uv, scale=None):
    """The reference: each head's content keys c W_UK and values c W_UV built, then attention."""
    from refmath.softmax import softmax_forward

    keys = np.einsum("tc,hck->htk", c, w_uk)
    values = np.einsum("tc,hcv->htv", c, w_uv)
    scale = 1 / np.sqrt(q_c.shape[-1] + q_r.shape[-1]) if scale is None else scale
    scores = scale * (np.einsum("hk,htk->ht", q_c, keys) + q_r @ k_r.T)
    return np.einsum("ht,htv->hv", softmax_forward(scores)[0], values)


def _mla_decode_inputs():
    draw = np.random.default_rng(11)
    return [tuple(draw.standard_normal(shape) for shape in
                  ((h, d_k), (h, d_r), (t, d_c), (t, d_r), (h, d_c, d_k), (h, d_c, d_v)))
            for h, d_k, d_r, d_c, d_v, t in ((4, 8, 4, 16, 8, 5), (2, 3, 2, 6, 5, 1),
                                             (3, 4, 2, 5, 4, 9))]


@function_exercise("11.3", "your absorbed MLA decode",
                   "the section 'K9: decoupled RoPE, and what MLA caches'",
                   "q_hat = q_c W_UK^T per head; scale by 1/sqrt(d_k + d_R); W_UV after the sum")
def _absorbed_attention():
    from refmath.softmax import softmax_forward

    expanded = _expanded_attention
    return dict(
        reference=expanded, inputs=_mla_decode_inputs, rtol=1e-12, allow=(softmax_forward,),
        reference_name="the expanded attention (keys and values built per head)",
        slips={"the scale 1/sqrt(d_k): the rotary width counts too": lambda q_c, q_r, c, k_r,
                   w_uk, w_uv: expanded(q_c, q_r, c, k_r, w_uk, w_uv, scale=1 / np.sqrt(q_c.shape[-1])),
               "the rotary part left out of the scores": lambda q_c, q_r, c, k_r, w_uk, w_uv:
                   expanded(q_c, 0 * q_r, c, k_r, w_uk, w_uv,
                            scale=1 / np.sqrt(q_c.shape[-1] + q_r.shape[-1])),
               "W_UV forgotten: the weighted sum of the latents, not of the values":
                   lambda q_c, q_r, c, k_r, w_uk, w_uv: expanded(
                       q_c, q_r, c, k_r, w_uk, np.broadcast_to(np.eye(c.shape[1]),
                                                               (len(q_c),) + (c.shape[1],) * 2))})
