"""What every model of refmath.models.MODELS satisfies, written once and parametrised over the
registry, so that a new family file is checked by it without a line here: its configuration
round-trips through JSON, its parameters match its shapes in either float dtype, float32 in gives
float32 out, one pass scores every prefix as if it ran alone and a prefix's logits do not see
the tokens after it (L6, K1; over every block shape of tests/_model_variants.py), a loss mask is
the same as ignored targets (L5), a bad batch is refused naming the key, the KV cache gives the
full forward's logits (K2, K3), and the sizes calculator counts its parameters exactly."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from refmath.inference.kv_cache import decode_step, prefill
from refmath.losses import IGNORE_INDEX
from refmath.models import DECODER_ONLY, MODELS, config_class, model_module
from refmath.sizing import ModelConfig, parameter_counts
from _model_variants import VARIANTS

VOCAB, LENGTH = 13, 12


def tiny(name: str):
    """Model ``name``'s training recipe at a vocabulary of 13 and sequences of 12."""
    return config_class(name)(vocab_size=VOCAB, max_seq_len=LENGTH,
                              **model_module(name).TRAINING_RECIPE.config)


def moved(name: str, config, seed=0, dtype=np.float64) -> dict:
    """Initial parameters moved off their initial values (unit gains and zero biases would hide a
    gain or a bias in the wrong place)."""
    rng = np.random.default_rng(seed)
    params = model_module(name).init_params(config, seed=seed)
    return {k: (v + 0.1 * rng.standard_normal(v.shape)).astype(dtype) for k, v in params.items()}


def batch(seed=0, b=2, t=LENGTH) -> dict:
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, VOCAB, (b, t)), "targets": rng.integers(0, VOCAB, (b, t))}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_config_round_trips_through_json(name):
    config = tiny(name)
    fields = json.loads(json.dumps(dataclasses.asdict(config)))
    assert config_class(name)(**fields) == config


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_init_params_has_the_shapes_of_param_shapes_in_the_dtype_asked(name, dtype):
    module, config = model_module(name), tiny(name)
    params = module.init_params(config, seed=3, dtype=dtype)
    assert {k: v.shape for k, v in params.items()} == dict(module.param_shapes(config))
    assert {v.dtype for v in params.values()} == {np.dtype(dtype)}
    again = module.init_params(config, seed=3, dtype=np.float64)  # one draw, cast
    for key in params:
        np.testing.assert_array_equal(params[key], again[key].astype(dtype), err_msg=key)


@pytest.mark.parametrize("name", DECODER_ONLY)
def test_float32_parameters_give_float32_loss_and_gradients_with_the_parameters_keys(name):
    module, config = model_module(name), tiny(name)
    params = moved(name, config, dtype=np.float32)
    loss, cache = module.forward(params, batch(), config)
    grads = module.backward(cache)
    assert loss.dtype == np.float32 and loss.shape == ()
    assert grads.keys() == params.keys()
    for key, grad in grads.items():
        assert grad.dtype == np.float32 and grad.shape == params[key].shape, key


