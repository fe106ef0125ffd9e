"""The M4 (MLA) decoder against the same network written with PyTorch functions and autograd.

The torch side follows the catalogue's K9 form literally: the score is the SUM of a content term
``q^C k^C^T`` and a rotary term ``q^R k^R^T`` (the shared rotary key broadcast over heads), divided
by ``sqrt(d_k + d_R)``, with an explicit causal softmax; refmath instead concatenates the two parts
and calls its scaled dot-product attention once. RoPE is the complex-number form (``torch.polar``,
``torch.view_as_complex``); norms, SwiGLU and the loss are ``F.rms_norm``, ``F.silu``,
``F.linear`` (weights transposed to torch's ``out x in``) and ``F.cross_entropy``.
"""
import math

import numpy as np
import pytest

from refmath.models import mla
from refmath.models.decoder import IGNORE_INDEX
from refmath.models.mla import MLAConfig

torch = pytest.importorskip("torch", reason="PyTorch is the oracle; install the 'oracle' extra")
F = torch.nn.functional

from _torch_moe import torch_moe  # noqa: E402  (needs torch)

V, B, T = 13, 2, 6


def rope_complex(x, base, scaling=None):
    """Rotate pair ``(x_2r, x_2r+1)`` at position ``p`` by multiplying ``x_2r + i x_2r+1`` with
    ``m exp(i p omega_r)``, ``omega_r = base^(-2r/d)`` or a scaling's (its frequencies and factor
    from refmath.positions.rope_inv_freq, checked against transformers in test_positions.py);
    ``x`` is ``(..., T, d)``."""
    from refmath.positions import rope_inv_freq

    t, d = x.shape[-2:]
    freqs, m = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d), 1.0
    if scaling is not None:
        freqs, m = rope_inv_freq(d, base, scaling)
        freqs = torch.as_tensor(freqs)
    angles = torch.outer(torch.arange(t, dtype=torch.float64), freqs)
    rotation = torch.polar(torch.full_like(angles, m), angles)
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(pairs * rotation).reshape(x.shape)


def torch_mla(x, p, config):
    """Multi-head latent attention; ``p(name)`` gives the layer's ``attn.<name>`` tensor."""
    b, t, _ = x.shape
    h, d_k, d_v, eps, base = (config.n_heads, config.d_h, config.d_v, config.norm_eps,
                              config.rope_base)

    def heads(y, width):
        return y.view(b, t, h, width).transpose(1, 2)

    c = F.linear(x, p("w_dkv").T)
    if config.latent_norm:
        c = F.rms_norm(c, (config.d_c,), p("kv_norm.gamma"), eps)
    k_c = heads(F.linear(c, p("w_uk").T), d_k)
    v = heads(F.linear(c, p("w_uv").T), d_v)
    k_r = rope_complex(F.linear(x, p("w_kr").T), base, config.rope_scaling)  # (B, T, d_R), one for all heads
    if config.q_lora_rank is None:
        u, w_qc = x, p("w_q")
    else:
        u, w_qc = F.linear(x, p("w_dq").T), p("w_uq")
        if config.latent_norm:
            u = F.rms_norm(u, (config.q_lora_rank,), p("q_norm.gamma"), eps)
    q_c = heads(F.linear(u, w_qc.T), d_k)
    q_r = rope_complex(heads(F.linear(u, p("w_qr").T), config.d_rope), base, config.rope_scaling)
    s = (q_c @ k_c.transpose(-1, -2) + q_r @ k_r.unsqueeze(1).transpose(-1, -2))
    s = s / math.sqrt(d_k + config.d_rope)
    if config.rope_scaling is not None and config.rope_scaling.mscale_all_dim:
        # DeepSeek's YaRN: the softmax scale times (0.1 mscale_all_dim ln s + 1)^2
        s = s * (0.1 * config.rope_scaling.mscale_all_dim * math.log(config.rope_scaling.factor)
                 + 1) ** 2
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    a = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
    return F.linear((a @ v).transpose(1, 2).reshape(b, t, h * d_v), p("w_o").T)


