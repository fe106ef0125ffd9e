// A streaming read of a large array with every thread: the machine's memory read bandwidth, the
// ceiling that a decode kernel (which reads each cached key and value once) is measured against.
#pragma once

#include <cstddef>
#include <cstdint>

namespace refmath {

// The sum of n floats, read once from front to back by all OpenMP threads (static chunks). The
// sum is returned so that the compiler cannot drop the reads.
double stream_sum(const float* x, std::ptrdiff_t n);

// The same read of the rows of x (rows of row_len floats) in the order given: rows order[0],
// order[1], ..., order[n_rows - 1], each read front to back, the list cut into one run per thread,
// and the next row of a thread's run requested while it reads one. With the page table of a paged
// cache as the order, the read a paged decode makes, page after scattered page, and nothing else.
// The caller checks that every order[i] is a row of x.
double stream_sum_rows(const float* x, std::ptrdiff_t row_len, const std::int32_t* order,
                       std::ptrdiff_t n_rows);

}  // namespace refmath
