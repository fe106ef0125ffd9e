r"""A catalogue of typical mistakes in hand-written backward passes, optimisers and schedules.

Each :class:`Mistake` is a one-line edit of a real function of refmath: the line a student (or a
tired engineer) writes instead of the right one. Applied with :func:`applied`, it turns the real
function into the wrong one for every caller; :func:`caught_by_gradcheck` then runs
:mod:`refmath.gradcheck` on the registered cases that exercise it and returns the first failure.

Why a module of the package and not a test file: three readers share the list.

- ``tests/test_mistakes.py`` asserts that ``refmath.gradcheck`` alone catches every gradient
  mistake (and the independent optimiser checks below every optimiser mistake): the evidence behind
  the README's claim that the checks catch such mistakes.
- ``benchmarks/mutation_score.py`` applies each one to a copy of the package and measures the kill
  rate of ``python -m refmath gradcheck`` and of the test suite.
- The lessons ("debugging a gradient") and the assignments' autograder use them as hostile fixtures:
  a wrong solution of known shape that a grader must reject.

Optimisers and schedules have no gradient to check: a wrong step is still a function of the
gradient that runs and returns numbers of the right shape. Their mistakes are caught by
:func:`optimiser_checks`, which recomputes each rule independently (a scalar recurrence written
from the equations in plain Python floats, the O2 worked example, the clip and schedule
identities), never by reading refmath's own code. The cache calculators' mistakes (a forgotten
factor) are caught the same way by :func:`sizing_checks`.
"""
from __future__ import annotations

import contextlib
import fnmatch
import importlib
import inspect
import math
import textwrap
from dataclasses import dataclass

import numpy as np

__all__ = ["Mistake", "MISTAKES", "wrong_source", "applied", "caught_by_gradcheck",
           "optimiser_checks", "sizing_checks", "caught_by_sizing_checks",
           "caught_by_optimiser_checks"]


@dataclass(frozen=True)
class Mistake:
    """One wrong line in one function.

    ``where`` is ``"module:qualname"`` of the function edited; ``old`` the exact text replaced
    (it must occur once in that function) and ``new`` the wrong text; ``why`` says what is wrong.
    ``cases`` is a glob over registry case names (as ``python -m refmath gradcheck --op``) that
    exercise the function; ``check`` is ``"gradcheck"``, for optimisers and schedules
    ``"optimiser"`` (see :func:`optimiser_checks`), or for the cache calculators ``"sizing"`` (see
    :func:`sizing_checks`).
    """

    name: str
    where: str
    old: str
    new: str
    why: str
    cases: str = ""
    check: str = "gradcheck"

    @property
    def module(self) -> str:
        return self.where.split(":")[0]

    @property
    def qualname(self) -> str:
        return self.where.split(":")[1]


def _g(name, where, old, new, why, cases):
    return Mistake(name, where, old, new, why, cases)


def _o(name, where, old, new, why):
    return Mistake(name, where, old, new, why, check="optimiser")


def _s(name, where, old, new, why):
    return Mistake(name, where, old, new, why, check="sizing")


