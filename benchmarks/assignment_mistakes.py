"""How the assignments' hidden tests score the catalogued mistakes (refmath.mistakes).

For every assignment and every catalogued mistake in a line that students write (inside a solution
region of a function the assignment lists), the reference file with that one-line edit is graded
as a submission (each hidden test in its own sandbox, as ``python -m refmath assignments grade``
does). A mistake that still gets full points is a hole in
the hidden tests. The unedited reference is graded first and must get full points.

    python benchmarks/assignment_mistakes.py                      # every assignment, ~10-20 min
    python benchmarks/assignment_mistakes.py --assignment attention --jobs 2

Prints one row per mistake (score, and the first failing test's feedback); exits with status 1 if
any mistake gets full points. Timings are printed, not asserted.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from refmath import solutions  # noqa: E402
from refmath.assignments import manifest as manifests  # noqa: E402
from refmath.assignments.grade import grade  # noqa: E402
from refmath.mistakes import MISTAKES, Mistake  # noqa: E402


def with_mistake(text: str, mistake: Mistake) -> str:
    """``text`` (a module's source) with ``mistake.old`` replaced inside its function only."""
    names = mistake.qualname.split(".")
    node = ast.parse(text)
    for name in names:
        node = next(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)
    lines = text.splitlines(keepends=True)
    first, last = node.lineno - 1, node.end_lineno
    body = "".join(lines[first:last])
    if body.count(mistake.old) != 1:
        raise ValueError(f"{mistake.name}: the text to replace occurs {body.count(mistake.old)} "
                         f"times in {mistake.where}")
    return "".join(lines[:first]) + body.replace(mistake.old, mistake.new) + "".join(lines[last:])


def module_file(manifest, mistake: Mistake) -> str:
    return next(p for p in manifest.files if p[:-3].replace("/", ".") == mistake.module)


def in_a_region(text: str, mistake: Mistake) -> bool:
    """Whether the text ``mistake`` replaces lies inside one of its function's solution regions."""
    regions = solutions.function_regions(text).get(mistake.qualname, [])
    lines = text.splitlines()
    return any(mistake.old in "\n".join(lines[r.begin + 1:r.end]) for r in regions)


def submission(folder: str, files: dict[str, str]) -> str:
    for path, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(folder, path)), exist_ok=True)
        with open(os.path.join(folder, path), "w") as f:
            f.write(text)
    return folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--assignment", default=None, help="one assignment (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="hidden tests run at once (default 1)")
    args = parser.parse_args(argv)
    names = [args.assignment] if args.assignment else manifests.names()
    holes = 0
    for name in names:
        manifest = manifests.load(name)
        reference = {}
        for path in manifest.files:
            with open(os.path.join(ROOT, path)) as f:
                reference[path] = f.read()
        graded = {(path[:-3].replace("/", "."), function)
                  for path, functions in manifest.functions.items() for function in functions}
        # only the mistakes a student can make: those that edit a line of a solution region
        mistakes = [m for m in MISTAKES if (m.module, m.qualname) in graded
                    and in_a_region(reference[module_file(manifest, m)], m)]
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            base = grade(manifest, submission(os.path.join(tmp, "reference"), reference), ROOT,
                         jobs=args.jobs)
            print(f"# {name}: reference {base['score']:g} / {base['max_score']:g} "
                  f"({time.perf_counter() - start:.0f} s); {len(mistakes)} catalogued mistakes")
            if base["score"] != base["max_score"]:
                print("  the reference does not get full points: the figures below mean nothing")
                return 1
            for i, mistake in enumerate(mistakes):
                path = module_file(manifest, mistake)
                files = {**reference, path: with_mistake(reference[path], mistake)}
                results = grade(manifest, submission(os.path.join(tmp, f"m{i}"), files), ROOT,
                                jobs=args.jobs)
                failed = [t for t in results["tests"] if t["score"] < t["max_score"]]
                holes += not failed
                first = failed[0]["output"].splitlines()[0][:110] if failed else "NOT CAUGHT"
                print(f"  {results['score']:>4g} / {results['max_score']:<4g} {mistake.name}: {first}",
                      flush=True)
    print(f"{holes} catalogued mistake(s) got full points")
    return 1 if holes else 0


if __name__ == "__main__":
    sys.exit(main())
