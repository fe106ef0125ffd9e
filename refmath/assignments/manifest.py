"""An assignment's manifest: ``assignments/<name>/assignment.toml``.

.. code-block:: toml

    title = "Attention"
    handout = "handout.py"                 # jupytext py:percent, beside the manifest
    public_tests = ["public/test_attention.py"]
    hidden_tests = "hidden/tests.py"

    [functions]                            # what students write, by file: these are stubbed,
    "refmath/attention.py" = ["sdpa_forward", "sdpa_backward"]   # and these files are submitted

    [uses]                                 # optional: other assignments' functions that this
    "refmath/attention.py" = ["sdpa_forward"]  # one's given code (or its checks) runs on; their
                                           # solutions stay in its trees, all others are stubbed
    [limits]                               # per hidden test, each in its own sandboxed process
    wall_s = 20
    cpu_s = 15
    memory_mb = 2048
    output_kb = 64

    [points]                               # every hidden test, in the order graded
    sdpa_forward_plain = 2

Read with ``tomllib`` (Python 3.11+; on 3.10 the ``tomli`` backport, which the ``assignments``
extra installs).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

try:
    import tomllib
except ImportError:  # Python 3.10
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None

__all__ = ["MANIFEST", "Limits", "Manifest", "default_root", "names", "load"]

MANIFEST = "assignment.toml"
DEFAULT_LIMITS = {"wall_s": 30.0, "cpu_s": 20.0, "memory_mb": 2048, "output_kb": 64}


@dataclass(frozen=True)
class Limits:
    wall_s: float  # wall-clock time of one hidden test's process
    cpu_s: float  # its CPU time (RLIMIT_CPU)
    memory_mb: int  # its address space (RLIMIT_AS)
    output_kb: int  # what it may print; more scores the test 0


@dataclass(frozen=True)
class Manifest:
    name: str
    folder: str  # the assignment's folder (manifest, handout, tests)
    title: str
    handout: str
    functions: dict[str, list[str]]  # submitted file -> the functions stubbed in it
    public_tests: list[str]
    hidden_tests: str
    limits: Limits
    points: dict[str, float] = field(default_factory=dict)  # hidden test -> points
    # Functions of other assignments whose solutions this one's trees keep (its given code or its
    # checks run on them), by file; every other solution region is stubbed in its trees.
    uses: dict[str, list[str]] = field(default_factory=dict)

    @property
    def files(self) -> list[str]:
        """The files a student submits, relative to the student tree."""
        return list(self.functions)

    @property
    def total_points(self) -> float:
        return sum(self.points.values())

    def path(self, relative: str) -> str:
        return os.path.join(self.folder, relative)


def default_root() -> str:
    """The ``assignments/`` folder beside the ``refmath`` package: the repository's top level, or
    an autograder bundle's ``source/``."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(os.path.dirname(package), "assignments")


def names(root: str | None = None) -> list[str]:
    root = root or default_root()
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, MANIFEST)))


def _need(data: dict, key: str, kind, where: str):
    if key not in data:
        raise ValueError(f"{where}: missing key {key!r}")
    if not isinstance(data[key], kind):
        raise TypeError(f"{where}: {key!r} must be a {getattr(kind, '__name__', kind)}, "
                        f"got {type(data[key]).__name__}")
    return data[key]


def load(name: str, root: str | None = None) -> Manifest:
    """Read and check the manifest of assignment ``name``; ``ValueError`` says what is wrong."""
    root = root or default_root()
    folder = os.path.join(root, name)
    where = os.path.join(folder, MANIFEST)
    if not os.path.isfile(where):
        known = ", ".join(names(root)) or "none"
        raise ValueError(f"no assignment {name!r} (no {where}); known assignments: {known}")
    if tomllib is None:
        raise RuntimeError("reading assignment manifests needs Python 3.11+ or the tomli package "
                           "(pip install tomli)")
    with open(where, "rb") as f:
        data = tomllib.load(f)
    allowed = {"title", "handout", "functions", "public_tests", "hidden_tests", "limits", "points",
               "uses"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (allowed: {sorted(allowed)})")
    functions = _need(data, "functions", dict, where)
    limits = dict(DEFAULT_LIMITS)
    extra = sorted(set(data.get("limits", {})) - set(limits))
    if extra:
        raise ValueError(f"{where}: unknown limits {extra} (allowed: {sorted(limits)})")
    limits.update(data.get("limits", {}))
    for key, value in limits.items():
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{where}: limits.{key} must be a positive number, got {value!r}")
    points = _need(data, "points", dict, where)
    for test, value in points.items():
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{where}: points.{test} must be a positive number, got {value!r}")
    uses = data.get("uses", {})
    if not isinstance(uses, dict):
        raise TypeError(f"{where}: [uses] must be a table of file = [functions]")
    for file, funcs in {**functions, **uses}.items():
        if ".." in file or not (file.startswith("refmath/") and file.endswith(".py") or
                                file.startswith("csrc/teaching/") and file.endswith(".cpp")):
            raise ValueError(f"{where}: key {file!r} must be a refmath/...py or "
                             "csrc/teaching/...cpp path")
        if not isinstance(funcs, list) or not funcs or not all(isinstance(f, str) for f in funcs):
            raise TypeError(f"{where}: {file!r} must map to a non-empty list of function names")
    both = sorted(f"{file}: {f}" for file, fs in uses.items() for f in fs
                  if f in functions.get(file, []))
    if both:
        raise ValueError(f"{where}: {', '.join(both)} both written by students and kept in [uses]")
    return Manifest(
        name=name, folder=folder, title=_need(data, "title", str, where),
        handout=_need(data, "handout", str, where), functions=functions,
        public_tests=list(_need(data, "public_tests", list, where)),
        hidden_tests=_need(data, "hidden_tests", str, where),
        limits=Limits(float(limits["wall_s"]), float(limits["cpu_s"]), int(limits["memory_mb"]),
                      int(limits["output_kb"])),
        points=dict(points), uses={k: list(v) for k, v in uses.items()},
    )