def torch_decoder(P, tokens, config, drops):
    """Logits of the M4 network, and the sum of its mixture-of-experts layers' auxiliary losses
    (their layers are ``tests/_torch_moe.py``'s)."""
    x = F.embedding(tokens, P["tok_emb"])
    d, eps = config.d_model, config.norm_eps
    aux = torch.zeros((), dtype=x.dtype)
    for i in range(config.n_layers):
        def p(name):
            return P[f"layers.{i}.{name}"]

        a = torch_mla(F.rms_norm(x, (d,), p("ln1.gamma"), eps), lambda n: p("attn." + n), config)
        x = x + (a if drops[i][0] is None else a * drops[i][0])
        hn = F.rms_norm(x, (d,), p("ln2.gamma"), eps)
        if config.moe is not None and config.moe.is_moe_layer(i):
            prefix = f"layers.{i}.ffn."
            f, layer_aux = torch_moe(hn, config.moe, {name[len(prefix):]: value for name, value
                                                      in P.items() if name.startswith(prefix)})
            aux = aux + layer_aux
        else:
            f = F.linear(F.silu(F.linear(hn, p("ffn.w_gate").T)) * F.linear(hn, p("ffn.w_up").T),
                         p("ffn.w_down").T)
        x = x + (f if drops[i][1] is None else f * drops[i][1])
    x = F.rms_norm(x, (d,), P["ln_f.gamma"], eps)
    return F.linear(x, P["tok_emb"] if config.tie_embeddings else P["lm_head"].T), aux


CASES = {
    "queries from x": dict(),
    "query compression": dict(q_lora_rank=5),
    "query compression and latent norms": dict(q_lora_rank=5, latent_norm=True),
    "latent norm, tied head, dropout, loss mask, d_v = d_k": dict(latent_norm=True, v_head_dim=None,
                                                                  tie_embeddings=True, dropout=0.2),
    "YaRN with DeepSeek's mscale terms": dict(q_lora_rank=5, latent_norm=True, rope_scaling=dict(
        rope_type="yarn", factor=40.0, original_max_seq_len=4, beta_fast=4.0, beta_slow=0.5,
        mscale=0.707, mscale_all_dim=0.5)),
    "DeepSeek-V3's experts: sigmoid, grouped with a bias, shared, balance losses": dict(
        q_lora_rank=5, latent_norm=True, moe=dict(
            n_experts=8, top_k=2, d_expert=6, scoring="sigmoid", routing="noaux_tc", n_groups=4,
            topk_groups=2, n_shared=1, norm_topk=True, scaling=2.5, score_bias=True,
            first_dense=1, balance_coef=0.05, device_balance_coef=0.05, n_devices=2)),
    "DeepSeek-V2's experts: softmax, group-limited, two shared, z-loss": dict(
        latent_norm=True, moe=dict(n_experts=8, top_k=3, d_expert=6,
                                   routing="group_limited_greedy", n_groups=4, topk_groups=2,
                                   n_shared=2, scaling=1.5, z_coef=0.01)),
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_loss_logits_and_every_gradient_equal_torch_m4(overrides):
    fields = dict(vocab_size=V, max_seq_len=T, d_model=16, n_layers=2, n_heads=2, d_c=6,
                  d_rope=4, head_dim=4, v_head_dim=3, ffn_multiple_of=8, init_std=0.25)
    config = MLAConfig(**{**fields, **overrides})
    rng = np.random.default_rng(0)
    params = mla.init_params(config, seed=1)
    for name in params:
        if name.endswith(".gamma"):
            params[name] = 1.0 + 0.2 * rng.standard_normal(params[name].shape)
    batch = {"tokens": rng.integers(0, V, (B, T)), "targets": rng.integers(0, V, (B, T))}
    batch["targets"][1, 0] = IGNORE_INDEX
    train = config.dropout > 0
    if train:
        batch["loss_mask"] = (np.arange(T) >= 2).astype(np.int64)[None].repeat(B, axis=0)

    loss, cache = mla.forward(params, batch, config, train=train,
                              rng=np.random.default_rng(5) if train else None)
    grads = mla.backward(cache)
    drops = [tuple(None if m is None else torch.as_tensor(m) for m in (lc.attn.drop, lc.ffn.drop))
             for lc in cache.layers]

    P = {name: torch.tensor(value, requires_grad=True) for name, value in params.items()}
    z, aux = torch_decoder(P, torch.as_tensor(batch["tokens"]), config, drops)
    targets = torch.as_tensor(batch["targets"])
    if train:
        targets = torch.where(torch.as_tensor(batch["loss_mask"]) == 1, targets, IGNORE_INDEX)
    t_loss = (F.cross_entropy(z.reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE_INDEX)
              + aux)
    t_loss.backward()

    np.testing.assert_allclose(loss, t_loss.item(), rtol=1e-12)
    if not train:
        np.testing.assert_allclose(mla.logits(params, batch["tokens"], config), z.detach().numpy(),
                                   rtol=1e-10, atol=1e-12)
    assert set(grads) == set(P)
    for name, value in P.items():
        if name.endswith("router.bias"):  # it only chooses: no gradient reaches it in torch
            assert value.grad is None and not grads[name].any()
            continue
        np.testing.assert_allclose(grads[name], value.grad.numpy(), rtol=1e-9, atol=1e-12,
                                   err_msg=name)
