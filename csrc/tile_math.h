// Small dense building blocks shared by the CPU attention kernels: a matrix-product tile, a
// transpose, lane sums of dot products, a vectorisable 2^x, and the per-thread bookkeeping of an
// OpenMP region.
//
// Everything here is inline, so each kernel that includes it gets its own copy compiled for its own
// instruction set (see REFMATH_MULTIVERSION): the helpers carry no target of their own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#ifdef _OPENMP
#include <omp.h>
#endif

// The default x86-64 target is SSE2, which has 4-lane vectors and no fused multiply-add, while
// nearly every x86 CPU still in use has AVX2 and FMA (8 lanes, one instruction per a*b+c). GCC's
// target_clones compiles a function twice, for x86-64-v3 (AVX2, FMA) and for the baseline, and
// picks one when the module is loaded, so one portable wheel runs at full width where it can.
// Other compilers and CPUs get the baseline code only.
//
// Server CPUs with AVX-512 (x86-64-v4) do twice the multiply-adds per instruction again, but only
// with 16-lane vectors, which the 8-lane code above cannot express. So each hot kernel is written
// once as a template over its vector type and instantiated twice: the 8-lane copy behind
// REFMATH_MULTIVERSION, and a 16-lane copy behind REFMATH_AVX512, which the caller picks at run
// time with tile::wide_vectors() (a CPU without AVX-512 never runs it).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && \
    !defined(REFMATH_NO_MULTIVERSION)
#define REFMATH_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#ifdef REFMATH_WIDE_ON_AVX2
// A test build (setup.py's REFMATH_WIDE_ON_AVX2=1): the 16-lane copies are compiled for AVX2, each
// 16-lane operation done as two 8-lane ones, and run on any AVX2 CPU (vector_width.cpp), so that
// a machine without AVX-512 can test the 16-lane code paths. Slower, and never a release build.
#define REFMATH_AVX512 __attribute__((target("arch=x86-64-v3")))
#else
#define REFMATH_AVX512 __attribute__((target("arch=x86-64-v4")))
#endif
#define REFMATH_HAVE_AVX512 1
#else
#define REFMATH_MULTIVERSION
#define REFMATH_HAVE_AVX512 0
#endif

// The copy of a kernel to run: name_wide (16 lanes) where tile::wide_vectors() says so, else name.
#if REFMATH_HAVE_AVX512
#define REFMATH_PICK_WIDTH(name) (::refmath::tile::wide_vectors() ? name##_wide : name)
#else
#define REFMATH_PICK_WIDTH(name) (name)
#endif

// Forced inlining, so that a helper runs with the instruction set of the clone that calls it (an
// out-of-line call would go to a baseline copy).
#define REFMATH_INLINE inline __attribute__((always_inline))

