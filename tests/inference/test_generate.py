"""Generation without a cache (catalogue L7): greedy, temperature, top-k, top-p, seeding, EOS."""
import importlib
import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refmath.inference.generate import generate, generate_seq2seq
from refmath.inference.sampling import next_token_distribution, sample_token, top_k_filter, top_p_filter
from refmath.models import gpt, transformer

V = 7


def _bigram_model(table):
    """A stand-in decoder: the logits after token a are row a of ``table`` (V x V)."""
    def logits(params, tokens, config):
        tokens = np.asarray(tokens)
        assert tokens.shape[1] <= config.max_seq_len
        return params["table"][tokens]
    return SimpleNamespace(logits=logits)


def _softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def _chi2_survival_even_df(x: float, df: int) -> float:
    r"""P(X > x) for X ~ chi^2 with even df = 2m: e^{-x/2} \sum_{i<m} (x/2)^i / i! (Poisson tail)."""
    assert df % 2 == 0
    return math.exp(-x / 2) * sum((x / 2) ** i / math.factorial(i) for i in range(df // 2))


def _chi2_quantile_even_df(alpha: float, df: int) -> float:
    """The x with P(X > x) = alpha, by bisection (the survival function decreases in x)."""
    lo, hi = 0.0, 1000.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _chi2_survival_even_df(mid, df) > alpha else (lo, mid)
    return hi


# ---- picking one token ---------------------------------------------------------------------------

def test_temperature_one_is_the_softmax():
    z = np.array([0.3, -1.0, 2.0, 0.0])
    np.testing.assert_allclose(next_token_distribution(z), _softmax(z), rtol=1e-15)
    np.testing.assert_allclose(next_token_distribution(z, temperature=2.0), _softmax(z / 2), rtol=1e-15)


def test_small_temperature_approaches_greedy():
    # With gap g between the largest logit and the next, the others' total mass is at most
    # (V - 1) exp(-g / tau) (each is exp((z_v - z_max) / tau) <= exp(-g / tau) before normalising).
    z = np.array([0.5, 1.7, -0.2, 1.2, 0.0])
    gap = 1.7 - 1.2
    for tau in (1.0, 0.3, 0.1, 0.03):
        p = next_token_distribution(z, temperature=tau)
        assert (1 - p[1]) <= (len(z) - 1) * math.exp(-gap / tau) + 1e-15
    rng = np.random.default_rng(0)
    draws = {sample_token(next_token_distribution(z, temperature=0.01), rng) for _ in range(500)}
    assert draws == {int(np.argmax(z))}  # the bound gives 4 e^{-50}: no other token, ever


def test_top_k_never_samples_outside_the_top_k():
    rng = np.random.default_rng(1)
    for k in (1, 2, 4):
        z = rng.normal(size=12)
        top = set(np.argsort(-z)[:k].tolist())
        p = next_token_distribution(z, top_k=k)
        assert set(np.flatnonzero(p).tolist()) == top
        np.testing.assert_allclose(p[list(top)], _softmax(z[list(top)]), rtol=1e-12)
        draws = {sample_token(p, rng) for _ in range(300)}
        assert draws <= top
    assert top_k_filter(np.full(3, 1 / 3), 5).tolist() == [1 / 3] * 3  # k > V keeps everything
    np.testing.assert_array_equal(top_k_filter(np.array([0.25, 0.5, 0.25]), 2), [1 / 3, 2 / 3, 0])


def test_top_p_on_a_hand_made_distribution():
    # Dyadic probabilities, so every partial sum is exact; listed out of order on purpose.
    probs = np.array([1 / 16, 1 / 2, 1 / 8, 1 / 16, 1 / 4])
    kept = {0.3: {1}, 0.5: {1}, 0.6: {1, 4}, 0.75: {1, 4}, 0.8: {1, 4, 2}, 0.875: {1, 4, 2},
            0.9: {0, 1, 2, 4}, 1.0: {0, 1, 2, 3, 4}}  # at 0.9 the tie between ids 0 and 3: id 0
    for p, expected in kept.items():
        out = top_p_filter(probs, p)
        assert set(np.flatnonzero(out).tolist()) == expected, p
        mass = probs[list(expected)].sum()
        np.testing.assert_allclose(out[list(expected)], probs[list(expected)] / mass, rtol=1e-15)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0.01, 1.0), min_size=2, max_size=9), st.floats(0.05, 0.99))
