// Decode attention on the CPU: one query per sequence against its whole cached context, with the
// context split across threads (split-K) and the pieces merged by the online-softmax rule (F3).
//
// A decode step reads every cached key and value once and does ~2 multiply-adds per number read
// per query head, so it is limited by memory bandwidth, not arithmetic. Two things follow:
// * The H/G query heads of a GQA group are handled together (the rows of one small tile product),
//   so each key and value is read from memory once per group, not once per query head.
// * One long sequence must still keep every core streaming: the work items are
//   (sequence, key/value head, split), where a split is a contiguous chunk of the sequence's keys
//   (or pages). Each item leaves its unnormalised (u, m, l) (F2); a second, tiny loop merges the
//   splits of each (sequence, head) (F3). An empty split (more splits than keys) leaves the empty
//   state m = -inf, l = 0, u = 0, which the merge skips.
#include "decode_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "online_softmax.h"
#include "tile_math.h"

namespace refmath {

namespace {

using tile::idx;

constexpr idx kBlock = 64;            // keys per online-softmax step
constexpr idx kMinKeysPerSplit = 512;  // automatic splits keep at least this many keys each
constexpr idx kMaxSplits = 1024;       // a bound on the scratch (B * H * splits * (D + 2) floats)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A run of n consecutive keys and values in memory (rows of D floats).
struct KeyRun {
    const float *k, *v;
    idx n;
};

// Fold one block of at most kBlock keys, given as runs (one for a contiguous cache, one per page
// for a paged one), into the state of the R query heads of one group: S = Q K^T (R x block) run by
// run, scaled to base 2; the online softmax over the whole block; the block's P V; U = alpha U + P V.
// Folding whole blocks rather than single pages keeps small pages from turning the sum over the
// keys into a long chain of rescalings and additions (one per page), which would cost accuracy.
REFMATH_MULTIVERSION
void fold_block(idx R, idx D, float c, const float* qg, const KeyRun* runs, idx n_runs, float* S,
                float* m, float* l, float* U, float* PV, float* alpha) {
    idx cols = 0;
    for (idx i = 0; i < n_runs; ++i) {
        tile::gemm_nt(R, runs[i].n, D, qg, D, runs[i].k, D, S + cols, kBlock);
        cols += runs[i].n;
    }
    for (idx r = 0; r < R; ++r) {
        float* srow = S + r * kBlock;
#pragma omp simd
        for (idx j = 0; j < cols; ++j) srow[j] *= c;
    }
    online_softmax_fold(R, cols, S, kBlock, m, l, alpha);
    // P V, kSlab keys at a time: the tile product walks down its keys' rows 16 columns at a time,
    // and over a whole block (64 rows, 512 bytes apart) that order defeats the hardware prefetcher,
    // each cache line becoming a separate wait for memory. A slab of 8 rows is a few kilobytes,
    // and the next slab is requested while this one is multiplied.
    constexpr idx kSlab = 8;
    cols = 0;
    for (idx i = 0; i < n_runs; ++i) {
        for (idx j0 = 0; j0 < runs[i].n; j0 += kSlab) {
            const idx n = std::min(kSlab, runs[i].n - j0);
            const idx next = std::min(kSlab, runs[i].n - j0 - n);  // the next slab, if any
            tile::prefetch_rows(runs[i].v, D, D, j0 + n, j0 + n + next);
            if (cols == 0)
                tile::gemm_nn(R, D, n, S, kBlock, runs[i].v + j0 * D, D, PV, D);
            else
                tile::gemm_nn_acc(R, D, n, S + cols, kBlock, runs[i].v + j0 * D, D, PV, D);
            cols += n;
        }
    }
    online_softmax_merge_rows(R, D, alpha, U, D, PV, D);
}

// Where sequence b's keys are. A cache is cut into 'units' (keys, or pages) that splits divide;
// for_each_run calls run(k, v, n) for each contiguous run of n keys of head g in units [u0, u1).
struct ContiguousCache {
    const float *k, *v;
    idx t_max, kv_heads, D;
    const std::int64_t* lengths;

    idx units(idx b) const { return lengths[b]; }
    template <class Run>
    void for_each_run(idx b, idx g, idx u0, idx u1, Run&& run) const {
        const idx offset = ((b * kv_heads + g) * t_max + u0) * D;
        run(k + offset, v + offset, u1 - u0);
    }
};

struct PagedCache {
    const float *k, *v;
    idx page_size, kv_heads, D, max_pages;
    const std::int32_t* table;
    const std::int64_t* lengths;

