// FlashAttention forward and backward on the CPU (catalogue F1-F5), float32 throughout.
//
// The NumPy version (refmath/flash.py) is the reading copy of the algorithm; this file is the same
// loops over the same tiles, organised for speed:
//
// * Parallel work items are (batch, head, query tile) in the forward pass. Each runs the whole key
//   loop for its kBlockQ query rows, keeping the output rows and their (m, l) in a per-thread
//   scratch block: nothing of size t_q x t_k, and O(t) extra memory in all (the logsumexp).
// * Scores and weights are computed in base 2 (the scale multiplied by log2 e), so each weight is a
//   2^x of tile::exp2_fast, a loop the compiler vectorises.
// * Every tile product is one kind, C = A B with A's entries broadcast against B's rows
//   (tile::gemm_strips), B first copied into column strips that stay in the level-1 cache
//   (tile::pack_strips). Where a product needs B^T (S = Q K^T: rows of Q against rows of K), the
//   copy is the transpose (tile::transpose_strips). Either copy is a small cost next to the product
//   that reads it.
// * Tiles that the causal mask or the window hides entirely are never visited; a tile cut by the
//   mask's edge gets -inf outside each row's visible range [lo, hi).
//
// The backward pass follows FlashAttention-2 (F4): weights are recomputed from the saved logsumexp,
// P = 2^(S log2 e - lse log2 e), and delta_i = dO_i . O_i replaces the row sums of P * dP. On a GPU
// dQ is accumulated with atomic additions from every key tile. Here every output element is written
// by exactly one thread, so no atomics are needed, by one of two schedules (which give the same
// bits, so the result does not depend on the thread count either):
//   one pass, over (batch, key/value head): for each key tile, dV += P^T dO and dK += dS^T Q,
//           summed over the query heads of the group (GQA) and the query tiles that see the key
//           tile, and dQ += dS K into the item's own query heads: 5 tile products per tile pair;
//   two passes, when there are too few such items to share among the threads evenly:
//     pass 1, over (batch, key/value head, key tile): dV and dK as above;
//     pass 2, over (batch, head, query tile): dQ += dS K, recomputing S and dP (7 tile products
//     per tile pair).
#include "flash_cpu.h"

#include <algorithm>
#include <atomic>
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

// Tile sizes. A key tile of 128 rather than 64 halves the online-softmax rescaling of the output
// rows per key (one per tile) and was 5-8% faster (forward and backward, D = 64); a query tile of
// 128 rather than 64 shares each transposed key tile among twice the rows, another 6-10% on the
// forward. A thread's scratch is then 200-330 KB in the forward and 330-530 KB in the backward
// (D = 64 to 128), about the size of the level-2 cache of current x86 cores.
constexpr idx kBlockQ = 128;  // query rows per tile
constexpr idx kBlockK = 128;  // keys per tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Which (query, key) pairs are visible: query i sits at key position i + offset; it sees keys
// [first_key(i), end_key(i)) (before clipping to [0, t_k)).
struct Band {
    idx t_q, t_k, offset, window;  // window 0 = none
    bool causal;

    idx first_key(idx i) const { return window > 0 ? i + offset - window + 1 : 0; }
    idx end_key(idx i) const { return causal ? i + offset + 1 : t_k; }

    // The keys [lo, hi) seen by at least one query of [i0, i1): each query's interval has both ends
    // growing with i, so the union runs from the first query's lower end to the last one's upper.
    void keys_seen_by(idx i0, idx i1, idx& lo, idx& hi) const {
        lo = std::max<idx>(0, first_key(i0));
        hi = std::min(t_k, end_key(i1 - 1));
        hi = std::max(lo, hi);
    }

    // Whether every query of [i0, i1) sees every key of [j0, j1) (both non-empty): the ends of the
    // queries' intervals grow with i, so the last query's first key and the first one's end decide.
    bool sees_all(idx i0, idx i1, idx j0, idx j1) const {
        return first_key(i1 - 1) <= j0 && end_key(i0) >= j1;
    }

