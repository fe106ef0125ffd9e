// Row-wise softmax on the GPU, version 1: one thread block per row.
//
// Each block makes three passes over its row: the max (so exp never overflows, catalogue A11), the
// sum of exp(x - max), then the division. Each pass strides the row with all threads, so loads are
// coalesced, and the per-thread partial results meet in a tree reduction in shared memory.
#include <cmath>

#include "launch.h"

namespace refmath_cuda {
namespace {

constexpr int kThreads = 256;  // a power of two, as the tree reduction below requires

__device__ inline float device_exp(float v) { return expf(v); }
__device__ inline double device_exp(double v) { return exp(v); }

struct Max {  // NaN if either is NaN (a row holding a NaN is NaN, not masked)
    template <typename T>
    __device__ T operator()(T a, T b) const { return (a > b || a != a) ? a : b; }
};
struct Sum {
    template <typename T>
    __device__ T operator()(T a, T b) const { return a + b; }
};

// Combine one value per thread into a single value that every thread of the block receives.
template <typename T, typename Op>
__device__ T block_reduce(T* scratch, T value, Op op) {
    scratch[threadIdx.x] = value;
    __syncthreads();
    for (int half = kThreads / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            scratch[threadIdx.x] = op(scratch[threadIdx.x], scratch[threadIdx.x + half]);
        }
        __syncthreads();
    }
    T result = scratch[0];
    __syncthreads();  // every thread must read scratch[0] before the next reduction overwrites it
    return result;
}

template <typename T>
__global__ void softmax_rows_kernel(const T* __restrict__ in, T* __restrict__ out, std::int64_t cols) {
    __shared__ T scratch[kThreads];
    const T* x = in + static_cast<std::int64_t>(blockIdx.x) * cols;
    T* y = out + static_cast<std::int64_t>(blockIdx.x) * cols;

    T m = -INFINITY;
    for (std::int64_t j = threadIdx.x; j < cols; j += kThreads) m = Max()(m, x[j]);
    m = block_reduce(scratch, m, Max());

    // A fully masked row gives zeros instead of exp(-inf + inf) = NaN. Every thread of the block
    // sees the same m, so the whole block returns together and no __syncthreads is left waiting.
    if (m == -INFINITY) {
        for (std::int64_t j = threadIdx.x; j < cols; j += kThreads) y[j] = T(0);
        return;
    }

    T s = 0;
    for (std::int64_t j = threadIdx.x; j < cols; j += kThreads) {
        y[j] = device_exp(x[j] - m);
        s += y[j];
    }
    s = block_reduce(scratch, s, Sum());

    // Each thread divides the entries it wrote itself, so no barrier is needed before this pass.
    for (std::int64_t j = threadIdx.x; j < cols; j += kThreads) y[j] /= s;
}

}  // namespace

cudaError_t softmax_rows(const void* in, void* out, std::int64_t rows, std::int64_t cols,
                         DType dtype, cudaStream_t stream) {
    if (rows == 0 || cols == 0) return cudaSuccess;  // a zero-sized grid is a launch error
    const dim3 grid(static_cast<unsigned>(rows));
    if (dtype == kFloat32) {
        softmax_rows_kernel<float><<<grid, kThreads, 0, stream>>>(
            static_cast<const float*>(in), static_cast<float*>(out), cols);
    } else if (dtype == kFloat64) {
        softmax_rows_kernel<double><<<grid, kThreads, 0, stream>>>(
            static_cast<const double*>(in), static_cast<double*>(out), cols);
    } else {
        return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

}  // namespace refmath_cuda
