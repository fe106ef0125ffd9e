"""Generation with the layers' matrices and the output head in bf16, f16 and Q8_0
(refmath.inference.layer_formats, catalogue W1, W2): the compiled decode step reading the stored
bytes against the NumPy model on the explicitly dequantised matrices, with the float32 rule, and
the models and options it refuses."""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from refmath import kernels
from refmath.inference import compiled_step
from refmath.inference.generate import generate
from refmath.inference.kv_cache import sliding_next_logits
from refmath.inference.layer_formats import (HEAD, restored_params, stored_head,
                                              stored_layer_weights, stored_model)
from refmath.models import model_module
from refmath.models.decoder import DecoderConfig
from refmath.models.falcon import FalconConfig
from refmath.models.gpt import GPTConfig
from refmath.models.mla import MLAConfig
from refmath.weight_formats import FORMATS, dequantize, quantize
from _support import float32_rule

needs_cpu = pytest.mark.skipif(not kernels.cpu_available(), reason="needs refmath._C")

# Every matrix's inputs a multiple of 32, so that Q8_0's whole blocks hold them.
LLAMA = DecoderConfig(vocab_size=97, max_seq_len=24, d_model=64, n_layers=2, n_heads=4,
                      n_kv_heads=2, d_ff=96, rope_layout="half")
GPT = GPTConfig(vocab_size=97, max_seq_len=24, n_layers=2, d_model=32, n_heads=4, d_ff=64,
                norm_position="pre", dropout=0.0)
CASES = {
    "llama-gqa-half": ("llama", LLAMA),
    "gpt-tied": ("gpt", GPT),
    # multi-query attention with biases, interleaved RoPE, an untied head
    "llama-mqa-bias-interleaved": ("llama", dataclasses.replace(
        LLAMA, n_kv_heads=1, qkv_bias=True, rope_layout="interleaved", tie_embeddings=False)),
    # Falcon's sequential layout (the one the compiled layer takes): LayerNorms with their biases
    # before the sublayers, a GELU FFN, and a LayerNorm before its head
    "falcon-sequential": ("falcon", FalconConfig(vocab_size=97, max_seq_len=24, d_model=64,
                                                 n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                                                 parallel_block=False)),
}


def _params(model, config, seed=0):
    """float32 parameters with every entry moved off its initial value."""
    rng = np.random.default_rng(seed)
    params = model_module(model).init_params(config, seed=seed)
    return {name: (value + 0.05 * rng.standard_normal(value.shape)).astype(np.float32)
            for name, value in params.items()}


def _step_logits(model, params, config, tokens, prompt_len, backend, stored=None, weights="f32"):
    """The logits ``(B, N, V)`` after each prefix of ``tokens`` from ``prompt_len`` on: one prefill,
    then decode steps fed the given tokens (the same inputs for every path compared)."""
    next_logits = sliding_next_logits(model, params, config, config.max_seq_len, backend, stored,
                                      weights)
    return np.stack([next_logits(tokens[:, :t]) for t in range(prompt_len, tokens.shape[1] + 1)],
                    axis=1)


def _counting(monkeypatch) -> list:
    steps, real = [], compiled_step.CompiledLayers.step

    def counted(self, cache, ids, products=None):
        steps.append((cache.length, self.weights))
        return real(self, cache, ids, products)

    monkeypatch.setattr(compiled_step.CompiledLayers, "step", counted)
    return steps


