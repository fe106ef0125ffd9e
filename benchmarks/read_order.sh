#!/usr/bin/env bash
# Build benchmarks/read_order.cpp for this machine (-O2 -march=native) in a temporary folder and
# run it: what the hardware prefetchers carry by the order of the reads (see the .cpp's header).
#     bash benchmarks/read_order.sh [ROUNDS]
#     python benchmarks/record.py --note "..." -- bash benchmarks/read_order.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"${CXX:-g++}" -std=c++17 -O2 -march=native -o "$dir/read_order" "$here/read_order.cpp"
"$dir/read_order" "$@"
