// FlashAttention forward, version 2: a block of query rows shares K/V tiles in shared memory.
//
// What changes from v1, and why it is faster:
//
// * A thread block (4 warps) takes kBlockQ = 32 query rows of one (batch, head) and walks the keys
//   in tiles of kBlockK = 32. The 128 threads copy each K and V tile from global into shared memory
//   once, with coalesced loads (consecutive threads read consecutive elements), and all 32 rows use
//   it: a K/V element now comes from global memory once per 32 query rows instead of once per row.
// * The work on a tile is split so that no thread holds a whole row. Each warp owns 8 query rows.
//   For the scores, lane j computes s[r][j] = q_r . k_j for key j of the tile and the warp's rows
//   (q_r is read by all lanes at once: a shared-memory broadcast); the row maximum and sum of the
//   online softmax are warp shuffles. For P V, lane c owns output columns c, c + 32, ..., reading
//   v_j[c] (consecutive addresses, no bank conflicts) and p[r][j] (a broadcast). The accumulator is
//   8 rows x D/32 floats per thread: no register spills for any D up to 256.
// * The online-softmax state (F3) is now updated once per 32-key tile, not per key, so the
//   correction exponential is paid 32 times less often.
//
// Shared memory: Q (scaled, float), one K tile and one V tile (in the input type) and the tile's
// weights P. K rows are padded by one 32-bit word so that the 32 lanes, each reading a different
// key row at the same column, hit 32 different banks. It is dynamic shared memory because float32
// with large D needs more than the 48 KB a block gets without opting in (see allow_shared_memory).
//
// What v2 still leaves on the table: the arithmetic runs on the ordinary FP32 units, a few percent
// of what the tensor cores deliver on fp16/bf16 inputs. Version 3 moves both products (Q K^T and
// P V) onto the tensor cores.
#include "flash_forward.cuh"

