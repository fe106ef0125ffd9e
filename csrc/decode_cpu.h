// One decode step on the CPU, over a contiguous or a paged KV cache (catalogue K10, F3, A10): the
// plain C++ interface that bindings.cpp wraps. Free of pybind11 and Python.
#pragma once

#include <cstddef>
#include <cstdint>

namespace refmath {

// q is (batch, heads, head_dim): one query per sequence and head. kv_heads divides heads; query
// head r reads key/value head r / (heads / kv_heads). Sequence b attends to its lengths[b] keys
// (a length of 0 gives o = 0). splits: how many chunks each sequence's context is cut into, each
// chunk reduced by its own thread and the partial results merged by the online-softmax rule (F3);
// 0 chooses (see choose_splits in decode_cpu.cpp).
struct DecodeShape {
    std::ptrdiff_t batch = 0, heads = 0, kv_heads = 0, head_dim = 0;
    float scale = 1.0f;
    std::ptrdiff_t splits = 0;
};

// Caches (batch, kv_heads, t_max, head_dim), float32, C-contiguous; 0 <= lengths[b] <= t_max.
// Throws std::invalid_argument (before any work) on a bad size or length.
void decode_cpu(const DecodeShape& shape, const float* q, const float* k_cache,
                const float* v_cache, std::ptrdiff_t t_max, const std::int32_t* lengths, float* o);

// Pages (n_pages, kv_heads, page_size, head_dim), the layout of refmath.inference.paged; token j of
// sequence b is in slot j % page_size of page page_table[b, j / page_size] (page_table is
// (batch, max_pages), row-major). Only the entries that a length needs are read, and only the
// filled slots of each page. Throws std::invalid_argument (before any work) on a bad size, a length
// outside [0, max_pages * page_size] or a needed page id outside [0, n_pages).
void paged_decode_cpu(const DecodeShape& shape, const float* q, const float* k_pages,
                      const float* v_pages, std::ptrdiff_t n_pages, std::ptrdiff_t page_size,
                      const std::int32_t* page_table, std::ptrdiff_t max_pages,
                      const std::int32_t* lengths, float* o);

}  // namespace refmath
