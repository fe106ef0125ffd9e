r"""Gemma (``gemma``, ``gemma2``, ``gemma3_text``): Llama's decoder with these differences.

- **GeGLU** (N20): the gated FFN gates with the tanh form of GELU instead of SiLU.
- **Embeddings scaled by** :math:`\sqrt d`: :math:`x^{(0)} = \sqrt d\, E[a]`; the tied head still
  reads the unscaled table.
- **RMSNorm gain** :math:`1 + \gamma`: the stored gain starts at 0.
- **Score scale** :math:`1/\sqrt s` with ``query_pre_attn_scalar`` = ``s`` instead of
  :math:`1/\sqrt{d_h}` (Gemma 2, 3).
- **Soft-capping** (N19): attention scores and final logits squashed to :math:`c \tanh(x / c)`
  (Gemma 2).
- **Sandwich norms** (Gemma 2, 3): each branch's output is RMS-normalised before the residual sum,

  .. math::
      x' = x + \operatorname{RMSNorm}(\operatorname{Attn}(\operatorname{RMSNorm}(x))),\qquad
      x'' = x' + \operatorname{RMSNorm}(\operatorname{GeGLU}(\operatorname{RMSNorm}(x')))

- **Local and global layers** (A12): a layer with a window attends to its last ``w`` positions
  only; Gemma 3's local layers rotate at their own RoPE base, without the global rope scaling.
- **QK-norm per head** (N18, Gemma 3): each head's queries and keys RMS-normalised before RoPE.

Everything else is Llama's: RoPE (N10) on grouped-query attention (A10), computed by Llama's own
sublayer (:data:`refmath.models.rope_attention.ROPE_GQA`, which reads the score scale, the cap,
the window and QK-norm from the config), the final RMSNorm, no biases, the head tied to the token
table. The layer is the list of block calls in :func:`block_forward`, its backward the mirror in
:func:`layer_backward`.

Parameters (flat dict, row vectors ``x @ W``)::

    tok_emb                          (V, d)       also the head, transposed (tied)
    layers.{i}.ln1.gamma             (d,)         the RMSNorm before the attention
    layers.{i}.attn.w_q, w_k, w_v    (d, h d_h), (d, g d_h), (d, g d_h)
    layers.{i}.attn.w_o              (h d_h, d)
    layers.{i}.attn.q_norm.gamma     (d_h,)       Gemma 3's QK-norm, one gain shared by the heads
    layers.{i}.attn.k_norm.gamma     (d_h,)
    layers.{i}.ln1_post.gamma        (d,)         Gemma 2, 3: the RMSNorm after the attention
    layers.{i}.ln2.gamma             (d,)         the RMSNorm before the FFN
    layers.{i}.ln2_post.gamma        (d,)         Gemma 2, 3: the RMSNorm after the FFN
    layers.{i}.ffn.w_gate, w_up      (d, d_f)
    layers.{i}.ffn.w_down            (d_f, d)
    ln_f.gamma                       (d,)

Every stored gain is :math:`\gamma` of :math:`1 + \gamma`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np

from refmath._validate import check_choice, check_field, check_int, check_real
from refmath.attention import ATTENTION_BACKENDS
from refmath.embedding import EmbeddingCache, embedding_backward, embedding_forward
from refmath.ffn import (LinearCache, SoftcapCache, linear_backward, linear_forward,
                         matmul_rows_many,
                         softcap_backward, softcap_forward)
from refmath.losses import CrossEntropyCache
from refmath.models import check_config
from refmath.models import blocks
from refmath.models.batch import network_logits, network_loss, next_token_loss_backward
from refmath.models import network, rope_attention
from refmath.models.network import layers_backward, layers_forward, table_gradients
from refmath.models.cases import model_case_maker
from refmath.models.common import (CacheSpec, HeadDimHeads, TrainingRecipe, prefixed, sub_params,
                                   layer_dropout_masks)
from refmath.models.decoder import rope_attention_inputs
from refmath.models.decoder_config import check_rope_fields
from refmath.models.hf_layout import (ATTENTION_KEYS, GATED_FFN_KEYS, QK_NORM_KEYS,
                                      HFCheckpointError, interleaved_to_half, layer_key_rows,
                                      linear_out, refuse, refuse_common, require, rope_context,
                                      rope_from_hf, rope_to_hf, take_head)
from refmath.models.params import draw_params
from refmath.models.rope_attention import (  # Llama's attention sublayer and hooks
    cache_stale, rope_attention_backward, rope_attention_cached, rope_attention_forward,
    rope_attention_shapes, rope_attention_state, rope_options)
from refmath.positions import RopeScaling
from refmath.registry import OpCase, ParamCase, layer_case_ops, register_case

__all__ = [
    "GemmaConfig", "GENERATIONS", "TRAINING_RECIPE", "layer_config", "param_shapes",
    "init_params", "layer_norm", "LayerCache", "block_forward", "layer_forward",
    "layer_backward", "GemmaCache", "network_forward", "network_backward", "forward", "backward",
    "logits", "layer_kv", "rope_options", "cache_stale", "cache_spec", "embed", "cached_layer",
    "head", "COMPILED_FIELDS", "compiled_layer_spec", "sizing_fields", "HF_MODEL_TYPES",
    "key_table", "config_from_hf", "params_from_hf", "to_hf"
]

# ---- configuration -------------------------------------------------------------------------------

GENERATIONS = (1, 2, 3)  # Gemma 1; Gemma 2 adds the sandwich norms; Gemma 3 QK-norm too


@dataclass(frozen=True, kw_only=True)
class GemmaConfig(HeadDimHeads):
    """Sizes and options of Gemma 1, 2 and 3. ``dataclasses.asdict`` round-trips through JSON."""

    vocab_size: int  # V, rows of the token table (and columns of the tied head)
    max_seq_len: int  # the longest sequence accepted (RoPE has no table: a contract, not a size)
    d_model: int  # d, the residual stream's width
    n_layers: int  # L, layers
    n_heads: int  # h query heads
    head_dim: int  # d_h, even (RoPE rotates pairs); Gemma's is not d / h
    d_ff: int  # d_f, the GeGLU's width
    n_kv_heads: int | None = None  # g key/value heads (A10); None: h
    generation: int = 1  # 1, 2 (the norms after the sublayers too) or 3 (and QK-norm per head)
    rope_base: float = 10000.0  # RoPE's base theta (N10), of the global layers
    rope_layout: str = "interleaved"  # RoPE's pairs: (2i, 2i+1), or Hugging Face's "half"
    rope_scaling: RopeScaling | None = None  # a context-extension rule (N13-N17), global layers
    local_rope_base: float | None = None  # Gemma 3: the local layers' own base; None: rope_base
    windows: tuple | None = None  # per layer a window w (local) or None (global); None: all global
    query_pre_attn_scalar: float | None = None  # s of the score scale 1/sqrt(s); None: d_h
    attn_softcap: float | None = None  # c of the attention scores' c tanh(x / c); None: no cap
    final_softcap: float | None = None  # c of the logits' c tanh(x / c); None: no cap
    norm_eps: float = 1e-6  # every RMSNorm's epsilon (QK-norm's too)
    init_std: float = 0.02  # sigma of every weight at init (residual outputs: sigma / sqrt(2L))
    attention_backend: str = "numpy"  # training's causal attention: NumPy or the "cpu" kernel

    # what Llama's attention sublayer (refmath.models.rope_attention) reads besides the fields
    norm_offset: ClassVar[float] = 1.0  # the gains are 1 + gamma
    qkv_bias: ClassVar[bool] = False
    tie_embeddings: ClassVar[bool] = True  # every Gemma reads its logits off the token table
    dropout: ClassVar[float] = 0.0  # no residual dropout

    def __post_init__(self):
        for name in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "head_dim",
                     "d_ff"):
            check_field(self, name, check_int, 1)
        check_field(self, "n_kv_heads", check_int, 1, optional=True)
        check_field(self, "generation", check_choice, GENERATIONS)
        check_rope_fields(self)
        check_field(self, "local_rope_base", check_real, 1.0, low_open=True, optional=True)
        for name in ("query_pre_attn_scalar", "attn_softcap", "final_softcap"):
            check_field(self, name, check_real, 0.0, low_open=True, optional=True)
        for name in ("norm_eps", "init_std"):
            check_field(self, name, check_real, 0.0, low_open=True)
        check_field(self, "attention_backend", check_choice, ATTENTION_BACKENDS)
        self._check_windows()
        self.check_heads()  # head_dim is required: it sets d_h

    def _check_windows(self):
        if self.windows is None:
            if self.local_rope_base is not None:
                raise ValueError("GemmaConfig.local_rope_base is the RoPE base of the local "
                                 "layers, and windows = None has none")
            return
        if isinstance(self.windows, list):  # asdict's JSON form
            object.__setattr__(self, "windows", tuple(self.windows))
        if not isinstance(self.windows, tuple) or len(self.windows) != self.n_layers:
            raise ValueError(f"GemmaConfig.windows must be a tuple of n_layers = {self.n_layers} "
                             f"windows (an int >= 1 or None each), got {self.windows!r}")
        for w in self.windows:
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
                raise ValueError(f"GemmaConfig.windows must hold ints >= 1 or None, got "
                                 f"{self.windows!r}")
        if all(w is None for w in self.windows):
            raise ValueError("GemmaConfig.windows has no local layer: give None instead")

    @property
    def d_f(self) -> int:
        """The GeGLU's width."""
        return self.d_ff

    @property
    def sandwich_norms(self) -> bool:
        """Whether each branch's output is normalised too (Gemma 2, 3)."""
        return self.generation >= 2

    @property
    def qk_norm(self) -> str | None:
        """Llama's attention's QK-norm: ``"head"`` on Gemma 3, None before."""
        return "head" if self.generation == 3 else None

    @property
    def sliding_window(self) -> int | None:
        """The window every layer has (one or none); a config whose layers differ answers
        through :func:`layer_config`."""
        if self.windows is None:
            return None
        if len(set(self.windows)) > 1:
            raise ValueError(f"GemmaConfig.windows = {self.windows} differ by layer: ask "
                             f"layer_config(config, i).sliding_window")
        return self.windows[0]

    @property
    def score_scale(self) -> float:
        r""":math:`1/\sqrt{s}` with ``query_pre_attn_scalar`` = ``s``, else :math:`1/\sqrt{d_h}`."""
        return (self.d_h if self.query_pre_attn_scalar is None
                else self.query_pre_attn_scalar) ** -0.5


