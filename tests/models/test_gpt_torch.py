"""GPT (catalogue M2) against the same network written with PyTorch functional ops and autograd.

The torch network is written from the equations with torch's own functions (F.embedding,
F.layer_norm, F.linear, F.scaled_dot_product_attention or an explicit masked softmax, F.gelu,
F.cross_entropy), holding linear weights the way torch does (``out x in``, i.e. refmath's
transposed). Loss and every parameter gradient must agree to float64 rounding, in evaluation mode
and in train mode with refmath's dropout masks handed across, for dense layers and for GPT-3's
alternating dense and banded ones (the band written here as an explicit boolean mask).
"""
import dataclasses
import math

import numpy as np
import pytest

from refmath.models import gpt

torch = pytest.importorskip("torch", reason="PyTorch is the oracle; install the 'oracle' extra")
F = torch.nn.functional

CONFIG = gpt.GPTConfig(vocab_size=17, max_seq_len=8, n_layers=2, d_model=16, n_heads=4, d_ff=24,
                       dropout=0.2)


def _transposed(name: str) -> bool:
    """Weight matrices torch keeps as ``out x in``; the embedding tables are ``V x d`` in both."""
    return name == "lm_head" or name.rsplit(".", 1)[-1] in ("w_q", "w_k", "w_v", "w_o", "w1", "w2")


def _random_params(config, seed):
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in gpt.param_shapes(config).items():
        if name.endswith("gamma"):
            params[name] = 1.0 + 0.2 * rng.standard_normal(shape)
        elif len(shape) == 1:
            params[name] = 0.2 * rng.standard_normal(shape)
        elif name in ("tok_emb", "pos_emb"):
            params[name] = 0.5 * rng.standard_normal(shape)
        else:
            params[name] = rng.standard_normal(shape) / math.sqrt(shape[0])
    return params


def _as_tensor(mask):
    return None if mask is None else torch.from_numpy(mask)


def _visible(t, window):
    """Which keys each query sees: ``j <= i`` and, in a band of width ``window``, ``i - j < window``."""
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    return (j <= i) if window is None else (j <= i) & (i - j < window)


def _torch_attention(u, p, prefix, n_heads, attn_drop, window=None):
    b, t, d = u.shape

    def heads(z):  # (B, T, d) -> (B, h, T, d_h)
        return z.view(b, t, n_heads, d // n_heads).transpose(1, 2)

    q, k, v = (heads(F.linear(u, p[prefix + w], p[prefix + bias]))
               for w, bias in (("w_q", "b_q"), ("w_k", "b_k"), ("w_v", "b_v")))
    if attn_drop is None and window is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif attn_drop is None:  # a boolean attn_mask: True where a key may be attended to
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=_visible(t, window))
    else:  # torch would draw its own dropout mask; use refmath's on explicit weights
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // n_heads)
        weights = torch.softmax(scores.masked_fill(~_visible(t, window), -math.inf), dim=-1)
        o = (weights * attn_drop) @ v
    return F.linear(o.transpose(1, 2).reshape(b, t, d), p[prefix + "w_o"], p[prefix + "b_o"])


def _torch_logits(p, tokens, config, drops):
    """``p``: torch tensors (weights ``out x in``); ``drops``: refmath's dropout masks (or Nones)."""
    d, eps = config.d_model, config.norm_eps
    approximate = "tanh" if config.ffn == "gelu_tanh" else "none"

    def dropped(x, mask):
        return x if mask is None else x * mask

    def sublayer(x, ln, branch, drop):
        gamma, beta = p[ln + ".gamma"], p[ln + ".beta"]
        if config.norm_position == "pre":
            return x + dropped(branch(F.layer_norm(x, (d,), gamma, beta, eps)), drop)
        return F.layer_norm(x + dropped(branch(x), drop), (d,), gamma, beta, eps)

    t = tokens.shape[1]
    x = dropped(F.embedding(tokens, p["tok_emb"]) + p["pos_emb"][:t], drops["emb"])
    for i in range(config.n_layers):
        pre = f"layers.{i}."
        slides = config.window_layers is None or config.window_layers[i]
        window = config.sliding_window if slides else None
        x = sublayer(x, pre + "ln1", lambda u: _torch_attention(u, p, pre + "attn.", config.n_heads,
                                                                 drops["attn", i], window),
                     drops["res1", i])
        x = sublayer(x, pre + "ln2", lambda u: F.linear(
            F.gelu(F.linear(u, p[pre + "ffn.w1"], p[pre + "ffn.b1"]), approximate=approximate),
            p[pre + "ffn.w2"], p[pre + "ffn.b2"]), drops["res2", i])
    if config.norm_position == "pre":
        x = F.layer_norm(x, (d,), p["ln_f.gamma"], p["ln_f.beta"], eps)
    # tied: F.linear(h, E) = h E^T with the (V, d) embedding table itself
    return F.linear(x, p["tok_emb"] if config.tie_embeddings else p["lm_head"])


