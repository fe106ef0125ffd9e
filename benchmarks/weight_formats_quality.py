"""Generation with the layers' weights and the output head in bf16, f16 and Q8_0 against the
float32 model: the logit error, the greedy agreement, and tokens/s beside the bytes each token
reads.

Each model (--checkpoint, a run directory of `python -m refmath train`, and/or --shapes, random
float32 weights) is run greedily for --tokens tokens after a --prompt-tokens random prompt by the
NumPy float32 model: those are the reference tokens. Then for each format (--formats):

* logit error: the same tokens fed to the generation with `generate(..., weights=FORMAT,
  backend="cpu")`'s steps (refmath.inference.kv_cache.sliding_next_logits: one prefill, then one
  compiled decode step per token reading the stored bytes), and the logits after every prefix
  compared with the float32 model's on the same prefix: the largest |difference|, and that over
  the largest |logit|. "f32" is the compiled step on the float32 weights: the error of the sums'
  order alone, the floor under the formats' figures.
* agreement: on those same prefixes, the share of positions whose argmax is the float32 model's
  (teacher-forced), and, generating freely with the format, how many tokens come out before the
  first one that differs from the reference (all of them: "all").
* speed: greedy generation of --speed-tokens tokens on the cpu backend (generate's loop, with the
  stored weights made once beforehand, as the command makes them once), --repeats runs per
  format in turns whose order changes every round; tokens/s from the median run and the fastest.
  "bytes/token": the weights a token reads (the layers' matrices and the head in the format, the
  norms in float32, one row of each embedding table, a tied table's too: its head is a rounded
  copy) plus the KV cache read on average over the run; "bound": a plain read of that many bytes
  (benchmarks/_bandwidth.py, stream_sum on the same threads, after an untimed eviction), timed in
  the same turns, as tokens/s.

The error against the float32 model now includes the head's rounding: the logits are
norm(x) W~_out, where before the head was stored (records up to 2026-12-06) they were norm(x) W_out
with W_out float32. W1 and W2 bound it as they bound any stored product
(refmath.weight_formats.product_error_bound).

The layers' matrices and the head need inputs in whole 32-weight blocks for Q8_0 (refmath's
default `train` Llama has d_ff 176: train it with ffn_multiple_of=32). A --checkpoint model's context is stretched
to hold prompt + tokens where it has RoPE (no table of positions to outgrow), so that every token
after the prompt is one decode step.

    python benchmarks/weight_formats_quality.py --quick
    python benchmarks/weight_formats_quality.py --checkpoint runs/llama --shapes llama-small
    python benchmarks/weight_formats_quality.py --shapes llama-small --threads 1 2

Nothing is asserted: the figures belong to the machine and its load (printed first and last).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

import numpy as np
from _bandwidth import ReadReference, default_evict_mib
from _common import fmt_bytes, load_average, neutral_reader, print_table, rotated_times

from refmath import kernels
from refmath.fast.products import kernel_products
from refmath.inference.generate import generate
from refmath.inference.kv_cache import sliding_next_logits
from refmath.inference.layer_formats import (HEAD, WEIGHTS, restored_params, stored_layer_weights,
                                              stored_model)
from refmath.inference.weight_layout import decode_layout
from refmath.models import decoder, model_module

SHAPES = {  # random float32 weights (the speed does not depend on training; the errors do)
    "llama-small": ("llama", decoder.DecoderConfig(
        vocab_size=32000, max_seq_len=2048, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4,
        d_ff=2048, tie_embeddings=False, rope_layout="half", norm_eps=1e-5)),
    "llama-tiny": ("llama", decoder.DecoderConfig(
        vocab_size=512, max_seq_len=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
        d_ff=128, tie_embeddings=False, rope_layout="half", norm_eps=1e-5)),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", metavar="DIR", help="a run directory of refmath train")
    parser.add_argument("--shapes", nargs="*", choices=tuple(SHAPES), default=None,
                        help="random-weight models (default: llama-small without --checkpoint)")
    parser.add_argument("--formats", nargs="+", choices=WEIGHTS, default=list(WEIGHTS))
    parser.add_argument("--tokens", type=int, default=256, help="greedy tokens compared")
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--speed-tokens", type=int, default=64, help="tokens per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per format")
    parser.add_argument("--threads", type=int, nargs="+", default=[None],
                        help="kernel and BLAS thread counts for the timed runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="llama-tiny, 32 tokens, 2 runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.tokens, args.speed_tokens, args.repeats = ["llama-tiny"], 32, 16, 2
    if args.shapes is None:
        args.shapes = [] if args.checkpoint else ["llama-small"]
    if min(args.tokens, args.prompt_tokens, args.speed_tokens, args.repeats) < 1:
        parser.error("--tokens, --prompt-tokens, --speed-tokens and --repeats must be positive")
    return args


def models(args):
    """``(label, model, config, float32 params)`` for each model asked for."""
    length = args.prompt_tokens + args.tokens
    if args.checkpoint:
        from refmath.train import load_checkpoint

        ckpt = load_checkpoint(args.checkpoint)
        config = ckpt.config
        if config.max_seq_len < length:
            if not getattr(config, "rope_layout", None):
                raise SystemExit(f"{args.checkpoint}: a context of {config.max_seq_len} cannot "
                                 f"hold {length} tokens without RoPE; use fewer --tokens")
            config = dataclasses.replace(config, max_seq_len=length)
        params = {k: np.asarray(v, np.float32) for k, v in ckpt.params.items()}
        yield f"{args.checkpoint} (trained)", ckpt.model, config, params
    for shape in args.shapes:
        model, config = SHAPES[shape]
        params = model_module(model).init_params(config, seed=args.seed)
        yield f"{shape} (random)", model, config, {k: v.astype(np.float32) for k, v in params.items()}


def layer_forms(module, params, config, fmt, head: bool = True):
    """``(params the steps read, the config they run with, stored matrices or None)`` for ``fmt``:
    as ``generate(..., weights=fmt)`` makes them (the layers' matrices and the head stored,
    :func:`refmath.inference.layer_formats.stored_model`), or with ``head=False`` as it made them
    before the head was stored: the layers' matrices alone, the head float32."""
    if fmt == "f32":
        return decode_layout(params), config, None
    if head:
        restored, run_config, stored = stored_model(module, decode_layout(params), config, fmt)
        return restored, run_config, stored
    stored = stored_layer_weights(module, params, config, fmt)
    return restored_params(decode_layout(params), stored, fmt), config, stored


