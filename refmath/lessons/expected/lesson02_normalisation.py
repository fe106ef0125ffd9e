r"""Lesson 2, normalisation, its backward pass, and where to put it
(``notebooks/02_normalisation.py``): the expected value and the known slips of each exercise,
computed from the library and from the lesson's inputs."""
from __future__ import annotations

import numpy as np

from refmath.lessons.checks import catalogued
from refmath.lessons.table import exercise, function_exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; nothing here is called by name.
__all__ = []


@exercise("02.5", "the stream's RMS after 8 blocks", "the section 'N4: Post-LN against Pre-LN'",
          "each block adds RMSNorm(x), of RMS 1 and x's direction, so the RMS grows by 1 a block",
          uses=("stream0",))
def _stream_rms(stream0):
    from refmath.norms import rmsnorm_forward

    stream = np.asarray(stream0, dtype=np.float64)
    branch = stream
    for _ in range(8):
        branch = rmsnorm_forward(stream, np.ones(stream.shape[-1]), eps=1e-6)[0]
        stream = stream + branch
    rms = float(np.sqrt(np.mean(stream**2)))
    return rms, {"the RMS of the last block's normalised input, not of the stream: "
                 "RMSNorm bounds what a branch reads, not the stream": float(
                     np.sqrt(np.mean(branch**2))),
                 # 7 blocks, or 8 blocks with the starting stream left out, are both one RMS short
                 # (stream0 has RMS 1): the label names both, and no number that gives the answer
                 "one unit of RMS short: one block too few, or the starting stream left out":
                     rms - float(np.sqrt(np.mean(np.asarray(stream0, dtype=float)**2)))}


_N_LN = "the section 'The LayerNorm backward: three terms'"
_N_RMS = "the section 'The RMSNorm backward: two terms'"


@exercise("02.1", "LayerNorm dx", _N_LN, "(g - mean(g) - xhat mean(g xhat)) / sigma",
          uses=("dy", "ln_cache"))
def _layernorm_dx(dy, cache):
    from refmath.norms import layernorm_backward

    def dx():
        return layernorm_backward(dy, cache)[0]
    rstd = np.asarray(cache.rstd)  # 1 / sigma
    return dx(), {**catalogued("layernorm: variance path dropped", dx),
                  "the 1/sigma forgotten": dx() / rstd,
                  "the mean path dropped: only the direct and sigma terms":
                      dx() + np.mean(dy) * rstd}


@exercise("02.2", "RMSNorm dx", _N_RMS, "r g - r^3 x mean(g x): no mean term",
          uses=("dy", "rms_cache"))
def _rmsnorm_dx(dy, cache):
    from refmath.norms import rmsnorm_backward

    def dx():
        return rmsnorm_backward(dy, cache)[0]
    r = np.asarray(cache.rrms)
    g, d = np.asarray(dy) * cache.gamma, np.shape(dy)[-1]
    # r g - r^3 x sum(g x) = d dx - (d - 1) r g, since dx = r g - r^3 x mean(g x)
    return dx(), {**catalogued("rmsnorm: r^2 instead of r^3", dx),
                  "a sum for the mean in r^3 x mean(g x)": d * dx() - (d - 1) * r * g,
                  "LayerNorm's mean term kept (RMSNorm subtracts no mean)": dx() - np.mean(dy) * r,
                  "the sign of the r^3 term flipped": 2 * r * dy - dx()}


@exercise("02.3", "(dgamma, dbeta)", "the section 'The gradients of $\\gamma$ and $\\beta$'",
          "dy_ik/dgamma_k = xhat_ik, dy_ik/dbeta_k = 1, and gamma, beta are shared by every row: "
          "sum dy * xhat and dy over the rows", uses=("upstream", "xs", "gamma", "beta"))
def _layernorm_dgamma_dbeta(upstream, xs, gamma, beta):
    from refmath.norms import layernorm_backward, layernorm_forward

    def both():
        return np.stack(layernorm_backward(upstream, layernorm_forward(xs, gamma, beta)[1])[1:])
    return both(), {**catalogued("layernorm: dbeta averaged over rows", both),
                    "both averaged over the rows, not summed": both() / np.shape(xs)[0],
                    "dgamma and dbeta swapped": both()[::-1],
                    "dgamma from x instead of xhat":
                        np.stack([np.sum(upstream * xs, axis=0), np.sum(upstream, axis=0)]),
                    # the derivation's slips: dy/dgamma_k = xhat_k, not gamma_k xhat_k (g =
                    # gamma dy is the gradient at xhat, for dx), and a gain is shared by the rows
                    "g = gamma dy used for dy: g is the gradient at xhat, and dy/dgamma = xhat, "
                    "dy/dbeta = 1": both() * gamma,
                    "gamma multiplied into dgamma: dy/dgamma = xhat, without gamma (gamma dy is "
                    "the gradient at xhat, for dx)": both() * np.stack([gamma, np.ones_like(gamma)]),
                    "summed over the features of each row, not over the rows that share the gain":
                        np.stack([np.sum(upstream * layernorm_forward(xs, gamma, beta)[1].xhat,
                                         axis=-1), np.sum(upstream, axis=-1)])}


def _torch_layernorm(x, gamma, beta):
    """The oracle of 02.4 (used only where torch is installed): torch's own LayerNorm."""
    import torch

    return torch.nn.functional.layer_norm(x, x.shape[-1:], gamma, beta, eps=1e-5)


def _sum_in_the_sigma_term(dout, cache):
    """A slip of 02.4: the third term's mean over the d features written as a sum."""
    from refmath.norms import layernorm_backward

    _, dgamma, dbeta = layernorm_backward(dout, cache)
    g = dout * cache.gamma
    dx = cache.rstd * (g - g.mean(axis=-1, keepdims=True)
                       - cache.xhat * np.sum(g * cache.xhat, axis=-1, keepdims=True))
    return dx, dgamma, dbeta


@function_exercise("02.4", "your LayerNorm backward", _N_LN,
                   "dx = rstd (g - mean(g) - xhat mean(g xhat)), g = gamma dout; "
                   "dgamma and dbeta sum over every leading axis")
def _layernorm_backward():
    from refmath.norms import layernorm_backward

    return dict(
        reference=layernorm_backward, case="layernorm[*", oracle=_torch_layernorm,
        slips={**catalogued("layernorm: variance path dropped", layernorm_backward),
               "a sum for the mean in the sigma term: xhat sum(g xhat), not xhat mean(g xhat)":
                   _sum_in_the_sigma_term,
               **catalogued("layernorm: gamma left out of dx", layernorm_backward),
               **catalogued("layernorm: dbeta averaged over rows", layernorm_backward),
               **catalogued("layernorm: dgamma/dbeta sum over the first two axes only",
                            layernorm_backward)})
