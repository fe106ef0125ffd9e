// Decode attention on the CPU: one query per sequence against its whole cached context, with the
// context split across threads (split-K) and the pieces merged by the online-softmax rule (F3).
//
// A decode step reads every cached key and value once and does ~2 multiply-adds per number read
// per query head, so it should be limited by memory bandwidth, not arithmetic. Three things follow:
// * The R = H/G query heads of a GQA group are handled together, so each key and value is read from
//   memory once per group, not once per query head.
// * One long sequence must still keep every core streaming: the work items are
//   (sequence, key/value head, split), where a split is a contiguous chunk of the sequence's keys
//   (or pages; a paged item takes 2 key/value heads together, see decode_with). Each item leaves
//   its unnormalised (u, m, l) (F2); a second, tiny loop merges the splits of each (sequence,
//   head) (F3). An empty split (more splits than keys) leaves the empty state m = -inf, l = 0,
//   u = 0, which the merge skips.
// * The arithmetic must keep up with memory, which takes tight inner loops: a block of kBlock keys
//   is folded at a time (one max and one exponential pass per block, not per key), its scores and
//   its P V computed by small register tiles (fold_block), and the keys of a later block are
//   requested from memory while this one is computed, spread over its loops; further on, one line
//   of every 4 KiB is requested well ahead (look_ahead), a page of memory's first touch being the
//   slow one.
//
// A block is given as one pointer per key (to its key row and its value row), so a paged cache costs
// the same as a contiguous one: a block may gather keys from several pages, and a page may be cut
// across blocks, with no special case in the arithmetic.
//
// Where one thread stands on an Intel Xeon (Ice Lake, AVX-512; 1 thread, T = 32k and 128k, CPU
// time, paired turns, the machine shared, load 3-5): 89-92% of a plain read of the same bytes (10.8
// and 11.1 against 12.1 and 12.0 GB/s, benchmarks/results/2026-12-07-0315-decode.md; the paged
// decode at 1.01-1.06x its time), from 80-81% before the requests were spread (LineRequests;
// 2026-12-07-0259-decode.md). With K and V in the
// caches (T = 128, a C++ loop of calls) the kernel reads 22-27 GB/s, about twice what the core
// reads from memory, so what was missing was overlap, not arithmetic: taking the whole online
// softmax out (a fifth of that time; the result then wrong) moved the cold rate from 83-86% to
// 88-90% only. The memory traffic is the software prefetches' (none at all: 70-77%). Tried there
// and no faster from memory (before LineRequests): requests 2, 3 or 4 blocks ahead; into level 1
// (hint 3: 74-80%) or with hint 1 (the same as hint 2); one request per 128 or 256 bytes, or only
// the first 0.5-2 KiB of each 4 KiB, leaving the rest to the hardware prefetchers (66-81%); key
// rows or value rows alone (75-78%); the look-ahead off (the same, in 2 MiB pages); a 16-lane
// softmax of the whole block (one vector per row, the same bits: 1-3% faster in cache, unchanged
// from memory); the folds pipelined (the next block's scores before this block's P V, hiding the
// softmax's dependent chain: unchanged); 32-key blocks (10% faster in cache, 80% from memory
// against 85%) and P V tiles of 4 x 4 vectors (4-7% faster in cache, 79-80% from memory): both
// also make the bursts of requests larger. A plain read that takes K and V in the kernel's order
// (8 KiB of one, then of the other) reads as fast as one stream.
//
// One core of a Zen 4 (1 thread, T = 32k, builds in paired turns, benchmarks/paired_builds.py
// --workload decode; benchmarks/README.md has the figures) reads 77-78% of a plain read. There the
// level-2 requests are everything: without those for the rows the kernel took 0.31x the speed,
// into level 1 (hint 3) or non-temporal (hint 0) 0.47x, 2 blocks ahead 0.96x, half a block ahead
// 0.92x. There the hardware prefetchers follow memory read line after line, not the order of the
// register tiles (four key rows side by side, the value rows down columns of 32 floats):
// benchmarks/read_order.sh reads K and V both ways, with the kernel's 4 multiply-adds per 64-byte
// read between the reads. The kernel reads about the rate of its software requests. Reading each
// block front to back first made it slower, and so did two folds that read memory in order with
// the same bits: one with the block's P V sums in a level-1 buffer (1.3-2.7x the time in the
// caches: four times the query loads, a load and a store of the buffer per multiply-add), and one
// as fast as the tiles in the caches (two query heads at a time, their rows in registers, each
// key and value row read whole, twice), which from memory still did not stream without requests
// (0.75-0.86x the speed in alternating runs). Nor is the arithmetic the limit there: at R = 2, with
// the caches warm, the kernel reads 1.6x what the core reads from memory, and from memory no more
// than at R = 4. The second of those folds was tried again with each row's address computed from
// the block's start (a block that is one run of memory) instead of loaded from the block's list:
// in a C++ loop, a plain in-order read of K and V (2 MiB-aligned) through loaded row addresses
// read 14-17 GB/s and through computed ones 23-28, while the tiles' order without requests read
// 7-10 GB/s either way. That fold kept the bits and was 1.03-1.06x as fast in the caches, but
// from memory it swung between 1.23x and 0.51x the kernel's speed from one run to the next
// (paired calls in one C++ process, with stretches of seconds at 9 GB/s), and as the Python
// module it ran at 0.61-0.90x the speed contiguous and 0.49-0.55x paged
// (benchmarks/paired_builds.py).
#include "decode_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>

