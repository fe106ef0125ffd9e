// FlashAttention backward, FlashAttention-2 style, in float32 (catalogue F4, A8).
//
// The forward kept only o and the logsumexp lse per query row. The backward recomputes each tile
// of weights from them, P = exp(tau q_i . k_j - lse_i), exactly the final softmax weights, and uses
// the row constant delta_i = dO_i . O_i in place of the row sum of P * dP (refmath/flash.py derives
// both). Per (query tile, key tile):
//
//     P = exp(tau Q K^T - lse),  dP = dO V^T,  dS = P * (dP - delta)
//     dV += P^T dO,   dK += tau dS^T Q,   dQ += tau dS K
//
// Three kernels, in this order on the stream:
//   1. delta = rowsum(dO * O): one warp per query row.
//   2. dK, dV: one block per (batch, key/value head, tile of 32 keys). It loops over the query
//      heads of its GQA group and the query tiles that see its keys, and accumulates dK and dV
//      in registers. Each block owns its keys for every query head that reads them, so the sum
//      over the group's heads needs no atomics, and the result does not depend on scheduling.
//   3. dQ: one block per (batch, query head, tile of 16 rows), looping over the key tiles its rows
//      see.
// Kernels 2 and 3 both recompute P and dS (the arithmetic of Q K^T and dO V^T is done twice).
// FlashAttention-2 does it once, in the dK/dV loop, and adds each dS K into dQ with atomicAdd
// instead; that is faster, but float atomics make dQ depend on the order the blocks run in. Here
// the reference role wins: two passes, deterministic results.
//
// Inside a tile step, the work is split as in flash_v2: in phase 1 lane j of a warp takes key j
// and the warp's query rows (dot products against shared K and V rows, padded against bank
// conflicts), writing P and dS to shared memory; in phase 2 lane c takes output columns c, c + 32,
// ... and the tiles of P and dS are read as broadcasts. Everything is float32 on the FP32 units;
// the Python side converts fp16/bf16 inputs to float32 first. D <= 256; the tiles use dynamic
// shared memory, 53 KB for D = 128, so the kernels opt in above 48 KB.
#include "attention_common.cuh"

