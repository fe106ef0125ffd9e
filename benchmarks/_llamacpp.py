"""llama.cpp as a peer of refmath's generation in benchmarks/generate.py (``--peers llamacpp``).

The peer is llama-cpp-python (the optional extra ``llamacpp``: ``pip install -e '.[llamacpp]'``,
which compiles llama.cpp from source) running a GGUF file made by llama.cpp's own converter,
``convert_hf_to_gguf.py``, from the very Hugging Face folder refmath and transformers load. The
converter is not in the installed package; it is in the package's source distribution
(``vendor/llama.cpp/convert_hf_to_gguf.py``), found by ``--gguf-converter`` or the environment
variable ``LLAMA_CPP_CONVERTER`` (see :data:`HOW_TO_GET_IT`). Using llama.cpp's converter rather
than writing the GGUF here keeps the peer's side in the peer's hands: its tensor names, its
permutation of the query and key rows for its RoPE, and its own rounding to each format.

What each format means on each side (the same name is not the same bytes):

* f32: every tensor float32 on both sides.
* bf16, f16: the converter rounds every matrix, the output head and the embedding table included,
  to 16 bits; refmath's ``weights=`` rounds the layers' seven matrices and the output head and
  keeps the embedding float32, of which a token reads one row (its bytes per token are larger by
  half a row; until the head was stored, records up to 2026-12-07 00:49, by half the head).
* q8 (GGUF ``Q8_0``, blocks of 32 int8 weights with one float16 scale): the converter quantises
  the head and the embedding too; refmath's ``q8_0`` the layers' matrices and the head, the
  embedding float32. Both round the head from the same float32 numbers by the same rule (a tied
  head: refmath a copy of the table, its lookup reading the float32 one). llama.cpp also
  rounds the activations to Q8_0 (or to f16/bf16 for those formats) before each product, where
  refmath keeps them float32: the two sides' tokens part sooner at low precision for both reasons.

The tokenizer. A random checkpoint has none, and refmath's own ``tokenizer.json`` (one word per
character, the ``tokenizers`` package's WordLevel model, as ``convert --to-hf`` writes it) is
refused by the converter for a Llama checkpoint ("BPE pre-tokenizer was not recognized"): it
accepts a SentencePiece ``tokenizer.model``, a Llama BPE ``tokenizer.json`` with byte fallback, or
a BPE tokenizer whose pre-tokenizer it recognises by hash. :func:`write_stand_in_tokenizer` writes
the second kind, with exactly the model's vocabulary size. Both sides are fed token ids, never
text, so what the pieces spell does not matter; only the count (llama.cpp checks it against the
embedding's rows) and the special ids do.

The KV cache is float32 on the llama.cpp side too (``type_k``, ``type_v``; its default is f16),
so that at f32 both sides compute the same function and the KV bytes per token are the same.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

CONVERTER_ENV = "LLAMA_CPP_CONVERTER"
INSTALL = "pip install -e '.[llamacpp]'"
HOW_TO_GET_IT = (
    f"llama.cpp's converter comes with llama-cpp-python's source: `pip download --no-deps "
    f"--no-binary :all: llama-cpp-python==VERSION` (the version installed), unpack it, and pass "
    f"--gguf-converter llama_cpp_python-VERSION/vendor/llama.cpp/convert_hf_to_gguf.py (or set "
    f"{CONVERTER_ENV})")
# The benchmark's names (those of `python -m refmath generate --weights`) and the GGUF types the
# converter's --outtype takes for them.
GGUF_TYPES = {"f32": "f32", "bf16": "bf16", "f16": "f16", "q8": "q8_0"}


def converter_path(given: str | None = None) -> Path | None:
    """The converter script: ``given``, else the environment's :data:`CONVERTER_ENV`, else None."""
    path = given or os.environ.get(CONVERTER_ENV)
    return Path(path) if path else None


def missing(converter: Path | None) -> str | None:
    """Why the peer cannot run here (what to install or point at), or None when it can."""
    needs = []
    for module, package in (("llama_cpp", "llama-cpp-python"), ("gguf", "gguf"),
                            ("sentencepiece", "sentencepiece")):  # the converter imports it
        try:
            __import__(module)
        except ImportError:
            needs.append(package)
    if needs:
        return f"{', '.join(needs)} not installed ({INSTALL}; it compiles llama.cpp)"
    if converter is None:
        return f"no converter given: {HOW_TO_GET_IT}"
    if not converter.is_file():
        return f"the converter {converter} is not a file: {HOW_TO_GET_IT}"
    return None


