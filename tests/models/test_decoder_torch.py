"""The M3 decoder against the same network written with PyTorch functions and autograd.

The torch side is an independent formulation: RoPE as multiplication by unit complex numbers
(``torch.polar``, ``torch.view_as_complex``) instead of refmath's pairwise rotation formulas,
``F.rms_norm``, ``F.silu``, ``F.linear`` with the weights transposed to torch's ``out x in``,
``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` for the grouped heads, and
``F.cross_entropy`` with the loss mask turned into ignored targets. QK-norm (N18) is ``F.rms_norm``
over each head or the whole projection; a rope scaling (N13-N17) enters as its frequencies and
attention factor (from :func:`refmath.positions.rope_inv_freq`, which ``tests/test_positions.py``
checks against transformers' initialisers), the rotation and its gradient stay torch's.
"""
import numpy as np
import pytest

from refmath.models import decoder
from refmath.models.decoder import IGNORE_INDEX, DecoderConfig

torch = pytest.importorskip("torch", reason="PyTorch is the oracle; install the 'oracle' extra")
F = torch.nn.functional

V, B, T = 13, 2, 6


def rope_complex(x, base, scaling=None):
    """Rotate pair ``(x_2r, x_2r+1)`` at position ``p`` by multiplying ``x_2r + i x_2r+1`` with
    ``m exp(i p omega_r)``, ``omega_r = base^(-2r/d)`` or a scaling's; ``x`` is ``(..., T, d)``."""
    from refmath.positions import rope_inv_freq

    t, d = x.shape[-2:]
    freqs = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    m = 1.0
    if scaling is not None:
        freqs, m = rope_inv_freq(d, base, scaling, t)
        freqs = torch.as_tensor(freqs)
    angles = torch.outer(torch.arange(t, dtype=torch.float64), freqs)
    rotation = torch.polar(torch.full_like(angles, m), angles)
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(pairs * rotation).reshape(x.shape)


def torch_decoder(P, tokens, config, drops):
    """Logits of the M3 network from torch tensors ``P`` (refmath's names and layouts)."""
    h, g, d_h, eps = config.n_heads, config.kv_heads, config.d_h, config.norm_eps
    x = F.embedding(tokens, P["tok_emb"])
    b, t, d = x.shape
    for i in range(config.n_layers):
        def p(name):
            return P[f"layers.{i}.{name}"]

        def heads(w, n, norm=None):
            y = F.linear(hn, p(w).T)
            if config.qk_norm == "projection" and norm:
                y = F.rms_norm(y, (n * d_h,), p(norm), eps)
            y = y.view(b, t, n, d_h).transpose(1, 2)
            if config.qk_norm == "head" and norm:
                y = F.rms_norm(y, (d_h,), p(norm), eps)
            return y

        hn = F.rms_norm(x, (d,), p("ln1.gamma"), eps)
        q = rope_complex(heads("attn.w_q", h, "attn.q_norm.gamma"), config.rope_base,
                         config.rope_scaling)
        k = rope_complex(heads("attn.w_k", g, "attn.k_norm.gamma"), config.rope_base,
                         config.rope_scaling)
        o = F.scaled_dot_product_attention(q, k, heads("attn.w_v", g), is_causal=True,
                                           enable_gqa=True)
        a = F.linear(o.transpose(1, 2).reshape(b, t, h * d_h), p("attn.w_o").T)
        x = x + (a if drops[i][0] is None else a * drops[i][0])
        hn = F.rms_norm(x, (d,), p("ln2.gamma"), eps)
        f = F.linear(F.silu(F.linear(hn, p("ffn.w_gate").T)) * F.linear(hn, p("ffn.w_up").T),
                     p("ffn.w_down").T)
        x = x + (f if drops[i][1] is None else f * drops[i][1])
    x = F.rms_norm(x, (d,), P["ln_f.gamma"], eps)
    # torch's (out x in) head weight is the (V, d) embedding table itself when tied.
    return F.linear(x, P["tok_emb"] if config.tie_embeddings else P["lm_head"].T)


