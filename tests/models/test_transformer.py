"""The original encoder-decoder Transformer (catalogue M1): gradients, the shifted target (L1),
parallel training versus prefix decoding (L6), prefix invariance (K1), padding, config and batch
checks. The PyTorch comparison is in test_transformer_torch.py."""
import dataclasses
import json

import numpy as np
import pytest

from refmath.gradcheck import numerical_gradient, relative_error
from refmath.models import transformer as tm
from refmath.optim import takes_weight_decay

VOCAB = 13  # TRANSFORMER_TINY's; ids 0 (pad) and 1 (BOS) are special, real tokens are 2..12


def config(**changes):
    return dataclasses.replace(tm.TRANSFORMER_TINY, **changes)


def kink_free_params(cfg, seed=0):
    """Parameters with non-trivial norm gains and shifts, and every ReLU input kept far from 0.

    ``b1 = +-1`` with a shrunk ``W_1`` puts each FFN pre-activation near +1 or -1, so that the
    finite differences (steps up to 2e-3) never move one across the kink; the tests assert the
    margin on the actual forward pass.
    """
    params = tm.init_params(cfg, seed)
    rng = np.random.default_rng(seed + 1000)
    for name, value in params.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("gamma", "beta", "b2"):
            value += 0.2 * rng.standard_normal(value.shape)
        elif leaf == "b1":
            value[:] = rng.choice([-1.0, 1.0], size=value.shape)
        elif leaf == "w1":
            value *= 0.25
    return params


def make_batch(seed=0, b=2, s=6, t=5, src_lengths=(6, 4), tgt_lengths=None):
    rng = np.random.default_rng(seed)
    batch = {"src": rng.integers(2, VOCAB, (b, s)), "src_lengths": np.array(src_lengths),
             "tgt": rng.integers(2, VOCAB, (b, t))}
    if tgt_lengths is not None:
        batch["tgt_lengths"] = np.array(tgt_lengths)
    return batch


def relu_margin(params, cache):
    """The smallest |ReLU input| over every FFN of the forward pass that made ``cache``."""
    margins = []
    for stack, stack_cache in (("encoder", cache.encoder), ("decoder", cache.decoder)):
        for i, layer in enumerate(stack_cache.layers):
            first = layer.ffn.ffn.first
            margins.append(np.abs(first.x @ first.w + params[f"{stack}.layers.{i}.ffn.b1"]).min())
    return min(margins)


def dropout_masks(cache):
    """Every dropout mask of a forward pass, in the order they were drawn."""
    masks = [cache.encoder.embed.dropout_mask]
    for layer in cache.encoder.layers:
        masks += [layer.self_attn.mha.attn.dropout_mask, layer.self_attn.dropout_mask,
                  layer.ffn.dropout_mask]
    masks.append(cache.decoder.embed.dropout_mask)
    for layer in cache.decoder.layers:
        for sub in (layer.self_attn, layer.cross_attn):
            masks += [sub.mha.attn.dropout_mask, sub.dropout_mask]
        masks.append(layer.ffn.dropout_mask)
    return masks


# ---- gradients -----------------------------------------------------------------------------------

@pytest.mark.parametrize("tie, train", [(True, True), (False, False)], ids=["tied-train", "untied-eval"])
def test_every_parameter_matches_central_differences(tie, train):
    cfg = config(tie_embeddings=tie, dropout=0.2)
    params = kink_free_params(cfg)
    # target padding by length and by pad_id, and a padded source: every path is exercised
    batch = make_batch(tgt_lengths=(5, 4))
    batch["tgt"][1, 2] = cfg.pad_id

    def phi():
        # the same seed gives the same dropout masks in every evaluation
        return float(tm.forward(params, batch, cfg, train=train, rng=7)[0])

    loss, cache = tm.forward(params, batch, cfg, train=train, rng=7)
    grads = tm.backward(cache)
    assert list(grads) == list(params)
    assert relu_margin(params, cache) > 0.1
    masks = dropout_masks(cache)
    if train:
        assert all(m is not None for m in masks) and any((m == 0).any() for m in masks)
    else:
        assert all(m is None for m in masks)

    rng = np.random.default_rng(3)
    worst = {}
    for name, value in params.items():
        assert grads[name].shape == value.shape and grads[name].dtype == np.float64
        # 4 coordinates per tensor in each of the two runs keeps the file fast on 2 cores
        coords = rng.choice(value.size, size=min(4, value.size), replace=False)
        numeric = numerical_gradient(phi, value, coords)
        worst[name] = relative_error(grads[name].reshape(-1)[coords], numeric).max()
    assert max(worst.values()) < 1e-6, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
    assert float(loss) == phi()  # the checks left params as they found them


