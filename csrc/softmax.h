// Row-wise softmax on the CPU: the plain C++ interface that bindings.cpp wraps.
//
// Kept free of pybind11 and Python so the kernel can be read (and reused) on its own.
#pragma once

#include <cstddef>

namespace refmath {

// y[r, :] = softmax(x[r, :]) for each of `rows` rows of `cols` contiguous values.
// A row whose entries are all -inf (fully masked) gives zeros, as the NumPy reference does.
// x and y must not overlap. Defined for float and double.
template <typename T>
void softmax_rows(const T* x, T* y, std::ptrdiff_t rows, std::ptrdiff_t cols);

}  // namespace refmath
