"""The contiguous KV cache: prefill + decode equal full recomputation for every decoder model (K2),
cached rows are prefix invariant (K1), RoPE keys are cached rotated (K3), query-key pair counts (K4,
K5), MLA's absorbed and expanded paths and its latent cache (K8, K9), sampling, sizes, bad input."""
import dataclasses
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refmath import sizing
from refmath.attention import causal_attention_forward
from refmath.inference import generate as no_cache
from refmath.inference import kv_cache as kc
from refmath.inference.kv_cache import (
    KVCache,
    LatentCache,
    decode_step,
    generate_cached,
    generate_naive,
    prefill,
)
from refmath.models import common, decoder, gemma, gpt, mla
from refmath.norms import rmsnorm_forward
from refmath.positions import rope_forward
from _support import float32_rule

V, T_MAX = 13, 9
# init_std 0.3 instead of 0.02: logits of order 1 and attention weights far from uniform, so a key
# at the wrong position or a missing row changes the logits well above rounding.
CONFIGS = {
    "gpt-pre-tied": (gpt, gpt.GPTConfig(vocab_size=V, max_seq_len=T_MAX, n_layers=2, d_model=16,
                                        n_heads=4, d_ff=24, init_std=0.3)),
    "gpt-post-untied": (gpt, gpt.GPTConfig(vocab_size=V, max_seq_len=T_MAX, n_layers=2, d_model=12,
                                           n_heads=3, d_ff=20, norm_position="post",
                                           tie_embeddings=False, ffn="gelu",
                                           init_std=0.3)),
    "decoder-gqa": (decoder, decoder.DecoderConfig(vocab_size=V, max_seq_len=T_MAX, d_model=16,
                                                   n_layers=2, n_heads=4, n_kv_heads=2,
                                                   ffn_multiple_of=8, init_std=0.3)),
    "decoder-mqa-tied": (decoder, decoder.DecoderConfig(vocab_size=V, max_seq_len=T_MAX,
                                                        d_model=16, n_layers=2, n_heads=4,
                                                        n_kv_heads=1, head_dim=6,
                                                        tie_embeddings=True, ffn_multiple_of=8,
                                                        init_std=0.3)),
    "decoder-half-rope": (decoder, decoder.DecoderConfig(vocab_size=V, max_seq_len=T_MAX,
                                                         d_model=16, n_layers=1, n_heads=4,
                                                         n_kv_heads=2, ffn_multiple_of=8,
                                                         init_std=0.3,
                                                         rope_layout="half")),
    "mla": (mla, mla.MLAConfig(vocab_size=V, max_seq_len=T_MAX, d_model=16, n_layers=2, n_heads=4,
                               d_c=6, d_rope=4, ffn_multiple_of=8, init_std=0.3)),
    "mla-qlora-norms": (mla, mla.MLAConfig(vocab_size=V, max_seq_len=T_MAX, d_model=16,
                                           n_layers=2, n_heads=4, d_c=6, d_rope=4, head_dim=6,
                                           v_head_dim=5, q_lora_rank=8, latent_norm=True,
                                           ffn_multiple_of=8, init_std=0.3, rope_layout="half",
                                           latent_norm_eps=1e-3)),
}
# Sliding layers (A12): their caches keep only the window's rows, so every test of the contents
# above (which reads positions 0..T-1 back) would not apply; the tests below are theirs. Layers 0
# and 2 slide a window of 3 (Qwen2's window on some layers; Gemma 3's with their own RoPE base);
# "decoder-all-slide" slides every layer (Mistral).
WINDOWED = {
    "decoder-windows": (decoder, decoder.DecoderConfig(vocab_size=V, max_seq_len=T_MAX,
                                                       d_model=16, n_layers=3, n_heads=4,
                                                       n_kv_heads=2, ffn_multiple_of=8,
                                                       init_std=0.3, sliding_window=3,
                                                       window_layers=(True, False, True))),
    "gemma-windows": (gemma, gemma.GemmaConfig(vocab_size=V, max_seq_len=T_MAX, d_model=16,
                                               n_layers=3, n_heads=4, n_kv_heads=2, head_dim=4,
                                               d_ff=48, init_std=0.3, generation=3,
                                               windows=(3, None, 3), local_rope_base=100.0)),
    "decoder-all-slide": (decoder, decoder.DecoderConfig(vocab_size=V, max_seq_len=T_MAX,
                                                         d_model=16, n_layers=2, n_heads=4,
                                                         n_kv_heads=1, ffn_multiple_of=8,
                                                         init_std=0.3, sliding_window=4)),
}
# Every model, and for MLA each decode path.
MODEL_PATHS = [(name, "absorbed") for name in CONFIGS] + \
              [(name, "expanded") for name in CONFIGS if name.startswith("mla")]
RTOL = 1e-10  # float64: both sides differ only in the order of rounding


def setup(name, seed=0, dtype=np.float64):
    module, config = {**CONFIGS, **WINDOWED}[name]
    params = module.init_params(config, seed, dtype)
    rng = np.random.default_rng(seed + 100)
    for key, value in params.items():  # gains away from 1, so that a skipped norm would show
        if key.endswith(".gamma"):
            params[key] = (1.0 + 0.2 * rng.standard_normal(value.shape)).astype(dtype)
    return module, config, params


def random_tokens(shape, seed=0):
    return np.random.default_rng(seed).integers(0, V, shape)


def model_cache(module, params, config, tokens):
    """The training-style forward's cache (no dropout), whose layers hold every row's k, v."""
    batch = {"tokens": tokens, "targets": tokens}
    return module.forward(params, batch, config)[1]


# ---- K2: cached decode equals recomputing the full prefix ----------------------------------------


@pytest.mark.parametrize("name, path", MODEL_PATHS)
def test_prefill_then_decode_equals_full_recomputation_k2(name, path):
    module, config, params = setup(name)
    tokens = random_tokens((2, T_MAX), seed=1)
    p = 3
    z, cache = prefill(module, params, config, tokens[:, :p], all_logits=True, mla_path=path)
    np.testing.assert_allclose(z, module.logits(params, tokens[:, :p], config), rtol=RTOL, atol=0)
    for t in range(p, T_MAX):
        z_t = decode_step(module, params, config, cache, tokens[:, t], mla_path=path)
        assert cache.length == t + 1
        # The model's own logits on the whole prefix 0..t, recomputed from scratch.
        expected = module.logits(params, tokens[:, :t + 1], config)[:, -1]
        np.testing.assert_allclose(z_t, expected, rtol=RTOL, atol=0)


