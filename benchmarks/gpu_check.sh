#!/usr/bin/env bash
# Everything that needs a GPU, in one go, on a bare CUDA machine (driver + toolkit + Python 3), with
# answers that cannot say "ok" by mistake:
#
#   0. versions first: the driver and the CUDA version it supports, the toolkit (nvcc), Python, CuPy
#      and PyTorch; a toolkit newer than the driver is detected and said (the statically linked
#      runtime then fails with "insufficient driver")
#   1. missing Python packages, pip-installed if pip can reach an index: CuPy's wheel is chosen from
#      the driver's CUDA version (cupy-cuda12x or cupy-cuda13x); PyTorch is never installed here
#      (minutes of the budget): without it the benchmark's baseline column says "missing"
#   2. build refmath with its CUDA module for this GPU's architecture (REFMATH_REQUIRE_CUDA=1)
#   3. the CUDA tests with REFMATH_REQUIRE_GPU=1: every skip for want of the module, CuPy or a GPU
#      is a failure
#   4. compute-sanitizer memcheck and racecheck on one small call of every kernel; a sanitizer that
#      refuses the device ("Device not supported") is reported SKIPPED with its reason
#   5. the GPU benchmarks (benchmarks/attention_gpu.py): kernel-only and call-level figures
#   6. the attention conformance sweep (benchmarks/conformance_gpu.py): refmath's CUDA rungs,
#      decode and paged decode, and PyTorch's SDPA on CUDA (as dispatched and on its flash
#      backend), every case against the float64 oracle
#
# Every step ends with one word: ok, FAILED, TIMED OUT or SKIPPED (with the reason). Each step has a
# time limit and all share one budget (GPU_CHECK_BUDGET seconds: 450 by default, 170 with --quick),
# so the script ends in time; a failed step does not stop the next one. Everything is written under
# $OUT (else /tmp/refmath-gpu-check): summary.txt (the versions, each step's word and time, the benchmark
# tables) and one log per step. Exit status: 0 if every step was ok, 2 if some were SKIPPED and
# none failed, 1 otherwise.
#
# Usage: bash benchmarks/gpu_check.sh [--quick] [--no-install]
#   --quick       fewer tests (stop at the first failure), shorter timings, T up to 4096
#   --no-install  report missing packages instead of installing them
#   PYTHON=...    the interpreter (default python3)
set -uo pipefail

QUICK=0
INSTALL=1
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK=1 ;;
        --no-install) INSTALL=0 ;;
        *) echo "usage: $0 [--quick] [--no-install]" >&2; exit 64 ;;
    esac
done

cd "$(dirname "$0")/.."
LOGS="${OUT:-${TMPDIR:-/tmp}/refmath-gpu-check}"
mkdir -p "$LOGS"
PY="${PYTHON:-python3}"
if [ $QUICK -eq 1 ]; then BUDGET="${GPU_CHECK_BUDGET:-170}"; else BUDGET="${GPU_CHECK_BUDGET:-450}"; fi
SUMMARY="$LOGS/summary.txt"
: > "$SUMMARY"
WORDS=()  # "name: WORD" of every step, for the last lines

say() { echo "$*" | tee -a "$SUMMARY"; }
record() { WORDS+=("$1: $2"); }

