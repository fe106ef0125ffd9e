r"""Lesson 15, mixture of experts (``notebooks/15_mixture_of_experts.py``): the expected value and
the known slips of each exercise, computed from the library and from the lesson's inputs."""
from __future__ import annotations

import numpy as np

from refmath.lessons.checks import catalogued
from refmath.lessons.table import exercise, function_exercise

# Each exercise registers itself in refmath.lessons.table.EXERCISES; nothing here is called by name.
__all__ = []


_E7 = "the section 'E7, E2, E3: top-2 routing by hand'"
_E5 = "the section 'E5: load balance'"
_E8 = "the section 'E8: total against active parameters'"
_E9 = "the section 'E9, E10: the memory against the compute, and the all-to-all'"


def _worked_routing(logits):
    """(probabilities, Mixtral's routing, the routing without renormalised gates) of the worked
    example, whose router input is the logits themselves (W_r = I)."""
    from refmath.moe import MoEConfig, route, router_scores

    probs = router_scores(logits, np.eye(np.shape(logits)[1]))[1]
    n = np.shape(logits)[1]
    return (probs, route(probs, MoEConfig(n_experts=n, top_k=2, d_expert=1, norm_topk=True)),
            route(probs, MoEConfig(n_experts=n, top_k=2, d_expert=1)))


@exercise("15.1a", "the probabilities", _E7, "a softmax along each row, over the experts",
          uses=("worked_logits",))
def _worked_probabilities(logits):
    probs = _worked_routing(logits)[0]
    e = np.exp(logits)
    return probs, {"exp(z) without dividing by its sum": e,
                   "the softmax over the wrong axis: over the tokens (columns), not the experts":
                       e / e.sum(axis=0)}


@exercise("15.1b", "the top-2 experts", _E7,
          "best first; equal probabilities go to the lower index", uses=("worked_logits",),
          rtol=0.0)
def _worked_top2(logits):
    probs, mixtral, _ = _worked_routing(logits)
    chosen = mixtral[0]
    ascending = np.argsort(probs, axis=1, kind="stable")
    return chosen, {"an ascending argsort reversed: ties go to the higher index":
                    ascending[:, ::-1][:, :2],
                    "the two smallest probabilities (argsort is ascending)": ascending[:, :2],
                    "experts numbered from 1: refmath, like NumPy, numbers them from 0":
                        chosen + 1}


@exercise("15.1c", "the gates", _E7, "the chosen probabilities divided by their sum",
          uses=("worked_logits",))
def _worked_gates(logits):
    from refmath.softmax import softmax_forward

    _, mixtral, plain = _worked_routing(logits)
    return mixtral[1], {"not renormalised: the chosen probabilities themselves": plain[1],
                        "a softmax over the chosen probabilities, not a division by their sum":
                            softmax_forward(plain[1])[0]}