SETTINGS = [
    dict(norm_position="pre", tie_embeddings=True, train=False),
    dict(norm_position="pre", tie_embeddings=False, train=True, loss_mask=True),
    dict(norm_position="post", tie_embeddings=True, train=True),
    dict(norm_position="post", tie_embeddings=False, train=False, ffn="gelu", loss_mask=True),
    dict(norm_position="pre", tie_embeddings=True, train=True, ffn="gelu"),
    # GPT-3's alternation (dense first; the band width 3 is an example, the paper gives none),
    # then one band on both layers of a Post-LN network: 7 tokens reach past either window
    dict(norm_position="pre", tie_embeddings=True, train=True, sliding_window=3,
         window_layers=(False, True), loss_mask=True),
    dict(norm_position="post", tie_embeddings=False, train=False, sliding_window=2),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_loss_and_every_gradient_equal_torch_autograd(setting):
    setting = dict(setting)
    train, with_mask = setting.pop("train"), setting.pop("loss_mask", False)
    config = dataclasses.replace(CONFIG, **setting)
    params = _random_params(config, 0)
    rng = np.random.default_rng(1)
    b, t = 2, 7
    batch = {"tokens": rng.integers(0, config.vocab_size, (b, t)),
             "targets": rng.integers(0, config.vocab_size, (b, t))}
    batch["targets"][1, -1] = gpt.IGNORE_INDEX
    counted = batch["targets"]
    if with_mask:  # a 3-token prompt (L5); torch sees those targets as ignored
        batch["loss_mask"] = (np.arange(t) >= 3).astype(np.int64)[None].repeat(b, axis=0)
        counted = np.where(batch["loss_mask"] == 1, batch["targets"], gpt.IGNORE_INDEX)

    loss, cache = gpt.forward(params, batch, config, train=train, rng=np.random.default_rng(2))
    grads = gpt.backward(cache)

    drops = {"emb": _as_tensor(cache.emb_drop)}
    for i, layer in enumerate(cache.layers):
        drops["attn", i] = _as_tensor(layer.attn.branch.attn.dropout_mask)
        drops["res1", i] = _as_tensor(layer.attn.drop)
        drops["res2", i] = _as_tensor(layer.ffn.drop)
    assert (drops["emb"] is not None) == train

    leaves = {name: torch.tensor(value.T if _transposed(name) else value, requires_grad=True)
              for name, value in params.items()}
    torch_logits = _torch_logits(leaves, torch.from_numpy(batch["tokens"]), config, drops)
    torch_loss = F.cross_entropy(torch_logits.reshape(-1, config.vocab_size),
                                 torch.from_numpy(counted).reshape(-1), ignore_index=gpt.IGNORE_INDEX)
    torch_loss.backward()

    np.testing.assert_allclose(loss, torch_loss.item(), rtol=1e-12)
    for name, leaf in leaves.items():
        theirs = leaf.grad.numpy()
        theirs = theirs.T if _transposed(name) else theirs
        if name.endswith("attn.b_k"):
            # zero in exact arithmetic (softmax ignores the per-row shift q_i . b_k): both sides
            # are rounding residue of sums of O(1) terms, far below 1e-12
            assert np.abs(grads[name]).max() < 1e-12 and np.abs(theirs).max() < 1e-12
            continue
        # rtol 1e-9 for float64 sums taken in a different order; the atol only covers entries that
        # cancel to rounding level (a sum of O(1) terms leaves ~1e-16 times their number)
        np.testing.assert_allclose(grads[name], theirs, rtol=1e-9, atol=1e-14, err_msg=name)


def test_logits_equal_torch():
    config = dataclasses.replace(CONFIG, norm_position="post", tie_embeddings=False)
    params = _random_params(config, 3)
    tokens = np.random.default_rng(4).integers(0, config.vocab_size, (2, 8))
    leaves = {n: torch.tensor(v.T if _transposed(n) else v) for n, v in params.items()}
    no_dropout = {"emb": None, **{(kind, i): None for kind in ("attn", "res1", "res2")
                                  for i in range(config.n_layers)}}
    theirs = _torch_logits(leaves, torch.from_numpy(tokens), config, no_dropout)
    np.testing.assert_allclose(gpt.logits(params, tokens, config), theirs.numpy(), rtol=1e-12,
                               atol=1e-14)
