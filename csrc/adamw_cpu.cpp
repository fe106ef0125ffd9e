// AdamW's update in one pass: each element of p, g, m, v is read once and p, m, v written once
// (28 bytes per float32 parameter), against the fifteen passes over cache-sized blocks of the
// NumPy form in refmath/flat_adamw.py. The arithmetic is that form's, operation for operation.
//
// Bit for bit NumPy takes three things:
// * No fused multiply-add. setup.py builds the module with -ffp-contract=fast (the attention
//   kernels want their a*b + c fused), and the x86-64-v3 clone below has FMA, so GCC would fuse
//   m*b1 + g*c1 into one rounding where NumPy rounds the product first. The pragma below turns
//   contraction off for this file. (Clang's -ffp-contract=fast ignores pragmas: a Clang build has
//   no FMA clone on x86, but with -march=native or on ARM it may fuse; the tests would say so.)
// * No errno for sqrt. With -fmath-errno (GCC's default) each sqrt is checked for a negative
//   input to set errno, and a loop with that check stays scalar; setup.py passes -fno-math-errno
//   (a pragma cannot: GCC decides it for the whole file). Nothing reads errno, and sqrt's value is
//   IEEE's correctly rounded one either way.
// * No other reordering: no -ffast-math, so the vectoriser keeps every operation and its order
//   and only does 8 (or 4) elements at a time; each vector division and square root is correctly
//   rounded like the scalar one, so the vector body and the scalar tail give the same bits.
#include "adamw_cpu.h"

#include <algorithm>
#include <vector>

#include "tile_math.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma clang fp contract(off)
#endif

namespace refmath {

namespace {

using tile::idx;

// The square root as the builtin, not std::sqrt: GCC does not inline <cmath>'s std::sqrt, whose
// options are not this file's after the pragma above, and a call would keep the loop scalar.
REFMATH_INLINE float square_root(float x) { return __builtin_sqrtf(x); }
REFMATH_INLINE double square_root(double x) { return __builtin_sqrt(x); }

// n elements from the start of each pointer. __restrict: the caller has checked that the arrays
// do not overlap, which lets the compiler vectorise without testing it at run time.
template <typename T>
REFMATH_INLINE void update(T* __restrict p, const T* __restrict g, T* __restrict m,
                           T* __restrict v, idx n, T shrink, const AdamWScalars<T>& s) {
    const T b1 = s.beta1, c1 = s.one_minus_beta1, b2 = s.beta2, c2 = s.one_minus_beta2;
    const T bias1 = s.bias1, bias2 = s.bias2, lr = s.lr, eps = s.eps;
    for (idx i = 0; i < n; ++i) {
        const T gi = g[i];
        const T mi = m[i] * b1 + gi * c1;          // two rounded products, a rounded sum
        const T vi = v[i] * b2 + (gi * gi) * c2;
        const T step = (mi / bias1) * lr / (square_root(vi / bias2) + eps);
        // The decay before the Adam step, as in AdamW (O4). Without decay shrink is 1, and x * 1
        // is x for every float, so this is the NumPy form's skipped multiplication.
        p[i] = p[i] * shrink - step;
        m[i] = mi;
        v[i] = vi;
    }
}

// One clone for x86-64-v3 (AVX2: 8 floats or 4 doubles a step) and one for the baseline.
REFMATH_MULTIVERSION
void update_f32(float* p, const float* g, float* m, float* v, idx n, float shrink,
                const AdamWScalars<float>& s) {
    update(p, g, m, v, n, shrink, s);
}

REFMATH_MULTIVERSION
void update_f64(double* p, const double* g, double* m, double* v, idx n, double shrink,
                const AdamWScalars<double>& s) {
    update(p, g, m, v, n, shrink, s);
}

void update_run(float* p, const float* g, float* m, float* v, idx n, float shrink,
                const AdamWScalars<float>& s) {
    update_f32(p, g, m, v, n, shrink, s);
}

void update_run(double* p, const double* g, double* m, double* v, idx n, double shrink,
                const AdamWScalars<double>& s) {
    update_f64(p, g, m, v, n, shrink, s);
}

}  // namespace

template <typename T>
void adamw_step_cpu(T* p, T* m, T* v, const AdamWPiece<T>* pieces, std::ptrdiff_t n_pieces,
                    const AdamWScalars<T>& s, int threads) {
    // starts[k]: the first element of piece k; starts[n_pieces]: the buffers' length.
    std::vector<idx> starts(static_cast<std::size_t>(n_pieces) + 1, 0);
    for (idx k = 0; k < n_pieces; ++k) starts[k + 1] = starts[k] + pieces[k].n;
    const idx n = starts[n_pieces];
    // Each thread takes whole 64-byte lines, so no two threads write into one line (false
    // sharing), and at least one line: a tiny buffer is not worth waking threads for.
    const idx line = 64 / static_cast<idx>(sizeof(T));
    const idx lines = (n + line - 1) / line;
    const idx parts = std::max<idx>(1, std::min<idx>(threads, lines));
    const idx chunk = (lines + parts - 1) / parts * line;
    const int used = static_cast<int>(n == 0 ? 1 : (n + chunk - 1) / chunk);
#pragma omp parallel for schedule(static, 1) num_threads(used)
    for (int t = 0; t < used; ++t) {
        const idx lo = std::min(n, t * chunk), hi = std::min(n, lo + chunk);
        // The piece holding element lo, then each piece until hi.
        idx k = std::upper_bound(starts.begin(), starts.end(), lo) - starts.begin() - 1;
        for (; k < n_pieces && starts[k] < hi; ++k) {
            const idx a = std::max(lo, starts[k]), b = std::min(hi, starts[k + 1]);
            if (a < b)
                update_run(p + a, pieces[k].g + (a - starts[k]), m + a, v + a, b - a,
                           pieces[k].shrink, s);
        }
    }
}

template void adamw_step_cpu<float>(float*, float*, float*, const AdamWPiece<float>*,
                                    std::ptrdiff_t, const AdamWScalars<float>&, int);
template void adamw_step_cpu<double>(double*, double*, double*, const AdamWPiece<double>*,
                                     std::ptrdiff_t, const AdamWScalars<double>&, int);

}  // namespace refmath