@needs_cpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(CASES))
def test_the_compiled_step_reading_stored_weights_is_the_dequantised_reference(case, fmt,
                                                                               monkeypatch):
    model, config_given = CASES[case]
    module = model_module(model)
    params = _params(model, config_given)
    restored, config, stored = stored_model(module, params, config_given, fmt)
    # Q, K, V, O and the FFN's matrices (SwiGLU's three, GPT's plain two), and the head
    assert len(stored) == config.n_layers * (7 if model == "llama" else 6) + 1
    assert not config.tie_embeddings  # a tied head is run as the untied copy it was rounded from
    restored64 = {name: value.astype(np.float64) for name, value in restored.items()}
    prompt_len = 5
    tokens = generate(model, restored, config, np.stack([np.arange(5), np.arange(5, 10)]), 9,
                      greedy=True)  # batch 2, 14 tokens: 9 decode steps after the prefill
    steps = _counting(monkeypatch)
    fast = _step_logits(model, restored, config, tokens, prompt_len, "cpu", stored, fmt)
    assert steps == [(t, fmt) for t in range(prompt_len, tokens.shape[1])]  # every decode step
    plain = _step_logits(model, restored, config, tokens, prompt_len, "numpy")
    ref64 = _step_logits(model, restored64, config, tokens, prompt_len, "numpy")
    float32_rule(f"{fmt} layers, {case}", fast, ref64, plain,
                 floor=4 * np.finfo(np.float32).eps * np.abs(ref64).max())
    # and the tokens of generate() on both backends, from the float32 parameters as given
    out = generate(model, params, config_given, tokens[:, :prompt_len], 9, greedy=True,
                   backend="cpu", weights=fmt)
    np.testing.assert_array_equal(out, generate(model, params, config_given,
                                                tokens[:, :prompt_len], 9, greedy=True,
                                                weights=fmt))
    np.testing.assert_array_equal(out, tokens)


@needs_cpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_compiled_step_gives_the_same_bits_on_any_thread_count(fmt):
    # The step multiplies one input by the query, key and value (and by the gate and up) in one
    # parallel region, each thread taking its share of every matrix's outputs; each output is
    # still summed by one thread, so the logits are the same bits on 1, 2 and 3 threads. The
    # widths put every group of products past the size at which the kernels use more than one
    # thread (query, key and value: 512 x (512 + 256 + 256) multiply-adds a row; the head, which
    # runs last and whose team the test reads, 512 x 512).
    config = dataclasses.replace(LLAMA, vocab_size=512, d_model=512, n_heads=8, n_kv_heads=2,
                                 d_ff=768, n_layers=1, max_seq_len=8)
    module = model_module("llama")
    restored, config, stored = stored_model(module, _params("llama", config), config, fmt)
    tokens = np.array([[3, 1, 4, 1, 5, 9]])
    logits, teams = [], []
    for threads in (1, 2, 3):
        with kernels.cpu_thread_limit(threads):
            logits.append(_step_logits("llama", restored, config, tokens, 3, "cpu", stored, fmt))
            teams.append(kernels.cpu_last_team())
    assert teams == [1, 2, 3]
    for other in logits[1:]:
        np.testing.assert_array_equal(other, logits[0])


