"""Planted mistakes: typical slips written into a lesson's answers are rejected and named.

Each plant edits one line of an exercise's solution (the answer a student with that slip would
write), the lesson runs with the plants in place, and the check after each planted exercise must
print ``wrong: NAME: looks like: SLIP``, naming the slip; the checks of the other exercises still
say right. A slip's value comes from the check itself (``refmath.lessons.check_close``'s
``slips``, many of them the catalogued mistakes of ``refmath.mistakes`` applied to the library),
so this test confirms that the student's way of making the slip and the check's way agree.
The write-the-function exercises are planted the same way: one line of the student's function is
edited, and ``refmath.lessons.check_function`` must name the slip function it now matches.
"""
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from _support import run_lesson

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

PROBS_15 = "probs_by_hand = np.array([[4, 2, 1, 1], [1, 1, 2, 4], [1, 3, 3, 1], [1, 1, 1, 1]]) / row_sums"

# lesson -> [(solution text, the slip written instead, the check's name, words of the slip's name)]
PLANTS = {
    "01_attention.py": [
        ("scores = Q @ K.T / np.sqrt(Q.shape[-1])\n", "scores = Q @ K.T\n",
         "your attention forward", "scale missing from the scores"),
        ("        scores = scores + mask\n", "        scores = scores\n", "your attention forward",
         "the mask ignored"),
        ('"w_v": params["w_v"][:, order], "w_o": params["w_o"][order, :]}',
         '"w_v": params["w_v"][:, order], "w_o": params["w_o"]}',
         "the parameters with heads 0 and 1 swapped", "w_o left as it was"),
        ("np.array([[1 / 3 * 1 + 2 / 3 * 0, 1 / 3 * 0 + 2 / 3 * 2]])",
         "np.array([[0.25 * 1 + 0.5 * 0, 0.25 * 0 + 0.5 * 2]])",
         "the masked output", "not renormalised"),
        ("jacobian_a3 = np.diag(a3) - np.outer(a3, a3)", "jacobian_a3 = np.diag(a3) - a3 @ a3",
         "the Jacobian of (1/4, 1/2, 1/4)", "inner product"),
        ("dK_causal = dS_causal.T @ Q / np.sqrt(d_k)", "dK_causal = dS_causal @ Q / np.sqrt(d_k)",
         "dK (causal)", "dK without the transpose of dS"),
        # walk-through A (issue 47): the Jacobian's diagonal alone
        ("jacobian_a3 = np.diag(a3) - np.outer(a3, a3)", "jacobian_a3 = np.diag(a3 - a3**2)",
         "the Jacobian of (1/4, 1/2, 1/4)", "the diagonal only"),
        ("dA_drop = (dO @ V.T) * D", "dA_drop = dO @ V.T",
         "(dV, dQ) with dropout", "dropout mask ignored in dA"),
        # the write-the-function exercises: a slip in the student's own function
        ("dx = a * (dout - row_mean)", "dx = a * dout", "your softmax backward",
         "the -a a^T term dropped"),
        ("row_mean = np.sum(a * dout, axis=-1, keepdims=True)",
         "row_mean = np.sum(a * dout, axis=0, keepdims=True)", "your softmax backward",
         "sum over the wrong axis"),
        ("row_mean = np.sum(a * dout, axis=-1, keepdims=True)",
         "row_mean = np.mean(a * dout, axis=-1, keepdims=True)", "your softmax backward",
         "a mean for the sum"),
        ("dx = a * (dout - row_mean)", "dx = a * (1 - a) * dout", "your softmax backward",
         "Jacobian's diagonal only"),
        ("dK_causal = dS_causal.T @ Q / np.sqrt(d_k)", "dK_causal = dS_causal.T @ Q",
         "dK (causal)", "scale 1/sqrt(d_k) missing from dK"),
        ("dK_causal = dS_causal.T @ Q / np.sqrt(d_k)", "dK_causal = dS_causal @ K / np.sqrt(d_k)",
         "dK (causal)", "dQ's formula"),
        # 01.4 is derived from J's entries: the factor a_u left off the second term
        ("dx = a * (dout - row_mean)", "dx = a * dout - row_mean", "your softmax backward",
         "the factor a_u left off"),
        ("dS_causal = A_causal * (dA_causal - np.sum(A_causal * dA_causal, axis=1, keepdims=True))",
         "dS_causal = A_causal * (dA_causal - np.mean(A_causal * dA_causal, axis=1, keepdims=True))",
         "dK (causal)", "a mean for the sum in dS"),
        ("dS_drop = A_c * (dA_drop - np.sum(A_c * dA_drop, axis=1, keepdims=True))",
         "dS_drop = (A_c * D) * (dA_drop - np.sum((A_c * D) * dA_drop, axis=1, keepdims=True))",
         "(dV, dQ) with dropout", "A * D inside dS"),
    ],
    "02_normalisation.py": [
        ("dx_layernorm = (direct + through_mean + through_sigma) / sigma",
         "dx_layernorm = (direct + through_mean) / sigma", "LayerNorm dx", "variance path dropped"),
        ("dx_rmsnorm = r * dy - r**3 * x * np.mean(dy * x)",
         "dx_rmsnorm = r * dy - r**2 * x * np.mean(dy * x)", "RMSNorm dx", "r^2 instead of r^3"),
        # walk-through A (issue 47): a sum for a mean, in RMSNorm's dx and in LayerNorm's sigma term
        ("dx_rmsnorm = r * dy - r**3 * x * np.mean(dy * x)",
         "dx_rmsnorm = r * dy - r**3 * x * np.sum(dy * x)", "RMSNorm dx", "a sum for the mean"),
        ("g_along_xhat = np.mean(g * cache.xhat, axis=-1, keepdims=True)",
         "g_along_xhat = np.sum(g * cache.xhat, axis=-1, keepdims=True)", "your LayerNorm backward",
         "a sum for the mean in the sigma term"),
        ("dgamma_dbeta = np.stack([np.sum(upstream * xhat_batch, axis=0), np.sum(upstream, axis=0)])",
         "dgamma_dbeta = np.stack([np.sum(upstream * xhat_batch, axis=0), np.mean(upstream, axis=0)])",
         "(dgamma, dbeta)", "dbeta averaged over rows"),
        # 02.3 is derived from y = gamma xhat + beta: gamma multiplied in, or the wrong axis summed
        ("dgamma_dbeta = np.stack([np.sum(upstream * xhat_batch, axis=0), np.sum(upstream, axis=0)])",
         "dgamma_dbeta = np.stack([np.sum(gamma * upstream * xhat_batch, axis=0), "
         "np.sum(gamma * upstream, axis=0)])", "(dgamma, dbeta)", "g = gamma dy used for dy"),
        ("dgamma_dbeta = np.stack([np.sum(upstream * xhat_batch, axis=0), np.sum(upstream, axis=0)])",
         "dgamma_dbeta = np.stack([np.sum(upstream * xhat_batch, axis=1), np.sum(upstream, axis=1)])",
         "(dgamma, dbeta)", "summed over the features of each row"),
        ("dgamma_dbeta = np.stack([np.sum(upstream * xhat_batch, axis=0), np.sum(upstream, axis=0)])",
         "dgamma_dbeta = np.stack([np.sum(gamma * upstream * xhat_batch, axis=0), "
         "np.sum(upstream, axis=0)])", "(dgamma, dbeta)", "gamma multiplied into dgamma"),
        ("dx = cache.rstd * (g - g_mean - cache.xhat * g_along_xhat)",
         "dx = cache.rstd * (g - g_mean)", "your LayerNorm backward", "variance path dropped"),
        ("rows = tuple(range(dout.ndim - 1))  # every leading axis",
         "rows = (0, 1)[:dout.ndim - 1]", "your LayerNorm backward", "over the first two axes only"),
    ],
    "03_flash_and_kv_cache.py": [
        ("merged_m_l = (m_merged, np.exp(state_c.m - m_merged) * state_c.l\n"
         "              + np.exp(state_d.m - m_merged) * state_d.l)",
         "merged_m_l = (m_merged, state_c.l + state_d.l)", "(m, l) of the merge", "neither rescaled"),
        # walk-through A (issue 47): the causal mask aligned top-left, query i seeing keys 0 .. i
        ("visible = np.arange(6)[None, :] <= np.arange(4)[:, None] + 2",
         "visible = np.arange(6)[None, :] <= np.arange(4)[:, None]",
         "dQ from the logsumexp", "aligned top-left"),
        ("dS_small = P_small * (do_small[0, 0] @ v_small[0, 0].T - delta)",
         "dS_small = P_small * (do_small[0, 0] @ v_small[0, 0].T)",
         "dQ from the logsumexp", "delta = rowsum(dO * O) left out"),
        ("per_token = 2 * 40 * 8 * (5120 // 40) * 2", "per_token = 40 * 8 * (5120 // 40) * 2",
         "the tokens per sequence in 24 GiB", "the factor 2 for K and V forgotten"),
        ("per_token = 2 * 40 * 8 * (5120 // 40) * 2", "per_token = 2 * 40 * 40 * (5120 // 40) * 2",
         "the tokens per sequence in 24 GiB", "the 40 query heads cached"),
        # walk-through (round four): 1 byte per element gives the same number as K and V once
        ("per_token = 2 * 40 * 8 * (5120 // 40) * 2", "per_token = 2 * 40 * 8 * (5120 // 40) * 1",
         "the tokens per sequence in 24 GiB", "or 1 byte per element"),
        ("tokens_that_fit = (24 * 2**30) // (8 * per_token)",
         "tokens_that_fit = -(-(24 * 2**30) // (8 * per_token))",
         "the tokens per sequence in 24 GiB", "rounded up"),
        ("shift = np.where(np.isneginf(m), 0.0, m)", "shift = m", "your online-softmax merge",
         "no guard for two empty sides"),
        ("u = alpha[..., None] * a.u + beta[..., None] * b.u", "u = a.u + b.u",
         "your online-softmax merge", "u added without rescaling"),
    ],
    "04_ffn_and_positions.py": [
        ("back = -np.array([2.0, 2.0 / 100])", "back = np.array([2.0, 2.0 / 100])",
         "RoPE dx", "forward rotation used in backward"),
        ("derivative = gate + x * np.exp(-x**2 / 2) / np.sqrt(2 * np.pi)", "derivative = gate",
         "your GELU backward", "x phi(x) term dropped"),
        ("dt = (1 - gate**2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x**2)",
         "dt = (1 - gate**2) * np.sqrt(2 / np.pi) * (1 + 0.044715 * x**2)",
         "your GELU backward", "the 3 of d(x^3)/dx forgotten"),
        ("dt = (1 - gate**2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x**2)",
         "dt = (1 - gate**2) * float(np.float32(np.sqrt(2 / np.pi))) * (1 + 3 * 0.044715 * x**2)",
         "your GELU backward", "sqrt(2/pi) rounded to float32"),
        ("dx_swiglu = dg @ w_gate.T + (dm * s_act) @ w_up.T", "dx_swiglu = dg @ w_gate.T",
         "SwiGLU dx", "only the gate's path"),
        ("dg = dm * u_pre * sig * (1 + g_pre * (1 - sig))", "dg = dm * u_pre * sig * (1 - sig)",
         "SwiGLU dx", "product rule forgotten"),
        ("d_f_1000 = 64 * int(np.ceil(8 * 1000 / 3 / 64))",
         "d_f_1000 = 64 * int(np.floor(8 * 1000 / 3 / 64))", "(d_f, excess) at d = 1000",
         "rounded down to a multiple of 64"),
        ("angles = np.array([2.0, 2.0 / 100])", "angles = np.array([2.0, 2.0])",
         "RoPE of (3, 4, 1, 0) at position 2", "both pairs turned by p radians"),
        # walk-through A (issue 47): SiLU's minimum with its sign flipped, GELU' without x phi(x)
        # in the exact form only, and tanh' written 1 - t
        ("silu_min = 1 - u_one", "silu_min = u_one - 1", "the smallest value of SiLU",
         "the sign flipped"),
        ("    standard_normal_cdf(points) + points * density,\n",
         "    standard_normal_cdf(points),\n", "GELU'(0, 1, -2), exact and tanh",
         "exact form: the product rule's second term u phi(u) forgotten"),
        # 04.3 is derived now: slips inside the tanh form's chain rule
        ("0.5 * points * (1 - t**2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * points**2)",
         "0.5 * points * (1 - t**2) * np.sqrt(2 / np.pi) * (1 + 0.044715 * points**2)",
         "GELU'(0, 1, -2), exact and tanh", "the 3 of d(x^3)/dx forgotten"),
        ("0.5 * points * (1 - t**2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * points**2)",
         "0.5 * points * (1 - t) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * points**2)",
         "GELU'(0, 1, -2), exact and tanh", "tanh' written 1 - t"),
        ("dt = (1 - gate**2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x**2)",
         "dt = (1 - gate) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x**2)",
         "your GELU backward", "1 - t, not 1 - t^2"),
        # walk-through (round four): the rows swapped, sqrt(2/pi) or phi's 1/sqrt(2 pi) left out
        ("gelu_derivatives = np.stack([\n    standard_normal_cdf(points) + points * density,\n"
         "    0.5 * (1 + t) + 0.5 * points * (1 - t**2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * points**2),\n])",
         "gelu_derivatives = np.stack([\n"
         "    0.5 * (1 + t) + 0.5 * points * (1 - t**2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * points**2),\n"
         "    standard_normal_cdf(points) + points * density,\n])",
         "GELU'(0, 1, -2), exact and tanh", "the rows swapped"),
        ("0.5 * points * (1 - t**2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * points**2)",
         "0.5 * points * (1 - t**2) * (1 + 3 * 0.044715 * points**2)",
         "GELU'(0, 1, -2), exact and tanh", "the factor sqrt(2/pi) of the inner derivative"),
        ("density = np.exp(-points**2 / 2) / np.sqrt(2 * np.pi)", "density = np.exp(-points**2 / 2)",
         "GELU'(0, 1, -2), exact and tanh", "phi(u) without its 1/sqrt(2 pi)"),
    ],
    "05_losses_and_optimisers.py": [
        ("v_hat_after_two = v2 / (1 - 0.999**2)", "v_hat_after_two = v2",
         "v_hat after two steps", "without its bias correction"),
        ("dlogits_by_hand = (p - np.eye(4)[targets]) / 3", "dlogits_by_hand = p - np.eye(4)[targets]",
         "dloss/dlogits", "not divided by the number of positions"),
        ("sft_sum_by_hand = -np.sum(answer_mask * np.log(sft_p[np.arange(6), sft_targets]))",
         "sft_sum_by_hand = -np.sum(answer_mask * np.log(sft_p[np.arange(6), sft_targets])) / 3",
         "the summed SFT loss", "the mean over the answer tokens"),
        ("m_hat1, v_hat1 = (1 - 0.9) * g1 / (1 - 0.9), (1 - 0.999) * g1**2 / (1 - 0.999)",
         "m_hat1, v_hat1 = (1 - 0.9) * g1, (1 - 0.999) * g1**2",
         "theta after one Adam step", "bias correction missing"),
        # walk-through A (issue 47): the cosine's phase measured from step 0
        ("schedule_values = (512**-0.5 * 4000**-0.5, 3e-5 + 0.5 * (3e-4 - 3e-5))",
         "schedule_values = (512**-0.5 * 4000**-0.5,\n"
         "                   3e-5 + 0.5 * (3e-4 - 3e-5) * (1 + np.cos(np.pi * 11000 / 20000)))",
         "(peak, half-way rate)", "the warm-up not subtracted"),
        ("adamw_after_200 = (1 - 0.1 * 0.1) ** 200", "adamw_after_200 = (1 - 0.1 * 0.1) ** 199",
         "AdamW's weight after 200 steps", "(n - 1): one step too few"),
        ("adamw_after_200 = (1 - 0.1 * 0.1) ** 200", "adamw_after_200 = (1 - 0.1) ** 200",
         "AdamW's weight after 200 steps", "decay not scaled by the learning rate"),
        ("theta_after_one_step = np.array([1.0, -2.0]) - 0.1 * m_hat1 / (np.sqrt(v_hat1) + 1e-8)",
         "theta_after_one_step = np.array([1.0, -2.0]) - 0.1 * m_hat1 / np.sqrt(v_hat1)",
         "theta after one Adam step", "eps left out of the denominator"),
        ("per_token = per_token / max(cache.n_counted, 1)",
         "per_token = per_token / max(cache.n_counted, 2)", "your cross-entropy backward",
         "mean over max(n, 2)"),
        ("dlogits = dout * np.where(cache.counted[..., None], per_token, 0.0)",
         "dlogits = dout * per_token", "your cross-entropy backward", "ignored tokens get a gradient"),
        ("m_hat, v_hat = new_m / (1 - beta1**s), new_v / (1 - beta2**s)", "m_hat, v_hat = new_m, new_v",
         "your AdamW step", "bias correction missing"),
        ("new_theta = (1 - lr * weight_decay) * theta - lr * m_hat / (np.sqrt(v_hat) + eps)",
         "new_theta = (1 - weight_decay) * theta - lr * m_hat / (np.sqrt(v_hat) + eps)",
         "your AdamW step", "decay not scaled by the learning rate"),
        ("new_theta = (1 - lr * weight_decay) * theta - lr * m_hat / (np.sqrt(v_hat) + eps)",
         "new_theta = (1 - lr * weight_decay) * (theta - lr * m_hat / (np.sqrt(v_hat) + eps))",
         "your AdamW step", "the decay applied after the Adam step"),
        ("    return new_theta, new_m, new_v\n", "    return new_theta, m_hat, v_hat\n",
         "your AdamW step", "m_hat and v_hat kept as the moments"),
    ],
    "06_encoder_decoder.py": [
        ("shifted_by_hand = np.concatenate([np.full((2, 1), bos), targets_2[:, :-1]], axis=1)",
         "shifted_by_hand = targets_2", "shifted decoder input", "not shifted"),
        ("p_target = p[0, np.arange(4), tgt[0]].prod()", "p_target = p[0, np.arange(4), tgt[0]].mean()",
         "p(y | x)", "the mean of the probabilities"),
        ("np.add.at(d_table, ids, dy)", "d_table[ids] += dy", "dE", "repeated ids keep one contribution"),
        # 06.3 derives the gradient of a smoothed cross-entropy, for tensor2tensor's target
        ("dz_t2t = p[0] - q_t2t", "dz_t2t = q_t2t", "dloss/dz for tensor2tensor's target",
         "target q itself, not the gradient"),
        ("dz_t2t = p[0] - q_t2t", "dz_t2t = p[0] - np.eye(V)[0]", "dloss/dz for tensor2tensor's target",
         "the smoothing left out"),
        ("shifted_by_hand = np.concatenate([np.full((2, 1), bos), targets_2[:, :-1]], axis=1)",
         "shifted_by_hand = np.concatenate([np.full((2, 1), bos), targets_2[:, 1:]], axis=1)",
         "shifted decoder input", "the first target token dropped, not the last"),
        ("p_target = p[0, np.arange(4), tgt[0]].prod()", "p_target = p[0, np.arange(4), dec_in[0]].prod()",
         "p(y | x)", "read at the decoder input"),
        # the walk-through's wrong answer that passed: no analytic gradient at all
        ("analytic_wq = grads[name].reshape(-1)[coords_wq]", "analytic_wq = numeric_wq.copy()",
         "(numeric, analytic) dW_Q at coords_wq", "the numerical gradient copied as the analytic one"),
        ("q = (1 - eps) * np.eye(vocab)[cache.targets] + eps / vocab",
         "q = (1 - eps) * np.eye(vocab)[cache.targets]", "your smoothed cross-entropy backward",
         "label smoothing left out of the gradient"),
        ("q = (1 - eps) * np.eye(vocab)[cache.targets] + eps / vocab",
         "q = np.eye(vocab)[cache.targets]", "your smoothed cross-entropy backward",
         "no smoothing at all"),
        ("q = (1 - eps) * np.eye(vocab)[cache.targets] + eps / vocab",
         "q = (1 - eps) * np.eye(vocab)[cache.targets] + (1 - np.eye(vocab)[cache.targets]) * eps / "
         "max(vocab - 1, 1)", "your smoothed cross-entropy backward", "tensor2tensor's target"),
        ("q = (1 - eps) * np.eye(vocab)[cache.targets] + eps / vocab",
         "q = np.eye(vocab)[cache.targets] + eps / vocab", "your smoothed cross-entropy backward",
         "1 - eps dropped from the smoothed target"),
    ],
    "07_gpt.py": [
        ("dP[1:3] = dy.sum(axis=0)", "dP[1:3] = dy.mean(axis=0)", "dP", "averaged over the batch"),
        ("dP[1:3] = dy.sum(axis=0)", "dP[0:2] = dy.sum(axis=0)", "dP", "offset ignored"),
        ("inputs_and_targets = (windows[:, :-1], windows[:, 1:])",
         "inputs_and_targets = (windows[:, 1:], windows[:, :-1])",
         "(inputs, targets)", "shifted the wrong way"),
        ("inputs_and_targets = (windows[:, :-1], windows[:, 1:])",
         "inputs_and_targets = (windows[:, :-1], windows[:, :-1])", "(inputs, targets)", "not shifted"),
        ("inputs_and_targets = (windows[:, :-1], windows[:, 1:])",
         "inputs_and_targets = (windows[:, :-1], stream[starts[:, None] + 2 + np.arange(context)])",
         "(inputs, targets)", "the targets two tokens ahead"),
        ('"targets": batch["targets"][:, :n],\n              "loss_mask": last_only}',
         '"targets": batch["targets"][:, :n]}', "mean of the prefix losses", "no loss mask"),
        ("sft_loss = -picked.sum()", "sft_loss = -picked.mean()", "the SFT loss",
         "the mean over the answer, not the sum"),
        ("gpt2_by_hand = V * d + T_ctx * d + L * per_layer + 2 * d",
         "gpt2_by_hand = V * d + L * per_layer + 2 * d", "GPT-2 small parameters",
         "the position table forgotten"),
        ("decay = WD if takes_weight_decay(name) else 0.0", "decay = WD", "your AdamW step",
         "the decay applied to every parameter"),
        ("m_hat, v_hat = new_m / (1 - beta1**s), new_v / (1 - beta2**s)", "m_hat, v_hat = new_m, new_v",
         "your AdamW step", "bias correction missing"),
        ("new_theta = theta * (1 - LR * decay) - LR * m_hat / (np.sqrt(v_hat) + EPS)",
         "new_theta = theta * (1 - LR * decay) - LR * m_hat / np.sqrt(v_hat + EPS)",
         "your AdamW step", "eps inside the square root"),
        ("m_hat, v_hat = new_m / (1 - beta1**s), new_v / (1 - beta2**s)",
         "m_hat, v_hat = new_m / (1 - beta1**(s + 1)), new_v / (1 - beta2**(s + 1))",
         "your AdamW step", "the bias correction one step ahead"),
        # walk-through (round four): the starts read as 1-based
        ("windows = stream[starts[:, None] + np.arange(context + 1)]",
         "windows = stream[starts[:, None] - 1 + np.arange(context + 1)]", "(inputs, targets)",
         "the starts read as 1-based"),
    ],
    "08_modern_decoder_and_gqa.py": [
        ("dk_shared = per_head.reshape(B, G, H // G, T, D).sum(axis=2)",
         "dk_shared = per_head.reshape(B, G, H // G, T, D).mean(axis=2)",
         "dK of the shared heads", "the mean over the sharing query heads"),
        ("dk_shared = per_head.reshape(B, G, H // G, T, D).sum(axis=2)",
         "dk_shared = per_head[:, ::2]",
         "dK of the shared heads", "one query head's copy only"),
        ("(1 - gamma) * w / 8 + gamma * w", "gamma * w / 8 + (1 - gamma) * w", "llama3 frequencies",
         "the blend's weights exchanged"),
        # 08.4-08.7 make the student derive: the head map, the counts, gamma, the cap's order and slope
        ("dk_shared = per_head.reshape(B, G, H // G, T, D).sum(axis=2)",
         "dk_shared = per_head.reshape(B, H // G, G, T, D).sum(axis=1)",
         "dK of the shared heads", "grouped as r mod g"),
        ("cache_equals_weights_at = 2 * 41_943_040 / (2 * 8 * 128 * 2)",
         "cache_equals_weights_at = 41_943_040 / (2 * 8 * 128 * 2)",
         "the context where the cache equals the weights", "counted in numbers"),
        ("cache_bytes_by_hand = 2 * 8192 * 8 * 128 * 2", "cache_bytes_by_hand = 2 * 8192 * 32 * 128 * 2",
         "cache bytes", "MHA's cache"),
        ("gamma = (32 / lam - 1) / (4 - 1)", "gamma = (32 - lam) / (32 - 8)", "llama3 frequencies",
         "linear in the wavelength"),
        ("capped = 50.0 * np.tanh(scaled / 50.0) + np.array([0.0, 0.0, 0.0, -np.inf])",
         "capped = 50.0 * np.tanh((scaled + np.array([0.0, 0.0, 0.0, -np.inf])) / 50.0)",
         "the capped scores", "the mask added before the cap"),
        ("scaled = dots / np.sqrt(4)", "scaled = dots", "the capped scores", "no 1/sqrt(d_k) scale"),
        # walk-through (round four): RoPE's s = 8 read as the score scale, the mask as a finite
        # number or left out, an extra 1/c in the slope, the frequencies rounded to a print's digits
        ("scaled = dots / np.sqrt(4)", "scaled = dots / np.sqrt(8)", "the capped scores",
         "the scale 1/sqrt(8), RoPE's factor s"),
        ("capped = 50.0 * np.tanh(scaled / 50.0) + np.array([0.0, 0.0, 0.0, -np.inf])",
         "capped = 50.0 * np.tanh(scaled / 50.0) + np.array([0.0, 0.0, 0.0, -1e9])",
         "the capped scores", "not a large finite number"),
        ("capped = 50.0 * np.tanh(scaled / 50.0) + np.array([0.0, 0.0, 0.0, -np.inf])",
         "capped = 50.0 * np.tanh(scaled / 50.0)", "the capped scores", "the mask not applied"),
        ("slope = np.array([1.0, 1.0, 1.0, 0.0]) * (1.0 - np.tanh(scaled / 50.0) ** 2) / np.sqrt(4)",
         "slope = np.array([1.0, 1.0, 1.0, 0.0]) * (1.0 - np.tanh(scaled / 50.0) ** 2) / np.sqrt(4) / 50",
         "the slopes", "an extra 1/c"),
        ("llama3_by_hand = np.where(lam < 8, w, np.where(lam > 32, w / 8, (1 - gamma) * w / 8 + gamma * w))",
         "llama3_by_hand = np.round(np.where(lam < 8, w, np.where(lam > 32, w / 8, (1 - gamma) * w / 8 + gamma * w)), 4)",
         "llama3 frequencies", "rounded to 4 decimals"),
        ("slope = np.array([1.0, 1.0, 1.0, 0.0]) * (1.0 - np.tanh(scaled / 50.0) ** 2) / np.sqrt(4)",
         "slope = np.array([1.0, 1.0, 1.0, 0.0]) * (1.0 - np.tanh(scaled / 50.0) ** 2)",
         "the slopes", "the 1/sqrt(d_k) of the chain rule left out"),
        ("du = dm * s\n", "du = dm * g\n", "your SwiGLU backward", "du uses the gate's input"),
        ("dg = dm * u * sig * (1 + g * (1 - sig))", "dg = dm * u * sig * (1 - sig)",
         "your SwiGLU backward", "product rule forgotten"),
        ("dx = dg @ cache.w_gate.T + du @ cache.w_up.T", "dx = dg @ cache.w_gate.T",
         "your SwiGLU backward", "dx from the gate's path only"),
    ],
    "09_numerics_and_sampling.py": [
        ("safe_max = np.where(np.isneginf(row_max), 0.0, row_max)  # a fully masked row: shift by 0\n"
         "e = np.exp(rows - safe_max)\n"
         "sums = e.sum(axis=1, keepdims=True)\n"
         "stable_rows = np.divide(e, sums, out=np.zeros_like(e), where=sums > 0)",
         "e = np.exp(rows - row_max)\nstable_rows = e / e.sum(axis=1, keepdims=True)",
         "stable softmax rows", "NaN for the fully masked row"),
        ("x_sum_overflows = np.log(65504) - np.log(1 + np.exp(-1) + np.exp(-2))",
         "x_sum_overflows = np.log(65504)", "x where the float16 sum overflows",
         "the other two terms of the sum"),
        ("pairs_by_formula = 4 * 5 // 2 + (10 - 4) * 4", "pairs_by_formula = 10 * 4",
         "visible pairs, T = 10, w = 4", "T w: the first w - 1 rows"),
        ("pairs_by_formula = 4 * 5 // 2 + (10 - 4) * 4", "pairs_by_formula = 4 * 3 // 2 + (10 - 4) * 4",
         "visible pairs, T = 10, w = 4", "w (w - 1) / 2 for the first rows"),
        ("top_p_by_hand = np.array([0.0, 0.4, 0.0, 0.3]) / 0.7",
         "top_p_by_hand = np.array([0.4, 0.3, 0.0, 0.0]) / 0.7", "top-p, p = 0.6",
         "left in sorted order"),
        ("x_sum_overflows = np.log(65504) - np.log(1 + np.exp(-1) + np.exp(-2))",
         "x_sum_overflows = 10.7", "x where the float16 sum overflows", "read off the figure"),
        ("top_p_by_hand = np.array([0.0, 0.4, 0.0, 0.3]) / 0.7",
         "top_p_by_hand = np.array([0.0, 0.4, 0.0, 0.3])", "top-p, p = 0.6", "not renormalised"),
        ("keep[order[mass_before < p]] = True", "keep[order[mass_before <= p]] = True",
         "your top-p filter", "the test is mass before < p, not <="),
        ("mass_before = np.cumsum(probs[order]) - probs[order]",
         "mass_before = np.cumsum(probs[order])", "your top-p filter",
         "the token whose mass crosses p dropped"),
    ],
    "10_decode_cost.py": [
        ("seconds_per_token = (2 * 7_504_658_432 + 8192 * 128 * 1024) / 2e12",
         "seconds_per_token = 2 * 7_504_658_432 / 2e12", "lower bound on time per token",
         "the cache forgotten"),
        ("scale_by_hand = 3.5 / 7", "scale_by_hand = 3.5 / 8", "scale", "-7 .. 7, not -8 .. 7"),
        ("visible = np.arange(T_max)[None, None, :] < np.asarray(lengths)[:, None, None]",
         "visible = np.ones((B, 1, T_max), dtype=bool)", "your decode attention", "the padding read"),
        ("heads = np.arange(H) // (H // G)", "heads = np.arange(H) % G", "your decode attention",
         "GQA heads interleaved"),
        ("q8_bytes_per_token = (layer_weights + d * V) * 34 / 32 + 4 * ((2 * L + 1) * d + d)",
         "q8_bytes_per_token = (layer_weights + d * V) * 1 + 4 * ((2 * L + 1) * d + d)",
         "weight bytes a token reads in Q8_0", "scale of each block of 32 forgotten"),
        ("q8_bytes_per_token = (layer_weights + d * V) * 34 / 32 + 4 * ((2 * L + 1) * d + d)",
         "q8_bytes_per_token = layer_weights * 34 / 32 + 4 * (d * V + (2 * L + 1) * d + d)",
         "weight bytes a token reads in Q8_0", "the head left in float32"),
        ("q8_bound = given_bandwidth / q8_bytes_per_token",
         "q8_bound = q8_bytes_per_token / given_bandwidth", "the bound in tokens/s in Q8_0",
         "seconds per token"),
        # the slips the walk-through (walkb) found unnamed
        ('u, _ = rmsnorm_forward(params["tok_emb"][tokens], params["layers.0.ln1.gamma"], '
         'config.norm_eps)', 'u = params["tok_emb"][tokens]', "cached keys of layer 0",
         "no RMSNorm before W_K"),
        ("visible = np.arange(T_max)[None, None, :] < np.asarray(lengths)[:, None, None]",
         "visible = np.arange(T_max)[None, None, :] <= np.asarray(lengths)[:, None, None]",
         "your decode attention", "the mask t <= length"),
        ("x_hat_by_hand = scale_by_hand * np.clip(np.round(x / scale_by_hand), -7, 7)",
         "x_hat_by_hand = 3.5 / 8 * np.clip(np.round(x / (3.5 / 8)), -8, 8)", "x_hat",
         "x_hat from the scale max |x| / 8"),
        ("error_by_hand = np.abs(x - x_hat_by_hand)", "error_by_hand = x - x_hat_by_hand",
         "the error |x - x_hat|, at most half a step", "the signed error"),
    ],
    "12_from_equation_to_kernel.py": [
        ("bound_o = 2 * numpy_error + 4 * U32 * np.abs(vg).max()", "bound_o = 2 * numpy_error",
         "the rule's bound on o", "the floor 4 u M left out"),
        ("bound_o = 2 * numpy_error + 4 * U32 * np.abs(vg).max()",
         "bound_o = 2 * numpy_error + 4 * 2.0**-23 * np.abs(vg).max()",
         "the rule's bound on o", "u = 2^-23"),
        ("floats = 128 * 128 + 2 * 128 * 128 + 3 * 128 + 2 * 128 * 128",
         "floats = 128 * 128 + 2 * 128 * 128 + 3 * 128 + 128 * 128",
         "scratch bytes per thread at D = 128", "one of the 128 x 128 buffers left out"),
        # a forgotten P V is the same number, and must get the same name, not "Vs"
        ("floats = 128 * 128 + 2 * 128 * 128 + 3 * 128 + 2 * 128 * 128",
         "floats = 128 * 128 + 128 * 128 + 3 * 128 + 2 * 128 * 128",
         "scratch bytes per thread at D = 128", "(U, PV, KT or Vs)"),
        ("scratch_128 = 4 * (-(-floats // 16) * 16)", "scratch_128 = -(-floats // 16) * 16",
         "scratch bytes per thread at D = 128", "float32 numbers, not bytes"),
        ("chunk = -(-n // splits)\n", "chunk = n // splits\n", "your split-K decode",
         "the last keys dropped"),
        ("alpha = np.exp(np.array(m_s) - max(m_s))", "alpha = np.ones(splits)",
         "your split-K decode", "without rescaling to the largest m"),
        ("split_scores = k[lo:hi] @ q / np.sqrt(d)", "split_scores = k[lo:hi] @ q",
         "your split-K decode", "no 1/sqrt(D) scale"),
        ("splits_a = max(1, min(-(-8 * 16 // (3 * 8)), 32768 // 512))",
         "splits_a = max(1, min(8 * 16 // (3 * 8), 32768 // 512))",
         "the splits chosen for (a) and (b)", "rounded down"),
        ("splits_b = max(1, min(-(-8 * 16 // (1 * 1)), 4096 // 512))",
         "splits_b = -(-8 * 16 // (1 * 1))", "the splits chosen for (a) and (b)",
         "the 512-key floor ignored"),
    ],
    "13_real_weights.py": [
        ("as_float32 = (patterns.astype(np.uint32) << 16).view(np.float32)",
         "as_float32 = patterns.view(np.float16).astype(np.float32)",
         "the bfloat16 patterns as numbers", "read as float16"),
        ("gpt2_count = 50257 * dg + 1024 * dg + 12 * gpt2_layer + 2 * dg",
         "gpt2_count = 50257 * dg + 12 * gpt2_layer + 2 * dg",
         "GPT-2 small's parameter count", "the position table forgotten"),
        ("gpt2_float32_mib = 4 * gpt2_count / 2**20", "gpt2_float32_mib = 4 * gpt2_count / 1e6",
         "GPT-2 small in float32, MiB", "MB (10^6 bytes)"),
        ("rows = (np.arange(heads)[:, None] * d_h + one_head[None, :]).reshape(-1)",
         "rows = np.arange(heads * d_h)", "W_Q from q_proj.weight", "unpermuted"),
        ("within = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)",
         "within = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])",
         "your half_to_interleaved", "not its inverse"),
        ("f.seek(8 + n + begin)\n    embedding = np.frombuffer",
         "f.seek(begin)\n    embedding = np.frombuffer", "the embedding read from the file",
         "counted from the start of the file"),
        ("out = w[..., columns]", "out = w", "your half_to_interleaved", "left in the half layout"),
    ],
    "14_synthesis.py": [
        ("O, _ = sdpa_forward(Q, K[:, shared], V[:, shared], mask=causal_mask(T))",
         "O, _ = sdpa_forward(Q, K[:, shared], V[:, shared], mask=causal_mask(T), scale=1.0)",
         "logits of the whole decoder", "the 1/sqrt(d_k) scale missing"),
        ("tokens = context if shape.sliding_window is None else min(context, shape.sliding_window)",
         "tokens = context", "your cache bytes", "the sliding window ignored"),
        ("total = numbers * bits / 8 + 2 * numbers / 32", "total = numbers * bits / 8",
         "your cache bytes", "the quantisation scales left out"),
        ('twin_w_k = params["layers.0.attn.w_k"].reshape(d, config.kv_heads, d_h)[:, repeat].reshape(d, -1)',
         'twin_w_k = np.tile(params["layers.0.attn.w_k"], (1, config.n_heads // config.kv_heads))',
         "layer 0's w_k of the MHA twin", "interleaved (np.tile)"),
    ],
    "15_mixture_of_experts.py": [
        ("\nexpert = 3 * 256 * 512", "\nexpert = 2 * 256 * 512", "the total",
         "2 d d_e per expert"),
        (PROBS_15, "probs_by_hand = np.exp(worked_logits) / np.exp(worked_logits).sum(axis=0)",
         "the probabilities", "the softmax over the wrong axis"),
        ("top2_by_hand = np.array([[0, 1], [3, 2], [1, 2], [0, 1]])",
         "top2_by_hand = np.array([[1, 2], [4, 3], [2, 3], [1, 2]])", "the top-2 experts",
         "experts numbered from 1"),
        (PROBS_15, PROBS_15.split(" / ")[0],
         "the probabilities", "without dividing by its sum"),
        ("top2_by_hand = np.array([[0, 1], [3, 2], [1, 2], [0, 1]])",
         "top2_by_hand = np.array([[0, 1], [3, 2], [2, 1], [3, 2]])",
         "the top-2 experts", "ties go to the higher index"),
        ("gates_by_hand = np.array([[2 / 3, 1 / 3], [2 / 3, 1 / 3], [1 / 2, 1 / 2], [1 / 2, 1 / 2]])",
         "gates_by_hand = np.array([[1 / 2, 1 / 4], [1 / 2, 1 / 4], [3 / 8, 3 / 8], [1 / 4, 1 / 4]])",
         "the gates", "not renormalised"),
        # the write-the-function exercise: the gates' backward
        ("dg = dgates * cache.scaling", "dg = dgates", "your gates backward",
         "scaling left out of the backward"),
        ("dg = (dg - np.sum(dg * cache.chosen, axis=-1, keepdims=True) / d_sum) / d_sum",
         "dg = dg / d_sum", "your gates backward", "renormalisation's Jacobian dropped"),
        ("dg = (dg - np.sum(dg * cache.chosen, axis=-1, keepdims=True) / d_sum) / d_sum",
         "dg = dg - np.sum(dg * cache.chosen, axis=-1, keepdims=True) / d_sum",
         "your gates backward", "the outer 1/D forgotten"),
        ("load6_by_hand = np.array([4, 4, 3, 1])", "load6_by_hand = np.array([3, 2, 0, 1])",
         "the load", "the first choice only"),
        ("f6 = 4 / (2 * 6) * load6_by_hand", "f6 = load6_by_hand", "L_ExpBal", "without E / (k N)"),
        ("f6 = 4 / (2 * 6) * load6_by_hand", "f6 = 4 / 6 * load6_by_hand", "L_ExpBal",
         "k times DeepSeek's"),
        ("bias_after_by_hand = bias_before - 0.001 * np.array([1.0, -1.0, 0.0, 0.0])",
         "bias_after_by_hand = bias_before + 0.001 * np.array([1.0, -1.0, 0.0, 0.0])",
         "the biases after one update", "the sign flipped"),
        ("per_layer = 4 * 256**2 + 2 * 256 + 256 * 8 + 8 * expert + expert",
         "per_layer = 4 * 256**2 + 2 * 256 + 256 * 8 + 8 * expert", "the total",
         "the shared expert forgotten"),
        ("toy_active = toy_total - 4 * (8 - 2) * expert", "toy_active = toy_total - 4 * 8 * expert",
         "the active parameters", "the k chosen ones too"),
        ("bytes_64_devices = 2 * 8 * (1 - 1 / 64) * 7168 * 2",
         "bytes_64_devices = 8 * (1 - 1 / 64) * 7168 * 2", "bytes on 64 devices", "one way only"),
        ("bytes_node_limited = 2 * min(8, 4) * (1 - 1 / 8) * 7168 * 2",
         "bytes_node_limited = 2 * 8 * (1 - 1 / 8) * 7168 * 2", "bytes, node-limited", "k sends"),
    ],
    "16_capstone.py": [
        # Adam's steps do not change when one parameter's gradient is scaled: the model still
        # learns with either slip, and only the checks see them
        ("    dbeta = np.sum(dout, axis=rows)\n", "    dbeta = np.mean(dout, axis=rows)\n",
         "your LayerNorm backward", "dbeta averaged over rows"),
        ("per_token = per_token / max(cache.n_counted, 1)",
         "per_token = per_token / max(cache.n_counted, 2)", "your cross-entropy backward",
         "mean over max(n, 2)"),
    ],
    "11_latent_attention_and_memory.py": [
        ("smallest_d_c = (np.linalg.matrix_rank(mha_w_k), np.linalg.matrix_rank(factored_w_k))",
         "smallest_d_c = (mha_w_k.shape[1], factored_w_k.shape[1])",
         "the smallest exact latent widths", "not their ranks"),
        ("mha_numbers = 2 * 128 * 128", "mha_numbers = 128 * 128", "MHA numbers per token and layer",
         "K or V only"),
        ("mla_numbers = 512 + 64", "mla_numbers = 512", "MLA numbers per token and layer",
         "the shared rotary key"),
        ("kv_heads_like_mla = mla_numbers / (2 * 128)", "kv_heads_like_mla = mla_numbers / 128",
         "GQA key/value heads that cache as much as MLA", "the factor 2 forgotten"),
        ("largest_served = 80e9 / (2 * 1.2)", "largest_served = 80e9 / 2",
         "the largest P served on 80 GB", "the 20% allowance forgotten"),
        ("train_bytes_bf16_moments = (2 + 2 + 4 + 2 * 2) * 1000",
         "train_bytes_bf16_moments = (2 + 2 + 4 + 2) * 1000",
         "AdamW training state with bf16 moments", "counted as one moment"),
        ("pages_unshared = 16 * (full_pages + part_full)", "pages_unshared = 16 * full_pages",
         "pages without sharing", "16 x floor(1000 / 16)"),
        ("scores = (q_hat @ c.T + q_r @ k_r.T) / np.sqrt(q_c.shape[-1] + q_r.shape[-1])",
         "scores = (q_hat @ c.T + q_r @ k_r.T) / np.sqrt(q_c.shape[-1])",
         "your absorbed MLA decode", "the rotary width counts too"),
        ('out = np.einsum("hc,hcv->hv", weights @ c, w_uv)', "out = weights @ c",
         "your absorbed MLA decode", "W_UV forgotten"),
    ],
}

