r"""Lesson 10, what a generated token costs (``notebooks/10_decode_cost.py``): the expected value
and the known slips of each exercise, computed from the library and from the lesson's inputs."""
from __future__ import annotations

import numpy as np

from refmath.lessons.table import exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; nothing here is called by name.
__all__ = []


def _layer0_keys(params, config, tokens, rotated: bool = True) -> np.ndarray:
    """Layer 0's cached keys after a prefill of 3 tokens and 3 decode steps (the lesson's run),
    or the same keys before RoPE's rotation."""
    from refmath.inference.kv_cache import decode_step, prefill
    from refmath.models import decoder
    from refmath.norms import rmsnorm_forward

    tokens = np.asarray(tokens)
    if not rotated:
        u, _ = rmsnorm_forward(params["tok_emb"][tokens], params["layers.0.ln1.gamma"],
                               config.norm_eps)
        raw = (u @ params["layers.0.attn.w_k"]).reshape(*tokens.shape, config.kv_heads, config.d_h)
        return raw.transpose(0, 2, 1, 3)
    _, cache = prefill(decoder, params, config, tokens[:, :3])
    for t in range(3, tokens.shape[1]):
        decode_step(decoder, params, config, cache, tokens[:, t])
    return cache.layer(0)[0]


@exercise("10.1", "cached keys of layer 0", "the section 'K3: RoPE keys are cached after their "
          "rotation'", "rotate after splitting into heads, at positions 0..5",
          uses=("params", "config", "tokens"), atol=1e-15)
def _cached_keys(params, config, tokens):
    return _layer0_keys(params, config, tokens), {
        "the keys not rotated: the cache holds them after RoPE":
            _layer0_keys(params, config, tokens, rotated=False)}


@exercise("10.3", "visible pairs after a prefill of 5 and 3 steps", "the section 'K5: the prompt "
          "is quadratic, each new token linear'",
          "P (P + 1) / 2 for the prefill, then P + 1, P + 2, P + 3 for the steps",
          uses=("params", "config", "tokens"), rtol=0.0)
def _visible_pairs(params, config, tokens):
    from refmath.inference.kv_cache import decode_step, prefill
    from refmath.models import decoder

    _, cache = prefill(decoder, params, config, np.asarray(tokens)[:, :5])
    for t in range(3):
        decode_step(decoder, params, config, cache, np.array([t + 1]))
    total = cache.counts.visible[0]
    return total, {"the prefill's pairs only": 5 * 6 // 2,
                   "each step's query not counted against its own key": total - 3}


@exercise("10.4", "lower bound on time per token", "the section 'K13: decode is bound by memory "
          "bandwidth'", "weights are read once per step; add the whole cache",
          uses=("step",))
def _seconds_per_token(step):
    from refmath.sizing import decode_time_lower_bound

    bound = decode_time_lower_bound(step, 2e12)  # step: the lesson's traffic at t = 8192
    return bound, {"the cache forgotten: the weights alone": 2 * 7_504_658_432 / 2e12,
                   "the weights counted in 1 byte, not 2 (bf16)": bound - 7_504_658_432 / 2e12}


_K12 = "the section 'K12: a cache of small integers'"


@exercise("10.5a", "scale", _K12, "s = max |x| / q_max, q_max = 2^(q - 1) - 1 = 7 for 4 bits",
          uses=("x",), rtol=0.0)
def _quantiser_scale(x):
    from refmath.inference.quantized import quantize

    scale = quantize(x, bits=4, group_size=4).scales[0]
    return scale, {"max |x| / 8: the symmetric 4-bit range is -7 .. 7, not -8 .. 7": scale * 7 / 8,
                   "max |x| / 15: the 16 levels split over both signs": scale * 7 / 15}


@exercise("10.5b", "x_hat", _K12, "x_hat = s clip(round(x / s), -7, 7)", uses=("x",), rtol=0.0)
def _quantised_x(x):
    from refmath.inference.quantized import dequantize, quantize

    packed = quantize(x, bits=4, group_size=4)
    x_hat = dequantize(packed)
    return x_hat, {"the codes c, not x_hat = s c": x_hat / packed.scales[0]}
