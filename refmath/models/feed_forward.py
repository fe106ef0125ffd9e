r"""A layer's feed-forward branch as a component: the dense SwiGLU, or a mixture of experts.

A decoder layer is the same recurrence whichever feed-forward it holds,

.. math::
    x'' = x' + \operatorname{FFN}(\operatorname{RMSNorm}(x')),

with :math:`\operatorname{FFN}` the gated FFN of N7 on every token, or a router that sends each
token to ``top_k`` of ``n_experts`` such FFNs and sums their outputs by the gates (E1-E4). The
layer does not ask which: it is handed a :class:`FeedForward`, chosen once per layer
(:func:`refmath.models.decoder.feed_forward`), and calls its parameter shapes, its forward and its
backward. What only a mixture has, the auxiliary losses that join the training loss (E5), is also
asked of the component, and the dense FFN answers 0.

Parameter names here are relative to a layer's ``ffn.`` prefix.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from refmath import moe as moe_ops
from refmath.ffn import matmul_rows_many
from refmath.models.blocks import ffn_backward, ffn_forward

__all__ = ["FeedForward", "swiglu", "mixture_of_experts"]


class FeedForward(NamedTuple):
    """What a layer needs from its feed-forward branch."""

    name: str  # "swiglu" or "moe", for messages and reprs
    shapes: dict  # {name: shape} of its parameters
    forward: Callable  # (h, params, *, matmul) -> (y, cache); h is (B, T, d)
    backward: Callable  # (dy, cache) -> (dh, {name: gradient})
    aux_loss: Callable  # cache -> the auxiliary loss its forward added to the model's loss (E5)


def swiglu(d_model: int, d_f: int) -> FeedForward:
    """The gated FFN of N7 (:func:`refmath.models.blocks.ffn_forward`) from ``d_model`` to ``d_f``
    and back: ``w_gate``, ``w_up`` ``(d, d_f)`` and ``w_down`` ``(d_f, d)``; no auxiliary loss."""
    shapes = {"w_gate": (d_model, d_f), "w_up": (d_model, d_f), "w_down": (d_f, d_model)}
    return FeedForward("swiglu", shapes, ffn_forward, ffn_backward, lambda cache: 0.0)


def mixture_of_experts(d_model: int, moe: moe_ops.MoEConfig) -> FeedForward:
    """The mixture of experts of :mod:`refmath.moe` with the options of ``moe``: its router,
    experts and shared experts (:func:`refmath.moe.moe_param_shapes`); its auxiliary loss is the
    forward's ``aux_loss`` (the balance and z-losses times their coefficients, E5), whose gradient
    :func:`refmath.moe.moe_backward` includes."""
    def forward(h, params: dict, *, matmul=matmul_rows_many):
        return moe_ops.moe_forward(h, params, moe, matmul=matmul)

    return FeedForward("moe", moe_ops.moe_param_shapes(d_model, moe), forward,
                       moe_ops.moe_backward, lambda cache: float(cache.aux_loss))
