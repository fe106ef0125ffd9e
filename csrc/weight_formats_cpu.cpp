// See weight_formats_cpu.h. Each thread takes a stretch of the outputs and computes them G at a
// time (G = 4 in the 16-lane copy, 2 in the 8-lane ones): each 16 weights of each row are decoded
// straight into registers (one 16-lane vector, or two of 8 lanes; no buffer in memory), and the
// matching 16 floats of each of up to M rows of x are loaded once for the whole group and
// multiplied into G * M accumulators. A weight is decoded once per M rows of x, an x vector loaded
// once per G outputs, and each output is reduced from 16 lanes to one number once, at the end.
// The G rows come from G equal parts of the stretch, so that each part is read as one long forward
// stream (rows_matmul_cpu's two halves); G adjacent rows read side by side, short streams that
// restart every G rows, read from memory 1.5-3x slower (bf16, 2048 x 768, m = 1, one thread).
//
// The previous rung decoded one output row 256 weights at a time into a float32 buffer, then took
// a 16-lane dot product of the buffer with each row of x, reducing the lanes once per 256 weights:
// every weight was written to memory and read back, every x vector reloaded for every output, the
// float16 decode sat in a loop GCC did not turn into vcvtph2ps, and the lane sums cost as much as
// the products at m = 1. It ran at a third to a sixth of the float32 product's speed, though it
// read half or a quarter of the bytes (one thread, a 2048 x 768 matrix in cache, m = 1: 514 us
// bf16, 978 us f16, 940 us Q8_0, against 160 us for float32 rows_matmul).
#include "weight_formats_cpu.h"

#include <algorithm>
#include <cstring>

#include "piece_team.h"
#include "tile_math.h"

#if REFMATH_HAVE_AVX512
#include <immintrin.h>  // F16C's conversions, used only by the copy compiled for x86-64-v4 (or v3)
#endif