# Checks that judge a property of the same answer as the named check.
ALSO = {"RoPE dx": ("rotating your dx forward gives dy back",),
        "RMSNorm dx": ("your RMSNorm dx is orthogonal to x",),
        "dK of the shared heads": ("your dK holds all of the per-head gradient",),
        # 08.7's slopes are taken at the scaled scores of 08.7a
        "the capped scores": ("the slopes",),
        # answers computed from the planted one inherit its slip
        "scale": ("x_hat", "the error |x - x_hat|, at most half a step"),
        "x_hat": ("the error |x - x_hat|, at most half a step",),
        "MLA numbers per token and layer": ("GQA key/value heads that cache as much as MLA",),
        "GQA key/value heads that cache as much as MLA": ("MLA numbers per token and layer",),
        "W_Q from q_proj.weight": ("W_K from k_proj.weight",),
        "GPT-2 small's parameter count": ("GPT-2 small in float32, MiB",),
        "the load": ("L_ExpBal",),
        "the total": ("the active parameters",),
        "weight bytes a token reads in Q8_0": ("the bound in tokens/s in Q8_0",),
        # the capstone's model runs with the student's LayerNorm backward
        "your LayerNorm backward": ("the gradient check of the whole model, with your backward passes",
                                    "your model's gradients against the library's"),
        "your model's gradients against the library's": (
            "your LayerNorm backward", "the gradient check of the whole model, with your backward passes")}


