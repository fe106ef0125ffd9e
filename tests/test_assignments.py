"""Course assignments: build (with the leak check), grade (isolation, scores), the student tree.

The hostile fixtures are the reference's own file with one function turned hostile; each is graded
on the hidden tests that call that function plus one that does not, which must still pass.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile

import pytest

from refmath import solutions
from refmath.assignments import manifest as manifests
from refmath.assignments import sandbox as sandboxes
from refmath.assignments.build import LeakError, assemble, build
from refmath.assignments.grade import grade, with_time_limit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = manifests.names(os.path.join(ROOT, "assignments"))

pytest.importorskip(
    "torch", reason="the hidden tests compute expected values with PyTorch: install the 'assignments' extra")
try:  # grading runs student code in a sandbox; where none can be made the grader refuses
    sandboxes.choose()
except RuntimeError as error:
    if os.environ.get("REFMATH_REQUIRE_SANDBOX") == "1":
        raise
    pytest.skip(str(error), allow_module_level=True)


def load(name):
    return manifests.load(name, os.path.join(ROOT, "assignments"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every assignment built once: {name: output folder}."""
    out = {}
    for name in NAMES:
        folder = tmp_path_factory.mktemp(name)
        build(load(name), str(folder), ROOT)
        out[name] = str(folder)
    return out