namespace refmath {

namespace {

using tile::f32x16;
using tile::idx;

// The integer vectors that go with a float vector of N lanes (the GCC/Clang vector extension).
template <int N>
struct Ints {
    typedef std::uint32_t u32 __attribute__((vector_size(4 * N)));
    typedef std::int32_t i32 __attribute__((vector_size(4 * N)));
    typedef std::uint16_t u16 __attribute__((vector_size(2 * N)));
    typedef std::int16_t i16 __attribute__((vector_size(2 * N)));
    typedef std::int8_t i8 __attribute__((vector_size(N)));
};

// The sum over k runs in chunks of kChunk weights: each chunk in its own 16 lane accumulators
// (16 products a lane), then added lane by lane into running totals. A lane thus rounds about
// kChunk / 16 + k / kChunk times rather than k / 16 (see tile::kSumChunk for why that matters).
constexpr idx kChunk = 256;

REFMATH_INLINE float bits_to_float(std::uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// float16 -> float32, exactly and without branches. The float16's exponent and mantissa, shifted
// into a float32's, read as a float32 whose exponent is 112 too small (a float32's bias is 127, a
// float16's 15): multiplying by 2^112 puts it right, for normal and subnormal float16 alike (a
// subnormal lands on a float32 subnormal, which the multiply makes normal). Infinity and NaN
// (exponent 31) keep their mantissa under float32's top exponent.
REFMATH_INLINE float half_to_float(std::uint16_t h) {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t rest = static_cast<std::uint32_t>(h & 0x7fffu) << 13;
    const float finite = bits_to_float(rest) * 0x1p112f;
    std::uint32_t bits;
    std::memcpy(&bits, &finite, sizeof bits);
    bits = (h & 0x7c00u) == 0x7c00u ? (rest | 0x7f800000u) : bits;
    return bits_to_float(bits | sign);
}

template <class V, class U>
REFMATH_INLINE V bits_to_floats(const U& bits) {
    static_assert(sizeof(V) == sizeof(U), "a reinterpretation");
    V f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// kLanes<V> 16-bit values from p, zero-extended to 32 bits.
template <class V>
REFMATH_INLINE typename Ints<tile::kLanes<V>>::u32 load_u16(const void* p) {
    typename Ints<tile::kLanes<V>>::u16 h;
    std::memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, typename Ints<tile::kLanes<V>>::u32);
}

// half_to_float on a vector of lanes, in integer and float operations that every target has.
template <class V>
REFMATH_INLINE V halves_to_floats(const void* p) {
    using U = typename Ints<tile::kLanes<V>>::u32;
    const U h = load_u16<V>(p);
    const U sign = (h & 0x8000u) << 16;
    const U rest = (h & 0x7fffu) << 13;
    const V finite = bits_to_floats<V>(rest) * 0x1p112f;
    U bits;
    std::memcpy(&bits, &finite, sizeof bits);
    // All ones where the exponent is 31 (Inf, NaN), else 0, without a vector comparison (which
    // GCC 12 does one lane at a time for 16 lanes on AVX2): an exponent field e <= 0x7c00 plus
    // 0x0400 reaches bit 15 only when e is 0x7c00.
    const U special = 0u - (((h & 0x7c00u) + 0x0400u) >> 15);
    bits = (bits & ~special) | ((rest | 0x7f800000u) & special);
    return bits_to_floats<V>(bits | sign);
}

// kLanes<V> int8 codes to float, int8 -> int16 -> int32 -> float: GCC 12 converts int8 to int32 or
// float one element at a time, but each of these steps in vector instructions (on AVX2: vpmovsxbw,
// vpmovsxwd, vcvtdq2ps).
template <class V>
REFMATH_INLINE V codes_to_floats(const void* p) {
    using I = Ints<tile::kLanes<V>>;
    typename I::i8 q;
    std::memcpy(&q, p, sizeof q);
    const auto wide = __builtin_convertvector(__builtin_convertvector(q, typename I::i16),
                                              typename I::i32);
    return __builtin_convertvector(wide, V);
}

// The float16 conversions of the 16-lane copy, compiled for x86-64-v4 (or v3), which has F16C:
// vcvtph2ps, one instruction per 8 values (GCC 12 converts a vector of _Float16 one element at a
// time, so the intrinsic is spelled out). Elsewhere the integer version above.
#if REFMATH_HAVE_AVX512
#define REFMATH_F16C_DECODE 1
// GCC 12's AVX-512 conversions start from an undefined register, which -Wall calls uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
REFMATH_AVX512 inline f32x16 f16c_to_floats(const void* p) {
#ifndef REFMATH_WIDE_ON_AVX2
    __m256i h;
    std::memcpy(&h, p, sizeof h);
    const __m512 v = _mm512_cvtph_ps(h);  // one register: no 32-byte halves through memory
    return reinterpret_cast<const f32x16&>(v);
#else  // the test build's AVX2 copy: two 8-lane conversions
    __m128i lo, hi;
    std::memcpy(&lo, p, sizeof lo);
    std::memcpy(&hi, static_cast<const char*>(p) + sizeof lo, sizeof hi);
    const __m256 a = _mm256_cvtph_ps(lo), b = _mm256_cvtph_ps(hi);
    f32x16 v;
    std::memcpy(&v, &a, sizeof a);
    std::memcpy(reinterpret_cast<char*>(&v) + sizeof a, &b, sizeof b);
    return v;
#endif
}
// bfloat16's 16 values to float: vpmovzxwd and vpslld on one 16-lane register. The vector
// extension's conversion of 16 uint16 to 16 uint32 came out of GCC 12 as two 8-lane conversions
// joined by extract and insert shuffles (five shuffles for 16 weights), which held the bf16
// product in cache to 60% of the float16 one's speed; with this, 1.5x faster than that in cache
// (one thread, a Zen 4, benchmarks/paired_builds.py), as fast as float16.
REFMATH_AVX512 inline f32x16 wide_bf16_to_floats(const void* p) {
#ifndef REFMATH_WIDE_ON_AVX2
    __m256i h;
    std::memcpy(&h, p, sizeof h);
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return reinterpret_cast<const f32x16&>(v);
#else
    return bits_to_floats<f32x16>(load_u16<f32x16>(p) << 16);
#endif
}
// Q8_0's 16 int8 codes to float: vpmovsxbd and vcvtdq2ps on one 16-lane register.
REFMATH_AVX512 inline f32x16 wide_codes_to_floats(const void* p) {
#ifndef REFMATH_WIDE_ON_AVX2
    __m128i q;
    std::memcpy(&q, p, sizeof q);
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
    return reinterpret_cast<const f32x16&>(v);
#else
    return codes_to_floats<f32x16>(p);
#endif
}

#define REFMATH_AVX2 __attribute__((target("arch=x86-64-v3")))
// One float16 (a Q8_0 scale): for the AVX2 and the AVX-512 copies alike.
REFMATH_AVX2 inline float f16c_to_float(std::uint16_t bits) { return _cvtsh_ss(bits); }

// The same for the AVX2 copy (x86-64-v3, which has F16C), 8 lanes. GCC's target_clones cannot
// hold these (its baseline clone would call them), so that copy is a function of its own.
REFMATH_AVX2 inline tile::f32x8 f16c_to_floats8(const void* p) {
    __m128i h;
    std::memcpy(&h, p, sizeof h);
    const __m256 v = _mm256_cvtph_ps(h);
    return reinterpret_cast<const tile::f32x8&>(v);
}
REFMATH_AVX2 inline tile::f32x8 avx2_bf16_to_floats8(const void* p) {
    const __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p))), 16));
    return reinterpret_cast<const tile::f32x8&>(v);
}
REFMATH_AVX2 inline tile::f32x8 avx2_codes_to_floats(const void* p) {
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
        static_cast<const __m128i*>(p))));  // 8 bytes, unaligned
    return reinterpret_cast<const tile::f32x8&>(v);
}
// The scales of G <= 4 Q8_0 blocks, float16s gathered into one register and converted by one
// vcvtph2ps, then stored for the multiply-adds to broadcast from memory (a load, not a vector
// instruction): converting and broadcasting each block's scale alone took 4 vector instructions,
// as many as decoding its 32 codes.
template <int G>
REFMATH_AVX2 inline void f16c_scales(const unsigned char* const (&blocks)[G], float (&out)[G]) {
    static_assert(G <= 4, "four float16s in 64 bits");
    std::uint64_t packed = 0;
    for (int g = 0; g < G; ++g) {
        std::uint16_t bits;
        std::memcpy(&bits, blocks[g], sizeof bits);
        packed |= static_cast<std::uint64_t>(bits) << (16 * g);
    }
    float all[4];
    _mm_storeu_ps(all, _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<long long>(packed))));
    std::memcpy(out, all, sizeof out);
    asm("" : "+m"(out));  // read back from memory where used: a broadcast load, not a shuffle
}
#pragma GCC diagnostic pop
#else
#define REFMATH_F16C_DECODE 0
#endif

