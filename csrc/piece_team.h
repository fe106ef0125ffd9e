// A team that shares a call's pieces of work without waiting for a late member.
//
// An OpenMP parallel region forks and joins: every thread of the team must arrive before the
// region ends, and the waiting thread sleeps (passive wait, see refmath/kernels.py) so that a busy
// neighbour keeps its core. A decode step of a small model makes about 50 such regions, a few
// hundred microseconds apart, and each woke a sleeping thread: about 50 us each in a 2-core VM,
// a third of a token's time at 2 threads. A spinning wait removes that cost but, with one other busy
// process on 2 cores, made 2 threads slower than 1: the region then waits at its end for a thread
// that the scheduler has parked behind the other process.
//
// run_pieces makes a different promise. The work is cut into pieces in a way that does not change
// the output bits; the calling thread takes runs of consecutive pieces (long ones first, single
// pieces at the end) and so does any helper that is awake, and the call returns when every piece
// is done. A helper that arrives late finds nothing left and costs nothing; the caller waits only
// for pieces a helper has already taken. A helper, after its last piece, spins for a short while
// (kSpinMicroseconds, long enough to bridge the serial work between a step's products, short
// enough that a helper of an idle model gives its core back) and then sleeps until the next call.
// While other processes keep cores busy, fewer threads take part (usable_threads in
// piece_team.cpp), so that 2 threads beside a busy process run no slower than 1.
//
// One call at a time uses the helpers; a call made while another runs (from a second Python thread)
// runs all its pieces on its own thread. The helpers are made on first use and never joined (they
// sleep at exit); a child made by fork() starts with none.
#pragma once

#include <algorithm>
#include <cstddef>

namespace refmath {
namespace team {

// A run of consecutive pieces of a call, [first, last) within [0, pieces); member in [0, threads),
// the same for every run one thread takes in a call (0 for the calling thread): the index of
// per-thread scratch. A thread that runs alone is given all the pieces as one run, so a body that
// reads memory in piece order reads it as one stretch. Must not throw.
using PieceFn = void (*)(void* context, std::ptrdiff_t first, std::ptrdiff_t last, int member);

// Runs fn(context, first, last, member) over runs that cover [0, pieces) once, on the calling
// thread and up to threads - 1 helpers, and returns when all are done. threads <= 1 or
// pieces <= 1 runs them as one run on the calling thread.
void run_pieces(std::ptrdiff_t pieces, int threads, PieceFn fn, void* context);

// The same for a callable f(first, last, member).
template <class F>
void run(std::ptrdiff_t pieces, int threads, const F& f) {
    run_pieces(
        pieces, threads,
        [](void* c, std::ptrdiff_t first, std::ptrdiff_t last, int member) {
            (*static_cast<const F*>(c))(first, last, member);
        },
        const_cast<F*>(&f));
}

// For calls that cut each of several products into per_product pieces: the run [first, last) as
// f(product, a, b) for each product it covers, pieces a..b of that product's per_product.
template <class F>
void for_each_part(std::ptrdiff_t first, std::ptrdiff_t last, std::ptrdiff_t per_product,
                   const F& f) {
    for (std::ptrdiff_t piece = first; piece < last;) {
        const std::ptrdiff_t p = piece / per_product;
        const std::ptrdiff_t end = std::min(last, (p + 1) * per_product);
        f(p, piece - p * per_product, end - p * per_product);
        piece = end;
    }
}

// The threads the last call that the team shared allowed to take its pieces: its `threads`, or
// fewer while other processes keep the cores busy (see usable_threads in piece_team.cpp); 0 before
// the first. A call run alone (one thread asked, one piece, or the team busy) leaves it as it was.
int last_threads_used();

// The helpers' spin before sleeping, in microseconds.
constexpr int kSpinMicroseconds = 100;

}  // namespace team
}  // namespace refmath
