r"""Lesson 7, GPT, a decoder on its own (``notebooks/07_gpt.py``): the expected value and the known
slips of each exercise, computed from the library and from the lesson's inputs."""
from __future__ import annotations

import math

import numpy as np

from refmath.lessons.checks import catalogued
from refmath.lessons.expected.lesson05_losses_and_optimisers import adamw_slips
from refmath.lessons.table import exercise, flat_parameters, function_exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; nothing here is called by name.
__all__ = []


@exercise("07.5", "(inputs, targets)", "the section 'The prefix is the conditioning: tasks, "
          "instructions, preferences'",
          "a row takes context + 1 tokens of the stream from its start: the inputs are its first "
          "context tokens, the targets its last context tokens (CharLMTask.batch)",
          uses=("stream", "starts", "context"), rtol=0.0)
def _shifted_pair(stream, starts, context):
    stream, starts = np.asarray(stream), np.asarray(starts)[:, None]

    def window(offset, length=context):
        """The ``length`` tokens of the stream from each start plus ``offset``."""
        return stream[starts + offset + np.arange(length)]
    # CharLMTask.batch's windows of context + 1 tokens, split as it splits them
    windows = window(0, context + 1)
    return (windows[:, :-1], windows[:, 1:]), {
        "shifted the wrong way: the targets come before the inputs": (window(1), window(0)),
        "not shifted: the targets are the inputs, so each position is scored on its own token":
            (window(0), window(0)),
        "the targets one token back: position t is scored on the token after its own, not before":
            (window(0), window(-1)),
        "the targets two tokens ahead: the next token is one position on":
            (window(0), window(2)),
        "rows of context tokens with the targets shifted inside them: the first inputs repeat as "
        "targets, and the last target is missing (filled with the last input)":
            (window(0), np.concatenate([window(1, context - 1), window(context - 1, 1)], axis=1)),
        "the starts read as 1-based: a start is an index into the stream, counted from 0":
            (window(-1), window(0))}


_N11 = "the section 'N11: initialisation, std 0.02 and residual projections scaled by $1/\\sqrt{2L}$'"
_SFT = "the section 'The prefix is the conditioning: tasks, instructions, preferences'"


@exercise("07.1", "dP", "the section 'N9: learned absolute positions'",
          "row offset + t gets the batch sum of dy[:, t]", uses=("dy", "pos_cache"), rtol=0.0)
def _position_table_gradient(dy, cache):
    from refmath.positions import learned_positions_backward

    def d_table():
        return learned_positions_backward(dy, cache)[1]
    return d_table(), {
        **catalogued("learned positions: table gradient averaged over the batch", d_table),
        **catalogued("learned positions: offset ignored", d_table)}


def _count(shapes) -> int:
    return sum(math.prod(shape) for shape in shapes.values())


@exercise("07.2", "GPT-2 small parameters", "the section 'M2: GPT, Post-LN (GPT-1) and Pre-LN "
          "(GPT-2)'", "per layer 12 d^2 + 13 d", rtol=0.0)
def _gpt2_small_parameters():
    from refmath.models import gpt

    config = gpt.GPT_CONFIGS["gpt2-small"]
    total, d = _count(gpt.param_shapes(config)), config.d_model
    return total, {"the position table forgotten (T_ctx d)": total - config.max_seq_len * d,
                   "the final LayerNorm forgotten (2 d)": total - 2 * d,
                   "an untied output matrix counted (V d more: GPT-2 reuses E)":
                       total + config.vocab_size * d}


@exercise("07.3a", "prescribed std", _N11, "0.02 / sqrt(2 L): two residual writers per layer",
          uses=("config4",))
def _prescribed_std(config):
    layers = config.n_layers
    return 0.02 / math.sqrt(2 * layers), {
        "0.02 / sqrt(L): each layer has two residual writers, attention and the FFN":
            0.02 / math.sqrt(layers),
        "0.02, unscaled: w_o writes into the residual stream": 0.02}


@exercise("07.3b", "measured std of w_o", _N11,
          "params4[f'layers.{i}.attn.w_o'].std() for each layer i, then their mean",
          uses=("params4", "config4"))
def _measured_std(params, config):
    stds = [float(np.std(params[f"layers.{i}.attn.w_o"])) for i in range(config.n_layers)]
    return float(np.mean(stds)), {
        "the rule's std, not the one measured on params4": 0.02 / math.sqrt(2 * config.n_layers),
        "layer 0's std only, not the mean over the layers": stds[0]}


@exercise("07.4", "mean of the prefix losses", "the section 'L6: one masked pass scores every "
          "prefix'", "loss_mask 1 on the last of the n positions only, then the mean over n",
          uses=("params", "batch", "gpt_config"), rtol=1e-13)
def _mean_of_prefixes(params, batch, config):
    from refmath.models import gpt

    # the slip: each prefix scored on all its positions (no loss mask), then those means averaged
    unmasked = [float(gpt.forward(params, {"tokens": batch["tokens"][:, :n],
                                           "targets": batch["targets"][:, :n]}, config)[0])
                for n in range(1, np.shape(batch["tokens"])[1] + 1)]
    return float(gpt.forward(params, batch, config)[0]), {
        "no loss mask: each prefix's loss is the mean over all its positions, so the early "
        "positions count again in every longer prefix": float(np.mean(unmasked))}


def _sft_mask(batch, first: int) -> np.ndarray:
    mask = np.zeros(np.shape(batch["tokens"]), dtype=int)
    mask[:, first:] = 1
    return mask