// The decoders: one row's weights i..i+L-1 as a vector V of L lanes (i a multiple of L), and
// weight i alone. kX86: the x86 copies' F16C, AVX2 and AVX-512 conversions (the same values: every
// conversion here is exact).
template <bool kX86>
REFMATH_INLINE float half_value(const unsigned char* p) {
    std::uint16_t bits;
    std::memcpy(&bits, p, sizeof bits);  // unaligned: Q8_0 blocks are 34 bytes apart
#if REFMATH_F16C_DECODE
    if constexpr (kX86) return f16c_to_float(bits);
#endif
    return half_to_float(bits);
}

template <bool kX86>
struct Bf16 {
    static idx row_bytes(idx k) { return 2 * k; }
    template <class V>
    REFMATH_INLINE static V load(const unsigned char* row, idx i) {
#if REFMATH_F16C_DECODE
        if constexpr (kX86 && tile::kLanes<V> == 16) return wide_bf16_to_floats(row + 2 * i);
        if constexpr (kX86 && tile::kLanes<V> == 8) return avx2_bf16_to_floats8(row + 2 * i);
#endif
        return bits_to_floats<V>(load_u16<V>(row + 2 * i) << 16);
    }
    REFMATH_INLINE static float one(const unsigned char* row, idx i) {
        std::uint16_t bits;
        std::memcpy(&bits, row + 2 * i, sizeof bits);
        return bits_to_float(static_cast<std::uint32_t>(bits) << 16);
    }
};

