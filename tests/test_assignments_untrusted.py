"""Every byte a student controls is untrusted input: the readers never raise anything but their own
error, a submission's files are read as data, and one submission never touches another's grade.

The fuzz tests drive the three readers of student bytes (the Python extractor, the C++ function
matcher, the wire reader) with generated hostile input. The submissions below are graded through
the real ``grade`` and ``--batch`` paths, in a batch where an honest submission comes before and
after every attacker, on two tests of the attention assignment: ``sdpa_forward_plain`` (2 points)
and ``gqa_head_map_values`` (2 points).
"""
from __future__ import annotations

import csv
import json
import os
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refmath.assignments import grade as grading
from refmath.assignments import sandbox as sandboxes
from refmath.assignments import wire
from refmath.assignments.extract import cpp_functions, take_functions
from refmath.assignments.grade import (grade, grade_batch, load_hidden_tests, secret_paths, summary,
                                      with_time_limit)
from refmath.assignments.submission import MAX_FILE_BYTES
from refmath.assignments.text import clean, csv_cell

from test_assignments_hostile import (ONLY, RECOMPUTE_SOURCE, ROOT, manifest, planted, reference_text,
                                     write_submission)

TRIED = {"extractor": 0, "cpp": 0, "wire": 0}
GIVEN = "import numpy as np\n\n\ndef wanted(x):\n    raise NotImplementedError\n\n\nclass Cache:\n" \
        "    def append(self, k):\n        raise NotImplementedError\n"
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))

# ---- the readers never raise anything but their own error ----------------------------------------

# Pieces that hostile sources are made of: deep nesting, NUL, encodings, decorators, defaults.
PY_PIECES = st.sampled_from([
    "def wanted(x):\n", "    return x\n", "@", "(", ")", "[", "-", "~", "not ", "lambda: ", "\0", "\ufeff",
    "\x1b[2J", "class Cache:\n", "    def append(self, k", "=", "[]", "):\n", "        pass\n", "\t",
    "\\\n", '"""', "'", "#", "async ", "yield ", "global x\n", "\r", "\n", " ", "\u202e", "x",
])


@st.composite
def python_sources(draw):
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.text(max_size=400))
    if kind == 1:
        return "".join(draw(st.lists(PY_PIECES, max_size=60)))
    depth = draw(st.integers(1, 200_000))
    opener = draw(st.sampled_from(["-", "(", "[", "not ", "~", "a.", "f("]))
    return f"def wanted(x):\n    return {opener * depth}1\n"


@FUZZ
@given(python_sources())
def test_the_extractor_returns_for_any_source(source):
    TRIED["extractor"] += 1
    text, notes = take_functions(GIVEN, source, ["wanted", "Cache.append"], "refmath/m.py")
    assert isinstance(text, str) and all(isinstance(n, str) for n in notes)
    compile(text, "refmath/m.py", "exec")  # what is graded always parses


@FUZZ
@given(st.one_of(st.text(alphabet="{}()/*'\"\\\n;#=ab ", max_size=300), st.text(max_size=300)))
def test_the_cpp_matcher_returns_for_any_source(source):
    TRIED["cpp"] += 1
    found = cpp_functions(source)
    lines = source.count("\n")
    assert all(0 <= a <= b <= lines for a, b in found.values())


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)
SPEC = st.fixed_dictionaries({"dtype": st.sampled_from(sorted(wire.DTYPES) + ["|O", "<c16", 3]),
                              "shape": st.one_of(st.lists(st.sampled_from([0, 1, 2, 7, 2**31, 2**62,
                                                                           -1, True]), max_size=9),
                                                 JSON)})


@st.composite
def messages(draw):
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=300))
    if kind == 1:  # nested far past any recursion limit
        depth = draw(st.integers(1, 100_000))
        return b'{"status": "ok", "value": ' + b"[" * depth + b"]" * depth + b', "arrays": []}\n'
    head = {"status": "ok", "arrays": draw(st.lists(SPEC, max_size=4)),
            "value": draw(st.one_of(JSON, st.just({"a": {"__array__": draw(JSON)}})))}
    if kind == 3:
        head = draw(JSON)
    return json.dumps(head).encode() + b"\n" + draw(st.binary(max_size=200))