    idx units(idx b) const { return (lengths[b] + page_size - 1) / page_size; }
    idx filled(idx b, idx i) const { return std::min(page_size, static_cast<idx>(lengths[b]) - i * page_size); }
    template <class Run>
    void for_each_run(idx b, idx g, idx u0, idx u1, Run&& run) const {
        for (idx i = u0; i < u1; ++i) {
            if (i + 1 < u1) {  // pages lie anywhere in the pool: request the next one in advance
                const idx next = (table[b * max_pages + i + 1] * kv_heads + g) * page_size * D;
                const idx rows = filled(b, i + 1);
                tile::prefetch_rows(k + next, D, D, 0, rows);
                tile::prefetch_rows(v + next, D, D, 0, rows);
            }
            const idx offset = (table[b * max_pages + i] * kv_heads + g) * page_size * D;
            run(k + offset, v + offset, filled(b, i));  // only the filled slots: the rest may hold anything
        }
    }
};

// How many splits: enough work items for two per thread (so that uneven items even out), but no
// split shorter than kMinKeysPerSplit keys, where the fixed cost of a work item would start to
// show. A requested count is used as given, except that more splits than the longest sequence has
// units would only add empty ones, and that it is capped at kMaxSplits.
idx choose_splits(idx requested, idx work_items, idx longest_units, idx units_per_min_split) {
    const idx most = std::clamp<idx>(longest_units, 1, kMaxSplits);
    if (requested > 0) return std::min(requested, most);
    if (work_items == 0) return 1;
    const idx want = (2 * tile::max_threads() + work_items - 1) / work_items;
    return std::clamp<idx>(want, 1, std::max<idx>(1, longest_units / units_per_min_split));
}

// The two phases shared by both caches. partial holds, per (sequence, head, split), the
// unnormalised output u (D floats) followed by m and l.
template <class Cache>
void decode_with(const DecodeShape& s, const float* q, const Cache& cache, idx units_per_min_split,
                 float* o) {
    const idx D = s.head_dim, R = s.heads / s.kv_heads, bg = s.batch * s.kv_heads;
    idx longest = 0;
    for (idx b = 0; b < s.batch; ++b) longest = std::max(longest, cache.units(b));
    const idx splits = choose_splits(s.splits, bg, longest, units_per_min_split);
    const idx stride = D + 2;
    std::vector<float> partial(static_cast<std::size_t>(s.batch * s.heads * splits * stride));
    const int threads = tile::max_threads();
    const idx per_thread = tile::padded_floats(R * kBlock + 2 * R * D + 3 * R);
    std::vector<float> work(static_cast<std::size_t>(threads * per_thread));
    const float c = s.scale * tile::kLog2e;
    float* part = partial.data();
    float* w = work.data();

    // Phase 1: (sequence, kv head, split) items, each folding its keys into the state (u, m, l) of
    // the R query heads of the group, then storing it in partial.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (idx t = 0; t < bg * splits; ++t) {
        const idx b = t / (s.kv_heads * splits), g = (t / splits) % s.kv_heads, sp = t % splits;
        const idx n = cache.units(b), chunk = (n + splits - 1) / splits;
        const idx u0 = std::min(n, sp * chunk), u1 = std::min(n, u0 + chunk);
        float* S = w + tile::thread_id() * per_thread;  // R x kBlock scores
        float* U = S + R * kBlock;                      // R x D unnormalised outputs
        float* PV = U + R * D;                          // R x D: one block's P V
        float* m = PV + R * D;
        float* l = m + R;
        float* alpha = l + R;
        std::fill(U, U + R * D, 0.0f);
        std::fill(m, m + R, kNegInf);
        std::fill(l, l + R, 0.0f);
        const float* qg = q + (b * s.heads + g * R) * D;  // the group's heads are consecutive rows
        // Cut the item's runs into blocks of kBlock keys (a long run into several, short pages
        // gathered into one) and fold each block.
        KeyRun block[kBlock];
        idx n_runs = 0, filled = 0;
        auto flush = [&]() {
            if (n_runs > 0) fold_block(R, D, c, qg, block, n_runs, S, m, l, U, PV, alpha);
            n_runs = filled = 0;
        };
        cache.for_each_run(b, g, u0, u1, [&](const float* k, const float* v, idx len) {
            while (len > 0) {
                const idx take = std::min(len, kBlock - filled);
                block[n_runs++] = KeyRun{k, v, take};
                filled += take;
                k += take * D;
                v += take * D;
                len -= take;
                if (filled == kBlock) {
                    // The run goes on past this block: request its next rows now, so that they
                    // arrive while this block is folded (the tile products prefetch only within
                    // their block).
                    const idx ahead = std::min(len, tile::kPrefetchRows);
                    tile::prefetch_rows(k, D, D, 0, ahead);
                    tile::prefetch_rows(v, D, D, 0, ahead);
                    flush();
                }
            }
        });
        flush();
        for (idx r = 0; r < R; ++r) {
            float* dst = part + ((b * s.heads + g * R + r) * splits + sp) * stride;
            std::copy(U + r * D, U + (r + 1) * D, dst);
            dst[D] = m[r];
            dst[D + 1] = l[r];
        }
    }
    // Phase 2: merge the splits of each (sequence, head) (F3) and normalise (F1).
#pragma omp parallel for schedule(static) num_threads(threads)
    for (idx bh = 0; bh < s.batch * s.heads; ++bh) {
        const float* p = part + bh * splits * stride;
        float* orow = o + bh * D;
        float m = kNegInf;
        for (idx sp = 0; sp < splits; ++sp) m = std::max(m, p[sp * stride + D]);
        std::fill(orow, orow + D, 0.0f);
        if (m == kNegInf) continue;  // no key at all (length 0): o = 0
        float l = 0.0f;
        for (idx sp = 0; sp < splits; ++sp) {
            const float* ps = p + sp * stride;
            if (ps[D] == kNegInf) continue;  // an empty split
            const float w_sp = std::exp2(ps[D] - m);
            l += w_sp * ps[D + 1];
            for (idx d = 0; d < D; ++d) orow[d] += w_sp * ps[d];
        }
        for (idx d = 0; d < D; ++d) orow[d] /= l;
    }
}

void check_decode_shape(const DecodeShape& s) {
    auto fail = [](const std::string& what) { throw std::invalid_argument("decode: " + what); };
    if (s.batch < 0 || s.heads < 0) fail("negative size");
    if (s.kv_heads < 1 || s.heads % s.kv_heads != 0)
        fail("kv_heads = " + std::to_string(s.kv_heads) + " must be >= 1 and divide heads = " +
             std::to_string(s.heads));
    if (s.head_dim < 1) fail("head_dim must be >= 1, got " + std::to_string(s.head_dim));
    if (s.splits < 0) fail("splits must be >= 0 (0 = automatic), got " + std::to_string(s.splits));
    if (!std::isfinite(s.scale)) fail("scale must be finite");
}

}  // namespace

