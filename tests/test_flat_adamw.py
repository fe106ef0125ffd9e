"""FlatAdamW against the per-parameter AdamW it must equal bit for bit (catalogue O4), in both its
backends: the NumPy form and the C++ kernel refmath.kernels.adamw_step, which is also checked
against the NumPy form directly, on lengths around the vector width and several thread counts.

The comparison with torch.optim.AdamW lives in test_optim_torch.py, which is skipped without torch.
"""
import numpy as np
import pytest

from refmath import kernels
from refmath.fast import flat_adamw
from refmath.fast.flat_adamw import FlatAdamW
from refmath.optim import AdamW

needs_kernel = pytest.mark.skipif(not kernels.cpu_available(), reason="refmath._C is not built")
BACKENDS = ["numpy", pytest.param("cpu", marks=needs_kernel)]

FLAT_SHAPES = {"layers.0.attn.w_q": (5, 7), "layers.0.attn.b_q": (7,), "layers.0.ln1.gamma": (7,),
               "layers.0.ffn.w1": (7, 11), "layers.0.ffn.b1": (11,), "tok_emb": (9, 7),
               "scale.w": ()}
# three coefficients and no decay, interleaved in the dict, so the flat layout regroups them
FLAT_DECAY = {"layers.0.attn.w_q": 0.1, "layers.0.attn.b_q": 0.0, "layers.0.ln1.gamma": 0.0,
              "layers.0.ffn.w1": 0.3, "layers.0.ffn.b1": 0.0, "tok_emb": 0.05, "scale.w": 0.1}


def _flat_pair(rng, dtype, threads=1, backend=None, **kwargs):
    """A per-parameter AdamW and a FlatAdamW with the same settings on copies of one dict."""
    kwargs = {"betas": (0.85, 0.97), "eps": 1e-6, "decay_of": FLAT_DECAY, **kwargs}
    ref = {n: rng.standard_normal(s).astype(dtype) for n, s in FLAT_SHAPES.items()}
    flat = {n: p.copy() for n, p in ref.items()}
    return ref, AdamW(1e-2, **kwargs), flat, FlatAdamW(flat, 1e-2, threads=threads,
                                                       backend=backend, **kwargs)


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
@pytest.mark.parametrize("backend, threads, block_bytes",
                         [("numpy", 1, None), ("numpy", 1, 40), ("numpy", 3, 40),
                          *(pytest.param("cpu", t, None, marks=needs_kernel) for t in (1, 2, 3))])
def test_flat_adamw_is_adamw_bit_for_bit(dtype, backend, threads, block_bytes, monkeypatch):
    # Small blocks (40 bytes: 5 or 10 elements) cut parameters and decay groups in pieces, and
    # three threads share them; the default size puts each group in one block. The kernel cuts the
    # 348 elements into whole 64-byte lines: 2 or 3 threads cut parameters and decay groups.
    if block_bytes is not None:
        monkeypatch.setattr(flat_adamw, "_BLOCK_BYTES", block_bytes)
        monkeypatch.setattr(flat_adamw, "_THREADED_BLOCK_BYTES", block_bytes)
    rng = np.random.default_rng(20)
    ref, opt_ref, flat, opt_flat = _flat_pair(rng, dtype, threads, backend)
    assert opt_flat.backend == backend
    if backend == "numpy":
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_flat_adamw_takes_gradients_written_into_its_buffer(backend):
    rng = np.random.default_rng(22)
    ref, opt_ref, flat, opt_flat = _flat_pair(rng, np.float32, backend=backend)
    for s in range(5):
        grads = _random_grads(rng, ref)
        for n, g in grads.items():
            opt_flat.grads[n][...] = g  # as a backward pass writing in place would
        mixed = dict(opt_flat.grads)
        if s % 2:  # some gradients in the buffer, others in arrays of their own
            mixed["tok_emb"] = grads["tok_emb"].copy()
        opt_ref.step(ref, grads)
        opt_flat.step(flat, mixed)
    _assert_same_state(ref, opt_ref, flat, opt_flat)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flat_adamw_nan_in_gives_nan_out(backend):
    rng = np.random.default_rng(23)
    ref, opt_ref, flat, opt_flat = _flat_pair(rng, np.float64, backend=backend)
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
    with pytest.raises(ValueError, match=r"threads must be an int in \[1, 256\], got 0"):
        FlatAdamW({"w": np.ones(2)}, 0.1, threads=0)
    with pytest.raises(ValueError, match=r"backend must be one of 'numpy', 'cpu', got 'cuda'"):
        FlatAdamW({"w": np.ones(2)}, 0.1, backend="cuda")
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