// Passing 32-byte vectors between functions compiled for different targets changes the ABI, and
// GCC says so for every helper below; all of them are inlined, so no such call ever happens.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace refmath {
namespace tile {

using idx = std::ptrdiff_t;

// Eight floats as one value (the GCC/Clang vector extension). The compiler maps each operation to
// the widest instructions of the target: one AVX2 instruction, two SSE2 ones, two NEON ones. The
// plain-loop versions of the products below are not vectorised well by GCC (it vectorises across
// the wrong axis and spills the accumulators), which is why they are spelled out this way.
typedef float f32x8 __attribute__((vector_size(32)));

REFMATH_INLINE f32x8 load8(const float* p) {
    f32x8 v;
    std::memcpy(&v, p, sizeof v);  // unaligned load; memcpy is the portable way to say it
    return v;
}

REFMATH_INLINE void store8(float* p, const f32x8& v) { std::memcpy(p, &v, sizeof v); }

// Sixteen floats: one AVX-512 register. Used only by code compiled for REFMATH_AVX512.
typedef float f32x16 __attribute__((vector_size(64)));

// Lanes of a vector type, and loads and stores of any of them.
template <class V>
constexpr int kLanes = sizeof(V) / sizeof(float);

template <class V>
REFMATH_INLINE V loadv(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

template <class V>
REFMATH_INLINE void storev(float* p, const V& v) { std::memcpy(p, &v, sizeof v); }

template <class V>
REFMATH_INLINE V zerov() { return V{}; }

// The two 8-lane halves of a 16-lane vector added together (the first step of a lane sum).
REFMATH_INLINE f32x8 fold_halves(const f32x16& v) {
    f32x8 lo, hi;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
    return lo + hi;
}
REFMATH_INLINE f32x8 fold_halves(const f32x8& v) { return v; }

typedef float f32x4 __attribute__((vector_size(16)));

// The sum of the eight lanes: halves added as 4-lane vectors, then the last four in pairs.
REFMATH_INLINE float sum8(const f32x8& v) {
    const f32x4 lo = {v[0], v[1], v[2], v[3]}, hi = {v[4], v[5], v[6], v[7]};
    const f32x4 s = lo + hi;
    return (s[0] + s[2]) + (s[1] + s[3]);
}

// ---- C = A B: row-major A (M x K) and B (K x N) --------------------------------------------------
//
// The register tile is MR rows x 2 vectors of columns of C (16 columns with 8-lane vectors, 32 with
// 16-lane ones), held in 2*MR vector registers while k runs: each step loads two vectors of B's
// row k, broadcasts one number of A per row, and does 2*MR fused multiply-adds. Each accumulator
// also has a running total (the chunked sums below), so a tile needs 4*MR registers. With AVX-512's
// 32, MR = 6: 12 accumulators, more than the FMA latency needs, and 8 loads per 12 multiply-adds.
// With AVX2's 16, MR = 4 (8 accumulators, 8 totals): an MR = 6 tile does not fit, and the compiler
// moves its totals and B's vectors to and from memory at every chunk, which measured 20-25% slower
// (27-28 against 34-36 flops per cycle of the time-stamp counter, of the 40 this core peaks at, for
// a 128 x 128 x 64 tile; an AMD EPYC, Zen 3). Smaller tiles take the rows left over.
//
// The sum over k runs in chunks of kSumChunk terms, each chunk summed in its own accumulators and
// then added to the total. A plain running sum of K terms rounds K times along one chain (its error
// grows like K u, typically sqrt(K) u); in chunks it is about kSumChunk + K / kSumChunk roundings:
// 16 instead of 64 for the scores of a head of width 64, 24 instead of 128 for P V over a tile of
// 128 keys. The attention kernels' error against float64 must stay within twice NumPy's own
// float32 error (the tests' rule); with one chain, about 1 random shape in 1000 went over, with
// chunks of 8 the worst of 2300 was 0.68 of the bound. The price is one addition per accumulator
// per chunk and the registers of the totals: with both in registers (the MR = 4 tile on AVX2) a
// 128 x 128 x 64 product ran at 34-36 flops per counter cycle, against 35-37 for one chain per
// output.
constexpr idx kSumChunk = 8;

template <int MR, class V>
REFMATH_INLINE void nn_tile(idx K, const float* A, idx lda, idx ak, const float* B, idx ldb, float* C,
                            idx ldc) {
    constexpr int L = kLanes<V>;
    V total[MR][2];
    for (int r = 0; r < MR; ++r) total[r][0] = total[r][1] = zerov<V>();
    for (idx k0 = 0; k0 < K; k0 += kSumChunk) {
        const idx k1 = k0 + kSumChunk < K ? k0 + kSumChunk : K;
        V acc[MR][2];
        for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = zerov<V>();
        for (idx k = k0; k < k1; ++k) {
            const V b0 = loadv<V>(B + k * ldb), b1 = loadv<V>(B + k * ldb + L);
            for (int r = 0; r < MR; ++r) {
                const float a = A[r * lda + k * ak];
                acc[r][0] += a * b0;
                acc[r][1] += a * b1;
            }
        }
        for (int r = 0; r < MR; ++r) {
            total[r][0] += acc[r][0];
            total[r][1] += acc[r][1];
        }
    }
    for (int r = 0; r < MR; ++r) {
        storev(C + r * ldc, total[r][0]);
        storev(C + r * ldc + L, total[r][1]);
    }
}

// The last n < 16 columns: plain loops (the compiler vectorises what it can), summed in the same
// chunks of k.
template <int MR>
REFMATH_INLINE void nn_tile_narrow(idx K, idx n, const float* A, idx lda, idx ak, const float* B, idx ldb,
                                   float* C, idx ldc) {
    float acc[16];
    for (int r = 0; r < MR; ++r) {
        for (idx c = 0; c < n; ++c) C[r * ldc + c] = 0.0f;
        for (idx k0 = 0; k0 < K; k0 += kSumChunk) {
            const idx k1 = k0 + kSumChunk < K ? k0 + kSumChunk : K;
            for (idx c = 0; c < n; ++c) acc[c] = 0.0f;
            for (idx k = k0; k < k1; ++k) {
                const float a = A[r * lda + k * ak];
                for (idx c = 0; c < n; ++c) acc[c] += a * B[k * ldb + c];
            }
            for (idx c = 0; c < n; ++c) C[r * ldc + c] += acc[c];
        }
    }
}

// Columns by tiles of two V vectors; with 16-lane vectors a last 16 columns by an 8-lane tile; the
// rest by plain loops.
template <int MR, class V>
REFMATH_INLINE void nn_rows(idx N, idx K, const float* A, idx lda, idx ak, const float* B, idx ldb,
                            float* C, idx ldc) {
    constexpr int W = 2 * kLanes<V>;
    idx j = 0;
    for (; j + W <= N; j += W) nn_tile<MR, V>(K, A, lda, ak, B + j, ldb, C + j, ldc);
    if (W > 16 && j + 16 <= N) {
        nn_tile<MR, f32x8>(K, A, lda, ak, B + j, ldb, C + j, ldc);
        j += 16;
    }
    if (j < N) nn_tile_narrow<MR>(K, N - j, A, lda, ak, B + j, ldb, C + j, ldc);
}

// ---- B in column strips ----------------------------------------------------------------------
//
// A product reads each strip of B (its columns [j, j + 2 vectors)) once per block of MR rows of A.
// In a row-major tile of B that strip is a column of cache lines 256 or 512 bytes apart, which the
// level-1 cache keeps poorly (the lines fall into a few of its sets), and running all of B's strips
// for each row block streams the whole of B through it again and again. So B is first copied into
// strips, each one K x width and contiguous (pack_strips, or transpose_strips straight from rows of
// keys), and gemm_strips runs each strip against every row block of A while the strip stays in the
// level-1 cache. Measured inside the attention forward (128 x 128 tiles, D = 64, AVX2): 35-37
// flops per counter cycle (of 40) for both tile products, against 28-31 with row-major B; the two
// copies take 5-6% of the forward's time.
//
// Layout: the strip of columns [j, j + w), w = min(width, cols - j), is a K x w row-major block at
// dst + j * K (every strip before it is K x width).
template <class V>
constexpr idx kStripWidth = 2 * kLanes<V>;

// dst = src (rows x cols, row stride lds), in strips of kStripWidth<V> columns.
template <class V>
REFMATH_INLINE void pack_strips(idx rows, idx cols, const float* src, idx lds, float* dst) {
    constexpr idx W = kStripWidth<V>;
    for (idx j = 0; j < cols; j += W) {
        const idx w = cols - j < W ? cols - j : W;
        for (idx k = 0; k < rows; ++k)
            std::memcpy(dst + j * rows + k * w, src + k * lds + j, w * sizeof(float));
    }
}

// C (M x N) = A (M x K) B (K x N), B in strips (above) of a matrix of b_rows rows, of which rows
// [k0, k0 + K) are used: A's columns are its own, starting at A. A_rk is A[r * lda + k * ak]: a
// row-major A has ak = 1, and lda = 1 reads the transpose of a row-major matrix of row stride ak
// (A is only ever read one number at a time, so either costs the same). Reads exactly those
// entries, any M, N, K >= 0.
template <class V>
REFMATH_INLINE void gemm_strips(idx M, idx N, idx K, const float* A, idx lda, idx ak, const float* B,
                                idx b_rows, idx k0, float* C, idx ldc) {
    constexpr idx W = kStripWidth<V>;
    for (idx j = 0; j < N; j += W) {
        const idx w = N - j < W ? N - j : W;
        const float* Bj = B + j * b_rows + k0 * w;
        idx i = 0;
        for (; kLanes<V> >= 16 && i + 6 <= M; i += 6)
            nn_rows<6, V>(w, K, A + i * lda, lda, ak, Bj, w, C + i * ldc + j, ldc);
        for (; i + 4 <= M; i += 4)
            nn_rows<4, V>(w, K, A + i * lda, lda, ak, Bj, w, C + i * ldc + j, ldc);
        for (; i < M; ++i) nn_rows<1, V>(w, K, A + i * lda, lda, ak, Bj, w, C + i * ldc + j, ldc);
    }
}

// C += T for an M x N block (strides ldc, ldt). Used to add a tile's products into a running sum:
// summing each tile on its own first and then adding it keeps the rounding error of a long sum
// near (tile length + number of tiles) roundings instead of (total length).
REFMATH_INLINE void add_block(idx M, idx N, const float* T, idx ldt, float* C, idx ldc) {
    for (idx i = 0; i < M; ++i) {
#pragma omp simd
        for (idx j = 0; j < N; ++j) C[i * ldc + j] += T[i * ldt + j];
    }
}

// Lane selection from two vectors (indices 0-7: the first, 8-15: the second).
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define REFMATH_SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else  // older GCC: the same selection, with the indices given as a vector
typedef std::int32_t i32x8 __attribute__((vector_size(32)));
#define REFMATH_SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, i32x8{__VA_ARGS__})
#endif

// ---- products with a transposed factor ---------------------------------------------------------
//
// Attention's scores are q_i . k_j with both vectors stored as rows, i.e. S = Q K^T. Rather than a
// tile of dot products (whose 8-lane sums must each be added up at the end), the kernels transpose
// the key tile once (transpose_strips below) and use the broadcast-and-multiply tile of gemm_strips: the copy
// is one read and one write per key number, against a whole tile's rows of products that use it.

// An 8 x 8 block: dst[c][r] = src[r][c], in registers. Three rounds of shuffles, each within what
// one AVX2 instruction does: interleave pairs of rows (unpacklo/hi), pairs of pairs (shufps), then
// swap 128-bit halves (vperm2f128). Row names a..h below are src rows 0..7.
REFMATH_INLINE void transpose8x8(const float* src, idx lds, float* dst, idx ldd) {
    f32x8 r[8];
    for (int i = 0; i < 8; ++i) r[i] = load8(src + i * lds);
    f32x8 t[8];  // t[2i] = (a0 b0 a1 b1 | a4 b4 a5 b5) for rows a, b = 2i, 2i+1; t[2i+1]: 2, 3, 6, 7
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = REFMATH_SHUFFLE8(r[2 * i], r[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[2 * i + 1] = REFMATH_SHUFFLE8(r[2 * i], r[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    f32x8 u[8];  // u[4h + c] = column c (low half) and c + 4 (high half) of rows 4h .. 4h + 3
    for (int h = 0; h < 2; ++h) {
        const f32x8* th = t + 4 * h;
        u[4 * h + 0] = REFMATH_SHUFFLE8(th[0], th[2], 0, 1, 8, 9, 4, 5, 12, 13);
        u[4 * h + 1] = REFMATH_SHUFFLE8(th[0], th[2], 2, 3, 10, 11, 6, 7, 14, 15);
        u[4 * h + 2] = REFMATH_SHUFFLE8(th[1], th[3], 0, 1, 8, 9, 4, 5, 12, 13);
        u[4 * h + 3] = REFMATH_SHUFFLE8(th[1], th[3], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    for (int c = 0; c < 4; ++c) {  // column c: low halves of rows a-d and e-h; column c + 4: high
        store8(dst + c * ldd, REFMATH_SHUFFLE8(u[c], u[4 + c], 0, 1, 2, 3, 8, 9, 10, 11));
        store8(dst + (c + 4) * ldd, REFMATH_SHUFFLE8(u[c], u[4 + c], 4, 5, 6, 7, 12, 13, 14, 15));
    }
}

// dst (cols x rows, row stride ldd) = src^T for src rows x cols (row stride lds): 8 x 8 blocks in
// registers, the edges one number at a time.
REFMATH_INLINE void transpose(idx rows, idx cols, const float* src, idx lds, float* dst, idx ldd) {
    const idx rows8 = rows - rows % 8, cols8 = cols - cols % 8;
    for (idx r = 0; r < rows8; r += 8)
        for (idx c = 0; c < cols8; c += 8) transpose8x8(src + r * lds + c, lds, dst + c * ldd + r, ldd);
    for (idx r = 0; r < rows; ++r)
        for (idx c = r < rows8 ? cols8 : 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
}

// dst = src^T in strips (see pack_strips) for src rows x cols: the strip of src's rows [j, j + w)
// is their transpose, cols x w. This is how a tile of keys becomes the B of S = Q K^T.
template <class V>
REFMATH_INLINE void transpose_strips(idx rows, idx cols, const float* src, idx lds, float* dst) {
    constexpr idx W = kStripWidth<V>;
    for (idx j = 0; j < rows; j += W) {
        const idx w = rows - j < W ? rows - j : W;
        transpose(w, cols, src + j * lds, lds, dst + j * cols, w);
    }
}

// ---- lane sums ------------------------------------------------------------------------------------
//
// Eight accumulators' lane sums at once, for the decode kernel's dot products (one query against
// many keys, where a transposed copy of the keys would cost as much as the products).
//
// out[i] = the sum of the 8 lanes of v[i]. Pairs of accumulators are interleaved and added
// (unpacklo/unpackhi), halving the lanes each holds, three times over; the last step swaps the
// 128-bit halves. Every shuffle stays within what SSE2 and AVX2 do in one instruction.
REFMATH_INLINE f32x8 sum_lanes_8x8(const f32x8 (&v)[8]) {
    f32x8 h[4];
    for (int i = 0; i < 4; ++i)  // h[i] lanes: v[2i], v[2i+1] alternating, each the sum of 2 lanes
        h[i] = REFMATH_SHUFFLE8(v[2 * i], v[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13) +
               REFMATH_SHUFFLE8(v[2 * i], v[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    f32x8 q[2];
    for (int i = 0; i < 2; ++i)  // q[i] lanes: v[4i .. 4i+3] in each half, each the sum of 4 lanes
        q[i] = REFMATH_SHUFFLE8(h[2 * i], h[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               REFMATH_SHUFFLE8(h[2 * i], h[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return REFMATH_SHUFFLE8(q[0], q[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           REFMATH_SHUFFLE8(q[0], q[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// One dot product of two rows of K floats.
REFMATH_INLINE float dot(idx K, const float* a, const float* b) {
    f32x8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
    idx k = 0;
    for (; k + 8 <= K; k += 8) acc += load8(a + k) * load8(b + k);
    float s = sum8(acc);
    for (; k < K; ++k) s += a[k] * b[k];
    return s;
}

// The sum of n floats in eight interleaved partial sums: the same order, and so the same rounding, in
// every build (an '#pragma omp simd' reduction is summed in whatever order the vectoriser picks, one
// by one when it does not vectorise, as in the -O1 sanitizer build), and a shorter chain of
// additions than a plain loop (about n/8 + 3 roundings per term instead of n).
REFMATH_INLINE float sum(idx n, const float* x) {
    f32x8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
    idx i = 0;
    for (; i + 8 <= n; i += 8) acc += load8(x + i);
    float s = sum8(acc);
    for (; i < n; ++i) s += x[i];
    return s;
}

// ---- 2^x --------------------------------------------------------------------------------------
//
// std::exp is a library call that no loop around it can vectorise (without -ffast-math), and the
// attention kernels take one exponential per score. This one is branch-free arithmetic, so a loop of
// them vectorises. The kernels work in base 2: scores are multiplied by scale * log2(e) once, and
// e^(s - m) becomes 2^(x - m'), which saves a multiplication per score.
//
// 2^x = 2^n 2^f with n = round(x) and f = x - n in [-1/2, 1/2]. 2^f = e^(f ln 2) is its Taylor
// series to degree 7 (truncation error below 1e-8 relative, a sixth of a float32 rounding); 2^n is
// built directly as the float with exponent field n + 127. x is clamped to [-127, 127]: below -127
// the result is 0 (exactly what the softmax wants for -inf, a masked score). A NaN passes both
// clamps and makes p, and so the result, NaN: a NaN score must make its row NaN, not weigh 0 like
// a masked one.
//
// Rounding without a library call: t = x + 1.5 * 2^23 lies in [2^23, 2^24), where floats are the
// integers, so the addition rounds x to an integer n = t - 1.5 * 2^23, and t's low mantissa bits
// are n + 2^22. Adding 127 to t's bit pattern and shifting it left by 23 then leaves n + 127 in the
// exponent field (everything above it shifts out): 2^n with no float-to-integer conversion, which
// would be undefined for a NaN.
//
// exp2_fast8 is the same function on 8 lanes at once, written with vector operations rather than
// left to the vectoriser: in a loop of exp2_fast, GCC merges the clamps into selects of the
// polynomial and of the exponent (36 instructions per 8 numbers where 19 do), 1.4 cycles per
// number against 1.06. Both give the same bits for every one of the 2^32 inputs (NaN for NaN).

// 2^f for f in [-1/2, 1/2], on a float or a vector of them.
template <class T>
REFMATH_INLINE T exp2_taylor(const T& f) {
    T p = T{} + 1.5252733804059840e-5f;  // (ln 2)^7 / 7!
    p = p * f + 1.5403530393381609e-4f;  // (ln 2)^6 / 6!
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;  // ln 2
    return p * f + 1.0f;
}

constexpr float kRoundShifter = 12582912.0f;  // 1.5 * 2^23

typedef std::uint32_t u32x8 __attribute__((vector_size(32)));

// 2^x on a float (U = its bits, uint32_t) or on 8 of them at once (f32x8, U = u32x8): one
// definition, so the two give the same bits (tests/test_exp2.py checks it).
template <class T, class U>
REFMATH_INLINE T exp2_bits(const T& x_in) {
    const T lo = T{} - 127.0f, hi = T{} + 127.0f;
    T x = x_in < lo ? lo : x_in;  // NaN is kept (the comparison is false); on vectors, ?: selects
    x = x > hi ? hi : x;          // by the lane mask of the comparison
    const T t = x + kRoundShifter;
    const T p = exp2_taylor(x - (t - kRoundShifter));
    U bits;
    std::memcpy(&bits, &t, sizeof bits);
    bits = (bits + 127u) << 23;  // n = -127 gives +0.0
    T two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

REFMATH_INLINE float exp2_fast(float x) { return exp2_bits<float, std::uint32_t>(x); }
REFMATH_INLINE f32x8 exp2_fast8(const f32x8& x) { return exp2_bits<f32x8, u32x8>(x); }

// Whether every entry of the rows x cols block at A (row stride lda) is finite. x - x is 0 for a
// finite x and NaN for an infinite or NaN one.
REFMATH_INLINE bool all_finite(idx rows, idx cols, const float* A, idx lda) {
    int bad = 0;
    for (idx i = 0; i < rows; ++i) {
        const float* a = A + i * lda;
#pragma omp simd reduction(| : bad)
        for (idx j = 0; j < cols; ++j) bad |= !(a[j] - a[j] == 0.0f);
    }
    return bad == 0;
}

constexpr float kLog2e = 1.4426950408889634f;

// scale * log2(e), the factor that turns scores into base-2 exponents, rounded once (a float32
// product would round log2(e) first and the product again, and every exponent carries that error).
inline float base2_factor(float scale) { return static_cast<float>(scale * 1.4426950408889634); }
constexpr float kLn2 = 0.6931471805599453f;

// ---- per-thread scratch --------------------------------------------------------------------------

// The kernels' thread count, set by refmath.kernels.cpu_threads(n) (as `generate --threads N`
// does): n > 0 makes every kernel run at most n OpenMP threads, from whichever Python thread it is
// called; 0 (the default) leaves the count to OpenMP (OMP_NUM_THREADS, else one per core). It is a
// process-wide value rather than omp_set_num_threads, which sets only the calling thread's count.
int thread_limit();
void set_thread_limit(int n);

inline int max_threads() {
#ifdef _OPENMP
    const int limit = thread_limit();
    return limit > 0 ? limit : omp_get_max_threads();
#else
    return 1;
#endif
}

// The threads the last call of the compiled row products, the decode attention or the bandwidth
// probe was shared among (the setting, or 1 for a small call): what a test reads to see that a
// thread setting reached the kernels (a relaxed store, once per call).
void note_team(int size);
int last_team();

// The threads for a call of about 'multiply_adds' multiply-adds: one below a quarter million (tens
// of microseconds of work). Waking more threads costs more than that saves, and on a machine whose
// cores are busy a woken thread that is not scheduled at once makes the whole call wait for it (a
// decode step of a small model took 10 ms instead of 0.1 ms). The result does not depend on it:
// the work is cut the same way whatever the thread count.
inline int threads_for(double multiply_adds) {
    return multiply_adds < 262144.0 ? 1 : max_threads();
}

// The pieces per thread that a call shared by a piece team (piece_team.h) is cut into: more than
// one, so that a thread the scheduler parks leaves the rest of the work to the others.
constexpr int kPiecesPerThread = 4;

// Whether to run the 16-lane (AVX-512) copies of the kernels: only where the CPU has x86-64-v4
// and it has not been switched off with set_wide_vectors(false) (how the tests reach the 8-lane
// copies on such a CPU, and how a benchmark compares the two).
bool wide_vectors();
void set_wide_vectors(bool on);
// Which copy the 8-lane kernels run: "x86-64-v3" (AVX2 and FMA), "baseline" (x86-64's SSE2, no
// fused multiply-add), or "build target" where there is no run-time choice (not GCC on x86-64).
const char* narrow_copy();

inline int thread_id() {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

// The number of threads in the current parallel region (1 outside one, or without OpenMP).
inline int team_size() {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

// Floats per thread rounded up to a whole number of 64-byte cache lines, so that two threads never
// write into the same line (false sharing).
inline idx padded_floats(idx n) { return (n + 15) / 16 * 16; }

}  // namespace tile
}  // namespace refmath
