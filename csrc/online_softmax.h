// The online softmax on a tile of scores (catalogue F2, F3), shared by the attention and decode
// kernels.
//
// Each row keeps a running maximum m, a running normaliser l and an unnormalised output row u; a new
// tile of scores s_1..s_n (with its value rows) is folded in as
//
//     m' = max(m, max_j s_j),  alpha = 2^(m - m'),  p_j = 2^(s_j - m'),
//     l' = alpha l + sum_j p_j,  u' = alpha u + sum_j p_j v_j,
//
// in base 2 (s_j is a score times scale * log2(e)). The factor alpha <= 1 rescales what was summed
// against the old maximum, so no exponential ever exceeds 1. The caller computes the tile's own
// sum_j p_j v_j (tile::gemm_strips on the weights left in S) and merges it with
// online_softmax_merge_rows.
#pragma once

#include <limits>

#include "tile_math.h"

namespace refmath {

// S: rows x cols scores (row stride lds), -inf where hidden; the base-2 exponents are the scores
// times 'factor' (1 when S already holds them; scale * log2(e) for raw dot products, which saves a
// pass over the tile). On return S holds the weights p, each row's (m, l) is updated, and alpha[r]
// holds the factor for the row's old u. A row whose exponents and running maximum are all -inf has
// seen no key yet: its weights are set to 0 and its state stays empty (m = -inf, l = 0; alpha = 0
// keeps u = 0).
//
// NaN in, NaN out: the maximum below skips a NaN score, but its weight 2^(NaN - m') is NaN, so l
// and u become NaN and stay so (the caller turns l = NaN into o = NaN, lse = NaN). A row whose only
// non-hidden scores are NaN keeps m = -inf and gets l = NaN the same way.
REFMATH_INLINE void online_softmax_fold(tile::idx rows, tile::idx cols, float* S, tile::idx lds,
                                        float factor, float* m, float* l, float* alpha) {
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    for (tile::idx r = 0; r < rows; ++r) {
        float* s = S + r * lds;
        float tile_max = kNegInf;
#pragma omp simd reduction(max : tile_max)
        for (tile::idx j = 0; j < cols; ++j) {
            const float x = s[j] * factor;
            tile_max = x > tile_max ? x : tile_max;
        }
        const float m_new = tile_max > m[r] ? tile_max : m[r];
        if (m_new == kNegInf) {  // every exponent -inf or NaN: weights 0, and NaN for the NaNs
            for (tile::idx j = 0; j < cols; ++j) s[j] = s[j] * factor == kNegInf ? 0.0f : s[j] * factor;
            alpha[r] = 0.0f;
            l[r] += tile::sum(cols, s);  // l was 0 (or NaN already): nothing to rescale
            continue;
        }
        alpha[r] = tile::exp2_fast(m[r] - m_new);  // 0 when m = -inf, exactly 1 when m = m'
        // The weights and their sum in one pass, 8 at a time, summed in tile::sum's order.
        // s * factor - m' is one fused multiply-add: at the maximum it is the rounding error of
        // m' (tiny), so no weight exceeds 1 by more than a rounding.
        tile::f32x8 acc = {};
        tile::idx j = 0;
        for (; j + 8 <= cols; j += 8) {
            const tile::f32x8 p = tile::exp2_fast8(tile::load8(s + j) * factor - m_new);
            tile::store8(s + j, p);
            acc += p;
        }
        float sum = tile::sum8(acc);
        for (; j < cols; ++j) {
            s[j] = tile::exp2_fast(s[j] * factor - m_new);
            sum += s[j];
        }
        l[r] = alpha[r] * l[r] + sum;
        m[r] = m_new;
    }
}

// u' = alpha u + u_tile for each row (F3; the tile's weights already use the new maximum).
REFMATH_INLINE void online_softmax_merge_rows(tile::idx rows, tile::idx width, const float* alpha,
                                              float* U, tile::idx ldu, const float* T,
                                              tile::idx ldt) {
    for (tile::idx r = 0; r < rows; ++r) {
        float* u = U + r * ldu;
        const float* t = T + r * ldt;
        const float a = alpha[r];
#pragma omp simd
        for (tile::idx d = 0; d < width; ++d) u[d] = a * u[d] + t[d];
    }
}

}  // namespace refmath
