// The piece team of piece_team.h: one calling thread at a time, helpers that spin briefly and
// then sleep, and runs of pieces taken from a shared counter.
#include "piece_team.h"

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>
#define REFMATH_POSIX 1
#else
#define REFMATH_POSIX 0
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <mutex>
#include <system_error>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace refmath {
namespace team {
namespace {

using idx = std::ptrdiff_t;
using Clock = std::chrono::steady_clock;

// Free cores where nobody has counted them: as many as a call asks for.
constexpr int kAll = std::numeric_limits<int>::max();

// A word that says "no piece left" whatever a call's piece count (which must stay below it).
constexpr std::uint32_t kClosed = 0xffffffffu;

inline void relax() {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

// The current call. `claim` holds the call's number (high 32 bits) and its next untaken piece
// (low 32 bits), so that one compare-exchange both takes a piece and checks that the call is the
// one whose fields the taker read. A helper reads the fields after it sees a new number; if the
// caller has meanwhile finished that call and begun writing the next one's fields, it had first set
// the piece word to kClosed, so the helper's compare-exchange fails and it runs nothing with fields
// of the wrong call. All operations are sequentially consistent (a few per piece), which is what
// makes that argument hold.
struct Team {
    std::atomic<std::uint64_t> claim{0};
    std::atomic<PieceFn> fn{nullptr};
    std::atomic<void*> context{nullptr};
    std::atomic<idx> pieces{0};
    std::atomic<int> threads{0};
    std::atomic<idx> done{0};      // pieces finished in the current call
    std::atomic<bool> busy{false};  // a caller holds the team
    std::atomic<int> sleepers{0};  // helpers asleep (or about to be) on `wake`
    std::atomic<int> last_used{0};  // the threads the last shared call allowed (usable_threads)
    std::mutex mutex;
    std::condition_variable wake;
    // Changed only by the caller that holds `busy`:
    int helpers = 0;                   // made so far
    int free = kAll;                   // cores other processes leave free, as last counted
    int free_before = kAll;            // and as counted the time before
    Clock::time_point counted{};       // when last counted
};

inline std::uint32_t call_of(std::uint64_t claim) {
    return static_cast<std::uint32_t>(claim >> 32);
}
inline std::uint64_t word(std::uint32_t call, std::uint32_t next) {
    return (static_cast<std::uint64_t>(call) << 32) | next;
}

// Takes the next run of pieces of call `call` into [first, last): a part of what is left, which
// shrinks as the call goes on (long runs first, for long forward reads; single pieces at the end,
// so that a thread that is parked mid-run holds up little). False when none is left or the call
// is over.
bool take(Team& t, std::uint32_t call, idx pieces, int threads, idx& first, idx& last) {
    std::uint64_t c = t.claim.load();
    for (;;) {
        if (call_of(c) != call) return false;
        first = static_cast<idx>(c & kClosed);
        if (first >= pieces) return false;
        last = first + std::max<idx>(1, (pieces - first) / (threads + 1));
        if (t.claim.compare_exchange_weak(c, c + static_cast<std::uint64_t>(last - first)))
            return true;
    }
}

// Never destroyed: helpers may still be asleep on its condition variable when the process exits.
std::atomic<Team*> current{nullptr};

// A child made by fork() has only the forking thread: it starts a new team with no helpers (the
// old one's state belongs to threads the child does not have).
#if REFMATH_POSIX
void after_fork_in_child() { current.store(new Team); }
#endif

Team& the_team() {
    static const bool once = [] {
        current.store(new Team);
#if REFMATH_POSIX
        pthread_atfork(nullptr, nullptr, after_fork_in_child);
#endif
        return true;
    }();
    (void)once;
    return *current.load();
}

// A helper's life: wait for a call with a new number (spinning kSpinMicroseconds after its last
// one, then asleep), take pieces until none is left, and wait again.
void helper(Team* t, int member, std::uint32_t seen) {
    bool spin = true;
    for (;;) {
        std::uint64_t c = t->claim.load();
        if (call_of(c) == seen) {
            const Clock::time_point start = Clock::now();
            for (int i = 0; spin; ++i) {
                relax();
                c = t->claim.load();
                if (call_of(c) != seen) break;
                if ((i & 63) == 63 &&
                    Clock::now() - start > std::chrono::microseconds(kSpinMicroseconds))
                    break;
            }
            if (call_of(c) == seen) {
                std::unique_lock<std::mutex> lock(t->mutex);
                t->sleepers.fetch_add(1);
                t->wake.wait(lock, [&] {
                    c = t->claim.load();
                    return call_of(c) != seen;
                });
                t->sleepers.fetch_sub(1);
            }
        }
        seen = call_of(c);
        const PieceFn fn = t->fn.load();
        void* const context = t->context.load();
        const idx pieces = t->pieces.load();
        const int threads = t->threads.load();
        // A helper beyond this call's thread count sits it out, and sleeps rather than spins
        // until the next one.
        spin = member < threads;
        if (!spin) continue;
        for (idx first, last; take(*t, seen, pieces, threads, first, last);) {
            fn(context, first, last, member);
            t->done.fetch_add(last - first);
        }
    }
}

// The kernel's count of runnable tasks, all processes' (the fourth field of /proc/loadavg,
// "runnable/existing"), or -1 where it cannot be read.
int runnable_tasks() {
#ifdef __linux__
    const int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    char text[128];
    const ssize_t got = read(fd, text, sizeof text - 1);
    close(fd);
    if (got <= 0) return -1;
    text[got] = 0;
    const char* p = text;
    for (int field = 0; field < 3; ++field) {  // three load averages, each followed by a space
        while (*p != 0 && *p != ' ') ++p;
        while (*p == ' ') ++p;
    }
    int count = 0;
    bool digits = false;
    for (; *p >= '0' && *p <= '9'; ++p, digits = true) count = count * 10 + (*p - '0');
    return digits && *p == '/' ? count : -1;
#else
    return -1;
#endif
}

// How many threads a call may use: `threads`, or fewer while other processes keep cores busy.
// The cores minus the runnable tasks that are not this team's (the calling thread, and the
// helpers not asleep) are free. A task that runs for a moment (a short command, a kernel thread,
// this process's own BLAS threads as they finish) would cut the team for nothing, so the larger
// of the last two counts holds, taken at least kRecount apart: a busy process is in both. Only who
// runs the pieces follows the count, never how the work is cut, so the results do not depend on
// the load.
int usable_threads(Team& t, int threads) {
    constexpr auto kRecount = std::chrono::milliseconds(10);
#if REFMATH_POSIX
    static const long cores = sysconf(_SC_NPROCESSORS_ONLN);
#else
    static const long cores = static_cast<long>(std::thread::hardware_concurrency());
#endif
    const Clock::time_point now = Clock::now();
    if (now - t.counted > kRecount) {  // (the first time too: `counted` starts at the epoch)
        t.counted = now;
        const int runnable = runnable_tasks();
        const int ours = 1 + t.helpers - t.sleepers.load();
        t.free_before = t.free;
        t.free = runnable < 0 || cores < 1 ? kAll : static_cast<int>(cores) - (runnable - ours);
    }
    return std::clamp(std::max(t.free, t.free_before), 1, threads);
}

void run_alone(idx pieces, PieceFn fn, void* context) {
    fn(context, 0, pieces, 0);
}

}  // namespace

int last_threads_used() { return the_team().last_used.load(); }

void run_pieces(std::ptrdiff_t pieces, int threads, PieceFn fn, void* context) {
    if (pieces <= 0) return;
    if (threads <= 1 || pieces == 1 || pieces >= static_cast<idx>(kClosed))
        return run_alone(pieces, fn, context);
    Team& t = the_team();
    bool held = false;
    if (!t.busy.compare_exchange_strong(held, true)) return run_alone(pieces, fn, context);
    threads = usable_threads(t, threads);
    t.last_used.store(threads);
    if (threads == 1) {
        run_alone(pieces, fn, context);
        t.busy.store(false);
        return;
    }

    const std::uint32_t call = call_of(t.claim.load()) + 1;
    while (t.helpers < threads - 1) {
        try {
            std::thread(helper, &t, t.helpers + 1, call - 1).detach();
        } catch (const std::system_error&) {
            break;  // no thread to be had: this call goes on with the helpers it has
        }
        ++t.helpers;
    }
    t.fn.store(fn);
    t.context.store(context);
    t.pieces.store(pieces);
    t.threads.store(threads);
    t.done.store(0);
    t.claim.store(word(call, 0));
    if (t.sleepers.load() > 0) {
        // Taking the mutex orders this call's number before the check of any helper that was
        // between its last look and its sleep; it is released before the notification.
        { std::lock_guard<std::mutex> lock(t.mutex); }
        t.wake.notify_all();
    }

    idx mine = 0;
    for (idx first, last; take(t, call, pieces, threads, first, last); mine += last - first)
        fn(context, first, last, 0);
    // Every piece is taken; wait for the ones a helper is still running (yielding the core after a
    // while, in case the scheduler has parked that helper behind this thread).
    const idx others = pieces - mine;
    for (int i = 0; t.done.load() < others; ++i) {
        if (i < 4096)
            relax();
        else
            std::this_thread::yield();
    }
    t.claim.store(word(call, kClosed));
    t.busy.store(false);
}

}  // namespace team
}  // namespace refmath