def _apart(a, b):
    """Whether two plants can share a run: they judge different checks, neither computed from the
    other's answer."""
    return a[2] != b[2] and a[2] not in ALSO.get(b[2], ()) and b[2] not in ALSO.get(a[2], ())


def _rounds(plants):
    """The plants in runs of one plant per exercise check (two slips of one answer, or of two
    answers one computed from the other, go in separate runs)."""
    rounds = []
    for plant in plants:
        for batch in rounds:
            if all(_apart(p, plant) for p in batch):
                batch.append(plant)
                break
        else:
            rounds.append([plant])
    return rounds


@pytest.mark.parametrize("lesson", sorted(PLANTS))
def test_planted_slips_are_rejected_and_named(lesson, tmp_path):
    original = (NOTEBOOKS / lesson).read_text()
    for batch in _rounds(PLANTS[lesson]):
        text = original
        for right, slip, _, _ in batch:
            assert text.count(right) == 1, f"{lesson}: the solution line {right!r} has changed"
            text = text.replace(right, slip)
        run = run_lesson(text, tmp_path, lesson)
        assert run.returncode == 0, f"{lesson}: the planted lesson fails:\n{run.stderr[-2000:]}"
        verdicts = [line for line in run.stdout.splitlines()
                    if line.startswith(("right: ", "wrong: ", "almost: ", "no answer yet: "))]
        for _, slip, check, words in batch:
            said = [v for v in verdicts if v.startswith(f"wrong: {check}: ")]
            assert said, f"{lesson}: planting {slip!r}, check {check!r} did not say wrong: {verdicts}"
            assert "looks like: " in said[0] and words in said[0], \
                f"{lesson}: planting {slip!r}, the check said {said[0]!r}, not the slip {words!r}"
        # a property check of the same answer (check_true(..., of=answer)) may say wrong as well
        judged = {check for _, _, check, _ in batch} | {c for plant in batch for c in ALSO.get(plant[2], ())}
        others = [v for v in verdicts if not any(v.startswith(f"wrong: {c}: ") for c in judged)]
        assert all(v.startswith("right: ") for v in others), \
            f"{lesson}: checks of unplanted exercises that are not right: " \
            f"{[v for v in others if not v.startswith('right: ')]}"