# ---- the kernel, refmath.kernels.adamw_step, against the NumPy form ----

def _scalars(dtype, lr, step, betas=(0.9, 0.999), eps=1e-8):
    """The step's scalars as FlatAdamW rounds them: Python floats rounded once to ``dtype``."""
    (b1, b2), real = betas, np.dtype(dtype).type
    return (real(b1), real(1 - b1), real(b2), real(1 - b2), real(1 - b1**step),
            real(1 - b2**step), real(lr), real(eps))


def _numpy_step(p, pieces, m, v, shrink, scalars):
    """The NumPy form (flat_adamw._adamw_part) over the same pieces, piece k decayed by
    shrink[k] (a factor of 1 takes the form's no-decay path, which skips the multiplication)."""
    blocks, lo = [], 0
    for k, g in enumerate(pieces):
        hi = lo + g.size
        blocks.append((p[lo:hi], g, m[lo:hi], v[lo:hi], np.empty_like(g), np.empty_like(g),
                       0 if shrink[k] == 1 else k + 1))
        lo = hi
    factors = {k + 1: p.dtype.type(f) for k, f in enumerate(shrink)}
    flat_adamw._adamw_part([], blocks, {}, (*scalars, factors))


def _cut(rng, n, parts):
    """``parts`` random piece lengths adding up to ``n`` (empty pieces included)."""
    cuts = np.sort(rng.integers(0, n + 1, parts - 1))
    return np.diff(np.concatenate([[0], cuts, [n]])).astype(int)


@needs_kernel
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 15, 17, 63, 100, 1001, 4099])
@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_kernel_is_the_numpy_form_bit_for_bit(dtype, n, threads):
    # Lengths below, at and around the 4- and 8-lane vectors and the 16-float cache line (the
    # threads' unit), so that vector bodies, scalar tails and thread cuts all fall inside pieces.
    rng = np.random.default_rng(n * 31 + threads)
    p = rng.standard_normal(n).astype(dtype)
    m, v = np.zeros(n, dtype), np.zeros(n, dtype)
    want_p, want_m, want_v = p.copy(), m.copy(), v.copy()
    lengths = _cut(rng, n, int(rng.integers(1, 6)))
    for step in range(1, 31):
        scale = 10 ** rng.uniform(-4, 1)
        pieces = [(rng.standard_normal(k) * scale).astype(dtype) for k in lengths]
        lr = float(rng.uniform(0.0, 0.05))
        shrink = [1.0 if k % 2 else float(np.dtype(dtype).type(1 - lr * 0.1 * (k + 1)))
                  for k in range(len(pieces))]
        scalars = _scalars(dtype, lr, step)
        kernels.adamw_step(p, pieces, m, v, shrink, scalars, threads)
        _numpy_step(want_p, pieces, want_m, want_v, shrink, scalars)
        for got, want, name in ((p, want_p, "p"), (m, want_m, "m"), (v, want_v, "v")):
            assert np.array_equal(got, want), f"{name} differs at step {step}"