def test_every_decoder_only_model_has_its_block_shapes_in_the_variants():
    assert {model for model, _ in VARIANTS.values()} == set(DECODER_ONLY)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_one_pass_scores_every_prefix_as_if_run_alone_l6(variant):
    # The causal mask makes position t see tokens 0..t only: the full pass's logits at t are those
    # of the prefix run alone, and the mean loss is the mean over prefixes of each one's last
    # position (every prefix contributes its B last tokens).
    name, fields = VARIANTS[variant]
    module, config = model_module(name), config_class(name)(**fields)
    params = moved(name, config)
    rng = np.random.default_rng(5)
    b, t = 2, 7
    tokens, targets = (rng.integers(0, config.vocab_size, (b, t)) for _ in range(2))
    full_loss, _ = module.forward(params, {"tokens": tokens, "targets": targets}, config)
    full_logits = module.logits(params, tokens, config)
    prefix_losses = []
    for n in range(1, t + 1):
        last_only = np.zeros((b, n), dtype=np.int64)
        last_only[:, -1] = 1
        loss, _ = module.forward(params, {"tokens": tokens[:, :n], "targets": targets[:, :n],
                                          "loss_mask": last_only}, config)
        prefix_losses.append(float(loss))
        np.testing.assert_allclose(module.logits(params, tokens[:, :n], config)[:, -1],
                                   full_logits[:, n - 1], rtol=1e-12,
                                   atol=1e-12 * np.abs(full_logits).max())
    np.testing.assert_allclose(np.mean(prefix_losses), full_loss, rtol=1e-12)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tokens_after_a_prefix_change_none_of_its_logits_k1(variant):
    # ... while another tail after the prefix changes the positions after it (so the comparison
    # above is not vacuous).
    name, fields = VARIANTS[variant]
    module, config = model_module(name), config_class(name)(**fields)
    params = moved(name, config)
    rng = np.random.default_rng(8)
    tokens = rng.integers(0, config.vocab_size, (2, 8))
    logits = module.logits(params, tokens, config)
    for t in (1, 4, 7):
        other = tokens.copy()
        other[:, t:] = (other[:, t:] + 1 + rng.integers(0, 5, other[:, t:].shape)) % config.vocab_size
        changed = module.logits(params, other, config)
        np.testing.assert_allclose(changed[:, :t], logits[:, :t], rtol=1e-12,
                                   atol=1e-12 * np.abs(logits).max())
        assert not np.allclose(changed[:, t:], logits[:, t:])


@pytest.mark.parametrize("name", DECODER_ONLY)
def test_a_loss_mask_is_the_same_as_ignored_targets_l5(name):
    module, config = model_module(name), tiny(name)
    params, masked = moved(name, config), batch()
    ignored = dict(masked, targets=masked["targets"].copy())
    masked["loss_mask"] = np.ones_like(masked["tokens"])
    masked["loss_mask"][:, :4] = 0
    ignored["targets"][:, :4] = IGNORE_INDEX
    loss_a, cache_a = module.forward(params, masked, config)
    loss_b, cache_b = module.forward(params, ignored, config)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-14)
    grads_a, grads_b = module.backward(cache_a), module.backward(cache_b)
    for key in grads_a:
        np.testing.assert_allclose(grads_a[key], grads_b[key], rtol=1e-12, atol=1e-15, err_msg=key)


@pytest.mark.parametrize("name", DECODER_ONLY)
def test_a_bad_batch_is_refused_naming_the_key(name):
    module, config = model_module(name), tiny(name)
    params, good = moved(name, config), batch()
    with pytest.raises(ValueError, match="missing 'targets'"):
        module.forward(params, {"tokens": good["tokens"]}, config)
    with pytest.raises(ValueError, match=r"batch\['targets'\]"):
        module.forward(params, dict(good, targets=good["targets"] + VOCAB), config)
    with pytest.raises(ValueError, match="tokens"):
        module.forward(params, dict(good, tokens=good["tokens"] + VOCAB), config)


@pytest.mark.parametrize("name", DECODER_ONLY)
def test_prefill_and_decode_steps_give_the_full_forwards_logits_k2_k3(name):
    module, config = model_module(name), tiny(name)
    params, tokens = moved(name, config), batch()["tokens"]
    full = module.logits(params, tokens, config)
    z, cache = prefill(name, params, config, tokens[:, :5], all_logits=True)
    rows = [z]
    for t in range(5, LENGTH):
        rows.append(decode_step(name, params, config, cache, tokens[:, t])[:, None])
    np.testing.assert_allclose(np.concatenate(rows, axis=1), full, rtol=1e-11,
                               atol=1e-11 * np.abs(full).max())


@pytest.mark.parametrize("name", [n for n in sorted(MODELS) if model_module(n).HF_MODEL_TYPES])
def test_the_sizes_calculator_counts_every_parameter(name):
    module, config = model_module(name), tiny(name)
    counted = parameter_counts(ModelConfig(name=name, **module.sizing_fields(config))).total
    assert counted == sum(int(np.prod(s)) for s in module.param_shapes(config).values())
