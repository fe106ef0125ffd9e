"""refmath.hf against Hugging Face transformers: every checkpoint is built here from a config with
random weights and written by ``save_pretrained`` in safetensors format (nothing is downloaded).

transformers computes RMSNorm, RoPE's angles and the mixture-of-experts routers in float32 even
inside a float64 model, which limits any float64 comparison to float32's ~1e-7.
:func:`float64_internals` (tests/_hf_oracle.py, shared with each family's tests/models/test_<family>_hf.py) replaces those forwards by the same formulas evaluated in float64 (the
weights, head layouts, attention, experts, MLP and head stay transformers' own), so the logits can
be compared at a relative 1e-9.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is the test oracle's backend: install the 'oracle' extra")
transformers = pytest.importorskip(
    "transformers", reason="the comparison needs transformers: pip install 'transformers>=5'")
pytest.importorskip("safetensors", reason="checkpoints are safetensors: install the 'hf' extra")

from refmath import hf, kernels  # noqa: E402
from refmath.sizing import hf_parameter_count, sizing_config  # noqa: E402
from refmath.commands import main  # noqa: E402
from refmath.inference.generate import generate  # noqa: E402
from refmath.models import model_module  # noqa: E402

from _hf_oracle import (REL, TOKENS, VOCAB, edit_config, float64_internals,  # noqa: E402
                        generate_hf_runs, hf_config, hf_logits, load_float64, one_line_error,
                        random_model, relative_error, run_main)


MODEL_TYPES = ("gpt2", "openai-gpt", "llama", "mistral", "qwen2", "qwen3", "deepseek_v2",
               "deepseek_v3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2-moe",
               "deepseek_v3-moe")
EXPERTS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2-moe", "deepseek_v3-moe")


def rope(rope_type, **fields):
    return {"rope_parameters": {"rope_type": rope_type, "rope_theta": 500.0, **fields}}


# Context extension (N13-N17): head_dim 8 and base 500 give wavelengths 6.3, 30, 140 and 660
# tokens, so each rule moves some pairs and keeps others within the tests' 13 tokens.
SCALED = {
    "llama-linear": ("llama", rope("linear", factor=4.0)),
    # max_position_embeddings 8 < 13 tokens: the base stretches with the length
    "llama-dynamic": ("llama", dict(max_position_embeddings=8, **rope("dynamic", factor=4.0))),
    "llama-llama3": ("llama", rope("llama3", factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=32)),
    "llama-yarn": ("llama", rope("yarn", factor=4.0, original_max_position_embeddings=16,
                                 beta_fast=8.0, beta_slow=0.5)),
    "llama-yarn-mscale": ("llama", rope("yarn", factor=4.0, original_max_position_embeddings=16,
                                        mscale=1.0, mscale_all_dim=0.5)),
    "qwen3-yarn": ("qwen3", rope("yarn", factor=4.0, original_max_position_embeddings=16)),
    # LongRoPE's per-pair factors, the long ones past 8 tokens (Phi-3's own file:
    # tests/models/test_phi3_hf.py)
    "llama-longrope": ("llama", rope("longrope", factor=4.0, original_max_position_embeddings=8,
                                     short_factor=[1.0, 1.2, 1.5, 2.0],
                                     long_factor=[1.0, 2.0, 5.0, 9.0])),
    # DeepSeek-V2's and V3's own terms: mscale = mscale_all_dim leaves m = 1 on the rotation and
    # moves the temperature into the softmax scale
    "deepseek_v2-yarn": ("deepseek_v2", rope("yarn", factor=40.0, original_max_position_embeddings=4,
                                             beta_fast=4, beta_slow=1, mscale=0.707,
                                             mscale_all_dim=0.707)),
    "deepseek_v3-yarn": ("deepseek_v3", rope("yarn", factor=40.0, original_max_position_embeddings=4,
                                             beta_fast=4, beta_slow=1, mscale=1.0,
                                             mscale_all_dim=0.5)),
}
# Qwen's windows of 4 (the tests run 13 tokens): Qwen2's on the layers from max_window_layers on,
# Qwen3's on every layer, Qwen2-MoE's on the even layers below max_window_layers, Qwen3-MoE's on
# every layer whatever its layer types
QWEN_WINDOWS = {
    "qwen2-upper-window": ("qwen2", dict(use_sliding_window=True, sliding_window=4,
                                         max_window_layers=1)),
    "qwen3-window": ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)),
    "qwen2_moe-window": ("qwen2_moe", dict(use_sliding_window=True, sliding_window=4,
                                           max_window_layers=2)),
    "qwen3_moe-window": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=4)),
}
VARIANTS = {  # id -> (model_type, config overrides)
    **{t: (t, {}) for t in MODEL_TYPES},
    **SCALED,
    **QWEN_WINDOWS,
    "gpt2-untied-exact-gelu": ("gpt2", dict(tie_word_embeddings=False, activation_function="gelu")),
    "deepseek_v3-half-rope": ("deepseek_v3", dict(rope_interleave=False, q_lora_rank=None)),
}


# ---- logits and generation -------------------------------------------------------------------

@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_loaded_checkpoint_gives_the_logits_of_transformers(variant, tmp_path, monkeypatch):
    model_type, overrides = VARIANTS[variant]
    model = random_model(model_type, **overrides)
    model.save_pretrained(tmp_path, safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path, dtype=np.float64)
    z = model_module(name).logits(params, TOKENS, config)
    reference = hf_logits(float64_internals(model, monkeypatch), TOKENS)
    error = relative_error(z, reference)
    print(f"{variant}: largest logit difference {error:.1e} of the largest logit")
    assert error < REL
    if variant in SCALED or variant in ("qwen3", *EXPERTS,
                                        *QWEN_WINDOWS):  # float64 rounding
        assert error < 1e-13                                         # (~1e-15), with room to spare


@pytest.mark.parametrize("variant", [*MODEL_TYPES, *SCALED, *QWEN_WINDOWS])
def test_greedy_generation_gives_the_tokens_of_transformers(variant, tmp_path, monkeypatch):
    model_type, overrides = VARIANTS[variant]
    model = random_model(model_type, seed=1, **overrides)
    model.save_pretrained(tmp_path, safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path, dtype=np.float64)
    prompt = TOKENS[0, :6]
    ours = generate(name, params, config, prompt, 16, greedy=True)  # through the KV cache
    float64_internals(model, monkeypatch)
    model.generation_config.eos_token_id = None  # 16 tokens, whatever they are
    # transformers' cache keeps the keys a dynamic NTK (or LongRoPE) rotated at shorter lengths
    # (stale past the trained context, K3); refmath prefills afresh there, which is recomputing
    use_cache = variant not in ("llama-dynamic", "llama-longrope")
    with torch.no_grad():
        theirs = model.generate(torch.as_tensor(prompt[None]), max_new_tokens=16, do_sample=False,
                                pad_token_id=0, use_cache=use_cache)[0].numpy()
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("variant", sorted(SCALED))
def test_cached_decode_of_a_scaled_rope_equals_recomputing(variant, tmp_path):
    """Prefill then one decode step per token gives the logits of the whole sequence run at once;
    for dynamic NTK the step past the trained context is refused as stale (K3), and generate
    prefills afresh there."""
    from refmath.inference.kv_cache import decode_step, prefill

    model_type, overrides = VARIANTS[variant]
    random_model(model_type, seed=4, **overrides).save_pretrained(tmp_path,
                                                                  safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path, dtype=np.float64)
    module = model_module(name)
    tokens = TOKENS[:, :12]
    full = module.logits(params, tokens, config)
    if variant in ("llama-dynamic", "llama-longrope"):
        z, cache = prefill(name, params, config, tokens[:, :8], all_logits=True)
        np.testing.assert_allclose(z, module.logits(params, tokens[:, :8], config), rtol=1e-12,
                                   atol=1e-12)
        with pytest.raises(ValueError, match="stale"):
            decode_step(name, params, config, cache, tokens[:, 8])
        return
    _, cache = prefill(name, params, config, tokens[:, :5])
    for t in range(5, 12):
        z = decode_step(name, params, config, cache, tokens[:, t])
        np.testing.assert_allclose(z, full[:, t], rtol=1e-11, atol=1e-11 * np.abs(full).max())


@pytest.mark.parametrize("variant", [*EXPERTS, *QWEN_WINDOWS])
def test_cached_decode_of_experts_and_windows_equals_recomputing(variant, tmp_path):
    """Each decode step routes its one new token as the whole sequence routed it (E4 on one row);
    a window on some layers is the same one row at a time (Gemma's local layers:
    tests/models/test_gemma_hf.py)."""
    from refmath.inference.kv_cache import decode_step, prefill

    model_type, overrides = VARIANTS[variant]
    random_model(model_type, seed=4, **overrides).save_pretrained(tmp_path,
                                                                  safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path, dtype=np.float64)
    tokens = TOKENS[:, :12]
    full = model_module(name).logits(params, tokens, config)
    _, cache = prefill(name, params, config, tokens[:, :5])
    for t in range(5, 12):
        z = decode_step(name, params, config, cache, tokens[:, t])
        np.testing.assert_allclose(z, full[:, t], rtol=1e-11, atol=1e-11 * np.abs(full).max())


@pytest.mark.parametrize("variant", ["qwen3", *EXPERTS, *sorted(SCALED)])
def test_generate_hf_runs_each_new_type(variant, tmp_path):
    model_type, overrides = VARIANTS[variant]
    random_model(model_type, seed=6, **overrides).save_pretrained(tmp_path,
                                                                  safe_serialization=True)
    generate_hf_runs(tmp_path)


def test_mistral_window_is_the_models_window(tmp_path):
    """The logits test above runs 13 tokens through a window of 5, and generation passes it: the
    window changes the logits there, so those tests check it."""
    import dataclasses

    random_model("mistral").save_pretrained(tmp_path, safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path, dtype=np.float64)
    assert (config.sliding_window, config.max_seq_len) == (5, 64)
    z = model_module(name).logits(params, TOKENS, config)
    unwindowed = dataclasses.replace(config, sliding_window=None)
    z_full = model_module(name).logits(params, TOKENS, unwindowed)
    np.testing.assert_array_equal(z[:, :5], z_full[:, :5])
    assert np.abs(z[:, 5:] - z_full[:, 5:]).min() > 0


def test_windowed_decoding_on_the_cpu_kernels(tmp_path):
    """The KV cache's windowed decode step hands the kernel the window's rows: the same tokens as
    the NumPy reference, and as recomputing every prefix."""
    random_model("mistral", seed=9).save_pretrained(tmp_path, safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path)  # float32, as the kernels need
    runs = [generate(name, params, config, TOKENS[0, :3], 12, greedy=True, **how)
            for how in ({"backend": "numpy"}, {"backend": "cpu"}, {"cache": False})]
    np.testing.assert_array_equal(runs[1], runs[0])
    np.testing.assert_array_equal(runs[2], runs[0])


@pytest.mark.parametrize("variant, expected", [
    ("qwen2-upper-window", (4, (False, True))), ("qwen3-window", (4, None)),
    ("qwen2_moe-window", (4, (True, False))), ("qwen3_moe-window", (4, None)),
])
def test_qwens_windows_slide_the_layers_transformers_slides(variant, expected, tmp_path):
    """Qwen slides its window on some layers: those layers, and only those, slide here too,
    over the whole trained context (the logits, generation and cached-decode tests above run 13
    tokens through these windows of 4)."""
    model_type, overrides = VARIANTS[variant]
    random_model(model_type, **overrides).save_pretrained(tmp_path, safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path, dtype=np.float64)
    assert (config.sliding_window, config.window_layers, config.max_seq_len) == (*expected, 64)
    unwindowed = dataclasses.replace(config, sliding_window=None, window_layers=None)
    z = model_module(name).logits(params, TOKENS, config)
    z_full = model_module(name).logits(params, TOKENS, unwindowed)
    np.testing.assert_array_equal(z[:, :4], z_full[:, :4])
    assert np.abs(z[:, 4:] - z_full[:, 4:]).min() > 0


@pytest.mark.parametrize("torch_dtype,ours", [(torch.bfloat16, "BF16"), (torch.float16, "F16")])
def test_16_bit_checkpoints_convert_exactly(torch_dtype, ours, tmp_path, monkeypatch):
    """bf16/fp16 files: the loaded float64 parameters are exactly the 16-bit values, so the logits
    equal transformers' on the same rounded weights held in float64."""
    model = random_model("llama", seed=2).to(torch_dtype)
    model.save_pretrained(tmp_path, safe_serialization=True)
    header = hf._read_header(tmp_path / hf.WEIGHTS_FILE)
    assert {t.dtype for t in header.values()} == {ours}
    name, config, params = hf.load_checkpoint(tmp_path, dtype=np.float64)
    model = float64_internals(model.to(torch.float64), monkeypatch)
    np.testing.assert_array_equal(params["tok_emb"],
                                  model.model.embed_tokens.weight.detach().numpy())
    error = relative_error(model_module(name).logits(params, TOKENS, config),
                           hf_logits(model, TOKENS))
    print(f"{ours} llama: largest logit difference {error:.1e} of the largest logit")
    assert error < REL


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    model = random_model("qwen2", seed=3)
    model.save_pretrained(tmp_path / "one", safe_serialization=True)
    model.save_pretrained(tmp_path / "shards", safe_serialization=True, max_shard_size="40KB")
    shards = sorted(p.name for p in (tmp_path / "shards").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "shards" / hf.INDEX_FILE).is_file()
    _, _, single = hf.load_checkpoint(tmp_path / "one", dtype=np.float64)
    _, _, sharded = hf.load_checkpoint(tmp_path / "shards", dtype=np.float64)
    assert single.keys() == sharded.keys()
    for key in single:
        np.testing.assert_array_equal(single[key], sharded[key])


