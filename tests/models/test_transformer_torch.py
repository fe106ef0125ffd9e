"""The encoder-decoder Transformer (M1) against the same network written with PyTorch functions.

The weights are copied across (transposed for F.linear, which takes ``out x in``), the dropout
masks that refmath drew are handed to the torch network (torch would draw its own), and the loss
and every gradient must agree to float64 rounding.
"""
import dataclasses

import numpy as np
import pytest

from refmath.models import transformer as tm

torch = pytest.importorskip("torch", reason="PyTorch is the oracle; install the 'oracle' extra")
F = torch.nn.functional


def sinusoids(t, d):
    position = torch.arange(t, dtype=torch.float64)[:, None]
    rate = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    table = torch.zeros(t, d, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * rate)
    table[:, 1::2] = torch.cos(position * rate)
    return table


class Masks:
    """Hands out refmath's dropout masks in the order the forward pass drew them."""

    def __init__(self, masks):
        self.masks = iter(masks)

    def __call__(self, x):
        mask = next(self.masks)
        return x if mask is None else x * torch.from_numpy(mask)


def attention(x, context, p, n_heads, mask, drop):
    """Multi-head attention without biases; with a dropout mask the weights are formed
    explicitly, without one torch's own scaled_dot_product_attention does the work."""
    def heads(t):  # (B, T, d) -> (B, h, T, d_k)
        return t.unflatten(-1, (n_heads, -1)).transpose(1, 2)
    q = heads(F.linear(x, p["w_q"].T))
    k = heads(F.linear(context, p["w_k"].T))
    v = heads(F.linear(context, p["w_v"].T))
    weights_mask = next(drop.masks)
    if weights_mask is None:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        a = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5 + mask, dim=-1)
        o = (a * torch.from_numpy(weights_mask)) @ v
    return F.linear(o.transpose(1, 2).flatten(-2), p["w_o"].T)


def post_ln(x, f, p, drop, eps):
    return F.layer_norm(x + drop(f), x.shape[-1:], p["gamma"], p["beta"], eps=eps)


def ffn(x, p):
    return F.linear(F.relu(F.linear(x, p["w1"].T, p["b1"])), p["w2"].T, p["b2"])


def sub_of(params, prefix):
    """The entries under ``prefix.``, keyed by the rest of their names."""
    return {k[len(prefix) + 1:]: v for k, v in params.items() if k.startswith(prefix + ".")}


def torch_loss(params, batch, cfg, drop):
    src, tgt = torch.from_numpy(batch["src"]), torch.from_numpy(batch["tgt"])
    b, s = src.shape
    t = tgt.shape[1]
    d, emb, eps = cfg.d_model, params["tok_emb"], cfg.norm_eps
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float64)
    src_visible = torch.arange(s)[None, :] < torch.from_numpy(batch["src_lengths"])[:, None]
    pad = torch.where(src_visible, 0.0, neg_inf).to(torch.float64)[:, None, None, :]
    causal = torch.where(torch.ones(t, t, dtype=torch.bool).tril(), 0.0, neg_inf).to(torch.float64)

    x = drop(F.embedding(src, emb) * d ** 0.5 + sinusoids(s, d))
    for i in range(cfg.n_layers):
        lp = sub_of(params, f"encoder.layers.{i}")
        x = post_ln(x, attention(x, x, sub_of(lp, "self_attn"), cfg.n_heads, pad, drop),
                    sub_of(lp, "ln1"), drop, eps)
        x = post_ln(x, ffn(x, sub_of(lp, "ffn")), sub_of(lp, "ln2"), drop, eps)

    dec_in = torch.cat([torch.full((b, 1), cfg.bos_id), tgt[:, :-1]], dim=1)
    y = drop(F.embedding(dec_in, emb) * d ** 0.5 + sinusoids(t, d))
    for i in range(cfg.n_layers):
        lp = sub_of(params, f"decoder.layers.{i}")
        y = post_ln(y, attention(y, y, sub_of(lp, "self_attn"), cfg.n_heads, causal, drop),
                    sub_of(lp, "ln1"), drop, eps)
        y = post_ln(y, attention(y, x, sub_of(lp, "cross_attn"), cfg.n_heads, pad, drop),
                    sub_of(lp, "ln2"), drop, eps)
        y = post_ln(y, ffn(y, sub_of(lp, "ffn")), sub_of(lp, "ln3"), drop, eps)

    z = F.linear(y, emb) if cfg.tie_embeddings else y @ params["lm_head"]
    counted = torch.ones(b, t, dtype=torch.bool)
    if batch.get("tgt_lengths") is not None:
        counted &= torch.arange(t)[None, :] < torch.from_numpy(batch["tgt_lengths"])[:, None]
    if cfg.pad_id is not None:
        counted &= tgt != cfg.pad_id
    targets = torch.where(counted, tgt, -100)
    return F.cross_entropy(z.reshape(-1, z.shape[-1]), targets.reshape(-1), ignore_index=-100,
                           label_smoothing=cfg.label_smoothing)


def dropout_masks(cache):
    """refmath's masks in drawing order; for attention the weights mask comes before the
    residual one (torch's `attention` takes it from the iterator directly)."""
    masks = [cache.encoder.embed.dropout_mask]
    for layer in cache.encoder.layers:
        masks += [layer.self_attn.mha.attn.dropout_mask, layer.self_attn.dropout_mask,
                  layer.ffn.dropout_mask]
    masks.append(cache.decoder.embed.dropout_mask)
    for layer in cache.decoder.layers:
        for sub in (layer.self_attn, layer.cross_attn):
            masks += [sub.mha.attn.dropout_mask, sub.dropout_mask]
        masks.append(layer.ffn.dropout_mask)
    return masks


@pytest.mark.parametrize("tie, train, pad_id", [
    (True, True, 0), (False, False, 0), (True, False, None), (False, True, None),
], ids=["tied-train-pad", "untied-eval-pad", "tied-eval-lengths", "untied-train-lengths"])
def test_loss_and_every_gradient_match_torch(tie, train, pad_id):
    cfg = dataclasses.replace(tm.TRANSFORMER_TINY, tie_embeddings=tie, pad_id=pad_id, dropout=0.2,
                              label_smoothing=0.1)
    params = tm.init_params(cfg, seed=4)
    rng = np.random.default_rng(5)
    for name, value in params.items():  # move gains, shifts and biases off their initial 1s and 0s
        if value.ndim == 1:
            value += 0.3 * rng.standard_normal(value.shape)
    batch = {"src": rng.integers(0, cfg.vocab_size, (3, 7)), "src_lengths": np.array([7, 2, 5]),
             "tgt": rng.integers(2, cfg.vocab_size, (3, 6)), "tgt_lengths": np.array([6, 4, 1])}
    batch["tgt"][0, 2] = 0  # a pad token inside the length: ignored only when pad_id = 0

    loss, cache = tm.forward(params, batch, cfg, train=train, rng=11)
    grads = tm.backward(cache)

    tensors = {k: torch.from_numpy(v.copy()).requires_grad_(True) for k, v in params.items()}
    expected = torch_loss(tensors, batch, cfg, Masks(dropout_masks(cache)))
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-12)
    for name in params:
        np.testing.assert_allclose(grads[name], tensors[name].grad.numpy(), rtol=1e-9, atol=1e-13,
                                   err_msg=name)
