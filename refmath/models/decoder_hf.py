r"""The Hugging Face key tables of the decoder family: the configuration and the weights of each
``model_type`` in :data:`HF_MODEL_TYPES` read into a :class:`refmath.models.decoder_config.DecoderConfig`
and refmath's parameter names, and written back (:func:`to_hf`), so that a checkpoint round-trips.
:mod:`refmath.models.decoder` offers them as its model's ``config_from_hf``, ``params_from_hf`` and
``to_hf``.
"""
from __future__ import annotations


from refmath.moe import MoEConfig
from refmath.models.hf_layout import (MIXTRAL_EXPERTS, QWEN_MOE_EXPERTS, HFCheckpointError,
                                      interleaved_to_half, linear_out, refuse, refuse_common,
                                      require, rope_context, rope_from_hf, rope_to_hf,
                                      swiglu_layers_to_hf, take_ends, take_feed_forward_layer)
from refmath.models.decoder_config import DecoderConfig

__all__ = [
    "HF_MODEL_TYPES", "QWEN_TYPES", "config_from_hf", "params_from_hf", "to_hf"
]


# ---- Hugging Face: llama, mistral, qwen2, qwen3, their mixtures of experts -----------------------

# RoPE in the "half" layout; any of them with a rope scaling (N13-N17), qwen3 with QK-norm (N18);
# mixtral, qwen2_moe and qwen3_moe with mixture-of-experts feed-forwards (E1-E4) (falcon is
# refmath.models.falcon's, olmo2 refmath.models.olmo2's, phi3 refmath.models.phi3's, gemma,
# gemma2 and gemma3_text refmath.models.gemma's)
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
_EXPERT_LAYOUTS = {"mixtral": MIXTRAL_EXPERTS, "qwen2_moe": QWEN_MOE_EXPERTS,
                   "qwen3_moe": QWEN_MOE_EXPERTS}


def _hf_window(hf: dict) -> int | None:
    """Mistral's and Mixtral's sliding window (every layer's), or None where it masks nothing."""
    window = hf.get("sliding_window")
    if hf["model_type"] not in ("mistral", "mixtral") or not window:
        return None
    return int(window) if int(window) < int(hf["max_position_embeddings"]) else None


QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


def _qwen_windows(hf: dict) -> tuple:
    """``(sliding_window, window_layers)`` of a Qwen config: its window on the layers
    ``layer_types`` marks ``"sliding_attention"`` (as transformers derives them when the file has
    none: Qwen2 and Qwen3 slide the layers from ``max_window_layers`` on, Qwen2-MoE the even ones
    below it), on every layer of a Qwen3-MoE (whose attention reads no layer types), or
    ``(None, None)`` without ``use_sliding_window`` or where the window hides nothing."""
    window = hf.get("sliding_window")
    if not hf.get("use_sliding_window") or not window:
        return None, None
    window, layers, kind = int(window), int(hf["num_hidden_layers"]), hf["model_type"]
    if window >= rope_context(hf, rope_from_hf(hf)[1]):
        return None, None
    if kind == "qwen3_moe":
        return window, None
    first = int(hf.get("max_window_layers", 28))
    types = hf.get("layer_types") or [
        "sliding_attention" if (i >= first if kind != "qwen2_moe" else i < first and i % 2 == 0)
        else "full_attention" for i in range(layers)]
    if set(types) - {"sliding_attention", "full_attention"} or len(types) != layers:
        refuse(hf, "layer_types", types, "refmath reads one sliding_attention or full_attention "
               "per layer")
    slides = tuple(t == "sliding_attention" for t in types)
    if not any(slides):
        return None, None
    return window, None if all(slides) else slides


def _moe_from_hf(hf: dict) -> MoEConfig | None:
    """The mixture of experts of a mixtral, qwen2_moe or qwen3_moe config (None for the others).

    Mixtral renormalises its top-k softmax scores; the Qwen MoEs do so with ``norm_topk_prob``,
    and Qwen2-MoE adds one shared expert behind a sigmoid gate. The auxiliary-loss coefficient is a
    training choice, and transformers adds its loss (over all layers' routers at once) only with
    ``output_router_logits``: a loaded model's loss is the cross-entropy alone (``balance_coef``
    0).
    """
    kind = hf["model_type"]
    if kind not in _EXPERT_LAYOUTS:
        return None
    n = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
    if n < 1:
        refuse(hf, "num_local_experts", n, f"a {kind} checkpoint needs routed experts")
    moe = dict(n_experts=n, top_k=int(hf["num_experts_per_tok"]))
    if kind == "mixtral":
        if float(hf.get("router_jitter_noise") or 0.0):
            refuse(hf, "router_jitter_noise", hf["router_jitter_noise"], "refmath's router adds "
                   "no noise to its input (transformers does it only while training)")
        return MoEConfig(**moe, d_expert=int(hf["intermediate_size"]), norm_topk=True)
    step, only = int(hf.get("decoder_sparse_step", 1)), sorted(hf.get("mlp_only_layers") or [])
    if step != 1:
        refuse(hf, "decoder_sparse_step", step, "refmath places experts on every layer from "
               "its dense first ones on (decoder_sparse_step 1)")
    if only != list(range(len(only))):
        refuse(hf, "mlp_only_layers", only, "refmath's dense layers are the first ones")
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if kind == "qwen2_moe" else 0
    return MoEConfig(**moe, d_expert=int(hf["moe_intermediate_size"]),
                     norm_topk=bool(hf.get("norm_topk_prob", False)), first_dense=len(only),
                     d_shared=shared, shared_gate=shared > 0)


