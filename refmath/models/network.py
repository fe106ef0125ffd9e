r"""The network around a decoder family's layers: the embedding, the layers in turn, the final
norm and the output head, and the backward of each.

Every decoder-only family runs the same recurrence between its embedding and its head,

.. math::
    x^{(0)} = E[a],\qquad
    x^{(\ell)} = \operatorname{Layer}_\ell\big(x^{(\ell-1)}\big),\ \ell = 1, \dots, L,\qquad
    z = N\big(x^{(L)}\big)\, W_{\text{out}},

with :math:`W_{\text{out}}` the untied head ``lm_head`` or :math:`E^\top`, and its backward runs
the layers' backwards in the reverse order, each layer's gradients named under its ``layers.{i}.``
prefix. What a family's layer and norm are stays in its own file; this module is the loop, written
once: :func:`layers_forward` and :func:`layers_backward` for a family whose network adds something
of its own (Gemma's embedding scale and logit cap, Command-R's logit scale), :func:`forward` and
:func:`backward` for one that adds nothing (Falcon, OLMo 2). The token table's gradient is the
same in every family: the lookup's, plus the head's transposed when the head is the table.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from refmath.embedding import EmbeddingCache, embedding_backward, embedding_forward
from refmath.ffn import LinearCache, linear_backward, linear_forward
from refmath.losses import CrossEntropyCache
from refmath.models.blocks import norm_backward
from refmath.models.common import layer_dropout_masks, prefixed, sub_params

__all__ = ["layers_forward", "layers_backward", "table_gradients", "NetworkCache", "forward",
           "backward"]


def layers_forward(x, params: dict, n_layers: int, layer: Callable):
    """The ``n_layers`` layers in turn on the rows ``x``: ``layer(i, x, layer_params) -> (x,
    cache)`` with layer ``i``'s parameters without their ``layers.{i}.`` prefix. Returns
    ``(x, caches)``, one cache per layer."""
    caches = []
    for i in range(n_layers):
        x, cache = layer(i, x, sub_params(params, f"layers.{i}"))
        caches.append(cache)
    return x, tuple(caches)


def layers_backward(dx, caches, layer_backward: Callable):
    """The mirror of :func:`layers_forward`: ``layer_backward(dx, cache) -> (dx, grads)`` from the
    last layer to the first. Returns ``(dx, grads)``, each layer's under ``layers.{i}.``."""
    grads = {}
    for i in reversed(range(len(caches))):
        dx, layer_grads = layer_backward(dx, caches[i])
        grads.update(prefixed(f"layers.{i}", layer_grads))
    return dx, grads


def table_gradients(dtable, dw_out, tied: bool) -> dict:
    r"""The gradients of the token table and of the head: ``tok_emb`` gets its lookup's
    ``dtable`` and, when the head is :math:`E^\top` (``tied``), the head's ``dw_out`` transposed;
    otherwise ``lm_head`` gets ``dw_out``."""
    if tied:
        return {"tok_emb": dtable + dw_out.T}
    return {"tok_emb": dtable, "lm_head": dw_out}


class NetworkCache(NamedTuple):
    emb: EmbeddingCache
    layers: tuple  # one cache per layer
    norm_f: object  # the final norm's cache
    head: LinearCache  # its weight is lm_head, or tok_emb^T when tied
    tied: bool
    loss: CrossEntropyCache | None = None  # None from a logits-only pass


def forward(params, tokens, config, layer: Callable, final_norm: Callable, train: bool = False,
            rng=None):
    r"""Logits ``(B, T, V)`` of checked ``tokens`` through the whole network (the module
    docstring's equations): ``layer(i, x, layer_params, drops) -> (x, cache)`` is layer ``i``,
    given its two residual dropout multipliers, drawn from ``rng`` only when ``train`` and
    ``config.dropout > 0``; ``final_norm(x) -> (x, cache)`` is :math:`N`. Returns ``(z,
    cache)``."""
    table = params["tok_emb"]
    x, emb = embedding_forward(tokens, table)
    drops = layer_dropout_masks(rng, x.shape, config.dropout, x.dtype, config.n_layers, train)
    x, layers = layers_forward(x, params, config.n_layers,
                               lambda i, x, p: layer(i, x, p, drops[i]))
    x, norm_f = final_norm(x)
    z, head = linear_forward(x, table.T if config.tie_embeddings else params["lm_head"])
    return z, NetworkCache(emb, layers, norm_f, head, config.tie_embeddings)


def backward(dz, cache: NetworkCache, layer_backward: Callable) -> dict:
    """Gradients of :func:`forward` given ``dz``, the forward in reverse (``layer_backward(dx,
    cache) -> (dx, grads)`` is a layer's); the final norm's under ``ln_f.``."""
    dx, dw_out, _ = linear_backward(dz, cache.head)
    dx, norm_grads = norm_backward(dx, cache.norm_f)
    dx, grads = layers_backward(dx, cache.layers, layer_backward)
    return {**prefixed("ln_f", norm_grads), **grads,
            **table_gradients(embedding_backward(dx, cache.emb), dw_out, cache.tied)}
