"""The M3 decoder: gradients of every parameter, L5, K1, RoPE placement, config and batch checks
(L6 for every model is test_model_properties.py's).

The PyTorch comparison lives in test_decoder_torch.py.
"""
import dataclasses
import json
import math

import numpy as np
import pytest

from refmath.models import decoder
from refmath.models.decoder import IGNORE_INDEX, DecoderConfig
from refmath.norms import rmsnorm_forward
from refmath.optim import takes_weight_decay
from refmath.positions import rope_forward
from refmath.softmax import log_softmax_forward
from _support import float32_rule, gradient_check

V, B, T = 11, 2, 7


def tiny(**overrides) -> DecoderConfig:
    # init_std 0.25 (about 1/sqrt(d)) instead of 0.02 keeps every gradient entry far above the
    # ~1e-12 rounding noise of the finite differences, so the relative errors mean something.
    fields = dict(vocab_size=V, max_seq_len=8, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                  ffn_multiple_of=8, init_std=0.25)
    return DecoderConfig(**{**fields, **overrides})


def random_params(model, config, seed=0, dtype=np.float64):
    """``init_params`` with the norm gains moved away from 1, so their gradients are generic too."""
    params = model.init_params(config, seed, dtype)
    rng = np.random.default_rng(seed + 1000)
    for name, value in params.items():
        if name.endswith(".gamma"):
            params[name] = (1.0 + 0.2 * rng.standard_normal(value.shape)).astype(dtype)
    return params


def random_batch(seed=0, t=T, ignored=True, prompt=0):
    """Tokens holding every id at least once (so every embedding row has a gradient), targets with
    one ignored entry, and a loss mask hiding the first ``prompt`` positions when ``prompt > 0``."""
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

@pytest.mark.parametrize("kv_heads, head_dim", [(4, None), (2, None), (1, 6)],
                         ids=["MHA g=h=4", "GQA g=2 of h=4", "MQA g=1, head_dim 6 != d/h"])
def test_every_parameter_gradient_check_m3_a10(kv_heads, head_dim):
    config = tiny(n_kv_heads=kv_heads, head_dim=head_dim)
    errors = gradient_check(decoder, random_params(decoder, config), random_batch(), config)
    assert max(errors.values()) < 1e-6, errors


def test_gradient_check_train_with_dropout_tied_head_and_loss_mask():
    config = tiny(dropout=0.25, tie_embeddings=True)
    params, batch = random_params(decoder, config, seed=3), random_batch(seed=3, prompt=2)
    errors = gradient_check(decoder, params, batch, config, train=True, seed=7)
    assert "lm_head" not in errors
    assert max(errors.values()) < 1e-6, errors
    # The masks really drop units, and the evaluation mode ignores dropout altogether.
    _, cache = decoder.forward(params, batch, config, train=True, rng=np.random.default_rng(7))
    drop = cache.layers[0].attn.drop
    assert set(np.unique(drop)) == {0.0, 1.0 / 0.75}
    loss_eval, cache_eval = decoder.forward(params, batch, config)
    loss_plain, _ = decoder.forward(params, batch, dataclasses.replace(config, dropout=0.0))
    assert cache_eval.layers[0].attn.drop is None
    assert loss_eval == loss_plain


def test_float32_parameters_give_float32_loss_and_gradients():
    config = tiny()
    p64 = random_params(decoder, config)
    p32 = {name: value.astype(np.float32) for name, value in p64.items()}
    batch = random_batch()
    loss64, cache64 = decoder.forward(p64, batch, config)
    loss32, cache32 = decoder.forward(p32, batch, config)
    grads64, grads32 = decoder.backward(cache64), decoder.backward(cache32)
    assert loss32.dtype == np.float32
    assert all(g.dtype == np.float32 for g in grads32.values())
    assert decoder.logits(p32, batch["tokens"], config).dtype == np.float32
    np.testing.assert_allclose(loss32, loss64, rtol=1e-5)
    for name in p64:
        np.testing.assert_allclose(grads32[name], grads64[name], rtol=2e-3, atol=2e-5, err_msg=name)


# ---- structure: parameters, init, RoPE placement, SwiGLU width ------------------------------------

