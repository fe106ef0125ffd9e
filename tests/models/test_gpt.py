"""GPT (catalogue M2): gradients of every parameter, initialisation (N11), prefix invariance of
the cached keys and values (K1; L6 for every model is test_model_properties.py's), the SFT loss
mask (L5), dropout, banded layers (A12, GPT-3's pattern), configs and bad input."""
import dataclasses
import json
import math

import numpy as np
import pytest

from refmath import sizing
from refmath.gradcheck import numerical_gradient, relative_error, sample_coords
from refmath.models import gpt
from refmath.models.hf_layout import HFCheckpointError
from refmath.optim import takes_weight_decay
from _support import float32_rule

SMALL = gpt.GPTConfig(vocab_size=13, max_seq_len=8, n_layers=2, d_model=8, n_heads=2, d_ff=12,
                      dropout=0.2)
# GPT-3's alternation at test size, dense layer first. The paper publishes no band width; 3 is an
# example small enough that a test sequence of 5 to 8 tokens has keys outside the band.
BANDED = dataclasses.replace(SMALL, sliding_window=3, window_layers=(False, True))


def _random_params(config, seed):
    """Parameters away from the initialisation (random gains, shifts and biases) so that every
    path of the network carries a signal of order 1 in the gradient check."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in gpt.param_shapes(config).items():
        if name.endswith("gamma"):
            params[name] = 1.0 + 0.2 * rng.standard_normal(shape)
        elif len(shape) == 1:  # biases and LayerNorm shifts
            params[name] = 0.2 * rng.standard_normal(shape)
        elif name in ("tok_emb", "pos_emb"):
            params[name] = 0.5 * rng.standard_normal(shape)
        else:  # 1/sqrt(fan-in) keeps attention scores and GELU inputs of order 1
            params[name] = rng.standard_normal(shape) / math.sqrt(shape[0])
    return params


def _batch(config, rng, b=2, t=6, prompt_len=0, n_ignored=0):
    batch = {"tokens": rng.integers(0, config.vocab_size, (b, t)),
             "targets": rng.integers(0, config.vocab_size, (b, t))}
    if prompt_len:
        mask = np.ones((b, t), dtype=np.int64)
        mask[:, :prompt_len] = 0
        batch["loss_mask"] = mask
    if n_ignored:
        batch["targets"][:, -n_ignored:] = gpt.IGNORE_INDEX
    return batch


# ---- end-to-end gradient check -------------------------------------------------------------------

# Four settings cover every switch both ways (Pre/Post-LN, tied/untied, dropout on/off, tanh/exact
# GELU, loss mask and ignored targets) at half the cost of the full product; the fifth bands the
# first layer of a Post-LN network (the registered gpt case bands the second of a Pre-LN one).
GRADCHECK_SETTINGS = [
    dict(norm_position="pre", tie_embeddings=True, train=False, ffn="gelu_tanh"),
    dict(norm_position="pre", tie_embeddings=False, train=True, ffn="gelu_tanh",
         prompt_len=2, n_ignored=1),
    dict(norm_position="post", tie_embeddings=True, train=True, ffn="gelu_tanh"),
    dict(norm_position="post", tie_embeddings=False, train=False, ffn="gelu",
         prompt_len=1),
    dict(norm_position="post", tie_embeddings=True, train=True, ffn="gelu_tanh",
         sliding_window=3, window_layers=(True, False)),
]


@pytest.mark.parametrize("setting", GRADCHECK_SETTINGS, ids=lambda s: "-".join(
    f"{k}={v}" for k, v in s.items()))
def test_every_parameter_gradient_matches_central_differences(setting):
    setting = dict(setting)
    train = setting.pop("train")
    shape = {k: setting.pop(k) for k in ("prompt_len", "n_ignored") if k in setting}
    config = dataclasses.replace(SMALL, **setting)
    params = _random_params(config, seed=1)
    batch = _batch(config, np.random.default_rng(2), **shape)

    # With dropout the masks come from the rng: a fresh generator with the same seed at every
    # evaluation reuses the same masks, so phi is the deterministic function that backward
    # differentiates.
    def phi():
        return float(gpt.forward(params, batch, config, train=train, rng=np.random.default_rng(5))[0])

    loss, cache = gpt.forward(params, batch, config, train=train, rng=np.random.default_rng(5))
    if train:
        assert cache.emb_drop is not None and cache.layers[0].attn.branch.attn.dropout_mask is not None
    grads = gpt.backward(cache)
    assert list(grads) == list(params)

    coord_rng = np.random.default_rng(0)
    errors = {}
    for name, value in params.items():
        assert grads[name].shape == value.shape and grads[name].dtype == value.dtype
        coords = sample_coords(value.size, 6, coord_rng)
        numeric = numerical_gradient(phi, value, coords)
        analytic = grads[name].reshape(-1)[coords]
        if name.endswith("attn.b_k"):
            # b_k adds q_i . b_k to every score of query row i, a shift softmax ignores: the gradient
            # is 0 exactly, so both sides are rounding noise and a relative error means nothing.
            # Analytic: a sum of ~B T^2 products of size O(1) that cancels, ~1e-16 * 10^2 at most;
            # numeric: ulps of phi (~4e-16) * 8 / (12 h) ~ 3e-13. 1e-11 bounds both.
            assert np.abs(analytic).max() < 1e-11 and np.abs(numeric).max() < 1e-11, name
            continue
        errors[name] = float(relative_error(analytic, numeric).max())
    worst = max(errors, key=errors.get)
    print(f"worst relative error {errors[worst]:.1e} at {worst}")
    assert errors[worst] < 1e-6, (worst, errors[worst])


def test_float32_parameters_give_float32_loss_and_gradients():
    params = {k: v.astype(np.float32) for k, v in _random_params(SMALL, 3).items()}
    batch = _batch(SMALL, np.random.default_rng(4))
    loss, cache = gpt.forward(params, batch, SMALL, train=True, rng=np.random.default_rng(0))
    grads = gpt.backward(cache)
    assert loss.dtype == np.float32
    assert all(g.dtype == np.float32 for g in grads.values())
    assert gpt.logits(params, batch["tokens"], SMALL).dtype == np.float32
    # and the float32 loss is the float64 loss to float32 accuracy
    loss64, _ = gpt.forward({k: v.astype(np.float64) for k, v in params.items()}, batch, SMALL,
                            train=True, rng=np.random.default_rng(0))
    np.testing.assert_allclose(loss, loss64, rtol=1e-5)


# ---- initialisation (N11) and parameter bookkeeping ----------------------------------------------

def test_init_std_and_scaled_residual_projections():
    config = gpt.GPTConfig(vocab_size=50, max_seq_len=32, n_layers=3, d_model=64, n_heads=4, d_ff=128)
    params = gpt.init_params(config, seed=0)
    residual_std = 0.02 / math.sqrt(2 * config.n_layers)
    for name, value in params.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "gamma":
            np.testing.assert_array_equal(value, 1.0)
            continue
        if value.ndim == 1:  # biases and LayerNorm shifts
            np.testing.assert_array_equal(value, 0.0)
            continue
        sigma = residual_std if name.endswith(("attn.w_o", "ffn.w2")) else 0.02
        n = value.size
        # For n i.i.d. N(0, sigma^2) draws the sample std s has Var(s^2) = 2 sigma^4 / (n - 1), and
        # by the delta method (s = sqrt(s^2)) a standard error of sigma / sqrt(2 (n - 1)); the mean
        # has standard error sigma / sqrt(n). Five standard errors: a false failure has probability
        # ~6e-7 per tensor (and the seed is fixed). The smallest tensor (w_o, n = 4096) gets a 5.5%
        # band, while the unscaled std would be sqrt(6) = 2.4 times too large.
        assert abs(value.std() - sigma) < 5 * sigma / math.sqrt(2 * (n - 1)), name
        assert abs(value.mean()) < 5 * sigma / math.sqrt(n), name


def test_init_is_seeded_and_takes_a_dtype():
    a = gpt.init_params(SMALL, seed=7)
    b = gpt.init_params(SMALL, seed=7)
    c = gpt.init_params(SMALL, seed=8, dtype=np.float32)
    assert list(a) == list(gpt.param_shapes(SMALL))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
        assert c[name].dtype == np.float32
    assert not np.array_equal(a["tok_emb"], c["tok_emb"].astype(np.float64))


@pytest.mark.parametrize("norm_position", ["pre", "post"])
@pytest.mark.parametrize("tied", [True, False])
def test_parameter_names_and_count_agree_with_sizing(norm_position, tied):
    config = dataclasses.replace(SMALL, norm_position=norm_position, tie_embeddings=tied)
    names = set(gpt.param_shapes(config))
    assert ("ln_f.gamma" in names) == (norm_position == "pre")
    assert ("lm_head" in names) == (not tied)
    # the same network as the model describes itself to the parameter calculator
    described = sizing.ModelConfig("gpt-test", **gpt.sizing_fields(config))
    total = sum(v.size for v in gpt.init_params(config).values())
    assert total == sizing.parameter_counts(described).total


def test_gpt2_small_preset_has_124_439_808_parameters():
    config = gpt.GPT_CONFIGS["gpt2-small"]
    assert config == gpt.GPTConfig()  # the defaults are GPT-2 small
    assert (config.n_layers, config.d_model, config.n_heads, config.vocab_size,
            config.max_seq_len, config.d_ff) == (12, 768, 12, 50257, 1024, 3072)
    # Token table 50257 * 768 = 38,597,376; positions 1024 * 768 = 786,432; per layer two
    # LayerNorms (2 * 1536), attention 4 * 768^2 + 4 * 768 = 2,362,368, FFN 2 * 768 * 3072 + 3072
    # + 768 = 4,722,432, i.e. 7,087,872 per layer and 85,054,464 for 12; final LayerNorm 1536;
    # tied output 0. Sum: 124,439,808 (the "124M" of the model card).
    shapes = gpt.param_shapes(config)  # counted from the shapes: no 1 GB allocation
    assert sum(math.prod(s) for s in shapes.values()) == 124_439_808
    assert sizing.parameter_counts(sizing.PRESETS["gpt2-small"]).total == 124_439_808
    tiny = gpt.GPT_CONFIGS["tiny"]
    loss, _ = gpt.forward(gpt.init_params(tiny), _batch(tiny, np.random.default_rng(0)), tiny)
    # at initialisation the logits are nearly 0, so the loss is close to log(vocab)
    assert abs(float(loss) - math.log(tiny.vocab_size)) < 0.05


def test_weight_decay_rule_reads_the_parameter_names():
    config = dataclasses.replace(SMALL, tie_embeddings=False)
    decayed = {n for n in gpt.param_shapes(config) if takes_weight_decay(n)}
    matrices = {n for n, s in gpt.param_shapes(config).items() if len(s) == 2
                and n not in ("tok_emb", "pos_emb")}
    assert decayed == matrices
    assert "lm_head" in decayed and "layers.1.ffn.w2" in decayed


@pytest.mark.parametrize("base", [SMALL, BANDED], ids=["dense", "banded"])
@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_k1_appending_tokens_leaves_earlier_logits_keys_and_values_unchanged(norm_position, base):
    config = dataclasses.replace(base, norm_position=norm_position)
    params = _random_params(config, 7)
    rng = np.random.default_rng(8)
    short = _batch(config, rng, 2, 5)
    tail = rng.integers(0, config.vocab_size, (2, 3))
    long = {"tokens": np.concatenate([short["tokens"], tail], axis=1),
            "targets": np.concatenate([short["targets"], tail], axis=1)}
    _, short_cache = gpt.forward(params, short, config)
    _, long_cache = gpt.forward(params, long, config)
    # Equal up to rounding only: the matrix products have different sizes, so BLAS may sum in a
    # different order. Without the causal mask the differences would be of order 1.
    close = dict(rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(gpt.logits(params, long["tokens"], config)[:, :5],
                               gpt.logits(params, short["tokens"], config), **close)
    for layer in range(config.n_layers):
        s_attn = short_cache.layers[layer].attn.branch.attn
        l_attn = long_cache.layers[layer].attn.branch.attn
        np.testing.assert_allclose(l_attn.k[:, :, :5], s_attn.k, **close)
        np.testing.assert_allclose(l_attn.v[:, :, :5], s_attn.v, **close)
    # while a different tail does change the positions after the prefix
    other = long["tokens"].copy()
    other[:, 5:] = (other[:, 5:] + 1) % config.vocab_size
    assert not np.allclose(gpt.logits(params, other, config)[:, 5:],
                           gpt.logits(params, long["tokens"], config)[:, 5:])


def _per_token_nll(logits, targets):
    z = logits - logits.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def test_l5_loss_mask_removes_prompt_tokens_from_loss_and_gradient():
    config = SMALL
    params = _random_params(config, 9)
    rng = np.random.default_rng(10)
    prompt = 3
    batch = _batch(config, rng, 2, 6, prompt_len=prompt)
    loss, cache = gpt.forward(params, batch, config)
    grads = gpt.backward(cache)

    # the loss is the mean negative log-likelihood of the answer tokens only
    nll = _per_token_nll(gpt.logits(params, batch["tokens"], config), batch["targets"])
    np.testing.assert_allclose(loss, nll[:, prompt:].mean(), rtol=1e-13)

    # other targets under the mask change neither loss nor any gradient ...
    other = dict(batch, targets=batch["targets"].copy())
    other["targets"][:, :prompt] = (other["targets"][:, :prompt] + 1) % config.vocab_size
    # ... and the mask is the same as ignoring those targets
    ignored = {"tokens": batch["tokens"], "targets": np.where(batch["loss_mask"] == 1,
                                                              batch["targets"], gpt.IGNORE_INDEX)}
    for variant in (other, ignored):
        loss_v, cache_v = gpt.forward(params, variant, config)
        grads_v = gpt.backward(cache_v)
        np.testing.assert_array_equal(loss_v, loss)
        for name in grads:
            np.testing.assert_array_equal(grads_v[name], grads[name])

    # while without the mask the prompt tokens do count
    unmasked, _ = gpt.forward(params, {"tokens": batch["tokens"], "targets": batch["targets"]}, config)
    np.testing.assert_allclose(unmasked, nll.mean(), rtol=1e-13)
    assert not np.isclose(unmasked, loss)


# ---- dropout -------------------------------------------------------------------------------------

def test_dropout_masks_are_drawn_from_rng_and_kept_in_the_cache():
    config = dataclasses.replace(SMALL, dropout=0.25)
    params = _random_params(config, 11)
    batch = _batch(config, np.random.default_rng(12))
    b, t = batch["tokens"].shape
    eval_loss, eval_cache = gpt.forward(params, batch, config, rng=np.random.default_rng(0))
    assert eval_cache.emb_drop is None  # train=False: no dropout, the rng is not used
    loss_a, cache = gpt.forward(params, batch, config, train=True, rng=np.random.default_rng(3))
    loss_b, _ = gpt.forward(params, batch, config, train=True, rng=np.random.default_rng(3))
    loss_c, _ = gpt.forward(params, batch, config, train=True, rng=np.random.default_rng(4))
    assert loss_a == loss_b and loss_a != loss_c and loss_a != eval_loss

    masks = [cache.emb_drop]
    for layer in cache.layers:
        assert layer.attn.branch.attn.dropout_mask.shape == (b, config.n_heads, t, t)
        masks += [layer.attn.branch.attn.dropout_mask, layer.attn.drop, layer.ffn.drop]
    assert cache.emb_drop.shape == layer.attn.drop.shape == layer.ffn.drop.shape == (b, t, config.d_model)
    values = np.concatenate([m.ravel() for m in masks])
    assert set(np.unique(values)) == {0.0, 1.0 / (1.0 - 0.25)}  # inverted dropout
    # the kept fraction is 0.75 to within 5 binomial standard errors sqrt(p (1 - p) / n)
    kept = np.mean(values > 0)
    assert abs(kept - 0.75) < 5 * math.sqrt(0.75 * 0.25 / values.size)

    # rate 0 in train mode is the evaluation network and draws nothing
    off = dataclasses.replace(config, dropout=0.0)
    loss_off, cache_off = gpt.forward(params, batch, off, train=True)
    assert loss_off == eval_loss and cache_off.emb_drop is None


# ---- banded layers: GPT-3's alternating dense and locally banded attention (A12) ------------------

def test_a_banded_layer_gives_zero_weight_outside_its_window_and_a_dense_one_does_not():
    config = dataclasses.replace(BANDED, dropout=0.0)
    params = _random_params(config, 13)
    batch = _batch(config, np.random.default_rng(14), 2, 7)
    _, cache = gpt.forward(params, batch, config)
    i, j = np.indices((7, 7))
    outside = (j < i) & (j <= i - config.sliding_window)  # earlier than the band: 10 of 21 pairs
    assert outside.sum() == 10
    dense, banded = (cache.layers[n].attn.branch.attn.a for n in (0, 1))
    assert np.all(banded[..., outside] == 0.0) and np.all(banded[..., j > i] == 0.0)
    assert np.all(dense[..., outside] > 0.0)  # layer 0 is dense: it sees every earlier key
    np.testing.assert_allclose(banded.sum(axis=-1), 1.0, rtol=1e-14)  # the band's rows still sum to 1


def test_a_token_outside_every_band_changes_no_logit():
    """Two banded layers of window w = 3 give position i a receptive field of i - 4 .. i (each layer
    reaches w - 1 = 2 further back), so a new token 0 changes the logits of positions 0 .. 4 and
    leaves those of 5 .. 7 as they were; with GPT-3's dense layer first every position sees it."""
    rng = np.random.default_rng(15)
    tokens = rng.integers(0, SMALL.vocab_size, (2, 8))
    other = tokens.copy()
    other[:, 0] = (other[:, 0] + 1) % SMALL.vocab_size
    both = dataclasses.replace(SMALL, sliding_window=3)  # window_layers None: every layer slides
    params = _random_params(both, 16)
    before, after = gpt.logits(params, tokens, both), gpt.logits(params, other, both)
    # equal up to rounding only: the hidden keys get weight exactly 0, but BLAS may round the
    # products of the visible ones differently when other rows change
    np.testing.assert_allclose(after[:, 5:], before[:, 5:], rtol=1e-12, atol=1e-14)
    for position in range(5):
        assert not np.allclose(after[:, position], before[:, position]), position
    before, after = gpt.logits(params, tokens, BANDED), gpt.logits(params, other, BANDED)
    for position in range(8):
        assert not np.allclose(after[:, position], before[:, position]), position


