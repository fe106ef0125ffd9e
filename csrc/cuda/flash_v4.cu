// FlashAttention forward, version 4: v3's tensor-core math, fed the way FlashAttention-2 feeds it.
//
// Inputs fp16 or bf16, products accumulated in fp32, softmax statistics in fp32; D = 64 or 128.
// The arithmetic (the mma.m16n8k16 products, the online softmax on the accumulator fragments, P
// kept in registers as the next A operand, exponentials in base 2, the unmasked fast path and the
// NaN rules) is v3's, the same functions of flash_mma_math.cuh. What changes is how the operands
// reach the tensor cores.
//
// What changes from v3, and why it is faster:
//
// * ldmatrix. v3 builds each B fragment from 32-bit shared loads (K) or pairs of 16-bit loads (V,
//   whose columns the mma wants): about three shared-memory instructions per mma. Here one
//   ldmatrix.x4 gives a warp four 8 x 8 matrices at once: for K, the b0 and b1 of one 8-key n-tile
//   over two k-steps; for V, ldmatrix.x4.trans transposes on the way and gives b0 and b1 of two
//   8-column n-tiles of one 16-key k-step. One instruction per two mma. Q's fragments too.
// * cp.async, double buffered. v3 loads a K/V tile, waits, computes, and only then loads the next:
//   global latency and tensor-core work take turns. Here the tile j + 1 is requested (cp.async:
//   global -> shared without passing through registers) before tile j is computed, into the other
//   of two buffers, so the copy runs under the math. Rows past the keys are zero-filled by the copy.
// * __launch_bounds__(128, 3) at D = 64: three blocks (12 warps) per multiprocessor hide each
//   other's stalls, which caps registers at 168 per thread; ptxas (sm_90, CUDA 13) fits in it
//   without spilling. At D = 128 the accumulators alone take 64 registers and the same cap spills
//   128 bytes, which costs more than the third block buys: __launch_bounds__(128, 2), 244
//   registers, no spills (benchmarks/ptxas_spills.sh). Shared memory: 2 stages x (K, V) x 64 x
//   (D + 8) x 2 bytes = 36 KB per block at D = 64, 68 KB at D = 128.
// * Output through shared memory: v3 stores 4-byte pairs straight from the fragments (each row
//   written by 4 lanes in 4-byte pieces). Here each warp puts its 16 x D tile into shared memory and
//   writes it back in 16-byte chunks, consecutive lanes on consecutive bytes of a row.
//
// The per-lane addressing of ldmatrix, of the fragments and of the copies is in mma_layout.h, which
// the CPU test suite runs through a NumPy model of ldmatrix and mma (tests/test_kernels_mma_model.py).
//
// What is left for later versions: fewer registers at D = 128 (three blocks, see above);
// 32 query rows per warp (FlashAttention-2 reuses each K and V
// fragment for two 16-row tiles, halving the ldmatrix traffic per mma); on Hopper, TMA for the
// copies and wgmma (warpgroup-wide, asynchronous) for the products, as FlashAttention-3 does.
//
// Needs compute capability 8.0 (cp.async, mma.m16n8k16; ldmatrix is 7.5). A build for an older
// target compiles with bodies that trap, and the launcher refuses such code (check_compiled_for).
#include "flash_forward.cuh"
#include "flash_mma_math.cuh"
#include "mma_layout.h"

namespace refmath_cuda {
namespace {

using v4::kBlockK;
using v4::kBlockQ;
using v4::kPadV4;
using v4::kThreads;
using v4::kWarps;

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define REFMATH_V4_HAS_SM80 1
#else
#define REFMATH_V4_HAS_SM80 0
#endif

__device__ inline std::uint32_t shared_address(const void* p) {
    return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8 x 8 matrices of 16-bit elements; this lane gives the address of one row (mma_layout.h).
// "memory" clobbers: the compiler must not move these reads across the barriers and the copies
// that fill the tile.
__device__ inline void ldmatrix_x4(std::uint32_t (&r)[4], const void* row) {
#if REFMATH_V4_HAS_SM80
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row))
                 : "memory");
#else
    asm volatile("trap;");
#endif
}
__device__ inline void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* row) {
#if REFMATH_V4_HAS_SM80
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row))
                 : "memory");
#else
    asm volatile("trap;");
#endif
}

