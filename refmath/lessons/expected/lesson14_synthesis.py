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


def _mha_twin(params, tokens, config, heads):
    """The logits of the MHA twin whose query head r reads the columns of shared head
    ``heads[r]`` of each layer's w_k and w_v (a list of heads, or "columns": each column repeated
    h/g times in place)."""
    import dataclasses

    from refmath.models import decoder

    d, g, d_h = config.d_model, config.kv_heads, config.d_h
    twin = dict(params)
    for layer in range(config.n_layers):
        for w in ("w_k", "w_v"):
            name = f"layers.{layer}.attn.{w}"
            if isinstance(heads, str):
                twin[name] = np.repeat(params[name], config.n_heads // g, axis=1)
            else:
                twin[name] = params[name].reshape(d, g, d_h)[:, heads].reshape(d, -1)
    return decoder.logits(twin, tokens, dataclasses.replace(config, n_kv_heads=config.n_heads))


@exercise("14.2", "MHA twin of the GQA decoder", "the section 'From the Transformer to an LLM: "
          "what each change acts on'", "head r of the twin reads shared head gqa_head_map(h, g)[r]",
          uses=("params", "tokens", "config"), rtol=1e-10, atol=1e-12)
def _mha_twin_logits(params, tokens, config):
    from refmath.models import decoder

    h, g = config.n_heads, config.kv_heads
    # the twin is the same function: its logits are the GQA decoder's
    return decoder.logits(params, tokens, config), {
        "the shared heads interleaved (np.tile): query head r reads shared head r mod g, where "
        "it should read r // (h/g)": _mha_twin(params, tokens, config, np.arange(h) % g),
        "each column repeated on its own (np.repeat on axis 1), not each head's block of d_h "
        "columns": _mha_twin(params, tokens, config, "columns")}


@exercise("14.3", "bound on the speed-up", "the section 'The cost of one decode step, all "
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