def test_layer_window_and_layer_config():
    assert [gpt.layer_window(BANDED, n) for n in range(2)] == [None, 3]
    assert [gpt.layer_window(dataclasses.replace(SMALL, sliding_window=4), n) for n in range(2)] \
        == [4, 4]
    assert [gpt.layer_window(SMALL, n) for n in range(2)] == [None, None]
    dense, banded = (gpt.layer_config(BANDED, n) for n in range(2))
    assert (dense.sliding_window, dense.window_layers) == (None, None)
    assert (banded.sliding_window, banded.window_layers) == (3, None)
    assert gpt.layer_config(BANDED, 1) is banded  # built once per layer
    assert gpt.layer_config(SMALL, 1) is SMALL
    # a window wider than the sequence hides nothing: the dense network's loss, bit for bit
    params = _random_params(SMALL, 17)
    batch = _batch(SMALL, np.random.default_rng(18), 2, 6)
    wide = dataclasses.replace(SMALL, sliding_window=6)
    assert gpt.forward(params, batch, wide)[0] == gpt.forward(params, batch, SMALL)[0]
    assert gpt.forward(params, batch, BANDED)[0] != gpt.forward(params, batch, SMALL)[0]


def test_the_gpt3_175b_preset_alternates_dense_and_banded_layers():
    config = gpt.GPT_CONFIGS["gpt-3-175b"]
    assert (config.n_layers, config.d_model, config.n_heads, config.d_h, config.d_ff,
            config.vocab_size, config.max_seq_len) == (96, 12288, 96, 128, 4 * 12288, 50257, 2048)
    assert config.window_layers == (False, True) * 48 and config.sliding_window == 256
    # Tokens 50257 * 12288 = 617,558,016; positions 2048 * 12288 = 25,165,824; per layer two
    # LayerNorms 4 d = 49,152, attention 4 d^2 + 4 d = 604,028,928, FFN 8 d^2 + 5 d =
    # 1,208,020,992, i.e. 1,812,099,072 and 173,961,510,912 for 96; final LayerNorm 24,576;
    # tied head 0. Sum 174,604,259,328: the "175B" of the paper's Table 2.1.
    shapes = gpt.param_shapes(config)
    assert sum(math.prod(s) for s in shapes.values()) == 174_604_259_328
    assert sizing.parameter_counts(sizing.PRESETS["gpt-3-175b"]).total == 174_604_259_328
    # the calculators count each layer's window: the 48 banded layers keep 256 positions
    sized = sizing.ModelConfig("gpt-3-like", **gpt.sizing_fields(config))
    assert sized.layer_windows == (None, 256) * 48
    assert sizing.model_cache_bytes(sized, 2048) == 48 * (2048 + 256) * 2 * 12288 * 2
    assert gpt.sizing_fields(dataclasses.replace(SMALL, sliding_window=3))["sliding_window"] == 3