def torch_loss(z, batch):
    targets = torch.as_tensor(batch["targets"])
    if "loss_mask" in batch:
        targets = torch.where(torch.as_tensor(batch["loss_mask"]) == 1, targets, IGNORE_INDEX)
    return F.cross_entropy(z.reshape(-1, z.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)


CASES = {
    "MHA g=h=4": dict(n_kv_heads=4),
    "GQA g=2 of h=4": dict(n_kv_heads=2),
    "MQA g=1, head_dim 6": dict(n_kv_heads=1, head_dim=6),
    "GQA, tied head, dropout, loss mask, rope_base 500": dict(n_kv_heads=2, tie_embeddings=True,
                                                              dropout=0.2, rope_base=500.0),
    "QK-norm per head (Qwen3)": dict(n_kv_heads=2, qk_norm="head"),
    "QK-norm on the projections (OLMo 2)": dict(n_kv_heads=2, qk_norm="projection"),
    "linear scaling": dict(n_kv_heads=2, rope_scaling=dict(rope_type="linear", factor=4.0)),
    "dynamic NTK past 4 tokens": dict(n_kv_heads=2, rope_scaling=dict(
        rope_type="dynamic", factor=2.0, original_max_seq_len=4)),
    "llama3 scaling": dict(n_kv_heads=2, rope_base=500.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, original_max_seq_len=4)),
    "YaRN, DeepSeek's mscale terms, QK-norm": dict(n_kv_heads=2, qk_norm="head", rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_seq_len=4, beta_fast=4.0, beta_slow=0.5,
        mscale=1.0, mscale_all_dim=0.5)),
    "LongRoPE past 4 tokens": dict(n_kv_heads=2, rope_scaling=dict(
        rope_type="longrope", factor=4.0, original_max_seq_len=4, short_factor=(1.0, 2.0),
        long_factor=(1.5, 5.0))),
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_loss_logits_and_every_gradient_equal_torch_m3(overrides):
    config = DecoderConfig(vocab_size=V, max_seq_len=T, d_model=16, n_layers=2, n_heads=4,
                           ffn_multiple_of=8, init_std=0.25, **overrides)
    rng = np.random.default_rng(0)
    params = decoder.init_params(config, seed=1)
    for name in params:
        if name.endswith(".gamma"):
            params[name] = 1.0 + 0.2 * rng.standard_normal(params[name].shape)
    batch = {"tokens": rng.integers(0, V, (B, T)), "targets": rng.integers(0, V, (B, T))}
    batch["targets"][1, 0] = IGNORE_INDEX
    train = config.dropout > 0
    if train:
        batch["loss_mask"] = (np.arange(T) >= 2).astype(np.int64)[None].repeat(B, axis=0)

    loss, cache = decoder.forward(params, batch, config, train=train,
                                  rng=np.random.default_rng(5) if train else None)
    grads = decoder.backward(cache)
    # The dropout masks are inputs of the function: hand refmath's to torch.
    drops = [tuple(None if m is None else torch.as_tensor(m) for m in (lc.attn.drop, lc.ffn.drop))
             for lc in cache.layers]

    P = {name: torch.tensor(value, requires_grad=True) for name, value in params.items()}
    z = torch_decoder(P, torch.as_tensor(batch["tokens"]), config, drops)
    t_loss = torch_loss(z, batch)
    t_loss.backward()

    np.testing.assert_allclose(loss, t_loss.item(), rtol=1e-12)
    if not train:
        np.testing.assert_allclose(decoder.logits(params, batch["tokens"], config),
                                   z.detach().numpy(), rtol=1e-10, atol=1e-12)
    assert set(grads) == set(P)
    for name, value in P.items():
        np.testing.assert_allclose(grads[name], value.grad.numpy(), rtol=1e-9, atol=1e-12,
                                   err_msg=name)
