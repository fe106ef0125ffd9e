"""Every lesson runs top to bottom, draws the figures it promises, and its exercises are right.

Lessons are stored as py:percent scripts (see README); jupytext turns each into a notebook and
nbclient executes it in a fresh kernel, so a cell that raises fails the test. The kernel uses the
inline backend, as Jupyter and the docs site do (under Agg, ``plt.show()`` would draw nothing), and
each figure becomes an ``image/png`` output: a lesson declares how many in its header metadata
(``refmath: figures: N``) and must produce exactly that many. ``REFMATH_LESSONS_STRICT=1`` turns a
wrong exercise answer (see ``refmath.lessons``) into an error.
"""
import re
from pathlib import Path

import numpy as np
import pytest

jupytext = pytest.importorskip("jupytext", reason="lessons need the 'dev' extra (jupytext)")
nbclient = pytest.importorskip("nbclient", reason="lessons need the 'dev' extra (nbclient)")

LESSONS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9]*.py"))
INLINE = "module://matplotlib_inline.backend_inline"


def test_there_are_lessons():
    assert LESSONS, "no lesson found in notebooks/"


def _images(notebook):
    return sum("image/png" in output.get("data", {})
               for cell in notebook.cells if cell.cell_type == "code"
               for output in cell.get("outputs", []))


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_executes(path, monkeypatch, tmp_path):
    monkeypatch.setenv("MPLBACKEND", INLINE)
    monkeypatch.setenv("REFMATH_LESSONS_STRICT", "1")
    # One BLAS thread: the lessons' matrices are small, and threads spinning against other work
    # on a busy machine made some lessons several times slower.
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    notebook = jupytext.read(path)
    promised = notebook.metadata.get("refmath", {}).get("figures")
    assert isinstance(promised, int) and promised >= 1, \
        f"{path.name}: the header must declare 'refmath: figures: N' (N >= 1)"
    client = nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    assert _images(notebook) == promised, \
        f"{path.name}: drew {_images(notebook)} figures, its header promises {promised}"
    _every_check_says_right(path, notebook)
    for cell in notebook.cells:  # e.g. tqdm's, when a library draws a bar without ipywidgets
        err = "".join(o.get("text", "") for o in cell.get("outputs", [])
                      if o.get("output_type") == "stream" and o.get("name") == "stderr")
        assert "IProgress not found" not in err, f"{path.name}: cell {cell.source[:60]!r}: {err}"


CHECK_CALL = re.compile(r"\bcheck(?:_close|_true|_function)?\(")
VERDICT = re.compile(r"^(right|wrong|almost|no answer yet): ", re.MULTILINE)


def _verdicts(source: str, printed: str) -> tuple[int, list[str]]:
    """(how many checks the code calls, the verdict lines it printed)."""
    return len(CHECK_CALL.findall(source)), [m.group(0) + printed[m.end():].split("\n")[0]
                                             for m in VERDICT.finditer(printed)]


def _every_check_says_right(path, notebook):
    """With the answers in, each check cell prints one "right" line per check, and shows no value
    after it (a check's Verdict is not displayed: no stray True/False)."""
    for cell in notebook.cells:
        if cell.cell_type != "code" or not CHECK_CALL.search(cell.source):
            continue
        printed = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
        calls, lines = _verdicts(cell.source, printed)
        assert len(lines) == calls and all(line.startswith("right: ") for line in lines), \
            f"{path.name}: check cell {cell.source[:60]!r} printed {lines}, {calls} checks called"
        shown = [o for o in cell.outputs if o.get("output_type") == "execute_result"]
        assert not shown, f"{path.name}: check cell {cell.source[:60]!r} displays {shown}"


NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _numbers(text: str) -> list[tuple[float, int]]:
    """Every number written in ``text``, in order, as (value, significant digits written);
    thousands separators ("15,726,848") are read as one number."""
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)
    found = []
    for m in NUMBER.finditer(text):
        mantissa = re.split(r"[eE]", m.group(0))[0].lstrip("+-").replace(".", "").lstrip("0")
        try:
            found.append((float(m.group(0)), len(mantissa)))
        except ValueError:
            pass
    return found