@pytest.mark.parametrize("name", ["gpt-pre-tied", "decoder-gqa", "mla"])
def test_prefill_last_position_and_unbatched_input(name):
    module, config, params = setup(name)
    tokens = random_tokens((1, 5), seed=2)
    z_last, _ = prefill(module, params, config, tokens)
    assert z_last.shape == (1, V)
    z_one, cache = prefill(module, params, config, tokens[0])  # (P,): one sequence, no batch axis
    assert z_one.shape == (V,) and cache.batch == 1
    np.testing.assert_array_equal(z_one, z_last[0])
    z_next = decode_step(module, params, config, cache, int(tokens[0, 0]))
    assert z_next.shape == (V,)
    expected = module.logits(params, np.append(tokens[0], tokens[0, 0])[None], config)[0, -1]
    np.testing.assert_allclose(z_next, expected, rtol=RTOL, atol=0)


@settings(max_examples=20, deadline=None)
@given(p=st.integers(1, T_MAX), steps=st.integers(0, T_MAX), seed=st.integers(0, 10**6))
def test_any_prompt_length_and_steps_decoder(p, steps, seed):
    module, config, params = setup("decoder-gqa")
    steps = min(steps, T_MAX - p)
    tokens = random_tokens((1, p + steps), seed)
    z, cache = prefill(module, params, config, tokens[:, :p])
    for t in range(p, p + steps):
        z = decode_step(module, params, config, cache, tokens[:, t])
    np.testing.assert_allclose(z, module.logits(params, tokens, config)[:, -1], rtol=RTOL, atol=0)


def test_gpt_with_banded_layers_decodes_past_its_window_k2():
    """GPT-3's alternating dense and banded layers through the cache (window 3, an example: the
    paper publishes no band width). A prompt of 5 tokens, longer than the window, then decode steps
    up to T_MAX: every step's logits are the model's own on the whole prefix, so the banded layer
    reads only its last 3 keys while the learned positions stay absolute; greedy generation gives
    the same tokens with the cache as with the model's training-style logits and no cache."""
    _, config, params = setup("gpt-pre-tied")
    config = dataclasses.replace(config, sliding_window=3, window_layers=(False, True))
    dense = dataclasses.replace(config, sliding_window=None, window_layers=None)
    tokens = random_tokens((2, T_MAX), seed=21)
    p = 5
    z, cache = prefill(gpt, params, config, tokens[:, :p], all_logits=True)
    np.testing.assert_allclose(z, gpt.logits(params, tokens[:, :p], config), rtol=RTOL, atol=0)
    for t in range(p, T_MAX):
        z = decode_step(gpt, params, config, cache, tokens[:, t])
        np.testing.assert_allclose(z, gpt.logits(params, tokens[:, :t + 1], config)[:, -1],
                                   rtol=RTOL, atol=0)
    assert not np.allclose(z, gpt.logits(params, tokens, dense)[:, -1])  # the band is in effect

    # Per sequence and head: the prefill's 5 x 5 mask leaves 15 causal pairs on the dense layer
    # and 1 + 2 + 3 + 3 + 3 = 12 in the band; decode steps at 6..9 positions add 6 + 7 + 8 + 9 = 30
    # and 3 each, 12.
    prompt, n_new = tokens[:, :p], T_MAX - p + 1  # positions up to max_seq_len are fed
    cached = generate_cached(gpt, params, config, prompt, n_new, greedy=True)
    assert cached.counts.visible == [15 + 30, 12 + 12]
    expected = no_cache.generate(gpt, params, config, prompt, n_new, greedy=True, cache=False)
    np.testing.assert_array_equal(cached.tokens, expected)

    # One banded layer: the last logits read the last 3 tokens only, at their own positions
    # 6..8 of the table; the same 3 tokens at positions 0..2 give other logits.
    one = dataclasses.replace(config, n_layers=1, window_layers=None)
    params = gpt.init_params(one, seed=3)
    z, cache = prefill(gpt, params, one, tokens[:, :p])
    for t in range(p, T_MAX):
        z = decode_step(gpt, params, one, cache, tokens[:, t])
    other = tokens.copy()
    other[:, :T_MAX - 3] = (other[:, :T_MAX - 3] + 1) % V  # every token before the window changed
    np.testing.assert_allclose(z, gpt.logits(params, other, one)[:, -1], rtol=RTOL, atol=0)
    assert not np.allclose(z, gpt.logits(params, tokens[:, -3:], one)[:, -1])


# ---- K1: prefix invariance of the cached rows ----------------------------------------------------