def test_gpt2_in_the_layout_of_the_released_file(tmp_path, monkeypatch):
    """The released GPT-2 weights name tensors without the ``transformer.`` prefix and keep the
    causal mask as ``h.{i}.attn.bias`` buffers; they load the same."""
    model = random_model("gpt2", seed=7)
    model.save_pretrained(tmp_path, safe_serialization=True)

    def edit(tensors):
        for name in list(tensors):
            tensors[name.removeprefix("transformer.")] = tensors.pop(name)
        for i in range(2):
            tensors[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), np.float32))
    rewrite_weights(tmp_path, edit)
    name, config, params = hf.load_checkpoint(tmp_path, dtype=np.float64)
    reference = hf_logits(float64_internals(model, monkeypatch), TOKENS)
    assert relative_error(model_module(name).logits(params, TOKENS, config), reference) < REL


# ---- writing ------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_name", ["gpt", "llama", "mla"])
def test_refmath_trained_model_saved_loads_in_transformers(model_name, tmp_path, monkeypatch):
    """A few training steps, ``convert --to-hf``, then transformers' logits equal refmath's.
    The llama run uses RoPE's interleaved layout, so its q/k columns are permuted on the way."""
    import dataclasses

    from refmath.data import make_task
    from refmath.train import default_config, load_checkpoint as load_run, recipe, train

    task = {**recipe(model_name).task, "seq_len": 16}
    config = dataclasses.replace(default_config(model_name, make_task(task)), d_model=32)
    if model_name == "mla":  # deepseek_v3 always normalises its latents, with epsilon 1e-6
        config = dataclasses.replace(config, latent_norm=True, latent_norm_eps=1e-6)
    run = tmp_path / "run"
    train(model_name, run, steps=3, batch_size=4, eval_every=3, accuracy_examples=0,
          config=config, task=task, out=io.StringIO())
    ckpt = load_run(run)
    if model_name == "llama":
        assert ckpt.config.rope_layout == "interleaved"
    out = tmp_path / "hf"
    assert main(["convert", "--to-hf", str(run), str(out)]) == 0
    model = load_float64(out)
    float64_internals(model, monkeypatch)
    tokens = np.random.default_rng(1).integers(0, ckpt.config.vocab_size, (2, 11))
    params64 = {k: v.astype(np.float64) for k, v in ckpt.params.items()}
    z = model_module(model_name).logits(params64, tokens, ckpt.config)
    error = relative_error(z, hf_logits(model, tokens))
    print(f"trained {model_name}: largest logit difference {error:.1e} of the largest logit")
    assert error < REL
    # the run's tokenizer went with it: transformers reads the same ids for the same text
    text = "the cat. a dog\n"
    ours = make_task(ckpt.task).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert theirs(text)["input_ids"] == ours.encode(text).tolist()
    assert theirs.decode(ours.encode(text)) == text
    assert (model.config.bos_token_id, model.config.eos_token_id) == (ours.bos_id, ours.eos_id)
    assert main(["generate", "--hf", str(out), "--prompt", "the", "--max-new-tokens", "3",
                 "--greedy"]) == 0
    # and back: the written directory loads into the same parameters
    name, config, params = hf.load_checkpoint(out, dtype=np.float64)
    assert name == model_name
    np.testing.assert_allclose(model_module(name).logits(params, tokens, config), z, rtol=0,
                               atol=REL * np.abs(z).max())