# run NAME LIMIT_SECONDS COMMAND...: a step with a time limit, logged to $LOGS/NAME.log.
run() {
    local name="$1" limit="$2"
    shift 2
    local start=$SECONDS status left=$((BUDGET - SECONDS))
    if [ $left -lt 15 ]; then
        say "== $name: SKIPPED (the ${BUDGET}s budget is spent)"
        record "$name" "SKIPPED (budget spent)"
        return 125
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    status=$?
    local took=$((SECONDS - start)) refusal=""
    # SKIP_IF: a pattern of the log saying the tool refused the machine (not the code): SKIPPED.
    [ $status -ne 0 ] && [ -n "${SKIP_IF:-}" ] \
        && refusal="$(grep -m 1 -i -o -E "$SKIP_IF" "$LOGS/$name.log")"
    if [ -n "$refusal" ]; then
        say "   SKIPPED in ${took}s: refused by the machine, not the code: $refusal"
        record "$name" "SKIPPED ($refusal)"
    elif [ $status -eq 0 ]; then
        say "   ok in ${took}s"
        record "$name" "ok"
    elif [ $status -eq 124 ] || [ $status -eq 137 ]; then
        say "   TIMED OUT after ${took}s"
        record "$name" "TIMED OUT"
    else
        say "   FAILED (exit $status) in ${took}s"
        tail -n 20 "$LOGS/$name.log" | sed 's/^/   | /' | tee -a "$SUMMARY"
        record "$name" "FAILED"
    fi
    return $status
}

# "12.4" -> 1204, for comparisons; empty stays empty.
version_number() { [ -n "$1" ] && echo "$1" | awk -F. '{ printf "%d\n", $1 * 100 + $2 }'; }

# ---- 0. versions, first ----
say "refmath gpu_check, $(date -u '+%Y-%m-%d %H:%M UTC'), $([ $QUICK -eq 1 ] && echo quick || echo full), budget ${BUDGET}s"
DRIVER="" DRIVER_CUDA="" GPU_NAME="" GPU_ARCH=""
if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi > "$LOGS/nvidia-smi.log" 2>&1; then
    DRIVER_CUDA="$(sed -n 's/.*CUDA Version: *\([0-9][0-9.]*\).*/\1/p' "$LOGS/nvidia-smi.log" | head -n 1)"
    IFS=, read -r GPU_NAME DRIVER GPU_ARCH < <(nvidia-smi --query-gpu=name,driver_version,compute_cap \
        --format=csv,noheader 2>/dev/null | head -n 1)
    GPU_NAME="$(echo "$GPU_NAME" | xargs)" DRIVER="$(echo "$DRIVER" | xargs)"
    GPU_ARCH="$(echo "$GPU_ARCH" | xargs | tr -d .)"
    say "driver:  $DRIVER (supports CUDA ${DRIVER_CUDA:-?}); GPU: ${GPU_NAME:-?}, sm_${GPU_ARCH:-?}"
    record device "ok"
else
    say "driver:  none (nvidia-smi missing or failing: $(head -n 1 "$LOGS/nvidia-smi.log" 2>/dev/null))"
    say "== device: FAILED (no NVIDIA driver or GPU here: every GPU step below will fail)"
    record device "FAILED (no driver or GPU)"
fi
NVCC="$(command -v nvcc || true)"
[ -z "$NVCC" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] && NVCC="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
TOOLKIT=""
if [ -n "$NVCC" ]; then
    TOOLKIT="$("$NVCC" --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p')"
    say "toolkit: CUDA ${TOOLKIT:-?} ($NVCC)"
else
    say "toolkit: nvcc not found (setup.py also looks in CUDA_HOME, /usr/local/cuda*)"
fi
say "python:  $("$PY" --version 2>&1) ($PY)"
say "cupy:    $("$PY" -c 'import cupy; print(cupy.__version__, "built for CUDA", cupy.cuda.runtime.runtimeGetVersion())' 2>&1 | tail -n 1)"
say "torch:   $("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null || echo 'missing (not installed by this script: the baseline columns will say missing)')"