def config_from_hf(hf: dict) -> DecoderConfig:
    kind = hf["model_type"]
    refuse_common(hf, experts=kind in _EXPERT_LAYOUTS)
    require(hf, "hidden_act", ("silu",), "silu", "refmath's SwiGLU gates with SiLU")
    if kind not in ("qwen2", "qwen2_moe"):
        require(hf, "attention_bias", (False,), False, "refmath's decoder has no bias on the "
                 "output projection (q/k/v biases alone are Qwen2's)")
    require(hf, "mlp_bias", (False,), False, "refmath's SwiGLU has no biases")
    heads = int(hf["num_attention_heads"])
    base, scaling = rope_from_hf(hf)
    qkv_bias = kind == "qwen2" or (kind == "qwen2_moe" and bool(hf.get("qkv_bias", True)))
    fields = dict(qk_norm="head" if kind in ("qwen3", "qwen3_moe") else None,
                  tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                  sliding_window=_hf_window(hf))
    if kind in QWEN_TYPES:
        fields["sliding_window"], fields["window_layers"] = _qwen_windows(hf)
    return DecoderConfig(rope_scaling=scaling, moe=_moe_from_hf(hf), **fields,
        vocab_size=int(hf["vocab_size"]), max_seq_len=rope_context(hf, rope_from_hf(hf)[1]),
        d_model=int(hf["hidden_size"]), n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        d_ff=int(hf["intermediate_size"]), rope_base=base,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), dropout=0.0,
        rope_layout="half", qkv_bias=qkv_bias)


def params_from_hf(hf: dict, config: DecoderConfig, weights) -> dict:
    d = config.d_model
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
        if config.qk_norm == "head":  # qwen3's q_norm and k_norm, one (d_h,) gain each
            for name in ("q", "k"):
                params[p + f"attn.{name}_norm.gamma"] = weights.take(
                    h + f"self_attn.{name}_norm.weight", (config.d_h,))
        take_feed_forward_layer(weights, params, h, p, config, i,
                                _EXPERT_LAYOUTS.get(hf["model_type"]))
        # Older Llama files store RoPE's frequencies as a buffer: derived from rope_theta.
        if weights.has(h + "self_attn.rotary_emb.inv_freq"):
            weights.skip(h + "self_attn.rotary_emb.inv_freq")
    take_ends(weights, params, config)
    return params


def _moe_kind(config: DecoderConfig) -> str:
    """The Hugging Face type a decoder with a mixture of experts is written as: qwen2_moe (a gated
    shared expert), qwen3_moe (QK-norm) or mixtral; what none of them holds is refused."""
    moe = config.moe

    def refuse_moe(field, why):
        raise HFCheckpointError(f"a decoder with moe.{field} = {getattr(moe, field)!r} has no "
                                f"Hugging Face counterpart here: {why}")

    for field, plain, why in (("scoring", "softmax", "mixtral and the Qwen MoEs score by softmax"),
                              ("routing", "greedy", "mixtral and the Qwen MoEs route greedily"),
                              ("scaling", 1.0, "mixtral and the Qwen MoEs do not scale the gates"),
                              ("score_bias", False, "only deepseek_v3 biases the choice"),
                              ("every", 1, "mixtral and the Qwen MoEs put experts on every layer")):
        if getattr(moe, field) != plain:
            refuse_moe(field, why)
    if moe.shared_width and not moe.shared_gate:
        refuse_moe("n_shared", "only deepseek's shared experts are ungated (write it as mla)")
    if moe.shared_gate:
        if config.qk_norm or config.sliding_window:
            refuse_moe("shared_gate", "qwen2_moe has no QK-norm and slides only some layers")
        return "qwen2_moe"
    if config.qkv_bias:
        raise HFCheckpointError("a decoder with q/k/v biases and experts is written as "
                                "qwen2_moe, which also needs its gated shared expert "
                                "(moe.shared_gate)")
    if config.qk_norm:
        if config.sliding_window:
            raise HFCheckpointError("qwen3_moe slides only some layers; this config has "
                                    f"sliding_window = {config.sliding_window} on every layer")
        return "qwen3_moe"
    if not moe.norm_topk:
        refuse_moe("norm_topk", "mixtral renormalises its top-k scores")
    if moe.first_dense:
        refuse_moe("first_dense", "mixtral has no dense layers")
    return "mixtral"


_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                  "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM"}


