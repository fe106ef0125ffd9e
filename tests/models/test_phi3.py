"""Phi-3's file (refmath.models.phi3): Llama's network on its own configuration, so the same
parameters give Llama's loss, gradients and logits bit for bit; LongRoPE is its one rope scaling;
the compiled decode layer runs it as it runs Llama; its configuration is checked naming the field.
What every model satisfies is tests/models/test_model_properties.py's, the gradient check the
registry's (refmath.models.phi3's case), Hugging Face's parity test_phi3_hf.py's."""
import dataclasses
import json

import numpy as np
import pytest

from refmath import kernels
from refmath.models import decoder, phi3
from refmath.models.phi3 import Phi3Config
from test_decoder import random_batch, random_params

LONGROPE = dict(rope_type="longrope", factor=4.0, original_max_seq_len=4,
                short_factor=(1.0, 2.0), long_factor=(1.5, 5.0))


def tiny(**overrides) -> Phi3Config:
    fields = dict(vocab_size=11, max_seq_len=8, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                  d_ff=24, init_std=0.25)
    return Phi3Config(**{**fields, **overrides})


@pytest.mark.parametrize("fields", [{}, dict(rope_scaling=LONGROPE, sliding_window=3),
                                    dict(tie_embeddings=True, dropout=0.25)],
                         ids=["plain", "LongRoPE and a window", "tied, dropout"])
def test_phi3_is_llamas_network_bit_for_bit(fields):
    """The same parameters under a Phi3Config and the DecoderConfig of the same fields: equal
    losses, gradients and logits (the file states no network of its own)."""
    config = tiny(**fields)
    llama = decoder.DecoderConfig(**dataclasses.asdict(config))
    params = random_params(phi3, config, seed=2)
    batch = random_batch(seed=3)
    loss, cache = phi3.forward(params, batch, config, train=True, rng=np.random.default_rng(5))
    loss_llama, cache_llama = decoder.forward(params, batch, llama, train=True,
                                              rng=np.random.default_rng(5))
    assert loss == loss_llama
    grads, grads_llama = phi3.backward(cache), decoder.backward(cache_llama)
    assert grads.keys() == grads_llama.keys() == params.keys()
    for key in grads:
        np.testing.assert_array_equal(grads[key], grads_llama[key], err_msg=key)
    np.testing.assert_array_equal(phi3.logits(params, batch["tokens"], config),
                                  decoder.logits(params, batch["tokens"], llama))


def test_only_longrope_scales_its_rope():
    assert tiny(rope_scaling=LONGROPE).rope_scaling.rope_type == "longrope"
    with pytest.raises(ValueError, match="Phi3Config.rope_scaling must be LongRoPE's"):
        tiny(rope_scaling=dict(rope_type="linear", factor=2.0))


def test_config_round_trips_through_json():
    config = tiny(rope_scaling=LONGROPE, sliding_window=3, tie_embeddings=True, dropout=0.1)
    assert Phi3Config(**json.loads(json.dumps(dataclasses.asdict(config)))) == config


@pytest.mark.parametrize("overrides, message", [
    (dict(n_kv_heads=3), "n_kv_heads = 3 must divide n_heads = 4"),
    (dict(d_model=18), "n_heads = 4 must divide d_model = 18"),
    (dict(d_model=24, n_heads=8), "even head width"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(rope_layout="sideways"), "rope_layout"),
    (dict(head_dim=8), "head_dim"),
    (dict(qkv_bias=True), "qkv_bias"),
])
def test_options_are_checked_naming_the_field(overrides, message):
    with pytest.raises((ValueError, TypeError), match=message):
        tiny(**overrides)


def test_a_subclass_is_refused():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Scaled(Phi3Config):
        logit_scale: float = 2.0

    with pytest.raises(TypeError, match="exactly that class"):
        phi3.param_shapes(Scaled(**dataclasses.asdict(tiny())))
    assert phi3.compiled_layer_spec({}, Scaled(**dataclasses.asdict(tiny()))) is None


@pytest.mark.skipif(not kernels.cpu_available(), reason="needs refmath._C")
def test_the_compiled_decode_layer_runs_it_as_it_runs_llama():
    """Llama's compiled layers, with LongRoPE's rotation handed in at each step; a window is not
    on its allow-list, so that config keeps the NumPy step."""
    config = tiny(rope_scaling=LONGROPE)
    params = {k: v.astype(np.float32) for k, v in random_params(phi3, config, seed=6).items()}
    llama = decoder.DecoderConfig(**dataclasses.asdict(config))
    ours, theirs = phi3.compiled_layer_spec(params, config), decoder.compiled_layer_spec(params,
                                                                                          llama)
    assert ours is not None and ours[0] == theirs[0]
    for mine, llamas in zip(ours[1], theirs[1]):
        assert mine.keys() == llamas.keys()
        assert all(mine[k] is llamas[k] for k in mine)
    assert phi3.compiled_layer_spec(params, tiny(rope_scaling=LONGROPE, sliding_window=3)) is None