template <bool kX86>
struct F16 {
    static idx row_bytes(idx k) { return 2 * k; }
    template <class V>
    REFMATH_INLINE static V load(const unsigned char* row, idx i) {
#if REFMATH_F16C_DECODE
        if constexpr (kX86 && tile::kLanes<V> == 16) return f16c_to_floats(row + 2 * i);
        if constexpr (kX86 && tile::kLanes<V> == 8) return f16c_to_floats8(row + 2 * i);
#endif
        return halves_to_floats<V>(row + 2 * i);
    }
    REFMATH_INLINE static float one(const unsigned char* row, idx i) {
        return half_value<kX86>(row + 2 * i);
    }
};

// Q8_0: weight i of a row is code i times the scale of block i / 32. The codes are exact in
// float32 (integers of at most 127 in size), and so is the scale (a float16); the kernel sums a
// block's codes times x first and multiplies that sum by the scale once (scaled_block_outputs),
// as llama.cpp does.
template <bool kX86>
struct Q8 {
    static idx row_bytes(idx k) { return k / kQ8Block * kQ8BlockBytes; }
    // The scales of the G blocks at 'blocks', and a block's codes i..i+L-1 (i + L <= 32) as floats.
    template <int G>
    REFMATH_INLINE static void scales(const unsigned char* const (&blocks)[G], float (&out)[G]) {
#if REFMATH_F16C_DECODE
        if constexpr (kX86) return f16c_scales(blocks, out);
#endif
        for (int g = 0; g < G; ++g) out[g] = half_value<kX86>(blocks[g]);
    }
    template <class V>
    REFMATH_INLINE static V codes(const unsigned char* block, idx i) {
        const unsigned char* p = block + 2 + i;
#if REFMATH_F16C_DECODE
        if constexpr (kX86 && tile::kLanes<V> == 16) return wide_codes_to_floats(p);
        if constexpr (kX86 && tile::kLanes<V> == 8) return avx2_codes_to_floats(p);
#endif
        return codes_to_floats<V>(p);
    }
};

template <class D>
constexpr bool kScaledBlocks = false;
template <bool kX86>
constexpr bool kScaledBlocks<Q8<kX86>> = true;

// The sum of 16 lanes held as P vectors of 16 / P lanes, pairwise: lane l + lane l + 8 (with two
// 8-lane vectors, the two added), then l + 4, l + 2, l + 1.
REFMATH_INLINE float sum16(const f32x16 (&v)[1]) { return tile::sum8(tile::fold_halves(v[0])); }
REFMATH_INLINE float sum16(const tile::f32x8 (&v)[2]) { return tile::sum8(v[0] + v[1]); }

