"""Time one training step (forward + backward + AdamW) of refmath's models against PyTorch CPU eager.

Both sides run the same network in float32 on the same number of threads: refmath's GPT (M2) and
modern decoder (M3), and the same architectures written here with ``torch.nn.functional`` ops, their
weights copied from refmath's parameters (transposed where torch stores ``out x in``). Before any
timing the script checks that both give the same loss and the same gradients to float32 accuracy,
so the comparison is between two implementations of one function, not two different networks.

Run from the repository root::

    python benchmarks/train_step.py                  # d=256, L=4, T=256, B=8, vocab 256
    python benchmarks/train_step.py --models gpt --repeats 10 --d-model 128
    python benchmarks/train_step.py --quick          # small sizes, a few steps (seconds)

Timings are printed, never asserted. Each step is timed per phase (forward, backward, optimiser
step); every figure is the median over ``--repeats`` steps after ``--warmup`` untimed ones (the
minimum beside it), with the two implementations taking turns in an order that alternates.

The optimiser peer is torch at its best. torch.optim.AdamW's default on the CPU is a Python loop
over the tensors, one small kernel each; ``foreach=True`` updates them in batches and
``fused=True`` in one fused kernel. Before the steps, the script times one optimiser step alone on
the same gradients (rotating turns, median and minimum): refmath's :class:`~refmath.fast.flat_adamw.FlatAdamW`
(the training form, one buffer) on its default backend (the C++ kernel
:func:`refmath.kernels.adamw_step` where the extension is built; ``--adamw-backend`` picks one) and
on its NumPy form, per-parameter :class:`~refmath.optim.AdamW` (the readable form), the three torch
forms and, as the floor no AdamW step can beat, one NumPy pass that moves as
many bytes as an AdamW step must: 28 per float32 parameter (p, g, m, v read, p, m, v written), here
14 read and written back in place, as AdamW writes back what it read (a copy into another array
would also read its target into the cache first, and take half as long again). It prints all of
them, and the whole-step comparison then uses FlatAdamW against the fastest torch form
(``--torch-optimizer`` picks one instead). The thread count is the same on both sides: NumPy's
matrix products use it and FlatAdamW splits its buffer over that many threads, but NumPy's other
element-wise operations run on one thread, while torch spreads every operation over its threads:
``--threads 1`` compares the arithmetic alone. On a machine that other processes keep busy,
``--threads 1 --clock cpu`` (CPU time instead of elapsed time) gives steadier figures.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

# Run as a script from anywhere: make the checkout's refmath importable without installing it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refmath.models import decoder, gpt  # noqa: E402
from refmath.malloc import retain_freed_memory  # noqa: E402
from refmath.fast.flat_adamw import FlatAdamW  # noqa: E402
from refmath.optim import AdamW, takes_weight_decay  # noqa: E402

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - the benchmark needs the peer
    sys.exit("this benchmark compares with PyTorch: install torch (pip install -e '.[oracle]')")

LR, WEIGHT_DECAY = 3e-4, 0.1
PHASES = ("forward", "backward", "optimizer")
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


# ---- threads and BLAS ---------------------------------------------------------------------------

def blas_info() -> tuple[int, str]:
    """``(threads, description)`` of the BLAS NumPy calls; ``os.cpu_count()`` without threadpoolctl."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return os.cpu_count() or 1, "BLAS unknown: install threadpoolctl to see which kernel runs"
    pools = [pool for pool in threadpool_info() if pool.get("user_api") == "blas"]
    # torch may have loaded a BLAS of its own: prefer the one shipped with (or named by) NumPy
    pools.sort(key=lambda pool: "numpy" not in pool.get("filepath", ""))
    if not pools:
        return os.cpu_count() or 1, "no BLAS found by threadpoolctl"
    pool = pools[0]
    return pool["num_threads"], (f"{pool['internal_api']} {pool.get('version')}, kernel "
                                 f"{pool.get('architecture')}, {pool['num_threads']} threads")