def refmath_configs():
    from refmath.models import decoder, gpt, mla

    return {
        "qwen2 (q/k/v biases, tied, interleaved RoPE)": ("llama", decoder.DecoderConfig(
            vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1,
            d_ff=40, qkv_bias=True, tie_embeddings=True, rope_base=300.0)),
        "qwen3 (QK-norm, YaRN, interleaved RoPE)": ("llama", decoder.DecoderConfig(
            vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
            d_ff=40, qk_norm="head", rope_base=300.0,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_seq_len=8))),
        "llama (llama3 scaling, half RoPE)": ("llama", decoder.DecoderConfig(
            vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
            d_ff=40, rope_base=300.0, rope_layout="half",
            rope_scaling=dict(rope_type="llama3", factor=8.0, original_max_seq_len=16))),
        "llama (dynamic NTK past 8 tokens)": ("llama", decoder.DecoderConfig(
            vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
            d_ff=40, rope_base=300.0,
            rope_scaling=dict(rope_type="dynamic", factor=4.0, original_max_seq_len=8))),
        "mistral (sliding window 4, interleaved RoPE)": ("llama", decoder.DecoderConfig(
            vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
            d_ff=40, sliding_window=4)),
        "openai-gpt (Post-LN)": ("gpt", gpt.GPTConfig(
            vocab_size=VOCAB, max_seq_len=32, n_layers=2, d_model=32, n_heads=4,
            norm_position="post", dropout=0.0)),
        "gpt2 (untied, exact GELU)": ("gpt", gpt.GPTConfig(
            vocab_size=VOCAB, max_seq_len=32, n_layers=2, d_model=32, n_heads=4, d_ff=48,
            tie_embeddings=False, ffn="gelu", dropout=0.0, norm_eps=1e-6)),
        "deepseek_v3 (YaRN with mscale_all_dim)": ("mla", mla.MLAConfig(
            vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, d_c=12,
            d_rope=4, head_dim=6, v_head_dim=10, latent_norm=True, d_ff=40,
            latent_norm_eps=1e-6, norm_eps=1e-5, rope_scaling=dict(
                rope_type="yarn", factor=8.0, original_max_seq_len=4, mscale=1.0,
                mscale_all_dim=1.0))),
        "deepseek_v3 (query compression, half RoPE)": ("mla", mla.MLAConfig(
            vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, d_c=12,
            d_rope=4, head_dim=6, v_head_dim=10, q_lora_rank=8, latent_norm=True, d_ff=40,
            rope_layout="half", latent_norm_eps=1e-6, norm_eps=1e-5)),
        "mistral (LongRoPE past 8 tokens, sliding window 4, interleaved RoPE)": (
            "llama", decoder.DecoderConfig(
                vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                d_ff=40, rope_base=300.0, sliding_window=4, rope_scaling=dict(
                    rope_type="longrope", factor=4.0, original_max_seq_len=8,
                    short_factor=(1.0, 1.2, 1.5, 2.0), long_factor=(1.0, 2.0, 5.0, 9.0)))),
        "qwen2 (a window on the upper layer, q/k/v biases)": ("llama", decoder.DecoderConfig(
            vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
            d_ff=40, qkv_bias=True, sliding_window=4, window_layers=(False, True))),
        "qwen2 (a window on the lower layer only)": ("llama", decoder.DecoderConfig(
            vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
            d_ff=40, qkv_bias=True, sliding_window=4, window_layers=(True, False))),
        "qwen3 (QK-norm, a window on every layer)": ("llama", decoder.DecoderConfig(
            vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
            d_ff=40, qk_norm="head", sliding_window=4)),
        "mixtral (4 experts, top 2, sliding window 4)": ("llama", decoder.DecoderConfig(
            vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
            d_ff=40, sliding_window=4, moe=dict(n_experts=4, top_k=2, d_expert=12,
                                                norm_topk=True))),
        "qwen2_moe (gated shared expert, dense first layer)": ("llama", decoder.DecoderConfig(
            vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
            d_ff=40, qkv_bias=True, moe=dict(n_experts=4, top_k=2, d_expert=12, d_shared=20,
                                             shared_gate=True, first_dense=1))),
        "qwen3_moe (QK-norm, renormalised top 2)": ("llama", decoder.DecoderConfig(
            vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
            d_ff=40, qk_norm="head", moe=dict(n_experts=4, top_k=2, d_expert=12,
                                              norm_topk=True))),
        "deepseek_v2 (group-limited experts, shared experts)": ("mla", mla.MLAConfig(
            vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, d_c=12,
            d_rope=4, head_dim=6, v_head_dim=10, latent_norm=True, d_ff=40,
            latent_norm_eps=1e-6, norm_eps=1e-5, moe=dict(
                n_experts=8, top_k=3, d_expert=12, routing="group_limited_greedy", n_groups=4,
                topk_groups=2, n_shared=2, scaling=1.5, first_dense=1))),
        "deepseek_v3 (sigmoid experts chosen with a bias)": ("mla", mla.MLAConfig(
            vocab_size=VOCAB, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, d_c=12,
            d_rope=4, head_dim=6, v_head_dim=10, q_lora_rank=8, latent_norm=True, d_ff=40,
            latent_norm_eps=1e-6, norm_eps=1e-5, moe=dict(
                n_experts=8, top_k=2, d_expert=12, scoring="sigmoid", routing="noaux_tc",
                n_groups=4, topk_groups=2, n_shared=1, norm_topk=True, scaling=2.5,
                score_bias=True, first_dense=1))),
    }


