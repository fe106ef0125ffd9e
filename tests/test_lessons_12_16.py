"""Lessons 12-16 as a student meets them (issue 47, walk C): the library refused where an exercise
asks for the computation, slips named, and no answer computed or printed in the cells a student
sees before answering.

The lessons run as scripts (as tests/test_lesson_slips.py runs them), with one edit each: a planted
answer in place of the solution, or the student copy itself, unanswered.
"""
import re
from pathlib import Path

import numpy as np
import pytest

from refmath import kernels
from refmath.lessons import student_copy

from _support import run_lesson

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
VERDICT = ("right: ", "wrong: ", "almost: ", "no answer yet: ")


def _lesson(prefix):
    return next(NOTEBOOKS.glob(f"{prefix}_*.py"))


def _planted(prefix, edits, tmp_path):
    """The verdict lines of lesson ``prefix`` run with each ``old -> new`` of ``edits`` in place
    (each ``old`` must occur once), and its standard output."""
    text = _lesson(prefix).read_text()
    for old, new in edits.items():
        assert text.count(old) == 1, f"lesson {prefix}: {old!r} has changed"
        text = text.replace(old, new)
    run = run_lesson(text, tmp_path)
    assert run.returncode == 0, f"lesson {prefix} fails with the plant:\n{run.stderr[-3000:]}"
    return [line for line in run.stdout.splitlines() if line.startswith(VERDICT)], run.stdout


def _verdict_of(verdicts, name):
    found = [v for v in verdicts if v.startswith(tuple(f"{s}{name}:" for s in VERDICT))]
    assert found, f"no verdict on {name!r} among {verdicts}"
    return found[0]


# ---- lesson 12: the counts the lesson no longer computes, held to the kernel here -----------------