MISTAKES: tuple[Mistake, ...] = (
    # ---- softmax (A5, A11) ----
    _g("softmax: sign of the correction flipped", "refmath.softmax:softmax_backward",
       "a * (dout - np.sum(a * dout", "a * (dout + np.sum(a * dout",
       "dx = a (dout - <a, dout>): the mean of dout under a is subtracted, not added", "softmax*"),
    _g("softmax: the -a a^T term dropped (a * dout)", "refmath.softmax:softmax_backward",
       "return a * (dout - np.sum(a * dout, axis=-1, keepdims=True))", "return a * dout",
       "keeps diag(a) of the Jacobian diag(a) - a a^T and forgets the -a a^T part", "softmax*"),
    _g("softmax: Jacobian's diagonal only", "refmath.softmax:softmax_backward",
       "return a * (dout - np.sum(a * dout, axis=-1, keepdims=True))",
       "return a * (1 - a) * dout",
       "a_j (1 - a_j) is the diagonal of diag(a) - a a^T; every off-diagonal -a_j a_u counts too",
       "softmax*"),
    _g("softmax: a mean for the sum in <a, dout>", "refmath.softmax:softmax_backward",
       "np.sum(a * dout, axis=-1, keepdims=True)", "np.mean(a * dout, axis=-1, keepdims=True)",
       "<a, dout> = sum_u a_u dout_u: a's weights already sum to one, nothing divides by n",
       "softmax*"),
    _g("softmax: sum over the wrong axis", "refmath.softmax:softmax_backward",
       "np.sum(a * dout, axis=-1, keepdims=True)", "np.sum(a * dout, axis=0, keepdims=True)",
       "<a, dout> is per row (the softmax axis), not over the batch", "softmax*"),
    _g("log-softmax: masked entries' dout leaks in", "refmath.softmax:log_softmax_backward",
       "dout = np.where(allowed, dout, 0.0)", "dout = dout",
       "a -inf output is a constant; its upstream gradient must reach nothing", "log_softmax*"),
    _g("log-softmax: softmax's backward used", "refmath.softmax:log_softmax_backward",
       "return dout - a * np.sum(dout, axis=-1, keepdims=True)",
       "return a * (dout - np.sum(a * dout, axis=-1, keepdims=True))",
       "dy_j/dx_u = delta_ju - a_u for log-softmax, not a_j (delta_ju - a_u)", "log_softmax*"),
    # ---- norms (N1, N2) ----
    _g("layernorm: dgamma/dbeta sum over the first two axes only", "refmath.norms:layernorm_backward",
       "rows = tuple(range(dout.ndim - 1))", "rows = (0, 1)[:dout.ndim - 1]",
       "the parameters are shared by every row of every leading axis", "layernorm*"),
    _g("rmsnorm: dgamma sums over the first two axes only", "refmath.norms:rmsnorm_backward",
       "rows = tuple(range(dout.ndim - 1))", "rows = (0, 1)[:dout.ndim - 1]",
       "the gain is shared by every row of every leading axis", "rmsnorm*"),
    _g("layernorm: variance path dropped", "refmath.norms:layernorm_backward",
       "g - g.mean(axis=-1, keepdims=True) - xhat * np.mean(g * xhat, axis=-1, keepdims=True)",
       "g - g.mean(axis=-1, keepdims=True)",
       "sigma depends on x too: the projection on xhat is part of the Jacobian", "layernorm*"),
    _g("layernorm: gamma left out of dx", "refmath.norms:layernorm_backward",
       "g = dout * gamma", "g = dout", "y = gamma * xhat + beta: dxhat = gamma * dy", "layernorm*"),
    _g("layernorm: dbeta averaged over rows", "refmath.norms:layernorm_backward",
       "dbeta = np.sum(dout, axis=rows)", "dbeta = np.mean(dout, axis=rows)",
       "a shared bias receives the sum of its rows' gradients, not their mean", "layernorm*"),
    _g("rmsnorm: r^2 instead of r^3", "refmath.norms:rmsnorm_backward",
       "rrms**3 * x", "rrms**2 * x", "d(r)/dx = -r^3 x / d: the chain rule gives a third power",
       "rmsnorm*"),
    _g("rmsnorm: dgamma without the 1/rms", "refmath.norms:rmsnorm_backward",
       "np.sum(dout * x * rrms, axis=rows)", "np.sum(dout * x, axis=rows)",
       "y = gamma * x * r: dgamma = sum dy * x * r", "rmsnorm*"),
    # ---- linear, activations, FFN (N5-N7) ----
    _g("linear: bias gradient averaged", "refmath.ffn:linear_backward",
       "dout_rows.sum(axis=0)", "dout_rows.mean(axis=0)",
       "the bias is added to every row: its gradient is the sum over rows", "linear*"),
    _g("linear: dW from the first batch entry only", "refmath.ffn:linear_backward",
       "dw = x_rows.T @ dout_rows", "dw = x_rows[: x.shape[-2]].T @ dout_rows[: x.shape[-2]]",
       "every row (every leading axis) is a sample of the same map", "linear*"),
    _g("relu: dout passed everywhere", "refmath.ffn:relu_backward",
       "dout * cache.slope", "dout",
       "the derivative is 0 where x < 0", "relu*"),
    _g("gelu exact: x phi(x) term dropped", "refmath.ffn:gelu_backward",
       "local = gate + x * (_INV_SQRT_2PI * np.exp(-0.5 * x * x))", "local = gate",
       "d/dx [x Phi(x)] = Phi(x) + x phi(x): the product rule", "gelu[exact*"),
    _g("gelu tanh: sqrt(2/pi) rounded to float32", "refmath.ffn:gelu_backward",
       "(1.0 - gate * gate) * _SQRT_2_OVER_PI", "(1.0 - gate * gate) * float(np.float32(_SQRT_2_OVER_PI))",
       "a constant copied from a float32 kernel: off by 3e-8 relative", "gelu[tanh*"),
    _g("gelu tanh: 0.044715 rounded to float32", "refmath.ffn:gelu_backward",
       "(1.0 + 3.0 * _GELU_TANH_CUBIC * x * x)", "(1.0 + 3.0 * float(np.float32(_GELU_TANH_CUBIC)) * x * x)",
       "the cubic's coefficient off by 3.5e-8 relative", "gelu[tanh*"),
    _g("gelu tanh: the 3 of d(x^3)/dx forgotten", "refmath.ffn:gelu_backward",
       "(1.0 + 3.0 * _GELU_TANH_CUBIC * x * x)", "(1.0 + _GELU_TANH_CUBIC * x * x)",
       "d/dx (x + c x^3) = 1 + 3 c x^2", "gelu[tanh*"),
    _g("silu: product rule forgotten", "refmath.ffn:silu_backward",
       "dout * sig * (1.0 + x * (1.0 - sig))", "dout * sig * (1.0 - sig)",
       "d/dx [x sigma(x)] = sigma + x sigma (1 - sigma), not sigma'", "silu*"),
    _g("ffn: activation derivative skipped", "refmath.ffn:ffn_backward",
       "dh = act_backward(da, act)", "dh = da", "back through phi: dh = da * phi'(h)",
       "ffn*"),
    _g("swiglu: du uses the gate's input, not SiLU of it", "refmath.ffn:swiglu_backward",
       "du = dm * s", "du = dm * gate.x", "m = SiLU(g) * u, so du = dm * SiLU(g)", "swiglu*"),
    _g("swiglu: dx from the gate's path only", "refmath.ffn:swiglu_backward",
       "dx = matmul_rows(dg, w_gate.T) + matmul_rows(du, w_up.T)", "dx = matmul_rows(dg, w_gate.T)",
       "x feeds both projections, g = x W_g and u = x W_u: dx = dg W_g^T + du W_u^T", "swiglu*"),
    _g("swiglu: gate and up weight gradients swapped", "refmath.ffn:swiglu_backward",
       "return dx, dw_gate, dw_up, dw_down", "return dx, dw_up, dw_gate, dw_down",
       "returned in the wrong order", "swiglu*"),
    # ---- attention (A2, A6-A10) ----
    _g("sdpa: the 1/sqrt(d_k) scale missing from the scores", "refmath.attention:sdpa_forward",
       "s = (q * scale) @ np.swapaxes(k, -1, -2)", "s = q @ np.swapaxes(k, -1, -2)",
       "S = Q K^T / sqrt(d_k): unscaled scores saturate the softmax as d_k grows (A4)", "sdpa*"),
    _g("sdpa: scale missing from dQ", "refmath.attention:sdpa_backward",
       "dq = (ds @ k) * scale", "dq = ds @ k", "S = tau Q K^T: dQ = tau dS K", "sdpa*"),
    _g("sdpa: dropout mask ignored in dA", "refmath.attention:sdpa_backward",
       "da = da * dropout_mask", "da = da",
       "O = (A * D) V: dA = (dO V^T) * D", "sdpa[causal with dropout*"),
    _g("sdpa: dV from the weights before dropout", "refmath.attention:sdpa_backward",
       "dv = np.swapaxes(weights, -1, -2) @ dout", "dv = np.swapaxes(a, -1, -2) @ dout",
       "dV = (A * D)^T dO: the dropped weights do not reach V", "sdpa[causal with dropout*"),
    _g("sdpa: dK without the transpose of dS", "refmath.attention:sdpa_backward",
       "np.swapaxes(ds, -1, -2) @ q", "ds @ q", "dK = tau dS^T Q (keys index the columns of S)",
       "sdpa*"),
    _g("mha: GQA key gradient averaged over the sharing heads", "refmath.attention:mha_backward",
       "dk = merge_heads(dk_rep.reshape(b, g, h // g, s, d_h).sum(axis=2))",
       "dk = merge_heads(dk_rep.reshape(b, g, h // g, s, d_h).mean(axis=2))",
       "a key/value head used by h/g query heads receives the sum of their gradients", "mha*"),
    _g("mha: GQA value gradient averaged over the sharing heads", "refmath.attention:mha_backward",
       "dv = merge_heads(dv_rep.reshape(b, g, h // g, s, d_h).sum(axis=2))",
       "dv = merge_heads(dv_rep.reshape(b, g, h // g, s, d_h).mean(axis=2))",
       "a key/value head used by h/g query heads receives the sum of their gradients", "mha*"),
    _g("mha: bias gradients averaged", "refmath.attention:_linear_grads",
       "grads[b] = dy.sum(axis=(0, 1))", "grads[b] = dy.mean(axis=(0, 1))",
       "each bias is added to every token of every sequence", "mha*"),
    _g("mha: K and V blocks swapped in the fused projection", "refmath.attention:mha_backward",
       "np.concatenate([dq, dk, dv], axis=-1)", "np.concatenate([dq, dv, dk], axis=-1)",
       "W_qkv = [W_Q W_K W_V]: the gradient blocks follow the same order", "mha[fused*"),
    _g("mha: self-attention's key/value path left out of dX", "refmath.attention:mha_backward",
       "dx = dx + dsource", "dx = dx",
       "X feeds Q, K and V in self-attention: its gradient is the sum of the three", "mha*"),
    _g("mha: dO = dY W_O (transpose missing)", "refmath.attention:mha_backward",
       'matmul_rows(dy, params["w_o"].T)', 'matmul_rows(dy, params["w_o"])',
       "Y = H W_O: dH = dY W_O^T (square W_O hides the shape error)", "mha[MHA*"),
    _g("mha: key gradient sent back through W_V", "refmath.attention:mha_backward",
       'matmul_rows(dk, params["w_k"].T)', 'matmul_rows(dk, params["w_v"].T)',
       "K = Z W_K: dZ gets dK W_K^T", "mha*"),
    # ---- positions, embedding (N9, N10, N12) ----
    _g("rope: forward rotation used in backward", "refmath.positions:rope_backward",
       "_rotate_pairs(dout, cache.cos, -cache.sin, cache.layout)",
       "_rotate_pairs(dout, cache.cos, cache.sin, cache.layout)",
       "the transpose of a rotation is the rotation by the negative angle", "rope*"),
    _g("learned positions: table gradient averaged over the batch",
       "refmath.positions:learned_positions_backward",
       "dout.reshape(-1, *dout.shape[-2:]).sum(axis=0)", "dout.reshape(-1, *dout.shape[-2:]).mean(axis=0)",
       "every sequence of the batch adds the same rows", "learned_positions*"),
    _g("learned positions: offset ignored", "refmath.positions:learned_positions_backward",
       "dtable[rows] = ", "dtable[: rows.stop - rows.start] = ",
       "rows offset .. offset + T - 1 were added, not the first T", "learned_positions*"),
    _g("embedding: repeated ids keep one contribution", "refmath.embedding:embedding_backward",
       "np.add.at(dtable, ids.reshape(-1), rows * scale if scale != 1.0 else rows)",
       "dtable[ids.reshape(-1)] += rows * scale if scale != 1.0 else rows",
       "fancy-index += keeps one write per repeated index; np.add.at accumulates", "embedding*"),
    _g("embedding: sqrt(d) scale forgotten", "refmath.embedding:embedding_backward",
       "rows * scale if scale != 1.0 else rows", "rows", "y = s E[a]: dE = s dy",
       "embedding[scaled*"),
    # ---- cross-entropy (L2-L5) ----
    _g("cross-entropy: mean over max(n, 2)", "refmath.losses:cross_entropy_backward",
       "max(n_counted, 1)", "max(n_counted, 2)",
       "a guard against n = 0 written as 2 halves the gradient of a single counted token",
       "cross_entropy*"),
    _g("cross-entropy: mean over every position, ignored ones too", "refmath.losses:cross_entropy_backward",
       "max(n_counted, 1)", "max(counted.size, 1)",
       "the loss divides by the counted tokens only", "cross_entropy*"),
    _g("cross-entropy: ignored tokens get a gradient", "refmath.losses:cross_entropy_backward",
       "np.where(counted[..., None], grad * scale, np.zeros((), dtype=probs.dtype))", "grad * scale",
       "an ignored (padding) token is not in the loss", "cross_entropy*"),
    _g("cross-entropy: label smoothing left out of the gradient", "refmath.losses:cross_entropy_backward",
       "grad = probs - eps / vocab", "grad = probs",
       "the smoothed target q = (1 - eps) onehot + eps / V is what p is compared with",
       "cross_entropy*smooth*"),
    _g("cross-entropy: 1 - eps dropped from the smoothed target", "refmath.losses:cross_entropy_backward",
       "axis=-1) - (1.0 - eps)", "axis=-1) - 1.0",
       "q = (1 - eps) onehot + eps / V: the eps / V added to every token comes out of the right one",
       "cross_entropy*smooth*"),
    # ---- FlashAttention reference (F4) ----
    _g("flash: delta = rowsum(dO * O) left out", "refmath.flash:flash_attention_backward",
       "ds = p * (dp - delta[:, :, :, i0:i1, None])", "ds = p * dp",
       "the softmax backward subtracts sum_j P dP = rowsum(dO * O)", "flash_attention*"),
    _g("flash: GQA value gradient averaged over the group", "refmath.flash:flash_attention_backward",
       "dv_j += dv_part.sum(axis=2)", "dv_j += dv_part.mean(axis=2)",
       "the shared key/value head receives the sum over its H/G query heads",
       "flash_attention*"),
    _g("flash: scale missing from dK", "refmath.flash:flash_attention_backward",
       "dk_j += dk_part.sum(axis=2) * scale", "dk_j += dk_part.sum(axis=2)",
       "S = tau Q K^T: dK = tau dS^T Q", "flash_attention*"),
    _g("flash: causal mask forgotten in the backward", "refmath.flash:flash_attention_backward",
       "            if visible is not None:\n"
       "                s = np.where(visible, s, -np.inf)\n"
       "            p = ",
       "            p = ",
       "recomputed weights must hide the same pairs as the forward", "flash_attention*causal*"),
    # ---- whole models (M1-M4) ----
    _g("gpt: tied table misses the output projection's gradient", "refmath.models.gpt:backward",
       'grads["tok_emb"] = grads["tok_emb"] + dw_out.T', 'grads["tok_emb"] = grads["tok_emb"]',
       "a table used twice (lookup and W_out = E^T) sums both gradients", "gpt*"),
    _g("gpt: Pre-LN residual gradient dropped", "refmath.models.gpt:_residual_backward",
       "return dout + dx_ln, dgamma, dbeta, branch_grads", "return dx_ln, dgamma, dbeta, branch_grads",
       "x feeds the skip path and the branch: dx = dout + the branch's term", "gpt*"),
    _g("decoder: RoPE not undone on dQ", "refmath.models.decoder:rope_attention_backward",
       "dq = rope_backward(dq, cache.q_rope)", "dq = dq",
       "queries were rotated after the projection: rotate their gradient back",
       "rope_attention*"),
    _g("decoder: residual dropout mask ignored", "refmath.models.decoder:sublayer_backward",
       "df = apply_mask(dout, cache.drop)", "df = dout",
       "the branch's output was multiplied by the mask", "decoder*"),
    _g("mla: shared rotary key's gradient averaged over heads", "refmath.models.mla:mla_backward",
       "dk[..., d_k:].sum(axis=1)", "dk[..., d_k:].mean(axis=1)",
       "one rotary key row serves every head: it receives the sum", "mla*"),
    _g("mla: latent gets only the key path", "refmath.models.mla:mla_backward",
       "dc = dc_k + dc_v", "dc = dc_k", "the latent feeds both up-projections (W_UK and W_UV)",
       "mla*"),
    _g("transformer: source embedding gradient dropped", "refmath.models.transformer:backward",
       '"tok_emb": demb_src + demb_tgt', '"tok_emb": demb_tgt',
       "the shared table is read by the encoder too", "transformer*"),
    # ---- cache sizes (K6): arithmetic, no gradient; sizing_checks catches them ----
    _s("kv cache: the factor 2 for K and V forgotten", "refmath.sizing:kv_cache_bytes_per_token",
       "layers * kv_heads * (head_dim + value_dim) * bytes_per_element",
       "layers * kv_heads * head_dim * bytes_per_element",
       "every cached token stores a key and a value: 2 L g d_h b bytes"),
    # ---- optimisers and schedules (O1-O7): no gradient; optimiser_checks catches them ----
    _o("adam: bias correction missing", "refmath.optim:Adam.corrected_moments",
       'return self.state["m"][name] / (1 - beta1**s), self.state["v"][name] / (1 - beta2**s)',
       'return self.state["m"][name], self.state["v"][name]',
       "m and v start at zero: without dividing by 1 - beta^s they are too small early on (O2)"),
    _o("adam: bias correction with beta instead of beta^s", "refmath.optim:Adam.corrected_moments",
       "self.state[\"m\"][name] / (1 - beta1**s)", "self.state[\"m\"][name] / (1 - beta1)",
       "m_s = (1 - beta1^s) g for a constant g: the correction is 1 - beta1^s"),
    _o("adam: eps inside the square root", "refmath.optim:Adam._update",
       "np.sqrt(v_hat) + self.eps", "np.sqrt(v_hat + self.eps)",
       "theta -= lr m_hat / (sqrt(v_hat) + eps)"),
    _o("adam: second moment of |g| instead of g^2", "refmath.optim:Adam._update",
       "v += (1 - beta2) * (g * g)", "v += (1 - beta2) * np.abs(g)",
       "v estimates E[g^2]"),
    _o("adamw: decay also inside the moments", "refmath.optim:Adam._update",
       "if wd and not self.decoupled:", "if wd:",
       "AdamW's decay is decoupled: the moments see the data gradient only (O4)"),
    _o("adamw: decay not scaled by the learning rate", "refmath.optim:Adam._update",
       "p *= 1 - lr * wd", "p *= 1 - wd", "theta <- (1 - eta lambda) theta (torch's AdamW)"),
    _o("sgd: momentum buffer dampened", "refmath.optim:SGD._update",
       "buf += g", "buf += (1 - self.momentum) * g",
       "b_s = mu b_{s-1} + g (torch's SGD, no dampening)"),
    _o("sgd: weight decay with the wrong sign", "refmath.optim:SGD._update",
       "g = g + wd * p", "g = g - wd * p", "d/dtheta (lambda/2)|theta|^2 = lambda theta"),
    _o("clip: sum of norms instead of the global norm", "refmath.optim:clip_grad_norm",
       "total = float(np.linalg.norm([np.linalg.norm(g.ravel()) for g in grads.values()]))",
       "total = float(sum(np.linalg.norm(g.ravel()) for g in grads.values()))",
       "the global norm is the root of the sum of squares"),
    _o("warmup-cosine: progress measured over the whole run", "refmath.optim:warmup_cosine",
       "(step - warmup) / (total - warmup)", "(step - warmup) / total",
       "the cosine runs from the end of warmup to the end of training"),
    _o("transformer schedule: warmup^-0.5 in the linear branch", "refmath.optim:transformer_schedule",
       "step * warmup**-1.5", "step * warmup**-0.5",
       "the branches must meet at s = w: s w^-1.5 = s^-0.5 there"),
    # ---- mixture of experts (E3-E5) ----
    # ("[[]" is a literal bracket in the glob: "moe_route*" would match moe_router too)
    _g("moe route: renormalisation's Jacobian dropped", "refmath.moe:route_backward",
       "dg = (dg - np.sum(dg * chosen, axis=-1, keepdims=True) / denominator) / denominator",
       "dg = dg / denominator",
       "g_j = s_j / D and D sums every chosen score: ds_i = (dg_i - sum_j dg_j g_j) / D",
       "moe_route[[]*"),
    _g("moe route: scaling left out of the backward", "refmath.moe:route_backward",
       "dg = dgates * scaling", "dg = dgates",
       "g_j = rho s_j (/ D): the routed scaling factor rho multiplies the gradient too",
       "moe_route[[]*"),
    _g("moe: an expert's gradient not scaled by its gate", "refmath.moe:moe_backward",
       "swiglu_backward(expert.gates[:, None] * dy_e,", "swiglu_backward(dy_e,",
       "y = sum_j g_j E_j(x): the expert's output reaches y times its gate", "moe[[]*"),
    _g("moe: no gradient to the router through the gates", "refmath.moe:moe_backward",
       "dweight[expert.tokens, e] = np.sum(dy_e * expert.out, axis=-1)",
       "dweight[expert.tokens, e] = 0.0",
       "the choice has no gradient, the gates do: dg_j = <dy, E_j(x)>", "moe[[]*"),
    _g("moe balance loss: gradient not divided by the tokens",
       "refmath.moe:expert_balance_loss_backward", "dloss * f / n", "dloss * f",
       "P_i is a mean over the N tokens: dL/dp_ni = f_i / N", "moe_balance_loss[[]*"),
)


