r"""Hugging Face's side of refmath's models: the error a mapping raises, the refusals and the tensor
layouts the mappings share (:mod:`refmath.hf` reads and writes the files).

Each model module maps its own configuration and parameters (``HF_MODEL_TYPES``,
``config_from_hf``, ``params_from_hf``, ``to_hf``) with these pieces. ``weights`` is the reader
:mod:`refmath.hf` hands a mapping: ``weights.take(name, shape, transpose=False)`` returns a tensor
(as refmath stores it) and marks it read, ``weights.has(name)`` and ``weights.skip(name)`` let a
mapping pass over the buffers a file may hold; every tensor must be taken or skipped.

``torch.nn.Linear`` stores :math:`W^\top` (``out x in``) and computes :math:`x W^\top + b`;
refmath's row-vector convention stores ``W`` itself (``in x out``), so linear weights are
transposed on the way in and out (:func:`linear_out`).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = [
    "HFCheckpointError", "refuse", "require", "refuse_common", "rope_from_hf", "rope_context",
    "rope_to_hf", "take_head", "MIXTRAL_EXPERTS", "QWEN_MOE_EXPERTS", "DEEPSEEK_EXPERTS",
    "take_moe", "take_swiglu", "take_feed_forward_layer", "take_ends", "linear_out",
    "swiglu_layers_to_hf", "interleaved_to_half", "split_heads_columns", "join_heads_columns",
    "ATTENTION_KEYS", "QK_NORM_KEYS", "GATED_FFN_KEYS", "layer_key_rows"
]


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint refmath cannot load or write: said in one line, naming the file,
    the field or the tensor and what is wrong."""


def refuse(hf: dict, field: str, value, why: str):
    """Raise :class:`HFCheckpointError`: ``field = value`` of a config of ``hf["model_type"]`` is
    not supported, because ``why``."""
    raise HFCheckpointError(f"{hf['model_type']}: config field {field} = {value!r} is not "
                            f"supported: {why}")


def require(hf: dict, field: str, allowed: tuple, default, why: str):
    """The value of ``field`` (``default`` when absent), refused unless it is one of ``allowed``."""
    value = hf.get(field, default)
    if value not in allowed:
        refuse(hf, field, value, why)
    return value


def refuse_common(hf: dict, experts: bool = False, softcap: bool = False) -> None:
    """Fields of any model type that change the function in ways refmath does not implement;
    ``experts``: the mapping reads a mixture of experts; ``softcap``: it reads soft-capping."""
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(field) is not None and not softcap:
            refuse(hf, field, hf[field], "refmath's attention and head have no soft-capping")
    for field in ("num_local_experts", "num_experts"):
        if hf.get(field) and not experts:
            refuse(hf, field, hf[field], f"refmath reads no mixture-of-experts layers in a "
                                         f"{hf['model_type']} checkpoint")
    if hf.get("add_cross_attention"):
        refuse(hf, "add_cross_attention", True, "a decoder-only model has no cross-attention")


_HF_ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn", "longrope")


