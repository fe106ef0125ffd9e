"""Cohere's Command-R (refmath.models.cohere) against transformers' CohereForCausalLM in float64:
the logits and greedy tokens of a random checkpoint read through refmath.hf, the checkpoint refmath
writes read back by transformers, and the decode steps on every CPU backend."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from refmath import hf, kernels
from refmath.fast.products import kernel_products
from refmath.inference import compiled_step
from refmath.inference.generate import generate
from refmath.inference.kv_cache import generate_cached, prefill
from refmath.models import model_module
from refmath.models.cohere import CohereConfig
from _support import float32_rule

torch = pytest.importorskip("torch", reason="the parity tests need PyTorch")
transformers = pytest.importorskip("transformers", reason="the parity tests need transformers")
pytest.importorskip("safetensors", reason="checkpoints are safetensors files")
from transformers.models.cohere import modeling_cohere  # noqa: E402

VOCAB = 61
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 13))
VARIANTS = {  # id -> transformers config overrides
    "tied": {},
    "qk-norm": dict(use_qk_norm=True),
    "untied-mha": dict(tie_word_embeddings=False, num_key_value_heads=4, logit_scale=0.5),
}


def random_model(seed: int = 0, **overrides):
    """A float64 CohereForCausalLM with every parameter drawn at random (the norm gains moved off
    1, so that each gain's place in the function is exercised)."""
    torch.manual_seed(seed)
    config = transformers.CohereConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        logit_scale=0.25, pad_token_id=0, bos_token_id=1, eos_token_id=2), **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model.eval()


def _layer_norm64(self, x):
    """CohereLayerNorm in float64 (transformers computes it in float32)."""
    x = x.to(torch.float64)
    mean = x.mean(-1, keepdim=True)
    variance = (x - mean).pow(2).mean(-1, keepdim=True)
    return self.weight.to(torch.float64) * ((x - mean) * torch.rsqrt(variance + self.variance_epsilon))


def _rotary64(self, x, position_ids):
    """The interleaved rotation's cos and sin at float64 frequencies and angles."""
    dim = 2 * self.inv_freq.numel()
    theta = self.config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    emb = torch.repeat_interleave(position_ids[..., None].to(torch.float64) * inv_freq, 2, dim=-1)
    return emb.cos(), emb.sin()


