"""The model contract (refmath.models.contract): every registered model defines the whole protocol,
a module that lacks a name fails at import naming the module and the name, and a configuration is
accepted only as exactly its model's class."""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from refmath import hf, kernels
from refmath.inference import compiled_step
from refmath.inference.kv_cache import prefill
from refmath.models import MODELS, check_config, config_class, model_module
from refmath.models import contract
from refmath.models.decoder import DecoderConfig


@pytest.mark.parametrize("name", list(MODELS))
def test_every_registered_model_defines_the_protocol(name):
    module = model_module(name)  # checked on first import
    entry = MODELS[name]
    for required in contract.required_names(module, entry.config_class, entry.decoder_only):
        assert hasattr(module, required), (name, required)
    contract.check_module(module, entry.config_class, entry.decoder_only)


def _fake(missing: str, fields=None):
    """A copy of the decoder's module namespace without ``missing``."""
    real = model_module("llama")
    fake = types.ModuleType("refmath.models.fake_family")
    for name in contract.required_names(real, "DecoderConfig", True):
        if name != missing:
            setattr(fake, name, getattr(real, name))
    if fields is not None:
        fake.COMPILED_FIELDS = fields
    return fake


@pytest.mark.parametrize("hook", ["cache_stale", "compiled_layer_spec", "rope_options",
                                  "cached_layer", "to_hf", "TRAINING_RECIPE"])
def test_a_missing_name_is_an_import_error_naming_the_module_and_the_name(hook):
    with pytest.raises(ImportError, match=rf"refmath.models.fake_family does not define '{hook}'"):
        contract.check_module(_fake(hook), "DecoderConfig", decoder_only=True)


def test_an_allow_list_that_leaves_a_field_out_is_an_import_error():
    fields = {k: v for k, v in model_module("llama").COMPILED_FIELDS.items() if k != "qkv_bias"}
    with pytest.raises(ImportError, match=r"COMPILED_FIELDS does not say .*DecoderConfig\.qkv_bias"):
        contract.check_module(_fake(None, fields), "DecoderConfig", decoder_only=True)


def test_allowed_reads_every_field_and_refuses_an_unlisted_one():
    config = DecoderConfig(vocab_size=11, max_seq_len=8, d_model=16, n_layers=1, n_heads=2)
    rules = model_module("llama").COMPILED_FIELDS
    assert contract.allowed(config, rules)
    assert not contract.allowed(dataclasses.replace(config, sliding_window=4), rules)
    assert not contract.allowed(config, {k: v for k, v in rules.items() if k != "vocab_size"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class CohereLikeConfig(DecoderConfig):
    """A family written as a subclass: its extra field is nothing the decoder's code reads."""

    logit_scale: float = 0.0625


def test_a_subclassed_config_is_refused_everywhere_not_run_without_its_field():
    config = CohereLikeConfig(vocab_size=11, max_seq_len=8, d_model=16, n_layers=1, n_heads=2)
    llama = model_module("llama")
    params = llama.init_params(DecoderConfig(vocab_size=11, max_seq_len=8, d_model=16, n_layers=1,
                                             n_heads=2))
    with pytest.raises(TypeError, match="needs a DecoderConfig .*not a subclass.*CohereLikeConfig"):
        check_config("llama", config)
    with pytest.raises(TypeError, match="needs a DecoderConfig"):
        prefill("llama", params, config, [1, 2])
    with pytest.raises(TypeError, match="exactly that class"):
        llama.logits(params, np.array([[1, 2]]), config)
    with pytest.raises(TypeError, match="exactly that class"):
        llama.init_params(config)
    with pytest.raises(TypeError, match="needs a DecoderConfig"):
        hf.save_checkpoint("/nonexistent", "llama", config, params)
    assert llama.compiled_layer_spec(params, config) is None


@pytest.mark.skipif(not kernels.cpu_available(), reason="needs refmath._C")
def test_the_compiled_step_asks_the_allow_list():
    llama = model_module("llama")
    config = DecoderConfig(vocab_size=11, max_seq_len=8, d_model=16, n_layers=1, n_heads=2)
    params = {k: v.astype(np.float32) for k, v in llama.init_params(config).items()}
    assert compiled_step.compiled_layers(llama, params, config) is not None
    for field, value in [("qk_norm", "head"), ("sliding_window", 4)]:
        changed = dataclasses.replace(config, **{field: value})
        p = {k: v.astype(np.float32) for k, v in llama.init_params(changed).items()}
        assert compiled_step.compiled_layers(llama, p, changed) is None, field


@pytest.mark.parametrize("name", [n for n, e in MODELS.items() if e.decoder_only])
def test_the_hooks_answer_for_a_plain_config(name):
    module = model_module(name)
    config = config_class(name)(**{"gpt": dict(vocab_size=11, max_seq_len=8, n_layers=1,
                                               d_model=16, n_heads=2),
                                   "llama": dict(vocab_size=11, max_seq_len=8, d_model=16,
                                                 n_layers=1, n_heads=2),
                                   "mla": dict(vocab_size=11, max_seq_len=8, d_model=16,
                                               n_layers=1, n_heads=2, d_c=8, d_rope=4),
                                   "cohere": dict(vocab_size=11, max_seq_len=8, d_model=16,
                                                  n_layers=1, n_heads=2, d_ff=24),
                                   "falcon": dict(vocab_size=11, max_seq_len=8, d_model=16,
                                                  n_layers=1, n_heads=2),
                                   "olmo2": dict(vocab_size=11, max_seq_len=8, d_model=16,
                                                 n_layers=1, n_heads=2),
                                   "phi3": dict(vocab_size=11, max_seq_len=8, d_model=16,
                                                n_layers=1, n_heads=2, d_ff=24),
                                   "gemma": dict(vocab_size=11, max_seq_len=8, d_model=16,
                                                 n_layers=1, n_heads=2, head_dim=8,
                                                 d_ff=24)}[name])
    assert module.cache_stale(config, 4, 1) is False
    rope = module.rope_options(config, 3, 4)
    assert rope is None or rope["offset"] == 3
