r"""Train any model of :data:`refmath.models.MODELS` on the built-in data, with checkpoints that
resume exactly.

One training step (catalogue O4, O5, O6):

.. math::
    \ell_s = \operatorname{loss}(\theta_{s-1}; \text{batch}_{s-1}),\quad
    g = \operatorname{clip}(\nabla\ell_s, c),\quad
    \theta_s = \operatorname{AdamW}(\theta_{s-1}, g;\ \eta_s)

with ``batch`` number ``s-1`` of the task's training split (a pure function of the seed and the
index, see :mod:`refmath.data`), global-norm clipping at ``c`` and the learning rate
:math:`\eta_s` of :func:`refmath.optim.warmup_cosine` (linear warmup, cosine decay to a tenth).
AdamW decays the weight matrices only (:func:`refmath.optim.takes_weight_decay`). The parameters
live in the one flat buffer of :class:`refmath.fast.flat_adamw.FlatAdamW`, which updates them bit for
bit as :class:`refmath.optim.AdamW` does, in a few vectorised calls instead of a loop over the
tensors.

Every model of :data:`refmath.models.MODELS` comes with a recipe (its module's
``TRAINING_RECIPE``, see :func:`recipe`): a task and a default configuration small enough to learn
in a few minutes on two CPU cores in float32:

- ``transformer`` (M1) reverses digit strings (:class:`refmath.data.ReversalTask`);
- ``gpt`` (M2), ``llama`` (M3), ``mla`` (M4) model the characters of the generated English of
  :class:`refmath.data.CharLMTask`, or learn the same reversal as prompt and answer with the
  answer-only loss of supervised fine-tuning (L5, :class:`refmath.data.ReversalLMTask`, task
  ``"reverse-lm"``).

A run directory holds ``config.json`` (model, configuration, task and training settings, and the
alphabet of the task's tokenizer, written once when the run starts) and ``checkpoint.npz``
(parameters, AdamW state, step, data position, the dropout generator's state and the loss
history), rewritten every ``eval_every`` steps. Every write goes to a temporary file in the same
directory, is flushed to disk and then renamed over the old file, so a crash during a write leaves
the previous checkpoint intact. Resuming reloads all of it, so a run that stops and resumes
produces the same losses, bit for bit, as one that does not.

The matrices here are small: on a machine whose cores are busy, BLAS threads that wait for each
other can make a step several times slower. So :func:`train` chooses the BLAS threads from the
size of a step's largest product (:mod:`refmath._threads`: one thread for the default models), and
``threads`` overrides the choice.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from refmath import kernels
from refmath.models import MODELS, config_class, model_module, saved_config_fields
from refmath.models.common import TrainingRecipe
from refmath.models.decoder import expert_loads, moe_aux_loss
from refmath.moe import MoEConfig, balance_bias_update
from refmath._threads import blas_threads, choose_blas_threads, largest_product
from refmath._validate import check_field, check_int, check_real
from refmath.data import EOS_ID, CharTokenizer, ReversalLMTask, ReversalTask, make_task
from refmath.fast.flat_adamw import FlatAdamW
from refmath.inference.generate import generate, generate_seq2seq
from refmath.optim import AdamW, clip_grad_norm, warmup_cosine

__all__ = ["CONFIG_FILE", "recipe", "default_config", "expert_models", "with_experts",
           "TrainSettings", "atomic_write", "CheckpointError", "Checkpoint", "save_checkpoint",
           "load_checkpoint", "load_tokenizer",
           "evaluate", "reversal_accuracy", "save_loss_plot", "TrainResult", "TrainingDiverged",
           "train"]

FORMAT = "refmath-train/1"
CONFIG_FILE = "config.json"
CHECKPOINT_FILE = "checkpoint.npz"
PLOT_FILE = "loss.png"
EVAL_SEED = 2**31 - 1  # evaluation batches are the same for every training seed


# ---- the models and their recipes ----------------------------------------------------------------

def recipe(name: str) -> TrainingRecipe:
    """How model ``name`` (one of :data:`refmath.models.MODELS`) is trained by default: its
    module's ``TRAINING_RECIPE``."""
    return model_module(name).TRAINING_RECIPE


