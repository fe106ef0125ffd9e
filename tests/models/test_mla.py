"""The M4 (MLA) decoder: gradients of every parameter, the K8/K9 score, L5, K1 on the cached
latents (L6 for every model is test_model_properties.py's), config and batch checks. The PyTorch comparison lives in test_mla_torch.py."""
import dataclasses
import json
import math

import numpy as np
import pytest

from refmath.models import mla
from refmath.models.decoder import IGNORE_INDEX
from refmath.models.mla import MLAConfig
from refmath.norms import rmsnorm_forward
from refmath.optim import takes_weight_decay
from refmath.positions import rope_forward
from refmath.softmax import log_softmax_forward, softmax_forward
from _support import gradient_check

V, B, T = 11, 2, 7


def tiny(**overrides) -> MLAConfig:
    # d_k = 4, d_v = 3, d_R = 4, d_c = 6: every width distinct, so a mixed-up axis cannot pass.
    # init_std 0.25 keeps the gradient entries far above the finite differences' rounding noise.
    fields = dict(vocab_size=V, max_seq_len=8, d_model=16, n_layers=2, n_heads=2, d_c=6, d_rope=4,
                  head_dim=4, v_head_dim=3, ffn_multiple_of=8, init_std=0.25)
    return MLAConfig(**{**fields, **overrides})


def random_params(config, seed=0, dtype=np.float64):
    """``init_params`` with the norm gains moved away from 1, so their gradients are generic too."""
    params = mla.init_params(config, seed, dtype)
    rng = np.random.default_rng(seed + 1000)
    for name, value in params.items():
        if name.endswith(".gamma"):
            params[name] = (1.0 + 0.2 * rng.standard_normal(value.shape)).astype(dtype)
    return params


def random_batch(seed=0, t=T, ignored=True, prompt=0):
    """Tokens holding every id (every embedding row gets a gradient), one ignored target, and a
    loss mask hiding the first ``prompt`` positions when ``prompt > 0``."""
    rng = np.random.default_rng(seed)
    ids = np.concatenate([np.arange(V), rng.integers(0, V, max(B * t - V, 0))])[: B * t]
    batch = {"tokens": rng.permutation(ids).reshape(B, t), "targets": rng.integers(0, V, (B, t))}
    if ignored:
        batch["targets"][0, 2] = IGNORE_INDEX
    if prompt:
        mask = np.ones((B, t), dtype=np.int64)
        mask[:, :prompt] = 0
        batch["loss_mask"] = mask
    return batch


# ---- gradients -----------------------------------------------------------------------------------

# Query compression without the latent norms is the same code minus the norms; the torch test
# covers that combination too.
@pytest.mark.parametrize("overrides", [dict(), dict(q_lora_rank=5, latent_norm=True)],
                         ids=["queries from x", "query compression and latent norms"])
def test_every_parameter_gradient_check_m4(overrides):
    config = tiny(**overrides)
    errors = gradient_check(mla, random_params(config), random_batch(), config)
    assert max(errors.values()) < 1e-6, errors


def test_gradient_check_train_with_dropout_tied_head_latent_norm_and_loss_mask():
    config = tiny(dropout=0.25, tie_embeddings=True, latent_norm=True, n_layers=1)
    params, batch = random_params(config, seed=3), random_batch(seed=3, prompt=2)
    errors = gradient_check(mla, params, batch, config, train=True, seed=7)
    assert "lm_head" not in errors and "layers.0.attn.kv_norm.gamma" in errors
    assert max(errors.values()) < 1e-6, errors


def test_float32_parameters_give_float32_loss_and_gradients():
    config = tiny(q_lora_rank=5, latent_norm=True)
    p64 = random_params(config)
    p32 = {name: value.astype(np.float32) for name, value in p64.items()}
    batch = random_batch()
    loss64, cache64 = mla.forward(p64, batch, config)
    loss32, cache32 = mla.forward(p32, batch, config)
    grads64, grads32 = mla.backward(cache64), mla.backward(cache32)
    assert loss32.dtype == np.float32 and all(g.dtype == np.float32 for g in grads32.values())
    assert all(s.dtype == np.float32 for layer in mla.layer_latents(cache32) for s in layer)
    np.testing.assert_allclose(loss32, loss64, rtol=1e-5)
    for name in p64:
        np.testing.assert_allclose(grads32[name], grads64[name], rtol=2e-3, atol=2e-5, err_msg=name)