# ---- applying a mistake ----------------------------------------------------------------------------

def _function(mistake: Mistake):
    obj = importlib.import_module(mistake.module)
    for part in mistake.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def wrong_source(mistake: Mistake) -> str:
    """The source of the edited function with the mistake in it (dedented for methods)."""
    source = textwrap.dedent(inspect.getsource(_function(mistake)))
    count = source.count(mistake.old)
    if count != 1:
        raise ValueError(f"mistake {mistake.name!r}: the text to replace occurs {count} times in "
                         f"{mistake.where} (expected once); has the function changed?")
    return source.replace(mistake.old, mistake.new)


@contextlib.contextmanager
def applied(mistake: Mistake):
    """Within the block, the function ``mistake.where`` runs the wrong code, for every caller.

    The wrong source is compiled in the function's own module namespace and its code object swapped
    into the existing function object, so references taken earlier (the registry's cases, other
    modules' ``from ... import``) see the mistake too. The right code is restored on exit.
    """
    func = _function(mistake)
    namespace = dict(func.__globals__)
    exec(compile(wrong_source(mistake), f"<mistake: {mistake.name}>", "exec"), namespace)
    wrong = namespace[mistake.qualname.split(".")[-1]]
    right = func.__code__
    func.__code__ = wrong.__code__
    try:
        yield
    finally:
        func.__code__ = right


