"""What the Hugging Face parity tests share (tests/test_hf.py and each family's
tests/models/test_<family>_hf.py): tiny transformers models with random weights (nothing is
downloaded), transformers' internals in float64, and the command line's and refusals' helpers.

transformers computes RMSNorm, RoPE's angles and the mixture-of-experts routers in float32 even
inside a float64 model, which limits any float64 comparison to float32's ~1e-7.
:func:`float64_internals` replaces those forwards by the same formulas evaluated in float64 (the
weights, head layouts, attention, experts, MLP and head stay transformers' own), so the logits can
be compared at a relative 1e-9.
"""
from __future__ import annotations

import functools
import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is the test oracle's backend: install the 'oracle' extra")
transformers = pytest.importorskip(
    "transformers", reason="the comparison needs transformers: pip install 'transformers>=5'")
pytest.importorskip("safetensors", reason="checkpoints are safetensors: install the 'hf' extra")

from refmath import hf  # noqa: E402
from refmath.commands import main  # noqa: E402

VOCAB = 61
REL = 1e-9  # float64 logits, relative to the largest logit


# ---- tiny Hugging Face models ------------------------------------------------------------------

def hf_config(model_type: str, **overrides):
    """A tiny transformers config of ``model_type`` (d_model 32, 2 layers, vocabulary 61)."""
    llama = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 rms_norm_eps=1e-5, initializer_range=0.2,
                 rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    mla = dict(llama, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=4,
               qk_nope_head_dim=8, v_head_dim=6, first_k_dense_replace=2, n_routed_experts=4)
    # mixtures of experts (E1-E4): 8 experts of width 12 in 4 groups, dense first layer
    experts = dict(num_experts_per_tok=2, moe_intermediate_size=12)
    deepseek_moe = dict(mla, **experts, first_k_dense_replace=1, n_routed_experts=8, n_group=4,
                        topk_group=2, n_shared_experts=2)
    gpt = dict(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
               initializer_range=0.2, bos_token_id=0, eos_token_id=0)
    # Falcon-7B's layout: multi-query attention, one LayerNorm before the parallel block
    falcon = dict(vocab_size=VOCAB, hidden_size=32, ffn_hidden_size=48, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, layer_norm_epsilon=1e-5,
                  initializer_range=0.2, bos_token_id=0, eos_token_id=0,
                  rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    fields = {
        "gpt2": (transformers.GPT2Config, gpt),
        "openai-gpt": (transformers.OpenAIGPTConfig, gpt),
        "llama": (transformers.LlamaConfig, llama),
        "mistral": (transformers.MistralConfig, dict(llama, sliding_window=5)),
        "qwen2": (transformers.Qwen2Config, dict(llama, tie_word_embeddings=True)),
        "qwen3": (transformers.Qwen3Config, dict(llama, head_dim=8)),
        "deepseek_v2": (transformers.DeepseekV2Config, dict(mla, q_lora_rank=None)),
        "deepseek_v3": (transformers.DeepseekV3Config, dict(mla, q_lora_rank=12)),
        # Gemma: head_dim 8 apart from d/h, small caps that bite on these tiny models' scores
        "gemma": (transformers.GemmaConfig, dict(llama, head_dim=8)),
        "gemma2": (transformers.Gemma2Config, dict(
            llama, head_dim=8, query_pre_attn_scalar=12, sliding_window=5,
            attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
        "gemma3_text": (transformers.Gemma3TextConfig, dict(
            llama, head_dim=8, query_pre_attn_scalar=10, sliding_window=5,
            layer_types=["sliding_attention", "full_attention"], rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}})),
        "mixtral": (transformers.MixtralConfig, dict(llama, num_local_experts=4,
                                                     num_experts_per_tok=2, sliding_window=None)),
        "qwen2_moe": (transformers.Qwen2MoeConfig, dict(
            llama, **experts, num_experts=4, shared_expert_intermediate_size=20,
            mlp_only_layers=[0], tie_word_embeddings=True)),
        "qwen3_moe": (transformers.Qwen3MoeConfig, dict(llama, **experts, head_dim=8,
                                                        num_experts=4, norm_topk_prob=True)),
        "olmo2": (transformers.Olmo2Config, dict(llama, pad_token_id=0, eos_token_id=0)),
        # Phi-3: head_dim d/h (its config has no other), a window of 5 on every layer
        "phi3": (transformers.Phi3Config, dict(llama, sliding_window=5, pad_token_id=0,
                                               eos_token_id=0, bos_token_id=0)),
        "falcon": (transformers.FalconConfig, falcon),
        # Falcon-40B's: grouped query_key_value (2 KV heads), ln_attn and ln_mlp
        "falcon-40b": (transformers.FalconConfig, dict(falcon, new_decoder_architecture=True,
                                                       num_kv_heads=2)),
        "deepseek_v2-moe": (transformers.DeepseekV2Config, dict(
            deepseek_moe, q_lora_rank=None, num_experts_per_tok=3,
            topk_method="group_limited_greedy", routed_scaling_factor=1.5)),
        "deepseek_v3-moe": (transformers.DeepseekV3Config, dict(
            deepseek_moe, q_lora_rank=12, norm_topk_prob=True, routed_scaling_factor=2.5)),
    }[model_type]
    return fields[0](**{**fields[1], **overrides})


def random_model(model_type: str, seed: int = 0, **overrides):
    """A float64 transformers model with every parameter drawn at random (norm gains near 1,
    biases near 0 but not 0, so that every tensor's place in the function is exercised)."""
    torch.manual_seed(seed)
    config = hf_config(model_type, **overrides)
    config._experts_implementation = "eager"  # the experts' own loop: grouped_mm has no float64
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(0.1 * torch.randn_like(parameter))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's choice bias, 0 at init
                buffer.copy_(0.1 * torch.randn_like(buffer))
    return model.eval()


def load_float64(directory):
    """A saved checkpoint in transformers, float64, with the experts' own loop."""
    config = transformers.AutoConfig.from_pretrained(directory)
    config._experts_implementation = "eager"  # grouped_mm has no float64
    return transformers.AutoModelForCausalLM.from_pretrained(directory, config=config,
                                                             dtype=torch.float64).eval()


def _gemma_rms_norm(module, x):
    """Gemma's RMSNorm, (1 + w) x / rms(x), in float64 (transformers computes it in float32)."""
    x = x.to(torch.float64)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps) * (1.0 + module.weight)


