// See rows_matmul_cpu.h. The products are memory-bound (m is a few rows: a few multiply-adds per
// float read), so the code aims at one thing: every weight read once, in long forward streams the
// hardware prefetcher follows, by every thread at once.
//
// * w (k, n): each thread takes a contiguous stretch of w's rows (and the same stretch of x's
//   columns) and sums its share of every output over them, four rows at a time:
//   y[c] += x[i] w[i][c] + ... + x[i+3] w[i+3][c], one load and store of y per four rows, y held
//   in L1 or L2. (Eight rows read slower where a row is a multiple of 4 KiB, 2048 floats: eight
//   streams and y then fall into one set of the 8-way L1 cache.) Thread 0 sums into y itself,
//   the others into scratch, and after a barrier each thread adds the partial sums, in thread
//   order, into a stretch of y. Cutting w by columns instead (no partial sums) read 15-20% slower
//   on 2 threads of a Zen CPU: each thread then reads a short piece of every row rather than one
//   long stream.
// * w^T, w (n, k): the rows are cut into stretches (4 per thread) that the threads of a piece team
//   take as they come (piece_team.h); a thread reads a stretch's two halves side by side (two
//   forward streams); each output is a dot product over k in two vector accumulators, computed
//   whole by one thread.
// 8-lane vectors only: wider ones would not read memory faster.
#include "rows_matmul_cpu.h"

#include <algorithm>
#include <vector>

#include "piece_team.h"
#include "tile_math.h"