def test_float32_in_float32_out():
    cfg = config()
    params64 = kink_free_params(cfg)
    params32 = {k: v.astype(np.float32) for k, v in params64.items()}
    batch = make_batch()
    loss32, cache = tm.forward(params32, batch, cfg, train=True, rng=0)
    grads32 = tm.backward(cache)
    loss64, _ = tm.forward(params64, batch, cfg, train=True, rng=0)
    assert loss32.dtype == np.float32
    assert all(g.dtype == np.float32 for g in grads32.values())
    assert tm.logits(params32, batch["src"], batch["src_lengths"], batch["tgt"], cfg).dtype == np.float32
    # float32 rounding (~6e-8 per op) over a few hundred operations
    np.testing.assert_allclose(loss32, loss64, rtol=1e-5)


# ---- the shifted target (L1) and the loss --------------------------------------------------------

def test_shift_right_prepends_bos_and_drops_the_last_token():
    np.testing.assert_array_equal(tm.shift_right(np.array([[5, 6, 7], [8, 9, 10]]), 1),
                                  [[1, 5, 6], [1, 8, 9]])
    np.testing.assert_array_equal(tm.shift_right(np.array([[4]]), 3), [[3]])


def smoothed_ce(z, targets, counted, eps):
    """Mean of -(1-eps) log p[y] - eps/V sum_v log p[v] over the counted positions, from scratch."""
    logp = z - z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    per_token = (1 - eps) * nll - eps * logp.mean(-1)
    return per_token[counted].sum() / counted.sum()


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_loss_is_the_smoothed_cross_entropy_of_the_shifted_decoder_input(eps):
    cfg = config(label_smoothing=eps)
    params = kink_free_params(cfg)
    batch = make_batch(tgt_lengths=(5, 3))
    batch["tgt"][0, 1] = cfg.pad_id
    loss, cache = tm.forward(params, batch, cfg)
    np.testing.assert_array_equal(cache.decoder.embed.emb.ids, tm.shift_right(batch["tgt"], cfg.bos_id))
    z = tm.logits(params, batch["src"], batch["src_lengths"], tm.shift_right(batch["tgt"], 1), cfg)
    counted = np.array([[1, 0, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=bool)
    np.testing.assert_allclose(loss, smoothed_ce(z, batch["tgt"], counted, eps), rtol=1e-13)


# ---- L6 and K1 -----------------------------------------------------------------------------------

def test_parallel_loss_equals_prefix_by_prefix_decoding_l6():
    cfg = config()
    params = kink_free_params(cfg)
    batch = make_batch(t=6, tgt_lengths=(6, 4))
    loss, _ = tm.forward(params, batch, cfg)
    memory = tm.encode(params, batch["src"], batch["src_lengths"], cfg)
    dec_in = tm.shift_right(batch["tgt"], cfg.bos_id)
    # position t sees only (BOS, y_1..y_t): run that prefix alone and keep its last row
    last_rows = [tm.decode(params, memory, batch["src_lengths"], dec_in[:, :t + 1], cfg)[:, -1]
                 for t in range(dec_in.shape[1])]
    z = np.stack(last_rows, axis=1)
    counted = np.arange(6)[None, :] < batch["tgt_lengths"][:, None]
    np.testing.assert_allclose(loss, smoothed_ce(z, batch["tgt"], counted, cfg.label_smoothing),
                               rtol=1e-12)


def test_appending_target_tokens_changes_no_earlier_logits_keys_or_values_k1():
    cfg = config()
    params = kink_free_params(cfg)
    batch = make_batch(t=7)
    full = tm.logits(params, batch["src"], batch["src_lengths"], batch["tgt"], cfg)
    _, full_cache = tm.forward(params, batch, cfg)
    for t in (1, 3, 6):
        prefix = tm.logits(params, batch["src"], batch["src_lengths"], batch["tgt"][:, :t], cfg)
        np.testing.assert_allclose(prefix, full[:, :t], rtol=1e-12, atol=1e-14)
        _, cache = tm.forward(params, {**batch, "tgt": batch["tgt"][:, :t]}, cfg)
        for short, long in zip(cache.decoder.layers, full_cache.decoder.layers):
            for a, b in ((short.self_attn.mha.attn.k, long.self_attn.mha.attn.k),
                         (short.self_attn.mha.attn.v, long.self_attn.mha.attn.v)):
                np.testing.assert_allclose(a, b[:, :, :t], rtol=1e-12, atol=1e-14)


# ---- padding -------------------------------------------------------------------------------------

@pytest.mark.parametrize("train", [False, True])
def test_padded_source_tokens_change_nothing(train):
    cfg = config()
    params = kink_free_params(cfg)
    batch = make_batch(src_lengths=(6, 3))
    other = {**batch, "src": batch["src"].copy()}
    other["src"][1, 3:] = (batch["src"][1, 3:] + 5) % VOCAB
    loss_a, cache_a = tm.forward(params, batch, cfg, train=train, rng=5)
    loss_b, cache_b = tm.forward(params, other, cfg, train=train, rng=5)
    grads_a, grads_b = tm.backward(cache_a), tm.backward(cache_b)
    # a padded source row reaches nothing: masked keys get weight exactly 0 and gradient exactly 0
    assert loss_a == loss_b
    for name in params:
        np.testing.assert_array_equal(grads_a[name], grads_b[name], err_msg=name)
    np.testing.assert_array_equal(
        tm.logits(params, batch["src"], batch["src_lengths"], batch["tgt"], cfg),
        tm.logits(params, other["src"], other["src_lengths"], other["tgt"], cfg))


def test_target_padding_by_pad_id_or_by_length_is_the_same_and_its_tokens_are_inert():
    pad_cfg, len_cfg = config(), config(pad_id=None)
    params = kink_free_params(pad_cfg)
    batch = make_batch()
    batch["tgt"][0, 3:] = pad_cfg.pad_id
    batch["tgt"][1, 4:] = pad_cfg.pad_id
    by_pad = tm.forward(params, batch, pad_cfg, train=True, rng=2)
    by_length = tm.forward(params, {**batch, "tgt_lengths": np.array([3, 4])}, len_cfg,
                           train=True, rng=2)
    # with lengths the padded tokens may be anything
    noisy = {**batch, "tgt": batch["tgt"].copy(), "tgt_lengths": np.array([3, 4])}
    noisy["tgt"][0, 3:] = [7, 9]
    noisy["tgt"][1, 4:] = 11
    by_noisy_length = tm.forward(params, noisy, len_cfg, train=True, rng=2)
    reference = tm.backward(by_pad[1])
    for loss, cache in (by_length, by_noisy_length):
        assert loss == by_pad[0]
        grads = tm.backward(cache)
        for name in params:
            np.testing.assert_array_equal(grads[name], reference[name], err_msg=name)


def test_a_fully_padded_target_row_counts_nothing():
    cfg = config(label_smoothing=0.0)
    params = kink_free_params(cfg)
    batch = make_batch(tgt_lengths=(5, 0))
    loss, _ = tm.forward(params, batch, cfg)
    z = tm.logits(params, batch["src"], batch["src_lengths"], tm.shift_right(batch["tgt"], 1), cfg)
    counted = np.array([[True] * 5, [False] * 5])
    np.testing.assert_allclose(loss, smoothed_ce(z, batch["tgt"], counted, 0.0), rtol=1e-13)


# ---- dropout -------------------------------------------------------------------------------------

def test_dropout_only_in_train_mode_and_reproducible_from_the_seed():
    cfg = config(dropout=0.3)
    params = kink_free_params(cfg)
    batch = make_batch()
    eval_loss, _ = tm.forward(params, batch, cfg, rng=1)
    assert tm.forward(params, batch, cfg, train=False, rng=2)[0] == eval_loss
    assert tm.forward(params, batch, config(dropout=0.0), train=True, rng=1)[0] == eval_loss
    a = tm.forward(params, batch, cfg, train=True, rng=1)[0]
    assert a == tm.forward(params, batch, cfg, train=True, rng=np.random.default_rng(1))[0]
    assert a != eval_loss and a != tm.forward(params, batch, cfg, train=True, rng=9)[0]


def test_dropout_masks_are_zero_or_the_inverse_keep_rate():
    cfg = config(dropout=0.25)
    _, cache = tm.forward(kink_free_params(cfg), make_batch(), cfg, train=True, rng=0)
    values = np.concatenate([m.ravel() for m in dropout_masks(cache)])
    assert set(np.unique(values)) == {0.0, 1.0 / 0.75}
    assert abs((values == 0).mean() - 0.25) < 0.05  # about 3000 draws


# ---- parameters and configuration ----------------------------------------------------------------

def test_tying_removes_lm_head_and_uses_the_unscaled_table():
    tied, untied = config(), config(tie_embeddings=False)
    assert "lm_head" not in tm.param_shapes(tied)
    assert tm.param_shapes(untied)["lm_head"] == (16, VOCAB)
    params = kink_free_params(tied)
    batch = make_batch()
    with_head = {**params, "lm_head": params["tok_emb"].T.copy()}
    # an untied model whose output matrix equals E^T computes the same logits
    np.testing.assert_array_equal(
        tm.logits(params, batch["src"], batch["src_lengths"], batch["tgt"], tied),
        tm.logits(with_head, batch["src"], batch["src_lengths"], batch["tgt"], untied))
    # and the tied gradient of E is the untied one plus lm_head's gradient transposed
    g_tied = tm.backward(tm.forward(params, batch, tied)[1])
    g_untied = tm.backward(tm.forward(with_head, batch, untied)[1])
    np.testing.assert_allclose(g_tied["tok_emb"], g_untied["tok_emb"] + g_untied["lm_head"].T,
                               rtol=1e-12, atol=1e-15)


def test_base_preset_sizes_and_parameter_count():
    cfg = tm.TRANSFORMER_BASE
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_h, cfg.d_ff) == (6, 512, 8, 64, 2048)
    assert (cfg.dropout, cfg.label_smoothing, cfg.tie_embeddings) == (0.1, 0.1, True)
    d, f, n, v = 512, 2048, 6, cfg.vocab_size
    ffn = 2 * d * f + f + d
    encoder_layer = 4 * d * d + ffn + 2 * 2 * d  # attention (no biases), FFN, two LayerNorms
    decoder_layer = 8 * d * d + ffn + 3 * 2 * d
    expected = v * d + n * (encoder_layer + decoder_layer)  # about 63M; the paper quotes 65M
    shapes = tm.param_shapes(cfg)
    assert sum(int(np.prod(s)) for s in shapes.values()) == expected


def test_init_params_names_dtypes_and_weight_decay_rule():
    cfg = config(tie_embeddings=False)
    params = tm.init_params(cfg, seed=3, dtype=np.float32)
    assert {k: v.shape for k, v in params.items()} == tm.param_shapes(cfg)
    assert all(v.dtype == np.float32 for v in params.values())
    # sqrt(d) E[a] has unit-variance entries
    assert 0.8 < np.std(np.sqrt(16) * params["tok_emb"]) < 1.2
    for name in params:
        leaf = name.rsplit(".", 1)[-1]
        decays = leaf.startswith("w") or name == "lm_head"
        assert takes_weight_decay(name) == decays, name
    again = tm.init_params(cfg, seed=3, dtype=np.float32)
    assert all(np.array_equal(params[k], again[k]) for k in params)


def test_config_round_trips_through_json():
    for cfg in (tm.TRANSFORMER_BASE, tm.TRANSFORMER_TINY, config(pad_id=None, tie_embeddings=False)):
        assert tm.TransformerConfig(**json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg


@pytest.mark.parametrize("changes, match", [
    ({"vocab_size": 0}, "vocab_size"),
    ({"max_seq_len": 2.5}, "max_seq_len"),
    ({"n_layers": True}, "n_layers"),
    ({"d_model": 15, "n_heads": 3}, "d_model must be even"),
    ({"d_model": 16, "n_heads": 3}, "n_heads must divide d_model"),
    ({"d_ff": -1}, "d_ff"),
    ({"dropout": 1.0}, "dropout"),
    ({"dropout": -0.1}, "dropout"),
    ({"label_smoothing": 1.5}, "label_smoothing"),
    ({"norm_eps": 0.0}, "norm_eps"),
    ({"tie_embeddings": 1}, "tie_embeddings"),
    ({"bos_id": 13}, "bos_id"),
    ({"pad_id": -1}, "pad_id"),
    ({"pad_id": 1}, "pad_id and bos_id must differ"),
])
def test_config_validation_names_the_field(changes, match):
    # TypeError for a value of the wrong kind, ValueError for one out of range
    with pytest.raises((ValueError, TypeError), match=match):
        config(**changes)


# ---- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("edit, error, match", [
    (lambda b: b.pop("src_lengths"), ValueError, r"missing \['src_lengths'\]"),
    (lambda b: b.update(tgt_length=np.array([5, 5])), ValueError, r"unexpected \['tgt_length'\]"),
    (lambda b: b.update(src=b["src"].astype(float)), TypeError, r"batch\['src'\] must be an integer"),
    (lambda b: b.update(src=b["src"][0]), ValueError, r"batch\['src'\] must have 2 dimensions"),
    (lambda b: b.update(tgt=b["tgt"] + VOCAB), ValueError, r"batch\['tgt'\] must lie in \[0, 13\)"),
    (lambda b: b.update(src=np.zeros((2, 17), dtype=int)), ValueError,
     r"batch\['src'\].*max_seq_len = 16.*\(2, 17\)"),
    (lambda b: b.update(tgt=np.zeros((2, 17), dtype=int)), ValueError, r"batch\['tgt'\].*\(2, 17\)"),
    (lambda b: b.update(tgt=b["tgt"][:1]), ValueError, r"batch\['tgt'\] must hold 2 sequences"),
    (lambda b: b.update(src_lengths=np.array([6, 0])), ValueError, r"src_lengths'\] must lie in \[1, 6\]"),
    (lambda b: b.update(src_lengths=np.array([7, 2])), ValueError, r"src_lengths'\] must lie in \[0, 7\)"),
    (lambda b: b.update(src_lengths=np.array([6])), ValueError, r"src_lengths'\] must have shape \(2,\)"),
    (lambda b: b.update(tgt_lengths=np.array([[5, 5]])), ValueError, r"tgt_lengths'\] must have 1"),
])
def test_bad_batches_name_the_key(edit, error, match):
    cfg = config()
    params = tm.init_params(cfg)
    batch = make_batch()
    edit(batch)
    with pytest.raises(error, match=match):
        tm.forward(params, batch, cfg)


