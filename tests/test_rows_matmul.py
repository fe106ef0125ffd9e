"""refmath.kernels.rows_matmul: a few float32 rows times large matrices (the products of a decode
step), against the float64 product within float32's derived summation bound, on every remainder
path of the kernel (rows of w not a multiple of 8, columns not a multiple of 8), both layouts, one
and several threads; and its refusals. Then decode steps on refmath.fast.products.kernel_products,
which route their products to it: float32's logits."""
import numpy as np
import pytest

from refmath import kernels
from refmath.fast.products import blas_products, kernel_products
from refmath.ffn import matmul_rows, matmul_rows_many
from refmath.inference import kv_cache
from refmath.inference.generate import generate
from refmath.inference.kv_cache import generate_cached
from refmath.inference.weight_layout import decode_layout
from refmath.models import model_module
from refmath.models.decoder import DecoderConfig
from refmath.models.gpt import GPTConfig
from _support import float32_rule

pytestmark = pytest.mark.skipif(not kernels.cpu_available(), reason="refmath._C is not built")
threadpoolctl = pytest.importorskip("threadpoolctl")

U32 = 2.0 ** -24  # float32's unit roundoff


def summation_bound(x, w):
    """|fl(x w) - x w| <= gamma_k (|x| |w|), gamma_k = k u / (1 - k u): the classic bound for
    any order of a float32 sum of k products (each product rounded once more, hence k + 1)."""
    k = x.shape[1] + 1
    return k * U32 / (1 - k * U32) * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)))


def check_product(y, x, w):
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert y.dtype == np.float32 and y.shape == exact.shape
    assert np.all(np.abs(y - exact) <= summation_bound(x, w))


@pytest.fixture(params=[1, 2, 3], ids=lambda t: f"{t}threads")
def threads(request):
    with threadpoolctl.threadpool_limits(request.param, user_api="openmp"):
        if kernels.cpu_threads() != request.param:
            pytest.skip("threadpoolctl does not reach refmath's OpenMP runtime here")
        yield request.param


@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("k, n", [(1, 1), (7, 9), (8, 8), (9, 17), (769, 1030), (1030, 769)])
@pytest.mark.parametrize("transposed", [False, True], ids=["w", "wT"])
def test_rows_matmul_is_the_product(threads, m, k, n, transposed):
    # (769, 1030) and (1030, 769) are large enough to be shared by every thread (a quarter million
    # multiply-adds); their k leaves a remainder after the 8-row steps and n after 8 columns.
    rng = np.random.default_rng(k * n + m)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = (rng.standard_normal((n, k), dtype=np.float32).T if transposed
         else rng.standard_normal((k, n), dtype=np.float32))
    check_product(kernels.rows_matmul(x, w), x, w)


def test_several_products_in_one_call_and_given_outputs(threads):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 640), dtype=np.float32)
    ws = [rng.standard_normal((640, 700), dtype=np.float32),
          rng.standard_normal((900, 640), dtype=np.float32).T,  # a tied head's table, transposed
          rng.standard_normal((640, 3), dtype=np.float32)]
    outs = [np.full((2, w.shape[1]), np.nan, np.float32) for w in ws]
    got = kernels.rows_matmul_many(x, ws, outs)
    for y, out, w in zip(got, outs, ws):
        assert y is out
        check_product(y, x, w)


def test_one_thread_sums_each_output_in_order_and_threads_change_only_rounding():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 1024), dtype=np.float32)
    w = rng.standard_normal((1024, 512), dtype=np.float32)
    results = []
    for t in (1, 2):
        with threadpoolctl.threadpool_limits(t, user_api="openmp"):
            results.append(kernels.rows_matmul(x, w))
    for y in results:
        check_product(y, x, w)
    # the transposed layout sums each output whole in one thread: the same bits on any team
    wt = np.ascontiguousarray(w.T).T
    with threadpoolctl.threadpool_limits(1, user_api="openmp"):
        one = kernels.rows_matmul(x, wt)
    with threadpoolctl.threadpool_limits(2, user_api="openmp"):
        assert np.array_equal(kernels.rows_matmul(x, wt), one)


def test_a_strided_matrix_is_copied_and_still_right():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 40), dtype=np.float32)
    w = rng.standard_normal((80, 60), dtype=np.float32)[::2, ::3]  # neither layout
    check_product(kernels.rows_matmul(x, w), x, w)
    check_product(kernels.rows_matmul(x[:, ::1], np.asfortranarray(w)), x, w)