@FUZZ
@given(messages())
def test_the_wire_reader_raises_only_wire_errors(data):
    TRIED["wire"] += 1
    try:
        wire.decode(data, max_bytes=1 << 16)
    except wire.WireError:
        pass
    read, write = os.pipe()
    try:
        os.write(write, data[:60000])
        os.close(write)
        write = None
        wire.read_message(read, time.monotonic() + 5, 1 << 16)
    except (wire.WireError, EOFError):
        pass
    finally:
        os.close(read)
        if write is not None:
            os.close(write)


def test_the_fuzzers_tried_what_they_say():
    print(f"fuzz inputs tried: {TRIED}")
    assert all(n >= 100 for n in TRIED.values()) or sum(TRIED.values()) == 0  # run alone: none


# ---- text from a submission is shown escaped -------------------------------------------------

def test_control_and_format_characters_are_escaped_and_formulas_quoted():
    assert clean("a\x1b]0;owned\x07b\rc\u202ed") == "a\\x1b]0;owned\\x07b\\rc\\u202ed"
    assert csv_cell("=HYPERLINK(\"http://x\")") == "'=HYPERLINK(\"http://x\")"
    assert csv_cell("-2+3") == "'-2+3" and csv_cell("alice") == "alice" and csv_cell(2.5) == 2.5


# ---- submissions graded as untrusted data, in one batch ----------------------------------------

