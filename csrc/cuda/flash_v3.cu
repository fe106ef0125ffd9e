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
//
// The math on those fragments, which v4 reuses as it stands (the mma, the mask, the online
// softmax, P as the next A operand, the NaN-safe P V), is written once in flash_mma_math.cuh; this
// file keeps what is v3's own: the tiles' loads and the fragments built from them, the loop, the
// output.
#include "flash_forward.cuh"
#include "flash_mma_math.cuh"

namespace refmath_cuda {
namespace {

constexpr int kWarpsV3 = 4;
constexpr int kThreadsV3 = kWarpsV3 * kWarpSize;
constexpr int kBlockQV3 = kWarpsV3 * 16;  // 64 query rows per block, 16 per warp
constexpr int kBlockKV3 = 64;             // keys per tile
constexpr int kPadV3 = 8;                 // elements (16 bytes) of padding per shared row

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
        scale_and_mask(s, scale_log2, whole_tile, band, rows, q1, j0, hi, t);

        // Online softmax (F3) on the accumulator fragments: two shuffles per row maximum, P in place
        // of S, then u rescaled.
        float correction[2];
        online_softmax(s, m, l, correction);
        rescale(acc, correction);

        if (only_visible) {  // block-uniform: the barrier below is reached by every thread or none
            // The rare path: P goes to shared memory, in k_s's place, and each thread sums its
            // accumulator entries over the visible keys.
            __syncthreads();  // every warp is done reading k_s
            pv_visible_only<T, kStride>(acc, s, k_s, v_s, band, rows, q1, j0, hi, warp, g, t);
            continue;
        }

        // u += P V. The accumulators of S tiles 2kk and 2kk + 1 (keys 16kk .. 16kk + 15) are the
        // A fragment of the k-step kk: no data movement between threads.
#pragma unroll
        for (int kk = 0; kk < kKeyChunks; ++kk) {
            std::uint32_t pa[4];
            p_operand<T>(pa, s, kk);
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
    sum_row_threads(l);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = rows[r];
        if (i >= q1) continue;
        const std::int64_t row = static_cast<std::int64_t>(bh) * band.t_q + i;
        const float inv_l = l[r] != 0.0f ? 1.0f / l[r] : 0.0f;  // l = NaN: o = NaN
        T* o_row = o + row * D;
#pragma unroll
        for (int dn = 0; dn < kDimTiles; ++dn) {
            const std::uint32_t pair = pack_pair<T>(acc[dn][2 * r] * inv_l, acc[dn][2 * r + 1] * inv_l);
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
