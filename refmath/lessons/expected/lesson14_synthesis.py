r"""Lesson 14, one modern decoder, every piece (``notebooks/14_synthesis.py``): the expected value
and the known slips of each exercise, computed from the library and from the lesson's inputs."""
from __future__ import annotations

import dataclasses

import numpy as np

from refmath.lessons.checks import catalogued
from refmath.lessons.table import exercise, function_exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; the lesson imports only the
# reference and slips of 14.3 by name, after its exercise (its check cell is a check_function call).
__all__ = ["cache_bytes_reference", "cache_bytes_scales_left_out", "cache_bytes_with_float32_scales"]


def _decoder_inputs():
    """The lesson's model and tokens (config, init_params(seed=0), default_rng(0)'s tokens), and an
    MQA model of one layer on one shorter sequence: ``(params, tokens, config)`` each."""
    from refmath.models.decoder import DecoderConfig, init_params

    lesson = DecoderConfig(vocab_size=32, max_seq_len=16, d_model=32, n_layers=2, n_heads=4,
                           n_kv_heads=2, ffn_multiple_of=16)
    mqa = DecoderConfig(vocab_size=32, max_seq_len=16, d_model=32, n_layers=1, n_heads=4,
                        n_kv_heads=1, ffn_multiple_of=16)
    return [(init_params(lesson, seed=0), np.random.default_rng(0).integers(0, 32, (2, 7)), lesson),
            (init_params(mqa, seed=1), np.random.default_rng(1).integers(0, 32, (1, 5)), mqa)]


def _logits_without_final_norm(params, tokens, config):
    """A slip: the logits of the last layer's output itself, RMSNorm_final left out (the library's
    decoder with its final norm, and only that one, made the identity)."""
    from unittest import mock

    from refmath.models import decoder

    norm = decoder.norm_forward
    def skip_final(x, p, name, c):
        return (x, None) if name == "ln_f" else norm(x, p, name, c)

    with mock.patch.object(decoder, "norm_forward", skip_final):
        return decoder.logits(params, tokens, config)


@function_exercise("14.1", "logits of the whole decoder", "the section 'The recurrence'",
                   "rotate Q and K after splitting heads; values are never rotated")
def _decoder_logits():
    from refmath.models import decoder

    # the library's decoder is the reference; its other ways in are refused as well
    return dict(reference=decoder.logits, inputs=_decoder_inputs, rtol=1e-10,
                reference_name="refmath's decoder.logits",
                refuse=(decoder.decoder_logits, decoder.decoder_forward, decoder.forward,
                        decoder.layer_forward, decoder.block_forward, decoder.head),
                slips={**catalogued("sdpa: the 1/sqrt(d_k) scale missing from the scores",
                                    decoder.logits),
                       "the final RMSNorm forgotten: the logits come from RMSNorm_final(H^(L))":
                           _logits_without_final_norm})


def cache_bytes_reference(shape, context, batch, bits=None):
    """Exercise 14.3's reference: the KV-cache bytes a decode step reads, from
    :func:`refmath.sizing.decode_step_traffic` (bf16) or
    :func:`refmath.sizing.quantized_kv_cache_bytes` (``bits`` bits in groups of 32, a 2-byte scale
    each), the window's last ``w`` tokens only on a sliding-window shape."""
    from refmath.sizing import decode_step_traffic

    if bits is None:
        return decode_step_traffic(shape, context, batch).cache_bytes
    return _quantized(shape, context, batch, bits).total


def _quantized(shape, context, batch, bits):
    from refmath.sizing import quantized_kv_cache_bytes

    kept = min(context, shape.sliding_window or context)
    return quantized_kv_cache_bytes(batch, shape.n_layers, kept, shape.kv_heads, shape.head_dim,
                                    bits=bits, group_size=32)


def cache_bytes_scales_left_out(shape, context, batch, bits=None):
    """A slip of 14.3: the quantised payload alone, without the scales."""
    if bits is None:
        return cache_bytes_reference(shape, context, batch)
    return _quantized(shape, context, batch, bits).payload


def cache_bytes_with_float32_scales(shape, context, batch, bits=None):
    """A slip of 14.3: one 4-byte (float32) scale per group of 32, where refmath's are 2 bytes."""
    if bits is None:
        return cache_bytes_reference(shape, context, batch)
    quantized = _quantized(shape, context, batch, bits)
    return quantized.payload + 2 * quantized.scales


