r"""Lesson 13, real weights, the same function as the library everyone uses
(``notebooks/13_real_weights.py``): the expected value and the known slips of each exercise,
computed from the library and from the lesson's inputs."""
from __future__ import annotations

import numpy as np

from refmath.lessons.table import exercise, function_exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; nothing here is called by name.
__all__ = []


def _read_embedding(path, start=None, dtype="<f8"):
    """``model.embed_tokens.weight`` read from the safetensors file at ``path``: from its offsets
    counted from the end of the header, 8 + N bytes into the file, or from byte ``start + b``."""
    import json

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(n))["model.embed_tokens.weight"]
        begin, end = entry["data_offsets"]
        f.seek((8 + n if start is None else start(n)) + begin)
        return np.frombuffer(f.read(end - begin), dtype=dtype).reshape(entry["shape"])


@exercise("13.1", "the embedding read from the file", "the section 'The safetensors format'",
          "the offsets count from the end of the header, 8 + N bytes into the file",
          uses=("params", "weights_path"), rtol=0.0)
def _embedding_from_file(params, weights_path):
    table = params["tok_emb"]
    return table, {
        "the offsets counted from the start of the file: they count from the end of the header":
            _read_embedding(weights_path, start=lambda n: 0),
        "the header's N bytes skipped but not the 8 bytes that give N":
            _read_embedding(weights_path, start=lambda n: n),
        "read big-endian: safetensors stores its numbers little-endian (<f8)":
            _read_embedding(weights_path, dtype=">f8"),
        "transposed: an embedding is a V x d lookup table, stored as it is used": table.T}


@exercise("13.2", "W_Q from q_proj.weight", "the section 'Two "
          "RoPE layouts, one function'", "within each head: half coordinate r, then r + d_h/2",
          uses=("heads", "d_h"), rtol=0.0)
def _interleaved_rows(heads, d_h):
    from refmath import hf

    moved = hf.interleaved_to_half(np.arange(heads * d_h), d_h)  # half row j <- interleaved moved[j]
    return np.argsort(moved), {
        "the rows in Hugging Face's order, unpermuted: its halves layout is not refmath's "
        "interleaved one": np.arange(heads * d_h),
        "the permutation the other way: interleaved to half, not back": moved}


@exercise("13.4", "the bfloat16 patterns as numbers", "the section 'bfloat16 without bfloat16'",
          "shift the 16 bits into the upper half of a uint32", uses=("patterns",), rtol=0.0)
def _bfloat16_values(patterns):
    patterns = np.asarray(patterns, dtype=np.uint16)
    s, e, m = patterns >> 15, (patterns >> 7) & 0xFF, patterns & 0x7F
    if not np.all((e > 0) & (e < 255)):
        raise ValueError("13.4: the formula holds for normal numbers only")
    return (-1.0) ** s * 2.0 ** (e.astype(np.int64) - 127) * (1 + m / 2**7), {
        "the patterns read as float16: bfloat16 has float32's 8 exponent bits":
            patterns.view(np.float16).astype(np.float32)}


_GPT2_CONFIG = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768,
                "n_layer": 12, "n_head": 12}
_REAL_NEEDS = "the section 'What a real model needs'"


@exercise("13.5a", "this lesson's parameter count", _REAL_NEEDS,
          "embeddings, then per layer two RMSNorms, the four attention and three FFN matrices, "
          "then the final norm (and an untied output)", uses=("hf_config",), rtol=0.0)
def _tiny_count(hf_config):
    from refmath.sizing import hf_parameter_count

    total = hf_parameter_count(hf_config)
    d = hf_config["hidden_size"]
    v, untied = hf_config["vocab_size"], not hf_config.get("tie_word_embeddings", False)
    slips = {"the final norm forgotten (d)": total - d}
    if untied:  # this lesson's checkpoint: its own output matrix, V x d
        slips["the untied output matrix left out (V x d): tie_word_embeddings is false"] = \
            total - v * d
    return total, slips


@exercise("13.5b", "GPT-2 small's parameter count", _REAL_NEEDS,
          "the final LayerNorm and the position table count too", rtol=0.0)
def _gpt2_count():
    from refmath.sizing import hf_parameter_count

    total = hf_parameter_count(_GPT2_CONFIG)
    return total, {"the position table forgotten (1024 x 768)": total - 1024 * 768,
                   "the final LayerNorm forgotten (2 x 768)": total - 2 * 768,
                   "an output matrix counted: GPT-2 ties it to the token table":
                       total + 50257 * 768}


@exercise("13.5c", "GPT-2 small in float32, MiB", _REAL_NEEDS,
          "4 bytes a parameter, and a MiB is 2^20 bytes")
def _gpt2_mib():
    from refmath.sizing import hf_parameter_count

    total = hf_parameter_count(_GPT2_CONFIG)
    return 4 * total / 2**20, {"MB (10^6 bytes), not MiB (2^20)": 4 * total / 1e6,
                               "2 bytes per parameter: that is bfloat16, not float32":
                                   2 * total / 2**20}


def _undo_interleaved_to_half(w, head_dim):
    """The reference: the inverse of the library's permutation, found by applying it to 0, 1, ..."""
    from refmath import hf

    moved = hf.interleaved_to_half(np.arange(w.shape[-1]), head_dim)  # half column j <- moved[j]
    return w[..., np.argsort(moved)]


@function_exercise("13.3", "your half_to_interleaved", "the section 'Two RoPE layouts, one function'",
                   "within each head, interleaved coordinate 2r is half coordinate r, 2r + 1 is "
                   "r + head_dim / 2", uses=("q_proj", "k_proj", "d_h", "rng"))
def _half_to_interleaved(q_proj, k_proj, d_h, rng):
    from refmath import hf

    layout_inputs = [(q_proj.T, d_h), (k_proj.T, d_h), (rng.standard_normal(3 * 4), 4),
                     (rng.standard_normal((5, 16)), 16), (rng.standard_normal((2, 3, 24)), 12)]
    return dict(
        reference=_undo_interleaved_to_half, inputs=layout_inputs, rtol=0,
        reference_name="the inverse of hf.interleaved_to_half",
        slips={"interleaved_to_half itself, not its inverse": hf.interleaved_to_half,
               "the permutation taken over the whole width, not within each head":
                   lambda w, head_dim: _undo_interleaved_to_half(w, w.shape[-1]),
               "the columns left in the half layout": lambda w, head_dim: w})
