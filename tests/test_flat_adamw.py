"""FlatAdamW against the per-parameter AdamW it must equal bit for bit (catalogue O4).

The comparison with torch.optim.AdamW lives in test_optim_torch.py, which is skipped without torch.
"""
import numpy as np
import pytest

from refmath import flat_adamw
from refmath.flat_adamw import FlatAdamW
from refmath.optim import AdamW

FLAT_SHAPES = {"layers.0.attn.w_q": (5, 7), "layers.0.attn.b_q": (7,), "layers.0.ln1.gamma": (7,),
               "layers.0.ffn.w1": (7, 11), "layers.0.ffn.b1": (11,), "tok_emb": (9, 7),
               "scale.w": ()}
# three coefficients and no decay, interleaved in the dict, so the flat layout regroups them
FLAT_DECAY = {"layers.0.attn.w_q": 0.1, "layers.0.attn.b_q": 0.0, "layers.0.ln1.gamma": 0.0,
              "layers.0.ffn.w1": 0.3, "layers.0.ffn.b1": 0.0, "tok_emb": 0.05, "scale.w": 0.1}


def _flat_pair(rng, dtype, threads=1, **kwargs):
    """A per-parameter AdamW and a FlatAdamW with the same settings on copies of one dict."""
    kwargs = {"betas": (0.85, 0.97), "eps": 1e-6, "decay_of": FLAT_DECAY, **kwargs}
    ref = {n: rng.standard_normal(s).astype(dtype) for n, s in FLAT_SHAPES.items()}
    flat = {n: p.copy() for n, p in ref.items()}
    return ref, AdamW(1e-2, **kwargs), flat, FlatAdamW(flat, 1e-2, threads=threads, **kwargs)


def _random_grads(rng, params):
    # scales from 1e-4 to 10 per step: the moments and the eps term all matter somewhere
    return {n: (rng.standard_normal(p.shape) * 10 ** rng.uniform(-4, 1)).astype(p.dtype)
            for n, p in params.items()}


def _assert_same_state(ref, opt_ref, flat, opt_flat):
    for n in ref:
        np.testing.assert_array_equal(flat[n], ref[n], err_msg=n)
        for buffer in ("m", "v"):
            np.testing.assert_array_equal(opt_flat.state[buffer][n], opt_ref.state[buffer][n],
                                          err_msg=f"{buffer}.{n}")
    a, b = opt_ref.state_dict(), opt_flat.state_dict()
    assert list(a) == list(b)
    for key in a:
        np.testing.assert_array_equal(b[key], a[key], err_msg=key)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads, block_bytes", [(1, None), (1, 40), (3, 40)])
def test_flat_adamw_is_adamw_bit_for_bit(dtype, threads, block_bytes, monkeypatch):
    # Small blocks (40 bytes: 5 or 10 elements) cut parameters and decay groups in pieces, and
    # three threads share them; the default size puts each group in one block.
    if block_bytes is not None:
        monkeypatch.setattr(flat_adamw, "_BLOCK_BYTES", block_bytes)
        monkeypatch.setattr(flat_adamw, "_THREADED_BLOCK_BYTES", block_bytes)
    rng = np.random.default_rng(20)
    ref, opt_ref, flat, opt_flat = _flat_pair(rng, dtype, threads)
    assert len(opt_flat._parts) == threads
    for s in range(150):
        grads = _random_grads(rng, ref)
        if s % 7 == 0:  # a gradient that is not C-contiguous is read in the right order
            grads["layers.0.ffn.w1"] = np.asfortranarray(grads["layers.0.ffn.w1"])
        lr = 0.0 if s == 3 else float(rng.uniform(0.0, 0.05))  # a schedule: another rate each step
        opt_ref.step(ref, grads, lr)
        opt_flat.step(flat, grads, lr)
    assert opt_flat.step_count == opt_ref.step_count == 150
    _assert_same_state(ref, opt_ref, flat, opt_flat)
    assert all(p.dtype == dtype for p in flat.values())


