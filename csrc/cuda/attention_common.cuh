// What the attention kernels share: element conversions, warp reductions, the mask band, and the
// host-side argument checks and launch helpers. Included by the .cu files only (never by the
// bindings, which see launch.h alone).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "launch.h"

namespace refmath_cuda {

constexpr int kWarpSize = 32;
constexpr int kMaxHeadDim = 256;     // the largest D of v1, v2, the backward and decode
constexpr int kMaxSequence = 1 << 30;  // T_q, T_k, page sizes: int arithmetic never overflows
// B, H, G, B * H and B * G at most 2**31 - 1: the kernels index (batch, head) pairs with an int,
// and the host's products of them with T_q, T_k or the splits then fit in int64.
constexpr std::int64_t kMaxCount = INT_MAX;

// "" if B, H and G (each >= 0) are within kMaxCount, alone and as the products above.
inline std::string check_counts(std::int64_t batch, std::int64_t heads, std::int64_t kv_heads) {
    const bool ok = batch <= kMaxCount && heads <= kMaxCount && kv_heads <= kMaxCount &&
                    batch * heads <= kMaxCount && batch * kv_heads <= kMaxCount;
    if (ok) return "";
    return "B=" + std::to_string(batch) + ", H=" + std::to_string(heads) + ", G=" +
           std::to_string(kv_heads) + ": B, H, G, B*H and B*G must each be at most 2**31 - 1";
}

__host__ __device__ inline int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ inline int imin(int a, int b) { return a < b ? a : b; }
__host__ __device__ inline int imax(int a, int b) { return a > b ? a : b; }

// ---- element types: every kernel computes in float32 whatever it loads and stores ----

__device__ inline float to_float(float x) { return x; }
__device__ inline float to_float(__half x) { return __half2float(x); }
__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ inline T from_float(float x);
template <> __device__ inline float from_float<float>(float x) { return x; }
template <> __device__ inline __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// ---- NaN in, NaN out ----
//
// fmaxf(a, NaN) is a: a running maximum built on it forgets a NaN score, and a row whose only
// visible score is NaN would then look fully masked (o = 0, lse = -inf). Every maximum of scores
// is taken with nan_max instead, which is NaN if either argument is; the softmax state of that
// row then becomes NaN and stays so, as the reference's does.
__device__ inline float nan_max(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    float m;  // one instruction (sm_80 and newer): the canonical NaN if a or b is NaN
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
    return m;
#else
    return (a > b || a != a) ? a : b;
#endif
}

// Whether an element is infinite or NaN (all exponent bits set), for the tiles' loaders: a value
// the mask hides must not reach a row through 0 * NaN (see the P V products).
__device__ inline bool nonfinite(float x) { return !isfinite(x); }
__device__ inline bool nonfinite(__half x) { return !isfinite(__half2float(x)); }
__device__ inline bool nonfinite(__nv_bfloat16 x) { return !isfinite(__bfloat162float(x)); }

// ---- warp reductions: every lane of the warp receives the result ----

__device__ inline float warp_max(float x) {  // NaN if any lane's x is NaN
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
        x = nan_max(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

__device__ inline float warp_sum(float x) {
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
        x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// ---- the mask ----
//
// Query i sits at key position pos = i + t_k - t_q (the queries are the last t_q positions). It
// sees the keys [first_key(i), end_key(i)): all of them without a mask, up to pos when causal, and
// only the last `window` of those with a window. The same band as refmath/flash.py's _Band.
struct Band {
    int t_q, t_k;
    bool causal;
    int window;  // 0: none; a window is causal by definition, see make_band

    __host__ __device__ int pos(int i) const { return i + (t_k - t_q); }
    __host__ __device__ int first_key(int i) const {
        return window > 0 ? imax(0, pos(i) - window + 1) : 0;
    }
    __host__ __device__ int end_key(int i) const {
        return causal ? imax(0, imin(t_k, pos(i) + 1)) : t_k;
    }
    __host__ __device__ bool visible(int i, int j) const {
        return j >= first_key(i) && j < end_key(i);
    }
    // The keys seen by at least one of the queries [i0, i1): the ends of each query's interval
    // grow with i, so the union is [first_key(i0), end_key(i1 - 1)). Empty (lo >= hi) if none.
    __host__ __device__ void keys_seen_by(int i0, int i1, int* lo, int* hi) const {
        *lo = first_key(i0);
        *hi = i1 > i0 ? end_key(i1 - 1) : *lo;
    }
    // The queries that see at least one of the keys [j0, j1): key j is seen by the queries with
    // j <= pos <= j + window - 1, again one interval.
    __host__ __device__ void queries_seeing(int j0, int j1, int* lo, int* hi) const {
        const int offset = t_k - t_q;
        *lo = causal ? imax(0, j0 - offset) : 0;
        *hi = window > 0 ? imin(t_q, (j1 - 1) + window - offset) : t_q;
        if (*hi < *lo) *hi = *lo;
    }
};

inline Band make_band(const AttentionProblem& p) {
    Band band;
    band.t_q = static_cast<int>(p.t_q);
    band.t_k = static_cast<int>(p.t_k);
    band.causal = p.causal || p.window > 0;
    // A window at least as long as the keys cuts nothing off: clamp it so int arithmetic is safe.
    band.window = static_cast<int>(p.window > p.t_k ? (p.t_k > 0 ? p.t_k : 1) : p.window);
    return band;
}

// ---- host-side checks and launch helpers ----

inline std::string cuda_message(const char* what, cudaError_t status) {
    return std::string(what) + ": " + cudaGetErrorString(status);
}

// The status of the launch just queued ("" if fine), clearing it so it is not reported twice.
inline std::string launch_status(const char* kernel) {
    const cudaError_t status = cudaGetLastError();
    return status == cudaSuccess ? std::string() : cuda_message(kernel, status);
}

// The checks every attention launcher shares; "" if the problem is well formed.
inline std::string check_problem(const AttentionProblem& p, std::int64_t max_dim) {
    auto num = [](std::int64_t x) { return std::to_string(x); };
    if (p.batch < 0 || p.heads < 0 || p.kv_heads < 0 || p.t_q < 0 || p.t_k < 0)
        return "sizes must be non-negative, got B=" + num(p.batch) + " H=" + num(p.heads) +
               " G=" + num(p.kv_heads) + " T_q=" + num(p.t_q) + " T_k=" + num(p.t_k);
    const std::string counts = check_counts(p.batch, p.heads, p.kv_heads);
    if (!counts.empty()) return counts;
    // G >= 1 even when H = 0: every launcher divides H by G on the host (a division by zero there
    // would kill the process), as the CPU kernels require too.
    if (p.kv_heads < 1 || p.heads % p.kv_heads != 0)
        return "the key/value heads G=" + num(p.kv_heads) + " must be >= 1 and divide the query "
               "heads H=" + num(p.heads);
    if (p.head_dim < 1 || p.head_dim > max_dim)
        return "head width D=" + num(p.head_dim) + " is outside [1, " + num(max_dim) + "]";
    if (p.t_q > kMaxSequence || p.t_k > kMaxSequence)
        return "T_q=" + num(p.t_q) + " and T_k=" + num(p.t_k) + " must be at most 2**30";
    if (p.window < 0) return "window must be >= 0 (0: none), got " + num(p.window);
    if (!std::isfinite(p.scale)) return "scale must be finite";
    return "";
}

// Blocks in a one-dimensional grid: at most 2**31 - 1 (the x limit from compute capability 3.0).
inline std::string check_grid(std::int64_t blocks, const char* what) {
    if (blocks > INT_MAX)
        return std::string(what) + " needs " + std::to_string(blocks) +
               " thread blocks, more than the grid limit 2**31 - 1";
    return "";
}

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// "" if the current device has at least compute capability `major`.0.
inline std::string check_compute_capability(int major, const char* what) {
    int device = 0, have = 0;
    cudaError_t status = cudaGetDevice(&device);
    if (status == cudaSuccess)
        status = cudaDeviceGetAttribute(&have, cudaDevAttrComputeCapabilityMajor, device);
    if (status != cudaSuccess) {
        cudaGetLastError();
        return cuda_message(what, status);
    }
    if (have < major)
        return std::string(what) + " needs compute capability " + std::to_string(major) +
               ".0 or newer; this device has " + std::to_string(have) + ".x";
    return "";
}

// "" if the code of `kernel` that runs on the current device was compiled for a virtual
// architecture of at least `arch` (80 = compute_80): the __CUDA_ARCH__ its body saw. The device's
// own compute capability is not enough to know that: from a build for sm_75 alone, an sm_90 GPU
// runs the compute_75 PTX, JIT-compiled.
template <typename Kernel>
std::string check_compiled_for(Kernel* kernel, int arch, const char* what) {
    cudaFuncAttributes attributes{};
    const cudaError_t status = cudaFuncGetAttributes(&attributes, kernel);
    if (status != cudaSuccess) {
        cudaGetLastError();
        return cuda_message(what, status);
    }
    if (attributes.ptxVersion < arch)
        return std::string(what) + " needs code compiled for compute_" + std::to_string(arch) +
               " or newer, but this build gives the device compute_" +
               std::to_string(attributes.ptxVersion) + " code (rebuild with REFMATH_CUDA_ARCH "
               "listing 80 or newer, e.g. \"80;90\")";
    return "";
}

// Allow `kernel` to use `bytes` of dynamic shared memory. Up to 48 KB needs nothing; above that
// every kernel must opt in (cudaFuncAttributeMaxDynamicSharedMemorySize), up to the device's
// per-block maximum (227 KB on sm_90).
template <typename Kernel>
std::string allow_shared_memory(Kernel* kernel, std::size_t bytes, const char* name) {
    if (bytes <= 48 * 1024) return "";
    int device = 0, optin = 0;
    cudaError_t status = cudaGetDevice(&device);
    if (status == cudaSuccess)
        status = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (status != cudaSuccess) {
        cudaGetLastError();
        return cuda_message(name, status);
    }
    if (bytes > static_cast<std::size_t>(optin))
        return std::string(name) + " needs " + std::to_string(bytes) +
               " bytes of shared memory per block; this device allows " + std::to_string(optin);
    status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes));
    if (status != cudaSuccess) {
        cudaGetLastError();
        return cuda_message(name, status);
    }
    return "";
}

}  // namespace refmath_cuda