def test_parameter_names_shapes_and_weight_decay_groups():
    config = tiny(n_kv_heads=1)
    params = decoder.init_params(config)
    shapes = decoder.param_shapes(config)
    assert list(params) == list(shapes)
    assert {name: p.shape for name, p in params.items()} == shapes
    d_f = config.d_f
    assert shapes["layers.1.attn.w_q"] == (16, 16) and shapes["layers.1.attn.w_k"] == (16, 4)
    assert shapes["layers.0.ffn.w_gate"] == (16, d_f) and shapes["layers.0.ffn.w_down"] == (d_f, 16)
    assert shapes["lm_head"] == (16, V)
    # No biases anywhere; norm gains and the embedding are exempt from weight decay (O5).
    assert not any(name.split(".")[-1].startswith("b") for name in params)
    no_decay = {name for name in params if not takes_weight_decay(name)}
    assert no_decay == {"tok_emb", "ln_f.gamma"} | {f"layers.{i}.ln{j}.gamma"
                                                   for i in range(2) for j in (1, 2)}
    assert "lm_head" not in decoder.init_params(tiny(tie_embeddings=True))


def test_init_is_normal_002_with_residual_outputs_scaled_n11():
    config = decoder.preset("tiny", n_layers=4)
    params = decoder.init_params(config, seed=5)
    # 16k and 4k draws: the sample std lies within a few percent of the true one.
    np.testing.assert_allclose(params["tok_emb"].std(), 0.02, rtol=0.05)
    np.testing.assert_allclose(params["layers.0.attn.w_q"].std(), 0.02, rtol=0.05)
    for name in ("layers.3.attn.w_o", "layers.2.ffn.w_down"):
        np.testing.assert_allclose(params[name].std(), 0.02 / math.sqrt(8), rtol=0.05)
    assert np.all(params["layers.1.ln2.gamma"] == 1.0) and np.all(params["ln_f.gamma"] == 1.0)
    p32 = decoder.init_params(config, seed=5, dtype=np.float32)
    assert all(p32[n].dtype == np.float32 and np.array_equal(p32[n], params[n].astype(np.float32))
               for n in params)
    assert all(np.array_equal(params[n], decoder.init_params(config, seed=5)[n]) for n in params)
    with pytest.raises(TypeError, match="dtype"):
        decoder.init_params(config, dtype=np.int32)


