// Decode attention over a paged KV cache, split-K (FlashDecoding), in two kernels.
//
// At decode time each sequence has ONE new query per head and a long context: there are too few
// query rows to fill the GPU with one block per (sequence, head), and the work is reading the
// cache, not arithmetic. So the context is also cut: the `splits` parts of a sequence's tokens go
// to different blocks, each reduces its part to the partial softmax statistics (m, l, u) of its
// keys (F2), and a second kernel merges the parts (F3):
//
//     M = max_s m_s,   L = sum_s e^{m_s - M} l_s,   o = sum_s e^{m_s - M} u_s / L
//
// Kernel 1, one block per (sequence b, key/value head g, chunk of up to 8 query heads, split s).
// The block takes the query heads of g's GQA group (up to 8 of them), so every K/V element it
// loads serves all of them. It walks its tokens in 32-key tiles staged in shared memory.
//
// What changed from the previous version of this kernel, and why: it gave each warp two of the 8
// heads and all 32 keys of a tile, so each of the 4 warps read the whole K and V tile from shared
// memory (4 reads of every byte, and as many shuffles and exponentials per key as heads per warp).
// Now a tile is split across the warps instead (csrc/cuda/decode_layout.h): warp w takes keys
// 8w .. 8w + 7 of the tile for all 8 heads, so each K/V byte is read from shared memory once per
// block. Within a warp, the 4 lanes of a key each sum a quarter of its dot products (consecutive
// 32-bit words, two shuffles to add them), and lane c accumulates output columns c, c + 32, ...
// of the slice's P V. Each warp keeps its own running state (m, l, u) per head over the tiles;
// the 4 warps' states are merged once, at the end, through shared memory (F3, the same formula
// as the second kernel's merge of splits). What is left: the tile still goes through shared memory
// and a block barrier per tile; loading each warp's slice straight into registers (as vLLM's
// paged attention does) would drop both.
//
// Paging: token j of sequence b lives in physical page page_table[b, j / page_size], slot
// j % page_size, and the layout (n_pages, G, page_size, D) keeps the page_size x D keys of one
// head in one contiguous run. Each row of a 32-key tile is located once (locate_row: one thread per
// row does the page-table lookup, for the next tile while the current one is copied), then the
// block copies the tile in 16-byte pieces, consecutive threads on consecutive pieces of a row, every
// thread's loads issued before its stores (copy_tile_vectors; one element per lane where the rows
// are not 16-byte aligned, copy_tile_elements). Only slots below the length are
// read, so unused slots may hold anything (the tests fill them with NaN). A page id outside
// [0, n_pages) or a length outside [0, max_pages * page_size] is never dereferenced: it turns the
// sequence's output into NaN, so that a bad table shows up instead of reading stray memory.
//
// A contiguous cache (B, G, T_max, D) is the same layout with page_size = T_max and the page
// table [[0], [1], ..., [B - 1]]. Splits are runs of consecutive tokens (multiples of the tile),
// not of pages, so a contiguous cache splits as well as a paged one.
#include "attention_common.cuh"
#include "decode_layout.h"

