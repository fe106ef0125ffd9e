"""The character tokenizer, the generated corpus and the two tasks of refmath.data."""
import dataclasses
import math
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refmath import data
from refmath.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    CharLMTask,
    CharTokenizer,
    Choice,
    Maybe,
    ReversalLMTask,
    ReversalTask,
    SplitMix64,
    grammar_entropy_rate,
    grammar_sentences,
    grammar_text,
    make_task,
    unigram_entropy,
)
from refmath.models.transformer import TransformerConfig

ALPHABET = "abc xyz.\n"


# ---- tokenizer -----------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(st.text(alphabet=ALPHABET, max_size=40))
def test_tokenizer_round_trip(text):
    tok = CharTokenizer(ALPHABET)
    ids = tok.encode(text)
    assert ids.dtype == np.int64 and ids.shape == (len(text),)
    assert ids.min(initial=4) >= 4  # characters never take a special id
    assert tok.decode(ids) == text


def test_special_ids_match_the_encoder_decoder_defaults():
    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    assert (PAD_ID, BOS_ID) == (defaults["pad_id"], defaults["bos_id"]) == (0, 1)
    tok = CharTokenizer("01")
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.vocab_size == 6
    np.testing.assert_array_equal(tok.encode("0110"), [4, 5, 5, 4])


def test_unknown_characters_are_explicit():
    tok = CharTokenizer("ab")
    with pytest.raises(ValueError, match=r"'z' at position 2"):
        tok.encode("abz")
    ids = tok.encode("abz", unknown="unk")
    np.testing.assert_array_equal(ids, [4, 5, UNK_ID])
    assert tok.decode(ids) == "ab\ufffd"
    assert tok.decode([BOS_ID, 4, EOS_ID, PAD_ID]) == "a"
    assert tok.decode([BOS_ID, 4, UNK_ID, EOS_ID, PAD_ID], specials="show") == "<bos>a<unk><eos><pad>"


def test_tokenizer_rejects_bad_input():
    with pytest.raises(ValueError, match="repeat"):
        CharTokenizer("aba")
    with pytest.raises(ValueError, match="non-empty"):
        CharTokenizer("")
    tok = CharTokenizer("ab")
    with pytest.raises(ValueError, match=r"\[0, 6\)"):
        tok.decode([0, 6])
    with pytest.raises(ValueError, match="dimensions"):
        tok.decode([[4, 5]])
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"ab")
    with pytest.raises(ValueError, match="unknown"):
        tok.encode("a", unknown="skip")
    assert CharTokenizer.from_text("banana").alphabet == "abn"


# ---- the generated corpus ------------------------------------------------------------------------

def test_splitmix64_reference_values():
    # The first two outputs for seed 0 of the reference C implementation (Vigna, splitmix64.c).
    rng = SplitMix64(0)
    assert rng.next() == 0xE220A8397B1DCDAF
    assert rng.next() == 0x6E789E6AA1B965F4


def test_corpus_is_deterministic():
    a, b = grammar_text(300, seed=5), grammar_text(300, seed=5)
    assert a == b
    assert a != grammar_text(300, seed=6)
    sentences = grammar_sentences(300, seed=5)
    assert "".join(sentences) == a
    assert all(s.endswith(".\n") and s.count("\n") == 1 for s in sentences)
    task1, task2 = CharLMTask(16, 300), CharLMTask(16, 300)
    for split in ("train", "val"):
        np.testing.assert_array_equal(task1.ids[split], task2.ids[split])


def test_corpus_does_not_depend_on_hash_randomisation():
    # Another interpreter with another str-hash seed must produce the very same text.
    code = "import sys; from refmath.data import grammar_text; sys.stdout.write(grammar_text(200, 3))"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out == grammar_text(200, 3)


def _enumerate(node) -> dict:
    """Every string a grammar node can emit, with its probability (small grammars only)."""
    if isinstance(node, str):
        return {node: 1.0}
    if isinstance(node, Choice):
        out = {}
        for option in node.options:
            for s, p in _enumerate(option).items():
                out[s] = out.get(s, 0.0) + p / len(node.options)
        return out
    if isinstance(node, Maybe):
        out = {"": 0.5}
        for s, p in _enumerate(node.node).items():
            out[s] = out.get(s, 0.0) + p / 2
        return out
    out = {"": 1.0}
    for part in node:
        out = {a + b: p * q for a, p in out.items() for b, q in _enumerate(part).items()}
    return out


