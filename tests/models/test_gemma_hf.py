"""Gemma (refmath.models.gemma) against Hugging Face transformers: gemma, gemma2 and gemma3_text
checkpoints built with random weights (tests/_hf_oracle.py), their float64 logits, greedy tokens
and cached decoding equal to transformers', refmath's Gemmas written and read back by
transformers, and a checkpoint that reports its own family."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is the oracle's backend: the 'oracle' extra")
pytest.importorskip("transformers", reason="the comparison needs transformers>=5")
pytest.importorskip("safetensors", reason="checkpoints are safetensors: install the 'hf' extra")

from refmath import hf  # noqa: E402
from refmath.inference.kv_cache import decode_step, prefill  # noqa: E402
from refmath.models import gemma  # noqa: E402
from refmath.models.gemma import GemmaConfig  # noqa: E402

from _hf_oracle import (REL, TOKENS, VOCAB, float64_internals, greedy_tokens_match, hf_logits,  # noqa: E402
                        load_float64, random_model, relative_error, run_main)

GEMMAS = ("gemma", "gemma2", "gemma3_text")


@pytest.mark.parametrize("model_type", GEMMAS)
def test_loaded_checkpoint_gives_the_logits_of_transformers(model_type, tmp_path, monkeypatch):
    model = random_model(model_type)
    model.save_pretrained(tmp_path, safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path, dtype=np.float64)
    assert name == "gemma" and type(config) is GemmaConfig
    assert config.generation == GEMMAS.index(model_type) + 1
    z = gemma.logits(params, TOKENS, config)
    error = relative_error(z, hf_logits(float64_internals(model, monkeypatch), TOKENS))
    print(f"{model_type}: largest logit difference {error:.1e} of the largest logit")
    assert error < 1e-13  # float64 rounding (~1e-15), with room to spare


@pytest.mark.parametrize("model_type", GEMMAS)
def test_greedy_generation_gives_the_tokens_of_transformers(model_type, tmp_path, monkeypatch):
    model = random_model(model_type, seed=1)
    greedy_tokens_match(model, tmp_path, monkeypatch)


@pytest.mark.parametrize("model_type", GEMMAS)
def test_cached_decode_equals_recomputing(model_type, tmp_path):
    """Gemma's capped scores, local and global layers and their two RoPEs are the same one row at a
    time through the KV cache."""
    random_model(model_type, seed=4).save_pretrained(tmp_path, safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path, dtype=np.float64)
    tokens = TOKENS[:, :12]
    full = gemma.logits(params, tokens, config)
    _, cache = prefill(name, params, config, tokens[:, :5])
    for t in range(5, 12):
        z = decode_step(name, params, config, cache, tokens[:, t])
        np.testing.assert_allclose(z, full[:, t], rtol=1e-11, atol=1e-11 * np.abs(full).max())


@pytest.mark.parametrize("model_type", GEMMAS)
def test_generate_hf_runs_each_gemma(model_type, tmp_path):
    random_model(model_type, seed=6).save_pretrained(tmp_path, safe_serialization=True)
    status, out, err = run_main(["generate", "--hf", str(tmp_path), "--prompt-ids", "1,2,3",
                                 "--greedy", "--max-new-tokens", "12"])
    assert status == 0, err
    ids = [int(i) for i in out.strip().split(",")]  # it may stop early at the config's eos
    assert ids[:3] == [1, 2, 3] and 3 < len(ids) <= 15
    assert f"a {model_type} checkpoint as refmath's gemma model" in err


_GEMMA = dict(vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
              head_dim=6, d_ff=40, rope_base=300.0)
REFMATH_CONFIGS = {
    "gemma (GeGLU, (1 + w) norms, scaled embeddings)": GemmaConfig(**_GEMMA),
    "gemma2 (capped scores and logits, sandwich norms, a local layer)": GemmaConfig(
        **_GEMMA, generation=2, query_pre_attn_scalar=12.0, attn_softcap=2.0, final_softcap=3.0,
        windows=(4, None)),
    "gemma3_text (QK-norm, the local layer's own RoPE)": GemmaConfig(
        **_GEMMA, generation=3, query_pre_attn_scalar=10.0, windows=(4, None),
        local_rope_base=100.0, rope_scaling=dict(rope_type="linear", factor=4.0)),
}


@pytest.mark.parametrize("label", sorted(REFMATH_CONFIGS))
def test_saved_checkpoint_gives_the_logits_of_refmath_in_transformers(label, tmp_path,
                                                                      monkeypatch):
    config = REFMATH_CONFIGS[label]
    rng = np.random.default_rng(8)
    params = {key: value + 0.1 * rng.standard_normal(value.shape)  # gains off 0
              for key, value in gemma.init_params(config, seed=8).items()}
    hf.save_checkpoint(tmp_path, "gemma", config, params)
    model = load_float64(tmp_path)
    tokens = TOKENS[:, :11]
    z = gemma.logits(params, tokens, config)
    error = relative_error(z, hf_logits(float64_internals(model, monkeypatch), tokens))
    print(f"{label}: largest logit difference {error:.1e} of the largest logit")
    assert error < REL
    assert error < 1e-13  # float64 rounding, with room to spare
    name, read, back = hf.load_checkpoint(tmp_path, dtype=np.float64)  # and back, the same model
    assert name == "gemma" and read.generation == config.generation
    np.testing.assert_allclose(gemma.logits(back, tokens, read), z, rtol=0,
                               atol=REL * np.abs(z).max())


def test_a_gemma2_checkpoint_reports_its_own_family(tmp_path):
    """A Gemma 2 checkpoint is of the family "gemma2" and runs as refmath's "gemma" model; saving
    what was loaded writes gemma2 again."""
    random_model("gemma2").save_pretrained(tmp_path / "in", safe_serialization=True)
    assert hf.checkpoint_family(hf.read_config(tmp_path / "in")) == "gemma2"
    name, config, params = hf.load_checkpoint(tmp_path / "in")
    assert name == hf.config_from_hf(hf.read_config(tmp_path / "in"))[0] == "gemma"
    hf.save_checkpoint(tmp_path / "out", name, config, params)
    assert hf.checkpoint_family(hf.read_config(tmp_path / "out")) == "gemma2"


@pytest.mark.parametrize("fields, message", [
    (dict(generation=2, windows=(4, 3)), "one sliding_window"),
    (dict(windows=(4, None)), r"gemma \(generation 1\) has no windows"),
    (dict(final_softcap=2.0), r"gemma \(generation 1\) has no windows"),
])
def test_save_refuses_what_no_gemma_holds(fields, message, tmp_path):
    config = GemmaConfig(**_GEMMA, **fields)
    with pytest.raises(hf.HFCheckpointError, match=message):
        hf.save_checkpoint(tmp_path, "gemma", config, gemma.init_params(config))


def test_an_untied_gemma_is_refused(tmp_path):
    random_model("gemma", tie_word_embeddings=False).save_pretrained(tmp_path,
                                                                     safe_serialization=True)
    with pytest.raises(hf.HFCheckpointError, match="tie_word_embeddings"):
        hf.load_checkpoint(tmp_path)
