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
                                                     projections; its window on the layers
                                                     ``layer_types`` (or ``max_window_layers``)
                                                     slide: ``window_layers``
``qwen3``                           ``"llama"``      plus QK-norm (``qk_norm="head"``), its
                                                     window as Qwen2's
``mixtral``                         ``"llama"``      Mistral with a mixture of experts
                                                     (``DecoderConfig.moe``: softmax, top-k,
                                                     renormalised)
``qwen2_moe``, ``qwen3_moe``        ``"llama"``      Qwen2 / Qwen3 with experts; Qwen2-MoE's
                                                     shared expert behind its sigmoid gate
``deepseek_v2``, ``deepseek_v3``    ``"mla"``        dense first layers, then experts with shared
                                                     ones (V2: softmax, group-limited; V3:
                                                     sigmoid, chosen with its bias)
``cohere``                          ``"cohere"``     Command-R: the parallel block on one
                                                     LayerNorm without bias, interleaved RoPE,
                                                     ``logit_scale``, optional per-head QK-norm
``falcon``                          ``"falcon"``     the parallel block of LayerNorms and a
                                                     plain GELU MLP; 7B's multi-query layout (one
                                                     norm), 40B's grouped one (``ln_attn``,
                                                     ``ln_mlp``), the sequential block; the fused
                                                     ``query_key_value`` split into ``w_q``,
                                                     ``w_k``, ``w_v``; no ALiBi
``olmo2``                           ``"olmo2"``      RMSNorm after each sublayer and none before,
                                                     QK-norm over the whole projections
``gemma``                           ``"gemma"``      ``(1 + w)`` norms, embeddings times
                                                     :math:`\sqrt d`, GeGLU, tied head
``gemma2``                          ``"gemma"``      plus sandwich norms, capped scores and
                                                     logits, ``query_pre_attn_scalar``, local and
                                                     global layers (``windows``)
``gemma3_text``                     ``"gemma"``      plus QK-norm; the local layers' own RoPE base
``phi3``                            ``"phi3"``       Llama with fused ``qkv_proj`` and
                                                     ``gate_up_proj`` (split on the way in, stacked
                                                     on the way out), LongRoPE, a window on every
                                                     layer
==================================  ===============  =============================================

The encoder-decoder (``marian``) is not converted: Marian's attention projections carry biases,
its FFN is SiLU ("swish") rather than ReLU, it adds a bias to the final logits, and its sinusoid
table puts every sine before every cosine; refmath's encoder-decoder, the paper's, has none of these.