def test_bad_params_and_bad_decode_inputs():
    cfg = config()
    params = tm.init_params(cfg)
    batch = make_batch()
    with pytest.raises(ValueError, match=r"missing \['tok_emb'\]"):
        tm.forward({k: v for k, v in params.items() if k != "tok_emb"}, batch, cfg)
    with pytest.raises(ValueError, match=r"unexpected \['lm_head'\]"):
        tm.forward({**params, "lm_head": np.zeros((16, VOCAB))}, batch, cfg)
    with pytest.raises(ValueError, match=r"params\['encoder.layers.0.ffn.w1'\] must have shape \(16, 32\)"):
        tm.forward({**params, "encoder.layers.0.ffn.w1": np.zeros((16, 31))}, batch, cfg)
    with pytest.raises(TypeError, match="same dtype"):
        tm.forward({**params, "tok_emb": params["tok_emb"].astype(np.float32)}, batch, cfg)
    with pytest.raises(TypeError, match="batch must be a dict"):
        tm.forward(params, [batch["src"], batch["tgt"]], cfg)
    with pytest.raises(ValueError, match=r"memory must be \(B, S, d_model = 16\)"):
        tm.decode(params, np.zeros((2, 6, 8)), batch["src_lengths"], batch["tgt"], cfg)
    with pytest.raises(ValueError, match=r"tokens must hold 2 sequences"):
        tm.decode(params, np.zeros((2, 6, 16)), batch["src_lengths"], batch["tgt"][:1], cfg)
