"""Greedy generation, tokens per second: refmath against transformers' generate on the same
checkpoint, and both against the weight-streaming bound.

For each shape (--shapes), the script writes a checkpoint with random float32 weights
(refmath.hf.save_checkpoint: the speed does not depend on training) into a temporary directory,
loads that one directory into both sides (refmath.hf.load_checkpoint, and transformers'
AutoModelForCausalLM.from_pretrained), and continues the same random --prompt-tokens prompt by
--tokens greedy tokens on each:

* refmath: refmath.inference.generate.generate(..., greedy=True) with the KV cache, attention on
  --backend (default cpu, the C++ decode kernels);
* transformers: model.generate(do_sample=False) with its default cache and attention (SDPA),
  under torch.inference_mode, no end-of-sequence stop (neither side stops early).

refmath's weights are laid out by refmath.inference.weight_layout.decode_layout by default
(--layout decode: each matrix stored as the rows of W^T, as torch stores a Linear's weight), once,
before any timing; --layout stored keeps the loader's (in, out) rows. Its decode-step products
(--products) are generate's own choice by default: on --backend cpu, refmath.kernels.rows_matmul
with two or more threads or in the decode layout, otherwise NumPy's BLAS. "blas" and "kernel" fix
one of them (products=refmath.fast.products.blas_products or kernel_products); "both" times
BLAS's, and rows_matmul's as a third side in the same turns, and prints the two side by side.
Wherever the products run on rows_matmul, each decode step runs every layer in one compiled call
(refmath.inference.compiled_step); on BLAS's products the NumPy layers run.

The generated token ids must be identical (printed: yes, or the first position where they part).

Shapes:
* gpt2-124m: refmath.models.gpt.GPT_CONFIGS["gpt2-small"] (12 layers, width 768, vocab 50257,
  tied head), written as transformers' gpt2;
* llama-small: a Llama-shaped decoder of about the same size (12 layers, width 768, 12 query and
  4 key/value heads, SwiGLU 2048, vocab 32000, untied head), written as transformers' llama.

The bound. Decoding one token reads every weight once (the embedding tables: one row, unless the
head reuses the table) and the whole KV cache so far, so a token cannot come faster than a plain
read of those bytes. The reference (benchmarks/_bandwidth.py) is exactly that read: a float32
buffer of the bytes a token reads on average (weights plus the run's KV reads over its tokens),
read by refmath.kernels.stream_sum on the run's thread count, after an untimed eviction of the
caches (--evict-mib of other memory read by NumPy on one thread), timed as one more side in the
same turns as the generations. Each side's median tokens/s is printed as a fraction of two bounds:
one token per median read, and in parentheses one per fastest read. On a shared machine the reads
move from one minute to the next (their range is printed): a disturbed read can put a median run
above the median's bound, and a read made while the neighbours were idle sets a ceiling that the
generations of the other minutes never saw, so neither alone is the machine's bound. Compute is
not the bound at batch 1: 2 FLOPs per 4-byte weight.

Threads: each --threads count is set on both sides (threadpoolctl for NumPy's BLAS and the OpenMP
pools, refmath.kernels.set_cpu_threads for refmath's kernels, torch.set_num_threads for torch) and
printed. The OpenMP runtime's wait policy (refmath.kernels.OPENMP_WAIT, printed) is one for both
sides, which share the runtime: passive unless OMP_WAIT_POLICY (or GOMP_SPINCOUNT) says otherwise.

Contention: --contend N starts N busy processes (each a Python loop that never sleeps, on any core)
before the first run and ends them after the last, so that every figure is taken with them
competing for the cores, as on a shared server or a laptop running something else. Timing: --repeats runs of each side in turns
whose order reverses every round; tokens/s from the median run and from the fastest.

llama.cpp (--peers llamacpp, with or instead of transformers; the `llamacpp` extra, see
benchmarks/_llamacpp.py): the Llama-shaped checkpoints only. The same folder (with a stand-in
tokenizer.json that llama.cpp's converter accepts) is converted by llama.cpp's own
convert_hf_to_gguf.py to a GGUF file at each --weights format (f32, bf16, f16, q8 = Q8_0), and
llama-cpp-python generates greedily from the same prompt ids on the same thread count, its KV cache
float32. refmath runs the same format with `generate(..., weights=FORMAT)`'s loop (the stored
matrices made once beforehand, as the command makes them once). All formats of both sides, and a
plain read of each side's bytes per token (its own: llama.cpp's files round the head and the
embedding too, refmath's formats the layers' matrices and the head, its embedding float32, of
which a token reads one row), take turns in one rotation, so that every ratio in a row is of runs
made in the same minutes. --head-f32-too adds refmath with the head left in float32 (its layers
alone stored, as generate did before the head was stored: records up to 2026-12-07 00:49) at
bf16, f16 and q8 as one more side in the same turns, with a plain read of its bytes, and prints it
against the head in the format in a second table. Each side's bound is its own bytes per
token read at one bandwidth, the median over all those reads (the same for both sides). Each row:
tokens/s of both, their ratio, each side's bound and fraction of it, whether the ids are refmath's at that format (or the first
token where they part), and the load average when the row's turns ended. Without llama-cpp-python
(or the converter) that table is skipped with a line saying what to install.

Then, unless --no-self, the old table: refmath against itself on the tiny default models of
`python -m refmath train` (recomputing every prefix, the KV cache in NumPy, in the C++ kernels).

    python benchmarks/generate.py --quick                  # tiny shapes, seconds
    python benchmarks/generate.py --threads 1 2            # GPT-2-124M and llama-small, 64 tokens
    OPENBLAS_NUM_THREADS=1 python benchmarks/generate.py --threads 1
    python benchmarks/generate.py --threads 1 2 --contend 1   # with one competing busy process
    python benchmarks/generate.py --peers llamacpp --shapes llama-small --threads 1 2 \
        --weights f32 bf16 f16 q8 --gguf-converter PATH/convert_hf_to_gguf.py --no-self
    python benchmarks/generate.py --peers llamacpp --shapes llama-small --threads 1 \
        --weights f32 bf16 f16 q8 --llamacpp-repack off --head-f32-too --no-self

Nothing is asserted: the figures belong to the machine (and its load, printed first and last).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import _llamacpp
from _bandwidth import ReadReference
from _common import fmt_bytes, interleaved_best_ms, load_average
from weight_formats_quality import bytes_per_token, greedy_run, layer_forms

from refmath import hf, kernels, train
from refmath.fast.products import blas_products, kernel_products
from refmath.data import make_task
from refmath.inference.generate import generate
from refmath.inference.weight_layout import decode_layout
from refmath.models import DECODER_ONLY, decoder, gpt, model_module

READ = "read reference"  # the bandwidth reference's side in the turns
PRODUCTS = {"default": "generate's choice (rows_matmul on 2+ threads or in the decode layout, "
                       "BLAS otherwise)", "blas": "BLAS",
            "kernel": "rows_matmul", "both": "BLAS and rows_matmul"}
SHAPES = {
    "gpt2-124m": ("gpt", dataclasses.replace(gpt.GPT_CONFIGS["gpt2-small"], dropout=0.0)),
    "llama-small": ("llama", decoder.DecoderConfig(
        vocab_size=32000, max_seq_len=2048, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4,
        d_ff=2048, tie_embeddings=False, rope_layout="half", norm_eps=1e-5)),
}
QUICK_SHAPES = {
    "gpt2-tiny": ("gpt", gpt.GPTConfig(vocab_size=512, max_seq_len=128, n_layers=2, d_model=64,
                                        n_heads=4, d_ff=256, norm_position="pre",
                                        tie_embeddings=True, ffn="gelu_tanh", dropout=0.0)),
    "llama-tiny": ("llama", decoder.DecoderConfig(
        vocab_size=512, max_seq_len=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
        d_ff=128, tie_embeddings=False, rope_layout="half", norm_eps=1e-5)),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=list(SHAPES))
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens to generate")
    parser.add_argument("--prompt-tokens", type=int, default=8, help="length of the random prompt")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each side")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="thread counts to run at, on both sides (default: as started)")
    parser.add_argument("--backend", choices=("numpy", "cpu"), default="cpu",
                        help="refmath's attention over the KV cache")
    parser.add_argument("--products", choices=PRODUCTS, default="default",
                        help="refmath's decode-step products: generate's choice (rows_matmul on "
                             "--backend cpu with 2+ threads, BLAS otherwise), NumPy's BLAS, "
                             "refmath.kernels.rows_matmul (refmath.fast.products), or "
                             "both: BLAS, and rows_matmul timed in the same turns as a third side")
    parser.add_argument("--layout", choices=("decode", "stored"), default="decode",
                        help="refmath's weight matrices as the rows of W^T (decode_layout) or as "
                             "the loader's (in, out) rows")
    parser.add_argument("--evict-mib", type=float, default=None,
                        help="memory read before each reference read, so that it starts from "
                             "cold caches (default: 1.5 times the last-level cache; 0: warm)")
    parser.add_argument("--no-self", action="store_true",
                        help="skip the old table (refmath against itself on the tiny models)")
    parser.add_argument("--peers", nargs="+", choices=("transformers", "llamacpp"),
                        default=["transformers"],
                        help="transformers: its generate on the float32 checkpoint; llamacpp: "
                             "llama-cpp-python on the checkpoint converted to GGUF at each "
                             "--weights format (Llama shapes only; the llamacpp extra)")
    parser.add_argument("--weights", nargs="+", choices=tuple(_llamacpp.GGUF_TYPES),
                        default=["f32"],
                        help="formats of the llama.cpp comparison: refmath's generate --weights, "
                             "and the GGUF type of that name (q8: Q8_0)")
    parser.add_argument("--gguf-converter", metavar="PATH", default=None,
                        help="llama.cpp's convert_hf_to_gguf.py (default: $"
                             f"{_llamacpp.CONVERTER_ENV}); {_llamacpp.HOW_TO_GET_IT}")
    parser.add_argument("--head-f32-too", action="store_true",
                        help="with --peers llamacpp: also time refmath with its head left in "
                             "float32 (the layers alone stored) at each narrower format, in the "
                             "same turns, and print it against the head in the format")
    parser.add_argument("--llamacpp-repack", choices=("on", "off"), default="on",
                        help="llama.cpp's extra buffer types for quantised weights (AMX tiles, "
                             "repacked rows): on, its default, or off, its --no-repack")
    parser.add_argument("--contend", type=int, default=0, metavar="N",
                        help="busy processes competing for the cores during every run")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run of seconds: tiny shapes, 16 tokens, 2 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.repeats = 16, 2
    if args.tokens < 1 or args.repeats < 1 or args.prompt_tokens < 1:
        parser.error("--tokens, --prompt-tokens and --repeats must be positive")
    if args.contend < 0:
        parser.error("--contend must be 0 or more")
    if args.threads and min(args.threads) < 1:
        parser.error("--threads must be positive")
    return args


# ---- the bound -------------------------------------------------------------------------------------

def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bytes_read(model: str, config, params: dict, prompt: int, tokens: int) -> tuple[int, int]:
    """``(weight bytes per token, KV bytes over the whole run)``. Every weight is read once per
    token, except the embedding tables, of which a token reads one row (the tied head reads the
    whole token table). The KV read at the j-th forward pass covers prompt + j positions."""
    row = {name: params[name].nbytes // params[name].shape[0] for name in ("tok_emb", "pos_emb")
           if name in params}
    weights = sum(v.nbytes for v in params.values())
    for name, one in row.items():
        if not (name == "tok_emb" and config.tie_embeddings):
            weights += one - params[name].nbytes
    if model == "gpt":
        per_position = 2 * config.n_layers * config.n_heads * config.d_h * 4
    else:
        per_position = 2 * config.n_layers * config.kv_heads * config.d_h * 4
    positions = tokens * prompt + tokens * (tokens - 1) // 2
    return weights, per_position * positions


# ---- the two sides ----------------------------------------------------------------------------------

def load_both(model: str, config, directory):
    """The one checkpoint, loaded by refmath and by transformers."""
    import torch
    import transformers

    name, r_config, r_params = hf.load_checkpoint(directory)
    if name != model:
        raise SystemExit(f"the checkpoint loaded as {name!r}, expected {model!r}")
    t_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return r_config, r_params, t_model


def sides(model, config, params, t_model, prompt, tokens, backend, products):
    import torch
    import transformers

    ids = torch.from_numpy(prompt[None].astype(np.int64))
    mask = torch.ones_like(ids)
    # no end-of-sequence token: both sides generate exactly `tokens`, and nobody's logits are edited
    generation = transformers.GenerationConfig(max_new_tokens=tokens, do_sample=False, num_beams=1,
                                               pad_token_id=0, eos_token_id=None)
    t_model.generation_config = generation

    def ours(choice=None):  # None: generate's own choice of products
        return generate(model, params, config, prompt, tokens, greedy=True, backend=backend,
                        products=choice)[-tokens:]

    def theirs():
        with torch.inference_mode():
            out = t_model.generate(input_ids=ids, attention_mask=mask, generation_config=generation)
        return out[0, -tokens:].numpy()
    choice = {"default": None, "blas": blas_products, "kernel": kernel_products,
              "both": blas_products}[products]
    fns = {"refmath": lambda: ours(choice), "transformers": theirs}
    if products == "both":
        fns["refmath, rows_matmul"] = lambda: ours(kernel_products)
    return fns


def time_sides(fns: dict, repeats: int) -> dict:
    """Seconds of each run per side, the sides taking turns in an order reversed every round."""
    names = list(fns)
    times = {name: [] for name in names}
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:  # a reference read times itself, after its untimed eviction
            fn = fns[name]
            times[name].append(fn.seconds() if isinstance(fn, ReadReference) else _seconds(fn))
    return times


@contextlib.contextmanager
def limit_threads(n: int | None):
    """Both sides on ``n`` threads (None: as started): NumPy's BLAS and every OpenMP pool
    (threadpoolctl), refmath's kernels, torch."""
    if n is None:
        yield
        return
    import torch
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=n), kernels.cpu_thread_limit(n):
        torch.set_num_threads(n)
        yield