namespace refmath_cuda {
namespace {

constexpr int kWarpsD = decode::kWarps;
constexpr int kThreadsD = decode::kThreads;
constexpr int kHeadsPerBlockD = decode::kHeads;  // 8 query heads per block
constexpr int kBlockKD = decode::kBlockK;        // 32 keys per tile
static_assert(kThreadsD == kWarpsD * kWarpSize, "decode_layout.h and the warp size agree");

template <typename T, int D_MAX>
struct DecodeLayout {
    static constexpr int kRowWords = D_MAX * static_cast<int>(sizeof(T)) / 4;  // 32-bit words per row
    // K rows padded by 16 bytes (decode_layout.h: bank-conflict-free score reads; rows stay
    // 16-byte aligned, so the copy stores 16 bytes at a time).
    static constexpr int kKStride = decode::k_stride_words(kRowWords) * 4 / static_cast<int>(sizeof(T));
    static constexpr std::size_t kQBytes = sizeof(float) * kHeadsPerBlockD * D_MAX;
    static constexpr std::size_t kKBytes = sizeof(T) * kBlockKD * kKStride;
    static constexpr std::size_t kVBytes = sizeof(T) * kBlockKD * D_MAX;
    static constexpr std::size_t kPBytes = sizeof(float) * kHeadsPerBlockD * kBlockKD;
    static constexpr std::size_t kBytes = kQBytes + kKBytes + kVBytes + kPBytes;
    // After the last tile the K/V area holds the warps' accumulators for the merge.
    static constexpr std::size_t kMergeBytes = sizeof(float) * kWarpsD * kHeadsPerBlockD * D_MAX;
    static_assert(kMergeBytes <= kKBytes + kVBytes, "the warps' states fit where the tiles were");
    static_assert(kRowWords % decode::kLanesPerKey == 0, "whole words per lane of a key");
    // Blocks per SM asked of ptxas (__launch_bounds__; 0: no request). Each lane holds u for all
    // 8 heads, 8 x D / 32 floats (32 at D = 128: 4 times the previous version's 2 heads per warp),
    // and registers, not shared memory, bound the blocks per SM. Left to itself ptxas picks the
    // register count by its own occupancy heuristic, and at D = 128 it spilled 4 bytes to reach
    // it (CUDA 13, sm_90); asked for 6 blocks (80 registers) it spills nothing. At D = 32, 10
    // blocks (48 registers: the ~10 per SM that kernels._auto_splits aims at) fit without a
    // spill; at D = 64 (72 registers, 7 blocks) and 256 (128, 4) its own choice is kept.
    static constexpr int kMinBlocks = D_MAX == 32 ? 10 : D_MAX == 128 ? 6 : 0;
};

struct PagedCache {
    const std::int32_t* page_table;
    const std::int32_t* lengths;
    int n_pages, page_size, max_pages, kv_heads;
};

// Element offset of token j's key row (head g of sequence b) in the pool: one page-table lookup,
// done by one thread per tile row and shared through shared memory, instead of by every lane that
// copies part of the row. kNoRow past the split's end t1, kBadPage for a page id outside
// [0, n_pages) (the block then poisons its output).
constexpr std::int64_t kNoRow = -1, kBadPage = -2;

__device__ inline std::int64_t locate_row(const PagedCache& cache, int b, int g, int head_dim, int j,
                                          int t1) {
    if (j >= t1) return kNoRow;
    const int page = cache.page_table[static_cast<std::int64_t>(b) * cache.max_pages + j / cache.page_size];
    if (page < 0 || page >= cache.n_pages) return kBadPage;
    return ((static_cast<std::int64_t>(page) * cache.kv_heads + g) * cache.page_size + j % cache.page_size) *
           head_dim;
}

// Copy the tile's 32 key and value rows into shared memory with 16-byte loads (head_dim a multiple
// of 16 / sizeof(T), the pools 16-byte aligned: the launcher checks). Piece i of the tile is
// decode::copy_piece(i): consecutive threads read consecutive pieces of a row, and a thread issues
// its loads before its stores, so that the block has the tile (up to 2 pieces of K and 2 of V per
// thread at a time: 8 KB per block) in flight instead of one row per warp.
template <typename T, int D_MAX, int K_STRIDE>
__device__ inline void copy_tile_vectors(T* __restrict__ k_s, T* __restrict__ v_s,
                                         const T* __restrict__ k_pages, const T* __restrict__ v_pages,
                                         const std::int64_t* at, int head_dim, int* poisoned) {
    constexpr int kVec = 16 / sizeof(T);                   // elements per 16-byte piece
    constexpr int kPerThread = decode::copy_rounds(D_MAX / kVec);  // at head_dim = D_MAX
    // K and V pieces loaded before the first store: two where a thread copies four or more (more
    // made ptxas spill at D = 128), one for the small tiles (two spilled at float32, D = 32).
    constexpr int kBatch = kPerThread >= 4 ? 2 : 1;
    const int pieces_per_row = head_dim / kVec;
    for (int i0 = 0; i0 < kPerThread; i0 += kBatch) {
        uint4 kx[kBatch], vx[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
            const decode::RowPiece rp = decode::copy_piece(threadIdx.x + (i0 + i) * kThreadsD, pieces_per_row);
            kx[i] = vx[i] = make_uint4(0, 0, 0, 0);
            if (rp.row < kBlockKD && at[rp.row] >= 0) {
                kx[i] = *reinterpret_cast<const uint4*>(k_pages + at[rp.row] + rp.piece * kVec);
                vx[i] = *reinterpret_cast<const uint4*>(v_pages + at[rp.row] + rp.piece * kVec);
            }
        }
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
            const decode::RowPiece rp = decode::copy_piece(threadIdx.x + (i0 + i) * kThreadsD, pieces_per_row);
            if (rp.row >= kBlockKD) continue;
            if (at[rp.row] == kBadPage && rp.piece == 0) atomicOr(poisoned, 1);
            *reinterpret_cast<uint4*>(k_s + rp.row * K_STRIDE + rp.piece * kVec) = kx[i];
            *reinterpret_cast<uint4*>(v_s + rp.row * D_MAX + rp.piece * kVec) = vx[i];
        }
    }
    // Columns head_dim .. D_MAX - 1 are read by the score and P V loops: zeros.
    for (int idx = threadIdx.x; idx < kBlockKD * (D_MAX - head_dim); idx += kThreadsD) {
        const int r = idx / (D_MAX - head_dim), c = head_dim + idx % (D_MAX - head_dim);
        k_s[r * K_STRIDE + c] = v_s[r * D_MAX + c] = from_float<T>(0.0f);
    }
}

// The same copy one element at a time, for any head_dim and alignment; warp w copies rows w, w + 4,
// ..., the row's elements on consecutive lanes.
template <typename T, int D_MAX, int K_STRIDE>
__device__ inline void copy_tile_elements(T* k_s, T* v_s, const T* k_pages, const T* v_pages,
                                          const std::int64_t* at, int head_dim, int* poisoned) {
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    for (int r = warp; r < kBlockKD; r += kWarpsD) {
        const std::int64_t row = at[r];
        if (row == kBadPage && lane == 0) atomicOr(poisoned, 1);
        for (int c = lane; c < D_MAX; c += kWarpSize) {
            T kx = from_float<T>(0.0f), vx = kx;
            if (row >= 0 && c < head_dim) {
                kx = k_pages[row + c];
                vx = v_pages[row + c];
            }
            k_s[r * K_STRIDE + c] = kx;
            v_s[r * D_MAX + c] = vx;
        }
    }
}

// One 32-bit word of a K row as floats: 2 columns of a 16-bit type, 1 of float32.
__device__ inline float2 word_to_float2(std::uint32_t w, const __half*) {
    __half2 h;
    memcpy(&h, &w, sizeof(h));
    return __half22float2(h);
}
__device__ inline float2 word_to_float2(std::uint32_t w, const __nv_bfloat16*) {
    __nv_bfloat162 h;
    memcpy(&h, &w, sizeof(h));
    return __bfloat1622float2(h);
}

// Sum of the kLanesPerKey partial dot products of a key (every lane of the group gets the same
// sum: each adds the same terms, and float addition is commutative), and the maximum and sum over
// the keys of the warp's slice (lanes kLanesPerKey apart; the lanes of a group hold equal values).
__device__ inline float key_sum(float x) {
    for (int offset = 1; offset < decode::kLanesPerKey; offset *= 2)
        x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}
__device__ inline float slice_max(float x) {  // NaN if any key's x is NaN
    for (int offset = decode::kLanesPerKey; offset < kWarpSize; offset *= 2)
        x = nan_max(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}
__device__ inline float slice_sum(float x) {
    for (int offset = decode::kLanesPerKey; offset < kWarpSize; offset *= 2)
        x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

template <typename T, int D_MAX>
__global__ void __launch_bounds__(kThreadsD, DecodeLayout<T, D_MAX>::kMinBlocks)
decode_split_kernel(const T* __restrict__ q, const T* __restrict__ k_pages,
                    const T* __restrict__ v_pages, PagedCache cache, float* __restrict__ workspace,
                    int heads, int group, int head_dim, int splits, int head_chunks, float scale,
                    bool vector_loads) {
    using L = DecodeLayout<T, D_MAX>;
    constexpr int kCols = D_MAX / kWarpSize;        // P V columns per lane
    constexpr int kWords = decode::score_words_per_lane(L::kRowWords);  // K words per lane
    constexpr int kH = kHeadsPerBlockD;
    extern __shared__ __align__(16) unsigned char smem[];
    float* q_s = reinterpret_cast<float*>(smem);                                          // [8][D_MAX]
    T* k_s = reinterpret_cast<T*>(smem + L::kQBytes);                                     // [32][kKStride]
    T* v_s = reinterpret_cast<T*>(smem + L::kQBytes + L::kKBytes);                        // [32][D_MAX]
    float* p_s = reinterpret_cast<float*>(smem + L::kQBytes + L::kKBytes + L::kVBytes);  // [8][32]
    __shared__ int poisoned;
    __shared__ std::int64_t row_at[2][kBlockKD];  // element offset of each tile row (see locate_row)
    // Each warp's running m and l per head. They are the same in every lane of the warp, so they
    // live here rather than in 16 registers of every lane (registers bound this kernel's blocks
    // per SM); the merge at the end reads them from here too.
    __shared__ float m_s[kWarpsD][kH], l_s[kWarpsD][kH];

    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    int rest = blockIdx.x;
    const int split = rest % splits;
    rest /= splits;
    const int chunk = rest % head_chunks;
    rest /= head_chunks;
    const int g = rest % cache.kv_heads, b = rest / cache.kv_heads;
    const int h0 = g * group + chunk * kH;           // first query head of the block
    const int n_rows = imin(kH, group - chunk * kH);

    int length = cache.lengths[b];
    const int capacity = cache.max_pages * cache.page_size;  // <= 2**30, checked by the launcher
    if (threadIdx.x == 0) poisoned = length < 0 || length > capacity;
    if (length < 0 || length > capacity) length = 0;
    // This split's tokens [t0, t1): equal runs, rounded up to whole tiles.
    const int run = ceil_div(ceil_div(length, splits), kBlockKD) * kBlockKD;
    const int t0 = imin(split * run, length), t1 = imin(t0 + run, length);

    const T* q_block = q + (static_cast<std::int64_t>(b) * heads + h0) * head_dim;
    for (int idx = threadIdx.x; idx < kH * D_MAX; idx += kThreadsD) {
        const int r = idx / D_MAX, c = idx % D_MAX;
        q_s[idx] = (r < n_rows && c < head_dim) ? to_float(q_block[r * head_dim + c]) * scale : 0.0f;
    }

    // This warp's running state for every head of the block, over the keys of its slices of all
    // the tiles so far: m and l in m_s, l_s, and the lane's columns of u here.
    float acc[kH][kCols];
#pragma unroll
    for (int h = 0; h < kH; ++h)
#pragma unroll
        for (int cc = 0; cc < kCols; ++cc) acc[h][cc] = 0.0f;
    if (lane < kH) {  // seen by the warp after the loop's first barrier
        m_s[warp][lane] = -INFINITY;
        l_s[warp][lane] = 0.0f;
    }
    // The tile row this lane scores (a quarter of it: words score_word(lane, 0..kWords - 1)).
    const int my_key = decode::slice_begin(warp, kBlockKD) + decode::lane_key(lane);
    const std::uint32_t* k_words = reinterpret_cast<const std::uint32_t*>(k_s + my_key * L::kKStride);

    // Where the rows of the first tile are (row_at[0]); each tile then locates the next one's.
    if (threadIdx.x < kBlockKD) row_at[0][threadIdx.x] = locate_row(cache, b, g, head_dim, t0 + threadIdx.x, t1);
    int buffer = 0;
    for (int j0 = t0; j0 < t1; j0 += kBlockKD, buffer ^= 1) {
        __syncthreads();  // the previous tile is no longer read; row_at[buffer] (and q_s) written
        // Threads 0-31 locate the next tile's rows while every thread copies this one.
        if (threadIdx.x < kBlockKD)
            row_at[buffer ^ 1][threadIdx.x] = locate_row(cache, b, g, head_dim, j0 + kBlockKD + threadIdx.x, t1);
        const std::int64_t* at = row_at[buffer];
        if (vector_loads)
            copy_tile_vectors<T, D_MAX, L::kKStride>(k_s, v_s, k_pages, v_pages, at, head_dim, &poisoned);
        else
            copy_tile_elements<T, D_MAX, L::kKStride>(k_s, v_s, k_pages, v_pages, at, head_dim, &poisoned);
        __syncthreads();

        // Scores of key my_key against every head: this lane's quarter of each dot product.
        float s[kH];
#pragma unroll
        for (int h = 0; h < kH; ++h) s[h] = 0.0f;
#pragma unroll 4
        for (int i = 0; i < kWords; ++i) {
            const int w = decode::score_word(lane, i);
            if constexpr (sizeof(T) == 4) {
                const float kc = __uint_as_float(k_words[w]);
#pragma unroll
                for (int h = 0; h < kH; ++h) s[h] += q_s[h * D_MAX + w] * kc;
            } else {
                const float2 kc = word_to_float2(k_words[w], k_s);
#pragma unroll
                for (int h = 0; h < kH; ++h) {
                    const float2 qc = *reinterpret_cast<const float2*>(q_s + h * D_MAX + 2 * w);
                    s[h] += qc.x * kc.x + qc.y * kc.y;
                }
            }
        }

        // Online softmax over the warp's slice (F2, F3), head by head.
        const int n = imin(t1 - j0, kBlockKD);  // valid keys (the split's last tile may end mid-slice)
        const bool valid = my_key < decode::slice_end(warp, n);
#pragma unroll
        for (int h = 0; h < kH; ++h) {
            const float m_old = m_s[warp][h];
            const float score = valid ? key_sum(s[h]) : -INFINITY;
            const float m_new = nan_max(m_old, slice_max(score));  // NaN in, NaN out
            float p = 0.0f;
            if (m_new != -INFINITY) {  // the same in every lane of the warp
                const float correction = expf(m_old - m_new);
                p = expf(score - m_new);
                const float l_new = l_s[warp][h] * correction + slice_sum(p);
#pragma unroll
                for (int cc = 0; cc < kCols; ++cc) acc[h][cc] *= correction;
                __syncwarp();  // every lane has read m_old and l before lane 0 replaces them
                if (lane == 0) {
                    m_s[warp][h] = m_new;
                    l_s[warp][h] = l_new;
                }
            }
            if (decode::lane_part(lane) == 0) p_s[h * kBlockKD + my_key] = p;
        }
        __syncwarp();  // the warp reads back only its own slice of p_s

        // u += P V over the slice's valid rows: each V row of the tile is read by one warp.
        const int r_end = decode::slice_end(warp, n);
        for (int r = decode::slice_begin(warp, n); r < r_end; ++r) {
            float vj[kCols];
#pragma unroll
            for (int cc = 0; cc < kCols; ++cc) vj[cc] = to_float(v_s[r * D_MAX + decode::pv_column(lane, cc)]);
#pragma unroll
            for (int h = 0; h < kH; ++h) {
                const float p = p_s[h * kBlockKD + r];
#pragma unroll
                for (int cc = 0; cc < kCols; ++cc) acc[h][cc] += p * vj[cc];
            }
        }
    }
    __syncthreads();  // `poisoned` is final, and no warp reads the tiles any more

    // Merge the 4 warps' states (F3) through shared memory, where the K/V tiles were.
    float* u_s = reinterpret_cast<float*>(smem + L::kQBytes);  // [kWarps][kH][D_MAX]
#pragma unroll
    for (int h = 0; h < kH; ++h)
#pragma unroll
        for (int cc = 0; cc < kCols; ++cc)
            u_s[(warp * kH + h) * D_MAX + decode::pv_column(lane, cc)] = acc[h][cc];
    __syncthreads();
    const bool bad = poisoned != 0;

    // The partial state of this split, unnormalised: (m, l, u) for each of the block's heads.
    for (int i = threadIdx.x; i < n_rows * head_dim; i += kThreadsD) {
        const decode::HeadColumn hc = decode::merge_item(i, head_dim);
        float big_m = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarpsD; ++w) big_m = nan_max(big_m, m_s[w][hc.head]);
        float big_l = 0.0f, u = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarpsD; ++w) {
            // exp(m_w - M); 0 for every warp when none saw a key (M = -inf), NaN when M is NaN
            const float weight = big_m == -INFINITY ? 0.0f : expf(m_s[w][hc.head] - big_m);
            big_l += weight * l_s[w][hc.head];
            u += weight * u_s[(w * kH + hc.head) * D_MAX + hc.column];
        }
        float* part = workspace +
                      ((static_cast<std::int64_t>(b) * heads + h0 + hc.head) * splits + split) * (head_dim + 2);
        if (hc.column == 0) {
            part[0] = bad ? 0.0f : big_m;
            part[1] = bad ? NAN : big_l;
        }
        part[2 + hc.column] = bad ? NAN : u;
    }
}

// Kernel 2: merge the splits of each (sequence, head) with F3; one warp per (b, h).
template <typename T>
__global__ void __launch_bounds__(kThreadsD)
decode_merge_kernel(const float* __restrict__ workspace, T* __restrict__ o, std::int64_t rows,
                    int head_dim, int splits) {
    const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsD + threadIdx.x / kWarpSize;
    if (row >= rows) return;  // whole warps leave; there is no block barrier
    const int lane = threadIdx.x % kWarpSize;
    const int width = head_dim + 2;
    const float* parts = workspace + row * splits * width;

    float big_m = -INFINITY;
    // nan_max, not fmaxf: a split whose keys held a NaN has m = NaN, and fmaxf would drop it
    // (with one split, M = -inf would then give o = 0 instead of NaN).
    for (int s = 0; s < splits; ++s) big_m = nan_max(big_m, parts[s * width]);
    // exp(m_s - M) for each split; 0 for all of them when no split saw a key (M = -inf).
    auto weight = [&](int s) { return big_m == -INFINITY ? 0.0f : expf(parts[s * width] - big_m); };
    float big_l = 0.0f;
    for (int s = 0; s < splits; ++s) big_l += weight(s) * parts[s * width + 1];
    for (int c = lane; c < head_dim; c += kWarpSize) {
        float u = 0.0f;
        for (int s = 0; s < splits; ++s) u += weight(s) * parts[s * width + 2 + c];
        // An empty context gives 0; a poisoned one (L = NaN) gives NaN.
        o[row * head_dim + c] = from_float<T>(big_l == 0.0f ? 0.0f : u / big_l);
    }
}

template <typename T, int D_MAX>
std::string launch_decode(const DecodeArgs& a, int head_chunks, cudaStream_t stream) {
    auto* kernel = decode_split_kernel<T, D_MAX>;
    const std::size_t bytes = DecodeLayout<T, D_MAX>::kBytes;
    std::string error = allow_shared_memory(kernel, bytes, "paged_decode");
    if (!error.empty()) return error;
    const PagedCache cache{a.page_table, a.lengths, static_cast<int>(a.n_pages),
                           static_cast<int>(a.page_size), static_cast<int>(a.max_pages),
                           static_cast<int>(a.kv_heads)};
    const std::int64_t blocks = a.batch * a.kv_heads * head_chunks * a.splits;
    // 16-byte copies need rows that start on 16 bytes: head_dim a multiple of 16 / sizeof(T) and
    // aligned pools (a CuPy allocation is; a view at an offset may not be).
    const bool vector_loads = a.head_dim % (16 / sizeof(T)) == 0 && aligned16(a.k_pages) &&
                              aligned16(a.v_pages);
    kernel<<<static_cast<int>(blocks), kThreadsD, bytes, stream>>>(
        static_cast<const T*>(a.q), static_cast<const T*>(a.k_pages),
        static_cast<const T*>(a.v_pages), cache, a.workspace, static_cast<int>(a.heads),
        static_cast<int>(a.heads / a.kv_heads), static_cast<int>(a.head_dim), static_cast<int>(a.splits),
        head_chunks, a.scale, vector_loads);
    error = launch_status("paged_decode (splits)");
    if (!error.empty()) return error;
    const std::int64_t rows = a.batch * a.heads;
    decode_merge_kernel<T><<<static_cast<int>((rows + kWarpsD - 1) / kWarpsD), kThreadsD, 0, stream>>>(
        a.workspace, static_cast<T*>(a.o), rows, static_cast<int>(a.head_dim), static_cast<int>(a.splits));
    return launch_status("paged_decode (merge)");
}

template <typename T>
std::string launch_decode_dim(const DecodeArgs& a, int head_chunks, cudaStream_t s) {
    if (a.head_dim <= 32) return launch_decode<T, 32>(a, head_chunks, s);
    if (a.head_dim <= 64) return launch_decode<T, 64>(a, head_chunks, s);
    if (a.head_dim <= 128) return launch_decode<T, 128>(a, head_chunks, s);
    return launch_decode<T, 256>(a, head_chunks, s);
}

}  // namespace