# The CUDA runtime is linked statically, so the toolkit's version is the runtime's: a driver must
# support at least that CUDA version, else every call fails with "insufficient driver". Within one
# major version the driver's minor-version compatibility covers a newer toolkit (as long as nothing
# needs PTX JIT); across major versions nothing does.
if [ -n "$TOOLKIT" ] && [ -n "$DRIVER_CUDA" ]; then
    if [ "$(version_number "$TOOLKIT")" -gt "$(version_number "$DRIVER_CUDA")" ]; then
        if [ "${TOOLKIT%%.*}" -gt "${DRIVER_CUDA%%.*}" ]; then
            say "== driver-vs-toolkit: FAILED: toolkit CUDA $TOOLKIT is newer than the driver's CUDA $DRIVER_CUDA;"
            say "   the statically linked runtime will fail with 'insufficient driver'. Use a CUDA ${DRIVER_CUDA%%.*}.x toolkit"
            say "   (CUDA_HOME=...) or a newer driver."
            record driver-vs-toolkit "FAILED (toolkit $TOOLKIT > driver CUDA $DRIVER_CUDA)"
        else
            say "== driver-vs-toolkit: ok with a warning: toolkit CUDA $TOOLKIT > driver CUDA $DRIVER_CUDA, same major"
            say "   version: runs by minor-version compatibility, but a PTX JIT would fail"
            record driver-vs-toolkit "ok (minor-version compatibility)"
        fi
    else
        record driver-vs-toolkit "ok"
    fi
fi

# ---- 1. packages ----
# CuPy's wheel follows the driver's CUDA major version (the newest a driver supports), not nvcc's.
case "${DRIVER_CUDA%%.*}" in
    12) CUPY=cupy-cuda12x ;;
    13) CUPY=cupy-cuda13x ;;
    *) CUPY="" ;;
esac
missing=()
for pair in numpy:numpy pybind11:pybind11 setuptools:setuptools pytest:pytest hypothesis:hypothesis \
            ml_dtypes:ml-dtypes; do
    "$PY" -c "import ${pair%%:*}" > /dev/null 2>&1 || missing+=("${pair#*:}")
done
CUPY_MAJOR="$("$PY" -c 'import cupy; print(cupy.cuda.runtime.runtimeGetVersion() // 1000)' 2>/dev/null)"
if [ -n "$CUPY" ] && [ "$CUPY_MAJOR" != "${DRIVER_CUDA%%.*}" ]; then
    missing+=("$CUPY")  # absent, or built for another CUDA major version than the driver's
elif [ -z "$CUPY" ] && [ -z "$CUPY_MAJOR" ]; then
    say "== cupy: FAILED (no driver CUDA version to choose cupy-cuda12x or cupy-cuda13x by)"
    record cupy "FAILED (no driver to choose a wheel)"
