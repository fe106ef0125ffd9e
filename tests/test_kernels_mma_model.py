"""flash_v4.cu's per-lane addressing, run on the CPU through a NumPy model of ldmatrix and mma.

The kernel takes every lane's shared-memory address and fragment position from
``csrc/cuda/mma_layout.h``. This test compiles that header with the host compiler, prints what each
function gives for each lane, and plays the warp's program (the loops of ``flash_v4_kernel``) on
a NumPy model of the two instructions, written from the PTX ISA:

* ``ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16``: lane ``l`` gives the address of row
  ``l % 8`` of matrix ``l / 8``; lane ``l`` then holds in register ``i`` the elements
  ``(l / 4, 2 (l % 4))`` and ``(l / 4, 2 (l % 4) + 1)`` of matrix ``i``, transposed with ``.trans``
  (``(2 (l % 4), l / 4)`` and ``(2 (l % 4) + 1, l / 4)``).
* ``mma.sync.aligned.m16n8k16.row.col`` (g = l / 4, t = l % 4): A (16 x 16) ``a0 = A[g][2t, 2t+1]``,
  ``a1 = A[g+8][2t, 2t+1]``, ``a2 = A[g][2t+8, 2t+9]``, ``a3 = A[g+8][2t+8, 2t+9]``; B (16 x 8)
  ``b0 = B[2t, 2t+1][g]``, ``b1 = B[2t+8, 2t+9][g]``; C and D (16 x 8) ``c0, c1 = C[g][2t, 2t+1]``,
  ``c2, c3 = C[g+8][2t, 2t+1]``.

The products come out exact (small integers in float64), so S = Q K^T and u = P V through the model
must equal NumPy's products exactly; the padding columns of every shared tile hold NaN, so a lane
that reads one poisons the result. The same offsets are checked for shared-memory bank conflicts
and for coalesced global copies. A GPU is not needed; the host compiler (the one that builds
refmath._C) is.
"""
import os
import shutil
import subprocess

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER_DIR = os.path.join(ROOT, "csrc", "cuda")
LANES = 32
DIMS = (64, 128)