#include "online_softmax.h"
#include "piece_team.h"
#include "tile_math.h"

namespace refmath {

namespace {

using tile::f32x8;
using tile::idx;

// Keys per online-softmax step. 16, not 32: at the usual page size of 16 a block is then exactly
// one page, so a paged block reads one run of memory and never gathers across a page boundary,
// and the contiguous decode, folding the same 16-key blocks, gives the same bits (lesson 12). It
// also measured faster for both (B = 1, H = 32, G = 8, D = 128, 2 threads, AVX2: contiguous 4k
// 2.3-2.5 ms against 2.6-3.0, paged 4k 2.5-2.7 ms against 3.0-3.7).
constexpr idx kBlock = 16;
constexpr idx kPad = 8;                // room to round a block up to a whole register tile of keys
constexpr idx kItemsPerThread = 8;     // automatic splits: work items per thread (see choose_splits)
constexpr idx kMinKeysPerSplit = 512;  // automatic splits keep at least this many keys each
constexpr idx kMaxSplits = 1024;       // a bound on the scratch (B * H * splits * (D + 2) floats)
constexpr idx kMaxHeadsPerItem = 8;    // key/value heads a work item may read together
// Key/value heads one paged work item reads together (see decode_with): 2, a rung on 8 (all the
// heads of a page, one 64 KiB run of keys and one of values at G = 8, first chosen on a Zen 4).
// Once the requests were spread over the fold (LineRequests), 8 heads per item were the slower on
// an Intel Xeon (Ice Lake, AVX-512; 1 thread, T = 32k, page size 16, pages scattered, a C++ loop
// of calls in paired turns, CPU time, load 2-3): 81-83% of a plain read of the same bytes, against
// 84-87% with 4, 87-89% with 2 and 86-87% with 1. The likely reason: an item's state is a
// head's queries and U (4 KiB at R = 4, D = 128) per head, so 8 heads cycle 32 KiB of state
// through a 48 KiB level 1 beside the 16 KiB block of each fold. 2 heads still read 16 KiB runs of
// a page. On a Zen 4 (1 thread, T = 32k, the same pages, builds in paired turns), against 2: 1 head
// 0.93x the speed, 4 heads 0.95x and 8 heads 1.01x, where a pair of equal builds gave 0.98-1.00x.
constexpr idx kPagedHeadsPerItem = 2;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Up to kBlock keys: the key row and the value row of each (D floats each, anywhere in memory).
// Entries n .. n + kPad - 1 repeat the last key, so that a register tile may run past n: the extra
// scores are computed and never used, and no address outside the cache is read.
struct KeyBlock {
    const float* k[kBlock + kPad];
    const float* v[kBlock + kPad];
    idx n = 0;

    void pad() {
        for (idx j = n; j < n + kPad && n > 0; ++j) {
            k[j] = k[n - 1];
            v[j] = v[n - 1];
        }
    }
};

// Request the cache lines of one row of D floats (the row need not start on a line boundary) into
// the level-2 cache (locality hint 2: prefetcht1 on x86). What a fold requests is the block folded
// next (32 KiB for D = 128, see decode_with), and on a machine whose level 1 holds no more than
// that, lines fetched all the way into it were pushed out again before use; into level 2 the same
// requests decoded 5-10% faster (contiguous and paged).
REFMATH_INLINE void prefetch_row(const float* row, idx D) {
    const std::uintptr_t end = reinterpret_cast<std::uintptr_t>(row + D);
    for (std::uintptr_t a = reinterpret_cast<std::uintptr_t>(row) & ~std::uintptr_t{63}; a < end; a += 64)
        __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 2);
}

// The lines of some rows (the same lines as prefetch_row's), requested a few at a time: a rung on
// requesting each row's lines all at once. The fold used to request four rows of the next block
// (32 lines) before each score tile and each P V tile; now score_rows requests NR lines per 64
// bytes of its loop along d and pv_tile a few per key, so the requests go out at an even pace
// among the multiply-adds. A core can keep only so many requests to memory in flight (its fill
// buffers), and a burst of 32 left the rest waiting in its load queue, ahead of the tile's own
// loads. On an Intel Xeon (Ice Lake, AVX-512; 1 thread, T = 32k, B = 1, H = 32, G = 8, D = 128, a
// C++ loop of calls in paired turns, CPU time, caches in 2 MiB pages, load 4-5) the contiguous
// decode read 10.8-11.0 GB/s against 10.2-10.6 (87-88% of a plain read in the same turns against
// 84-86%), the paged one 10.1-10.5 against 10.0-10.2 (83-84% against 80-81%); the bits are the
// same. The order of the lines among the requests mattered less than the pace: spreading the key
// rows' requests alone gave half the gain.
struct LineRequests {
    const float* const* rows;  // the rows not yet begun
    idx left, D;
    std::uintptr_t line = 0, end = 0;  // the next line of the current row, and the row's end