@pytest.mark.parametrize("config", [dataclasses.replace(SMALL, sliding_window=3), BANDED],
                         ids=["every-layer", "window_layers"])
def test_to_hf_refuses_a_window_in_one_line(config):
    params = gpt.init_params(config)
    with pytest.raises(HFCheckpointError, match=r"sliding_window = 3") as info:
        gpt.to_hf(config, params)
    assert "\n" not in str(info.value)
    assert gpt.to_hf(SMALL, gpt.init_params(SMALL))[0]["model_type"] == "gpt2"


# ---- configuration and bad input -----------------------------------------------------------------

def test_config_round_trips_through_json_and_resolves_d_ff():
    config = gpt.GPTConfig(vocab_size=11, max_seq_len=9, n_layers=1, d_model=12, n_heads=3,
                           norm_position="post", tie_embeddings=False)
    assert config.d_ff == 48 and config.d_h == 4
    assert gpt.GPTConfig(**json.loads(json.dumps(dataclasses.asdict(config)))) == config
    for preset in gpt.GPT_CONFIGS.values():
        assert gpt.GPTConfig(**json.loads(json.dumps(dataclasses.asdict(preset)))) == preset


@pytest.mark.parametrize("field, value, error, message", [
    ("vocab_size", 0, ValueError, r"GPTConfig.vocab_size must be an int >= 1, got 0"),
    ("max_seq_len", -4, ValueError, r"max_seq_len must be an int >= 1, got -4"),
    ("n_layers", 1.5, TypeError, r"n_layers must be an int, got 1.5"),
    ("d_model", True, TypeError, r"d_model must be an int, got True"),
    ("n_heads", 3, ValueError, r"n_heads = 3 must divide GPTConfig.d_model = 8"),
    ("d_ff", 0, ValueError, r"d_ff must be an int >= 1"),
    ("norm_position", "middle", ValueError, r"norm_position must be one of 'pre', 'post', got 'middle'"),
    ("tie_embeddings", 1, TypeError, r"tie_embeddings must be True or False, got 1"),
    ("ffn", "tanh", ValueError, r"ffn must be one of 'gelu', 'gelu_tanh', got 'tanh'"),
    ("ffn", "swiglu", ValueError, r"ffn must be one of 'gelu', 'gelu_tanh', got 'swiglu'"),
    ("dropout", 1.0, ValueError, r"dropout must be a finite number in \[0, 1\), got 1.0"),
    ("dropout", -0.1, ValueError, r"dropout must be a finite number in \[0, 1\)"),
    ("dropout", True, TypeError, r"dropout must be a number, got True"),
    ("norm_eps", 0.0, ValueError, r"norm_eps must be a finite number > 0, got 0.0"),
    ("init_std", float("nan"), ValueError, r"init_std must be a finite number > 0, got nan"),
    ("sliding_window", 0, ValueError, r"GPTConfig.sliding_window must be an int >= 1, got 0"),
    ("sliding_window", 2.5, TypeError, r"sliding_window must be an int, got 2.5"),
    ("window_layers", (True,), ValueError,
     r"window_layers must hold one True/False per layer \(n_layers = 2\), got 1 entries \(True,\)"),
    ("window_layers", (1, 0), ValueError, r"window_layers must hold one True/False per layer"),
    ("window_layers", (True, False, True), ValueError, r"one True/False per layer"),
])
def test_config_validation_names_the_field(field, value, error, message):
    base = BANDED if field == "window_layers" else SMALL
    with pytest.raises(error, match=message):
        dataclasses.replace(base, **{field: value})