// 16 bytes global -> shared, bypassing registers (and the L1 cache: .cg). With valid = false the
// 16 bytes are zero-filled and nothing is read (src-size 0); src must still be a global address.
__device__ inline void copy16_async(void* dst, const void* src, bool valid) {
#if REFMATH_V4_HAS_SM80
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :
                 : "r"(shared_address(dst)), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
#else
    asm volatile("trap;");
#endif
}
__device__ inline void copy_commit() {
#if REFMATH_V4_HAS_SM80
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Wait until at most `pending` of this thread's committed groups are still in flight.
template <int pending>
__device__ inline void copy_wait() {
#if REFMATH_V4_HAS_SM80
    asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");
#endif
}

// Request rows [r0, r0 + rows) of a (?, D) matrix into a padded shared tile (rows >= r_end: zeros).
template <typename T, int D, int ROWS>
__device__ inline void request_tile(T* tile, const T* src, int r0, int r_end) {
    constexpr int kPerThread = v4::chunks_per_thread(ROWS, D);
    // Not unrolled: a handful of copies per thread and tile, and their addresses, all kept live
    // when unrolled, cost the registers that decide between two and three blocks at D = 64.
#pragma unroll 1
    for (int i = 0; i < kPerThread; ++i) {
        const v4::RowCol at = v4::tile_chunk(threadIdx.x + i * kThreads, D);
        const bool valid = r0 + at.row < r_end;
        const T* from = valid ? src + static_cast<std::int64_t>(r0 + at.row) * D + at.col : src;
        copy16_async(tile + at.row * v4::stride(D) + at.col, from, valid);
    }
}

// Whether a chunk this thread copied into the tile holds an infinite or NaN element. Called after
// copy_wait: a thread's own cp.async writes are visible to it then (others' after a barrier).
template <typename T, int D>
__device__ inline bool tile_has_nonfinite(const T* tile) {
    constexpr int kPerThread = v4::chunks_per_thread(kBlockK, D);
    bool odd = false;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
        const v4::RowCol at = v4::tile_chunk(threadIdx.x + i * kThreads, D);
        const uint4 w = *reinterpret_cast<const uint4*>(tile + at.row * v4::stride(D) + at.col);
        odd |= nonfinite_pair<T>(w.x) || nonfinite_pair<T>(w.y) || nonfinite_pair<T>(w.z) ||
               nonfinite_pair<T>(w.w);
    }
    return odd;
}

// Shared memory of one block: two stages of (K tile, V tile). The Q tile is read through stage 1's
// K buffer before the first copy into it, and the output tile goes through stage 0's buffers.
template <typename T, int D>
struct TilesV4 {
    static constexpr int kTile = kBlockK * v4::stride(D);
    T k[2][kTile];
    T v[2][kTile];
};