namespace refmath_cuda {
namespace {

constexpr int kWarpsB = 4;
constexpr int kThreadsB = kWarpsB * kWarpSize;
constexpr int kBlockQB = 16;                    // query rows per tile: 4 per warp in phase 1
constexpr int kBlockKB = kWarpSize;             // keys per tile: one per lane in phase 1
constexpr int kRowsPerWarpB = kBlockQB / kWarpsB;  // 4
constexpr int kKeysPerWarpB = kBlockKB / kWarpsB;  // 8, in phase 2 of the dK/dV kernel

template <int D_MAX>
struct BwdLayout {
    static constexpr int kKVStride = D_MAX + 1;  // odd: lanes reading 32 rows hit 32 banks
    static constexpr int kKVFloats = kBlockKB * kKVStride;
    static constexpr int kQFloats = kBlockQB * D_MAX;
    static constexpr int kPFloats = kBlockQB * kBlockKB;
    // k_s, v_s, q_s, do_s, p_s, ds_s, lse_s, delta_s, seen_s (one 32-bit mask per row)
    static constexpr std::size_t kBytes =
        sizeof(float) * (2 * kKVFloats + 2 * kQFloats + 2 * kPFloats + 3 * kBlockQB);
    // The blocks per SM that the kernels ask ptxas for (__launch_bounds__). Left to itself,
    // ptxas picks a register count by its own occupancy heuristic, and for dK/dV at D = 64 and dQ
    // at D = 128 it shaved the last few registers by spilling (CUDA 13, sm_90). Told an occupancy,
    // it fits the registers to it without spilling. The request: as many blocks as these tiles let
    // an sm_90 SM hold anyway (228 KB of shared memory, 1 KB reserved per block: D = 128 gives 4,
    // D = 256 gives 2, so those get every register that occupancy leaves), and no more than ptxas
    // chose by itself where registers were the limit (9 blocks, 56 registers, at D = 32; 7 blocks,
    // 72 registers, at D = 64): no kernel runs fewer blocks per SM than before.
    static constexpr int kSharedBlocks = static_cast<int>((228 * 1024) / (kBytes + 1024));
    static constexpr int kRegisterBlocks = D_MAX <= 32 ? 9 : 7;
    static constexpr int kMinBlocks = kSharedBlocks < kRegisterBlocks ? kSharedBlocks : kRegisterBlocks;
    static_assert(kMinBlocks >= 1, "the tiles must fit in one SM's shared memory");
};

template <int D_MAX>
struct BwdShared {
    float *k, *v, *q, *dout, *p, *ds, *lse, *delta;
    unsigned* seen;  // seen[row]: bit j set if the pair (row, key j) of the tile is visible
    __device__ explicit BwdShared(float* base) {
        using L = BwdLayout<D_MAX>;
        k = base;
        v = k + L::kKVFloats;
        q = v + L::kKVFloats;
        dout = q + L::kQFloats;
        p = dout + L::kQFloats;
        ds = p + L::kPFloats;
        lse = ds + L::kPFloats;
        delta = lse + kBlockQB;
        seen = reinterpret_cast<unsigned*>(delta + kBlockQB);
    }
};

// Rows [i0, i0 + 16) of one query head into q_s, do_s, lse_s, delta_s; rows >= t_q are zeros
// with lse = -inf (so their P is 0). Returns whether this thread copied an infinite or NaN q or dO.
template <int D_MAX>
__device__ bool load_query_tile(const BwdShared<D_MAX>& sm, const float* q_head, const float* do_head,
                                const float* lse_head, const float* delta_head, int i0, int t_q,
                                int head_dim) {
    bool odd = false;
    for (int idx = threadIdx.x; idx < kBlockQB * D_MAX; idx += kThreadsB) {
        const int r = idx / D_MAX, c = idx % D_MAX;
        float qx = 0.0f, dox = 0.0f;
        if (i0 + r < t_q && c < head_dim) {
            const std::int64_t at = static_cast<std::int64_t>(i0 + r) * head_dim + c;
            qx = q_head[at];
            dox = do_head[at];
            odd |= nonfinite(qx) || nonfinite(dox);
        }
        sm.q[idx] = qx;
        sm.dout[idx] = dox;
    }
    if (threadIdx.x < kBlockQB) {
        const int i = i0 + threadIdx.x;
        sm.lse[threadIdx.x] = i < t_q ? lse_head[i] : -INFINITY;
        sm.delta[threadIdx.x] = i < t_q ? delta_head[i] : 0.0f;
    }
    return odd;
}

// Keys [j0, j0 + 32) of one key/value head into k_s and v_s; keys >= j_end are zeros. Returns
// whether this thread copied an infinite or NaN key.
template <int D_MAX>
__device__ bool load_key_tile(const BwdShared<D_MAX>& sm, const float* k_head, const float* v_head,
                              int j0, int j_end, int head_dim) {
    constexpr int kStride = BwdLayout<D_MAX>::kKVStride;
    bool odd = false;
    for (int idx = threadIdx.x; idx < kBlockKB * D_MAX; idx += kThreadsB) {
        const int r = idx / D_MAX, c = idx % D_MAX;
        float kx = 0.0f, vx = 0.0f;
        if (j0 + r < j_end && c < head_dim) {
            const std::int64_t at = static_cast<std::int64_t>(j0 + r) * head_dim + c;
            kx = k_head[at];
            vx = v_head[at];
            odd |= nonfinite(kx);
        }
        sm.k[r * kStride + c] = kx;
        sm.v[r * kStride + c] = vx;
    }
    return odd;
}

// Phase 1 of a tile step: for the warp's 4 rows and key j0 + lane, P and dS into shared memory
// (P only if write_p). Keys >= j_end, rows >= t_q and pairs outside the band get P = dS = 0.
// Which pairs are visible is also kept, one bit per key in seen[row] (a warp ballot): phase 2
// needs it when a tile holds an infinite or NaN input, and a bit test there costs less (in
// instructions and in live registers) than evaluating the band again for every pair.
template <int D_MAX>
__device__ void weights_and_score_gradients(const BwdShared<D_MAX>& sm, const Band& band, int i0,
                                            int j0, int j_end, float scale, bool write_p) {
    constexpr int kStride = BwdLayout<D_MAX>::kKVStride;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int row0 = warp * kRowsPerWarpB;
    float s[kRowsPerWarpB], dp[kRowsPerWarpB];
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarpB; ++rr) s[rr] = dp[rr] = 0.0f;
    const float* k_row = sm.k + lane * kStride;
    const float* v_row = sm.v + lane * kStride;
#pragma unroll 4
    for (int c = 0; c < D_MAX; ++c) {
        const float kc = k_row[c], vc = v_row[c];
#pragma unroll
        for (int rr = 0; rr < kRowsPerWarpB; ++rr) {
            s[rr] += sm.q[(row0 + rr) * D_MAX + c] * kc;      // q_i . k_j
            dp[rr] += sm.dout[(row0 + rr) * D_MAX + c] * vc;  // dO_i . v_j
        }
    }
    const int j = j0 + lane;
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarpB; ++rr) {
        const int il = row0 + rr, i = i0 + il;
        // A hidden pair gets dS = 0 outright, not 0 * (dP - delta): its dP may be NaN (a NaN value
        // or dO that this pair does not involve) and must not leak.
        const bool seen = i < band.t_q && j < j_end && band.visible(i, j);
        float p = 0.0f;
        if (seen && sm.lse[il] != -INFINITY) p = expf(s[rr] * scale - sm.lse[il]);
        if (write_p) sm.p[il * kBlockKB + lane] = p;
        sm.ds[il * kBlockKB + lane] = seen ? p * (dp[rr] - sm.delta[il]) : 0.0f;
        const unsigned mask = __ballot_sync(0xffffffffu, seen);
        if (lane == 0) sm.seen[il] = mask;
    }
}