def test_window_layers_need_a_window_and_come_back_from_json_as_a_tuple():
    with pytest.raises(ValueError, match=r"window_layers flags the layers that slide "
                                         r"sliding_window, which is None"):
        dataclasses.replace(SMALL, window_layers=(False, True))
    listed = dataclasses.replace(BANDED, window_layers=[False, True])  # as JSON gives it
    assert listed.window_layers == (False, True) and listed == BANDED and hash(listed) == hash(BANDED)


def _bad(batch, **changes):
    out = dict(batch, **changes)
    return {k: v for k, v in out.items() if v is not None}


GOOD = {"tokens": np.array([[1, 2, 3], [4, 5, 6]]), "targets": np.array([[2, 3, 4], [5, 6, 7]])}


@pytest.mark.parametrize("batch, error, message", [
    ([GOOD["tokens"], GOOD["targets"]], TypeError, r"batch must be a dict"),
    (_bad(GOOD, tokens=None), ValueError, r"batch is missing 'tokens'"),
    (_bad(GOOD, targets=None), ValueError, r"batch is missing 'targets'"),
    (_bad(GOOD, mask=np.ones((2, 3))), ValueError, r"unexpected keys \['mask'\]"),
    (_bad(GOOD, tokens=GOOD["tokens"] * 1.0), TypeError, r"batch\['tokens'\] must be an integer array"),
    (_bad(GOOD, tokens=GOOD["tokens"][0]), ValueError, r"batch\['tokens'\] must have 2 dimensions"),
    (_bad(GOOD, tokens=GOOD["tokens"] + 10), ValueError, r"batch\['tokens'\] must lie in \[0, 13\)"),
    (_bad(GOOD, tokens=-GOOD["tokens"]), ValueError, r"batch\['tokens'\] must lie in \[0, 13\)"),
    (_bad(GOOD, tokens=np.zeros((2, 0), dtype=int)), ValueError, r"at least one token"),
    ({"tokens": np.zeros((1, 9), dtype=int), "targets": np.zeros((1, 9), dtype=int)}, ValueError,
     r"T = 9 tokens \(shape \(1, 9\)\), more than max_seq_len = 8"),
    (_bad(GOOD, targets=GOOD["targets"][:, :2]), ValueError,
     r"batch\['targets'\] must have the shape of batch\['tokens'\] \(2, 3\), got \(2, 2\)"),
    (_bad(GOOD, targets=GOOD["targets"] * 1.0), TypeError, r"batch\['targets'\] must be an integer"),
    (_bad(GOOD, targets=GOOD["targets"] + 6), ValueError,
     r"batch\['targets'\] must lie in \[0, 13\) or equal -100"),
    (_bad(GOOD, targets=-GOOD["targets"]), ValueError, r"batch\['targets'\] must lie in"),
    (_bad(GOOD, loss_mask=np.ones((3, 2))), ValueError, r"batch\['loss_mask'\] must have the shape"),
    (_bad(GOOD, loss_mask=np.full((2, 3), 2)), ValueError, r"batch\['loss_mask'\] must hold only 0 and 1"),
])
def test_bad_batches_name_the_key_and_shapes(batch, error, message):
    params = gpt.init_params(SMALL)
    with pytest.raises(error, match=message):
        gpt.forward(params, batch, SMALL)