The ``"llama"``, ``"falcon"``, ``"olmo2"`` and ``"gemma"`` types load with their rope scaling (``rope_parameters.rope_type``
``linear``, ``dynamic``, ``llama3``, ``yarn`` or ``longrope``: ``rope_scaling``), ``"phi3"``
with LongRoPE, the
``"mla"`` types with the length-independent ones (``linear``, ``llama3``, ``yarn``, with
DeepSeek's ``mscale_all_dim``). Anything else is refused with a message that names the field and
its value (a router or layer placement transformers does not compute, another rope scaling,
biases refmath's models do not have, ...): a checkpoint is never loaded into a model that would compute a different function.

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

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from refmath.models import MODELS, check_config, model_module
# interleaved_to_half is the RoPE permutation the writer applies (module docstring), public here too
from refmath.models.hf_layout import HFCheckpointError, interleaved_to_half  # noqa: F401
from refmath.models.params import check_param_dict

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "INDEX_FILE", "SUPPORTED_MODEL_TYPES", "read_config",
           "read_config_file", "checkpoint_family", "config_from_hf", "load_checkpoint",
           "save_checkpoint", "TOKENIZER_FILE", "save_tokenizer"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# {model_type: refmath model}: every model's HF_MODEL_TYPES, read once from its module
_MODEL_OF_TYPE = {kind: name for name in MODELS for kind in model_module(name).HF_MODEL_TYPES}
SUPPORTED_MODEL_TYPES = tuple(_MODEL_OF_TYPE)


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


# ---- the dispatch to each model's mapping -----------------------------------------------------------

def _model_of(hf: dict) -> str:
    """The refmath model that reads a config of ``hf["model_type"]``."""
    kind = hf["model_type"]
    if kind not in SUPPORTED_MODEL_TYPES:
        raise HFCheckpointError(f"config field model_type = {kind!r} is not supported; refmath "
                                f"loads {', '.join(SUPPORTED_MODEL_TYPES)}")
    return _MODEL_OF_TYPE[kind]


def checkpoint_family(hf: dict) -> str:
    """The family a Hugging Face config is: its own ``model_type`` (``"falcon"``, ``"gemma2"``,
    ``"qwen3_moe"``), once checked to be one refmath loads (:data:`SUPPORTED_MODEL_TYPES`, else
    :class:`HFCheckpointError`).

    It names the checkpoint, where :func:`config_from_hf`'s model name names refmath's code that
    computes it: a Gemma 2 checkpoint is of the family ``"gemma2"`` and runs as the model
    ``"gemma"`` (see the table above); a Falcon checkpoint is ``"falcon"`` both ways."""
    _model_of(hf)
    return str(hf["model_type"])


class _TextField(str):
    """A config value that JSON gives as a string: itself wherever a string is read, and refused,
    naming its field, where a number is (``int("2")`` would quietly accept ``"2"``)."""

    field = ""

    def _refuse(self, *_):
        raise HFCheckpointError(f"config field {self.field} must be a number, got the string "
                                f"{str(self)!r}")

    __int__ = __float__ = __index__ = _refuse


class _RealField(float):
    """A config value that JSON gives as a real number: refused, naming its field, where an
    integer is read and it has a fraction (``int(2.5)`` would quietly read 2)."""

    field = ""

    def __int__(self):
        if not self.is_integer():
            raise HFCheckpointError(f"config field {self.field} must be an integer, got "
                                    f"{float(self)!r}")
        return int(float(self))

    __index__ = __int__


def _typed(hf: dict, prefix: str = "") -> dict:
    """``hf`` with its strings and real numbers (nested dicts too) wrapped so that a mapping's
    ``int(hf[...])``/``float(hf[...])`` refuses the wrong type instead of converting it."""
    out = {}
    for key, value in hf.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            value = _typed(value, f"{name}.")
        elif isinstance(value, str):
            value = _TextField(value)
            value.field = name
        elif isinstance(value, float):
            value = _RealField(value)
            value.field = name
        out[key] = value
    return out


def _plain(value):
    """A config's value with the wrappers of :func:`_typed` taken off (inside a nested
    configuration, such as a mixture of experts' or a rope scaling's, too)."""
    if isinstance(value, _TextField):
        return str(value)
    if isinstance(value, _RealField):
        return float(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _plain(getattr(value, f.name))
                                             for f in dataclasses.fields(value) if f.init})
    return value


def config_from_hf(hf: dict):
    """``(model_name, config)``: the refmath model and configuration of a Hugging Face config
    dict (its module's ``config_from_hf``), or :class:`HFCheckpointError` naming the first field
    refmath does not implement, or one whose value has the wrong type (a number written as a
    string, an integer with a fraction)."""
    model = _model_of(hf)
    try:
        config = model_module(model).config_from_hf(_typed(hf))
        return model, dataclasses.replace(config, **{
            f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config)})
    except KeyError as err:
        raise HFCheckpointError(f"{hf['model_type']}: config has no field {err.args[0]!r}") from None
    except HFCheckpointError:
        raise
    except ValueError as err:  # fields that contradict each other, as the configuration says it
        raise HFCheckpointError(f"{hf['model_type']}: {err}") from None


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
        params = model_module(model).params_from_hf(hf, config, weights)
    finally:
        if weights.bar is not None:
            weights.bar.close()
    weights.check_all_taken()
    return model, config, params


