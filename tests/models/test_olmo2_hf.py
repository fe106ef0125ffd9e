"""OLMo 2 (refmath.models.olmo2) against Hugging Face transformers: a checkpoint built with random
weights (tests/_hf_oracle.py), its float64 logits, greedy tokens and cached decoding equal to
transformers', refmath's OLMo 2 written and read back by transformers, and what no OLMo 2 of
refmath computes refused in one line."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is the oracle's backend: the 'oracle' extra")
pytest.importorskip("transformers", reason="the comparison needs transformers>=5")
pytest.importorskip("safetensors", reason="checkpoints are safetensors: install the 'hf' extra")

from refmath import hf  # noqa: E402
from refmath.inference.kv_cache import decode_step, prefill  # noqa: E402
from refmath.models import olmo2  # noqa: E402

from _hf_oracle import (REL, TOKENS, VOCAB, edit_config, float64_internals, greedy_tokens_match,  # noqa: E402
                        hf_logits, load_float64, one_line_error, random_model, relative_error)

# the tiny OLMo 2 as it comes, and with a linear rope scaling and one key/value head
VARIANTS = {"olmo2": {}, "olmo2-mqa-linear": {
    "num_key_value_heads": 1,
    "rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}}}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_loaded_checkpoint_gives_the_logits_of_transformers(variant, tmp_path, monkeypatch):
    model = random_model("olmo2", **VARIANTS[variant])
    model.save_pretrained(tmp_path, safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path, dtype=np.float64)
    assert name == "olmo2" and type(config) is olmo2.OLMo2Config
    z = olmo2.logits(params, TOKENS, config)
    error = relative_error(z, hf_logits(float64_internals(model, monkeypatch), TOKENS))
    print(f"{variant}: largest logit difference {error:.1e} of the largest logit")
    assert error < 1e-13  # float64 rounding (~1e-15), with room to spare


def test_greedy_generation_gives_the_tokens_of_transformers(tmp_path, monkeypatch):
    model = random_model("olmo2", seed=1)
    greedy_tokens_match(model, tmp_path, monkeypatch)


def test_cached_decode_equals_recomputing(tmp_path):
    """The norms after the sublayers, one row at a time through the KV cache, give the whole
    sequence's logits."""
    random_model("olmo2", seed=4).save_pretrained(tmp_path, safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path, dtype=np.float64)
    tokens = TOKENS[:, :12]
    full = olmo2.logits(params, tokens, config)
    _, cache = prefill(name, params, config, tokens[:, :5])
    for t in range(5, 12):
        z = decode_step(name, params, config, cache, tokens[:, t])
        np.testing.assert_allclose(z, full[:, t], rtol=1e-11, atol=1e-11 * np.abs(full).max())


def test_a_checkpoint_reports_its_own_family(tmp_path):
    random_model("olmo2").save_pretrained(tmp_path / "in", safe_serialization=True)
    assert hf.checkpoint_family(hf.read_config(tmp_path / "in")) == "olmo2"
    name, config, params = hf.load_checkpoint(tmp_path / "in")
    assert name == "olmo2"
    hf.save_checkpoint(tmp_path / "out", name, config, params)
    assert hf.checkpoint_family(hf.read_config(tmp_path / "out")) == "olmo2"


def test_saved_checkpoint_gives_the_logits_of_refmath_in_transformers(tmp_path, monkeypatch):
    """Interleaved RoPE: the query and key columns and QK-norm's gains are permuted on the way."""
    config = olmo2.OLMo2Config(vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2,
                               n_heads=4, n_kv_heads=2, d_ff=40, rope_base=300.0,
                               tie_embeddings=True)
    rng = np.random.default_rng(8)
    params = {key: value + 0.1 * rng.standard_normal(value.shape)  # gains off 1
              for key, value in olmo2.init_params(config, seed=8).items()}
    hf.save_checkpoint(tmp_path, "olmo2", config, params)
    model = load_float64(tmp_path)
    tokens = TOKENS[:, :11]
    z = olmo2.logits(params, tokens, config)
    error = relative_error(z, hf_logits(float64_internals(model, monkeypatch), tokens))
    print(f"olmo2 (interleaved RoPE): largest logit difference {error:.1e} of the largest logit")
    assert error < REL


@pytest.mark.parametrize("fields, message", [
    (dict(attention_bias=True), "attention_bias = True"),
    (dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
])
def test_refuses_what_olmo2_does_not_compute(fields, message, tmp_path):
    random_model("olmo2").save_pretrained(tmp_path, safe_serialization=True)
    edit_config(tmp_path, **fields)
    assert message in one_line_error(tmp_path)
