r"""Lesson 8, the modern decoder and grouped-query attention
(``notebooks/08_modern_decoder_and_gqa.py``): the expected value and the known slips of each
exercise, computed from the library and from the lesson's inputs."""
from __future__ import annotations

import numpy as np

from refmath.lessons.checks import catalogued
from refmath.lessons.table import exercise, function_exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; nothing here is called by name.
__all__ = []


_HEAD_SUM = "the section 'The head-sum in the key and value gradients'"
_A13 = "the section 'A13: what grouping saves, and what it does not'"
_N19 = "the section 'N19, N20: Gemma's soft caps, GeGLU and local layers'"


def _fused_weights(params) -> np.ndarray:
    return np.concatenate([np.asarray(params[k], dtype=np.float64).ravel() for k in ("w_qkv", "w_o")])


@exercise("08.2", "the fused parameters", "the section 'A9: one fused projection equals three'",
          "w_qkv = [w_q w_k w_v] side by side (axis=1), in that order; w_o unchanged",
          uses=("separate",), prepare=_fused_weights)
def _fused_parameters(separate):
    def fused(*names):
        return _fused_weights({"w_qkv": np.concatenate([separate[n] for n in names], axis=1),
                               "w_o": separate["w_o"]})
    return fused("w_q", "w_k", "w_v"), {
        "the order Q, V, K: the heads read K before V": fused("w_q", "w_v", "w_k"),
        "the order K, Q, V: the queries come first": fused("w_k", "w_q", "w_v")}


@exercise("08.3", "dV of the shared head", _HEAD_SUM,
          "dV = A_0^T dO_0 + A_1^T dO_1: a copy's backward is a sum",
          uses=("do_small", "cache_small"), rtol=1e-14)
def _shared_dv(do, cache):
    from refmath.attention import causal_attention_backward

    dv = causal_attention_backward(do, cache)[2]
    weights = cache.saved.a[0]  # (h, T, T)
    head0 = (weights[0].T @ do[0, 0]).reshape(dv.shape)
    return dv, {"head 0's copy only, head 1's dropped": head0,
                "A dO, not A^T dO: the transpose forgotten":
                    sum(weights[r] @ do[0, r] for r in range(2)).reshape(dv.shape)}


@exercise("08.4", "dK of the shared heads", _HEAD_SUM, "sum over the h/g query heads of each block",
          uses=("q5", "k5", "v5", "do5", "per_head"), rtol=1e-7, atol=1e-9)
def _shared_dk(q, k, v, do, per_head):
    from refmath.attention import causal_attention_forward
    from refmath.gradcheck import numerical_gradient

    def phi():
        return float((causal_attention_forward(q, k, v)[0] * do).sum())
    b, g, t, d = np.shape(k)
    grouped = np.asarray(per_head).reshape(b, g, -1, t, d)
    return numerical_gradient(phi, k, np.arange(k.size)).reshape(k.shape), {
        "the mean over the sharing query heads, not the sum": grouped.mean(axis=2),
        "one query head's copy only, the other sharing head's dropped": grouped[:, :, 0]}


def _llama3_design(kv_heads: int = 8):
    from refmath.sizing import attention_design_cost

    return attention_design_cost(4096, 32, kv_heads, 128, 8192)


@exercise("08.5a", "score FLOPs", _A13, "2 FLOPs per multiply-add, h d_h t for q k^T and again "
          "for A V", rtol=0.0)
def _score_flops():
    flops = _llama3_design().score_flops
    # q k^T alone and multiply-adds counted as one FLOP both give half: one name for both
    return flops, {"half of it: q k^T without A V, or a multiply-add counted as one FLOP":
                       flops / 2,
                   "the g key/value heads, not the h query heads": flops * 8 / 32}


@exercise("08.5b", "cache bytes", _A13, "2 (K and V) x t x g x d_h x bytes, for one layer",
          rtol=0.0)
def _decode_cache_bytes():
    size = _llama3_design().cache_bytes
    return size, {"the factor 2 for K and V forgotten": size / 2,
                  "every query head's keys and values (MHA's cache)":
                      _llama3_design(kv_heads=32).cache_bytes}


