r"""Training data that needs no download: a character tokenizer and two deterministic tasks.

- :class:`CharTokenizer`: characters to ids and back, with the special ids ``<pad>`` = 0,
  ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3 first (the encoder-decoder's ``pad_id`` and
  ``bos_id`` defaults), then one id per character of the alphabet.
- :class:`ReversalTask`: the encoder-decoder's translation task (catalogue L1). The source is a
  random digit string, the target the same digits in reverse order followed by ``<eos>``. Output
  position ``t`` must read source position ``n - 1 - t``, so a trained model's cross-attention
  weights form an anti-diagonal that one can see in a heat map.
- :class:`CharLMTask`: character-level language modelling for the decoders (L2) on text generated
  by a small English grammar (:func:`grammar_text`) with subject-verb agreement ("the cat sees",
  "the cats see"). The text comes from a hand-written 64-bit generator (SplitMix64), not from
  NumPy or ``random``, so it is the same string on every platform and every Python and NumPy
  version; the first 90% of the sentences train, the last 10% validate. Because the grammar is
  known, so is its entropy rate (:func:`grammar_entropy_rate`), the floor under any model's loss.
- :class:`ReversalLMTask`: the reversal task for the decoders as prompt and answer, with a loss
  mask that counts the answer only (L5, supervised fine-tuning).

Batches come from :meth:`~CharLMTask.batch` ``(split, index, batch_size, seed)``: batch ``index``
is drawn from ``numpy.random.default_rng((seed, split_code, index))`` alone, so it does not depend
on which batches were drawn before it. A trainer that has consumed ``k`` batches resumes exactly by
asking for batch ``k`` next: the data position is one integer.
"""
from __future__ import annotations

import math
import zlib
from typing import NamedTuple

import numpy as np

from refmath._validate import check_choice, check_int, check_ndim
from refmath.losses import IGNORE_INDEX

__all__ = ["CharTokenizer", "SplitMix64", "Choice", "Maybe", "grammar_sentences", "grammar_text",
           "grammar_entropy_rate", "unigram_entropy", "CharLMTask", "ReversalTask",
           "ReversalLMTask", "make_task"]

# ---- the tokenizer -------------------------------------------------------------------------------

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(len(SPECIALS))
REPLACEMENT_CHAR = "\ufffd"  # what <unk> decodes to: Unicode's own "unknown character" mark


