"""Phi-3 (refmath.models.phi3) against Hugging Face transformers: checkpoints built with random
weights (tests/_hf_oracle.py), their float64 logits, greedy tokens and cached decoding equal to
transformers', refmath's Phi-3 written with its fused projections and read back by transformers,
and what no Phi-3 of refmath computes refused in one line."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is the oracle's backend: the 'oracle' extra")
pytest.importorskip("transformers", reason="the comparison needs transformers>=5")
pytest.importorskip("safetensors", reason="checkpoints are safetensors: install the 'hf' extra")

from refmath import hf  # noqa: E402
from refmath.inference.kv_cache import decode_step, prefill  # noqa: E402
from refmath.models import phi3  # noqa: E402

from _hf_oracle import (REL, TOKENS, VOCAB, edit_config, float64_internals,  # noqa: E402
                        generate_hf_runs, greedy_tokens_match, hf_logits, load_float64,
                        one_line_error, random_model, relative_error)

# The tiny Phi-3 as it comes (head_dim d/h, a window of 5 on every layer), and with LongRoPE:
# head_dim 8 and base 500 give wavelengths 6.3, 30, 140 and 660 tokens, the long factors past 8
LONGROPE = dict(rope_type="longrope", rope_theta=500.0, factor=4.0,
                original_max_position_embeddings=8, short_factor=[1.0, 1.2, 1.5, 2.0],
                long_factor=[1.0, 2.0, 5.0, 9.0])
VARIANTS = {"phi3": {}, "phi3-longrope": dict(sliding_window=None, rope_parameters=LONGROPE,
                                              original_max_position_embeddings=8)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_loaded_checkpoint_gives_the_logits_of_transformers(variant, tmp_path, monkeypatch):
    model = random_model("phi3", **VARIANTS[variant])
    model.save_pretrained(tmp_path, safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path, dtype=np.float64)
    assert name == "phi3" and type(config) is phi3.Phi3Config
    z = phi3.logits(params, TOKENS, config)
    error = relative_error(z, hf_logits(float64_internals(model, monkeypatch), TOKENS))
    print(f"{variant}: largest logit difference {error:.1e} of the largest logit")
    assert error < REL
    if variant == "phi3-longrope":  # float64 rounding (~1e-15), with room to spare
        assert error < 1e-13


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_generation_gives_the_tokens_of_transformers(variant, tmp_path, monkeypatch):
    model = random_model("phi3", seed=1, **VARIANTS[variant])
    greedy_tokens_match(model, tmp_path, monkeypatch, use_cache=variant != "phi3-longrope")


def test_cached_decode_equals_recomputing_and_longrope_past_the_context_is_stale(tmp_path):
    """Through the window of 5 one row at a time, the whole sequence's logits; with LongRoPE the
    step past the trained context of 8 is refused as stale (K3), and generate prefills afresh."""
    random_model("phi3", seed=4).save_pretrained(tmp_path / "window", safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path / "window", dtype=np.float64)
    tokens = TOKENS[:, :12]
    full = phi3.logits(params, tokens, config)
    _, cache = prefill(name, params, config, tokens[:, :5])
    for t in range(5, 12):
        z = decode_step(name, params, config, cache, tokens[:, t])
        np.testing.assert_allclose(z, full[:, t], rtol=1e-11, atol=1e-11 * np.abs(full).max())

    random_model("phi3", seed=4, **VARIANTS["phi3-longrope"]).save_pretrained(
        tmp_path / "longrope", safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path / "longrope", dtype=np.float64)
    z, cache = prefill(name, params, config, tokens[:, :8], all_logits=True)
    np.testing.assert_allclose(z, phi3.logits(params, tokens[:, :8], config), rtol=1e-12,
                               atol=1e-12)
    with pytest.raises(ValueError, match="stale"):
        decode_step(name, params, config, cache, tokens[:, 8])


def test_generate_hf_runs_phi3_with_longrope(tmp_path):
    random_model("phi3", seed=6, **VARIANTS["phi3-longrope"]).save_pretrained(
        tmp_path, safe_serialization=True)
    generate_hf_runs(tmp_path)


def test_a_checkpoint_reports_its_own_family(tmp_path):
    """A Phi-3 checkpoint is of the family "phi3", runs as refmath's "phi3", and is written back
    as a phi3 (with or without LongRoPE)."""
    random_model("phi3").save_pretrained(tmp_path / "in", safe_serialization=True)
    assert hf.checkpoint_family(hf.read_config(tmp_path / "in")) == "phi3"
    name, config, params = hf.load_checkpoint(tmp_path / "in")
    assert name == "phi3" and config.rope_scaling is None and config.sliding_window == 5
    hf.save_checkpoint(tmp_path / "out", name, config, params)
    assert hf.checkpoint_family(hf.read_config(tmp_path / "out")) == "phi3"


def refmath_phi3(**fields) -> phi3.Phi3Config:
    """LongRoPE past 8 tokens, a window of 4, RoPE's interleaved layout (permuted on the way), the
    RMSNorms' epsilon 1e-6 (the decoder's default, as in this test before Phi-3 had its file)."""
    return phi3.Phi3Config(**{**dict(
        vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
        d_ff=40, rope_base=300.0, sliding_window=4, norm_eps=1e-6, rope_scaling=dict(
            rope_type="longrope", factor=4.0, original_max_seq_len=8,
            short_factor=(1.0, 1.2, 1.5, 2.0), long_factor=(1.0, 2.0, 5.0, 9.0))), **fields})


def test_saved_checkpoint_gives_the_logits_of_refmath_in_transformers(tmp_path, monkeypatch):
    config = refmath_phi3()
    rng = np.random.default_rng(8)
    params = {key: value + 0.1 * rng.standard_normal(value.shape)  # gains off 1
              for key, value in phi3.init_params(config, seed=8).items()}
    hf.save_checkpoint(tmp_path, "phi3", config, params)
    model = load_float64(tmp_path)
    tokens = TOKENS[:, :11]
    z = phi3.logits(params, tokens, config)
    error = relative_error(z, hf_logits(float64_internals(model, monkeypatch), tokens))
    print(f"phi3 (LongRoPE past 8 tokens, sliding window 4, interleaved RoPE): largest logit "
          f"difference {error:.1e} of the largest logit")
    assert error < REL


def test_written_with_its_fused_projections_and_read_back(tmp_path):
    """Phi-3 stacks the query, key and value rows into qkv_proj and the gate and up rows into
    gate_up_proj (the logits test above holds the stacking to transformers' reading of it); the
    reader splits them back into the same parameters."""
    from safetensors.numpy import load_file

    config = refmath_phi3(rope_layout="half")
    params = phi3.init_params(config, seed=3)
    hf.save_checkpoint(tmp_path, "phi3", config, params)
    written = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
    tensors = load_file(str(tmp_path / hf.WEIGHTS_FILE))
    assert (written["model_type"], written["sliding_window"]) == ("phi3", 4)
    assert written["original_max_position_embeddings"] == 8
    assert tensors["model.layers.0.self_attn.qkv_proj.weight"].shape == ((4 + 2 * 2) * 8, 32)
    assert tensors["model.layers.1.mlp.gate_up_proj.weight"].shape == (2 * 40, 32)
    assert not any(key.endswith(("q_proj.weight", "gate_proj.weight")) for key in tensors)
    name, loaded, back = hf.load_checkpoint(tmp_path, dtype=np.float64)
    assert (name, loaded) == ("phi3", config)
    assert back.keys() == params.keys()
    for key in params:
        np.testing.assert_array_equal(back[key], params[key])


@pytest.mark.parametrize("fields, message", [
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                           "partial_rotary_factor": 0.5}), "partial_rotary_factor = 0.5"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}),
     "rope_parameters.rope_type = 'linear'"),
    (dict(head_dim=6), "head_dim = 6"),
    (dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
])
def test_refuses_what_phi3_does_not_compute(fields, message, tmp_path):
    random_model("phi3").save_pretrained(tmp_path, safe_serialization=True)
    edit_config(tmp_path, **fields)
    assert message in one_line_error(tmp_path)