def layer_config(config: GemmaConfig, layer: int) -> GemmaConfig:
    """The configuration layer ``layer`` computes with: its own window on every layer (or none),
    and, on a local layer with ``local_rope_base``, that base without the rope scaling."""
    if config.windows is None:
        return config
    return _layer_config(config, layer)


@functools.lru_cache(maxsize=1024)
def _layer_config(config: GemmaConfig, layer: int) -> GemmaConfig:
    w = config.windows[layer]
    fields = dict(windows=None if w is None else (w,) * config.n_layers, local_rope_base=None)
    if w is not None and config.local_rope_base is not None:
        fields.update(rope_base=config.local_rope_base, rope_scaling=None)
    return dataclasses.replace(config, **fields)


# The default of `python -m refmath train`: the size of the decoder's recipe, Gemma 2's layers
TRAINING_RECIPE = TrainingRecipe(
    {"name": "chars", "seq_len": 64},
    dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=176, generation=2),
    steps=1000, batch_size=32, lr=3e-3, tasks=("chars", "reverse-lm"))


# ---- parameters ----------------------------------------------------------------------------------

def param_shapes(config: GemmaConfig) -> dict:
    """``{name: shape}`` of every parameter (see the module docstring), in order."""
    check_config("gemma", config)
    d, f = config.d_model, config.d_f
    post = config.sandwich_norms
    attn = {"attn." + k: v for k, v in rope_attention_shapes(config).items()}
    layer = {"ln1.gamma": (d,), **attn,
             **({"ln1_post.gamma": (d,)} if post else {}), "ln2.gamma": (d,),
             **({"ln2_post.gamma": (d,)} if post else {}),
             "ffn.w_gate": (d, f), "ffn.w_up": (d, f), "ffn.w_down": (f, d)}
    shapes = {"tok_emb": (config.vocab_size, d)}
    for i in range(config.n_layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    shapes["ln_f.gamma"] = (d,)
    return shapes


def init_params(config: GemmaConfig, seed=0, dtype=np.float64) -> dict:
    r"""Stored gains at 0 (applied gains :math:`1 + 0 = 1`); weights and the token table
    :math:`\mathcal N(0, \sigma^2)` with :math:`\sigma` = ``init_std``, the residual outputs
    (``attn.w_o``, ``ffn.w_down``) at :math:`\sigma/\sqrt{2L}` (N11)."""
    return draw_params(param_shapes(config), seed, dtype, config.init_std, config.n_layers,
                       ("attn.w_o", "ffn.w_down"), gain=0.0)


# ---- the layer: Llama's, GeGLU, each branch's output normalised from Gemma 2 on -----------------

def layer_norm(params: dict, name: str, config: GemmaConfig):
    """The RMSNorm ``name`` (``"ln1"``, ``"ln_f"``, ...) with gain ``1 + gamma``, as a function of
    the rows."""
    return lambda x: blocks.norm_forward(x, "rmsnorm", 1.0 + params[name + ".gamma"], None,
                                         config.norm_eps)


class LayerCache(NamedTuple):
    attn: blocks.SublayerCache  # its branch cache is the attention's (a PostNormCache of it)
    ffn: blocks.SublayerCache  # its branch cache is the GeGLU's (a PostNormCache of it)
    sandwich: bool  # whether each branch ended in its own norm


def block_forward(x, params: dict, config: GemmaConfig, attn_branch, ffn_branch,
                  drops=(None, None)):
    r"""The two pre-normed residual sublayers around a layer's branches (each ``rows -> (rows,
    cache)``), each branch's output normalised too from Gemma 2 on. Returns ``(x'', attn, ffn)``."""
    if config.sandwich_norms:
        attn_branch = blocks.post_normed(attn_branch, layer_norm(params, "ln1_post", config))
        ffn_branch = blocks.post_normed(ffn_branch, layer_norm(params, "ln2_post", config))
    x, attn = blocks.sublayer_forward(x, layer_norm(params, "ln1", config), attn_branch, drops[0])
    x, ffn = blocks.sublayer_forward(x, layer_norm(params, "ln2", config), ffn_branch, drops[1])
    return x, attn, ffn


def layer_forward(x, params: dict, layer: int, config: GemmaConfig, drops=(None, None)):
    """Layer ``layer`` on its ``params`` (without ``layers.{i}.``): Llama's RoPE attention with
    this layer's window and RoPE (:func:`layer_config`) and the GeGLU, in :func:`block_forward`.
    Returns ``(x'', cache)``."""
    config = layer_config(config, layer)
    attn, ffn = sub_params(params, "attn"), sub_params(params, "ffn")
    x, attn_cache, ffn_cache = block_forward(
        x, params, config, lambda h: rope_attention_forward(h, attn, config),
        lambda h: blocks.ffn_forward(h, ffn, "gelu_tanh"), drops)
    return x, LayerCache(attn_cache, ffn_cache, config.sandwich_norms)


def layer_backward(dout, cache: LayerCache):
    """Gradients of :func:`layer_forward`, the mirror: the FFN's sublayer (its output norm, the
    GeGLU, its pre-norm), then the attention's. Returns ``(dx, grads)`` named relative to
    ``layers.{i}.``."""
    ffn_back, attn_back, post = blocks.geglu_ffn_backward, rope_attention_backward, {}
    if cache.sandwich:
        ffn_back = blocks.post_normed_backward(ffn_back, post, "ln2_post")
        attn_back = blocks.post_normed_backward(attn_back, post, "ln1_post")
    dx, norm2, ffn_grads = blocks.sublayer_backward(dout, cache.ffn, ffn_back)
    dx, norm1, attn_grads = blocks.sublayer_backward(dx, cache.attn, attn_back)
    return dx, {**prefixed("ln1", norm1), **prefixed("attn", attn_grads),
                **prefixed("ln2", norm2), **prefixed("ffn", ffn_grads), **post}


# ---- the network ---------------------------------------------------------------------------------

class GemmaCache(NamedTuple):
    emb: EmbeddingCache
    scale: np.ndarray  # sqrt(d) in the parameters' dtype, the embeddings' factor
    layers: tuple  # one LayerCache per layer
    norm_f: object  # the final RMSNorm's cache
    head: LinearCache  # its weight is tok_emb^T
    softcap: SoftcapCache | None  # the logits' cap (Gemma 2), or None
    loss: CrossEntropyCache | None = None  # None from a logits-only pass


def _embed_scale(config: GemmaConfig, dtype) -> np.ndarray:
    return np.asarray(math.sqrt(config.d_model), dtype=dtype)


def network_forward(params, tokens, config: GemmaConfig, train: bool = False, rng=None):
    r"""Logits ``(B, T, V)`` of checked ``tokens``:

    .. math::
        x^{(0)} = \sqrt d\, E[a],\qquad x^{(\ell)} = \operatorname{Layer}_\ell(x^{(\ell-1)}),\qquad
        z = \operatorname{softcap}_c\big(\operatorname{RMSNorm}(x^{(L)})\, E^\top\big)

    the cap only with ``final_softcap``. Returns ``(z, cache)``."""
    table = params["tok_emb"]
    x, emb = embedding_forward(tokens, table)
    scale = _embed_scale(config, table.dtype)
    x = x * scale
    drops = layer_dropout_masks(rng, x.shape, config.dropout, x.dtype, config.n_layers, train)
    x, layers = layers_forward(x, params, config.n_layers,
                               lambda i, x, p: layer_forward(x, p, i, config, drops[i]))
    x, norm_f = layer_norm(params, "ln_f", config)(x)
    z, head_cache = linear_forward(x, table.T)
    cap = None
    if config.final_softcap is not None:
        z, cap = softcap_forward(z, config.final_softcap)
    return z, GemmaCache(emb, scale, layers, norm_f, head_cache, cap)


def network_backward(dz, cache: GemmaCache) -> dict:
    """Gradients of :func:`network_forward` given ``dz``, the forward in reverse; the table gets
    both its lookup's gradient (times :math:`\\sqrt d`) and the head's."""
    if cache.softcap is not None:
        dz = softcap_backward(dz, cache.softcap)
    dx, dw_out, _ = linear_backward(dz, cache.head)
    dx, norm_grads = blocks.norm_backward(dx, cache.norm_f)
    dx, grads = layers_backward(dx, cache.layers, layer_backward)
    return {**prefixed("ln_f", norm_grads), **grads,
            **table_gradients(embedding_backward(dx * cache.scale, cache.emb), dw_out, True)}


def forward(params, batch, config: GemmaConfig, train: bool = False, rng=None):
    """Mean next-token cross-entropy of a batch (L2, L5), ``(loss, cache)``, the batch as
    :func:`refmath.models.decoder.forward` takes it (Gemma has no dropout: ``train`` and ``rng``
    change nothing)."""
    return network_loss(params, batch, config, param_shapes(config),  # it checks the config
                        lambda tokens: network_forward(params, tokens, config, train, rng))


def backward(cache: GemmaCache) -> dict:
    """Gradients of the loss of :func:`forward` with respect to every parameter (same keys)."""
    return next_token_loss_backward(cache, network_backward)


def logits(params, tokens, config: GemmaConfig) -> np.ndarray:
    """Next-token logits ``(B, T, V)`` for int ``tokens`` ``(B, T)``, without loss."""
    return network_logits(params, tokens, config, param_shapes(config),
                          lambda tokens: network_forward(params, tokens, config))


def _attention_cache(layer: LayerCache):
    branch = layer.attn.branch
    return branch.branch if layer.sandwich else branch


def layer_kv(cache: GemmaCache) -> list:
    """Per layer, the rotated keys and the values ``(B, g, T, d_h)`` a KV cache keeps."""
    return [rope_attention_state(_attention_cache(layer)) for layer in cache.layers]


# ---- inference with a KV cache (K2, K3); rope_options and cache_stale are Llama's ----------------

def cache_spec(config: GemmaConfig, batch: int, max_len: int) -> CacheSpec:
    """Keys and values of ``g`` heads per layer, ``(L, B, g, max_len, d_h)`` each, of which a local
    layer keeps only its window's rows."""
    return rope_attention.cache_spec(config, batch, max_len, windows=config.windows)


def embed(params, tokens, config: GemmaConfig, offset: int) -> np.ndarray:
    r"""The new rows' embeddings times :math:`\sqrt d`; positions enter through RoPE only."""
    table = params["tok_emb"]
    return embedding_forward(tokens, table)[0] * _embed_scale(config, table.dtype)


def cached_layer(x, params, layer: int, config: GemmaConfig, slot, offset: int, *,
                 matmul=matmul_rows_many) -> np.ndarray:
    """Layer ``layer`` on the new rows ``x`` at positions ``offset..``: :func:`block_forward`
    around Llama's cached attention step at this layer's window and RoPE, and the GeGLU."""
    config = layer_config(config, layer)
    p = sub_params(params, f"layers.{layer}")
    attn, ffn = sub_params(p, "attn"), sub_params(p, "ffn")
    return block_forward(
        x, p, config,
        lambda h: (rope_attention_cached(h, attn, config, slot, offset, matmul=matmul), None),
        lambda h: blocks.ffn_forward(h, ffn, "gelu_tanh", matmul=matmul))[0]


def head(params, x, config: GemmaConfig, *, matmul=matmul_rows_many) -> np.ndarray:
    """Final RMSNorm, the tied output projection and the cap of the new rows: ``(B, n, V)``."""
    z = network.head(params, x, layer_norm(params, "ln_f", config), tied=True, matmul=matmul)
    return z if config.final_softcap is None else softcap_forward(z, config.final_softcap)[0]


COMPILED_FIELDS = None  # the compiled decode layer gates with SiLU only: the NumPy step


def compiled_layer_spec(params, config: GemmaConfig) -> None:
    """None: the NumPy step runs every layer (the compiled layer has no GeGLU)."""
    return None


def sizing_fields(config: GemmaConfig) -> dict:
    """What :mod:`refmath.sizing` counts of this model."""
    windows = config.windows or (None,) * config.n_layers
    window = next((w for w in windows if w is not None), None)
    return dict(n_layers=config.n_layers, d_model=config.d_model, n_heads=config.n_heads,
                kv_heads=config.kv_heads, head_dim=config.d_h, d_ff=config.d_f,
                vocab_size=config.vocab_size, qkv_bias=False, tie_embeddings=True,
                sliding_window=window,
                window_layers=None if window is None or all(windows) else
                tuple(w is not None for w in windows),
                qk_norm=config.qk_norm, moe=None, norm="rmsnorm", ffn="geglu",
                norms_per_layer=2 + 2 * config.sandwich_norms)


# ---- Hugging Face: one key table, read by params_from_hf and written by to_hf --------------------

HF_MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
_ARCHITECTURES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                  "gemma3_text": "Gemma3ForCausalLM"}

