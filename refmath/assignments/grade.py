"""Grade submissions: each hidden test's student side in a sandbox, results in Gradescope's schema.

A submission is a directory holding the manifest's files at their paths in the student tree
(``refmath/attention.py``), or flat (``attention.py``, as Gradescope stores files uploaded one by
one). Only the manifest's functions are taken from it (:mod:`~refmath.assignments.extract`), into
the grader's stubbed copy of the library; a file not submitted is graded as the starter.

The hidden tests are loaded once, in the grader, before any submission is read; their file's
SHA-256 goes into the results. For each test the sandbox receives the source of its ``run`` and
its inputs, nothing else (:mod:`~refmath.assignments.sandbox`); the arrays that come back are
checked here.
"""
from __future__ import annotations

import csv
import fnmatch
import hashlib
import importlib.util
import json
import os
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from refmath._validate import check_real
from refmath.assignments.build import TEACHING, library_files, stub_library
from refmath.assignments.checks import IDLE_CPU_S, Case, Verdict, run_source
from refmath.assignments.extract import (install_lines, submitted_module, submitted_path,
                                         take_functions)
from refmath.assignments.manifest import Limits, Manifest
from refmath.assignments import submission as submission_files
from refmath.assignments.sandbox import SLOTS, Outcome, Sandbox, choose
from refmath.assignments.text import clean, clean_lines, csv_cell

__all__ = ["load_hidden_tests", "read_submission", "secret_paths", "graded_library", "quoted",
           "submitted_library", "grade", "summary", "write_results", "batch_submissions",
           "grade_batch", "with_time_limit"]

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "installer.py"),
          encoding="utf-8") as _f:
    INSTALLER = _f.read()  # refmath/_submitted/__init__.py of every graded library
PRINTED_LINES = 20  # of what a failing test's code printed, quoted in its feedback


class HiddenTests(NamedTuple):
    """The hidden tests of one assignment, loaded once: each test's case, and the file's hash."""

    cases: dict[str, Case]
    descriptions: dict[str, str]
    sources: dict[str, str]  # the student-side run() of each test
    sha256: str


