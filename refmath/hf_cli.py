"""The command line's side of Hugging Face checkpoints: ``generate --hf DIR`` and
``convert --to-hf RUN_DIR OUT_DIR`` (``sizes --hf DIR`` lives with the other sizes, in
:mod:`refmath.sizing`)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from refmath.hf import TOKENIZER_FILE


def _prompt_ids(text: str) -> np.ndarray:
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers such as 1,2,3, got "
                         f"{text!r}") from None
    return np.array(ids, dtype=np.int64)


def _tokenizer(directory: Path):
    """The directory's ``tokenizer.json`` through the ``tokenizers`` package, or None if there is
    no such file."""
    path = directory / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(f"{path} needs the tokenizers package: pip install 'refmath[hf]' (or "
                         f"give --prompt-ids)") from None
    return Tokenizer.from_file(str(path))


def _eos_id(directory: Path):
    """The config's end-of-sequence id when it names exactly one."""
    from refmath.hf import read_config

    eos = read_config(directory).get("eos_token_id")
    if isinstance(eos, list) and len(eos) == 1:
        eos = eos[0]
    return eos if isinstance(eos, int) else None


def run_generate_hf(args: argparse.Namespace) -> int:
    """``generate --hf DIR``: print the prompt and its continuation; 2 on bad input or a
    checkpoint refmath does not load (one line on stderr)."""
    from refmath.hf import config_from_hf, load_checkpoint, read_config
    from refmath.inference.generate import generate
    from refmath.train import _check_generate_flags

    try:
        if (args.prompt is None) == (args.prompt_ids is None):
            raise ValueError("give --prompt (text, needs DIR/tokenizer.json) or --prompt-ids "
                             "(comma-separated token ids), not both")
        _check_generate_flags(args, alphabet=None)
        directory = Path(args.hf)
        config_from_hf(read_config(directory))  # refuse an unsupported model before any weight
        tokenizer = _tokenizer(directory)
        if args.prompt is not None:
            if tokenizer is None:
                raise ValueError(f"{directory} has no {TOKENIZER_FILE}: give the prompt as "
                                 f"--prompt-ids 1,2,3")
            prompt = np.array(tokenizer.encode(args.prompt).ids, dtype=np.int64)
            if prompt.size == 0:
                raise ValueError(f"--prompt {args.prompt!r} encodes to no tokens")
        else:
            prompt = _prompt_ids(args.prompt_ids)
        model, config, params = load_checkpoint(directory, dtype=np.float32, progress=True)
        n = 20 if args.max_new_tokens is None else args.max_new_tokens
        start = time.perf_counter()
        out = generate(model, params, config, prompt, n, greedy=args.greedy,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed, eos_id=_eos_id(directory), cache=not args.no_cache,
                       backend=args.backend)
        seconds = time.perf_counter() - start
    except (ValueError, TypeError) as err:
        print(f"generate: {err}", file=sys.stderr)
        return 2
    if tokenizer is not None:
        print(tokenizer.decode(out.tolist()))
    else:
        print(",".join(str(i) for i in out))
    new = len(out) - len(prompt)
    how = "recomputing every prefix" if args.no_cache else f"KV cache on {args.backend}"
    print(f"({new} tokens in {seconds:.2f} s: {new / seconds:.0f} tokens/s; {model} model, "
          f"{how})", file=sys.stderr)
    return 0


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``convert`` options to ``parser`` and set ``run=run_convert``."""
    parser.add_argument("--to-hf", nargs=2, metavar=("RUN_DIR", "OUT_DIR"), required=True,
                        help="write the model of a 'train' run directory as a Hugging Face model "
                        "directory (config.json, model.safetensors and the run's character "
                        "tokenizer as tokenizer.json); OUT_DIR must not already hold a config.json")
    parser.set_defaults(run=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    """``convert --to-hf RUN_DIR OUT_DIR``; 2 (one line on stderr) when it cannot."""
    from refmath.data import make_task
    from refmath.hf import CONFIG_FILE, save_checkpoint, save_tokenizer
    from refmath.train import load_checkpoint

    run_dir, out_dir = (Path(p) for p in args.to_hf)
    try:
        if (out_dir / CONFIG_FILE).exists():
            raise ValueError(f"{out_dir / CONFIG_FILE} exists: choose an empty OUT_DIR")
        ckpt = load_checkpoint(run_dir)
        save_checkpoint(out_dir, ckpt.model, ckpt.config, ckpt.params)
        save_tokenizer(out_dir, make_task(ckpt.task).tokenizer)
    except (ValueError, TypeError, ImportError) as err:
        print(f"convert: {err}", file=sys.stderr)
        return 2
    print(f"{run_dir} ({ckpt.model}, step {ckpt.step}) -> {out_dir} (config.json, "
          f"model.safetensors, {TOKENIZER_FILE})")
    return 0
