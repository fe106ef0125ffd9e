#!/usr/bin/env bash
# Run the CPU kernel tests against a build of refmath._C with AddressSanitizer and UBSan.
#
# The build also compiles the 16-lane (AVX-512) copies of the kernels for AVX2 and runs them on any
# AVX2 CPU (REFMATH_WIDE_ON_AVX2, see setup.py), so that the tests' "16 lanes" cases run here too:
# the only place the 16-lane code paths are checked on a machine without AVX-512.
#
# The sanitized module is built into build/asan (a separate copy of the package: the pure-Python
# files plus the instrumented _C), so the normal editable install and its refmath/_C*.so are not
# touched. Python then imports refmath from that copy:
#   * PYTHONPATH puts the copy first, and PYTHONSAFEPATH=1 stops `python -m pytest` from putting the
#     current directory (the checkout, whose refmath/ holds the uninstrumented _C) in front of it;
#   * libasan must be loaded before the interpreter starts (Python itself is not instrumented), and
#     libstdc++ with it, so that ASan's interceptors see the C++ runtime's allocations;
#   * detect_leaks=0: CPython keeps memory alive on purpose at exit, which LeakSanitizer would report;
#   * halt_on_error=1 makes any UBSan report fatal (a non-zero exit), like ASan's errors already are.
#
# Usage: tests/run_sanitized.sh [pytest arguments]   (default: tests/test_kernels_cpu.py tests/inference/test_compiled_step.py -q)
# Needs GCC (for the sanitizer runtimes) and the dev requirements (pytest, hypothesis, pybind11).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
BUILD=build/asan

# `setup.py build` copies the package's Python files and builds the extension into $BUILD/lib*.
REFMATH_SANITIZE=1 REFMATH_WIDE_ON_AVX2=1 REFMATH_CUDA=0 "$PYTHON" setup.py --quiet build --build-base "$BUILD" \
    --build-lib "$BUILD/lib" --build-temp "$BUILD/temp" >/dev/null

preload="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
for lib in $preload; do
    [ -f "$lib" ] || { echo "run_sanitized.sh: $lib not found (GCC's sanitizer runtime)" >&2; exit 1; }
done

run() {
    env PYTHONPATH="$PWD/$BUILD/lib" PYTHONSAFEPATH=1 LD_PRELOAD="$preload" \
        ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
        "$PYTHON" "$@"
}

# Refuse to report success on the wrong module: the imported _C must be the sanitized build.
run -c 'import refmath.kernels as k, sys
info = k.build_info()
print("sanitized refmath._C from", k._C.__file__)
ok = info.get("sanitize") and k.cpu_available() and "/build/asan/" in k._C.__file__
sys.exit(0 if ok and info.get("wide_on_avx2") else 1)'

if [ $# -eq 0 ]; then
    set -- tests/test_kernels_cpu.py tests/inference/test_compiled_step.py -q
fi
run -m pytest -p no:cacheprovider "$@"