void decode_cpu(const DecodeShape& shape, const float* q, const float* k_cache,
                const float* v_cache, idx t_max, const std::int64_t* lengths, float* o) {
    check_decode_shape(shape);
    if (t_max < 0) throw std::invalid_argument("decode: t_max must be >= 0");
    for (idx b = 0; b < shape.batch; ++b)
        if (lengths[b] < 0 || lengths[b] > t_max)
            throw std::invalid_argument("decode: lengths[" + std::to_string(b) + "] = " +
                                        std::to_string(lengths[b]) + " is outside [0, t_max = " +
                                        std::to_string(t_max) + "]");
    const ContiguousCache cache{k_cache, v_cache, t_max, shape.kv_heads, shape.head_dim, lengths};
    decode_with(shape, q, cache, kMinKeysPerSplit, o);
}

void paged_decode_cpu(const DecodeShape& shape, const float* q, const float* k_pages,
                      const float* v_pages, idx n_pages, idx page_size,
                      const std::int32_t* page_table, idx max_pages, const std::int64_t* lengths,
                      float* o) {
    check_decode_shape(shape);
    if (page_size < 1) throw std::invalid_argument("paged_decode: page_size must be >= 1");
    if (n_pages < 0 || max_pages < 0) throw std::invalid_argument("paged_decode: negative size");
    for (idx b = 0; b < shape.batch; ++b) {
        const idx length = lengths[b];
        if (length < 0 || length > max_pages * page_size)
            throw std::invalid_argument(
                "paged_decode: lengths[" + std::to_string(b) + "] = " + std::to_string(length) +
                " is outside [0, max_pages * page_size = " + std::to_string(max_pages * page_size) + "]");
        for (idx i = 0; i < (length + page_size - 1) / page_size; ++i) {
            const idx page = page_table[b * max_pages + i];
            if (page < 0 || page >= n_pages)
                throw std::invalid_argument(
                    "paged_decode: page_table[" + std::to_string(b) + ", " + std::to_string(i) +
                    "] = " + std::to_string(page) + " is outside [0, n_pages = " +
                    std::to_string(n_pages) + ") but sequence " + std::to_string(b) +
                    " of length " + std::to_string(length) + " needs it");
        }
    }
    const PagedCache cache{k_pages, v_pages, page_size, shape.kv_heads, shape.head_dim, max_pages,
                           page_table, lengths};
    decode_with(shape, q, cache, std::max<idx>(1, kMinKeysPerSplit / page_size), o);
}

}  // namespace refmath