def test_top_p_keeps_the_smallest_set_with_enough_mass(weights, p):
    probs = np.array(weights) / sum(weights)
    kept = top_p_filter(probs, p) > 0
    mass = probs[kept].sum()
    assert mass >= p - 1e-12  # enough mass ...
    assert mass - probs[kept].min() < p + 1e-12  # ... and dropping any kept id loses too much
    if (~kept).any():
        assert probs[kept].min() >= probs[~kept].max()  # the kept ids are the most probable


def test_sampler_frequencies_match_the_renormalised_distribution():
    # Pearson's X^2 = sum (n_v - N q_v)^2 / (N q_v) over the m kept ids is approximately chi^2 with
    # m - 1 degrees of freedom when the draws follow q; its 1 - 1e-4 quantile bounds X^2.
    z = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -3.0, 1.4])
    q = next_token_distribution(z, temperature=0.8, top_k=6, top_p=0.97)
    support = np.flatnonzero(q)
    assert len(support) == 5  # df = 4, even, for the closed-form tail
    rng = np.random.default_rng(2024)
    n = 6000
    counts = np.bincount([sample_token(q, rng) for _ in range(n)], minlength=len(z))
    assert counts[q == 0].sum() == 0
    x2 = float((((counts[support] - n * q[support]) ** 2) / (n * q[support])).sum())
    assert x2 < _chi2_quantile_even_df(1e-4, df=4), x2


def test_chi2_helper():
    # df = 2 is the exponential distribution with mean 2: P(X > x) = e^{-x/2}.
    assert math.isclose(_chi2_survival_even_df(3.0, 2), math.exp(-1.5))
    assert math.isclose(_chi2_quantile_even_df(0.05, 2), -2 * math.log(0.05), rel_tol=1e-9)


def test_sample_token_never_draws_zero_probability():
    probs = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    rng = np.random.default_rng(3)
    assert {sample_token(probs, rng) for _ in range(200)} == {1, 3}

    class TopOfRange(np.random.Generator):
        """u = 1.0, the edge where u * total reaches the total and would index past the end."""
        def random(self, *args, **kwargs):
            return 1.0
    assert sample_token(probs, TopOfRange(np.random.PCG64(0))) == 3  # not the trailing zero
    with pytest.raises(TypeError, match="Generator"):
        sample_token(probs, np.random.RandomState(0))


# ---- the decoding loop ---------------------------------------------------------------------------

def _bigram_setup(seed=0):
    rng = np.random.default_rng(seed)
    return {"table": rng.normal(size=(V, V))}, SimpleNamespace(vocab_size=V, max_seq_len=6)


def test_greedy_picks_the_argmax_chain():
    params, config = _bigram_setup()
    model = _bigram_model(params["table"])
    out = generate(model, params, config, np.array([3]), 10, greedy=True)
    assert out.shape == (11,) and out[0] == 3
    for t in range(10):
        assert out[t + 1] == np.argmax(params["table"][out[t]])  # a bigram: only the last counts


def test_same_seed_same_tokens():
    params, config = _bigram_setup()
    model = _bigram_model(params["table"])
    a = generate(model, params, config, [0, 1], 20, temperature=1.3, top_k=5, seed=11)
    b = generate(model, params, config, [0, 1], 20, temperature=1.3, top_k=5, seed=11)
    c = generate(model, params, config, [0, 1], 20, temperature=1.3, top_k=5, seed=12)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    gen = np.random.default_rng(11)  # a Generator works too, and is advanced
    np.testing.assert_array_equal(generate(model, params, config, [0, 1], 20, temperature=1.3,
                                           top_k=5, seed=gen), a)