    // Request up to k more lines.
    REFMATH_INLINE void issue(idx k) {
        for (; k > 0; --k) {
            if (line >= end) {
                if (left == 0) return;
                line = reinterpret_cast<std::uintptr_t>(*rows) & ~std::uintptr_t{63};
                end = reinterpret_cast<std::uintptr_t>(*rows + D);
                ++rows;
                --left;
            }
            __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
            line += 64;
        }
    }
    REFMATH_INLINE void rest() { issue(std::numeric_limits<idx>::max()); }
};

// The look-ahead (a rung on prefetch_row's one block ahead): besides the rows of the next block,
// one line in every 4 KiB of memory that a cursor reads further on, requested well before the
// block that holds it (kLookAheadFloats further on for a contiguous cache, the whole next page
// for a paged one). The rows of the next block arrive in time only if the first touch of each
// 4 KiB page of memory (the translation of its address, the memory row it opens) has already
// happened; requested one block ahead, that first touch was still waiting when the fold
// needed the row. One request per 4 KiB costs little and takes that wait out of the fold. How
// much it buys depends on the size of the memory pages: on a 2-core Zen 4 (1 thread, H = 32,
// G = 8, D = 128, cold caches, the CPU time of paired calls, the machine shared, load 4-8), with
// caches in 4 KiB pages (a C++ caller's plain allocation) paged decode took 0.76x its time at
// T = 4k and 0.83x at 32k, contiguous 0.85x and 0.74x; in 2 MiB pages (NumPy's large arrays,
// where the system grants them) the first touches are 512 times rarer and it bought less:
// paged 0.94-0.98x and contiguous 0.94-0.99x at 4k to 64k, never slower.
constexpr idx kLookAheadFloats = 16384;   // 64 KiB: in a contiguous cache, how far further on
constexpr idx kLookAheadStride = 1024;    // 4 KiB: one request per page of memory

REFMATH_INLINE void look_ahead(const float* from, idx n) {
    for (idx x = 0; x < n; x += kLookAheadStride) __builtin_prefetch(from + x, 0, 2);
}

// S[r, j] = q_r . k_j for rows 0..MR-1 of q (row stride D, already scaled) and keys j < n (rounded
// up to a multiple of NR; the block's padding makes that safe). The register tile is MR rows x NR
// keys, one vector accumulator per (row, key) running along d, L products each (L = 8 or 16 lanes),
// then 8 more with 8-lane vectors where D % 16 leaves 8. The lanes of the tile's accumulators are
// summed eight at a time (sum_lanes_8x8), so each dot product is summed in the same order whatever
// the tile's shape. While the keys are multiplied, the key rows of block 'ahead' are requested (pf:
// whether this row group does it; only the first one does).
//
// Each step along d loads NR key vectors and MR query vectors for MR * NR multiply-adds. The tile
// must fit the vector registers with room for those loads: otherwise GCC takes the operands it has
// no register for straight from memory in every multiply-add, and a query vector used by NR keys is
// loaded NR times. The shapes used: 4 x 4 for 16-lane vectors (16 accumulators of AVX-512's 32
// registers: 8 loads per 16 multiply-adds), 4 x 3 for 8-lane ones (12 of AVX2's 16: 7 loads per 12).
// A 4 x 2 tile, for either width, took every query vector from memory twice (10 loads per 8
// multiply-adds), and the loads were the limit: on a Zen 4, the scores of a block held in level 2
// took 49 cycles of the time-stamp counter per key with it against 27 with 4 x 4 (16 lanes), and
// 47 against 33 with 4 x 3 (8 lanes), prefetches left out.
template <int MR, int NR, class V>
REFMATH_INLINE void score_rows(idx n, idx D, const float* q, const KeyBlock& blk, float* S, idx lds,
                               const KeyBlock& ahead, bool pf) {
    constexpr int A = MR * NR;        // accumulators
    constexpr int A8 = (A + 7) / 8 * 8;  // rounded up to whole groups of eight lane sums
    constexpr int L = tile::kLanes<V>;
    const idx DL = D - D % L;
    for (idx j = 0; j < n; j += NR) {
        // The tile's share of the rows of 'ahead' (LineRequests): NR lines per 64 bytes along d.
        LineRequests req{ahead.k + j, pf ? std::max<idx>(0, std::min<idx>(NR, ahead.n - j)) : 0, D};
        const float* kr[NR];
        for (int c = 0; c < NR; ++c) kr[c] = blk.k[j + c];
        V acc[A];
        for (int i = 0; i < A; ++i) acc[i] = tile::zerov<V>();
        for (idx d = 0; d < DL; d += L) {
            V kv[NR];
            for (int c = 0; c < NR; ++c) kv[c] = tile::loadv<V>(kr[c] + d);
            if (d % 16 == 0) req.issue(NR);
            for (int r = 0; r < MR; ++r) {
                const V x = tile::loadv<V>(q + r * D + d);
                for (int c = 0; c < NR; ++c) acc[r * NR + c] += x * kv[c];
            }
        }
        req.rest();  // lines the loop did not reach (a row off a line boundary, D % 16 != 0)
        f32x8 halves[A8];
        for (int i = 0; i < A; ++i) halves[i] = tile::fold_halves(acc[i]);
        for (int i = A; i < A8; ++i) halves[i] = f32x8{};
        idx d8 = DL;
        if (L > 8 && d8 + 8 <= D) {  // 16-lane vectors: 8 columns left over, one 8-lane step
            for (int r = 0; r < MR; ++r) {
                const f32x8 x = tile::load8(q + r * D + d8);
                for (int c = 0; c < NR; ++c) halves[r * NR + c] += x * tile::load8(kr[c] + d8);
            }
            d8 += 8;
        }
        float sums[A8];
        for (int g = 0; g < A8; g += 8) {
            const f32x8 group[8] = {halves[g],     halves[g + 1], halves[g + 2], halves[g + 3],
                                    halves[g + 4], halves[g + 5], halves[g + 6], halves[g + 7]};
            tile::store8(sums + g, tile::sum_lanes_8x8(group));
        }
        for (idx d = d8; d < D; ++d)  // the D % 8 products left over
            for (int r = 0; r < MR; ++r)
                for (int c = 0; c < NR; ++c) sums[r * NR + c] += q[r * D + d] * kr[c][d];
        for (int r = 0; r < MR; ++r)
            for (int c = 0; c < NR; ++c) S[r * lds + j + c] = sums[r * NR + c];
    }
}

// U[r, d0 .. d0 + L NV) = alpha_r U[r, ...] + sum_{j < n} P[r, j] v_j[d0 ...] for rows 0..MR-1 (L
// the lanes of V): a register tile of MR rows x NV vectors, summed over the block's keys, then
// added to U (F3). The
// block's own sum is kept apart from U until it is complete, so the long sum over the whole
// context is a chain of one addition per block, not one per key.
template <int MR, int NV, class V>
REFMATH_INLINE void pv_tile(idx n, idx d0, const float* P, idx ldp, const KeyBlock& blk,
                            const float* alpha, float* U, idx ldu, LineRequests* req = nullptr,
                            idx per_key = 0) {
    constexpr int L = tile::kLanes<V>;
    V acc[MR][NV];
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NV; ++c) acc[r][c] = tile::zerov<V>();
    for (idx j = 0; j < n; ++j) {
        if (req != nullptr) req->issue(per_key);
        const float* vr = blk.v[j] + d0;
        V vv[NV];
        for (int c = 0; c < NV; ++c) vv[c] = tile::loadv<V>(vr + L * c);
        for (int r = 0; r < MR; ++r) {
            const float p = P[r * ldp + j];
            for (int c = 0; c < NV; ++c) acc[r][c] += p * vv[c];
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NV; ++c) {
            float* u = U + r * ldu + d0 + L * c;
            tile::storev(u, alpha[r] * tile::loadv<V>(u) + acc[r][c]);
        }
}

// The whole width D for rows 0..MR-1: tiles of NV vectors V, then single vectors V, then single
// 8-lane vectors, then the last columns one by one. The value rows of block 'ahead' are requested a
// few lines per key of each full tile (LineRequests).
template <int MR, int NV, class V>
REFMATH_INLINE void pv_rows(idx n, idx D, const float* P, idx ldp, const KeyBlock& blk,
                            const float* alpha, float* U, const KeyBlock& ahead, bool pf) {
    constexpr int L = tile::kLanes<V>;
    const idx tiles = D / (L * NV);
    const idx per_tile = tiles > 0 ? (ahead.n + tiles - 1) / tiles : 0;
    idx next = pf ? 0 : ahead.n;  // the next row of 'ahead' to request
    idx d = 0;
    for (; d + L * NV <= D; d += L * NV) {
        // The tile's rows of 'ahead', a few lines per key (LineRequests); D / 16 + 1 lines a row
        // at most (one more where a row does not start on a line).
        const idx rows = std::min(ahead.n, next + per_tile) - next;
        LineRequests req{ahead.v + next, rows, D};
        const idx per_key = n > 0 ? (rows * (D / 16 + 1) + n - 1) / n : 0;
        pv_tile<MR, NV, V>(n, d, P, ldp, blk, alpha, U, D, &req, per_key);
        req.rest();
        next += rows;
    }
    for (; next < ahead.n; ++next) prefetch_row(ahead.v[next], D);
    for (; d + L <= D; d += L) pv_tile<MR, 1, V>(n, d, P, ldp, blk, alpha, U, D);
    for (; d + 8 <= D; d += 8) pv_tile<MR, 1, f32x8>(n, d, P, ldp, blk, alpha, U, D);
    for (; d < D; ++d)
        for (int r = 0; r < MR; ++r) {
            float s = 0.0f;
            for (idx j = 0; j < n; ++j) s += P[r * ldp + j] * blk.v[j][d];
            U[r * D + d] = alpha[r] * U[r * D + d] + s;
        }
}

// Fold one block of keys into the state (U, m, l) of the R query heads of one group (qs: their
// rows, scaled by scale * log2(e)): S = Q K^T (R x n, base 2), the online softmax over the block
// (F2), then U = alpha U + P V. Rows go four at a time (the tiles that suit GQA's usual 4 or 8
// heads per group), then two, then one, each shape with 8 accumulators.
template <class V>
REFMATH_INLINE void fold_block_impl(idx R, idx D, const float* qs, const KeyBlock& blk,
                                    const KeyBlock& ahead, float* S, float* m, float* l, float* alpha,
                                    float* U) {
    constexpr idx lds = kBlock + kPad;
    const idx n = blk.n;
    idx r = 0;
    constexpr int kKeysPerTile = tile::kLanes<V> == 16 ? 4 : 3;  // see score_rows
    for (; r + 4 <= R; r += 4)
        score_rows<4, kKeysPerTile, V>(n, D, qs + r * D, blk, S + r * lds, lds, ahead, r == 0);
    for (; r + 2 <= R; r += 2)
        score_rows<2, 4, V>(n, D, qs + r * D, blk, S + r * lds, lds, ahead, r == 0);
    for (; r < R; ++r) score_rows<1, 8, V>(n, D, qs + r * D, blk, S + r * lds, lds, ahead, r == 0);
    online_softmax_fold(R, n, S, lds, 1.0f, m, l, alpha);
    r = 0;
    for (; r + 4 <= R; r += 4)
        pv_rows<4, 2, V>(n, D, S + r * lds, lds, blk, alpha + r, U + r * D, ahead, r == 0);
    for (; r + 2 <= R; r += 2)
        pv_rows<2, 4, V>(n, D, S + r * lds, lds, blk, alpha + r, U + r * D, ahead, r == 0);
    // One row: tiles of 64 columns (8 accumulators of 8 lanes, or 4 of 16), so that D = 64 still
    // gets a full tile.
    for (; r < R; ++r)
        pv_rows<1, 64 / tile::kLanes<V>, V>(n, D, S + r * lds, lds, blk, alpha + r, U + r * D, ahead,
                                           r == 0);
}

// The 8-lane and the 16-lane copies (see REFMATH_AVX512 in tile_math.h).
REFMATH_MULTIVERSION
void fold_block(idx R, idx D, const float* qs, const KeyBlock& blk, const KeyBlock& ahead, float* S,
                float* m, float* l, float* alpha, float* U) {
    fold_block_impl<f32x8>(R, D, qs, blk, ahead, S, m, l, alpha, U);
}

#if REFMATH_HAVE_AVX512
REFMATH_AVX512
void fold_block_wide(idx R, idx D, const float* qs, const KeyBlock& blk, const KeyBlock& ahead,
                     float* S, float* m, float* l, float* alpha, float* U) {
    fold_block_impl<tile::f32x16>(R, D, qs, blk, ahead, S, m, l, alpha, U);
}
#endif

// Where sequence b's keys are. A cache is cut into 'units' (keys, or pages) that splits divide;
// cursor(b, g, u0, u1) walks the keys of head g in units [u0, u1), and its fill(blk) puts the next
// (up to) kBlock of them into blk (blk.n = 0 once they are all taken).
struct ContiguousCache {
    const float *k, *v;
    idx t_max, kv_heads, D;
    const std::int32_t* lengths;