@pytest.mark.parametrize("label", sorted(refmath_configs()))
def test_saved_checkpoint_gives_the_logits_of_refmath_in_transformers(label, tmp_path,
                                                                      monkeypatch):
    name, config = refmath_configs()[label]
    rng = np.random.default_rng(8)
    params = {key: value + 0.1 * rng.standard_normal(value.shape)  # biases and gains off 0 and 1
              for key, value in model_module(name).init_params(config, seed=8).items()}
    for key in params:  # transformers' DeepSeek keeps its router in float32 whatever the dtype:
        if ".ffn.router." in key:  # give it weights that float32 holds exactly
            params[key] = params[key].astype(np.float32).astype(np.float64)
    hf.save_checkpoint(tmp_path, name, config, params)
    model = load_float64(tmp_path)
    tokens = TOKENS[:, :11]
    z = model_module(name).logits(params, tokens, config)
    error = relative_error(z, hf_logits(float64_internals(model, monkeypatch), tokens))
    print(f"{label}: largest logit difference {error:.1e} of the largest logit")
    assert error < REL
    if getattr(config, "moe", None):  # float64 rounding,
        assert error < 1e-13          # with room to spare


def test_a_llama_with_longrope_is_written_as_its_own_family(tmp_path):
    """LongRoPE is a rope scaling of Llama's too: a decoder with it is written as llama or
    mistral (a window), whatever its head width (the logits test above runs the mistral one in
    transformers); Phi-3's fused checkpoint is refmath.models.phi3's."""
    name, config = refmath_configs()["mistral (LongRoPE past 8 tokens, sliding window 4, "
                                     "interleaved RoPE)"]
    wide = dict(head_dim=6, rope_scaling=dataclasses.replace(
        config.rope_scaling, short_factor=(1.0, 1.5, 2.0), long_factor=(2.0, 6.0, 9.0)))
    for i, (fields, kind) in enumerate(((dict(), "mistral"), (dict(sliding_window=None), "llama"),
                                        (wide, "mistral"))):
        changed = dataclasses.replace(config, **fields)
        hf.save_checkpoint(tmp_path / str(i), name, changed,
                           model_module(name).init_params(changed))
        written = json.loads((tmp_path / str(i) / hf.CONFIG_FILE).read_text())
        assert (written["model_type"], written["rope_parameters"]["rope_type"]) == (kind,
                                                                                     "longrope")


