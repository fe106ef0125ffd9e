"""The gradient-case makers the decoder family shares (M3 and M4): parameters and batches drawn so
that every gradient is generic (gains off 1, every token id present), and, for a mixture of
experts, draws far enough from a change of the expert selection that finite differences never
straddle one (:func:`moe_case_maker`). Each model registers its own cases
(:mod:`refmath.registry`) with them."""
from __future__ import annotations

import numpy as np

from refmath import moe as moe_ops
from refmath.losses import IGNORE_INDEX

__all__ = [
    "case_params", "case_batch", "model_case_maker", "routed_experts", "routing_margin",
    "SelectionChanged", "moe_case_maker"
]


def case_params(init_params, config, rng) -> dict:
    """``init_params`` with the norm gains moved off 1 and LayerNorm biases off 0, so that their
    gradients are generic too."""
    params = init_params(config, seed=int(rng.integers(1 << 31)))
    for name, value in params.items():
        if name.endswith(".gamma"):
            params[name] = 1.0 + 0.2 * rng.standard_normal(value.shape)
        elif name.endswith(".beta"):
            params[name] = 0.2 * rng.standard_normal(value.shape)
    return params


def case_batch(rng, vocab: int, b: int = 2, t: int = 5, prompt: int = 1) -> dict:
    """Tokens holding every id (every embedding row gets a gradient), one ignored target and a
    loss mask on the first ``prompt`` positions."""
    ids = np.concatenate([np.arange(vocab), rng.integers(0, vocab, max(b * t - vocab, 0))])
    batch = {"tokens": rng.permutation(ids[: b * t]).reshape(b, t),
             "targets": rng.integers(0, vocab, (b, t)), "loss_mask": np.ones((b, t), np.int64)}
    batch["targets"][0, -1] = IGNORE_INDEX
    batch["loss_mask"][:, :prompt] = 0
    return batch


def model_case_maker(model_forward, model_init_params, config, train: bool):
    """``make(rng) -> (params, forward)`` for a ParamCase of a decoder-family model; with ``train``
    every forward draws the same dropout masks from a generator seeded afresh."""
    def make(rng):
        params = case_params(model_init_params, config, rng)
        batch = case_batch(rng, config.vocab_size)

        def loss(p):
            return model_forward(p, batch, config, train=train,
                                 rng=np.random.default_rng(7) if train else None)
        return params, loss
    return make


def routed_experts(cache) -> tuple:
    """The experts every mixture-of-experts layer of a forward pass chose, per token."""
    return tuple(layer.ffn.branch.indices for layer in cache.layers
                 if isinstance(layer.ffn.branch, moe_ops.MoECache))


def routing_margin(cache, params: dict) -> float:
    """The smallest routing margin (:func:`refmath.moe.routing_margin`) of a forward pass's
    mixture-of-experts layers: how near its selection is to changing."""
    return min(moe_ops.routing_margin(layer.ffn.branch.router.scores, layer.ffn.branch.moe,
                                      params.get(f"layers.{i}.ffn.router.bias"))
               for i, layer in enumerate(cache.layers)
               if isinstance(layer.ffn.branch, moe_ops.MoECache))


class SelectionChanged(RuntimeError):
    """A gradient check's probe changed an expert selection: its finite differences would straddle
    a jump of the loss."""


def moe_case_maker(model_forward, model_init_params, config, margin: float = 0.01):
    """:func:`model_case_maker` for a decoder with experts: the selection is piecewise constant,
    so the check must not probe across a change of it. The parameters are drawn again until every
    router's margin exceeds ``margin`` (the stencil moves one entry by at most 1e-3, which moves a
    router logit by 1e-3 times an entry of the other factor, normalised rows of order 1, and a
    score by at most half that), and every probe is compared with the selection at the drawn
    point: a probe that changes it raises :class:`SelectionChanged` rather than give a wrong
    difference, so a passing check never straddled a jump."""
    base = model_case_maker(model_forward, model_init_params, config, train=False)

    def make(rng):
        for _ in range(200):
            params, loss = base(rng)
            cache = loss(params)[1]
            if routing_margin(cache, params) > margin:
                break
        else:
            raise RuntimeError(f"no draw in 200 had a routing margin above {margin}")
        chosen = routed_experts(cache)

        def checked(p):
            value, cache = loss(p)
            if any(not np.array_equal(a, b) for a, b in zip(routed_experts(cache), chosen)):
                raise SelectionChanged("a probe of the gradient check changed an expert "
                                       "selection; draw the case with a larger margin")
            return value, cache
        return params, checked
    return make