DRIVER = r"""
#include <cstdio>
#include <initializer_list>
#include "mma_layout.h"
using namespace refmath_cuda::v4;
int main() {
    std::printf("const threads %d block_q %d block_k %d pad %d\n", kThreads, kBlockQ, kBlockK, kPadV4);
    for (int lane = 0; lane < 32; ++lane) {
        RowCol a = a_operand_row(lane), k = k_operand_row(lane), v = v_operand_row(lane);
        std::printf("lane %d a %d %d k %d %d v %d %d c", lane, a.row, a.col, k.row, k.col, v.row, v.col);
        for (int e = 0; e < 4; ++e) std::printf(" %d %d", c_fragment(lane, e).row, c_fragment(lane, e).col);
        std::printf("\n");
    }
    for (int D : {64, 128}) {
        std::printf("dim %d stride %d per_thread %d out_per_lane %d\n", D, stride(D),
                    chunks_per_thread(kBlockK, D), out_chunks_per_lane(D));
        for (int i = 0; i < kBlockK * D / 8; ++i)
            std::printf("chunk %d %d %d %d\n", D, i, tile_chunk(i, D).row, tile_chunk(i, D).col);
    }
}
"""


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """Every function of mma_layout.h, evaluated by the compiled header itself."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no host C++ compiler to run csrc/cuda/mma_layout.h")
    folder = tmp_path_factory.mktemp("mma_layout")
    source, binary = folder / "driver.cpp", folder / "driver"
    source.write_text(DRIVER)
    subprocess.run([compiler, "-std=c++17", "-I", HEADER_DIR, str(source), "-o", str(binary)], check=True,
                   timeout=120)
    out = subprocess.run([str(binary)], check=True, capture_output=True, text=True, timeout=60).stdout
    lay = {"a": {}, "k": {}, "v": {}, "c": {}, "dims": {}, "chunks": {d: {} for d in DIMS}}
    for line in out.splitlines():
        w = line.split()
        if w[0] == "const":
            lay.update(threads=int(w[2]), block_q=int(w[4]), block_k=int(w[6]), pad=int(w[8]))
        elif w[0] == "lane":
            lane = int(w[1])
            lay["a"][lane] = (int(w[3]), int(w[4]))
            lay["k"][lane] = (int(w[6]), int(w[7]))
            lay["v"][lane] = (int(w[9]), int(w[10]))
            lay["c"][lane] = [(int(w[12 + 2 * e]), int(w[13 + 2 * e])) for e in range(4)]
        elif w[0] == "dim":
            lay["dims"][int(w[1])] = dict(stride=int(w[3]), per_thread=int(w[5]), out_per_lane=int(w[7]))
        elif w[0] == "chunk":
            lay["chunks"][int(w[1])][int(w[2])] = (int(w[3]), int(w[4]))
    return lay


# ---- the instructions, from the PTX ISA ----

def ldmatrix_x4(tile, row_of_lane, trans=False):
    """regs[lane][i] = the two 16-bit elements lane holds in register i, as a pair of floats.
    row_of_lane[l] = (row, col) of the first element of the 8-element row that lane l points at."""
    regs = [[None] * 4 for _ in range(LANES)]
    for i in range(4):
        rows = [row_of_lane[8 * i + r] for r in range(8)]
        matrix = np.array([tile[r, c:c + 8] for r, c in rows])  # 8 x 8, row r from lane 8 i + r
        if trans:
            matrix = matrix.T
        for lane in range(LANES):
            g, t = lane // 4, lane % 4
            regs[lane][i] = (matrix[g, 2 * t], matrix[g, 2 * t + 1])
    return regs


def assemble_a(regs):
    """The 16 x 16 A operand that the per-lane registers (a0..a3) stand for."""
    a = np.full((16, 16), np.nan)
    seen = np.zeros((16, 16), int)
    for lane in range(LANES):
        g, t = lane // 4, lane % 4
        for i, (r, c) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            a[r, c:c + 2] = regs[lane][i]
            seen[r, c:c + 2] += 1
    assert (seen == 1).all()
    return a


def assemble_b(b0, b1):
    """The 16 x 8 B operand of per-lane registers b0, b1 (b0[lane] = (B[2t][g], B[2t+1][g]))."""
    b = np.full((16, 8), np.nan)
    seen = np.zeros((16, 8), int)
    for lane in range(LANES):
        g, t = lane // 4, lane % 4
        b[2 * t:2 * t + 2, g] = b0[lane]
        b[2 * t + 8:2 * t + 10, g] = b1[lane]
        seen[2 * t:2 * t + 2, g] += 1
        seen[2 * t + 8:2 * t + 10, g] += 1
    assert (seen == 1).all()
    return b


def c_to_matrix(c):
    """The 16 x 8 accumulator of per-lane c[lane] = [c0, c1, c2, c3]."""
    m = np.full((16, 8), np.nan)
    for lane in range(LANES):
        g, t = lane // 4, lane % 4
        m[g, 2 * t], m[g, 2 * t + 1], m[g + 8, 2 * t], m[g + 8, 2 * t + 1] = c[lane]
    return m


def matrix_to_c(m):
    out = []
    for lane in range(LANES):
        g, t = lane // 4, lane % 4
        out.append([m[g, 2 * t], m[g, 2 * t + 1], m[g + 8, 2 * t], m[g + 8, 2 * t + 1]])
    return out


def mma(c, a_regs, b0, b1):
    """D = A B + C, every operand in its per-lane fragment layout."""
    return matrix_to_c(assemble_a(a_regs) @ assemble_b(b0, b1) + c_to_matrix(c))


def zeros_c():
    return [[0.0] * 4 for _ in range(LANES)]


def padded_tile(rng, rows, d, pad):
    """Small integers (every product and sum exact in float64) with NaN in the padding columns."""
    tile = np.full((rows, d + pad), np.nan)
    tile[:, :d] = rng.integers(-4, 5, (rows, d))
    return tile


def at(lane_rows, lane, row0, col0):
    r, c = lane_rows[lane]
    return r + row0, c + col0


# ---- the warp's program, as in flash_v4_kernel ----

@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("warp", range(4))
def test_q_k_fragments_give_s_equal_q_k_transposed(layout, d, warp):
    rng = np.random.default_rng(d + warp)
    bq, bk = layout["block_q"], layout["block_k"]
    q_s = padded_tile(rng, bq, d, layout["pad"])
    k_s = padded_tile(rng, bk, d, layout["pad"])
    # qa[kc] = ldmatrix_x4(q_rows + kc * 16), q_rows = (16 warp + a.row, a.col)
    qa = [ldmatrix_x4(q_s, [at(layout["a"], l, 16 * warp, 16 * kc) for l in range(LANES)])
          for kc in range(d // 16)]
    s = []
    for nt in range(bk // 8):
        acc = zeros_c()
        for kc in range(0, d // 16, 2):  # kb = ldmatrix_x4(k_rows + kc * 16), k_rows = (8 nt + k.row, k.col)
            kb = ldmatrix_x4(k_s, [at(layout["k"], l, 8 * nt, 16 * kc) for l in range(LANES)])
            acc = mma(acc, qa[kc], [r[0] for r in kb], [r[1] for r in kb])
            acc = mma(acc, qa[kc + 1], [r[2] for r in kb], [r[3] for r in kb])
        s.append(c_to_matrix(acc))
    want = q_s[16 * warp:16 * warp + 16, :d] @ k_s[:, :d].T
    np.testing.assert_array_equal(np.concatenate(s, axis=1), want)


@pytest.mark.parametrize("d", DIMS)
def test_p_from_the_accumulators_and_v_fragments_give_p_v(layout, d):
    rng = np.random.default_rng(d)
    bk = layout["block_k"]
    p = rng.integers(-3, 4, (16, bk)).astype(float)
    s = [matrix_to_c(p[:, 8 * nt:8 * nt + 8]) for nt in range(bk // 8)]  # S's accumulator tiles
    v_s = padded_tile(rng, bk, d, layout["pad"])
    acc = [zeros_c() for _ in range(d // 8)]
    for kk in range(bk // 16):
        # pa = the accumulators of S tiles 2kk and 2kk + 1, packed in pairs (no data movement)
        pa = [[(s[2 * kk][l][0], s[2 * kk][l][1]), (s[2 * kk][l][2], s[2 * kk][l][3]),
               (s[2 * kk + 1][l][0], s[2 * kk + 1][l][1]), (s[2 * kk + 1][l][2], s[2 * kk + 1][l][3])]
              for l in range(LANES)]
        for dn in range(0, d // 8, 2):  # vb = ldmatrix_x4_trans(v_rows + dn * 8), v_rows = (16 kk + v.row, v.col)
            vb = ldmatrix_x4(v_s, [at(layout["v"], l, 16 * kk, 8 * dn) for l in range(LANES)], trans=True)
            acc[dn] = mma(acc[dn], pa, [r[0] for r in vb], [r[1] for r in vb])
            acc[dn + 1] = mma(acc[dn + 1], pa, [r[2] for r in vb], [r[3] for r in vb])
    got = np.concatenate([c_to_matrix(a) for a in acc], axis=1)
    np.testing.assert_array_equal(got, p @ v_s[:, :d])


def test_c_fragment_is_the_isa_accumulator_layout(layout):
    for lane in range(LANES):
        g, t = lane // 4, lane % 4
        assert layout["c"][lane] == [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]


@pytest.mark.parametrize("d", DIMS)
def test_output_goes_through_shared_memory_once_per_element_in_16_byte_stores(layout, d):
    """Each warp writes its 16 x D output from the fragments (pairs at c_fragment(lane, 2r)) into
    shared rows, then lane l stores chunks l, l + 32, ...: every element once, each store 16 bytes
    at a 16-byte boundary, and the 32 lanes of one store cover whole rows, contiguous in memory."""
    rng = np.random.default_rng(d)
    stride = layout["dims"][d]["stride"]
    o = rng.integers(-9, 10, (16, d)).astype(float)
    acc = [matrix_to_c(o[:, 8 * dn:8 * dn + 8]) for dn in range(d // 8)]
    o_s = np.full((16, stride), np.nan)
    for dn in range(d // 8):
        for lane in range(LANES):
            for r in range(2):
                row, col = layout["c"][lane][2 * r]
                o_s[row, 8 * dn + col:8 * dn + col + 2] = acc[dn][lane][2 * r:2 * r + 2]
    out = np.full((16, d), np.nan)
    written = np.zeros((16, d), int)
    n = layout["dims"][d]["out_per_lane"]
    assert n * LANES * 8 == 16 * d
    for i in range(n):
        addresses = []
        for lane in range(LANES):
            row, col = layout["chunks"][d][lane + i * LANES]
            out[row, col:col + 8] = o_s[row, col:col + 8]
            written[row, col:col + 8] += 1
            addresses.append((row * d + col) * 2)  # bytes from the warp's first output row
        assert all(a % 16 == 0 for a in addresses)
        assert addresses == list(range(addresses[0], addresses[0] + 16 * LANES, 16))
    assert (written == 1).all()
    np.testing.assert_array_equal(out, o)


@pytest.mark.parametrize("d", DIMS)
def test_tile_copies_cover_the_tile_once_and_are_coalesced(layout, d):
    threads, bk = layout["threads"], layout["block_k"]
    per_thread = layout["dims"][d]["per_thread"]
    assert per_thread * threads * 8 == bk * d
    covered = np.zeros((bk, d), int)
    for i in range(per_thread):
        for warp in range(threads // LANES):
            addresses = []
            for lane in range(LANES):
                row, col = layout["chunks"][d][warp * LANES + lane + i * threads]
                covered[row, col:col + 8] += 1
                addresses.append((row * d + col) * 2)
            # 32 consecutive 16-byte pieces of the (contiguous) global rows: 512 bytes in a run
            assert addresses == list(range(addresses[0], addresses[0] + 16 * LANES, 16))
    assert (covered == 1).all()


def banks(byte_address, nbytes):
    return {(byte_address // 4 + w) % 32 for w in range(nbytes // 4)}


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("operand", ["a", "k", "v"])
def test_ldmatrix_reads_are_free_of_bank_conflicts(layout, d, operand):
    """Each 8 x 8 matrix of an ldmatrix is one shared-memory phase: its 8 rows of 16 bytes must
    fall on 32 different banks. The 16-byte padding of each row makes them so; every offset the
    kernel adds (16 kc columns, 8 dn columns, 8 nt or 16 kk rows) keeps it."""
    stride = layout["dims"][d]["stride"]
    for row0 in (0, 8, 16, 48):
        for col0 in range(0, d - 8 * (2 if operand == "v" else 4) + 1, 8):
            for i in range(4):
                seen = set()
                for r in range(8):
                    row, col = at(layout[operand], 8 * i + r, row0, col0)
                    b = banks((row * stride + col) * 2, 16)
                    assert not b & seen, (operand, d, row0, col0, i)
                    seen |= b


@pytest.mark.parametrize("d", DIMS)
def test_output_fragment_writes_are_free_of_bank_conflicts(layout, d):
    stride = layout["dims"][d]["stride"]
    for dn in range(d // 8):
        for r in range(2):
            seen = set()
            for lane in range(LANES):
                row, col = layout["c"][lane][2 * r]
                b = banks((row * stride + 8 * dn + col) * 2, 4)
                assert not b & seen, (d, dn, r, lane)
                seen |= b
