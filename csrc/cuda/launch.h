// Host-side launchers for the CUDA kernels: plain C++ declarations.
//
// bindings.cpp (compiled by the host compiler, with pybind11) includes this header; softmax.cu
// (compiled by nvcc, without pybind11) defines it. Keeping pybind11 out of nvcc's way avoids a
// whole class of front-end incompatibilities and keeps the .cu files about the GPU only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace refmath_cuda {

// Element types the launchers accept; the Python side passes these codes.
enum DType : int { kFloat32 = 0, kFloat64 = 1 };

// out[r, :] = softmax(in[r, :]) for `rows` rows of `cols` contiguous values, on `stream`.
// Fully masked rows (all -inf) give zeros. Returns the launch status (cudaSuccess if queued);
// errors during the kernel's run surface at the next synchronising call, as usual in CUDA.
cudaError_t softmax_rows(const void* in, void* out, std::int64_t rows, std::int64_t cols,
                         DType dtype, cudaStream_t stream);

}  // namespace refmath_cuda
