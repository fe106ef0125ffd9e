r"""Lesson 10, what a generated token costs (``notebooks/10_decode_cost.py``): the expected value
and the known slips of each exercise, computed from the library and from the lesson's inputs."""
from __future__ import annotations

import numpy as np

from refmath.lessons.table import exercise, function_exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; nothing here is called by name.
__all__ = []


def _layer0_keys(params, config, tokens, rotated: bool = True,
                 normed: bool = True) -> np.ndarray:
    """Layer 0's cached keys after a prefill of 3 tokens and 3 decode steps (the lesson's run),
    or, as slips, the same keys before RoPE's rotation, or projected from the embeddings without
    the layer's RMSNorm (then rotated)."""
    from refmath.inference.kv_cache import decode_step, prefill
    from refmath.models import decoder
    from refmath.norms import rmsnorm_forward
    from refmath.positions import rope_forward

    tokens = np.asarray(tokens)
    if not (rotated and normed):
        u = params["tok_emb"][tokens]
        if normed:
            u, _ = rmsnorm_forward(u, params["layers.0.ln1.gamma"], config.norm_eps)
        raw = (u @ params["layers.0.attn.w_k"]).reshape(*tokens.shape, config.kv_heads, config.d_h)
        raw = raw.transpose(0, 2, 1, 3)
        return rope_forward(raw, base=config.rope_base)[0] if rotated else raw
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
            _layer0_keys(params, config, tokens, rotated=False),
        "no RMSNorm before W_K: a layer projects its normalised input, not the embeddings":
            _layer0_keys(params, config, tokens, normed=False)}


def _decode_inputs():
    """GQA, MQA and MHA caches of 3 sequences (one of them empty in the first), whose padding
    holds large numbers that must not be read."""
    draw = np.random.default_rng(3)
    inputs = []
    for heads, kv_heads, lengths in ((4, 2, [5, 2, 0]), (4, 1, [6, 3, 1]), (2, 2, [4, 6, 2])):
        k = draw.standard_normal((3, kv_heads, 6, 8))
        v = draw.standard_normal((3, kv_heads, 6, 8))
        for b, length in enumerate(lengths):
            k[b, :, length:], v[b, :, length:] = 50.0, -50.0
        inputs.append((draw.standard_normal((3, heads, 8)), k, v, np.array(lengths)))
    return inputs


@function_exercise("10.2", "your decode attention",
                   "the section 'K3: RoPE keys are cached after their rotation'",
                   "mask the rows at or past each length; query head r reads r // (H / G)")
def _decode_attention():
    from refmath.inference.decode import decode_attention

    def interleaved_heads(q, k_cache, v_cache, lengths):
        """A slip: query head r reads key/value head r % g instead of r // (h / g)."""
        heads = np.arange(q.shape[1]) % k_cache.shape[1]
        return decode_attention(q, k_cache[:, heads], v_cache[:, heads], lengths)

    def nan_for_empty(q, k_cache, v_cache, lengths):
        """A slip: a sequence with no key divides 0 by 0."""
        out = decode_attention(q, k_cache, v_cache, lengths)
        return np.where(np.asarray(lengths)[:, None, None] == 0, np.nan, out)

    return dict(
        reference=decode_attention, inputs=_decode_inputs, rtol=1e-12,
        slips={"the padding read: every sequence attends to all T_max rows":
                   lambda q, k, v, lengths: decode_attention(q, k, v, np.full(len(lengths), 6)),
               "no 1/sqrt(D) scale": lambda q, k, v, lengths:
                   decode_attention(q, k, v, lengths, scale=1.0),
               "GQA heads interleaved: head r reads r % g, not r // (h/g)": interleaved_heads,
               "an empty sequence gives NaN (0 / 0), not 0": nan_for_empty,
               "the mask t <= length: one padding row read, rows 0 .. L, not 0 .. L - 1":
                   lambda q, k, v, lengths: decode_attention(
                       q, k, v, np.minimum(np.asarray(lengths) + 1, k.shape[2]))})


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
          uses=())
def _seconds_per_token():
    from refmath.sizing import PRESETS, decode_step_traffic, decode_time_lower_bound

    # the lesson's model, Llama-3-8B's shape (its PRESETS entry), at t = 8192, batch 1, bf16
    traffic = decode_step_traffic(PRESETS["llama-3-8b"], context=8192)
    bound = decode_time_lower_bound(traffic, 2e12)
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


def _x_hat(x) -> tuple[np.ndarray, float]:
    """(x_hat, s): the lesson's x in one group of 4 bits, quantised and dequantised by the
    library."""
    from refmath.inference.quantized import dequantize, quantize

    packed = quantize(x, bits=4, group_size=4)
    return dequantize(packed), float(packed.scales[0])


def _x_hat_of_scale_8(x, largest_code: int) -> np.ndarray:
    """10.5a's slip carried on: x_hat with s = max |x| / 8, codes clipped to +-largest_code."""
    s = np.max(np.abs(x)) / 8
    return s * np.clip(np.round(x / s), -largest_code, largest_code)


@exercise("10.5b", "x_hat", _K12, "x_hat = s clip(round(x / s), -7, 7)", uses=("x",), rtol=0.0)
def _quantised_x(x):
    x_hat, s = _x_hat(x)
    return x_hat, {"the codes c, not x_hat = s c": x_hat / s,
                   "x_hat from the scale max |x| / 8 (not / 7), codes up to 8":
                       _x_hat_of_scale_8(x, 8),
                   "x_hat from the scale max |x| / 8 (not / 7), codes clipped to -7 .. 7":
                       _x_hat_of_scale_8(x, 7)}