fi
if [ ${#missing[@]} -gt 0 ]; then
    if [ $INSTALL -eq 1 ]; then
        # Two CuPy wheels would both install a `cupy` package over each other: drop the wrong one.
        [ -n "$CUPY" ] && [ -n "$CUPY_MAJOR" ] && [ "$CUPY_MAJOR" != "${DRIVER_CUDA%%.*}" ] \
            && "$PY" -m pip uninstall -y cupy-cuda12x cupy-cuda13x cupy > "$LOGS/cupy-uninstall.log" 2>&1
        run install-packages 150 "$PY" -m pip install "${missing[@]}" \
            || say "   (continuing: the steps that need a missing package will fail and say so)"
    else
        say "== install-packages: SKIPPED (--no-install): missing ${missing[*]}"
        record install-packages "SKIPPED (--no-install: missing ${missing[*]})"
    fi
fi

# ---- 2. build, for this GPU's architecture only (one SASS target: the fastest build) ----
export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:-} --threads 0"
ARCH="${REFMATH_CUDA_ARCH:-${GPU_ARCH:-90}}"
run build 300 env REFMATH_REQUIRE_CUDA=1 REFMATH_CUDA_ARCH="$ARCH" "$PY" setup.py build_ext --inplace
run build-info 60 "$PY" -c "from refmath import kernels; print(kernels.build_info()); \
print('versions:', kernels.flash_versions()); print(kernels.cuda_build_info()); \
assert kernels.cuda_available(), kernels.cuda_build_info()" \
    && sed 's/^/   /' "$LOGS/build-info.log" | tee -a "$SUMMARY"
# Without libcuda at all the runtime says "insufficient driver" too; with a driver it means the
# toolkit the module was built with is newer than the driver.
[ -n "$DRIVER" ] && grep -qi "insufficient" "$LOGS/build-info.log" \
    && say "   -> 'insufficient driver': libcuda is missing, or the driver ($DRIVER, CUDA $DRIVER_CUDA) is older than the toolkit (CUDA $TOOLKIT)"

# ---- 3. tests: a skip for want of CUDA is a failure here ----
TESTS=(tests/test_kernels_cuda.py tests/test_kernels.py
       tests/inference/test_kv_cache.py::test_a_kernel_backend_gives_the_same_greedy_tokens)
[ $QUICK -eq 1 ] && TESTS=(-x tests/test_kernels_cuda.py)
run tests $([ $QUICK -eq 1 ] && echo 90 || echo 200) env REFMATH_REQUIRE_GPU=1 \
    "$PY" -m pytest -p no:cacheprovider -q -s -rfEs "${TESTS[@]}"
{ grep -m 1 -o "REFMATH_REQUIRE_GPU=1, but.*" "$LOGS/tests.log"
  grep -E "^worst CUDA kernel error|passed|failed|skipped" "$LOGS/tests.log" | tail -n 2; } \
    | sed 's/^/   /' | tee -a "$SUMMARY"

# ---- 4. compute-sanitizer on a small call of every kernel ----
SANITIZER="$(command -v compute-sanitizer || true)"
for candidate in "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer \
                 /opt/nvidia/compute-sanitizer/compute-sanitizer; do
    [ -z "$SANITIZER" ] && [ -x "$candidate" ] && SANITIZER="$candidate"
done
for tool in memcheck racecheck; do
    if [ -z "$SANITIZER" ]; then
        say "== $tool: SKIPPED (compute-sanitizer not found)"
        record "$tool" "SKIPPED (compute-sanitizer not found)"
        continue
    fi
    extra=(--leak-check no)
    [ "$tool" = racecheck ] && extra=(--racecheck-report all)
    # The sanitizer may refuse the device for reasons of the machine (a GPU or driver it does not
    # support, a virtualised or MIG device): that answers nothing about the kernels either way.
    SKIP_IF="device not supported[^.]*|[^.]*not supported on this (device|platform)[^.]*" \
        run "$tool" 120 "$SANITIZER" --tool "$tool" "${extra[@]}" --error-exitcode 1 \
        "$PY" benchmarks/attention_gpu.py --smoke
    grep -h -E "ERROR SUMMARY|RACECHECK SUMMARY|smoke:" "$LOGS/$tool.log" | sed 's/^/   /' | tee -a "$SUMMARY"
done

# ---- 5. benchmarks ----
run benchmarks $([ $QUICK -eq 1 ] && echo 60 || echo 150) "$PY" benchmarks/attention_gpu.py \
    $([ $QUICK -eq 1 ] && echo --quick)
cat "$LOGS/benchmarks.log" >> "$SUMMARY"

# ---- 6. the conformance sweep on the GPU ----
run conformance $([ $QUICK -eq 1 ] && echo 60 || echo 150) "$PY" benchmarks/conformance_gpu.py \
    $([ $QUICK -eq 1 ] && echo --quick)
grep -E "^(refmath|torch|conformance)|FAIL" "$LOGS/conformance.log" | head -n 40 | sed 's/^/   /' \
    | tee -a "$SUMMARY"

# ---- the words ----
say ""
say "== summary (${SECONDS}s; logs in $LOGS)"
failed=0 skipped=0
for word in "${WORDS[@]}"; do
    say "   $word"
    case "$word" in
        *": ok"*) ;;
        *": SKIPPED"*) skipped=1 ;;
        *) failed=1 ;;
    esac
done
if [ $failed -eq 1 ]; then
    say "== FAILED"; exit 1
elif [ $skipped -eq 1 ]; then
    say "== ok except for the SKIPPED steps above"; exit 2
fi
say "== ok"
exit 0