namespace refmath_cuda {
namespace {

constexpr int kWarpsV2 = 4;
constexpr int kThreadsV2 = kWarpsV2 * kWarpSize;
constexpr int kRowsPerWarpV2 = 8;
constexpr int kBlockQV2 = kWarpsV2 * kRowsPerWarpV2;  // 32 query rows per block
constexpr int kBlockKV2 = kWarpSize;                  // 32 keys per tile: one per lane

template <typename T, int D_MAX>
struct V2Layout {
    // K rows padded by one 32-bit word: D_MAX is a multiple of 32, so the row stride in words is
    // odd and lanes reading the same column of 32 different rows meet 32 different banks.
    static constexpr int kKStride = D_MAX + static_cast<int>(4 / sizeof(T));
    static constexpr std::size_t kQBytes = sizeof(float) * kBlockQV2 * D_MAX;
    static constexpr std::size_t kKBytes = sizeof(T) * kBlockKV2 * kKStride;
    static constexpr std::size_t kVBytes = sizeof(T) * kBlockKV2 * D_MAX;
    static constexpr std::size_t kPBytes = sizeof(float) * kBlockQV2 * kBlockKV2;
    static constexpr std::size_t kBytes = kQBytes + kKBytes + kVBytes + kPBytes;
    // Blocks per SM asked of ptxas (__launch_bounds__; 0: no request). Left to itself, ptxas
    // picks the register count by its own occupancy heuristic; at D = 64 it chose 96 registers
    // (5 blocks) and spilled 36 bytes (CUDA 13, sm_90). Asked for
    // 6 blocks it fits the kernel in 80 registers with no spill: one block per SM more, not less.
    // At the other widths its own choice spills nothing and is kept.
    static constexpr int kMinBlocks = D_MAX == 64 ? 6 : 0;
};

template <typename T, int D_MAX>
__global__ void __launch_bounds__(kThreadsV2, V2Layout<T, D_MAX>::kMinBlocks)
flash_v2_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                T* __restrict__ o, float* __restrict__ lse, Band band, int heads, int group,
                int head_dim, float scale) {
    using L = V2Layout<T, D_MAX>;
    constexpr int kCols = D_MAX / kWarpSize;  // output columns per lane
    extern __shared__ __align__(16) unsigned char smem[];
    float* q_s = reinterpret_cast<float*>(smem);                          // [kBlockQ][D_MAX]
    T* k_s = reinterpret_cast<T*>(smem + L::kQBytes);                     // [kBlockK][kKStride]
    T* v_s = reinterpret_cast<T*>(smem + L::kQBytes + L::kKBytes);        // [kBlockK][D_MAX]
    float* p_s = reinterpret_cast<float*>(smem + L::kQBytes + L::kKBytes + L::kVBytes);  // [kBlockQ][kBlockK]

    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int row_blocks = ceil_div(band.t_q, kBlockQV2);
    const int bh = blockIdx.x / row_blocks;
    const int q0 = (blockIdx.x % row_blocks) * kBlockQV2;
    const int q1 = imin(q0 + kBlockQV2, band.t_q);
    const int b = bh / heads, h = bh % heads;
    const int kv_heads = heads / group;
    const T* q_tile = q + (static_cast<std::int64_t>(bh) * band.t_q + q0) * head_dim;
    const std::int64_t kv_offset =
        (static_cast<std::int64_t>(b) * kv_heads + h / group) * band.t_k * head_dim;
    const T* k_head = k + kv_offset;
    const T* v_head = v + kv_offset;

    // Q tile, scaled once here; rows past T_q and columns past D are zeros.
    for (int idx = threadIdx.x; idx < kBlockQV2 * D_MAX; idx += kThreadsV2) {
        const int r = idx / D_MAX, c = idx % D_MAX;
        q_s[idx] = (q0 + r < q1 && c < head_dim) ? to_float(q_tile[r * head_dim + c]) * scale : 0.0f;
    }

    // This warp's rows: q0 + warp * 8 + rr. Their state m, l (the same in every lane) and the
    // lane's columns of the accumulator u.
    float m[kRowsPerWarpV2], l[kRowsPerWarpV2], acc[kRowsPerWarpV2][kCols];
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarpV2; ++rr) {
        m[rr] = -INFINITY;
        l[rr] = 0.0f;
#pragma unroll
        for (int cc = 0; cc < kCols; ++cc) acc[rr][cc] = 0.0f;
    }
    const int row0 = warp * kRowsPerWarpV2;  // first local row of this warp

