// Numerically stable row-wise softmax, y = exp(x - max(x)) / sum(exp(x - max(x))).
//
// Subtracting the row max makes every exponent <= 0, so exp never overflows and the largest term
// is exactly 1, which keeps the sum away from underflow too (catalogue A11).
#include "softmax.h"
#include "tile_math.h"

#include <cmath>
#include <limits>

namespace refmath {

template <typename T>
static void softmax_one_row(const T* x, T* y, std::ptrdiff_t cols) {
    T m = -std::numeric_limits<T>::infinity();
    for (std::ptrdiff_t j = 0; j < cols; ++j) m = x[j] > m ? x[j] : m;

    // Every entry is -inf: the row is fully masked. exp(x - m) would be exp(-inf + inf) = NaN,
    // so return zeros explicitly (the row attends to nothing). The maximum above skips NaN, so a
    // row of -inf and NaN lands here too: it is not masked, and NaN in gives a row of NaN out.
    if (m == -std::numeric_limits<T>::infinity()) {
        bool nan = false;
        for (std::ptrdiff_t j = 0; j < cols; ++j) nan |= x[j] != x[j];
        for (std::ptrdiff_t j = 0; j < cols; ++j)
            y[j] = nan ? std::numeric_limits<T>::quiet_NaN() : T(0);
        return;
    }

    // Accumulate in double even for float rows: a long float sum loses digits that the rest of the
    // computation cannot win back, and the wider accumulator costs next to nothing here.
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (std::ptrdiff_t j = 0; j < cols; ++j) {
        y[j] = std::exp(x[j] - m);
        s += y[j];
    }

    // Divide rather than multiply by 1/s: one rounding per output instead of two.
    const T sum = static_cast<T>(s);
#pragma omp simd
    for (std::ptrdiff_t j = 0; j < cols; ++j) y[j] /= sum;
}

template <typename T>
void softmax_rows(const T* x, T* y, std::ptrdiff_t rows, std::ptrdiff_t cols) {
    // Rows are independent, so they split across threads with no synchronisation. Small inputs stay
    // on one thread: waking a thread team costs more than softmaxing a few thousand numbers.
#pragma omp parallel for schedule(static) if (rows * cols >= 32768) num_threads(tile::max_threads())
    for (std::ptrdiff_t r = 0; r < rows; ++r) softmax_one_row(x + r * cols, y + r * cols, cols);
}

template void softmax_rows<float>(const float*, float*, std::ptrdiff_t, std::ptrdiff_t);
template void softmax_rows<double>(const double*, double*, std::ptrdiff_t, std::ptrdiff_t);

}  // namespace refmath
