"""Public tests of the inference assignment: `python -m pytest -q tests`.

The hidden tests check more: batches, MQA, the other RoPE layout, sampled tokens, forks and frees,
and published model sizes.
"""
import numpy as np

from refmath.inference.kv_cache import decode_step, prefill
from refmath.inference.paged import PagedKVCache
from refmath.models.decoder import DecoderConfig, init_params, logits
from refmath.sizing import kv_cache_bytes_per_token


def test_decode_equals_recomputation():
    config = DecoderConfig(vocab_size=20, max_seq_len=16, d_model=16, n_layers=1, n_heads=2,
                           ffn_multiple_of=16)
    params = init_params(config, seed=0)
    tokens = np.array([[3, 1, 4, 1, 5, 9]])
    _, cache = prefill("llama", params, config, tokens[:, :4])
    step = decode_step("llama", params, config, cache, tokens[:, 4])
    np.testing.assert_allclose(step, logits(params, tokens[:, :5], config)[:, -1], rtol=1e-10, atol=1e-12)


def test_paged_cache_reads_back_what_was_appended():
    cache = PagedKVCache(n_pages=4, page_size=2, n_kv_heads=1, head_dim=2)
    cache.add_sequence(0)
    k = np.arange(10.0).reshape(5, 1, 2)
    cache.append(0, k, -k)
    got_k, got_v = cache.gather(0)
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, -k)


def test_mha_cache_per_token():
    # one layer, one head of width 1, one byte: a key and a value
    assert kv_cache_bytes_per_token(1, 1, 1, 1) == 2
