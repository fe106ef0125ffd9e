"""Block diagrams of refmath's four models and of FlashAttention's tiles, drawn with matplotlib.

Each diagram is read off the code it pictures: a model's boxes follow the parameter names of its
first layer in ``param_shapes`` (which norms, which attention, which feed-forward, in their order)
and its configuration (Pre-LN or Post-LN, tied head, the widths printed in the boxes); the tile map
runs :func:`refmath.flash.flash_attention_forward` and colours the tiles its counters say it
computed. ``docs/architecture.md`` shows them.
"""
from __future__ import annotations

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

COLOURS = {"embed": "#d9e8f5", "norm": "#fde9c9", "attn": "#f6d5d5", "ffn": "#d8efd8",
           "head": "#e6dcf0", "add": "#ffffff", "cache": "#fff3a8", "proj": "#eeeeee"}
BOX_W, BOX_H, GAP = 3.4, 0.62, 0.36


def _box(ax, x, y, text, kind, width=BOX_W):
    ax.add_patch(FancyBboxPatch((x - width / 2, y - BOX_H / 2), width, BOX_H,
                                boxstyle="round,pad=0.04,rounding_size=0.12",
                                facecolor=COLOURS[kind], edgecolor="#444444", linewidth=1.0))
    ax.text(x, y, text, ha="center", va="center", fontsize=8.5)


def _arrow(ax, start, end, curve=0.0, colour="#444444"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=10, color=colour,
                                 linewidth=1.0, connectionstyle=f"arc3,rad={curve}",
                                 shrinkA=2, shrinkB=2))


def _finish(ax, title, height):
    ax.set_xlim(-3, 3)
    ax.set_ylim(-0.7, height + 0.2)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=10)


def layer_parts(param_names, layer: int = 0) -> list[str]:
    """The sublayer prefixes of layer ``layer`` in the order the parameters are listed:
    ``["ln1", "attn", "ln2", "ffn"]`` for the decoders, with ``self_attn``/``cross_attn`` and
    their norms in the encoder-decoder."""
    prefix, parts = f"layers.{layer}.", []
    for name in param_names:
        if name.startswith(prefix) or f".{prefix}" in name:
            part = name.split(prefix, 1)[1].split(".")[0]
            if part not in parts:
                parts.append(part)
    return parts


def draw_stack(ax, title, below, layer, above, repeat: str, pre_norm: bool = True):
    """A decoder stack bottom to top: ``below`` boxes, one layer of ``(norm, branch)`` residual
    sublayers repeated ``repeat`` times (a bracket), then ``above``. Each entry is ``(text,
    kind)``; a sublayer is ``((norm text, branch text, branch kind))``."""
    y, x = 0.0, 0.0
    for i, (text, kind) in enumerate(below):
        _box(ax, x, y, text, kind)
        if i:
            _arrow(ax, (x, y - BOX_H / 2 - GAP), (x, y - BOX_H / 2))
        y += BOX_H + GAP
    layer_start = y - GAP / 2
    for norm, branch, kind in layer:
        residual_from = y - BOX_H / 2 - GAP / 2
        if pre_norm:
            _box(ax, x, y, norm, "norm")
            _arrow(ax, (x, y - BOX_H / 2 - GAP), (x, y - BOX_H / 2))
            y += BOX_H + GAP
            _box(ax, x, y, branch, kind)
            _arrow(ax, (x, y - BOX_H - GAP + BOX_H / 2), (x, y - BOX_H / 2))
            y += BOX_H / 2 + GAP
            ax.text(x, y, "+", ha="center", va="center", fontsize=12)
            _arrow(ax, (x, y - GAP), (x, y - 0.15))
            _arrow(ax, (x - BOX_W / 2 - 0.05, residual_from), (x - 0.18, y), curve=-0.35,
                   colour="#1f5fa8")
            y += GAP + BOX_H / 2
        else:
            _box(ax, x, y, branch, kind)
            _arrow(ax, (x, y - BOX_H / 2 - GAP), (x, y - BOX_H / 2))
            y += BOX_H / 2 + GAP
            ax.text(x, y, "+", ha="center", va="center", fontsize=12)
            _arrow(ax, (x, y - GAP), (x, y - 0.15))
            _arrow(ax, (x - BOX_W / 2 - 0.05, residual_from), (x - 0.18, y), curve=-0.35,
                   colour="#1f5fa8")
            y += GAP + BOX_H / 2
            _box(ax, x, y, norm, "norm")
            _arrow(ax, (x, y - BOX_H / 2 - GAP), (x, y - BOX_H / 2))
            y += BOX_H + GAP
    layer_end = y - GAP / 2 - (BOX_H / 2 if pre_norm else 0)
    ax.plot([BOX_W / 2 + 0.25] * 2, [layer_start, layer_end], color="#888888", linewidth=1.2)
    ax.text(BOX_W / 2 + 0.35, (layer_start + layer_end) / 2, repeat, rotation=90, va="center",
            fontsize=8.5, color="#555555")
    for text, kind in above:
        _box(ax, x, y, text, kind)
        _arrow(ax, (x, y - BOX_H / 2 - GAP), (x, y - BOX_H / 2))
        y += BOX_H + GAP
    _finish(ax, title, y)