def test_flat_adamw_keeps_the_dict_and_updates_its_views_in_place():
    rng = np.random.default_rng(21)
    params = {n: rng.standard_normal(s) for n, s in FLAT_SHAPES.items()}
    before = {n: p.copy() for n, p in params.items()}
    same_dict = params
    opt = FlatAdamW(params, 0.1, decay_of=FLAT_DECAY)
    assert params is same_dict and list(params) == list(FLAT_SHAPES)  # the order stays
    buffer = opt._buffers["p"]
    for n, p in params.items():
        assert p is opt.params[n] and np.shares_memory(p, buffer) and p.flags.c_contiguous
        np.testing.assert_array_equal(p, before[n])
        assert p.shape == before[n].shape
    assert buffer.size == sum(p.size for p in before.values())
    # The layout groups the decay coefficients: each one is a single stretch of the buffer.
    offsets = {n: (p.__array_interface__["data"][0] - buffer.__array_interface__["data"][0])
               // p.itemsize for n, p in params.items()}
    by_place = sorted(params, key=offsets.get)
    coefficients = [FLAT_DECAY[n] for n in by_place]
    assert coefficients == sorted(coefficients)
    # Writing into a view is training the buffer; re-assigning an entry is refused, unchanged.
    params["tok_emb"][...] = 0.0
    opt.step(params, {n: np.zeros_like(p) for n, p in params.items()})
    assert not params["tok_emb"].any()  # no gradient and no decay (O4 with a zero gradient)
    params["tok_emb"] = params["tok_emb"].copy()
    with pytest.raises(ValueError, match=r"params\['tok_emb'\] is not the view .* re-assigned"):
        opt.step(params, {n: np.ones_like(p) for n, p in params.items()})
    assert opt.step_count == 1


def test_flat_adamw_takes_gradients_written_into_its_buffer():
    rng = np.random.default_rng(22)
    ref, opt_ref, flat, opt_flat = _flat_pair(rng, np.float32)
    for _ in range(5):
        grads = _random_grads(rng, ref)
        for n, g in grads.items():
            opt_flat.grads[n][...] = g  # as a backward pass writing in place would
        opt_ref.step(ref, grads)
        opt_flat.step(flat, opt_flat.grads)
    _assert_same_state(ref, opt_ref, flat, opt_flat)


def test_flat_adamw_nan_in_gives_nan_out():
    rng = np.random.default_rng(23)
    ref, opt_ref, flat, opt_flat = _flat_pair(rng, np.float64)
    grads = _random_grads(rng, ref)
    grads["layers.0.ffn.w1"][2, 3] = np.nan
    opt_ref.step(ref, grads)
    opt_flat.step(flat, grads)
    assert np.isnan(flat["layers.0.ffn.w1"][2, 3]) and np.isnan(opt_flat.state["v"]["layers.0.ffn.w1"][2, 3])
    assert np.isnan(flat["layers.0.ffn.w1"]).sum() == 1  # the other elements stay finite
    for n in ref:
        np.testing.assert_array_equal(flat[n], ref[n])  # NaNs in the same places


@pytest.mark.parametrize("direction", ["per-parameter to flat", "flat to per-parameter"])
def test_flat_and_per_parameter_state_dicts_load_into_each_other(direction, tmp_path):
    rng = np.random.default_rng(24)
    ref, opt_ref, flat, opt_flat = _flat_pair(rng, np.float32)
    assert list(opt_flat.state_dict()) == list(opt_ref.state_dict()) == ["step"]  # no moments yet
    stream = [_random_grads(rng, ref) for _ in range(12)]
    source, params = (opt_ref, ref) if direction == "per-parameter to flat" else (opt_flat, flat)
    for grads in stream[:6]:
        source.step(params, grads, lr=0.02)
    np.savez(tmp_path / "state.npz", **source.state_dict())
    resumed = {n: p.copy() for n, p in params.items()}
    if direction == "per-parameter to flat":
        target = FlatAdamW(resumed, 1e-2, betas=(0.85, 0.97), eps=1e-6, decay_of=FLAT_DECAY)
    else:
        target = AdamW(1e-2, betas=(0.85, 0.97), eps=1e-6, decay_of=FLAT_DECAY)
    with np.load(tmp_path / "state.npz") as saved:
        target.load_state_dict(dict(saved))
    assert target.step_count == 6
    for grads in stream[6:]:
        source.step(params, grads, lr=0.01)
        target.step(resumed, grads, lr=0.01)
    pair = (params, source, resumed, target)
    _assert_same_state(*(pair if direction == "per-parameter to flat" else pair[2:] + pair[:2]))


def test_flat_adamw_bad_input_names_the_parameter_and_changes_nothing():
    with pytest.raises(TypeError, match=r"params must be a non-empty dict .* got an empty dict"):
        FlatAdamW({}, 0.1)
    with pytest.raises(TypeError, match=r"params\['b'\] must be a floating-point ndarray, got "
                                        r"ndarray int64"):
        FlatAdamW({"w": np.ones(2), "b": np.ones(2, dtype=np.int64)}, 0.1)
    with pytest.raises(TypeError, match=r"share one dtype .* float32 \('w' \.\.\.\), "
                                        r"float64 \('b' \.\.\.\)"):
        FlatAdamW({"w": np.ones(2, np.float32), "b": np.ones(2)}, 0.1)
    with pytest.raises(ValueError, match=r"threads must be an int >= 1, got 0"):
        FlatAdamW({"w": np.ones(2)}, 0.1, threads=0)
    with pytest.raises(ValueError, match=r"decay_of has no weight-decay entry for parameter 'b'"):
        FlatAdamW({"w": np.ones(2), "b": np.ones(2)}, 0.1, decay_of={"w": 0.1})

    params = {"layers.0.attn.w_q": np.ones((4, 4), np.float32), "layers.0.ffn.b1": np.ones(8, np.float32)}
    opt = FlatAdamW(params, 0.1)
    good = {n: np.ones_like(p) for n, p in params.items()}
    with pytest.raises(ValueError, match=r"grads has no entry for parameter 'layers.0.ffn.b1' "
                                         r"\(shape \(8,\)\)"):
        opt.step(params, {"layers.0.attn.w_q": good["layers.0.attn.w_q"]})
    with pytest.raises(ValueError, match=r"not parameters: \['stray'\]"):
        opt.step(params, {**good, "stray": np.ones(1, np.float32)})
    with pytest.raises(ValueError, match=r"params\['layers.0.attn.w_q'\].*\(4, 4\).*\(4, 3\)"):
        opt.step(params, {**good, "layers.0.attn.w_q": np.ones((4, 3), np.float32)})
    with pytest.raises(TypeError, match=r"grads\['layers.0.ffn.b1'\] must have the parameters' "
                                        r"dtype float32, got float64 \(shape \(8,\)\)"):
        opt.step(params, {**good, "layers.0.ffn.b1": np.ones(8)})
    with pytest.raises(ValueError, match=r"stay the same across steps: missing \[\], new \['x'\]"):
        opt.step({**params, "x": np.ones(1, np.float32)}, good)
    with pytest.raises(ValueError, match=r"lr must be a finite number >= 0, got -1.0"):
        opt.step(params, good, lr=-1.0)
    assert opt.step_count == 0 and np.all(params["layers.0.ffn.b1"] == 1)
    assert not opt._buffers["g"].any()  # nothing was copied in either

    opt.step(params, good)
    state = opt.state_dict()
    partial = {k: v for k, v in state.items() if k != "m.layers.0.ffn.b1"}
    with pytest.raises(ValueError, match=r"'m' entries must cover every parameter or none: "
                                         r"missing \['layers.0.ffn.b1'\]"):
        opt.load_state_dict(partial)
    with pytest.raises(ValueError, match=r"state\['v.layers.0.ffn.b1'\] must have shape \(8,\) and "
                                         r"dtype float32, got shape \(8,\) and dtype float64"):
        opt.load_state_dict({**state, "v.layers.0.ffn.b1": np.ones(8)})
    with pytest.raises(ValueError, match=r"unknown state entry 'q.w'"):
        opt.load_state_dict({**state, "q.w": np.ones(2)})
    with pytest.raises(ValueError, match=r"state\['step'\] must be an integer >= 0"):
        opt.load_state_dict({**state, "step": np.array(1.5)})
    np.testing.assert_array_equal(opt.state_dict()["m.layers.0.ffn.b1"], state["m.layers.0.ffn.b1"])
    # moments left out (an AdamW that never stepped) load as zeros
    opt.load_state_dict({"step": np.array(0)})
    assert opt.step_count == 0 and not opt._buffers["m"].any() and not opt._buffers["v"].any()
