// REFMATH_HD marks the index arithmetic that both the kernels (nvcc) and the CPU model tests (g++,
// tests/test_kernels_*_model.py) compile: __host__ __device__ under nvcc, nothing under g++.
#pragma once

#if defined(__CUDACC__)
#define REFMATH_HD __host__ __device__
#else
#define REFMATH_HD
#endif