# (Hugging Face's name under model.layers.{i}., refmath's under layers.{i}., stored transposed)
# with Llama's ATTENTION_KEYS, QK_NORM_KEYS (Gemma 3's) and GATED_FFN_KEYS (refmath.models.hf_layout)
NORM_KEYS = {  # Gemma 1 names its norm before the FFN post_attention_layernorm, as Llama does
    1: (("input_layernorm.weight", "ln1.gamma", False),
        ("post_attention_layernorm.weight", "ln2.gamma", False)),
    2: (("input_layernorm.weight", "ln1.gamma", False),
        ("post_attention_layernorm.weight", "ln1_post.gamma", False),  # the attention's output
        ("pre_feedforward_layernorm.weight", "ln2.gamma", False),
        ("post_feedforward_layernorm.weight", "ln2_post.gamma", False)),
}
# the columns (and QK-norm's gains) that Hugging Face's "half" RoPE layout permutes within a head
ROTATED = ("attn.w_q", "attn.w_k", "attn.q_norm.gamma", "attn.k_norm.gamma")


def key_table(config: GemmaConfig) -> list:
    """``[(Hugging Face name, refmath name, transposed)]`` of every parameter (the head is the
    token table)."""
    layer = (ATTENTION_KEYS + (QK_NORM_KEYS if config.qk_norm else ())
             + NORM_KEYS[min(config.generation, 2)] + GATED_FFN_KEYS)
    return ([("model.embed_tokens.weight", "tok_emb", False)]
            + layer_key_rows(config.n_layers, layer) + [("model.norm.weight", "ln_f.gamma", False)])


