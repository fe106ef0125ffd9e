"""What several test files check the same way, written once (issue 24).

* :func:`visible`: which keys each query may see (causal, sliding window), from the index rule;
* :func:`float32_rule`: a kernel's error against a float64 reference is at most ``factor`` times
  the error of a plain float32 NumPy computation of the same thing, plus a floor (DESIGN.md,
  "Checking"; each file states and computes its own floor);
* :func:`gradient_check`: every parameter of a model against finite differences of its loss.

The decode reference is :func:`refmath.inference.decode.decode_attention` with
``backend="numpy"``; the tests call it directly rather than keep a copy.

A plain module, imported as ``_support`` by test files in every folder of tests/ (conftest.py puts
tests/ on ``sys.path``); pytest collects nothing from it.
"""
import numpy as np

from refmath.gradcheck import numerical_gradient, relative_error, sample_coords


def visible(t_q, t_k, causal=False, window=None):
    """Boolean (t_q, t_k) from the rule: query i sits at p = i + t_k - t_q (the queries are the
    last t_q of the t_k positions); causal keeps keys j <= p, a window w (causal by definition)
    also keeps only j >= p - w + 1. Written out independently of refmath's masks
    (test_flash.py checks that the two agree)."""
    pos = np.arange(t_q)[:, None] + t_k - t_q
    j = np.arange(t_k)[None, :]
    keep = np.ones((t_q, t_k), dtype=bool)
    if causal or window is not None:
        keep &= j <= pos
    if window is not None:
        keep &= j >= pos - window + 1
    return keep


def float32_rule(label, kernel, ref64, plain, factor=2, floor=0.0, worst=None):
    """Assert ``max |kernel - ref64| <= factor * max |plain - ref64| + floor``.

    ``ref64`` is the float64 reference, ``plain`` the same computation in plain float32 NumPy (or
    the inputs' precision), ``floor`` what the calling file adds for the roundings no summation
    order avoids. Where ``ref64`` is infinite (-inf: a row with no visible key) the kernel must
    return it exactly; the maxima run over the other entries (a NaN there fails the check). Prints
    the worst error as a fraction of its bound (``pytest -s``), appends ``(fraction, label)`` to
    ``worst`` when given, and returns the bound.
    """
    kernel = np.asarray(kernel, dtype=np.float64)
    plain = np.asarray(plain, dtype=np.float64)
    ref64 = np.asarray(ref64, dtype=np.float64)
    infinite = np.isinf(ref64)
    np.testing.assert_array_equal(kernel[infinite], ref64[infinite], err_msg=label)
    rest = ~infinite
    kernel_err = np.abs(kernel[rest] - ref64[rest]).max(initial=0.0)
    plain_err = np.abs(plain[rest] - ref64[rest]).max(initial=0.0)
    bound = factor * plain_err + floor
    fraction = kernel_err / bound if bound > 0 else (0.0 if kernel_err == 0 else np.inf)
    if worst is not None:
        worst.append((fraction, label))
    print(f"{label}: error {kernel_err:.3g} = {fraction:.2f} of bound {bound:.3g} "
          f"(plain {plain_err:.3g})")
    assert kernel_err <= bound, f"{label}: error {kernel_err:.3g} > bound {bound:.3g}"
    return bound


def gradient_check(model, params, batch, config, train=False, seed=None, per_tensor=6):
    """Largest relative error, per parameter, between ``model.backward`` and five-point
    differences of the loss of ``model.forward`` on ``per_tensor`` sampled coordinates. With
    dropout every evaluation redraws the same masks from a generator seeded with ``seed``.
    Asserts that backward returns a gradient for every parameter, of its shape and dtype."""
    def run():
        rng = None if seed is None else np.random.default_rng(seed)
        return model.forward(params, batch, config, train=train, rng=rng)

    _, cache = run()
    grads = model.backward(cache)
    assert set(grads) == set(params)
    pick = np.random.default_rng(1)
    errors = {}
    for name, value in params.items():
        assert grads[name].shape == value.shape and grads[name].dtype == value.dtype
        coords = sample_coords(value.size, per_tensor, pick)
        numeric = numerical_gradient(lambda: float(run()[0]), value, coords)
        errors[name] = float(relative_error(grads[name].reshape(-1)[coords], numeric).max())
    return errors


def verdict_line(number, answer, inputs=None):
    """The line ``check(number, answer)`` prints, called from a namespace holding ``inputs`` (a
    lesson's check reads its inputs by name from the namespace that calls it, so they cannot be
    passed as arguments). Under ``REFMATH_LESSONS_STRICT=1`` a wrong answer raises instead."""
    from refmath.lessons import check

    space = {**(inputs or {}), "check": check, "number": number, "answer": answer}
    exec("verdict = check(number, answer)", space)
    return space["verdict"].line


def run_lesson(text, tmp_path, name="lesson.py", **env):
    """Run a lesson's ``text`` as the script ``tmp_path/name``, from ``tmp_path``, as a student's
    run without a display meets it: figures drawn off screen (Agg), one BLAS thread (the machine's
    cores are shared), wrong answers printed rather than raised; ``env`` adds variables. Returns
    the finished process (its ``stdout`` holds the verdict lines)."""
    import os
    import subprocess
    import sys

    script = tmp_path / name
    script.write_text(text)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "MPLBACKEND": "Agg",
                                             "OPENBLAS_NUM_THREADS": "1",
                                             "REFMATH_LESSONS_STRICT": "0", **env})
