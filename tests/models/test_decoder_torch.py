r"""The M3 decoder against the same network written with PyTorch functions and autograd.

The torch side is an independent formulation: RoPE as multiplication by unit complex numbers
(``torch.polar``, ``torch.view_as_complex``) instead of refmath's pairwise rotation formulas,
``F.rms_norm``, ``F.silu``, ``F.linear`` with the weights transposed to torch's ``out x in``,
``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` for the grouped heads, and
``F.cross_entropy`` with the loss mask turned into ignored targets. QK-norm (N18) is ``F.rms_norm``
over each head or the whole projection; a rope scaling (N13-N17) enters as its frequencies and
attention factor (from :func:`refmath.positions.rope_inv_freq`, which ``tests/test_positions.py``
checks against transformers' initialisers), the rotation and its gradient stay torch's.
Gemma's options are written as Gemma's own code writes them: ``(1 + w)`` gains, the embedding
times :math:`\sqrt d`, ``F.gelu(approximate="tanh")`` as the gate, the scores as an explicit
product with ``cap * tanh(s / cap)`` before the mask (SDPA has no cap), an RMSNorm on each
sublayer's output, and per-layer windows and RoPE bases (:mod:`refmath.models.gemma`). A
mixture-of-experts layer is
``tests/_torch_moe.py``'s (``torch.topk``, ``index_add``), its auxiliary losses added to the loss.
The block's other shapes are written out as their models compute them: a parallel block as one
sum ``x + attn(h1) + ffn(h2)`` (Falcon, PaLM: :mod:`refmath.models.falcon`), ``F.layer_norm``
(with its bias or without it), the plain MLP as ``F.gelu`` between two ``F.linear``, and OLMo 2's
branches reading ``x`` itself with ``F.rms_norm`` on their outputs.
"""
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from refmath.models import decoder, falcon, gemma, olmo2
from refmath.models.decoder import IGNORE_INDEX, DecoderConfig

torch = pytest.importorskip("torch", reason="PyTorch is the oracle; install the 'oracle' extra")
F = torch.nn.functional

from _torch_moe import torch_moe  # noqa: E402  (needs torch)

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


def attention(q, k, v, config, window):
    """Causal attention; Gemma's scale, cap and a window as explicit scores, else torch's SDPA."""
    if config.query_pre_attn_scalar is None and config.attn_softcap is None and window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2) / (config.query_pre_attn_scalar or q.shape[-1]) ** 0.5
    if config.attn_softcap is not None:
        s = config.attn_softcap * torch.tanh(s / config.attn_softcap)
    t = q.shape[-2]
    behind = torch.arange(t)[:, None] - torch.arange(t)[None, :]  # query minus key position
    visible = (behind >= 0) & (behind < (t if window is None else window))
    return torch.softmax(s.masked_fill(~visible, -torch.inf), dim=-1) @ v


# The options of Gemma (refmath.models.gemma) at their plain values: what a Llama-family config
# lacks, for torch_decoder, which reads them
PLAIN = dict(norm_offset=0.0, embed_scale=False, local_rope_base=None, query_pre_attn_scalar=None,
             attn_softcap=None, final_softcap=None, sandwich_norms=False, ffn="swiglu")


def llama_view(config: DecoderConfig) -> SimpleNamespace:
    """A DecoderConfig as :func:`torch_decoder` reads a configuration: its fields, and Gemma's
    options at their plain values."""
    return SimpleNamespace(**{**dataclasses.asdict(config), **PLAIN, "moe": config.moe,
                              "rope_scaling": config.rope_scaling},
                           kv_heads=config.kv_heads, d_h=config.d_h)


def gemma_view(config: gemma.GemmaConfig) -> SimpleNamespace:
    """A GemmaConfig as :func:`torch_decoder` reads a configuration: Gemma's options, its layers'
    windows as one window and the flags of the layers that slide it."""
    windows = config.windows or (None,) * config.n_layers
    window = next((w for w in windows if w is not None), None)
    return SimpleNamespace(
        **{**dataclasses.asdict(config), "rope_scaling": config.rope_scaling},
        kv_heads=config.kv_heads, d_h=config.d_h, norm_offset=1.0, embed_scale=True, ffn="geglu",
        sandwich_norms=config.sandwich_norms, qk_norm=config.qk_norm, tie_embeddings=True,
        dropout=0.0, moe=None, qkv_bias=False, sliding_window=window,
        window_layers=None if window is None else tuple(w is not None for w in windows))