def _rms_norm(module, x):
    return module.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                            + module.variance_epsilon))


def _angles(inv_freq, position_ids):
    return position_ids[..., None].to(torch.float64) * inv_freq


def _rope_cos_sin(inv_freq, x, position_ids):
    freqs = _angles(inv_freq, position_ids)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rope_complex(inv_freq, x, position_ids):
    freqs = _angles(inv_freq, position_ids)
    return torch.polar(torch.ones_like(freqs), freqs)


def _apply_rotary_complex(xq, xk, freqs_cis):
    # deepseek_v2's apply_rotary_emb without its cast to float32
    def rotate(x):
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * freqs_cis.unsqueeze(1)).flatten(3)
    return rotate(xq), rotate(xk)


class _Float64Torch:
    """torch, but with float32 meaning float64: transformers' rope initialisers
    (``modeling_rope_utils``) run under it compute their frequencies in float64."""
    float = torch.float64
    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def _scaled_rope_cos_sin(module, x, position_ids):
    # the rotary embedding's forward in float64; transformers' dynamic_rope_update wraps it below
    freqs = _angles(module.inv_freq.to(torch.float64), position_ids)
    if type(module).__name__ == "DeepseekV2RotaryEmbedding":  # its complex form
        return torch.polar(torch.full_like(freqs, module.attention_scaling), freqs)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * module.attention_scaling, emb.sin() * module.attention_scaling


