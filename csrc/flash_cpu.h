// FlashAttention on the CPU (catalogue F1-F5, A10, A12): the plain C++ interface that bindings.cpp
// wraps. Free of pybind11 and Python.
#pragma once

#include <cstddef>

namespace refmath {

// Sizes and options of one attention call. q is (batch, heads, t_q, head_dim), k and v are
// (batch, kv_heads, t_k, head_dim), all float32 and C-contiguous; kv_heads divides heads, and query
// head r reads key/value head r / (heads / kv_heads) (GQA, A10). Query i sits at key position
// i + t_k - t_q. causal: key j is visible iff j <= that position; window w > 0: also only the last
// w keys up to it (A12; a window implies causal). window = 0 means no window.
struct AttentionShape {
    std::ptrdiff_t batch = 0, heads = 0, kv_heads = 0, t_q = 0, t_k = 0, head_dim = 0;
    bool causal = false;
    std::ptrdiff_t window = 0;
    float scale = 1.0f;  // multiplies q . k
};

// Throws std::invalid_argument unless every size is usable (non-negative, kv_heads >= 1 dividing
// heads, head_dim >= 1, window >= 0, scale finite). The kernels below call it first.
void check_attention_shape(const AttentionShape& shape);

// o (like q) and lse (batch, heads, t_q): o = softmax(scale q k^T + mask) v, lse the log of each
// row's softmax normaliser. A row with no visible key gets o = 0 and lse = -inf.
void flash_forward_cpu(const AttentionShape& shape, const float* q, const float* k, const float* v,
                       float* o, float* lse);

// dq, dk, dv (shaped like q, k, v) from dout = dL/do and the forward's o and lse (FlashAttention-2:
// each tile's weights are recomputed from lse, nothing of size t_q x t_k is stored).
void flash_backward_cpu(const AttentionShape& shape, const float* dout, const float* q,
                        const float* k, const float* v, const float* o, const float* lse, float* dq,
                        float* dk, float* dv);

// Which schedule flash_backward_cpu uses: 0 chooses by the work and the thread count (the
// default), 1 forces the one-pass schedule, 2 the two-pass one (see flash_cpu.cpp). Both give the
// same bits; tests use this to check that. Throws std::invalid_argument for any other value.
void set_backward_schedule(int schedule);

}  // namespace refmath
