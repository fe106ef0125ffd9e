"""llama.cpp as a peer of benchmarks/generate.py (benchmarks/_llamacpp.py).

Without llama-cpp-python (CI does not compile it) the peer is skipped with a line naming what to
install, and these tests check that line and the parts that need only the ``gguf`` package (the
``dev`` extra) and transformers: the stand-in tokenizer llama.cpp's converter accepts, and the
bytes a GGUF file's token reads. Where llama-cpp-python and its converter are present
(``LLAMA_CPP_CONVERTER``), the last test converts a tiny checkpoint at F32 and checks that
llama.cpp's greedy ids are refmath's."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _llamacpp  # noqa: E402  (benchmarks/, put on the path above)

from refmath import hf, kernels  # noqa: E402
from refmath.models import decoder, model_module  # noqa: E402

TINY = decoder.DecoderConfig(vocab_size=512, max_seq_len=128, d_model=64, n_layers=2, n_heads=4,
                             n_kv_heads=2, d_ff=128, tie_embeddings=False, rope_layout="half",
                             norm_eps=1e-5)


def _present(monkeypatch, *modules):
    for name in modules:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))


def test_without_llama_cpp_the_peer_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp then raises ImportError
    _present(monkeypatch, "gguf", "sentencepiece")
    why = _llamacpp.missing(Path(__file__))
    assert "llama-cpp-python not installed" in why
    assert "pip install -e '.[llamacpp]'" in why


def test_without_the_converter_the_peer_says_where_to_find_it(monkeypatch, tmp_path):
    _present(monkeypatch, "llama_cpp", "gguf", "sentencepiece")
    monkeypatch.delenv(_llamacpp.CONVERTER_ENV, raising=False)
    assert _llamacpp.converter_path(None) is None
    why = _llamacpp.missing(None)
    assert "--gguf-converter" in why and "vendor/llama.cpp/convert_hf_to_gguf.py" in why
    assert "is not a file" in _llamacpp.missing(tmp_path / "nowhere.py")
    monkeypatch.setenv(_llamacpp.CONVERTER_ENV, str(tmp_path / "c.py"))
    assert _llamacpp.converter_path(None) == tmp_path / "c.py"
    assert _llamacpp.converter_path("given.py") == Path("given.py")
    (tmp_path / "c.py").write_text("")
    assert _llamacpp.missing(_llamacpp.converter_path(None)) is None


def test_generate_benchmark_skips_the_peer_with_that_line(monkeypatch, capsys):
    pytest.importorskip("torch", reason="benchmarks/generate.py needs torch (pip install torch)")
    pytest.importorskip("transformers", reason="benchmarks/generate.py needs transformers")
    pytest.importorskip("threadpoolctl")
    if not kernels.cpu_available():
        pytest.skip("refmath._C is not built (pip install -e .)")
    import generate

    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # as in CI, which has neither
    assert generate.main(["--quick", "--peers", "llamacpp", "--no-self"]) == 0
    out = capsys.readouterr().out
    assert ("llama.cpp peer skipped: llama-cpp-python, sentencepiece not installed "
            "(pip install -e '.[llamacpp]'") in out


def test_stand_in_tokenizer_is_one_llamas_converter_accepts(tmp_path):
    """gguf's LlamaHfVocab is the converter's reader for a Llama tokenizer.json: it must take the
    stand-in, with exactly the model's vocabulary, ids in order; refmath's own character tokenizer
    (WordLevel) it refuses, which is why the stand-in exists."""
    gguf = pytest.importorskip("gguf", reason="pip install gguf (the dev extra)")
    pytest.importorskip("transformers", reason="LlamaHfVocab reads the tokenizer with transformers")
    _llamacpp.write_stand_in_tokenizer(tmp_path, 300)
    vocab = gguf.LlamaHfVocab(tmp_path)
    tokens = [text for text, _, _ in vocab.all_tokens()]
    assert vocab.vocab_size == len(tokens) == 300
    assert tokens[:4] == [b"<unk>", b"<s>", b"</s>", b"<0x00>"]
    assert tokens[-1] == "\u2581t40".encode()
    with pytest.raises(ValueError, match="vocab_size must be at least 259"):
        _llamacpp.write_stand_in_tokenizer(tmp_path, 258)

    from refmath.data import CharTokenizer

    char = tmp_path / "char"
    hf.save_tokenizer(char, CharTokenizer("abc"))
    with pytest.raises(FileNotFoundError, match="Cannot find Llama BPE tokenizer"):
        gguf.LlamaHfVocab(char)


def test_weight_bytes_per_token_reads_one_row_of_the_embedding(tmp_path):
    gguf = pytest.importorskip("gguf", reason="pip install gguf (the dev extra)")
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    vocab, width = 100, 64
    table = rng.standard_normal((vocab, width)).astype(np.float32)
    head = rng.standard_normal((vocab, width)).astype(np.float32)
    norm = np.ones(width, np.float32)
    for kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0):
        path = tmp_path / f"{kind.name}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        stored = {}
        for name, value in (("token_embd.weight", table), ("output.weight", head)):
            stored[name] = quantize(value, kind)
            writer.add_tensor(name, stored[name], raw_dtype=kind)
        writer.add_tensor("output_norm.weight", norm)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        row = stored["token_embd.weight"].nbytes // vocab  # Q8_0: 2 blocks of 34 bytes
        assert row == (width * 4 if kind.name == "F32" else width // 32 * 34)
        want = row + stored["output.weight"].nbytes + norm.nbytes
        assert _llamacpp.weight_bytes_per_token(path) == want
        assert _llamacpp.gguf_types(path) == ("F32 x3" if kind.name == "F32" else "Q8_0 x2, F32 x1")


def test_llamacpp_greedy_ids_are_refmaths_at_f32(tmp_path):
    """Needs llama-cpp-python and its converter (LLAMA_CPP_CONVERTER); CI has neither."""
    why = _llamacpp.missing(_llamacpp.converter_path(None))
    if why is not None:
        pytest.skip(f"llama.cpp peer: {why}")
    pytest.importorskip("torch", reason="llama.cpp's converter needs torch")
    from refmath.inference.generate import generate

    params = model_module("llama").init_params(TINY, seed=0, dtype=np.float32)
    hf.save_checkpoint(tmp_path, "llama", TINY, params)
    _llamacpp.write_stand_in_tokenizer(tmp_path, TINY.vocab_size)
    path = _llamacpp.convert(tmp_path, "f32", tmp_path / "tiny-f32.gguf",
                             _llamacpp.converter_path(None))
    prompt = np.random.default_rng(0).integers(0, TINY.vocab_size, 8)
    n = 32
    ours = generate("llama", params, TINY, prompt, n, greedy=True)[-n:]
    peer = _llamacpp.LlamaCppPeer(path, threads=1, n_ctx=len(prompt) + n)
    try:
        theirs = peer.generate(prompt, n)
        again = peer.generate(prompt, n)  # a second run starts afresh, not from the last cache
    finally:
        peer.close()
    np.testing.assert_array_equal(theirs, ours)
    np.testing.assert_array_equal(again, ours)


def test_repack_off_reaches_the_model_parameters_and_is_put_back(monkeypatch):
    """Llama() takes no argument for use_extra_bufts: the peer sets it on the default parameters
    while the model loads, and leaves llama-cpp-python's function as it was."""
    low = types.SimpleNamespace(llama_model_default_params=lambda: types.SimpleNamespace(
        use_extra_bufts=True, n_gpu_layers=-1))
    package = types.ModuleType("llama_cpp")
    package.llama_cpp = low
    monkeypatch.setitem(sys.modules, "llama_cpp", package)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", low)
    original = low.llama_model_default_params
    with _llamacpp._model_params(use_extra_bufts=False):
        params = low.llama_model_default_params()
        assert params.use_extra_bufts is False and params.n_gpu_layers == -1
    assert low.llama_model_default_params is original