    // The queries [lo, hi) that see at least one key of [j0, j1): key j is seen by the queries with
    // j <= i + offset <= j + window - 1.
    void queries_seeing(idx j0, idx j1, idx& lo, idx& hi) const {
        lo = causal ? std::max<idx>(0, j0 - offset) : 0;
        hi = window > 0 ? std::min(t_q, j1 - 1 + window - offset) : t_q;
        hi = std::max(lo, hi);
    }
};

Band make_band(const AttentionShape& s) {
    // A window longer than t_q + t_k hides nothing that causality does not; capping it keeps the
    // index arithmetic far from overflow whatever window Python passes.
    const idx window = std::min<idx>(s.window, s.t_q + s.t_k + 1);
    return Band{s.t_q, s.t_k, s.t_k - s.t_q, window, s.causal || s.window > 0};
}

// The part [a, b) of [j0, j0 + n) that query i sees, as offsets from j0 (a == b when none).
inline void visible_range(const Band& band, idx i, idx j0, idx n, idx& a, idx& b) {
    a = std::clamp<idx>(band.first_key(i) - j0, 0, n);
    b = std::clamp<idx>(band.end_key(i) - j0, 0, n);
    b = std::max(a, b);
}

// C (M x N) = A B, B in strips (tile::pack_strips), with row r of C summed over its own range
// [lo, hi) of the inner index only
// (range(r, lo, hi) gives it), when 'cut' says some row's range is not the whole of [0, K).
//
// Why: in a tile that the mask cuts, A holds weight 0 at the hidden pairs, and the plain product
// adds 0 * x for each of them. That is 0, unless x is NaN or infinite: then a value, key or query
// that a row does not see would still make the row NaN. So when a cut tile's B holds a non-finite
// number (rare, and checked in one pass over B), each row is summed over its visible range alone;
// otherwise the plain product runs. NaN in gives NaN out, and only where the math says so.
template <class V, class Range>
REFMATH_INLINE void masked_product(idx M, idx N, idx K, const float* A, idx lda, idx ak,
                                   const float* B, float* C, idx ldc, bool cut, Range range) {
    if (!cut || tile::all_finite(1, K * N, B, K * N)) {
        tile::gemm_strips<V>(M, N, K, A, lda, ak, B, K, 0, C, ldc);
        return;
    }
    for (idx r = 0; r < M; ++r) {
        idx lo, hi;
        range(r, lo, hi);  // hi - lo = 0 gives a row of zeros
        tile::gemm_strips<V>(1, N, hi - lo, A + r * lda + lo * ak, lda, ak, B, K, lo, C + r * ldc, ldc);
    }
}

// ---- forward -------------------------------------------------------------------------------------

