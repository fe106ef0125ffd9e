"""Build refmath's compiled extensions.

- ``refmath._C``: the CPU kernels in ``csrc/`` (C++17, -O3, OpenMP when the compiler has it). Always
  built; the install fails if it cannot be. Needs GCC or Clang (Linux, macOS); MSVC is refused at
  once, since the kernels use the GCC/Clang vector extension.
- ``refmath._cuda``: the CUDA kernels in ``csrc/cuda/``, built when a CUDA toolkit (nvcc and
  ``include/cuda_runtime.h``) is found and the driver shows a CUDA device (or ``REFMATH_CUDA=1``:
  a toolkit without a GPU compiles for several minutes a module nothing here could run). Otherwise
  the install still succeeds, prints one line saying why the module was skipped (and, for a
  toolkit without a device, how to build it anyway), and records the reason for
  ``refmath.kernels.build_info()``.

Switches (environment variables):

=========================  =====================================================================
``REFMATH_CUDA=0``         do not build the CUDA module
``REFMATH_CUDA=1``         build it wherever a toolkit is, with or without a visible CUDA device
``REFMATH_REQUIRE_CUDA=1`` as ``REFMATH_CUDA=1``, and a missing toolkit or a failed CUDA compile
                           fails the install
``REFMATH_CUDA_ARCH``      GPU architectures, e.g. ``"80;90"`` (default ``"90"``): SASS for each,
                           plus PTX for the newest so later GPUs can JIT-compile it
``REFMATH_NATIVE=1``       add ``-march=native`` to the CPU module (faster here, not portable)
``REFMATH_SANITIZE=1``     build the CPU module with AddressSanitizer and UBSan (-O1 -g); Python
                           must then preload libasan, as tests/run_sanitized.sh does
``REFMATH_WIDE_ON_AVX2=1`` a test build: compile the 16-lane (AVX-512) copies of the CPU kernels
                           for AVX2 instead, and run them on any AVX2 CPU, so that a machine
                           without AVX-512 can test them (tests/run_sanitized.sh does)
``CUDA_HOME``/``CUDA_PATH``  where to look for the toolkit first
=========================  =====================================================================
"""
from __future__ import annotations

import functools
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
CUDA_EXT = "refmath._cuda"
BUILD_INFO = os.path.join("refmath", "_build_info.py")


def _rel(pattern: str) -> list[str]:
    # setuptools wants paths relative to setup.py; sorted so builds are reproducible.
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern)))


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _say(message: str) -> None:
    # pip hides build output unless -v; the same facts are kept in refmath/_build_info.py.
    print(f"refmath: {message}", file=sys.stderr, flush=True)


# ---- locating the CUDA toolkit ----

def _is_toolkit(root: str | None) -> bool:
    return bool(root) and os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")) and \
        os.path.isfile(os.path.join(root, "bin", "nvcc"))


def _toolkit_behind(nvcc: str) -> str | None:
    """Ask nvcc where it really lives (a wrapper script's own folder says nothing)."""
    try:
        run = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (run.stdout + run.stderr).splitlines():
        if line.startswith("#$ _HERE_="):  # nvcc's own bin/ folder
            return os.path.dirname(line.split("=", 1)[1].strip())
    return None


def _toolkit_candidates():
    yield os.environ.get("CUDA_HOME")
    yield os.environ.get("CUDA_PATH")
    nvcc = shutil.which("nvcc")
    if nvcc:  # a real nvcc (or a symlink to one) lives in <root>/bin
        yield os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    yield "/usr/local/cuda"
    versioned = glob.glob("/usr/local/cuda-*")
    versioned.sort(key=lambda p: [int(t) if t.isdigit() else 0 for t in p.rsplit("-", 1)[-1].split(".")],
                   reverse=True)  # newest first: cuda-12.10 before cuda-12.9
    yield from versioned
    yield "/opt/cuda"
    if nvcc:  # last, as it runs nvcc: a wrapper on PATH pointing somewhere unusual
        yield _toolkit_behind(nvcc)