@needs_kernel
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernel_passes_nan_and_inf_on(dtype):
    p = np.linspace(-1, 1, 37).astype(dtype)
    g = np.linspace(-2, 3, 37).astype(dtype)
    m, v = np.full(37, 0.1, dtype), np.full(37, 0.2, dtype)
    g[3], g[20], p[30] = np.nan, np.inf, -np.inf
    want = (p.copy(), m.copy(), v.copy())
    scalars = _scalars(dtype, 1e-3, 4)
    kernels.adamw_step(p, [g], m, v, [0.999], scalars, 2)
    with np.errstate(invalid="ignore"):  # inf - inf and inf / inf: NaN is the answer
        _numpy_step(want[0], [g], want[1], want[2], [0.999], scalars)
    for got, expected in zip((p, m, v), want):
        assert np.array_equal(got, expected, equal_nan=True)
    assert np.isnan(p[3]) and np.isnan(p[20]) and np.isneginf(p[30])


@needs_kernel
def test_kernel_refuses_bad_input_with_the_argument_named():
    f32 = np.float32
    p, m, v, g = (np.ones(8, f32) for _ in range(4))
    ok = dict(shrink=[1.0], scalars=_scalars(f32, 1e-3, 1), threads=1)

    def call(p=p, g=(g,), m=m, v=v, **kw):
        kernels.adamw_step(p, list(g), m, v, **{**ok, **kw})

    cases = [
        (TypeError, r"m must be a native-byte-order float32 array \(the dtype of p\), got dtype "
                    r"float64", dict(m=np.ones(8))),
        (TypeError, r"g\[0\] must be a native-byte-order float32 .* got dtype float64",
         dict(g=[np.ones(8)])),
        (TypeError, r"p must be float32 or float64, got dtype int64",
         dict(p=np.ones(8, np.int64))),
        (TypeError, r"v must be a native-byte-order float32 .* got dtype >f4",
         dict(v=np.ones(8, ">f4"))),
        (TypeError, r"g\[0\] must be a NumPy array, got list", dict(g=[[1.0] * 8])),
        (ValueError, r"m and v must have the length of p \(8,\), got m \(7,\) and v \(8,\)",
         dict(m=np.ones(7, f32))),
        (ValueError, r"p must be 1-D, got shape \(2, 4\)", dict(p=np.ones((2, 4), f32))),
        (ValueError, r"v must be contiguous and aligned, got a strided view of shape \(8,\)",
         dict(v=np.ones(16, f32)[::2])),
        (ValueError, r"the gradient pieces g must cover p end to end: their lengths add up to 7, "
                     r"p has 8", dict(g=[np.ones(7, f32)])),
        (ValueError, r"shrink must hold one factor per gradient piece: 2 pieces, 1 factors",
         dict(g=[np.ones(4, f32), np.ones(4, f32)])),
        (ValueError, r"scalars must be \(beta1, .*\), got 3 numbers", dict(scalars=(0.9, 0.1, 1.0))),
        (ValueError, r"threads must be an int in \[1, 256\], got 0", dict(threads=0)),
        (ValueError, r"threads must be an int in \[1, 256\], got 1000", dict(threads=1000)),
        (ValueError, r"p, m and v must be separate arrays", dict(v=m)),
        (ValueError, r"g\[0\] shares memory with p, m or v", dict(g=[p])),
    ]
    for error, message, bad in cases:
        with pytest.raises(error, match=message):
            call(**bad)
    readonly = np.ones(8, f32)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match=r"p must be writeable: it is updated in place"):
        call(p=readonly)
    # Refused before anything is written.
    assert all(np.all(a == 1) for a in (p, m, v, g))
    call()  # and the same arguments, corrected, run
    assert not np.all(p == 1)


def test_flat_adamw_picks_the_kernel_where_it_is_built(monkeypatch):
    params = {"w": np.ones(3)}
    want = "cpu" if kernels.cpu_available() else "numpy"
    assert FlatAdamW(dict(params), 0.1).backend == want
    assert FlatAdamW(dict(params), 0.1, backend="numpy").backend == "numpy"
    monkeypatch.setattr(kernels, "_C", None)  # as in a tree built without the extension
    assert FlatAdamW(dict(params), 0.1).backend == "numpy"
    with pytest.raises(ImportError, match=r"backend='cpu'\) needs the compiled extension"):
        FlatAdamW(dict(params), 0.1, backend="cpu")
