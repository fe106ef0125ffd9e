"""``python -m refmath train``: :func:`refmath.train.train` with its settings as flags."""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from refmath._validate import check_int, check_real
from refmath.commands import CommandError
from refmath.malloc import retain_freed_memory
from refmath.models import MODELS
from refmath.train import (CHECKPOINT_FILE, CONFIG_FILE, PLOT_FILE, TrainingDiverged,
                           expert_models, recipe, train)

__all__ = ["HELP", "DESCRIPTION", "add_arguments", "run"]

HELP = "train a model with its hand-written backward pass and AdamW"
DESCRIPTION = (
    "Train a model of refmath.models.MODELS on data generated on the fly (no download), with AdamW, "
    "warmup-cosine learning rate and gradient clipping; writes checkpoints, a loss curve and a "
    "summary to --out.")


def _tasks_of_models() -> str:
    """The models of :data:`refmath.models.MODELS` grouped by the tasks their recipes learn, the
    first the default: ``"transformer: reverse; gpt, llama, ...: chars, reverse-lm"``."""
    groups: dict = {}
    for name in MODELS:
        groups.setdefault(recipe(name).tasks, []).append(name)
    return "; ".join(f"{', '.join(names)}: {', '.join(tasks)}" for tasks, names in groups.items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments: the model, task and training settings, ``--out`` and ``--resume``."""
    parser.add_argument("--model", choices=sorted(MODELS),
                        help=f"the model; the tasks each learns, its default first: "
                        f"{_tasks_of_models()} (required for a new run; to resume, --model NAME "
                        "stands for --out runs/NAME)")
    parser.add_argument("--task", choices=("chars", "reverse", "reverse-lm"),
                        help="chars: generated English (the decoders' default); reverse: digit "
                        "strings (the transformer's only task); reverse-lm: the reversal as prompt "
                        "and answer for a decoder, loss on the answer only")
    parser.add_argument("--steps", type=int, help="optimiser steps (default: the model's, 600-1000)")
    parser.add_argument("--batch-size", type=int, help="sequences per batch (default: the model's)")
    parser.add_argument("--lr", type=float, help="peak learning rate (default: the model's, 3e-3)")
    parser.add_argument("--seed", type=int, help="seed of the initialisation and the batches (default: 0)")
    parser.add_argument("--out", metavar="DIR",
                        help="run directory for config.json, checkpoint.npz, loss.png "
                        "(default: runs/<model>)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run saved in --out (its settings are kept)")
    parser.add_argument("--eval-every", type=int,
                        help="evaluate and checkpoint every N steps (default: 100; a resumed run "
                        "keeps its own)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="BLAS threads and the C++ kernels' OpenMP threads (default: BLAS's "
                        "chosen from the size of the matrix products: one for the default models, "
                        "whose small products run slower on many threads; a thread count set in "
                        "OPENBLAS_NUM_THREADS is kept; the kernels' left as they are)")
    parser.add_argument("--experts", type=int, metavar="E",
                        help=f"{', '.join(expert_models())}: make every feed-forward a mixture "
                        "of E SwiGLU experts "
                        "(a new run only); the log shows the balance loss and the busiest "
                        "expert's load")
    parser.add_argument("--top-k", type=int, default=2, metavar="K",
                        help="with --experts: experts per token (default: 2)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (it is also off when stderr is not a terminal); "
                        "without it a status line is printed every 30 s between evaluations")


def run(args: argparse.Namespace) -> int:
    """Train, then print the final losses next to the baselines; 130 if interrupted."""
    if args.out is None and args.model is None:
        raise CommandError("--resume needs the run directory: --out DIR, or --model NAME for "
                           "runs/NAME" if args.resume else
                           f"give --model, one of {', '.join(sorted(MODELS))}")
    out_dir = args.out if args.out is not None else os.path.join("runs", args.model)
    progress = not args.no_progress and sys.stderr.isatty()
    for flag, low in (("steps", 1), ("batch_size", 1), ("seed", 0), ("eval_every", 1),
                      ("threads", 1), ("experts", 1), ("top_k", 1)):
        if getattr(args, flag) is not None:
            check_int(f"--{flag.replace('_', '-')}", getattr(args, flag), low)
    if args.lr is not None:
        check_real("--lr", args.lr, 0.0, low_open=True)
    retain_freed_memory()  # a training process reuses its large temporaries: see refmath.malloc
    task = None if args.task is None else {"name": args.task}
    try:
        # NumPy's overflow warnings would bury the one line that says where a diverging run stopped
        with np.errstate(over="ignore", invalid="ignore"):
            result = train(args.model, out_dir, steps=args.steps, batch_size=args.batch_size,
                           lr=args.lr, seed=args.seed, task=task, resume=args.resume,
                           eval_every=args.eval_every, progress=progress,
                           threads=args.threads, experts=args.experts, top_k=args.top_k)
    except OSError as err:
        raise CommandError(f"cannot write the run directory {out_dir}: {err.strerror or err}"
                           f"{f' ({err.filename})' if err.filename else ''}") from None
    except TrainingDiverged as err:
        raise CommandError(str(err), status=1) from None
    except ValueError as err:
        if args.experts is None:
            raise
        raise CommandError(f"--experts: {err}") from None
    except KeyboardInterrupt:
        return 130
    print(f"\n{result.model}: {result.step} steps in {result.seconds:.1f} s (this session)")
    if result.final is not None:
        print(f"final loss (nats/token): train {result.final['train']:.4f}, "
              f"validation {result.final['val']:.4f}")
    print(f"unigram-entropy baseline: {result.unigram_entropy:.4f} nats/token "
          f"(the loss of predicting the token frequencies, ignoring the context)")
    if result.entropy_rate > 0:
        print(f"entropy rate of the generated text: {result.entropy_rate:.4f} nats/char "
              f"(the floor for an unbounded context)")
    if result.accuracy is not None:
        print(f"exact-match accuracy of greedy decoding on held-out sources: {100 * result.accuracy:.1f}%")
    plot = result.directory / PLOT_FILE
    print(f"run directory: {result.directory} ({CONFIG_FILE}, {CHECKPOINT_FILE}"
          f"{', ' + PLOT_FILE if plot.exists() else '; no plot: matplotlib is not installed'})")
    return 0