def test_rope_rotates_queries_and_keys_but_not_values_n10():
    config = tiny()
    params, batch = random_params(decoder, config), random_batch()
    _, cache = decoder.forward(params, batch, config)
    # Recompute layer 0's projections by hand from the embedding.
    h, _ = rmsnorm_forward(params["tok_emb"][batch["tokens"]], params["layers.0.ln1.gamma"],
                           config.norm_eps)

    def heads(w, n):
        return (h @ params[f"layers.0.attn.{w}"]).reshape(B, T, n, 4).transpose(0, 2, 1, 3)

    k, v = decoder.layer_kv(cache)[0]
    np.testing.assert_allclose(k, rope_forward(heads("w_k", 2))[0], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(v, heads("w_v", 2), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(cache.layers[0].attn.branch.attn.saved.q, rope_forward(heads("w_q", 4))[0],
                               rtol=1e-13, atol=1e-15)
    assert not np.allclose(k, heads("w_k", 2))  # the rotation did something


def test_swiglu_width_is_8d_over_3_rounded_up_n7():
    assert tiny().d_f == 48  # 8 * 16 / 3 = 42.7, rounded up to a multiple of 8
    assert tiny(ffn_multiple_of=1).d_f == 43
    assert tiny(d_ff=20).d_f == 20
    assert decoder.preset("llama-small").d_f == 2048  # 8 * 768 / 3 = 2048 exactly


def test_presets_are_valid_configs():
    small = decoder.preset("llama-small")
    assert (small.n_heads, small.kv_heads, small.d_h) == (12, 4, 64)
    n_params = sum(math.prod(s) for s in decoder.param_shapes(small).values())
    assert 120e6 < n_params < 130e6  # "about 125M", as the preset's comment says
    assert decoder.preset("tiny", n_kv_heads=1).kv_heads == 1
    with pytest.raises(ValueError, match="unknown preset"):
        decoder.preset("huge")


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_appending_tokens_changes_no_earlier_logit_or_cached_k_v_k1(kv_heads):
    config = tiny(n_kv_heads=kv_heads)
    params, batch = random_params(decoder, config), random_batch(ignored=False)
    _, full = decoder.forward(params, batch, config)
    full_logits = decoder.logits(params, batch["tokens"], config)
    rng = np.random.default_rng(9)
    for t in (1, 3, 6):
        # Truncate, and also replace everything after position t with other tokens.
        other = batch["tokens"].copy()
        other[:, t:] = rng.integers(0, V, (B, T - t))
        for tokens in (batch["tokens"][:, :t], other):
            _, cache = decoder.forward(params, {"tokens": tokens, "targets": tokens}, config)
            z = decoder.logits(params, tokens, config)
            np.testing.assert_allclose(z[:, :t], full_logits[:, :t], rtol=1e-12, atol=1e-13)
            for (k, v), (k_full, v_full) in zip(decoder.layer_kv(cache), decoder.layer_kv(full)):
                assert k.shape[1] == kv_heads
                np.testing.assert_allclose(k[:, :, :t], k_full[:, :, :t], rtol=1e-12, atol=1e-13)
                np.testing.assert_allclose(v[:, :, :t], v_full[:, :, :t], rtol=1e-12, atol=1e-13)
    assert len(decoder.layer_kv(full)) == config.n_layers


def test_loss_mask_removes_prompt_tokens_from_loss_and_gradient_l5():
    config = tiny()
    params = random_params(decoder, config)
    batch = random_batch(ignored=False, prompt=3)
    loss, cache = decoder.forward(params, batch, config)
    grads = decoder.backward(cache)
    # The loss is the mean over answer tokens of -log p(target), read off the logits.
    logp, _ = log_softmax_forward(decoder.logits(params, batch["tokens"], config))
    nll = -np.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(loss, nll[:, 3:].mean(), rtol=1e-13)
    # The same as ignoring the prompt's targets, and blind to what those targets are.
    ignored = {"tokens": batch["tokens"], "targets": batch["targets"].copy()}
    ignored["targets"][:, :3] = IGNORE_INDEX
    changed = {**batch, "targets": batch["targets"].copy()}
    changed["targets"][:, :3] = (changed["targets"][:, :3] + 1) % V
    for other in (ignored, changed):
        other_loss, other_cache = decoder.forward(params, other, config)
        other_grads = decoder.backward(other_cache)
        assert other_loss == loss
        for name in params:
            np.testing.assert_array_equal(other_grads[name], grads[name])
    # Unmasked, the prompt tokens do count.
    assert decoder.forward(params, {"tokens": batch["tokens"], "targets": batch["targets"]},
                           config)[0] != loss


# ---- configuration, batches, parameters ------------------------------------------------------------

@pytest.mark.parametrize("overrides, field", [
    (dict(n_kv_heads=3), "n_kv_heads"),  # 3 does not divide 4
    (dict(head_dim=5), "head_dim"),  # odd: RoPE pairs coordinates
    (dict(d_model=12, n_heads=4, n_kv_heads=4), "d_model // n_heads"),  # d_h = 3 is odd
    (dict(d_model=18, n_kv_heads=4), "d_model"),  # 18 not divisible by 4 heads
    (dict(vocab_size=0), "vocab_size"),
    (dict(max_seq_len=-1), "max_seq_len"),
    (dict(n_layers=2.0), "n_layers"),
    (dict(n_heads=True), "n_heads"),
    (dict(n_kv_heads=3), "n_kv_heads"),  # does not divide the 4 query heads
    (dict(d_ff=0), "d_ff"),
    (dict(ffn_multiple_of=0), "ffn_multiple_of"),
    (dict(dropout=1.0), "dropout"),
    (dict(dropout=-0.1), "dropout"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(rope_base=1.0), "rope_base"),
    (dict(init_std=float("nan")), "init_std"),
    (dict(tie_embeddings=1), "tie_embeddings"),
])
def test_config_validation_names_the_field(overrides, field):
    # TypeError for a value of the wrong kind (2.0, True, 1), ValueError for one out of range
    with pytest.raises((ValueError, TypeError), match=field.replace("(", r"\(")):
        tiny(**overrides)


def test_config_stores_plain_python_numbers():
    config = tiny(n_kv_heads=np.int64(2), dropout=np.float32(0.25))
    assert type(config.n_kv_heads) is int and type(config.dropout) is float
    assert json.loads(json.dumps(dataclasses.asdict(config)))["n_kv_heads"] == 2


def test_config_round_trips_through_json():
    config = tiny(n_kv_heads=1, head_dim=6, d_ff=20, tie_embeddings=True, dropout=0.1)
    assert DecoderConfig(**json.loads(json.dumps(dataclasses.asdict(config)))) == config
    config = tiny(qk_norm="head", sliding_window=3, window_layers=(True, False))
    assert DecoderConfig(**json.loads(json.dumps(dataclasses.asdict(config)))) == config


def _batch_with(**changes):
    batch = random_batch()
    batch.update(changes)
    return {k: v for k, v in batch.items() if v is not None}


@pytest.mark.parametrize("batch, error, match", [
    ([1, 2, 3], TypeError, "batch must be a dict"),
    (_batch_with(tokens=None), ValueError, "missing 'tokens'"),
    (_batch_with(targets=None), ValueError, "missing 'targets'"),
    (_batch_with(mask=np.ones((B, T))), ValueError, r"unexpected keys \['mask'\]"),
    (_batch_with(tokens=np.zeros((B, T))), TypeError, r"batch\['tokens'\] must be an integer"),
    (_batch_with(tokens=np.full((B, T), V)), ValueError, r"batch\['tokens'\] must lie in \[0, 11\)"),
    (_batch_with(tokens=np.zeros(T, dtype=int)), ValueError, r"batch\['tokens'\] must have 2"),
    (_batch_with(tokens=np.zeros((B, 0), dtype=int), targets=np.zeros((B, 0), dtype=int)),
     ValueError, "at least one token"),
    (_batch_with(tokens=np.zeros((B, 9), dtype=int), targets=np.zeros((B, 9), dtype=int)),
     ValueError, "more than max_seq_len = 8"),
    (_batch_with(targets=np.zeros((B, T - 1), dtype=int)), ValueError,
     r"batch\['targets'\] must have"),
    (_batch_with(targets=np.zeros((B, T))), TypeError, r"batch\['targets'\] must be an integer"),
    (_batch_with(targets=np.full((B, T), -1)), ValueError, r"or equal -100"),
    (_batch_with(loss_mask=np.ones((B, T + 1))), ValueError, r"batch\['loss_mask'\] must have"),
    (_batch_with(loss_mask=np.full((B, T), 2)), ValueError, "only 0 and 1"),
])
def test_bad_batches_raise_naming_the_key(batch, error, match):
    config = tiny()
    with pytest.raises(error, match=match):
        decoder.forward(decoder.init_params(config), batch, config)


def test_bad_params_config_and_rng():
    config = tiny()
    params, batch = decoder.init_params(config), random_batch()
    missing = {k: v for k, v in params.items() if k != "layers.1.ffn.w_up"}
    with pytest.raises(ValueError, match=r"missing \['layers.1.ffn.w_up'\]"):
        decoder.forward(missing, batch, config)
    with pytest.raises(ValueError, match=r"unexpected \['lm_head'\]"):
        decoder.forward(params, batch, tiny(tie_embeddings=True))
    with pytest.raises(ValueError, match=r"params\['layers.0.attn.w_k'\] must have shape \(16, 8\)"):
        decoder.forward({**params, "layers.0.attn.w_k": np.zeros((16, 4))}, batch, config)
    with pytest.raises(TypeError, match="same dtype"):
        decoder.forward({**params, "tok_emb": params["tok_emb"].astype(np.float32)}, batch, config)
    with pytest.raises(TypeError, match="DecoderConfig"):
        decoder.forward(params, batch, dataclasses.asdict(config))
    with pytest.raises(ValueError, match=r"tokens must have 2 dimensions"):
        decoder.logits(params, batch["tokens"][0], config)
    dropout = tiny(dropout=0.1)
    with pytest.raises(ValueError, match="needs rng"):
        decoder.forward(params, batch, dropout, train=True)
    with pytest.raises(TypeError, match="Generator"):
        decoder.forward(params, batch, dropout, train=True, rng=0)
    loss, cache = decoder.forward(params, batch, config)
    with pytest.raises(ValueError, match="no loss"):
        decoder.backward(cache._replace(loss=None))


def test_half_rope_layout_is_the_same_model_with_permuted_query_and_key_columns():
    # Hugging Face's Llama pairs (x_r, x_{r + d_h/2}); refmath's default pairs (x_2r, x_2r+1).
    # Permuting each head's query and key columns maps one onto the other: same logits.
    config = tiny(n_kv_heads=2, head_dim=6)
    params = decoder.init_params(config, seed=3)
    d_h = config.d_h
    perm = np.concatenate([np.arange(0, d_h, 2), np.arange(1, d_h, 2)])
    half_params = dict(params)
    for layer in range(config.n_layers):
        for name, heads in (("w_q", config.n_heads), ("w_k", config.kv_heads)):
            key = f"layers.{layer}.attn.{name}"
            columns = (np.arange(heads)[:, None] * d_h + perm[None, :]).ravel()
            half_params[key] = params[key][:, columns]
    half = dataclasses.replace(config, rope_layout="half")
    tokens = np.random.default_rng(4).integers(0, config.vocab_size, (2, 7))
    np.testing.assert_allclose(decoder.logits(half_params, tokens, half),
                               decoder.logits(params, tokens, config), rtol=1e-12, atol=1e-12)
    assert not np.allclose(decoder.logits(params, tokens, half), decoder.logits(params, tokens, config))


@pytest.mark.skipif(not __import__("refmath.kernels").kernels.cpu_available(),
                    reason="the C++ module refmath._C is not built")
@pytest.mark.parametrize("window", [None, 3])
def test_the_flash_kernel_backend_gives_the_reference_loss_and_gradients(window):
    # float32 through the FlashAttention kernel against float32 through NumPy, both against the
    # float64 model: the kernel's error is at most twice NumPy's plus a few float32 ulps, with a
    # sliding window too (the kernel's own, forward and backward).
    config = tiny(n_kv_heads=2, sliding_window=window)
    params64, batch = random_params(decoder, config), random_batch()
    params32 = {k: v.astype(np.float32) for k, v in params64.items()}
    loss64, cache64 = decoder.forward(params64, batch, config)
    grads64 = decoder.backward(cache64)
    runs = {}
    for backend in ("numpy", "cpu"):
        run_config = dataclasses.replace(config, attention_backend=backend)
        loss, cache = decoder.forward(params32, batch, run_config)
        assert cache.layers[0].attn.branch.attn.backend == backend
        runs[backend] = (loss, decoder.backward(cache))
    u32 = np.finfo(np.float32).eps
    for name in ["loss", *grads64]:
        ref = loss64 if name == "loss" else grads64[name]
        got = {b: (r[0] if name == "loss" else r[1][name]).astype(np.float64) for b, r in runs.items()}
        float32_rule(name, got["cpu"], ref, got["numpy"], 2, 4 * u32 * np.abs(ref).max())
    with pytest.raises(ValueError, match="attention_backend must be one of 'numpy', 'cpu'"):
        tiny(attention_backend="cuda")


# ---- the other block shapes are their files': the parallel block test_falcon.py's, OLMo 2's norms
# test_olmo2.py's, Gemma's sandwich norms test_gemma.py's

@pytest.mark.parametrize("overrides, message", [
    (dict(pre_norms=False), "pre_norms"),
    (dict(qk_norm="projection"), "qk_norm"),
    (dict(ffn_activation="gelu_tanh"), "ffn_activation"),
    (dict(sandwich_norms=True), "sandwich_norms"),
    (dict(norm_offset=1.0), "norm_offset"),
    (dict(parallel_block=True), "parallel_block"),
    (dict(norm="layernorm"), "norm"),
])
def test_block_options_are_checked_naming_the_field(overrides, message):
    with pytest.raises((ValueError, TypeError), match=message):
        tiny(**overrides)


def test_a_layers_feed_forward_is_one_component_chosen_once_e1_n7():
    # Qwen2-MoE's shape: the first layer dense, the others a mixture of experts. The layer takes
    # the component's shapes, forward and backward, and its auxiliary loss joins the model's.
    config = DecoderConfig(vocab_size=11, max_seq_len=8, d_model=16, n_layers=2, n_heads=4,
                           n_kv_heads=2, ffn_multiple_of=8, moe=dict(
                               n_experts=4, top_k=2, d_expert=8, first_dense=1, balance_coef=0.05))
    dense, mixture = decoder.feed_forward(config, 0), decoder.feed_forward(config, 1)
    assert (dense.name, mixture.name) == ("swiglu", "moe")
    shapes = decoder.param_shapes(config)
    for i, component in enumerate((dense, mixture)):
        assert {name: shape for name, shape in shapes.items()
                if name.startswith(f"layers.{i}.ffn.")} == {
            f"layers.{i}.ffn.{name}": shape for name, shape in component.shapes.items()}
    params = decoder.init_params(config, seed=0)
    tokens = np.arange(10).reshape(2, 5)
    loss, cache = decoder.forward(params, {"tokens": tokens, "targets": tokens}, config)
    assert [layer.feed_forward.name for layer in cache.layers] == ["swiglu", "moe"]
    assert cache.layers[0].feed_forward.aux_loss(cache.layers[0].ffn.branch) == 0.0
    aux = cache.layers[1].ffn.branch.aux_loss
    assert aux > 0 and decoder.moe_aux_loss(cache) == float(aux)
    assert list(decoder.expert_loads(cache)) == [1]