def falcon_view(config: falcon.FalconConfig) -> SimpleNamespace:
    """A FalconConfig as :func:`torch_decoder` reads a configuration: Llama's options at their
    plain values, and Falcon's block, norm and FFN."""
    return SimpleNamespace(
        **dataclasses.asdict(config), kv_heads=config.kv_heads, d_h=config.d_h, norm_offset=0.0,
        embed_scale=False, qk_norm=None, sliding_window=None, window_layers=None,
        local_rope_base=None, query_pre_attn_scalar=None, attn_softcap=None, final_softcap=None,
        moe=None, sandwich_norms=False, pre_norms=True)


def olmo2_view(config: olmo2.OLMo2Config) -> SimpleNamespace:
    """An OLMo2Config as :func:`torch_decoder` reads a configuration: Llama's options at their
    plain values, QK-norm over the projections and the norms after the sublayers only."""
    return SimpleNamespace(
        **dataclasses.asdict(config), kv_heads=config.kv_heads, d_h=config.d_h, norm_offset=0.0,
        embed_scale=False, qk_norm="projection", sliding_window=None, window_layers=None,
        local_rope_base=None, query_pre_attn_scalar=None, attn_softcap=None, final_softcap=None,
        moe=None, sandwich_norms=True, pre_norms=False, ffn="swiglu")


def torch_decoder(P, tokens, config, drops):
    """Logits of the M3 network from torch tensors ``P`` (refmath's names and layouts), and the
    sum of its mixture-of-experts layers' auxiliary losses; ``config`` a DecoderConfig, or a
    :func:`falcon_view` of a FalconConfig (its ``norm``, ``ffn`` and ``parallel_block``) or
    :func:`olmo2_view` of an OLMo2Config (its ``pre_norms``)."""
    norm_kind = getattr(config, "norm", "rmsnorm")
    h, g, d_h, eps = config.n_heads, config.kv_heads, config.d_h, config.norm_eps

    def norm(x, gamma, width):
        return F.rms_norm(x, (width,), config.norm_offset + gamma, eps)

    def layer_norm(x, name):  # a block's or the final norm: RMSNorm, LayerNorm with or without bias
        gamma = config.norm_offset + P[name + ".gamma"]
        if norm_kind == "rmsnorm":
            return F.rms_norm(x, (d,), gamma, eps)
        return F.layer_norm(x, (d,), gamma, P.get(name + ".beta"), eps)

    x = F.embedding(tokens, P["tok_emb"])
    b, t, d = x.shape
    aux = torch.zeros((), dtype=x.dtype)
    if config.embed_scale:
        x = x * d ** 0.5
    for i in range(config.n_layers):
        def p(name):
            return P[f"layers.{i}.{name}"]

        def heads(hn, w, n, gamma=None):
            y = F.linear(hn, p(w).T, P.get(f"layers.{i}.{w.replace('.w_', '.b_')}"))  # Qwen2's
            if config.qk_norm == "projection" and gamma:
                y = norm(y, p(gamma), n * d_h)
            y = y.view(b, t, n, d_h).transpose(1, 2)
            if config.qk_norm == "head" and gamma:
                y = norm(y, p(gamma), d_h)
            return y

        local = config.window_layers is not None and config.window_layers[i]
        window = config.sliding_window if config.window_layers is None or local else None
        base, scaling = config.rope_base, config.rope_scaling
        if local and config.local_rope_base is not None:
            base, scaling = config.local_rope_base, None

        def attention_branch(hn):
            q = rope_complex(heads(hn, "attn.w_q", h, "attn.q_norm.gamma"), base, scaling)
            k = rope_complex(heads(hn, "attn.w_k", g, "attn.k_norm.gamma"), base, scaling)
            o = attention(q, k, heads(hn, "attn.w_v", g), config, window)
            a = F.linear(o.transpose(1, 2).reshape(b, t, h * d_h), p("attn.w_o").T)
            return layer_norm(a, f"layers.{i}.ln1_post") if config.sandwich_norms else a

        def ffn_branch(hn):
            nonlocal aux
            if config.moe is not None and config.moe.is_moe_layer(i):
                prefix = f"layers.{i}.ffn."
                f, layer_aux = torch_moe(hn, config.moe, {
                    name[len(prefix):]: value for name, value in P.items()
                    if name.startswith(prefix)})
                aux = aux + layer_aux
            elif config.ffn in ("gelu", "gelu_tanh"):  # Falcon's, GPT-J's: down(gelu(up(x)))
                approximate = "tanh" if config.ffn == "gelu_tanh" else "none"
                f = F.linear(F.gelu(F.linear(hn, p("ffn.w_up").T), approximate=approximate),
                             p("ffn.w_down").T)
            else:
                gate = F.linear(hn, p("ffn.w_gate").T)
                gate = F.gelu(gate, approximate="tanh") if config.ffn == "geglu" else F.silu(gate)
                f = F.linear(gate * F.linear(hn, p("ffn.w_up").T), p("ffn.w_down").T)
            return layer_norm(f, f"layers.{i}.ln2_post") if config.sandwich_norms else f

        def dropped(y, which):
            return y if drops[i][which] is None else y * drops[i][which]

        def pre_norm(y, name):  # OLMo 2 has none: its branches read the residual stream itself
            return layer_norm(y, f"layers.{i}.{name}") if getattr(config, "pre_norms", True) else y

        if getattr(config, "parallel_block", False):  # GPT-J, PaLM, Falcon: on the block's input
            h1 = layer_norm(x, f"layers.{i}.ln1")
            h2 = layer_norm(x, f"layers.{i}.ln2") if config.parallel_norms == 2 else h1
            x = x + dropped(attention_branch(h1), 0) + dropped(ffn_branch(h2), 1)
        else:
            x = x + dropped(attention_branch(pre_norm(x, "ln1")), 0)
            x = x + dropped(ffn_branch(pre_norm(x, "ln2")), 1)
    x = layer_norm(x, "ln_f")
    # torch's (out x in) head weight is the (V, d) embedding table itself when tied.
    z = F.linear(x, P["tok_emb"] if config.tie_embeddings else P["lm_head"].T)
    if config.final_softcap is not None:
        z = config.final_softcap * torch.tanh(z / config.final_softcap)
    return z, aux


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
    "Mixtral's experts: top 2 of 4 renormalised, balance and z-losses": dict(
        n_kv_heads=2, moe=dict(n_experts=4, top_k=2, d_expert=8, norm_topk=True,
                               balance_coef=0.05, z_coef=0.01)),
    "Qwen2-MoE's gated shared expert, dense first layer, q/k/v biases": dict(
        n_kv_heads=2, qkv_bias=True, moe=dict(n_experts=4, top_k=2, d_expert=8, d_shared=12,
                                              shared_gate=True, first_dense=1,
                                              balance_coef=0.05)),
}