@functools.lru_cache(maxsize=None)  # asked once for the opening message and once for the build
def find_cuda_toolkit() -> tuple[str | None, list[str]]:
    """Return (toolkit root or None, the places looked at).

    ``nvcc`` on PATH may be a wrapper script (``exec /usr/local/cuda-X/bin/nvcc "$@"``) whose
    folder holds no headers, so a toolkit is recognised by ``include/cuda_runtime.h`` next to
    ``bin/nvcc``, and nvcc is then always called as ``<root>/bin/nvcc``.
    """
    looked = []
    for root in _toolkit_candidates():
        if root and root not in looked:
            looked.append(root)
            if _is_toolkit(root):
                return root, looked
    return None, looked


def _cuda_lib_dir(root: str) -> str | None:
    for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"),
                os.path.join("targets", "sbsa-linux", "lib")):
        if os.path.isfile(os.path.join(root, sub, "libcudart_static.a")):
            return os.path.join(root, sub)
    return None


def _arch_numbers(archs: str) -> list[str]:
    """"80;90", "sm_80,compute_90" -> ["80", "90"], sorted and without repeats."""
    return sorted({a.strip().replace("sm_", "").replace("compute_", "")
                   for a in archs.replace(",", ";").split(";") if a.strip()}, key=int)


def _gencode_flags(archs: str) -> list[str]:
    """SASS for each listed architecture plus PTX of the newest one (forward compatibility)."""
    numbers = _arch_numbers(archs)
    if not numbers:
        raise ValueError(f"REFMATH_CUDA_ARCH={archs!r} names no architecture (e.g. '80;90')")
    flags = [f"-gencode=arch=compute_{n},code=sm_{n}" for n in numbers]
    return flags + [f"-gencode=arch=compute_{numbers[-1]},code=compute_{numbers[-1]}"]


