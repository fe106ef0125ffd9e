// A few float32 rows times a weight matrix stored in fewer bytes than float32: bfloat16, float16,
// or llama.cpp's Q8_0 blocks. The plain C++ interface that bindings.cpp wraps; the formats, their
// rounding and the error bounds are in refmath/weight_formats.py (catalogue W1, W2).
//
// The matrix is (n, k): n outputs, each a row of k weights along the inputs (a Linear's weight,
// the decode layout's rows of W^T), so every output is one dot product that reads its row once.
// Each stored weight is decoded to the float32 it stands for, exactly (a bfloat16 or float16 is a
// float32 with fewer bits; a Q8_0 block's codes q are integers of at most 127 in size and its
// scale d a float16), and the products are summed in float32: the result is a float32 product of
// the dequantised matrix. A Q8_0 block enters as d times the sum of its q x, which rounds each
// term d q x once more than scaling each weight first, within the same bound (refmath's
// product_error_bound, gamma_k |x| |W~|^T).
#pragma once

#include <cstddef>
#include <cstdint>

namespace refmath {

enum class WeightFormat { bf16, f16, q8_0 };

// Q8_0: 32 weights a block, stored as one float16 scale d (2 bytes, little-endian) and 32 int8
// codes q, 34 bytes in all; weight i of the block is q[i] * d.
constexpr std::ptrdiff_t kQ8Block = 32;
constexpr std::ptrdiff_t kQ8BlockBytes = 34;

// y (m, n) = x (m, k) times the transpose of w (n, k), w in 'format': n rows of k 16-bit values
// (bf16, f16), or n rows of k / 32 Q8_0 blocks (k a multiple of 32). x and y are float32,
// C-contiguous, and must not overlap. At most 'threads' threads of the piece team (piece_team.h)
// share the outputs; each output is summed by one thread, so the result does not depend on the
// thread count.
void format_rows_matmul_cpu(const float* x, std::ptrdiff_t m, std::ptrdiff_t k, const void* w,
                            WeightFormat format, std::ptrdiff_t n, float* y, int threads);

// One product of a call below: the stored matrix w (n, k) in 'format' and its output y (m, n).
struct FormatProduct {
    const void* w;
    WeightFormat format;
    std::ptrdiff_t n;
    float* y;
};

// The same x times each of 'count' stored matrices (a layer's query, key and value; its gate and
// up), as the call above gives each, in one call of the piece team (piece_team.h): the threads take
// runs of every product's outputs in turn. With a parallel region per matrix, each woke the
// sleeping (passive) threads once, each wake costing tens of microseconds (about 50 on machine D, a
// VM), as long as a small matrix's own read at batch 1 (a 256 x 768 key matrix in Q8_0: 0.2 MB,
// about 20 us).
void format_rows_matmul_cpu(const float* x, std::ptrdiff_t m, std::ptrdiff_t k,
                            const FormatProduct* products, std::ptrdiff_t count, int threads);

// The float32 value of a float16 bit pattern (exposed for the tests of the conversion).
float f16_to_f32(std::uint16_t bits);

}  // namespace refmath