def test_bad_calls_and_parameters():
    params = gpt.init_params(SMALL)
    with pytest.raises(ValueError, match=r"train=True with dropout = 0.2 needs rng"):
        gpt.forward(params, GOOD, SMALL, train=True)
    with pytest.raises(ValueError, match=r"tokens must have 2 dimensions \(B, T\), got shape \(3,\)"):
        gpt.logits(params, np.array([1, 2, 3]), SMALL)
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 13\)"):
        gpt.logits(params, np.array([[13]]), SMALL)
    with pytest.raises(TypeError, match=r"params must be a dict"):
        gpt.forward(list(params.values()), GOOD, SMALL)
    missing = {k: v for k, v in params.items() if k != "layers.1.ffn.b2"}
    with pytest.raises(ValueError, match=r"missing \['layers.1.ffn.b2'\]"):
        gpt.forward(missing, GOOD, SMALL)
    with pytest.raises(ValueError, match=r"unexpected \['lm_head'\]"):
        gpt.forward(dict(params, lm_head=np.zeros((8, 13))), GOOD, SMALL)
    with pytest.raises(ValueError, match=r"params\['pos_emb'\] must have shape \(8, 8\) .* got \(4, 8\)"):
        gpt.forward(dict(params, pos_emb=params["pos_emb"][:4]), GOOD, SMALL)
    with pytest.raises(TypeError, match=r"params\['tok_emb'\] must be a NumPy array, got list"):
        gpt.forward(dict(params, tok_emb=params["tok_emb"].tolist()), GOOD, SMALL)
    with pytest.raises(TypeError, match=r"same dtype: params\['ln_f.beta'\] is float32"):
        gpt.forward(dict(params, **{"ln_f.beta": params["ln_f.beta"].astype(np.float32)}), GOOD, SMALL)
    with pytest.raises(TypeError, match=r"params\['ln_f.gamma'\] must be a floating-point array"):
        gpt.forward(dict(params, **{"ln_f.gamma": np.ones(8, dtype=int)}), GOOD, SMALL)


