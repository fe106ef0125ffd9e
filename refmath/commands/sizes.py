"""``python -m refmath sizes``: the calculators of :mod:`refmath.sizing` for a preset, a Hugging
Face config or explicit flags, as a table (and a plot)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from refmath._validate import check_int
from refmath.commands import CommandError
from refmath.sizing import (
    PRESETS, ModelConfig, active_parameters, adamw_training_memory, attention_cache_rows,
    decode_step_flops, expert_parallel_traffic, format_bytes, hf_parameter_count,
    inference_memory_rule_of_thumb, memory_against_compute, model_cache_bytes, own_design,
    parameter_counts, prefill_flops, save_cache_plot, sizing_config)

__all__ = ["HELP", "DESCRIPTION", "add_arguments", "run"]

HELP = "KV-cache, memory, parameter and FLOP sizes for a preset or a given shape"
DESCRIPTION = (
    "Sizes of the KV cache (MHA/GQA/MQA/MLA, optionally quantised), weights, inference and "
    "training memory, parameters and FLOPs, for a published preset or for explicit flags. For a "
    "mixture of experts (--preset deepseek-v3, deepseek-v2, mixtral-8x7b) also the active "
    "parameters per token, the memory of all the experts against the FLOPs of one token, and the "
    "all-to-all bytes per token of expert parallelism (one expert per device, and with DeepSeek's "
    "group-limited routing one group per device). Units are binary (KiB, MiB, GiB).")
DEFAULT_TOKENS = 8192  # T for a shape whose context length is not known


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments: a source (``--preset``, ``--hf``, ``--config``), the shape flags that
    override it, ``--plot``."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=sorted(PRESETS),
                        help="a published configuration; the flags below override its fields")
    source.add_argument("--hf", metavar="DIR",
                        help="the config.json of a Hugging Face model directory (any model type "
                        "refmath.hf loads); the flags below override its fields")
    source.add_argument("--config", metavar="FILE",
                        help="a Hugging Face config.json file, as --hf")
    parser.add_argument("--layers", type=int, help="layers L holding a KV cache")
    parser.add_argument("--heads", type=int, help="query heads h")
    parser.add_argument("--kv-heads", type=int, help="key/value heads g (default: h, i.e. MHA)")
    parser.add_argument("--head-dim", type=int, help="head width d_h")
    parser.add_argument("--latent-dim", type=int,
                        help="MLA latent width d_c for the MLA row (default: the preset's, else 4 d_h)")
    parser.add_argument("--rope-dim", type=int,
                        help="MLA positional key width d_R (default: the preset's, else d_h/2)")
    parser.add_argument("--tokens", type=int,
                        help=f"context length T (default: the preset's own context length, else "
                        f"{DEFAULT_TOKENS})")
    parser.add_argument("--batch", type=int, default=1, help="sequences B (default: 1)")
    parser.add_argument("--bytes", type=int, default=2,
                        help="bytes per element b: of the cache, and for a mixture of experts of "
                        "its weights and of the rows sent to the experts (default: 2, fp16/bf16)")
    parser.add_argument("--plot", metavar="PATH",
                        help="also save a figure of cache size against context length, as .png, "
                        ".pdf, .svg, ... (needs matplotlib)")


def _resolve_config(args: argparse.Namespace) -> ModelConfig:
    # the flags' fields of refmath.sizing.ModelConfig, and the flags that set them
    flags = {"n_layers": ("--layers", args.layers), "n_heads": ("--heads", args.heads),
             "kv_heads": ("--kv-heads", args.kv_heads), "head_dim": ("--head-dim", args.head_dim)}
    given = {field: value for field, (_, value) in flags.items() if value is not None}
    if args.hf or args.config:
        config = _with_fields(sizing_config(_hf_config(args)), given)
    elif args.preset:
        config = _with_fields(PRESETS[args.preset], given)
    else:
        missing = [flags[k][0] for k in ("n_layers", "n_heads", "head_dim") if k not in given]
        if missing:
            raise ValueError(f"without --preset, give {', '.join(missing)}")
        given.setdefault("kv_heads", given["n_heads"])
        # Without a preset d_model is a placeholder: nothing printed for bare flags depends on it.
        config = ModelConfig("custom", d_model=given["n_heads"] * given["head_dim"], **given)
    if config.is_mla:
        # For an MLA preset the latent flags change the model itself, not just the comparison row.
        mla = {k: v for k, v in (("d_c", args.latent_dim), ("d_rope", args.rope_dim))
               if v is not None}
        config = dataclasses.replace(config, **mla)
    return config


def _with_fields(config: ModelConfig, given: dict) -> ModelConfig:
    """``config`` with the flags' fields; refused where ``--layers`` would leave its per-layer
    windows without their layers."""
    layers = given.get("n_layers", config.n_layers)
    if config.window_layers is not None and layers != config.n_layers:
        raise ValueError(f"--layers {layers}: {config.name} flags which of its {config.n_layers} "
                         f"layers slide a window (window_layers); there are no such flags for "
                         f"{layers} layers")
    return dataclasses.replace(config, **given)


def _print_windows(config: ModelConfig, tokens: int, batch: int, b: int, out) -> None:
    """How many layers slide which window, and what that saves at ``tokens`` tokens."""
    windows = config.layer_windows
    sliding = {}
    for w in windows:
        if w is not None:
            sliding[w] = sliding.get(w, 0) + 1
    dense = windows.count(None)
    parts = [f"{n} of {config.n_layers} layers slide a {w}-token window and keep "
             f"min(T, {w}) = {min(tokens, w)} tokens" for w, n in sorted(sliding.items())]
    if dense:
        parts.append(f"{dense} keep all T = {tokens}")
    own = model_cache_bytes(config, tokens, batch, b)
    every = model_cache_bytes(dataclasses.replace(config, sliding_window=None, window_layers=None),
                              tokens, batch, b)
    print(f"  sliding layers (A12): {'; '.join(parts)}", file=out)
    print(f"  this model's cache, layer by layer: {format_bytes(own)} (the cache column), against "
          f"{format_bytes(every)} if every layer kept all T tokens; per token: a token that "
          f"every layer still holds", file=out)


def _hf_config(args: argparse.Namespace) -> dict:
    from refmath import hf

    if args.hf:
        return hf.read_config(args.hf)
    return hf.read_config_file(args.config)


def _print_parameters(config: ModelConfig, out, total: int | None = None, buffers: int = 0) -> None:
    """Parameters by component (N7) and the memory they need; ``total`` alone where the
    components are not written for this kind of model (MLA), with ``buffers`` stored numbers that
    no gradient trains (DeepSeek-V3's routing biases) said apart."""
    if total is None:
        counts = parameter_counts(config)
        published = f"; published {config.published_params}" if config.published_params else ""
        print(f"\nparameters (N7): {counts.total:,} ({counts.total:.3g}{published})", file=out)
        for name in ("embedding", "positions", "attention", "ffn", "norms", "output"):
            print(f"  {name:<10} {getattr(counts, name):>16,}", file=out)
        total = counts.total
    else:
        print(f"\nparameters (the loaded model's shapes): {total:,} ({total:.3g})", file=out)
        if buffers:
            print(f"  not counted: {buffers:,} routing biases (e_score_correction_bias: buffers "
                  f"that steer the expert choice, set outside the gradient)", file=out)

    p = total
    rule = inference_memory_rule_of_thumb(p)
    train = adamw_training_memory(p)
    print("\nmemory (bf16/fp16 weights, 2 bytes per parameter):", file=out)
    print(f"  weights 2P                                    {format_bytes(rule.weights):>12}", file=out)
    print(f"  inference, RULE OF THUMB (S1): 2P + ~20%      {format_bytes(rule.total):>12}", file=out)
    print(f"  AdamW mixed-precision training (S2): 16P      {format_bytes(train.total):>12}", file=out)
    print(f"    = fp16 weights 2P {format_bytes(train.weights_fp16)} + fp16 grads 2P "
          f"{format_bytes(train.grads_fp16)} + fp32 master 4P {format_bytes(train.master_fp32)} "
          f"+ fp32 Adam m, v 8P {format_bytes(train.adam_moments_fp32)} (activations excluded)", file=out)


def _print_moe(config: ModelConfig, b: int, out) -> None:
    """Active parameters, the experts' memory against one token's FLOPs, and the expert-parallel
    all-to-all traffic of a mixture of experts."""
    moe, d = config.moe, config.d_model
    L = config.moe_layers
    budget = memory_against_compute(config, b)
    active = active_parameters(config)
    shared = f", {moe.n_shared} shared" if moe.n_shared else ""
    print(f"\nmixture of experts: {L} of {config.n_layers} layers; {moe.top_k} of "
          f"{moe.n_experts} routed experts per token{shared} (d_e = {moe.d_expert})", file=out)
    published = f"; published {config.published_active}" if config.published_active else ""
    print(f"  active parameters per token: {active.active:,} ({active.active:.3g}{published}) of "
          f"{active.total:,}", file=out)
    print(f"    = all but {L} layers x ({moe.n_experts} - {moe.top_k}) unchosen experts x 3 d d_e; "
          f"the embedding and output matrices counted whole", file=out)
    print(f"  memory, b={b} bytes per parameter: all weights {format_bytes(budget.weight_bytes)}, "
          f"of which the {L} x {moe.n_experts} routed experts {format_bytes(budget.expert_bytes)}",
          file=out)
    print(f"  compute: one token through the weights, 2 x {active.matmul:,} active matmul weights "
          f"= {budget.token_flops:.3e} FLOPs (attention scores excluded)", file=out)
    print(f"    {budget.bytes_per_flop:.2f} bytes of weights held per FLOP of a token", file=out)
    print(f"  expert-parallel all-to-all per token (dispatch + combine of the d = {d} row, "
          f"b={b} bytes):", file=out)
    plain = expert_parallel_traffic(config, bytes_per_element=b)
    print(f"    D = E = {plain.devices} devices: 2 k (1 - 1/D) d b = 2 x {moe.top_k} x "
          f"(1 - 1/{plain.devices}) x {d} x {b} = {plain.per_layer:,.0f} B per MoE layer; "
          f"x {L} layers = {format_bytes(plain.per_token)}", file=out)
    if moe.routing != "greedy":
        node = expert_parallel_traffic(config, bytes_per_element=b, node_limited=True)
        print(f"    group-limited routing, one group a device: D = n_groups = {node.devices}, "
              f"at most M = topk_groups = {node.max_devices} a token, one send to each: "
              f"2 min(k, M) (1 - 1/D) d b = {node.per_layer:,.0f} B per MoE layer at most; "
              f"x {L} layers = {format_bytes(node.per_token)}", file=out)


def _print_flops(config: ModelConfig, tokens: int, batch: int, out) -> None:
    prefill = prefill_flops(config, tokens, batch)
    step = decode_step_flops(config, tokens, batch)
    print("\nFLOPs (2 per multiply-add; weight matmuls and attention scores/values only):", file=out)
    print(f"  prefill of T={tokens}:          weights {prefill.weights:.3e}, "
          f"attention {prefill.attention:.3e}, total {prefill.total:.3e}", file=out)
    print(f"  one decode step at T={tokens}:  weights {step.weights:.3e}, "
          f"attention {step.attention:.3e}, total {step.total:.3e}", file=out)


def _check_plot_path(path: str) -> None:
    """Refuse a --plot path that cannot be written, before any work: a missing matplotlib, a
    folder that does not exist, or a format matplotlib does not write."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or pip install "
                         "'refmath[lessons]')") from None
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise ValueError(f"--plot {path}: the folder {folder} does not exist")
    formats = FigureCanvasAgg(Figure()).get_supported_filetypes()
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    if extension not in formats:
        raise ValueError(f"--plot {path}: unsupported format {extension or '(none)'!r}; use one of "
                         f"{', '.join(sorted(formats))}")


def run(args: argparse.Namespace) -> int:
    """Print the cache table (and, for a preset, parameters, memory and FLOPs); every input is
    checked before anything is printed."""
    out = sys.stdout
    for flag in ("tokens", "batch", "bytes", "layers", "heads", "kv_heads", "head_dim",
                 "latent_dim", "rope_dim"):
        value = getattr(args, flag)
        if value is not None:
            check_int(f"--{flag.replace('_', '-')}", value, 1)
    if args.plot:
        _check_plot_path(args.plot)
    config = _resolve_config(args)
    tokens = args.tokens or config.context or DEFAULT_TOKENS
    latent = args.latent_dim if args.latent_dim is not None else config.d_c
    rope = args.rope_dim if args.rope_dim is not None else config.d_rope
    rows = attention_cache_rows(config.n_layers, config.n_heads, config.kv_heads, config.head_dim,
                                tokens, args.batch, args.bytes, latent, rope, config.layer_windows)
    hf_total = None  # an MLA model's count, from its shapes, unless a flag changed them
    overridden = any(getattr(args, f) is not None
                     for f in ("layers", "heads", "kv_heads", "head_dim"))
    hf_buffers = 0  # DeepSeek-V3's routing biases: stored, but buffers, not parameters
    if config.is_mla and (args.hf or args.config) and not overridden:
        hf_total = hf_parameter_count(_hf_config(args))
        hf_buffers = hf_parameter_count(_hf_config(args), buffers=True) - hf_total
    if args.tokens:
        why = "as given"
    elif config.context:
        why = f"{config.name}'s own context length"
    else:
        why = f"the default: {config.name} states no context length"

    own = own_design(config)
    title = config.name + (f" ({config.source})" if config.source else "")
    print(f"KV cache (K6, K7, K9): {title}", file=out)
    print(f"  L={config.n_layers}, h={config.n_heads}, g={config.kv_heads}, d_h={config.head_dim}; "
          f"B={args.batch}, b={args.bytes} bytes per element", file=out)
    print(f"  T = {tokens} tokens ({why})", file=out)
    print("  units are binary: 1 KiB = 1024 B, 1 MiB = 1024 KiB, 1 GiB = 1024 MiB\n", file=out)
    print(f"  {'attention':<26} {'per token':>12} {'cache':>12} {'smaller than MHA':>17}", file=out)
    mha = rows[0].total
    for row in rows:
        mark = "*" if row.kind == own else " "
        print(f"{mark} {row.label:<26} {format_bytes(row.bytes_per_token):>12} "
              f"{format_bytes(row.total):>12} {mha / row.total:>16.2f}x", file=out)
    print("  (* this configuration's own attention)", file=out)
    if not config.is_mla and latent is None:
        print("  the MLA row is hypothetical here: DeepSeek-V2's proportions d_c = 4 d_h, "
              "d_R = d_h/2 (set --latent-dim, --rope-dim)", file=out)
    if config.encoder_layers:
        print("  decoder self-attention only: cross-attention also keeps the encoder's K and V",
              file=out)
    if config.sliding_window:
        _print_windows(config, tokens, args.batch, args.bytes, out)

    countable = config.vocab_size is not None and (
        config.d_ff is not None or config.moe_layers == config.n_layers)
    if hf_total is not None or countable:
        _print_parameters(config, out, hf_total, hf_buffers)
        if config.moe is not None:
            _print_moe(config, args.bytes, out)
        if config.is_mla:
            matmul = active_parameters(config).matmul
            print(f"\nFLOPs (2 per multiply-add): one token through the weights, 2 x {matmul:,} = "
                  f"{2 * matmul:.3e}; no prefill or decode attention count: MLA's scores run on "
                  f"the latent cache, which these formulas do not model", file=out)
        elif not config.encoder_layers:
            _print_flops(config, tokens, args.batch, out)
    elif args.preset:
        print(f"\n(no parameter or FLOP count: {config.name} describes only its attention)", file=out)

    if args.plot:
        try:
            save_cache_plot(args.plot, config, tokens, args.batch, args.bytes, latent, rope)
        except OSError as err:
            raise CommandError(f"cannot write --plot {args.plot}: {err.strerror or err}") from None
        print(f"\nplot saved to {args.plot}", file=out)
    return 0