def write_stand_in_tokenizer(directory, vocab_size: int) -> Path:
    """A Llama-style BPE ``tokenizer.json`` with byte fallback and exactly ``vocab_size`` pieces
    (``<unk>``, ``<s>``, ``</s>`` at 0, 1, 2 as in Llama 2, the 256 byte pieces, then placeholder
    pieces; no merges), and a ``tokenizer_config.json`` naming the special tokens: the form of
    tokenizer llama.cpp's converter accepts for a Llama checkpoint that has no
    ``tokenizer.model``. Returns the path of ``tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    specials = ["<unk>", "<s>", "</s>"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)]
    if vocab_size < len(pieces):
        raise ValueError(f"vocab_size must be at least {len(pieces)} (3 special and 256 byte "
                         f"pieces) for a byte-fallback tokenizer, got {vocab_size}")
    pieces += [f"\u2581t{i}" for i in range(vocab_size - len(pieces))]
    tokenizer = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[],
                                     unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    # Llama 2's text handling (a leading space marker, spaces as U+2581); the converter checks
    # only that the decoder is a Sequence, but a consistent tokenizer keeps transformers quiet.
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                 normalizers.Replace(" ", "\u2581")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(specials)
    directory = Path(directory)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    settings = {"tokenizer_class": "LlamaTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
                "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    return path


def convert(hf_dir, fmt: str, out, converter: Path) -> Path:
    """llama.cpp's converter, in a process of its own, on ``hf_dir`` at format ``fmt`` (a key of
    :data:`GGUF_TYPES`) into the file ``out``. Raises RuntimeError with the converter's last words
    if it fails."""
    command = [sys.executable, str(converter), str(hf_dir), "--outtype", GGUF_TYPES[fmt],
               "--outfile", str(out)]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed (exit {run.returncode}) on {hf_dir} at "
                           f"{fmt}:\n{run.stderr[-3000:]}")
    return Path(out)


def weight_bytes_per_token(path) -> int:
    """The bytes of a GGUF file's tensors that one generated token reads: every tensor once, but
    one row of the token embedding (``token_embd.weight``, ``n_vocab`` rows of ``n_embd``, in its
    own format; a model with a tied head and no ``output.weight`` reads the whole table, as
    llama.cpp then uses it as the head)."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    if "output.weight" in tensors and "token_embd.weight" in tensors:
        table = tensors["token_embd.weight"]
        rows = int(table.shape[-1])  # GGUF lists dimensions innermost first: (n_embd, n_vocab)
        total -= int(table.n_bytes) - int(table.n_bytes) // rows
    return total


def gguf_types(path) -> str:
    """The tensor types in a GGUF file and how many tensors of each, e.g. ``Q8_0 x86, F32 x25``."""
    from collections import Counter

    from gguf import GGUFReader

    counts = Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors)
    return ", ".join(f"{name} x{n}" for name, n in counts.most_common())


@contextlib.contextmanager
def _model_params(**fields):
    """llama-cpp-python's Llama() builds its model parameters from
    ``llama_model_default_params()`` and loads the model in the same call, exposing no argument
    for some fields (``use_extra_bufts``): set them by wrapping that function while a Llama is
    made."""
    from llama_cpp import llama_cpp as low

    default = low.llama_model_default_params

    def chosen():
        params = default()
        for name, value in fields.items():
            setattr(params, name, value)
        return params
    low.llama_model_default_params = chosen
    try:
        yield
    finally:
        low.llama_model_default_params = default


class LlamaCppPeer:
    """One GGUF file loaded by llama-cpp-python for greedy generation from token ids on
    ``threads`` threads (prefill and decode alike), with room for ``n_ctx`` positions, its KV
    cache float32, nothing offloaded to a GPU.

    ``repack``: llama.cpp's "extra buffer types", on by default, which give quantised weights
    (Q8_0 among them) a layout of the CPU backend's choosing when the model loads: AMX tiles where
    the CPU has AMX, interleaved rows for its repacked products elsewhere. False is llama.cpp's
    ``--no-repack``: the weights as stored in the file. (On the Intel Xeon with AMX these figures
    were taken on, llama-cpp-python 0.3.36 built with -DGGML_NATIVE=ON crashed with SIGSEGV in
    ``ggml_backend_amx_mul_mat`` on the first Q8_0 decode with it on.)"""

    def __init__(self, path, threads: int, n_ctx: int, repack: bool = True):
        import llama_cpp

        with _model_params(use_extra_bufts=repack):
            self.llm = llama_cpp.Llama(model_path=str(path), n_threads=threads,
                                       n_threads_batch=threads, n_ctx=n_ctx, n_gpu_layers=0,
                                       type_k=llama_cpp.GGML_TYPE_F32,
                                       type_v=llama_cpp.GGML_TYPE_F32, seed=0, verbose=False)

    def generate(self, prompt, n: int) -> np.ndarray:
        """The ``n`` greedy tokens after ``prompt`` (token ids). reset() first: otherwise
        llama-cpp-python keeps the KV cache of the last run's common prefix (the same prompt) and
        skips its prefill, work the other side does. temp=0 is llama.cpp's greedy sampler (its
        repeat penalty, 1.0, changes nothing). The generator is left after the n-th token, so no
        step beyond it runs: one prefill and n - 1 decode steps, as refmath's loop."""
        self.llm.reset()
        out = []
        for token in self.llm.generate([int(t) for t in prompt], temp=0.0, repeat_penalty=1.0):
            out.append(token)
            if len(out) == n:
                break
        return np.asarray(out, dtype=np.int64)

    def close(self) -> None:
        self.llm.close()


def version() -> str:
    import llama_cpp

    return f"llama-cpp-python {llama_cpp.__version__}"