def _libomp_prefixes() -> list[str]:
    """Where Homebrew keeps libomp on macOS (Apple silicon, then Intel), asked of brew first."""
    found = []
    if shutil.which("brew"):
        try:
            run = subprocess.run(["brew", "--prefix", "libomp"], capture_output=True, text=True,
                                 timeout=60)
            found.append(run.stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    found += ["/opt/homebrew/opt/libomp", "/usr/local/opt/libomp"]
    return [p for i, p in enumerate(found)
            if p and p not in found[:i] and os.path.isfile(os.path.join(p, "include", "omp.h"))]


def _cuda_off() -> bool:
    return os.environ.get("REFMATH_CUDA", "").strip().lower() in ("0", "false", "no", "off")


def _cuda_forced() -> bool:
    return _flag("REFMATH_CUDA") or _flag("REFMATH_REQUIRE_CUDA")


@functools.lru_cache(maxsize=None)
def cuda_device_count() -> int:
    """CUDA devices the driver shows this process (CUDA_VISIBLE_DEVICES included): 0 without a
    driver, as on a machine that has nvcc but no GPU. Asked of libcuda directly, since nothing
    that could ask it (CuPy, torch) need be installed."""
    import ctypes

    for name in ("libcuda.so.1", "libcuda.so", "libcuda.dylib"):
        try:
            driver = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return 0
    count = ctypes.c_int(0)
    try:
        if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
    except AttributeError:  # a library of that name that is no CUDA driver
        return 0
    return count.value


def _no_device_reason(root: str) -> str | None:
    """Why the CUDA module is skipped although a toolkit is at ``root``: no device is visible and
    REFMATH_CUDA=1 does not ask for it anyway. None when it is to be built."""
    if _cuda_forced() or cuda_device_count() > 0:
        return None
    return (f"{root}/bin/nvcc is here but no CUDA device is visible, so no CUDA module "
            f"(REFMATH_CUDA=1 builds it anyway: several minutes more)")


def _build_plan() -> str:
    """The one line printed as the build starts: what will be built and roughly how long.

    The C++ module's files compile one after another, so its time hardly depends on the number of
    cores (about 1-2 minutes on a 2-core machine); the CUDA sources compile beside it, one file a
    core, for several minutes more per architecture when a toolkit is found.
    """
    cpu = "building the C++ module refmath._C (about 1-2 minutes)"
    if _cuda_off():
        return f"{cpu}; the CUDA module is off (REFMATH_CUDA=0)"
    root, _ = find_cuda_toolkit()
    if root is None:
        return f"{cpu}; no CUDA toolkit found, so no CUDA module"
    no_device = _no_device_reason(root)
    if no_device:
        return f"{cpu}; {no_device}"
    archs = os.environ.get("REFMATH_CUDA_ARCH", "90")
    return (f"{cpu} and, beside it, the CUDA module refmath._cuda with {root}/bin/nvcc for arch "
            f"{archs} (several minutes more; REFMATH_CUDA=0 skips it)")


class BuildExt(build_ext):
    """Configures the extensions from the compiler and toolkit actually found, then builds them."""

    def run(self):
        self.info = {"openmp": False, "native": _flag("REFMATH_NATIVE"),
                     "sanitize": _flag("REFMATH_SANITIZE"),
                     "wide_on_avx2": _flag("REFMATH_WIDE_ON_AVX2"), "cuda_built": False,
                     "cuda_reason": "", "cuda_toolkit": None, "cuda_arch": None}
        # setuptools clears self.inplace while it builds (it copies into the source tree after).
        self.into_source = self.inplace or self.editable_mode
        _say(_build_plan())
        super().run()
        self._write_build_info()

    def build_extensions(self):
        cuda = [ext for ext in self.extensions if ext.name == CUDA_EXT]
        cpu = [ext for ext in self.extensions if ext.name != CUDA_EXT]
        for ext in cpu:
            self._configure_cpu(ext)
        # Most of the time goes into compiling the two pybind11 binding files (~10 s each), so the
        # two modules build side by side: on two cores that is a third off the install.
        with ThreadPoolExecutor(max_workers=2) as pool:
            jobs = [pool.submit(self.build_extension, ext) for ext in cpu]
            jobs += [pool.submit(self._build_cuda, ext) for ext in cuda]
            for job in jobs:
                job.result()  # re-raises a build error here

    # ---- the module cache: a reinstall (an extra added, say) compiles nothing unchanged ----
    #
    # pip builds in a fresh temporary directory every time, so setuptools never finds the objects of
    # the last build. Each module built is kept in build/refmath-cache (REFMATH_BUILD_CACHE=DIR
    # elsewhere, =0 not at all) under a digest of everything its compilation reads: the sources and
    # headers, the compiler commands and flags, the macros, libraries, Python and pybind11 versions
    # and, for CUDA, the toolkit and architectures. A build whose digest is there copies the module.

    @staticmethod
    def _cache_dir() -> str | None:
        where = os.environ.get("REFMATH_BUILD_CACHE", "").strip()
        if where.lower() in ("0", "false", "no", "off"):
            return None
        return where or os.path.join(HERE, "build", "refmath-cache")

    def _cache_key(self, ext) -> str:
        import pybind11

        digest = hashlib.sha256()
        for path in sorted(set(ext.sources + ext.depends)):
            digest.update(path.encode() + b"\0")
            with open(os.path.join(HERE, path), "rb") as f:
                digest.update(f.read())
        # pybind11's headers come from pip's temporary build environment: its version, not its path.
        includes = [f"pybind11-{pybind11.__version__}" if "pybind11" in d else d
                    for d in ext.include_dirs]
        compiler = [getattr(self.compiler, name, None)
                    for name in ("compiler_so", "compiler_cxx", "linker_so")]
        facts = [compiler, ext.extra_compile_args, ext.extra_link_args, ext.define_macros,
                 ext.undef_macros, ext.libraries, ext.library_dirs, includes,
                 getattr(ext, "cache_facts", None), sys.version, sys.platform,
                 sysconfig.get_config_var("EXT_SUFFIX"), os.environ.get("CC"),
                 os.environ.get("CXX"), os.environ.get("CFLAGS"), os.environ.get("LDFLAGS")]
        digest.update(repr(facts).encode())
        return digest.hexdigest()[:24]

    def _cached(self, ext) -> str | None:
        where = self._cache_dir()
        if where is None:
            return None
        return os.path.join(where, f"{ext.name}-{self._cache_key(ext)}"
                                   f"{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}")

    def _restore(self, ext) -> bool:
        """Copy the cached module of ``ext`` to where the build puts it; False if there is none."""
        cached = None if self.force else self._cached(ext)
        if cached is None or not os.path.exists(cached):
            return False
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        # A fresh modification time (copy, not copy2): `build_ext --inplace` then copies the module
        # into the package only if it is newer than the one there, so a cached module of an earlier
        # source, restored with its old time, would leave the last build's module in place.
        shutil.copy(cached, target)
        _say(f"{ext.name}: sources and flags unchanged since {os.path.relpath(cached, HERE)}; "
             f"reused, not recompiled")
        return True

    def _store(self, ext) -> None:
        cached = self._cached(ext)
        target = self.get_ext_fullpath(ext.name)
        if cached is None or not os.path.exists(target):
            return
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        shutil.copy2(target, cached + ".part")
        os.replace(cached + ".part", cached)
        # Keep the three newest builds of each module (a few configurations side by side).
        older = sorted(glob.glob(os.path.join(os.path.dirname(cached), f"{ext.name}-*")),
                       key=os.path.getmtime)[:-3]
        for path in older:
            os.remove(path)

    def build_extension(self, ext):
        if self._restore(ext):
            return
        super().build_extension(ext)
        self._store(ext)

    # ---- CPU ----

    def _probe(self, code: str, compile_args: list[str], link_args: list[str] | None = None) -> bool:
        """Whether the build's own C++ compiler compiles ``code`` with these flags (and, given
        ``link_args``, links it into a program)."""
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "probe.cpp")
            with open(src, "w") as f:
                f.write(code)
            try:
                objs = self.compiler.compile([src], output_dir=tmp, extra_postargs=compile_args)
                if link_args is not None:
                    self.compiler.link_executable(objs, "probe", output_dir=tmp,
                                                  extra_postargs=link_args)
            except Exception:
                return False
        return True

    def _openmp_flags(self) -> tuple[list[str], list[str]] | None:
        """(compile flags, link flags) that give OpenMP, or None.

        A tiny OpenMP program is compiled and linked: "the flag is accepted" is not enough, since
        clang accepts -fopenmp yet fails to link without libomp. GCC and LLVM clang take -fopenmp;
        Apple's clang has no such driver flag and needs -Xpreprocessor -fopenmp plus libomp
        (``brew install libomp``), which is tried second on macOS.
        """
        program = "#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
        candidates = [(["-fopenmp"], ["-fopenmp"])]
        if sys.platform == "darwin":
            candidates += [(["-Xpreprocessor", "-fopenmp", f"-I{p}/include"], [f"-L{p}/lib", "-lomp"])
                           for p in _libomp_prefixes()]
        for compile_args, link_args in candidates:
            if self._probe(program, compile_args, link_args):
                return compile_args, link_args
        return None

    def _configure_cpu(self, ext):
        if self.compiler.compiler_type == "msvc":
            # The kernels are written with the GCC/Clang vector extension (vector_size), which MSVC
            # does not have: fail at once with the reason rather than with pages of C++ errors.
            raise RuntimeError(
                "refmath: the C++ kernels need GCC or Clang (they use the GCC/Clang vector "
                "extension); MSVC cannot build them. On Windows, install refmath under WSL.")
        # Each flag only where the compiler knows it (GCC and clang know all three; the GCC-only
        # function attributes, target_clones and target, are chosen in csrc/tile_math.h by macro).
        ext.extra_compile_args += [f for f in CPU_VECTOR_FLAGS if self._probe("int x;\n", [f])]
        ext.extra_compile_args += ["-O3"]
        openmp = self._openmp_flags()
        if openmp:
            self.info["openmp"] = True
            ext.extra_compile_args += openmp[0]
            ext.extra_link_args += openmp[1]
        else:
            _say("OpenMP not found: the CPU module will run on one thread")
        if self.info["native"]:
            ext.extra_compile_args += ["-march=native"]
        if self.info["wide_on_avx2"]:
            ext.define_macros.append(("REFMATH_WIDE_ON_AVX2", "1"))
        if self.info["sanitize"]:
            # Last on the command line, so -O1 -g override -O3 and pybind11's -g0.
            san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
            ext.extra_compile_args += san + ["-O1", "-g"]
            ext.extra_link_args += san

    # ---- CUDA ----

    def _skip_cuda(self, ext, reason: str, said: bool = False):
        """Build without the CUDA module; ``said``: the plan line has already given the reason."""
        self.info["cuda_reason"] = reason
        if _flag("REFMATH_REQUIRE_CUDA"):
            raise RuntimeError(f"refmath: REFMATH_REQUIRE_CUDA=1 but {reason}")
        if not said:
            _say(f"CUDA module skipped: {reason}")
        self.extensions.remove(ext)
        # An earlier in-place build may have left a _cuda module that would now be imported stale.
        if self.into_source:
            for stale in glob.glob(os.path.join(HERE, "refmath", "_cuda.*")):
                _say(f"removing the stale {os.path.relpath(stale, HERE)}")
                os.remove(stale)

    def _build_cuda(self, ext):
        if _cuda_off():
            return self._skip_cuda(ext, "REFMATH_CUDA=0")
        root, looked = find_cuda_toolkit()
        if root is None:
            return self._skip_cuda(ext, "no CUDA toolkit found (no include/cuda_runtime.h with "
                                        f"bin/nvcc under: {', '.join(looked)})")
        no_device = _no_device_reason(root)
        if no_device:
            return self._skip_cuda(ext, no_device, said=True)
        lib_dir = _cuda_lib_dir(root)
        if lib_dir is None:
            return self._skip_cuda(ext, f"libcudart_static.a not found in the toolkit at {root}")
        archs = os.environ.get("REFMATH_CUDA_ARCH", "90")
        self.info.update(cuda_toolkit=root, cuda_arch=archs)
        if all(int(n) < 80 for n in _arch_numbers(archs)) and _arch_numbers(archs):
            # The build works (v1, v2, the backward and decode run anywhere), but the tensor-core
            # rungs' mma needs compute_80 code: their launchers refuse to run the code of this build.
            _say(f"REFMATH_CUDA_ARCH={archs} is below 80: the tensor-core versions of the "
                 "FlashAttention ladder will refuse to run; add 80 or newer to use them")

        ext.extra_compile_args += ["-O3"]
        ext.include_dirs += [os.path.join(root, "include")]
        ext.library_dirs += [lib_dir]
        # The static runtime loads the driver (libcuda.so) only when first used, so the module
        # imports on machines without a GPU; it needs these three system libraries itself.
        ext.libraries += ["cudart_static", "dl", "rt", "pthread"]
        ext.cache_facts = (root, archs, os.environ.get("REFMATH_CUDA_ARCH"))
        try:
            if self._restore(ext):
                pass  # build_extension below finds it again: no nvcc
            elif self.force or self._outdated(ext):
                # nvcc keeps one core busy per file and the files are independent: compile them
                # side by side (a GPU machine with many cores builds in the time of the slowest).
                gencode = _gencode_flags(archs)
                with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                    ext.extra_objects = list(pool.map(lambda cu: self._nvcc(root, cu, gencode),
                                                      CU_SOURCES))
            self.build_extension(ext)
        except subprocess.CalledProcessError as err:  # nvcc's own messages are printed above
            return self._skip_cuda(ext, f"nvcc failed on {err.cmd[err.cmd.index('-c') + 1]} "
                                        f"(exit status {err.returncode})")
        except Exception as err:  # the bindings' compile or the link failed
            detail = str(err).strip() or type(err).__name__
            return self._skip_cuda(ext, f"CUDA module build failed: {detail}")
        self.info["cuda_built"] = True
        _say(f"CUDA module built with {root}/bin/nvcc for arch {archs}")

    def _outdated(self, ext) -> bool:
        target = self.get_ext_fullpath(ext.name)
        if not os.path.exists(target):
            return True
        newest = max(os.path.getmtime(p) for p in ext.sources + ext.depends)
        return newest > os.path.getmtime(target)

    def _nvcc(self, root: str, source: str, gencode: list[str]) -> str:
        obj = os.path.join(self.build_temp, os.path.splitext(source)[0] + ".o")
        os.makedirs(os.path.dirname(obj), exist_ok=True)
        cmd = [os.path.join(root, "bin", "nvcc"), "-c", source, "-o", obj, "-std=c++17", "-O3",
               "-Xcompiler", "-fPIC,-fvisibility=hidden", "-Icsrc/cuda", *gencode]
        if os.environ.get("CXX"):  # use the same host compiler as the rest of the build
            cmd[1:1] = ["-ccbin", os.environ["CXX"]]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=HERE)
        return obj

    # ---- what was built, for refmath.kernels.build_info() ----

    def _write_build_info(self):
        text = ("# Written by setup.py when the compiled extensions were built; not tracked by git.\n"
                f"BUILD_INFO = {self.info!r}\n")
        targets = [os.path.join(self.build_lib, BUILD_INFO)]
        if self.into_source:
            targets.append(os.path.join(HERE, BUILD_INFO))
        for path in targets:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)

    def get_outputs(self):
        return super().get_outputs() + [os.path.join(self.build_lib, BUILD_INFO)]