def test_interleaved_to_half_keeps_every_score():
    """RoPE_half(x W_pi) = RoPE_interleaved(x W)_pi, so q.k is unchanged (module docstring)."""
    from refmath.positions import rope_forward

    rng = np.random.default_rng(4)
    x, w_q, w_k = rng.standard_normal((7, 12)), rng.standard_normal((12, 16)), rng.standard_normal((12, 16))

    def scores(wq, wk, layout):
        q = rope_forward(np.stack(np.split(x @ wq, 2, axis=1)), layout=layout)[0]
        k = rope_forward(np.stack(np.split(x @ wk, 2, axis=1)), layout=layout)[0]
        return q @ k.transpose(0, 2, 1)

    half = scores(hf.interleaved_to_half(w_q, 8), hf.interleaved_to_half(w_k, 8), "half")
    np.testing.assert_allclose(half, scores(w_q, w_k, "interleaved"), rtol=1e-12, atol=1e-12)
    assert not np.allclose(scores(w_q, w_k, "half"), scores(w_q, w_k, "interleaved"))


def test_save_refuses_what_has_no_transformers_counterpart(tmp_path):
    from refmath.models import decoder, gpt, mla, transformer

    plain = dict(vocab_size=11, max_seq_len=8, d_model=16, n_layers=2, n_heads=2)
    for fields, message in ((dict(sliding_window=4, window_layers=(False, True)),
                             r"written as qwen2 \(with qkv_bias\), qwen3"),
                            (dict(qk_norm="head", qkv_bias=True), "qkv_bias = True"),
                            (dict(qkv_bias=True, sliding_window=4, window_layers=(False, True),
                                  moe=dict(n_experts=2, top_k=1, d_expert=4, d_shared=4,
                                           shared_gate=True)), "window_layers = ")):
        config = decoder.DecoderConfig(**plain, **fields)
        with pytest.raises(hf.HFCheckpointError, match=message):
            hf.save_checkpoint(tmp_path, "llama", config, decoder.init_params(config))

    config = transformer.TransformerConfig(vocab_size=11, max_seq_len=8, n_layers=1, d_model=16,
                                           n_heads=2, d_ff=32)
    with pytest.raises(hf.HFCheckpointError, match="'transformer' has no Hugging Face"):
        hf.save_checkpoint(tmp_path, "transformer", config, transformer.init_params(config))
    config = gpt.GPTConfig(vocab_size=11, max_seq_len=8, n_layers=1, d_model=16, n_heads=2,
                           norm_position="post", tie_embeddings=False)
    with pytest.raises(hf.HFCheckpointError, match="tie_embeddings = False"):
        hf.save_checkpoint(tmp_path, "gpt", config, gpt.init_params(config))
    config = mla.MLAConfig(vocab_size=11, max_seq_len=8, d_model=16, n_layers=1, n_heads=2,
                           d_c=8, d_rope=4)
    with pytest.raises(hf.HFCheckpointError, match="latent_norm = False"):
        hf.save_checkpoint(tmp_path, "mla", config, mla.init_params(config))
    with pytest.raises(TypeError, match="GPTConfig"):
        hf.save_checkpoint(tmp_path, "gpt", config, mla.init_params(config))


# ---- refusals -----------------------------------------------------------------------------------

@pytest.fixture
def llama_dir(tmp_path):
    random_model("llama").save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


@pytest.mark.parametrize("model_type, written", [
    ("qwen3", "qwen3"),
    ("mistral", "mistral"), ("llama", "llama"), ("gpt2", "gpt2"), ("deepseek_v3", "deepseek_v3"),
])
def test_a_checkpoint_reports_its_own_family(model_type, written, tmp_path):
    """A checkpoint reports its own family (a Qwen3 one "qwen3", though refmath's "llama" model
    computes it), and saving what was loaded writes the family of what it computes (Gemma's:
    tests/models/test_gemma_hf.py)."""
    random_model(model_type).save_pretrained(tmp_path / "in", safe_serialization=True)
    assert hf.checkpoint_family(hf.read_config(tmp_path / "in")) == model_type
    name, config, params = hf.load_checkpoint(tmp_path / "in")
    assert name == hf.config_from_hf(hf.read_config(tmp_path / "in"))[0]
    hf.save_checkpoint(tmp_path / "out", name, config, params)
    assert hf.checkpoint_family(hf.read_config(tmp_path / "out")) == written