template <class V>
REFMATH_INLINE void forward_tile_impl(const AttentionShape& s, const Band& band, idx b, idx h,
                                      idx i0, const float* q, const float* k, const float* v,
                                      float* o, float* lse, float* work) {
    const idx D = s.head_dim, group = s.heads / s.kv_heads, g = h / group;
    const idx rows = std::min(kBlockQ, s.t_q - i0);
    const idx qrow0 = (b * s.heads + h) * s.t_q + i0;  // first row of this tile in (B*H*t_q, D)
    const float* qt = q + qrow0 * D;
    const float* kh = k + (b * s.kv_heads + g) * s.t_k * D;
    const float* vh = v + (b * s.kv_heads + g) * s.t_k * D;
    const float c = tile::base2_factor(s.scale);

    float* S = work;                   // kBlockQ x kBlockK scores, then weights
    float* U = S + kBlockQ * kBlockK;  // rows x D unnormalised output
    float* PV = U + kBlockQ * D;       // rows x D: this tile's P V
    float* m = PV + kBlockQ * D;       // running maxima (base 2)
    float* l = m + kBlockQ;            // running normalisers
    float* alpha = l + kBlockQ;        // rescaling factors of the current tile
    float* KT = alpha + kBlockQ;       // D x kBlockK: the key tile, transposed, in strips
    float* Vs = KT + D * kBlockK;      // kBlockK x D: the value tile, in strips
    std::fill(m, m + rows, kNegInf);
    std::fill(l, l + rows, 0.0f);
    std::fill(U, U + rows * D, 0.0f);

    idx lo, hi;
    band.keys_seen_by(i0, i0 + rows, lo, hi);
    for (idx j0 = lo; j0 < hi; j0 += kBlockK) {
        const idx cols = std::min(kBlockK, hi - j0);
        tile::transpose_strips<V>(cols, D, kh + j0 * D, D, KT);
        tile::gemm_strips<V>(rows, cols, D, qt, D, 1, KT, D, 0, S, kBlockK);  // S = Q K^T
        // Whether the mask hides some pair of this tile: then the hidden scores become -inf, and
        // the scaling to base 2 is done in the same pass (the fold cannot scale a -inf: times a
        // scale of 0 or below it is NaN or +inf); otherwise the fold scales them.
        const bool cut = !band.sees_all(i0, i0 + rows, j0, j0 + cols);
        for (idx r = 0; cut && r < rows; ++r) {
            idx a, e;
            visible_range(band, i0 + r, j0, cols, a, e);
            float* srow = S + r * kBlockK;
#pragma omp simd
            for (idx j = 0; j < cols; ++j) srow[j] = (j >= a && j < e) ? srow[j] * c : kNegInf;
        }
        online_softmax_fold(rows, cols, S, kBlockK, cut ? 1.0f : c, m, l, alpha);  // F2
        tile::pack_strips<V>(cols, D, vh + j0 * D, D, Vs);
        masked_product<V>(rows, D, cols, S, kBlockK, 1, Vs, PV, D, cut,  // this tile's P V
                          [&](idx r, idx& a, idx& e) { visible_range(band, i0 + r, j0, cols, a, e); });
        online_softmax_merge_rows(rows, D, alpha, U, D, PV, D);  // F3: U = alpha U + P V
    }

    for (idx r = 0; r < rows; ++r) {  // F1: o = u / l; lse = ln(2) (m + log2 l)
        float* orow = o + (qrow0 + r) * D;
        const float* urow = U + r * D;
        if (l[r] != 0.0f) {  // l > 0, or NaN (a NaN score): then o and lse are NaN too
            const float denom = l[r];
#pragma omp simd
            for (idx d = 0; d < D; ++d) orow[d] = urow[d] / denom;
            lse[qrow0 + r] = (m[r] + std::log2(l[r])) * tile::kLn2;
        } else {  // no visible key
            std::fill(orow, orow + D, 0.0f);
            lse[qrow0 + r] = kNegInf;
        }
    }
}

// The 8-lane and the 16-lane copies (see REFMATH_AVX512 in tile_math.h).
REFMATH_MULTIVERSION
void forward_tile(const AttentionShape& s, const Band& band, idx b, idx h, idx i0, const float* q,
                  const float* k, const float* v, float* o, float* lse, float* work) {
    forward_tile_impl<tile::f32x8>(s, band, b, h, i0, q, k, v, o, lse, work);
}

#if REFMATH_HAVE_AVX512
REFMATH_AVX512
void forward_tile_wide(const AttentionShape& s, const Band& band, idx b, idx h, idx i0,
                       const float* q, const float* k, const float* v, float* o, float* lse,
                       float* work) {
    forward_tile_impl<tile::f32x16>(s, band, b, h, i0, q, k, v, o, lse, work);
}
#endif

// ---- backward ------------------------------------------------------------------------------------

// For a run of n queries starting at i0: lse2[r] = lse * log2(e), or +inf for a row that saw no key
// (lse = -inf), so that 2^(s - lse2) is 0 there instead of 2^(-inf + inf) = NaN.
inline void base2_lse(const float* lse, idx i0, idx n, float* lse2) {
    for (idx r = 0; r < n; ++r) {
        const float x = lse[i0 + r];
        lse2[r] = x == kNegInf ? std::numeric_limits<float>::infinity() : x * tile::kLog2e;
    }
}