def _same_to_3_digits(written: float, digits: int, want: float) -> bool:
    if want == 0 or written == 0:
        return written == want
    return abs(written - want) <= 5e-3 * abs(want) and (digits >= 3 or written == want)


def _specific(x: float) -> bool:
    """A value a scan can look for without matching every small number of a lesson: an integer
    of at least 10, or a number of 3 significant digits or more. (An array is scannable when one
    of its entries is, or when it has three entries or more, not all equal: a row of numbers is
    specific in itself.)"""
    if not np.isfinite(x):
        return False
    if float(x).is_integer():
        return abs(x) >= 10
    return len(f"{abs(x):.12g}".replace(".", "").lstrip("0").rstrip("0")) >= 3


def _scannable(want: list | None) -> bool:
    """Whether a value is specific enough to be looked for (see :func:`_gives_away`)."""
    if want is None or not want or not all(np.isfinite(want)):
        return False
    if len(want) == 1:
        return _specific(want[0])
    return any(_specific(x) for x in want) or (len(want) >= 3 and len(set(want)) > 1)


def _gives_away(want: list, text: str) -> str | None:
    """The written numbers of ``text`` that show ``want`` (a scalar to 3 significant digits, or an
    array by all its values in a row), or None."""
    if not _scannable(want):
        return None
    numbers = _numbers(text)
    if len(want) == 1:
        x = want[0]
        for value, digits in numbers:
            if (float(x).is_integer() and value == x) or (
                    not float(x).is_integer() and _same_to_3_digits(value, digits, x)):
                return f"{value:g}"
        return None
    n = len(want)
    for i in range(len(numbers) - n + 1):
        if all(_same_to_3_digits(v, max(d, 3), x) for (v, d), x in zip(numbers[i:i + n], want)):
            return "[" + ", ".join(f"{v:g}" for v, _ in numbers[i:i + n]) + "]"
    return None


def _cell_end(lines: list[str], line: int) -> int:
    """The number of lines up to the end of the py:percent cell that holds line ``line`` (1-based)."""
    for n in range(line, len(lines)):
        if lines[n].startswith("# %%"):
            return n
    return len(lines)


def visible_answers(student: str, stdout: str, records: list[dict]) -> tuple[list[str], int]:
    """(each expected value a student could read before its check, the checks scanned): each
    record's value looked for in the copy's text up to the end of the check's cell (the code, the
    prose and the check cell itself) and in what the copy printed before the check."""
    from refmath.lessons import RECORD_MARK

    lines = student.splitlines()
    printed = stdout.split(RECORD_MARK)
    found, scanned = [], 0
    for k, record in enumerate(records):
        if not _scannable(record["value"]) or record["line"] is None:
            continue
        scanned += 1
        source = "\n".join(lines[:_cell_end(lines, record["line"])])
        before = "".join(printed[:k + 1])
        for where, text in (("the lesson's text", source), ("its printed output", before)):
            shown = _gives_away(record["value"], text)
            if shown is not None:
                found.append(f"{record['name']!r} (line {record['line']}): {shown} in {where}")
    return found, scanned


def test_the_scan_for_visible_answers_finds_them():
    """The scan is not blind: a printed value, a literal and a value with thousands separators."""
    from refmath.lessons import RECORD_MARK

    record = [{"name": "x", "line": 3, "value": [15726848.0]},
              {"name": "y", "line": 5, "value": [0.95, 0.025, 0.025]}]
    text = "# %%\nprint(total)\ncheck_close('x', ...)\n# %%\ncheck_close('y', ..., [0.95, 0.025, 0.025])\n"
    found, scanned = visible_answers(text, f"total 15,726,848\n{RECORD_MARK}x\n", record)
    assert scanned == 2 and len(found) == 2, found
    assert visible_answers(text, "", [{"name": "z", "line": 3, "value": [0.5]}]) == ([], 0)
    clean, _ = visible_answers("# %%\ncheck_close('x', ...)\n", "total 15.7 M\n",
                               [{"name": "x", "line": 2, "value": [15726848.0]}])
    assert clean == []
    assert _gives_away([0.3333333], "1/3 is 0.3333") and not _gives_away([0.3333333], "0.33")
    assert not _gives_away([2.0], "2 heads")  # too small a number to tell from any other


