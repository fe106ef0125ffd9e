"""Falcon's file (refmath.models.falcon): the parallel block (N21) with one norm or two, the
sequential block, LayerNorm with and without its bias, the plain GELU FFN and PaLM's SwiGLU,
the PaLM preset, the KV cache, and the configuration's checks. What every model satisfies is
tests/models/test_model_properties.py's; the torch oracle is test_decoder_torch.py's, Hugging
Face's parity test_falcon_hf.py's."""
import dataclasses
import json
import math

import numpy as np
import pytest

from refmath.models import falcon
from refmath.models.common import sub_params
from refmath.models.falcon import FalconConfig
from refmath.models.rope_attention import rope_attention_forward
from refmath.optim import takes_weight_decay
from test_decoder import B, T, V, random_batch, random_params

FALCON_7B = dict(n_kv_heads=1)
FALCON_40B = dict(n_kv_heads=2, parallel_norms=2)


def tiny(**overrides) -> FalconConfig:
    fields = dict(vocab_size=V, max_seq_len=8, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                  init_std=0.25)
    return FalconConfig(**{**fields, **overrides})


def test_parameters_of_each_block_shape():
    d, layer = 16, "layers.1."
    one = falcon.param_shapes(tiny(**FALCON_7B))
    # one LayerNorm (gain and bias) feeds both branches: no ln2; the plain FFN is 4d wide
    assert [n for n in one if n.startswith(layer + "ln")] == [layer + "ln1.gamma",
                                                              layer + "ln1.beta"]
    assert one[layer + "ffn.w_up"] == (d, 4 * d) and one[layer + "ffn.w_down"] == (4 * d, d)
    assert layer + "ffn.w_gate" not in one and one["ln_f.beta"] == (d,)
    two = falcon.param_shapes(tiny(**FALCON_40B))
    assert {layer + "ln2.gamma", layer + "ln2.beta"} <= set(two)
    palm = falcon.param_shapes(tiny(norm="layernorm_no_bias"))
    assert not any(n.endswith(".beta") for n in palm) and layer + "ln2.gamma" not in palm
    sequential = falcon.param_shapes(tiny(parallel_block=False))
    assert {layer + "ln2.gamma", layer + "ln2.beta"} <= set(sequential)
    # a LayerNorm's bias, like its gain, is exempt from weight decay (O5), and starts at 0
    assert not takes_weight_decay(layer + "ln1.beta")
    params = falcon.init_params(tiny(**FALCON_40B))
    assert np.all(params[layer + "ln2.beta"] == 0) and np.all(params[layer + "ln2.gamma"] == 1)


def _branch_input(config, params, x, name):
    return falcon.layer_norm(sub_params(params, "layers.0"), name, config)(x)[0]


@pytest.mark.parametrize("fields", [FALCON_7B, FALCON_40B], ids=["one norm", "two norms"])
def test_parallel_block_adds_both_branches_of_the_blocks_input_n21(fields):
    """x' = x + Attn(N1(x)) + FFN(N2(x)), with N2 = N1 for one norm, from the ops themselves."""
    config = tiny(**fields)
    params = random_params(falcon, config, seed=2)
    x = np.random.default_rng(3).standard_normal((B, T, 16))
    layer = sub_params(params, "layers.0")
    out, _ = falcon.layer_forward(x, layer, config)
    h1 = _branch_input(config, params, x, "ln1")
    h2 = _branch_input(config, params, x, "ln2") if config.parallel_norms == 2 else h1
    attn = rope_attention_forward(h1, sub_params(layer, "attn"), config)[0]
    ffn = falcon.blocks.plain_ffn_forward(h2, sub_params(layer, "ffn"), approximate=False)[0]
    np.testing.assert_allclose(out, x + attn + ffn, rtol=1e-13, atol=1e-13)
    # and not the sequential layer's x + A + F(N(x + A))
    sequential = dataclasses.replace(config, parallel_block=False, parallel_norms=1)
    seq_params = {**layer, "ln2.gamma": layer["ln1.gamma"], "ln2.beta": layer["ln1.beta"]}
    assert not np.allclose(falcon.layer_forward(x, seq_params, sequential)[0], out)


