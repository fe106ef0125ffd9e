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
:func:`backward` for one that adds nothing, and :func:`plain_network`, that family's whole
``forward``/``backward``/``logits`` with the next-token loss on top (Falcon, OLMo 2). The token
table's gradient is the same in every family: the lookup's, plus the head's transposed when the
head is the table. :func:`embed` and :func:`head` are the two ends of a cached step, around
the family's ``cached_layer``.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from refmath.embedding import EmbeddingCache, embedding_backward, embedding_forward
from refmath.ffn import LinearCache, linear_backward, linear_forward, matmul_rows_many
from refmath.losses import CrossEntropyCache
from refmath.models.batch import network_logits, network_loss, next_token_loss_backward
from refmath.models.blocks import norm_backward
from refmath.models.common import layer_dropout_masks, prefixed, sub_params

__all__ = ["param_shapes", "layers_forward", "layers_backward", "head_weight", "table_gradients",
           "NetworkCache", "forward", "backward", "embed", "head", "PlainNetwork", "plain_network"]


def param_shapes(config, layer_shapes: Callable, final_norm: dict) -> dict:
    """``{name: shape}`` of the network, in order: the token table ``tok_emb`` ``(V, d)``, each
    layer's ``layer_shapes(i)`` under ``layers.{i}.``, the final norm's ``final_norm`` under
    ``ln_f.``, and the head ``lm_head`` ``(d, V)`` unless the head is the table."""
    d = config.d_model
    shapes = {"tok_emb": (config.vocab_size, d)}
    for i in range(config.n_layers):
        shapes.update(prefixed(f"layers.{i}", layer_shapes(i)))
    shapes.update(prefixed("ln_f", final_norm))
    if not config.tie_embeddings:
        shapes["lm_head"] = (d, config.vocab_size)
    return shapes


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


def head_weight(params: dict, tied: bool):
    r"""The head's weight :math:`W_{\text{out}}` ``(d, V)``: the token table transposed,
    :math:`E^\top`, when ``tied``, else ``lm_head``."""
    return params["tok_emb"].T if tied else params["lm_head"]


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
    z, head = linear_forward(x, head_weight(params, config.tie_embeddings))
    return z, NetworkCache(emb, layers, norm_f, head, config.tie_embeddings)


def backward(dz, cache: NetworkCache, layer_backward: Callable) -> dict:
    """Gradients of :func:`forward` given ``dz``, the forward in reverse (``layer_backward(dx,
    cache) -> (dx, grads)`` is a layer's); the final norm's under ``ln_f.``."""
    dx, dw_out, _ = linear_backward(dz, cache.head)
    dx, norm_grads = norm_backward(dx, cache.norm_f)
    dx, grads = layers_backward(dx, cache.layers, layer_backward)
    return {**prefixed("ln_f", norm_grads), **grads,
            **table_gradients(embedding_backward(dx, cache.emb), dw_out, cache.tied)}


def embed(params, tokens, config, offset: int):
    """The new rows' embeddings ``(B, n, d)`` of a cached step, :math:`E[a]`; positions enter
    through RoPE only, so ``offset`` changes nothing here."""
    return embedding_forward(tokens, params["tok_emb"])[0]


def head(params, x, final_norm: Callable, tied: bool, *, matmul=matmul_rows_many):
    """The final norm and the head on the new rows ``x`` of a cached step: logits ``(B, n, V)``,
    the product computed by ``matmul`` (:mod:`refmath.models.contract`); ``final_norm(x) -> (y,
    cache)`` is the family's :math:`N`."""
    x, _ = final_norm(x)
    return linear_forward(x, head_weight(params, tied), matmul=matmul)[0]


class PlainNetwork(NamedTuple):
    """The whole network of a family that adds nothing of its own around its layers, and the
    next-token loss on it: the five functions of :func:`plain_network`."""
    network_forward: Callable  # (params, tokens, config, train=False, rng=None) -> (z, cache)
    network_backward: Callable  # (dz, cache) -> grads
    forward: Callable  # (params, batch, config, train=False, rng=None) -> (loss, cache)
    backward: Callable  # (cache) -> grads
    logits: Callable  # (params, tokens, config) -> z


def plain_network(layer_forward: Callable, layer_backward: Callable, final_norm: Callable,
                  param_shapes: Callable) -> PlainNetwork:
    """A family's network functions, given its layer ``layer_forward(x, layer_params, config,
    drops) -> (x, cache)`` and ``layer_backward(dx, cache) -> (dx, grads)``, its norm
    ``final_norm(params, "ln_f", config) -> (x -> (y, cache))`` and its ``param_shapes(config)``
    (which checks the config's class). The family's own file holds what differs; this is the
    part that does not."""

    def network_forward(params, tokens, config, train: bool = False, rng=None):
        r"""Logits ``(B, T, V)`` of checked ``tokens``: :math:`z = N(x^{(L)})\,W_{\text{out}}`
        after the embedding and the ``L`` layers (:func:`refmath.models.network.forward`); the
        residual dropout masks are drawn from ``rng`` only when ``train`` and ``dropout > 0``.
        Returns ``(z, cache)``."""
        return forward(params, tokens, config,
                       lambda i, x, p, drops: layer_forward(x, p, config, drops),
                       final_norm(params, "ln_f", config), train, rng)

    def network_backward(dz, cache: NetworkCache) -> dict:
        """Gradients of ``network_forward`` given ``dz``, the forward in reverse; the tied table
        gets both its lookup's and the head's gradient."""
        return backward(dz, cache, layer_backward)

    def loss_forward(params, batch, config, train: bool = False, rng=None):
        """Mean next-token cross-entropy of a batch (L2, L5): ``(loss, cache)``; the batch as
        :func:`refmath.models.decoder.forward` takes it. With ``train`` and ``dropout > 0`` the
        masks are drawn from ``rng`` (a ``numpy.random.Generator``) and kept for ``backward``."""
        return network_loss(params, batch, config, param_shapes(config),  # it checks the config
                            lambda tokens: network_forward(params, tokens, config, train, rng))

    def loss_backward(cache: NetworkCache) -> dict:
        """Gradients of the loss of ``forward`` with respect to every parameter (same keys)."""
        return next_token_loss_backward(cache, network_backward)

    def logits(params, tokens, config):
        """Next-token logits ``(B, T, V)`` for int ``tokens`` ``(B, T)``, without dropout or
        loss."""
        return network_logits(params, tokens, config, param_shapes(config),
                              lambda tokens: network_forward(params, tokens, config))

    return PlainNetwork(network_forward, network_backward, loss_forward, loss_backward, logits)