def test_the_plants_cover_the_lessons_with_slips():
    # Lessons 01-03, 05-07, 09, 12, 13 and 15 carry three planted slips or more; 04, 08, 10, 11
    # and 14 fewer, for fewer of their exercises have a typical slip.
    for lesson, plants in PLANTS.items():
        wanted = 3 if lesson[:2] in ("01", "02", "03", "05", "06", "07", "09", "12", "13",
                                     "15") else 1
        assert len(plants) >= wanted, lesson
    # a lesson's slips live in refmath.lessons.expected, keyed by its exercises' numbers (or, for
    # lesson 10 still, in its check cell)
    from refmath.lessons.table import EXERCISES

    numbered = {number[:2] for number in EXERCISES}
    with_slips = {p.name for p in NOTEBOOKS.glob("[0-9]*.py")
                  if "slips=" in p.read_text() or p.name[:2] in numbered}
    assert with_slips == set(PLANTS), f"lessons with slips but no plants: {with_slips - set(PLANTS)}"


# ---- the slips of single exercises, judged directly ------------------------------------------------
#
# Each exercise below is checked as its lesson checks it, ``check("NN.k", answer)``, with inputs made
# here under the names the lesson uses; every wrong answer is written by hand the way a student with
# the slip would write it, and must be rejected with the slip's name, and the right answer, written
# by hand as well, accepted.