@contextlib.contextmanager
def competitors(count: int):
    """``count`` busy processes (a Python loop each) for the length of the ``with`` block."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait()


def thread_line() -> str:
    import torch
    from threadpoolctl import threadpool_info

    blas = [p["num_threads"] for p in threadpool_info() if p.get("user_api") == "blas"]
    return (f"threads: NumPy BLAS {blas[0] if blas else '?'}, refmath kernels "
            f"{kernels.cpu_threads()}, torch {torch.get_num_threads()}")


def run_shape(label: str, model: str, config, args, rows: list) -> None:
    rng = np.random.default_rng(0)
    params = model_module(model).init_params(config, seed=0, dtype=np.float32)
    prompt = rng.integers(0, config.vocab_size, args.prompt_tokens)
    with tempfile.TemporaryDirectory() as directory:
        hf.save_checkpoint(directory, model, config, params)
        del params
        r_config, r_params, t_model = load_both(model, config, directory)
    if args.layout == "decode":
        r_params = decode_layout(r_params)
    n_params = sum(v.size for v in r_params.values())
    weights, kv = bytes_read(model, r_config, r_params, args.prompt_tokens, args.tokens)
    fns = sides(model, r_config, r_params, t_model, prompt, args.tokens, args.backend, args.products)
    ours, theirs = fns["refmath"](), fns["transformers"]()  # also the warm-up
    same = np.array_equal(ours, theirs)
    if "refmath, rows_matmul" in fns:
        same = same and np.array_equal(fns["refmath, rows_matmul"](), theirs)
    parted = "yes" if same else f"no (from token {int(np.argmax(ours != theirs))})"
    print(f"{label}: {n_params:,} parameters; {fmt_bytes(weights)} of weights read per token, "
          f"{fmt_bytes(kv // args.tokens)} of KV per token on average; identical ids: {parted}",
          flush=True)
    per_token = (args.tokens * weights + kv) / args.tokens
    reference = ReadReference(per_token, evict_mib=args.evict_mib)
    for threads in args.threads or [None]:
        with limit_threads(threads):
            times = time_sides({**fns, READ: reference}, args.repeats)
            print(f"  {thread_line()}; {load_average()}", flush=True)
            print(f"  {reference.describe()}", flush=True)
        reads = sorted(reference.nbytes / t for t in times.pop(READ))
        bandwidth = statistics.median(reads)
        print(f"  read bandwidth {bandwidth / 1e9:.1f} GB/s (median of the {len(reads)} reads in "
              f"the same turns; {reads[0] / 1e9:.1f}-{reads[-1] / 1e9:.1f})", flush=True)
        bound, ceiling = bandwidth / reference.nbytes, reads[-1] / reference.nbytes  # tokens/s

        def of_bound(rate: float) -> str:
            return f"{100 * rate / bound:.0f}% ({100 * rate / ceiling:.0f}%)"

        med = {name: args.tokens / statistics.median(t) for name, t in times.items()}
        best = {name: args.tokens / min(t) for name, t in times.items()}
        rows.append([label, threads or kernels.cpu_threads(),
                     f"{med['refmath']:.1f} ({best['refmath']:.1f})",
                     f"{med['transformers']:.1f} ({best['transformers']:.1f})",
                     f"{med['refmath'] / med['transformers']:.2f} "
                     f"({best['refmath'] / best['transformers']:.2f})",
                     "yes" if same else "no", f"{bound:.1f} ({ceiling:.1f})",
                     of_bound(med["refmath"]), of_bound(med["transformers"])])
        if "refmath, rows_matmul" in med:
            kernel, blas = med["refmath, rows_matmul"], med["refmath"]
            rows[-1].append(f"{kernel:.1f} ({best['refmath, rows_matmul']:.1f}), "
                            f"{kernel / blas:.2f}x")


# ---- llama.cpp as a peer (benchmarks/_llamacpp.py) -------------------------------------------------

LLAMACPP_HEADERS = ["shape", "weights", "threads", "refmath tok/s", "llama.cpp tok/s",
                    "refmath / llama.cpp", "bytes/token refmath, llama.cpp",
                    "bound tok/s refmath, llama.cpp", "refmath of bound", "llama.cpp of bound",
                    "ids as refmath's", "load (1 min)"]


OLD_HEAD = "refmath, head f32"  # the side with the head left in float32 (--head-f32-too)
HEAD_HEADERS = ["shape", "weights", "threads", "head in format tok/s", "head f32 tok/s",
                "in format / f32", "bytes/token in format, f32", "bound tok/s in format, f32",
                "of bound in format, f32", "ids as head f32's", "load (1 min)"]


def parted(ours: np.ndarray, theirs: np.ndarray) -> str:
    """"yes" for identical ids, else the first position (0-based, among the generated tokens)
    where they differ."""
    return "yes" if np.array_equal(ours, theirs) else f"from token {int(np.argmax(ours != theirs))}"


def run_llamacpp(label: str, model: str, config, args, converter, rows: list,
                 head_rows: list) -> None:
    """refmath and llama.cpp on one checkpoint at each --weights format and --threads count: one
    rotation of turns per thread count holding every format of both sides and a plain read of each
    side's bytes per token (see the module's docstring); with --head-f32-too, refmath with its head
    left in float32 as a third side at the narrower formats, its rows in ``head_rows``."""
    module = model_module(model)
    rng = np.random.default_rng(0)  # the same weights and prompt as run_shape's
    params = module.init_params(config, seed=0, dtype=np.float32)
    prompt = rng.integers(0, config.vocab_size, args.prompt_tokens)
    n = args.tokens
    with tempfile.TemporaryDirectory() as directory:
        hf.save_checkpoint(directory, model, config, params)
        del params
        _llamacpp.write_stand_in_tokenizer(directory, config.vocab_size)
        _, r_config, r_params = hf.load_checkpoint(directory)
        _, kv = bytes_read(model, r_config, r_params, args.prompt_tokens, n)
        ggufs, ours, nbytes = {}, {}, {}
        # the formats at which refmath also runs with its head left in float32
        old_head = [fmt for fmt in args.weights if fmt != "f32"] if args.head_f32_too else []
        old, old_bytes = {}, {}
        for fmt in args.weights:
            ggufs[fmt] = _llamacpp.convert(directory, fmt, f"{directory}/model-{fmt}.gguf",
                                           converter)
            weights = _llamacpp.GGUF_TYPES[fmt]  # refmath's name for it too
            steps, run_config, stored = layer_forms(module, r_params, r_config, weights)
            ours[fmt] = greedy_run(model, run_config, steps, stored, weights, prompt, n)
            nbytes[fmt] = (bytes_per_token(model, r_config, r_params, stored, args.prompt_tokens, n),
                           _llamacpp.weight_bytes_per_token(ggufs[fmt]) + kv / n)
            print(f"{label}, {fmt}: GGUF tensors {_llamacpp.gguf_types(ggufs[fmt])}; bytes per "
                  f"token refmath {fmt_bytes(int(nbytes[fmt][0]))}, llama.cpp "
                  f"{fmt_bytes(int(nbytes[fmt][1]))}", flush=True)
            if fmt in old_head:
                steps, run_config, stored = layer_forms(module, r_params, r_config, weights,
                                                        head=False)
                old[fmt] = greedy_run(model, run_config, steps, stored, weights, prompt, n)
                old_bytes[fmt] = bytes_per_token(model, r_config, r_params, stored,
                                                 args.prompt_tokens, n)
                print(f"{label}, {fmt}, refmath's head left in float32: bytes per token "
                      f"{fmt_bytes(int(old_bytes[fmt]))}", flush=True)
        # One buffer for every read reference: each reads a prefix of it, its side's bytes.
        largest = max([max(pair) for pair in nbytes.values()] + list(old_bytes.values()))
        buffer = np.ones(int(largest) // 4 + 1, np.float32)
        reads = {(fmt, side): ReadReference(arrays=[buffer[:int(b) // 4]], evict_mib=args.evict_mib)
                 for fmt, pair in nbytes.items() for side, b in zip(("refmath", "llama.cpp"), pair)}
        reads.update({(fmt, OLD_HEAD): ReadReference(arrays=[buffer[:int(b) // 4]],
                                                     evict_mib=args.evict_mib)
                      for fmt, b in old_bytes.items()})
        for threads in args.threads or [None]:
            with limit_threads(threads):
                count = threads or kernels.cpu_threads()
                peers = {fmt: _llamacpp.LlamaCppPeer(path, count, args.prompt_tokens + n,
                                                     repack=args.llamacpp_repack == "on")
                         for fmt, path in ggufs.items()}
                fns = {}
                for fmt in args.weights:
                    fns[("refmath", fmt)] = lambda run=ours[fmt]: run()[0, -n:]
                    fns[("llama.cpp", fmt)] = lambda peer=peers[fmt]: peer.generate(prompt, n)
                    fns[("read refmath", fmt)] = reads[(fmt, "refmath")]
                    fns[("read llama.cpp", fmt)] = reads[(fmt, "llama.cpp")]
                    if fmt in old:
                        fns[(OLD_HEAD, fmt)] = lambda run=old[fmt]: run()[0, -n:]
                        fns[(f"read {OLD_HEAD}", fmt)] = reads[(fmt, OLD_HEAD)]
                # the first run of each side is its warm-up, and gives the ids compared
                agree = {fmt: parted(fns[("refmath", fmt)](), fns[("llama.cpp", fmt)]())
                         for fmt in args.weights}
                agree_old = {fmt: parted(fns[("refmath", fmt)](), fns[(OLD_HEAD, fmt)]())
                             for fmt in old}
                times = time_sides(fns, args.repeats)
                load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
                print(f"  {thread_line()}; llama.cpp n_threads {count}; {load_average()}",
                      flush=True)
                for peer in peers.values():
                    peer.close()
            # One bandwidth for both sides: the median over every read of these turns (each its
            # bytes over its seconds). The reads differ only in length, so a bound per side from
            # its own few reads would carry that side's luck in which minutes they fell.
            rates = sorted(reads[key].nbytes / t for key in reads
                           for t in times[(f"read {key[1]}", key[0])])
            bandwidth = statistics.median(rates)
            print(f"  read bandwidth {bandwidth / 1e9:.1f} GB/s (median of the {len(rates)} reads "
                  f"in the same turns; {rates[0] / 1e9:.1f}-{rates[-1] / 1e9:.1f})", flush=True)
            for fmt in args.weights:
                med = {side: n / statistics.median(times[(side, fmt)])
                       for side in ("refmath", "llama.cpp")}
                best = {side: n / min(times[(side, fmt)]) for side in ("refmath", "llama.cpp")}
                bound = {side: bandwidth / nbytes[fmt][i]
                         for i, side in enumerate(("refmath", "llama.cpp"))}
                rows.append([label, fmt, count,
                             f"{med['refmath']:.1f} ({best['refmath']:.1f})",
                             f"{med['llama.cpp']:.1f} ({best['llama.cpp']:.1f})",
                             f"{med['refmath'] / med['llama.cpp']:.2f} "
                             f"({best['refmath'] / best['llama.cpp']:.2f})",
                             f"{fmt_bytes(int(nbytes[fmt][0]))}, {fmt_bytes(int(nbytes[fmt][1]))}",
                             f"{bound['refmath']:.1f}, {bound['llama.cpp']:.1f}",
                             f"{100 * med['refmath'] / bound['refmath']:.0f}%",
                             f"{100 * med['llama.cpp'] / bound['llama.cpp']:.0f}%",
                             agree[fmt], f"{load:.1f}"])
            for fmt in old:
                new_rate = n / statistics.median(times[("refmath", fmt)])
                old_rate = n / statistics.median(times[(OLD_HEAD, fmt)])
                new_best = n / min(times[("refmath", fmt)])
                old_best = n / min(times[(OLD_HEAD, fmt)])
                new_bound, old_bound = bandwidth / nbytes[fmt][0], bandwidth / old_bytes[fmt]
                head_rows.append([label, fmt, count, f"{new_rate:.1f} ({new_best:.1f})",
                                  f"{old_rate:.1f} ({old_best:.1f})",
                                  f"{new_rate / old_rate:.2f} ({new_best / old_best:.2f})",
                                  f"{fmt_bytes(int(nbytes[fmt][0]))}, "
                                  f"{fmt_bytes(int(old_bytes[fmt]))}",
                                  f"{new_bound:.1f}, {old_bound:.1f}",
                                  f"{100 * new_rate / new_bound:.0f}%, "
                                  f"{100 * old_rate / old_bound:.0f}%",
                                  agree_old[fmt], f"{load:.1f}"])


def print_table(headers, rows, title):
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print(title)
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def self_comparison(tokens: int, repeats: int) -> None:
    """The old table: refmath's generate against itself on the tiny default models."""
    ways = {"recompute": dict(cache=False), "cache numpy": dict(backend="numpy")}
    if kernels.cpu_available():
        ways["cache cpu"] = dict(backend="cpu")
    print(f"\nrefmath against itself (no external peer), the default models of `python -m refmath "
          f"train`: {tokens} greedy tokens from a 1-token prompt, tokens/s (x recompute), best of "
          f"{repeats}")
    print(f"{'model':<8}" + "".join(f"{way:>22}" for way in ways))
    for name in DECODER_ONLY:
        task = make_task(train.recipe(name).task)
        config = train.default_config(name, task)
        params = model_module(name).init_params(config, 0, dtype=np.float32)
        n = min(tokens, config.max_seq_len - 1)

        def run(options):
            return lambda: generate(name, params, config, np.array([1]), n, greedy=True, **options)

        times = interleaved_best_ms({way: run(o) for way, o in ways.items()}, repeats=repeats)
        base = times["recompute"]
        print(f"{name:<8}" + "".join(f"{1e3 * n / times[way]:>12.0f} ({base / times[way]:4.1f}x)"
                                     .rjust(22) for way in ways))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import threadpoolctl  # noqa: F401
        import torch
        import transformers
    except ImportError as error:
        raise SystemExit(f"this benchmark compares with transformers: {error} "
                         "(pip install -e '.[oracle,hf]' transformers threadpoolctl)")
    transformers.logging.set_verbosity_error()  # random weights: no warnings about special tokens
    transformers.utils.logging.disable_progress_bar()
    if not kernels.cpu_available() and args.backend == "cpu":
        raise SystemExit("refmath._C is not built: run pip install -e . first, or --backend numpy")
    print(f"{os.cpu_count()} CPUs; {load_average()}; refmath's CPU kernels: "
          f"{kernels.cpu_vector_lanes()} float32 lanes; torch {torch.__version__}, transformers "
          f"{transformers.__version__}; {thread_line()}")
    print(f"OpenMP wait policy: {kernels.OPENMP_WAIT}; competing busy processes: {args.contend}")
    print(f"{args.tokens} greedy tokens after a {args.prompt_tokens}-token random prompt, float32, "
          f"batch 1, refmath attention on {args.backend}, its weights in the "
          f"{'decode layout (rows of W^T)' if args.layout == 'decode' else 'stored (in, out) rows'}, "
          f"its decode-step products on {PRODUCTS[args.products]} (with rows_matmul, every "
          f"layer of a step in one compiled call)")
    shapes = QUICK_SHAPES if args.quick else {s: SHAPES[s] for s in args.shapes}
    converter = _llamacpp.converter_path(args.gguf_converter)
    skip = _llamacpp.missing(converter) if "llamacpp" in args.peers else None
    if "llamacpp" in args.peers and skip is None:
        print(f"llama.cpp: {_llamacpp.version()}, GGUF files made by {converter}; formats "
              f"{', '.join(args.weights)}; Llama shapes only; its extra buffer types "
              f"(repack) {args.llamacpp_repack}")
    rows, llama_rows, head_rows = [], [], []
    with competitors(args.contend):
        for label, (model, config) in shapes.items():
            if "transformers" in args.peers:
                run_shape(label, model, config, args, rows)
            if "llamacpp" in args.peers and skip is None and model == "llama":
                run_llamacpp(label, model, config, args, converter, llama_rows, head_rows)
    print()
    if "transformers" in args.peers:
        headers = ["shape", "threads", "refmath tok/s", "transformers tok/s",
                   "refmath / transformers", "same ids", "bound tok/s", "refmath of bound",
                   "transformers of bound"]
        if args.products == "both":
            headers.append("refmath with rows_matmul tok/s, / BLAS's")
        print_table(headers, rows,
                    title=f"tokens/s from the median run (from the fastest), {args.repeats} runs "
                          "per side in turns whose order reverses every round; bound: one token "
                          "per median (fastest) cold read of the bytes a token reads (weights + "
                          "KV); 'of bound': median tokens/s over the bound from the median read "
                          "(from the fastest read)")
    if "llamacpp" in args.peers:
        if skip is not None:
            print(f"llama.cpp peer skipped: {skip}")
        else:
            print("\n" if "transformers" in args.peers else "", end="")
            print_table(LLAMACPP_HEADERS, llama_rows,
                        title=f"refmath against llama.cpp at each weight format: tokens/s from "
                              f"the median run (from the fastest), {args.repeats} runs per side "
                              f"in turns whose order reverses every round, every format of both "
                              f"sides in the same turns; bound: that side's bytes per token (weights + "
                              f"KV) read at the median bandwidth of all the cold reads timed in "
                              f"the same turns; ids: llama.cpp's {args.tokens} against refmath's at the "
                              f"same format")
            if head_rows:
                print()
                print_table(HEAD_HEADERS, head_rows,
                            title=f"refmath with its head in the format against its head left "
                                  f"in float32 (the layers alone stored), in the same turns as "
                                  f"the table above; the same bandwidth for the bounds; ids: "
                                  f"the head-in-format run's {args.tokens} against the head-f32 "
                                  f"run's")
    if not args.no_self:
        with competitors(args.contend):
            self_comparison(min(args.tokens, 63), max(2, args.repeats))
    print(load_average() + " at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