    int lo, hi;  // the keys any row of this block sees
    band.keys_seen_by(q0, q1, &lo, &hi);
    for (int j0 = lo; j0 < hi; j0 += kBlockKV2) {
        __syncthreads();  // everyone is done with the previous tile (and q_s is written)
        bool odd_value = false;  // an infinite or NaN value in this tile
        for (int idx = threadIdx.x; idx < kBlockKV2 * D_MAX; idx += kThreadsV2) {
            const int r = idx / D_MAX, c = idx % D_MAX;
            T kx = from_float<T>(0.0f), vx = kx;  // zeros past the end keep P V finite
            if (j0 + r < hi && c < head_dim) {
                const std::int64_t at = static_cast<std::int64_t>(j0 + r) * head_dim + c;
                kx = k_head[at];
                vx = v_head[at];
                odd_value |= nonfinite(vx);
            }
            k_s[r * L::kKStride + c] = kx;
            v_s[r * D_MAX + c] = vx;
        }
        // With an infinite or NaN value in the tile, P V below adds only the visible pairs: a
        // hidden pair's weight is 0, and 0 * NaN would leak the value into rows that never see it.
        const bool only_visible = __syncthreads_or(odd_value) != 0;

        // Scores of key j = j0 + lane against the warp's rows.
        float s[kRowsPerWarpV2];
#pragma unroll
        for (int rr = 0; rr < kRowsPerWarpV2; ++rr) s[rr] = 0.0f;
        const T* k_row = k_s + lane * L::kKStride;
#pragma unroll 4
        for (int c = 0; c < D_MAX; ++c) {
            const float kc = to_float(k_row[c]);
#pragma unroll
            for (int rr = 0; rr < kRowsPerWarpV2; ++rr) s[rr] += q_s[(row0 + rr) * D_MAX + c] * kc;
        }

        // Online softmax over the tile (F2, F3), one row at a time; every lane holds one key.
        const int j = j0 + lane;
#pragma unroll
        for (int rr = 0; rr < kRowsPerWarpV2; ++rr) {
            const int i = q0 + row0 + rr;
            const float score = (i < q1 && j < hi && band.visible(i, j)) ? s[rr] : -INFINITY;
            const float m_new = nan_max(m[rr], warp_max(score));
            float p = 0.0f;
            if (m_new != -INFINITY) {  // the same in every lane: no divergence
                const float correction = expf(m[rr] - m_new);
                p = expf(score - m_new);
                l[rr] = l[rr] * correction + warp_sum(p);
#pragma unroll
                for (int cc = 0; cc < kCols; ++cc) acc[rr][cc] *= correction;
                m[rr] = m_new;
            }
            p_s[(row0 + rr) * kBlockKV2 + lane] = p;
        }
        __syncwarp();  // the warp reads back only its own rows of p_s

        // u += P V: lane owns columns lane, lane + 32, ...
        for (int jj = 0; jj < kBlockKV2; ++jj) {
            float vj[kCols];
#pragma unroll
            for (int cc = 0; cc < kCols; ++cc) vj[cc] = to_float(v_s[jj * D_MAX + lane + cc * kWarpSize]);
#pragma unroll
            for (int rr = 0; rr < kRowsPerWarpV2; ++rr) {
                const int i = q0 + row0 + rr;
                if (only_visible && !(i < q1 && j0 + jj < hi && band.visible(i, j0 + jj))) continue;
                const float p = p_s[(row0 + rr) * kBlockKV2 + jj];
#pragma unroll
                for (int cc = 0; cc < kCols; ++cc) acc[rr][cc] += p * vj[cc];
            }
        }
    }

    // F1: o = u / l; a row that saw no key has l = 0, o = 0 and lse = -inf (l = NaN: both NaN).
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarpV2; ++rr) {
        const int i = q0 + row0 + rr;
        if (i >= q1) continue;
        const std::int64_t row = static_cast<std::int64_t>(bh) * band.t_q + i;
        const float inv_l = l[rr] != 0.0f ? 1.0f / l[rr] : 0.0f;
#pragma unroll
        for (int cc = 0; cc < kCols; ++cc) {
            const int c = lane + cc * kWarpSize;
            if (c < head_dim) o[row * head_dim + c] = from_float<T>(acc[rr][cc] * inv_l);
        }
        if (lane == 0) lse[row] = l[rr] != 0.0f ? m[rr] + logf(l[rr]) : -INFINITY;
    }
}

template <typename T, int D_MAX>
std::string launch_v2(const FlashForwardArgs& a, const Band& band, int blocks, cudaStream_t stream) {
    const AttentionProblem& p = a.problem;
    auto* kernel = flash_v2_kernel<T, D_MAX>;
    const std::size_t bytes = V2Layout<T, D_MAX>::kBytes;
    const std::string error = allow_shared_memory(kernel, bytes, "flash_forward_v2");
    if (!error.empty()) return error;
    kernel<<<blocks, kThreadsV2, bytes, stream>>>(
        static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<const T*>(a.v),
        static_cast<T*>(a.o), a.lse, band, static_cast<int>(p.heads),
        static_cast<int>(p.heads / p.kv_heads), static_cast<int>(p.head_dim), p.scale);
    return launch_status("flash_forward_v2");
}

}  // namespace

// The checks against v2's line of the ladder (flash_ladder.h), the grid and the choice of the
// instance for the dtype and head width: launch_forward, flash_forward.cuh.
std::string flash_forward_v2(const FlashForwardArgs& a, cudaStream_t stream) {
    auto launch = [&](auto element, auto width, const Band& band, int blocks) {
        return launch_v2<decltype(element), decltype(width)::value>(a, band, blocks, stream);
    };
    return launch_forward<Rung::v2>(a, kBlockQV2, launch);
}

}  // namespace refmath_cuda
