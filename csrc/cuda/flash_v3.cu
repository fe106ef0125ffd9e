// FlashAttention forward, version 3: both products on the tensor cores (mma.sync m16n8k16).
//
// Inputs fp16 or bf16, products accumulated in fp32, softmax statistics in fp32; D = 64 or 128.
//
// What changes from v2, and why it is faster:
//
// * S = Q K^T and u += P V are computed with the warp-wide instruction
//   mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: one instruction multiplies a 16 x 16 tile
//   of A by a 16 x 8 tile of B and adds a 16 x 8 fp32 tile, on the tensor cores, many times the
//   throughput of the FP32 units that v2 used.
// * Each warp owns 16 query rows (a block of 4 warps: 64 rows) and the key tiles are 64 keys.
//   The warp's Q fragments stay in registers for the whole kernel (Q is read from memory once).
// * The softmax works directly on the accumulator fragments: the thread that holds scores of rows
//   g and g + 8 keeps their m and l, the row maximum and sum need only two shuffles among the 4
//   threads that share a row, and the probabilities P, rounded to fp16/bf16, are already laid out
//   as the A operand of the next mma (the accumulator layout of a 16 x 8 tile pairs up into the
//   operand layout of a 16 x 16 tile). P never goes through shared memory.
// * Exponentials in base 2: exp(x) = exp2(x log2 e), with log2 e folded into the scale, so each is
//   one ex2 instruction; lse is converted back to natural log at the end.
// * Tiles strictly inside the visible band skip the per-element mask.
// * K and V tiles travel global -> shared in 16-byte vectors, rows padded by 16 bytes so that the
//   fragment loads hit 32 different banks.
//
// What is left for later versions: the loads of the next K/V tile could overlap the math of the
// current one (cp.async double buffering, or TMA and wgmma on Hopper); P V could use ldmatrix.
//
// The fragment layouts of m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with
// g = lane / 4 and t = lane % 4:
//   A (16 x 16, row-major), 4 registers of 2 halves: a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1],
//     a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9]
//   B (16 x 8, k x n), 2 registers: b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]
//   C, D (16 x 8, fp32), 4 floats: c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]
// The lower-numbered column of a pair sits in the low 16 bits of its register.
#include "flash_forward.cuh"

namespace refmath_cuda {
namespace {

constexpr int kWarpsV3 = 4;
constexpr int kThreadsV3 = kWarpsV3 * kWarpSize;
constexpr int kBlockQV3 = kWarpsV3 * 16;  // 64 query rows per block, 16 per warp
constexpr int kBlockKV3 = 64;             // keys per tile
constexpr int kPadV3 = 8;                 // elements (16 bytes) of padding per shared row

template <typename T> struct MmaType;
template <> struct MmaType<__half> {
    static __device__ std::uint32_t pack(float lo, float hi) {
        __half2 h = __floats2half2_rn(lo, hi);  // .x (lo) in the low 16 bits
        return *reinterpret_cast<std::uint32_t*>(&h);
    }
};
template <> struct MmaType<__nv_bfloat16> {
    static __device__ std::uint32_t pack(float lo, float hi) {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<std::uint32_t*>(&h);
    }
};

// d += a b for one 16 x 16 by 16 x 8 product, fp32 accumulation.
// m16n8k16 needs code compiled for compute capability 8.0 or newer. A build for an older target
// (REFMATH_CUDA_ARCH=75) still compiles, with a body that traps: the launcher refuses to run such
// code (check_compiled_for), and should it run anyway the kernel fails loudly rather than return
// the garbage of a product never computed.
__device__ inline void mma_16816(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                 std::uint32_t b1, __half) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile("trap;");
#endif
}
__device__ inline void mma_16816(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                 std::uint32_t b1, __nv_bfloat16) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile("trap;");
#endif
}

// Two consecutive 16-bit elements of a shared row as one register (the address must be even).
template <typename T>
__device__ inline std::uint32_t load_pair(const T* p) {
    return *reinterpret_cast<const std::uint32_t*>(p);
}
// Two elements from consecutive rows of the same column (for V as the B operand).
template <typename T>
__device__ inline std::uint32_t load_column_pair(const T* p, int stride) {
    const std::uint32_t lo = *reinterpret_cast<const std::uint16_t*>(p);
    const std::uint32_t hi = *reinterpret_cast<const std::uint16_t*>(p + stride);
    return lo | (hi << 16);
}

// Whether either 16-bit element of a register is infinite or NaN (every exponent bit set).
template <typename T> __device__ inline bool nonfinite_pair(std::uint32_t w);
template <> __device__ inline bool nonfinite_pair<__half>(std::uint32_t w) {
    return (w & 0x7C00u) == 0x7C00u || (w & 0x7C000000u) == 0x7C000000u;
}
template <> __device__ inline bool nonfinite_pair<__nv_bfloat16>(std::uint32_t w) {
    return (w & 0x7F80u) == 0x7F80u || (w & 0x7F800000u) == 0x7F800000u;
}