std::string paged_decode(const DecodeArgs& a, cudaStream_t stream) {
    auto num = [](std::int64_t x) { return std::to_string(x); };
    const std::string name = "paged_decode: ";
    if (a.batch < 0 || a.heads < 0 || a.kv_heads < 0 || a.n_pages < 0 || a.max_pages < 0)
        return name + "sizes must be non-negative, got B=" + num(a.batch) + " H=" + num(a.heads) +
               " G=" + num(a.kv_heads) + " n_pages=" + num(a.n_pages) + " max_pages=" + num(a.max_pages);
    const std::string counts = check_counts(a.batch, a.heads, a.kv_heads);
    if (!counts.empty()) return name + counts;
    // G >= 1 even when H = 0, as in check_problem: H / G is taken on the host below.
    if (a.kv_heads < 1 || a.heads % a.kv_heads != 0)
        return name + "the key/value heads G=" + num(a.kv_heads) + " must be >= 1 and divide the "
               "query heads H=" + num(a.heads);
    if (a.head_dim < 1 || a.head_dim > kMaxHeadDim)
        return name + "head width D=" + num(a.head_dim) + " is outside [1, " + num(kMaxHeadDim) + "]";
    if (a.page_size < 1 || a.page_size > kMaxSequence)
        return name + "page_size must be in [1, 2**30], got " + num(a.page_size);
    if (a.max_pages > kMaxSequence / a.page_size || a.n_pages > INT_MAX)
        return name + "max_pages * page_size = " + num(a.max_pages) + " * " + num(a.page_size) +
               " must be at most 2**30 (and n_pages below 2**31)";
    if (a.splits < 1 || a.splits > kMaxDecodeSplits)
        return name + "splits must be in [1, " + num(kMaxDecodeSplits) + "], got " + num(a.splits);
    if (!std::isfinite(a.scale)) return name + "scale must be finite";
    if (a.dtype != kFloat32 && a.dtype != kFloat16 && a.dtype != kBFloat16)
        return name + "dtype must be float32, float16 or bfloat16, got " + dtype_name(a.dtype);
    const std::int64_t rows = a.batch * a.heads;
    if (rows == 0) return "";
    if (!a.q || !a.o || !a.lengths || !a.workspace || (a.max_pages > 0 && !a.page_table) ||
        (a.n_pages > 0 && (!a.k_pages || !a.v_pages)))
        return name + "a null pointer for a non-empty array";
    const std::int64_t group = a.heads / a.kv_heads;
    const int head_chunks = static_cast<int>((group + kHeadsPerBlockD - 1) / kHeadsPerBlockD);
    std::string error = check_grid(a.batch * a.kv_heads * head_chunks * a.splits, "paged_decode (splits)");
    if (error.empty()) error = check_grid((rows + kWarpsD - 1) / kWarpsD, "paged_decode (merge)");
    if (!error.empty()) return error;
    switch (a.dtype) {
        case kFloat32: return launch_decode_dim<float>(a, head_chunks, stream);
        case kFloat16: return launch_decode_dim<__half>(a, head_chunks, stream);
        default: return launch_decode_dim<__nv_bfloat16>(a, head_chunks, stream);
    }
}

}  // namespace refmath_cuda