def _windows_from_hf(hf: dict) -> tuple | None:
    """Each layer's window from ``layer_types`` (or the released alternation when absent: every
    other layer for Gemma 2, five local layers per global one for Gemma 3)."""
    layers = int(hf["num_hidden_layers"])
    pattern = 2 if hf["model_type"] == "gemma2" else int(hf.get(
        "sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else
                                      "full_attention" for i in range(layers)]
    if set(types) - {"sliding_attention", "full_attention"} or len(types) != layers:
        refuse(hf, "layer_types", types, "refmath reads one sliding_attention or full_attention "
               "per layer")
    if "sliding_attention" not in types:
        return None
    return tuple(int(hf["sliding_window"]) if t == "sliding_attention" else None for t in types)


def _ropes_from_hf(hf: dict, windows) -> dict:
    """The RoPE fields: Gemma 3's global rope and its local layers' own base."""
    if hf["model_type"] != "gemma3_text":
        base, scaling = rope_from_hf(hf)
        return dict(rope_base=base, rope_scaling=scaling)
    rope = hf.get("rope_parameters") or {}
    if "sliding_attention" in rope:  # transformers 5: one rope per layer type
        local = rope_from_hf({**hf, "rope_parameters": rope["sliding_attention"]})
        base, scaling = rope_from_hf({**hf, "rope_parameters": rope["full_attention"]})
    else:
        local = (float(hf.get("rope_local_base_freq", 10000.0)), None)
        base, scaling = rope_from_hf(hf)
    if local[1] is not None:
        refuse(hf, "rope_parameters.sliding_attention", rope["sliding_attention"],
               "refmath's local layers rotate at their own base without a scaling")
    if windows is None:
        return dict(rope_base=base, rope_scaling=scaling)
    if all(w is not None for w in windows):  # every layer is local: the local rope is the rope
        return dict(rope_base=local[0], rope_scaling=None)
    return dict(rope_base=base, rope_scaling=scaling, local_rope_base=local[0])


def config_from_hf(hf: dict) -> GemmaConfig:
    r"""A :class:`GemmaConfig` from a gemma, gemma2 or gemma3_text ``config.json``.

    Every Gemma gates with tanh-GELU (Gemma 1's legacy ``hidden_act="gelu"`` meant that too, as
    transformers reads it); Gemma 2 and 3 add the sandwich norms, ``query_pre_attn_scalar`` and
    local layers; Gemma 3 its QK-norm and the local layers' own RoPE. Biases, an untied head and
    bidirectional attention are refused."""
    kind = hf["model_type"]
    generation = HF_MODEL_TYPES.index(kind) + 1
    refuse_common(hf, softcap=generation > 1)
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu") or (act == "gelu" and kind != "gemma"):
        refuse(hf, "hidden_activation", act, "refmath's GeGLU gates with tanh-GELU")
    require(hf, "attention_bias", (False,), False, "refmath's Gemma has no attention biases")
    require(hf, "mlp_bias", (False,), False, "refmath's GeGLU has no biases")
    require(hf, "tie_word_embeddings", (True,), True, "refmath's Gemma reads its logits off the "
            "token table")
    heads = int(hf["num_attention_heads"])
    fields = dict(rope_base=rope_from_hf(hf)[0]) if generation == 1 else {}
    if generation > 1:
        if hf.get("use_bidirectional_attention"):
            refuse(hf, "use_bidirectional_attention", True, "refmath's decoder is causal")
        windows = _windows_from_hf(hf)
        fields = dict(windows=windows, **_ropes_from_hf(hf, windows),
                      query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or
                                                  int(hf.get("head_dim") or 256)),
                      attn_softcap=hf.get("attn_logit_softcapping"),
                      final_softcap=hf.get("final_logit_softcapping"))
    else:
        fields.update(rope_scaling=rope_from_hf(hf)[1])
    return GemmaConfig(
        **fields, generation=generation, vocab_size=int(hf["vocab_size"]),
        max_seq_len=rope_context(hf, rope_from_hf(hf)[1]), d_model=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        d_ff=int(hf["intermediate_size"]), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_layout="half")