// Blocks per multiprocessor that the register budget must allow (see the header).
template <int D> constexpr int kMinBlocks = D == 64 ? 3 : 2;

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, kMinBlocks<D>)
flash_v4_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                T* __restrict__ o, float* __restrict__ lse, Band band, int heads, int group,
                float scale_log2) {
    constexpr int kStride = v4::stride(D);
    constexpr int kDChunks = D / 16;            // k-steps of Q K^T
    constexpr int kKeyTiles = kBlockK / 8;      // n-tiles of S (8 keys each)
    constexpr int kKeyChunks = kBlockK / 16;    // k-steps of P V
    constexpr int kDimTiles = D / 8;            // n-tiles of the output
    static_assert(kBlockQ == kBlockK, "the Q tile borrows a K buffer");
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    TilesV4<T, D>& sm = *reinterpret_cast<TilesV4<T, D>*>(shared_bytes);

    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int g = lane / 4, t = lane % 4;
    const int row_blocks = ceil_div(band.t_q, kBlockQ);
    const int bh = blockIdx.x / row_blocks;
    const int q0 = (blockIdx.x % row_blocks) * kBlockQ;
    const int q1 = imin(q0 + kBlockQ, band.t_q);
    const int b = bh / heads, h = bh % heads;
    const int kv_heads = heads / group;
    const T* q_head = q + static_cast<std::int64_t>(bh) * band.t_q * D;
    const std::int64_t kv_offset = (static_cast<std::int64_t>(b) * kv_heads + h / group) * band.t_k * D;
    const T* k_head = k + kv_offset;
    const T* v_head = v + kv_offset;
    int lo, hi;
    band.keys_seen_by(q0, q1, &lo, &hi);

    // Copies in flight: the Q tile (group 1), then the first K/V tile (group 2).
    request_tile<T, D, kBlockQ>(sm.k[1], q_head, q0, q1);
    copy_commit();
    if (lo < hi) {
        request_tile<T, D, kBlockK>(sm.k[0], k_head, lo, hi);
        request_tile<T, D, kBlockK>(sm.v[0], v_head, lo, hi);
    }
    copy_commit();
    copy_wait<1>();  // this thread's Q chunks have landed
    __syncthreads();  // and everyone's

    // This warp's 16 rows of Q as A fragments, kept in registers for the whole kernel.
    std::uint32_t qa[kDChunks][4];
    {
        const v4::RowCol at = v4::a_operand_row(lane);
        const T* q_rows = sm.k[1] + (warp * 16 + at.row) * kStride + at.col;
#pragma unroll
        for (int kc = 0; kc < kDChunks; ++kc) ldmatrix_x4(qa[kc], q_rows + kc * 16);
    }

    const int rows[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float acc[kDimTiles][4];
#pragma unroll
    for (int dn = 0; dn < kDimTiles; ++dn)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[dn][e] = 0.0f;

    const int w0 = q0 + warp * 16, w1 = imin(w0 + 16, q1);
    const v4::RowCol k_at = v4::k_operand_row(lane), v_at = v4::v_operand_row(lane);
    int stage = 0;
    for (int j0 = lo; j0 < hi; j0 += kBlockK, stage ^= 1) {
        // Every warp is done with the other stage (its previous tile, or the Q tile): request the
        // next tile into it, then wait for this one only.
        __syncthreads();
        const bool has_next = j0 + kBlockK < hi;
        if (has_next) {
            request_tile<T, D, kBlockK>(sm.k[stage ^ 1], k_head, j0 + kBlockK, hi);
            request_tile<T, D, kBlockK>(sm.v[stage ^ 1], v_head, j0 + kBlockK, hi);
            copy_commit();
            copy_wait<1>();
        } else {
            copy_wait<0>();
        }
        T* k_s = sm.k[stage];
        const T* v_s = sm.v[stage];
        // An infinite or NaN value in the tile: P V is then summed over the visible pairs alone
        // (below), since the mma would add 0 * NaN = NaN for every hidden one. The barrier also
        // publishes every thread's copies of this tile.
        const bool only_visible = __syncthreads_or(tile_has_nonfinite<T, D>(v_s)) != 0;

        // S = Q K^T: 16 rows x 64 keys per warp, in 8 accumulator tiles of 16 x 8.
        float s[kKeyTiles][4];
#pragma unroll
        for (int nt = 0; nt < kKeyTiles; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] = 0.0f;
            const T* k_rows = k_s + (nt * 8 + k_at.row) * kStride + k_at.col;
#pragma unroll
            for (int kc = 0; kc < kDChunks; kc += 2) {
                std::uint32_t kb[4];  // b0, b1 of k-step kc, then of kc + 1
                ldmatrix_x4(kb, k_rows + kc * 16);
                mma_16816(s[nt], qa[kc], kb[0], kb[1], T());
                mma_16816(s[nt], qa[kc + 1], kb[2], kb[3], T());
            }
        }

        // Scale into log2 units and hide what this warp's rows may not see (as v3).
        const int j_last = imin(j0 + kBlockK, hi) - 1;
        const bool whole_tile = w0 < w1 && j0 + kBlockK <= hi && band.visible(w0, j_last) &&
                                band.visible(w1 - 1, j0) && band.visible(w0, j0) &&
                                band.visible(w1 - 1, j_last);
        scale_and_mask(s, scale_log2, whole_tile, band, rows, q1, j0, hi, t);

        // Online softmax (F3) for the two rows of this thread (as v3).
        float correction[2];
        online_softmax(s, m, l, correction);
        rescale(acc, correction);

        if (only_visible) {  // block-uniform: the barrier below is reached by every thread or none
            // The rare path (v3's): P, rounded to T, goes to shared memory in this stage's K
            // buffer, and each thread sums its accumulator entries over the visible keys.
            __syncthreads();  // every warp is done reading k_s
            pv_visible_only<T, kStride>(acc, s, k_s, v_s, band, rows, q1, j0, hi, warp, g, t);
            continue;
        }

        // u += P V: the accumulators of S tiles 2kk and 2kk + 1 are the A fragment of k-step kk.
#pragma unroll
        for (int kk = 0; kk < kKeyChunks; ++kk) {
            std::uint32_t pa[4];
            p_operand<T>(pa, s, kk);
            const T* v_rows = v_s + (kk * 16 + v_at.row) * kStride + v_at.col;
#pragma unroll
            for (int dn = 0; dn < kDimTiles; dn += 2) {
                std::uint32_t vb[4];  // b0, b1 of n-tile dn, then of dn + 1
                ldmatrix_x4_trans(vb, v_rows + dn * 8);
                mma_16816(acc[dn], pa, vb[0], vb[1], T());
                mma_16816(acc[dn + 1], pa, vb[2], vb[3], T());
            }
        }
    }

    // F1. Sum l over the 4 threads of each row, then o = u / l; lse = (m + log2 l) ln 2.
    sum_row_threads(l);
    const float inv_l[2] = {l[0] != 0.0f ? 1.0f / l[0] : 0.0f, l[1] != 0.0f ? 1.0f / l[1] : 0.0f};
    // The output tile goes through stage 0's K buffer, 16 rows per warp. Other warps may still be
    // reading it (their last tile), hence the barrier; no copy is in flight any more.
    __syncthreads();
    T* o_s = sm.k[0] + warp * 16 * kStride;
#pragma unroll
    for (int dn = 0; dn < kDimTiles; ++dn)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const v4::RowCol at = v4::c_fragment(lane, 2 * r);
            *reinterpret_cast<std::uint32_t*>(o_s + at.row * kStride + dn * 8 + at.col) =
                pack_pair<T>(acc[dn][2 * r] * inv_l[r], acc[dn][2 * r + 1] * inv_l[r]);
        }
    __syncwarp();
    T* o_warp = o + (static_cast<std::int64_t>(bh) * band.t_q + w0) * D;
