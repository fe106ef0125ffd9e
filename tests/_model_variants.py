"""Every block shape each model of refmath.models.MODELS has, as small configurations: what the
registry-wide tests run each property on (tests/models/test_model_properties.py) and what the
config-perturbation test perturbs each field from (tests/models/test_config_perturbation.py). A
field that matters in only one shape (parallel_norms, local_rope_base, window_layers) has a
variant where it does. A new family adds its shapes here and is checked by both."""
from __future__ import annotations

from refmath.moe import MoEConfig

_LLAMA = dict(vocab_size=61, max_seq_len=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
              d_ff=48, rope_layout="half")
_GPT = dict(vocab_size=61, max_seq_len=16, n_layers=2, d_model=32, n_heads=4, d_ff=64,
            norm_position="pre", dropout=0.0)
_SMALL = dict(vocab_size=61, max_seq_len=16, d_model=32, n_layers=2, n_heads=4)

# label: (model, configuration fields)
VARIANTS = {
    "llama": ("llama", dict(_LLAMA)),
    "llama-mqa": ("llama", dict(_LLAMA, n_kv_heads=1)),
    "llama-biases": ("llama", dict(_LLAMA, qkv_bias=True)),
    "llama-window": ("llama", dict(_LLAMA, qk_norm="head", sliding_window=3)),  # Qwen3's
    "mixtral": ("llama", dict(_LLAMA, moe=MoEConfig(n_experts=4, top_k=2, d_expert=16))),
    "gemma": ("gemma", dict(_SMALL, n_kv_heads=2, head_dim=8, d_ff=48, rope_layout="half",
                            generation=3, windows=(3, None), local_rope_base=100.0,
                            attn_softcap=50.0)),
    "gemma1": ("gemma", dict(_SMALL, n_kv_heads=2, head_dim=8, d_ff=48)),
    "falcon": ("falcon", dict(_SMALL, n_kv_heads=2, d_ff=48, rope_layout="half",
                              parallel_norms=2)),
    "falcon-sequential": ("falcon", dict(_SMALL, n_kv_heads=2, d_ff=48, parallel_block=False)),
    "olmo2": ("olmo2", dict(_LLAMA)),
    "phi3": ("phi3", dict(_LLAMA)),
    "gpt": ("gpt", dict(_GPT)),
    "gpt-post": ("gpt", dict(_GPT, norm_position="post")),
    "gpt-banded": ("gpt", dict(_GPT, sliding_window=3, window_layers=(False, True))),
    "mla": ("mla", dict(_SMALL, d_c=16, d_rope=8, d_ff=48)),
    "mla-q-lora-latent-norm": ("mla", dict(_SMALL, d_c=16, d_rope=8, d_ff=48, q_lora_rank=12,
                                           latent_norm=True)),
    "cohere": ("cohere", dict(_SMALL, n_kv_heads=2, d_ff=48)),
}