def params_from_hf(hf: dict, config: GemmaConfig, weights) -> dict:
    """Every parameter, read through :func:`key_table` (a ``lm_head.weight`` stored beside the
    table must equal it)."""
    shapes = param_shapes(config)
    params = {ours: weights.take(theirs, shapes[ours][::-1] if transposed else shapes[ours],
                                 transpose=transposed)
              for theirs, ours, transposed in key_table(config)}
    buffers = [f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(config.n_layers)]
    for name in filter(weights.has, buffers):  # older files keep RoPE's frequencies as a buffer
        weights.skip(name)
    take_head(weights, True, params, config.vocab_size, config.d_model)
    return params


def to_hf(config: GemmaConfig, params: dict):
    """``(config.json fields, {name: tensor})`` of a ``GemmaForCausalLM``,
    ``Gemma2ForCausalLM`` or ``Gemma3ForCausalLM`` (by ``generation``), through the same
    :func:`key_table` the reader reads; an ``"interleaved"`` RoPE layout is permuted to Hugging
    Face's (:func:`refmath.models.hf_layout.interleaved_to_half`)."""
    check_config("gemma", config)
    kind = HF_MODEL_TYPES[config.generation - 1]
    rope_parameters, context = rope_to_hf(config.rope_base, config.rope_scaling)
    hf = {"model_type": kind, "architectures": [_ARCHITECTURES[kind]],
          "vocab_size": config.vocab_size,
          "max_position_embeddings": config.max_seq_len if context is None else context,
          "hidden_size": config.d_model, "num_hidden_layers": config.n_layers,
          "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads,
          "head_dim": config.d_h, "intermediate_size": config.d_f,
          "rms_norm_eps": config.norm_eps, "rope_parameters": rope_parameters,
          "tie_word_embeddings": True, "attention_bias": False}
    if config.generation == 1:
        if config.windows is not None or config.query_pre_attn_scalar is not None \
                or config.attn_softcap is not None or config.final_softcap is not None:
            raise HFCheckpointError("gemma (generation 1) has no windows, query_pre_attn_scalar "
                                    "or soft-capping: write such a config as generation 2 or 3")
        hf.update(hidden_act="gelu_pytorch_tanh")
    else:
        windows = config.windows or (None,) * config.n_layers
        sizes = {w for w in windows if w is not None}
        if len(sizes) > 1:
            raise HFCheckpointError(f"{kind} has one sliding_window for its local layers; this "
                                    f"config has windows = {config.windows}")
        scalar = config.d_h if config.query_pre_attn_scalar is None else \
            config.query_pre_attn_scalar
        hf.update(hidden_activation="gelu_pytorch_tanh",
                  # transformers' Gemma configs take an integer where it is one
                  query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                  attn_logit_softcapping=config.attn_softcap,
                  final_logit_softcapping=config.final_softcap,
                  sliding_window=sizes.pop() if sizes else config.max_seq_len,
                  layer_types=["full_attention" if w is None else "sliding_attention"
                               for w in windows])
    if config.generation == 3:
        local = config.rope_base if config.local_rope_base is None else config.local_rope_base
        hf.update(use_bidirectional_attention=False, rope_parameters={
            "full_attention": hf["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": local}})

    def tensor(ours, transposed):
        w = params[ours]
        if ours.endswith(ROTATED) and config.rope_layout == "interleaved":
            w = interleaved_to_half(w, config.d_h)
        return linear_out(w) if transposed else w

    return hf, {theirs: tensor(ours, transposed)
                for theirs, ours, transposed in key_table(config)}