def pipe_writer(header: bytes) -> str:
    """Planted code that writes ``header`` as the result message, then leaves."""
    return f"""
import os, stat
for fd in range(3, 64):
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.write(fd, {header!r})
    except OSError:
        pass
os._exit(0)
"""


ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b[1A\rtotal 4 / 4\u202e"
LINKS_AND_FILES = {  # name -> (what it does to the folder, what its feedback must name)
    "link_to_the_graders_cwd": "is a symbolic link",
    "link_to_a_classmate": "is a symbolic link",
    "link_as_the_submission": "is a symbolic link",
    "hard_link": "is a hard link",
    "fifo": "is not a regular file",
    "huge_file": "bytes",
    "utf16": "UTF-16",
    "nul_byte": "NUL byte",
    "latin1": "not UTF-8",
}


def make_file_attack(folder, name: str, honest: str) -> None:
    package = folder / name / "refmath"
    if name == "link_as_the_submission":
        os.symlink(os.path.join(honest, ""), folder / name)
        return
    if name == "link_to_the_graders_cwd":  # the reference, when graded from a checkout
        (folder / name).mkdir()
        os.symlink("/proc/self/cwd/refmath", package)
        return
    if name == "link_to_a_classmate":
        (folder / name).mkdir()
        os.symlink(os.path.join("..", os.path.basename(honest), "refmath"), package)
        return
    package.mkdir(parents=True)
    target = package / "attention.py"
    if name == "hard_link":  # a second name for a file elsewhere (here, outside the batch)
        outside = folder.parent / f"{folder.name}-outside.py"
        outside.write_text(reference_text())
        os.link(outside, target)
    elif name == "fifo":
        os.mkfifo(target)
    elif name == "huge_file":
        target.write_text(reference_text() + "#" * MAX_FILE_BYTES)
    elif name == "utf16":
        target.write_bytes(reference_text().encode("utf-16"))
    elif name == "nul_byte":
        target.write_bytes(reference_text().encode() + b"\0")
    elif name == "latin1":
        target.write_bytes(("# café\n" + reference_text()).encode("latin-1"))


DEEP = "(" * 100 + "x" + ")" * 100
CODE_ATTACKS = {  # name -> planted code, each deserving the 2 points of gqa_head_map_values
    "nested_json_header": pipe_writer(b'{"status": "ok", "value": ' + b"[" * 200000 + b"]" * 200000
                                      + b', "arrays": []}\n'),
    "zero_size_shape": pipe_writer(b'{"status": "ok", "value": {"o": {"__array__": 0}}, "arrays": '
                                   b'[{"dtype": "<f8", "shape": [0, 4611686018427387904, '
                                   b'4611686018427387904]}]}\n'),
    "forged_error_text": f"raise type({ESCAPES!r}, (Exception,), {{}})({ESCAPES!r})\n",
    "forged_error_header": pipe_writer(json.dumps({"status": "error", "error": ESCAPES,
                                                   "message": ESCAPES, "where": ESCAPES}).encode()
                                       + b"\n"),
}


def deep_expression_file() -> str:
    """The reference with an expression so deep that the parser raises (RecursionError/MemoryError)."""
    return reference_text() + "\nx = " + "-" * 300_000 + "1\n"


@pytest.fixture(scope="module")
def untrusted_batch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("untrusted")
    honest = write_submission(folder / "a_honest", reference_text())
    write_submission(folder / "z_honest", reference_text())
    for name in LINKS_AND_FILES:
        make_file_attack(folder, name, honest)
    for name, code in CODE_ATTACKS.items():
        write_submission(folder / name, planted(code))
    write_submission(folder / "deep_expression", deep_expression_file())
    (folder / ESCAPES.replace("/", "")).mkdir()  # a folder named to attack the terminal and CSV
    (folder / "=HYPERLINK(1)").mkdir()
    return folder


def expected_scores() -> dict[str, float]:
    return {"a_honest": 4.0, "z_honest": 4.0, **{n: 0.0 for n in LINKS_AND_FILES},
            **{n: 2.0 for n in CODE_ATTACKS}, "deep_expression": 0.0,
            clean(ESCAPES.replace("/", "")): 0.0, "=HYPERLINK(1)": 0.0}


@pytest.fixture(scope="module")
def hostile_sandbox():
    """The sandbox the grader chooses here; CI (REFMATH_REQUIRE_SANDBOX=1) fails without one."""
    try:
        return sandboxes.choose(unreadable=secret_paths(manifest(), ROOT))
    except RuntimeError as error:
        if os.environ.get("REFMATH_REQUIRE_SANDBOX") == "1":
            raise
        pytest.skip(str(error))


def test_every_untrusted_submission_alone_through_grade(untrusted_batch, hostile_sandbox, monkeypatch):
    monkeypatch.chdir(ROOT)  # the instructor grading from the checkout: /proc/self/cwd is the reference
    m = manifest()
    limits, hidden = with_time_limit(m.limits, 10), load_hidden_tests(m)
    for name in sorted(os.listdir(untrusted_batch)):
        results = grade(m, str(untrusted_batch / name), ROOT, limits, only=ONLY,
                        sandbox=hostile_sandbox, hidden=hidden)
        shown = summary(results)
        assert results["score"] == expected_scores()[clean(name)], (name, shown)
        assert not any(c in shown for c in "\x1b\x07\r\u202e"), shown
        assert not any(c in json.dumps(results, ensure_ascii=False) for c in "\x1b\x07\u202e")
        if name in LINKS_AND_FILES:
            reason = LINKS_AND_FILES[name]
            assert all(reason in t["output"] for t in results["tests"]), (name, shown)
            assert reason in shown and "\n" not in results["tests"][0]["output"]


def test_one_batch_grades_everyone_and_no_attacker_moves_another_score(untrusted_batch, hostile_sandbox,
                                                                       monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    m = manifest()
    csv_path = tmp_path / "scores.csv"
    rows = grade_batch(m, str(untrusted_batch), str(csv_path), ROOT, with_time_limit(m.limits, 10),
                       show_progress=False, only=ONLY, sandbox=hostile_sandbox)
    assert {r["submission"]: r["score"] for r in rows} == expected_scores()
    with open(csv_path, newline="") as f:
        table = list(csv.reader(f))
    assert len(table) == 1 + len(expected_scores())
    cells = [cell for row in table for cell in row]
    assert not any(c in cell for cell in cells for c in "\x1b\x07\r\u202e")
    assert not any(cell.startswith(("=", "+", "-", "@")) for cell in cells)
    assert "'=HYPERLINK(1)" in cells


def test_an_interrupted_batch_keeps_the_rows_it_wrote(tmp_path, hostile_sandbox, monkeypatch):
    for name in ("a", "b", "c"):
        write_submission(tmp_path / "batch" / name, reference_text())
    real, graded = grading.grade, []

    def grade_then_stop(*args, **kwargs):
        if len(graded) == 2:
            raise KeyboardInterrupt
        graded.append(args[1])
        return real(*args, **kwargs)
    monkeypatch.setattr(grading, "grade", grade_then_stop)
    m = manifest()
    with pytest.raises(KeyboardInterrupt):
        grade_batch(m, str(tmp_path / "batch"), str(tmp_path / "scores.csv"), ROOT,
                    with_time_limit(m.limits, 10), show_progress=False, only=ONLY,
                    sandbox=hostile_sandbox)
    with open(tmp_path / "scores.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["submission"], float(r["score"])) for r in rows] == [("a", 4.0), ("b", 4.0)]


def test_the_arrays_that_come_back_are_the_ones_declared():
    value = {"o": np.arange(6.0).reshape(2, 3), "e": np.zeros((0, 5), np.float32)}
    _, back = wire.decode(wire.encode({"status": "ok"}, value))
    assert np.array_equal(back["o"], value["o"]) and back["e"].shape == (0, 5)


# ---- only the student's function bodies cross ---------------------------------------------------

SIGNATURE = "_cached_attention(cache, layer, q, k, v, offset, window=None, scale=None, softcap=None)"
REBINDERS = {
    "decorator": f"@(lambda f: exec({RECOMPUTE_SOURCE!r}, __import__('sys').modules["
                 f"'refmath.inference.kv_cache'].__dict__) or f)\ndef {SIGNATURE}:\n"
                 "    raise NotImplementedError\n",
    "default value": f"def {SIGNATURE.replace('softcap=None', 'softcap=exec(' + repr(RECOMPUTE_SOURCE) + ')')}:\n"
                     "    raise NotImplementedError\n",
    # on its first call, rebinds the module's prefill and decode_step by name, then answers that
    # call with plain causal attention over what it was given (right for a prefill from nothing)
    "global statement": f"def {SIGNATURE}:\n    global prefill, decode_step\n" + "".join(
        f"    {line}\n" for line in RECOMPUTE_SOURCE.strip().splitlines()) + """
    from refmath.attention import causal_mask, sdpa_forward
    return sdpa_forward(q, np.repeat(k, q.shape[1] // k.shape[1], 1),
                        np.repeat(v, q.shape[1] // v.shape[1], 1), mask=causal_mask(q.shape[2]))[0]
""",
    "module attribute": f"def {SIGNATURE}:\n    import refmath.inference.kv_cache as given\n"
                        "    given.decode_step = None\n    raise NotImplementedError\n",
}


@pytest.mark.parametrize("how", list(REBINDERS))
def test_given_code_cannot_be_rebound_by_a_submission(tmp_path, hostile_sandbox, how):
    m = manifests_load("inference")
    with open(os.path.join(ROOT, "refmath", "inference", "kv_cache.py")) as f:
        reference = f.read()
    start = reference.index("def _cached_attention(")
    end = reference.index("\ndef ", start + 10)
    submission = tmp_path / "sub" / "refmath"
    (submission / "inference").mkdir(parents=True)
    (submission / "models").mkdir()
    (submission / "inference" / "kv_cache.py").write_text(reference[:start] + REBINDERS[how] +
                                                          reference[end:])
    with open(os.path.join(ROOT, "refmath", "models", "decoder.py")) as f:  # written honestly
        (submission / "models" / "decoder.py").write_text(f.read())
    results = grade(m, str(tmp_path / "sub"), ROOT, with_time_limit(m.limits, 20),
                    only="cached_logits_equal_recompute,generated_tokens_identical",
                    sandbox=hostile_sandbox)
    assert results["score"] == 0, summary(results)
    if how != "global statement":
        assert "refused" in results["output"], results["output"]


def manifests_load(name):
    from refmath.assignments import manifest as manifests
    return manifests.load(name, os.path.join(ROOT, "assignments"))


# ---- memory, measured outside the student and bounded per test ----------------------------------

def plant_in(path: str, function: str, code: str) -> str:
    """The reference file ``path`` with ``code`` run first in ``function``'s solution region."""
    with open(os.path.join(ROOT, path)) as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {function}("))
    begin = next(i for i in range(start, len(lines)) if lines[i].strip() == "# BEGIN SOLUTION")
    indent = lines[begin][:len(lines[begin]) - len(lines[begin].lstrip())]
    lines[begin + 1:begin + 1] = [indent + line for line in code.strip().splitlines()]
    return "\n".join(lines) + "\n"


# A child process holds a T x T-sized block while the parent computes the tiled answer: neither
# tracemalloc nor anything else in the parent sees it.
HIDDEN_MEMORY = """
import os, time
import tracemalloc
tracemalloc.stop()
child = os.fork()
if child == 0:
    held = np.ones(600 * 2**20 // 8)
    time.sleep(1.0)
    os._exit(0)
os.waitpid(child, 0)
"""

# Three children resident at 0.8 GiB each: each under the 2 GiB of one process, 2.4 GiB together.
THREE_CHILDREN = """
import os, time
children = []
for _ in range(3):
    child = os.fork()
    if child == 0:
        held = np.ones(800 * 2**20 // 8)
        time.sleep(5)
        os._exit(0)
    children.append(child)
for child in children:
    os.waitpid(child, 0)
"""


def test_flash_memory_is_read_from_the_kernel_for_all_the_tests_processes(tmp_path, hostile_sandbox):
    m = manifests_load("flash")
    for name, code in (("honest", None), ("hidden_memory", HIDDEN_MEMORY)):
        folder = tmp_path / name / "refmath"
        folder.mkdir(parents=True)
        with open(os.path.join(ROOT, "refmath", "flash.py")) as f:
            text = f.read()
        (folder / "flash.py").write_text(text if code is None else
                                         plant_in("refmath/flash.py", "flash_attention_forward", code))
        with open(os.path.join(ROOT, "refmath", "softmax.py")) as f:  # the merge, written honestly
            (folder / "softmax.py").write_text(f.read())
        results = grade(m, str(tmp_path / name), ROOT, only="memory_is_linear_in_length",
                        sandbox=hostile_sandbox)
        print(name, results["tests"][0]["output"])
        assert results["score"] == (2.0 if code is None else 0.0), results["tests"][0]["output"]


def test_the_memory_limit_is_per_test_not_per_process(tmp_path, hostile_sandbox):
    m = manifests_load("attention")
    write_submission(tmp_path / "three", planted(THREE_CHILDREN))
    results = grade(m, str(tmp_path / "three"), ROOT, with_time_limit(m.limits, 15), only=ONLY,
                    sandbox=hostile_sandbox)
    assert results["score"] == 2.0, summary(results)
    assert "all its processes together" in results["tests"][0]["output"], summary(results)


# ---- a backward that differentiates the student's own forward does not pay ----------------------

# LayerNorm by a complex step, one column at a time for all rows at once: d forward calls.
COMPLEX_STEP_LAYERNORM = '''
def layernorm_backward(dout, cache):
    xhat, rstd, gamma = cache.xhat, cache.rstd, cache.gamma
    x = xhat / rstd  # LayerNorm ignores the mean: the same Jacobian

    def forward(z):  # the forward, in complex arithmetic
        mu = z.mean(axis=-1, keepdims=True)
        var = ((z - mu) ** 2).mean(axis=-1, keepdims=True)
        return (z - mu) / np.sqrt(var + 1e-5) * gamma
    dx = np.zeros_like(x)
    for j in range(x.shape[-1]):
        z = x.astype(complex)
        z[..., j] += 1e-30j
        dx[..., j] = np.sum(forward(z).imag * dout, axis=-1) / 1e-30
    axes = tuple(range(dout.ndim - 1))
    return dx, np.sum(dout * xhat, axis=axes), np.sum(dout, axis=axes)
'''

# RMSNorm by forward mode: a dual number (value, tangent) pushed through the forward, one column
# seeded at a time for all rows at once: d forward passes.
DUAL_RMSNORM = '''
def rmsnorm_backward(dout, cache):
    x, gamma = cache.x, cache.gamma

    def forward(value, tangent):  # RMSNorm on dual numbers
        mean, dmean = np.mean(value * value, -1, keepdims=True), np.mean(2 * value * tangent, -1, keepdims=True)
        r, dr = (mean + 1e-6) ** -0.5, -0.5 * (mean + 1e-6) ** -1.5 * dmean
        return value * r * gamma, (tangent * r + value * dr) * gamma
    dx = np.zeros_like(x)
    for j in range(x.shape[-1]):
        seed = np.zeros_like(x)
        seed[..., j] = 1
        dx[..., j] = np.sum(forward(x, seed)[1] * dout, axis=-1)
    return dx, np.sum(dout * x * cache.rrms, axis=tuple(range(dout.ndim - 1)))
'''

# RoPE by forward mode: its pairs never mix, so two seeded passes (each coordinate of every pair at
# once) give the whole Jacobian; the forward itself does the pushing.
DUAL_ROPE = '''
def rope_backward(dout, cache):
    half = dout.shape[-1] // 2
    slots = ((np.s_[..., 0::2], np.s_[..., 1::2]) if cache.layout == "interleaved"
             else (np.s_[..., :half], np.s_[..., half:]))
    dx = np.zeros_like(dout)
    for seeded in slots:
        value = _rotate_pairs(np.zeros_like(dout), cache.cos, cache.sin, cache.layout)
        seed = np.zeros_like(dout)
        seed[seeded] = 1
        tangent = value + _rotate_pairs(seed, cache.cos, cache.sin, cache.layout)
        dx[seeded] = dout[slots[0]] * tangent[slots[0]] + dout[slots[1]] * tangent[slots[1]]
    return dx
'''


def replaced(path: str, function: str, definition: str) -> str:
    """The reference ``path`` with ``function`` replaced by ``definition``."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    start = text.index(f"\ndef {function}(") + 1
    end = text.index("\ndef ", start + 5)
    return text[:start] + definition.strip() + "\n\n" + text[end:]


DIFFERENTIATORS = {  # name -> (file, function, definition, the tests it is graded on)
    "complex step, LayerNorm": ("refmath/norms.py", "layernorm_backward", COMPLEX_STEP_LAYERNORM,
                                "layernorm_backward_large,layernorm_backward_batched"),
    "dual numbers, RMSNorm": ("refmath/norms.py", "rmsnorm_backward", DUAL_RMSNORM,
                              "rmsnorm_backward_batched,rmsnorm_backward_float32"),
    "dual numbers, RoPE": ("refmath/positions.py", "rope_backward", DUAL_ROPE, "rope_backward_autograd"),
}


def norms_ffn_reference(folder):
    for name in ("norms.py", "ffn.py", "positions.py"):
        with open(os.path.join(ROOT, "refmath", name)) as f:
            (folder / "refmath").mkdir(parents=True, exist_ok=True)
            (folder / "refmath" / name).write_text(f.read())


@pytest.mark.parametrize("how", list(DIFFERENTIATORS))
def test_differentiating_the_forward_scores_nothing(tmp_path, hostile_sandbox, how):
    path, function, definition, only = DIFFERENTIATORS[how]
    m = manifests_load("norms_ffn")
    norms_ffn_reference(tmp_path / "honest")
    norms_ffn_reference(tmp_path / "attack")
    (tmp_path / "attack" / path).write_text(replaced(path, function, definition))
    honest = grade(m, str(tmp_path / "honest"), ROOT, only=only, sandbox=hostile_sandbox)
    attack = grade(m, str(tmp_path / "attack"), ROOT, only=only, sandbox=hostile_sandbox)
    print(how, [t["output"].splitlines()[0] for t in attack["tests"]])
    assert honest["score"] == honest["max_score"], summary(honest)
    assert attack["score"] == 0, summary(attack)
    assert "refused" not in attack["output"]  # it ran, and it did not pay