# Gemma's file (refmath.models.gemma), with the same oracle
GEMMA_CASES = {
    "Gemma: GeGLU, (1 + w) gains, scaled embeddings, tied": dict(n_kv_heads=1, head_dim=6),
    "Gemma 2: caps, sandwich norms, a local layer": dict(
        n_kv_heads=2, generation=2, query_pre_attn_scalar=6.0, attn_softcap=1.5,
        final_softcap=2.0, windows=(3, None)),
    "Gemma 3: QK-norm, local layer with its own RoPE base": dict(
        n_kv_heads=2, generation=3, windows=(None, 3), local_rope_base=100.0,
        rope_scaling=dict(rope_type="linear", factor=4.0)),
}


# Falcon's file (refmath.models.falcon), with the same oracle
FALCON_CASES = {
    "Falcon-7B: parallel block, one LayerNorm, MQA, exact-GELU MLP, tied": dict(
        n_kv_heads=1, tie_embeddings=True),
    "Falcon-40B: parallel block, two LayerNorms, GQA, dropout": dict(
        n_kv_heads=2, parallel_norms=2, d_ff=24, dropout=0.2),
    "PaLM: parallel block, MQA, SwiGLU, LayerNorm without bias, tied": dict(
        n_kv_heads=1, norm="layernorm_no_bias", ffn="swiglu", d_ff=48, tie_embeddings=True),
    "sequential LayerNorm blocks, tanh-GELU MLP": dict(
        n_kv_heads=4, parallel_block=False, ffn="gelu_tanh"),
}


