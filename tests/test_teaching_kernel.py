"""The teaching kernel of csrc/teaching (the kernel assignment): the reference against dense
attention, its errors for bad input, and the hidden tests against typical slips in the C++."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from refmath.teaching_kernel import BuildError, build, compiler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:
    compiler()
    import pybind11  # noqa: F401
except (BuildError, ImportError) as error:
    pytest.skip(f"the teaching kernel needs a C++ compiler and pybind11: {error}",
                allow_module_level=True)


@pytest.fixture(scope="module")
def kernel():
    return build()


def dense(q, k, v, causal):
    s = q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64) / np.sqrt(q.shape[-1])
    t_q, t_k = s.shape[-2:]
    if causal:
        s = np.where(np.tril(np.ones((t_q, t_k), dtype=bool), t_k - t_q), s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    seen = np.isfinite(m)
    p = np.exp(s - np.where(seen, m, 0))
    l = p.sum(axis=-1, keepdims=True)
    o = np.where(seen, (p @ v) / np.where(seen, l, 1), 0)
    return o, np.where(seen, m + np.log(np.where(seen, l, 1)), -np.inf)[..., 0]


@pytest.mark.parametrize("shape_q, t_k, causal, block", [
    ((7, 4), 7, False, 3), ((2, 3, 37, 16), 53, True, 16), ((10, 8), 6, True, 4),
    ((1, 64, 32), 64, True, 64), ((3, 5, 8), 9, False, 1),
])
def test_the_reference_kernel_equals_dense_attention(kernel, shape_q, t_k, causal, block):
    rng = np.random.default_rng(0)
    q = rng.standard_normal(shape_q).astype(np.float32)
    k = rng.standard_normal(shape_q[:-2] + (t_k, shape_q[-1])).astype(np.float32)
    v = rng.standard_normal(shape_q[:-2] + (t_k, 5)).astype(np.float32)
    o, lse = kernel.flash_forward(q, k, v, causal, block, block)
    expected_o, expected_lse = dense(q, k, v, causal)
    assert o.dtype == np.float32 and o.shape == expected_o.shape
    np.testing.assert_allclose(o, expected_o, atol=3e-6)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(expected_lse))  # rows that see nothing
    np.testing.assert_allclose(lse[np.isfinite(lse)], expected_lse[np.isfinite(expected_lse)],
                               atol=3e-6)


def test_nan_in_gives_nan_out(kernel):
    q, k, v = (np.ones((4, 2), np.float32) for _ in range(3))
    q[1, 0] = np.nan
    o, lse = kernel.flash_forward(q, k, v, False, 2, 2)
    assert np.isnan(o[1]).all() and np.isnan(lse[1]) and np.isfinite(o[[0, 2, 3]]).all()


@pytest.mark.parametrize("shapes, options, message", [
    (((4,), (4, 2), (4, 2)), {}, "same number"),
    (((2, 4, 3), (3, 4, 3), (3, 4, 3)), {}, "leading dimensions"),
    (((4, 3), (5, 2), (5, 2)), {}, r"k must be \(\.\.\., T_k, d\)"),
    (((4, 3), (5, 3), (6, 2)), {}, r"v \(\.\.\., T_k, dv\)"),
    (((4, 3), (5, 3), (5, 2)), {"block_q": 0}, "block_q and block_k must be >= 1"),
])
def test_bad_input_is_refused_with_the_shapes(kernel, shapes, options, message):
    arrays = [np.zeros(s, np.float32) for s in shapes]
    with pytest.raises(ValueError, match=message):
        kernel.flash_forward(*arrays, **options)


# ---- the hidden tests against slips ----------------------------------------------------------

SLIPS = {
    # the folded state is not rescaled to the new maximum
    "no rescale": ("        for (int j = 0; j < dv; ++j) out[j] *= rescale;\n", ""),
    # the weights against the old maximum
    "old maximum": ("const float p = std::exp(s[c] - m_new);", "const float p = std::exp(s[c] - m[r]);"),
    # exp(s) without subtracting any maximum: overflows once scores pass 88
    "no maximum": ("const float p = std::exp(s[c] - m_new);",
                   "const float p = std::exp(s[c]) * std::exp(-m_new);"),
    # a row that has seen nothing goes through exp(-inf - (-inf)) = NaN
    "no empty-row guard": ("        if (m_new == neg_inf) continue;\n", ""),
    # the scale forgotten
    "no scale": ("s[c] = scale * dot;", "s[c] = dot;"),
}


@pytest.fixture(scope="module")
def kernel_grading():
    from refmath.assignments import manifest as manifests
    from refmath.assignments import sandbox as sandboxes
    from refmath.assignments.grade import load_hidden_tests, secret_paths
    pytest.importorskip("torch", reason="the grader imports torch for the other assignments")
    m = manifests.load("kernel", os.path.join(ROOT, "assignments"))
    try:
        sandbox = sandboxes.choose(unreadable=secret_paths(m, ROOT))
    except RuntimeError as error:
        if os.environ.get("REFMATH_REQUIRE_SANDBOX") == "1":
            raise
        pytest.skip(str(error))
    return m, sandbox, load_hidden_tests(m)


def submit(folder, text):
    target = folder / "csrc" / "teaching"
    target.mkdir(parents=True)
    (target / "flash_tile.cpp").write_text(text)
    return str(folder)


@pytest.mark.parametrize("slip", list(SLIPS))
def test_each_slip_loses_points(kernel_grading, tmp_path, slip):
    from refmath.assignments.grade import grade
    m, sandbox, hidden = kernel_grading
    with open(os.path.join(ROOT, "csrc", "teaching", "flash_tile.cpp")) as f:
        reference = f.read()
    old, new = SLIPS[slip]
    assert old in reference
    results = grade(m, submit(tmp_path, reference.replace(old, new)), ROOT, jobs=2,
                    sandbox=sandbox, hidden=hidden)
    failed = [t["name"] for t in results["tests"] if not t["score"]]
    print(f"{slip}: {results['score']:g} / {results['max_score']:g}; fails {failed}")
    assert results["score"] < results["max_score"]


def test_a_compile_error_is_quoted_in_the_feedback(kernel_grading, tmp_path):
    from refmath.assignments.grade import grade
    m, sandbox, hidden = kernel_grading
    with open(os.path.join(ROOT, "csrc", "teaching", "flash_tile.cpp")) as f:
        broken = f.read().replace("m[r] = m_new;", "m[r] = m_new  // no semicolon")
    results = grade(m, submit(tmp_path, broken), ROOT, only="forward_one_head", sandbox=sandbox,
                    hidden=hidden)
    (test,) = results["tests"]
    assert results["score"] == 0
    assert "BuildError: compiling flash_tile.cpp failed" in test["output"]
    assert "\n| " in test["output"] and "error:" in test["output"]  # the compiler's own words


def test_the_student_copy_builds_and_says_what_to_write(tmp_path):
    from refmath.assignments import manifest as manifests
    from refmath.assignments.build import build as build_assignment
    build_assignment(manifests.load("kernel", os.path.join(ROOT, "assignments")),
                     str(tmp_path / "out"), ROOT)
    student = tmp_path / "out" / "student" / "csrc" / "teaching"
    assert "BEGIN SOLUTION" not in (student / "flash_tile.cpp").read_text()
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "out" / "student", copy)
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", "from refmath.teaching_kernel import build\n"
                          "import numpy as np\nx = np.ones((2, 2), np.float32)\n"
                          "build().flash_forward(x, x, x)"], cwd=copy, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(copy)})
    assert "RuntimeError: online_softmax_tile: see the handout kernel" in run.stderr, run.stderr