def test_scratch_count_is_the_kernels_own_expression():
    from refmath.lessons.expected.lesson12_from_equation_to_kernel import _forward_scratch_bytes

    source = ROOT / "csrc" / "flash_cpu.cpp"
    line = re.search(r"const idx per_thread =\s*tile::padded_floats\(([^;]*)\);", source.read_text())
    expression = " ".join(line.group(1).split())  # the forward pass's, the first in the file
    for d in (32, 64, 128, 256):  # C++ arithmetic on three names, which Python reads alike
        floats = eval(expression, {}, {"kBlockQ": 128, "kBlockK": 128,
                                       "shape": type("Shape", (), {"head_dim": d})})
        assert 4 * (-(-floats // 16) * 16) == _forward_scratch_bytes(d), d


@pytest.mark.skipif(not kernels.cpu_available(), reason="refmath._C is not built")
def test_kernel_splits_follow_the_lessons_rule():
    from refmath.lessons.expected.lesson12_from_equation_to_kernel import _cpu_splits

    rng, threads = np.random.default_rng(0), kernels.cpu_threads()
    for batch, kv_heads, n in ((1, 1, 32768), (1, 8, 8192), (4, 2, 3000)):
        qs = rng.standard_normal((batch, 4 * kv_heads, 64)).astype(np.float32)
        ks, vs = (rng.standard_normal((batch, kv_heads, n, 64)).astype(np.float32) for _ in "kv")
        auto = kernels.decode(qs, ks, vs, [n] * batch)
        rule = _cpu_splits(batch, kv_heads, n, threads)
        same = [s for s in (rule - 1, rule, rule + 1) if s >= 1
                and np.array_equal(auto, kernels.decode(qs, ks, vs, [n] * batch, splits=s))]
        assert same == [rule], (batch, kv_heads, n, threads)


SPLIT_DECODE_SOLUTION = """    alpha = np.exp(np.array(m_s) - max(m_s))
    o = alpha @ np.array(u_s) / (alpha @ np.array(l_s))
"""
# 12.3 handed to the library's F2 and F3 (the walk's 7 lines): no m, l or u arithmetic of its own
SPLIT_DECODE_BY_THE_LIBRARY = """    from refmath.softmax import online_softmax_block, online_softmax_merge, online_softmax_result
    state = online_softmax_block(k[:chunk] @ q / np.sqrt(d), v[:chunk])
    for s in range(1, splits):
        lo, hi = min(n, s * chunk), min(n, s * chunk + chunk)
        state = online_softmax_merge(state, online_softmax_block(k[lo:hi] @ q / np.sqrt(d), v[lo:hi]))
    o = online_softmax_result(state)
"""


def test_lesson_12_refuses_the_library_and_names_c_equal_1(tmp_path):
    verdicts, out = _planted("12", {
        SPLIT_DECODE_SOLUTION: SPLIT_DECODE_BY_THE_LIBRARY,
        "bound_o = 2 * numpy_error + 4 * U32 * np.abs(vg).max()":
            "bound_o = numpy_error + 4 * U32 * np.abs(vg).max()"}, tmp_path)
    said = _verdict_of(verdicts, "your split-K decode")
    assert said.startswith("wrong: ") and "calls refmath.softmax.online_softmax_" in said, said
    said = _verdict_of(verdicts, "the rule's bound on o")
    assert said.startswith("wrong: ") and "looks like: c = 1" in said, said
    # the cells after 12.1 and 12.2 print no bound and no scratch count
    assert not re.search(r"bound \d", out) and "KiB per thread" not in out
    assert all(v.startswith("right: ") for v in verdicts
               if not v.startswith(("wrong: your split-K", "wrong: the rule's bound"))), verdicts


# ---- lesson 14 ---------------------------------------------------------------------------------

def test_lesson_14_refuses_the_library_and_names_its_slips(tmp_path):
    # 14.1 handed to the library's decoder (a value check accepted it); 14.3 with 4-byte scales
    verdicts, _ = _planted("14", {
        '    logits = final @ params["lm_head"]\n':
            '    from refmath.models import decoder\n'
            '    logits = decoder.logits(params, tokens, config)\n',
        "total = numbers * bits / 8 + 2 * numbers / 32": "total = numbers * bits / 8 + 4 * numbers / 32"},
        tmp_path)
    said = _verdict_of(verdicts, "logits of the whole decoder")
    assert said.startswith("wrong: ") and "refmath.models.decoder.logits" in said, said
    said = _verdict_of(verdicts, "your cache bytes")
    assert said.startswith("wrong: ") and "looks like: 4-byte (float32) scales" in said, said


def test_lesson_14_names_the_final_rmsnorm_forgotten(tmp_path):
    verdicts, _ = _planted("14", {
        '    final, _ = rmsnorm_forward(H, params["ln_f.gamma"], config.norm_eps)\n':
            "    final = H\n"}, tmp_path)
    said = _verdict_of(verdicts, "logits of the whole decoder")
    assert said.startswith("wrong: ") and "looks like: the final RMSNorm forgotten" in said, said


def test_the_mha_twin_is_the_gqa_decoder():
    # what lesson 14 states after exercise 14.2 (and leaves to its exercise 1)
    import dataclasses

    from refmath.attention import gqa_head_map
    from refmath.models import decoder

    config = decoder.DecoderConfig(vocab_size=32, max_seq_len=16, d_model=32, n_layers=2,
                                   n_heads=4, n_kv_heads=2, ffn_multiple_of=16)
    params = decoder.init_params(config, seed=0)
    tokens = np.random.default_rng(0).integers(0, 32, (2, 7))
    head_of, twin = gqa_head_map(config.n_heads, config.kv_heads), dict(params)
    for name in params:
        if name.endswith(("attn.w_k", "attn.w_v")):
            twin[name] = params[name].reshape(config.d_model, config.kv_heads,
                                              config.d_h)[:, head_of].reshape(config.d_model, -1)
    mha = dataclasses.replace(config, n_kv_heads=config.n_heads)
    gap = np.abs(decoder.logits(twin, tokens, mha) - decoder.logits(params, tokens, config)).max()
    assert gap <= 1e-13 * np.abs(decoder.logits(params, tokens, config)).max()


# ---- lesson 13 ---------------------------------------------------------------------------------

def test_lesson_13_names_the_untied_output_left_out(tmp_path):
    verdicts, _ = _planted("13", {
        "tiny_count = V * d + L * per_layer + d + (V * d if untied else 0)":
            "tiny_count = V * d + L * per_layer + d"}, tmp_path)
    said = _verdict_of(verdicts, "this lesson's parameter count")
    assert said.startswith("wrong: ") and "looks like: the untied output matrix left out" in said, said


def test_lesson_13_keeps_no_answer_of_13_2_in_a_variable():
    # the figure's matrix of equal rows and columns gave rows = same.argmax(axis=0)
    text = _lesson("13").read_text()
    figure = text[:text.index("**Exercise 13.2.**")]
    assert not re.search(r"^same = ", figure, re.MULTILINE)


# ---- lesson 15 ---------------------------------------------------------------------------------

def test_lesson_15_imports_no_asked_for_function_before_its_exercise():
    import ast

    first_cell = ast.parse(_lesson("15").read_text().split("# %%")[2])  # after the header
    imported = {alias.name for node in ast.walk(first_cell)
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    for name in ("expert_load", "expert_balance_loss", "softmax_forward", "parameter_counts",
                 "expert_parallel_traffic", "router_scores_backward", "route_backward",
                 "active_parameters", "expert_parallel_bytes"):
        assert name not in imported, name


def _student_run(prefix, tmp_path):
    run = run_lesson(student_copy(_lesson(prefix).read_text()), tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@pytest.mark.parametrize("prefix, answers", [
    # 12.1's bound, 12.2's scratch (its count and KiB, and the markdown's 330 KB)
    ("12", ("3.12e-06", "329,216", "329216", "321.5 KiB", "330 KB")),
    # 13.4's decoded values, 13.5's counts (and GPT-2's size)
    ("13", ("3.140625", "'0xC020'", "18,720", "151,880", "124,439,808", "475 MiB")),
    # 15.1 ties and loads, 15.3's f, 15.5's counts, 15.6's bytes (and their rows of the token)
    ("15", ("(2, 3, 2, 1)", "1.3333", "15,726,848", "6,289,664", "220.50 KiB", "98.00 KiB",
            "7.00 rows", "15.75 on")),
])
def test_unanswered_student_copy_prints_no_answer(prefix, answers, tmp_path):
    out = _student_run(prefix, tmp_path)
    for answer in answers:
        assert answer not in out, answer


# ---- lesson 16 ---------------------------------------------------------------------------------

SOFTMAX_16 = "    dx = a * (dout - np.sum(a * dout, axis=-1, keepdims=True))\n"


def test_capstone_says_whose_backward_passes_run(tmp_path):
    # the walk's plant: the softmax backward calls the library's, the LayerNorm backward is it
    verdicts, out = _planted("16", {
        SOFTMAX_16: "    from refmath.softmax import softmax_backward as library_backward\n"
                    "    dx = library_backward(dout, cache)\n",
        "    return dx, dgamma, dbeta\n": "    return dx, dgamma, dbeta\n\n\n"
                                        "from refmath.norms import layernorm_backward as my_layernorm_backward\n"},
        tmp_path)
    assert _verdict_of(verdicts, "your softmax backward").startswith("wrong: ")
    assert _verdict_of(verdicts, "your LayerNorm backward").startswith("wrong: ")
    assert "softmax: the library's: yours calls refmath.softmax.softmax_backward" in out, out
    assert "layernorm: the library's: yours is refmath.norms.layernorm_backward" in out, out
    assert not any(v.startswith("right: ") and "your backward passes" in v for v in verdicts)
    assert not any(v.startswith("right: your model's gradients") for v in verdicts)


def test_capstone_names_its_slips_and_does_not_crash(tmp_path):
    # the walk's four slips at once: each named, and the training cell ends with a sentence
    verdicts, out = _planted("16", {
        SOFTMAX_16: SOFTMAX_16.replace("np.sum", "np.mean"),
        "    g = dout * cache.gamma\n": "    g = dout\n",
        "(1 + 3 * 0.044715 * x**2)": "(1 + 0.044715 * x**2)",
        "per_token = per_token / max(cache.n_counted, 1)": "per_token = per_token / cache.counted.size"},
        tmp_path)
    for name, words in (("your softmax backward", "a mean for the sum"),
                        ("your LayerNorm backward", "gamma left out of dx"),
                        ("your GELU backward", "the 3 of d(x^3)/dx forgotten"),
                        ("your cross-entropy backward", "mean over every position")):
        said = _verdict_of(verdicts, name)
        assert said.startswith("wrong: ") and "looks like: " in said and words in said, said
    assert "loss: first step" in out  # the training ran to its end, its figure with it


def test_parameter_at_names_the_parameter_and_its_element():
    from refmath.lessons.table import flat_parameters, parameter_at

    # sorted names: "a" (2, 3), then "b" (a scalar), then "c" (4,): positions 0-5, 6, 7-10
    params = {"c": np.arange(4.0), "a": np.arange(6.0).reshape(2, 3), "b": np.float64(9.0)}
    flat = flat_parameters(params)
    for position, name in ((0, "a[0, 0]"), (4, "a[1, 1]"), (6, "b"), (7, "c[0]"), (10, "c[3]")):
        assert parameter_at(params, (position,)) == name
    assert flat[4] == params["a"][1, 1] and flat[6] == params["b"] and flat[10] == params["c"][3]
    with pytest.raises(IndexError, match="11"):
        parameter_at(params, (11,))
    # the vector keeps its names and shapes, for the check to compare before the numbers; an array
    # made from it (a product, a slice) has no layout, its positions need not hold the same
    assert flat.layout == (("a", (2, 3)), ("b", ()), ("c", (4,)))
    assert (flat * 2).layout is None and flat[::-1].layout is None


def test_16_5_names_a_wrong_key_shape_or_element_by_its_parameter(tmp_path):
    # one number of one gradient off: the verdict says which parameter and which element (it said
    # "at index (N,)", a position in the concatenation of every gradient, which no student can read)
    w1 = 'grads["layers.0.ffn.w1"]'
    # the names and shapes before the numbers: a key renamed where it sorts as the right one did,
    # a (1, n) row for an (n,) bias, hold the right numbers in the right positions and were taken
    # as right; a key missing or added was "shape (27744,), expected (27776,)", naming neither
    plants = (
        ("the right answer", "grads"),
        ("a wrong element", f'{{**grads, "layers.0.ffn.w1": {w1} + 1e-3 * '
                            f'(np.arange({w1}.size).reshape({w1}.shape) == 7)}}'),
        ("a renamed key", '{("ln_f.bias" if k == "ln_f.beta" else k): v for k, v in grads.items()}'),
        ("a reshaped bias", '{**grads, "layers.0.ffn.b1": grads["layers.0.ffn.b1"][None]}'),
        ("a missing key", '{k: v for k, v in grads.items() if k != "ln_f.beta"}'),
        ("an extra key", '{**grads, "extra": np.zeros(3)}'),
    )
    checks = "\n".join(f'check("16.5", {answer} if all_yours else None)' for _, answer in plants)
    verdicts, _ = _planted("16", {'check("16.5", grads if all_yours else None)': checks}, tmp_path)
    name = "your model's gradients against the library's: "
    said = dict(zip((label for label, _ in plants),
                    (v for v in verdicts if v.split(": ", 1)[1].startswith(name))))
    assert len(said) == len(plants), verdicts
    assert said["the right answer"].startswith("right: "), said
    assert said["a wrong element"].startswith("wrong: ") and " at layers.0.ffn.w1[0, 7], " in \
        said["a wrong element"], said
    assert "index" not in said["a wrong element"], said
    for label, words in (("a renamed key", "missing: ln_f.beta; unexpected: ln_f.bias"),
                         ("a reshaped bias", "layers.0.ffn.b1 has shape (1, 128), expected (128,)"),
                         ("a missing key", "missing: ln_f.beta"),
                         ("an extra key", "unexpected: extra")):
        assert said[label].startswith(f"wrong: {name}{words}"), (label, said[label])
    assert "unexpected" not in said["a missing key"] and "missing" not in said["an extra key"], said
