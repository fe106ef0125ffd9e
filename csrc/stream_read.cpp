// See stream_read.h. Each thread sums its chunk into four vector accumulators: one accumulator
// would make every addition wait for the previous one (a 3-4 cycle latency), and the loop would
// measure the adder rather than the memory.
#include "stream_read.h"

#include <algorithm>

#include "tile_math.h"

namespace refmath {

namespace {

// How far ahead a read of pieces requests lines: 2 KiB. On a Zen 4 reading the pages of a
// (2048, 8, 16, 128) pool on one thread, 2 KiB ahead read the pages in order as fast as one
// stream_sum of the pool (28.6 against 29.7 GB/s) and scattered at 21.5 GB/s; 8 and 32 KiB ahead
// slowed the pages in order to 23 GB/s for the same scattered rate, and no request at all read
// them scattered at 19.7 GB/s.
constexpr tile::idx kAheadFloats = 512;

// The sum of x[0 .. n). Where 'ahead' is given (the piece read after this one), the lines
// kAheadFloats further on are requested into the level-2 cache meanwhile, past the end of this
// piece into 'ahead', so that a read of scattered pieces has the next piece on its way when it
// jumps to it, as the decode kernel requests its next block while it folds one.
REFMATH_MULTIVERSION
double sum_chunk(const float* x, tile::idx n, const float* ahead) {
    tile::f32x8 acc[4] = {};
    tile::idx i = 0;
    for (; i + 32 <= n; i += 32) {
        if (ahead != nullptr) {
            // Only addresses inside this piece or the next (of the same length n) are formed.
            const tile::idx j = i + kAheadFloats;
            const float* line = j + 32 <= n ? x + j
                                : j >= n && j - n + 32 <= n ? ahead + (j - n) : nullptr;
            if (line != nullptr) {
                __builtin_prefetch(line, 0, 2);
                __builtin_prefetch(line + 16, 0, 2);
            }
        }
        for (int a = 0; a < 4; ++a) acc[a] += tile::load8(x + i + 8 * a);
    }
    double s = tile::sum8(acc[0] + acc[1]) + static_cast<double>(tile::sum8(acc[2] + acc[3]));
    for (; i < n; ++i) s += x[i];
    return s;
}

}  // namespace

double stream_sum(const float* x, std::ptrdiff_t n) {
    const int threads = tile::max_threads();
    const tile::idx chunk = (n + threads - 1) / std::max(1, threads);
    double total = 0.0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : total)
    for (int t = 0; t < threads; ++t) {
        if (t == 0) tile::note_team(tile::team_size());
        const tile::idx lo = std::min<tile::idx>(n, t * chunk), hi = std::min<tile::idx>(n, lo + chunk);
        total += sum_chunk(x + lo, hi - lo, nullptr);
    }
    return total;
}

double stream_sum_rows(const float* x, std::ptrdiff_t row_len, const std::int32_t* order,
                       std::ptrdiff_t n_rows) {
    const int threads = tile::max_threads();
    const tile::idx chunk = (n_rows + threads - 1) / std::max(1, threads);
    double total = 0.0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : total)
    for (int t = 0; t < threads; ++t) {
        const tile::idx lo = std::min<tile::idx>(n_rows, t * chunk);
        const tile::idx hi = std::min<tile::idx>(n_rows, lo + chunk);
        for (tile::idx i = lo; i < hi; ++i) {
            const float* next = i + 1 < hi ? x + order[i + 1] * row_len : nullptr;
            total += sum_chunk(x + order[i] * row_len, row_len, next);
        }
    }
    return total;
}

}  // namespace refmath