def caught_by_gradcheck(mistake: Mistake, seed: int = 0):
    """With ``mistake`` applied, run :func:`refmath.gradcheck.check` on the registered cases that
    match ``mistake.cases`` (every group) and return the first failing result, or None if every
    one passes. A case whose forward or backward raises counts as caught, with the exception."""
    from refmath.gradcheck import check
    from refmath.gradcheck import all_cases

    cases = [c for c in all_cases(group=None) if fnmatch.fnmatch(c.name, mistake.cases)]
    if not cases:
        raise ValueError(f"mistake {mistake.name!r}: no registered case matches {mistake.cases!r}")
    with applied(mistake):
        for case in cases:
            try:
                result = check(case, seed=seed)
            except Exception as error:  # a shape error in the wrong code is a catch too
                return error
            if not result.passed:
                return result
    return None


# ---- the independent checks of optimisers and schedules ------------------------------------------

def _adam_by_hand(theta, grads, lr, beta1, beta2, eps, wd, decoupled):
    """Adam (O1) / AdamW (O4) on one scalar, from the equations, in plain Python floats."""
    m = v = 0.0
    for s, g in enumerate(grads, start=1):
        if wd and not decoupled:
            g = g + wd * theta
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat, v_hat = m / (1 - beta1**s), v / (1 - beta2**s)
        if wd and decoupled:
            theta = theta * (1 - lr * wd)
        theta = theta - lr * m_hat / (math.sqrt(v_hat) + eps)
    return theta