# ---- gradient-check cases ------------------------------------------------------------------------

# init_std ~ 1/sqrt(d): gradients far above the stencil's noise; d_ff = 48 is the decoder's
# 8d/3 rounded up to 8 at d = 16
_TINY = dict(vocab_size=11, max_seq_len=8, d_model=16, n_layers=2, n_heads=4, head_dim=4,
             d_ff=48, init_std=0.25)
register_case(OpCase("rope_attention", "h=4 g=2 causal (2, 5, 16), Gemma 2's score scale and cap",
                     ("N10", "A10", "A8", "N19"),
                     rope_attention_inputs(_ATTENTION := GemmaConfig(
                         **_TINY, n_kv_heads=2, query_pre_attn_scalar=6.0, attn_softcap=1.5)),
                     *layer_case_ops(rope_attention_forward, rope_attention_backward),
                     ("x", *rope_attention_shapes(_ATTENTION)), group="attention execution",
                     max_coords=12))
register_case(ParamCase("gemma", "Gemma 2: GeGLU, (1 + w) and sandwich norms, caps, a local "
                        "layer", ("M3", "N19", "N20", "A12"),
                        model_case_maker(forward, init_params, GemmaConfig(
                            **_TINY, generation=2, n_kv_heads=2, query_pre_attn_scalar=6.0,
                            attn_softcap=1.5, final_softcap=2.0, windows=(3, None)),
                            train=False),
                        backward, max_coords=2, step=2.5e-4))
register_case(ParamCase("gemma", "Gemma 3: QK-norm, the local layer's own RoPE base, linear "
                        "scaling on the global one", ("M3", "N13", "N18", "N20"),
                        model_case_maker(forward, init_params, GemmaConfig(
                            **_TINY, generation=3, n_kv_heads=2, windows=(None, 3),
                            local_rope_base=100.0,
                            rope_scaling=dict(rope_type="linear", factor=4.0)), train=False),
                        backward, max_coords=2, step=2.5e-4))
