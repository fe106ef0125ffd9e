r"""Load and save Hugging Face checkpoints (safetensors) for refmath's reference models.

A Hugging Face model directory holds ``config.json`` and the weights, either one
``model.safetensors`` or several shards listed in ``model.safetensors.index.json``.
:func:`load_checkpoint` turns it into ``(model_name, config, params)``, so that
``refmath.models.model_module(model_name).logits(params, tokens, config)`` computes the same
function as ``transformers``; :func:`save_checkpoint` writes refmath parameters back out in that
format.

==================================  ===============  =============================================
``model_type``                      refmath model    notes
==================================  ===============  =============================================
``gpt2``                            ``"gpt"``        Pre-LN, tied or untied output
``openai-gpt``                      ``"gpt"``        Post-LN, no final norm, tied output
``llama``, ``mistral``              ``"llama"``      RoPE in the ``"half"`` layout (see below);
                                                     Mistral's window is the model's ``sliding_window``
``qwen2``                           ``"llama"``      plus biases on the query, key and value
                                                     projections; a window on some layers caps the
                                                     context at the window (:func:`_context`)
``deepseek_v2``, ``deepseek_v3``    ``"mla"``        dense feed-forward layers only (no experts)
==================================  ===============  =============================================

The encoder-decoder (``marian``) is not converted: Marian's attention projections carry biases,
its FFN is SiLU ("swish") rather than ReLU, it adds a bias to the final logits, and its sinusoid
table puts every sine before every cosine; refmath's encoder-decoder, the paper's, has none of these.

Anything else is refused with a message that names the field and its value (mixture-of-experts
layers, rope scaling such as YaRN or Llama 3.1's, soft-capping, biases refmath's models do not
have, ...): a checkpoint is never loaded into a model that would compute a different function.

Weight layout. ``torch.nn.Linear`` stores :math:`W^\top` (``out x in``) and computes
:math:`x W^\top + b`; refmath's row-vector convention stores ``W`` itself (``in x out``), so linear
weights are transposed. GPT-2's ``Conv1D`` already stores ``in x out``.

RoPE layout. Hugging Face's Llama rotates the coordinate pairs :math:`(x_r, x_{r+d/2})` of each
head (``rotate_half``), the original Llama code the pairs :math:`(x_{2r}, x_{2r+1})`. With the
permutation :math:`\pi` = ``[0, 2, 4, ..., 1, 3, 5, ...]`` of a head's coordinates,
:math:`\operatorname{RoPE}_{\text{half}}(x_\pi) = \operatorname{RoPE}_{\text{interleaved}}(x)_\pi`,
and since queries and keys are permuted alike, every score :math:`\tilde q \cdot \tilde k` is
unchanged. So a checkpoint loads with ``rope_layout="half"`` and its weights untouched; a refmath
model trained with the ``"interleaved"`` layout is saved with the columns of ``W_Q`` and ``W_K``
(and their biases) permuted by :math:`\pi` within each head (:func:`interleaved_to_half`).

Memory. Each tensor is read through its own read-only memory map and converted at once to the
requested dtype, so the peak is about the converted parameters plus one raw tensor; the file's
pages are released as each map closes (``benchmarks/hf_load.py`` measures it). bfloat16 and
float16 tensors are converted exactly (every 16-bit value is a float32 value).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from refmath.models import config_class, decoder, gpt, mla, model_module
from refmath.models.params import check_param_dict

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SUPPORTED_MODEL_TYPES = ("gpt2", "openai-gpt", "llama", "mistral", "qwen2", "deepseek_v2",
                         "deepseek_v3")


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint refmath cannot load or write: said in one line, naming the file,
    the field or the tensor and what is wrong."""


# ---- reading safetensors files ------------------------------------------------------------------

# The safetensors format: 8 bytes (little-endian u64) giving the header's length N, N bytes of JSON
# {name: {"dtype", "shape", "data_offsets": [begin, end]}} (offsets counted from the end of the
# header), then the raw little-endian data.
_RAW_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}


class _Tensor(NamedTuple):
    path: Path
    dtype: str  # the safetensors dtype name, e.g. "BF16"
    shape: tuple
    offset: int  # of its first byte in the file