// 1. delta[row] = sum_c dO[row, c] O[row, c], one warp per row.
__global__ void __launch_bounds__(kThreadsB)
backward_delta_kernel(const float* __restrict__ dout, const float* __restrict__ o,
                      float* __restrict__ delta, std::int64_t rows, int head_dim) {
    const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsB + threadIdx.x / kWarpSize;
    if (row >= rows) return;  // the whole warp leaves together; there is no block barrier
    const int lane = threadIdx.x % kWarpSize;
    float sum = 0.0f;
    for (int c = lane; c < head_dim; c += kWarpSize) sum += dout[row * head_dim + c] * o[row * head_dim + c];
    sum = warp_sum(sum);
    if (lane == 0) delta[row] = sum;
}

// 2. dK, dV for one (batch, key/value head, key tile).
template <int D_MAX>
__global__ void __launch_bounds__(kThreadsB, BwdLayout<D_MAX>::kMinBlocks)
backward_dkdv_kernel(const float* __restrict__ q, const float* __restrict__ k,
                     const float* __restrict__ v, const float* __restrict__ dout,
                     const float* __restrict__ lse, const float* __restrict__ delta,
                     float* __restrict__ dk, float* __restrict__ dv, Band band, int heads,
                     int group, int head_dim, float scale) {
    constexpr int kCols = D_MAX / kWarpSize;
    extern __shared__ __align__(16) float smem_b[];
    const BwdShared<D_MAX> sm(smem_b);
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int kv_heads = heads / group;
    const int key_tiles = ceil_div(band.t_k, kBlockKB);
    const int bg = blockIdx.x / key_tiles;  // batch * kv_heads + kv_head
    const int j0 = (blockIdx.x % key_tiles) * kBlockKB;
    const int j1 = imin(j0 + kBlockKB, band.t_k);
    const int b = bg / kv_heads, g = bg % kv_heads;
    const std::int64_t kv_offset = static_cast<std::int64_t>(bg) * band.t_k * head_dim;

    load_key_tile(sm, k + kv_offset, v + kv_offset, j0, j1, head_dim);

    // Phase 2 ownership: keys j0 + 8 warp + jj, columns lane + 32 cc.
    float dk_acc[kKeysPerWarpB][kCols], dv_acc[kKeysPerWarpB][kCols];
#pragma unroll
    for (int jj = 0; jj < kKeysPerWarpB; ++jj)
#pragma unroll
        for (int cc = 0; cc < kCols; ++cc) dk_acc[jj][cc] = dv_acc[jj][cc] = 0.0f;

    int i_lo, i_hi;  // the query rows that see any of these keys
    band.queries_seeing(j0, j1, &i_lo, &i_hi);
    for (int h = g * group; h < (g + 1) * group; ++h) {  // the query heads sharing this K/V head
        const std::int64_t bh = static_cast<std::int64_t>(b) * heads + h;
        const float* q_head = q + bh * band.t_q * head_dim;
        const float* do_head = dout + bh * band.t_q * head_dim;
        for (int i0 = i_lo; i0 < i_hi; i0 += kBlockQB) {
            __syncthreads();  // the previous step's tiles are no longer read (and k_s, v_s are written)
            const bool odd = load_query_tile(sm, q_head, do_head, lse + bh * band.t_q,
                                             delta + bh * band.t_q, i0, band.t_q, head_dim);
            // With an infinite or NaN q or dO in the tile, phase 2 adds the visible pairs only: a
            // hidden pair has P = dS = 0, and 0 * NaN would leak into keys that row never sees.
            const bool only_visible = __syncthreads_or(odd) != 0;
            weights_and_score_gradients(sm, band, i0, j0, j1, scale, true);
            __syncthreads();  // phase 2 reads every row of P and dS
            for (int il = 0; il < kBlockQB; ++il) {
                float qv[kCols], dov[kCols];
#pragma unroll
                for (int cc = 0; cc < kCols; ++cc) {
                    qv[cc] = sm.q[il * D_MAX + lane + cc * kWarpSize];
                    dov[cc] = sm.dout[il * D_MAX + lane + cc * kWarpSize];
                }
                const unsigned seen = sm.seen[il];
#pragma unroll
                for (int jj = 0; jj < kKeysPerWarpB; ++jj) {
                    const int jl = warp * kKeysPerWarpB + jj;
                    if (only_visible && !((seen >> jl) & 1u)) continue;
                    const float p = sm.p[il * kBlockKB + jl], ds = sm.ds[il * kBlockKB + jl];
#pragma unroll
                    for (int cc = 0; cc < kCols; ++cc) {
                        dv_acc[jj][cc] += p * dov[cc];  // dV_j += P_ij dO_i
                        dk_acc[jj][cc] += ds * qv[cc];  // dK_j += dS_ij q_i (times tau below)
                    }
                }
            }
        }
    }

#pragma unroll
    for (int jj = 0; jj < kKeysPerWarpB; ++jj) {
        const int j = j0 + warp * kKeysPerWarpB + jj;
        if (j >= j1) continue;
        const std::int64_t at = kv_offset + static_cast<std::int64_t>(j) * head_dim;
#pragma unroll
        for (int cc = 0; cc < kCols; ++cc) {
            const int c = lane + cc * kWarpSize;
            if (c < head_dim) {
                dk[at + c] = dk_acc[jj][cc] * scale;
                dv[at + c] = dv_acc[jj][cc];
            }
        }
    }
}

