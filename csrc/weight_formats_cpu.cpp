// See weight_formats_cpu.h. Each thread takes a stretch of the outputs; for each output it decodes
// its row a chunk at a time into a small float32 buffer, then takes the chunk's dot product with
// every row of x, so that a weight is decoded once however many rows x has.
#include "weight_formats_cpu.h"

#include <algorithm>
#include <cstring>

#include "tile_math.h"

namespace refmath {

namespace {

using tile::idx;

constexpr idx kChunk = 256;  // weights decoded at a time: 1 KiB of float32, 8 Q8_0 blocks

REFMATH_INLINE float bits_to_float(std::uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// float16 -> float32, exactly and without branches (so that the loops over it vectorise). The
// float16's exponent and mantissa, shifted into a float32's, read as a float32 whose exponent is
// 112 too small (a float32's bias is 127, a float16's 15): multiplying by 2^112 puts it right, for
// normal and subnormal float16 alike (a subnormal lands on a float32 subnormal, which the multiply
// makes normal). Infinity and NaN (exponent 31) keep their mantissa under float32's top exponent.
REFMATH_INLINE float half_to_float(std::uint16_t h) {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t rest = static_cast<std::uint32_t>(h & 0x7fffu) << 13;
    const float finite = bits_to_float(rest) * 0x1p112f;
    std::uint32_t bits;
    std::memcpy(&bits, &finite, sizeof bits);
    bits = (h & 0x7c00u) == 0x7c00u ? (rest | 0x7f800000u) : bits;
    return bits_to_float(bits | sign);
}

REFMATH_INLINE void decode_bf16(const std::uint16_t* w, idx count, float* out) {
#pragma omp simd
    for (idx i = 0; i < count; ++i) out[i] = bits_to_float(static_cast<std::uint32_t>(w[i]) << 16);
}

REFMATH_INLINE void decode_f16(const std::uint16_t* w, idx count, float* out) {
#pragma omp simd
    for (idx i = 0; i < count; ++i) out[i] = half_to_float(w[i]);
}

// 'blocks' whole Q8_0 blocks from 'w' (34 bytes each) into 32 * blocks floats.
REFMATH_INLINE void decode_q8_0(const unsigned char* w, idx blocks, float* out) {
    for (idx b = 0; b < blocks; ++b) {
        const unsigned char* block = w + b * kQ8BlockBytes;
        std::uint16_t d_bits;
        std::memcpy(&d_bits, block, sizeof d_bits);  // unaligned: blocks are 34 bytes apart
        const float d = half_to_float(d_bits);
        const auto* q = reinterpret_cast<const std::int8_t*>(block + 2);
        float* o = out + b * kQ8Block;
#pragma omp simd
        for (idx i = 0; i < kQ8Block; ++i) o[i] = static_cast<float>(q[i]) * d;  // exact
    }
}

// The dot product of a and b (n floats) in a fixed order, whatever the build: kLanes running sums
// (lane l takes the products l, l + kLanes, ...), added pairwise, then the products past the last
// whole group in turn. Written out, rather than left to the vectoriser's choice of a reduction, so
// that every build (8 or 16 lanes, the baseline, a sanitizer's unvectorised one) sums in the same
// order, which keeps the error near that of a blocked BLAS sum rather than of a k-long chain.
constexpr int kLanes = 16;

REFMATH_INLINE float dot(const float* a, const float* b, idx n) {
    float acc[kLanes] = {};
    idx i = 0;
    for (; i + kLanes <= n; i += kLanes)
        for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
    for (int width = kLanes / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
    float tail = 0.0f;
    for (; i < n; ++i) tail += a[i] * b[i];
    return acc[0] + tail;
}

// Outputs j0..j1 of y = x w^T. The chunk sums are float32 sums in vector lanes, added into y[r, j]
// in order: every product passes through at most k additions (catalogue W1's bound).
REFMATH_MULTIVERSION
void rows_range(const float* x, idx m, idx k, const void* w, WeightFormat format, idx n, float* y,
                idx j0, idx j1) {
    alignas(64) float buf[kChunk];
    for (idx j = j0; j < j1; ++j) {
        for (idx r = 0; r < m; ++r) y[r * n + j] = 0.0f;
        for (idx c = 0; c < k; c += kChunk) {
            const idx len = std::min(kChunk, k - c);
            switch (format) {
                case WeightFormat::bf16:
                    decode_bf16(static_cast<const std::uint16_t*>(w) + j * k + c, len, buf);
                    break;
                case WeightFormat::f16:
                    decode_f16(static_cast<const std::uint16_t*>(w) + j * k + c, len, buf);
                    break;
                case WeightFormat::q8_0:  // k and kChunk are multiples of 32: whole blocks
                    decode_q8_0(static_cast<const unsigned char*>(w) +
                                    (j * (k / kQ8Block) + c / kQ8Block) * kQ8BlockBytes,
                                len / kQ8Block, buf);
                    break;
            }
            for (idx r = 0; r < m; ++r) y[r * n + j] += dot(buf, x + r * k + c, len);
        }
    }
}

}  // namespace

float f16_to_f32(std::uint16_t bits) { return half_to_float(bits); }

void format_rows_matmul_cpu(const float* x, std::ptrdiff_t m, std::ptrdiff_t k, const void* w,
                            WeightFormat format, std::ptrdiff_t n, float* y, int threads) {
    threads = std::max(1, std::min(threads, tile::threads_for(static_cast<double>(m) * k * n)));
#pragma omp parallel num_threads(threads)
    {
        const int t = tile::thread_id(), team = tile::team_size();
        if (t == 0) tile::note_team(team);
        rows_range(x, m, k, w, format, n, y, n * t / team, n * (t + 1) / team);
    }
}

}  // namespace refmath