def submission_of(folder, manifest, texts):
    """Write a submission folder holding ``texts`` ({path: text}) for the manifest's files."""
    os.makedirs(folder, exist_ok=True)
    for path in manifest.files:
        target = os.path.join(folder, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            f.write(texts[path])
    return str(folder)


def reference_texts(manifest):
    texts = {}
    for path in manifest.files:
        with open(os.path.join(ROOT, path)) as f:
            texts[path] = f.read()
    return texts


def plant(text, function, code):
    """``text`` with ``code`` run first in ``function``'s solution region (at its indentation)."""
    regions = solutions.function_regions(text)[function]
    lines = text.splitlines()
    first = regions[0]
    indent = first.indent
    lines[first.begin + 1:first.begin + 1] = [indent + line for line in code.strip().splitlines()]
    return "\n".join(lines) + "\n"


# ---- regions ------------------------------------------------------------------------------------

def test_regions_are_found_stripped_and_checked():
    text = ("def f(x):\n    y = 1\n    # BEGIN SOLUTION\n    secret = x * 2\n    return secret\n"
            "    # END SOLUTION\n\n\nclass A:\n    def g(self):\n        # BEGIN SOLUTION\n"
            "        return 3\n        # END SOLUTION\n")
    grouped = solutions.function_regions(text)
    assert set(grouped) == {"f", "A.g"}
    stripped = solutions.strip_all(text)
    assert "secret" not in stripped and "return 3" not in stripped
    assert '    raise NotImplementedError("write this part: see the handout")' in stripped
    assert '        raise NotImplementedError("write this part: see the handout")' in stripped
    compile(stripped, "<stripped>", "exec")
    for bad in ("# BEGIN SOLUTION\nx\n", "x\n# END SOLUTION\n",
                "# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION\n",
                "# BEGIN SOLUTION\n# <!-- END SOLUTION -->\n"):
        with pytest.raises(ValueError, match=r"<text>:\d"):
            solutions.find_regions(bad)


def test_markdown_answers_are_stripped():
    text = "# %% [markdown]\n# Why?\n#\n# <!-- BEGIN SOLUTION -->\n# Because.\n# <!-- END SOLUTION -->\n"
    assert solutions.strip_all(text) == "# %% [markdown]\n# Why?\n#\n# *Your answer here.*\n"


@pytest.mark.parametrize("lesson", sorted(glob.glob(os.path.join(ROOT, "notebooks", "[0-9]*.py"))),
                         ids=os.path.basename)
def test_stripping_a_lesson_leaves_no_solution_line(lesson):
    # Works for lessons with no region as well as with some: a region line that the lesson also
    # has outside every region (an import, say) is not a solution line.
    with open(lesson) as f:
        text = f.read()
    regions = solutions.find_regions(text, lesson)
    inside = set(solutions.region_lines(text, regions))
    stripped = solutions.strip_all(text, lesson)
    outside = {solutions.normalise(line) for line in solutions.strip_regions(
        text, regions, lambda region: []).splitlines()}
    assert solutions.find_regions(stripped) == []
    assert not (inside - outside) & {solutions.normalise(line) for line in stripped.splitlines()}


# ---- build --------------------------------------------------------------------------------------

def test_list_shows_every_assignment():
    run = subprocess.run([sys.executable, "-m", "refmath", "assignments", "list"], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr
    for name in NAMES:
        assert f"{name}: " in run.stdout


@pytest.mark.parametrize("args, message", [
    (["build", "no_such_assignment", "--out", "x"], "no assignment 'no_such_assignment'"),
    (["grade", "attention", ".", "--jobs", "0"], "jobs must be a positive integer"),
    (["grade", "attention", ".", "--jobs", "65"], "of at most 64"),
    (["grade", "attention", "no/such/folder"], "is not a directory"),
    (["grade", "attention", ".", "--only", "nothing*"], "no hidden test of attention matches"),
])
def test_bad_input_is_refused_with_the_reason(args, message):
    run = subprocess.run([sys.executable, "-m", "refmath", "assignments", *args], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 2 and message in run.stderr, run.stderr


@pytest.mark.parametrize("name", NAMES)
def test_build_stubs_exactly_the_listed_functions(built, name):
    manifest = load(name)
    student = os.path.join(built[name], "student")
    for path, functions in manifest.functions.items():
        with open(os.path.join(student, path)) as f:
            text = f.read()
        stub = "throw std::logic_error(\"{}" if path.endswith(".cpp") else "NotImplementedError('{}"
        for function in functions:
            assert stub.format(f"{function}: see the handout {name}") in text
        assert not solutions.find_regions(text)
    for part in ("handout.py", "README.md", "pyproject.toml"):
        assert os.path.isfile(os.path.join(student, part))
    autograder = os.path.join(built[name], "autograder")
    with zipfile.ZipFile(os.path.join(autograder, "gradescope.zip")) as zf:
        names = zf.namelist()
        assert {"setup.sh", "run_autograder", f"assignments/{name}/assignment.toml"} <= set(names)
        assert zf.getinfo("run_autograder").external_attr >> 16 & 0o111


def test_the_in_place_restatements_are_not_copied(built):
    """refmath.fast.fused computes the GELU, SwiGLU and LayerNorm backward passes in place: the
    copies hold a version that calls refmath.ffn and refmath.norms instead, and the models still
    run through it."""
    with open(os.path.join(ROOT, "refmath", "fast", "fused.py")) as f:
        in_place = [line.strip() for line in f
                    if line.strip().startswith(("slope", "local", "dg ", "dx ", "projection"))]
    assert in_place
    for tree in ("student", "autograder"):
        with open(os.path.join(built["norms_ffn"], tree, "refmath", "fast", "fused.py")) as f:
            copy = f.read()
        assert "from refmath.ffn import" in copy and not any(line in copy for line in in_place)
    # The copy's fused forwards (delegating to the reference forms) give the library's values
    # exactly; the backward passes they delegate to are the assignment's, stubbed in the copy.
    code = ("import numpy as np\n"
            "from refmath.fast import fused\n"
            "rng = np.random.default_rng(0)\n"
            "h, b, g, w = rng.standard_normal((3, 8)), rng.standard_normal(8), rng.standard_normal(8), rng.standard_normal((8, 8))\n"
            # copies: the library's forms may work in place on their input
            "print(repr(float(fused.bias_gelu_forward(h.copy(), b, True)[0].sum())),\n"
            "      repr(float(fused.layernorm_forward(h.copy(), g, b)[0].sum())),\n"
            "      repr(float(fused.swiglu_forward(h.copy(), w, w, w)[0].sum())))\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=os.path.join(built["norms_ffn"], "student"),
                         capture_output=True, text=True, timeout=120)
    here = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert run.stdout.strip() == here.stdout.strip() != "", run.stderr[-2000:] + here.stderr[-2000:]


@pytest.mark.parametrize("name", NAMES)
def test_the_handout_runs_in_the_student_tree(built, name):
    student = os.path.join(built[name], "student")
    run = subprocess.run([sys.executable, "handout.py"], cwd=student, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": student, "MPLBACKEND": "Agg"})
    assert run.returncode == 0, run.stderr
    with open(os.path.join(student, "handout.py")) as f:
        assert "BEGIN SOLUTION" not in f.read()


@pytest.mark.parametrize("name", NAMES)
def test_the_public_tests_pass_once_the_functions_are_written(built, tmp_path, name):
    """Every other assignment's solutions are stubbed in a tree: its public tests and handout must
    need only this assignment's functions (and its [uses])."""
    manifest = load(name)
    student = tmp_path / "student"
    shutil.copytree(os.path.join(built[name], "student"), student)
    for path, text in reference_texts(manifest).items():
        (student / path).write_text(text)
    env = {**os.environ, "PYTHONPATH": str(student), "MPLBACKEND": "Agg"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                         cwd=student, capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stdout[-3000:]
    handout = subprocess.run([sys.executable, "handout.py"], cwd=student, capture_output=True,
                             text=True, env=env)
    assert handout.returncode == 0, handout.stderr[-3000:]


@pytest.mark.parametrize("how", ["as a line", "quoted"])
def test_a_planted_solution_line_in_the_handout_fails_the_build(tmp_path, how):
    manifest = load("attention")
    with open(os.path.join(ROOT, "refmath", "attention.py")) as f:
        text = f.read()
    region = solutions.function_regions(text)["sdpa_backward"][0]
    line = text.splitlines()[region.end - 2]  # a line of the body: "dk = (np.swapaxes(ds, ...) * scale"
    with open(manifest.path(manifest.handout)) as f:
        handout = f.read()
    planted = tmp_path / "assignments" / "attention"
    planted.mkdir(parents=True)
    for part in (manifest.hidden_tests, *manifest.public_tests, "assignment.toml"):
        (planted / part).parent.mkdir(parents=True, exist_ok=True)
        (planted / part).write_text(open(manifest.path(part)).read())
    planted_line = line.strip() if how == "as a line" else f"hint = {line.strip()!r}  # a hint"
    (planted / manifest.handout).write_text(handout + f"\n# %%\n{planted_line}\n")
    out = tmp_path / "out"
    with pytest.raises(LeakError, match="handout.py"):
        build(manifests.load("attention", str(tmp_path / "assignments")), str(out), ROOT)
    assert not out.exists()  # nothing written


@pytest.mark.parametrize("name", NAMES)
def test_no_solution_line_is_written(name):
    # assemble() is what build() writes; the leak check inside build() already passed in `built`,
    # so check the same property independently: no region line of a listed function survives.
    student, autograder, secrets = assemble(load(name), ROOT)
    assert secrets, "the leak check would compare against nothing"
    for files in (student, autograder):
        for path, text in files.items():
            assert not secrets & {solutions.normalise(line) for line in text.splitlines()}, path


# ---- grading ------------------------------------------------------------------------------------

def grade_in_bundle(autograder, name, submission, out):
    """Grade as Gradescope does: the bundle's own (stubbed) refmath runs the grader, so no solution
    is anywhere in reach."""
    run = subprocess.run([sys.executable, "-m", "refmath", "assignments", "grade", name,
                          str(submission), "--out", str(out), "--jobs", "2"], cwd=autograder,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": autograder})
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", NAMES)
def test_the_starter_scores_zero_and_the_reference_full(built, tmp_path, name):
    manifest = load(name)
    student = os.path.join(built[name], "student")
    autograder = os.path.join(built[name], "autograder")
    starter = grade(manifest, student, ROOT, jobs=2)
    assert starter["score"] == 0, [t["output"] for t in starter["tests"] if t["score"]]
    assert all("NotImplementedError" in t["output"] or "RuntimeError: online_softmax_tile: see the "
               "handout" in t["output"] for t in starter["tests"])
    reference = grade_in_bundle(autograder, name, submission_of(tmp_path / "ref", manifest,
                                                                reference_texts(manifest)),
                                tmp_path / "results.json")
    assert reference["score"] == manifest.total_points, \
        [t["output"] for t in reference["tests"] if not t["score"]]
    print(f"{name}: {manifest.total_points:g} points, {len(manifest.points)} hidden tests, "
          f"starter {starter['score']:g} in {starter['execution_time']:.1f} s, reference "
          f"{reference['score']:g} in {reference['execution_time']:.1f} s (2 jobs)")


# Each fixture: (function made hostile, its code, the tests graded, the score expected, the feedback
# expected on the failing tests). The last test of each list does not call the hostile function:
# the score expected is its points, which it keeps.
HOSTILE = {
    "hang": ("sdpa_backward", "import time\ntime.sleep(10**6)",
             "sdpa_backward_scale,gqa_head_map_values", 2, "timed out"),
    "exit": ("sdpa_forward", "import os\nos._exit(0)",
             "sdpa_forward_plain,gqa_head_map_values", 2, "before the test finished"),
    "segfault": ("gqa_head_map", "import faulthandler\nfaulthandler._sigsegv()",
                 "gqa_head_map_values,sdpa_forward_plain", 2, "segmentation fault"),
    "huge allocation": ("mha_forward", "np.ones(50 * 2**30 // 8)",
                        "mha_forward_cross,gqa_head_map_values", 2, "out of memory"),
    "output flood": ("mha_forward", "for _ in range(10**6):\n    print('x' * 99)",
                     "mha_forward_cross,gqa_head_map_values", 2, "printed"),
    "missing import": ("sdpa_forward", "import a_module_that_is_not_installed",
                       "sdpa_forward_plain,gqa_head_map_values", 2, "ModuleNotFoundError"),
    # torch's autograd would do the work: the sandbox holds no torch
    "torch import": ("sdpa_backward", "import torch",
                     "sdpa_backward_scale,gqa_head_map_values", 2, "No module named 'torch'"),
    # A backward by central differences of the forward: a plain gradient check passes it.
    "finite differences": ("sdpa_backward", """
q, k, v, a, dropout_mask, scale = cache
grads = []
for x in (q, k, v):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + 1e-6
        plus = np.sum(sdpa_forward(q, k, v, dropout_mask=dropout_mask, scale=scale)[0] * dout)
        x[i] = old - 1e-6
        minus = np.sum(sdpa_forward(q, k, v, dropout_mask=dropout_mask, scale=scale)[0] * dout)
        x[i] = old
        g[i] = (plus - minus) / 2e-6
    grads.append(g)
return tuple(grads)
""", "sdpa_backward_scale,sdpa_backward_large,gqa_head_map_values", 2, ""),
    # The complex step, Im f(x + ih) / h: exact to rounding, one forward call per input entry.
    # Every backward test has inputs too large for that within the CPU limit.
    "complex step": ("sdpa_backward", """
q, k, v, a, dropout_mask, scale = cache
def loss(q, k, v):
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    e = np.exp(s - s.real.max(axis=-1, keepdims=True))
    return np.sum((e / e.sum(axis=-1, keepdims=True)) @ v * dout)
inputs = [q.astype(complex), k.astype(complex), v.astype(complex)]
grads = []
for x in inputs:
    g = np.zeros(x.shape)
    for i in np.ndindex(x.shape):
        x[i] += 1e-30j
        g[i] = loss(*inputs).imag / 1e-30
        x[i] -= 1e-30j
    grads.append(g)
return tuple(grads)
""", "sdpa_backward_scale,gqa_head_map_values", 2, ""),
    # A forward that ignores its mask, with the backward that matches it (the cache holds the
    # unmasked weights): consistent, so a gradient check of the pair passes.
    "mask-ignoring forward": ("sdpa_forward", "mask = None",
                              "sdpa_forward_masks,sdpa_backward_masked_dropout,sdpa_forward_plain", 2,
                              "relative error"),
}


@pytest.mark.parametrize("fixture", list(HOSTILE))
def test_hostile_submissions_score_low_and_finish(tmp_path, fixture):
    manifest = load("attention")
    function, code, only, expected, feedback = HOSTILE[fixture]
    texts = reference_texts(manifest)
    path = manifest.files[0]
    texts[path] = plant(texts[path], function, code)
    limits = with_time_limit(manifest.limits, 5)
    start = time.perf_counter()
    results = grade(manifest, submission_of(tmp_path / "sub", manifest, texts), ROOT, limits,
                    only=only)
    elapsed = time.perf_counter() - start
    failed = [t for t in results["tests"] if not t["score"]]
    print(f"{fixture}: {results['score']:g} / {results['max_score']:g} in {elapsed:.1f} s; "
          + " | ".join(t["output"].splitlines()[0][:90] for t in failed))
    assert results["score"] == expected
    assert all(feedback in t["output"] for t in failed)
    n_tests = len(results["tests"])
    assert elapsed < n_tests * (limits.wall_s + 10)
    # feedback is a line about the error, never an array
    assert all("[[" not in t["output"] and "array(" not in t["output"] for t in failed)


def test_a_busy_loop_is_stopped_by_the_cpu_limit(tmp_path):
    manifest = load("attention")
    texts = reference_texts(manifest)
    path = manifest.files[0]
    texts[path] = plant(texts[path], "gqa_head_map", "while True:\n    pass")
    limits = dataclasses.replace(manifest.limits, cpu_s=2, wall_s=60)
    start = time.perf_counter()
    results = grade(manifest, submission_of(tmp_path / "sub", manifest, texts), ROOT, limits,
                    only="gqa_head_map_values")
    assert results["score"] == 0
    assert "CPU time" in results["tests"][0]["output"]
    assert time.perf_counter() - start < 30  # well before the wall-clock limit


def test_results_json_follows_gradescope_schema(tmp_path):
    manifest = load("attention")
    out = tmp_path / "results.json"
    sub = submission_of(tmp_path / "sub", manifest, reference_texts(manifest))
    run = subprocess.run([sys.executable, "-m", "refmath", "assignments", "grade", "attention", sub,
                          "--only", "gqa_head_map_values", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr
    assert "total 2 / 2" in run.stdout
    results = json.loads(out.read_text())
    assert results["score"] == 2
    (test,) = results["tests"]
    assert {"name", "score", "max_score", "output", "visibility"} <= set(test)


def test_batch_grading_writes_a_csv(tmp_path):
    manifest = load("attention")
    batch = tmp_path / "batch"
    submission_of(batch / "alice", manifest, reference_texts(manifest))
    (batch / "bob").mkdir(parents=True)  # submitted nothing: the starter
    csv_path = tmp_path / "scores.csv"
    run = subprocess.run([sys.executable, "-m", "refmath", "assignments", "grade", "attention",
                          "--batch", str(batch), "--csv", str(csv_path), "--only",
                          "gqa_head_map_values"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr
    rows = csv_path.read_text().splitlines()
    assert rows[0].startswith("submission,score,max_score")
    assert rows[1].startswith("alice,2.0,2.0") and rows[2].startswith("bob,0.0,2.0")
    assert "grading attention" in run.stderr  # the progress bar


# ---- the student tree ---------------------------------------------------------------------------

def test_student_tree_installs_and_public_tests_fail_clearly(built, tmp_path):
    student = os.path.join(built["attention"], "student")
    venv = tmp_path / "venv"
    # A fresh venv (no pip of its own) that borrows this interpreter's packages (pip, numpy, pytest,
    # setuptools) through a .pth line, which does not run their .pth files, so refmath's own
    # editable install stays out; the student tree is installed without build isolation (no index
    # needed). PYTHONPATH is dropped so that only the install can provide refmath.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site_dir = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site_dir, "borrowed.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    start = time.perf_counter()
    install = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                              "--no-index", "-e", student], capture_output=True, text=True, env=env)
    assert install.returncode == 0, install.stdout + install.stderr
    assert time.perf_counter() - start < 120
    where = subprocess.run([python, "-c", "import refmath; print(refmath.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, env=env)
    assert where.stdout.strip().startswith(student), where.stdout + where.stderr
    run = subprocess.run([python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests"],
                         cwd=student, capture_output=True, text=True, env=env)
    assert run.returncode == 1
    assert "NotImplementedError: sdpa_forward: see the handout attention" in run.stdout