def load_hidden_tests(manifest: Manifest) -> HiddenTests:
    """Import the hidden-test module in the grader and build every case (its ``check`` runs here).

    torch, which the checks use, is imported now too, before any student code exists."""
    path = manifest.path(manifest.hidden_tests)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    spec = importlib.util.spec_from_file_location(f"_hidden_{manifest.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    defined = [n for n, f in vars(module).items() if callable(f) and hasattr(f, "description")]
    missing = [n for n in manifest.points if n not in defined]
    unscored = [n for n in defined if n not in manifest.points]
    if missing or unscored:
        raise ValueError(f"assignment {manifest.name}: the manifest's [points] and {path} disagree: "
                         f"no such test {missing}, tests without points {unscored}")
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    cases, sources = {}, {}
    for name in manifest.points:
        case = getattr(module, name)()
        if not isinstance(case, Case):
            raise TypeError(f"{path}: {name}() returned {type(case).__name__}, not a Case")
        cases[name], sources[name] = case, run_source(case.run, f"{path}: {name}")
    return HiddenTests(cases, {n: getattr(module, n).description for n in cases}, sources, digest)


def read_submission(manifest: Manifest, submission: str) -> tuple[dict[str, str], list[str]]:
    """``({path: text} of the submitted files, notes)``, read as data
    (:mod:`~refmath.assignments.submission`): ``SubmissionError`` names what was refused."""
    return submission_files.read_submission(submission, list(manifest.files))


def secret_paths(manifest: Manifest, src_root: str) -> tuple[str, ...]:
    """What a sandbox that shares the grader's file system (``user`` mode) must not be able to
    read: the hidden tests, the grader's refmath (the reference itself when graded from a
    checkout) and torch."""
    paths = [os.path.abspath(manifest.path(manifest.hidden_tests)), os.path.join(src_root, "refmath")]
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        paths.append(spec.submodule_search_locations[0])
    return tuple(paths)


def compiled_given_parts(manifest: Manifest, src_root: str) -> dict[str, bytes]:
    """For an assignment with C++ functions (the kernel), the given pybind11 half compiled here,
    once per source, from the grader's own copy: the sandbox links the student's file to it
    (:mod:`refmath.teaching_kernel`) instead of compiling pybind11 for every test. It is kept
    under the hash of its source, so a batch, and later runs, compile it once."""
    if not any(path.endswith(".cpp") for path in manifest.functions):
        return {}
    from refmath import teaching_kernel
    # compiled in the grader's own build folder (0700, checked), which no sandbox can write to
    built = teaching_kernel.given_object(os.path.join(src_root, TEACHING),
                                         teaching_kernel.private_folder())
    with open(built, "rb") as f:
        return {f"{TEACHING}/{teaching_kernel.PREBUILT}/{teaching_kernel.GIVEN[:-4]}.o": f.read()}


def graded_library(manifest: Manifest, base: dict[str, str], submitted: dict[str, str]):
    """``(library, notes)``: the stubbed ``base`` with the manifest's functions taken from
    ``submitted``: C++ ones in place, Python ones in modules of their own under
    ``refmath/_submitted/`` that the given files import by name
    (:mod:`~refmath.assignments.installer`)."""
    library, notes = dict(base), []
    for path, text in submitted.items():
        if path.endswith(".cpp"):
            library[path], file_notes = take_functions(base[path], text, manifest.functions[path],
                                                       path)
        else:
            module, taken, file_notes = submitted_module(base[path], text,
                                                         manifest.functions[path], path)
            if taken:
                library[path] = install_lines(base[path], path, taken)
                library[submitted_path(path)] = module
                library["refmath/_submitted/__init__.py"] = INSTALLER
        notes += file_notes
    return library, notes


def quoted(printed: str, lines: int = PRINTED_LINES) -> str:
    """What the student's code printed, as a labelled block whose every line starts with a bar and
    a space, control characters shown as escapes: nothing in it can pass for a line of the
    grader's."""
    shown = printed.splitlines()
    body = [f"| {clean(line)[:200]}" for line in shown[:lines]]
    if len(shown) > lines:
        body.append(f"| ... ({len(shown) - lines} more lines)")
    return "\n".join(["--- what your code printed (quoted; not the grader's words) ---", *body,
                      "--- end of what your code printed ---"])


def submitted_library(manifest: Manifest, base: dict, submission: str):
    """``(library, notes)`` of a submission, or, when it cannot be read or taken apart,
    ``(reason, [reason])``: whatever the submission holds, this returns."""
    try:
        submitted, notes = read_submission(manifest, submission)
        library, extract_notes = graded_library(manifest, base, submitted)
        return library, [clean(n) for n in notes + extract_notes]
    except Exception as error:  # SubmissionError, or anything else the files made happen
        reason = (str(error) if isinstance(error, submission_files.SubmissionError) else
                  f"the submission could not be read: {type(error).__name__}: {error}")
        reason = clean(reason, 400)
        return reason, [reason]


def _grade_test(name: str, points: float, hidden: HiddenTests, library, sandbox: Sandbox,
                limits: Limits) -> dict:
    """One hidden test: its student side in the sandbox, then its ``check`` here on the arrays
    that came back. Returns the test's entry of results.json."""
    case = hidden.cases[name]
    if isinstance(library, str):  # the submission could not be read: every test fails with why
        outcome = Outcome("setup", library, "", 0.0)
    else:
        try:
            outcome = sandbox.run(library, hidden.sources[name], case.run.__name__, case.inputs,
                                  limits)
        except Exception as error:  # anything this test's run sent or did is this test's failure
            outcome = Outcome("error", f"the grader could not run this test on the submission: "
                              f"{type(error).__name__}: {clean(error, 300)}", "", 0.0)
    if outcome.status == "ok":
        try:
            if case.costed:
                outcome.value[IDLE_CPU_S] = np.array(sandbox.idle_cpu_s())
            verdict = case.check(outcome.value)
            if not isinstance(verdict, Verdict):
                raise TypeError(f"check returned {type(verdict).__name__}, not a Verdict")
        except Exception as error:  # outputs the check cannot read count as wrong
            verdict = Verdict(False, f"could not check the results: "
                                     f"{type(error).__name__}: {clean(error, 300)}")
    else:
        verdict = Verdict(False, outcome.message)
    output = ("passed: " if verdict.passed else "FAILED: ") + clean(" ".join(verdict.message.split()))
    if outcome.output.strip() and not verdict.passed:
        output += "\n" + quoted(outcome.output)
    return {"name": hidden.descriptions[name], "score": float(points) if verdict.passed else 0.0,
            "max_score": float(points), "output": output, "visibility": "visible",
            "execution_time": round(outcome.seconds, 2)}


def select_tests(manifest: Manifest, only: str | None) -> dict[str, float]:
    """The hidden tests (name -> points) matching ``only``: globs separated by commas (all if None)."""
    globs = None if only is None else [g.strip() for g in only.split(",")]
    chosen = {n: p for n, p in manifest.points.items()
              if globs is None or any(fnmatch.fnmatch(n, g) for g in globs)}
    if not chosen:
        raise ValueError(f"no hidden test of {manifest.name} matches {only!r}; the tests are "
                         f"{', '.join(manifest.points)}")
    return chosen


def grade(manifest: Manifest, submission: str, src_root: str, limits: Limits | None = None,
          progress=None, only: str | None = None, jobs: int = 1, sandbox: Sandbox | None = None,
          hidden: HiddenTests | None = None) -> dict:
    """Grade one submission; returns Gradescope's ``results.json`` as a dict.

    ``only`` (globs over the hidden tests' names, separated by commas) grades a subset, and the
    maximum is then that subset's. ``jobs`` hidden tests run at once (each in its own sandbox).
    ``sandbox`` defaults to the strongest this machine can make (:func:`sandbox.choose`), and
    ``hidden`` to the manifest's hidden tests, loaded now; a batch passes both, made once.
    """
    limits = limits or manifest.limits
    if not isinstance(jobs, int) or not 1 <= jobs <= SLOTS:
        raise ValueError(f"jobs must be a positive integer of at most {SLOTS}, got {jobs!r}")
    if not os.path.isdir(submission) and not os.path.islink(submission):
        raise ValueError(f"submission {submission!r} is not a directory")
    chosen = select_tests(manifest, only)
    hidden = hidden or load_hidden_tests(manifest)
    sandbox = sandbox or choose(unreadable=secret_paths(manifest, src_root))
    base, _ = stub_library(library_files(src_root), manifest, strict=False)
    base.update(compiled_given_parts(manifest, src_root))
    library, notes = submitted_library(manifest, base, submission)
    start = time.perf_counter()

    def one(item):
        entry = _grade_test(*item, hidden, library, sandbox, limits)
        if progress is not None:
            progress()
        return entry
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # each test is a process: threads suffice
        tests = list(pool.map(one, chosen.items()))
    score = sum(t["score"] for t in tests)
    total = float(sum(chosen.values()))
    return {"score": score, "max_score": total,
            "execution_time": round(time.perf_counter() - start, 2),
            "output": "\n".join([f"{manifest.title}: {score:g} / {total:g}", *notes]),
            "extra_data": {"sandbox": sandbox.mode, "hidden_tests_sha256": hidden.sha256},
            "tests": tests}


def summary(results: dict, width: int = 100) -> str:
    """A readable table of ``results``: one line per test, then the total. A lost point's
    feedback (the first line of the test's output) follows its test, indented and wrapped at
    ``width`` characters between words, never cut: its end is where the tolerance is."""
    lines = []
    indent = " " * 11
    for test in results["tests"]:
        first = test["output"].splitlines()[0] if test["output"] else ""
        lines.append(f"{test['score']:>5g}/{test['max_score']:<4g} {test['name']}")
        if test["score"] < test["max_score"] and first:
            lines += textwrap.wrap(first, width, initial_indent=indent, subsequent_indent=indent,
                                   break_long_words=False, break_on_hyphens=False)
    lines += results.get("output", "").splitlines()[1:]  # the notes
    lines = [clean(line) for line in lines]  # cleaned where they were made; again at the door
    lines.append(f"total {results['score']:g} / {results['max_score']:g} "
                 f"({results['execution_time']:.1f} s, sandbox: {results['extra_data']['sandbox']})")
    return "\n".join(lines)


def write_results(results: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)


def failed_results(manifest: Manifest, chosen: dict[str, float], hidden: HiddenTests,
                   reason: str, sandbox: str) -> dict:
    """results.json of a submission that could not be graded at all: every test 0, with why."""
    tests = [{"name": hidden.descriptions[n], "score": 0.0, "max_score": float(p),
              "output": f"FAILED: {reason}", "visibility": "visible", "execution_time": 0.0}
             for n, p in chosen.items()]
    total = float(sum(chosen.values()))
    return {"score": 0.0, "max_score": total, "execution_time": 0.0,
            "output": f"{manifest.title}: 0 / {total:g}\n{reason}",
            "extra_data": {"sandbox": sandbox, "hidden_tests_sha256": hidden.sha256},
            "tests": tests}


def batch_submissions(folder: str) -> list[str]:
    """The sub-folders of ``folder``, sorted; a link among them is listed too (and refused when
    graded), so that no student is silently left out."""
    if not os.path.isdir(folder):
        raise ValueError(f"--batch {folder!r} is not a directory")
    names = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False) or entry.is_symlink():
                names.append(entry.name)
    if not names:
        raise ValueError(f"--batch {folder!r} holds no submission directories")
    return sorted(names)


