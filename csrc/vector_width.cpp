// Which copy of the vectorised kernels runs: 8-lane (AVX2 or the baseline) or 16-lane (AVX-512)
// (see REFMATH_AVX512 in tile_math.h), and how many threads they run on.
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

namespace {
std::atomic<int> threads_set{0}, team_seen{0};
}  // namespace

int thread_limit() { return threads_set.load(std::memory_order_relaxed); }
void set_thread_limit(int n) { threads_set.store(n > 0 ? n : 0, std::memory_order_relaxed); }
void note_team(int size) { team_seen.store(size, std::memory_order_relaxed); }
int last_team() { return team_seen.load(std::memory_order_relaxed); }

// Two versions of one function, chosen when the module loads by the same test as the
// REFMATH_MULTIVERSION kernels' (one bit of libgcc's CPU model, set only where every x86-64-v3
// feature is there and the OS saves the AVX registers): a CPU, or a virtual machine, that hides
// one of those features runs the kernels' baseline copies, at about half their speed, while still
// listing avx2 among its flags.
// (The versions are dispatched only where a call sees them all: here, through narrow_copy.)
#if REFMATH_HAVE_AVX512
namespace {
__attribute__((target("default"))) const char* copy_chosen() { return "baseline"; }
__attribute__((target("arch=x86-64-v3"))) const char* copy_chosen() { return "x86-64-v3"; }
}  // namespace
const char* narrow_copy() { return copy_chosen(); }
#else
const char* narrow_copy() { return "build target"; }
#endif

}  // namespace tile
}  // namespace refmath