@pytest.mark.parametrize("make, error, words", [
    (lambda x, w: (x.astype(np.float64), w, None), TypeError, "float32"),
    (lambda x, w: (x, w.astype(np.float16), None), TypeError, "float32"),
    (lambda x, w: (x[0], w, None), ValueError, "x.shape = (8,)"),
    (lambda x, w: (x, w[:5], None), ValueError, "w[0].shape = (5, 6)"),
    (lambda x, w: (x, w, np.empty((2, 7), np.float32)), ValueError, "out[0] must have shape (2, 6)"),
    (lambda x, w: (x, w, np.empty((2, 6), np.float64)), TypeError, "out[0] must be a native"),
    (lambda x, w: (x, w, np.empty((2, 12), np.float32)[:, ::2]), ValueError, "C-contiguous"),
])
def test_bad_arguments_are_refused_with_their_names(make, error, words):
    rng = np.random.default_rng(4)
    x, w, out = make(rng.standard_normal((2, 8), dtype=np.float32),
                     rng.standard_normal((8, 6), dtype=np.float32))
    with pytest.raises(error) as caught:
        kernels.rows_matmul(x, w, out)
    assert words in str(caught.value)


def test_outputs_that_share_memory_with_the_inputs_are_refused():
    x = np.ones((1, 8), np.float32)
    w = np.ones((8, 8), np.float32)
    with pytest.raises(ValueError, match="shares memory"):
        kernels.rows_matmul(x, w, out=w[:1])
    with pytest.raises(ValueError, match="shares memory"):
        kernels.rows_matmul(w[:1], w, out=w[1:2])
    frozen = np.empty((1, 8), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        kernels.rows_matmul(x, w, out=frozen)


def test_kernel_products_send_a_few_float32_rows_to_the_kernel_and_the_rest_to_blas():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 1, 300), dtype=np.float32)
    w = rng.standard_normal((300, 200), dtype=np.float32)
    blas = matmul_rows(x, w)
    assert np.array_equal(blas, (x.reshape(1, 300) @ w).reshape(1, 1, 200))
    assert blas_products is matmul_rows_many  # the reference ops' own products
    y, y2 = kernel_products(x, (w, w[:, :50]))
    many_rows = kernel_products(np.repeat(x, 8, axis=1), (w,))[0]  # 8 rows: BLAS again
    wide = kernel_products(x.astype(np.float64), (w,))[0]  # float64: BLAS again
    assert y.shape == (1, 1, 200) and y2.shape == (1, 1, 50)
    check_product(y.reshape(1, 200), x.reshape(1, 300), w)
    check_product(y2.reshape(1, 50), x.reshape(1, 300), w[:, :50])
    assert np.array_equal(many_rows, (np.repeat(x, 8, axis=1).reshape(8, 300) @ w).reshape(1, 8, 200))
    assert wide.dtype == np.float64