def grade_batch(manifest: Manifest, folder: str, csv_path: str, src_root: str,
                limits: Limits | None = None, show_progress: bool = True, only: str | None = None,
                jobs: int = 1, sandbox: Sandbox | None = None) -> list[dict]:
    """Grade every sub-directory of ``folder``; write one CSV row per submission and each
    submission's results.json under ``<csv stem>-results/``. The hidden tests are loaded once and
    the sandbox chosen once, before the first submission is read.

    Every submission is graded, whatever another one holds: a submission that cannot be graded
    gets its row (0, with the reason in its results.json). Each row is written, and flushed, as
    soon as its submission is graded, so an interrupted batch keeps the rows it had. Folder names
    are the students': they are cleaned, and written so that no spreadsheet runs them."""
    submissions = batch_submissions(folder)
    results_dir = os.path.splitext(csv_path)[0] + "-results"
    os.makedirs(results_dir, exist_ok=True)
    hidden = load_hidden_tests(manifest)
    chosen = select_tests(manifest, only)
    sandbox = sandbox or choose(unreadable=(*secret_paths(manifest, src_root), folder))
    columns = ["submission", "score", "max_score", *(hidden.descriptions[n] for n in chosen)]
    rows = []
    from tqdm import tqdm
    with tqdm(total=len(submissions) * len(chosen), desc=f"grading {manifest.name}",
              unit="test", disable=not show_progress, file=sys.stderr) as bar, \
            open(csv_path, "w", newline="") as table:
        writer = csv.DictWriter(table, fieldnames=columns)
        writer.writeheader()
        table.flush()
        for name in submissions:
            try:
                results = grade(manifest, os.path.join(folder, name), src_root, limits,
                                progress=lambda: bar.update(1), only=only, jobs=jobs,
                                sandbox=sandbox, hidden=hidden)
            except Exception as error:  # the grader's own failure on this one: still a row
                results = failed_results(manifest, chosen, hidden, clean(
                    f"the grader failed on this submission: {type(error).__name__}: {error}", 400),
                    sandbox.mode)
            write_results(results, os.path.join(results_dir, f"{name}.json"))
            row = {"submission": clean(name), "score": results["score"],
                   "max_score": results["max_score"],
                   **{t["name"]: t["score"] for t in results["tests"]}}
            writer.writerow({k: csv_cell(v) for k, v in row.items()})
            table.flush()
            rows.append(row)
    return rows


def with_time_limit(limits: Limits, seconds: float | None) -> Limits:
    """``limits`` with each hidden test's wall-clock and CPU limits set to ``seconds`` (lower for
    quick runs and code that may never return, higher for a slow machine); None keeps them."""
    if seconds is None:
        return limits
    seconds = check_real("time limit", seconds, 0.0, low_open=True)
    return replace(limits, wall_s=seconds, cpu_s=seconds)