@exercise("07.6a", "the SFT loss", _SFT,
          "the first answer token is the target of the question's last position",
          uses=("params", "sft_batch", "gpt_config", "q_ids"))
def _gpt_sft_loss(params, batch, config, q_ids):
    from refmath.models import gpt

    def loss(first, summed=True):
        mask = _sft_mask(batch, first)
        mean = float(gpt.forward(params, {**batch, "loss_mask": mask}, config)[0])
        return mean * mask.sum() if summed else mean
    first = len(q_ids) - 1
    return loss(first), {
        "the question's tokens counted too (the plain language-model loss)":
            float(gpt.forward(params, batch, config)[0]),
        "the first answer token left out (the mask starts one position late)": loss(first + 1),
        "the mean over the answer, not the sum (gpt.forward's reduction)":
            loss(first, summed=False)}


@exercise("07.6b", "answer_mask", _SFT,
          "1 on the positions whose target is an answer token, 0 elsewhere",
          uses=("sft_batch", "q_ids"), rtol=0.0)
def _gpt_answer_mask(batch, q_ids):
    first = len(q_ids) - 1
    return _sft_mask(batch, first), {
        "the mask starts one position late: the question's last position predicts the first "
        "answer token": _sft_mask(batch, first + 1),
        "the question's positions marked, not the answer's": 1 - _sft_mask(batch, first)}


@exercise("07.7", "parameters after one AdamW step", "the section 'O5: which parameters take "
          "weight decay'", "a decayed parameter is multiplied by 1 - lr lambda, the others kept",
          uses=("before",), rtol=1e-15, prepare=flat_parameters)
def _after_one_adamw_step(before):
    from refmath.optim import AdamW, takes_weight_decay

    stepped = {name: np.array(value, dtype=np.float64) for name, value in before.items()}
    AdamW(lr=0.1, weight_decay=0.5).step(stepped, {n: np.zeros_like(v) for n, v in stepped.items()})
    return flat_parameters(stepped), {
        "every parameter decayed, biases, norms and embeddings too":
            flat_parameters(before) * (1 - 0.1 * 0.5),
        "the decay not scaled by the learning rate: 1 - lambda":
            flat_parameters({n: v * (1 - 0.5 if takes_weight_decay(n) else 1.0)
                              for n, v in before.items()})}


# The write-the-function exercise ----------------------------------------------------------

def _adamw_inputs():
    draw = np.random.default_rng(7)
    scales = np.array([1e-4, 1e-2, 1.0, 3.0, 0.1, 1e-3])
    inputs = []
    for name, s in (("layers.0.attn.w_q", 1), ("layers.0.attn.w_q", 5), ("layers.1.ln1.gamma", 3),
                    ("tok_emb", 2), ("layers.1.ffn.b1", 4)):
        g = scales * draw.standard_normal(6)
        m = 0.0 if s == 1 else 0.5 * scales * draw.standard_normal(6)
        v = 0.0 if s == 1 else (scales * draw.standard_normal(6)) ** 2
        inputs.append((name, draw.standard_normal(6), g, np.zeros(6) + m, np.zeros(6) + v, s))
    return inputs


@function_exercise("07.8", "your AdamW step", "the section 'O5: which parameters take weight decay'",
                   "bias-correct both moments with beta^s; decay (1 - lr wd) only where "
                   "takes_weight_decay says so", uses=("LR", "BETAS", "EPS", "WD"))
def _gpt_adamw_step(LR, BETAS, EPS, WD):
    from refmath.optim import AdamW, takes_weight_decay

    def library_adamw_step(name, theta, g, m, v, s):
        """refmath's AdamW, its moments set to m, v and its counter to s - 1, taking one step."""
        optimiser = AdamW(LR, BETAS, EPS, weight_decay=WD)
        optimiser.state["m"][name], optimiser.state["v"][name] = m, v
        optimiser.step_count = s - 1
        params = {name: theta}
        optimiser.step(params, {name: g})
        return params[name], optimiser.state["m"][name], optimiser.state["v"][name]

    def torch_adamw_step(name, theta, g, m, v, s):
        """The oracle (used only where torch is installed): torch.optim.AdamW from the same state."""
        import torch

        p = torch.tensor(theta, requires_grad=True)
        optimiser = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS,
                                      weight_decay=WD if takes_weight_decay(name) else 0.0)
        optimiser.state[p] = {"step": torch.tensor(float(s - 1)), "exp_avg": torch.tensor(m),
                              "exp_avg_sq": torch.tensor(v)}
        p.grad = torch.tensor(g)
        optimiser.step()
        state = optimiser.state[p]
        return p.detach().numpy(), state["exp_avg"].numpy(), state["exp_avg_sq"].numpy()

    def decay_everything(name, theta, g, m, v, s):
        """A slip: the decay applied to biases, norm gains and embeddings too."""
        return library_adamw_step("layers.0.attn.w_q", theta, g, m, v, s)

    return dict(
        reference=library_adamw_step, inputs=_adamw_inputs, outputs=("theta", "m", "v"),
        oracle=torch_adamw_step, reference_name="refmath's AdamW",
        oracle_name="torch.optim.AdamW", rtol=1e-12,
        slips={**adamw_slips(library_adamw_step),
               "the decay applied to every parameter (biases, gains, embeddings too)":
                   decay_everything,
               "the bias correction one step ahead, beta^(s + 1): s counts this step":
                   lambda name, theta, g, m, v, s: library_adamw_step(name, theta, g, m, v,
                                                                      s + 1)})