@pytest.fixture
def judged(said):
    """``judged(number, right, wrongs, inputs)``: ``right`` is accepted, in strict mode too (which
    also feeds every slip of the exercise to its check), and each of ``wrongs``, ``{words of the
    slip's name: answer}``, named."""
    def judged(number, right, wrongs, inputs):
        assert said(number, right, inputs, strict=True).startswith("right: ")
        for words, answer in wrongs.items():
            line = said(number, answer, inputs)
            assert line.startswith("wrong: ") and "looks like: " in line and words in line, (words, line)

    return judged


def test_swiglu_dx_slips_are_named(judged):
    from refmath.ffn import swiglu_forward

    rng = np.random.default_rng(3)
    xs = rng.standard_normal((2, 3))
    w_gate, w_up, w_down = (rng.standard_normal(s) for s in ((3, 4), (3, 4), (4, 3)))
    y, swiglu_cache = swiglu_forward(xs, w_gate, w_up, w_down)
    dy = rng.standard_normal(y.shape)
    g, u = xs @ w_gate, xs @ w_up
    sig = 1 / (1 + np.exp(-g))
    dm = dy @ w_down.T
    dg = dm * u * sig * (1 + g * (1 - sig))
    du = dm * g * sig
    judged("04.5", dg @ w_gate.T + du @ w_up.T, {
        "du uses the gate's input": dg @ w_gate.T + (dm * g) @ w_up.T,
        "product rule forgotten": (dm * u * sig * (1 - sig)) @ w_gate.T + du @ w_up.T,
        "SiLU'(g) taken as sigma(g)": (dm * u * sig) @ w_gate.T + du @ w_up.T,
        "only the gate's path": dg @ w_gate.T,
        "only the up projection's path": du @ w_up.T,
    }, {"dy": dy, "swiglu_cache": swiglu_cache})