@needs_cpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(CASES))
def test_the_compiled_head_product_is_the_dequantised_reference(case, fmt):
    # The head's product alone, as the compiled step makes it (its products function on the
    # restored lm_head), against x @ dequantize(stored head).T in float64 and in plain float32.
    model, config_given = CASES[case]
    module = model_module(model)
    restored, config, stored = stored_model(module, _params(model, config_given), config_given, fmt)
    layers = compiled_step.compiled_layers(module, restored, config, stored, fmt)
    rows = np.random.default_rng(1).standard_normal((3, 1, config.d_model)).astype(np.float32)
    fast = layers._stored_head_products(None)(rows, (restored["lm_head"],))[0]
    w = dequantize(stored[HEAD], fmt)  # (V, d), the float32 numbers the stored head stands for
    ref64 = rows.astype(np.float64) @ w.T.astype(np.float64)
    float32_rule(f"{fmt} head, {case}", fast, ref64, rows @ w.T)
    # any other product goes to the products given
    other = np.ones((config.d_model, 5), np.float32)
    assert layers._stored_head_products(lambda x, ws: ["given"])(rows, (other,)) == ["given"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tied_head_is_rounded_as_a_copy_and_the_embedding_stays_float32(fmt):
    params = _params("gpt", GPT)
    assert GPT.tie_embeddings
    restored, config, stored = stored_model(model_module("gpt"), params, GPT, fmt)
    assert config == dataclasses.replace(GPT, tie_embeddings=False)
    assert restored["tok_emb"] is params["tok_emb"]  # the lookup reads the float32 table
    np.testing.assert_array_equal(stored[HEAD], quantize(params["tok_emb"], fmt))
    np.testing.assert_array_equal(restored["lm_head"], dequantize(stored[HEAD], fmt).T)
    assert not np.array_equal(restored["lm_head"], params["tok_emb"].T)
    # the embedding of the run is the float32 table's row, the head the rounded copy's logits
    gpt = model_module("gpt")
    ids = np.array([[3]])
    np.testing.assert_array_equal(gpt.embed(restored, ids, config, 0), gpt.embed(params, ids, GPT, 0))
    x = np.random.default_rng(2).standard_normal((1, 1, GPT.d_model)).astype(np.float32)
    untied_head = dict(params, lm_head=restored["lm_head"])
    np.testing.assert_array_equal(gpt.head(restored, x, config), gpt.head(untied_head, x, config))
    # generate without the cache runs the same untied model: the same tokens
    prompt = np.arange(4)
    np.testing.assert_array_equal(
        generate("gpt", params, GPT, prompt, 6, greedy=True, weights=fmt, cache=False),
        generate("gpt", params, GPT, prompt, 6, greedy=True, weights=fmt))


@needs_cpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", ["llama-gqa-half", "gpt-tied"])
def test_the_compiled_step_reads_the_stored_head(case, fmt):
    # Zeroing the stored head (and nothing of the float32 parameters) zeroes the compiled steps'
    # logits: the head's product reads the stored bytes.
    model, config_given = CASES[case]
    restored, config, stored = stored_model(model_module(model), _params(model, config_given),
                                            config_given, fmt)
    tokens = np.arange(8)[None, :]
    before = _step_logits(model, restored, config, tokens, 4, "cpu", stored, fmt)
    stored[HEAD] = np.zeros_like(stored[HEAD])
    after = _step_logits(model, restored, config, tokens, 4, "cpu", stored, fmt)
    np.testing.assert_array_equal(before[:, 0], after[:, 0])  # the prefill is NumPy's
    assert np.abs(before[:, 1:]).max() > 1e-3 and not after[:, 1:].any()


def test_a_head_that_is_not_norm_times_w_out_is_refused_naming_weights():
    # A stand-in model with the decoder's layers and a head of its own (a logit scale): storing
    # its head would change what the head computes, so it is refused.
    decoder = model_module("llama")
    scaled = types.SimpleNamespace(**{k: getattr(decoder, k) for k in dir(decoder)
                                      if not k.startswith("__")})
    scaled.__name__ = "scaled_head"
    scaled.head = lambda params, x, config, *, matmul=None: 0.5 * decoder.head(params, x, config)
    params = _params("llama", LLAMA)
    with pytest.raises(ValueError, match=r"^weights='f16' stores the output head .* scaled_head's "
                                         r"head is not one of them: use weights='f32'$"):
        stored_model(scaled, params, LLAMA, "f16")
    with pytest.raises(ValueError, match=r"weights='q8_0' stores each output's inputs in whole "
                                         r"32-weight blocks, got lm_head with 48 inputs"):
        stored_head(decoder, {"lm_head": np.ones((48, 97), np.float32)}, LLAMA, "q8_0")
    with pytest.raises(TypeError, match=r"weights='bf16' rounds float32 matrices, got tok_emb "
                                        r"\(the tied head, transposed\) of dtype float64"):
        stored_head(decoder, {"tok_emb": np.ones((97, 64))},
                    dataclasses.replace(LLAMA, tie_embeddings=True), "bf16")


@needs_cpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_compiled_step_reads_the_stored_bytes_not_the_restored_matrices(fmt):
    # Changing a stored matrix (and nothing of the float32 parameters) changes the compiled logits:
    # the products read the stored form.
    params = _params("llama", LLAMA)
    module = model_module("llama")
    stored = stored_layer_weights(module, params, LLAMA, fmt)
    restored = restored_params(params, stored, fmt)
    tokens = np.arange(8)[None, :]
    before = _step_logits("llama", restored, LLAMA, tokens, 4, "cpu", stored, fmt)
    stored["layers.1.ffn.w_down"] = np.zeros_like(stored["layers.1.ffn.w_down"])
    after = _step_logits("llama", restored, LLAMA, tokens, 4, "cpu", stored, fmt)
    np.testing.assert_array_equal(before[:, 0], after[:, 0])  # the prefill is NumPy's
    assert np.abs(before[:, 1:] - after[:, 1:]).max() > 1e-3


def test_the_restored_matrices_are_the_stored_ones_dequantised_and_nothing_else_changes():
    params = _params("gpt", GPT)
    stored = stored_layer_weights(model_module("gpt"), params, GPT, "bf16")
    restored = restored_params(params, stored, "bf16")
    assert set(stored) == {f"layers.{i}.{n}" for i in range(2)
                           for n in ("attn.w_q", "attn.w_k", "attn.w_v", "attn.w_o", "ffn.w1",
                                     "ffn.w2")}
    for name, value in params.items():
        if name in stored:
            assert restored[name].shape == value.shape and restored[name].T.flags.c_contiguous
            assert np.abs(restored[name] - value).max() <= 2.0 ** -8 * np.abs(value).max()
            assert not np.array_equal(restored[name], value)
        else:
            assert restored[name] is value  # embedding, norms, biases, head: float32 as given
    # with the head (stored_model): the tied table's rounded copy is added as lm_head
    restored, config, stored = stored_model(model_module("gpt"), params, GPT, "bf16")
    assert set(restored) == set(params) | {"lm_head"} and HEAD in stored


@pytest.mark.parametrize("model, config", [
    ("llama", dataclasses.replace(LLAMA, qk_norm="head")),
    ("llama", dataclasses.replace(LLAMA, sliding_window=4)),
    ("gpt", dataclasses.replace(GPT, norm_position="post")),
    ("mla", MLAConfig(vocab_size=97, max_seq_len=24, d_model=32, n_layers=2, n_heads=4, d_c=16,
                      d_rope=8, d_ff=48)),
], ids=["qk-norm", "window", "post-ln", "mla"])
def test_a_model_the_compiled_step_does_not_take_is_refused_naming_weights(model, config):
    params = _params(model, config)
    with pytest.raises(ValueError, match=r"^weights='bf16' stores the layers .*use weights='f32'$"):
        generate(model, params, config, np.arange(3), 2, greedy=True, weights="bf16")
    generate(model, params, config, np.arange(3), 2, greedy=True, weights="f32")  # as before


def test_bad_weights_are_refused_naming_the_option():
    params = _params("llama", LLAMA)
    with pytest.raises(ValueError, match="weights must be one of 'f32', 'bf16', 'f16', 'q8_0'"):
        generate("llama", params, LLAMA, np.arange(3), 2, weights="int4")
    with pytest.raises(TypeError, match="weights='f16' rounds float32 matrices"):
        generate("llama", {k: v.astype(np.float64) for k, v in params.items()}, LLAMA,
                 np.arange(3), 2, weights="f16")
    odd = dataclasses.replace(LLAMA, d_ff=48)
    with pytest.raises(ValueError, match=r"weights='q8_0' stores .* whole 32-weight blocks, got "
                                         r"layers\.0\.ffn\.w_down with 48 inputs"):
        generate("llama", _params("llama", odd), odd, np.arange(3), 2, weights="q8_0")


@needs_cpu
def test_decode_layers_refuses_stored_matrices_of_the_wrong_shape_or_dtype():
    module = model_module("llama")
    params = _params("llama", LLAMA)
    stored = stored_layer_weights(module, params, LLAMA, "q8_0")
    restored = restored_params(params, stored, "q8_0")
    shape, layers = module.compiled_layer_spec(restored, LLAMA)
    cache = np.zeros((1, 2, 8, 16), np.float32)

    def build(**change):
        layer = dict(layers[0], keys=cache, values=cache.copy(), **change)
        layer.update({k: stored[f"layers.0.{'attn' if k in ('w_q', 'w_k', 'w_v', 'w_o') else 'ffn'}.{k}"]
                      for k in ("w_q", "w_k", "w_v", "w_o", "w_gate", "w_up", "w_down")
                      if k not in change})
        return kernels.decode_layers(1, [layer], **shape, weights="q8_0")

    build()  # the stored matrices as they are
    with pytest.raises(ValueError, match=r"layers\[0\]\['w_q'\] in format q8_0 must have shape "
                                         r"\(64, 2\), got \(64, 4\)"):
        build(w_q=np.zeros((64, 4), stored["layers.0.attn.w_q"].dtype))
    with pytest.raises(TypeError, match=r"layers\[0\]\['w_up'\] in format q8_0 must have dtype"):
        build(w_up=np.zeros((96, 2), np.float32))
    with pytest.raises(ValueError, match="weights must be one of"):
        kernels.decode_layers(1, [], **shape, weights="q4_0")