    struct Cursor {
        const float *k, *v;
        idx left, D;
        void fill(KeyBlock& blk) {
            blk.n = std::min(kBlock, left);
            for (idx j = 0; j < blk.n; ++j) {
                blk.k[j] = k + j * D;
                blk.v[j] = v + j * D;
            }
            blk.pad();
            left -= blk.n;
            k += blk.n * D;
            v += blk.n * D;
            // The stretch this block's width further on than kLookAheadFloats, within the keys
            // left: over the blocks, one request in every 4 KiB of the cursor's keys and values.
            const idx lo = kLookAheadFloats, hi = std::min(left * D, lo + blk.n * D);
            if (hi > lo) {
                look_ahead(k + lo, hi - lo);
                look_ahead(v + lo, hi - lo);
            }
        }
    };

    idx units(idx b) const { return lengths[b]; }
    Cursor cursor(idx b, idx g, idx u0, idx u1) const {
        const idx offset = ((b * kv_heads + g) * t_max + u0) * D;
        return Cursor{k + offset, v + offset, u1 - u0, D};
    }
};

struct PagedCache {
    const float *k, *v;
    idx page_size, kv_heads, D, max_pages;
    const std::int32_t* table;
    const std::int32_t* lengths;

    idx units(idx b) const { return (lengths[b] + page_size - 1) / page_size; }

