// Which copy of the vectorised kernels runs: 8-lane (AVX2 or the baseline) or 16-lane (AVX-512).
// See REFMATH_AVX512 in tile_math.h.
#include <atomic>

#include "tile_math.h"

namespace refmath {
namespace tile {

namespace {

bool cpu_has_avx512() {
#if REFMATH_HAVE_AVX512 && defined(REFMATH_WIDE_ON_AVX2)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");  // see tile_math.h
#elif REFMATH_HAVE_AVX512
    // The features of x86-64-v4; GCC's check also asks the OS whether it saves the 512-bit state.
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512cd");
#else
    return false;
#endif
}

std::atomic<bool> wide_allowed{true};

}  // namespace

bool wide_vectors() {
    static const bool available = cpu_has_avx512();
    return available && wide_allowed.load(std::memory_order_relaxed);
}

void set_wide_vectors(bool on) { wide_allowed.store(on, std::memory_order_relaxed); }

}  // namespace tile
}  // namespace refmath