def test_stops_at_eos_and_finished_rows_repeat_it():
    table = np.full((V, V), -5.0)
    for a in range(V):
        table[a, (a + 1) % V] = 5.0  # greedy counts upwards: 2 -> 3 -> 4 ...
    params, config = {"table": table}, SimpleNamespace(vocab_size=V, max_seq_len=6)
    model = _bigram_model(table)
    out = generate(model, params, config, [2], 10, greedy=True, eos_id=5)
    np.testing.assert_array_equal(out, [2, 3, 4, 5])
    out = generate(model, params, config, [[4], [1]], 10, greedy=True, eos_id=5)
    np.testing.assert_array_equal(out, [[4, 5, 5, 5, 5], [1, 2, 3, 4, 5]])


def test_any_listed_eos_ends_a_row_and_the_row_repeats_its_own():
    """``eos_id=[5, 3]``, as Llama 3's configs list two: the first of either ends the row."""
    table = np.full((V, V), -5.0)
    for a in range(V):
        table[a, (a + 1) % V] = 5.0
    params, config = {"table": table}, SimpleNamespace(vocab_size=V, max_seq_len=6)
    model = _bigram_model(table)
    np.testing.assert_array_equal(generate(model, params, config, [1], 10, greedy=True,
                                           eos_id=[5, 3]), [1, 2, 3])
    out = generate(model, params, config, [[4], [1]], 10, greedy=True, eos_id=(5, 3))
    np.testing.assert_array_equal(out, [[4, 5, 5], [1, 2, 3]])
    np.testing.assert_array_equal(generate(model, params, config, [1], 10, greedy=True,
                                           eos_id=[6]), [1, 2, 3, 4, 5, 6])
    for bad, error in (([], ValueError), ([[1]], ValueError), ([1, 7], ValueError),
                       ([1.0], TypeError)):
        with pytest.raises(error, match="eos_id"):
            generate(model, params, config, [1], 3, eos_id=bad)


def test_sliding_window_past_max_seq_len():
    params, config = _bigram_setup(1)
    model = _bigram_model(params["table"])
    out = generate(model, params, config, np.arange(6), 5, greedy=True)  # the prompt fills the context
    assert out.shape == (11,)
    for t in range(6, 11):
        assert out[t] == np.argmax(params["table"][out[t - 1]])


def _tiny_gpt():
    config = gpt.GPTConfig(vocab_size=11, max_seq_len=8, n_layers=2, d_model=16, n_heads=2,
                           dropout=0.0)
    return config, gpt.init_params(config, seed=4)


def _decoder_models():
    """(name, config, params) for each decoder-only model that exists."""
    config, params = _tiny_gpt()
    out = [("gpt", config, params)]
    for name, module_name, make in (
            ("llama", "refmath.models.decoder",
             lambda m: m.DecoderConfig(vocab_size=11, max_seq_len=8, d_model=16, n_layers=2,
                                       n_heads=2, n_kv_heads=1, ffn_multiple_of=8)),
            ("mla", "refmath.models.mla",
             lambda m: m.MLAConfig(vocab_size=11, max_seq_len=8, d_model=16, n_layers=2, n_heads=2,
                                   d_c=8, d_rope=4, ffn_multiple_of=8))):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        config = make(module)
        # Larger weights than the default init, so that the argmax is far from ties.
        out.append((name, config, module.init_params(config, seed=5)))
    return out


@pytest.mark.parametrize("name, config, params", _decoder_models(), ids=lambda x: x if isinstance(x, str) else "")
def test_greedy_generation_is_the_argmax_of_logits_at_each_step(name, config, params):
    module = importlib.import_module({"gpt": "refmath.models.gpt", "llama": "refmath.models.decoder",
                                      "mla": "refmath.models.mla"}[name])
    prompt = np.array([3, 1, 4])
    out = generate(name, params, config, prompt, 5, greedy=True)
    np.testing.assert_array_equal(out[:3], prompt)
    for t in range(3, 8):
        z = module.logits(params, out[None, :t], config)[0, -1]
        assert out[t] == np.argmax(z)
    # The module itself is accepted in place of its name.
    np.testing.assert_array_equal(generate(module, params, config, prompt, 5, greedy=True), out)


