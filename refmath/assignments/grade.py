"""Grade submissions: each hidden test in its own limited process, results in Gradescope's schema.

A submission is a directory holding the manifest's files at their paths in the student tree
(``refmath/attention.py``), or flat (``attention.py``, as Gradescope stores files uploaded one by
one). It is laid over the stubbed library: a file not submitted is graded as the starter, any file
the manifest does not list is ignored.
"""
from __future__ import annotations

import csv
import fnmatch
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from refmath.assignments.build import library_files, stub_library
from refmath.assignments.checks import Verdict
from refmath.assignments.manifest import Limits, Manifest
from refmath.assignments.sandbox import run_test


def load_hidden_tests(manifest: Manifest):
    """The hidden-test module, imported in the grader (its ``check`` functions run here)."""
    path = manifest.path(manifest.hidden_tests)
    spec = importlib.util.spec_from_file_location(f"_hidden_{manifest.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    defined = [n for n, f in vars(module).items() if callable(f) and hasattr(f, "description")]
    missing = [n for n in manifest.points if n not in defined]
    unscored = [n for n in defined if n not in manifest.points]
    if missing or unscored:
        raise ValueError(f"assignment {manifest.name}: the manifest's [points] and {path} disagree: "
                         f"no such test {missing}, tests without points {unscored}")
    return module


def read_submission(manifest: Manifest, submission: str) -> tuple[dict[str, str], list[str]]:
    """``({path: text} of the submitted files, notes)``."""
    if not os.path.isdir(submission):
        raise ValueError(f"submission {submission!r} is not a directory")
    files, notes = {}, []
    for path in manifest.files:
        candidates = [os.path.join(submission, path), os.path.join(submission, os.path.basename(path))]
        found = next((c for c in candidates if os.path.isfile(c)), None)
        if found is None:
            notes.append(f"{path} was not submitted: graded as the starter code")
            continue
        with open(found, "rb") as f:
            files[path] = f.read().decode("utf-8", "replace")
    return files, notes


def _prepare(directory: str, base: dict[str, str], submitted: dict[str, str], hidden: str) -> None:
    for path, text in {**base, **submitted}.items():
        target = os.path.join(directory, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
    shutil.copyfile(hidden, os.path.join(directory, "hidden_tests.py"))


def _load_outputs(directory: str) -> dict[str, np.ndarray]:
    with np.load(os.path.join(directory, "out.npz"), allow_pickle=False) as data:
        return {key: data[key] for key in data.files}


def _grade_test(name: str, points: float, make, base, submitted, hidden, limits) -> dict:
    """One hidden test: run its ``run`` on the submission in a fresh limited process, then its
    ``check`` here on the arrays that came back. Returns the test's entry of results.json."""
    directory = tempfile.mkdtemp(prefix="refmath-grade-")
    try:
        _prepare(directory, base, submitted, hidden)
        outcome = run_test(directory, name, limits)
        if outcome.status == "ok":
            try:
                _, check = make()
                verdict = check(_load_outputs(directory))
                if not isinstance(verdict, Verdict):
                    raise TypeError(f"check returned {type(verdict).__name__}, not a Verdict")
            except Exception as error:  # outputs the check cannot read count as wrong
                verdict = Verdict(False, f"could not check the results: "
                                         f"{type(error).__name__}: {error}"[:400])
        else:
            verdict = Verdict(False, outcome.message)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    output = ("passed: " if verdict.passed else "FAILED: ") + verdict.message
    if outcome.output.strip() and not verdict.passed:
        output += "\nyour code printed:\n" + outcome.output[:500]
    return {"name": make.description, "score": float(points) if verdict.passed else 0.0,
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
          progress=None, only: str | None = None, jobs: int = 1) -> dict:
    """Grade one submission; returns Gradescope's ``results.json`` as a dict.

    ``only`` (globs over the hidden tests' names, separated by commas) grades a subset, and the
    maximum is then that subset's. ``jobs`` hidden tests run at once (each in its own process).
    """
    limits = limits or manifest.limits
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    module = load_hidden_tests(manifest)
    base, _ = stub_library(library_files(src_root), manifest, strict=False)
    submitted, notes = read_submission(manifest, submission)
    hidden = manifest.path(manifest.hidden_tests)
    chosen = select_tests(manifest, only)
    start = time.perf_counter()

    def one(item):
        entry = _grade_test(*item, getattr(module, item[0]), base, submitted, hidden, limits)
        if progress is not None:
            progress()
        return entry
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # each test is a process: threads suffice
        tests = list(pool.map(one, chosen.items()))
    score = sum(t["score"] for t in tests)
    total = float(sum(chosen.values()))
    return {"score": score, "max_score": total,
            "execution_time": round(time.perf_counter() - start, 2),
            "output": "\n".join(notes) if notes else f"{manifest.title}: {score:g} / {total:g}",
            "tests": tests}


def summary(results: dict, width: int = 100) -> str:
    """A readable table of ``results``: one line per test, then the total."""
    lines = []
    for test in results["tests"]:
        first = test["output"].splitlines()[0]
        lines.append(f"{test['score']:>5g}/{test['max_score']:<4g} {test['name']}")
        if test["score"] < test["max_score"]:
            lines.append(f"           {first[:width]}")
    if results.get("output") and "not submitted" in results["output"]:
        lines.append(results["output"])
    lines.append(f"total {results['score']:g} / {results['max_score']:g} "
                 f"({results['execution_time']:.1f} s)")
    return "\n".join(lines)


def write_results(results: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)


def grade_batch(manifest: Manifest, folder: str, csv_path: str, src_root: str,
                limits: Limits | None = None, show_progress: bool = True, only: str | None = None,
                jobs: int = 1) -> list[dict]:
    """Grade every sub-directory of ``folder``; write one CSV row per submission and each
    submission's results.json under ``<csv stem>-results/``."""
    if not os.path.isdir(folder):
        raise ValueError(f"--batch {folder!r} is not a directory")
    submissions = sorted(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
    if not submissions:
        raise ValueError(f"--batch {folder!r} holds no submission directories")
    results_dir = os.path.splitext(csv_path)[0] + "-results"
    rows = []
    from tqdm import tqdm
    with tqdm(total=len(submissions) * len(select_tests(manifest, only)), desc=f"grading {manifest.name}",
              unit="test", disable=not show_progress, file=sys.stderr) as bar:
        for name in submissions:
            results = grade(manifest, os.path.join(folder, name), src_root, limits,
                            progress=lambda: bar.update(1), only=only, jobs=jobs)
            write_results(results, os.path.join(results_dir, f"{name}.json"))
            rows.append({"submission": name, "score": results["score"],
                         "max_score": results["max_score"],
                         **{t["name"]: t["score"] for t in results["tests"]}})
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


def with_time_limit(limits: Limits, seconds: float | None) -> Limits:
    """``limits`` with the wall-clock and CPU limits lowered to ``seconds`` (for quick runs)."""
    if seconds is None:
        return limits
    return replace(limits, wall_s=min(limits.wall_s, seconds), cpu_s=min(limits.cpu_s, seconds))