// y[r][j + g s] = x[r] . w[j + g s] for g < G, r < M, s the stride (x has k columns, y has n).
// Every output is the same sum whatever G, M and the vector width are, in every build: lane l of
// an output (of 16; with 8-lane vectors, lane l % 8 of the (l / 8)th) accumulates the products l,
// l + 16, l + 32, ... of each 256-weight chunk in turn, the chunks' lanes are added in order, the
// 16 lanes are summed pairwise (sum16), then the products past the last 16 are added in turn.
// Written out, rather than left to the vectoriser's choice of a reduction, so that the 8-lane,
// 16-lane, baseline and sanitizer builds all sum in this order.
template <class D, class V, int G, int M>
REFMATH_INLINE void decoded_outputs(const float* x, idx k, const unsigned char* w, idx n, float* y,
                                    idx j, idx stride) {
    constexpr int L = tile::kLanes<V>, P = 16 / L;  // P vectors of L lanes: 16 lanes
    const unsigned char* rows[G];
    for (int g = 0; g < G; ++g) rows[g] = w + (j + g * stride) * D::row_bytes(k);
    V total[M][G][P] = {};
    const idx whole = k / 16 * 16;
    for (idx c = 0; c < whole; c += kChunk) {
        const idx end = std::min(whole, c + kChunk);
        V acc[M][G][P] = {};
        for (idx i = c; i < end; i += 16)
            for (int p = 0; p < P; ++p) {
                V wv[G];
                for (int g = 0; g < G; ++g) wv[g] = D::template load<V>(rows[g], i + p * L);
                for (int r = 0; r < M; ++r) {
                    const V xv = tile::loadv<V>(x + r * k + i + p * L);
                    for (int g = 0; g < G; ++g) acc[r][g][p] += xv * wv[g];
                }
            }
        for (int r = 0; r < M; ++r)
            for (int g = 0; g < G; ++g)
                for (int p = 0; p < P; ++p) total[r][g][p] += acc[r][g][p];
    }
    for (int r = 0; r < M; ++r)
        for (int g = 0; g < G; ++g) {
            float s = sum16(total[r][g]);
            for (idx i = whole; i < k; ++i) s += x[r * k + i] * D::one(rows[g], i);
            y[r * n + j + g * stride] = s;
        }
}

// decoded_outputs' sum for Q8_0, whose weights are codes times a scale per 32: lane l of an output
// (as above) takes, for each block b of a 256-weight chunk in turn, the two products of its
// weights l and l + 16 with x, added (one product, then one fused multiply-add), and adds that
// pair times the block's scale to its running sum (one fused multiply-add). A weight thus costs a
// conversion and a multiply-add, and a pair of them one more: scaling each weight as it was
// decoded cost a multiply per weight, and the product ran at 49-83% of a plain read of its bytes
// on one thread, 54-63% on two, compute-bound (m = 1, matrices from memory, machine D,
// benchmarks/results/2026-12-07-0623-weight_formats.md; 59-107% and 59-93% after, -0624). The
// chunks' lanes are then added and summed as above; k is whole blocks, so nothing is left past.
template <class D, class V, int G, int M>
REFMATH_INLINE void scaled_block_outputs(const float* x, idx k, const unsigned char* w, idx n,
                                         float* y, idx j, idx stride) {
    constexpr int L = tile::kLanes<V>, P = 16 / L;  // P vectors of L lanes: 16 lanes
    const unsigned char* rows[G];
    for (int g = 0; g < G; ++g) rows[g] = w + (j + g * stride) * D::row_bytes(k);
    V total[M][G][P] = {};
    for (idx c = 0; c < k; c += kChunk) {
        const idx end = std::min(k, c + kChunk);
        V acc[M][G][P] = {};
        // Block i / 32 of each row, a pointer stepped one block at a time (computing it from i took
        // a signed division, a multiply and an add per row, a third of the loop's instructions;
        // the speed is the same within the noise, benchmarks/paired_builds.py: the loop is held
        // by vcvtdq2ps, see benchmarks/README.md).
        const unsigned char* blocks[G];
        for (int g = 0; g < G; ++g) blocks[g] = rows[g] + c / kQ8Block * kQ8BlockBytes;
        for (idx i = c; i < end; i += kQ8Block) {
            float scales[G];
            D::scales(blocks, scales);
            for (int g = 0; g < G; ++g)
                for (int p = 0; p < P; ++p) {
                    const V low = D::template codes<V>(blocks[g], p * L);
                    const V high = D::template codes<V>(blocks[g], 16 + p * L);
                    for (int r = 0; r < M; ++r) {
                        const float* xb = x + r * k + i + p * L;
                        V pair = tile::loadv<V>(xb) * low;
                        pair += tile::loadv<V>(xb + 16) * high;
                        acc[r][g][p] += pair * scales[g];
                    }
                }
            for (int g = 0; g < G; ++g) blocks[g] += kQ8BlockBytes;
        }
        for (int r = 0; r < M; ++r)
            for (int g = 0; g < G; ++g)
                for (int p = 0; p < P; ++p) total[r][g][p] += acc[r][g][p];
    }
    for (int r = 0; r < M; ++r)
        for (int g = 0; g < G; ++g) y[r * n + j + g * stride] = sum16(total[r][g]);
}