    // Only the filled slots of each page are read: the rest may hold anything.
    // The sequence's row of the page table, its length and head g's offset within a page are
    // looked up once per cursor, not once per page.
    struct Cursor {
        const PagedCache* cache;
        const std::int32_t* pages;          // page_table row b
        idx length, head_offset;            // keys of sequence b; g * page_size * D
        idx page, end, slot, filled;        // logical page, one past the last, slot in the page
        const float *k, *v;                 // the current page's rows for head g

        void open(idx i) {
            page = i;
            slot = 0;
            if (page >= end) return;
            const PagedCache& c = *cache;
            filled = std::min(c.page_size, length - page * c.page_size);
            const idx offset = pages[page] * c.kv_heads * c.page_size * c.D + head_offset;
            k = c.k + offset;
            v = c.v + offset;
            if (page + 1 < end) {  // the look-ahead: the next page, while this one is read
                const idx next = pages[page + 1] * c.kv_heads * c.page_size * c.D + head_offset;
                look_ahead(c.k + next, c.page_size * c.D);
                look_ahead(c.v + next, c.page_size * c.D);
            }
        }
        void fill(KeyBlock& blk) {
            const idx D = cache->D;
            blk.n = 0;
            while (blk.n < kBlock && page < end) {
                const idx take = std::min(kBlock - blk.n, filled - slot);
                for (idx j = 0; j < take; ++j) {
                    blk.k[blk.n + j] = k + (slot + j) * D;
                    blk.v[blk.n + j] = v + (slot + j) * D;
                }
                blk.n += take;
                slot += take;
                if (slot == filled) open(page + 1);
            }
            blk.pad();
        }
    };

