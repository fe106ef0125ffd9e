// The tensor-core math of the forward ladder, written once: flash_v3.cu introduces it and
// flash_v4.cu runs it unchanged, fed by ldmatrix and cp.async instead of plain shared loads.
//
// One warp owns 16 query rows and meets the keys a tile of kBlockK = 8 kKeyTiles at a time. Its
// scores S live in kKeyTiles accumulator tiles of mma.m16n8k16 (16 x 8, fp32; the fragment layouts
// are in flash_v3.cu's header), so the thread of lane 4g + t holds, of each tile nt, the scores
// s[nt][0], s[nt][1] of row g, keys 8 nt + 2t and + 1, and s[nt][2], s[nt][3] of row g + 8, same
// keys. Its two rows keep their softmax state m, l (m in log2 units) in registers, and the output
// accumulator u in kDimTiles tiles of 16 x 8 over the head width: acc[dn] in the same layout.
//
// A kernel calls, per tile: mma_16816 for S = Q K^T (its operands loaded as the rung loads them),
// scale_and_mask, online_softmax and rescale, then either p_operand and mma_16816 for u += P V,
// or, where the value tile holds an infinite or NaN element, pv_visible_only; at the end,
// sum_row_threads for l.
// Every function here is __forceinline__ and takes its arrays by reference with sizes known at
// compile time: once inlined and unrolled, it is the code the kernel would have written out. So it
// was checked when the math moved here: the sm_90 cubins of v3 and v4 (nvcc 13.0, -O3) kept every
// kernel's .text byte for byte; the two notes below say where that needed care.
#pragma once

#include "attention_common.cuh"

namespace refmath_cuda {

// Two floats rounded to T and packed in one register, lo in the low 16 bits: the layout of an
// mma operand register (the lower-numbered column of a pair sits in the low half).
template <typename T> __device__ __forceinline__ std::uint32_t pack_pair(float lo, float hi);
template <> __device__ __forceinline__ std::uint32_t pack_pair<__half>(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);  // .x (lo) in the low 16 bits
    return *reinterpret_cast<std::uint32_t*>(&h);
}
template <> __device__ __forceinline__ std::uint32_t pack_pair<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<std::uint32_t*>(&h);
}

// d += a b for one 16 x 16 by 16 x 8 product, fp32 accumulation.
// m16n8k16 needs code compiled for compute capability 8.0 or newer. A build for an older target
// (REFMATH_CUDA_ARCH=75) still compiles, with a body that traps: the launchers refuse to run such
// code (check_compiled_for), and should it run anyway the kernel fails loudly rather than return
// the garbage of a product never computed.
__device__ __forceinline__ void mma_16816(float (&d)[4], const std::uint32_t (&a)[4],
                                          std::uint32_t b0, std::uint32_t b1, __half) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile("trap;");
#endif
}
__device__ __forceinline__ void mma_16816(float (&d)[4], const std::uint32_t (&a)[4],
                                          std::uint32_t b0, std::uint32_t b1, __nv_bfloat16) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile("trap;");
#endif
}

// Whether either 16-bit element of a register is infinite or NaN (every exponent bit set): the
// tile loaders' test of the values, which decides between the two P V paths below.
template <typename T> __device__ __forceinline__ bool nonfinite_pair(std::uint32_t w);
template <> __device__ __forceinline__ bool nonfinite_pair<__half>(std::uint32_t w) {
    return (w & 0x7C00u) == 0x7C00u || (w & 0x7C000000u) == 0x7C000000u;
}
template <> __device__ __forceinline__ bool nonfinite_pair<__nv_bfloat16>(std::uint32_t w) {
    return (w & 0x7F80u) == 0x7F80u || (w & 0x7F800000u) == 0x7F800000u;
}

// Scale the scores of the tile at keys [j0, j0 + kBlockK) into log2 units and hide what this
// thread's rows, rows[0] and rows[1] (= rows[0] + 8), may not see: the block's rows end at q1 and
// its keys at hi. whole_tile: every (row, key) pair of the tile is visible to the warp's rows (the
// kernel checks the tile's corners), and then the per-element test is skipped.
// (whole_tile is computed by the kernel, not here: computed in a function, the same test compiles
// to a few more instructions per tile with nvcc 13.)
template <int kKeyTiles>
__device__ __forceinline__ void scale_and_mask(float (&s)[kKeyTiles][4], float scale_log2,
                                               bool whole_tile, const Band& band,
                                               const int (&rows)[2], int q1, int j0, int hi,
                                               int t) {
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[nt][e] *= scale_log2;
            if (!whole_tile) {
                const int i = rows[e / 2], j = j0 + nt * 8 + 2 * t + (e % 2);
                if (i >= q1 || j >= hi || !band.visible(i, j)) s[nt][e] = -INFINITY;
            }
        }
}

