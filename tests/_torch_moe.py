"""A mixture-of-experts feed-forward written with torch's own functions (``torch.topk``,
``index_add``, ``F.linear``): the oracle of the MoE ops (tests/test_torch_oracle.py) and of the
decoders with experts (tests/models/test_*_torch.py). Import it only where torch is present."""
import torch

F = torch.nn.functional


def moe_route(scores, moe, bias=None):
    """The experts and gates of refmath.moe.route with torch.topk: the choice scores (plus the
    bias), the groups ranked by their best choice score (group_limited_greedy) or the sum of their
    two best (noaux_tc), the dropped groups' experts at -inf, the top k, their unbiased scores
    renormalised (plus 1e-20 for sigmoid scores, as transformers' DeepSeek-V3) and scaled."""
    choice = scores if bias is None else scores + bias
    if moe.routing != "greedy":
        groups = choice.unflatten(-1, (moe.n_groups, -1))
        group_scores = (groups.max(-1).values if moe.routing == "group_limited_greedy"
                        else groups.topk(2, dim=-1).values.sum(-1))
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter(
            -1, group_scores.topk(moe.topk_groups, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(moe.group_size, -1), -torch.inf)
    indices = choice.topk(moe.top_k, dim=-1).indices
    gates = scores.gather(-1, indices)
    if moe.norm_topk:
        gates = gates / (gates.sum(-1, keepdim=True) + (1e-20 if moe.scoring == "sigmoid" else 0.0))
    return indices, gates * moe.scaling


def balance_loss(probs, load, top_k, n_devices=None):
    """DeepSeek's f_i = E / (k N) load_i against P_i = mean_n p_ni, per expert or per device."""
    n, e = probs.shape
    f, p = load * e / (top_k * n), probs.mean(0)
    if n_devices is not None:
        f, p = f.unflatten(0, (n_devices, -1)).mean(1), p.unflatten(0, (n_devices, -1)).sum(1)
    return (f * p).sum()


def torch_moe(x, config, p):
    """The MoE feed-forward token by token with torch's own pieces: the router as F.linear and
    softmax or sigmoid, moe_route for the choice, each expert's SwiGLU on its tokens, index_add_
    into their rows, the shared experts and their sigmoid gate, then the auxiliary losses from the
    load of the same choice: ``(y, aux loss)``. ``p`` holds the layer's parameters by refmath's
    names (relative to its ``ffn.``) as torch tensors."""
    moe, rows = config, x.reshape(-1, x.shape[-1])
    logits = F.linear(rows, p["router.w"].T)
    scores = torch.softmax(logits, -1) if moe.scoring == "softmax" else torch.sigmoid(logits)
    indices, gates = moe_route(scores, moe, p.get("router.bias"))
    y = torch.zeros_like(rows)
    for e in range(moe.n_experts):
        token, slot = torch.nonzero(indices == e, as_tuple=True)
        h = F.silu(rows[token] @ p["experts.w_gate"][e]) * (rows[token] @ p["experts.w_up"][e])
        y = y.index_add(0, token, gates[token, slot, None] * (h @ p["experts.w_down"][e]))
    if "shared.w_gate" in p:
        hidden = F.silu(F.linear(rows, p["shared.w_gate"].T)) * F.linear(rows, p["shared.w_up"].T)
        shared = F.linear(hidden, p["shared.w_down"].T)
        y = y + (torch.sigmoid(F.linear(rows, p["shared_gate.w"].T)) * shared
                 if "shared_gate.w" in p else shared)
    load = torch.bincount(indices.reshape(-1), minlength=moe.n_experts).to(rows.dtype)
    probs = scores if moe.scoring == "softmax" else scores / scores.sum(-1, keepdim=True)
    aux = (moe.balance_coef * balance_loss(probs, load, moe.top_k)
           + moe.device_balance_coef * balance_loss(probs, load, moe.top_k, moe.n_devices)
           + moe.z_coef * (torch.logsumexp(logits, -1) ** 2).mean())
    return y.reshape(x.shape), aux