// The G outputs j + g stride for M rows of x, in the format's own sum.
template <class D, class V, int G, int M>
REFMATH_INLINE void outputs(const float* x, idx k, const unsigned char* w, idx n, float* y, idx j,
                            idx stride) {
    if constexpr (kScaledBlocks<D>)
        scaled_block_outputs<D, V, G, M>(x, k, w, n, y, j, stride);
    else
        decoded_outputs<D, V, G, M>(x, k, w, n, y, j, stride);
}

// Outputs j (G of them) for all m rows of x, up to kRowsX rows of x at a time.
template <class D, class V, int G, int kRowsX>
REFMATH_INLINE void group(const float* x, idx m, idx k, const unsigned char* w, idx n, float* y,
                          idx j, idx stride) {
    for (idx r = 0; r < m; r += kRowsX) {
        const float* xr = x + r * k;
        float* yr = y + r * n;
        const idx rows_x = std::min<idx>(kRowsX, m - r);
        if (rows_x == 1) outputs<D, V, G, 1>(xr, k, w, n, yr, j, stride);
        if constexpr (kRowsX >= 2) if (rows_x == 2) outputs<D, V, G, 2>(xr, k, w, n, yr, j, stride);
        if constexpr (kRowsX >= 3) if (rows_x == 3) outputs<D, V, G, 3>(xr, k, w, n, yr, j, stride);
        if constexpr (kRowsX >= 4) if (rows_x == 4) outputs<D, V, G, 4>(xr, k, w, n, yr, j, stride);
    }
}

// Outputs j0..j1: kOutputs at a time, one from each of kOutputs equal parts of the stretch (one
// forward read stream each), the few left over one at a time.
template <class D, class V, int kOutputs, int kRowsX>
REFMATH_INLINE void range(const float* x, idx m, idx k, const void* w, idx n, float* y, idx j0,
                          idx j1) {
    const auto* bytes = static_cast<const unsigned char*>(w);
    const idx count = (j1 - j0) / kOutputs;  // outputs j0 + c + g count, g < kOutputs
    for (idx c = 0; c < count; ++c)
        group<D, V, kOutputs, kRowsX>(x, m, k, bytes, n, y, j0 + c, count);
    for (idx j = j0 + kOutputs * count; j < j1; ++j)
        group<D, V, 1, kRowsX>(x, m, k, bytes, n, y, j, 0);
}

// One function per format and copy: with the three formats' loops inlined into one function, GCC
// merged them into a single loop that decoded every format and picked one (all three then ran at
// the slowest one's speed).
//
// The 8-lane copies (AVX2's 16 registers of 8 floats): 2 outputs and up to 2 rows of x at a time,
// 8 registers of accumulators (with one row of x at a time, 4 rows of x read 1.1-2x slower than
// float32 in cache: each weight decoded 4 times). GCC keeps 16-lane vector-extension values in
// memory on AVX2, which ran 5x slower, hence two 8-lane vectors for the 16 lanes. Each format has a
// copy with AVX2's (and F16C's) conversions for x86-64-v3 CPUs and a portable one for the rest;
// bfloat16 needs only a widening and a shift, but GCC 12 widened the vector extension's 8 lanes as
// two 4-lane halves, so it has its intrinsic copy too.
using Rows = void (*)(const float* x, idx m, idx k, const void* w, idx n, float* y, idx j0, idx j1);

#define REFMATH_ROWS(name, attributes, D, V, outputs, rows_x)                                    \
    attributes void name(const float* x, idx m, idx k, const void* w, idx n, float* y, idx j0, \
                         idx j1) {                                                            \
        range<D, V, outputs, rows_x>(x, m, k, w, n, y, j0, j1);                                \
    }