def test_swiglu_width_slips_are_named(judged):
    def excess(d_f, matrices=3):
        return matrices * 1000 * d_f / (2 * 1000 * 4000) - 1

    judged("04.6", (2688, excess(2688)), {
        "rounded down to a multiple of 64": (2624, excess(2624)),
        "a multiple of 256": (2816, excess(2816)),
        "in percent": (2688, 100 * excess(2688)),
        "two matrices": (2688, excess(2688, matrices=2)),
    }, {})


def test_rope_rotation_slips_are_named(judged):
    def turned(pairs, angles):
        (x0, y0), (x1, y1) = pairs
        return [x0 * np.cos(angles[0]) - y0 * np.sin(angles[0]),
                x0 * np.sin(angles[0]) + y0 * np.cos(angles[0]),
                x1 * np.cos(angles[1]) - y1 * np.sin(angles[1]),
                x1 * np.sin(angles[1]) + y1 * np.cos(angles[1])]

    neighbours, theta = [(3.0, 4.0), (1.0, 0.0)], [2.0, 2.0 / 100]
    halves = turned([(3.0, 1.0), (4.0, 0.0)], theta)  # (x0, x2) and (x1, x3), back in place
    judged("04.7", np.array([turned(neighbours, theta)]), {
        "the wrong way": np.array([turned(neighbours, [-2.0, -2.0 / 100])]),
        "halves layout": np.array([[halves[0], halves[2], halves[1], halves[3]]]),
        "both pairs turned by p radians": np.array([turned(neighbours, [2.0, 2.0])]),
        "the position left out": np.array([turned(neighbours, [1.0, 1.0 / 100])]),
    }, {})


