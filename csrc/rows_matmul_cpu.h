// A few rows times large matrices, y = x W, for decoding: the plain C++ interface that
// bindings.cpp wraps. Free of pybind11 and Python.
//
// At batch 1 a decode step multiplies one row by every weight matrix of the model, two FLOPs per
// weight read: the time is the time to stream the weights from memory. This kernel streams them
// on refmath's own threads, each reading contiguous stretches of every matrix, so that a decode
// step's products and its attention run on one set of threads rather than two (refmath's and a
// BLAS library's, each spinning for a while after its last call).
#pragma once

#include <cstddef>

namespace refmath {

// One product of a call: the matrix w and the output y (m, n) it gives, float32, C-contiguous.
//   transposed = false: w is (k, n) and y = x w    (a projection's weight, catalogue N5)
//   transposed = true:  w is (n, k) and y = x w^T  (a tied head reading the embedding table, M2)
struct RowsProduct {
    const float* w;
    std::ptrdiff_t n;
    bool transposed;
    float* y;
};

// x is (m, k), float32, C-contiguous; every product in 'products' multiplies the same x. The
// products' outputs must not overlap x, w or each other (the caller checks). Each output is a
// float32 sum over k; at most 'threads' threads share the work. For w not transposed (OpenMP
// threads) the sum is cut into one stretch of k per thread, added in thread order, so its last bits
// depend on the thread count. When every product is transposed, the outputs are the pieces of a
// piece team (piece_team.h), each summed by one thread over all of k: the same bits on any count.
void rows_matmul_cpu(const float* x, std::ptrdiff_t m, std::ptrdiff_t k, const RowsProduct* products,
                     std::ptrdiff_t count, int threads);

}  // namespace refmath