#pragma unroll
    for (int i = 0; i < v4::out_chunks_per_lane(D); ++i) {
        const v4::RowCol at = v4::tile_chunk(lane + i * kWarpSize, D);
        if (w0 + at.row < q1)
            *reinterpret_cast<uint4*>(o_warp + static_cast<std::int64_t>(at.row) * D + at.col) =
                *reinterpret_cast<const uint4*>(o_s + at.row * kStride + at.col);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = rows[r];
        if (i < q1 && t == 0)
            lse[static_cast<std::int64_t>(bh) * band.t_q + i] =
                l[r] != 0.0f ? (m[r] + log2f(l[r])) * 0.69314718055994531f : -INFINITY;
    }
}

template <typename T, int D>
std::string launch_v4(const FlashForwardArgs& a, const Band& band, int blocks, cudaStream_t stream) {
    const AttentionProblem& p = a.problem;
    const float log2e = 1.4426950408889634f;
    // The device may be new enough while the code the runtime picked for it is not (see v3).
    std::string error = check_compiled_for(flash_v4_kernel<T, D>, 80,
                                           "flash_forward_v4 (cp.async, ldmatrix, mma.sync)");
    if (!error.empty()) return error;
    const std::size_t bytes = sizeof(TilesV4<T, D>);
    error = allow_shared_memory(flash_v4_kernel<T, D>, bytes, "flash_forward_v4");
    if (!error.empty()) return error;
    flash_v4_kernel<T, D><<<blocks, kThreads, bytes, stream>>>(
        static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<const T*>(a.v),
        static_cast<T*>(a.o), a.lse, band, static_cast<int>(p.heads),
        static_cast<int>(p.heads / p.kv_heads), p.scale * log2e);
    return launch_status("flash_forward_v4");
}

}  // namespace

// The checks against v4's line of the ladder (flash_ladder.h), the grid and the choice of the
// instance for the dtype and head width: launch_forward, flash_forward.cuh.
std::string flash_forward_v4(const FlashForwardArgs& a, cudaStream_t stream) {
    auto launch = [&](auto element, auto width, const Band& band, int blocks) {
        return launch_v4<decltype(element), decltype(width)::value>(a, band, blocks, stream);
    };
    return launch_forward<Rung::v4>(a, kBlockQ, launch);
}

}  // namespace refmath_cuda