def _apply_rotary64(q, k, cos, sin, unsqueeze_dim=1):
    """apply_rotary_pos_emb without its cast to float32."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rotate = modeling_cohere.rotate_half
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


@pytest.fixture
def float64_cohere(monkeypatch):
    monkeypatch.setattr(modeling_cohere.CohereLayerNorm, "forward", _layer_norm64)
    monkeypatch.setattr(modeling_cohere.CohereRotaryEmbedding, "forward", _rotary64)
    monkeypatch.setattr(modeling_cohere, "apply_rotary_pos_emb", _apply_rotary64)


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.numpy()


def relative_error(z, reference) -> float:
    return float(np.abs(z - reference).max() / np.abs(reference).max())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_loaded_checkpoint_gives_the_logits_of_transformers(variant, tmp_path, float64_cohere):
    model = random_model(**VARIANTS[variant])
    model.save_pretrained(tmp_path, safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path, dtype=np.float64)
    assert name == "cohere" and type(config) is CohereConfig
    assert config.qk_norm == (variant == "qk-norm")
    error = relative_error(model_module(name).logits(params, TOKENS, config),
                           hf_logits(model, TOKENS))
    print(f"cohere {variant}: largest logit difference {error:.1e} of the largest logit")
    assert error < 1e-13  # float64 rounding (~1e-15), with room to spare


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_generation_gives_the_tokens_of_transformers(variant, tmp_path, float64_cohere):
    model = random_model(seed=1, **VARIANTS[variant])
    model.save_pretrained(tmp_path, safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path, dtype=np.float64)
    prompt = TOKENS[0, :6]
    ours = generate(name, params, config, prompt, 16, greedy=True)  # through the KV cache
    model.generation_config.eos_token_id = None  # 16 tokens, whatever they are
    with torch.no_grad():
        theirs = model.generate(torch.as_tensor(prompt[None]), max_new_tokens=16,
                                do_sample=False, pad_token_id=0)[0].numpy()
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_gradient_equals_torch_autograd_through_transformers(variant, tmp_path,
                                                                   float64_cohere):
    """The hand-written backward against autograd through transformers' own CohereForCausalLM: the
    mean next-token cross-entropy's gradient of every parameter, mapped into refmath's names by
    the same key table the reader uses (a transpose or a tied table maps a gradient as it maps a
    weight)."""
    # No padding id: torch's Embedding(padding_idx=0) drops the lookup's gradient of row 0, a
    # training convention for pad tokens, where the sequences here use id 0 as a word.
    model = random_model(seed=2, **{**VARIANTS[variant], "pad_token_id": None})
    model.save_pretrained(tmp_path, safe_serialization=True)
    name, config, params = hf.load_checkpoint(tmp_path, dtype=np.float64)
    module = model_module(name)
    tokens, targets = TOKENS[:, :-1], TOKENS[:, 1:]
    loss, cache = module.forward(params, {"tokens": tokens, "targets": targets}, config)
    grads = module.backward(cache)

    logits = model(torch.as_tensor(tokens)).logits
    theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                               torch.as_tensor(targets).reshape(-1))
    theirs.backward()
    assert loss == pytest.approx(theirs.item(), rel=1e-13)
    hf_grads = {k: p.grad.numpy() for k, p in model.named_parameters()}
    expected = {ours: hf_grads[key].T if transposed else hf_grads[key]
                for key, ours, transposed in module.key_table(config)}
    if not config.tie_embeddings:
        expected["lm_head"] = hf_grads["lm_head.weight"].T
    assert expected.keys() == grads.keys()
    for key, g in grads.items():
        scale = np.abs(expected[key]).max()
        assert scale > 0, key  # every parameter reaches the loss
        assert np.abs(g - expected[key]).max() <= 1e-12 * scale, key


def _params(config, seed=0):
    """Parameters moved off their initial values (unit gains would hide a misplaced gain)."""
    rng = np.random.default_rng(seed)
    params = model_module("cohere").init_params(config, seed=seed)
    return {k: v + 0.1 * rng.standard_normal(v.shape) for k, v in params.items()}


@pytest.mark.parametrize("options", [dict(), dict(qk_norm=True, tie_embeddings=False)],
                         ids=["tied", "qk-norm-untied"])
def test_a_written_checkpoint_is_read_by_transformers_and_back(options, tmp_path, float64_cohere):
    config = CohereConfig(vocab_size=VOCAB, max_seq_len=64, d_model=32, n_layers=2, n_heads=4,
                          n_kv_heads=2, d_ff=48, logit_scale=0.25, **options)
    params = _params(config)
    hf.save_checkpoint(tmp_path, "cohere", config, params)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert type(model).__name__ == "CohereForCausalLM"
    ours = model_module("cohere").logits(params, TOKENS, config)
    assert relative_error(ours, hf_logits(model, TOKENS)) < 1e-13
    name, again, read = hf.load_checkpoint(tmp_path, dtype=np.float64)  # the key table, both ways
    assert (name, again) == ("cohere", config)
    assert read.keys() == params.keys()
    for key in params:
        np.testing.assert_array_equal(read[key], params[key], err_msg=key)


def test_config_from_hf_refuses_what_it_does_not_compute():
    base = dict(model_type="cohere", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                logit_scale=0.0625)
    module = model_module("cohere")
    assert module.config_from_hf(base).n_kv_heads == 4
    for field, value in [("attention_bias", True), ("hidden_act", "gelu"), ("head_dim", 16),
                         ("rope_parameters", dict(rope_type="linear", factor=2.0,
                                                  rope_theta=10000.0))]:
        with pytest.raises(hf.HFCheckpointError, match=field):
            module.config_from_hf({**base, field: value})


@pytest.mark.skipif(not kernels.cpu_available(), reason="needs refmath._C")
@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_cpu_backend_gives_the_numpy_tokens_and_float32_logits(qk_norm):
    config = CohereConfig(vocab_size=VOCAB, max_seq_len=24, d_model=32, n_layers=2, n_heads=4,
                          n_kv_heads=2, d_ff=48, qk_norm=qk_norm)
    params64 = _params(config)
    params = {k: v.astype(np.float32) for k, v in params64.items()}
    module = model_module("cohere")
    assert compiled_step.compiled_layers(module, params, config) is None  # a parallel block
    prompt = TOKENS[:, :5]
    fast = generate_cached("cohere", params, config, prompt, 8, greedy=True, backend="cpu",
                           products=kernel_products)
    plain = generate_cached("cohere", params, config, prompt, 8, greedy=True)
    ref64 = generate_cached("cohere", params64, config, prompt, 8, greedy=True)
    np.testing.assert_array_equal(fast.tokens, plain.tokens)
    np.testing.assert_array_equal(ref64.tokens, plain.tokens)
    float32_rule("cohere on the cpu backend", fast.logits, ref64.logits, plain.logits,
                 floor=4 * np.finfo(np.float32).eps * np.abs(ref64.logits).max())


def test_the_cached_step_is_the_full_forward():
    config = CohereConfig(vocab_size=VOCAB, max_seq_len=24, d_model=32, n_layers=2, n_heads=4,
                          n_kv_heads=2, d_ff=48, qk_norm=True)
    params = _params(config)
    full = model_module("cohere").logits(params, TOKENS, config)
    z, _ = prefill("cohere", params, config, TOKENS, all_logits=True)
    np.testing.assert_allclose(z, full, rtol=1e-12, atol=1e-12 * np.abs(full).max())


def test_a_subclass_or_a_decoder_config_is_refused():
    config = CohereConfig(vocab_size=VOCAB, max_seq_len=24, d_model=32, n_layers=1, n_heads=4,
                          d_ff=48)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Wider(CohereConfig):
        extra: float = 2.0

    params = _params(config)
    with pytest.raises(TypeError, match="exactly that class"):
        model_module("cohere").logits(params, TOKENS, Wider(**dataclasses.asdict(config)))
    with pytest.raises(TypeError, match="needs a CohereConfig"):
        prefill("cohere", params, model_module("llama").DecoderConfig(
            vocab_size=VOCAB, max_seq_len=24, d_model=32, n_layers=1, n_heads=4), TOKENS)