TINY_GRAMMAR = Choice((
    ("a", Maybe(Choice(("b", "cc"))), "."),
    ("dd", Choice(("e", "f", "g")), Maybe(" h"), "."),
))


def test_entropy_rate_matches_enumeration():
    dist = _enumerate(TINY_GRAMMAR)
    assert math.isclose(sum(dist.values()), 1.0)
    entropy = -sum(p * math.log(p) for p in dist.values())
    length = sum(p * len(s) for s, p in dist.items())
    assert math.isclose(grammar_entropy_rate(TINY_GRAMMAR), entropy / length, rel_tol=1e-12)


def test_sentences_follow_the_enumerated_distribution():
    # n draws, each frequency within 5 standard deviations sqrt(p (1 - p) / n) of p.
    dist = _enumerate(TINY_GRAMMAR)
    n = 4000
    draws = grammar_sentences(n, seed=1, grammar=TINY_GRAMMAR)
    assert set(draws) <= set(dist)
    for s, p in dist.items():
        freq = draws.count(s) / n
        assert abs(freq - p) <= 5 * math.sqrt(p * (1 - p) / n), (s, freq, p)


def test_real_grammar_entropy_rate_is_below_the_unigram_entropy():
    task = CharLMTask(16, 500)
    rate = grammar_entropy_rate()
    assert 0 < rate < task.unigram_entropy()
    assert task.entropy_rate() == rate


def test_unigram_entropy():
    assert math.isclose(unigram_entropy([5, 5, 5, 5]), math.log(4))
    assert math.isclose(unigram_entropy([3, 1, 0]), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))


# ---- the language-modelling task -----------------------------------------------------------------

def test_lm_batches():
    task = CharLMTask(seq_len=12, n_sentences=200)
    assert task.text["train"] + task.text["val"] == grammar_text(200)
    assert task.text["val"] == "".join(grammar_sentences(200)[180:])  # the last 10% of sentences
    a = task.batch("train", 3, 5, seed=7)
    b = task.batch("train", 3, 5, seed=7)
    for key in ("tokens", "targets"):
        np.testing.assert_array_equal(a[key], b[key])
        assert a[key].shape == (5, 12)
    np.testing.assert_array_equal(a["tokens"][:, 1:], a["targets"][:, :-1])  # next characters
    assert not np.array_equal(a["tokens"], task.batch("train", 4, 5, seed=7)["tokens"])
    assert not np.array_equal(a["tokens"], task.batch("train", 3, 5, seed=8)["tokens"])
    for split in ("train", "val"):
        batch = task.batch(split, 0, 4, seed=0)
        for row in range(4):
            window = task.tokenizer.decode(np.append(batch["tokens"][row], batch["targets"][row, -1]))
            assert window in task.text[split]


def test_lm_task_rejects_bad_arguments():
    task = CharLMTask(seq_len=8, n_sentences=50)
    with pytest.raises(ValueError, match="split"):
        task.batch("test", 0, 2, 0)
    with pytest.raises(ValueError, match="batch_size"):
        task.batch("train", 0, 0, 0)
    with pytest.raises(ValueError, match="seq_len"):
        CharLMTask(seq_len=0)
    with pytest.raises(ValueError, match="fewer than"):
        CharLMTask(seq_len=500, n_sentences=10)


# ---- the reversal task ---------------------------------------------------------------------------

def test_reversal_batches():
    task = ReversalTask(max_len=5)
    batch = task.batch("train", 0, 50, seed=3)
    src, tgt = batch["src"], batch["tgt"]
    assert src.shape == (50, 5) and tgt.shape == (50, 6)
    for row, n in enumerate(batch["src_lengths"]):
        assert n in range(1, 6) and batch["tgt_lengths"][row] == n + 1
        np.testing.assert_array_equal(tgt[row, :n], src[row, :n][::-1])
        assert tgt[row, n] == EOS_ID
        assert (src[row, n:] == PAD_ID).all() and (tgt[row, n + 1:] == PAD_ID).all()
        assert (src[row, :n] >= 4).all()
    again = task.batch("train", 0, 50, seed=3)
    np.testing.assert_array_equal(again["src"], src)