def _gemma3_rope64(module, x, position_ids, layer_type):
    """Gemma 3's rotary embedding of a layer type, its frequencies in float64 (default or linear)."""
    params = module.config.rope_parameters[layer_type]
    dim = 2 * getattr(module, f"{layer_type}_inv_freq").numel()
    inv_freq = 1.0 / params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    assert params["rope_type"] in ("default", "linear")
    if params["rope_type"] == "linear":
        inv_freq = inv_freq / params["factor"]
    return _rope_cos_sin(inv_freq, x, position_ids)


def _longrope64(initialiser, config, device=None, seq_len=None, layer_type=None):
    """transformers' LongRoPE frequencies, 1 / (f_r base^(2r/d)), in float64; its factor m."""
    _, m = initialiser(config, device, seq_len=seq_len, layer_type=layer_type)
    p = config.rope_parameters
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    long = seq_len is not None and seq_len > p["original_max_position_embeddings"]
    factors = torch.tensor(p["long_factor"] if long else p["short_factor"], dtype=torch.float64)
    return 1.0 / (factors * p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)), m


def _float64_scaled_rope(module, monkeypatch):
    """A rotary embedding with a rope scaling: transformers' own initialiser and its per-length
    update (dynamic NTK), evaluated in float64."""
    from transformers import modeling_rope_utils as utils

    monkeypatch.setattr(utils, "torch", _Float64Torch())
    if module.rope_type == "longrope":  # its exponents are cast with Tensor.float(): redone here
        monkeypatch.setitem(utils.ROPE_INIT_FUNCTIONS, "longrope", functools.partial(
            _longrope64, utils.ROPE_INIT_FUNCTIONS["longrope"]))
    inv_freq, module.attention_scaling = utils.ROPE_INIT_FUNCTIONS[module.rope_type](module.config)
    module.register_buffer("inv_freq", inv_freq, persistent=False)
    module.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
    update = functools.partial(utils.dynamic_rope_update(_scaled_rope_cos_sin), module)

    def forward(x, position_ids):
        # dynamic NTK's stretched base is (int tensor) * float: of torch's default dtype
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            return update(x, position_ids)
        finally:
            torch.set_default_dtype(default)
    module.forward = forward


def _router64(module, hidden_states):
    """transformers' mixture-of-experts routers (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3), as their
    own code computes them but in float64: ``(logits, gates, chosen experts)``."""
    x = hidden_states.reshape(-1, module.weight.shape[1])
    logits = x @ module.weight.to(torch.float64).T  # DeepSeek keeps its router in float32
    kind = type(module).__name__
    if kind == "DeepseekV3TopkRouter":
        scores = logits.sigmoid()
        choice = scores + module.e_score_correction_bias.to(torch.float64)
        groups = choice.view(-1, module.num_group, module.num_experts // module.num_group)
        best = groups.topk(2, dim=-1)[0].sum(dim=-1).topk(module.topk_group, dim=-1)[1]
        keep = torch.zeros_like(groups[..., 0]).scatter_(1, best, 1).bool()
        choice = choice.masked_fill(~keep.repeat_interleave(groups.shape[-1], dim=1), -torch.inf)
        chosen = choice.topk(module.top_k, dim=-1)[1]
        gates = scores.gather(1, chosen)
        if module.norm_topk_prob:
            gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, gates * module.routed_scaling_factor, chosen
    scores = logits.softmax(dim=-1)
    if kind == "DeepseekV2TopkRouter":
        if module.topk_method == "group_limited_greedy":
            groups = scores.view(-1, module.num_group, module.num_experts // module.num_group)
            best = groups.max(dim=-1).values.topk(module.topk_group, dim=-1)[1]
            keep = torch.zeros_like(groups[..., 0]).scatter_(1, best, 1).bool()
            scores = scores.masked_fill(~keep.repeat_interleave(groups.shape[-1], dim=1), 0.0)
        gates, chosen = scores.topk(module.top_k, dim=-1)
        return logits, gates * module.routed_scaling_factor, chosen
    gates, chosen = scores.topk(module.top_k, dim=-1)
    if kind == "MixtralTopKRouter" or module.norm_topk_prob:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return logits, gates, chosen


def float64_internals(model, monkeypatch):
    """Evaluate transformers' RMSNorm, RoPE angles and routers in float64 (see the module
    docstring)."""
    for module in model.modules():
        name = type(module).__name__
        if name.startswith("Gemma") and name.endswith("RMSNorm"):
            module.forward = functools.partial(_gemma_rms_norm, module)
        elif name.endswith("RMSNorm"):
            module.forward = functools.partial(_rms_norm, module)
        elif name in ("MixtralTopKRouter", "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter",
                      "DeepseekV2TopkRouter", "DeepseekV3TopkRouter"):
            module.forward = functools.partial(_router64, module)
        elif name == "Gemma3RotaryEmbedding":  # one rope per layer type
            module.forward = functools.partial(_gemma3_rope64, module)
        elif name.endswith("RotaryEmbedding") and getattr(module, "rope_type", "default") != "default":
            _float64_scaled_rope(module, monkeypatch)
        elif name.endswith("RotaryEmbedding"):
            dim = 2 * module.inv_freq.numel()
            theta = module.config.rope_parameters["rope_theta"]
            inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
            complex_form = name == "DeepseekV2RotaryEmbedding"
            module.forward = functools.partial(_rope_complex if complex_form else _rope_cos_sin,
                                               inv_freq)
    if model.config.model_type in ("gemma2", "gemma3_text"):  # eager attention's float32 softmax
        from transformers.models.gemma2 import modeling_gemma2
        from transformers.models.gemma3 import modeling_gemma3
        for module in (modeling_gemma2, modeling_gemma3):
            monkeypatch.setattr(module, "torch", _Float64Torch())
    if model.config.model_type == "deepseek_v2":
        from transformers.models.deepseek_v2 import modeling_deepseek_v2
        monkeypatch.setattr(modeling_deepseek_v2, "apply_rotary_emb", _apply_rotary_complex)
    return model


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.numpy()


def relative_error(z, reference) -> float:
    return float(np.abs(z - reference).max() / np.abs(reference).max())


TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 13))



