"""Gemma's file (refmath.models.gemma): GeGLU, the (1 + w) gains and the scaled embeddings, the
sandwich norms (Gemma 2, 3), the local layers and their own RoPE (Gemma 3), the KV cache, and the
configuration's checks. What every model satisfies is tests/models/test_model_properties.py's; the
torch oracle is test_decoder_torch.py's, Hugging Face's parity test_gemma_hf.py's."""
import dataclasses
import json
import math

import numpy as np
import pytest

from refmath.ffn import geglu_forward
from refmath.models import gemma
from refmath.models.common import sub_params
from refmath.models.gemma import GemmaConfig
from refmath.models.rope_attention import rope_attention_forward
from refmath.norms import rmsnorm_forward
from test_decoder import B, T, V, random_batch, random_params


def tiny(**overrides) -> GemmaConfig:
    fields = dict(vocab_size=V, max_seq_len=8, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                  head_dim=4, d_ff=24, init_std=0.25)
    return GemmaConfig(**{**fields, **overrides})


def test_each_generation_has_its_norms_and_qk_gains():
    layer = "layers.1."
    for generation, norms in ((1, ["ln1", "ln2"]), (2, ["ln1", "ln1_post", "ln2", "ln2_post"]),
                              (3, ["ln1", "ln1_post", "ln2", "ln2_post"])):
        shapes = gemma.param_shapes(tiny(generation=generation))
        assert [n for n in shapes if n.startswith(layer + "ln")] == [
            layer + name + ".gamma" for name in norms]
        assert (layer + "attn.q_norm.gamma" in shapes) == (generation == 3)
        assert "lm_head" not in shapes  # the head is the token table
    assert all(np.all(v == 0) for k, v in gemma.init_params(tiny()).items() if k.endswith("gamma"))


def test_a_gemma2_layer_is_the_sandwich_of_one_plus_w_norms_around_geglu():
    r"""x' = x + N(Attn(N(x))), x'' = x' + N(GeGLU(N(x'))), each N an RMSNorm of gain 1 + w."""
    config = tiny(generation=2, query_pre_attn_scalar=6.0, attn_softcap=1.5)
    params = random_params(gemma, config, seed=4)
    x = np.random.default_rng(5).standard_normal((B, T, 16))
    layer = sub_params(params, "layers.0")

    def norm(u, name):
        return rmsnorm_forward(u, 1.0 + layer[name + ".gamma"], config.norm_eps)[0]

    out, _ = gemma.layer_forward(x, layer, 0, config)
    a = rope_attention_forward(norm(x, "ln1"), sub_params(layer, "attn"), config)[0]
    x1 = x + norm(a, "ln1_post")
    f = geglu_forward(norm(x1, "ln2"), layer["ffn.w_gate"], layer["ffn.w_up"],
                      layer["ffn.w_down"])[0]
    np.testing.assert_allclose(out, x1 + norm(f, "ln2_post"), rtol=1e-13, atol=1e-13)


def test_the_embeddings_are_scaled_and_the_logits_capped():
    config = tiny(final_softcap=2.0)
    params = random_params(gemma, config, seed=6)
    tokens = random_batch(seed=8)["tokens"]
    x = gemma.embed(params, tokens, config, 0)
    np.testing.assert_array_equal(x, params["tok_emb"][tokens] * math.sqrt(16))
    z = gemma.logits(params, tokens, config)
    assert np.abs(z).max() < 2.0
    uncapped = gemma.logits(params, tokens, dataclasses.replace(config, final_softcap=None))
    np.testing.assert_allclose(z, 2.0 * np.tanh(uncapped / 2.0), rtol=1e-13, atol=1e-14)


def test_a_local_layer_has_its_window_and_its_own_rope_base():
    config = tiny(generation=3, windows=(3, None), local_rope_base=100.0,
                  rope_scaling=dict(rope_type="linear", factor=4.0))
    local, global_ = gemma.layer_config(config, 0), gemma.layer_config(config, 1)
    assert (local.sliding_window, local.rope_base, local.rope_scaling) == (3, 100.0, None)
    assert (global_.sliding_window, global_.rope_base) == (None, 10000.0)
    assert global_.rope_scaling.rope_type == "linear"
    assert gemma.cache_spec(config, 2, 8).windows == (3, None)
    with pytest.raises(ValueError, match="differ by layer"):
        config.sliding_window  # noqa: B018 (the network has no one window)


@pytest.mark.parametrize("fields", [
    {}, dict(generation=2, query_pre_attn_scalar=6.0, attn_softcap=1.5, final_softcap=2.0,
             windows=(3, None)),
    dict(generation=3, windows=(None, 3), local_rope_base=100.0,
         rope_scaling=dict(rope_type="linear", factor=4.0))],
    ids=["gemma", "gemma2 caps and a local layer", "gemma3 QK-norm, local RoPE"])
def test_cached_decoding_equals_recomputing(fields):
    """Prefill, then one token at a time through the KV cache: the logits of the whole sequence."""
    from refmath.inference.kv_cache import decode_step, prefill

    config = tiny(**fields)
    params = random_params(gemma, config, seed=7)
    tokens = random_batch(seed=8)["tokens"]
    full = gemma.logits(params, tokens, config)
    _, cache = prefill("gemma", params, config, tokens[:, :3])
    for t in range(3, T):
        z = decode_step("gemma", params, config, cache, tokens[:, t])
        np.testing.assert_allclose(z, full[:, t], rtol=1e-12, atol=1e-12)


def test_config_round_trips_through_json():
    config = tiny(generation=3, windows=(3, None), local_rope_base=100.0, attn_softcap=5.0,
                  rope_scaling=dict(rope_type="linear", factor=2.0))
    assert GemmaConfig(**json.loads(json.dumps(dataclasses.asdict(config)))) == config


@pytest.mark.parametrize("overrides, message", [
    (dict(n_kv_heads=3), "n_kv_heads = 3 must divide n_heads = 4"),
    (dict(head_dim=5), "head_dim = 5 must be even"),
    (dict(generation=4), "generation"),
    (dict(windows=(3,)), "windows must be a tuple of n_layers = 2"),
    (dict(windows=(None, None)), "no local layer"),
    (dict(windows=(0, None)), "ints >= 1"),
    (dict(local_rope_base=100.0), "local_rope_base"),
    (dict(attn_softcap=0.0), "attn_softcap"),
    (dict(qk_norm="head"), "qk_norm"),
    (dict(tie_embeddings=False), "tie_embeddings"),
])
def test_options_are_checked_naming_the_field(overrides, message):
    with pytest.raises((ValueError, TypeError), match=message):
        tiny(**overrides)


def test_a_decoder_config_is_refused():
    from refmath.models.decoder import DecoderConfig

    config = DecoderConfig(vocab_size=V, max_seq_len=8, d_model=16, n_layers=1, n_heads=4)
    with pytest.raises(TypeError, match="GemmaConfig"):
        gemma.param_shapes(config)