def test_up_to_eight_rows_go_to_the_kernel_for_matrices_stored_transposed(monkeypatch):
    """In kernel_products, 5 to 8 rows reach the kernel only when every matrix is stored as the
    rows of its transpose (the decode layout); 9 rows never do."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((300, 200), dtype=np.float32)
    w_t = np.ascontiguousarray(w.T).T
    calls, kernel = [], kernels.rows_matmul_many

    def counted(x, ws, outs=None):
        calls.append(x.shape[0])
        return kernel(x, ws, outs)

    monkeypatch.setattr(kernels, "rows_matmul_many", counted)
    for rows in (4, 8, 9):
        x = rng.standard_normal((rows, 300), dtype=np.float32)
        for weight in (w, w_t):
            y = kernel_products(x, (weight,))[0]
            check_product(y, x, w)
        kernel_products(x, (w_t, w))  # one matrix stored as refmath stores it: BLAS past 4
    assert calls == [4, 4, 4, 8]


@pytest.mark.parametrize("model, config", [
    ("gpt", GPTConfig(vocab_size=97, max_seq_len=16, n_layers=2, d_model=32, n_heads=4, d_ff=64,
                      norm_position="pre", tie_embeddings=True, dropout=0.0)),
    ("llama", DecoderConfig(vocab_size=97, max_seq_len=16, d_model=32, n_layers=2, n_heads=4,
                            n_kv_heads=2, d_ff=48, tie_embeddings=False, rope_layout="half")),
], ids=["gpt-tied", "llama"])
def test_decode_steps_on_kernel_products_run_their_products_on_the_kernel(model, config,
                                                                          monkeypatch):
    """With kernel_products, every product of a NumPy decode step goes through rows_matmul (the
    prefill's five rows do not, but for the tied head's), and the logits are float32's: within
    twice the plain float32 model's error of float64's. (The compiled layers, which take these
    steps by default, call the same kernel from C++: tests/inference/test_compiled_step.py.)"""
    monkeypatch.setattr(kv_cache, "_compiled_layers", lambda *args: None)
    module = model_module(model)
    params64 = module.init_params(config, seed=0)
    params = {name: value.astype(np.float32) for name, value in params64.items()}
    prompt = np.arange(5) % config.vocab_size
    calls, kernel = [], kernels.rows_matmul_many

    def counted(x, ws, outs=None):
        calls.append(x.shape[0])
        return kernel(x, ws, outs)

    monkeypatch.setattr(kernels, "rows_matmul_many", counted)
    generate_cached(model, params, config, prompt, 6, greedy=True, backend="cpu")
    assert calls == []  # not by default
    on_kernel = generate_cached(model, params, config, prompt, 6, greedy=True, backend="cpu",
                                products=kernel_products)
    monkeypatch.setattr(kernels, "rows_matmul_many", kernel)
    # per layer: Q/K/V (GPT: its one fused matrix), the output, the FFN's input(s), the FFN's
    # output; then the head. Five decode steps (the sixth token is picked, never fed).
    # The prefill's five rows stay on BLAS, but for a tied head: the token table's transpose is
    # stored as the rows of its transpose, which reach the kernel up to 8 rows.
    per_step = config.n_layers * 4 + 1
    assert calls == [5] * config.tie_embeddings + [1] * (5 * per_step)
    plain = generate_cached(model, params, config, prompt, 6, greedy=True)
    ref64 = np.stack([module.logits(params64, on_kernel.tokens[None, :5 + i], config)[0, -1]
                      for i in range(6)])
    np.testing.assert_array_equal(on_kernel.tokens, plain.tokens)
    float32_rule("decode logits with rows_matmul", on_kernel.logits, ref64, plain.logits,
                 floor=4 * np.finfo(np.float32).eps * np.abs(ref64).max())


@pytest.mark.parametrize("threads, backend, choice, layout, on_kernel", [
    (2, "cpu", None, False, True),     # generate's own choice on 2+ threads: the kernel
    (4, "cpu", None, False, True),
    (1, "cpu", None, False, False),    # on 1 thread BLAS measured faster on (in, out) rows
    (1, "cpu", None, True, True),      # and slower than the kernel on the decode layout's
    (2, "numpy", None, True, False),   # the NumPy backend stays NumPy
    (2, "cpu", False, True, False),    # products=blas_products keeps BLAS's
    (1, "cpu", True, False, True),     # products=kernel_products gets the kernel on any count
])
def test_generate_chooses_the_products_by_thread_count_unless_the_caller_chose(
        threads, backend, choice, layout, on_kernel, monkeypatch):
    config = DecoderConfig(vocab_size=97, max_seq_len=16, d_model=32, n_layers=2, n_heads=4,
                           n_kv_heads=2, d_ff=48, tie_embeddings=False, rope_layout="half")
    params = {name: value.astype(np.float32)
              for name, value in model_module("llama").init_params(config, seed=0).items()}
    if layout:
        params = decode_layout(params)
    prompt = np.arange(5)
    calls, kernel = [], kernels.rows_matmul_many

    def counted(x, ws, outs=None):
        calls.append(x.shape[0])
        return kernel(x, ws, outs)

    monkeypatch.setattr(kernels, "rows_matmul_many", counted)
    monkeypatch.setattr(kernels, "cpu_threads", lambda: threads)
    # the NumPy layers, whose products are counted here (the compiled ones run inside the same
    # choice: tests/inference/test_compiled_step.py)
    monkeypatch.setattr(kv_cache, "_compiled_layers", lambda *args: None)
    products = {None: None, True: kernel_products, False: blas_products}[choice]
    out = generate("llama", params, config, prompt, 4, greedy=True, backend=backend,
                   products=products)
    # three decode steps (the fourth token is picked from the last one), 4 products per layer
    # and the head in each; in the decode layout the prefill's 5 rows too
    per_pass = config.n_layers * 4 + 1
    assert calls == (([5] * per_pass if layout else []) + [1] * 3 * per_pass if on_kernel else [])
    monkeypatch.setattr(kernels, "rows_matmul_many", kernel)
    blas = generate("llama", params, config, prompt, 4, greedy=True, backend=backend,
                    products=blas_products)
    np.testing.assert_array_equal(out, blas)


def test_products_must_be_a_function():
    config = DecoderConfig(vocab_size=97, max_seq_len=16, d_model=32, n_layers=1, n_heads=4,
                           n_kv_heads=2, d_ff=48)
    params = model_module("llama").init_params(config, seed=0)
    with pytest.raises(TypeError, match="products must be None or a function"):
        generate("llama", params, config, np.arange(3), 2, greedy=True, products="kernel")
    with pytest.raises(TypeError, match="products must be None or a function"):
        kv_cache.prefill("llama", params, config, np.arange(3), products=True)