def step_logits(model, params, config, tokens, prompt_len, backend, stored=None, fmt="f32",
                products=None):
    """The ``(N, V)`` logits after each prefix of ``tokens`` ``(1, T)`` from ``prompt_len`` on."""
    next_logits = sliding_next_logits(model, params, config, config.max_seq_len, backend, stored,
                                      fmt, products)
    return np.concatenate([next_logits(tokens[:, :t]) for t in range(prompt_len, tokens.shape[1])])


def bytes_per_token(model, config, params, stored, prompt, tokens) -> int:
    """Weights a token reads plus the KV cache read on average: the stored matrices (the layers',
    and the head where it is stored), every other entry of ``params`` (the float32 parameters,
    with ``config`` as given) in float32, and one row of each embedding table, unless the table is
    also the head and the head is not stored (then the head's product reads all of it)."""
    stored = stored or {}
    head_stored = HEAD in stored
    total = stored[HEAD].nbytes if head_stored and HEAD not in params else 0  # a tied head's copy
    for name, value in params.items():
        if name in stored:
            total += stored[name].nbytes
        elif name in ("tok_emb", "pos_emb") and not (
                name == "tok_emb" and config.tie_embeddings and not head_stored):
            total += value.nbytes // value.shape[0]
        else:
            total += value.nbytes
    kv_heads = config.n_heads if model == "gpt" else config.kv_heads
    per_position = 2 * config.n_layers * kv_heads * config.d_h * 4
    return total + per_position * (prompt + (tokens - 1) / 2)


