"""paged_decode.cu's split of each key tile across the warps, run on the CPU.

The split kernel takes every warp's slice of a tile, every lane's key and part of a dot product,
every lane's output columns, the tile copy's pieces and the merge's items from
``csrc/cuda/decode_layout.h``. This test compiles that header with the host compiler, prints what
each function gives, and

* checks the addressing: each key of a tile (of any length 0..32, most of them not multiples of
  the 4 warps) is scored by exactly one warp and, within it, by one group of lanes whose parts
  cover the key row's words once; each output column is accumulated by one lane; the copy covers
  the tile once, coalesced; the score reads are free of bank conflicts;
* plays the block's program in float64 NumPy with exactly those indices (the shuffles as the
  kernel's xor patterns, the online softmax per warp, the log-sum-exp merge of the 4 warps' states
  through shared memory, then the merge of the splits), and compares the result with a plain
  float64 decode attention, for sequences that end mid-tile and mid-slice, 1 to 8 query heads,
  head widths below the compiled width, and 1 or 3 splits;
* plants mistakes in a copy of the header (an off-by-one in the slice, overlapping slices, a wrong
  word stride, wrong output columns, lanes grouped across keys) and checks that each is caught.

A GPU is not needed; the host compiler (the one that builds refmath._C) is.
"""
import os
import shutil
import subprocess

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = os.path.join(ROOT, "csrc", "cuda", "decode_layout.h")
LANES = 32
ROW_WORDS = (8, 16, 32, 64, 128)
PIECES = (2, 4, 5, 8, 16, 32)
WIDTHS = (20, 40, 64)

DRIVER = r"""
#include <cstdio>
#include <initializer_list>
#include "decode_layout.h"
using namespace refmath_cuda::decode;
int main() {
    std::printf("const %d %d %d %d %d %d\n", kWarps, kThreads, kHeads, kBlockK, kKeysPerWarp, kLanesPerKey);
    for (int n = 0; n <= kBlockK; ++n)
        for (int w = 0; w < kWarps; ++w) std::printf("slice %d %d %d %d\n", n, w, slice_begin(w, n), slice_end(w, n));
    for (int lane = 0; lane < 32; ++lane) {
        std::printf("lane %d %d %d", lane, lane_key(lane), lane_part(lane));
        for (int cc = 0; cc < 8; ++cc) std::printf(" %d", pv_column(lane, cc));
        std::printf("\n");
    }
    for (int rw : {8, 16, 32, 64, 128}) {
        std::printf("words %d %d %d\n", rw, score_words_per_lane(rw), k_stride_words(rw));
        for (int lane = 0; lane < 32; ++lane) {
            std::printf("word %d %d", rw, lane);
            for (int i = 0; i < score_words_per_lane(rw); ++i) std::printf(" %d", score_word(lane, i));
            std::printf("\n");
        }
    }
    for (int ppr : {2, 4, 5, 8, 16, 32}) {
        std::printf("rounds %d %d\n", ppr, copy_rounds(ppr));
        for (int i = 0; i < copy_rounds(ppr) * kThreads; ++i)
            std::printf("piece %d %d %d %d\n", ppr, i, copy_piece(i, ppr).row, copy_piece(i, ppr).piece);
    }
    for (int width : {20, 40, 64})
        for (int i = 0; i < kHeads * width; ++i)
            std::printf("item %d %d %d %d\n", width, i, merge_item(i, width).head, merge_item(i, width).column);
}
"""


def compile_layout(header_dir, folder):
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no host C++ compiler to run csrc/cuda/decode_layout.h")
    source, binary = folder / "driver.cpp", folder / "driver"
    source.write_text(DRIVER)
    # header_dir first (a mutant's copy of decode_layout.h), then csrc/cuda for what it includes
    subprocess.run([compiler, "-std=c++17", "-I", str(header_dir), "-I", os.path.dirname(HEADER),
                    str(source), "-o", str(binary)], check=True, timeout=120)
    out = subprocess.run([str(binary)], check=True, capture_output=True, text=True, timeout=60).stdout
    lay = {"slice": {}, "key": {}, "part": {}, "pv": {}, "words": {}, "word": {rw: {} for rw in ROW_WORDS},
           "rounds": {}, "piece": {p: {} for p in PIECES}, "item": {w: {} for w in WIDTHS}}
    for line in out.splitlines():
        w = line.split()
        v = [int(x) for x in w[1:]]
        if w[0] == "const":
            lay.update(warps=v[0], threads=v[1], heads=v[2], block_k=v[3], keys_per_warp=v[4], lanes_per_key=v[5])
        elif w[0] == "slice":
            lay["slice"][v[0], v[1]] = (v[2], v[3])
        elif w[0] == "lane":
            lay["key"][v[0]], lay["part"][v[0]], lay["pv"][v[0]] = v[1], v[2], v[3:]
        elif w[0] == "words":
            lay["words"][v[0]] = dict(per_lane=v[1], stride=v[2])
        elif w[0] == "word":
            lay["word"][v[0]][v[1]] = v[2:]
        elif w[0] == "rounds":
            lay["rounds"][v[0]] = v[1]
        elif w[0] == "piece":
            lay["piece"][v[0]][v[1]] = (v[2], v[3])
        elif w[0] == "item":
            lay["item"][v[0]][v[1]] = (v[2], v[3])
    return lay


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """Every function of decode_layout.h, evaluated by the compiled header itself."""
    return compile_layout(os.path.dirname(HEADER), tmp_path_factory.mktemp("decode_layout"))


