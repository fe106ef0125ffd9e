// See stream_read.h. Each thread sums its chunk into four vector accumulators: one accumulator
// would make every addition wait for the previous one (a 3-4 cycle latency), and the loop would
// measure the adder rather than the memory.
#include "stream_read.h"

#include <algorithm>

#include "tile_math.h"

namespace refmath {

namespace {

REFMATH_MULTIVERSION
double sum_chunk(const float* x, tile::idx n) {
    tile::f32x8 acc[4] = {};
    tile::idx i = 0;
    for (; i + 32 <= n; i += 32)
        for (int a = 0; a < 4; ++a) acc[a] += tile::load8(x + i + 8 * a);
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
        const tile::idx lo = std::min<tile::idx>(n, t * chunk), hi = std::min<tile::idx>(n, lo + chunk);
        total += sum_chunk(x + lo, hi - lo);
    }
    return total;
}

}  // namespace refmath