def test_safetensors_reading_slips_are_named(judged, tmp_path):
    import json

    rng = np.random.default_rng(4)
    table, other = rng.standard_normal((5, 3)), rng.standard_normal(4)
    # a safetensors file written by hand: another tensor first, so the table's offsets are not 0
    header = json.dumps({"other": {"dtype": "F64", "shape": [4], "data_offsets": [0, 32]},
                         "model.embed_tokens.weight": {"dtype": "F64", "shape": [5, 3],
                                                       "data_offsets": [32, 152]}}).encode()
    weights_path = tmp_path / "model.safetensors"
    weights_path.write_bytes(len(header).to_bytes(8, "little") + header + other.astype("<f8").tobytes()
                             + table.astype("<f8").tobytes())

    def read(at, dtype="<f8"):
        with open(weights_path, "rb") as f:
            f.seek(at)
            return np.frombuffer(f.read(120), dtype=dtype).reshape(5, 3)

    n = len(header)
    assert np.array_equal(read(8 + n + 32), table)
    judged("13.1", read(8 + n + 32), {
        "counted from the start of the file": read(32),
        "not the 8 bytes that give N": read(n + 32),
        "big-endian": read(8 + n + 32, dtype=">f8"),
        "transposed": read(8 + n + 32).T,
    }, {"params": {"tok_emb": table}, "weights_path": weights_path})