def default_config(name: str, task):
    """The default configuration of model ``name`` sized for ``task``'s vocabulary and lengths."""
    spec = recipe(name)
    if task.name not in spec.tasks:
        raise ValueError(f"model {name!r} learns the tasks {list(spec.tasks)}, not {task.name!r}")
    max_seq_len = task.max_len + 1 if isinstance(task, ReversalTask) else task.seq_len
    return config_class(name)(vocab_size=task.vocab_size, max_seq_len=max_seq_len, **spec.config)


def expert_models() -> tuple:
    """The models of :data:`refmath.models.MODELS` whose configuration has a ``moe`` field, so
    that :func:`with_experts` can make their feed-forwards mixtures of experts."""
    return tuple(name for name in MODELS
                 if "moe" in {f.name for f in dataclasses.fields(config_class(name))})


def with_experts(config, n_experts: int, top_k: int = 2, balance_coef: float = 0.01):
    r"""``config`` with every layer's feed-forward a mixture of ``n_experts`` SwiGLU experts
    (E1-E5), ``top_k`` of them per token.

    Each expert is :math:`d_f / k` wide (rounded up to a multiple of 8), so that a token's
    feed-forward multiplies about as many weights as the dense one did while the layer holds
    :math:`E / k` times as many; the router is a softmax whose top-k scores are renormalised
    (Mixtral's), and the expert-level balance loss is added to the loss at weight
    ``balance_coef`` (0.01, Switch Transformer's). Only the models of :func:`expert_models`
    take experts.
    """
    if "moe" not in {f.name for f in dataclasses.fields(config)}:  # a field (Phi-3's is a constant)
        raise ValueError(f"a {type(config).__name__} has no mixture-of-experts layers; experts go "
                         f"in the configurations of {', '.join(expert_models())}")
    width = -(-config.d_f // top_k)
    moe = MoEConfig(n_experts=n_experts, top_k=top_k, d_expert=-(-width // 8) * 8, norm_topk=True,
                    balance_coef=balance_coef)
    return dataclasses.replace(config, moe=moe)


# ---- settings ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainSettings:
    """Everything besides the model that decides the losses of a run (saved in ``config.json``).

    ``warmup`` defaults to a tenth of the steps, at most 100; the learning rate decays to
    ``lr * min_lr_ratio``. AdamW with ``betas`` ``(beta1, beta2)``; ``weight_decay`` on weight
    matrices only; gradients clipped to global norm ``grad_clip``. ``eval_batches`` batches of
    ``batch_size`` from each split (seed :data:`EVAL_SEED`) measure the evaluation losses, every
    ``eval_every`` steps, when the checkpoint is also written.
    """

    steps: int
    batch_size: int
    lr: float
    seed: int = 0
    warmup: int | None = None
    min_lr_ratio: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_batches: int = 8
    eval_every: int = 100

    def __post_init__(self):
        for field, low in (("steps", 1), ("batch_size", 1), ("seed", 0), ("eval_batches", 1),
                           ("eval_every", 1)):
            check_field(self, field, check_int, low)
        if self.warmup is None:
            object.__setattr__(self, "warmup", min(100, self.steps // 10))
        check_field(self, "warmup", check_int, 0, self.steps - 1)
        check_field(self, "lr", check_real, 0.0, low_open=True)
        check_field(self, "grad_clip", check_real, 0.0, low_open=True)
        check_field(self, "weight_decay", check_real, 0.0)
        check_field(self, "min_lr_ratio", check_real, 0.0, 1.0)
        for field in ("beta1", "beta2"):
            check_field(self, field, check_real, 0.0, 1.0, high_open=True)

    def lr_at(self, step: int) -> float:
        """The learning rate of optimiser step ``step`` (1-based): warmup, then cosine decay."""
        return warmup_cosine(step, self.lr, self.warmup, self.steps, self.lr * self.min_lr_ratio)


# ---- atomic files --------------------------------------------------------------------------------

def atomic_write(path, write) -> None:
    """Create or replace ``path`` with what ``write(binary_file)`` writes, all or nothing.

    The bytes go to a temporary file in the same directory (so the rename cannot cross file
    systems), are flushed and fsynced, and the file is then renamed over ``path`` with
    ``os.replace``, which is atomic: a reader sees the old file or the new one, never a mixture.
    If ``write`` raises, the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)  # read the umask (only settable), to give the usual permissions
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates files readable by their owner only
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    # Make the rename itself durable (POSIX); not possible on every platform, and not needed there.
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


# ---- checkpoints ---------------------------------------------------------------------------------

class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, truncated, corrupt, or for another model/config."""


class Checkpoint(NamedTuple):
    model: str
    config: object  # the model's configuration dataclass
    task: dict
    settings: TrainSettings
    params: dict
    optimizer: dict  # AdamW.state_dict(), which FlatAdamW.state_dict() also gives
    step: int
    data_position: int  # training batches consumed
    rng_state: dict  # the dropout Generator's bit_generator.state
    history: dict  # name -> 1-D array


HISTORY_KEYS = ("train_loss", "lr", "grad_norm", "eval_step", "eval_train", "eval_val")


def _meta(model: str, config, task, settings: TrainSettings) -> dict:
    # The tokenizer is recorded so that a reader of the run (generate, convert) need not rebuild
    # the task, which for generated English means generating its whole corpus.
    return {"format": FORMAT, "model": model, "config": dataclasses.asdict(config),
            "task": task.settings(), "tokenizer": {"alphabet": task.tokenizer.alphabet},
            "train": dataclasses.asdict(settings)}


def _json_bytes(meta: dict) -> bytes:
    return (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()


def save_checkpoint(directory, meta: dict, params: dict, optimizer: AdamW, step: int,
                    data_position: int, rng: np.random.Generator, history: dict) -> Path:
    """Atomically write ``checkpoint.npz`` in ``directory`` (``config.json`` is written once, by
    :func:`train`). The ``.npz`` embeds a copy of the JSON so the pair can be checked on load."""
    arrays = {"meta": np.array(json.dumps(meta, sort_keys=True)),
              "step": np.array(step), "data_position": np.array(data_position),
              "rng_state": np.array(json.dumps(rng.bit_generator.state))}
    arrays.update({f"params.{k}": v for k, v in params.items()})
    arrays.update({f"optim.{k}": v for k, v in optimizer.state_dict().items()})
    arrays.update({f"history.{k}": np.asarray(history[k], dtype=np.float64) for k in HISTORY_KEYS})
    path = Path(directory) / CHECKPOINT_FILE
    atomic_write(path, lambda f: np.savez(f, **arrays))
    return path


def _read_meta(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file (is {directory} a training run directory?)")
    try:
        meta = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a refmath training config (expected \"format\": "
                              f"\"{FORMAT}\")")
    missing = [k for k in ("model", "config", "task", "train") if k not in meta]
    if missing:
        raise CheckpointError(f"{path}: missing {missing}")
    if meta["model"] not in MODELS:
        raise CheckpointError(f"{path}: unknown model {meta['model']!r} (known: {sorted(MODELS)})")
    return meta


def _config_from(meta: dict, path: Path):
    try:
        config = config_class(meta["model"])(**saved_config_fields(meta["model"], meta["config"]))
        settings = TrainSettings(**meta["train"])
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: invalid configuration for model {meta['model']!r}: {err}") from None
    return config, settings


def _differences(a: dict, b: dict) -> list[str]:
    return [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def load_checkpoint(directory, model: str | None = None, config=None) -> Checkpoint:
    """Read and check a run directory's ``config.json`` and ``checkpoint.npz``.

    With ``model`` and/or ``config`` given, the checkpoint must be of that model and configuration.
    Raises :class:`CheckpointError` naming the file and what is wrong: a missing, truncated or
    corrupt file, entries missing, the two files disagreeing, parameters of other shapes than the
    configuration gives, or another model or configuration than asked for.
    """
    directory = Path(directory)
    meta = _read_meta(directory)
    config_path, path = directory / CONFIG_FILE, directory / CHECKPOINT_FILE
    saved_config, settings = _config_from(meta, config_path)
    if model is not None and model != meta["model"]:
        raise CheckpointError(f"{config_path}: the checkpoint is of model {meta['model']!r}, "
                              f"not {model!r}")
    if config is not None and config != saved_config:
        diffs = _differences(dataclasses.asdict(saved_config), dataclasses.asdict(config))
        raise CheckpointError(f"{config_path}: the checkpoint's configuration differs from the one "
                              f"given (checkpoint vs given): {'; '.join(diffs)}")
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}  # read every member now: truncation shows here
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{path}: truncated or corrupt .npz ({type(err).__name__}: {err})") from None

    required = ["meta", "step", "data_position", "rng_state", "optim.step"]
    required += [f"history.{k}" for k in HISTORY_KEYS]
    missing = [k for k in required if k not in arrays]
    if missing:
        raise CheckpointError(f"{path}: missing entries {missing}")
    try:
        embedded = json.loads(str(arrays["meta"]))
        rng_state = json.loads(str(arrays["rng_state"]))
    except ValueError as err:
        raise CheckpointError(f"{path}: unreadable metadata ({err})") from None
    if embedded != meta:
        diffs = _differences(embedded, meta)
        raise CheckpointError(f"{path} and {config_path} describe different runs: {'; '.join(diffs)}")

    module = model_module(meta["model"])
    shapes = module.param_shapes(saved_config)
    params = {k[len("params."):]: v for k, v in arrays.items() if k.startswith("params.")}
    missing = [k for k in shapes if k not in params]
    extra = sorted(set(params) - set(shapes))
    wrong = [f"{k} {params[k].shape} (config says {s})" for k, s in shapes.items()
             if k in params and params[k].shape != s]
    if missing or extra or wrong:
        raise CheckpointError(f"{path}: parameters do not match the configuration in {config_path}: "
                              f"missing {missing[:6]}, unexpected {extra[:6]}, wrong shape {wrong[:6]}")
    optimizer = {k[len("optim."):]: v for k, v in arrays.items() if k.startswith("optim.")}
    for buffer in ("m", "v"):
        names = {k[len(buffer) + 1:] for k in optimizer if k.startswith(buffer + ".")}
        if names and names != set(shapes):
            raise CheckpointError(f"{path}: the optimiser's {buffer!r} state does not cover the "
                                  f"parameters (differs in {sorted(names ^ set(shapes))[:6]})")
    for kind, arrays_of_kind in (("parameter", params), ("optimiser state", optimizer)):
        bad = [k for k, v in arrays_of_kind.items()
               if np.issubdtype(v.dtype, np.floating) and not np.isfinite(v).all()]
        if bad:
            count = f"1 {kind} array holds" if len(bad) == 1 else f"{len(bad)} {kind} arrays hold"
            raise CheckpointError(f"{path}: {count} NaN or inf (first: {bad[0]!r}); the run "
                                  f"diverged before this checkpoint was written")
    step = int(arrays["step"])
    history = {k: arrays[f"history.{k}"] for k in HISTORY_KEYS}
    if len(history["train_loss"]) != step or int(optimizer["step"]) != step:
        raise CheckpointError(f"{path}: inconsistent step counts (step {step}, optimiser "
                              f"{int(optimizer['step'])}, {len(history['train_loss'])} losses)")
    return Checkpoint(meta["model"], saved_config, meta["task"], settings, params, optimizer, step,
                      int(arrays["data_position"]), rng_state, history)


def load_tokenizer(directory) -> CharTokenizer:
    """The tokenizer of the run in ``directory``, from the alphabet its ``config.json`` records.

    A run written before ``config.json`` recorded it gets the tokenizer its task rebuilds (for
    generated English, by generating the corpus again). Raises :class:`CheckpointError` if the
    alphabet is malformed or does not give the configuration's vocabulary size.
    """
    directory = Path(directory)
    meta = _read_meta(directory)
    if "tokenizer" not in meta:
        return make_task(meta["task"]).tokenizer
    path = directory / CONFIG_FILE
    described = meta["tokenizer"]
    alphabet = described.get("alphabet") if isinstance(described, dict) else None
    try:
        tokenizer = CharTokenizer(alphabet)
    except ValueError as err:
        raise CheckpointError(f"{path}: \"tokenizer\": {err}") from None
    vocab_size = meta["config"].get("vocab_size") if isinstance(meta["config"], dict) else None
    if tokenizer.vocab_size != vocab_size:
        raise CheckpointError(f"{path}: the tokenizer's {tokenizer.vocab_size} ids do not match "
                              f"the configuration's vocab_size {vocab_size}")
    return tokenizer


# ---- evaluation ----------------------------------------------------------------------------------

def evaluate(module, params, config, task, n_batches: int, batch_size: int) -> dict[str, float]:
    """Mean cross-entropy (eval mode, no dropout) over ``n_batches`` fixed batches of each split
    (a mixture of experts' auxiliary losses left out)."""
    out = {}
    experts = getattr(config, "moe", None) is not None
    for split in ("train", "val"):
        losses = []
        for i in range(n_batches):
            loss, cache = module.forward(params, task.batch(split, i, batch_size, EVAL_SEED), config)
            losses.append(float(loss) - (moe_aux_loss(cache) if experts else 0.0))
        out[split] = float(np.mean(losses))
    return out


def reversal_accuracy(params, config, task, n_examples: int = 500, batch_size: int = 100,
                      model: str | None = None) -> float:
    """Fraction of held-out sources whose greedy decoding is exactly the reversed digits + EOS.

    ``task`` is a :class:`~refmath.data.ReversalTask` (the encoder-decoder) or a
    :class:`~refmath.data.ReversalLMTask` (a decoder-only ``model`` continues ``<bos> x =``).
    """
    correct = 0
    for index in range(-(-n_examples // batch_size)):
        sources = task.source.examples if isinstance(task, ReversalLMTask) else task.examples
        batch = sources("val", index, min(batch_size, n_examples - index * batch_size), EVAL_SEED)
        outputs = {}
        if isinstance(task, ReversalLMTask):
            for n in sorted({len(s) for s in batch}):  # one batch per prompt length
                group = [s for s in batch if len(s) == n]
                prompts = np.stack([task.prompt_ids(s) for s in group])
                out = generate(model, params, config, prompts, n + 1, greedy=True, eos_id=EOS_ID)
                outputs.update(zip(group, out[:, n + 2:]))
        else:
            src, lengths = task.encode_sources(batch)
            outputs.update(zip(batch, generate_seq2seq(params, config, src, task.max_len + 1,
                                                       src_lengths=lengths, greedy=True,
                                                       eos_id=EOS_ID)))
        for source in batch:
            expected = np.append(task.tokenizer.encode(source[::-1]), EOS_ID)
            got = outputs[source]
            correct += len(got) >= len(expected) and np.array_equal(got[:len(expected)], expected)
    return correct / n_examples


def save_loss_plot(path, history: dict, baseline: float, floor: float | None = None,
                   title: str = "") -> None:
    """Save the training loss per step and the evaluation losses as a PNG (needs matplotlib).

    matplotlib is imported here, with the Agg canvas and no pyplot, so training never needs it.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    steps = np.arange(1, len(history["train_loss"]) + 1)
    ax.plot(steps, history["train_loss"], lw=0.8, alpha=0.6, label="training batch loss")
    ax.plot(history["eval_step"], history["eval_train"], "o-", label="train (eval)")
    ax.plot(history["eval_step"], history["eval_val"], "s-", label="validation (eval)")
    ax.axhline(baseline, color="gray", ls="--", label=f"unigram entropy {baseline:.3f}")
    if floor is not None:
        ax.axhline(floor, color="black", ls=":", label=f"loss floor (entropy rate of the data) {floor:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


# ---- the training loop ---------------------------------------------------------------------------

class TrainResult(NamedTuple):
    model: str
    step: int
    history: dict  # name -> 1-D array (see HISTORY_KEYS)
    final: dict | None  # {"train": loss, "val": loss} at the last step, None if stopped early
    unigram_entropy: float
    entropy_rate: float
    accuracy: float | None  # exact match of greedy decoding (transformer only, at the end)
    seconds: float
    directory: Path


@dataclass
class _Run:
    """Everything a training loop changes or reads, as a fresh start or a checkpoint gives it."""

    model: str
    module: object
    config: object
    task: object
    settings: TrainSettings
    params: dict
    optimizer: AdamW
    rng: np.random.Generator  # draws the dropout masks
    step: int
    data_position: int
    history: dict  # name -> list
    meta: dict  # the content of config.json
    experts: tuple | None = None  # the last step's auxiliary loss and expert loads, with experts


def _adamw(settings: TrainSettings, params: dict) -> AdamW:
    """The run's optimiser; from here on ``params`` holds views into its flat buffer."""
    return FlatAdamW(params, settings.lr, (settings.beta1, settings.beta2),
                     weight_decay=settings.weight_decay)


def _check_same(name: str, given, saved, path: Path) -> None:
    if given is not None and given != saved:
        raise CheckpointError(f"{path}: --{name.replace('_', '-')} {given} differs from the "
                              f"run's {saved}; a resumed run keeps its settings")


def _resume_run(directory: Path, model, config, task, given: dict) -> _Run:
    ckpt = load_checkpoint(directory, model=model, config=config)
    config_path = directory / CONFIG_FILE
    if task is not None and any(ckpt.task.get(k) != v for k, v in task.items()):
        raise CheckpointError(f"{config_path}: task {task} differs from the run's {ckpt.task}")
    for name, value in given.items():
        _check_same(name, value, getattr(ckpt.settings, name), config_path)
    optimizer = _adamw(ckpt.settings, ckpt.params)
    optimizer.load_state_dict(ckpt.optimizer)
    rng = np.random.default_rng()
    rng.bit_generator.state = ckpt.rng_state
    return _Run(ckpt.model, model_module(ckpt.model), ckpt.config, make_task(ckpt.task),
                ckpt.settings, ckpt.params, optimizer, rng, ckpt.step, ckpt.data_position,
                {k: list(v) for k, v in ckpt.history.items()}, _read_meta(directory))


def _fresh_run(directory: Path, model, config, task, given: dict) -> _Run:
    if model is None:
        raise ValueError(f"give the model to train, one of {sorted(MODELS)}")
    spec = recipe(model)
    if (directory / CHECKPOINT_FILE).exists() or (directory / CONFIG_FILE).exists():
        raise CheckpointError(f"{directory} already holds a run; resume it or choose another "
                              f"output directory")
    task = spec.task if task is None else task
    if task.get("name") not in spec.tasks:
        raise ValueError(f"model {model!r} learns the tasks {list(spec.tasks)}, not {task.get('name')!r}")
    the_task = make_task(task)
    config = default_config(model, the_task) if config is None else config
    if not isinstance(config, config_class(model)):
        raise TypeError(f"config must be a {config_class(model).__name__} for model {model!r}, "
                        f"got {type(config).__name__}")
    if config.vocab_size != the_task.vocab_size:
        raise ValueError(f"config.vocab_size = {config.vocab_size} must equal the task's "
                         f"vocabulary size {the_task.vocab_size}")
    defaults = {"steps": spec.steps, "batch_size": spec.batch_size, "lr": spec.lr, "seed": 0,
                "eval_every": TrainSettings.eval_every}
    settings = TrainSettings(**{k: v if given[k] is None else given[k] for k, v in defaults.items()})
    module = model_module(model)
    params = module.init_params(config, settings.seed, dtype=np.float32)
    rng = np.random.default_rng((settings.seed, 1))  # dropout masks; the batches have their own
    meta = _meta(model, config, the_task, settings)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / CONFIG_FILE, lambda f: f.write(_json_bytes(meta)))
    return _Run(model, module, config, the_task, settings, params, _adamw(settings, params), rng,
                0, 0, {k: [] for k in HISTORY_KEYS}, meta)


class TrainingDiverged(RuntimeError):
    """A loss, gradient norm or parameter became NaN or infinite; the run stopped before using it."""


def _train_step(run: _Run) -> float:
    """One optimiser step on the next training batch; returns the batch's cross-entropy (the loss
    it minimised, less a mixture of experts' auxiliary losses, which the log shows apart).

    Raises :class:`TrainingDiverged`, before anything is updated, if the loss or the gradient norm
    is not finite: one NaN step would make every parameter NaN.
    """
    batch = run.task.batch("train", run.data_position, run.settings.batch_size, run.settings.seed)
    loss, cache = run.module.forward(run.params, batch, run.config, train=True, rng=run.rng)
    grads = run.module.backward(cache)
    norm = clip_grad_norm(grads, run.settings.grad_clip)
    lr = run.settings.lr_at(run.step + 1)
    for quantity, value in (("training loss", float(loss)), ("gradient norm", norm)):
        if not math.isfinite(value):
            raise TrainingDiverged(f"step {run.step + 1}: the {quantity} is {value} at learning "
                                   f"rate {lr:.3g}")
    run.optimizer.step(run.params, grads, lr)
    if getattr(run.config, "moe", None) is not None:
        _balance_experts(run, cache)
    run.step, run.data_position = run.step + 1, run.data_position + 1
    cross_entropy = float(loss) - (run.experts[0] if run.experts is not None else 0.0)
    for key, value in (("train_loss", cross_entropy), ("lr", lr), ("grad_norm", norm)):
        run.history[key].append(value)
    return cross_entropy


def _balance_experts(run: _Run, cache) -> None:
    """After a step of a model with experts: keep its auxiliary loss and loads for the log, and
    move DeepSeek-V3's selection biases against the loads (E6, ``moe.bias_speed``), in place."""
    loads = expert_loads(cache)
    run.experts = (moe_aux_loss(cache), loads)
    moe = run.config.moe
    if moe.score_bias and moe.bias_speed:
        for layer, load in loads.items():
            bias = run.params[f"layers.{layer}.ffn.router.bias"]
            bias[...] = balance_bias_update(bias, load, moe.bias_speed)


def _experts_line(run: _Run) -> str:
    """The log's word on the experts: the auxiliary loss and the busiest expert's load against
    the mean, over the last step's MoE layers."""
    if run.experts is None or not run.experts[1]:  # no layer is a mixture of experts
        return ""
    aux, loads = run.experts
    busiest = max(float(load.max() / load.mean()) for load in loads.values())
    return f"  aux {aux:.4f}  busiest expert {busiest:.2f}x the mean load"


@contextlib.contextmanager
def _finish_step_on_interrupt():
    """While active, Ctrl-C (SIGINT) only raises a flag, so the loop can stop between two steps
    (a step interrupted halfway would leave parameters half updated). A second Ctrl-C interrupts
    at once, as usual. Outside the main thread signals cannot be caught: Ctrl-C acts as usual."""
    requested: list = []
    try:
        previous = signal.getsignal(signal.SIGINT)

        def handler(signum, frame):
            requested.append(signum)
            signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGINT, handler)
    except ValueError:
        yield requested
        return
    try:
        yield requested
    finally:
        signal.signal(signal.SIGINT, previous)


def _thread_limits(blas: int | None, kernel_threads: int | None) -> contextlib.ExitStack:
    """BLAS's threads (``blas``, None: as they are) and the C++ kernels' OpenMP threads
    (``kernel_threads``, None: as they are) for the length of a ``with`` block."""
    stack = contextlib.ExitStack()
    stack.enter_context(blas_threads(blas))
    stack.enter_context(kernels.cpu_thread_limit(kernel_threads))
    return stack


def train(model: str | None, out_dir, *, steps: int | None = None, batch_size: int | None = None,
          lr: float | None = None, seed: int | None = None, config=None, task: dict | None = None,
          resume: bool = False, eval_every: int | None = None, progress: bool = False,
          stop_after: int | None = None, accuracy_examples: int = 500, out=None,
          threads: int | None = None, status_every: float = 30.0, experts: int | None = None,
          top_k: int = 2) -> TrainResult:
    """Train ``model`` in run directory ``out_dir`` (created if needed); see the module docstring.

    Fresh run: ``config`` (default :func:`default_config`) and ``task`` settings (default the
    model's) may be overridden; ``steps``, ``batch_size``, ``lr`` default to the model's,
    ``seed`` to 0 and ``eval_every`` to 100. The directory must not already hold a run.

    ``resume=True`` continues the run saved in ``out_dir``: the model, configuration, task and
    settings come from there, and any given here must agree with them.

    Evaluates and checkpoints every ``eval_every`` steps and at the end; ``stop_after`` stops (with
    a checkpoint) once that many steps are done, as an interruption would. Ctrl-C finishes the
    current step, saves a checkpoint and raises ``KeyboardInterrupt``. ``progress`` shows a tqdm
    bar on stderr; the evaluation lines go to ``out`` (default stdout). Without the bar a status
    line (step, loss, seconds) goes there too once ``status_every`` seconds have passed since the
    last line, so a run whose output is a file or a pipe is never silent for long. A resumed run
    says the step it resumes from.

    ``threads``: BLAS threads for the run (default: chosen by
    :func:`refmath._threads.choose_blas_threads` from the largest product of a step, batch rows
    times the widest weight matrix), and the C++ kernels' OpenMP threads too (the FlashAttention
    kernel of ``attention_backend="cpu"``; :func:`refmath.kernels.cpu_thread_limit`, restored when
    the run returns), as ``generate --threads`` sets both. Default: the kernels'
    count is left as it is.

    ``experts`` (a fresh ``llama`` or ``mla`` run): every feed-forward a mixture of that many
    experts, ``top_k`` per token (:func:`with_experts`); the log shows the auxiliary loss and how
    far the busiest expert's load is above the mean.
    """
    out = sys.stdout if out is None else out
    if threads is not None:
        check_int("threads", threads, 1)
    status_every = check_real("status_every", status_every, 0.0)
    directory = Path(out_dir)
    given = {"steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed,
             "eval_every": eval_every}
    if experts is not None:
        check_int("experts", experts, 1)
        if resume:
            raise ValueError("experts: a resumed run keeps the configuration it was started with")
        if model is None:
            raise ValueError(f"give the model to train, one of {sorted(MODELS)}")
        if config is None:
            config = default_config(model, make_task(recipe(model).task if task is None else task))
        config = with_experts(config, experts, check_int("top_k", top_k, 1))
    run = (_resume_run if resume else _fresh_run)(directory, model, config, task, given)
    settings = run.settings
    eval_every = settings.eval_every
    baseline, floor = run.task.unigram_entropy(), run.task.entropy_rate()
    last = settings.steps if stop_after is None else min(settings.steps, stop_after)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=settings.steps, initial=run.step, desc=run.model, dynamic_ncols=True,
                   file=sys.stderr)
    say = bar.write if bar is not None else (lambda line: print(line, file=out, flush=True))
    if resume and run.step < settings.steps:
        say(f"resuming the run in {directory} at step {run.step} of {settings.steps}")
    if run.step == settings.steps:
        say(f"the run in {directory} finished at step {run.step} of {settings.steps}: "
            f"nothing left to do")

    saved_step = run.step if resume else None  # the step of the checkpoint on disk, if any

    def save():
        nonlocal saved_step
        bad = [name for name, p in run.params.items() if not np.isfinite(p).all()]
        if bad:
            raise TrainingDiverged(f"step {run.step}: {len(bad)} parameters hold NaN or inf "
                                   f"(first: {bad[0]!r}) at learning rate {run.history['lr'][-1]:.3g}")
        save_checkpoint(directory, run.meta, run.params, run.optimizer, run.step, run.data_position,
                        run.rng, {k: np.asarray(v) for k, v in run.history.items()})
        saved_step = run.step

    rows = settings.batch_size * run.config.max_seq_len
    chosen = choose_blas_threads(largest_product(rows, run.params), threads)
    pool = _thread_limits(chosen, threads)
    start = time.perf_counter()
    last_line = start
    try:
        with pool, _finish_step_on_interrupt() as interrupted:
            while run.step < last and not interrupted:
                loss = _train_step(run)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.3f}")
                elif time.perf_counter() - last_line >= status_every and run.step % eval_every:
                    say(f"step {run.step:>6} of {settings.steps}  loss {loss:.4f}  "
                        f"({time.perf_counter() - start:.0f} s)")
                    last_line = time.perf_counter()
                if run.step % eval_every == 0 or run.step == settings.steps:
                    losses = evaluate(run.module, run.params, run.config, run.task,
                                      settings.eval_batches, settings.batch_size)
                    for key, value in losses.items():
                        if not math.isfinite(value):
                            raise TrainingDiverged(f"step {run.step}: the {key} evaluation loss "
                                                   f"is {value}")
                    for key in ("train", "val"):
                        run.history[f"eval_{key}"].append(losses[key])
                    run.history["eval_step"].append(run.step)
                    say(f"step {run.step:>6}  lr {run.history['lr'][-1]:.2e}  "
                        f"train {losses['train']:.4f}  val {losses['val']:.4f}  "
                        f"(unigram entropy {baseline:.4f}){_experts_line(run)}")
                    last_line = time.perf_counter()
                    save()
        if run.step % eval_every and run.step != settings.steps:
            save()  # stopped between two evaluations
        if interrupted:
            say(f"interrupted after step {run.step}: checkpoint saved in {directory}; "
                f"resume to continue")
            raise KeyboardInterrupt
    except TrainingDiverged as err:
        kept = (f"the checkpoint of step {saved_step} in {directory} is untouched"
                if saved_step is not None else "no checkpoint was written")
        raise TrainingDiverged(f"{err}. Training stopped; {kept}. A smaller --lr may help.") from None
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - start

    history = {k: np.asarray(v) for k, v in run.history.items()}
    done = run.step == settings.steps
    final = None
    if done and len(history["eval_step"]):
        final = {"train": float(history["eval_train"][-1]), "val": float(history["eval_val"][-1])}
    accuracy = None
    if done and isinstance(run.task, (ReversalTask, ReversalLMTask)) and accuracy_examples:
        with _thread_limits(chosen, threads):
            accuracy = reversal_accuracy(run.params, run.config, run.task, accuracy_examples,
                                         model=run.model)
    with contextlib.suppress(ImportError):
        save_loss_plot(directory / PLOT_FILE, history, baseline, floor,
                       title=f"{run.model} on {run.task.name}")
    return TrainResult(run.model, run.step, history, final, baseline, floor, accuracy, seconds,
                       directory)