// 3. dQ for one (batch, query head, query tile).
template <int D_MAX>
__global__ void __launch_bounds__(kThreadsB, BwdLayout<D_MAX>::kMinBlocks)
backward_dq_kernel(const float* __restrict__ q, const float* __restrict__ k,
                   const float* __restrict__ v, const float* __restrict__ dout,
                   const float* __restrict__ lse, const float* __restrict__ delta,
                   float* __restrict__ dq, Band band, int heads, int group, int head_dim, float scale) {
    constexpr int kCols = D_MAX / kWarpSize;
    constexpr int kStride = BwdLayout<D_MAX>::kKVStride;
    extern __shared__ __align__(16) float smem_b[];
    const BwdShared<D_MAX> sm(smem_b);
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int row_tiles = ceil_div(band.t_q, kBlockQB);
    const int bh = blockIdx.x / row_tiles;
    const int i0 = (blockIdx.x % row_tiles) * kBlockQB;
    const int i1 = imin(i0 + kBlockQB, band.t_q);
    const int b = bh / heads, h = bh % heads;
    const int kv_heads = heads / group;
    const std::int64_t q_offset = static_cast<std::int64_t>(bh) * band.t_q * head_dim;
    const std::int64_t kv_offset =
        (static_cast<std::int64_t>(b) * kv_heads + h / group) * band.t_k * head_dim;

    load_query_tile(sm, q + q_offset, dout + q_offset, lse + static_cast<std::int64_t>(bh) * band.t_q,
                    delta + static_cast<std::int64_t>(bh) * band.t_q, i0, band.t_q, head_dim);

    // Phase 2 ownership: rows i0 + 4 warp + rr (the rows of phase 1), columns lane + 32 cc.
    float dq_acc[kRowsPerWarpB][kCols];
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarpB; ++rr)
#pragma unroll
        for (int cc = 0; cc < kCols; ++cc) dq_acc[rr][cc] = 0.0f;

    int lo, hi;
    band.keys_seen_by(i0, i1, &lo, &hi);
    for (int j0 = lo; j0 < hi; j0 += kBlockKB) {
        __syncthreads();  // the previous key tile is no longer read (and the query tile is written)
        const bool odd = load_key_tile(sm, k + kv_offset, v + kv_offset, j0, hi, head_dim);
        // An infinite or NaN key: add the visible pairs only (0 * NaN would leak, as in dK, dV).
        const bool only_visible = __syncthreads_or(odd) != 0;
        weights_and_score_gradients(sm, band, i0, j0, hi, scale, false);
        __syncwarp();  // phase 2 reads only this warp's own rows of dS
        for (int jl = 0; jl < kBlockKB; ++jl) {
            float kv[kCols];
#pragma unroll
            for (int cc = 0; cc < kCols; ++cc) kv[cc] = sm.k[jl * kStride + lane + cc * kWarpSize];
#pragma unroll
            for (int rr = 0; rr < kRowsPerWarpB; ++rr) {
                if (only_visible && !((sm.seen[warp * kRowsPerWarpB + rr] >> jl) & 1u)) continue;
                const float ds = sm.ds[(warp * kRowsPerWarpB + rr) * kBlockKB + jl];
#pragma unroll
                for (int cc = 0; cc < kCols; ++cc) dq_acc[rr][cc] += ds * kv[cc];  // dQ_i += dS_ij k_j
            }
        }
    }