def test_q8_0_bytes_and_bound_slips_are_named(judged):
    from refmath.models.decoder_config import DecoderConfig

    # a model of the lesson's kind, smaller: every count written out by hand
    config = DecoderConfig(vocab_size=64, max_seq_len=16, d_model=64, n_layers=2, n_heads=4,
                           n_kv_heads=2, d_ff=96)  # d_h = 16, so h d_h = 64 and g d_h = 32
    layers = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96)
    head = 64 * 64  # d V, stored in the format as the layers are
    rest = 4 * (5 * 64 + 64)  # 2L + 1 gains, one embedding row

    def read(per_weight, extra=0):
        return (layers + head) * per_weight + rest + extra

    q8 = read(34 / 32)
    judged("10.6", q8, {
        "the float16 scale of each block of 32 forgotten": read(1),
        "bits, not bytes": read(8.5),
        "counted for every weight": read(3),
        "the head left in float32": layers * 34 / 32 + 4 * head + rest,
        "the float32 gains and embedding row left out": (layers + head) * 34 / 32,
        "the whole embedding table counted": read(34 / 32, 4 * (64 * 64 - 64)),
        "the layers and the head left in float32": read(4),
    }, {"small_config": config})
    # a tied head: stored as a rounded copy, the lookup still one float32 row of the table
    tied = dataclasses.replace(config, tie_embeddings=True)
    judged("10.6", q8, {"the head left in float32": layers * 34 / 32 + 4 * head + 4 * 5 * 64},
           {"small_config": tied})
    beta = 1e10
    judged("10.7", beta / q8, {
        "seconds per token": q8 / beta,
        "the float32 model's bound": beta / read(4),
        "the scales forgotten": beta / read(1),
        "bits per second over bytes": 8 * beta / q8,
    }, {"small_config": config, "given_bandwidth": beta})


def test_mha_twin_slips_are_named(judged):
    from refmath.models import decoder

    config = decoder.DecoderConfig(vocab_size=32, max_seq_len=16, d_model=32, n_layers=2, n_heads=4,
                                   n_kv_heads=2, ffn_multiple_of=16)
    params = decoder.init_params(config, seed=2)
    w_k = params["layers.0.attn.w_k"]  # (32, 2 heads of 8)
    by_hand = np.concatenate([w_k[:, :8], w_k[:, :8], w_k[:, 8:], w_k[:, 8:]], axis=1)
    judged("14.2", by_hand, {
        "interleaved (np.tile)": np.tile(w_k, 2),
        "each column repeated on its own": np.repeat(w_k, 2, axis=1),
        "w_k left as it was": w_k,
    }, {"params": params, "config": config})
