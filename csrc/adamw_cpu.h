// One AdamW step (catalogue O4) over flat buffers of parameters and moments, in one pass over
// memory: the plain C++ interface that bindings.cpp wraps. Free of pybind11 and Python.
//
// The arithmetic is that of refmath/flat_adamw.py's _adamw_part, operation for operation, each
// result rounded to T, so the buffers come out bit for bit as NumPy's would.
#pragma once

#include <cstddef>

namespace refmath {

// The step's scalars, each already rounded to T the way NumPy rounds the Python float it meets
// next to an array of dtype T (refmath/flat_adamw.py computes them in double and rounds once).
template <typename T>
struct AdamWScalars {
    T beta1, one_minus_beta1;  // beta1 and 1 - beta1
    T beta2, one_minus_beta2;  // beta2 and 1 - beta2
    T bias1, bias2;            // 1 - beta1^s and 1 - beta2^s
    T lr, eps;
};

// A stretch of n consecutive elements of the buffers: its gradients (read where they lie, e.g. in
// the parameter's own gradient array) and its decay factor 1 - lr * weight_decay (1 for no decay).
template <typename T>
struct AdamWPiece {
    const T* g;
    std::ptrdiff_t n;
    T shrink;
};

// p, m, v hold the sum of the pieces' n elements; piece k covers the elements after piece k - 1.
// Per element, in this order and rounded to T at each step:
//   m = m b1 + g (1 - b1);  v = v b2 + (g g)(1 - b2);
//   p = p shrink - (m / bias1) lr / (sqrt(v / bias2) + eps)
// The elements are cut into at most 'threads' stretches of whole cache lines, one per OpenMP
// thread; the result does not depend on the cut. The arrays must not overlap (the caller checks).
template <typename T>
void adamw_step_cpu(T* p, T* m, T* v, const AdamWPiece<T>* pieces, std::ptrdiff_t n_pieces,
                    const AdamWScalars<T>& s, int threads);

extern template void adamw_step_cpu<float>(float*, float*, float*, const AdamWPiece<float>*,
                                           std::ptrdiff_t, const AdamWScalars<float>&, int);
extern template void adamw_step_cpu<double>(double*, double*, double*, const AdamWPiece<double>*,
                                            std::ptrdiff_t, const AdamWScalars<double>&, int);

}  // namespace refmath