def _sgd_by_hand(theta, grads, lr, momentum, wd):
    """SGD with momentum and L2 (O7), torch's convention, on one scalar."""
    buf = 0.0
    for g in grads:
        g = g + wd * theta
        buf = momentum * buf + g
        theta = theta - lr * buf
    return theta


def _by_hand(rule: str, theta, grads, wd):
    lr, b1, b2, eps = 0.1, 0.9, 0.99, 1e-8  # optimiser_checks' settings
    if rule == "sgd":
        return _sgd_by_hand(theta, grads, lr, 0.9, wd)
    return _adam_by_hand(theta, grads, lr, b1, b2, eps, wd, decoupled=rule == "adamw")


def _torch_optimiser_checks(theta0, steps, lr, b1, b2, eps, wd, run, close) -> dict[str, bool]:
    """Adam, AdamW and SGD with momentum against ``torch.optim`` in float64 over the same steps,
    in two parameter groups (the matrix decays, the bias does not); {} without torch."""
    try:
        import torch
    except ImportError:
        return {}
    from refmath import optim

    def torch_run(make):
        tensors = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
                   for k, v in theta0.items()}
        opt = make([{"params": [tensors["w"]], "weight_decay": wd},
                    {"params": [tensors["b"]], "weight_decay": 0.0}])
        for grads in steps:
            for k, t in tensors.items():
                t.grad = torch.tensor(grads[k], dtype=torch.float64)
            opt.step()
        return {k: t.detach().numpy() for k, t in tensors.items()}

    return {
        "Adam (L2 inside), two groups = torch.optim.Adam": close(
            run(optim.Adam(lr, (b1, b2), eps, weight_decay=wd)),
            torch_run(lambda g: torch.optim.Adam(g, lr=lr, betas=(b1, b2), eps=eps))),
        "AdamW, two groups = torch.optim.AdamW": close(
            run(optim.AdamW(lr, (b1, b2), eps, weight_decay=wd)),
            torch_run(lambda g: torch.optim.AdamW(g, lr=lr, betas=(b1, b2), eps=eps))),
        "SGD with momentum and L2, two groups = torch.optim.SGD": close(
            run(optim.SGD(lr, momentum=0.9, weight_decay=wd)),
            torch_run(lambda g: torch.optim.SGD(g, lr=lr, momentum=0.9))),
    }