// dK and dV of keys [j0, j0 + nk) of head g, from every query head of the group; and, when dq_sum
// is given, dS K added into dq_sum's rows of those query heads (the one-pass schedule, whose work
// item owns them) instead of leaving dQ to pass 2.
// The tile products are transposed (keys are the rows): S^T = K Q^T, P^T, dP^T = V dO^T, so that
// dV += P^T dO and dK += dS^T Q are plain 'nn' products into rows of dK and dV.
template <class V>
REFMATH_INLINE void backward_kv_tile_impl(const AttentionShape& s, const Band& band, idx b, idx g,
                                          idx j0, const float* dout, const float* q, const float* k,
                                          const float* v, const float* lse, const float* delta,
                                          float* dk, float* dv, float* dq_sum, float* work) {
    const idx D = s.head_dim, group = s.heads / s.kv_heads;
    const idx nk = std::min(kBlockK, s.t_k - j0);
    const idx krow0 = (b * s.kv_heads + g) * s.t_k + j0;
    const float* kt = k + krow0 * D;
    const float* vt = v + krow0 * D;
    const float c = tile::base2_factor(s.scale);

    float* Pt = work;                    // kBlockK x kBlockQ: S^T, then P^T
    float* dSt = Pt + kBlockK * kBlockQ;  // kBlockK x kBlockQ: dP^T, then dS^T
    float* dK = dSt + kBlockK * kBlockQ;  // nk x D
    float* dV = dK + kBlockK * D;         // nk x D
    float* T = dV + kBlockK * D;          // one tile's product (nk x D, or nq x D for dQ), then added
    float* lse2 = T + kBlockK * D;        // kBlockQ
    float* XT = lse2 + kBlockQ;           // D x kBlockQ: a tile of Q, then of dO, transposed
    float* Xs = XT + D * kBlockQ;         // kBlockQ x D: a tile of dO, then of Q
    float* Ks = Xs + kBlockQ * D;         // nk x D: the key tile (for dS K)
    // (XT, Xs and Ks in strips: tile::pack_strips)
    if (dq_sum != nullptr) tile::pack_strips<V>(nk, D, kt, D, Ks);
    std::fill(dK, dK + nk * D, 0.0f);
    std::fill(dV, dV + nk * D, 0.0f);

    idx ilo, ihi;
    band.queries_seeing(j0, j0 + nk, ilo, ihi);
    for (idx r = 0; r < group; ++r) {
        const idx hrow0 = (b * s.heads + g * group + r) * s.t_q;  // row 0 of query head h
        const float* qh = q + hrow0 * D;
        const float* doh = dout + hrow0 * D;
        for (idx i0 = ilo; i0 < ihi; i0 += kBlockQ) {
            const idx nq = std::min(kBlockQ, ihi - i0);
            base2_lse(lse + hrow0, i0, nq, lse2);
            tile::transpose_strips<V>(nq, D, qh + i0 * D, D, XT);
            tile::gemm_strips<V>(nk, nq, D, kt, D, 1, XT, D, 0, Pt, kBlockQ);  // S^T = K Q^T
            // The queries of this tile that key jr is seen by: [a, e) as offsets from i0.
            auto queries = [&](idx jr, idx& a, idx& e) {
                band.queries_seeing(j0 + jr, j0 + jr + 1, a, e);
                a = std::clamp<idx>(a - i0, 0, nq);
                e = std::clamp<idx>(e - i0, a, nq);
            };
            // P^T = 2^(c S^T - lse2) on the visible pairs, 0 on the hidden ones
            const bool cut = !band.sees_all(i0, i0 + nq, j0, j0 + nk);
            for (idx jr = 0; jr < nk; ++jr) {
                idx a = 0, e = nq;
                if (cut) queries(jr, a, e);
                float* prow = Pt + jr * kBlockQ;
                std::fill(prow, prow + a, 0.0f);
                idx ir = a;
                for (; ir + 8 <= e; ir += 8) {
                    const tile::f32x8 x = tile::load8(prow + ir) * c - tile::load8(lse2 + ir);
                    tile::store8(prow + ir, tile::exp2_fast8(x));
                }
                for (; ir < e; ++ir) prow[ir] = tile::exp2_fast(prow[ir] * c - lse2[ir]);
                std::fill(prow + e, prow + nq, 0.0f);
            }
            tile::pack_strips<V>(nq, D, doh + i0 * D, D, Xs);
            masked_product<V>(nk, D, nq, Pt, kBlockQ, 1, Xs, T, D, cut, queries);  // P^T dO
            tile::add_block(nk, D, T, D, dV, D);  // dV += P^T dO
            tile::transpose_strips<V>(nq, D, doh + i0 * D, D, XT);
            tile::gemm_strips<V>(nk, nq, D, vt, D, 1, XT, D, 0, dSt, kBlockQ);  // dP^T = V dO^T
            const float* dl = delta + hrow0 + i0;
            for (idx jr = 0; jr < nk; ++jr) {  // dS = P (dP - delta), 0 where hidden (dP may be NaN)
                idx a, e;
                queries(jr, a, e);
                float* srow = dSt + jr * kBlockQ;
                const float* prow = Pt + jr * kBlockQ;
#pragma omp simd
                for (idx ir = 0; ir < nq; ++ir)
                    srow[ir] = (ir >= a && ir < e) ? prow[ir] * (srow[ir] - dl[ir]) : 0.0f;
            }
            tile::pack_strips<V>(nq, D, qh + i0 * D, D, Xs);
            masked_product<V>(nk, D, nq, dSt, kBlockQ, 1, Xs, T, D, cut, queries);  // dS^T Q
            tile::add_block(nk, D, T, D, dK, D);  // dK += dS^T Q
            if (dq_sum != nullptr) {  // dQ += dS K, dS read as the transpose of dS^T
                masked_product<V>(nq, D, nk, dSt, 1, kBlockQ, Ks, T, D, cut,
                                  [&](idx ir, idx& a, idx& e) {
                                      visible_range(band, i0 + ir, j0, nk, a, e);
                                  });
                tile::add_block(nq, D, T, D, dq_sum + (hrow0 + i0) * D, D);
            }
        }
    }
    for (idx jr = 0; jr < nk; ++jr) {
        float* dkrow = dk + (krow0 + jr) * D;
        float* dvrow = dv + (krow0 + jr) * D;
#pragma omp simd
        for (idx d = 0; d < D; ++d) {
            dkrow[d] = dK[jr * D + d] * s.scale;
            dvrow[d] = dV[jr * D + d];
        }
    }
}