# ---- the addressing ----

def my_key(lay, warp, lane):
    """The tile row lane scores, as in decode_split_kernel."""
    return lay["slice"][lay["block_k"], warp][0] + lay["key"][lane]


def check_slices(lay):
    """Each key of a tile with n valid keys is scored by exactly one warp, by kLanesPerKey lanes of
    it with the parts 0..kLanesPerKey-1, and its V row is read by that same warp's P V loop."""
    bk, warps = lay["block_k"], lay["warps"]
    assert warps * LANES == lay["threads"]
    for n in range(bk + 1):
        pv_rows = np.zeros(bk, int)
        scored = {}
        for warp in range(warps):
            begin, end = lay["slice"][n, warp]
            assert 0 <= begin <= end <= n, (n, warp, begin, end)
            pv_rows[begin:end] += 1
            for lane in range(LANES):
                key = my_key(lay, warp, lane)
                assert 0 <= key < bk, (warp, lane, key)
                if key < end:  # `valid` in the kernel
                    assert key >= begin, (n, warp, lane, key)
                    scored.setdefault(key, []).append((warp, lay["part"][lane]))
        assert (pv_rows[:n] == 1).all() and (pv_rows[n:] == 0).all(), (n, pv_rows)
        assert sorted(scored) == list(range(n)), (n, sorted(scored))
        for key, who in scored.items():
            assert len({w for w, _ in who}) == 1, (n, key, who)
            assert sorted(p for _, p in who) == list(range(lay["lanes_per_key"])), (n, key, who)


def check_score_words(lay):
    """The lanes of one key read each word of its row once between them; the lanes that the
    kernel's shuffles (xor 1, 2, ...) add are the lanes of that key."""
    lpk = lay["lanes_per_key"]
    for rw in ROW_WORDS:
        per_lane = lay["words"][rw]["per_lane"]
        assert per_lane * lpk == rw, rw
        for lane in range(LANES):
            group = {lane ^ o for o in range(lpk)}
            assert {lay["key"][g] for g in group} == {lay["key"][lane]}, (lane, group)
            words = np.concatenate([lay["word"][rw][g] for g in sorted(group)])
            assert sorted(words) == list(range(rw)), (rw, lane, sorted(words))