def _read_header(path: Path) -> dict[str, _Tensor]:
    """The tensors of one safetensors file, each checked to lie inside the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            raise HFCheckpointError(f"{path}: truncated or not a safetensors file (its header "
                                    f"needs {8 + max(n, 0)} bytes, the file has {size})")
        try:
            header = json.loads(f.read(n))
        except ValueError as err:
            raise HFCheckpointError(f"{path}: unreadable safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise HFCheckpointError(f"{path}: the safetensors header is not a JSON object")
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = entry["dtype"], tuple(int(s) for s in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise HFCheckpointError(f"{path}: the header entry of tensor {name!r} is not "
                                    f"{{dtype, shape, data_offsets}}: {entry!r}") from None
        if dtype not in _RAW_DTYPES:
            raise HFCheckpointError(f"{path}: tensor {name!r} has dtype {dtype}; refmath reads "
                                    f"{', '.join(_RAW_DTYPES)}")
        nbytes = math.prod(shape) * np.dtype(_RAW_DTYPES[dtype]).itemsize
        if end - begin != nbytes:
            raise HFCheckpointError(f"{path}: tensor {name!r} of shape {shape} and dtype {dtype} "
                                    f"needs {nbytes} bytes, its offsets span {end - begin}")
        if 8 + n + end > size:
            raise HFCheckpointError(f"{path}: truncated: tensor {name!r} ends at byte "
                                    f"{8 + n + end}, the file has {size}")
        tensors[name] = _Tensor(path, dtype, shape, 8 + n + begin)
    return tensors


def _read_tensor(tensor: _Tensor, dtype, transpose: bool = False) -> np.ndarray:
    """One tensor, copied out of its memory map into a new C-ordered array of ``dtype``."""
    count = math.prod(tensor.shape)
    if count == 0:
        raw = np.zeros(tensor.shape, _RAW_DTYPES[tensor.dtype])
    else:
        raw = np.memmap(tensor.path, dtype=_RAW_DTYPES[tensor.dtype], mode="r",
                        offset=tensor.offset, shape=(count,)).reshape(tensor.shape)
    fresh = False  # whether raw is already a new array rather than the memory map
    if tensor.dtype == "BF16":
        # NumPy has no bfloat16. A bfloat16 is the upper half of a float32 (sign, the same 8
        # exponent bits, 7 mantissa bits), so shifting its 16-bit pattern up by 16 gives the float32
        # of exactly the same value.
        raw, fresh = (raw.astype(np.uint32) << 16).view(np.float32), True
    value = raw.T if transpose else raw
    if fresh and value.dtype == dtype and value.flags.c_contiguous:
        return value
    # A copy in every other case: the parameters must not stay tied to the file.
    return np.array(value, dtype=dtype, order="C")


class _Weights:
    """The tensors of a checkpoint directory by name; :meth:`take` reads each one once, and
    :meth:`check_all_taken` refuses the tensors no parameter took."""

    def __init__(self, directory: Path, dtype, progress: bool = False):
        self.directory, self.dtype = directory, dtype
        self.tensors = _weight_files(directory)
        self.taken: set[str] = set()
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=len(self.tensors), desc=f"loading {directory.name}",
                            unit="tensor", file=sys.stderr)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str, shape: tuple, transpose: bool = False) -> np.ndarray:
        """Tensor ``name``, which must have ``shape`` (Hugging Face's), in the requested dtype
        (transposed when ``transpose``)."""
        if name not in self.tensors:
            raise HFCheckpointError(f"{self.directory}: tensor {name!r} is missing")
        tensor = self.tensors[name]
        if tensor.shape != tuple(shape):
            raise HFCheckpointError(f"{tensor.path}: tensor {name!r} has shape {tensor.shape}, "
                                    f"the config gives {tuple(shape)}")
        self.taken.add(name)
        if self.bar is not None:
            self.bar.update()
        return _read_tensor(tensor, self.dtype, transpose)

    def skip(self, name: str) -> None:
        """Mark ``name`` as known and not needed (a buffer, not a parameter)."""
        self.taken.add(name)

    def check_all_taken(self) -> None:
        left = sorted(set(self.tensors) - self.taken)
        if left:
            more = f" and {len(left) - 5} more" if len(left) > 5 else ""
            raise HFCheckpointError(f"{self.directory}: tensors the config has no place for: "
                                    f"{', '.join(left[:5])}{more}")


def _weight_files(directory: Path) -> dict[str, _Tensor]:
    """Every tensor of the directory's ``model.safetensors`` or of the shards its index lists."""
    single, index = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise HFCheckpointError(f"{index}: not a safetensors index ({type(err).__name__}: "
                                    f"{err})") from None
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            path = directory / shard
            if not path.is_file():
                raise HFCheckpointError(f"{index}: lists the shard {shard}, which does not exist")
            tensors.update(_read_header(path))
        for name, shard in weight_map.items():
            if name not in tensors or tensors[name].path.name != shard:
                raise HFCheckpointError(f"{index}: tensor {name!r} is not in {shard}")
        stray = sorted(set(tensors) - set(weight_map))
        if stray:
            raise HFCheckpointError(f"{index}: the shards hold tensors the index does not list: "
                                    f"{', '.join(stray[:5])}")
        return tensors
    if single.is_file():
        return _read_header(single)
    raise HFCheckpointError(f"{directory}: neither {WEIGHTS_FILE} nor {INDEX_FILE} (refmath reads "
                            f"safetensors weights only, not pytorch_model.bin)")


# ---- reading config.json --------------------------------------------------------------------------

def read_config(directory) -> dict:
    """The parsed ``config.json`` of a Hugging Face model directory."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise HFCheckpointError(f"{path}: no such file (is {directory} a Hugging Face model "
                                f"directory?)")
    return read_config_file(path)


def read_config_file(path) -> dict:
    """A parsed Hugging Face ``config.json``, which must name its ``model_type``."""
    path = Path(path)
    if not path.is_file():
        raise HFCheckpointError(f"{path}: no such file")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise HFCheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise HFCheckpointError(f"{path}: has no \"model_type\"")
    return config


def _refuse(hf: dict, field: str, value, why: str):
    raise HFCheckpointError(f"{hf['model_type']}: config field {field} = {value!r} is not "
                            f"supported: {why}")


def _require(hf: dict, field: str, allowed: tuple, default, why: str):
    """The value of ``field`` (``default`` when absent), refused unless it is one of ``allowed``."""
    value = hf.get(field, default)
    if value not in allowed:
        _refuse(hf, field, value, why)
    return value


def _refuse_common(hf: dict) -> None:
    """Fields of any model type that change the function in ways refmath does not implement."""
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(field) is not None:
            _refuse(hf, field, hf[field], "refmath's attention and head have no soft-capping")
    for field in ("num_local_experts", "num_experts"):
        if hf.get(field):
            _refuse(hf, field, hf[field], "refmath has no mixture-of-experts layers")
    if hf.get("add_cross_attention"):
        _refuse(hf, "add_cross_attention", True, "a decoder-only model has no cross-attention")


def _rope_theta(hf: dict) -> float:
    """RoPE's base, refusing any rope scaling (refmath's RoPE is the plain rotation, N10)."""
    scaling = hf.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        _refuse(hf, "rope_scaling", scaling, "refmath's RoPE has no scaling (YaRN, Llama 3.1's, "
                "linear, dynamic, ...)")
    params = hf.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        _refuse(hf, "rope_parameters.rope_type", params["rope_type"],
                "refmath's RoPE has no scaling (YaRN, Llama 3.1's, linear, dynamic, ...)")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse(hf, "rope_parameters.partial_rotary_factor", params["partial_rotary_factor"],
                "refmath rotates every coordinate of a head")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _window(hf: dict) -> int | None:
    """Mistral's sliding window (every layer's), or None where it masks nothing."""
    window = hf.get("sliding_window")
    if hf["model_type"] != "mistral" or not window:
        return None
    return int(window) if int(window) < int(hf["max_position_embeddings"]) else None


def _context(hf: dict) -> int:
    """``max_seq_len``: the trained context; for a Qwen2 whose upper layers slide, capped at the
    window.

    Qwen2 slides only the layers from ``max_window_layers`` on, which refmath's decoder (one window
    for every layer) does not express; but up to ``W`` tokens a window of ``W`` hides nothing, so
    the plain causal model is exactly the windowed one on every sequence it accepts.
    """
    context = int(hf["max_position_embeddings"])
    if hf["model_type"] == "qwen2" and hf.get("use_sliding_window") and hf.get("sliding_window"):
        if "sliding_attention" in (hf.get("layer_types") or ["sliding_attention"]):
            return min(context, int(hf["sliding_window"]))
    return context


# ---- one mapping per model type --------------------------------------------------------------------

def _gpt_config(hf: dict) -> gpt.GPTConfig:
    _refuse_common(hf)
    d = int(hf["n_embd"])
    if hf["model_type"] == "gpt2":
        act = _require(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh", "gelu"),
                       "gelu_new", "refmath's GPT uses GELU (tanh or exact)")
        _require(hf, "scale_attn_weights", (True,), True, "refmath scales scores by 1/sqrt(d_h)")
        _require(hf, "scale_attn_by_inverse_layer_idx", (False,), False,
                 "refmath does not scale scores by the layer index")
        return gpt.GPTConfig(vocab_size=int(hf["vocab_size"]), max_seq_len=int(hf["n_positions"]),
                             n_layers=int(hf["n_layer"]), d_model=d, n_heads=int(hf["n_head"]),
                             d_ff=int(hf.get("n_inner") or 4 * d), norm_position="pre",
                             tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                             gelu_approximate=act != "gelu", dropout=0.0,
                             layernorm_eps=float(hf.get("layer_norm_epsilon", 1e-5)))
    # OpenAI GPT: transformers' "gelu" for this model is the tanh form (gelu_new); always tied.
    _require(hf, "afn", ("gelu",), "gelu", "refmath's GPT uses GELU")
    _require(hf, "tie_word_embeddings", (True,), True, "OpenAI GPT's head is its token table")
    return gpt.GPTConfig(vocab_size=int(hf["vocab_size"]), max_seq_len=int(hf["n_positions"]),
                         n_layers=int(hf["n_layer"]), d_model=d, n_heads=int(hf["n_head"]),
                         d_ff=4 * d, norm_position="post", tie_embeddings=True,
                         gelu_approximate=True, dropout=0.0,
                         layernorm_eps=float(hf.get("layer_norm_epsilon", 1e-5)))


def _gpt_names(hf: dict, weights: _Weights) -> dict:
    """Hugging Face's names for GPT-2 and OpenAI GPT (with or without the ``transformer.``
    prefix that ``*LMHeadModel`` adds)."""
    gpt2 = hf["model_type"] == "gpt2"
    tok, pos = ("wte", "wpe") if gpt2 else ("tokens_embed", "positions_embed")
    prefix = "transformer." if weights.has(f"transformer.{tok}.weight") else ""
    return {"prefix": prefix, "tok": prefix + tok + ".weight", "pos": prefix + pos + ".weight"}


def _gpt_params(hf: dict, config: gpt.GPTConfig, weights: _Weights) -> dict:
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    names = _gpt_names(hf, weights)
    params = {"tok_emb": weights.take(names["tok"], (v, d)),
              "pos_emb": weights.take(names["pos"], (config.max_seq_len, d))}
    for i in range(config.n_layers):
        h, p = f"{names['prefix']}h.{i}.", f"layers.{i}."
        # Conv1D weights are (in, out) already; c_attn holds [W_Q W_K W_V] side by side.
        w_qkv = weights.take(h + "attn.c_attn.weight", (d, 3 * d))
        b_qkv = weights.take(h + "attn.c_attn.bias", (3 * d,))
        for j, name in enumerate(("q", "k", "v")):
            params[p + f"attn.w_{name}"] = np.ascontiguousarray(w_qkv[:, j * d:(j + 1) * d])
            params[p + f"attn.b_{name}"] = b_qkv[j * d:(j + 1) * d].copy()
        params[p + "attn.w_o"] = weights.take(h + "attn.c_proj.weight", (d, d))
        params[p + "attn.b_o"] = weights.take(h + "attn.c_proj.bias", (d,))
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            params[p + f"{ours}.gamma"] = weights.take(h + f"{theirs}.weight", (d,))
            params[p + f"{ours}.beta"] = weights.take(h + f"{theirs}.bias", (d,))
        params[p + "ffn.w1"] = weights.take(h + "mlp.c_fc.weight", (d, f))
        params[p + "ffn.b1"] = weights.take(h + "mlp.c_fc.bias", (f,))
        params[p + "ffn.w2"] = weights.take(h + "mlp.c_proj.weight", (f, d))
        params[p + "ffn.b2"] = weights.take(h + "mlp.c_proj.bias", (d,))
        # The causal mask that older GPT-2 files store as buffers: derived, not parameters.
        for buffer in ("attn.bias", "attn.masked_bias"):
            if weights.has(h + buffer):
                weights.skip(h + buffer)
    if config.norm_position == "pre":
        params["ln_f.gamma"] = weights.take(names["prefix"] + "ln_f.weight", (d,))
        params["ln_f.beta"] = weights.take(names["prefix"] + "ln_f.bias", (d,))
    _take_head(weights, config.tie_embeddings, params, v, d)
    return params


def _take_head(weights: _Weights, tied: bool, params: dict, v: int, d: int) -> None:
    """``lm_head`` (transposed to ``(d, V)``), or, when tied, a stored copy that must equal the
    token table."""
    if not tied:
        params["lm_head"] = weights.take("lm_head.weight", (v, d), transpose=True)
    elif weights.has("lm_head.weight"):
        if not np.array_equal(weights.take("lm_head.weight", (v, d)), params["tok_emb"]):
            raise HFCheckpointError(f"{weights.directory}: tie_word_embeddings is true but "
                                    f"lm_head.weight differs from the token embedding")


def _llama_config(hf: dict) -> decoder.DecoderConfig:
    _refuse_common(hf)
    kind = hf["model_type"]
    _require(hf, "hidden_act", ("silu",), "silu", "refmath's SwiGLU gates with SiLU")
    if kind != "qwen2":
        _require(hf, "attention_bias", (False,), False, "refmath's decoder has no bias on the "
                 "output projection (q/k/v biases alone are Qwen2's)")
    _require(hf, "mlp_bias", (False,), False, "refmath's SwiGLU has no biases")
    heads = int(hf["num_attention_heads"])
    return decoder.DecoderConfig(
        vocab_size=int(hf["vocab_size"]), max_seq_len=_context(hf),
        d_model=int(hf["hidden_size"]), n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        d_ff=int(hf["intermediate_size"]), rope_base=_rope_theta(hf),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dropout=0.0,
        rope_layout="half", qkv_bias=kind == "qwen2", sliding_window=_window(hf))


def _take_swiglu_layer(weights: _Weights, params: dict, h: str, p: str, d: int, f: int) -> None:
    """The two RMSNorm gains and the SwiGLU of one layer (Llama's names)."""
    params[p + "ln1.gamma"] = weights.take(h + "input_layernorm.weight", (d,))
    params[p + "ln2.gamma"] = weights.take(h + "post_attention_layernorm.weight", (d,))
    params[p + "ffn.w_gate"] = weights.take(h + "mlp.gate_proj.weight", (f, d), transpose=True)
    params[p + "ffn.w_up"] = weights.take(h + "mlp.up_proj.weight", (f, d), transpose=True)
    params[p + "ffn.w_down"] = weights.take(h + "mlp.down_proj.weight", (d, f), transpose=True)


def _take_ends(weights: _Weights, params: dict, config) -> None:
    """Token table, final norm and head of the Llama-style models."""
    d, v = config.d_model, config.vocab_size
    params["tok_emb"] = weights.take("model.embed_tokens.weight", (v, d))
    params["ln_f.gamma"] = weights.take("model.norm.weight", (d,))
    _take_head(weights, config.tie_embeddings, params, v, d)


def _llama_params(hf: dict, config: decoder.DecoderConfig, weights: _Weights) -> dict:
    d, f = config.d_model, config.d_f
    widths = {"q": config.n_heads * config.d_h, "k": config.kv_heads * config.d_h,
              "v": config.kv_heads * config.d_h}
    params = {}
    for i in range(config.n_layers):
        h, p = f"model.layers.{i}.", f"layers.{i}."
        for name, width in widths.items():
            params[p + f"attn.w_{name}"] = weights.take(h + f"self_attn.{name}_proj.weight",
                                                        (width, d), transpose=True)
            if config.qkv_bias:
                params[p + f"attn.b_{name}"] = weights.take(h + f"self_attn.{name}_proj.bias",
                                                            (width,))
        params[p + "attn.w_o"] = weights.take(h + "self_attn.o_proj.weight", (d, widths["q"]),
                                              transpose=True)
        _take_swiglu_layer(weights, params, h, p, d, f)
        # Older Llama files store RoPE's frequencies as a buffer: derived from rope_theta.
        if weights.has(h + "self_attn.rotary_emb.inv_freq"):
            weights.skip(h + "self_attn.rotary_emb.inv_freq")
    _take_ends(weights, params, config)
    return params


# DeepSeek's released code builds its two latent RMSNorms with this epsilon whatever rms_norm_eps is.
_DEEPSEEK_LATENT_EPS = 1e-6


def _mla_config(hf: dict) -> mla.MLAConfig:
    _refuse_common(hf)
    layers = int(hf["num_hidden_layers"])
    dense = int(hf.get("first_k_dense_replace") or 0)
    if dense < layers and hf.get("n_routed_experts"):
        _refuse(hf, "first_k_dense_replace", dense,
                f"layers {dense}..{layers - 1} of {layers} would be mixture-of-experts layers "
                f"(n_routed_experts = {hf['n_routed_experts']}), which refmath does not implement; "
                f"only all-dense models load (first_k_dense_replace >= num_hidden_layers)")
    _require(hf, "hidden_act", ("silu",), "silu", "refmath's SwiGLU gates with SiLU")
    _require(hf, "attention_bias", (False,), False, "refmath's MLA has no biases")
    _require(hf, "mlp_bias", (False,), False, "refmath's SwiGLU has no biases")
    # V2 rotates interleaved pairs (complex multiplication); V3 too unless rope_interleave is false.
    interleaved = hf["model_type"] == "deepseek_v2" or hf.get("rope_interleave", True)
    return mla.MLAConfig(
        vocab_size=int(hf["vocab_size"]), max_seq_len=int(hf["max_position_embeddings"]),
        d_model=int(hf["hidden_size"]), n_layers=layers, n_heads=int(hf["num_attention_heads"]),
        d_c=int(hf["kv_lora_rank"]), d_rope=int(hf["qk_rope_head_dim"]),
        head_dim=int(hf["qk_nope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
        q_lora_rank=None if hf.get("q_lora_rank") is None else int(hf["q_lora_rank"]),
        latent_norm=True, d_ff=int(hf["intermediate_size"]), rope_base=_rope_theta(hf),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dropout=0.0,
        rope_layout="interleaved" if interleaved else "half", latent_norm_eps=_DEEPSEEK_LATENT_EPS)


def _split_heads_columns(w: np.ndarray, heads: int, widths: tuple) -> list[np.ndarray]:
    """Columns of ``w`` ``(n, heads * sum(widths))``, per head laid out as consecutive blocks of
    ``widths``, regrouped as one ``(n, heads * width)`` matrix per block."""
    per_head = w.reshape(w.shape[0], heads, sum(widths))
    edges = np.cumsum((0,) + widths)
    return [np.ascontiguousarray(per_head[:, :, a:b].reshape(w.shape[0], -1))
            for a, b in zip(edges[:-1], edges[1:])]


def _mla_params(hf: dict, config: mla.MLAConfig, weights: _Weights) -> dict:
    d, f, h = config.d_model, config.d_f, config.n_heads
    d_c, d_r, d_k, d_v = config.d_c, config.d_rope, config.d_k, config.d_v
    params = {}
    for i in range(config.n_layers):
        s, p = f"model.layers.{i}.self_attn.", f"layers.{i}.attn."
        kv_a = weights.take(s + "kv_a_proj_with_mqa.weight", (d_c + d_r, d), transpose=True)
        params[p + "w_dkv"] = np.ascontiguousarray(kv_a[:, :d_c])
        params[p + "w_kr"] = np.ascontiguousarray(kv_a[:, d_c:])
        params[p + "kv_norm.gamma"] = weights.take(s + "kv_a_layernorm.weight", (d_c,))
        kv_b = weights.take(s + "kv_b_proj.weight", (h * (d_k + d_v), d_c), transpose=True)
        params[p + "w_uk"], params[p + "w_uv"] = _split_heads_columns(kv_b, h, (d_k, d_v))
        if config.q_lora_rank is None:
            q = weights.take(s + "q_proj.weight", (h * (d_k + d_r), d), transpose=True)
            params[p + "w_q"], params[p + "w_qr"] = _split_heads_columns(q, h, (d_k, d_r))
        else:
            rank = config.q_lora_rank
            params[p + "w_dq"] = weights.take(s + "q_a_proj.weight", (rank, d), transpose=True)
            params[p + "q_norm.gamma"] = weights.take(s + "q_a_layernorm.weight", (rank,))
            q = weights.take(s + "q_b_proj.weight", (h * (d_k + d_r), rank), transpose=True)
            params[p + "w_uq"], params[p + "w_qr"] = _split_heads_columns(q, h, (d_k, d_r))
        params[p + "w_o"] = weights.take(s + "o_proj.weight", (d, h * d_v), transpose=True)
        _take_swiglu_layer(weights, params, f"model.layers.{i}.", f"layers.{i}.", d, f)
    _take_ends(weights, params, config)
    return params


class _Mapping(NamedTuple):
    model: str  # the refmath model (refmath.models.MODELS)
    config: Callable  # Hugging Face config dict -> refmath config
    params: Callable  # (hf, config, weights) -> refmath params


_MAPPINGS = {
    "gpt2": _Mapping("gpt", _gpt_config, _gpt_params),
    "openai-gpt": _Mapping("gpt", _gpt_config, _gpt_params),
    "llama": _Mapping("llama", _llama_config, _llama_params),
    "mistral": _Mapping("llama", _llama_config, _llama_params),
    "qwen2": _Mapping("llama", _llama_config, _llama_params),
    "deepseek_v2": _Mapping("mla", _mla_config, _mla_params),
    "deepseek_v3": _Mapping("mla", _mla_config, _mla_params),
}


def _mapping(hf: dict) -> _Mapping:
    kind = hf["model_type"]
    if kind not in _MAPPINGS:
        raise HFCheckpointError(f"config field model_type = {kind!r} is not supported; refmath "
                                f"loads {', '.join(SUPPORTED_MODEL_TYPES)}")
    return _MAPPINGS[kind]


def config_from_hf(hf: dict):
    """``(model_name, config)``: the refmath model and configuration of a Hugging Face config
    dict, or :class:`HFCheckpointError` naming the first field refmath does not implement."""
    mapping = _mapping(hf)
    try:
        return mapping.model, mapping.config(hf)
    except KeyError as err:
        raise HFCheckpointError(f"{hf['model_type']}: config has no field {err.args[0]!r}") from None


def load_checkpoint(directory, dtype=np.float32, progress: bool = False):
    r"""Load a Hugging Face model directory: ``(model_name, config, params)``.

    ``directory`` holds ``config.json`` and ``model.safetensors`` (or the shards listed in
    ``model.safetensors.index.json``). ``model_name`` is one of :data:`refmath.models.MODELS`;
    ``refmath.models.model_module(model_name).logits(params, tokens, config)`` then gives the
    same logits as the ``transformers`` model. ``dtype`` is the parameters' floating dtype
    (float32 or float64); float16 and bfloat16 tensors convert exactly. ``progress`` shows a
    tqdm bar over the tensors on stderr.

    Raises :class:`HFCheckpointError` (a ``ValueError``) naming the field, file or tensor for an
    unsupported ``model_type`` or config field, a tensor missing, left over or of the wrong shape,
    and a truncated file.
    """
    dtype = np.dtype(dtype)
    if not np.issubdtype(dtype, np.floating):
        raise TypeError(f"dtype must be a floating-point type, got {dtype}")
    directory = Path(directory)
    hf = read_config(directory)
    model, config = config_from_hf(hf)
    weights = _Weights(directory, dtype, progress)
    try:
        params = _MAPPINGS[hf["model_type"]].params(hf, config, weights)
    finally:
        if weights.bar is not None:
            weights.bar.close()
    weights.check_all_taken()
    return model, config, params


# ---- sizes -----------------------------------------------------------------------------------------

def parameter_count(hf: dict) -> int:
    """Parameters of the refmath model a Hugging Face config loads into (every tensor's size)."""
    name, config = config_from_hf(hf)
    module = model_module(name)
    return sum(math.prod(shape) for shape in module.param_shapes(config).values())


def sizing_config(hf: dict):
    """The :class:`refmath.sizing.ModelConfig` of a Hugging Face config, for ``sizes --hf``:
    the same refusals as :func:`load_checkpoint`, then the shapes the calculators need."""
    from refmath.sizing import ModelConfig

    name, config = config_from_hf(hf)
    common = dict(name=hf["model_type"], layers=config.n_layers, d_model=config.d_model,
                  heads=config.n_heads, vocab=config.vocab_size,
                  tied_output=config.tie_embeddings, context=int(hf.get(
                      "max_position_embeddings", hf.get("n_positions", config.max_seq_len))),
                  source="config.json")
    if name == "gpt":
        return ModelConfig(**common, kv_heads=config.n_heads, head_dim=config.head_dim,
                           d_ff=config.d_ff, mlp="gelu", norm="layernorm", attention_bias=True,
                           mlp_bias=True, learned_positions=config.max_seq_len,
                           final_norm=config.norm_position == "pre")
    if name == "llama":
        window = config.sliding_window or (
            config.max_seq_len if config.max_seq_len < common["context"] else None)
        return ModelConfig(**common, kv_heads=config.kv_heads, head_dim=config.d_h,
                           d_ff=config.d_f, qkv_bias=config.qkv_bias, sliding_window=window)
    return ModelConfig(**common, kv_heads=config.n_heads, head_dim=config.d_k, d_ff=config.d_f,
                       latent_dim=config.d_c, rope_dim=config.d_rope)


# ---- writing ---------------------------------------------------------------------------------------

def interleaved_to_half(w: np.ndarray, head_dim: int) -> np.ndarray:
    r"""Columns of a query or key projection (or its bias) permuted within each head from RoPE's
    ``"interleaved"`` pairs :math:`(x_{2r}, x_{2r+1})` to the ``"half"`` pairs
    :math:`(x_r, x_{r+d/2})`: head column ``j`` of the result is column :math:`\pi_j` of ``w``,
    :math:`\pi = [0, 2, 4, \dots, 1, 3, 5, \dots]`. Attention scores are unchanged (module
    docstring)."""
    if head_dim % 2 or w.shape[-1] % head_dim:
        raise ValueError(f"w's last axis ({w.shape[-1]}) must be a multiple of the even head_dim "
                         f"= {head_dim}")
    pi = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    heads = w.shape[-1] // head_dim
    columns = (np.arange(heads)[:, None] * head_dim + pi[None, :]).reshape(-1)
    return np.ascontiguousarray(w[..., columns])


def _linear_out(w: np.ndarray) -> np.ndarray:
    """refmath's ``(in, out)`` weight as ``torch.nn.Linear`` stores it, ``(out, in)``."""
    return np.ascontiguousarray(w.T)


def _gpt_to_hf(config: gpt.GPTConfig, params: dict):
    d = config.d_model
    if config.norm_position == "pre":
        hf = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": d,
              "n_layer": config.n_layers, "n_head": config.n_heads, "n_positions": config.max_seq_len,
              "n_inner": config.d_ff, "vocab_size": config.vocab_size,
              "activation_function": "gelu_new" if config.gelu_approximate else "gelu",
              "layer_norm_epsilon": config.layernorm_eps,
              "tie_word_embeddings": config.tie_embeddings}
        prefix, tok, pos = "transformer.", "wte", "wpe"
    else:
        why = [f"{field} = {value!r}" for field, value, ok in (
            ("tie_embeddings", config.tie_embeddings, config.tie_embeddings),
            ("d_ff", config.d_ff, config.d_ff == 4 * d),
            ("gelu_approximate", config.gelu_approximate, config.gelu_approximate)) if not ok]
        if why:
            raise HFCheckpointError(f"a Post-LN GPT is written as openai-gpt, which has a tied "
                                    f"head, d_ff = 4 d_model and tanh GELU; this config has "
                                    f"{', '.join(why)}")
        hf = {"model_type": "openai-gpt", "architectures": ["OpenAIGPTLMHeadModel"], "n_embd": d,
              "n_layer": config.n_layers, "n_head": config.n_heads,
              "n_positions": config.max_seq_len, "vocab_size": config.vocab_size, "afn": "gelu",
              "layer_norm_epsilon": config.layernorm_eps, "tie_word_embeddings": True}
        prefix, tok, pos = "transformer.", "tokens_embed", "positions_embed"
    tensors = {f"{prefix}{tok}.weight": params["tok_emb"], f"{prefix}{pos}.weight": params["pos_emb"]}
    for i in range(config.n_layers):
        h, p = f"{prefix}h.{i}.", f"layers.{i}."
        tensors[h + "attn.c_attn.weight"] = np.concatenate(
            [params[p + f"attn.w_{n}"] for n in "qkv"], axis=1)
        tensors[h + "attn.c_attn.bias"] = np.concatenate([params[p + f"attn.b_{n}"] for n in "qkv"])
        tensors[h + "attn.c_proj.weight"] = params[p + "attn.w_o"]
        tensors[h + "attn.c_proj.bias"] = params[p + "attn.b_o"]
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            tensors[h + f"{theirs}.weight"] = params[p + f"{ours}.gamma"]
            tensors[h + f"{theirs}.bias"] = params[p + f"{ours}.beta"]
        tensors[h + "mlp.c_fc.weight"] = params[p + "ffn.w1"]
        tensors[h + "mlp.c_fc.bias"] = params[p + "ffn.b1"]
        tensors[h + "mlp.c_proj.weight"] = params[p + "ffn.w2"]
        tensors[h + "mlp.c_proj.bias"] = params[p + "ffn.b2"]
    if config.norm_position == "pre":
        tensors[prefix + "ln_f.weight"] = params["ln_f.gamma"]
        tensors[prefix + "ln_f.bias"] = params["ln_f.beta"]
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = _linear_out(params["lm_head"])
    return hf, tensors


def _swiglu_ends_to_hf(config, params: dict, tensors: dict) -> None:
    for i in range(config.n_layers):
        h, p = f"model.layers.{i}.", f"layers.{i}."
        tensors[h + "input_layernorm.weight"] = params[p + "ln1.gamma"]
        tensors[h + "post_attention_layernorm.weight"] = params[p + "ln2.gamma"]
        for name in ("gate", "up", "down"):
            tensors[h + f"mlp.{name}_proj.weight"] = _linear_out(params[p + f"ffn.w_{name}"])
    tensors["model.embed_tokens.weight"] = params["tok_emb"]
    tensors["model.norm.weight"] = params["ln_f.gamma"]
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = _linear_out(params["lm_head"])


def _llama_to_hf(config: decoder.DecoderConfig, params: dict):
    if config.qkv_bias and config.sliding_window:
        raise HFCheckpointError(f"a decoder with q/k/v biases is written as qwen2, whose window "
                                f"slides only some layers; this config has sliding_window = "
                                f"{config.sliding_window} on every layer")
    kind = "qwen2" if config.qkv_bias else "mistral" if config.sliding_window else "llama"
    architecture = {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                    "llama": "LlamaForCausalLM"}[kind]
    hf = {"model_type": kind, "architectures": [architecture],
          "vocab_size": config.vocab_size, "max_position_embeddings": config.max_seq_len,
          "hidden_size": config.d_model, "num_hidden_layers": config.n_layers,
          "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads,
          "head_dim": config.d_h, "intermediate_size": config.d_f, "hidden_act": "silu",
          "rms_norm_eps": config.norm_eps,
          "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_base},
          "tie_word_embeddings": config.tie_embeddings}
    if kind == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    elif kind == "mistral":
        hf.update(sliding_window=config.sliding_window)
    else:
        hf.update(use_sliding_window=False)

    def rotated(w):  # the query and key columns in Hugging Face's "half" RoPE layout
        return w if config.rope_layout == "half" else interleaved_to_half(w, config.d_h)

    tensors = {}
    for i in range(config.n_layers):
        h, p = f"model.layers.{i}.self_attn.", f"layers.{i}.attn."
        tensors[h + "q_proj.weight"] = _linear_out(rotated(params[p + "w_q"]))
        tensors[h + "k_proj.weight"] = _linear_out(rotated(params[p + "w_k"]))
        tensors[h + "v_proj.weight"] = _linear_out(params[p + "w_v"])
        tensors[h + "o_proj.weight"] = _linear_out(params[p + "w_o"])
        if config.qkv_bias:
            tensors[h + "q_proj.bias"] = rotated(params[p + "b_q"])
            tensors[h + "k_proj.bias"] = rotated(params[p + "b_k"])
            tensors[h + "v_proj.bias"] = params[p + "b_v"]
    _swiglu_ends_to_hf(config, params, tensors)
    return hf, tensors


def _join_heads_columns(blocks: list, heads: int) -> np.ndarray:
    """The inverse of :func:`_split_heads_columns`."""
    n = blocks[0].shape[0]
    return np.concatenate([b.reshape(n, heads, -1) for b in blocks], axis=2).reshape(n, -1)


def _mla_to_hf(config: mla.MLAConfig, params: dict):
    if not config.latent_norm:
        raise HFCheckpointError("an MLA model is written as deepseek_v3, whose latents are always "
                                "RMS-normalised; this config has latent_norm = False")
    if config.latent_eps != _DEEPSEEK_LATENT_EPS:
        raise HFCheckpointError(f"deepseek_v3's latent RMSNorms use epsilon "
                                f"{_DEEPSEEK_LATENT_EPS}; this config has latent_norm_eps = "
                                f"{config.latent_eps}")
    h = config.n_heads
    hf = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
          "vocab_size": config.vocab_size, "max_position_embeddings": config.max_seq_len,
          "hidden_size": config.d_model, "num_hidden_layers": config.n_layers,
          "num_attention_heads": h, "num_key_value_heads": h,
          "kv_lora_rank": config.d_c, "q_lora_rank": config.q_lora_rank,
          "qk_rope_head_dim": config.d_rope, "qk_nope_head_dim": config.d_k,
          "v_head_dim": config.d_v, "intermediate_size": config.d_f, "hidden_act": "silu",
          "first_k_dense_replace": config.n_layers, "rms_norm_eps": config.norm_eps,
          "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_base},
          "rope_interleave": config.rope_layout == "interleaved", "attention_bias": False,
          "tie_word_embeddings": config.tie_embeddings}
    tensors = {}
    for i in range(config.n_layers):
        s, p = f"model.layers.{i}.self_attn.", f"layers.{i}.attn."
        tensors[s + "kv_a_proj_with_mqa.weight"] = _linear_out(
            np.concatenate([params[p + "w_dkv"], params[p + "w_kr"]], axis=1))
        tensors[s + "kv_a_layernorm.weight"] = params[p + "kv_norm.gamma"]
        tensors[s + "kv_b_proj.weight"] = _linear_out(
            _join_heads_columns([params[p + "w_uk"], params[p + "w_uv"]], h))
        if config.q_lora_rank is None:
            tensors[s + "q_proj.weight"] = _linear_out(
                _join_heads_columns([params[p + "w_q"], params[p + "w_qr"]], h))
        else:
            tensors[s + "q_a_proj.weight"] = _linear_out(params[p + "w_dq"])
            tensors[s + "q_a_layernorm.weight"] = params[p + "q_norm.gamma"]
            tensors[s + "q_b_proj.weight"] = _linear_out(
                _join_heads_columns([params[p + "w_uq"], params[p + "w_qr"]], h))
        tensors[s + "o_proj.weight"] = _linear_out(params[p + "w_o"])
    _swiglu_ends_to_hf(config, params, tensors)
    return hf, tensors


_WRITERS = {"gpt": _gpt_to_hf, "llama": _llama_to_hf, "mla": _mla_to_hf}


def save_checkpoint(directory, model_name: str, config, params: dict) -> Path:
    """Write refmath parameters as a Hugging Face model directory (``config.json`` and
    ``model.safetensors``) that ``transformers`` loads with ``AutoModelForCausalLM``.

    ``"gpt"`` is written as ``gpt2`` (Pre-LN) or ``openai-gpt`` (Post-LN), ``"llama"`` as
    ``llama`` (``qwen2`` with ``qkv_bias``; an ``"interleaved"`` RoPE layout is permuted to
    Hugging Face's, see :func:`interleaved_to_half`), ``"mla"`` as a dense ``deepseek_v3``. The
    encoder-decoder and configurations without a Hugging Face counterpart are refused with
    :class:`HFCheckpointError`. Tensors keep the parameters' dtype. Returns the directory.
    """
    if model_name not in _WRITERS:
        raise HFCheckpointError(f"model {model_name!r} has no Hugging Face counterpart refmath "
                                f"writes; it writes {', '.join(_WRITERS)}")
    if not isinstance(config, config_class(model_name)):
        raise TypeError(f"config must be a {config_class(model_name).__name__} for model "
                        f"{model_name!r}, got {type(config).__name__}")
    module = model_module(model_name)
    dtype = check_param_dict(params, module.param_shapes(config))
    try:
        from safetensors.numpy import save_file
    except ImportError:
        raise ImportError("save_checkpoint needs the safetensors package: pip install "
                          "'refmath[hf]'") from None
    hf, tensors = _WRITERS[model_name](config, params)
    hf["dtype"] = str(dtype)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({name: np.ascontiguousarray(t) for name, t in tensors.items()},
              str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return directory


TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def save_tokenizer(directory, tokenizer) -> Path:
    """Write a :class:`refmath.data.CharTokenizer` into a Hugging Face model directory, so that
    ``transformers.AutoTokenizer.from_pretrained(directory)`` reads the same ids for the same text.

    ``tokenizer.json`` (the ``tokenizers`` package's format) has one token per character, the four
    special tokens ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>`` at their refmath ids, and reads a
    character outside the alphabet as ``<unk>``; ``tokenizer_config.json`` names the generic fast
    tokenizer class and the special tokens. A ``config.json`` already in the directory (from
    :func:`save_checkpoint`) gets the special tokens' ids, replacing the defaults of its model
    type (GPT-2's 50256, for one). Returns the path of ``tokenizer.json``.
    """
    from refmath.data import SPECIALS, CharTokenizer

    if not isinstance(tokenizer, CharTokenizer):
        raise TypeError(f"tokenizer must be a refmath.data.CharTokenizer, got "
                        f"{type(tokenizer).__name__}")
    try:
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise ImportError("save_tokenizer needs the tokenizers package: pip install "
                          "'refmath[hf]'") from None
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({c: i for i, c in enumerate(tokenizer.alphabet, start=len(SPECIALS))})
    out = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[tokenizer.unk_id]))
    # Every character is a word of its own ([\s\S] matches newlines too); decoding joins them.
    out.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    out.decoder = decoders.Fuse()
    out.add_special_tokens(list(SPECIALS))
    path = directory / TOKENIZER_FILE
    out.save(str(path))
    roles = {"pad": tokenizer.pad_id, "bos": tokenizer.bos_id, "eos": tokenizer.eos_id,
             "unk": tokenizer.unk_id}
    settings = {"tokenizer_class": "PreTrainedTokenizerFast",
                **{f"{role}_token": SPECIALS[i] for role, i in roles.items()}}
    (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(settings, indent=2) + "\n")
    config_path = directory / CONFIG_FILE
    if config_path.is_file():
        hf = json.loads(config_path.read_text())
        hf.update({f"{role}_token_id": roles[role] for role in ("pad", "bos", "eos")})
        config_path.write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return path