class CharTokenizer:
    """One id per character of ``alphabet`` (in its order), after the four special ids.

    ``encode`` handles characters outside the alphabet explicitly: ``unknown="error"`` (default)
    raises naming the character and its position, ``unknown="unk"`` maps it to ``<unk>``.
    ``decode(encode(s)) == s`` for every string ``s`` over the alphabet.
    """

    def __init__(self, alphabet: str):
        if not isinstance(alphabet, str) or not alphabet:
            raise ValueError(f"alphabet must be a non-empty string, got {alphabet!r}")
        repeated = sorted({c for c in alphabet if alphabet.count(c) > 1})
        if repeated:
            raise ValueError(f"alphabet must not repeat characters, repeats {repeated}")
        self.alphabet = alphabet
        self._id_of = {c: i + len(SPECIALS) for i, c in enumerate(alphabet)}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        """The tokenizer whose alphabet is the sorted set of characters of ``text``."""
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.alphabet)

    def encode(self, text: str, unknown: str = "error") -> np.ndarray:
        """Ids of the characters of ``text`` as an int64 array ``(len(text),)``."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        check_choice("unknown", unknown, ("error", "unk"))
        ids = np.empty(len(text), dtype=np.int64)
        for i, c in enumerate(text):
            idx = self._id_of.get(c)
            if idx is None:
                if unknown == "error":
                    raise ValueError(
                        f"character {c!r} at position {i} of the text is not in the tokenizer's "
                        f"alphabet {self.alphabet!r}; pass unknown='unk' to map it to <unk>"
                    )
                idx = UNK_ID
            ids[i] = idx
        return ids

    def decode(self, ids, specials: str = "drop") -> str:
        """The text of ``ids`` (a 1-D sequence of ints).

        ``specials="drop"`` leaves out ``<pad>``, ``<bos>`` and ``<eos>`` and writes ``<unk>`` as
        U+FFFD; ``specials="show"`` writes every special id as its name, e.g. ``<eos>``.
        """
        check_choice("specials", specials, ("drop", "show"))
        ids = np.asarray(ids)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"ids must be integers, got dtype {ids.dtype} with shape {ids.shape}")
        check_ndim("ids", ids, 1, "(T,)")
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bad.any():
            raise ValueError(f"ids must lie in [0, {self.vocab_size}), got {ids[bad][:6]} "
                             f"(shape {ids.shape})")
        out = []
        for idx in ids.tolist():
            if idx >= len(SPECIALS):
                out.append(self.alphabet[idx - len(SPECIALS)])
            elif specials == "show":
                out.append(SPECIALS[idx])
            elif idx == UNK_ID:
                out.append(REPLACEMENT_CHAR)
        return "".join(out)


# ---- a portable random number generator for the corpus -------------------------------------------

_MASK64 = (1 << 64) - 1


class SplitMix64:
    """Steele, Lea and Flood's SplitMix64: 64-bit outputs from a 64-bit counter.

    Written out in Python integers so the corpus is identical on every platform and library
    version (NumPy does not promise that its Generator streams never change).
    """

    def __init__(self, seed: int):
        self.state = seed & _MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """A draw from ``0 .. n-1``; the modulo bias is below ``n / 2**64``, i.e. none in practice."""
        return self.next() % n


# ---- the grammar ---------------------------------------------------------------------------------
# A node is a str (emitted as is), a tuple (its parts in order), a Choice (one option, uniformly)
# or a Maybe (its node with probability 1/2, else nothing).


class Choice(NamedTuple):
    options: tuple


class Maybe(NamedTuple):
    node: object


_ADJECTIVES = Choice(("big", "small", "red", "green", "quiet", "happy", "lazy", "brave"))
_NOUNS = (("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("fox", "foxes"),
          ("child", "children"), ("robot", "robots"), ("teacher", "teachers"), ("mouse", "mice"))
_VERBS = (("sees", "see"), ("likes", "like"), ("chases", "chase"), ("helps", "help"),
          ("watches", "watch"), ("follows", "follow"))
_DETERMINERS = (("the", "a", "one", "this"), ("the", "some", "two", "these"))


def _noun_phrase(number: int):
    """``det [adj] noun`` in the singular (0) or plural (1)."""
    return (Choice(_DETERMINERS[number]), " ", Maybe((_ADJECTIVES, " ")),
            Choice(tuple(n[number] for n in _NOUNS)))


_OBJECT = Choice((_noun_phrase(0), _noun_phrase(1)))
_PLACE = Maybe((" ", Choice(("near", "behind", "under", "with")), " ", _OBJECT))
# The subject's number picks the verb form: that agreement is what a model must carry across the
# optional adjective. Every option of every Choice and Maybe yields a different word, so each
# sentence has a single derivation (needed by grammar_entropy_rate).
GRAMMAR = Choice(tuple(
    (_noun_phrase(number), " ", Choice(tuple(v[number] for v in _VERBS)), " ", _OBJECT, _PLACE,
     ".\n")
    for number in (0, 1)
))


def _generate(node, rng: SplitMix64, out: list) -> None:
    if isinstance(node, str):
        out.append(node)
    elif isinstance(node, Choice):
        _generate(node.options[rng.below(len(node.options))], rng, out)
    elif isinstance(node, Maybe):
        if rng.below(2):
            _generate(node.node, rng, out)
    else:
        for part in node:
            _generate(part, rng, out)


def grammar_sentences(n: int, seed: int = 0, grammar=GRAMMAR) -> list[str]:
    """``n`` sentences of ``grammar``, each ending in ``".\\n"``, from SplitMix64 seeded ``seed``."""
    n = check_int("n", n, 1)
    rng = SplitMix64(check_int("seed", seed, 0))
    sentences = []
    for _ in range(n):
        out: list[str] = []
        _generate(grammar, rng, out)
        sentences.append("".join(out))
    return sentences


def grammar_text(n: int, seed: int = 0) -> str:
    """The corpus: ``n`` sentences of :data:`GRAMMAR` joined (one per line)."""
    return "".join(grammar_sentences(n, seed))


def _entropy_and_length(node) -> tuple[float, float]:
    """(entropy in nats, expected length in characters) of the string a node emits."""
    if isinstance(node, str):
        return 0.0, float(len(node))
    if isinstance(node, Choice):
        parts = [_entropy_and_length(option) for option in node.options]
        k = len(parts)
        return math.log(k) + sum(h for h, _ in parts) / k, sum(n for _, n in parts) / k
    if isinstance(node, Maybe):
        h, n = _entropy_and_length(node.node)
        return math.log(2) + h / 2, n / 2
    parts = [_entropy_and_length(part) for part in node]
    return sum(h for h, _ in parts), sum(n for _, n in parts)


def grammar_entropy_rate(grammar=GRAMMAR) -> float:
    r"""Entropy per character (nats) of an endless stream of independent sentences.

    .. math:: h = \frac{H(S)}{\mathbb E\,|S|}

    where :math:`H(S)` is the entropy of one sentence and :math:`|S|` its length with the newline
    (a renewal argument: the sentences are independent and the newline marks where each ends). If
    every sentence has a single derivation, :math:`H(S)` is the entropy of the choices made:
    :math:`\log k` plus the mean of the options' entropies for a uniform choice among ``k``,
    :math:`\log 2` plus half the inner entropy for an optional part. No model can average less
    than :math:`h` nats per character over a long text; with a short context window it averages
    more, since it first has to find where in a sentence the window starts.
    """
    h, n = _entropy_and_length(grammar)
    return h / n


# ---- the tasks -----------------------------------------------------------------------------------

SPLITS = {"train": 0, "val": 1}


def _split_code(split: str) -> int:
    return SPLITS[check_choice("split", split, sorted(SPLITS))]


def _check_batch_args(index, batch_size, seed) -> None:
    for name, value, low in (("index", index, 0), ("batch_size", batch_size, 1), ("seed", seed, 0)):
        check_int(name, value, low)


def unigram_entropy(counts) -> float:
    r"""Entropy :math:`-\sum_v p_v \log p_v` (nats) of the frequencies ``counts / counts.sum()``:
    the loss of the best model that ignores the context (it predicts the frequencies)."""
    counts = np.asarray(counts, dtype=np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


class CharLMTask:
    """Next-character prediction on :func:`grammar_text` (for the decoders, L2).

    ``n_sentences`` sentences come from SplitMix64 seeded ``corpus_seed``; the first 90% (at least
    one) train, the rest validate. A batch holds ``batch_size`` windows of ``seq_len + 1``
    consecutive characters of the split, at uniformly drawn offsets: ``tokens`` the first
    ``seq_len``, ``targets`` the last ``seq_len`` (each the next character of its token).
    """

    name = "chars"

    def __init__(self, seq_len: int = 64, n_sentences: int = 8000, corpus_seed: int = 0):
        seq_len = check_int("seq_len", seq_len, 1)
        n_sentences = check_int("n_sentences", n_sentences, 2)  # one per split at least
        corpus_seed = check_int("corpus_seed", corpus_seed, 0)
        self.seq_len, self.n_sentences, self.corpus_seed = seq_len, n_sentences, corpus_seed
        sentences = grammar_sentences(n_sentences, corpus_seed)
        n_train = min(n_sentences - 1, max(1, (9 * n_sentences) // 10))
        self.text = {"train": "".join(sentences[:n_train]), "val": "".join(sentences[n_train:])}
        self.tokenizer = CharTokenizer.from_text("".join(sentences))
        self.ids = {split: self.tokenizer.encode(text) for split, text in self.text.items()}
        for split, ids in self.ids.items():
            if ids.size < seq_len + 1:
                raise ValueError(f"the {split} split has {ids.size} characters, fewer than "
                                 f"seq_len + 1 = {seq_len + 1}; raise n_sentences")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def settings(self) -> dict:
        """What rebuilds this task exactly (saved in checkpoints)."""
        return {"name": self.name, "seq_len": self.seq_len, "n_sentences": self.n_sentences,
                "corpus_seed": self.corpus_seed}

    def batch(self, split: str, index: int, batch_size: int, seed: int) -> dict:
        """Batch number ``index`` of ``split``: ``{"tokens", "targets"}``, int64 ``(B, seq_len)``."""
        code = _split_code(split)
        _check_batch_args(index, batch_size, seed)
        ids = self.ids[split]
        rng = np.random.default_rng((seed, code, index))
        starts = rng.integers(0, ids.size - self.seq_len, size=batch_size)
        windows = ids[starts[:, None] + np.arange(self.seq_len + 1)]
        return {"tokens": windows[:, :-1], "targets": windows[:, 1:]}

    def unigram_entropy(self) -> float:
        """Entropy of the training split's character frequencies (nats per character)."""
        return unigram_entropy(np.bincount(self.ids["train"], minlength=self.vocab_size))

    def entropy_rate(self) -> float:
        """The grammar's entropy per character, the floor under any model's loss (nats)."""
        return grammar_entropy_rate()