def _twin_w_k(params, config, heads):
    """Layer 0's w_k of the MHA twin whose query head r reads the columns of shared head
    ``heads[r]`` (a list of heads, or "columns": each column repeated h/g times in place)."""
    w, d, g, d_h = params["layers.0.attn.w_k"], config.d_model, config.kv_heads, config.d_h
    if isinstance(heads, str):
        return np.repeat(w, config.n_heads // g, axis=1)
    return w.reshape(d, g, d_h)[:, heads].reshape(d, -1)


@exercise("14.2", "layer 0's w_k of the MHA twin", "the section 'From the Transformer to an LLM: "
          "what each change acts on'", "head r of the twin reads shared head gqa_head_map(h, g)[r]",
          uses=("params", "config"))
def _mha_twin_w_k(params, config):
    from refmath.attention import gqa_head_map

    h, g = config.n_heads, config.kv_heads
    return _twin_w_k(params, config, gqa_head_map(h, g)), {
        "the shared heads interleaved (np.tile): query head r reads shared head r mod g, where "
        "it should read r // (h/g)": _twin_w_k(params, config, np.arange(h) % g),
        "each column repeated on its own (np.repeat on axis 1), not each head's block of d_h "
        "columns": _twin_w_k(params, config, "columns"),
        "w_k left as it was: g heads, not h": params["layers.0.attn.w_k"]}


@exercise("14.4", "bound on the speed-up", "the section 'The cost of one decode step, all "
          "together'", "the sum of weights and cache for MHA, over the same sum for int4 GQA",
          uses=("batch", "context"))
def _speedup_bound(batch, context):
    gqa_weights = 2 * 7_504_658_432  # bf16 weights a GQA step multiplies by (lesson 10)
    mha_weights = gqa_weights + 2 * 32 * 2 * 4096 * (32 - 8) * 128  # wider W_K, W_V in 32 layers
    mha_cache = batch * context * 2 * 32 * 32 * 128 * 2  # 2 B T L g d_h b with g = 32
    int4_payload = batch * context * 2 * 32 * 8 * 128 * 4 / 8
    int4_cache = int4_payload + batch * context * 2 * 32 * 8 * 128 * 2 / 32  # and the scales
    return (mha_weights + mha_cache) / (gqa_weights + int4_cache), {
        "the caches alone: the weights are read at every step too": mha_cache / int4_cache,
        "the int4 cache without its scales (2 bytes per group of 32)":
            (mha_weights + mha_cache) / (gqa_weights + int4_payload),
        "the cache ratio upside down": (gqa_weights + int4_cache) / (mha_weights + mha_cache)}


@function_exercise("14.3", "your cache bytes",
                   "the section 'The cost of one decode step, all together'",
                   "2 B T' L g d_h numbers; T' = min(T, w); int: bits/8 a number plus 2 bytes a group")
def _cache_bytes():
    from refmath.sizing import PRESETS

    llama, mistral, gpt2 = PRESETS["llama-3-8b"], PRESETS["mistral-7b"], PRESETS["gpt2-small"]
    cache_inputs = [(dataclasses.replace(llama, kv_heads=32), 8192, 16), (llama, 8192, 16),
                    (llama, 8192, 16, 8), (llama, 8192, 16, 4), (mistral, 8192, 4),
                    (mistral, 2048, 4, 4), (gpt2, 1024, 1)]
    return dict(
        reference=cache_bytes_reference, inputs=cache_inputs, rtol=1e-12,
        reference_name="decode_step_traffic and quantized_kv_cache_bytes",
        slips={"K or V only: the factor 2 forgotten": lambda *args: cache_bytes_reference(*args) / 2,
               "the sliding window ignored": lambda shape, *rest: cache_bytes_reference(
                   dataclasses.replace(shape, sliding_window=None), *rest),
               "the query heads counted, not the key/value heads": lambda shape, *rest:
                   cache_bytes_reference(dataclasses.replace(shape, kv_heads=shape.n_heads), *rest),
               "the quantisation scales left out": cache_bytes_scales_left_out,
               "4-byte (float32) scales: refmath's are 2 bytes a group":
                   cache_bytes_with_float32_scales})