def check_pv_columns(lay):
    for d_max in (32, 64, 128, 256):
        cols = [c for lane in range(LANES) for c in lay["pv"][lane][:d_max // LANES]]
        assert sorted(cols) == list(range(d_max)), d_max


def check_copy(lay):
    bk, threads = lay["block_k"], lay["threads"]
    for ppr in PIECES:
        covered = np.zeros((bk, ppr), int)
        for i in range(lay["rounds"][ppr] * threads):
            row, piece = lay["piece"][ppr][i]
            assert 0 <= piece < ppr
            if row < bk:
                covered[row, piece] += 1
            if i % LANES:  # consecutive threads, consecutive 16-byte pieces of the tile's rows
                prev = lay["piece"][ppr][i - 1]
                assert row * ppr + piece == prev[0] * ppr + prev[1] + 1, (ppr, i)
        assert (covered == 1).all(), ppr


def check_merge_items(lay):
    for width in WIDTHS:
        seen = np.zeros((lay["heads"], width), int)
        for i in range(lay["heads"] * width):
            h, c = lay["item"][width][i]
            seen[h, c] += 1
        assert (seen == 1).all(), width


def check_addressing(lay):
    check_slices(lay)
    check_score_words(lay)
    check_pv_columns(lay)
    check_copy(lay)
    check_merge_items(lay)


def test_slices_cover_every_key_of_every_tile_length_once(layout):
    check_slices(layout)


def test_the_lanes_of_a_key_read_its_words_once_and_are_the_ones_the_shuffles_add(layout):
    check_score_words(layout)


def test_each_output_column_has_one_lane(layout):
    check_pv_columns(layout)


def test_the_copy_covers_the_tile_once_coalesced(layout):
    check_copy(layout)


def test_the_merge_covers_each_head_and_column_once(layout):
    check_merge_items(layout)


def banks(word_address):
    return word_address % 32


@pytest.mark.parametrize("rw", ROW_WORDS)
def test_score_reads_are_free_of_bank_conflicts(layout, rw):
    """One score read of a warp: each lane reads the 32-bit word score_word(lane, i) of its key's
    row (stride k_stride_words words): 32 different banks, for every warp and every step i."""
    stride = layout["words"][rw]["stride"]
    for warp in range(layout["warps"]):
        for i in range(layout["words"][rw]["per_lane"]):
            hit = {banks(my_key(layout, warp, lane) * stride + layout["word"][rw][lane][i]) for lane in range(LANES)}
            assert len(hit) == LANES, (rw, warp, i)


# ---- the block's program in float64 ----

def xor_reduce(x, offsets, op):
    """The kernel's butterfly: x[lane] = op(x[lane], x[lane ^ o]) for each offset, all lanes at once."""
    for o in offsets:
        x = op(x, x[np.arange(LANES) ^ o])
    return x


def nan_max(a, b):
    return np.where(np.isnan(a) | np.isnan(b), np.nan, np.maximum(a, b))


def play_split(lay, q_s, k, v, t0, t1, d_max, cols_per_word):
    """decode_split_kernel for one split: q_s (kHeads, d_max) scaled queries (zeros past the block's
    heads and past D), k, v (L, D). Returns the merged (m, l, u) per head, u of width d_max."""
    heads, bk, warps, lpk = lay["heads"], lay["block_k"], lay["warps"], lay["lanes_per_key"]
    d = k.shape[1]
    rw = d_max // cols_per_word
    kcols = d_max // LANES
    lane_cols = [np.concatenate([np.arange(w * cols_per_word, (w + 1) * cols_per_word) for w in lay["word"][rw][lane]])
                 for lane in range(LANES)]
    m = np.full((warps, heads), -np.inf)
    l = np.zeros((warps, heads))
    acc = np.zeros((warps, LANES, heads, kcols))
    for j0 in range(t0, t1, bk):
        n = min(t1 - j0, bk)
        k_s, v_s = np.zeros((bk, d_max)), np.zeros((bk, d_max))
        k_s[:n, :d], v_s[:n, :d] = k[j0:j0 + n], v[j0:j0 + n]
        p_s = np.full((heads, bk), np.nan)  # shared: a read of a slot no lane wrote shows up
        for warp in range(warps):
            keys = np.array([my_key(lay, warp, lane) for lane in range(LANES)])
            s = np.array([q_s[:, lane_cols[lane]] @ k_s[keys[lane], lane_cols[lane]] for lane in range(LANES)])
            s = xor_reduce(s, [1 << i for i in range(lpk.bit_length() - 1)], np.add)  # key_sum
            valid = keys < lay["slice"][n, warp][1]
            score = np.where(valid[:, None], s, -np.inf)
            slice_offsets = [lpk << i for i in range((LANES // lpk).bit_length() - 1)]
            m_new = nan_max(m[warp], xor_reduce(score, slice_offsets, nan_max))  # (lanes, heads)
            # The kernel branches on m_new, so it must be the same in every lane of the warp.
            assert (np.isnan(m_new) | (m_new == m_new[0])).all(), "m differs between the lanes of a warp"
            m_new = m_new[0]
            live = m_new != -np.inf
            with np.errstate(invalid="ignore"):
                correction = np.where(live, np.exp(m[warp] - m_new), 1.0)
                p = np.where(live, np.exp(score - m_new), 0.0)
            l[warp] = np.where(live, l[warp] * correction + xor_reduce(p, slice_offsets, np.add)[0], l[warp])
            acc[warp] *= correction[None, :, None]
            m[warp] = np.where(live, m_new, m[warp])
            for lane in range(LANES):
                if lay["part"][lane] == 0:
                    p_s[:, keys[lane]] = p[lane]
            begin, end = lay["slice"][n, warp]
            for r in range(begin, end):
                for lane in range(LANES):
                    cols = lay["pv"][lane][:kcols]
                    acc[warp, lane] += p_s[:, r][:, None] * v_s[r, cols][None, :]
    # the merge of the warps' states, through u_s as the kernel lays it out
    u_s = np.full((warps, heads, d_max), np.nan)
    for warp in range(warps):
        for lane in range(LANES):
            u_s[warp, :, lay["pv"][lane][:kcols]] = acc[warp, lane].T
    big_m = m[0]
    for warp in range(1, warps):
        big_m = nan_max(big_m, m[warp])
    with np.errstate(invalid="ignore"):
        weight = np.where(big_m == -np.inf, 0.0, np.exp(m - big_m))  # (warps, heads)
    big_l = (weight * l).sum(axis=0)
    u = np.full((heads, d_max), np.nan)
    for i in range(heads * d):
        h, c = lay["item"][d][i]  # the thread that merges item i (d is one of WIDTHS)
        u[h, c] = (weight[:, h] * u_s[:, h, c]).sum()
    return big_m, big_l, u[:, :d]


def play_decode(lay, q, k, v, splits, d_max, cols_per_word):
    """Both kernels for one (sequence, key/value head): q (H, D) with H <= kHeads, k, v (L, D)."""
    h, d = q.shape
    length, bk = k.shape[0], lay["block_k"]
    scale = d ** -0.5
    q_s = np.zeros((lay["heads"], d_max))
    q_s[:h, :d] = q * scale
    run = -(-(-(-length // splits)) // bk) * bk
    parts = []
    for split in range(splits):
        t0 = min(split * run, length)
        t1 = min(t0 + run, length)
        parts.append(play_split(lay, q_s, k, v, t0, t1, d_max, cols_per_word))
    big_m = np.full(lay["heads"], -np.inf)
    for pm, _, _ in parts:
        big_m = nan_max(big_m, pm)
    with np.errstate(invalid="ignore"):
        w = [np.where(big_m == -np.inf, 0.0, np.exp(pm - big_m)) for pm, _, _ in parts]
    big_l = sum(wi * pl for wi, (_, pl, _) in zip(w, parts))
    u = sum(wi[:, None] * pu for wi, (_, _, pu) in zip(w, parts))
    with np.errstate(invalid="ignore", divide="ignore"):
        o = np.where((big_l == 0.0)[:, None], 0.0, u / big_l[:, None])
    return o[:h]


def reference_decode(q, k, v):
    """Plain float64 decode attention of one query per head against every key."""
    if k.shape[0] == 0:
        return np.zeros_like(q)
    s = (q @ k.T) * q.shape[1] ** -0.5
    a = np.exp(s - s.max(axis=1, keepdims=True))
    return (a / a.sum(axis=1, keepdims=True)) @ v


MODEL_CASES = [  # (heads, D, D_MAX, columns per 32-bit word: 2 for float16/bfloat16, 1 for float32)
    (8, 64, 64, 2),
    (3, 40, 64, 2),   # D < D_MAX, 3 of the block's 8 heads
    (1, 20, 32, 1),
    (5, 64, 64, 1),
]
LENGTHS = (0, 1, 5, 8, 9, 31, 32, 33, 45, 77, 100)


def check_model(lay, cases=MODEL_CASES, lengths=LENGTHS, splits_list=(1, 3)):
    rng = np.random.default_rng(0)
    for h, d, d_max, cpw in cases:
        for length in lengths:
            q = rng.standard_normal((h, d))
            k, v = rng.standard_normal((length, d)), rng.standard_normal((length, d))
            want = reference_decode(q, k, v)
            for splits in splits_list:
                got = play_decode(lay, q, k, v, splits, d_max, cpw)
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12,
                                           err_msg=f"H={h} D={d} D_MAX={d_max} L={length} splits={splits}")


def test_the_warps_partial_states_merge_to_exact_decode_attention(layout):
    check_model(layout)


def test_a_nan_key_makes_every_head_nan_through_both_merges(layout):
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((4, 64)), rng.standard_normal((45, 64)), rng.standard_normal((45, 64))
    k[40, 3] = np.nan  # in the last tile, warp 1's slice: three warps stay finite
    for splits in (1, 3):
        assert np.isnan(play_decode(layout, q, k, v, splits, 64, 2)).all()


# ---- planted mistakes ----

MUTANTS = {
    "slice off by one (a gap)": ("return clamp_to((warp + 1) * kKeysPerWarp, n);",
                                 "return clamp_to((warp + 1) * kKeysPerWarp - 1, n);"),
    "overlapping slices": ("return clamp_to(warp * kKeysPerWarp, n);",
                           "return clamp_to(warp * kKeysPerWarp - (warp > 0), n);"),
    "word stride": ("return lane_part(lane) + i * kLanesPerKey;", "return lane_part(lane) + i * 2;"),
    "output columns": ("return lane + 32 * cc;", "return lane + 31 * cc;"),
    "lanes of a key not adjacent": ("return lane / kLanesPerKey;", "return lane % kKeysPerWarp;"),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_planted_mistake_in_the_header_is_caught(tmp_path, name):
    old, new = MUTANTS[name]
    text = open(HEADER).read()
    assert text.count(old) == 1, f"the mutant's target is no longer in decode_layout.h: {old}"
    (tmp_path / "decode_layout.h").write_text(text.replace(old, new))
    lay = compile_layout(tmp_path, tmp_path)
    with pytest.raises(AssertionError):
        check_addressing(lay)
    with pytest.raises(AssertionError):  # the float64 model alone catches it too
        check_model(lay, cases=MODEL_CASES[:1] + MODEL_CASES[2:3], lengths=(9, 33, 77), splits_list=(1,))