# Lessons whose student copies still show an exercise's expected value before its check; the
# test below fails for any other lesson that does, and for one of these that no longer does.
STILL_SHOWN = set()


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_an_unanswered_student_copy_runs_and_no_check_says_right(path, tmp_path):
    """The student copy (answers stripped) runs to the end as a script, each of its checks says
    "no answer yet" (a check whose verdict does not depend on the student's answer would say
    "right" here), and no exercise's expected value can be read before its check: not in the
    copy's code or prose, not in anything it printed. (Run as a plain script, not a kernel: the
    verdicts and prints are the same, and it is faster.)"""
    import json
    import os
    import subprocess
    import sys

    from refmath.lessons import RECORD, student_copy

    student = student_copy(path.read_text(), str(path))
    script = tmp_path / path.name
    script.write_text(student)
    records = tmp_path / "expected.jsonl"
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**os.environ, "MPLBACKEND": "Agg",
                                            "OPENBLAS_NUM_THREADS": "1",
                                            "REFMATH_LESSONS_STRICT": "0", RECORD: str(records)})
    assert run.returncode == 0, f"{path.name}: the student copy fails:\n{run.stderr[-2000:]}"
    calls, lines = _verdicts(student, run.stdout)
    assert calls >= 3 and len(lines) == calls, \
        f"{path.name}: {calls} checks in the copy, {len(lines)} verdicts printed: {lines}"
    answered = [line for line in lines if not line.startswith("no answer yet: ")]
    assert not answered, f"{path.name}: checks with a verdict before any answer: {answered}"

    recorded = [json.loads(line) for line in records.read_text().splitlines()] \
        if records.exists() else []
    shown, scanned = visible_answers(student, run.stdout, recorded)
    print(f"{path.name}: {len(recorded)} value checks, {scanned} expected values specific enough to "
          f"scan, {len(shown)} visible before their check")
    for line in shown:
        print("  ", line)
    if path.name in STILL_SHOWN:
        assert shown, f"{path.name}: no answer is visible any more: take it off STILL_SHOWN"
    else:
        assert not shown, f"{path.name}: answers visible before their check:\n  " + "\n  ".join(shown)