def rope_from_hf(hf: dict) -> tuple[float, dict | None]:
    """RoPE's base and its context-extension rule (the fields of
    :class:`refmath.positions.RopeScaling`, or None for the plain rotation), from
    ``rope_parameters`` (transformers 5) or the older ``rope_scaling`` and ``rope_theta``.

    Hugging Face's dynamic NTK takes ``max_position_embeddings`` as the pretrained context and
    stretches past it; refmath records that context as ``original_max_seq_len`` and accepts
    ``factor`` times as many tokens (:func:`rope_context`).
    """
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    if legacy.get("rope_type", legacy.get("type")) not in (None, "default"):
        params = {**legacy, **{k: v for k, v in params.items() if k in ("rope_theta",)}}
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        refuse(hf, "rope_parameters.partial_rotary_factor",
               params.get("partial_rotary_factor", hf.get("partial_rotary_factor")),
               "refmath rotates every coordinate of a head")
    if kind == "default":
        return theta, None
    if kind not in _HF_ROPE_TYPES:
        refuse(hf, "rope_parameters.rope_type", kind,
               f"refmath's RoPE scalings are {', '.join(_HF_ROPE_TYPES)}")
    context = int(hf["max_position_embeddings"])
    original = params.get("original_max_position_embeddings", hf.get(
        "original_max_position_embeddings"))
    if kind == "dynamic" or (original is None and kind != "linear"):
        original = context
    factor = params.get("factor")
    if factor is None:
        if kind in ("yarn", "longrope"):
            factor = context / int(original)
        else:
            refuse(hf, "rope_parameters.factor", None, f"rope_type {kind!r} needs a factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        refuse(hf, "rope_parameters.factor", factor, "the scaling factor must be a number > 0")
    scaling = {"rope_type": kind, "factor": float(factor)}
    if kind != "linear":
        scaling["original_max_seq_len"] = int(original)
    fields = {"llama3": ("low_freq_factor", "high_freq_factor"),
              "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                       "truncate"),
              "longrope": ("short_factor", "long_factor", "attention_factor")}.get(kind, ())
    for name in fields:
        if params.get(name) is not None:
            scaling[name] = tuple(params[name]) if isinstance(params[name], list) else params[name]
    return theta, scaling


def rope_context(hf: dict, scaling: dict | None) -> int:
    """``max_seq_len`` of a RoPE model: ``max_position_embeddings``, or for dynamic NTK (whose
    ``max_position_embeddings`` is the pretrained context) ``factor`` times it."""
    context = int(hf["max_position_embeddings"])
    if scaling is not None and scaling["rope_type"] == "dynamic":
        return int(scaling["factor"] * context)
    return context


def rope_to_hf(base: float, scaling) -> tuple[dict, int | None]:
    """``rope_parameters`` for a base and a :class:`refmath.positions.RopeScaling` (or None), and
    for dynamic NTK the ``max_position_embeddings`` to write (its pretrained context)."""
    params = {"rope_type": "default", "rope_theta": base}
    if scaling is None:
        return params, None
    params["rope_type"] = scaling.rope_type
    params["factor"] = scaling.factor
    if scaling.rope_type in ("llama3", "yarn", "longrope"):
        params["original_max_position_embeddings"] = scaling.original_max_seq_len
    fields = {"llama3": ("low_freq_factor", "high_freq_factor"),
              "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                       "truncate"),
              "longrope": ("short_factor", "long_factor", "attention_factor")}
    for name in fields.get(scaling.rope_type, ()):
        value = getattr(scaling, name)
        if value is not None:
            params[name] = list(value) if isinstance(value, tuple) else value
    context = scaling.original_max_seq_len if scaling.rope_type == "dynamic" else None
    return params, context


# ---- Llama's key rows, which the families written as its differences share ------------------------
# (Hugging Face's name under model.layers.{i}., refmath's under layers.{i}., stored transposed)

ATTENTION_KEYS = (
    ("self_attn.q_proj.weight", "attn.w_q", True),
    ("self_attn.k_proj.weight", "attn.w_k", True),
    ("self_attn.v_proj.weight", "attn.w_v", True),
    ("self_attn.o_proj.weight", "attn.w_o", True),
)
QK_NORM_KEYS = (  # QK-norm's gains (N18): Gemma 3's, OLMo 2's, Command-R's
    ("self_attn.q_norm.weight", "attn.q_norm.gamma", False),
    ("self_attn.k_norm.weight", "attn.k_norm.gamma", False),
)
GATED_FFN_KEYS = (  # the SwiGLU's (or GeGLU's) three projections
    ("mlp.gate_proj.weight", "ffn.w_gate", True),
    ("mlp.up_proj.weight", "ffn.w_up", True),
    ("mlp.down_proj.weight", "ffn.w_down", True),
)


def layer_key_rows(n_layers: int, layer_keys) -> list:
    """The key table's rows of ``n_layers`` layers, ``(model.layers.{i}.<theirs>,
    layers.{i}.<ours>, transposed)``, from one layer's ``layer_keys``."""
    return [(f"model.layers.{i}.{theirs}", f"layers.{i}.{ours}", transposed)
            for i in range(n_layers) for theirs, ours, transposed in layer_keys]


def take_head(weights, tied: bool, params: dict, v: int, d: int) -> None:
    """``lm_head`` (transposed to ``(d, V)``), or, when tied, a stored copy that must equal the
    token table."""
    if not tied:
        params["lm_head"] = weights.take("lm_head.weight", (v, d), transpose=True)
    elif weights.has("lm_head.weight"):
        if not np.array_equal(weights.take("lm_head.weight", (v, d)), params["tok_emb"]):
            raise HFCheckpointError(f"{weights.directory}: tie_word_embeddings is true but "
                                    f"lm_head.weight differs from the token embedding")


class ExpertLayout(NamedTuple):
    """Where a family's checkpoint keeps a mixture-of-experts feed-forward (E4) of a layer
    ``model.layers.{i}.``: the block's name, each expert's SwiGLU matrices (gate, up, down) under
    ``{block}.experts.{j}.``, and the shared experts' block (None: there are none)."""

    block: str
    expert: tuple[str, str, str]
    shared: str | None


MIXTRAL_EXPERTS = ExpertLayout("block_sparse_moe", ("w1", "w3", "w2"), None)
QWEN_MOE_EXPERTS = ExpertLayout("mlp", ("gate_proj", "up_proj", "down_proj"), "shared_expert")
DEEPSEEK_EXPERTS = ExpertLayout("mlp", ("gate_proj", "up_proj", "down_proj"), "shared_experts")

_SWIGLU = ("w_gate", "w_up", "w_down")


def _moe_layer(config, layer: int) -> bool:
    return config.moe is not None and config.moe.is_moe_layer(layer)


def take_moe(weights, params: dict, h: str, p: str, config, layout: ExpertLayout) -> None:
    """One layer's mixture of experts: the router ``gate.weight`` (and DeepSeek-V3's
    ``gate.e_score_correction_bias``), every expert's SwiGLU stacked on a first axis of ``E``, the
    shared experts and Qwen2-MoE's ``shared_expert_gate``."""
    moe, d = config.moe, config.d_model
    e, f, s = moe.n_experts, moe.d_expert, moe.shared_width
    block = f"{h}{layout.block}."
    params[p + "ffn.router.w"] = weights.take(block + "gate.weight", (e, d), transpose=True)
    if moe.score_bias:
        params[p + "ffn.router.bias"] = weights.take(block + "gate.e_score_correction_bias", (e,))
    for ours, theirs, shape in zip(_SWIGLU, layout.expert, ((f, d), (f, d), (d, f))):
        params[p + f"ffn.experts.{ours}"] = np.stack([
            weights.take(f"{block}experts.{j}.{theirs}.weight", shape, transpose=True)
            for j in range(e)])
    if s:
        for ours, theirs, shape in zip(_SWIGLU, ("gate_proj", "up_proj", "down_proj"),
                                       ((s, d), (s, d), (d, s))):
            params[p + f"ffn.shared.{ours}"] = weights.take(
                f"{block}{layout.shared}.{theirs}.weight", shape, transpose=True)
    if moe.shared_gate:
        params[p + "ffn.shared_gate.w"] = weights.take(block + "shared_expert_gate.weight", (1, d),
                                                       transpose=True)


def moe_to_hf(params: dict, tensors: dict, h: str, p: str, config, layout: ExpertLayout) -> None:
    """The inverse of :func:`take_moe`: one layer's mixture of experts under Hugging Face's names."""
    moe, block = config.moe, f"{h}{layout.block}."
    tensors[block + "gate.weight"] = linear_out(params[p + "ffn.router.w"])
    if moe.score_bias:
        tensors[block + "gate.e_score_correction_bias"] = params[p + "ffn.router.bias"]
    for ours, theirs in zip(_SWIGLU, layout.expert):
        for j, w in enumerate(params[p + f"ffn.experts.{ours}"]):
            tensors[f"{block}experts.{j}.{theirs}.weight"] = linear_out(w)
    if moe.shared_width:
        for ours, theirs in zip(_SWIGLU, ("gate_proj", "up_proj", "down_proj")):
            tensors[f"{block}{layout.shared}.{theirs}.weight"] = linear_out(
                params[p + f"ffn.shared.{ours}"])
    if moe.shared_gate:
        tensors[block + "shared_expert_gate.weight"] = linear_out(params[p + "ffn.shared_gate.w"])


def take_swiglu_layer(weights, params: dict, h: str, p: str, d: int, f: int) -> None:
    """The two RMSNorm gains and the SwiGLU of one layer (Llama's names)."""
    params[p + "ln1.gamma"] = weights.take(h + "input_layernorm.weight", (d,))
    params[p + "ln2.gamma"] = weights.take(h + "post_attention_layernorm.weight", (d,))
    take_swiglu(weights, params, h, p, d, f)


def take_swiglu(weights, params: dict, h: str, p: str, d: int, f: int) -> None:
    """The gated FFN of one layer (Llama's names)."""
    params[p + "ffn.w_gate"] = weights.take(h + "mlp.gate_proj.weight", (f, d), transpose=True)
    params[p + "ffn.w_up"] = weights.take(h + "mlp.up_proj.weight", (f, d), transpose=True)
    params[p + "ffn.w_down"] = weights.take(h + "mlp.down_proj.weight", (d, f), transpose=True)


def take_feed_forward_layer(weights, params: dict, h: str, p: str, config, layer: int,
                            layout: ExpertLayout | None) -> None:
    """The two RMSNorm gains and the feed-forward of layer ``layer``: its mixture of experts in
    ``layout`` on a layer ``config.moe`` selects, else the dense SwiGLU (Llama's names)."""
    d = config.d_model
    if not _moe_layer(config, layer):
        take_swiglu_layer(weights, params, h, p, d, config.d_f)
        return
    params[p + "ln1.gamma"] = weights.take(h + "input_layernorm.weight", (d,))
    params[p + "ln2.gamma"] = weights.take(h + "post_attention_layernorm.weight", (d,))
    take_moe(weights, params, h, p, config, layout)


def take_ends(weights, params: dict, config) -> None:
    """Token table, final norm and head of the Llama-style models."""
    d, v = config.d_model, config.vocab_size
    params["tok_emb"] = weights.take("model.embed_tokens.weight", (v, d))
    params["ln_f.gamma"] = weights.take("model.norm.weight", (d,))
    take_head(weights, config.tie_embeddings, params, v, d)


def linear_out(w: np.ndarray) -> np.ndarray:
    """refmath's ``(in, out)`` weight as ``torch.nn.Linear`` stores it, ``(out, in)``."""
    return np.ascontiguousarray(w.T)


def swiglu_layers_to_hf(config, params: dict, tensors: dict,
                        layout: ExpertLayout | None = None) -> None:
    """Every layer's two norms and
    feed-forward (a mixture of experts in ``layout`` where ``config.moe`` has one), the token
    table, the final norm and the head, under Llama's names."""
    for i in range(config.n_layers):
        h, p = f"model.layers.{i}.", f"layers.{i}."
        tensors[h + "input_layernorm.weight"] = params[p + "ln1.gamma"]
        tensors[h + "post_attention_layernorm.weight"] = params[p + "ln2.gamma"]
        if _moe_layer(config, i):
            moe_to_hf(params, tensors, h, p, config, layout)
            continue
        for name in ("gate", "up", "down"):
            tensors[h + f"mlp.{name}_proj.weight"] = linear_out(params[p + f"ffn.w_{name}"])
    tensors["model.embed_tokens.weight"] = params["tok_emb"]
    tensors["model.norm.weight"] = params["ln_f.gamma"]
    if not config.tie_embeddings:
        tensors["lm_head.weight"] = linear_out(params["lm_head"])


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


def split_heads_columns(w: np.ndarray, heads: int, widths: tuple) -> list[np.ndarray]:
    """Columns of ``w`` ``(n, heads * sum(widths))``, per head laid out as consecutive blocks of
    ``widths``, regrouped as one ``(n, heads * width)`` matrix per block."""
    per_head = w.reshape(w.shape[0], heads, sum(widths))
    edges = np.cumsum((0,) + widths)
    return [np.ascontiguousarray(per_head[:, :, a:b].reshape(w.shape[0], -1))
            for a, b in zip(edges[:-1], edges[1:])]


def join_heads_columns(blocks: list, heads: int) -> np.ndarray:
    """The inverse of :func:`split_heads_columns`."""
    n = blocks[0].shape[0]
    return np.concatenate([b.reshape(n, heads, -1) for b in blocks], axis=2).reshape(n, -1)