@pytest.mark.parametrize("name, config, params", _decoder_models(), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("sampling", [dict(greedy=True), dict(temperature=0.8, top_k=6, seed=3)])
def test_the_cache_gives_the_tokens_of_recomputation_past_the_window(name, config, params, sampling):
    # 3 + 14 tokens with max_seq_len = 8: prefill, 5 decode steps, then a prefill per sliding step.
    prompt = np.array([[3, 1, 4], [2, 7, 1]])
    cached = generate(name, params, config, prompt, 14, **sampling)
    recomputed = generate(name, params, config, prompt, 14, cache=False, **sampling)
    np.testing.assert_array_equal(cached, recomputed)


def _tiny_transformer():
    config = transformer.TransformerConfig(vocab_size=9, max_seq_len=6, n_layers=1, d_model=8,
                                           n_heads=2, d_ff=16, dropout=0.0)
    return config, transformer.init_params(config, seed=6)


def test_seq2seq_greedy_is_the_argmax_of_logits_at_each_step():
    config, params = _tiny_transformer()
    src = np.array([[4, 5, 6, 7], [8, 4, 0, 0]])
    lengths = np.array([4, 2])
    out = generate_seq2seq(params, config, src, 6, src_lengths=lengths, greedy=True)
    assert out.shape == (2, 6)
    for row in range(2):
        for t in range(6):
            prefix = np.concatenate([[config.bos_id], out[row, :t]])[None]
            z = transformer.logits(params, src[row:row + 1, :lengths[row]], lengths[row:row + 1],
                                   prefix, config)[0, -1]
            assert out[row, t] == np.argmax(z)
    # A single unpadded source gives the same tokens as its row in the batch.
    np.testing.assert_array_equal(generate_seq2seq(params, config, src[0], 6, greedy=True), out[0])


def test_seq2seq_sampling_is_seeded():
    config, params = _tiny_transformer()
    a = generate_seq2seq(params, config, [4, 5, 6], 5, top_p=0.9, seed=1)
    b = generate_seq2seq(params, config, [4, 5, 6], 5, top_p=0.9, seed=1)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (5,) and a.min() >= 0 and a.max() < 9


# ---- argument checks -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=0.0), "temperature"), (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(top_k=0), "top_k"), (dict(top_k=2.5), "top_k"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_p=float("nan")), "top_p"),
])
def test_bad_sampling_arguments(kwargs, match):
    params, config = _bigram_setup()
    model = _bigram_model(params["table"])
    # TypeError for a value of the wrong kind (top_k=2.5), ValueError for one out of range
    error = TypeError if kwargs.get("top_k") == 2.5 else ValueError
    with pytest.raises(error, match=match):
        generate(model, params, config, [1], 3, **kwargs)
    with pytest.raises(error, match=match):
        next_token_distribution(np.zeros(4), **kwargs)
    config_t, params_t = _tiny_transformer()
    with pytest.raises(error, match=match):
        generate_seq2seq(params_t, config_t, [4, 5], 3, **kwargs)
    with pytest.raises(TypeError, match="greedy must be True or False, got 1"):
        generate(model, params, config, [1], 3, greedy=1)


def test_bad_prompts_and_lengths():
    params, config = _bigram_setup()
    model = _bigram_model(params["table"])
    with pytest.raises(ValueError, match="max_seq_len = 6"):
        generate(model, params, config, np.zeros(7, dtype=int), 1)
    with pytest.raises(ValueError, match="between 1"):
        generate(model, params, config, np.zeros(0, dtype=int), 1)
    with pytest.raises(ValueError, match=r"\[0, 7\)"):
        generate(model, params, config, [1, 7], 1)
    with pytest.raises(TypeError, match="integer"):
        generate(model, params, config, [1.0], 1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, params, config, [1], -1)
    with pytest.raises(ValueError, match="generate_seq2seq"):
        generate("transformer", params, config, [1], 1)
    with pytest.raises(TypeError, match="logits"):
        generate(object(), params, config, [1], 1)
    config_t, params_t = _tiny_transformer()
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        generate_seq2seq(params_t, config_t, [4, 5], 7)
    with pytest.raises(ValueError, match="max_seq_len = 6"):
        generate_seq2seq(params_t, config_t, np.full(7, 4), 2)
    assert generate(model, params, config, [1, 2], 0).tolist() == [1, 2]