def test_reversal_splits_are_disjoint():
    task = ReversalTask(max_len=6)
    for split in ("train", "val"):
        for index in range(3):
            for source in task.examples(split, index, 40, seed=0):
                assert (zlib.crc32(source.encode()) % 10 == 0) == (split == "val")


def test_reversal_unigram_entropy_is_close_to_the_generator_formula():
    # Without the split, a target of n ~ U{1..L} digits plus EOS has p(EOS) = 1 / (E n + 1) and
    # every digit (1 - p(EOS)) / 10. The checksum split hardly changes that. The estimate uses
    # 4000 targets (~2.2 x 10^4 tokens); the plug-in entropy's standard error is about
    # sd(-log p) / sqrt(tokens) = 0.3 / 148 = 0.002, so 0.01 nats is five standard errors.
    task = ReversalTask(max_len=8)
    mean_n = (1 + 8) / 2
    p_eos = 1 / (mean_n + 1)
    formula = unigram_entropy([p_eos] + [(1 - p_eos) / 10] * 10)
    assert abs(task.unigram_entropy() - formula) < 0.01


def test_reversal_lm_batches_mask_the_prompt():
    task = ReversalLMTask(max_len=4)
    batch = task.batch("val", 2, 30, seed=1)
    sources = task.source.examples("val", 2, 30, seed=1)  # the same strings as ReversalTask's
    tokens, targets, mask = batch["tokens"], batch["targets"], batch["loss_mask"]
    assert tokens.shape == targets.shape == mask.shape == (30, task.seq_len) == (30, 10)
    for row, source in enumerate(sources):
        n = len(source)
        text = task.tokenizer.decode(tokens[row], specials="show")
        assert text.startswith(f"<bos>{source}={source[::-1]}")
        # the answer (reversed digits and <eos>) is counted, the prompt and the padding are not
        answer = targets[row][mask[row] == 1]
        assert task.tokenizer.decode(answer, specials="show") == source[::-1] + "<eos>"
        assert mask[row].sum() == n + 1 and (targets[row, 2 * n + 2:] == -100).all()
        np.testing.assert_array_equal(tokens[row, 1:2 * n + 2], targets[row, :2 * n + 1])
    np.testing.assert_array_equal(task.prompt_ids("12"), [BOS_ID, 5, 6, 14])


def test_reversal_lm_loss_counts_the_answer_only():
    # L5 at the data level: the model's loss on a batch is the mean of -log p(target) over the
    # answer tokens, computed here from the logits by hand.
    from refmath.models import gpt
    task = ReversalLMTask(max_len=3)
    config = gpt.GPTConfig(vocab_size=task.vocab_size, max_seq_len=task.seq_len, n_layers=1,
                           d_model=8, n_heads=2, dropout=0.0)
    params = gpt.init_params(config, seed=0)
    params["tok_emb"] *= 50  # a sharper distribution, so that counting the prompt would show
    batch = task.batch("train", 0, 6, seed=0)
    loss, _ = gpt.forward(params, batch, config)
    z = gpt.logits(params, batch["tokens"], config)
    log_p = z - z.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    rows, cols = np.nonzero(batch["loss_mask"])
    expected = -log_p[rows, cols, batch["targets"][rows, cols]].mean()
    np.testing.assert_allclose(loss, expected, rtol=1e-12)
    counted = batch["targets"] != -100
    everything = -log_p[counted, batch["targets"][counted]].mean()
    assert abs(everything - expected) > 0.1


def test_make_task_round_trips_settings():
    for task in (ReversalTask(4), CharLMTask(8, 50, corpus_seed=2), ReversalLMTask(3)):
        again = make_task(task.settings())
        assert type(again) is type(task) and again.settings() == task.settings()
    with pytest.raises(ValueError, match="unknown task"):
        make_task({"name": "sorting"})
    assert data.make_task({"name": "reverse"}).max_len == 8