def optimiser_checks() -> dict[str, bool]:
    """Each optimiser and schedule against an independent computation; ``{check: passed}``.

    - Adam, AdamW and SGD over four steps on a small parameter dict against scalar recurrences
      written from the equations (``rtol 1e-12``; gradients from 1e-4 to 3 so that ``eps`` and the
      decay matter; the matrix ``w`` decays and the bias ``b`` does not, O5), again without weight
      decay, and with explicit parameter groups (``decay_of``) that decay both differently;
    - the same three against ``torch.optim`` in float64 with two parameter groups, where torch is
      installed;
    - O4 and O7 worked examples: on a zero gradient AdamW and SGD + L2 decay by ``1 - lr wd``;
    - O2: for a constant gradient the corrected moments are exactly ``g`` and ``g^2``;
    - clipping: the clipped global norm is ``max_norm * n / (n + 1e-6)``, the direction unchanged;
    - schedules: warmup-cosine is ``max_lr`` at ``w``, the midpoint at ``(w + T) / 2``, ``min_lr``
      at ``T``; the Transformer's rate peaks at ``s = w`` with ``d^-1/2 w^-1/2``, continuous there.
    """
    from refmath import optim

    rng = np.random.default_rng(0)
    theta0 = {"w": rng.standard_normal((2, 3)), "b": rng.standard_normal(3)}
    scales = {"w": np.array([[1e-4, 1e-2, 1.0], [3.0, 0.1, 1e-3]]), "b": np.array([0.5, 1e-4, 2.0])}
    steps = [{k: scales[k] * rng.standard_normal(v.shape) for k, v in theta0.items()} for _ in range(4)]

    def run(opt):
        params = {k: v.copy() for k, v in theta0.items()}
        for grads in steps:
            opt.step(params, {k: g.copy() for k, g in grads.items()})
        return params

    def by_hand(rule):
        # O5: the matrix "w" decays, the bias "b" does not
        return {k: np.vectorize(lambda t, *gs: rule(t, gs, wd if k == "w" else 0.0))(
                    theta0[k], *[g[k] for g in steps]) for k in theta0}

    def close(a, b):
        return all(np.allclose(a[k], b[k], rtol=1e-12, atol=0) for k in a)

    results = {}
    lr, b1, b2, eps, wd = 0.1, 0.9, 0.99, 1e-8, 0.3
    results["Adam (L2 inside) = its recurrence"] = close(
        run(optim.Adam(lr, (b1, b2), eps, weight_decay=wd)),
        by_hand(lambda t, gs, wd: _adam_by_hand(t, gs, lr, b1, b2, eps, wd, decoupled=False)))
    results["AdamW (decoupled) = its recurrence"] = close(
        run(optim.AdamW(lr, (b1, b2), eps, weight_decay=wd)),
        by_hand(lambda t, gs, wd: _adam_by_hand(t, gs, lr, b1, b2, eps, wd, decoupled=True)))
    results["SGD with momentum and L2 = its recurrence"] = close(
        run(optim.SGD(lr, momentum=0.9, weight_decay=wd)),
        by_hand(lambda t, gs, wd: _sgd_by_hand(t, gs, lr, 0.9, wd)))

    for name, make, rule in (
            ("Adam", lambda d: optim.Adam(lr, (b1, b2), eps, weight_decay=d), "adam"),
            ("AdamW", lambda d: optim.AdamW(lr, (b1, b2), eps, weight_decay=d), "adamw"),
            ("SGD with momentum", lambda d: optim.SGD(lr, momentum=0.9, weight_decay=d), "sgd")):
        results[f"{name}, no weight decay = its recurrence"] = close(
            run(make(0.0)), by_hand(lambda t, gs, _, rule=rule: _by_hand(rule, t, gs, 0.0)))
    # O5, explicit parameter groups: every parameter its own coefficient, the bias's not zero
    groups = {"w": wd, "b": 0.05}
    for name, opt, rule in (
            ("Adam", optim.Adam(lr, (b1, b2), eps, decay_of=groups), "adam"),
            ("AdamW", optim.AdamW(lr, (b1, b2), eps, decay_of=groups), "adamw"),
            ("SGD with momentum", optim.SGD(lr, momentum=0.9, decay_of=groups), "sgd")):
        expected = {k: np.vectorize(lambda t, *gs, k=k: _by_hand(rule, t, gs, groups[k]))(
                        theta0[k], *[g[k] for g in steps]) for k in theta0}
        results[f"{name}, parameter groups (decay 0.3 and 0.05) = its recurrence"] = close(
            run(opt), expected)
    results.update(_torch_optimiser_checks(theta0, steps, lr, b1, b2, eps, wd, run, close))

    # O4 and O7, the worked examples: on a zero gradient AdamW's step is exactly theta (1 - lr wd)
    # each step (its moments stay 0), and SGD + L2 (no momentum) the same multiplicative decay.
    for name, opt in (("O4: AdamW on a zero gradient decays by (1 - lr wd)",
                       optim.AdamW(lr, (b1, b2), eps, weight_decay=wd)),
                      ("O7: SGD + L2 on a zero gradient decays by (1 - lr wd)",
                       optim.SGD(lr, weight_decay=wd))):
        params = {"w": theta0["w"].copy()}
        for _ in range(3):
            opt.step(params, {"w": np.zeros_like(params["w"])})
        results[name] = bool(np.allclose(params["w"], theta0["w"] * (1 - lr * wd) ** 3,
                                         rtol=1e-14, atol=0))

    adam = optim.Adam(0.01, (b1, b2))
    params, g = {"p": np.ones(3)}, np.array([0.3, -2.0, 1e-3])
    o2 = True
    for _ in range(5):
        adam.step(params, {"p": g.copy()})
        m_hat, v_hat = adam.corrected_moments("p")
        o2 &= np.allclose(m_hat, g, rtol=1e-13, atol=0) and np.allclose(v_hat, g * g, rtol=1e-12, atol=0)
    results["O2: constant gradient, corrected moments g and g^2"] = bool(o2)

    grads = {k: 3.0 * v for k, v in steps[0].items()}
    before = {k: v.copy() for k, v in grads.items()}
    n = math.sqrt(sum(float(np.sum(v * v)) for v in before.values()))
    returned = optim.clip_grad_norm(grads, 0.5)
    clipped = math.sqrt(sum(float(np.sum(v * v)) for v in grads.values()))
    results["clip: global norm max_norm n / (n + 1e-6)"] = (
        math.isclose(returned, n, rel_tol=1e-12)
        and math.isclose(clipped, 0.5 * n / (n + 1e-6), rel_tol=1e-12)
        and all(np.allclose(grads[k] * n, before[k] * clipped, rtol=1e-12) for k in grads))

    w, total, top, bottom = 10, 110, 3e-4, 3e-5
    results["warmup-cosine: max at w, midpoint, min at T"] = (
        math.isclose(optim.warmup_cosine(w, top, w, total, bottom), top, rel_tol=1e-15)
        and math.isclose(optim.warmup_cosine(60, top, w, total, bottom), (top + bottom) / 2, rel_tol=1e-12)
        and math.isclose(optim.warmup_cosine(w // 2, top, w, total, bottom), top / 2, rel_tol=1e-15)
        and math.isclose(optim.warmup_cosine(total - 1, top, w, total, bottom),
                         bottom + (top - bottom) * (1 + math.cos(math.pi * (total - 1 - w) / (total - w)))
                         / 2, rel_tol=1e-12))
    d, warm = 512, 4000
    peak = d**-0.5 * warm**-0.5
    results["transformer schedule: peak d^-1/2 w^-1/2 at s = w"] = (
        math.isclose(optim.transformer_schedule(warm, d, warm), peak, rel_tol=1e-12)
        and math.isclose(optim.transformer_schedule(warm // 2, d, warm), peak / 2, rel_tol=1e-12)
        and math.isclose(optim.transformer_schedule(4 * warm, d, warm), peak / 2, rel_tol=1e-12))
    return results


def sizing_checks() -> dict[str, bool]:
    """The cache calculators against figures computed here from K6, ``2 B T L g d_h b``, and a
    published one (Llama-3-8B: 32 layers, 8 key/value heads of 128, bfloat16: 128 KiB a token);
    ``{check: passed}``."""
    from refmath import sizing

    shapes = [(32, 8, 128, 2), (40, 8, 128, 2), (12, 12, 64, 4), (1, 1, 3, 1)]
    results = {"per token: 2 L g d_h b": all(
        sizing.kv_cache_bytes_per_token(L, g, d, b) == 2 * L * g * d * b for L, g, d, b in shapes)}
    results["Llama-3-8B: 128 KiB a token in bf16"] = (
        sizing.kv_cache_bytes_per_token(32, 8, 128, 2) == 128 * 1024)
    results["a batch: 2 B T L g d_h b"] = (
        sizing.kv_cache_bytes(batch=8, layers=40, tokens=4096, kv_heads=8, head_dim=128,
                              bytes_per_element=2) == 2 * 8 * 4096 * 40 * 8 * 128 * 2)
    return results


def caught_by_sizing_checks(mistake: Mistake) -> list[str]:
    """The names of the :func:`sizing_checks` that fail with ``mistake`` applied."""
    with applied(mistake):
        return [name for name, passed in sizing_checks().items() if not passed]


def caught_by_optimiser_checks(mistake: Mistake) -> list[str]:
    """The names of the :func:`optimiser_checks` that fail with ``mistake`` applied."""
    with applied(mistake):
        return [name for name, passed in optimiser_checks().items() if not passed]