#pragma unroll
    for (int rr = 0; rr < kRowsPerWarpB; ++rr) {
        const int i = i0 + warp * kRowsPerWarpB + rr;
        if (i >= i1) continue;
        const std::int64_t at = q_offset + static_cast<std::int64_t>(i) * head_dim;
#pragma unroll
        for (int cc = 0; cc < kCols; ++cc) {
            const int c = lane + cc * kWarpSize;
            if (c < head_dim) dq[at + c] = dq_acc[rr][cc] * scale;
        }
    }
}

template <int D_MAX>
std::string launch_backward(const FlashBackwardArgs& a, const Band& band, cudaStream_t stream) {
    const AttentionProblem& p = a.problem;
    const int heads = static_cast<int>(p.heads), group = static_cast<int>(p.heads / p.kv_heads);
    const int head_dim = static_cast<int>(p.head_dim);
    const std::size_t bytes = BwdLayout<D_MAX>::kBytes;
    std::string error;

    const std::int64_t rows = p.batch * p.heads * p.t_q;
    if (rows > 0) {
        const std::int64_t delta_blocks = (rows + kWarpsB - 1) / kWarpsB;
        error = check_grid(delta_blocks, "flash_backward (delta)");
        if (!error.empty()) return error;
        backward_delta_kernel<<<static_cast<int>(delta_blocks), kThreadsB, 0, stream>>>(
            a.dout, a.o, a.delta, rows, head_dim);
        error = launch_status("flash_backward (delta)");
        if (!error.empty()) return error;
    }

    const std::int64_t dkdv_blocks = p.batch * p.kv_heads * ceil_div(static_cast<int>(p.t_k), kBlockKB);
    if (dkdv_blocks > 0) {
        auto* kernel = backward_dkdv_kernel<D_MAX>;
        error = check_grid(dkdv_blocks, "flash_backward (dK, dV)");
        if (error.empty()) error = allow_shared_memory(kernel, bytes, "flash_backward (dK, dV)");
        if (!error.empty()) return error;
        kernel<<<static_cast<int>(dkdv_blocks), kThreadsB, bytes, stream>>>(
            a.q, a.k, a.v, a.dout, a.lse, a.delta, a.dk, a.dv, band, heads, group, head_dim, p.scale);
        error = launch_status("flash_backward (dK, dV)");
        if (!error.empty()) return error;
    }

    const std::int64_t dq_blocks = p.batch * p.heads * ceil_div(static_cast<int>(p.t_q), kBlockQB);
    if (dq_blocks > 0) {
        auto* kernel = backward_dq_kernel<D_MAX>;
        error = check_grid(dq_blocks, "flash_backward (dQ)");
        if (error.empty()) error = allow_shared_memory(kernel, bytes, "flash_backward (dQ)");
        if (!error.empty()) return error;
        kernel<<<static_cast<int>(dq_blocks), kThreadsB, bytes, stream>>>(
            a.q, a.k, a.v, a.dout, a.lse, a.delta, a.dq, band, heads, group, head_dim, p.scale);
        error = launch_status("flash_backward (dQ)");
    }
    return error;
}

}  // namespace

std::string flash_backward(const FlashBackwardArgs& a, cudaStream_t stream) {
    const AttentionProblem& p = a.problem;
    std::string error = check_problem(p, kMaxHeadDim);
    if (!error.empty()) return "flash_backward: " + error;
    if (p.dtype != kFloat32)
        return std::string("flash_backward: computes in float32 only, got ") + dtype_name(p.dtype);
    const bool has_queries = p.batch * p.heads * p.t_q > 0;
    const bool has_keys = p.batch * p.kv_heads * p.t_k > 0;
    if ((has_queries && (!a.q || !a.o || !a.lse || !a.dout || !a.dq || !a.delta)) ||
        (has_keys && (!a.k || !a.v || !a.dk || !a.dv)))
        return "flash_backward: a null pointer for a non-empty array";
    const Band band = make_band(p);
    if (p.head_dim <= 32) return launch_backward<32>(a, band, stream);
    if (p.head_dim <= 64) return launch_backward<64>(a, band, stream);
    if (p.head_dim <= 128) return launch_backward<128>(a, band, stream);
    return launch_backward<256>(a, band, stream);
}

}  // namespace refmath_cuda