    Cursor cursor(idx b, idx g, idx u0, idx u1) const {
        Cursor c{this, table + b * max_pages, lengths[b], g * page_size * D, u0, u1, 0, 0, nullptr,
                 nullptr};
        c.open(u0);
        return c;
    }
};
// How many splits: enough work items for kItemsPerThread per thread, so that uneven items even out,
// and so does a thread that the operating system pauses for a while (another process on the same
// cores): the others take its share of the items meanwhile. But no split shorter than
// kMinKeysPerSplit keys, where the fixed cost of a work item would start to show. On one thread
// there is nothing to even out, so each (sequence, set of heads) is one item: a split costs its
// start (state, first blocks requested with nothing to overlap them) and its share of the merge,
// and a paged item, which then held 8 heads, was otherwise cut into 8 splits (1 thread, T = 1024, the
// cache warm, Zen 4: 8 splits 0.30 ms against 0.28 ms for one, for paged and contiguous alike). A
// requested count is used as given, except that more splits than the longest sequence has units
// would only add empty ones, and that it is capped at kMaxSplits.
idx choose_splits(idx requested, idx work_items, idx longest_units, idx units_per_min_split,
                  int threads) {
    const idx most = std::clamp<idx>(longest_units, 1, kMaxSplits);
    if (requested > 0) return std::min(requested, most);
    if (work_items == 0 || threads <= 1) return 1;
    const idx want = (kItemsPerThread * threads + work_items - 1) / work_items;
    return std::clamp<idx>(want, 1, std::max<idx>(1, longest_units / units_per_min_split));
}

// The splits of one (sequence, head), p (splits x (D + 2)), merged into its output row orow (D).
void merge_splits(const float* p, idx splits, idx D, float* orow) {
    const idx stride = D + 2;
    float m = kNegInf;
    for (idx sp = 0; sp < splits; ++sp) m = std::max(m, p[sp * stride + D]);
    // Every split is weighed, the empty ones too: an empty split (m = -inf, l = 0, u = 0) gets
    // weight 2^(-inf) = 0 and adds 0, while one whose scores were all NaN (m = -inf, l and u
    // NaN) adds 0 * NaN = NaN, as it must. No split with a key at all (m = -inf, l = 0): o = 0.
    const float shift = m == kNegInf ? 0.0f : m;
    std::fill(orow, orow + D, 0.0f);
    float l = 0.0f;
    for (idx sp = 0; sp < splits; ++sp) {
        const float* ps = p + sp * stride;
        const float w_sp = std::exp2(ps[D] - shift);
        l += w_sp * ps[D + 1];
        for (idx d = 0; d < D; ++d) orow[d] += w_sp * ps[d];
    }
    if (l != 0.0f)  // l > 0, or NaN
        for (idx d = 0; d < D; ++d) orow[d] /= l;
}

// The two phases shared by both caches. partial holds, per (sequence, head, split), the
// unnormalised output u (D floats) followed by m and l.
//
// A work item takes `heads_per_item` consecutive key/value heads of one sequence and split (each
// with the R query heads of its group) and walks their keys block by block, the heads of a block
// one after another. For a contiguous cache one head per item is right: each head's keys are one
// run. A paged pool (n_pages, G, page_size, D) keeps the G heads of a page side by side, so one
// head's keys are page_size * D floats every G * page_size * D: at page_size 16, D = 128 and G = 8,
// 8 KiB every 64 KiB. Every one of them then falls on the same eighth of the sets of a cache whose
// way is 64 KiB (a common level-2 size), and the keys requested ahead evict each other before use.
// Taking several heads of a page together reads them as one run instead: kPagedHeadsPerItem.
template <class Cache>
void decode_with(const DecodeShape& s, const float* q, const Cache& cache, idx units_per_min_split,
                 idx heads_per_item, float* o) {
    const idx D = s.head_dim, R = s.heads / s.kv_heads;
    const idx GI = std::clamp<idx>(heads_per_item, 1, std::min<idx>(s.kv_heads, kMaxHeadsPerItem));
    const idx head_sets = (s.kv_heads + GI - 1) / GI, items_per_split = s.batch * head_sets;
    idx longest = 0;
    for (idx b = 0; b < s.batch; ++b) longest = std::max(longest, cache.units(b));
    double keys = 0;  // every (sequence, key) pair costs 2 D multiply-adds per query head
    for (idx b = 0; b < s.batch; ++b) keys += static_cast<double>(cache.lengths[b]);
    const int threads = tile::threads_for(2.0 * keys * s.heads * D);
    // The shortest split is set for one head per item; an item of GI heads has GI times the work.
    const idx splits = choose_splits(s.splits, items_per_split, longest,
                                     std::max<idx>(1, units_per_min_split / GI), threads);
    const idx stride = D + 2;
    // Scratch is left uninitialised (new float[], not a zero-filled vector): every entry of partial
    // is written by the item that owns it, and every entry of work before it is read, so zeroing
    // them first would be one more pass over memory per call, for nothing.
    std::unique_ptr<float[]> partial(
        new float[static_cast<std::size_t>(s.batch * s.heads * splits * stride)]);
    // Per head of an item: the group's queries (R x D, scaled), U (R x D), m, l, alpha (R each);
    // and one score buffer (R x (kBlock + kPad)) that the heads take in turn.
    const idx per_head = 2 * R * D + 3 * R;
    const idx per_thread = tile::padded_floats(R * (kBlock + kPad) + GI * per_head);
    std::unique_ptr<float[]> work(new float[static_cast<std::size_t>(threads * per_thread)]);
    const float c = tile::base2_factor(s.scale);
    float* part = partial.get();
    float* w = work.get();

    // Phase 1: (sequence, set of kv heads, split) items, each folding its keys into the state
    // (u, m, l) of the R query heads of each group, then storing it in partial.
    auto* const fold = REFMATH_PICK_WIDTH(fold_block);
    auto item = [&](idx t, int member) {
        const idx b = t / (head_sets * splits), g0 = (t / splits) % head_sets * GI, sp = t % splits;
        const idx g1 = std::min(s.kv_heads, g0 + GI);
        const idx n = cache.units(b), chunk = (n + splits - 1) / splits;
        const idx u0 = std::min(n, sp * chunk), u1 = std::min(n, u0 + chunk);
        float* S = w + member * per_thread;  // R x (kBlock + kPad) scores
        float* heads_state = S + R * (kBlock + kPad);
        // Two blocks per head, i and i + 1, located ahead of their folds (see the loop below). The
        // first fold's rows are requested here.
        KeyBlock ring[kMaxHeadsPerItem][2];
        typename Cache::Cursor cursors[kMaxHeadsPerItem];
        for (idx g = g0; g < g1; ++g) {
            float* qs = heads_state + (g - g0) * per_head;  // R x D: the group's queries, scaled
            float* U = qs + R * D;
            float* m = U + R * D;
            float* l = m + R;
            // The group's heads are consecutive rows of q. Scaling them once here, to base 2 (the
            // exponentials are 2^x), saves a multiplication per score.
            const float* qg = q + (b * s.heads + g * R) * D;
            for (idx i = 0; i < R * D; ++i) qs[i] = qg[i] * c;
            std::fill(U, U + R * D, 0.0f);
            std::fill(m, m + R, kNegInf);
            std::fill(l, l + R, 0.0f);
            cursors[g - g0] = cache.cursor(b, g, u0, u1);
            cursors[g - g0].fill(ring[g - g0][0]);
            cursors[g - g0].fill(ring[g - g0][1]);
        }
        for (idx j = 0; j < ring[0][0].n; ++j) {
            prefetch_row(ring[0][0].k[j], D);
            prefetch_row(ring[0][0].v[j], D);
        }
        // Every head of the item has the same keys (one sequence, one split): the same blocks. They
        // are folded block by block, and within a block head by head, and each fold requests the
        // rows of the fold after it: the same block of the next head, or the next block of the
        // first. That is one block ahead whatever the number of heads per item, which on a
        // 2-core AMD EPYC (AVX2) decoded about 10% faster than 2 or 4 blocks ahead (one head per
        // item), and than one block ahead per head (8 heads per item, 256 KiB ahead): the memory
        // system keeps only so many requests in flight, and the rest wait in the core's queues.
        for (idx i = 0; ring[0][i % 2].n > 0; ++i) {
            for (idx g = g0; g < g1; ++g) {
                float* qs = heads_state + (g - g0) * per_head;
                float* U = qs + R * D;
                float* m = U + R * D;
                float* l = m + R;
                float* alpha = l + R;
                KeyBlock& blk = ring[g - g0][i % 2];
                const KeyBlock& next = g + 1 < g1 ? ring[g + 1 - g0][i % 2] : ring[0][(i + 1) % 2];
                fold(R, D, qs, blk, next, S, m, l, alpha, U);
                cursors[g - g0].fill(blk);  // becomes block i + 2
            }
        }
        for (idx g = g0; g < g1; ++g) {
            const float* U = heads_state + (g - g0) * per_head + R * D;
            const float* m = U + R * D;
            const float* l = m + R;
            for (idx r = 0; r < R; ++r) {
                float* dst = part + ((b * s.heads + g * R + r) * splits + sp) * stride;
                std::copy(U + r * D, U + (r + 1) * D, dst);
                dst[D] = m[r];
                dst[D + 1] = l[r];
            }
        }
    };
    // The items are the pieces of a piece team (piece_team.h), taken in runs.
    team::run(items_per_split * splits, threads, [&](idx first, idx last, int member) {
        for (idx t = first; t < last; ++t) item(t, member);
    });
    // Phase 2: merge the splits of each (sequence, head) (F3) and normalise (F1).
    tile::note_team(threads);
    team::run(s.batch * s.heads, threads, [&](idx first, idx last, int) {
        for (idx bh = first; bh < last; ++bh)
            merge_splits(part + bh * splits * stride, splits, D, o + bh * D);
    });
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
                const float* v_cache, idx t_max, const std::int32_t* lengths, float* o) {
    check_decode_shape(shape);
    if (t_max < 0) throw std::invalid_argument("decode: t_max must be >= 0");
    for (idx b = 0; b < shape.batch; ++b)
        if (lengths[b] < 0 || lengths[b] > t_max)
            throw std::invalid_argument("decode: lengths[" + std::to_string(b) + "] = " +
                                        std::to_string(lengths[b]) + " is outside [0, t_max = " +
                                        std::to_string(t_max) + "]");
    const ContiguousCache cache{k_cache, v_cache, t_max, shape.kv_heads, shape.head_dim, lengths};
    decode_with(shape, q, cache, kMinKeysPerSplit, 1, o);
}

void paged_decode_cpu(const DecodeShape& shape, const float* q, const float* k_pages,
                      const float* v_pages, idx n_pages, idx page_size,
                      const std::int32_t* page_table, idx max_pages, const std::int32_t* lengths,
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
    decode_with(shape, q, cache, std::max<idx>(1, kMinKeysPerSplit / page_size), kPagedHeadsPerItem,
                o);
}

}  // namespace refmath