@pytest.mark.skipif(not __import__("refmath.kernels").kernels.cpu_available(),
                    reason="the C++ module refmath._C is not built")
@pytest.mark.parametrize("base", [SMALL, BANDED], ids=["dense", "banded"])
def test_the_flash_kernel_backend_gives_the_reference_loss_and_gradients(base):
    # float32 through the FlashAttention kernel against float32 through NumPy, both against the
    # float64 model: the kernel's error is at most twice NumPy's plus a few float32 ulps. Banded,
    # the kernel gets the second layer's window and the first layer's None.
    config = dataclasses.replace(base, dropout=0.0)
    params64 = gpt.init_params(config, seed=5)
    rng = np.random.default_rng(6)
    batch = {"tokens": rng.integers(0, config.vocab_size, (2, 7)),
             "targets": rng.integers(0, config.vocab_size, (2, 7))}
    loss64, cache64 = gpt.forward(params64, batch, config)
    grads64 = gpt.backward(cache64)
    params32 = {k: v.astype(np.float32) for k, v in params64.items()}
    runs = {}
    for backend in ("numpy", "cpu"):
        run_config = dataclasses.replace(config, attention_backend=backend)
        loss, cache = gpt.forward(params32, batch, run_config, train=True,
                                  rng=np.random.default_rng(0))
        assert isinstance(cache.layers[0].attn.branch, gpt.KernelAttentionCache) == (backend == "cpu")
        if backend == "cpu":
            assert [layer.attn.branch.attn.window for layer in cache.layers] == \
                [gpt.layer_window(config, n) for n in range(config.n_layers)]
        runs[backend] = (loss, gpt.backward(cache))
    u32 = np.finfo(np.float32).eps
    # b_k's gradient is exactly 0 (a key bias shifts a whole row of scores, which softmax ignores):
    # what comes out is the rounding of a cancellation whose terms are of the size of b_q's
    # gradient, so it is held to that scale rather than to its own (zero) size.
    for name in (n for n in grads64 if n.endswith("attn.b_k")):
        scale = np.abs(grads64[name.replace("b_k", "b_q")]).max()
        for backend, (_, grads) in runs.items():
            assert np.abs(grads.pop(name)).max() <= 8 * u32 * scale, (backend, name)
    for name in ["loss", *runs["cpu"][1]]:
        ref = loss64 if name == "loss" else grads64[name]
        got = {b: np.asarray(r[0] if name == "loss" else r[1][name], np.float64) for b, r in runs.items()}
        float32_rule(name, got["cpu"], ref, got["numpy"], 2, 4 * u32 * np.abs(ref).max())
    with pytest.raises(ValueError, match="attention_backend = 'cpu' needs dropout = 0"):
        dataclasses.replace(config, attention_backend="cpu", dropout=0.1)