def stored(cache):
    """The filled rows of every layer's two cached arrays."""
    return [cache.layer(i) for i in range(cache.n_layers)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cached_rows_are_prefix_invariant_k1(name):
    module, config, params = setup(name)
    tokens = random_tokens((2, T_MAX), seed=3)
    p = 4
    _, short = prefill(module, params, config, tokens[:, :p])
    _, decoded = prefill(module, params, config, tokens[:, :p])
    for t in range(p, T_MAX):
        decode_step(module, params, config, decoded, tokens[:, t])
    _, full = prefill(module, params, config, tokens)
    for (a_short, b_short), (a_dec, b_dec), (a_full, b_full) in zip(
            stored(short), stored(decoded), stored(full)):
        # Appending tokens does not change the first p rows (the position axis is -2) ...
        np.testing.assert_allclose(a_full[..., :p, :], a_short, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(b_full[..., :p, :], b_short, rtol=1e-12, atol=1e-15)
        # ... and rows written one decode step at a time equal rows from one prefill pass.
        np.testing.assert_allclose(a_dec, a_full, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(b_dec, b_full, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cache_equals_the_models_own_keys_and_values(name):
    module, config, params = setup(name)
    tokens = random_tokens((2, 6), seed=4)
    _, cache = prefill(module, params, config, tokens)
    train_cache = model_cache(module, params, config, tokens)
    if module is gpt:
        # mha_forward's attention cache holds k, v per query head (g = h in GPT).
        expected = [(layer.attn.branch.attn.k, layer.attn.branch.attn.v)
                    for layer in train_cache.layers]
    elif module is decoder:
        expected = decoder.layer_kv(train_cache)
    else:
        expected = mla.layer_latents(train_cache)
    for (a, b), (a_ref, b_ref) in zip(stored(cache), expected):
        np.testing.assert_allclose(a, a_ref, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(b, b_ref, rtol=1e-12, atol=1e-15)


# ---- K3: RoPE keys are cached rotated at their own positions -------------------------------------


def test_rope_keys_cached_rotated_at_their_positions_k3():
    module, config, params = setup("decoder-gqa")
    tokens = random_tokens((2, 7), seed=5)
    _, cache = prefill(module, params, config, tokens[:, :2])
    for t in range(2, 7):
        decode_step(module, params, config, cache, tokens[:, t])
    # Layer 0's keys by hand: RMSNorm of the embeddings, W_K, split into g heads, then each row
    # rotated by its own position j alone.
    u, _ = rmsnorm_forward(params["tok_emb"][tokens], params["layers.0.ln1.gamma"], config.norm_eps)
    k = (u @ params["layers.0.attn.w_k"]).reshape(2, 7, config.kv_heads, config.d_h)
    k = k.transpose(0, 2, 1, 3)
    keys = cache.layer(0)[0]
    for j in range(7):
        rotated, _ = rope_forward(k[:, :, j:j + 1], offset=j, base=config.rope_base)
        np.testing.assert_allclose(keys[:, :, j:j + 1], rotated, rtol=1e-12, atol=1e-15)
        if j:  # the rotation is really there: the unrotated key differs
            assert not np.allclose(keys[:, :, j], k[:, :, j], rtol=1e-3)


def test_mla_rotary_key_cached_rotated_at_its_position_k3_k9():
    module, config, params = setup("mla")
    tokens = random_tokens((1, 5), seed=6)
    _, cache = prefill(module, params, config, tokens[:, :1])
    for t in range(1, 5):
        decode_step(module, params, config, cache, tokens[:, t])
    u, _ = rmsnorm_forward(params["tok_emb"][tokens], params["layers.0.ln1.gamma"], config.norm_eps)
    c, k_r = cache.layer(0)
    np.testing.assert_allclose(c, u @ params["layers.0.attn.w_dkv"], rtol=1e-12, atol=1e-15)
    expected, _ = rope_forward(u @ params["layers.0.attn.w_kr"], positions=np.arange(5),
                               base=config.rope_base)
    np.testing.assert_allclose(k_r, expected, rtol=1e-12, atol=1e-15)


# ---- K8, K9: MLA absorbed = expanded, and the cache holds only c and k^R -------------------------


@pytest.mark.parametrize("name", ["mla", "mla-qlora-norms"])
def test_mla_absorbed_and_expanded_decode_are_equal_k8(name):
    module, config, params = setup(name)
    tokens = random_tokens((2, T_MAX), seed=7)
    z_abs, absorbed = prefill(module, params, config, tokens[:, :2], all_logits=True)
    z_exp, expanded = prefill(module, params, config, tokens[:, :2], all_logits=True,
                              mla_path="expanded")
    np.testing.assert_allclose(z_abs, z_exp, rtol=RTOL, atol=0)
    for t in range(2, T_MAX):
        z_abs = decode_step(module, params, config, absorbed, tokens[:, t], mla_path="absorbed")
        z_exp = decode_step(module, params, config, expanded, tokens[:, t], mla_path="expanded")
        np.testing.assert_allclose(z_abs, z_exp, rtol=RTOL, atol=0)
    # Both paths store the same latents: what is cached does not depend on how it is read. Layer 0
    # reads only the embeddings, so it matches bit for bit; deeper layers see the previous layer's
    # outputs, which the two paths round differently.
    for layer, ((c_a, r_a), (c_e, r_e)) in enumerate(zip(stored(absorbed), stored(expanded))):
        tol = dict(rtol=0, atol=0) if layer == 0 else dict(rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(c_a, c_e, **tol)
        np.testing.assert_allclose(r_a, r_e, **tol)


def test_mla_cache_holds_only_latents_and_the_shared_rotary_key_k9():
    module, config, params = setup("mla-qlora-norms")
    _, cache = prefill(module, params, config, random_tokens((3, 4)))
    assert isinstance(cache, LatentCache)
    arrays = [f.name for f in dataclasses.fields(cache) if isinstance(getattr(cache, f.name),
                                                                       np.ndarray)]
    assert arrays == ["rows"]
    L, d_c, d_r = config.n_layers, config.d_c, config.d_rope
    assert cache.rows.shape == (L, 3, T_MAX, d_c + d_r)  # no head axis: one row per token and layer
    assert cache.latents.shape == (L, 3, T_MAX, d_c) and cache.rope_keys.shape == (L, 3, T_MAX, d_r)
    assert np.shares_memory(cache.latents, cache.rows) and np.shares_memory(cache.rope_keys,
                                                                            cache.rows)


# ---- K6/K9 sizes: the cache's bytes are the sizing formulas --------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cache_bytes_equal_sizing_formulas(name, dtype):
    module, config, _ = setup(name)
    batch, b = 3, np.dtype(dtype).itemsize
    cache = kc.empty_cache(module, config, batch, dtype)
    if module is mla:
        expected = sizing.mla_cache_bytes(batch, config.n_layers, config.max_seq_len, config.d_c,
                                          config.d_rope, b)
    elif module is gpt:  # every head keeps its keys and values: g = h
        expected = sizing.kv_cache_bytes(batch, config.n_layers, config.max_seq_len,
                                         config.n_heads, config.d_h, b)
    else:
        expected = sizing.kv_cache_bytes(batch, config.n_layers, config.max_seq_len,
                                         config.kv_heads, config.d_h, b)
    assert cache.nbytes == expected
    if module is decoder:  # g heads stored, not h
        assert cache.keys[0].shape[1] == config.kv_heads < config.n_heads


# ---- K4, K5: counting query-key pairs ------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, T_MAX])
def test_naive_and_cached_generation_pair_counts_k4(n):
    module, config, params = setup("gpt-pre-tied")
    prompt = random_tokens((1, 1), seed=8)  # a 1-token prompt; n positions pass through the model
    naive = generate_naive(module, params, config, prompt, n, greedy=True)
    cached = generate_cached(module, params, config, prompt, n, greedy=True)
    L = config.n_layers
    # Per sequence, query head and layer. Naive: step t recomputes t x t scores (the masked half
    # included), sum t^2; the causal half alone would be sum t(t+1)/2 = n(n+1)(n+2)/6.
    assert naive.counts.scores == [n * (n + 1) * (2 * n + 1) // 6] * L
    assert naive.counts.visible == [n * (n + 1) * (n + 2) // 6] * L
    # Cached: position t (1-based) is one query against t keys, sum t, all visible.
    assert cached.counts.scores == cached.counts.visible == [n * (n + 1) // 2] * L
    np.testing.assert_array_equal(naive.tokens, cached.tokens)


@pytest.mark.parametrize("name, path", MODEL_PATHS)
def test_every_model_counts_its_pairs_k4(name, path):
    module, config, params = setup(name)
    n = 6
    prompt = random_tokens((2, 1), seed=9)
    naive = generate_naive(module, params, config, prompt, n, greedy=True, mla_path=path)
    cached = generate_cached(module, params, config, prompt, n, greedy=True, mla_path=path)
    assert naive.counts.scores == [n * (n + 1) * (2 * n + 1) // 6] * config.n_layers
    assert cached.counts.scores == [n * (n + 1) // 2] * config.n_layers


@pytest.mark.parametrize("p", [1, 4, T_MAX - 1])
def test_prefill_and_decode_step_pair_counts_k5(p):
    module, config, params = setup("decoder-gqa")
    _, cache = prefill(module, params, config, random_tokens((2, p), seed=10))
    assert cache.counts.visible == [p * (p + 1) // 2] * config.n_layers  # causal pairs, O(P^2)
    assert cache.counts.scores == [p * p] * config.n_layers  # the dense P x P score matrix
    decode_step(module, params, config, cache, np.array([0, 1]))
    # The step at 0-based position p reads p + 1 keys with one query: O(t) pairs.
    assert cache.counts.visible == [p * (p + 1) // 2 + p + 1] * config.n_layers
    assert cache.counts.scores == [p * p + p + 1] * config.n_layers


# ---- generation: same tokens with and without the cache ------------------------------------------


def reference_logits(module, params, config, tokens, n_prompt):
    """The model's own logits, recomputing the whole prefix for every generated position."""
    return np.stack([module.logits(params, tokens[:, :t], config)[:, -1]
                     for t in range(n_prompt, tokens.shape[1])], axis=1)


SAMPLING = {
    "greedy": dict(greedy=True),
    "seeded": dict(temperature=0.8, seed=5),
    "seeded-top-k-top-p": dict(temperature=1.3, top_k=5, top_p=0.9, seed=7),
}


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("name, path", MODEL_PATHS)
def test_cached_generation_gives_the_same_tokens(name, path, sampling):
    module, config, params = setup(name)
    prompt = random_tokens((2, 2), seed=11)
    n_new = T_MAX - 1  # positions up to max_seq_len are fed
    # The no-cache generator of refmath.inference.generate, on the model's own logits.
    expected = no_cache.generate(module, params, config, prompt, n_new, **SAMPLING[sampling])
    for generator in (generate_cached, generate_naive):
        out = generator(module, params, config, prompt, n_new, mla_path=path, **SAMPLING[sampling])
        np.testing.assert_array_equal(out.tokens, expected)
        reference = reference_logits(module, params, config, expected, n_prompt=2)
        np.testing.assert_allclose(out.logits, reference, rtol=RTOL, atol=0)


def test_generation_with_one_unbatched_prompt_and_a_generator_seed():
    module, config, params = setup("decoder-gqa")
    prompt = random_tokens(3, seed=12)
    out = generate_cached("llama", params, config, prompt, 4, temperature=0.7,
                          seed=np.random.default_rng(1))
    assert out.tokens.shape == (7,) and out.logits.shape == (4, V)
    expected = no_cache.generate("llama", params, config, prompt, 4, temperature=0.7,
                                 seed=np.random.default_rng(1))
    np.testing.assert_array_equal(out.tokens, expected)


@pytest.mark.parametrize("name", ["gpt-pre-tied", "decoder-gqa", "mla"])
def test_a_generation_splits_its_parameters_once_whatever_its_length(name, monkeypatch):
    """generate_cached and generate's cached loop split each layer's parameters (sub_params) as
    often as one prefill does, however many tokens follow it (SplitParams), and give the logits
    that stepping with the plain dict, split afresh at every step, gives."""
    module, config, params = setup(name)
    prompt = random_tokens((2, 2), seed=13)
    splits = []
    scan = common._entries_under
    monkeypatch.setattr(common, "_entries_under",
                        lambda p, prefix: splits.append(prefix) or scan(p, prefix))
    prefill(module, common.SplitParams(params), config, prompt)
    one_prefill = len(splits)
    assert one_prefill >= config.n_layers
    for n_new in (2, T_MAX - 1):
        splits.clear()
        made = generate_cached(module, params, config, prompt, n_new, greedy=True)
        assert len(splits) == one_prefill
        splits.clear()
        no_cache.generate(module, params, config, prompt, n_new, greedy=True)
        assert len(splits) == one_prefill
    logits, cache = prefill(module, params, config, prompt)
    steps = [logits] + [decode_step(module, params, config, cache, token)
                        for token in made.tokens[:, 2:-1].T]
    np.testing.assert_array_equal(made.logits, np.stack(steps, axis=1))


# ---- lengths at the edges, float32 ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt-pre-tied", "decoder-gqa", "mla"])
def test_prompt_of_max_seq_len_minus_one_then_the_limit(name):
    module, config, params = setup(name)
    tokens = random_tokens((1, T_MAX), seed=12)
    _, cache = prefill(module, params, config, tokens[:, :-1])
    z = decode_step(module, params, config, cache, tokens[:, -1])
    np.testing.assert_allclose(z, module.logits(params, tokens, config)[:, -1], rtol=RTOL, atol=0)
    assert cache.length == config.max_seq_len
    with pytest.raises(ValueError, match=f"max_seq_len = {T_MAX}"):
        decode_step(module, params, config, cache, tokens[:, 0])
    assert cache.length == T_MAX  # the failed step changed nothing
    with pytest.raises(ValueError, match="max_seq_len"):
        prefill(module, params, config, random_tokens((1, T_MAX + 1)))
    with pytest.raises(ValueError, match="max_seq_len"):
        generate_cached(module, params, config, tokens[:, :3], T_MAX - 1)
    generate_cached(module, params, config, tokens[:, :3], T_MAX - 2)  # just fits


def test_prompt_of_one_token():
    module, config, params = setup("gpt-post-untied")
    tokens = random_tokens((2, 4), seed=13)
    z, cache = prefill(module, params, config, tokens[:, :1])
    assert cache.length == 1 and cache.counts.scores == [1] * config.n_layers
    np.testing.assert_allclose(z, module.logits(params, tokens[:, :1], config)[:, 0], rtol=RTOL,
                               atol=0)
    for t in range(1, 4):
        z = decode_step(module, params, config, cache, tokens[:, t])
    np.testing.assert_allclose(z, module.logits(params, tokens, config)[:, -1], rtol=RTOL, atol=0)


@pytest.mark.parametrize("name", ["gpt-pre-tied", "decoder-gqa", "mla"])
def test_float32_stays_float32(name):
    module, config, params = setup(name, dtype=np.float32)
    tokens = random_tokens((2, 5), seed=14)
    z, cache = prefill(module, params, config, tokens[:, :3])
    assert z.dtype == np.float32 and cache.dtype == np.float32
    for t in range(3, 5):
        z = decode_step(module, params, config, cache, tokens[:, t])
    assert z.dtype == np.float32
    # Both sides are float32 computations of the same function (eps 6e-8 per rounding, a few
    # hundred roundings deep): they agree far below the logits' size of order 1.
    np.testing.assert_allclose(z, module.logits(params, tokens, config)[:, -1], rtol=1e-5,
                               atol=1e-5)


def test_smaller_max_len():
    module, config, params = setup("decoder-gqa")
    cache = kc.empty_cache("llama", config, batch=1, max_len=2)
    decode_step(module, params, config, cache, 1)  # an empty cache: the step is a 1-token prefill
    decode_step(module, params, config, cache, 2)
    _, reference = prefill(module, params, config, [1, 2])
    np.testing.assert_allclose(cache.layer(1)[0], reference.layer(1)[0], rtol=1e-12, atol=1e-15)
    limit = r"limited to its max_len = 2 \(the model's max_seq_len = 9\)"
    with pytest.raises(ValueError, match=limit):
        decode_step(module, params, config, cache, 3)
    with pytest.raises(ValueError, match="max_len"):
        kc.empty_cache("llama", config, max_len=T_MAX + 1)


# ---- bad input -----------------------------------------------------------------------------------


def test_bad_token_ids():
    module, config, params = setup("decoder-gqa")
    _, cache = prefill(module, params, config, random_tokens((2, 3)))
    for bad in ([0, V], [-1, 0]):
        with pytest.raises(ValueError, match=r"token_id must lie in \[0, 13\)"):
            decode_step(module, params, config, cache, np.array(bad))
    with pytest.raises(TypeError, match="token_id must be an integer array"):
        decode_step(module, params, config, cache, np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="B = 2"):
        decode_step(module, params, config, cache, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="B = 2"):
        decode_step(module, params, config, cache, 3)  # one id for a batch of two
    with pytest.raises(ValueError, match="token_id must have 1 dimensions"):
        decode_step(module, params, config, cache, np.array([[0, 1]]))
    assert cache.length == 3  # nothing was appended
    with pytest.raises(ValueError, match="prompt_ids must lie in"):
        prefill(module, params, config, [[1, V]])


def test_bad_model_config_cache_and_options():
    module, config, params = setup("decoder-gqa")
    with pytest.raises(ValueError, match="model must be one of"):
        prefill("llama2", params, config, [1, 2])
    with pytest.raises(ValueError, match="has no KV-cache decoding"):
        prefill(np, params, config, [1, 2])
    with pytest.raises(TypeError, match="needs a GPTConfig"):
        prefill(gpt, params, config, [1, 2])
    with pytest.raises(ValueError, match="mla_path"):
        prefill(module, params, config, [1, 2], mla_path="fused")
    with pytest.raises(ValueError, match="missing"):
        prefill(module, {k: v for k, v in params.items() if k != "lm_head"}, config, [1, 2])
    _, mla_config, mla_params = setup("mla")
    _, latent = prefill(mla, mla_params, mla_config, [[1, 2]])
    with pytest.raises(TypeError, match="decodes with a KVCache"):
        decode_step(module, params, config, latent, [1])
    _, cache = prefill(module, params, config, [[1, 2]])
    params32 = {k: v.astype(np.float32) for k, v in params.items()}
    with pytest.raises(TypeError, match="the cache is float64 but params are float32"):
        decode_step(module, params32, config, cache, [1])
    other = dataclasses.replace(config, n_kv_heads=4)
    with pytest.raises(ValueError, match="do not fit the config"):
        decode_step(module, module.init_params(other), other, cache, [1])
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_naive(module, params, config, [[1]], 0)
    with pytest.raises(ValueError, match="temperature"):
        generate_cached(module, params, config, [[1]], 2, temperature=0.0)
    assert isinstance(cache, KVCache)


# ---- backends: the C++ kernels attend over the same cache ----------------------------------------

def test_backends_the_caches_cannot_take(monkeypatch):
    module, config, params = setup("decoder-gqa", dtype=np.float32)
    monkeypatch.setattr(kc.kernels, "cuda_available", lambda: False)
    with pytest.raises(ValueError, match="backend='cuda' keeps the cache on a GPU, and none can be "
                                         "used here: refmath._cuda"):
        prefill(module, params, config, random_tokens((1, 2)), backend="cuda")
    for backend in ("cpu", "cuda"):
        with pytest.raises(TypeError, match=f"backend='{backend}' runs the compiled kernels, which "
                                            f"take float32 caches: .* got float64"):
            prefill(module, setup("decoder-gqa")[2], config, random_tokens((1, 2)),
                    backend=backend)
    module, config, params = setup("mla", dtype=np.float32)
    with pytest.raises(ValueError, match="mla_path='expanded' needs backend='numpy'"):
        prefill(module, params, config, random_tokens((1, 2)), backend="cpu", mla_path="expanded")
    module, config, params = setup("gpt-pre-tied")
    with pytest.raises(ValueError, match="backend must be one of 'numpy', 'cpu', 'cuda', got 'gpu'"):
        generate_cached(module, params, config, random_tokens((1, 2)), 2, backend="gpu")


# ---- backend="cuda": the cache in GPU memory -----------------------------------------------------

def skip_cuda(reason):
    """A skip for want of CUDA, which is a failure under REFMATH_REQUIRE_GPU=1 (set by
    benchmarks/gpu_check.sh, as for tests/test_kernels_cuda.py)."""
    if os.environ.get("REFMATH_REQUIRE_GPU", "").strip().lower() in ("1", "true", "yes", "on"):
        pytest.fail(f"REFMATH_REQUIRE_GPU=1, but {reason}", pytrace=False)
    pytest.skip(reason)


def cuda_or_skip():
    """CuPy and a usable GPU, or :func:`skip_cuda`."""
    if not kc.kernels.cuda_available():
        skip_cuda(kc.kernels.cuda_build_info())
    try:
        import cupy
    except ImportError as err:
        skip_cuda(f"CuPy is not installed: {err}")
    return cupy


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
@pytest.mark.parametrize("name", CONFIGS)
def test_a_kernel_backend_gives_the_same_greedy_tokens(name, backend):
    if backend == "cpu" and not kc.kernels.cpu_available():
        pytest.skip("the C++ module refmath._C is not built")
    device = cuda_or_skip() if backend == "cuda" else np  # where the cache's arrays live
    module, config, params = setup(name, dtype=np.float32)
    prompt = random_tokens((3, 3), seed=12)
    runs = {b: generate_cached(module, params, config, prompt, T_MAX - 2, greedy=True, backend=b)
            for b in ("numpy", backend)}
    np.testing.assert_array_equal(runs[backend].tokens, runs["numpy"].tokens)
    # The same logits up to float32 rounding: the kernels sum in another order (tiles, base 2).
    # Compared with the float64 model on the same tokens, the kernel path's error is within a
    # small multiple of the float32 reference path's.
    reference = reference_logits(module, setup(name)[2], config, runs["numpy"].tokens, n_prompt=3)
    float32_rule(f"{name} {backend} logits", runs[backend].logits, reference, runs["numpy"].logits,
                 2, 4 * np.finfo(np.float32).eps * np.abs(reference).max())
    assert runs[backend].counts == runs["numpy"].counts
    _, cache = prefill(module, params, config, prompt, backend=backend)
    assert all(isinstance(a, device.ndarray) for a in cache._arrays())


class StandInDeviceArray(np.ndarray):
    """Host memory standing in for GPU memory where no GPU is. Like a CuPy array, it refuses to
    enter NumPy's math: the host code must bring it back with ``.get()`` first."""

    def get(self):
        return self.view(np.ndarray).copy()

    def __array_ufunc__(self, *args, **kwargs):
        raise TypeError("a device array reached NumPy's math on the host")

    def __array_function__(self, *args, **kwargs):
        raise TypeError("a device array reached a NumPy function on the host")


class StandInDevice:
    """The three CuPy functions the cache uses, over :class:`StandInDeviceArray`."""

    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, dtype).view(StandInDeviceArray)

    @staticmethod
    def asarray(x):  # host to device: a copy
        return x if isinstance(x, StandInDeviceArray) else np.array(x).view(StandInDeviceArray)

    @staticmethod
    def ascontiguousarray(x):
        return np.ascontiguousarray(x.view(np.ndarray)).view(StandInDeviceArray)


def on_stand_in_device(kernel):
    """``kernel`` (a C++ one) as the CUDA path calls it: every array argument must be in device
    memory, and the result stays there."""
    def run(*args, backend=None, **kwargs):
        assert backend in (None, "cuda")  # decode_attention gets backend="cuda"; flash none
        arrays = [a for a in args if isinstance(a, np.ndarray)]
        assert all(isinstance(a, StandInDeviceArray) for a in arrays[:3]), \
            "q, keys and values must be on the device"
        host = [a.get() if isinstance(a, StandInDeviceArray) else a for a in args]
        out = kernel(*host, **kwargs)
        return tuple(StandInDevice.asarray(x) for x in out) if isinstance(out, tuple) else \
            StandInDevice.asarray(out)

    return run


@pytest.mark.skipif(not kc.kernels.cpu_available(), reason="the C++ module refmath._C is not built")
def test_a_windowed_prefill_runs_the_kernel_with_the_window(monkeypatch):
    """A prompt longer than the window: every layer's prefill is the FlashAttention kernel with the
    window, and its logits are as close to the float64 model's as the float32 reference's."""
    module, config, params = setup("decoder-gqa", dtype=np.float32)
    config = dataclasses.replace(config, sliding_window=3)
    prompt = random_tokens((2, 7), seed=5)
    windows, kernel = [], kc.kernels.flash_attention_forward

    def counted(*args, **kwargs):
        windows.append(kwargs.get("window"))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(kc.kernels, "flash_attention_forward", counted)
    on_kernel, _ = prefill(module, params, config, prompt, all_logits=True, backend="cpu")
    assert windows == [3] * config.n_layers
    on_numpy, _ = prefill(module, params, config, prompt, all_logits=True)
    reference = module.logits(setup("decoder-gqa")[2], prompt, config)
    float32_rule("windowed prefill logits", on_kernel, reference, on_numpy,
                 floor=4 * np.finfo(np.float32).eps * np.abs(reference).max())


@pytest.mark.skipif(not kc.kernels.cpu_available(), reason="the C++ module refmath._C is not built")
@pytest.mark.parametrize("name", [*CONFIGS, "decoder-gqa-window", "decoder-windows"])
def test_the_cuda_backend_plumbing_on_a_stand_in_device(name, monkeypatch):
    """Runs here, without a GPU: the "cuda" path with host memory posing as the device and the C++
    kernels posing as the CUDA ones. The cache must live on the device, every kernel must get
    device arrays, no device array may reach the host's NumPy math, and the result must equal the
    "cpu" backend's bit for bit (the same kernels on the same numbers)."""
    if name == "decoder-gqa-window":
        module, config, params = setup("decoder-gqa", dtype=np.float32)
        config = dataclasses.replace(config, sliding_window=4)  # a windowed prefill, then decode
        prompt = random_tokens((2, 5), seed=3)
    elif name in WINDOWED:  # a prefill past the window into the rings, then decode steps
        module, config, params = setup(name, dtype=np.float32)
        prompt = random_tokens((2, 5), seed=3)
    else:
        module, config, params = setup(name, dtype=np.float32)
        prompt = random_tokens((3, 3), seed=12)
    cpu = generate_cached(module, params, config, prompt, T_MAX - prompt.shape[1], greedy=True,
                          backend="cpu")

    monkeypatch.setattr(kc, "_array_module", lambda backend: StandInDevice if backend == "cuda" else np)
    monkeypatch.setattr(kc.kernels, "cuda_available", lambda: True)
    cpu_decode = kc.decode_attention
    monkeypatch.setattr(kc, "decode_attention", on_stand_in_device(
        lambda *args, **kwargs: cpu_decode(*args, backend="cpu", **kwargs)))
    monkeypatch.setattr(kc.kernels, "flash_attention_forward",
                        on_stand_in_device(kc.kernels.flash_attention_forward))
    cuda = generate_cached(module, params, config, prompt, T_MAX - prompt.shape[1], greedy=True,
                           backend="cuda")
    np.testing.assert_array_equal(cuda.tokens, cpu.tokens)
    np.testing.assert_array_equal(cuda.logits, cpu.logits)
    assert cuda.counts == cpu.counts
    _, cache = prefill(module, params, config, prompt, backend="cuda")
    assert all(isinstance(a, StandInDeviceArray) for a in cache._arrays())


@pytest.mark.parametrize("window", [None, 3])
def test_prefill_then_decode_with_a_scale_and_softcap_equals_dense_attention_n19(window):
    """One layer of a GQA cache: a prefill of 3 positions, then 4 decode steps, through
    ``_Slot.attend`` with a query scale and a logit cap (Gemma 2), equal the causal attention
    over all 7 positions with the same options. With the window of 3 the last decode steps read
    only the window's rows."""
    rng = np.random.default_rng(12)
    b, h, g, t, d, prompt = 2, 4, 2, 7, 4, 3
    q = rng.standard_normal((b, h, t, d))
    k, v = rng.standard_normal((2, b, g, t, d))
    slot = kc._Slot(KVCache((np.zeros((b, g, t, d)),), (np.zeros((b, g, t, d)),), max_len=t), 0)
    options = dict(window=window, scale=0.8, softcap=1.5)
    rows = [slot.attend(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], 0, **options)]
    for pos in range(prompt, t):
        step = slice(pos, pos + 1)
        rows.append(slot.attend(q[:, :, step], k[:, :, step], v[:, :, step], pos, **options))
    want, _ = causal_attention_forward(q, k, v, "numpy", window, 0.8, 1.5)
    np.testing.assert_allclose(np.concatenate(rows, axis=2), want, rtol=1e-13, atol=1e-15)
    uncapped, _ = causal_attention_forward(q, k, v, "numpy", window, 0.8)
    assert np.abs(want - uncapped).max() > 1e-2  # the cap is in effect


def test_a_kernel_cache_refuses_a_softcap():
    cache = KVCache((np.zeros((1, 1, 4, 2), np.float32),), (np.zeros((1, 1, 4, 2), np.float32),),
                    max_len=4, backend="cpu")
    for n in (2, 1):  # a prefill (the FlashAttention kernel), then a decode step (decode)
        x = np.ones((1, 1, n, 2), np.float32)
        with pytest.raises(ValueError, match=r"softcap = 50.0 is not supported on backend='cpu'"):
            kc._Slot(cache, 0).attend(x, x, x, 0, softcap=50.0)


# ---- sliding layers keep only their window (A12, K6) ---------------------------------------------


@pytest.mark.parametrize("name", list(WINDOWED))
@pytest.mark.parametrize("p", [1, 3, 5, T_MAX - 1])
def test_sliding_layers_keep_their_window_and_decode_equals_recomputation(name, p):
    """Prompts shorter than, equal to and longer than the window of 3 (4), then decode steps up to
    max_seq_len = 9, past it: every logit equals the model's own forward on the whole prefix (its
    per-layer window masks, checked against PyTorch in tests/models/test_decoder_torch.py), though
    a sliding layer's cache holds only the window's rows."""
    module, config, params = setup(name)
    tokens = random_tokens((2, T_MAX), seed=21)
    z, cache = prefill(module, params, config, tokens[:, :p], all_logits=True)
    windows = [module.layer_config(config, i).sliding_window for i in range(config.n_layers)]
    assert [cache.keys[i].shape[2] for i in range(config.n_layers)] == \
        [T_MAX if w is None else w for w in windows]
    assert [cache.ring_size(i) for i in range(config.n_layers)] == windows
    np.testing.assert_allclose(z, module.logits(params, tokens[:, :p], config), rtol=RTOL, atol=0)
    for t in range(p, T_MAX):
        z_t = decode_step(module, params, config, cache, tokens[:, t])
        expected = module.logits(params, tokens[:, :t + 1], config)[:, -1]
        np.testing.assert_allclose(z_t, expected, rtol=RTOL, atol=0)
    # What each layer still holds is the model's own keys and values of its last positions.
    train = module.layer_kv(model_cache(module, params, config, tokens))
    for i, (k_ref, v_ref) in enumerate(train):
        first = 0 if windows[i] is None else T_MAX - windows[i]
        assert cache.first_kept(i) == first
        k, v = cache.layer(i)
        np.testing.assert_allclose(k, k_ref[:, :, first:], rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(v, v_ref[:, :, first:], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("chunks", [(2, 4, 1, 2), (5, 4), (1, 1, 7), (3, 3, 3)])
def test_a_chunked_prefill_across_the_wrap_equals_recomputation(chunks):
    """The cache extended by several rows at a time: chunks that stay inside the ring, wrap
    around it, or are longer than the window of 3. Every position's logits equal the model's."""
    module, config, params = setup("decoder-windows")
    tokens = random_tokens((2, T_MAX), seed=22)
    cache = kc.empty_cache(module, config, batch=2)
    expected = module.logits(params, tokens, config)
    offset = 0
    for n in chunks:
        z = kc._forward_rows(module, params, config, cache, tokens[:, offset:offset + n],
                             "absorbed")
        np.testing.assert_allclose(z, expected[:, offset:offset + n], rtol=RTOL, atol=0)
        offset += n
    assert cache.length == T_MAX


def test_a_sliding_layer_counts_the_pairs_of_its_window_k5():
    """Prefill of 5 with the window w = 3: the reference computes the full 5 x 5 scores, of which
    sum_{i=1}^{5} min(i, 3) = 1 + 2 + 3 + 3 + 3 = 12 are visible; each decode step's query reads
    the min(t, 3) = 3 kept keys. The dense layer counts as without a window."""
    module, config, params = setup("decoder-windows")
    _, cache = prefill(module, params, config, random_tokens((2, 5), seed=23))
    assert cache.counts.scores == [25, 25, 25]
    assert cache.counts.visible == [12, 15, 12]  # dense: 5 * 6 / 2
    decode_step(module, params, config, cache, np.array([0, 1]))  # position 5: t = 6 keys
    assert cache.counts.scores == [28, 31, 28] and cache.counts.visible == [15, 21, 15]


def test_a_windowed_cache_has_the_bytes_of_the_sizing_calculator_k6():
    """3 sequences, float64, g = 2 heads of d_h = 4, max_len 9: each sliding layer keeps 3 rows,
    2 * 3 * 2 * 4 * 8 * 3 = 1152 bytes; the dense one 9 rows, 3456 bytes: 5760 in all, what
    refmath.sizing counts for the model's sizing fields."""
    module, config, _ = setup("decoder-windows")
    cache = kc.empty_cache(module, config, batch=3)
    by_layer = [a.nbytes + b.nbytes for a, b in zip(cache.keys, cache.values)]
    assert by_layer == [1152, 3456, 1152] and cache.nbytes == 5760
    sized = sizing.ModelConfig("decoder-windows", **decoder.sizing_fields(config))
    assert sizing.cache_bytes_by_layer(sized, T_MAX, 3, 8) == (1152, 3456, 1152)
    assert sizing.model_cache_bytes(sized, T_MAX, batch=3, bytes_per_element=8) == 5760
    # Every layer sliding (Mistral-like, window 4): 2 layers x 2 x 3 x 1 x 4 x 8 x 4 rows.
    module, config, _ = setup("decoder-all-slide")
    cache = kc.empty_cache(module, config, batch=3)
    sized = sizing.ModelConfig("decoder-all-slide", **decoder.sizing_fields(config))
    assert cache.nbytes == sizing.model_cache_bytes(sized, T_MAX, 3, 8) == 2 * 2 * 3 * 4 * 8 * 4
    # A cache no longer than the window keeps every row: nothing to slide.
    short = kc.empty_cache(module, config, batch=3, max_len=4)
    assert short.ring_size(0) is None and short.nbytes == 2 * 2 * 3 * 4 * 8 * 4


@pytest.mark.parametrize("storage", ["ring", "every row"])
@settings(max_examples=25, deadline=None)
@given(w=st.integers(1, 5), chunks=st.lists(st.integers(1, 6), min_size=1, max_size=6),
       seed=st.integers(0, 10**6))
def test_a_sliding_layer_attends_as_its_window_mask_over_any_chunks(storage, w, chunks, seed):
    """One GQA layer through _Slot.attend, the positions fed in any chunks, with a query scale and
    a logit cap: equal to the causal attention with the window over all positions at once. The
    ring (w rows) holds the last min(t, w) positions' keys; over any chunking the visible pairs
    total sum_{i=1}^{t} min(i, w)."""
    rng = np.random.default_rng(seed)
    b, h, g, d, t = 2, 4, 2, 3, sum(chunks)
    q = rng.standard_normal((b, h, t, d))
    k, v = rng.standard_normal((2, b, g, t, d))
    max_len = max(t, w + 1)  # longer than the window: the layer slides
    rows = w if storage == "ring" else max_len
    cache = KVCache((np.zeros((b, g, rows, d)),), (np.zeros((b, g, rows, d)),), max_len=max_len)
    assert cache.ring_size(0) == (w if storage == "ring" else None)
    slot, out, offset = kc._Slot(cache, 0), [], 0
    for n in chunks:
        step = slice(offset, offset + n)
        out.append(slot.attend(q[:, :, step], k[:, :, step], v[:, :, step], offset, window=w,
                               scale=0.8, softcap=1.5))
        offset += n
        cache.length = offset
    want, _ = causal_attention_forward(q, k, v, "numpy", w, 0.8, 1.5)
    np.testing.assert_allclose(np.concatenate(out, axis=2), want, rtol=1e-13, atol=1e-15)
    kept_k, kept_v = cache.layer(0)
    first = max(0, t - w) if storage == "ring" else 0
    np.testing.assert_array_equal(kept_k, k[:, :, first:])
    np.testing.assert_array_equal(kept_v, v[:, :, first:])
    assert cache.counts.visible == [sum(min(i, w) for i in range(1, t + 1))]


@pytest.mark.skipif(not kc.kernels.cpu_available(), reason="the C++ module refmath._C is not built")
def test_a_ring_on_the_cpu_kernels_in_chunks():
    """The same ring on backend="cpu" (float32): a chunk gives FlashAttention a block of the
    window's rows in position order, a decode step gives decode_attention the ring as it is. The
    error against float64 stays within twice that of the float32 NumPy reference."""
    rng = np.random.default_rng(24)
    b, h, g, d, w, chunks = 2, 4, 2, 8, 3, (4, 1, 1, 5, 2, 1)
    t = sum(chunks)
    q, k, v = (rng.standard_normal((b, heads, t, d)) for heads in (h, g, g))
    outputs = {}
    for backend, dtype in (("cpu", np.float32), ("numpy", np.float32), ("numpy", np.float64)):
        zeros = np.zeros((b, g, w, d), dtype)
        cache = KVCache((zeros,), (zeros.copy(),), max_len=t, backend=backend)
        out, offset = [], 0
        for n in chunks:
            step = slice(offset, offset + n)
            out.append(kc._Slot(cache, 0).attend(*(x[:, :, step].astype(dtype) for x in (q, k, v)),
                                                 offset, window=w))
            offset += n
        outputs[backend, np.dtype(dtype).name] = np.concatenate(out, axis=2)
    reference = outputs["numpy", "float64"]
    np.testing.assert_allclose(reference, causal_attention_forward(q, k, v, "numpy", w)[0],
                               rtol=1e-13, atol=1e-15)
    float32_rule("ring on the cpu kernels", outputs["cpu", "float32"], reference,
                 outputs["numpy", "float32"], 2, 4 * np.finfo(np.float32).eps)


def test_a_ring_refuses_another_window():
    cache = KVCache((np.zeros((1, 1, 3, 2)),), (np.zeros((1, 1, 3, 2)),), max_len=8)
    x = np.ones((1, 1, 1, 2))
    for window in (None, 4):
        with pytest.raises(ValueError, match=rf"keeps the last 3 positions .* window = {window}"):
            kc._Slot(cache, 0).attend(x, x, x, 0, window=window)
    with pytest.raises(ValueError, match="1..max_len = 2 rows"):
        KVCache((np.zeros((1, 1, 3, 2)),), (np.zeros((1, 1, 3, 2)),), max_len=2)
    with pytest.raises(ValueError, match="one key and one value block per layer"):
        KVCache((np.zeros((1, 1, 3, 2)),), (), max_len=4)
