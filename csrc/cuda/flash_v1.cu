// FlashAttention forward, version 1: one thread per query row.
//
// The plainest kernel that never builds the T_q x T_k score matrix. Each thread owns one query
// row: it holds q (pre-multiplied by the scale) and its output accumulator in registers and walks
// the keys it may see one at a time, keeping the online-softmax state (m, l, u) of catalogue F3 with
// a block of a single key:
//
//     s = q . k_j,   m' = max(m, s),   l' = e^{m - m'} l + e^{s - m'},   u' = e^{m - m'} u + e^{s - m'} v_j
//
// and at the end o = u / l, lse = m + log l (F1). Nothing is shared between threads, so there is
// no shared memory and no synchronisation, which makes this the reference the later versions are
// read against.
//
// Why it is slow: every thread reads every key and value row it sees from global memory, so a
// K/V element is fetched once per query row that uses it (the 32 threads of a warp read the same
// row at the same time, which the L1 cache turns into one transaction, but different warps fetch
// it again); each key costs two exponentials; and for D = 128 the two register arrays (q and u,
// 256 floats) exceed the 255 registers a thread may have, so part of them lives in (cached) local
// memory. That spill is the lesson, not an accident: benchmarks/ptxas_spills.sh lists it (D_MAX =
// 128 and 256) as its one allowed spill, with this reason.
// Version 2 stages K/V tiles in shared memory and shares them between a block of query rows.
#include "flash_forward.cuh"

namespace refmath_cuda {
namespace {

constexpr int kThreadsV1 = 128;  // query rows per block

template <typename T, int D_MAX>
__global__ void __launch_bounds__(kThreadsV1)
flash_v1_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                T* __restrict__ o, float* __restrict__ lse, Band band, int heads, int group,
                int head_dim, float scale) {
    // Blocks are numbered (batch * heads + head) * row_blocks + row_block.
    const int row_blocks = ceil_div(band.t_q, kThreadsV1);
    const int bh = blockIdx.x / row_blocks;  // batch * heads + head
    const int i = (blockIdx.x % row_blocks) * kThreadsV1 + threadIdx.x;
    if (i >= band.t_q) return;  // no barrier in this kernel, so a thread may leave early
    const int b = bh / heads, h = bh % heads;
    const int kv_head = h / group;  // GQA: `group` query heads share one key/value head
    const int kv_heads = heads / group;

    const std::int64_t row = static_cast<std::int64_t>(bh) * band.t_q + i;
    const T* q_row = q + row * head_dim;
    const std::int64_t kv_offset = (static_cast<std::int64_t>(b) * kv_heads + kv_head) * band.t_k * head_dim;
    const T* k_head = k + kv_offset;
    const T* v_head = v + kv_offset;

    // Loops over c < D_MAX are unrolled, so q_reg[c] and acc[c] are registers; c >= head_dim is skipped.
    float q_reg[D_MAX], acc[D_MAX];
#pragma unroll
    for (int c = 0; c < D_MAX; ++c) {
        q_reg[c] = c < head_dim ? to_float(q_row[c]) * scale : 0.0f;
        acc[c] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;

    for (int j = band.first_key(i); j < band.end_key(i); ++j) {
        const T* k_row = k_head + static_cast<std::int64_t>(j) * head_dim;
        const T* v_row = v_head + static_cast<std::int64_t>(j) * head_dim;
        float s = 0.0f;
#pragma unroll
        for (int c = 0; c < D_MAX; ++c)
            if (c < head_dim) s += q_reg[c] * to_float(k_row[c]);
        // F3 with a one-key block: rescale what was summed against the old maximum.
        const float m_new = nan_max(m, s);  // a NaN score makes the row NaN
        const float correction = expf(m - m_new);  // 0 on the first key, when m = -inf
        const float p = expf(s - m_new);
        l = l * correction + p;
#pragma unroll
        for (int c = 0; c < D_MAX; ++c)
            if (c < head_dim) acc[c] = acc[c] * correction + p * to_float(v_row[c]);
        m = m_new;
    }

    // F1. A row that saw no key keeps l = 0: its output is 0 and its logsumexp -inf. (l is NaN
    // after a NaN score, and o and lse are NaN then.)
    const float inv_l = l != 0.0f ? 1.0f / l : 0.0f;
    T* o_row = o + row * head_dim;
#pragma unroll
    for (int c = 0; c < D_MAX; ++c)
        if (c < head_dim) o_row[c] = from_float<T>(acc[c] * inv_l);
    lse[row] = l != 0.0f ? m + logf(l) : -INFINITY;
}

template <typename T, int D_MAX>
std::string launch_v1(const FlashForwardArgs& a, const Band& band, int blocks, cudaStream_t stream) {
    const AttentionProblem& p = a.problem;
    flash_v1_kernel<T, D_MAX><<<blocks, kThreadsV1, 0, stream>>>(
        static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<const T*>(a.v),
        static_cast<T*>(a.o), a.lse, band, static_cast<int>(p.heads),
        static_cast<int>(p.heads / p.kv_heads), static_cast<int>(p.head_dim), p.scale);
    return launch_status("flash_forward_v1");
}

}  // namespace

// The checks against v1's line of the ladder (flash_ladder.h), the grid and the choice of the
// instance for the dtype and head width: launch_forward, flash_forward.cuh.
std::string flash_forward_v1(const FlashForwardArgs& a, cudaStream_t stream) {
    auto launch = [&](auto element, auto width, const Band& band, int blocks) {
        return launch_v1<decltype(element), decltype(width)::value>(a, band, blocks, stream);
    };
    return launch_forward<Rung::v1>(a, kThreadsV1, launch);
}

}  // namespace refmath_cuda