@exercise("08.5c", "MHA / GQA cache", _A13, "the cache is proportional to g", rtol=0.0)
def _mha_over_gqa():
    ratio = _llama3_design(kv_heads=32).cache_bytes / _llama3_design().cache_bytes
    return ratio, {"GQA / MHA, the ratio upside down": 1 / ratio}


@exercise("08.6", "llama3 frequencies", "the section 'N13-N17: context extension, rescaling "
          "RoPE's frequencies'",
          "pair 0 (wavelength 6.3) is kept; pair 1 (wavelength 30) is blended")
def _llama3_frequencies():
    from refmath.positions import rope_inv_freq

    plain = 500.0 ** (-np.arange(4) / 4)
    right = rope_inv_freq(8, 500.0, dict(rope_type="llama3", factor=8.0,
                                         original_max_seq_len=32))[0]
    # the blended pairs with gamma and 1 - gamma exchanged: gamma weighs the kept omega
    wavelength = 2 * np.pi / plain
    gamma = (32 / wavelength - 1) / (4 - 1)
    between = (wavelength >= 8) & (wavelength <= 32)
    swapped = np.where(between, gamma * plain / 8 + (1 - gamma) * plain, right)
    return right, {
        "the blend's weights exchanged: gamma goes with omega (kept), 1 - gamma with omega / s":
            swapped,
        "every pair divided by s = 8 (position interpolation)": plain / 8,
        "the frequencies left as they were": plain}


_CAPPED_SCORES = np.array([0.0, 25.0, 50.0, 100.0])


@exercise("08.7a", "the capped scores", _N19,
          "y = c tanh(x / c): at x = c it is c tanh(1), about 0.76 c")
def _capped_scores():
    from refmath.ffn import softcap_forward

    x = _CAPPED_SCORES
    return softcap_forward(x, 50.0)[0], {"tanh(x / c) without the factor c": np.tanh(x / 50.0),
                                         "c tanh(x), the score not divided by c":
                                             50.0 * np.tanh(x)}


@exercise("08.7b", "the slopes", _N19, "the derivative of c tanh(x / c) is 1 - tanh^2(x / c)")
def _cap_slopes():
    from refmath.ffn import softcap_forward

    x = _CAPPED_SCORES
    return 1.0 - (softcap_forward(x, 50.0)[0] / 50.0) ** 2, {
        "1 - tanh(x / c), not squared": 1.0 - np.tanh(x / 50.0),
        "the slope of tanh(x), not divided by c": 1.0 - np.tanh(x) ** 2}


@exercise("08.8", "the fused input projection's width", "the section 'N21, N22: the parallel "
          "block, and norms after the sublayers'",
          "queries h d_h, keys and values one head each, the gate and the up projection", rtol=0.0)
def _palm_fused_width():
    d, h, d_h, d_f = 18432, 48, 256, 4 * 18432
    return h * d_h + 2 * d_h + 2 * d_f, {
        "keys and values for every head (MHA, not MQA)": 3 * h * d_h + 2 * d_f,
        "one FFN matrix (the gate forgotten)": h * d_h + 2 * d_h + d_f,
        "the down projection counted too (it reads the FFN's hidden, not x)":
            h * d_h + 2 * d_h + 3 * d_f}


# The write-the-function exercise ----------------------------------------------------------

def _torch_swiglu(x, w_gate, w_up, w_down):
    """The oracle (used only where torch is installed): SwiGLU in torch, differentiated by autograd."""
    import torch

    return (torch.nn.functional.silu(x @ w_gate) * (x @ w_up)) @ w_down


@function_exercise("08.1", "your SwiGLU backward", "the section 'M3: the layer'",
                   "du = dm * SiLU(g), dg = dm * u * SiLU'(g); weight gradients sum over every row")
def _swiglu_backward():
    from refmath.ffn import swiglu_backward

    return dict(
        reference=swiglu_backward, case="swiglu[*", oracle=_torch_swiglu,
        slips={**catalogued("swiglu: du uses the gate's input, not SiLU of it", swiglu_backward),
               **catalogued("silu: product rule forgotten", swiglu_backward),
               **catalogued("swiglu: gate and up weight gradients swapped", swiglu_backward),
               **catalogued("swiglu: dx from the gate's path only", swiglu_backward)})
