"""Checks of the batches that the decoder-only models (GPT, the modern decoder, MLA) take, and
the next-token loss the family files put on their networks' logits.

A batch is a dict of integer arrays: ``tokens`` ``(B, T)`` (the inputs), ``targets`` ``(B, T)``
(the next tokens, or :data:`refmath.losses.IGNORE_INDEX` where nothing is predicted) and an
optional 0/1 ``loss_mask`` ``(B, T)`` (the SFT loss, L5). ``config`` is any model config with
``vocab_size`` and ``max_seq_len``.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from refmath._validate import check_ndim, int_array
from refmath.losses import IGNORE_INDEX, cross_entropy_backward, cross_entropy_forward
from refmath.models.params import check_param_dict

__all__ = ["check_tokens", "check_lm_batch", "next_token_loss", "next_token_loss_backward",
           "network_loss", "network_logits"]

LM_BATCH_KEYS = ("tokens", "targets", "loss_mask")


def check_tokens(name: str, tokens, config) -> np.ndarray:
    """Token ids as an int ``(B, T)`` array with ``1 <= T <= max_seq_len`` and ids in ``[0, V)``."""
    tokens = int_array(name, tokens, config.vocab_size)
    check_ndim(name, tokens, 2, "(B, T)")
    if tokens.size == 0:
        raise ValueError(f"{name} must hold at least one token, got shape {tokens.shape}")
    if tokens.shape[1] > config.max_seq_len:
        raise ValueError(f"{name} has T = {tokens.shape[1]} tokens (shape {tokens.shape}), more "
                         f"than max_seq_len = {config.max_seq_len}")
    return tokens


def check_lm_batch(batch, config):
    """Return ``(tokens, targets, loss_mask)`` from a batch dict, checked (``loss_mask`` may be None).

    ``targets`` are ids in ``[0, V)`` or :data:`IGNORE_INDEX`; ``loss_mask`` holds 0/1 (L5).
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a dict with keys {LM_BATCH_KEYS[:2]} (and optionally "
                        f"'loss_mask'), got {type(batch).__name__}")
    unknown = sorted(set(batch) - set(LM_BATCH_KEYS))
    if unknown:
        raise ValueError(f"batch has unexpected keys {unknown} (allowed: {list(LM_BATCH_KEYS)})")
    for key in LM_BATCH_KEYS[:2]:
        if key not in batch:
            raise ValueError(f"batch is missing {key!r} (has keys {sorted(batch)})")
    tokens = check_tokens("batch['tokens']", batch["tokens"], config)
    targets = np.asarray(batch["targets"])
    if not np.issubdtype(targets.dtype, np.integer):
        raise TypeError(f"batch['targets'] must be an integer array, got dtype {targets.dtype} "
                        f"with shape {targets.shape}")
    if targets.shape != tokens.shape:
        raise ValueError(f"batch['targets'] must have the shape of batch['tokens'] {tokens.shape}, "
                         f"got {targets.shape}")
    bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= config.vocab_size))
    if bad.any():
        raise ValueError(f"batch['targets'] must lie in [0, {config.vocab_size}) or equal "
                         f"{IGNORE_INDEX}, got {targets[bad][:5]} (shape {targets.shape})")
    loss_mask = batch.get("loss_mask")
    if loss_mask is not None:
        loss_mask = np.asarray(loss_mask)
        if loss_mask.shape != tokens.shape:
            raise ValueError(f"batch['loss_mask'] must have the shape of batch['tokens'] "
                             f"{tokens.shape}, got {loss_mask.shape}")
        if not np.all((loss_mask == 0) | (loss_mask == 1)):
            raise ValueError(f"batch['loss_mask'] must hold only 0 and 1, got values "
                             f"{np.unique(loss_mask)[:10]}")
    return tokens, targets, loss_mask


def next_token_loss(z, cache, targets, loss_mask):
    """The mean next-token cross-entropy of the logits ``z`` (L2, with the loss mask of L5), and
    the network's ``cache`` with the loss's own cache in its ``loss`` field: ``(loss, cache)``."""
    loss, ce = cross_entropy_forward(z, targets, ignore_index=IGNORE_INDEX, loss_mask=loss_mask)
    return loss, cache._replace(loss=ce)


def next_token_loss_backward(cache, network_backward) -> dict:
    """Every parameter's gradient of the loss of :func:`next_token_loss`: the loss's backward
    (``dL/dL = 1``) handed to the network's ``network_backward(dz, cache)``."""
    if cache.loss is None:
        raise ValueError("this cache has no loss: backward needs the cache of forward(...)")
    return network_backward(cross_entropy_backward(1.0, cache.loss), cache)


def network_loss(params, batch, config, shapes: dict, network):
    """A family's ``forward``: ``params`` checked against ``shapes`` and ``batch`` against
    ``config``, then the network's logits and cache, ``network(tokens) -> (z, cache)``, and
    :func:`next_token_loss` on them. Returns ``(loss, cache)``."""
    check_param_dict(params, shapes)
    tokens, targets, loss_mask = check_lm_batch(batch, config)
    z, cache = network(tokens)
    return next_token_loss(z, cache, targets, loss_mask)


def network_logits(params, tokens, config, shapes: dict, network):
    """A family's ``logits``: ``params`` and ``tokens`` checked, then the network's logits ``(B,
    T, V)``, ``network(tokens)[0]``."""
    check_param_dict(params, shapes)
    return network(check_tokens("tokens", tokens, config))[0]
