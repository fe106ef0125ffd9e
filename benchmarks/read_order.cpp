// What a core's hardware prefetchers carry, by the order of the reads: C++ loops that read K and V
// as the decode kernel does (8 KiB blocks of 16 rows of 128 floats, a block of K then one of V,
// 256 MiB in all, 2 MiB pages where granted), with multiply-adds on registers after every 64-byte
// read, in two orders:
//   memory  each block front to back, line after line;
//   tiles   the order of the kernel's register tiles (csrc/decode_cpu.cpp): the key rows four at
//           a time side by side (64 bytes of each in turn), the value rows down columns of 32
//           floats (the 16 rows' first 128 bytes, then their next 128, ...);
// each with no software requests, and with a level-2 request (prefetcht1) for one line of the next
// block after every read, as the kernel spreads its requests. 'memory + level-1 loads' adds a load
// from a 2 KiB table held in level 1 beside every read of memory, summed on its own (added into an
// accumulator that also waits on memory, it would hold the core back behind each miss, which is
// another matter than what the prefetchers follow). Every loop runs with 1 multiply-add per read
// and with 4, the kernel's own rate (per key and key/value head it reads 16 lines, 8 of K and 8 of
// V, and does 64 multiply-adds of 16 lanes at R = 4 query heads). Each loop runs once per round,
// the order of the loops rotating, after an untimed read of 256 MiB of other memory.
//
// Every accumulator index is known at compile time (the loops over a tile's rows and over a run of
// 8 lines are unrolled), so the accumulators stay in registers. An index computed at run time kept
// them in memory, a store and a load around every multiply-add, in the first version's memory-order
// loops and its value tiles without requests (records 2026-12-07-1902-read_order.md and -2.md).
//
// Build and run with benchmarks/read_order.sh. Nothing is asserted: the figures belong to the
// machine and its load.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));
using idx = long;

constexpr idx kRows = 16, kWidth = 128, kBlockFloats = kRows * kWidth;  // one 8 KiB block
constexpr idx kFloats = 8L * 32768 * kWidth;  // K (and V): 8 heads of 32k keys, 128 MiB

float* allocate(idx floats) {
    const std::size_t bytes = static_cast<std::size_t>(floats) * sizeof(float);
    void* p = std::aligned_alloc(2 << 20, (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20));
    if (p == nullptr) {
        std::perror("aligned_alloc");
        std::exit(1);
    }
    madvise(p, bytes, MADV_HUGEPAGE);
    std::memset(p, 0, bytes);  // every page touched before timing
    return static_cast<float*>(p);
}

inline v16 load(const float* p) {
    v16 x;
    std::memcpy(&x, p, sizeof x);
    return x;
}

enum class Order { memory, memory_l1, tiles };

float table[512] __attribute__((aligned(64)));  // 2 KiB, read beside memory in 'memory_l1'

// Read one 8 KiB block (key: whether it is a key block, which the tiles read four rows at a time)
// into the accumulators, with `work` multiply-adds per 64-byte read; with 'requests', one
// prefetcht1 of the next block per read.
template <Order order, bool requests, int work>
inline void read_block(const float* block, bool key, v16 (&acc)[8], v16 q, v16& side) {
    const char* next = reinterpret_cast<const char*>(block + kBlockFloats);
    idx line = 0;
    auto use = [&](const float* p, int a) {
        const v16 x = load(p);
#pragma GCC unroll 8
        for (int w = 0; w < work; ++w) acc[(a + w) % 8] += x * q;
        if (requests) __builtin_prefetch(next + 64 * line++, 0, 2);
    };
    if (order != Order::tiles) {
        for (idx i = 0; i < kBlockFloats; i += 128) {
#pragma GCC unroll 8
            for (int u = 0; u < 8; ++u) {
                use(block + i + 16 * u, u);
                if (order == Order::memory_l1) side += load(table + (i + 16 * u) % 512);
            }
        }
    } else if (key) {
        for (idx j = 0; j < kRows; j += 4)
            for (idx d = 0; d < kWidth; d += 16)
#pragma GCC unroll 4
                for (int r = 0; r < 4; ++r) use(block + (j + r) * kWidth + d, r);
    } else {
        for (idx d = 0; d < kWidth; d += 32)
            for (idx j = 0; j < kRows; j += 4)
#pragma GCC unroll 4
                for (int r = 0; r < 4; ++r) {
                    use(block + (j + r) * kWidth + d, r);
                    use(block + (j + r) * kWidth + d + 16, 4 + r);
                }
    }
}

volatile float factor = 1.0f;  // the multiplier, opaque to the compiler

template <Order order, bool requests, int work>
float read_all(const float* k, const float* v) {
    v16 acc[8] = {};
    v16 side = {};
    const v16 q = v16{} + factor;
    for (idx b = 0; b < kFloats; b += kBlockFloats) {
        read_block<order, requests, work>(k + b, true, acc, q, side);
        read_block<order, requests, work>(v + b, false, acc, q, side);
    }
    v16 s = acc[0] + side;
    for (int i = 1; i < 8; ++i) s += acc[i];
    return s[0];
}

struct Loop {
    const char* name;
    float (*run[2])(const float*, const float*);  // 1 and 4 multiply-adds per read
};

}  // namespace

int main(int argc, char** argv) {
    const int rounds = argc > 1 ? std::max(1, std::atoi(argv[1])) : 7;
    const Loop loops[] = {
        {"memory, no requests", read_all<Order::memory, false, 1>,
         read_all<Order::memory, false, 4>},
        {"memory + level-1 loads, no requests", read_all<Order::memory_l1, false, 1>,
         read_all<Order::memory_l1, false, 4>},
        {"tiles, no requests", read_all<Order::tiles, false, 1>, read_all<Order::tiles, false, 4>},
        {"memory, requests", read_all<Order::memory, true, 1>, read_all<Order::memory, true, 4>},
        {"tiles, requests", read_all<Order::tiles, true, 1>, read_all<Order::tiles, true, 4>},
    };
    constexpr int n = sizeof loops / sizeof loops[0];
    // One block more than is read: the requests made during the last block fall in it.
    float* k = allocate(kFloats + kBlockFloats);
    float* v = allocate(kFloats + kBlockFloats);
    float* other = allocate(2 * kFloats);
    std::vector<double> rates[n][2];
    volatile float sink = 0;
    for (int round = 0; round < rounds; ++round)
        for (int t = 0; t < 2 * n; ++t) {
            const int i = (t + round) % (2 * n), loop = i / 2, work = i % 2;
            float s = 0;
            for (idx x = 0; x < 2 * kFloats; x += 16) s += other[x];  // evict K and V
            const auto start = std::chrono::steady_clock::now();
            s += loops[loop].run[work](k, v);
            const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
            sink = sink + s;
            rates[loop][work].push_back(2.0 * kFloats * sizeof(float) / took.count() / 1e9);
        }
    std::printf("1 thread, K and V 256 MiB in 8 KiB blocks, %d rounds: GB/s, median (range)\n",
                rounds);
    std::printf("  %-38s %-19s %s\n", "", "1 multiply-add/read", "4 (the kernel's rate)");
    for (int i = 0; i < n; ++i) {
        std::printf("  %-38s", loops[i].name);
        for (int work = 0; work < 2; ++work) {
            std::vector<double> r = rates[i][work];
            std::sort(r.begin(), r.end());
            std::printf(" %5.1f (%5.1f-%5.1f)", r[r.size() / 2], r.front(), r.back());
        }
        std::printf("\n");
    }
    return 0;
}
