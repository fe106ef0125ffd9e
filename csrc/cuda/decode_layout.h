// Where each warp and lane of paged_decode.cu's split kernel reads, as plain integer functions.
//
// They live apart from the kernel so that the CPU test suite can run them: the test
// (tests/test_kernels_decode_model.py) compiles this header with the host compiler, prints what
// each function gives, and plays the block's program on NumPy in float64: which warp scores which
// key of a tile, which lane sums which part of a dot product, which lane accumulates which output
// column, and the log-sum-exp merge of the warps' partial softmax states, checked against a plain
// float64 decode attention. No CUDA header is needed here.
//
// The block serves up to kHeads query heads of one GQA group (they share every K/V row it loads)
// and walks its tokens in tiles of kBlockK keys. A tile is split across the warps: warp w takes
// the keys [slice_begin(w, n), slice_end(w, n)) of a tile with n valid keys, for all the heads,
// so each K and V element of the tile is read from shared memory by exactly one lane of one warp.
// Each warp keeps its own running (m, l, u) per head; the warps' states are merged once, at the
// end of the split (the same formula as the merge of splits, F3).
#pragma once

#include "host_device.h"

namespace refmath_cuda {
namespace decode {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kHeads = 8;                         // query heads per block
constexpr int kBlockK = 32;                       // keys per tile
constexpr int kKeysPerWarp = kBlockK / kWarps;    // 8: one warp's slice of a tile
constexpr int kLanesPerKey = 32 / kKeysPerWarp;   // 4 lanes share one key's dot products
static_assert(kBlockK % kWarps == 0 && 32 % kKeysPerWarp == 0, "slices of whole lane groups");

// The keys of a tile with n <= kBlockK valid keys that warp w scores: consecutive runs of
// kKeysPerWarp, cut at n (the last tile of a split, or of a sequence, may end mid-slice; a warp
// whose slice starts at or past n has nothing to do in that tile).
REFMATH_HD constexpr int clamp_to(int x, int n) { return x < n ? x : n; }
REFMATH_HD constexpr int slice_begin(int warp, int n) { return clamp_to(warp * kKeysPerWarp, n); }
REFMATH_HD constexpr int slice_end(int warp, int n) { return clamp_to((warp + 1) * kKeysPerWarp, n); }

// Scores. Lane l of warp w takes key slice_begin(w, kBlockK) + lane_key(l) of the tile and sums
// the part lane_part(l) of its dot products with every head's q: the 32-bit words
// score_word(l, 0), score_word(l, 1), ... of the key row (a word is 2 columns of a 16-bit type, 1
// of float32). The kLanesPerKey lanes of a key read consecutive words (16 contiguous bytes), and
// two shuffles add their parts.
REFMATH_HD constexpr int lane_key(int lane) { return lane / kLanesPerKey; }
REFMATH_HD constexpr int lane_part(int lane) { return lane % kLanesPerKey; }
REFMATH_HD constexpr int score_word(int lane, int i) { return lane_part(lane) + i * kLanesPerKey; }
REFMATH_HD constexpr int score_words_per_lane(int row_words) { return row_words / kLanesPerKey; }

// K rows in shared memory: row_words 32-bit words plus 4 of padding. The lanes of one score read
// (8 keys x 4 consecutive words) then meet 32 different banks: the rows start 4 banks apart.
REFMATH_HD constexpr int k_stride_words(int row_words) { return row_words + 4; }

// P V. Lane l accumulates, for every head, the output columns pv_column(l, 0), pv_column(l, 1),
// ... over the keys of its warp's slice: V row r is read once, by its warp, each lane its columns
// (consecutive lanes on consecutive elements: no bank conflicts).
REFMATH_HD constexpr int pv_column(int lane, int cc) { return lane + 32 * cc; }

// The tile copy, global -> shared, in 16-byte pieces of pieces_per_row per row: piece i of the
// tile is row i / pieces_per_row, piece i % pieces_per_row; thread x of the block copies pieces
// x, x + kThreads, ... (consecutive threads on consecutive pieces of a row: coalesced).
struct RowPiece {
    int row, piece;
};
REFMATH_HD constexpr RowPiece copy_piece(int i, int pieces_per_row) {
    return {i / pieces_per_row, i % pieces_per_row};
}
REFMATH_HD constexpr int copy_rounds(int pieces_per_row) {
    return (kBlockK * pieces_per_row + kThreads - 1) / kThreads;
}

// The merge of the warps' states at the end of a split: thread x of the block combines
// (head, column) = merge_item(x + k kThreads), k = 0, 1, ..., for the items below kHeads x width.
struct HeadColumn {
    int head, column;
};
REFMATH_HD constexpr HeadColumn merge_item(int i, int width) { return {i / width, i % width}; }

}  // namespace decode
}  // namespace refmath_cuda