def test_checkpoint_family_refuses_an_unsupported_model_type():
    with pytest.raises(hf.HFCheckpointError, match="model_type = 'mamba' is not supported"):
        hf.checkpoint_family({"model_type": "mamba"})


def test_refuses_an_unsupported_model_type(llama_dir):
    edit_config(llama_dir, model_type="mamba")
    assert "model_type = 'mamba' is not supported" in one_line_error(llama_dir)


def test_refuses_an_unknown_rope_scaling(llama_dir):
    edit_config(llama_dir, rope_parameters={"rope_type": "su", "rope_theta": 5e5, "factor": 8.0})
    message = one_line_error(llama_dir)
    assert "rope_parameters.rope_type = 'su'" in message and "yarn" in message


@pytest.mark.parametrize("factor", [0.0, -2.0, "4"])
def test_refuses_a_rope_scaling_factor_that_is_not_positive(llama_dir, factor):
    edit_config(llama_dir, rope_parameters={"rope_type": "linear", "rope_theta": 5e5,
                                            "factor": factor})
    assert f"rope_parameters.factor = {factor!r}" in one_line_error(llama_dir)


def test_legacy_rope_scaling_loads_like_rope_parameters(llama_dir):
    edit_config(llama_dir, rope_parameters=None, rope_theta=500.0,
                rope_scaling={"type": "linear", "factor": 2.0})
    _, config, _ = hf.load_checkpoint(llama_dir)
    assert (config.rope_base, config.rope_scaling.rope_type, config.rope_scaling.factor) == (
        500.0, "linear", 2.0)


def test_refuses_partial_rotary(llama_dir):
    edit_config(llama_dir, rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                            "partial_rotary_factor": 0.5})
    assert "partial_rotary_factor = 0.5" in one_line_error(llama_dir)


def test_refuses_a_config_without_a_needed_field(llama_dir):
    config = json.loads((llama_dir / hf.CONFIG_FILE).read_text())
    del config["hidden_size"]
    (llama_dir / hf.CONFIG_FILE).write_text(json.dumps(config))
    assert "llama: config has no field 'hidden_size'" in one_line_error(llama_dir)


@pytest.mark.parametrize("field, value, message", [
    ("num_hidden_layers", "2", "config field num_hidden_layers must be a number, got the string '2'"),
    ("rms_norm_eps", "1e-5", "config field rms_norm_eps must be a number, got the string '1e-5'"),
    ("hidden_size", 32.5, "config field hidden_size must be an integer, got 32.5"),
])
def test_refuses_a_number_of_the_wrong_type(llama_dir, field, value, message):
    edit_config(llama_dir, **{field: value})
    assert message in one_line_error(llama_dir)


def test_an_integer_written_as_a_real_number_is_read(llama_dir):
    config = json.loads((llama_dir / hf.CONFIG_FILE).read_text())
    edit_config(llama_dir, num_hidden_layers=float(config["num_hidden_layers"]))
    name, ours = hf.config_from_hf(hf.read_config(llama_dir))
    assert ours.n_layers == config["num_hidden_layers"] and type(ours.n_layers) is int
    assert type(ours.norm_eps) is float


def test_refuses_a_dtype_that_is_not_floating(llama_dir):
    with pytest.raises(TypeError, match="dtype must be a floating-point type, got int32"):
        hf.load_checkpoint(llama_dir, dtype=np.int32)