# ---- the attention itself: K8, K9 ---------------------------------------------------------------

def _layer0_input(params, batch, config):
    x = params["tok_emb"][batch["tokens"]]
    return rmsnorm_forward(x, params["layers.0.ln1.gamma"], config.norm_eps)[0]


def _heads(x, n):
    b, t, w = x.shape
    return x.reshape(b, t, n, w // n).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("overrides", [dict(), dict(q_lora_rank=5, latent_norm=True)],
                         ids=["queries from x", "query compression and latent norms"])
def test_scores_are_content_plus_shared_rotary_part_over_sqrt_dk_plus_dr_k8_k9(overrides):
    config = tiny(**overrides)
    params, batch = random_params(config), random_batch()
    _, cache = mla.forward(params, batch, config)
    p = {name[len("layers.0.attn."):]: v for name, v in params.items()
         if name.startswith("layers.0.attn.")}
    h, eps = config.n_heads, config.norm_eps
    x = _layer0_input(params, batch, config)
    # The latent, with its optional norm, and the rotary key shared by all heads: what is cached.
    c = x @ p["w_dkv"]
    if config.latent_norm:
        c = rmsnorm_forward(c, p["kv_norm.gamma"], eps)[0]
    k_r = rope_forward(x @ p["w_kr"])[0]
    cached_c, cached_k_r = mla.layer_latents(cache)[0]
    np.testing.assert_allclose(cached_c, c, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(cached_k_r, k_r, rtol=1e-13, atol=1e-15)
    assert cached_c.shape == (B, T, config.d_c) and cached_k_r.shape == (B, T, config.d_rope)
    # Queries, content and rotary, from x or from the (normalised) compressed query.
    u = x
    if config.q_lora_rank is not None:
        u = x @ p["w_dq"]
        if config.latent_norm:
            u = rmsnorm_forward(u, p["q_norm.gamma"], eps)[0]
    q_c = _heads(u @ p["w_q" if config.q_lora_rank is None else "w_uq"], h)
    q_r = rope_forward(_heads(u @ p["w_qr"], h))[0]
    k_c = _heads(c @ p["w_uk"], h)
    # K9: the two score terms summed, over sqrt(d_k + d_R); the rotary key broadcast over heads.
    content = q_c @ k_c.swapaxes(-1, -2)
    rotary = q_r @ k_r[:, None].swapaxes(-1, -2)
    s = (content + rotary) / math.sqrt(config.d_h + config.d_rope)
    s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
    attn = cache.layers[0].attn.branch.attn
    np.testing.assert_allclose(attn.a, softmax_forward(s)[0], rtol=1e-12, atol=1e-15)
    assert attn.scale == 1.0 / math.sqrt(config.d_h + config.d_rope)
    # K8: the content score through the absorbed query q^C W_UK^T against the cached latent.
    w_uk = p["w_uk"].reshape(config.d_c, h, config.d_h).transpose(1, 0, 2)  # (h, d_c, d_k)
    absorbed = (q_c @ w_uk.swapaxes(-1, -2)) @ cached_c[:, None].swapaxes(-1, -2)
    np.testing.assert_allclose(absorbed, content, rtol=1e-12, atol=1e-13)


def test_mla_cache_size_is_b_l_t_dc_plus_dr_bytes_k9():
    config = tiny(n_layers=3)
    params = mla.init_params(config, dtype=np.float32)
    _, cache = mla.forward(params, random_batch(), config)
    stored = sum(s.nbytes for layer in mla.layer_latents(cache) for s in layer)
    assert stored == B * config.n_layers * T * (config.d_c + config.d_rope) * 4


# ---- structure -----------------------------------------------------------------------------------

def test_parameter_names_shapes_and_weight_decay_groups():
    plain = mla.param_shapes(tiny())
    assert {k: v for k, v in plain.items() if k.startswith("layers.0.attn.")} == {
        "layers.0.attn.w_dkv": (16, 6), "layers.0.attn.w_uk": (6, 8), "layers.0.attn.w_uv": (6, 6),
        "layers.0.attn.w_kr": (16, 4), "layers.0.attn.w_q": (16, 8), "layers.0.attn.w_qr": (16, 8),
        "layers.0.attn.w_o": (6, 16)}
    compressed = mla.param_shapes(tiny(q_lora_rank=5, latent_norm=True))
    assert {k: v for k, v in compressed.items() if k.startswith("layers.1.attn.")} == {
        "layers.1.attn.w_dkv": (16, 6), "layers.1.attn.kv_norm.gamma": (6,),
        "layers.1.attn.w_uk": (6, 8), "layers.1.attn.w_uv": (6, 6), "layers.1.attn.w_kr": (16, 4),
        "layers.1.attn.w_dq": (16, 5), "layers.1.attn.q_norm.gamma": (5,),
        "layers.1.attn.w_uq": (5, 8), "layers.1.attn.w_qr": (5, 8), "layers.1.attn.w_o": (6, 16)}
    # The rest of the network is M3's.
    assert compressed["layers.1.ffn.w_gate"] == (16, 48) and "lm_head" in compressed
    params = mla.init_params(tiny(q_lora_rank=5, latent_norm=True))
    assert {k: v.shape for k, v in params.items()} == compressed
    no_decay = {name for name in params if not takes_weight_decay(name)}
    assert no_decay == {name for name in params if name.endswith("gamma")} | {"tok_emb"}
    np.testing.assert_array_equal(params["layers.0.attn.kv_norm.gamma"], np.ones(6))


def test_presets_and_defaults():
    config = mla.preset("tiny")
    assert (config.d_h, config.d_v, config.d_c, config.d_rope) == (16, 16, 32, 8)
    small = mla.preset("small")
    assert small.q_lora_rank == 384 and small.latent_norm and small.d_f == 2048
    with pytest.raises(ValueError, match="unknown preset"):
        mla.preset("v3")


@pytest.mark.parametrize("overrides", [dict(), dict(q_lora_rank=5, latent_norm=True)])
def test_appending_tokens_changes_no_earlier_logit_latent_or_rotary_key_k1(overrides):
    config = tiny(**overrides)
    params, batch = random_params(config), random_batch(ignored=False)
    _, full = mla.forward(params, batch, config)
    full_logits = mla.logits(params, batch["tokens"], config)
    rng = np.random.default_rng(9)
    for t in (1, 4, 6):
        other = batch["tokens"].copy()
        other[:, t:] = rng.integers(0, V, (B, T - t))
        for tokens in (batch["tokens"][:, :t], other):
            _, cache = mla.forward(params, {"tokens": tokens, "targets": tokens}, config)
            z = mla.logits(params, tokens, config)
            np.testing.assert_allclose(z[:, :t], full_logits[:, :t], rtol=1e-12, atol=1e-13)
            for (c, k_r), (c_full, k_r_full) in zip(mla.layer_latents(cache),
                                                    mla.layer_latents(full)):
                np.testing.assert_allclose(c[:, :t], c_full[:, :t], rtol=1e-12, atol=1e-13)
                np.testing.assert_allclose(k_r[:, :t], k_r_full[:, :t], rtol=1e-12, atol=1e-13)
    assert len(mla.layer_latents(full)) == config.n_layers


def test_loss_mask_removes_prompt_tokens_from_loss_and_gradient_l5():
    config = tiny(q_lora_rank=5)
    params = random_params(config)
    batch = random_batch(ignored=False, prompt=3)
    loss, cache = mla.forward(params, batch, config)
    grads = mla.backward(cache)
    logp, _ = log_softmax_forward(mla.logits(params, batch["tokens"], config))
    nll = -np.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(loss, nll[:, 3:].mean(), rtol=1e-13)
    changed = {**batch, "targets": batch["targets"].copy()}
    changed["targets"][:, :3] = (changed["targets"][:, :3] + 1) % V
    changed_loss, changed_cache = mla.forward(params, changed, config)
    changed_grads = mla.backward(changed_cache)
    assert changed_loss == loss
    for name in params:
        np.testing.assert_array_equal(changed_grads[name], grads[name])


# ---- configuration, batches, parameters ------------------------------------------------------------

@pytest.mark.parametrize("overrides, field", [
    (dict(d_rope=5), "d_rope"),  # odd: RoPE pairs coordinates
    (dict(d_rope=0), "d_rope"),
    (dict(d_c=0), "d_c"),
    (dict(q_lora_rank=0), "q_lora_rank"),
    (dict(head_dim=None, d_model=18, n_heads=4), "d_model"),
    (dict(v_head_dim=-2), "v_head_dim"),
    (dict(head_dim=2.5), "head_dim"),
    (dict(latent_norm="yes"), "latent_norm"),
    (dict(dropout=1.5), "dropout"),
    (dict(vocab_size=0), "vocab_size"),
])
def test_config_validation_names_the_field(overrides, field):
    # TypeError for a value of the wrong kind, ValueError for one out of range
    with pytest.raises((ValueError, TypeError), match=field):
        tiny(**overrides)


def test_config_round_trips_through_json_and_odd_content_widths_are_fine():
    config = tiny(q_lora_rank=5, latent_norm=True, head_dim=3, v_head_dim=5, dropout=0.1)
    assert MLAConfig(**json.loads(json.dumps(dataclasses.asdict(config)))) == config
    params = mla.init_params(config)  # only d_R is rotated, so d_k may be odd
    assert mla.logits(params, random_batch()["tokens"], config).shape == (B, T, V)


@pytest.mark.parametrize("change, error, match", [
    (dict(tokens=np.full((B, T), V)), ValueError, r"batch\['tokens'\] must lie in \[0, 11\)"),
    (dict(tokens=np.zeros((B, 9), dtype=int), targets=np.zeros((B, 9), dtype=int)), ValueError,
     "more than max_seq_len = 8"),
    (dict(targets=np.zeros((B, T + 1), dtype=int)), ValueError, r"batch\['targets'\] must have"),
    (dict(tokens=np.zeros((B, T), dtype=np.float32)), TypeError, "must be an integer"),
])
def test_bad_batches_raise_naming_the_key(change, error, match):
    config = tiny()
    with pytest.raises(error, match=match):
        mla.forward(mla.init_params(config), {**random_batch(), **change}, config)


def test_bad_params_and_config_type():
    config = tiny()
    params = mla.init_params(config)
    batch = random_batch()
    with pytest.raises(ValueError, match=r"missing \['layers.0.attn.w_dq'"):
        mla.forward(params, batch, tiny(q_lora_rank=5))
    with pytest.raises(TypeError, match="MLAConfig"):
        mla.forward(params, batch, dataclasses.asdict(config))
    with pytest.raises(TypeError, match="MLAConfig"):
        mla.init_params(dataclasses.asdict(config))


def test_latent_norm_eps_is_the_latent_norms_own():
    config = tiny(latent_norm=True, q_lora_rank=8, norm_eps=1e-5)
    params = mla.init_params(config, seed=2)
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, (1, 5))
    same = dataclasses.replace(config, latent_norm_eps=1e-5)  # None means norm_eps
    np.testing.assert_array_equal(mla.logits(params, tokens, same), mla.logits(params, tokens, config))
    other = dataclasses.replace(config, latent_norm_eps=0.5)
    assert not np.allclose(mla.logits(params, tokens, other), mla.logits(params, tokens, config))
    with pytest.raises(ValueError, match=r"MLAConfig.latent_norm_eps must be a finite number > 0"):
        dataclasses.replace(config, latent_norm_eps=0.0)
