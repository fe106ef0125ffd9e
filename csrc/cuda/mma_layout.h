// Where each lane of a warp reads and writes in flash_v4.cu: the per-lane addressing of ldmatrix,
// of the mma.m16n8k16 fragments and of the tile copies, as plain integer functions.
//
// They live apart from the kernel so that the CPU test suite can run them: the test
// (tests/test_kernels_mma_model.py) compiles this header with the host compiler, prints every
// lane's offsets, and feeds them to a NumPy model of ldmatrix and mma (PTX ISA, "Warp-level matrix
// load instruction: ldmatrix" and "Matrix Fragments for mma.m16n8k16"), checking that the
// fragments the kernel builds are the tiles it means to multiply. No CUDA header is needed here.
//
// Tiles in shared memory are row-major with a row stride of D + kPadV4 elements (16-bit elements):
// 16 bytes of padding make consecutive rows start 4 banks apart, so the 8 rows an ldmatrix phase
// reads (8 x 16 bytes) fall on 32 different banks.
#pragma once

#include "host_device.h"

namespace refmath_cuda {
namespace v4 {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockQ = kWarps * 16;  // 64 query rows per block, 16 per warp
constexpr int kBlockK = 64;           // keys per tile
constexpr int kPadV4 = 8;             // elements (16 bytes) of padding per shared row

REFMATH_HD constexpr int stride(int D) { return D + kPadV4; }

// A position in a tile: element (row, col).
struct RowCol {
    int row, col;
};

// ldmatrix.x4 reads four 8 x 8 matrices of 16-bit elements; lane l gives the address of row l % 8
// of matrix l / 8 (16 contiguous bytes). Lane l then holds, in register i, the two elements
// (l / 4, 2 (l % 4)) and (l / 4, 2 (l % 4) + 1) of matrix i, or with .trans the elements
// (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4).

// The A operand (16 x 16, row-major) at rows r0.., cols c0.. of a tile, with ldmatrix.x4:
// matrices 0..3 are (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15),
// (rows 8-15, cols 8-15): registers a0..a3 of the mma. Lane l gives row l % 16, col 8 (l / 16).
REFMATH_HD constexpr RowCol a_operand_row(int lane) { return {lane % 16, (lane / 16) * 8}; }

// The B operand of S = Q K^T: B[k = d][n = key] = K[key][d], so the 8 x 8 matrices are read from
// K's rows untransposed (lane l / 4 gets key l / 4, dims 2 (l % 4) and + 1: b0's layout). One x4
// covers one n-tile of 8 keys and two k-steps of 16 dims: matrices (keys, dims 0-7), (keys, 8-15),
// (keys, 16-23), (keys, 24-31) are b0, b1 of the first k-step and b0, b1 of the second.
// Lane l gives key l % 8, dim 8 (l / 8).
REFMATH_HD constexpr RowCol k_operand_row(int lane) { return {lane % 8, (lane / 8) * 8}; }

// The B operand of u += P V: B[k = key][n = d] = V[key][d]; b0 needs keys 2t, 2t + 1 of column g,
// which ldmatrix.trans gives from 8 key rows of V. One x4.trans covers one k-step of 16 keys and
// two n-tiles of 8 dims: matrices (keys 0-7, dims 0-7), (keys 8-15, dims 0-7), (keys 0-7, 8-15),
// (keys 8-15, dims 8-15) are b0, b1 of the first n-tile and b0, b1 of the second.
// Lane l gives key l % 8 + 8 ((l / 8) % 2), dim 8 (l / 16).
REFMATH_HD constexpr RowCol v_operand_row(int lane) {
    return {lane % 8 + 8 * ((lane / 8) % 2), (lane / 16) * 8};
}

// The accumulator C (16 x 8, fp32) of mma.m16n8k16: lane l holds c0, c1 at (l / 4, 2 (l % 4) + 0,
// 1) and c2, c3 at (l / 4 + 8, same columns). e = 0..3.
REFMATH_HD constexpr RowCol c_fragment(int lane, int e) {
    return {lane / 4 + 8 * (e / 2), 2 * (lane % 4) + e % 2};
}

// Tile copies global <-> shared in 16-byte chunks (8 elements): chunk i of a tile of D columns is
// row i / (D / 8), columns 8 (i % (D / 8)) .. + 7. Thread x of the block copies the chunks
// x, x + kThreads, ... (consecutive threads: consecutive 16-byte pieces of a row, coalesced).
REFMATH_HD constexpr RowCol tile_chunk(int chunk, int D) { return {chunk / (D / 8), (chunk % (D / 8)) * 8}; }
REFMATH_HD constexpr int chunks_per_thread(int rows, int D) { return rows * (D / 8) / kThreads; }

// The output: each warp writes its 16 rows x D through shared memory, then lane l stores the
// chunks l, l + 32, ... of those rows (16 x D / 8 chunks), 16 bytes each.
REFMATH_HD constexpr int out_chunks_per_lane(int D) { return 16 * (D / 8) / 32; }

}  // namespace v4
}  // namespace refmath_cuda