def draw_gpt(ax, gpt, config):
    """GPT (M2) as ``gpt.param_shapes(config)`` lists it: learned positions, LayerNorm, biased MHA,
    GELU FFN; Pre-LN adds ``ln_f``, a tied head reads the token table."""
    names = list(gpt.param_shapes(config))
    parts = layer_parts(names)
    assert parts == ["ln1", "attn", "ln2", "ffn"], parts
    d, h, f = config.d_model, config.n_heads, config.d_ff
    layer = [("LayerNorm", f"causal MHA, h = {h}, biases", "attn"),
             ("LayerNorm", f"GELU FFN, {d} -> {f} -> {d}", "ffn")]
    above = [("LayerNorm (ln_f)", "norm")] if "ln_f.gamma" in names else []
    head = r"logits $= x E^\top$ (tied)" if config.tie_embeddings else r"logits $= x W_{head}$"
    draw_stack(ax, f"GPT ({config.norm_position}-LN)",
               [("tokens", "add"), ("E[a] + P (learned positions)", "embed")], layer,
               above + [(head, "head")], f"x {config.n_layers} layers",
               pre_norm=config.norm_position == "pre")


def draw_decoder(ax, decoder, config):
    """The modern decoder (M3): RMSNorm, RoPE with grouped-query attention, SwiGLU, an untied head."""
    parts = layer_parts(decoder.param_shapes(config))
    assert parts == ["ln1", "attn", "ln2", "ffn"], parts
    h, g, d_f = config.n_heads, config.kv_heads, config.d_f
    layer = [("RMSNorm", f"RoPE attention, h = {h}, g = {g}", "attn"),
             ("RMSNorm", f"SwiGLU, d_f = {d_f}", "ffn")]
    head = r"logits $= x E^\top$ (tied)" if config.tie_embeddings else r"logits $= x W_{head}$"
    draw_stack(ax, "modern decoder (M3)", [("tokens", "add"), ("E[a] (no position table)", "embed")],
               layer, [("RMSNorm (ln_f)", "norm"), (head, "head")],
               f"x {config.n_layers} layers")


def draw_encoder_decoder(ax, transformer, config):
    """The original Transformer (M1): a Post-LN encoder beside a Post-LN decoder whose
    cross-attention reads the encoder's output."""
    names = list(transformer.param_shapes(config))
    enc, dec = layer_parts([n for n in names if n.startswith("encoder.")]), \
        layer_parts([n for n in names if n.startswith("decoder.")])
    y_top = 0.0
    for x, parts, label in ((-1.55, enc, "encoder"), (1.55, dec, "decoder")):
        y = 0.0
        _box(ax, x, y, "E[a] sqrt(d) + sinusoids", "embed", width=2.7)
        for part in parts:
            if part.endswith("_ln") or part.startswith("ln"):
                continue
            kind = "ffn" if part == "ffn" else "attn"
            text = {"self_attn": "masked self-attention" if label == "decoder" else "self-attention",
                    "cross_attn": "cross-attention", "ffn": "ReLU FFN"}.get(part, part)
            y += BOX_H + GAP
            _box(ax, x, y, text, kind, width=2.7)
            _arrow(ax, (x, y - BOX_H / 2 - GAP), (x, y - BOX_H / 2))
            y += BOX_H + GAP
            _box(ax, x, y, "add & LayerNorm", "norm", width=2.7)
            _arrow(ax, (x, y - BOX_H / 2 - GAP), (x, y - BOX_H / 2))
            if part == "cross_attn":
                cross_y = y - BOX_H - GAP
        if label == "decoder":
            y += BOX_H + GAP
            tied = config.tie_embeddings
            _box(ax, x, y, r"logits $= x E^\top$" if tied else r"logits $= x W_{head}$", "head",
                 width=2.7)
            _arrow(ax, (x, y - BOX_H / 2 - GAP), (x, y - BOX_H / 2))
        ax.text(x, y + BOX_H, f"{label}: x {config.n_layers} layers", ha="center", fontsize=8.5,
                color="#555555")
        if label == "encoder":
            encoder_top = y
        y_top = max(y_top, y)
    _arrow(ax, (-1.55 + 1.35, encoder_top), (1.55 - 1.35, cross_y), curve=0.25, colour="#1f5fa8")
    ax.set_xlim(-3.1, 3.1)
    ax.set_ylim(-0.7, y_top + 1.2)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("encoder-decoder (M1, Post-LN)", fontsize=10)