class ReversalTask:
    """Reverse a string of digits (the encoder-decoder's translation task, L1).

    A source has a uniformly drawn length ``1..max_len`` and uniform digits; its target is the
    digits reversed, then ``<eos>``. A string belongs to the validation split when its CRC-32 is
    divisible by 10 (about 10% of strings), else to the training split: the splits never share a
    string, and membership does not depend on the seed. Drawing for one split redraws strings of
    the other.

    Batches: ``src`` ``(B, max_len)`` and ``tgt`` ``(B, max_len + 1)`` padded with ``<pad>`` = 0,
    ``src_lengths`` = n, ``tgt_lengths`` = n + 1.
    """

    name = "reverse"
    alphabet = "0123456789"

    def __init__(self, max_len: int = 8):
        max_len = check_int("max_len", max_len, 1)
        self.max_len = max_len
        self.tokenizer = CharTokenizer(self.alphabet)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def settings(self) -> dict:
        return {"name": self.name, "max_len": self.max_len}

    @staticmethod
    def split_of(source: str) -> str:
        """``"val"`` if the CRC-32 of the string's ASCII bytes is divisible by 10, else ``"train"``."""
        return "val" if zlib.crc32(source.encode("ascii")) % 10 == 0 else "train"

    def examples(self, split: str, index: int, batch_size: int, seed: int) -> list[str]:
        """The source strings of batch ``index`` of ``split``."""
        _split_code(split)
        _check_batch_args(index, batch_size, seed)
        rng = np.random.default_rng((seed, SPLITS[split], index))
        out = []
        while len(out) < batch_size:
            n = int(rng.integers(1, self.max_len + 1))
            source = "".join(self.alphabet[d] for d in rng.integers(0, 10, size=n))
            if self.split_of(source) == split:
                out.append(source)
        return out

    def encode_sources(self, sources: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(src, src_lengths)``: the strings' ids padded to ``(B, max_len)``, and their lengths."""
        src = np.full((len(sources), self.max_len), PAD_ID, dtype=np.int64)
        lengths = np.empty(len(sources), dtype=np.int64)
        for row, source in enumerate(sources):
            if not 1 <= len(source) <= self.max_len:
                raise ValueError(f"source {source!r} must have 1..{self.max_len} characters")
            src[row, :len(source)] = self.tokenizer.encode(source)
            lengths[row] = len(source)
        return src, lengths

    def batch(self, split: str, index: int, batch_size: int, seed: int) -> dict:
        """Batch ``index`` of ``split``: ``{"src", "src_lengths", "tgt", "tgt_lengths"}``."""
        sources = self.examples(split, index, batch_size, seed)
        src, src_lengths = self.encode_sources(sources)
        tgt = np.full((batch_size, self.max_len + 1), PAD_ID, dtype=np.int64)
        for row, source in enumerate(sources):
            n = len(source)
            tgt[row, :n] = src[row, :n][::-1]
            tgt[row, n] = EOS_ID
        return {"src": src, "src_lengths": src_lengths, "tgt": tgt, "tgt_lengths": src_lengths + 1}

    def unigram_entropy(self, n_batches: int = 40, batch_size: int = 100) -> float:
        """Entropy of the target-token frequencies (digits and ``<eos>``) over ``n_batches``
        training batches (a fixed sample, seed 0): a context-free model's loss, in nats."""
        counts = np.zeros(self.vocab_size)
        for index in range(n_batches):
            batch = self.batch("train", index, batch_size, seed=0)
            counted = np.arange(batch["tgt"].shape[1]) < batch["tgt_lengths"][:, None]
            counts += np.bincount(batch["tgt"][counted], minlength=self.vocab_size)
        return unigram_entropy(counts)

    def entropy_rate(self) -> float:
        """The target is a function of the source, so the loss floor is 0."""
        return 0.0


class ReversalLMTask:
    r"""The reversal task for a decoder-only model, trained like supervised fine-tuning (L5).

    Each sequence is ``<bos> x_1 .. x_n = x_n .. x_1 <eos>``, padded with ``<pad>``: the digits and
    ``=`` form the prompt, the reversed digits and ``<eos>`` the answer. A batch holds ``tokens``
    (the sequence without its last position), ``targets`` (without its first; padding is -100) and
    ``loss_mask``, 1 exactly where the target is an answer token, so that the loss counts the
    answer only: :math:`-\sum_t \log p(a_t \mid q, a_{<t})` over the answer, divided by its
    length. Sources and the train/validation split are :class:`ReversalTask`'s.
    """

    name = "reverse-lm"
    separator = "="

    def __init__(self, max_len: int = 8):
        self.source = ReversalTask(max_len)
        self.max_len = max_len
        self.seq_len = 2 * max_len + 2  # <bos>, n digits, "=", n digits (the <eos> is a target)
        self.tokenizer = CharTokenizer(ReversalTask.alphabet + self.separator)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def settings(self) -> dict:
        return {"name": self.name, "max_len": self.max_len}

    def prompt_ids(self, source: str) -> np.ndarray:
        """``<bos>`` + the digits + ``=``: what a decoder continues with the reversed digits."""
        return np.concatenate([[BOS_ID], self.tokenizer.encode(source + self.separator)])

    def batch(self, split: str, index: int, batch_size: int, seed: int) -> dict:
        """Batch ``index`` of ``split``: ``{"tokens", "targets", "loss_mask"}``, ``(B, seq_len)``."""
        sources = self.source.examples(split, index, batch_size, seed)
        full = np.full((batch_size, self.seq_len + 1), PAD_ID, dtype=np.int64)
        answer = np.zeros(full.shape, dtype=bool)
        for row, source in enumerate(sources):
            n = len(source)
            prompt = self.prompt_ids(source)
            full[row, :n + 2] = prompt
            full[row, n + 2:2 * n + 2] = prompt[1:n + 1][::-1]
            full[row, 2 * n + 2] = EOS_ID
            answer[row, n + 2:2 * n + 3] = True
        targets = np.where(full[:, 1:] == PAD_ID, IGNORE_INDEX, full[:, 1:])
        return {"tokens": full[:, :-1], "targets": targets,
                "loss_mask": answer[:, 1:].astype(np.int64)}

    def unigram_entropy(self, n_batches: int = 40, batch_size: int = 100) -> float:
        """Entropy of the answer tokens' frequencies over a fixed sample (seed 0), in nats."""
        counts = np.zeros(self.vocab_size)
        for index in range(n_batches):
            batch = self.batch("train", index, batch_size, seed=0)
            counts += np.bincount(batch["targets"][batch["loss_mask"] == 1], minlength=self.vocab_size)
        return unigram_entropy(counts)

    def entropy_rate(self) -> float:
        """The answer is a function of the prompt, so the loss floor is 0."""
        return 0.0


def make_task(settings: dict):
    """The task that ``task.settings()`` describes (``{"name": ..., ...}``)."""
    settings = dict(settings)
    name = settings.pop("name", None)
    tasks = {task.name: task for task in (CharLMTask, ReversalTask, ReversalLMTask)}
    if name not in tasks:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(tasks)}")
    return tasks[name](**settings)