// Copy rows [r0, r0 + 64) of a (rows, D) matrix into a padded shared tile; rows >= r_end are zero.
// Returns whether this thread copied an infinite or NaN element.
template <typename T, int D>
__device__ inline bool load_tile(T* tile, const T* src, int r0, int r_end) {
    constexpr int kStride = D + kPadV3;
    constexpr int kChunks = D / 8;  // 16-byte vectors per row
    bool odd = false;
    for (int idx = threadIdx.x; idx < kBlockKV3 * kChunks; idx += kThreadsV3) {
        const int r = idx / kChunks, chunk = idx % kChunks;
        uint4 value = make_uint4(0, 0, 0, 0);
        if (r0 + r < r_end)
            value = *reinterpret_cast<const uint4*>(src + static_cast<std::int64_t>(r0 + r) * D + chunk * 8);
        odd |= nonfinite_pair<T>(value.x) || nonfinite_pair<T>(value.y) ||
               nonfinite_pair<T>(value.z) || nonfinite_pair<T>(value.w);
        *reinterpret_cast<uint4*>(tile + r * kStride + chunk * 8) = value;
    }
    return odd;
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreadsV3)
flash_v3_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                T* __restrict__ o, float* __restrict__ lse, Band band, int heads, int group,
                float scale_log2) {
    constexpr int kStride = D + kPadV3;
    constexpr int kDChunks = D / 16;      // k-steps of Q K^T
    constexpr int kKeyTiles = kBlockKV3 / 8;  // n-tiles of S (8 keys each)
    constexpr int kKeyChunks = kBlockKV3 / 16;  // k-steps of P V
    constexpr int kDimTiles = D / 8;      // n-tiles of the output
    __shared__ __align__(16) T k_s[kBlockKV3 * kStride];
    __shared__ __align__(16) T v_s[kBlockKV3 * kStride];

    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int g = lane / 4, t = lane % 4;
    const int row_blocks = ceil_div(band.t_q, kBlockQV3);
    const int bh = blockIdx.x / row_blocks;
    const int q0 = (blockIdx.x % row_blocks) * kBlockQV3;
    const int q1 = imin(q0 + kBlockQV3, band.t_q);
    const int b = bh / heads, h = bh % heads;
    const int kv_heads = heads / group;
    const T* q_head = q + static_cast<std::int64_t>(bh) * band.t_q * D;
    const std::int64_t kv_offset = (static_cast<std::int64_t>(b) * kv_heads + h / group) * band.t_k * D;
    const T* k_head = k + kv_offset;
    const T* v_head = v + kv_offset;

    // Q tile -> shared (borrowing k_s) -> this warp's A fragments, kept in registers.
    load_tile<T, D>(k_s, q_head, q0, q1);
    __syncthreads();
    std::uint32_t qa[kDChunks][4];
    {
        const T* q_warp = k_s + warp * 16 * kStride;
#pragma unroll
        for (int kc = 0; kc < kDChunks; ++kc) {
            qa[kc][0] = load_pair(q_warp + g * kStride + kc * 16 + 2 * t);
            qa[kc][1] = load_pair(q_warp + (g + 8) * kStride + kc * 16 + 2 * t);
            qa[kc][2] = load_pair(q_warp + g * kStride + kc * 16 + 2 * t + 8);
            qa[kc][3] = load_pair(q_warp + (g + 8) * kStride + kc * 16 + 2 * t + 8);
        }
    }

    // This thread's rows: i[0] = q0 + 16 warp + g and i[1] = i[0] + 8. m in log2 units.
    const int rows[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float acc[kDimTiles][4];
#pragma unroll
    for (int dn = 0; dn < kDimTiles; ++dn)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[dn][e] = 0.0f;

    // The warp's rows are q0 + 16 warp .. + 15; the block's keys are [lo, hi).
    const int w0 = q0 + warp * 16, w1 = imin(w0 + 16, q1);
    int lo, hi;
    band.keys_seen_by(q0, q1, &lo, &hi);
    for (int j0 = lo; j0 < hi; j0 += kBlockKV3) {
        __syncthreads();  // the previous tile (or the borrowed Q tile) is no longer read
        load_tile<T, D>(k_s, k_head, j0, hi);
        const bool odd_value = load_tile<T, D>(v_s, v_head, j0, hi);
        // An infinite or NaN value in the tile: P V is then summed over the visible pairs alone
        // (below), since the mma would add 0 * NaN = NaN for every hidden one.
        const bool only_visible = __syncthreads_or(odd_value) != 0;

        // S = Q K^T: 16 rows x 64 keys per warp, in 8 accumulator tiles of 16 x 8.
        float s[kKeyTiles][4];
#pragma unroll
        for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] = 0.0f;
            const T* k_rows = k_s + (nt * 8 + g) * kStride + 2 * t;  // B[k = d][n = key] = K[key][d]
#pragma unroll
            for (int kc = 0; kc < kDChunks; ++kc)
                mma_16816(s[nt], qa[kc], load_pair(k_rows + kc * 16), load_pair(k_rows + kc * 16 + 8), T());
        }

        // Scale into log2 units and hide what this warp's rows may not see. A tile needs no mask
        // when every (row, key) pair of it is visible: checked at the tile's corners.
        const int j_last = imin(j0 + kBlockKV3, hi) - 1;
        const bool whole_tile = w0 < w1 && j0 + kBlockKV3 <= hi && band.visible(w0, j_last) &&
                                band.visible(w1 - 1, j0) && band.visible(w0, j0) &&
                                band.visible(w1 - 1, j_last);
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

        // Online softmax (F3) for the two rows of this thread; the 4 threads of a row are the
        // lanes 4g .. 4g + 3, so xor-shuffles by 1 and 2 reduce over the row.
        float correction[2];
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
            // l is kept per thread (its 16 columns of the row) and summed over the 4 at the end.
            l[r] = l[r] * correction[r] + row_sum;
            m[r] = m_new;
        }