// The 8-lane and the 16-lane copies (see REFMATH_AVX512 in tile_math.h).
REFMATH_MULTIVERSION
void backward_kv_tile(const AttentionShape& s, const Band& band, idx b, idx g, idx j0,
                      const float* dout, const float* q, const float* k, const float* v,
                      const float* lse, const float* delta, float* dk, float* dv, float* dq_sum,
                      float* work) {
    backward_kv_tile_impl<tile::f32x8>(s, band, b, g, j0, dout, q, k, v, lse, delta, dk, dv, dq_sum,
                                       work);
}

#if REFMATH_HAVE_AVX512
REFMATH_AVX512
void backward_kv_tile_wide(const AttentionShape& s, const Band& band, idx b, idx g, idx j0,
                           const float* dout, const float* q, const float* k, const float* v,
                           const float* lse, const float* delta, float* dk, float* dv,
                           float* dq_sum, float* work) {
    backward_kv_tile_impl<tile::f32x16>(s, band, b, g, j0, dout, q, k, v, lse, delta, dk, dv,
                                        dq_sum, work);
}
#endif

// Pass 2 of the two-pass schedule: dQ of query rows [i0, i0 + nq) of head h.
template <class V>
REFMATH_INLINE void backward_q_tile_impl(const AttentionShape& s, const Band& band, idx b, idx h,
                                         idx i0, const float* dout, const float* q, const float* k,
                                         const float* v, const float* lse, const float* delta,
                                         float* dq, float* work) {
    const idx D = s.head_dim, group = s.heads / s.kv_heads, g = h / group;
    const idx nq = std::min(kBlockQ, s.t_q - i0);
    const idx qrow0 = (b * s.heads + h) * s.t_q + i0;
    const float* qt = q + qrow0 * D;
    const float* dot = dout + qrow0 * D;
    const float* kh = k + (b * s.kv_heads + g) * s.t_k * D;
    const float* vh = v + (b * s.kv_heads + g) * s.t_k * D;
    const float c = tile::base2_factor(s.scale);

    float* P = work;                   // kBlockQ x kBlockK
    float* dS = P + kBlockQ * kBlockK;  // kBlockQ x kBlockK: dP, then dS
    float* dQ = dS + kBlockQ * kBlockK;  // nq x D
    float* T = dQ + kBlockQ * D;        // nq x D: one tile's dS K
    float* lse2 = T + kBlockQ * D;      // kBlockQ
    float* XT = lse2 + kBlockQ;         // D x kBlockK: a tile of K, then of V, transposed
    float* Ks = XT + D * kBlockK;       // kBlockK x D: the key tile (XT and Ks in strips)
    std::fill(dQ, dQ + nq * D, 0.0f);
    base2_lse(lse + qrow0, 0, nq, lse2);
    const float* dl = delta + qrow0;

    idx lo, hi;
    band.keys_seen_by(i0, i0 + nq, lo, hi);
    // Key tiles aligned to multiples of kBlockK, as in pass 1 (keys before lo are masked), so that
    // dQ sums the same tiles in the same order as the one-pass schedule: the same bits either way.
    for (idx j0 = lo - lo % kBlockK; j0 < hi; j0 += kBlockK) {
        const idx nk = std::min(kBlockK, hi - j0);
        tile::transpose_strips<V>(nk, D, kh + j0 * D, D, XT);
        tile::gemm_strips<V>(nq, nk, D, qt, D, 1, XT, D, 0, P, kBlockK);   // S = Q K^T
        tile::transpose_strips<V>(nk, D, vh + j0 * D, D, XT);
        tile::gemm_strips<V>(nq, nk, D, dot, D, 1, XT, D, 0, dS, kBlockK);  // dP = dO V^T
        const bool cut = !band.sees_all(i0, i0 + nq, j0, j0 + nk);
        for (idx r = 0; r < nq; ++r) {  // dS = P (dP - delta), 0 where hidden (dP may be NaN)
            idx a = 0, e = nk;
            if (cut) visible_range(band, i0 + r, j0, nk, a, e);
            const float* prow = P + r * kBlockK;
            float* srow = dS + r * kBlockK;
            const float row_lse2 = lse2[r], row_delta = dl[r];
            std::fill(srow, srow + a, 0.0f);
            idx j = a;
            for (; j + 8 <= e; j += 8)
                tile::store8(srow + j, tile::exp2_fast8(tile::load8(prow + j) * c - row_lse2) *
                                           (tile::load8(srow + j) - row_delta));
            for (; j < e; ++j) srow[j] = tile::exp2_fast(prow[j] * c - row_lse2) * (srow[j] - row_delta);
            std::fill(srow + e, srow + nk, 0.0f);
        }
        tile::pack_strips<V>(nk, D, kh + j0 * D, D, Ks);
        masked_product<V>(nq, D, nk, dS, kBlockK, 1, Ks, T, D, cut,  // dS K
                          [&](idx r, idx& a, idx& e) { visible_range(band, i0 + r, j0, nk, a, e); });
        tile::add_block(nq, D, T, D, dQ, D);
    }
    for (idx r = 0; r < nq; ++r) {
        float* dqrow = dq + (qrow0 + r) * D;
#pragma omp simd
        for (idx d = 0; d < D; ++d) dqrow[d] = dQ[r * D + d] * s.scale;
    }
}