@pytest.mark.parametrize("variant, fields, message", [
    ("deepseek_v3-moe", dict(moe_layer_freq=2), "moe_layer_freq = 2"),
    ("deepseek_v3-moe", dict(scoring_func="softmax"), "scoring_func = 'softmax'"),
    ("deepseek_v2-moe", dict(norm_topk_prob=True), "norm_topk_prob = True"),
    ("deepseek_v3-moe", dict(n_group=3), "n_groups = 3 does not divide n_experts = 8"),
    ("deepseek_v3-moe", dict(topk_group=5), "topk_groups = 5 is larger than n_groups = 4"),
    ("qwen2_moe", dict(decoder_sparse_step=2), "decoder_sparse_step = 2"),
    ("qwen2_moe", dict(mlp_only_layers=[1]), "mlp_only_layers = [1]"),
    ("mixtral", dict(num_experts_per_tok=5), "top_k = 5 is larger than n_experts = 4"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise = 0.1"),
])
def test_refuses_what_its_experts_do_not_compute(variant, fields, message, tmp_path):
    random_model(variant).save_pretrained(tmp_path, safe_serialization=True)
    edit_config(tmp_path, **fields)
    assert message in one_line_error(tmp_path)


def test_refuses_a_missing_or_mis_shaped_expert(tmp_path):
    random_model("mixtral").save_pretrained(tmp_path, safe_serialization=True)
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"

    def drop(tensors):
        del tensors[name]
    rewrite_weights(tmp_path, drop)
    assert f"tensor {name!r} is missing" in one_line_error(tmp_path)

    def cut(tensors):
        tensors[name] = np.zeros((32, 47), np.float32)
    rewrite_weights(tmp_path, cut)
    assert name in one_line_error(tmp_path) and "(32, 47)" in one_line_error(tmp_path)


def test_refuses_output_bias(llama_dir):
    edit_config(llama_dir, attention_bias=True)
    assert "attention_bias = True" in one_line_error(llama_dir)


def rewrite_weights(directory: Path, edit) -> None:
    from safetensors.numpy import load_file, save_file

    path = directory / hf.WEIGHTS_FILE
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_refuses_a_missing_tensor(llama_dir):
    rewrite_weights(llama_dir, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    assert "'model.layers.1.self_attn.k_proj.weight' is missing" in one_line_error(llama_dir)


def test_refuses_a_wrong_shaped_tensor(llama_dir):
    def edit(tensors):
        tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((47, 32), np.float32)
    rewrite_weights(llama_dir, edit)
    message = one_line_error(llama_dir)
    assert "'model.layers.0.mlp.up_proj.weight' has shape (47, 32)" in message
    assert "(48, 32)" in message


def test_refuses_a_left_over_tensor(llama_dir):
    def edit(tensors):
        tensors["model.layers.2.input_layernorm.weight"] = np.ones(32, np.float32)
    rewrite_weights(llama_dir, edit)
    assert "model.layers.2.input_layernorm.weight" in one_line_error(llama_dir)


def test_refuses_a_truncated_file(llama_dir):
    path = llama_dir / hf.WEIGHTS_FILE
    os.truncate(path, path.stat().st_size - 100)
    assert "truncated" in one_line_error(llama_dir)


def test_refuses_a_directory_without_weights(llama_dir):
    (llama_dir / hf.WEIGHTS_FILE).unlink()
    assert "neither model.safetensors nor model.safetensors.index.json" in one_line_error(llama_dir)


# ---- sizes ----------------------------------------------------------------------------------------

# Published configurations, written out from their config.json files on the Hugging Face Hub.
PUBLISHED = {
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_theta=500000.0, tie_word_embeddings=False),
    "mistral-7b": dict(model_type="mistral", vocab_size=32000, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5,
                       rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False),
    "qwen2-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584,
                     intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, max_position_embeddings=131072, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, sliding_window=131072, use_sliding_window=False,
                     max_window_layers=28, tie_word_embeddings=False),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                         rope_theta=500000.0, tie_word_embeddings=False,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                     attention_bias=False, use_sliding_window=False),
    "gpt2": dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12,
                 n_head=12, activation_function="gelu_new", layer_norm_epsilon=1e-5),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5,
                         rope_theta=1000000.0, sliding_window=None, num_local_experts=8,
                         num_experts_per_tok=2, tie_word_embeddings=False),
    "deepseek-v3": dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
                        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                        num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
                        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
                        q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                        qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4,
                        num_experts_per_tok=8, first_k_dense_replace=3, moe_layer_freq=1,
                        norm_topk_prob=True, scoring_func="sigmoid",
                        max_position_embeddings=163840, rms_norm_eps=1e-6,
                        tie_word_embeddings=False,
                        rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32,
                                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                      "original_max_position_embeddings": 4096}),
    "gemma-2-9b": dict(model_type="gemma2", vocab_size=256000, hidden_size=3584,
                       intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                       sliding_window=4096, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0, max_position_embeddings=8192,
                       rms_norm_eps=1e-6, rope_theta=10000.0,
                       hidden_activation="gelu_pytorch_tanh"),
}
# refmath counts DeepSeek-V3's selection bias as a parameter (the checkpoint stores it, the
# model reads it); transformers keeps it as a buffer: one per expert of each of its 58 MoE layers
BUFFERS_AS_PARAMETERS = {"deepseek-v3": 58 * 256}


def meta_parameter_count(config: dict) -> int:
    """sum(p.numel()) of the transformers model, built on the meta device (no memory)."""
    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


# Published config.json files written out (tiiuae/falcon-7b and tiiuae/falcon-40b in
# transformers' falcon format, allenai/OLMo-2-1124-7B, microsoft/Phi-3-mini-4k-instruct):
# Falcon's multi-query against 8 grouped key/value heads and one norm against two, OLMo 2's norms
# after the sublayers and its QK-norm gains, Phi-3's fused projections.
LOADED_PUBLISHED = {
    "falcon-7b": dict(model_type="falcon", vocab_size=65024, hidden_size=4544,
                      num_hidden_layers=32, num_attention_heads=71, multi_query=True,
                      parallel_attn=True, new_decoder_architecture=False, bias=False,
                      alibi=False, layer_norm_epsilon=1e-5, max_position_embeddings=2048),
    "falcon-40b": dict(model_type="falcon", vocab_size=65024, hidden_size=8192,
                       num_hidden_layers=60, num_attention_heads=128, num_kv_heads=8,
                       new_decoder_architecture=True, parallel_attn=True, bias=False,
                       alibi=False, layer_norm_epsilon=1e-5, max_position_embeddings=2048),
    "olmo-2-7b": dict(model_type="olmo2", vocab_size=100352, hidden_size=4096,
                      intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
                      rope_theta=500000.0, attention_bias=False, tie_word_embeddings=False),
    "phi-3-mini-4k": dict(model_type="phi3", vocab_size=32064, hidden_size=3072,
                          intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=32, max_position_embeddings=4096,
                          original_max_position_embeddings=4096, sliding_window=2047,
                          rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False),
}


@pytest.mark.parametrize("name", sorted(LOADED_PUBLISHED))
def test_published_configs_load_with_transformers_parameters(name):
    """The loaded model holds every parameter transformers builds, and no other, and the sizing
    calculator's count of it (sizes --hf) is the same."""
    from refmath.sizing import parameter_counts

    config = LOADED_PUBLISHED[name]
    expected = meta_parameter_count(config)
    assert hf_parameter_count(config) == expected
    assert parameter_counts(sizing_config(config)).total == expected