@exercise("10.5c", "the error |x - x_hat|, at most half a step", _K12,
          "|x - x_hat| element by element, with your x_hat of 10.5b", uses=("x",))
def _quantisation_error(x):
    # compared with the error of the library's x_hat, not with the bound s / 2 alone: an x_hat
    # of a wrong scale can stay within half of the right step (s = max |x| / 8 does here)
    x_hat, s = _x_hat(x)
    error = np.abs(x - x_hat)
    assert np.all(error <= s / 2), "rounding to the nearest code is off by at most half a step"
    return error, {"the signed error x - x_hat, not its size |x - x_hat|": x - x_hat,
                   "the error of the codes, |x / s - c|: divide by s no more": error / s,
                   "the bound s / 2 for every element, not the error itself":
                       np.full_like(error, s / 2),
                   "x_hat from the scale max |x| / 8 (not / 7), codes up to 8":
                       np.abs(x - _x_hat_of_scale_8(x, 8)),
                   "x_hat from the scale max |x| / 8 (not / 7), codes clipped to -7 .. 7":
                       np.abs(x - _x_hat_of_scale_8(x, 7))}


_BANDWIDTH_LAW = "the section 'The bandwidth law, measured: fewer bytes per weight'"


def _weight_bytes_per_token(config, per_weight: float, whole_table: bool = False,
                            rest: bool = True, head_f32: bool = False) -> float:
    """Bytes of weights one decode step of refmath's decoder with ``config`` reads, as
    ``generate(..., weights=...)`` stores them
    (:func:`refmath.inference.layer_formats.stored_model`): the layers' seven matrices
    (:data:`refmath.inference.layer_formats.LAYER_MATRICES`) and the output head's ``d V`` weights
    at ``per_weight`` bytes each, every other parameter in float32, of the embedding table one row
    (the token's; a tied head is a rounded copy, so the lookup still reads one float32 row);
    counted from the model's parameter shapes. The slips: the whole table counted
    (``whole_table``), the float32 rest left out (``not rest``), the head left in float32
    (``head_f32``; a tied one then is the float32 table, read whole by the head's product)."""
    from refmath.inference.layer_formats import LAYER_MATRICES
    from refmath.models import decoder

    def is_layer(name):
        return name.rsplit(".", 1)[-1] in LAYER_MATRICES

    shapes = decoder.param_shapes(config)
    vocab, width = shapes["tok_emb"]
    head = vocab * width  # W_out, d x V: lm_head, or the tied table's rounded copy
    layers = sum(int(np.prod(s)) for k, s in shapes.items() if is_layer(k))
    others = sum(int(np.prod(s)) for k, s in shapes.items()
                 if not is_layer(k) and k not in ("tok_emb", "lm_head"))  # the gains
    read_of_table = vocab * width if whole_table else width
    if head_f32 and config.tie_embeddings:
        read_of_table = 0  # the head's product reads the whole float32 table, counted as the head
    stored = layers * per_weight + (4 if head_f32 else per_weight) * head
    return stored + (4 * (others + read_of_table) if rest else 0)


@exercise("10.6", "weight bytes a token reads in Q8_0", _BANDWIDTH_LAW,
          "L (2 d h d_h + 2 d g d_h + 3 d d_f) + d V weights (the layers' and the head's) at "
          "34/32 bytes each (32 int8 codes and one 2-byte scale per block), plus 4 bytes for each "
          "of the (2L + 1) d gains and the d numbers of one embedding row",
          uses=("small_config",))
def _q8_bytes_per_token(small_config):
    from refmath.weight_formats import bytes_per_weight

    def read(per_weight, **slip):
        return _weight_bytes_per_token(small_config, per_weight, **slip)

    q8 = bytes_per_weight("q8_0")  # 34 / 32: Q8_0_BLOCK's bytes over the 32 weights it holds
    return read(q8), {
        "1 byte a weight: the float16 scale of each block of 32 forgotten": read(1.0),
        "8.5 a weight: bits, not bytes": read(8 * q8),
        "3 bytes a weight: the 2-byte scale counted for every weight, not once per block of 32":
            read(3.0),
        "the head left in float32: generate stores it in Q8_0 too, as the layers":
            read(q8, head_f32=True),
        "the float32 gains and embedding row left out": read(q8, rest=False),
        "the whole embedding table counted: a token reads one row of it": read(q8, whole_table=True),
        "4 bytes a weight: the layers and the head left in float32": read(bytes_per_weight("f32")),
    }


@exercise("10.7", "the bound in tokens/s in Q8_0", _BANDWIDTH_LAW,
          "tokens/s <= bandwidth / bytes read per token, with your bytes of 10.6",
          uses=("small_config", "given_bandwidth"))
def _q8_bound(small_config, given_bandwidth):
    from refmath.weight_formats import bytes_per_weight

    q8 = _weight_bytes_per_token(small_config, bytes_per_weight("q8_0"))
    return given_bandwidth / q8, {
        "seconds per token (bytes / bandwidth), not tokens per second": q8 / given_bandwidth,
        "the float32 model's bound":
            given_bandwidth / _weight_bytes_per_token(small_config, bytes_per_weight("f32")),
        "1 byte a weight: the scales forgotten":
            given_bandwidth / _weight_bytes_per_token(small_config, 1.0),
        "bits per second over bytes: 8 times too many tokens": 8 * given_bandwidth / q8,
    }