// The 8-lane and the 16-lane copies (see REFMATH_AVX512 in tile_math.h).
REFMATH_MULTIVERSION
void backward_q_tile(const AttentionShape& s, const Band& band, idx b, idx h, idx i0,
                     const float* dout, const float* q, const float* k, const float* v,
                     const float* lse, const float* delta, float* dq, float* work) {
    backward_q_tile_impl<tile::f32x8>(s, band, b, h, i0, dout, q, k, v, lse, delta, dq, work);
}

#if REFMATH_HAVE_AVX512
REFMATH_AVX512
void backward_q_tile_wide(const AttentionShape& s, const Band& band, idx b, idx h, idx i0,
                          const float* dout, const float* q, const float* k, const float* v,
                          const float* lse, const float* delta, float* dq, float* work) {
    backward_q_tile_impl<tile::f32x16>(s, band, b, h, i0, dout, q, k, v, lse, delta, dq, work);
}
#endif

// delta_i = dO_i . O_i for every row (B*H*t_q of them): a small share of the work, left at the
// baseline instruction set.
void row_dots(idx rows, idx D, const float* dout, const float* o, float* delta) {
#pragma omp parallel for schedule(static) if (rows * D >= 32768) num_threads(tile::max_threads())
    for (idx i = 0; i < rows; ++i) delta[i] = tile::dot(D, dout + i * D, o + i * D);
}