def _torch_gates(scores, moe, bias=None):
    """The oracle: the gates in torch, with torch's own top-k (the cases have no ties)."""
    import torch

    choice = scores.detach()
    if moe.routing == "group_limited_greedy":
        best = choice.view(choice.shape[0], moe.n_groups, -1).amax(dim=-1)
        kept = torch.zeros_like(best, dtype=torch.bool)
        kept.scatter_(1, best.topk(moe.topk_groups, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(moe.group_size, dim=1), -torch.inf)
    chosen = scores.gather(1, choice.topk(moe.top_k, dim=-1).indices)
    if moe.norm_topk:
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return moe.scaling * chosen


def _outer_sum_forgotten(dgates, cache):
    """The slip that leaves the outer 1/D off the renormalised gates' backward."""
    from refmath.moe import route_backward

    dscores = route_backward(dgates, cache)
    if cache.denominator is None:
        return dscores
    return dscores * cache.denominator


@function_exercise("15.2", "your gates backward", "the section 'E3, E4: the gates carry the gradient'",
                   "scale by rho; with D, ds_i = (dg_i - sum_j dg_j s_j / D) / D on the chosen; "
                   "put the result at cache.indices")
def _route_backward():
    from refmath.moe import route_backward

    return dict(
        reference=route_backward, case=["moe_route[greedy*", "moe_route[group-limited*"],
        oracle=_torch_gates,
        slips={**catalogued("moe route: renormalisation's Jacobian dropped", route_backward),
               **catalogued("moe route: scaling left out of the backward", route_backward),
               "the outer 1/D forgotten: (dg - sum dg s / D), not divided by D again":
                   _outer_sum_forgotten})



def _load_of(probs, first_only: bool = False):
    from refmath.moe import MoEConfig, expert_load, route

    n = np.shape(probs)[1]
    chosen = route(probs, MoEConfig(n_experts=n, top_k=2, d_expert=1))[0]
    return expert_load(chosen[:, :1] if first_only else chosen, n)


@exercise("15.3a", "the load", _E5, "count each expert among every token's two choices",
          uses=("probs6",), rtol=0.0)
def _load6(probs):
    return _load_of(probs), {"the first choice only": _load_of(probs, first_only=True)}


@exercise("15.3b", "L_ExpBal", _E5, "f_i = E / (k N) load_i, P_i the mean probability; sum f P",
          uses=("probs6",))
def _balance_loss6(probs):
    from refmath.moe import expert_balance_loss

    load, (n, e) = _load_of(probs), np.shape(probs)
    mean_p = np.asarray(probs).mean(axis=0)
    return expert_balance_loss(probs, load, 2)[0], {
        "Switch's and Mixtral's (E / N) sum load P: k times DeepSeek's":
            e / n * np.sum(load * mean_p),
        "f_i = load_i, without E / (k N)": np.sum(load * mean_p),
        "the load of the first choices only":
            expert_balance_loss(probs, _load_of(probs, first_only=True), 1)[0]}


@exercise("15.4", "the biases after one update", "the section 'E6: DeepSeek-V3's bias balancing'",
          "b_i - gamma sign(load_i - mean load)", uses=("bias_before", "load_step"))
def _bias_after(bias, load):
    from refmath.moe import balance_bias_update

    load = np.asarray(load, dtype=np.float64)
    return balance_bias_update(bias, load, 0.001), {
        "the sign flipped: the overloaded expert's bias raised":
            balance_bias_update(bias, -load, 0.001),
        "a step of gamma (load - mean), not gamma sign(load - mean)":
            bias - 0.001 * (load - load.mean())}


def _toy_counts():
    from refmath.moe import MoEConfig
    from refmath.sizing import ModelConfig, active_parameters

    return active_parameters(ModelConfig(
        "toy-moe", n_layers=4, d_model=256, n_heads=4, kv_heads=4, head_dim=64, vocab_size=1000,
        moe=MoEConfig(n_experts=8, top_k=2, d_expert=512, n_shared=1)))


_ONE_EXPERT = 3 * 256 * 512  # a SwiGLU expert: three d x d_e matrices


@exercise("15.5a", "the total", _E8, "every expert counts, the shared one too, and the untied "
          "output matrix", rtol=0.0)
def _toy_total():
    total = _toy_counts().total
    return total, {"the shared expert forgotten": total - 4 * _ONE_EXPERT,
                   "the output matrix forgotten (it is untied)": total - 1000 * 256,
                   "2 d d_e per expert: a SwiGLU has three matrices": total - 4 * 9 * 256 * 512}


@exercise("15.5b", "the active parameters", _E8,
          "the total less the E - k routed experts each token leaves idle, in every layer",
          rtol=0.0)
def _toy_active():
    counts = _toy_counts()
    return counts.active, {
        "all E routed experts taken off, the k chosen ones too": counts.total - 4 * 8 * _ONE_EXPERT,
        "2 d d_e per idle expert taken off a right total: a SwiGLU has three matrices":
            counts.total - 4 * 6 * 2 * 256 * 512,
        # the two slips give one number: 9 experts at 2 d d_e less 6 idle ones is 21 d d_e a
        # layer, as is the shared expert's 3 d d_e more taken off
        "3 d d_e a layer short: 2 d d_e per expert throughout (a SwiGLU has three matrices), "
        "or the shared expert taken off as well": counts.active - 4 * _ONE_EXPERT}


@exercise("15.6a", "bytes on 64 devices", _E9,
          "2 (there and back) x k x (1 - 1/D) x d x b", rtol=1e-12)
def _bytes_64_devices():
    from refmath.sizing import expert_parallel_bytes

    both = expert_parallel_bytes(7168, 8, 64)
    return both, {"one way only: the outputs come back too": both / 2,
                  "(1 - 1/D) left out: an expert on the token's own device costs nothing":
                      2 * 8 * 7168 * 2}


@exercise("15.6b", "bytes, node-limited", _E9,
          "a node receives the token once: min(k, M) sends, with (1 - 1/nodes)", rtol=1e-12)
def _bytes_node_limited():
    from refmath.sizing import expert_parallel_bytes

    both = expert_parallel_bytes(7168, 8, 8, max_devices=4)
    return both, {"k sends: a node receives the token once, min(k, M) in all":
                  expert_parallel_bytes(7168, 8, 8),
                  "one way only: the outputs come back too": both / 2}
