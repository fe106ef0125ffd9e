// A streaming read of a large array with every thread: the machine's memory read bandwidth, the
// ceiling that a decode kernel (which reads each cached key and value once) is measured against.
#pragma once

#include <cstddef>

namespace refmath {

// The sum of n floats, read once from front to back by all OpenMP threads (static chunks). The
// sum is returned so that the compiler cannot drop the reads.
double stream_sum(const float* x, std::ptrdiff_t n);

}  // namespace refmath
