"""``python -m refmath generate``: sample from a run directory of ``train`` (``--checkpoint``) or
from a Hugging Face model directory (``--hf``), with the sampling rules of
:mod:`refmath.inference.generate`."""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from pathlib import Path

import numpy as np

from refmath.commands import CommandError
from refmath.kernels import BACKENDS
from refmath.models import MODELS

__all__ = ["HELP", "DESCRIPTION", "add_arguments", "run"]

HELP = "sample text from a trained checkpoint or a Hugging Face model directory"
DESCRIPTION = (
    "Load a checkpoint written by 'train' (--checkpoint) or a Hugging Face model directory (--hf) "
    "and generate from a prompt (greedy, temperature, top-k, top-p; seeded).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments: the source (``--checkpoint`` or ``--hf``), the prompt and the sampling
    and decoding flags."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="a run directory of train")
    source.add_argument("--hf", metavar="DIR",
                        help="a Hugging Face model directory (config.json, model.safetensors or "
                        "its shards, and tokenizer.json for --prompt); see refmath.hf. Generation "
                        "stops at config.json's eos_token_id, at any of them when it lists "
                        "several; an id outside the vocabulary can never be generated and is "
                        "ignored, with a warning")
    parser.add_argument("--prompt-ids", metavar="IDS",
                        help="with --hf: the prompt as comma-separated token ids, e.g. 1,2,3 "
                        "(when the directory has no tokenizer.json)")
    parser.add_argument("--prompt", help="text to continue (language models; default: a newline, "
                        "i.e. a new sentence) or digits to reverse (transformer; required). The "
                        "language models know lowercase a-z except j, space, '.' and newline; the "
                        "reversal knows the digits 0-9")
    parser.add_argument("--max-new-tokens", type=int,
                        help="tokens to generate (default: 200; --hf: 20; transformer: source "
                        "length + 1). Past the model's context the window slides (each token sees "
                        "the last max_seq_len tokens), and generate says so once")
    parser.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling")
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (default: 1)")
    parser.add_argument("--top-k", type=int, help="sample among the k most probable tokens")
    parser.add_argument("--top-p", type=float, help="sample from the smallest set of mass >= p")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--no-cache", action="store_true",
                        help="recompute the whole prefix at every step instead of decoding with the "
                        "KV cache (the same tokens, O(T^2) work; the decoders only)")
    parser.add_argument("--backend", choices=BACKENDS, default="numpy",
                        help="who computes attention over the KV cache: the NumPy reference, the "
                        "C++ kernels (which then also multiply the weights, laid out for decoding "
                        "first), or the CUDA kernels with the cache on the GPU (default: numpy; "
                        "the decoders only)")
    parser.add_argument("--weights", choices=("f32", "bf16", "f16", "q8"), default="f32",
                        help="the format the layers' weight matrices and the output head are "
                        "stored in and read from at each decode step: float32, bfloat16, float16, "
                        "or q8 (llama.cpp's Q8_0 blocks, 8.5 bits a weight); the sums stay "
                        "float32, and a tied head's embedding lookup reads the float32 table. "
                        "--backend cpu reads the stored bytes in the compiled step; the other "
                        "backends run the matrices dequantised (default: f32; refmath's decoder "
                        "and GPT only)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="BLAS and C++ kernel threads (default: chosen from the size of the matrix products: "
                        "one for decoding with the KV cache, whose per-token products run slower "
                        "on many threads; a thread count set in OPENBLAS_NUM_THREADS is kept)")


def run(args: argparse.Namespace) -> int:
    """Print the continuation (or the transformer's output), and its speed on stderr."""
    if args.threads is not None and args.threads < 1:
        raise CommandError(f"--threads must be >= 1, got {args.threads}")
    if args.hf is not None:
        return _from_hf(args)
    if args.prompt_ids is not None:
        raise CommandError("--prompt-ids goes with --hf; a run directory's model takes --prompt")
    return _from_run(args)


def _check_sampling_flags(args: argparse.Namespace, alphabet: str | None) -> None:
    """The checks of the sampling functions, said in terms of the command's flags (and, given an
    ``alphabet``, that the prompt's characters are in it)."""
    if not args.greedy and not 0 < args.temperature < math.inf:
        raise CommandError(f"--temperature must be a finite number > 0, got {args.temperature} "
                           f"(for argmax decoding use --greedy)")
    if args.top_k is not None and args.top_k < 1:
        raise CommandError(f"--top-k must be >= 1, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise CommandError(f"--top-p must lie in (0, 1], got {args.top_p}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise CommandError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    prompt = args.prompt if alphabet is not None and args.prompt else ""
    for i, c in enumerate(prompt):
        if c not in alphabet:
            raise CommandError(f"--prompt holds {c!r} at position {i}, which this model's "
                               f"tokenizer does not know; it knows {alphabet!r}")


def _threads(args: argparse.Namespace, params: dict, prompt_len: int, n: int):
    """The BLAS threads of the run (:mod:`refmath._threads`): the largest product of a step has one
    row per token decoded with the cache, the whole sequence's rows without it. ``--threads N``
    sets the C++ kernels' OpenMP threads too (:func:`refmath.kernels.cpu_thread_limit`)."""
    from refmath import kernels
    from refmath._threads import blas_threads, choose_blas_threads, largest_product

    rows = prompt_len + n if args.no_cache else 1
    stack = contextlib.ExitStack()
    stack.enter_context(blas_threads(choose_blas_threads(largest_product(rows, params), args.threads)))
    stack.enter_context(kernels.cpu_thread_limit(args.threads))
    return stack


def _for_decoding(args: argparse.Namespace, params: dict) -> dict:
    """The parameters as the decode steps read them fastest: with the KV cache on ``--backend cpu``,
    the weight matrices laid out in place as the rows of their transposes
    (:func:`refmath.inference.weight_layout.decode_layout`), which the C++ products stream as dot
    products (on a 2-core Zen 4, 28 GB/s on one thread against 15 GB/s from refmath's ``(in, out)``
    rows). In place, the memory stays the parameters plus one matrix while they are copied."""
    if args.backend != "cpu" or args.no_cache:
        return params
    from refmath.inference.weight_layout import decode_layout

    return decode_layout(params, in_place=True)


def _weights(args: argparse.Namespace) -> str:
    """``--weights`` as :func:`refmath.inference.generate.generate` names it."""
    return {"q8": "q8_0"}.get(args.weights, args.weights)


def _report_speed(n: int, seconds: float, how: str) -> None:
    print(f"({n} tokens in {seconds:.2f} s: {n / seconds:.0f} tokens/s; {how})", file=sys.stderr)


# ---- --checkpoint: a run directory of train ------------------------------------------------------

def _from_run(args: argparse.Namespace) -> int:
    from refmath.data import EOS_ID, ReversalLMTask, ReversalTask, make_task
    from refmath.inference.generate import generate, generate_seq2seq
    from refmath.train import load_checkpoint, load_tokenizer

    ckpt = load_checkpoint(args.checkpoint)
    params = _for_decoding(args, ckpt.params)
    tok = load_tokenizer(args.checkpoint)  # from config.json: the task's corpus is not rebuilt
    _check_sampling_flags(args, tok.alphabet)
    sampling = dict(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed)
    decoding = dict(cache=not args.no_cache, backend=args.backend, weights=_weights(args))
    task = ckpt.task.get("name")
    if task == ReversalTask.name and args.weights != "f32":
        raise CommandError(f"--weights {args.weights} goes with the decoder-only models; this "
                           f"run's {ckpt.model} is an encoder-decoder: use --weights f32")
    with _threads(args, params, len(args.prompt or "\n"), args.max_new_tokens or 200):
        start = time.perf_counter()
        if task in (ReversalTask.name, ReversalLMTask.name):
            if not args.prompt:
                raise CommandError("give --prompt, the digits to reverse")
            longest = ckpt.task["max_len"]  # the task's sources: 1..max_len digits
            if len(args.prompt) > longest:
                raise CommandError(f"--prompt has {len(args.prompt)} digits, but this model was "
                                   f"trained on at most {longest}: give 1 to {longest} digits")
            if task == ReversalTask.name and (args.max_new_tokens or 0) > ckpt.config.max_seq_len:
                raise CommandError(f"--max-new-tokens must be at most {ckpt.config.max_seq_len} "
                                   f"for this model (its longest output: {longest} digits and "
                                   f"<eos>), got {args.max_new_tokens}")
            n = args.max_new_tokens if args.max_new_tokens is not None else len(args.prompt) + 1
            if task == ReversalTask.name:
                out = generate_seq2seq(params, ckpt.config, tok.encode(args.prompt), n,
                                       eos_id=EOS_ID, **sampling)
            else:  # the prompt format is the task's; a reversal task is built at once (no corpus)
                prompt = make_task(ckpt.task).prompt_ids(args.prompt)
                out = generate(ckpt.model, params, ckpt.config, prompt, n, eos_id=EOS_ID,
                               **sampling, **decoding)[len(prompt):]
            print(f"{args.prompt} -> {tok.decode(out, specials='show')}")
            n = len(out)
        else:
            prompt = "\n" if args.prompt is None else args.prompt
            n = 200 if args.max_new_tokens is None else args.max_new_tokens
            out = generate(ckpt.model, params, ckpt.config, tok.encode(prompt), n, **sampling,
                           **decoding)
            print(tok.decode(out, specials="show"))
            n = len(out) - len(prompt)
            _note_context(len(out), ckpt.config.max_seq_len)
    seconds = time.perf_counter() - start
    how = "recomputing every prefix" if args.no_cache else f"KV cache on {args.backend}"
    if args.weights != "f32":
        how += f", {args.weights} weights (layers and head)"
    if not MODELS[ckpt.model].decoder_only:
        how = "the encoder-decoder recomputes its decoder prefix"
    _report_speed(n, seconds, how)
    return 0


# ---- --hf: a Hugging Face model directory --------------------------------------------------------

def _prompt_ids(text: str) -> np.ndarray:
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise CommandError(f"--prompt-ids must be comma-separated integers such as 1,2,3, got "
                           f"{text!r}") from None
    return np.array(ids, dtype=np.int64)


def _hf_tokenizer(directory: Path):
    """The directory's ``tokenizer.json`` through the ``tokenizers`` package, or None if there is
    no such file."""
    from refmath.hf import TOKENIZER_FILE

    path = directory / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise CommandError(f"{path} needs the tokenizers package: pip install 'refmath[hf]' (or "
                           f"give --prompt-ids)") from None
    return Tokenizer.from_file(str(path))


def _eos_ids(directory: Path, vocab_size: int) -> list[int] | None:
    """The config's end-of-sequence ids, as transformers reads ``eos_token_id``: one id or a list,
    any of which ends the generation. An id outside the vocabulary can never be generated: it is
    dropped, with one warning line (None when no id is left)."""
    from refmath.hf import read_config

    eos = read_config(directory).get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        print(f"refmath generate: warning: {directory / 'config.json'}: eos_token_id "
              f"{', '.join(map(str, outside))} lies outside the vocabulary of {vocab_size} tokens, "
              f"so no generated token can end the sequence there", file=sys.stderr)
    ids = [i for i in ids if 0 <= i < vocab_size]
    return ids or None


def _note_context(length: int, context: int) -> None:
    """One line when the sequence outgrew the model's context (generate's window then slides)."""
    if length > context:
        print(f"refmath generate: note: the sequence ({length} tokens) outgrew the model's context "
              f"of {context} tokens; past it each token was predicted from the last {context} "
              f"tokens only (a sliding window)", file=sys.stderr)


def _from_hf(args: argparse.Namespace) -> int:
    from refmath.hf import (TOKENIZER_FILE, checkpoint_family, config_from_hf, load_checkpoint,
                            read_config)
    from refmath.inference.generate import generate

    if args.prompt is None and args.prompt_ids is None:
        raise CommandError("give the prompt: --prompt TEXT (needs DIR/tokenizer.json) or "
                           "--prompt-ids 1,2,3 (token ids)")
    if args.prompt is not None and args.prompt_ids is not None:
        raise CommandError("give --prompt or --prompt-ids, not both")
    _check_sampling_flags(args, alphabet=None)
    directory = Path(args.hf)
    hf_config = read_config(directory)
    config_from_hf(hf_config)  # refuse an unsupported model before any weight
    family = checkpoint_family(hf_config)  # its own model_type, "gemma2" where the model is "gemma"
    tokenizer = _hf_tokenizer(directory)
    if args.prompt is not None:
        if tokenizer is None:
            raise CommandError(f"{directory} has no {TOKENIZER_FILE}: give the prompt as "
                               f"--prompt-ids 1,2,3")
        prompt = np.array(tokenizer.encode(args.prompt).ids, dtype=np.int64)
        if prompt.size == 0:
            raise CommandError(f"--prompt {args.prompt!r} encodes to no tokens")
    else:
        prompt = _prompt_ids(args.prompt_ids)
    model, config, params = load_checkpoint(directory, dtype=np.float32, progress=True)
    params = _for_decoding(args, params)
    n = 20 if args.max_new_tokens is None else args.max_new_tokens
    with _threads(args, params, len(prompt), n):
        start = time.perf_counter()
        out = generate(model, params, config, prompt, n, greedy=args.greedy,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed, eos_id=_eos_ids(directory, config.vocab_size),
                       cache=not args.no_cache,
                       backend=args.backend, weights=_weights(args))
        seconds = time.perf_counter() - start
    _note_context(len(out), config.max_seq_len)
    if tokenizer is not None:
        print(tokenizer.decode(out.tolist()))
    else:
        print(",".join(str(i) for i in out))
    new = len(out) - len(prompt)
    how = "recomputing every prefix" if args.no_cache else f"KV cache on {args.backend}"
    if args.weights != "f32":
        how += f", {args.weights} weights (layers and head)"
    _report_speed(new, seconds, f"a {family} checkpoint as refmath's {model} model, {how}")
    return 0
