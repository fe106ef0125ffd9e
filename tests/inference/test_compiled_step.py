"""The compiled decode layers (refmath.inference.compiled_step): the NumPy step's tokens and
logits, on every layer kind they take, and clear errors from the extension's checks."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from refmath import kernels
from refmath.fast.products import blas_products, kernel_products
from refmath.inference import compiled_step
from refmath.inference.generate import generate
from refmath.inference.kv_cache import generate_cached, prefill
from refmath.inference.weight_layout import decode_layout
from refmath.models import model_module
from refmath.models.decoder import DecoderConfig
from refmath.models.falcon import FalconConfig
from refmath.models.gemma import GemmaConfig
from refmath.models.gpt import GPTConfig
from refmath.models.mla import MLAConfig
from refmath.moe import MoEConfig
from _support import float32_rule

pytestmark = pytest.mark.skipif(not kernels.cpu_available(), reason="needs refmath._C")

LLAMA = DecoderConfig(vocab_size=97, max_seq_len=24, d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, d_ff=48, rope_layout="half")
GPT = GPTConfig(vocab_size=97, max_seq_len=24, n_layers=2, d_model=32, n_heads=4, d_ff=64,
                norm_position="pre", dropout=0.0)

CASES = {
    "gpt-tied": ("gpt", GPT),
    "gpt-exact-gelu-untied": ("gpt", dataclasses.replace(GPT, ffn="gelu",
                                                         tie_embeddings=False)),
    "llama-gqa-half": ("llama", LLAMA),
    # MQA, Qwen2's biases, Llama 3.1's rope scaling
    "llama-mqa-bias-llama3": ("llama", dataclasses.replace(
        LLAMA, n_kv_heads=1, qkv_bias=True, rope_layout="interleaved",
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_seq_len=8))),
    # Falcon's old sequential layout: LayerNorm with its bias, exact GELU, multi-query
    "falcon-sequential-gelu-mqa": ("falcon", FalconConfig(
        vocab_size=97, max_seq_len=24, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, d_ff=48,
        parallel_block=False, rope_layout="half")),
    # the same layout with PaLM's bias-free LayerNorm (a zero shift) and the SwiGLU, tied
    "falcon-sequential-swiglu-nobias": ("falcon", FalconConfig(
        vocab_size=97, max_seq_len=24, d_model=32, n_layers=2, n_heads=4, d_ff=48,
        parallel_block=False, norm="layernorm_no_bias", ffn="swiglu", tie_embeddings=True)),
    "falcon-sequential-gelu-tanh": ("falcon", FalconConfig(
        vocab_size=97, max_seq_len=24, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
        d_ff=48, parallel_block=False, ffn="gelu_tanh")),
}


def _params(model, config, seed=0):
    """float64 parameters with every entry moved off its initial value (zero biases and unit
    gains would hide a bias or gain the compiled layer forgot)."""
    rng = np.random.default_rng(seed)
    params = model_module(model).init_params(config, seed=seed)
    return {name: value + 0.05 * rng.standard_normal(value.shape) for name, value in params.items()}


def _counting(monkeypatch) -> list:
    steps, real = [], compiled_step.CompiledLayers.step

    def counted(self, cache, ids, products=None):
        steps.append(cache.length)
        return real(self, cache, ids, products)

    monkeypatch.setattr(compiled_step.CompiledLayers, "step", counted)
    return steps


@pytest.mark.parametrize("layout", [False, True], ids=["in-out", "decode-layout"])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_steps_give_the_numpy_steps_tokens_and_float32_logits(case, layout, monkeypatch):
    model, config = CASES[case]
    params64 = _params(model, config)
    params = {name: value.astype(np.float32) for name, value in params64.items()}
    if layout:
        params = decode_layout(params)
    prompt = np.stack([np.arange(5), np.arange(5, 10)]) % config.vocab_size  # batch 2
    steps = _counting(monkeypatch)
    fast = generate_cached(model, params, config, prompt, 10, greedy=True, backend="cpu",
                           products=kernel_products)
    assert steps == list(range(5, 14))  # every decode step, at positions 5..13
    plain = generate_cached(model, params, config, prompt, 10, greedy=True)
    ref64 = generate_cached(model, params64, config, plain.tokens[:, :5], 10, greedy=True)
    np.testing.assert_array_equal(fast.tokens, plain.tokens)
    np.testing.assert_array_equal(ref64.tokens, plain.tokens)  # the same path for all three
    assert fast.counts == plain.counts
    float32_rule(f"compiled decode layers, {case}", fast.logits, ref64.logits, plain.logits,
                 floor=4 * np.finfo(np.float32).eps * np.abs(ref64.logits).max())


def test_generate_on_the_cpu_backend_steps_through_the_compiled_layers(monkeypatch):
    params = decode_layout({name: value.astype(np.float32)
                            for name, value in _params("llama", LLAMA).items()})
    steps = _counting(monkeypatch)
    out = generate("llama", params, LLAMA, np.arange(4), 6, greedy=True, backend="cpu")
    assert steps == [4, 5, 6, 7, 8]
    # BLAS's products: the NumPy layers
    np.testing.assert_array_equal(out, generate("llama", params, LLAMA, np.arange(4), 6,
                                                greedy=True, backend="cpu",
                                                products=blas_products))
    assert len(steps) == 5


@pytest.mark.parametrize("model, config", [
    ("llama", dataclasses.replace(LLAMA, qk_norm="head")),
    ("llama", dataclasses.replace(LLAMA, sliding_window=4)),
    ("falcon", FalconConfig(vocab_size=97, max_seq_len=24, d_model=32, n_layers=2, n_heads=4,
                            n_kv_heads=2, d_ff=48, rope_layout="half")),
    ("gemma", GemmaConfig(vocab_size=97, max_seq_len=24, d_model=32, n_layers=2, n_heads=4,
                          n_kv_heads=2, head_dim=8, d_ff=48, rope_layout="half")),  # GeGLU
    ("llama", dataclasses.replace(LLAMA, moe=MoEConfig(n_experts=4, top_k=2, d_expert=16))),
    ("gpt", dataclasses.replace(GPT, norm_position="post")),
    ("gpt", dataclasses.replace(GPT, sliding_window=4)),
    ("mla", MLAConfig(vocab_size=97, max_seq_len=24, d_model=32, n_layers=2, n_heads=4, d_c=16,
                      d_rope=8, d_ff=48)),
], ids=["qk-norm", "window", "parallel", "gemma-geglu", "moe", "post-ln",
        "gpt-window", "mla"])
def test_a_layer_the_compiled_step_does_not_compute_keeps_the_numpy_step(model, config):
    module = model_module(model)
    params = {name: value.astype(np.float32)
              for name, value in module.init_params(config, seed=0).items()}
    assert compiled_step.compiled_layers(module, params, config) is None


def test_float64_parameters_keep_the_numpy_step():
    module = model_module("llama")
    assert compiled_step.compiled_layers(module, module.init_params(LLAMA, seed=0), LLAMA) is None


def test_the_compiled_step_leaves_a_full_cache_to_the_numpy_steps_error():
    module = model_module("llama")
    params = {name: value.astype(np.float32)
              for name, value in module.init_params(LLAMA, seed=0).items()}
    layers = compiled_step.compiled_layers(module, params, LLAMA)
    _, cache = prefill("llama", params, LLAMA, np.arange(4), max_len=4, backend="cpu")
    assert not layers.runs(cache, kernel_products)  # full: _forward_rows raises its own error
    _, roomy = prefill("llama", params, LLAMA, np.arange(4), max_len=8, backend="cpu")
    assert layers.runs(roomy, kernel_products)
    assert not layers.runs(roomy, blas_products)  # BLAS's products: the NumPy layers
    assert not layers.runs(roomy)  # no choice, float32 weights: the NumPy layers too
    _, numpy_cache = prefill("llama", params, LLAMA, np.arange(4), max_len=8)
    assert not layers.runs(numpy_cache, kernel_products)


# ---- the extension's own checks: errors, never a read past a buffer -----------------------------

def _spec():
    module = model_module("llama")
    params = {name: value.astype(np.float32)
              for name, value in module.init_params(LLAMA, seed=0).items()}
    shape, layers = module.compiled_layer_spec(params, LLAMA)
    g, d_h = LLAMA.kv_heads, LLAMA.d_h
    for layer in layers:
        layer.update(keys=np.zeros((1, g, 8, d_h), np.float32),
                     values=np.zeros((1, g, 8, d_h), np.float32))
    return shape, layers


def test_decode_layers_refuses_wrong_arrays_by_name():
    shape, layers = _spec()
    kernels.decode_layers(1, layers, **shape)  # the right ones are taken
    bad = [dict(layers[0], w_q=layers[0]["w_q"][:, :8]), layers[1]]
    with pytest.raises(ValueError, match=r"layers\[0\]\['w_q'\] must have shape \(32, 32\)"):
        kernels.decode_layers(1, bad, **shape)
    bad = [layers[0], dict(layers[1], w_down=layers[1]["w_down"].astype(np.float64))]
    with pytest.raises(TypeError, match=r"layers\[1\]\['w_down'\] must be a native-byte-order"):
        kernels.decode_layers(1, bad, **shape)
    strided = np.zeros((32, 96), np.float32)[:, ::3]
    with pytest.raises(ValueError, match=r"\['w_o'\] must be C-contiguous or the transpose"):
        kernels.decode_layers(1, [dict(layers[0], w_o=strided), layers[1]], **shape)
    short = dict(layers[1], keys=np.zeros((1, 2, 5, 8), np.float32))  # another T_max
    with pytest.raises(ValueError, match=r"layers\[1\]\['keys'\] must have shape \(1, 2, T_max, 8\)"):
        kernels.decode_layers(1, [layers[0], short], **shape)
    missing = {k: v for k, v in layers[0].items() if k != "w_gate"}
    with pytest.raises(ValueError, match=r"layers\[0\] has no entry 'w_gate'"):
        kernels.decode_layers(1, [missing], **shape)
    with pytest.raises(ValueError, match="RMSNorm takes no shift"):
        kernels.decode_layers(1, [dict(layers[0], norm1_shift=layers[0]["norm1_gain"])], **shape)
    with pytest.raises(ValueError, match="ffn must be one of 'swiglu', 'gelu_tanh', 'gelu', got 'rel"):
        kernels.decode_layers(1, layers, **dict(shape, ffn="relu"))
    with pytest.raises(ValueError, match="norm must be one of 'rmsnorm', 'layernorm', got 'rms'"):
        kernels.decode_layers(1, layers, **dict(shape, norm="rms"))  # the binding's own spelling
    with pytest.raises(ValueError, match="kv_heads must divide heads"):
        kernels.decode_layers(1, layers, **dict(shape, kv_heads=3))


def test_decode_layers_step_refuses_a_wrong_row_rotation_or_position():
    shape, layers = _spec()
    stack = kernels.decode_layers(1, layers, **shape)
    assert stack.t_max == 8
    x = np.ones((1, 32), np.float32)
    cos = sin = np.ones(4, np.float32)
    stack.step(x, 0, cos, sin)
    assert np.isfinite(x).all() and np.any(layers[0]["keys"][0, :, 0] != 0)
    with pytest.raises(ValueError, match=r"x must have shape \(1, 32\), got \(2, 32\)"):
        stack.step(np.ones((2, 32), np.float32), 1, cos, sin)
    with pytest.raises(ValueError, match="position 8 is outside the cache's rows"):
        stack.step(x, 8, cos, sin)
    with pytest.raises(ValueError, match="position -1 is outside"):
        stack.step(x, -1, cos, sin)
    with pytest.raises(ValueError, match=r"cos and sin must have shape \(4,\)"):
        stack.step(x, 1, np.ones(3, np.float32), sin)
    frozen = x.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="x must be writeable"):
        stack.step(frozen, 1, cos, sin)
    with pytest.raises(TypeError, match="x must be a native-byte-order float32"):
        stack.step(x.astype(np.float64), 1, cos, sin)