CU_SOURCES = _rel("csrc/cuda/*.cu")

# -std=c++17 turns GCC's contraction of a*b + c into one fused multiply-add off; the kernels' inner
# loops are built of such sums. -fno-trapping-math lets GCC turn a floating-point 'x < a ? a : x'
# inside a loop into a vector select (nothing here reads the floating-point exception flags);
# without it the 2^x loops stay scalar. -fopenmp-simd honours '#pragma omp simd' (reductions the
# vectoriser may reorder) even without OpenMP. -fno-math-errno: a loop calling sqrt stays scalar
# while sqrt must set errno for a negative input (nothing reads errno; the values are the same).
# csrc/adamw_cpu.cpp, bit for bit NumPy's arithmetic, turns contraction off for itself.
CPU_VECTOR_FLAGS = ["-ffp-contract=fast", "-fno-trapping-math", "-fopenmp-simd", "-fno-math-errno"]

ext_modules = [
    Pybind11Extension(
        "refmath._C",
        sources=_rel("csrc/*.cpp"),
        depends=_rel("csrc/*.h"),
        include_dirs=["csrc"],
        cxx_std=17,
        # CPU_VECTOR_FLAGS, -O3 and OpenMP are added by BuildExt._configure_cpu, by compiler.
    ),
    # Configured at build time (toolkit, flags), and dropped there if CUDA is unavailable.
    Pybind11Extension(
        CUDA_EXT,
        sources=_rel("csrc/cuda/*.cpp"),
        depends=_rel("csrc/cuda/*.h") + _rel("csrc/cuda/*.cuh") + CU_SOURCES,
        include_dirs=["csrc/cuda"],
        cxx_std=17,
    ),
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExt})
