// The kernel assignment's function: the online-softmax step of a tiled attention forward
// (see flash_tile.h for the contract). Given code (flash_forward_module.cpp) loops over the
// tiles, calls this for each (query tile, key tile) pair and writes o and lse at the end.
#include "flash_tile.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>  // the student copy's stub throws std::logic_error
#include <vector>

void online_softmax_tile(const float* q, const float* k, const float* v,
                         const unsigned char* visible, int rows, int cols, int d, int dv,
                         float scale, float* m, float* l, float* acc) {
    // BEGIN SOLUTION
    const float neg_inf = -std::numeric_limits<float>::infinity();
    std::vector<float> s(cols);
    for (int r = 0; r < rows; ++r) {
        // 1. The scaled scores of the visible keys, and their maximum.
        float tile_max = neg_inf;
        for (int c = 0; c < cols; ++c) {
            if (visible != nullptr && !visible[r * cols + c]) {
                s[c] = neg_inf;
                continue;
            }
            float dot = 0.0f;
            for (int i = 0; i < d; ++i) dot += q[r * d + i] * k[c * d + i];
            s[c] = scale * dot;
            // a NaN score makes the maximum NaN, so the row's output is NaN, not a silent value
            if (!(s[c] <= tile_max)) tile_max = s[c];
        }
        // 2. The new maximum. A row that has seen no key at all keeps m = -inf, l = 0, acc = 0:
        // exp(-inf - (-inf)) would be NaN.
        const float m_new = std::isnan(tile_max) ? tile_max : std::max(m[r], tile_max);
        if (m_new == neg_inf) continue;
        // 3. Rescale what was folded so far from the old maximum to the new one (F2): the factor is
        // exp(m_old - m_new) <= 1, and 0 when nothing was folded yet.
        const float rescale = std::exp(m[r] - m_new);
        l[r] *= rescale;
        float* out = acc + static_cast<long>(r) * dv;
        for (int j = 0; j < dv; ++j) out[j] *= rescale;
        // 4. Add this tile's weights exp(s - m_new) <= 1 and their values.
        for (int c = 0; c < cols; ++c) {
            const float p = std::exp(s[c] - m_new);  // 0 for an invisible key
            l[r] += p;
            for (int j = 0; j < dv; ++j) out[j] += p * v[c * dv + j];
        }
        m[r] = m_new;
    }
    // END SOLUTION
}
