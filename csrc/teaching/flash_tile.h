// The online-softmax step of a tiled attention forward: the one function the kernel assignment
// asks for (flash_tile.cpp), and the interface the given pybind11 module (flash_forward_module.cpp)
// calls it through.
#pragma once

// Fold one tile of keys into the running state of one tile of queries (catalogue F1-F3), float32.
//
//   q       rows x d   this tile's queries, row-major
//   k       cols x d   this tile's keys
//   v       cols x dv  this tile's values
//   visible rows x cols, 1 where query r may see key c; nullptr when every pair is visible
//   scale   the softmax scale tau (1/sqrt(d) unless the caller says otherwise)
//   m       rows       running maximum of the visible scaled scores s = tau q.k (-inf: none yet)
//   l       rows       running sum of exp(s - m) over the keys folded so far
//   acc     rows x dv  running sum of exp(s - m) v
//
// Before the first tile m = -inf, l = 0, acc = 0; after the last, o = acc / l and
// lse = m + log(l). A row that sees no key of this tile keeps its state exactly.
void online_softmax_tile(const float* q, const float* k, const float* v,
                         const unsigned char* visible, int rows, int cols, int d, int dv,
                         float scale, float* m, float* l, float* acc);