namespace refmath {

namespace {

using tile::f32x8;
using tile::idx;

// Rows of w per pass over y: four read streams at once, one load and store of y per four rows.
constexpr idx kRows = 4;
// Columns per tile when x has several rows: the tile of the four rows of w (4 x 4 KiB) stays
// in cache while each row of x is multiplied by it.
constexpr idx kTile = 1024;

// y[r][:] += sum over rows i < k of x[r][i] w[i][:], for every row r of x (y already holds its
// starting value); x has row stride ldx, w and y have n columns.
REFMATH_MULTIVERSION
void columns(const float* x, idx m, idx ldx, idx k, const float* w, idx n, float* y, idx ldy) {
    const idx tile_width = m == 1 ? n : kTile;
    idx i = 0;
    for (; i + kRows <= k; i += kRows) {
        const float* wi = w + i * n;
        for (idx t0 = 0; t0 < n; t0 += tile_width) {
            const idx t1 = std::min(n, t0 + tile_width);
            for (idx r = 0; r < m; ++r) {
                const float* a = x + r * ldx + i;
                float* yr = y + r * ldy;
                idx c = t0;
                for (; c + 8 <= t1; c += 8) {
                    f32x8 s = a[0] * tile::load8(wi + c) + a[1] * tile::load8(wi + n + c);
                    s += a[2] * tile::load8(wi + 2 * n + c) + a[3] * tile::load8(wi + 3 * n + c);
                    tile::store8(yr + c, tile::load8(yr + c) + s);
                }
                for (; c < t1; ++c) {
                    float s = 0.0f;
                    for (idx u = 0; u < kRows; ++u) s += a[u] * wi[u * n + c];
                    yr[c] += s;
                }
            }
        }
    }
    for (; i < k; ++i) {
        const float* wi = w + i * n;
        for (idx r = 0; r < m; ++r) {
            const float a = x[r * ldx + i];
            float* yr = y + r * ldy;
            for (idx c = 0; c < n; ++c) yr[c] += a * wi[c];
        }
    }
}

// y[r][j] = x[r] . w[j] for S runs of `count` rows of w (n, k): rows j0 + u * count + c for
// u < S, c < count, every row r of x. Each output is the same sum whatever S is (two vector
// accumulators over k, then the lanes, then the k % 16 products left over), so an output's bits
// do not depend on which run it falls in, nor on the thread count.
template <int S>
REFMATH_INLINE void dot_runs(const float* x, idx m, idx k, const float* w, float* y, idx ldy,
                             idx j0, idx count) {
    for (idx c = 0; c < count; ++c) {
        const float* rows[S];
        for (int u = 0; u < S; ++u) rows[u] = w + (j0 + u * count + c) * k;
        for (idx r = 0; r < m; ++r) {
            const float* xr = x + r * k;
            f32x8 acc[S][2] = {};
            idx i = 0;
            for (; i + 16 <= k; i += 16) {
                const f32x8 x0 = tile::load8(xr + i), x1 = tile::load8(xr + i + 8);
                for (int u = 0; u < S; ++u) {
                    acc[u][0] += x0 * tile::load8(rows[u] + i);
                    acc[u][1] += x1 * tile::load8(rows[u] + i + 8);
                }
            }
            for (int u = 0; u < S; ++u) {
                float s = tile::sum8(acc[u][0] + acc[u][1]);
                for (idx t = i; t < k; ++t) s += xr[t] * rows[u][t];
                y[r * ldy + j0 + u * count + c] = s;
            }
        }
    }
}

// y[r][j] = x[r] . w[j] for rows j0..j1 of w (n, k), every row r of x. The rows are read as two
// forward streams at once, the first half and the second half of the stretch: on one core of a
// Zen 4 two streams read 7-9% faster than one (medians of 6 interleaved runs of rows_matmul.py,
// 1 thread, decode layout; four streams fell between). On 2 threads, where memory rather than
// the core is the limit, the two read alike.
REFMATH_MULTIVERSION
void dots(const float* x, idx m, idx k, const float* w, float* y, idx ldy, idx j0, idx j1) {
    const idx half = (j1 - j0) / 2;
    dot_runs<2>(x, m, k, w, y, ldy, j0, half);
    dot_runs<1>(x, m, k, w, y, ldy, j0 + 2 * half, (j1 - j0) - 2 * half);
}

}  // namespace

void rows_matmul_cpu(const float* x, std::ptrdiff_t m, std::ptrdiff_t k, const RowsProduct* products,
                     std::ptrdiff_t count, int threads) {
    double multiply_adds = 0.0;
    idx summed = 0;  // floats of the outputs summed over k (the products not transposed)
    for (idx p = 0; p < count; ++p) {
        multiply_adds += static_cast<double>(m) * k * products[p].n;
        if (!products[p].transposed) summed += m * products[p].n;
    }
    threads = std::max(1, std::min(threads, tile::threads_for(multiply_adds)));
    if (summed == 0) {
        // Every product in W^T's rows (the decode layout): each output is one dot product, so the
        // outputs are cut into kPiecesPerThread * threads stretches of whole 8-output groups, the
        // pieces of a piece team (piece_team.h); a run of pieces is one stretch of each product.
        tile::note_team(threads);
        const idx per_product = tile::kPiecesPerThread * threads;
        team::run(count * per_product, threads, [&](idx first, idx last, int) {
            team::for_each_part(first, last, per_product, [&](idx p, idx a, idx b) {
                const RowsProduct& q = products[p];
                const idx groups = (q.n + 7) / 8;
                const idx j0 = std::min(q.n, groups * a / per_product * 8);
                const idx j1 = std::min(q.n, groups * b / per_product * 8);
                dots(x, m, k, q.w, q.y, q.n, j0, j1);
            });
        });
        return;
    }
    // Threads 1.. keep their partial sums here; thread 0 sums straight into y. One buffer per
    // calling thread, kept between calls: a decode step makes a hundred of them.
    static thread_local std::vector<float> scratch;
    if (static_cast<idx>(scratch.size()) < summed * (threads - 1))
        scratch.resize(summed * (threads - 1));
    float* partials = scratch.data();
#pragma omp parallel num_threads(threads)
    {
        const int t = tile::thread_id(), team = tile::team_size();
        if (t == 0) tile::note_team(team);
        idx offset = 0;  // where this product's partial sums start in a thread's share of scratch
        for (idx p = 0; p < count; ++p) {
            const RowsProduct& q = products[p];
            if (q.transposed) {  // rows j0..j1 of w, whole 8-output groups where n allows
                const idx groups = (q.n + 7) / 8;
                const idx j0 = std::min(q.n, groups * t / team * 8);
                const idx j1 = std::min(q.n, groups * (t + 1) / team * 8);
                dots(x, m, k, q.w, q.y, q.n, j0, j1);
                continue;
            }
            // rows i0..i1 of w (and columns i0..i1 of x), all n columns
            const idx i0 = k * t / team, i1 = k * (t + 1) / team;
            float* y = t == 0 ? q.y : partials + (t - 1) * summed + offset;
            std::fill(y, y + m * q.n, 0.0f);
            columns(x + i0, m, k, i1 - i0, q.w + i0 * q.n, q.n, y, q.n);
            offset += m * q.n;
        }
        if (team > 1) {
#pragma omp barrier
            // y += the other threads' partial sums, in thread order; each thread a stretch of y
            offset = 0;
            for (idx p = 0; p < count; ++p) {
                const RowsProduct& q = products[p];
                if (q.transposed) continue;
                const idx size = m * q.n, lo = size * t / team, hi = size * (t + 1) / team;
                for (int u = 1; u < team; ++u) {
                    const float* part = partials + (u - 1) * summed + offset;
                    for (idx c = lo; c < hi; ++c) q.y[c] += part[c];
                }
                offset += size;
            }
        }
    }
}

}  // namespace refmath
