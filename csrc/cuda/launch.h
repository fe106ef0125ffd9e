// Host-side launchers for the CUDA kernels: plain C++ declarations.
//
// bindings.cpp (compiled by the host compiler, with pybind11) includes this header; the .cu files
// (compiled by nvcc, without pybind11) define it. Keeping pybind11 out of nvcc's way avoids a
// whole class of front-end incompatibilities and keeps the .cu files about the GPU only.
//
// The attention launchers check every argument they can check on the host (sizes, the head
// grouping, the dtype, alignment, the grid and shared-memory limits) and return an error message,
// or an empty string once the kernels are queued. They never throw and never launch on bad input.
// They cannot look at device memory: refmath/kernels.py checks page tables and lengths before any
// pointer gets here, and the decode kernel poisons its output with NaN rather than read out of
// bounds if an invalid page id or length slips through.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace refmath_cuda {

// Element types the launchers accept; the Python side passes these codes.
enum DType : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

inline const char* dtype_name(DType dtype) {
    switch (dtype) {
        case kFloat32: return "float32";
        case kFloat64: return "float64";
        case kFloat16: return "float16";
        case kBFloat16: return "bfloat16";
    }
    return "an unknown dtype code";
}

// out[r, :] = softmax(in[r, :]) for `rows` rows of `cols` contiguous values, on `stream`.
// Fully masked rows (all -inf) give zeros. Returns the launch status (cudaSuccess if queued);
// errors during the kernel's run surface at the next synchronising call, as usual in CUDA.
cudaError_t softmax_rows(const void* in, void* out, std::int64_t rows, std::int64_t cols,
                         DType dtype, cudaStream_t stream);

// ---- FlashAttention ----
//
// q (B, H, T_q, D), k and v (B, G, T_k, D), o like q, lse (B, H, T_q) float32; all C-contiguous.
// Query head h reads key/value head h / (H / G). Query i sits at key position i + T_k - T_q.
// causal: key j is visible iff j <= that position; window w > 0: iff it is within the last w keys
// up to that position (a window implies causal). A query that sees no key gets o = 0, lse = -inf.
// The names are those of the CPU kernels (csrc/flash_cpu.h's AttentionShape, the Band of
// flash_cpu.cpp and attention_common.cuh) and of refmath/flash.py: head_dim for D; first_key(i) and
// end_key(i) for the keys [first, end) query i sees; keys_seen_by and queries_seeing for the
// unions over a tile. Sequence lengths are int32 in every compiled kernel.
struct AttentionProblem {
    std::int64_t batch = 0, heads = 0, kv_heads = 0, t_q = 0, t_k = 0, head_dim = 0;
    bool causal = false;
    std::int64_t window = 0;  // 0: no window
    float scale = 1.0f;       // multiplies q . k (usually 1 / sqrt(D))
    DType dtype = kFloat32;
};

struct FlashForwardArgs {
    AttentionProblem problem;
    const void* q = nullptr;
    const void* k = nullptr;
    const void* v = nullptr;
    void* o = nullptr;      // same dtype as q
    float* lse = nullptr;   // natural-log logsumexp of the scaled scores, per query row
};

// The forward ladder's launchers, flash_forward_<name> for each rung, are declared by the table of
// its rungs, flash_ladder.h (one line a rung: its name, what it takes and needs, what it adds).

// The backward pass, FlashAttention-2 style, in float32: problem.dtype must be kFloat32 and every
// array float32. do_ and o are (B, H, T_q, D); lse (B, H, T_q) from the forward; dq, dk, dv have
// the shapes of q, k, v; delta is a (B, H, T_q) float32 workspace. D <= 256.
struct FlashBackwardArgs {
    AttentionProblem problem;
    const float* q = nullptr;
    const float* k = nullptr;
    const float* v = nullptr;
    const float* o = nullptr;
    const float* lse = nullptr;
    const float* dout = nullptr;
    float* dq = nullptr;
    float* dk = nullptr;
    float* dv = nullptr;
    float* delta = nullptr;
};

std::string flash_backward(const FlashBackwardArgs& args, cudaStream_t stream);

// ---- decode: one new query per sequence against a paged KV cache ----
//
// q (B, H, D); k_pages and v_pages (n_pages, G, page_size, D), the layout of
// refmath.inference.paged.PagedKVCache; page_table int32 (B, max_pages), row b the physical
// pages of sequence b in logical order; lengths int32 (B,). Token j of sequence b lives in page
// page_table[b, j / page_size] at slot j % page_size. o (B, H, D) in q's dtype. The context is cut
// into `splits` runs of consecutive tokens (split-K); each writes partial softmax statistics
// (m, l, u) into workspace, float32 (B, H, splits, D + 2), and a second kernel merges them (F3).
// A contiguous cache (B, G, T_max, D) is this layout with page_size = T_max and page_table[b] = b.
struct DecodeArgs {
    std::int64_t batch = 0, heads = 0, kv_heads = 0, head_dim = 0;
    std::int64_t n_pages = 0, page_size = 0, max_pages = 0;
    std::int64_t splits = 1;
    float scale = 1.0f;
    DType dtype = kFloat32;
    const void* q = nullptr;
    const void* k_pages = nullptr;
    const void* v_pages = nullptr;
    const std::int32_t* page_table = nullptr;
    const std::int32_t* lengths = nullptr;
    float* workspace = nullptr;
    void* o = nullptr;
};

// float32, float16, bfloat16; any D <= 256; 1 <= splits <= kMaxDecodeSplits.
constexpr std::int64_t kMaxDecodeSplits = 1024;
std::string paged_decode(const DecodeArgs& args, cudaStream_t stream);

}  // namespace refmath_cuda