def quality(label, model, config, params, args, rows):
    module = model_module(model)
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, config.vocab_size, args.prompt_tokens)
    ref = generate(model, params, config, prompt, args.tokens, greedy=True)[None]  # NumPy float32
    ref_logits = step_logits(model, params, config, ref, args.prompt_tokens, "numpy")
    scale = float(np.abs(ref_logits).max())
    for fmt in args.formats:
        steps, run_config, stored = layer_forms(module, params, config, fmt)
        products = kernel_products if fmt == "f32" else None
        logits = step_logits(model, steps, run_config, ref, args.prompt_tokens, "cpu", stored, fmt,
                             products)
        free = generate(model, params, config, prompt, args.tokens, greedy=True, backend="cpu",
                        weights=fmt, products=products)
        error = float(np.abs(logits - ref_logits).max())
        agree = float(np.mean(logits.argmax(-1) == ref_logits.argmax(-1)))
        differ = np.flatnonzero(free[args.prompt_tokens:] != ref[0, args.prompt_tokens:])
        rows.append([label, fmt, f"{error:.2e}", f"{error / scale:.1e}", f"{100 * agree:.1f}%",
                     "all" if differ.size == 0 else str(int(differ[0]))])


def greedy_run(model, config, steps, stored, fmt, prompt, n):
    """generate's greedy loop on the cpu backend, with the stored weights made beforehand (as the
    command makes them once per run): one prefill, then n - 1 decode steps."""
    def run():
        # generate gives decode-layout parameters (every format's here) kernel_products: the head's
        # product and the prefill's then run on rows_matmul for every format, not BLAS for some
        next_logits = sliding_next_logits(model, steps, config, config.max_seq_len, "cpu", stored,
                                          fmt, kernel_products)
        tokens = prompt[None]
        for _ in range(n):
            tokens = np.concatenate([tokens, next_logits(tokens).argmax(-1)[:, None]], axis=1)
        return tokens
    return run


def speed(label, model, config, params, args, rows):
    module = model_module(model)
    prompt = np.random.default_rng(args.seed).integers(0, config.vocab_size, args.prompt_tokens)
    fns, nbytes = {}, {}
    for fmt in args.formats:
        steps, run_config, stored = layer_forms(module, params, config, fmt)
        nbytes[fmt] = bytes_per_token(model, config, params, stored, args.prompt_tokens,
                                      args.speed_tokens)
        fns[fmt] = greedy_run(model, run_config, steps, stored, fmt, prompt, args.speed_tokens)
        fns[f"read {fmt}"] = ReadReference(nbytes[fmt], evict_mib=0).read
    evict = neutral_reader(default_evict_mib())
    times = rotated_times(fns, args.repeats, before=lambda name: evict and evict())
    for fmt in args.formats:
        med, low = statistics.median(times[fmt]), min(times[fmt])
        rate, bound = args.speed_tokens / med, 1 / statistics.median(times[f"read {fmt}"])
        rows.append([label, kernels.cpu_threads(), fmt, fmt_bytes(int(nbytes[fmt])),
                     f"{rate:.1f} ({args.speed_tokens / low:.1f})", f"{bound:.1f}",
                     f"{100 * rate / bound:.0f}%"])


def main(argv=None) -> int:
    args = parse_args(argv)
    if not kernels.cpu_available():
        raise SystemExit("refmath._C is not built: run pip install -e . first")
    print(f"{load_average()}; OpenMP wait policy: {kernels.OPENMP_WAIT}; "
          f"{kernels.cpu_instructions()}")
    quality_rows, speed_rows = [], []
    loaded = list(models(args))
    for label, model, config, params in loaded:
        quality(label, model, config, params, args, quality_rows)
    print_table(["model", "weights", "max |logit error|", "over max |logit|", "same argmax",
                 "free run: first differing token"], quality_rows,
                title=f"against the NumPy float32 model over {args.tokens} greedy tokens after a "
                      f"{args.prompt_tokens}-token random prompt (teacher-forced on its tokens; "
                      f"the free run generates with the format)")
    for threads in args.threads:
        with kernels.cpu_thread_limit(threads):
            for label, model, config, params in loaded:
                speed(label, model, config, params, args, speed_rows)
    print_table(["model", "threads", "weights", "bytes/token", "tokens/s median (fastest)",
                 "bound tokens/s", "of bound"], speed_rows,
                title=f"{args.speed_tokens} greedy tokens on backend cpu, {args.repeats} runs per "
                      f"format in rotating turns, each after an untimed read of "
                      f"{default_evict_mib():g} MiB of other memory; bound: a plain read of the "
                      f"bytes a token reads, as tokens/s (median); timings on a shared machine "
                      f"are noisy")
    print(load_average() + " at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
