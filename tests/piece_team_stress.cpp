// A stress test of csrc/piece_team.cpp, built by tests/test_piece_team.py with ThreadSanitizer:
// callers on several threads share calls of random sizes; every piece must be run exactly once,
// by a member index below the call's thread count, and ThreadSanitizer must see no data race.
#include <atomic>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "piece_team.h"

namespace {

std::atomic<long> by_helpers{0};  // pieces run by a helper (member > 0)

bool one_caller(unsigned seed, int calls) {
    std::mt19937 rng(seed);
    std::vector<int> runs;
    for (int c = 0; c < calls; ++c) {
        const std::ptrdiff_t pieces = std::uniform_int_distribution<int>(0, 200)(rng);
        const int threads = std::uniform_int_distribution<int>(1, 4)(rng);
        runs.assign(static_cast<std::size_t>(pieces), 0);  // each piece is written by one thread only
        std::atomic<bool> bad_member{false};
        refmath::team::run(pieces, threads, [&](std::ptrdiff_t first, std::ptrdiff_t last, int member) {
            if (first < 0 || last > pieces || first >= last || member < 0 || member >= threads)
                bad_member = true;
            for (std::ptrdiff_t p = first; p < last; ++p) ++runs[static_cast<std::size_t>(p)];
            if (member > 0) by_helpers += last - first;
        });
        for (int r : runs)
            if (r != 1) {
                std::printf("caller %u call %d: a piece ran %d times\n", seed, c, r);
                return false;
            }
        if (bad_member) {
            std::printf("caller %u call %d: a run out of range\n", seed, c);
            return false;
        }
        if (c % 97 == 0) std::this_thread::sleep_for(std::chrono::microseconds(300));  // helpers sleep
    }
    return true;
}

}  // namespace

int main() {
    // One caller, whose calls the helpers share; then three at once, of which one at a time has
    // the helpers and the others run alone.
    std::atomic<bool> ok{one_caller(99, 3000)};
    const long alone_phase = by_helpers.load();
    std::vector<std::thread> callers;
    for (unsigned s = 0; s < 3; ++s)
        callers.emplace_back([&, s] { ok = one_caller(s, 3000) && ok; });
    for (std::thread& t : callers) t.join();
    if (!ok) return 1;
    std::printf("ok: pieces run by helpers: %ld with one caller, %ld in all\n", alone_phase,
                by_helpers.load());
    return 0;
}
