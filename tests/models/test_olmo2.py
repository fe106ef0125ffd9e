"""OLMo 2's file (refmath.models.olmo2): the norms after the sublayers only (N22), QK-norm over the
whole projections (N18), the KV cache, and the configuration's checks. What every model satisfies
is tests/models/test_model_properties.py's; the torch oracle is test_decoder_torch.py's, Hugging
Face's parity test_olmo2_hf.py's."""
import dataclasses
import json

import numpy as np
import pytest

from refmath.models import olmo2
from refmath.models.common import sub_params
from refmath.models.olmo2 import OLMo2Config
from refmath.models.rope_attention import rope_attention_forward
from refmath.norms import rmsnorm_forward
from test_decoder import B, T, V, random_batch, random_params


def tiny(**overrides) -> OLMo2Config:
    fields = dict(vocab_size=V, max_seq_len=8, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                  ffn_multiple_of=8, init_std=0.25)
    return OLMo2Config(**{**fields, **overrides})


def test_olmo2_has_only_the_norms_after_the_sublayers_and_projection_wide_qk_gains():
    layer = "layers.1."
    shapes = olmo2.param_shapes(tiny())
    assert [n for n in shapes if n.startswith(layer + "ln")] == [layer + "ln1_post.gamma",
                                                                 layer + "ln2_post.gamma"]
    assert (shapes[layer + "attn.q_norm.gamma"], shapes[layer + "attn.k_norm.gamma"]) == (
        (16,), (8,))  # h d_h and g d_h


def test_olmo2_normalises_each_branch_output_not_its_input_n22():
    """x' = x + RMSNorm(Attn(x)), x'' = x' + RMSNorm(FFN(x'))."""
    config = tiny()
    params = random_params(olmo2, config, seed=4)
    x = np.random.default_rng(5).standard_normal((B, T, 16))
    layer = sub_params(params, "layers.0")
    out, _ = olmo2.layer_forward(x, layer, config)
    a = rope_attention_forward(x, sub_params(layer, "attn"), config)[0]
    x1 = x + rmsnorm_forward(a, layer["ln1_post.gamma"], config.norm_eps)[0]
    f = olmo2.blocks.ffn_forward(x1, sub_params(layer, "ffn"))[0]
    expected = x1 + rmsnorm_forward(f, layer["ln2_post.gamma"], config.norm_eps)[0]
    np.testing.assert_allclose(out, expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("fields", [{}, dict(n_kv_heads=1, head_dim=6, tie_embeddings=True),
                                    dict(rope_scaling=dict(rope_type="linear", factor=2.0))],
                         ids=["GQA", "MQA head_dim 6 tied", "linear scaling"])
def test_cached_decoding_equals_recomputing(fields):
    """Prefill, then one token at a time through the KV cache: the logits of the whole sequence."""
    from refmath.inference.kv_cache import decode_step, prefill

    config = tiny(**fields)
    params = random_params(olmo2, config, seed=7)
    tokens = random_batch(seed=8)["tokens"]
    full = olmo2.logits(params, tokens, config)
    _, cache = prefill("olmo2", params, config, tokens[:, :3])
    for t in range(3, T):
        z = decode_step("olmo2", params, config, cache, tokens[:, t])
        np.testing.assert_allclose(z, full[:, t], rtol=1e-12, atol=1e-12)


def test_config_round_trips_through_json():
    config = tiny(head_dim=6, d_ff=20, tie_embeddings=True, dropout=0.1,
                  rope_scaling=dict(rope_type="linear", factor=2.0))
    assert OLMo2Config(**json.loads(json.dumps(dataclasses.asdict(config)))) == config


@pytest.mark.parametrize("overrides, message", [
    (dict(n_kv_heads=3), "n_kv_heads = 3 must divide n_heads = 4"),
    (dict(head_dim=5), "head width head_dim = 5 must be even"),
    (dict(d_model=18), "give head_dim"),
    (dict(rope_layout="sideways"), "rope_layout"),
    (dict(dropout=1.0), "dropout"),
    (dict(qk_norm="head"), "qk_norm"),
])
def test_options_are_checked_naming_the_field(overrides, message):
    with pytest.raises((ValueError, TypeError), match=message):
        tiny(**overrides)


def test_a_decoder_config_is_refused():
    from refmath.models.decoder import DecoderConfig

    config = DecoderConfig(vocab_size=V, max_seq_len=8, d_model=16, n_layers=1, n_heads=4)
    with pytest.raises(TypeError, match="OLMo2Config"):
        olmo2.param_shapes(config)