def _llama_kind(config: DecoderConfig) -> str:
    """The Hugging Face type of a decoder: llama, mistral (a window), qwen2 (q/k/v biases), qwen3
    (QK-norm) or, with experts, mixtral or a Qwen MoE, any of them with its rope scaling (LongRoPE
    included; Phi-3 is :mod:`refmath.models.phi3`'s). Qwen2 and Qwen3 slide their window on the
    layers their ``layer_types`` name, so they take a window on every layer or on some
    (``window_layers``)."""
    if config.moe is not None:
        if config.window_layers is not None:
            raise HFCheckpointError("a decoder with experts is written here with one window for "
                                    "every layer or none; this config has window_layers = "
                                    f"{config.window_layers}")
        return _moe_kind(config)
    if config.qk_norm and config.qkv_bias:
        raise HFCheckpointError("a decoder with qk_norm is written as qwen3, which has no q/k/v "
                                "biases without an output bias; this config has qkv_bias = True")
    if config.window_layers is not None and not (config.qk_norm or config.qkv_bias):
        raise HFCheckpointError("window_layers (a window on some layers only) is written as "
                                "qwen2 (with qkv_bias), qwen3 (with qk_norm), or, as Gemma 2 "
                                "or 3, by refmath.models.gemma")
    return ("qwen3" if config.qk_norm else "qwen2" if config.qkv_bias
            else "mistral" if config.sliding_window else "llama")


def _qwen_window_fields(config: DecoderConfig) -> dict:
    """The window fields of a qwen2 or qwen3 config: its layers' types, and, where the sliding
    layers are the upper ones, the first of them as ``max_window_layers``."""
    if config.sliding_window is None:
        return dict(use_sliding_window=False)
    slides = config.window_layers or (True,) * config.n_layers
    first = slides.index(True)
    fields = dict(use_sliding_window=True, sliding_window=config.sliding_window,
                  layer_types=["sliding_attention" if f else "full_attention" for f in slides])
    if all(slides[first:]):
        fields["max_window_layers"] = first
    return fields


def to_hf(config: DecoderConfig, params: dict):
    kind = _llama_kind(config)
    architecture = _ARCHITECTURES[kind]
    rope_parameters, context = rope_to_hf(config.rope_base, config.rope_scaling)
    hf = {"model_type": kind, "architectures": [architecture],
          "vocab_size": config.vocab_size,
          "max_position_embeddings": config.max_seq_len if context is None else context,
          "hidden_size": config.d_model, "num_hidden_layers": config.n_layers,
          "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads,
          "head_dim": config.d_h, "intermediate_size": config.d_f, "hidden_act": "silu",
          "rms_norm_eps": config.norm_eps,
          "rope_parameters": rope_parameters,
          "tie_word_embeddings": config.tie_embeddings}
    if kind == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    elif kind == "qwen3":
        hf.update(attention_bias=False, **_qwen_window_fields(config))
    elif kind == "mistral":
        hf.update(sliding_window=config.sliding_window)
    elif kind == "mixtral":
        hf.update(sliding_window=config.sliding_window, num_local_experts=config.moe.n_experts,
                  num_experts_per_tok=config.moe.top_k, intermediate_size=config.moe.d_expert,
                  router_jitter_noise=0.0, output_router_logits=False)
    elif kind in ("qwen2_moe", "qwen3_moe"):
        moe = config.moe
        hf.update(use_sliding_window=False, num_experts=moe.n_experts,
                  num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.d_expert,
                  norm_topk_prob=moe.norm_topk, decoder_sparse_step=1,
                  mlp_only_layers=list(range(moe.first_dense)), output_router_logits=False)
        if kind == "qwen2_moe":
            hf.update(qkv_bias=config.qkv_bias, shared_expert_intermediate_size=moe.shared_width)
        else:
            hf.update(attention_bias=False)
    else:
        hf.update(_qwen_window_fields(config))

    def rotated(w):  # the query and key columns in Hugging Face's "half" RoPE layout
        return w if config.rope_layout == "half" else interleaved_to_half(w, config.d_h)

    tensors = {}
    for i in range(config.n_layers):
        h, p = f"model.layers.{i}.self_attn.", f"layers.{i}.attn."
        tensors[h + "q_proj.weight"] = linear_out(rotated(params[p + "w_q"]))
        tensors[h + "k_proj.weight"] = linear_out(rotated(params[p + "w_k"]))
        tensors[h + "v_proj.weight"] = linear_out(params[p + "w_v"])
        tensors[h + "o_proj.weight"] = linear_out(params[p + "w_o"])
        if config.qkv_bias:
            tensors[h + "q_proj.bias"] = rotated(params[p + "b_q"])
            tensors[h + "k_proj.bias"] = rotated(params[p + "b_k"])
            tensors[h + "v_proj.bias"] = params[p + "b_v"]
        if config.qk_norm:  # a (d_h,) gain, permuted within the head like the columns it scales
            for name in ("q", "k"):
                tensors[h + f"{name}_norm.weight"] = rotated(params[p + f"{name}_norm.gamma"])
    swiglu_layers_to_hf(config, params, tensors, _EXPERT_LAYOUTS.get(kind))
    return hf, tensors
