#!/usr/bin/env bash
# Register use and spills of every CUDA kernel, from ptxas -v (needs nvcc, no GPU).
#
# A kernel that spills registers to local memory reads and writes them through the caches on every
# use; for the attention kernels that is a large slowdown that no test would catch. This compiles
# each csrc/cuda/*.cu for one architecture (REFMATH_CUDA_ARCH, default 90), prints ptxas's line per
# kernel (registers, shared memory, spill stores and loads) and exits 1 if any kernel spills,
# except the ones in the allow-list below, which are printed as "allowed" with their reason.
#
# Usage: bash benchmarks/ptxas_spills.sh                 (about a minute of one core per file)
#        bash benchmarks/ptxas_spills.sh csrc/cuda/flash_v4.cu ...   (those files only)
set -uo pipefail
cd "$(dirname "$0")/.."
NVCC="${NVCC:-$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")}"
ARCH="${REFMATH_CUDA_ARCH:-90}"
ARCH="${ARCH##*;}"  # the last (newest) of a list such as "80;90"
status=0
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
    sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0
fi

# Spills that are the point of a rung, not a defect: "<file> <regex on the mangled kernel name>
# <reason>", one a line. Keep it short; every entry is printed on each run.
#
# flash_v1 at D_MAX = 128 and 256: one thread owns a whole query row, so it holds q and the
# accumulator u, 2 x D floats: 256 at D = 128, more than the 255 registers a thread can have. That
# is v1's lesson (its header says so); v2 removes it by splitting a row's columns over a warp.
ALLOWED_SPILLS='
csrc/cuda/flash_v1.cu flash_v1_kernelI.*Li(128|256)EE v1 holds a whole row (q and u, 2 x D floats) in one thread: over 255 registers at D >= 128 (the naive rung; v2 splits the row)
'

sources=("$@")
[ ${#sources[@]} -eq 0 ] && sources=(csrc/cuda/*.cu)
for source in "${sources[@]}"; do
    out="$("$NVCC" -c -std=c++17 -O3 -Icsrc/cuda -arch="sm_$ARCH" -Xptxas -v "$source" -o /dev/null 2>&1)" \
        || { echo "$source: nvcc failed"; echo "$out"; status=1; continue; }
    # ptxas prints "Compiling entry function '<mangled>'" then "Used N registers, ..." and, in
    # between, "N bytes stack frame, N bytes spill stores, N bytes spill loads".
    echo "$out" | awk -v file="$source" -v allowed="$ALLOWED_SPILLS" '
        BEGIN {
            n = split(allowed, lines, "\n")
            for (i = 1; i <= n; ++i) {
                if (split(lines[i], w, " ") < 3) continue
                k = ++rules; rule_file[k] = w[1]; rule_name[k] = w[2]
                reason[k] = lines[i]; sub(/^[^ ]+ [^ ]+ /, "", reason[k])
            }
        }
        /Compiling entry function/ { name = $0; sub(/.*entry function .\047?/, "", name); sub(/\047.*/, "", name) }
        /spill stores/ { spill = $0 }
        /Used [0-9]+ registers/ {
            regs = $0; sub(/.*Used /, "", regs)
            printf "%s %s\n   %s\n   %s\n", file, name, spill, regs
            if (spill !~ / 0 bytes spill stores, 0 bytes spill loads/) {
                why = ""
                for (k = 1; k <= rules; ++k)
                    if (file == rule_file[k] && name ~ rule_name[k]) why = reason[k]
                if (why == "") { print "   SPILL"; bad = 1 }
                else print "   allowed spill: " why
            }
        }
        END { exit bad }' || status=1
done
[ $status -eq 0 ] && echo "no kernel spills (sm_$ARCH), except the allowed ones marked above" \
    || echo "SPILLS or errors above (sm_$ARCH)"
exit $status