# ---- writing ---------------------------------------------------------------------------------------

# The narrower dtypes save_checkpoint writes: refmath.weight_formats' rounding (catalogue W1), and
# the safetensors and config.json names of each.
WRITE_DTYPES = {"bf16": ("BF16", "bfloat16"), "f16": ("F16", "float16")}


def _narrowed(t: np.ndarray, dtype: str) -> np.ndarray:
    """A float tensor rounded to ``dtype``'s 16 bits (bf16 as ``uint16`` bit patterns), to nearest
    with ties to even; values the format cannot hold are refused (ValueError naming them)."""
    from refmath import weight_formats

    flat = np.ascontiguousarray(t, dtype=np.float32).reshape(1, -1)
    stored = weight_formats.to_bf16(flat) if dtype == "bf16" else weight_formats.to_f16(flat)
    return stored.reshape(t.shape)


def _write_safetensors(path: Path, tensors: dict, kinds: dict) -> None:
    """A safetensors file (see the reader above) of ``tensors``, ``kinds[name]`` the dtype name of
    each: safetensors' NumPy writer has no bfloat16, so the few lines of the format are written
    here."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": kinds[name], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data start 8-byte aligned, as safetensors writes them
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for t in tensors.values():
            f.write(np.ascontiguousarray(t, dtype=t.dtype.newbyteorder("<")).tobytes())


def save_checkpoint(directory, model_name: str, config, params: dict,
                    dtype: str | None = None) -> Path:
    """Write refmath parameters as a Hugging Face model directory (``config.json`` and
    ``model.safetensors``) that ``transformers`` loads with ``AutoModelForCausalLM``.

    ``"gpt"`` is written as ``gpt2`` (Pre-LN) or ``openai-gpt`` (Post-LN), ``"llama"`` as
    ``llama`` (``qwen2`` with ``qkv_bias``; an ``"interleaved"`` RoPE layout is permuted to
    Hugging Face's, see :func:`interleaved_to_half`), ``"mla"`` as a dense ``deepseek_v3``. The
    encoder-decoder and configurations without a Hugging Face counterpart are refused with
    :class:`HFCheckpointError`. Tensors keep the parameters' dtype, or with ``dtype`` ``"bf16"``
    or ``"f16"`` are rounded to it (to nearest, ties to even: :mod:`refmath.weight_formats`, W1;
    a value beyond float16's range is refused) and written as ``BF16``/``F16`` tensors, the
    config's ``dtype`` saying so; :func:`load_checkpoint` reads them back exactly. Returns the
    directory.
    """
    if dtype is not None and dtype not in WRITE_DTYPES:
        raise ValueError(f"dtype must be None (the parameters' own) or one of "
                         f"{', '.join(map(repr, WRITE_DTYPES))}, got {dtype!r}")
    writes = [name for name in MODELS if model_module(name).HF_MODEL_TYPES]
    if model_name not in writes:
        raise HFCheckpointError(f"model {model_name!r} has no Hugging Face counterpart refmath "
                                f"writes; it writes {', '.join(writes)}")
    check_config(model_name, config)  # exactly its class: a subclass's fields would be lost
    module = model_module(model_name)
    narrow = dtype
    dtype = check_param_dict(params, module.param_shapes(config))
    try:
        from safetensors.numpy import save_file
    except ImportError:
        raise ImportError("save_checkpoint needs the safetensors package: pip install "
                          "'refmath[hf]'") from None
    hf, tensors = module.to_hf(config, params)
    hf["dtype"] = str(dtype) if narrow is None else WRITE_DTYPES[narrow][1]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if narrow is None:
        save_file({name: np.ascontiguousarray(t) for name, t in tensors.items()},
                  str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    else:
        _write_safetensors(directory / WEIGHTS_FILE,
                           {name: _narrowed(t, narrow) for name, t in tensors.items()},
                           dict.fromkeys(tensors, WRITE_DTYPES[narrow][0]))
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
