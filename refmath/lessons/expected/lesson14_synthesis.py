r"""Lesson 14, one modern decoder, every piece (``notebooks/14_synthesis.py``): the expected value
and the known slips of each exercise, computed from the library and from the lesson's inputs."""
from __future__ import annotations

import numpy as np

from refmath.lessons.checks import catalogued
from refmath.lessons.table import exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; nothing here is called by name.
__all__ = []


@exercise("14.1", "logits of the whole decoder", "the section 'The recurrence'",
          "rotate Q and K after splitting heads; values are never rotated",
          uses=("params", "tokens", "config"), rtol=1e-10, atol=1e-12)
def _decoder_logits(params, tokens, config):
    from refmath.models import decoder

    return decoder.logits(params, tokens, config), catalogued(
        "sdpa: the 1/sqrt(d_k) scale missing from the scores",
        lambda: decoder.logits(params, tokens, config))


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