idx ceil_div(idx a, idx b) { return (a + b - 1) / b; }

// Whether the backward pass runs in one pass over (batch, key/value head) items, each computing dK,
// dV and the dQ of its query heads (5 tile products per pair of tiles), rather than two passes over
// finer items that need 7 (see the top of the file). The coarse items are all the same size, so the
// one pass is chosen when they fill every thread evenly, or when there are so many per thread that
// an uneven last round costs little.
// set_backward_schedule overrides the choice (for tests).
std::atomic<int> forced_schedule{0};

bool one_pass(idx items, idx threads) {
    if (forced_schedule.load(std::memory_order_relaxed) != 0)
        return forced_schedule.load(std::memory_order_relaxed) == 1;
    return items % threads == 0 || items >= 8 * threads;
}

}  // namespace

void set_backward_schedule(int schedule) {
    if (schedule < 0 || schedule > 2)
        throw std::invalid_argument("backward schedule must be 0 (automatic), 1 (one pass) or 2 "
                                    "(two passes), got " + std::to_string(schedule));
    forced_schedule.store(schedule, std::memory_order_relaxed);
}

void check_attention_shape(const AttentionShape& s) {
    auto fail = [](const std::string& what) { throw std::invalid_argument("attention: " + what); };
    if (s.batch < 0 || s.heads < 0 || s.t_q < 0 || s.t_k < 0) fail("negative size");
    if (s.kv_heads < 1 || s.heads % s.kv_heads != 0)
        fail("kv_heads = " + std::to_string(s.kv_heads) + " must be >= 1 and divide heads = " +
             std::to_string(s.heads));
    if (s.head_dim < 1) fail("head_dim must be >= 1, got " + std::to_string(s.head_dim));
    if (s.window < 0) fail("window must be >= 0 (0 = no window), got " + std::to_string(s.window));
    if (!std::isfinite(s.scale)) fail("scale must be finite");
}

void flash_forward_cpu(const AttentionShape& shape, const float* q, const float* k, const float* v,
                       float* o, float* lse) {
    check_attention_shape(shape);
    const Band band = make_band(shape);
    const idx n_tiles = ceil_div(shape.t_q, kBlockQ), bh = shape.batch * shape.heads;
    const idx n_tasks = n_tiles * bh;
    // S = Q K^T and P V: 2 T_q T_k D multiply-adds per head (an upper bound under a mask)
    const int threads = tile::threads_for(2.0 * bh * shape.t_q * shape.t_k * shape.head_dim);
    const idx per_thread =
        tile::padded_floats(kBlockQ * kBlockK + 2 * kBlockQ * shape.head_dim + 3 * kBlockQ +
                            2 * shape.head_dim * kBlockK);
    // Allocated before the parallel region, so that nothing inside it can throw.
    std::vector<float> work(static_cast<std::size_t>(threads * per_thread));
    float* w = work.data();
    // Dynamic scheduling, with the last query tiles first: under a causal mask they see the most keys,
    // and starting the big items first leaves small ones to even out the threads at the end.
    auto* const run_tile = REFMATH_PICK_WIDTH(forward_tile);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (idx t = 0; t < n_tasks; ++t) {
        const idx tile_index = n_tiles - 1 - t % n_tiles, bh_index = t / n_tiles;
        run_tile(shape, band, bh_index / shape.heads, bh_index % shape.heads, tile_index * kBlockQ, q,
                 k, v, o, lse, w + tile::thread_id() * per_thread);
    }
}