LIBRARY_AS_ANSWER = """
import re, runpy, sys
import refmath.lessons as lessons

original = lessons.check_function


def submit_the_reference(name, func, reference, **options):
    # the library function the exercise asks for, as the refusal of a function that calls the
    # reference names it (the reference itself, or what a lesson's own reference is built on)
    line = sys._getframe(1).f_lineno
    called = original(name, lambda *a, **k: reference(*a, **k), reference, **options).line
    for asked in re.findall(r"calls (refmath[.][\\w.]+)", called):
        print("ASKED", line, asked, name, flush=True)
    verdict = original(name, reference, reference, **options)
    refused = verdict.line.startswith(f"wrong: {name}: this ") and "write it yourself" in verdict.line
    print("LIBRARY-AS-ANSWER", "refused" if refused else "accepted", name, flush=True)
    return verdict


lessons.check_function = submit_the_reference
# a numbered write-the-function exercise, check("05.7", my_step), calls it from here
import refmath.lessons.exercises
refmath.lessons.exercises.check_function = submit_the_reference
sys.argv = [sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


_REFERENCE_RUNS: dict = {}


def _run_with_the_reference(path, tmp_path):
    """The student copy of ``path`` and the stdout of running it under LIBRARY_AS_ANSWER (once per
    lesson: two tests read it)."""
    import os
    import subprocess
    import sys

    from refmath.lessons import student_copy

    if path not in _REFERENCE_RUNS:
        script = tmp_path / path.name
        script.write_text(student_copy(path.read_text(), str(path)))
        runner = tmp_path / "submit_the_reference.py"
        runner.write_text(LIBRARY_AS_ANSWER)
        run = subprocess.run([sys.executable, str(runner), str(script)], capture_output=True,
                             text=True, timeout=300, cwd=tmp_path,
                             env={**os.environ, "MPLBACKEND": "Agg", "OPENBLAS_NUM_THREADS": "1",
                                  "REFMATH_LESSONS_STRICT": "0"})
        assert run.returncode == 0, f"{path.name}: {run.stderr[-2000:]}"
        _REFERENCE_RUNS[path] = (script.read_text(), run.stdout)
    return _REFERENCE_RUNS[path]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_no_write_the_function_exercise_accepts_the_library(path, tmp_path):
    """Each check_function of the lesson's student copy is handed its own reference (the library
    function, or the lesson's function built on it) as the student's answer: every one must be
    refused, named, with "write it yourself"."""
    _, stdout = _run_with_the_reference(path, tmp_path)
    said = [line.split(" ", 2)[1:] for line in stdout.splitlines()
            if line.startswith("LIBRARY-AS-ANSWER ")]
    print(f"{path.name}: {len(said)} write-the-function exercises, "
          f"{sum(s[0] == 'accepted' for s in said)} accept the library")
    assert said, f"{path.name}: no write-the-function exercise"
    accepted = [name for verdict, name in said if verdict != "refused"]
    assert not accepted, f"{path.name}: the library's own function is accepted by {accepted}"


def _names_in_code(text: str) -> list[tuple[int, str]]:
    """Every name the code of ``text`` uses, as (line, name): comments and plain strings left out,
    the expressions of f-strings kept (a token of their own only from Python 3.12 on), and the
    module path of ``from a.b import c`` left out (it binds only ``c``)."""
    import io
    import tokenize

    found, module_path = [], False
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in (tokenize.NEWLINE, tokenize.NL):
            module_path = False  # a "from" of "raise ... from err" ends with its line
        elif token.type == tokenize.NAME and token.string in ("from", "import"):
            module_path = token.string == "from"
        elif token.type == tokenize.NAME and not module_path:
            found.append((token.start[0], token.string))
        elif token.type == tokenize.STRING and "f" in token.string.split("'")[0].split('"')[0].lower():
            for part in re.findall(r"\{([^{}]*)\}", token.string):
                found += [(token.start[0], name) for name in re.findall(r"[A-Za-z_]\w*", part)]
    return found


def _importable_prefix(dotted: str) -> tuple[str, str]:
    """``refmath.optim.AdamW.step`` as (module, qualified name): ("refmath.optim", "AdamW.step")."""
    import importlib

    parts = dotted.split(".")
    for n in range(len(parts) - 1, 0, -1):
        try:
            importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        return ".".join(parts[:n]), ".".join(parts[n:])
    raise ValueError(f"{dotted}: no module of refmath holds it")


def asked_before_check(student: str, asked: list[tuple[int, str]]) -> list[str]:
    """Each library function an exercise asks for (``asked``: the line of its check, the function's
    dotted name) that the student copy's code names above the check's cell: imported, or called
    through its module, or its class (for a method) named."""
    lines = student.splitlines()
    names = _names_in_code(student)
    found = []
    for line, dotted in asked:
        cell = max(n for n in range(line) if n == 0 or lines[n - 1].startswith("# %%"))
        wanted = _importable_prefix(dotted)[1].split(".")[0]
        seen = sorted({n for n, name in names if name == wanted and n < cell})
        if seen:
            found.append(f"{dotted} (checked at line {line}) is named at line(s) "
                         f"{', '.join(map(str, seen))}, above its check")
    return found


def test_the_scan_for_asked_functions_finds_an_early_import():
    student = ("# %%\nfrom refmath.softmax import softmax_backward as sb  # softmax_backward\n"
               "# %%\ndef my_softmax_backward(dout, cache):\n    return ...\n"
               "# %%\nfrom refmath.softmax import softmax_backward\n"
               "check_function('f', my_softmax_backward, softmax_backward)\n")
    assert asked_before_check(student, [(8, "refmath.softmax.softmax_backward")]) == [
        "refmath.softmax.softmax_backward (checked at line 8) is named at line(s) 2, above its check"]
    after = "# %%\n# softmax_backward, in a comment\n" + student.split("\n", 2)[2]
    assert asked_before_check(after, [(8, "refmath.softmax.softmax_backward")]) == []
    assert asked_before_check("# %%\nopt = AdamW(lr=1.0)\n# %%\ncheck_function()\n",
                              [(4, "refmath.optim.AdamW.step")])
    assert asked_before_check('# %%\nprint(f"{kv_cache_bytes(1, 2, 3, 4, 5):,}")\n# %%\ncheck()\n',
                              [(4, "refmath.sizing.kv_cache_bytes")])
    assert not asked_before_check("# %%\nfrom refmath.models.decoder import init_params\n# %%\n"
                                  "check()\n", [(4, "refmath.models.decoder")])


# Lessons whose student copy still names an asked-for function before its check, and why; the
# test below fails for any other lesson that does, and for one of these that no longer does.
STILL_NAMED: set = set()


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_no_student_copy_names_an_asked_function_before_its_check(path, tmp_path):
    """A write-the-function exercise's library function (what its check refuses as the answer) is
    imported only after the exercise's check cell: before the attempt, the student copy neither
    imports it nor reaches it through its module, so the reference is not at hand to be called,
    copied or read with inspect.getsource."""
    student, stdout = _run_with_the_reference(path, tmp_path)
    asked = [(int(line.split()[1]), line.split()[2]) for line in stdout.splitlines()
             if line.startswith("ASKED ")]
    found = asked_before_check(student, asked)
    print(f"{path.name}: {len(asked)} asked-for library functions, {len(found)} named before "
          "their check")
    if path.name in STILL_NAMED:
        assert found, f"{path.name}: no asked-for function is named early any more: take it off " \
                      "STILL_NAMED"
    else:
        assert not found, f"{path.name}:\n  " + "\n  ".join(found)


# Value exercises whose answer one call of a library function gives (its value as the check
# computes it in refmath.lessons, from the same inputs): the student copy may not name that
# function above the exercise's check, or the exercise is answered without being worked.
ONE_CALL_ANSWERS = {
    "01.1": "refmath.attention.sdpa_forward",
    "01.3": "refmath.softmax.softmax_jacobian",
    "01.6": "refmath.attention.sdpa_backward",
    "01.7": "refmath.attention.sdpa_backward",
    "02.2": "refmath.norms.rmsnorm_backward",
    "02.3": "refmath.norms.layernorm_backward",
    "03.1": "refmath.softmax.online_softmax_merge",
    "03.3": "refmath.flash.flash_attention_backward",
    "03.4": "refmath.flash.attention_memory_traffic",
    "03.5": "refmath.sizing.kv_cache_bytes",
    "04.3": "refmath.ffn.gelu_backward",
    "04.5": "refmath.ffn.swiglu_backward",
    "04.7": "refmath.positions.rope_forward",
    "04.8": "refmath.positions.rope_backward",
    "04.6": ("refmath.ffn.swiglu_hidden_size", "refmath.ffn.ffn_parameter_count"),
    "05.2": "refmath.losses.cross_entropy_forward",
    "05.8": "refmath.optim.AdamW",
    "05.9": ("refmath.optim.transformer_schedule", "refmath.optim.warmup_cosine"),
    "06.7": "refmath.embedding.embedding_backward",
    "07.1": "refmath.positions.learned_positions_backward",
    "08.3": "refmath.attention.causal_attention_backward",
    "08.5a": "refmath.sizing.attention_design_cost",
    "08.5b": "refmath.sizing.attention_design_cost",
    "08.5c": "refmath.sizing.attention_design_cost",
    "08.6": "refmath.positions.rope_inv_freq",
    "08.7a": "refmath.ffn.softcap_forward",
    "09.1": "refmath.softmax.softmax_forward",
    "09.3": "refmath.attention.local_window_mask",
    "09.4": "refmath.inference.sampling.top_p_filter",
    "10.1": "refmath.inference.kv_cache.prefill",
    "10.4": "refmath.sizing.decode_time_lower_bound",
    "10.5a": "refmath.inference.quantized.quantize",
    "10.5b": "refmath.inference.quantized.dequantize",
    "11.4a": "refmath.sizing.attention_cache_rows",
    "11.4b": "refmath.sizing.attention_cache_rows",
    "11.4c": "refmath.sizing.attention_cache_rows",
    "11.6a": "refmath.sizing.inference_memory_rule_of_thumb",
    "11.6b": "refmath.sizing.adamw_training_memory",
    "13.5a": "refmath.sizing.hf_parameter_count",
    "13.5b": "refmath.sizing.hf_parameter_count",
    "13.5c": "refmath.sizing.hf_parameter_count",
    "14.1": "refmath.models.decoder.logits",
    "15.1a": "refmath.moe.router_scores",
    "15.1b": "refmath.moe.route",
    "15.1c": "refmath.moe.route",
    "15.4": "refmath.moe.balance_bias_update",
    "15.5a": "refmath.sizing.active_parameters",
    "15.5b": "refmath.sizing.active_parameters",
    "15.6a": "refmath.sizing.expert_parallel_bytes",
    "15.6b": "refmath.sizing.expert_parallel_bytes",
}
# The same, still at hand before the check (none now; an entry names an exercise to change).
STILL_ONE_CALL: dict = {}


def _check_line(student: str, number: str) -> int:
    """The 1-based line of ``check("NN.k", ...)`` in a student copy."""
    found = re.search(rf'^check\("{re.escape(number)}"', student, re.MULTILINE)
    assert found, f"no check({number!r}, ...) in the student copy"
    return student[:found.start()].count("\n") + 1


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_no_value_exercise_is_one_library_call_away(path):
    """No student copy names, above a value exercise's check, the library function that gives
    its answer in one call (ONE_CALL_ANSWERS); the exercises in STILL_ONE_CALL still do, and the
    test fails once one no longer does (take it off the list)."""
    from refmath.lessons import student_copy

    student = student_copy(path.read_text(), str(path))
    number = path.name[:2]
    for table, named in ((ONE_CALL_ANSWERS, False), (STILL_ONE_CALL, True)):
        mine = {k: v for k, v in table.items() if k.startswith(number + ".")}
        for exercise, function in mine.items():
            if isinstance(function, str) and function.startswith("refmath.models.decoder."):
                function = "refmath.models.decoder"  # the module gives its functions
            functions = (function,) if isinstance(function, str) else function
            found = asked_before_check(student, [(_check_line(student, exercise), f)
                                                 for f in functions])
            assert bool(found) == named, (
                f"{path.name}: exercise {exercise}: {found}" if found else
                f"{path.name}: exercise {exercise} is no longer one call away: take it off "
                "STILL_ONE_CALL")


# The shape every lesson shares; notebooks/README.md gives the order.
CATALOGUE = (Path(__file__).resolve().parents[1] / "docs" / "equations.md").read_text()
CATALOGUE_ROW = re.compile(r"^\|\s*([A-Z]\d+)\s*\|(.*)\|\s*$", re.MULTILINE)
HEADER_LINES = ("**Prerequisites:**", "**Goals:**", "**Catalogue IDs:**", "**Duration:**")


def _tags(cell):
    return set(cell.get("metadata", {}).get("tags", []))


def _lesson_column():
    """ID -> the lessons named in the Lesson column of docs/equations.md's Covered table."""
    covered = CATALOGUE[CATALOGUE.index("## Covered"):CATALOGUE.index("## Left for later")]
    return {m.group(1): set(re.findall(r"`notebooks/([^`]+)`", m.group(2).split("|")[-1]))
            for m in CATALOGUE_ROW.finditer(covered)}


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_has_a_header_exercises_questions_and_references(path):
    notebook = jupytext.read(path)
    meta = notebook.metadata.get("refmath", {})
    minutes, ids = meta.get("minutes"), meta.get("ids")
    # the time a student needs to work it honestly, exercises included: one or two class periods
    assert isinstance(minutes, int) and 10 <= minutes <= 90, \
        f"{path.name}: 'refmath: minutes:' must be at most two classes of 45 minutes, got {minutes!r}"
    assert isinstance(ids, list) and all(isinstance(i, str) for i in ids), \
        f"{path.name}: 'refmath: ids:' must list the catalogue IDs the lesson teaches"
    header = notebook.cells[0].source
    for line in HEADER_LINES:
        assert line in header, f"{path.name}: the first cell lacks the header line {line}"
    listed = re.search(r"\*\*Catalogue IDs:\*\*(.*)", header).group(1)
    assert set(re.findall(r"\b[A-Z]\d+\b", listed)) == set(ids), \
        f"{path.name}: the header's catalogue IDs differ from 'refmath: ids:'"
    assert str(minutes) in re.search(r"\*\*Duration:\*\*(.*)", header).group(1)

    code = [c for c in notebook.cells if c.cell_type == "code"]
    exercises = [i for i, c in enumerate(code) if "exercise" in _tags(c)]
    assert len(exercises) >= 3, f"{path.name}: {len(exercises)} exercise cells, at least 3 wanted"
    for i in exercises:
        assert "# BEGIN SOLUTION" in code[i].source and "# END SOLUTION" in code[i].source, \
            f"{path.name}: exercise cell {code[i].source[:60]!r} has no solution region"
        assert i + 1 < len(code) and re.search(r"\bcheck(_close|_true|_function)?\(", code[i + 1].source), \
            f"{path.name}: the code cell after exercise {code[i].source[:60]!r} checks nothing"
    questions = [c for c in notebook.cells if c.cell_type == "markdown" and "question" in _tags(c)]
    assert questions, f"{path.name}: no inline question (a markdown cell tagged 'question')"
    for cell in questions:
        assert "<!-- BEGIN SOLUTION -->" in cell.source and "<!-- END SOLUTION -->" in cell.source, \
            f"{path.name}: question {cell.source[:60]!r} has no answer region"
    headings = {line.strip() for c in notebook.cells if c.cell_type == "markdown"
                for line in c.source.splitlines() if line.startswith("## ")}
    assert {"## Exercises", "## References"} <= headings, \
        f"{path.name}: a lesson ends with '## Exercises' and '## References' sections"


def test_the_catalogue_names_the_lesson_that_teaches_each_id():
    taught = {}
    for path in LESSONS:
        for eq_id in jupytext.read(path).metadata.get("refmath", {}).get("ids", []):
            taught.setdefault(eq_id, set()).add(path.name)
    column = _lesson_column()
    unknown = set(taught) - set(column)
    assert not unknown, f"lessons claim IDs that docs/equations.md does not cover: {sorted(unknown)}"
    wrong = {i: (sorted(column[i]), sorted(taught.get(i, ()))) for i in column
             if column[i] != taught.get(i, set())}
    assert not wrong, f"ID: (lesson column, lessons whose header lists it) differ: {wrong}"
