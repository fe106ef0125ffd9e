"""Falcon (refmath.models.falcon) against Hugging Face transformers: checkpoints of every layout
built with random weights (tests/_hf_oracle.py), their float64 logits, greedy tokens and cached
decoding equal to transformers', refmath's Falcon written and read back by transformers, and what
no Falcon of refmath computes refused in one line."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is the oracle's backend: the 'oracle' extra")
pytest.importorskip("transformers", reason="the comparison needs transformers>=5")
pytest.importorskip("safetensors", reason="checkpoints are safetensors: install the 'hf' extra")

from refmath import hf  # noqa: E402
from refmath.inference.kv_cache import decode_step, prefill  # noqa: E402
from refmath.models import falcon  # noqa: E402

from _hf_oracle import (REL, TOKENS, VOCAB, edit_config, float64_internals, greedy_tokens_match,  # noqa: E402
                        hf_logits, load_float64, one_line_error, random_model, relative_error,
                        run_main)

# Falcon's layouts: 7B's and 40B's, 40B's with one norm, the old one with a key and value per head
# (untied, tanh-GELU), its sequential block, and a rope scaling
FALCONS = {"falcon": ("falcon", {}), "falcon-40b": ("falcon-40b", {}),
           "falcon-40b-one-norm": ("falcon-40b", dict(num_ln_in_parallel_attn=1)),
           "falcon-mha-untied-tanh": ("falcon", dict(multi_query=False, tie_word_embeddings=False,
                                                     activation="gelu_pytorch_tanh")),
           "falcon-sequential": ("falcon", dict(parallel_attn=False)),
           "falcon-linear": ("falcon", {"rope_parameters": {"rope_type": "linear",
                                                            "rope_theta": 500.0, "factor": 4.0}})}
LAYOUTS = [v for v in FALCONS if v != "falcon-linear"]


@pytest.mark.parametrize("variant", sorted(FALCONS))
def test_loaded_checkpoint_gives_the_logits_of_transformers(variant, tmp_path, monkeypatch):
    model_type, overrides = FALCONS[variant]
    model = random_model(model_type, **overrides)
    model.save_pretrained(tmp_path, safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path, dtype=np.float64)
    assert name == "falcon" and type(config) is falcon.FalconConfig
    z = falcon.logits(params, TOKENS, config)
    error = relative_error(z, hf_logits(float64_internals(model, monkeypatch), TOKENS))
    print(f"{variant}: largest logit difference {error:.1e} of the largest logit")
    assert error < 1e-13  # float64 rounding (~1e-15), with room to spare


@pytest.mark.parametrize("variant", ["falcon", "falcon-40b"])
def test_greedy_generation_gives_the_tokens_of_transformers(variant, tmp_path, monkeypatch):
    model_type, overrides = FALCONS[variant]
    model = random_model(model_type, seed=1, **overrides)
    greedy_tokens_match(model, tmp_path, monkeypatch)


@pytest.mark.parametrize("variant", LAYOUTS)
def test_cached_decode_equals_recomputing(variant, tmp_path):
    """The parallel block, one row at a time through the KV cache, gives the whole sequence's
    logits."""
    model_type, overrides = FALCONS[variant]
    random_model(model_type, seed=4, **overrides).save_pretrained(tmp_path,
                                                                  safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path, dtype=np.float64)
    tokens = TOKENS[:, :12]
    full = falcon.logits(params, tokens, config)
    _, cache = prefill(name, params, config, tokens[:, :5])
    for t in range(5, 12):
        z = decode_step(name, params, config, cache, tokens[:, t])
        np.testing.assert_allclose(z, full[:, t], rtol=1e-11, atol=1e-11 * np.abs(full).max())


def test_generate_hf_runs_falcon_and_names_its_family(tmp_path):
    random_model("falcon-40b", seed=6).save_pretrained(tmp_path, safe_serialization=True)
    status, out, err = run_main(["generate", "--hf", str(tmp_path), "--prompt-ids", "1,2,3",
                                 "--greedy", "--max-new-tokens", "12"])
    assert status == 0, err
    ids = [int(i) for i in out.strip().split(",")]  # it may stop early at the config's eos
    assert ids[:3] == [1, 2, 3] and 3 < len(ids) <= 15
    assert "a falcon checkpoint as refmath's falcon model" in err


def test_a_checkpoint_reports_its_own_family(tmp_path):
    random_model("falcon").save_pretrained(tmp_path / "in", safe_serialization=True)
    assert hf.checkpoint_family(hf.read_config(tmp_path / "in")) == "falcon"
    name, config, params = hf.load_checkpoint(tmp_path / "in")
    assert name == hf.config_from_hf(hf.read_config(tmp_path / "in"))[0] == "falcon"
    hf.save_checkpoint(tmp_path / "out", name, config, params)
    assert hf.checkpoint_family(hf.read_config(tmp_path / "out")) == "falcon"


# ---- refmath's Falcon written out ----------------------------------------------------------------

_FALCON = dict(vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, d_ff=40,
               rope_base=300.0, norm_eps=1e-5)
WRITTEN = {
    "parallel block, one LayerNorm, MQA, interleaved RoPE": dict(n_kv_heads=1,
                                                                 tie_embeddings=True),
    "two LayerNorms, GQA, untied, tanh GELU, half RoPE": dict(
        ffn="gelu_tanh", n_kv_heads=2, parallel_norms=2, rope_layout="half"),
    "sequential block, MHA, linear scaling": dict(
        parallel_block=False, rope_scaling=dict(rope_type="linear", factor=2.0)),
}


@pytest.mark.parametrize("label", sorted(WRITTEN))
def test_saved_checkpoint_gives_the_logits_of_refmath_in_transformers(label, tmp_path,
                                                                      monkeypatch):
    config = falcon.FalconConfig(**_FALCON, **WRITTEN[label])
    rng = np.random.default_rng(8)
    params = {key: value + 0.1 * rng.standard_normal(value.shape)  # biases and gains off 0 and 1
              for key, value in falcon.init_params(config, seed=8).items()}
    hf.save_checkpoint(tmp_path, "falcon", config, params)
    model = load_float64(tmp_path)
    tokens = TOKENS[:, :11]
    z = falcon.logits(params, tokens, config)
    error = relative_error(z, hf_logits(float64_internals(model, monkeypatch), tokens))
    print(f"{label}: largest logit difference {error:.1e} of the largest logit")
    assert error < REL
    assert error < 1e-13  # float64 rounding, with room to spare


@pytest.mark.parametrize("fields, message", [
    (dict(norm="layernorm_no_bias"), "falcon, which needs norm = 'layernorm'"),
    (dict(ffn="swiglu"), "ffn = 'gelu' or 'gelu_tanh'"),
    (dict(parallel_block=False, n_heads=4, n_kv_heads=2), "n_kv_heads = 2"),
])
def test_save_refuses_what_no_falcon_checkpoint_holds(fields, message, tmp_path):
    config = falcon.FalconConfig(**{**dict(vocab_size=11, max_seq_len=8, d_model=16, n_layers=1,
                                           n_heads=2), **fields})
    with pytest.raises(hf.HFCheckpointError, match=message):
        hf.save_checkpoint(tmp_path, "falcon", config, falcon.init_params(config))
    with pytest.raises(TypeError, match="FalconConfig"):
        hf.save_checkpoint(tmp_path, "llama", config, falcon.init_params(config))


# ---- refusals and layouts ------------------------------------------------------------------------

@pytest.mark.parametrize("variant, fields, message", [
    ("falcon", dict(alibi=True), "alibi = True"),
    ("falcon", dict(bias=True), "bias = True"),
    ("falcon", dict(activation="relu"), "activation = 'relu'"),
    ("falcon-40b", dict(parallel_attn=False), "parallel_attn = False"),
    ("falcon", dict(num_ln_in_parallel_attn=2), "num_ln_in_parallel_attn = 2"),
    ("falcon", dict(multi_query=False, num_kv_heads=2), "num_kv_heads = 2"),
])
def test_refuses_what_falcon_does_not_compute(variant, fields, message, tmp_path):
    random_model(variant).save_pretrained(tmp_path, safe_serialization=True)
    edit_config(tmp_path, **fields)
    assert message in one_line_error(tmp_path)


@pytest.mark.parametrize("variant, expected", [
    ("falcon", (1, True, 1, "gelu", True)),
    ("falcon-40b", (2, True, 2, "gelu", True)),
    ("falcon-40b-one-norm", (2, True, 1, "gelu", True)),
    ("falcon-mha-untied-tanh", (4, True, 1, "gelu_tanh", False)),
    ("falcon-sequential", (1, False, 1, "gelu", True)),
])
def test_falcon_layouts_load_as_their_blocks(variant, expected, tmp_path):
    """(key/value heads, parallel block, its norms, GELU, tied) of each Falcon layout: the
    logits tests above hold them to transformers' numbers."""
    model_type, overrides = FALCONS[variant]
    random_model(model_type, **overrides).save_pretrained(tmp_path, safe_serialization=True)
    _, config, _ = hf.load_checkpoint(tmp_path)
    assert (config.kv_heads, config.parallel_block, config.parallel_norms, config.ffn,
            config.tie_embeddings) == expected
    assert (config.norm, config.d_f, config.rope_layout) == ("layernorm", 48, "half")