def draw_mla_cache(ax, mla, config):
    """MLA's cache path (K8, K9): what a token leaves in the cache (``mla.cache_spec``) and how a
    new query reads it, absorbed."""
    spec = mla.cache_spec(config, 1, config.max_seq_len)
    d_c, d_r = spec.latent_width, spec.shapes[0][-1] - spec.latent_width
    items = [((-1.6, 0.0), r"token row $x_j$", "embed"),
             ((-1.6, 1.2), rf"$c_j = x_j W_{{DKV}}$  ({d_c})", "proj"),
             ((1.6, 1.2), rf"$k^R_j = $RoPE$(x_j W_{{KR}})$  ({d_r})", "proj"),
             ((0.0, 2.5), rf"cache row $[c_j\ k^R_j]$: {d_c + d_r} numbers", "cache"),
             ((-1.6, 3.8), r"$q^C W_{UK}^\top$ (absorbed)", "attn"),
             ((1.6, 3.8), r"$q^R$ (RoPE)", "attn"),
             ((0.0, 5.1), "softmax over the cached rows", "attn"),
             ((0.0, 6.4), r"$(\sum_j a_j c_j)\, W_{UV} W_O$", "head")]
    for (x, y), text, kind in items:
        _box(ax, x, y, text, kind, width=2.9)
    for a, b in [((-1.6, 0.3), (-1.6, 0.9)), ((-1.6, 0.3), (1.6, 0.9)), ((-1.6, 1.5), (-0.3, 2.2)),
                 ((1.6, 1.5), (0.3, 2.2)), ((-0.3, 2.8), (-1.6, 3.5)), ((0.3, 2.8), (1.6, 3.5)),
                 ((-1.6, 4.1), (-0.3, 4.8)), ((1.6, 4.1), (0.3, 4.8)), ((0.0, 5.4), (0.0, 6.1))]:
        _arrow(ax, a, b)
    n_heads, d_h = config.n_heads, config.d_h
    ax.text(0.0, -0.75, f"MHA would cache 2 h d_h = {2 * n_heads * d_h} numbers per token and layer",
            ha="center", fontsize=8.5, color="#555555")
    ax.set_xlim(-3.2, 3.2)
    ax.set_ylim(-1.1, 7.0)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("MLA: the latent cache path", fontsize=10)


def draw_flash_tiles(ax, flash, attention, t: int = 64, block: int = 16,
                     window: int | None = None):
    """The tiles of a causal FlashAttention forward: a (query tile, key tile) pair is computed
    when the mask leaves one of its pairs visible and skipped otherwise, and the counters of
    :func:`refmath.flash.flash_attention_forward` must agree on the number of each."""
    mask = (attention.causal_mask(t, t) if window is None
            else attention.local_window_mask(t, window))
    n = t // block
    visible = (mask == 0).reshape(n, block, n, block).any(axis=(1, 3))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, t, 16)) for _ in range(3))
    counters = flash.FlashCounters()
    flash.flash_attention_forward(q, k, v, causal=True, window=window, block_q=block,
                                  block_k=block, counters=counters)
    assert counters.tiles_computed == visible.sum() and counters.tiles_skipped == (~visible).sum()
    ax.imshow(visible, cmap=ListedColormap(["#ffffff", "#9ecae1"]), vmin=0, vmax=1)
    ax.set_xticks(range(n), [f"K{j}" for j in range(n)])
    ax.set_yticks(range(n), [f"Q{i}" for i in range(n)])
    for i in range(n):
        for j in range(n):
            ax.text(j, i, "computed" if visible[i, j] else "skipped", ha="center", va="center",
                    fontsize=7)
    where = "causal" if window is None else f"window {window}"
    ax.set_title(f"FlashAttention tiles, T = {t}, tiles of {block}, {where}: "
                 f"{counters.tiles_computed} computed, {counters.tiles_skipped} skipped",
                 fontsize=10)