def run_main(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


def generate_hf_runs(directory) -> None:
    """``generate --hf`` greedily continues the prompt 1, 2, 3 from ``directory`` by up to 12
    tokens (it may stop early at the config's end-of-sequence id)."""
    status, out, err = run_main(["generate", "--hf", str(directory), "--prompt-ids", "1,2,3",
                                 "--greedy", "--max-new-tokens", "12"])
    assert status == 0, err
    ids = [int(i) for i in out.strip().split(",")]
    assert ids[:3] == [1, 2, 3] and 3 < len(ids) <= 15


def one_line_error(directory) -> str:
    with pytest.raises(hf.HFCheckpointError) as info:
        hf.load_checkpoint(directory)
    message = str(info.value)
    assert "\n" not in message
    return message


def edit_config(directory: Path, **fields) -> None:
    path = directory / hf.CONFIG_FILE
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


def greedy_tokens_match(model, directory, monkeypatch, new_tokens: int = 16,
                        use_cache: bool = True):
    """Save ``model`` to ``directory``, read it with refmath.hf, and require refmath's greedy
    tokens through its KV cache to be those of ``model.generate`` in float64, after a 6-token
    prompt (end-of-sequence ignored, so that both run ``new_tokens`` steps). ``use_cache=False``
    makes transformers recompute every step: its cache keeps keys that a length-dependent rope
    scaling (dynamic NTK, LongRoPE) rotated at shorter lengths, stale past the trained context
    (K3), where refmath prefills afresh, which is recomputing."""
    from refmath.inference.generate import generate

    model.save_pretrained(directory, safe_serialization=True)
    name, config, params = hf.load_checkpoint(directory, dtype=np.float64)
    prompt = TOKENS[0, :6]
    ours = generate(name, params, config, prompt, new_tokens, greedy=True)
    float64_internals(model, monkeypatch)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = model.generate(torch.as_tensor(prompt[None]), max_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=0,
                                use_cache=use_cache)[0].numpy()
    np.testing.assert_array_equal(ours, theirs)

