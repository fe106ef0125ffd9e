"""What a newcomer meets first: the sdist, the build's choices and messages, and the README's
promises about them (issue 9, section 5).

The sdist test builds a real sdist from a copy of the checkout, so it needs git, setuptools and
pybind11 (all in the ``dev`` extra); the wheel built from that sdist is checked by ``.ci/run``,
since compiling it takes minutes.
"""
import os
import re
import runpy
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# Tracked files that belong to the repository, not to the source distribution.
NOT_SHIPPED = {".gitignore", ".gitattributes"}
NOT_SHIPPED_DIRS = (".ci/", ".github/")
# Files setuptools writes into every sdist.
GENERATED = {"PKG-INFO", "setup.cfg"}

# What a working checkout accumulates and the sdist must leave out.
JUNK = [
    "refmath/_C.cpython-311-x86_64-linux-gnu.so",
    "refmath/_cuda.cpython-311-x86_64-linux-gnu.so",
    "refmath/_build_info.py",
    "refmath/__pycache__/softmax.cpython-311.pyc",
    "tests/__pycache__/test_softmax.cpython-311-pytest-9.2.0.pyc",
    "notebooks/.ipynb_checkpoints/01_attention-checkpoint.py",
    "build/temp.linux-x86_64-cpython-311/csrc/softmax.o",
    "build/lib.linux-x86_64-cpython-311/refmath/__init__.py",
    "csrc/softmax.o",
    "docs/_build/html/index.html",
    "runs/gpt/checkpoint.npz",
    ".venv/bin/python",
]


