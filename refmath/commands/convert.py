"""``python -m refmath convert --to-hf RUN_DIR OUT_DIR``: a run directory of ``train`` written as
a Hugging Face model directory (:func:`refmath.hf.save_checkpoint`).

Nothing is half-written: the packages it needs are checked before anything is read or written, and
the files go into a hidden folder beside OUT_DIR that becomes OUT_DIR only once every file is in
it. A failure or Ctrl-C part way removes that folder, so a retry finds OUT_DIR as it was.
"""
from __future__ import annotations

import argparse
import importlib
import os
import secrets
import shutil
from pathlib import Path

from refmath.commands import CommandError
from refmath.models import MODELS, model_module

__all__ = ["HELP", "DESCRIPTION", "add_arguments", "run"]

HELP = "write a trained model as a Hugging Face model directory"
DESCRIPTION = (
    "Write the model of a 'train' run directory as a Hugging Face model directory (config.json "
    "and model.safetensors) that transformers loads, as the Hugging Face model type its "
    "configuration computes; the models written are those of refmath.models.MODELS with such a "
    f"type: {', '.join(name for name in MODELS if model_module(name).HF_MODEL_TYPES)}. Needs the "
    "safetensors and tokenizers packages: pip install 'refmath[hf]'.")

NEEDS = ("safetensors", "tokenizers")  # the weights file and tokenizer.json: the `hf` extra


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments: ``--to-hf RUN_DIR OUT_DIR``."""
    parser.add_argument("--to-hf", nargs=2, metavar=("RUN_DIR", "OUT_DIR"), required=True,
                        help="write the model of a 'train' run directory as a Hugging Face model "
                        "directory (config.json, model.safetensors and the run's character "
                        "tokenizer as tokenizer.json); OUT_DIR must be new or empty")
    parser.add_argument("--dtype", choices=("f32", "bf16", "f16"), default="f32",
                        help="the tensors' dtype: float32 as trained, or rounded to bfloat16 or "
                        "float16 (to nearest, ties to even; half the bytes) (default: f32)")


def _missing_packages() -> list[str]:
    missing = []
    for name in NEEDS:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def run(args: argparse.Namespace) -> int:
    """Write OUT_DIR and say what it holds."""
    from refmath.hf import TOKENIZER_FILE, save_checkpoint, save_tokenizer
    from refmath.train import load_checkpoint, load_tokenizer

    run_dir, out_dir = (Path(p) for p in args.to_hf)
    missing = _missing_packages()
    if missing:
        raise CommandError(f"convert needs the {' and '.join(missing)} package"
                           f"{'s' if len(missing) > 1 else ''}: pip install 'refmath[hf]'")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise CommandError(f"{out_dir} exists and is not an empty folder: choose a new OUT_DIR")
    ckpt, tokenizer = load_checkpoint(run_dir), load_tokenizer(run_dir)

    # Same parent, so the final rename stays on one file system (and is atomic there).
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = out_dir.parent / f".{out_dir.name}.partial-{secrets.token_hex(4)}"
    partial.mkdir()
    try:
        save_checkpoint(partial, ckpt.model, ckpt.config, ckpt.params,
                        dtype=None if args.dtype == "f32" else args.dtype)
        save_tokenizer(partial, tokenizer)
        os.replace(partial, out_dir)  # replaces an empty OUT_DIR too
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    print(f"{run_dir} ({ckpt.model}, step {ckpt.step}) -> {out_dir} (config.json, "
          f"model.safetensors, {TOKENIZER_FILE})")
    return 0