// Online softmax (F3) for the two rows of this thread, on the accumulator fragments: the scores
// become the unnormalised probabilities exp2(s - m) in place, m and l are updated, and
// correction[r] = exp2(m_old - m_new) is what u must be multiplied by (rescale, below). The 4
// threads of a row are the lanes 4g .. 4g + 3, so xor-shuffles by 1 and 2 reduce over the row:
// two shuffles per row maximum, none for the sum, which each thread keeps over its own
// 2 kKeyTiles columns of the row (sum_row_threads adds them up at the end).
// (correction is the kernel's array, not a local here: as a local, the same code compiles to
// another register assignment with nvcc 13.)
template <int kKeyTiles>
__device__ __forceinline__ void online_softmax(float (&s)[kKeyTiles][4], float (&m)[2],
                                               float (&l)[2], float (&correction)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kKeyTiles; ++nt)  // nan_max: a NaN score makes the row NaN
            tile_max = nan_max(tile_max, nan_max(s[nt][2 * r], s[nt][2 * r + 1]));
        tile_max = nan_max(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = nan_max(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        const float m_new = nan_max(m[r], tile_max);
        // While a row has seen nothing (m_new = -inf) use 0 as its reference: every
        // exponential below is then exp2(-inf) = 0 instead of exp2(-inf + inf) = NaN.
        const float ref = m_new == -INFINITY ? 0.0f : m_new;
        correction[r] = exp2f(m[r] - ref);
        float row_sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kKeyTiles; ++nt) {
            s[nt][2 * r] = exp2f(s[nt][2 * r] - ref);
            s[nt][2 * r + 1] = exp2f(s[nt][2 * r + 1] - ref);
            row_sum += s[nt][2 * r] + s[nt][2 * r + 1];
        }
        l[r] = l[r] * correction[r] + row_sum;
        m[r] = m_new;
    }
}

// u *= exp2(m_old - m_new), row by row: c0, c1 of each accumulator tile are on row g, c2, c3 on
// row g + 8.
template <int kDimTiles>
__device__ __forceinline__ void rescale(float (&acc)[kDimTiles][4], const float (&correction)[2]) {
#pragma unroll
    for (int dn = 0; dn < kDimTiles; ++dn) {
        acc[dn][0] *= correction[0];
        acc[dn][1] *= correction[0];
        acc[dn][2] *= correction[1];
        acc[dn][3] *= correction[1];
    }
}

// The A operand of the k-step kk of u += P V (keys 16kk .. 16kk + 15): the accumulators of S tiles
// 2kk and 2kk + 1, rounded to T and paired. The accumulator layout of two 16 x 8 tiles is the
// operand layout of one 16 x 16 tile, so P moves into the next product without leaving the thread.
template <typename T, int kKeyTiles>
__device__ __forceinline__ void p_operand(std::uint32_t (&pa)[4], const float (&s)[kKeyTiles][4],
                                          int kk) {
    pa[0] = pack_pair<T>(s[2 * kk][0], s[2 * kk][1]);
    pa[1] = pack_pair<T>(s[2 * kk][2], s[2 * kk][3]);
    pa[2] = pack_pair<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    pa[3] = pack_pair<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// u += P V summed over the visible (row, key) pairs alone, for a value tile that holds an infinite
// or NaN element: the mma would add 0 * NaN = NaN for every hidden pair. The rare path: P (rounded
// to T, as the mma would see it) goes to shared memory, p_s ([kBlockK rows][kStride], row
// 16 warp + g (+ 8) for this thread's rows, a buffer no warp reads any more), and each thread sums
// its accumulator entries over the visible keys of v_s, the tile at keys [j0, j0 + kBlockK).
template <typename T, int kStride, int kKeyTiles, int kDimTiles>
__device__ __forceinline__ void pv_visible_only(float (&acc)[kDimTiles][4],
                                                const float (&s)[kKeyTiles][4], T* p_s,
                                                const T* v_s, const Band& band,
                                                const int (&rows)[2], int q1, int j0, int hi,
                                                int warp, int g, int t) {
    constexpr int kBlockK = kKeyTiles * 8;
#pragma unroll
    for (int nt = 0; nt < kKeyTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            p_s[(warp * 16 + g + 8 * (e / 2)) * kStride + nt * 8 + 2 * t + (e % 2)] =
                from_float<T>(s[nt][e]);
    __syncwarp();  // each warp reads back its own 16 rows only
#pragma unroll
    for (int dn = 0; dn < kDimTiles; ++dn)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = rows[e / 2], c = dn * 8 + 2 * t + (e % 2);
            const T* p_row = p_s + (warp * 16 + g + 8 * (e / 2)) * kStride;
            float sum = 0.0f;
            for (int jj = 0; jj < kBlockK; ++jj) {
                const int j = j0 + jj;
                if (i < q1 && j < hi && band.visible(i, j))
                    sum += to_float(p_row[jj]) * to_float(v_s[jj * kStride + c]);
            }
            acc[dn][e] += sum;
        }
}

// F1's l: each thread kept the sum over its own columns of its two rows; the row's l is the sum
// over the 4 threads of the row (lanes 4g .. 4g + 3).
__device__ __forceinline__ void sum_row_threads(float (&l)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
}

}  // namespace refmath_cuda