#pragma unroll
        for (int dn = 0; dn < kDimTiles; ++dn) {
            acc[dn][0] *= correction[0];
            acc[dn][1] *= correction[0];
            acc[dn][2] *= correction[1];
            acc[dn][3] *= correction[1];
        }

        if (only_visible) {  // block-uniform: the barrier below is reached by every thread or none
            // The rare path: P (rounded to T, as the mma would see it) goes to shared memory, in
            // k_s's place, and each thread sums its accumulator entries over the visible keys.
            __syncthreads();  // every warp is done reading k_s
            T* p_s = k_s;     // [64 rows][kStride]: row 16 warp + g (+ 8) holds this thread's rows
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
                    for (int jj = 0; jj < kBlockKV3; ++jj) {
                        const int j = j0 + jj;
                        if (i < q1 && j < hi && band.visible(i, j))
                            sum += to_float(p_row[jj]) * to_float(v_s[jj * kStride + c]);
                    }
                    acc[dn][e] += sum;
                }
            continue;
        }

        // u += P V. The accumulators of S tiles 2kk and 2kk + 1 (keys 16kk .. 16kk + 15) are the
        // A fragment of the k-step kk: no data movement between threads.
#pragma unroll
        for (int kk = 0; kk < kKeyChunks; ++kk) {
            std::uint32_t pa[4];
            pa[0] = MmaType<T>::pack(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = MmaType<T>::pack(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = MmaType<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = MmaType<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            const T* v_rows = v_s + (kk * 16 + 2 * t) * kStride + g;  // B[k = key][n = d] = V[key][d]
#pragma unroll
            for (int dn = 0; dn < kDimTiles; ++dn) {
                const std::uint32_t b0 = load_column_pair(v_rows + dn * 8, kStride);
                const std::uint32_t b1 = load_column_pair(v_rows + 8 * kStride + dn * 8, kStride);
                mma_16816(acc[dn], pa, b0, b1, T());
            }
        }
    }

    // F1. Sum l over the 4 threads of each row, then o = u / l; lse = (m + log2 l) ln 2.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = rows[r];
        if (i >= q1) continue;
        const std::int64_t row = static_cast<std::int64_t>(bh) * band.t_q + i;
        const float inv_l = l[r] != 0.0f ? 1.0f / l[r] : 0.0f;  // l = NaN: o = NaN
        T* o_row = o + row * D;
#pragma unroll
        for (int dn = 0; dn < kDimTiles; ++dn) {
            const std::uint32_t pair = MmaType<T>::pack(acc[dn][2 * r] * inv_l, acc[dn][2 * r + 1] * inv_l);
            *reinterpret_cast<std::uint32_t*>(o_row + dn * 8 + 2 * t) = pair;
        }
        if (t == 0) lse[row] = l[r] != 0.0f ? (m[r] + log2f(l[r])) * 0.69314718055994531f : -INFINITY;
    }
}

template <typename T, int D>
std::string launch_v3(const FlashForwardArgs& a, const Band& band, int blocks, cudaStream_t stream) {
    const AttentionProblem& p = a.problem;
    const float log2e = 1.4426950408889634f;
    // The device may be new enough while the code the runtime picked for it is not (a build for
    // sm_75 only, whose PTX an sm_90 GPU JIT-compiles): that code has no mma (see mma_16816).
    const std::string error =
        check_compiled_for(flash_v3_kernel<T, D>, 80, "flash_forward_v3 (mma.sync m16n8k16)");
    if (!error.empty()) return error;
    flash_v3_kernel<T, D><<<blocks, kThreadsV3, 0, stream>>>(
        static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<const T*>(a.v),
        static_cast<T*>(a.o), a.lse, band, static_cast<int>(p.heads),
        static_cast<int>(p.heads / p.kv_heads), p.scale * log2e);
    return launch_status("flash_forward_v3");
}

}  // namespace

// The checks against v3's line of the ladder (flash_ladder.h), the grid and the choice of the
// instance for the dtype and head width: launch_forward, flash_forward.cuh.
std::string flash_forward_v3(const FlashForwardArgs& a, cudaStream_t stream) {
    auto launch = [&](auto element, auto width, const Band& band, int blocks) {
        return launch_v3<decltype(element), decltype(width)::value>(a, band, blocks, stream);
    };
    return launch_forward<Rung::v3>(a, kBlockQV3, launch);
}

}  // namespace refmath_cuda