REFMATH_ROWS(bf16_rows, , Bf16<false>, tile::f32x8, 2, 2)
REFMATH_ROWS(f16_rows, , F16<false>, tile::f32x8, 2, 2)
REFMATH_ROWS(q8_0_rows, , Q8<false>, tile::f32x8, 2, 2)

#if REFMATH_HAVE_AVX512
// (flatten: the intrinsics' helpers are inlined here, where the target allows them, and not into
// the generic templates on the way.)
REFMATH_ROWS(bf16_rows_avx2, REFMATH_AVX2 __attribute__((flatten)), Bf16<true>, tile::f32x8, 2, 2)
REFMATH_ROWS(f16_rows_avx2, REFMATH_AVX2 __attribute__((flatten)), F16<true>, tile::f32x8, 2, 2)
REFMATH_ROWS(q8_0_rows_avx2, REFMATH_AVX2 __attribute__((flatten)), Q8<true>, tile::f32x8, 2, 2)

// The 16-lane copies (AVX-512's 32 registers of 16 floats): 4 outputs and up to 4 rows of x at a
// time, 16 accumulators, F16C and AVX-512's conversions.
REFMATH_ROWS(bf16_rows_wide, REFMATH_AVX512 __attribute__((flatten)), Bf16<true>, f32x16, 4, 4)
REFMATH_ROWS(f16_rows_wide, REFMATH_AVX512 __attribute__((flatten)), F16<true>, f32x16, 4, 4)
REFMATH_ROWS(q8_0_rows_wide, REFMATH_AVX512 __attribute__((flatten)), Q8<true>, f32x16, 4, 4)
#endif
#undef REFMATH_ROWS

Rows rows_for(WeightFormat format) {
#if REFMATH_HAVE_AVX512
    static const bool avx2 = std::strcmp(tile::narrow_copy(), "x86-64-v3") == 0;
    const bool wide = tile::wide_vectors();
    switch (format) {
        case WeightFormat::bf16: return wide ? bf16_rows_wide : avx2 ? bf16_rows_avx2 : bf16_rows;
        case WeightFormat::f16: return wide ? f16_rows_wide : avx2 ? f16_rows_avx2 : f16_rows;
        case WeightFormat::q8_0: return wide ? q8_0_rows_wide : avx2 ? q8_0_rows_avx2 : q8_0_rows;
    }
#else
    switch (format) {
        case WeightFormat::bf16: return bf16_rows;
        case WeightFormat::f16: return f16_rows;
        case WeightFormat::q8_0: return q8_0_rows;
    }
#endif
    return nullptr;
}

}  // namespace

float f16_to_f32(std::uint16_t bits) { return half_to_float(bits); }

void format_rows_matmul_cpu(const float* x, std::ptrdiff_t m, std::ptrdiff_t k,
                            const FormatProduct* products, std::ptrdiff_t count, int threads) {
    double multiply_adds = 0.0;
    for (std::ptrdiff_t p = 0; p < count; ++p)
        multiply_adds += static_cast<double>(m) * k * products[p].n;
    threads = std::max(1, std::min(threads, tile::threads_for(multiply_adds)));
    tile::note_team(threads);
    // Each product's outputs in kPiecesPerThread * threads equal stretches, the pieces of a piece
    // team (piece_team.h); a run of pieces is read as one stretch of each product it covers. An
    // output's sum does not depend on the stretch it falls in.
    const idx per_product = tile::kPiecesPerThread * threads;
    team::run(count * per_product, threads, [&](idx first, idx last, int) {
        team::for_each_part(first, last, per_product, [&](idx p, idx a, idx b) {
            const FormatProduct& product = products[p];
            const idx n = product.n;
            rows_for(product.format)(x, m, k, product.w, n, product.y, n * a / per_product,
                                     n * b / per_product);
        });
    });
}

void format_rows_matmul_cpu(const float* x, std::ptrdiff_t m, std::ptrdiff_t k, const void* w,
                            WeightFormat format, std::ptrdiff_t n, float* y, int threads) {
    const FormatProduct product{w, format, n, y};
    format_rows_matmul_cpu(x, m, k, &product, 1, threads);
}

}  // namespace refmath