def test_layernorm_without_bias_is_layernorm_with_a_zero_bias():
    with_bias = tiny()
    params = random_params(falcon, with_bias, seed=6)
    no_bias = dataclasses.replace(with_bias, norm="layernorm_no_bias")
    zero = {n: (np.zeros_like(v) if n.endswith(".beta") else v) for n, v in params.items()}
    tokens = random_batch()["tokens"]
    np.testing.assert_array_equal(
        falcon.logits({n: v for n, v in params.items() if not n.endswith(".beta")}, tokens,
                      no_bias), falcon.logits(zero, tokens, with_bias))


@pytest.mark.parametrize("fields", [FALCON_7B, FALCON_40B, dict(norm="layernorm_no_bias"),
                                    dict(parallel_block=False, ffn="gelu_tanh"), falcon.PALM],
                         ids=["Falcon-7B", "Falcon-40B", "LayerNorm without bias", "sequential",
                              "PaLM"])
def test_cached_decoding_of_each_block_shape_equals_recomputing(fields):
    """Prefill, then one token at a time through the KV cache: the logits of the whole sequence."""
    from refmath.inference.kv_cache import decode_step, prefill

    config = tiny(**fields)
    params = random_params(falcon, config, seed=7)
    tokens = random_batch(seed=8)["tokens"]
    full = falcon.logits(params, tokens, config)
    _, cache = prefill("falcon", params, config, tokens[:, :3])
    for t in range(3, T):
        z = decode_step("falcon", params, config, cache, tokens[:, t])
        np.testing.assert_allclose(z, full[:, t], rtol=1e-12, atol=1e-12)


def test_palm_preset_is_palms_block_and_counts_its_parameters():
    config = falcon.preset("palm-tiny")
    assert (config.parallel_block, config.parallel_norms, config.kv_heads, config.norm,
            config.ffn, config.tie_embeddings) == (
        True, 1, 1, "layernorm_no_bias", "swiglu", True)
    d, f, h, d_h, v, n_layers = 64, 256, 4, 16, 256, 2
    # per layer: one LayerNorm gain, W_Q and W_O (d x h d_h), one key and one value head
    # (d x d_h each), the SwiGLU's three d x d_f matrices; then the shared table and ln_f's gain
    per_layer = d + 2 * d * h * d_h + 2 * d * d_h + 3 * d * f
    expected = v * d + n_layers * per_layer + d
    assert sum(math.prod(s) for s in falcon.param_shapes(config).values()) == expected
    with pytest.raises(ValueError, match="unknown preset 'palm'"):
        falcon.preset("palm")


def test_config_round_trips_through_json():
    config = tiny(parallel_norms=2, ffn="gelu_tanh", d_ff=20, tie_embeddings=True, dropout=0.1,
                  rope_scaling=dict(rope_type="linear", factor=2.0))
    assert FalconConfig(**json.loads(json.dumps(dataclasses.asdict(config)))) == config


@pytest.mark.parametrize("overrides, message", [
    (dict(parallel_norms=3), "parallel_norms"),
    (dict(parallel_norms=2, parallel_block=False), "parallel_norms = 2"),
    (dict(parallel_block=1), "parallel_block"),
    (dict(norm="rmsnorm"), "norm"),
    (dict(ffn="relu"), "ffn"),
    (dict(n_kv_heads=3), "n_kv_heads = 3 must divide n_heads = 4"),
    (dict(d_model=12, n_heads=4), "even head width"),
    (dict(dropout=1.0), "dropout"),
])
def test_options_are_checked_naming_the_field(overrides, message):
    with pytest.raises((ValueError, TypeError), match=message):
        tiny(**overrides)


def test_a_decoder_config_is_refused():
    from refmath.models.decoder import DecoderConfig

    config = DecoderConfig(vocab_size=V, max_seq_len=8, d_model=16, n_layers=1, n_heads=4)
    with pytest.raises(TypeError, match="FalconConfig"):
        falcon.param_shapes(config)