# OLMo 2's file (refmath.models.olmo2), with the same oracle
OLMO2_CASES = {
    "OLMo 2: norms after the sublayers only, QK-norm on the projections": dict(n_kv_heads=2),
    "OLMo 2: MQA, head_dim 6, tied, dropout": dict(n_kv_heads=1, head_dim=6, tie_embeddings=True,
                                                   dropout=0.2),
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_loss_logits_and_every_gradient_equal_torch_m3(overrides):
    config = DecoderConfig(vocab_size=V, max_seq_len=T, d_model=16, n_layers=2, n_heads=4,
                           ffn_multiple_of=8, init_std=0.25, **overrides)
    equal_torch(decoder, config, llama_view(config))


@pytest.mark.parametrize("overrides", GEMMA_CASES.values(), ids=GEMMA_CASES.keys())
def test_gemma_loss_logits_and_every_gradient_equal_torch(overrides):
    config = gemma.GemmaConfig(**{**dict(vocab_size=V, max_seq_len=T, d_model=16, n_layers=2,
                                         n_heads=4, head_dim=4, d_ff=48, init_std=0.25),
                                  **overrides})
    equal_torch(gemma, config, gemma_view(config))


@pytest.mark.parametrize("overrides", FALCON_CASES.values(), ids=FALCON_CASES.keys())
def test_falcon_loss_logits_and_every_gradient_equal_torch(overrides):
    config = falcon.FalconConfig(vocab_size=V, max_seq_len=T, d_model=16, n_layers=2, n_heads=4,
                                 init_std=0.25, **overrides)
    equal_torch(falcon, config, falcon_view(config))


@pytest.mark.parametrize("overrides", OLMO2_CASES.values(), ids=OLMO2_CASES.keys())
def test_olmo2_loss_logits_and_every_gradient_equal_torch(overrides):
    config = olmo2.OLMo2Config(vocab_size=V, max_seq_len=T, d_model=16, n_layers=2, n_heads=4,
                               ffn_multiple_of=8, init_std=0.25, **overrides)
    equal_torch(olmo2, config, olmo2_view(config))


def equal_torch(model, config, view):
    """``model``'s loss, logits and every gradient at ``config`` against :func:`torch_decoder`
    reading ``view``."""
    rng = np.random.default_rng(0)
    params = model.init_params(config, seed=1)
    for name in params:
        if name.endswith(".gamma"):  # an applied gain near 1 (a stored w near 0 for Gemma)
            params[name] = (1.0 - view.norm_offset) + 0.2 * rng.standard_normal(params[name].shape)
        elif name.endswith(".beta"):  # a LayerNorm's bias off 0
            params[name] = 0.2 * rng.standard_normal(params[name].shape)
    batch = {"tokens": rng.integers(0, V, (B, T)), "targets": rng.integers(0, V, (B, T))}
    batch["targets"][1, 0] = IGNORE_INDEX
    train = config.dropout > 0
    if train:
        batch["loss_mask"] = (np.arange(T) >= 2).astype(np.int64)[None].repeat(B, axis=0)

    loss, cache = model.forward(params, batch, config, train=train,
                                rng=np.random.default_rng(5) if train else None)
    grads = model.backward(cache)
    # The dropout masks are inputs of the function: hand refmath's to torch.
    drops = [tuple(None if m is None else torch.as_tensor(m) for m in (lc.attn.drop, lc.ffn.drop))
             for lc in cache.layers]

    P = {name: torch.tensor(value, requires_grad=True) for name, value in params.items()}
    z, aux = torch_decoder(P, torch.as_tensor(batch["tokens"]), view, drops)
    t_loss = torch_loss(z, batch) + aux
    t_loss.backward()

    np.testing.assert_allclose(loss, t_loss.item(), rtol=1e-12)
    if not train:
        np.testing.assert_allclose(model.logits(params, batch["tokens"], config),
                                   z.detach().numpy(), rtol=1e-10, atol=1e-12)
    assert set(grads) == set(P)
    for name, value in P.items():
        if name.endswith("router.bias"):  # it only chooses: no gradient reaches it in torch
            assert value.grad is None and not grads[name].any()
            continue
        np.testing.assert_allclose(grads[name], value.grad.numpy(), rtol=1e-9, atol=1e-12,
                                   err_msg=name)