def test_the_presets_are_the_published_configs():
    """refmath.sizing's presets count what their config.json loads, and a mixture of experts'
    active parameters are the preset's (DeepSeek-V3: 37.55e9 of 671.03e9)."""
    from refmath.sizing import PRESETS, active_parameters, parameter_counts

    for name in ("llama-3.1-8b", "qwen3-8b", "mixtral-8x7b", "deepseek-v3", "gemma-2-9b"):
        expected = meta_parameter_count(PUBLISHED[name]) + BUFFERS_AS_PARAMETERS.get(name, 0)
        assert parameter_counts(PRESETS[name]).total == expected, name
    for name in ("mixtral-8x7b", "deepseek-v3"):
        assert active_parameters(sizing_config(PUBLISHED[name])) == active_parameters(
            PRESETS[name])
    for name in ("falcon-7b", "falcon-40b"):  # a parallel block with one LayerNorm, and two
        assert parameter_counts(PRESETS[name]).total == meta_parameter_count(
            LOADED_PUBLISHED[name]), name
    _, config = hf.config_from_hf(PUBLISHED["llama-3.1-8b"])
    assert (config.rope_scaling.rope_type, config.rope_scaling.original_max_seq_len,
            config.max_seq_len) == ("llama3", 8192, 131072)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_sizes_count_the_parameters_of_transformers(name, tmp_path):
    from refmath.sizing import parameter_counts

    # sizes --hf counts what transformers counts; the preset's N7 count holds the buffers too
    buffers = BUFFERS_AS_PARAMETERS.get(name, 0)
    expected = meta_parameter_count(PUBLISHED[name])
    assert hf_parameter_count(PUBLISHED[name]) == expected
    assert hf_parameter_count(PUBLISHED[name], buffers=True) == expected + buffers
    assert parameter_counts(sizing_config(PUBLISHED[name])).total == expected + buffers
    (tmp_path / hf.CONFIG_FILE).write_text(json.dumps(PUBLISHED[name]))
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["sizes", "--hf", str(tmp_path)]) == 0
    counted = out.getvalue().split("\nparameters (", 1)[1].splitlines()  # N7, or MLA's shapes
    assert f"): {expected:,}" in counted[0]
    assert counted[1].startswith(f"  not counted: {buffers:,} routing biases") == bool(buffers)


def test_sizes_of_a_deepseek_config(tmp_path):
    config = hf_config("deepseek_v3").to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    expected = meta_parameter_count(config)
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["sizes", "--config", str(path)]) == 0
    assert f"parameters (the loaded model's shapes): {expected:,}" in out.getvalue()
    assert "* MLA" in out.getvalue()


# ---- the command line ---------------------------------------------------------------------------

def test_generate_hf_with_a_trained_tokenizer(tmp_path):
    """``generate --hf`` encodes the prompt with the directory's tokenizer.json (trained here)
    and prints the same continuation transformers' greedy search gives."""
    pytest.importorskip("tokenizers", reason="--prompt needs tokenizers (pip install tokenizers)")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    sentences = ["the cat sat on the mat", "a dog ran in the park", "the sun is warm today",
                 "refmath computes the same function"] * 4
    tokenizer.train_from_iterator(sentences, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["[UNK]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:40]))
    assert tokenizer.get_vocab_size() <= VOCAB
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    model = random_model("gpt2", seed=5)
    model.save_pretrained(tmp_path, safe_serialization=True)

    status, out, err = run_main(["generate", "--hf", str(tmp_path), "--prompt", "the cat",
                                 "--greedy", "--max-new-tokens", "8"])
    assert status == 0, err
    prompt = tokenizer.encode("the cat").ids
    with torch.no_grad():  # both stop at the config's eos_token_id
        theirs = model.generate(torch.as_tensor([prompt]), max_new_tokens=8, do_sample=False,
                                pad_token_id=0)[0].tolist()
    assert out.strip() == tokenizer.decode(theirs).strip()
    assert f"{len(theirs) - len(prompt)} tokens" in err


def test_generate_hf_with_prompt_ids_and_refusals(tmp_path):
    random_model("llama", seed=6).save_pretrained(tmp_path, safe_serialization=True)
    status, out, err = run_main(["generate", "--hf", str(tmp_path), "--prompt-ids", "1,2,3",
                                 "--greedy", "--max-new-tokens", "4"])
    assert status == 0, err
    ids = [int(i) for i in out.strip().split(",")]
    assert ids[:3] == [1, 2, 3] and len(ids) == 7
    if kernels.cpu_available():  # the weights laid out for the C++ products: the same tokens
        status, out, err = run_main(["generate", "--hf", str(tmp_path), "--prompt-ids", "1,2,3",
                                     "--greedy", "--max-new-tokens", "4", "--backend", "cpu"])
        assert status == 0, err
        assert [int(i) for i in out.strip().split(",")] == ids and "KV cache on cpu" in err

    status, _, err = run_main(["generate", "--hf", str(tmp_path), "--prompt", "hello"])
    assert status == 2 and "no tokenizer.json" in err and err.count("\n") == 1
    edit_config(tmp_path, model_type="mamba")
    status, _, err = run_main(["generate", "--hf", str(tmp_path), "--prompt-ids", "1"])
    assert status == 2 and "model_type = 'mamba' is not supported" in err
    assert err.count("\n") == 1


def test_save_tokenizer_keeps_ids_specials_and_unknowns(tmp_path):
    from tokenizers import Tokenizer

    from refmath.data import SPECIALS, CharTokenizer

    ours = CharTokenizer("ab c.\n")
    hf.save_tokenizer(tmp_path, ours)
    theirs = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert theirs.encode("ca b.\nzb").ids == ours.encode("ca b.\nzb", unknown="unk").tolist()
    assert [theirs.token_to_id(token) for token in SPECIALS] == [ours.pad_id, ours.bos_id,
                                                                 ours.eos_id, ours.unk_id]
    assert theirs.encode("<bos>ab<eos>").ids == [ours.bos_id, *ours.encode("ab"), ours.eos_id]
    assert theirs.decode([ours.bos_id, *ours.encode("a c\n")]) == "a c\n"
    with pytest.raises(TypeError, match="tokenizer must be a refmath.data.CharTokenizer"):
        hf.save_tokenizer(tmp_path, "abc")


def test_convert_refuses_an_existing_output(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    status, _, err = run_main(["convert", "--to-hf", str(tmp_path / "run"), str(tmp_path / "out")])
    assert status == 2 and "exists" in err