void flash_backward_cpu(const AttentionShape& shape, const float* dout, const float* q,
                        const float* k, const float* v, const float* o, const float* lse, float* dq,
                        float* dk, float* dv) {
    check_attention_shape(shape);
    const Band band = make_band(shape);
    const idx D = shape.head_dim, bh = shape.batch * shape.heads, bg = shape.batch * shape.kv_heads;
    std::vector<float> delta(static_cast<std::size_t>(bh * shape.t_q));  // the O(t) extra memory
    row_dots(bh * shape.t_q, D, dout, o, delta.data());

    // S again, dP, dV, dQ and dK: 5 T_q T_k D multiply-adds per head (an upper bound under a mask)
    const int threads = tile::threads_for(5.0 * bh * shape.t_q * shape.t_k * D);
    const idx per_thread = tile::padded_floats(2 * kBlockQ * kBlockK + 6 * std::max(kBlockQ, kBlockK) * D +
                                               std::max(kBlockQ, kBlockK));
    std::vector<float> work(static_cast<std::size_t>(threads * per_thread));
    float* w = work.data();
    const float* dl = delta.data();

    const idx n_key_tiles = ceil_div(shape.t_k, kBlockK);
    auto* const run_kv_tile = REFMATH_PICK_WIDTH(backward_kv_tile);
    if (one_pass(bg, threads)) {
        // One work item per (batch, key/value head): it owns dK and dV of that head and dQ of its
        // query heads, so it adds each tile's dS K into dq itself, and pass 2 is not needed.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (idx t = 0; t < bg; ++t) {
            const idx b = t / shape.kv_heads, g = t % shape.kv_heads;
            const idx group = shape.heads / shape.kv_heads;
            float* dq_group = dq + (b * shape.heads + g * group) * shape.t_q * D;  // group x t_q rows
            std::fill(dq_group, dq_group + group * shape.t_q * D, 0.0f);
            for (idx j = 0; j < n_key_tiles; ++j)
                run_kv_tile(shape, band, b, g, j * kBlockK, dout, q, k, v, lse, dl, dk, dv, dq,
                            w + tile::thread_id() * per_thread);
            for (idx i = 0; i < group * shape.t_q * D; ++i) dq_group[i] *= shape.scale;
        }
        return;
    }
    // Pass 1: key tiles in increasing order, since under a causal mask the first ones are seen by
    // the most queries.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (idx t = 0; t < n_key_tiles * bg; ++t) {
        const idx tile_index = t / bg, bg_index = t % bg;
        run_kv_tile(shape, band, bg_index / shape.kv_heads, bg_index % shape.kv_heads,
                    tile_index * kBlockK, dout, q, k, v, lse, dl, dk, dv, nullptr,
                    w + tile::thread_id() * per_thread);
    }
    // Pass 2: query tiles, the last (busiest) first as in the forward pass.
    const idx n_query_tiles = ceil_div(shape.t_q, kBlockQ);
    auto* const run_q_tile = REFMATH_PICK_WIDTH(backward_q_tile);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (idx t = 0; t < n_query_tiles * bh; ++t) {
        const idx tile_index = n_query_tiles - 1 - t / bh, bh_index = t % bh;
        run_q_tile(shape, band, bh_index / shape.heads, bh_index % shape.heads,
                   tile_index * kBlockQ, dout, q, k, v, lse, dl, dq,
                   w + tile::thread_id() * per_thread);
    }
}

}  // namespace refmath
