"""refmath.inference.weight_layout: the weight matrices stored as the rows of W^T for decoding. The
same values in another memory layout, the other parameters untouched; generation from them gives
the tokens of the stored layout and float32's logits, on NumPy and on the C++ kernels."""
import types
import weakref

import numpy as np
import pytest

from refmath import kernels
from refmath.inference.generate import generate
from refmath.inference.kv_cache import generate_cached
from refmath.inference.weight_layout import decode_layout, in_decode_layout
from refmath.models import mla, model_module
from refmath.models.decoder import DecoderConfig
from refmath.models.gpt import GPTConfig
from _support import float32_rule

CONFIGS = {
    "gpt": GPTConfig(vocab_size=97, max_seq_len=16, n_layers=2, d_model=32, n_heads=4, d_ff=64,
                     norm_position="pre", tie_embeddings=False, dropout=0.0),
    "llama": DecoderConfig(vocab_size=97, max_seq_len=16, d_model=32, n_layers=2, n_heads=4,
                           n_kv_heads=2, d_ff=48, tie_embeddings=False, rope_layout="half"),
    "mla": mla.preset("tiny", vocab_size=97, max_seq_len=16),
}


def float32_params(model):
    params64 = model_module(model).init_params(CONFIGS[model], seed=0)
    return params64, {name: value.astype(np.float32) for name, value in params64.items()}


@pytest.mark.parametrize("model", sorted(CONFIGS))
def test_decode_layout_keeps_every_value_and_moves_only_the_matrices(model):
    _, params = float32_params(model)
    laid = decode_layout(params)
    assert laid.keys() == params.keys() and in_decode_layout(laid) and not in_decode_layout(params)
    moved = 0
    for name, value in params.items():
        assert laid[name].shape == value.shape and laid[name].dtype == value.dtype
        np.testing.assert_array_equal(laid[name], value)
        last = name.rsplit(".", 1)[-1]
        if value.ndim == 2 and (last.startswith("w") or last == "lm_head") \
                and last not in ("w_uk", "w_uv"):
            assert laid[name].T.flags.c_contiguous and not np.shares_memory(laid[name], value)
            moved += 1
        else:  # embedding tables, gains, biases, MLA's reshaped up-projections: the same arrays
            assert laid[name] is value
    assert moved >= 4 * CONFIGS[model].n_layers


def test_decode_layout_in_place_replaces_the_entries_of_the_same_dict():
    _, params = float32_params("llama")
    expected = decode_layout(params)
    old = dict(params)
    laid = decode_layout(params, in_place=True)
    assert laid is params and in_decode_layout(params) and laid.keys() == old.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(laid[name], value)
        assert laid[name].T.flags.c_contiguous == value.T.flags.c_contiguous
        assert (laid[name] is old[name]) == (value is old[name])  # only the matrices are new
    with pytest.raises(TypeError, match="in_place=True replaces the entries of a dict"):
        decode_layout(types.MappingProxyType(old), in_place=True)
    # where only the dict holds a matrix, it is freed as soon as its entry is replaced, before the
    # next copy is made: the memory stays the parameters plus one matrix

    class Watched(dict):
        freed = []

        def __setitem__(self, name, value):
            old = weakref.ref(self[name])
            super().__setitem__(name, value)
            self.freed.append(old() is None)

    alone = Watched({"w_q": np.ones((3, 4), np.float32), "w_o": np.ones((4, 3), np.float32)})
    decode_layout(alone, in_place=True)
    assert Watched.freed == [True, True] and in_decode_layout(alone)


def test_decode_layout_refuses_what_is_not_a_parameter_dict():
    with pytest.raises(TypeError, match="params must be a mapping"):
        decode_layout([np.zeros((2, 2))])
    with pytest.raises(TypeError, match="w_q"):
        decode_layout({"w_q": np.zeros((2, 2), dtype=np.int32)})
    assert not in_decode_layout({}) and not in_decode_layout(None)


backends = ["numpy"] + (["cpu"] if kernels.cpu_available() else [])


@pytest.mark.parametrize("backend", backends)
@pytest.mark.parametrize("model", sorted(CONFIGS))
def test_generation_in_the_decode_layout_gives_the_same_tokens(model, backend):
    """The decode layout changes only where each product's weights are read from, so the greedy
    tokens are the stored layout's and the logits are float32's: within twice the stored
    layout's float32 error of float64's, plus a few roundings of the largest logit (another
    summation order)."""
    config = CONFIGS[model]
    params64, params = float32_params(model)
    prompt = np.arange(5) % config.vocab_size
    stored = generate_cached(model, params, config, prompt, 6, greedy=True, backend=backend)
    laid = generate_cached(model, decode_layout(params), config, prompt, 6, greedy=True,
                           backend=backend)
    np.testing.assert_array_equal(laid.tokens, stored.tokens)
    ref64 = np.stack([model_module(model).logits(params64, laid.tokens[None, :5 + i], config)[0, -1]
                      for i in range(6)])
    float32_rule(f"{model} on {backend}, decode layout", laid.logits, ref64, stored.logits,
                 floor=4 * np.finfo(np.float32).eps * np.abs(ref64).max())
    tokens = generate(model, decode_layout(params), config, prompt, 6, greedy=True,
                      backend=backend)
    np.testing.assert_array_equal(tokens, stored.tokens)
