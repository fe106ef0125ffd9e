#!/usr/bin/env bash
# Everything that needs a GPU, in one go, on a bare CUDA machine (driver + toolkit + Python 3):
#
#   1. the environment (nvidia-smi, nvcc, Python packages; missing ones are pip-installed if pip
#      can reach an index: numpy pybind11 setuptools cupy-cuda13x pytest hypothesis torch ml-dtypes)
#   2. build refmath with its CUDA module (REFMATH_REQUIRE_CUDA=1: a failed CUDA build is an error)
#   3. the CUDA tests (tests/test_kernels_cuda.py, and the CUDA part of tests/test_kernels.py)
#   4. compute-sanitizer --tool memcheck and --tool racecheck on one small call of every kernel
#      (benchmarks/attention_gpu.py --smoke)
#   5. the GPU benchmarks (benchmarks/attention_gpu.py)
#
# Each step has a time limit, and all of them share an overall budget (GPU_CHECK_BUDGET seconds,
# default 560: under a 10-minute command limit), so the run always ends in time; a step that fails
# or times out is reported and the next one still runs, a step with no time left is skipped. Logs go
# to $OUT if set, else /tmp/refmath-gpu-check; summary.txt lists each step's status and time. The exit
# status is 0 only if every step passed.
#
# Usage: bash benchmarks/gpu_check.sh          (PYTHON=... to choose the interpreter)
set -uo pipefail

cd "$(dirname "$0")/.."
LOGS="${OUT:-${TMPDIR:-/tmp}/refmath-gpu-check}"
mkdir -p "$LOGS"
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET:-560}"
SUMMARY="$LOGS/summary.txt"
: > "$SUMMARY"
FAILED=0

# run NAME LIMIT_SECONDS COMMAND...: run a step with a time limit, log to $LOGS/NAME.log
run() {
    local name="$1" limit="$2"
    shift 2
    local start=$SECONDS status left=$((BUDGET - SECONDS))
    if [ $left -lt 15 ]; then
        echo "== $name: SKIPPED, the ${BUDGET}s budget is spent" | tee -a "$SUMMARY"
        FAILED=1
        return 125
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit}s): $*" | tee -a "$SUMMARY"
    timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    status=$?
    local took=$((SECONDS - start))
    if [ $status -eq 0 ]; then
        echo "   ok in ${took}s" | tee -a "$SUMMARY"
    else
        [ $status -eq 124 ] && echo "   TIMED OUT after ${took}s" | tee -a "$SUMMARY" \
                            || echo "   FAILED (exit $status) in ${took}s" | tee -a "$SUMMARY"
        tail -n 25 "$LOGS/$name.log" | sed 's/^/   | /' | tee -a "$SUMMARY"
        FAILED=1
    fi
    return $status
}

# ---- 1. environment (into the summary: $OUT may bring back only a few files) ----
{
    date
    nvidia-smi || echo "nvidia-smi: not available"
    command -v nvcc && nvcc --version || echo "nvcc not on PATH (setup.py also looks in CUDA_HOME, /usr/local/cuda*)"
    "$PY" --version
} >> "$SUMMARY" 2>&1

# Python module -> the pip package that provides it.
missing=()
for pair in numpy:numpy pybind11:pybind11 setuptools:setuptools cupy:cupy-cuda13x pytest:pytest \
            hypothesis:hypothesis torch:torch ml_dtypes:ml-dtypes; do
    module="${pair%%:*}" package="${pair#*:}"
    "$PY" -c "import $module" > /dev/null 2>&1 || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
    run install-packages 240 "$PY" -m pip install "${missing[@]}" \
        || echo "   (continuing: the steps that need a missing package will say so)" | tee -a "$SUMMARY"
fi
"$PY" -m pip list 2>/dev/null | grep -i -E "^(numpy|pybind11|setuptools|cupy|pytest|hypothesis|torch|ml.dtypes) " \
    >> "$SUMMARY"

# ---- 2. build ----
# --no-build-isolation and --no-deps: use the packages already here, contact no index.
# NVCC_APPEND_FLAGS: nvcc compiles the SASS and PTX targets of each file in parallel.
export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:-} --threads 0"
if ! run build 420 env REFMATH_REQUIRE_CUDA=1 "$PY" -m pip install -v --no-build-isolation --no-deps -e . \
        && ! grep -q "REFMATH_REQUIRE_CUDA=1 but\|error:" "$LOGS/build.log"; then
    # Not a compile error: some pip/setuptools pairs cannot do an editable install, and an in-place
    # build is equivalent for running from this checkout.
    run build-inplace 420 env REFMATH_REQUIRE_CUDA=1 "$PY" setup.py build_ext --inplace
fi
run build-info 60 "$PY" -c "from refmath import kernels; print(kernels.build_info()); \
print('versions:', kernels.flash_versions()); assert kernels.cuda_available(), kernels.cuda_build_info()" \
    && sed 's/^/   /' "$LOGS/build-info.log" | tee -a "$SUMMARY"
rm -f "$LOGS/build-info.log"  # its content is in the summary either way

# ---- 3. tests ----
run tests 300 "$PY" -m pytest -p no:cacheprovider -q -s -rs tests/test_kernels_cuda.py tests/test_kernels.py
grep -E "^worst CUDA kernel error|passed|failed" "$LOGS/tests.log" | tail -n 3 | sed 's/^/   /' | tee -a "$SUMMARY"

# ---- 4. compute-sanitizer on a small call of every kernel ----
SANITIZER="$(command -v compute-sanitizer || true)"
for candidate in "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" /usr/local/cuda*/bin/compute-sanitizer \
                 /opt/nvidia/compute-sanitizer/compute-sanitizer; do
    [ -z "$SANITIZER" ] && [ -x "$candidate" ] && SANITIZER="$candidate"
done
if [ -n "$SANITIZER" ]; then
    run memcheck 240 "$SANITIZER" --tool memcheck --leak-check no --error-exitcode 1 \
        "$PY" benchmarks/attention_gpu.py --smoke
    run racecheck 240 "$SANITIZER" --tool racecheck --racecheck-report all --error-exitcode 1 \
        "$PY" benchmarks/attention_gpu.py --smoke
    grep -h -E "ERROR SUMMARY|RACECHECK SUMMARY|smoke:" "$LOGS/memcheck.log" "$LOGS/racecheck.log" \
        | sed 's/^/   /' | tee -a "$SUMMARY"
else
    echo "== compute-sanitizer: not found, skipped" | tee -a "$SUMMARY"
    FAILED=1
fi

# ---- 5. benchmarks ----
run benchmarks 240 "$PY" benchmarks/attention_gpu.py
cat "$LOGS/benchmarks.log" >> "$SUMMARY"

echo "== done in ${SECONDS}s; logs in $LOGS" | tee -a "$SUMMARY"
exit $FAILED