def _checkout_files() -> list[str]:
    """The files git tracks (untracked ones are left alone: a figure from `sizes --plot` or a
    scratch file in a working checkout is no part of the project)."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout (an unpacked sdist): nothing to compare the sdist with")
    out = subprocess.run(["git", "ls-files", "-z"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return sorted(p for p in set(out.split("\0")) if p and (ROOT / p).is_file())


def test_sdist_ships_every_project_file_and_no_build_output(tmp_path):
    pytest.importorskip("setuptools", minversion="77")
    pytest.importorskip("pybind11")
    files = _checkout_files()
    copy = tmp_path / "checkout"
    for rel in files:
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, copy / rel)
    for rel in JUNK:
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy / rel).write_text("junk\n")

    run = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")],
                         cwd=copy, capture_output=True, text=True,
                         env={**os.environ, "REFMATH_CUDA": "0"})
    assert run.returncode == 0, run.stdout + run.stderr
    (archive,) = (tmp_path / "dist").glob("refmath-*.tar.gz")
    with tarfile.open(archive) as tar:
        shipped = {name.split("/", 1)[1] for name in tar.getnames()
                   if "/" in name and tar.getmember(name).isfile()}

    wanted = {f for f in files if f not in NOT_SHIPPED and not f.startswith(NOT_SHIPPED_DIRS)}
    missing = sorted(wanted - shipped)
    assert not missing, f"the sdist leaves out {missing}: add them to MANIFEST.in"
    extra = sorted(f for f in shipped - wanted
                   if f not in GENERATED and not f.startswith("refmath.egg-info/"))
    assert not extra, f"the sdist ships files that are not part of the project: {extra}"
    # The three the issue found missing, named so a failure reads plainly.
    for needed in ("notebooks/01_attention.py", "docs/equations.md", "tests/models/test_gpt.py",
                   "tests/inference/test_kv_cache.py", "LICENSE", "csrc/cuda/flash_v1.cu"):
        assert needed in shipped


# ---- licence and metadata ----

def test_licence_is_stated_in_file_metadata_and_readme():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License")
    project = PYPROJECT["project"]
    assert project["license"] == "MIT"
    assert project["license-files"] == ["LICENSE"]
    assert project["authors"]
    assert re.search(r"MIT licen[cs]e", README), "the README should name the licence"
    # A URL is stated only if it is real: no example.com or placeholder addresses.
    for url in project.get("urls", {}).values():
        assert not re.search(r"example\.|placeholder|TODO|your-?name", url, re.I), url


def test_readme_names_every_runtime_dependency():
    sentence = re.search(r"refmath itself needs[^.]*\.", README)
    assert sentence, "the README should say what refmath itself needs"
    for requirement in PYPROJECT["project"]["dependencies"]:
        name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]
        assert name.lower() in sentence.group(0).lower(), \
            f"{name} is a dependency but the README says: {sentence.group(0)!r}"


def test_ci_runs_the_readmes_two_commands_and_the_dev_extra_holds_what_the_tests_need():
    """.ci/run runs the Quick start's two commands verbatim, first, in a fresh venv; so the tests
    that the second one runs must find every package they need in the `dev` extra (or skip)."""
    script = ROOT / ".ci" / "readme_commands.py"
    if not script.exists():
        pytest.skip("not a git checkout (an unpacked sdist): CI's files are not shipped")
    install, tests = runpy.run_path(str(script))["readme_commands"](README)
    assert install == "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && python -m refmath gradcheck"
    assert tests == 'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[dev]" && python -m pytest'
    ci = (ROOT / ".ci" / "run").read_text()
    first_install = re.search(r"^\s*(python -m )?pip install", ci, re.M)
    assert ci.index("python3 .ci/readme_commands.py") < first_install.start(), \
        ".ci/run installs something before the README's commands"
    dev = {re.split(r"[<>=!~; ]", r, maxsplit=1)[0] for r in PYPROJECT["project"]["optional-dependencies"]["dev"]}
    assert {"pytest", "hypothesis", "safetensors", "tokenizers"} <= dev  # convert writes both


# ---- the lessons ----

def test_lessons_extra_and_the_command_that_opens_them():
    extra = {re.split(r"[<>=!~ ]", r, maxsplit=1)[0] for r in
             PYPROJECT["project"]["optional-dependencies"]["lessons"]}
    assert {"matplotlib", "jupyterlab", "jupytext"} <= extra
    assert 'pip install -e ".[lessons]" && jupyter lab notebooks/' in README
    if "jupytext --to ipynb --execute" in README:  # jupytext executes through nbconvert
        assert "nbconvert" in extra


def test_a_lesson_runs_as_a_plain_script_as_the_readme_says(tmp_path):
    """The README offers ``python notebooks/01_attention.py``: it must run from a shell, outside
    Jupyter, with figures going nowhere (the Agg backend) and the working folder elsewhere."""
    assert "python notebooks/01_attention.py" in README
    pytest.importorskip("matplotlib")
    run = subprocess.run([sys.executable, str(ROOT / "notebooks" / "01_attention.py")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MPLBACKEND": "Agg"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "equals sdpa_backward" in run.stdout


# ---- the editable install, seen from the folder that holds the clone ----

def _editable_install_of_this_checkout() -> bool:
    """Whether the refmath that pip installed is ``pip install -e`` of this checkout."""
    import json
    from importlib import metadata

    # Every distribution of that name: the checkout's own refmath.egg-info, left by a build, has no
    # direct_url.json and may come first on sys.path.
    for dist in metadata.distributions(name="refmath"):
        url = json.loads(dist.read_text("direct_url.json") or "{}")
        if (url.get("dir_info", {}).get("editable", False)
                and url.get("url", "").rstrip("/") == ROOT.as_uri()):
            return True
    return False


def test_the_editable_install_is_a_path_entry():
    """With the package folder at the top said as ``package-dir = {"" = "."}``, setuptools writes a
    .pth path entry rather than its import hook, which comes after every path on sys.path."""
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"": "."}


def test_the_cli_runs_from_the_folder_that_holds_the_clone(tmp_path):
    """``cd parent-of-clone && python -m refmath --help``: the clone folder, named refmath, is a
    namespace package there, which the editable install's regular package must beat."""
    if not _editable_install_of_this_checkout():
        pytest.skip("refmath is not installed with pip install -e from this checkout")
    (tmp_path / "refmath").symlink_to(ROOT, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    run = subprocess.run([sys.executable, "-m", "refmath", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage: python -m refmath")


# ---- setup.py: the opening message and the flags chosen by compiler ----

@pytest.fixture
def setup_py(monkeypatch):
    """setup.py's names, loaded without running setup()."""
    setuptools = pytest.importorskip("setuptools")
    pytest.importorskip("pybind11")
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)
    monkeypatch.chdir(ROOT)
    return runpy.run_path(str(ROOT / "setup.py"), run_name="refmath_setup")


def test_build_plan_says_what_is_built_and_how_long(setup_py, monkeypatch, tmp_path):
    monkeypatch.setenv("REFMATH_CUDA", "0")
    plan = setup_py["_build_plan"]()
    assert "refmath._C" in plan and "minutes" in plan and "REFMATH_CUDA=0" in plan

    # A toolkit at CUDA_HOME (a fake one: only its layout is looked at).
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda_runtime.h").write_text("")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    monkeypatch.delenv("REFMATH_CUDA")
    monkeypatch.delenv("REFMATH_REQUIRE_CUDA", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    devices = setup_py["_no_device_reason"].__globals__  # setup.py's own namespace
    monkeypatch.setitem(devices, "cuda_device_count", lambda: 1)
    plan = setup_py["_build_plan"]()
    assert "refmath._cuda" in plan and f"{tmp_path}/bin/nvcc" in plan
    assert "several minutes" in plan and "REFMATH_CUDA=0 skips it" in plan

    # nvcc without a GPU: the CUDA module is skipped, in the plan's one line, which says how to
    # build it anyway; REFMATH_CUDA=1 (or REFMATH_REQUIRE_CUDA=1, as CI sets) builds it.
    monkeypatch.setitem(devices, "cuda_device_count", lambda: 0)
    plan = setup_py["_build_plan"]()
    assert "refmath._cuda" not in plan and "\n" not in plan
    assert (f"{tmp_path}/bin/nvcc is here but no CUDA device is visible, so no CUDA module "
            f"(REFMATH_CUDA=1 builds it anyway") in plan
    for switch in ("REFMATH_CUDA", "REFMATH_REQUIRE_CUDA"):
        with monkeypatch.context() as m:
            m.setenv(switch, "1")
            assert "the CUDA module refmath._cuda with" in setup_py["_build_plan"]()


class _Compiler:
    compiler_type = "msvc"


def test_msvc_is_refused_with_the_reason(setup_py):
    build = setup_py["BuildExt"].__new__(setup_py["BuildExt"])
    build.compiler = _Compiler()
    build.info = {"openmp": False, "native": False, "sanitize": False, "wide_on_avx2": False}
    with pytest.raises(RuntimeError, match="GCC or Clang.*WSL"):
        build._configure_cpu(setup_py["ext_modules"][0])


def _configured_flags(setup_py, compiler_name=None):
    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.sysconfig import customize_compiler

    compiler = new_compiler()
    customize_compiler(compiler)
    build = setup_py["BuildExt"].__new__(setup_py["BuildExt"])
    build.compiler = compiler
    build.info = {"openmp": False, "native": False, "sanitize": False, "wide_on_avx2": False}
    ext = setup_py["ext_modules"][0]
    build._configure_cpu(ext)
    return ext.extra_compile_args, build.info["openmp"]


def test_gcc_build_flags_are_unchanged(setup_py, monkeypatch):
    """The GCC command line is the one the kernels were tuned and benchmarked with, in order."""
    if sys.platform != "linux" or shutil.which("g++") is None:
        pytest.skip("the GCC build is checked on Linux with g++")
    for var in ("CC", "CXX", "CFLAGS", "CPPFLAGS", "LDSHARED"):
        monkeypatch.delenv(var, raising=False)
    flags, openmp = _configured_flags(setup_py)
    tail = ["-ffp-contract=fast", "-fno-trapping-math", "-fopenmp-simd", "-fno-math-errno", "-O3"]
    tail += ["-fopenmp"] if openmp else []
    assert flags[-len(tail):] == tail, flags
    assert flags[flags.index("-std=c++17") + 1:] == tail, flags


def test_clang_gets_the_same_flags_and_openmp_only_if_it_links(setup_py, monkeypatch):
    """Clang takes the same vector flags; -fopenmp is added only when a test program links with
    it (LLVM's libomp installed), otherwise the module builds single-threaded."""
    if shutil.which("clang") is None or shutil.which("clang++") is None:
        pytest.skip("clang is not installed here")
    monkeypatch.setenv("CC", "clang")
    monkeypatch.setenv("CXX", "clang++")
    for var in ("CFLAGS", "CPPFLAGS", "LDSHARED"):
        monkeypatch.delenv(var, raising=False)
    flags, openmp = _configured_flags(setup_py)
    tail = ["-ffp-contract=fast", "-fno-trapping-math", "-fopenmp-simd", "-fno-math-errno", "-O3"]
    assert flags[flags.index("-std=c++17") + 1:] == tail + (["-fopenmp"] if openmp else []), flags


def test_a_rebuild_with_unchanged_sources_and_flags_reuses_the_module(setup_py, monkeypatch,
                                                                      tmp_path):
    """pip builds in a fresh temporary folder each time: without the module cache, adding an
    extra (pip install -e ".[hf]") recompiled both modules. A changed source or flag rebuilds."""
    import copy

    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.sysconfig import customize_compiler

    monkeypatch.setenv("REFMATH_BUILD_CACHE", str(tmp_path / "cache"))
    BuildExt = setup_py["BuildExt"]
    compiled = []

    def compile_for_the_test(self, ext):  # stands in for the compiler: writes a distinct module
        compiled.append(ext.name)
        with open(self.get_ext_fullpath(ext.name), "w") as f:
            f.write(f"module {len(compiled)}")
    monkeypatch.setattr(BuildExt.__mro__[1], "build_extension", compile_for_the_test)
    compiler = new_compiler()
    customize_compiler(compiler)

    def build(ext, folder):
        command = BuildExt.__new__(BuildExt)
        command.compiler, command.force = compiler, False
        (tmp_path / folder).mkdir(exist_ok=True)
        command.get_ext_fullpath = lambda name: str(tmp_path / folder / f"{name}.so")
        command.build_extension(ext)
        return (tmp_path / folder / f"{ext.name}.so").read_text()

    ext = copy.deepcopy(setup_py["ext_modules"][0])
    assert build(ext, "first") == "module 1"
    for cached in (tmp_path / "cache").iterdir():  # built an hour ago
        os.utime(cached, (time.time() - 3600,) * 2)
    started = time.time()
    assert build(ext, "second") == "module 1" and len(compiled) == 1  # copied from the cache
    # Newer than the build's start: `build_ext --inplace` skips copying a module older than the
    # package's, which left a stale module in place when a source went back to an earlier state.
    assert os.path.getmtime(tmp_path / "second" / f"{ext.name}.so") >= started - 1
    flagged = copy.deepcopy(ext)
    flagged.extra_compile_args.append("-O1")
    assert build(flagged, "third") == "module 2"
    source = tmp_path / "kernel.cpp"
    source.write_text("int f() { return 1; }\n")
    own = copy.deepcopy(ext)
    own.sources = [str(source)]
    assert build(own, "fourth") == "module 3" and build(own, "fifth") == "module 3"
    source.write_text("int f() { return 2; }\n")
    assert build(own, "sixth") == "module 4"
    monkeypatch.setenv("REFMATH_BUILD_CACHE", "0")
    assert build(ext, "seventh") == "module 5"
