"""``python -m refmath convert --to-hf RUN_DIR OUT_DIR``: a run directory of ``train`` written as
a Hugging Face model directory (:func:`refmath.hf.save_checkpoint`)."""
from __future__ import annotations

import argparse
from pathlib import Path

from refmath.commands import CommandError

HELP = "write a trained model as a Hugging Face model directory"
DESCRIPTION = (
    "Write the model of a 'train' run directory as a Hugging Face model directory (config.json "
    "and model.safetensors) that transformers loads: GPT as gpt2 or openai-gpt, the modern "
    "decoder as llama, MLA as a dense deepseek_v3. Needs the safetensors package.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments: ``--to-hf RUN_DIR OUT_DIR``."""
    parser.add_argument("--to-hf", nargs=2, metavar=("RUN_DIR", "OUT_DIR"), required=True,
                        help="write the model of a 'train' run directory as a Hugging Face model "
                        "directory (config.json, model.safetensors and the run's character "
                        "tokenizer as tokenizer.json); OUT_DIR must not already hold a config.json")


def run(args: argparse.Namespace) -> int:
    """Write OUT_DIR and say what it holds."""
    from refmath.hf import CONFIG_FILE, TOKENIZER_FILE, save_checkpoint, save_tokenizer
    from refmath.train import load_checkpoint, load_tokenizer

    run_dir, out_dir = (Path(p) for p in args.to_hf)
    try:
        if (out_dir / CONFIG_FILE).exists():
            raise CommandError(f"{out_dir / CONFIG_FILE} exists: choose an empty OUT_DIR")
        ckpt, tokenizer = load_checkpoint(run_dir), load_tokenizer(run_dir)
        save_checkpoint(out_dir, ckpt.model, ckpt.config, ckpt.params)
        save_tokenizer(out_dir, tokenizer)
    except ImportError as err:  # safetensors or tokenizers missing
        raise CommandError(str(err)) from None
    print(f"{run_dir} ({ckpt.model}, step {ckpt.step}) -> {out_dir} (config.json, "
          f"model.safetensors, {TOKENIZER_FILE})")
    return 0