def limit_blas_threads(n: int):
    """Limit NumPy's BLAS to ``n`` threads for the rest of the run; None if threadpoolctl is missing."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(limits=n, user_api="blas")


def openblas_note() -> str | None:
    """OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE pin an older kernel choice and slow a current NumPy."""
    set_vars = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ}
    if not set_vars:
        return None
    return (f"note: {set_vars} is set; it can make NumPy's OpenBLAS pick a slower kernel. To compare "
            f"with the default choice, run with both unset (env -u OPENBLAS_CORETYPE -u "
            f"OPENBLAS_L2_SIZE ...) and check the kernel printed above.")


def load_note() -> str | None:
    """Other processes on the machine slow both sides unevenly; say so when the load is high."""
    if not hasattr(os, "getloadavg"):
        return None
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load < 0.5 * cpus:
        return None
    return (f"note: load average {load:.1f} on {cpus} CPUs before starting: other processes compete "
            f"for the cores, so wall-clock timings are noisy (the two sides alternate step by step to "
            f"share it; --threads 1 --clock cpu is steadier)")


# ---- the torch mirrors --------------------------------------------------------------------------

def _torch_layout(name: str) -> bool:
    """Whether torch keeps this refmath ``d_in x d_out`` matrix transposed (``out x in``)."""
    leaf = name.rsplit(".", 1)[-1]
    return name == "lm_head" or leaf.startswith("w")


def to_torch(params: dict) -> dict:
    """Leaf tensors holding refmath's parameters, matrices transposed to torch's ``out x in``."""
    return {name: torch.tensor(np.ascontiguousarray(value.T if _torch_layout(name) else value),
                                requires_grad=True)
            for name, value in params.items()}


def from_torch_grad(name: str, tensor) -> np.ndarray:
    g = tensor.grad.numpy()
    return g.T if _torch_layout(name) else g


def torch_gpt_loss(P: dict, tokens, targets, config: gpt.GPTConfig, sdpa: bool):
    """Pre-LN GPT-2 with tied embeddings (the benchmark's config), from torch functional ops."""
    b, t = tokens.shape
    d, h = config.d_model, config.n_heads
    eps = config.norm_eps
    approximate = "tanh" if config.ffn == "gelu_tanh" else "none"
    causal = torch.ones(t, t, dtype=torch.bool).triu(1)  # True above the diagonal: future keys

    def heads(z):  # (B, T, d) -> (B, h, T, d_h)
        return z.view(b, t, h, d // h).transpose(1, 2)

    x = F.embedding(tokens, P["tok_emb"]) + P["pos_emb"][:t]
    for i in range(config.n_layers):
        p = f"layers.{i}."
        u = F.layer_norm(x, (d,), P[p + "ln1.gamma"], P[p + "ln1.beta"], eps)
        q, k, v = (heads(F.linear(u, P[p + "attn.w_" + s], P[p + "attn.b_" + s])) for s in "qkv")
        if sdpa:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
            o = torch.softmax(scores.masked_fill(causal, -math.inf), dim=-1) @ v
        o = o.transpose(1, 2).reshape(b, t, d)
        x = x + F.linear(o, P[p + "attn.w_o"], P[p + "attn.b_o"])
        u = F.layer_norm(x, (d,), P[p + "ln2.gamma"], P[p + "ln2.beta"], eps)
        hidden = F.gelu(F.linear(u, P[p + "ffn.w1"], P[p + "ffn.b1"]), approximate=approximate)
        x = x + F.linear(hidden, P[p + "ffn.w2"], P[p + "ffn.b2"])
    x = F.layer_norm(x, (d,), P["ln_f.gamma"], P["ln_f.beta"], eps)
    logits = F.linear(x, P["tok_emb"])  # tied: h E^T with the (V, d) table itself
    return F.cross_entropy(logits.reshape(b * t, -1), targets.reshape(-1))


def rope_tables(t: int, d_h: int, base: float):
    """cos and sin of RoPE's angles, ``(T, d_h/2)``, built once as a torch model keeps them."""
    freqs = base ** (-torch.arange(0, d_h, 2, dtype=torch.float64) / d_h)
    angles = torch.outer(torch.arange(t, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def torch_rope(x, cos, sin):
    """Rotate each coordinate pair (x_2r, x_2r+1) by its angle; ``x`` is ``(B, n, T, d_h)``."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def torch_decoder_loss(P: dict, tokens, targets, config: decoder.DecoderConfig, sdpa: bool, rope):
    """Pre-RMSNorm, RoPE, GQA, SwiGLU decoder with an untied head, from torch functional ops."""
    b, t = tokens.shape
    h, g, d_h, eps = config.n_heads, config.kv_heads, config.d_h, config.norm_eps
    d = config.d_model
    cos, sin = rope
    causal = torch.ones(t, t, dtype=torch.bool).triu(1)

    def heads(z, n):
        return z.view(b, t, n, d_h).transpose(1, 2)

    x = F.embedding(tokens, P["tok_emb"])
    for i in range(config.n_layers):
        p = f"layers.{i}."
        u = F.rms_norm(x, (d,), P[p + "ln1.gamma"], eps)
        q = torch_rope(heads(F.linear(u, P[p + "attn.w_q"]), h), cos, sin)
        k = torch_rope(heads(F.linear(u, P[p + "attn.w_k"]), g), cos, sin)
        v = heads(F.linear(u, P[p + "attn.w_v"]), g)
        if sdpa:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(d_h)
            o = torch.softmax(scores.masked_fill(causal, -math.inf), dim=-1) @ v
        x = x + F.linear(o.transpose(1, 2).reshape(b, t, h * d_h), P[p + "attn.w_o"])
        u = F.rms_norm(x, (d,), P[p + "ln2.gamma"], eps)
        hidden = F.silu(F.linear(u, P[p + "ffn.w_gate"])) * F.linear(u, P[p + "ffn.w_up"])
        x = x + F.linear(hidden, P[p + "ffn.w_down"])
    x = F.rms_norm(x, (d,), P["ln_f.gamma"], eps)
    logits = F.linear(x, P["lm_head"])
    return F.cross_entropy(logits.reshape(b * t, -1), targets.reshape(-1))


# ---- one model: check, then time ------------------------------------------------------------------

def build(model: str, args):
    """``(refmath module, config, one-line description, torch loss function)`` for one model."""
    common = dict(vocab_size=args.vocab, max_seq_len=args.seq_len, n_layers=args.n_layers,
                  d_model=args.d_model, n_heads=args.heads)
    if model == "gpt":
        config = gpt.GPTConfig(**common, norm_position="pre", tie_embeddings=True,
                               ffn="gelu_tanh", dropout=0.0, attention_backend=args.attention)
        describe = (f"GPT (M2): Pre-LN, tied embeddings, GELU tanh, biases, d_ff = {config.d_ff}, "
                    f"{config.n_heads} heads of {config.d_h}, attention on {args.attention}")

        def torch_loss(P, tokens, targets):
            return torch_gpt_loss(P, tokens, targets, config, args.torch_attention == "sdpa")
        return gpt, config, describe, torch_loss
    config = decoder.DecoderConfig(**common, n_kv_heads=args.kv_heads, tie_embeddings=False,
                                   dropout=0.0, attention_backend=args.attention)
    describe = (f"decoder (M3): Pre-RMSNorm, RoPE, GQA {config.n_heads} query / {config.kv_heads} "
                f"key-value heads of {config.d_h}, SwiGLU d_f = {config.d_f}, untied head, "
                f"attention on {args.attention}")
    rope = rope_tables(args.seq_len, config.d_h, config.rope_base)

    def torch_loss(P, tokens, targets):
        return torch_decoder_loss(P, tokens, targets, config, args.torch_attention == "sdpa", rope)
    return decoder, config, describe, torch_loss


def check_same_function(module, config, params, P, batch, torch_loss) -> str:
    """Loss and every gradient of refmath and torch must agree to float32 accuracy."""
    loss, cache = module.forward(params, batch, config, train=True)
    grads = module.backward(cache)
    upcast = sorted(n for n, g in grads.items() if g.dtype != np.float32)
    if np.asarray(loss).dtype != np.float32 or upcast:
        raise SystemExit(f"refmath left float32: loss {np.asarray(loss).dtype}, gradients {upcast[:4]}")
    t_loss = torch_loss(P, torch.from_numpy(batch["tokens"]), torch.from_numpy(batch["targets"]))
    t_loss.backward()
    loss_err = abs(float(loss) - t_loss.item()) / abs(t_loss.item())
    # A gradient's error relative to its largest entry: float32 sums of ~B*T terms agree to ~1e-5.
    # The key bias is skipped: its gradient is 0 in exact arithmetic (softmax ignores the per-row
    # shift q . b_k), so both sides hold rounding noise only.
    grad_err = max(float(np.abs(grads[n] - from_torch_grad(n, P[n])).max() / np.abs(grads[n]).max())
                   for n in params if not n.endswith("attn.b_k"))
    for tensor in P.values():
        tensor.grad = None
    if loss_err > 1e-5 or grad_err > 1e-3:
        raise SystemExit(f"refmath and torch disagree: loss {float(loss)} vs {t_loss.item()} "
                         f"(relative {loss_err:.1e}), worst gradient relative error {grad_err:.1e}")
    return (f"same function: loss {float(loss):.6f} vs {t_loss.item():.6f} (relative {loss_err:.1e}), "
            f"worst gradient error {grad_err:.1e} of its largest entry")


def time_steps(steps: dict, warmup: int, repeats: int) -> dict:
    """Median seconds of each phase and of the whole step (and the fastest step), per
    implementation.

    ``steps`` maps a name to a function that runs one step and returns its phase times. The
    implementations take turns step by step, so that a change in the machine's load (other
    processes, clock speed) falls on both alike instead of on whichever ran second.
    """
    for _ in range(warmup):
        for step in steps.values():
            step()
    runs = {name: [] for name in steps}
    names = list(steps)
    for r in range(repeats):
        shift = r % len(names)  # the order rotates: nobody always runs first
        for name in names[shift:] + names[:shift]:
            runs[name].append(steps[name]())
    medians = {}
    for name, phases in runs.items():
        medians[name] = {phase: statistics.median(r[i] for r in phases) for i, phase in enumerate(PHASES)}
        medians[name]["step"] = statistics.median(sum(r) for r in phases)
        medians[name]["step min"] = min(sum(r) for r in phases)
    return medians


def refmath_step(module, config, params, batch, optimizer, clock):
    def step():
        t0 = clock()
        _, cache = module.forward(params, batch, config, train=True)
        t1 = clock()
        grads = module.backward(cache)
        del cache  # free the activations before the optimiser step, as torch does
        t2 = clock()
        optimizer.step(params, grads)
        return t1 - t0, t2 - t1, clock() - t2
    return step


def torch_step(torch_loss, P, batch, optimizer, clock):
    tokens, targets = torch.from_numpy(batch["tokens"]), torch.from_numpy(batch["targets"])

    def step():
        t0 = clock()
        optimizer.zero_grad(set_to_none=True)
        loss = torch_loss(P, tokens, targets)
        t1 = clock()
        loss.backward()
        t2 = clock()
        optimizer.step()
        return t1 - t0, t2 - t1, clock() - t2
    return step


TORCH_ADAMW_FORMS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def torch_adamw(P: dict, form: str = "default"):
    """torch's AdamW with refmath's decay rule (matrices decay; biases, norms, embeddings do not),
    in one of its implementations: ``default`` (a loop over the tensors on the CPU), ``foreach``
    (batched over the tensors), ``fused`` (one fused kernel)."""
    groups = [{"params": [t for n, t in P.items() if takes_weight_decay(n)], "weight_decay": WEIGHT_DECAY},
              {"params": [t for n, t in P.items() if not takes_weight_decay(n)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, **TORCH_ADAMW_FORMS[form])


def time_optimizers(module, config, params, batch, torch_loss, clock, args, threads: int) -> dict:
    """Seconds of one AdamW step alone, ``{name: [s, ...]}``: refmath's two forms, each torch form
    (on copies of the same parameters with the same gradients) and one pass over as many bytes as
    a step moves, in rotating turns."""
    _, cache = module.forward(params, batch, config, train=True)
    grads = module.backward(cache)
    del cache
    per_parameter = {n: v.copy() for n, v in params.items()}
    flat_params = {n: v.copy() for n, v in params.items()}
    flat = FlatAdamW(flat_params, LR, weight_decay=WEIGHT_DECAY, threads=threads,
                     backend=args.adamw_backend)
    numpy_params = {n: v.copy() for n, v in params.items()}
    numpy_flat = FlatAdamW(numpy_params, LR, weight_decay=WEIGHT_DECAY, threads=threads,
                           backend="numpy")
    # 28 bytes per parameter: negating 3.5 float32 per parameter in place reads 14 and writes 14
    n_params = sum(p.size for p in params.values())
    stream = np.ones(7 * n_params // 2, np.float32)
    P = to_torch(params)
    torch_loss(P, torch.from_numpy(batch["tokens"]), torch.from_numpy(batch["targets"])).backward()
    forms = {}
    for form in TORCH_ADAMW_FORMS:
        copy = {n: t.detach().clone().requires_grad_(True) for n, t in P.items()}
        for n, t in copy.items():
            t.grad = P[n].grad.clone()
        forms[form] = torch_adamw(copy, form)
    optimizer = AdamW(LR, weight_decay=WEIGHT_DECAY)

    def timed(step):
        def run():
            t0 = clock()
            step()
            return clock() - t0
        return run
    steps = {"refmath flat": timed(lambda: flat.step(flat_params, grads)),
             "refmath flat NumPy form": timed(lambda: numpy_flat.step(numpy_params, grads)),
             "refmath per-parameter": timed(lambda: optimizer.step(per_parameter, grads))}
    steps.update({f"torch {form}": timed(opt.step) for form, opt in forms.items()})
    steps[FLOOR] = timed(lambda: np.negative(stream, out=stream))
    names = list(steps)
    for _ in range(max(1, args.warmup)):
        for step in steps.values():
            step()
    runs = {name: [] for name in names}
    for r in range(args.repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(steps[name]())
    return runs


FLOOR = "28 B/parameter in place"


def run_model(model: str, args, threads: int) -> dict:
    module, config, describe, torch_loss = build(model, args)
    params = module.init_params(config, seed=0, dtype=np.float32)
    rng = np.random.default_rng(1)
    batch = {"tokens": rng.integers(0, args.vocab, (args.batch, args.seq_len)),
             "targets": rng.integers(0, args.vocab, (args.batch, args.seq_len))}
    P = to_torch(params)  # copies, taken before refmath's optimiser changes params in place
    n_params = sum(p.size for p in params.values())
    print(f"\n{describe}; {n_params:,} parameters")
    print("  " + check_same_function(module, config, params, P, batch, torch_loss))
    clock = CLOCKS[args.clock]
    runs = time_optimizers(module, config, params, batch, torch_loss, clock, args, threads)
    ms = {name: (1e3 * statistics.median(r), 1e3 * min(r)) for name, r in runs.items()}
    backend = FlatAdamW({"w": np.zeros(1, np.float32)}, LR, backend=args.adamw_backend).backend
    print(f"  refmath flat is FlatAdamW on its {backend!r} backend ("
          + ("the C++ kernel refmath.kernels.adamw_step, one pass" if backend == "cpu" else
             "NumPy calls over cache-sized blocks") + f", {threads} threads)")
    print(f"  AdamW step alone, {args.repeats} rotating turns: " + "; ".join(
        f"{name} {med:.2f} ms (min {low:.2f})" for name, (med, low) in ms.items() if name != FLOOR))
    floor, floor_min = ms[FLOOR]
    print(f"  the memory floor: one NumPy pass moving an AdamW step's 28 bytes per parameter takes "
          f"{floor:.2f} ms (min {floor_min:.2f}, {28 * n_params / floor_min / 1e6:.1f} GB/s)")
    forms = {form: ms[f"torch {form}"][0] for form in TORCH_ADAMW_FORMS}
    form = args.torch_optimizer or min(forms, key=forms.get)
    flat = ms["refmath flat"][0]
    print(f"  refmath flat / torch: {flat / forms['default']:.2f}x the default's time, "
          f"{flat / forms['foreach']:.2f}x foreach's, {flat / forms['fused']:.2f}x fused's, "
          f"{flat / floor:.2f}x the floor's (medians; per-parameter / flat "
          f"{ms['refmath per-parameter'][0] / flat:.2f}x, NumPy form / flat "
          f"{ms['refmath flat NumPy form'][0] / flat:.2f}x); the steps below use torch {form}"
          + ("" if args.torch_optimizer else " (the fastest)"))
    optimizer = FlatAdamW(params, LR, weight_decay=WEIGHT_DECAY, threads=threads,  # params: views
                          backend=args.adamw_backend)
    steps = {"ours": refmath_step(module, config, params, batch, optimizer, clock),
             "theirs": torch_step(torch_loss, P, batch, torch_adamw(P, form), clock)}
    result = time_steps(steps, args.warmup, args.repeats)
    result["optimizers"] = ms
    result["torch form"] = form
    return result


def print_table(results: dict) -> None:
    print("\nmedians (the fastest step beside the median step); refmath/torch above 1: torch is "
          "faster; torch's optimiser is the form named after the model")
    print(f"{'model':<17} {'phase':<13} {'refmath ms':>11} {'torch ms':>9} {'refmath/torch':>14}")
    for model, r in results.items():
        label = f"{model} ({r['torch form']})"
        for phase in PHASES + ("step", "step min"):
            ours, theirs = 1e3 * r["ours"][phase], 1e3 * r["theirs"][phase]
            print(f"{label:<17} {phase:<13} {ours:>11.1f} {theirs:>9.1f} {ours / theirs:>13.2f}x")
        opt = r["optimizers"]
        for form in TORCH_ADAMW_FORMS:
            ours, theirs = opt["refmath flat"][0], opt[f"torch {form}"][0]
            print(f"{label:<17} {'AdamW ' + form:<13} {ours:>11.2f} {theirs:>9.2f} {ours / theirs:>13.2f}x")
        ours, theirs = opt["refmath flat NumPy form"][0], opt["torch fused"][0]
        print(f"{label:<17} {'NumPy / fused':<13} {ours:>11.2f} {theirs:>9.2f} {ours / theirs:>13.2f}x")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Time forward + backward + AdamW of refmath's GPT and modern decoder against "
                    "the same networks in PyTorch CPU eager (float32, same thread count).")
    parser.add_argument("--models", nargs="+", choices=("gpt", "decoder"), default=["gpt", "decoder"])
    parser.add_argument("--d-model", type=int, default=256, help="model width d (default 256)")
    parser.add_argument("--n-layers", type=int, default=4, help="layers L (default 4)")
    parser.add_argument("--heads", type=int, default=4, help="query heads h (default 4)")
    parser.add_argument("--kv-heads", type=int, default=2,
                        help="key/value heads g of the decoder (default 2: GQA)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence T (default 256)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch B (default 8)")
    parser.add_argument("--vocab", type=int, default=256,
                        help="vocabulary size (default 256: byte-level characters)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps; medians (default 7)")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for both sides (needs threadpoolctl for NumPy's BLAS; "
                             "default: as many as NumPy's BLAS uses, and torch the same)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="wall: elapsed time (default); cpu: this process's CPU time, which "
                             "other processes on a busy machine barely disturb (with --threads 1 "
                             "only: with more threads it would add up every thread's time, "
                             "spin-waiting included)")
    parser.add_argument("--attention", choices=("numpy", "cpu"), default="numpy",
                        help="refmath side: causal attention in NumPy (default) or in the C++ "
                             "FlashAttention kernel (the configs' attention_backend)")
    parser.add_argument("--torch-attention", choices=("sdpa", "explicit"), default="sdpa",
                        help="torch side: F.scaled_dot_product_attention (default) or an explicit "
                             "masked softmax like refmath's")
    parser.add_argument("--torch-optimizer", choices=tuple(TORCH_ADAMW_FORMS), default=None,
                        help="torch's AdamW form in the whole steps (default: the fastest of "
                             "default, foreach and fused in the optimiser-alone timing)")
    parser.add_argument("--adamw-backend", choices=("numpy", "cpu"), default=None,
                        help="refmath side: FlatAdamW's backend, the C++ kernel (cpu) or the NumPy "
                             "form (default: the kernel where the extension is built); the "
                             "optimiser-alone timing shows the NumPy form beside it either way")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run of seconds: d=64, L=2, T=64, B=2, 1 warmup, 3 repeats")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's malloc thresholds as they are (see refmath.malloc)")
    args = parser.parse_args(argv)
    if args.quick:
        args.d_model, args.n_layers, args.seq_len, args.batch = 64, 2, 64, 2
        args.warmup, args.repeats = 1, 3
    for name in ("d_model", "n_layers", "heads", "kv_heads", "seq_len", "batch", "vocab", "repeats",
                 "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu needs --threads 1 (CPU time adds up the time of every thread)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    limiter = limit_blas_threads(args.threads) if args.threads else None  # kept for the whole run
    if args.threads and limiter is None:
        sys.exit("--threads needs threadpoolctl to set NumPy's BLAS threads; without it, set "
                 "OPENBLAS_NUM_THREADS (or OMP_NUM_THREADS) before starting instead")
    threads, blas = blas_info()
    torch.set_num_threads(threads)
    print(f"NumPy {np.__version__} ({blas}); torch {torch.__version__} with {threads} threads")
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"load average {load[0]:.1f} (1 min), {load[1]:.1f} (5 min) on {os.cpu_count()} CPUs")
    # Both sides allocate through malloc in this one process; keeping freed blocks (as python -m
    # refmath train does) spares NumPy a page fault per 4 KiB of every large temporary.
    if not args.default_malloc:
        print(f"malloc keeps freed memory (refmath.malloc): {retain_freed_memory()}")
    for note in (openblas_note(), load_note()):
        if note:
            print(note)
    print(f"float32, B = {args.batch}, T = {args.seq_len}, d = {args.d_model}, L = {args.n_layers}, "
          f"vocab = {args.vocab}, AdamW lr {LR} decay {WEIGHT_DECAY}, dropout 0; median of "
          f"{args.repeats} steps after {args.warmup} warmup; {args.clock} clock; torch attention: "
          f"{args.torch_attention}")
    try:
        results = {model: run_model(model, args, threads) for model in args.models}
    except ValueError as error:  # sizes the model configs reject, e.g. heads not dividing d
        sys.exit(f"error: {error}")
    print_table(results)


if __name__ == "__main__":
    main()
