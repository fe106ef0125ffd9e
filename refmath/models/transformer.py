r"""The original encoder-decoder Transformer (catalogue M1), forward and backward in NumPy.

Source and target share one vocabulary and one embedding table ``E``. With ``d`` = ``d_model``:

.. math::
    X^{(0)} = \operatorname{Drop}\big(\sqrt d\,E[x] + P\big),\qquad
    X^{(\ell)}:\ U = \operatorname{LN}\big(X + \operatorname{Drop}(\operatorname{MHA}(X; M_{pad}))\big),\
    X' = \operatorname{LN}\big(U + \operatorname{Drop}(F(U))\big)

    Y^{(0)} = \operatorname{Drop}\big(\sqrt d\,E[\mathrm{BOS}, y_1, \ldots, y_{T-1}] + P\big),\qquad
    Y^{(\ell)}:\ U = \operatorname{LN}\big(Y + \operatorname{Drop}(\operatorname{MHA}(Y; M_{causal}))\big),

    R = \operatorname{LN}\big(U + \operatorname{Drop}(\operatorname{MHA}_{cross}(U, Z; M_{pad}))\big),\
    Y' = \operatorname{LN}\big(R + \operatorname{Drop}(F(R))\big),\qquad
    z_t = Y^{(L)}_t W_{vocab}

with ``P`` the sinusoidal table (N8), Post-LN everywhere (N4), the ReLU FFN with biases (N5),
``Z = X^{(L)}`` the encoder output, cross-attention as in A7, the shifted decoder input of L1 and
the label-smoothed cross-entropy of L4. ``W_vocab = E^T`` when the embeddings are tied.

Choices the paper leaves open, made here and written down:

- The attention projections have no biases (the paper writes them as plain matrices ``W``), and
  neither does the output projection.
- There is no final LayerNorm after either stack: in Post-LN the last sublayer already ends in one.
- Dropout (train mode only, one rate ``config.dropout``): on every sublayer output before the
  residual add and on the embedding + position sums (both stated in the paper), and on the
  attention weights (as in the authors' tensor2tensor code). Not inside the FFN. Masks are drawn
  from ``rng`` and kept in the cache, so backward is exact for the masks that forward used.
- Initialisation (not in the paper): ``E ~ N(0, 1/d)`` so that ``sqrt(d) E[a]`` has unit-variance
  entries; every other matrix Glorot-uniform; biases and ``beta`` 0, ``gamma`` 1.

Parameter names (flat dict, weights ``d_in x d_out``): ``tok_emb`` ``(V, d)``;
``encoder.layers.{i}.`` + ``self_attn.{w_q,w_k,w_v,w_o}``, ``ln1.{gamma,beta}``,
``ffn.{w1,b1,w2,b2}``, ``ln2.{gamma,beta}``; ``decoder.layers.{i}.`` + ``self_attn.*``,
``ln1.*``, ``cross_attn.*``, ``ln2.*``, ``ffn.*``, ``ln3.*``; ``lm_head`` ``(d, V)`` only when the
embeddings are untied.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

from refmath._validate import (check_field, check_flag, check_int, check_ndim, check_real, float_array,
                               int_array)
from refmath.attention import MHACache, causal_mask, mha_backward, mha_forward, padding_mask
from refmath.embedding import EmbeddingCache, embedding_backward, embedding_forward
from refmath.ffn import FFNCache, LinearCache, ffn_backward, ffn_forward, linear_backward, linear_forward
from refmath.losses import IGNORE_INDEX, CrossEntropyCache, cross_entropy_backward, cross_entropy_forward
from refmath.models.common import TrainingRecipe, apply_mask, dropout_mask, prefixed, sub_params
from refmath.models.params import check_param_dict
from refmath.norms import LayerNormCache, layernorm_backward, layernorm_forward
from refmath.positions import sinusoidal_positions
from refmath.registry import ParamCase, register_case

__all__ = [
    "TransformerConfig", "TRANSFORMER_BASE", "TRANSFORMER_TINY", "TRAINING_RECIPE",
    "HF_MODEL_TYPES", "param_shapes", "init_params", "attention_sublayer_forward",
    "attention_sublayer_backward", "ffn_sublayer_forward", "ffn_sublayer_backward", "shift_right",
    "forward", "backward", "encode", "decode", "logits"
]


_ATTN = ("w_q", "w_k", "w_v", "w_o")
_LN = ("gamma", "beta")


# ---- configuration -------------------------------------------------------------------------------

@dataclass(frozen=True)
class TransformerConfig:
    """Sizes and switches of the encoder-decoder Transformer (catalogue M1).

    ``n_layers`` is the depth of each stack (the paper's ``N``, the same for encoder and decoder);
    the head width is ``d_model // n_heads`` (the paper's ``d_k = d_v``). ``max_seq_len`` bounds
    both the source and the target length; the sinusoids themselves work at any length.

    ``label_smoothing`` follows :func:`refmath.losses.cross_entropy_forward` (PyTorch's
    convention: ``eps/V`` on every class, the true class gets ``1 - eps + eps/V``), which is the
    Szegedy et al. form the paper cites with ``eps_ls = 0.1``.

    ``bos_id`` starts the shifted decoder input (L1). A target token is left out of the loss where
    it equals ``pad_id`` (unless ``pad_id`` is None) or lies past the batch's ``tgt_lengths``.
    """

    vocab_size: int
    max_seq_len: int
    n_layers: int = 6
    d_model: int = 512
    n_heads: int = 8
    d_ff: int = 2048
    dropout: float = 0.1
    label_smoothing: float = 0.1
    tie_embeddings: bool = True
    pad_id: int | None = 0
    bos_id: int = 1
    norm_eps: float = 1e-5

    def __post_init__(self):
        for name in ("vocab_size", "max_seq_len", "n_layers", "d_model", "n_heads", "d_ff"):
            check_field(self, name, check_int, 1)
        if self.d_model % 2:
            raise ValueError(f"d_model must be even (sin/cos position pairs), got {self.d_model}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"n_heads must divide d_model, got d_model = {self.d_model}, n_heads = {self.n_heads}"
            )
        check_field(self, "dropout", check_real, 0.0, 1.0, high_open=True)
        check_field(self, "label_smoothing", check_real, 0.0, 1.0)
        check_field(self, "norm_eps", check_real, 0.0, low_open=True)
        check_field(self, "tie_embeddings", check_flag)
        check_field(self, "bos_id", check_int, 0, self.vocab_size - 1)
        check_field(self, "pad_id", check_int, 0, self.vocab_size - 1, optional=True)
        if self.pad_id is not None:
            if self.pad_id == self.bos_id:
                raise ValueError(f"pad_id and bos_id must differ, both are {self.bos_id}")

    @property
    def d_h(self) -> int:
        """The head width :math:`d_h = d / h` (the paper's :math:`d_k = d_v`)."""
        return self.d_model // self.n_heads


#: The base model of the paper. The paper's EN-DE vocabulary is a shared BPE of about 37000 tokens;
#: max_seq_len = 512 is our choice (the paper fixes no length).
TRANSFORMER_BASE = TransformerConfig(vocab_size=37000, max_seq_len=512, n_layers=6, d_model=512,
                                     n_heads=8, d_ff=2048, dropout=0.1, label_smoothing=0.1)
# A model small enough for gradient checks and lessons.
TRANSFORMER_TINY = TransformerConfig(vocab_size=13, max_seq_len=16, n_layers=2, d_model=16,
                                     n_heads=2, d_ff=32, dropout=0.1, label_smoothing=0.1)


# The default of `python -m refmath train`: about 45 s on two busy CPU cores in float32 for 100%
# exact-match reversals (validation loss 0.0015). No dropout: the data is generated, so a short
# run sees little of it twice.
TRAINING_RECIPE = TrainingRecipe(
    {"name": "reverse", "max_len": 8},
    dict(n_layers=2, d_model=64, n_heads=4, d_ff=128, dropout=0.0, label_smoothing=0.0),
    steps=600, batch_size=64, lr=3e-3, tasks=("reverse",))

# No Hugging Face model type computes this network (the encoder-decoder of refmath.hf's notes).
HF_MODEL_TYPES = ()


# ---- parameters ----------------------------------------------------------------------------------

def param_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name with its shape, in the order of :func:`init_params`."""
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    attn = {w: (d, d) for w in _ATTN}  # h * d_k = d
    ffn = {"w1": (d, f), "b1": (f,), "w2": (f, d), "b2": (d,)}
    ln = {p: (d,) for p in _LN}
    enc_layer = [("self_attn", attn), ("ln1", ln), ("ffn", ffn), ("ln2", ln)]
    dec_layer = [("self_attn", attn), ("ln1", ln), ("cross_attn", attn), ("ln2", ln), ("ffn", ffn),
                 ("ln3", ln)]
    shapes = {"tok_emb": (v, d)}
    for stack, layer in (("encoder", enc_layer), ("decoder", dec_layer)):
        for i in range(config.n_layers):
            for block, leaves in layer:
                for leaf, shape in leaves.items():
                    shapes[f"{stack}.layers.{i}.{block}.{leaf}"] = shape
    if not config.tie_embeddings:
        shapes["lm_head"] = (d, v)
    return shapes


def init_params(config: TransformerConfig, seed: int = 0, dtype=np.float64) -> dict[str, np.ndarray]:
    """Fresh parameters (see the module docstring for the initialisation), as a flat dict."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in param_shapes(config).items():
        leaf = name.rsplit(".", 1)[-1]
        if name == "tok_emb":
            value = rng.standard_normal(shape) / math.sqrt(config.d_model)
        elif leaf == "gamma":
            value = np.ones(shape)
        elif len(shape) == 1:  # biases and beta
            value = np.zeros(shape)
        else:
            limit = math.sqrt(6.0 / (shape[0] + shape[1]))
            value = rng.uniform(-limit, limit, size=shape)
        params[name] = value.astype(dtype)
    return params


def _check_params(params, config: TransformerConfig) -> np.dtype:
    """Require exactly the expected names and shapes and one floating dtype; return that dtype."""
    return check_param_dict(params, param_shapes(config))


# ---- dropout -------------------------------------------------------------------------------------

class _Dropout:
    """Draws inverted-dropout multipliers (0 with probability ``p``, else ``1/(1-p)``) from ``rng``.

    With ``p = 0`` it draws nothing and returns None, so eval mode touches no random state.
    """

    def __init__(self, p: float, rng):
        self.p = float(p)
        self.rng = np.random.default_rng(rng) if self.p > 0.0 else None

    def mask(self, shape, dtype):
        return dropout_mask(self.rng, shape, self.p, dtype)


# ---- embedding: sqrt(d) E[a] + P, then dropout (N8) ------------------------------------------------

class EmbedCache(NamedTuple):
    emb: EmbeddingCache
    dropout_mask: np.ndarray | None  # on the sum of embeddings and positions, (B, T, d)


def embed_forward(ids, tok_emb, drop: _Dropout):
    r""":math:`\operatorname{Drop}(\sqrt d\,E[a_i] + P_i)` for ``ids`` ``(B, T)``: ``(B, T, d)``."""
    e, emb = embedding_forward(ids, tok_emb, scale_by_sqrt_d=True)
    x = e + sinusoidal_positions(ids.shape[-1], tok_emb.shape[1], dtype=e.dtype)
    mask = drop.mask(x.shape, x.dtype)
    return apply_mask(x, mask), EmbedCache(emb, mask)


def embed_backward(dx, cache: EmbedCache):
    """Gradient of the embedding table (the positions are fixed, so they have none)."""
    return embedding_backward(apply_mask(dx, cache.dropout_mask), cache.emb)


# ---- Post-LN sublayers: LN(x + Drop(F(x))) (N4) ----------------------------------------------------

def _residual_ln_forward(x, f, ln: Mapping, drop: _Dropout, eps: float):
    mask = drop.mask(f.shape, f.dtype)
    y, ln_cache = layernorm_forward(x + apply_mask(f, mask), ln["gamma"], ln["beta"], eps)
    return y, mask, ln_cache


def _residual_ln_backward(dy, mask, ln_cache):
    """Returns ``(dz, df, dln)``: ``dz`` reaches ``x`` through the residual, ``df`` the sublayer."""
    dz, dgamma, dbeta = layernorm_backward(dy, ln_cache)
    return dz, apply_mask(dz, mask), {"gamma": dgamma, "beta": dbeta}


class AttentionSublayerCache(NamedTuple):
    mha: MHACache  # its sdpa cache holds the attention-weight dropout mask
    dropout_mask: np.ndarray | None  # residual dropout on the attention output, (B, T, d)
    ln: LayerNormCache


def attention_sublayer_forward(x, attn: Mapping, ln: Mapping, n_heads: int, mask, drop: _Dropout,
                               eps: float, context=None):
    r""":math:`\operatorname{LN}(x + \operatorname{Drop}(\operatorname{MHA}(x, Z; M)))` with
    ``Z = x`` (self-attention) or ``Z = context`` (cross-attention, A7).

    ``x`` ``(B, T, d)``, ``context`` ``(B, S, d)``, ``mask`` broadcast to ``(B, h, T, S)``;
    ``attn`` holds ``w_q, w_k, w_v, w_o`` and ``ln`` holds ``gamma, beta``.
    """
    b, t, _ = x.shape
    s = t if context is None else context.shape[1]
    weights_mask = drop.mask((b, n_heads, t, s), x.dtype)
    a, mha = mha_forward(x, attn, n_heads, context=context, mask=mask, dropout_mask=weights_mask)
    y, res_mask, ln_cache = _residual_ln_forward(x, a, ln, drop, eps)
    return y, AttentionSublayerCache(mha, res_mask, ln_cache)


def attention_sublayer_backward(dy, cache: AttentionSublayerCache):
    """Returns ``(dx, dcontext, dattn, dln)``; ``dcontext`` is None for self-attention."""
    dz, da, dln = _residual_ln_backward(dy, cache.dropout_mask, cache.ln)
    dx, dattn, *dcontext = mha_backward(da, cache.mha)
    return dz + dx, (dcontext[0] if dcontext else None), dattn, dln


class FFNSublayerCache(NamedTuple):
    ffn: FFNCache
    dropout_mask: np.ndarray | None  # residual dropout on the FFN output, (B, T, d)
    ln: LayerNormCache


def ffn_sublayer_forward(x, ffn: Mapping, ln: Mapping, drop: _Dropout, eps: float):
    r""":math:`\operatorname{LN}(x + \operatorname{Drop}(\max(0, x W_1 + b_1) W_2 + b_2))` (N5)."""
    f, ffn_cache = ffn_forward(x, ffn["w1"], ffn["b1"], ffn["w2"], ffn["b2"], activation="relu")
    y, res_mask, ln_cache = _residual_ln_forward(x, f, ln, drop, eps)
    return y, FFNSublayerCache(ffn_cache, res_mask, ln_cache)


def ffn_sublayer_backward(dy, cache: FFNSublayerCache):
    """Returns ``(dx, dffn, dln)``."""
    dz, df, dln = _residual_ln_backward(dy, cache.dropout_mask, cache.ln)
    dx, dw1, db1, dw2, db2 = ffn_backward(df, cache.ffn)
    return dz + dx, {"w1": dw1, "b1": db1, "w2": dw2, "b2": db2}, dln


# ---- layers --------------------------------------------------------------------------------------

class EncoderLayerCache(NamedTuple):
    self_attn: AttentionSublayerCache
    ffn: FFNSublayerCache


def encoder_layer_forward(x, layer: Mapping, config: TransformerConfig, pad_mask, drop: _Dropout):
    """One encoder layer: padding-masked self-attention, then the FFN, each Post-LN.

    ``layer`` holds this layer's parameters without the ``encoder.layers.{i}.`` prefix.
    """
    eps = config.norm_eps
    u, attn = attention_sublayer_forward(x, sub_params(layer, "self_attn"), sub_params(layer, "ln1"),
                                         config.n_heads, pad_mask, drop, eps)
    y, ffn = ffn_sublayer_forward(u, sub_params(layer, "ffn"), sub_params(layer, "ln2"), drop, eps)
    return y, EncoderLayerCache(attn, ffn)


def encoder_layer_backward(dy, cache: EncoderLayerCache):
    """Returns ``(dx, grads)`` with the gradient names relative to the layer."""
    du, dffn, dln2 = ffn_sublayer_backward(dy, cache.ffn)
    dx, _, dattn, dln1 = attention_sublayer_backward(du, cache.self_attn)
    grads = {**prefixed("self_attn", dattn), **prefixed("ln1", dln1), **prefixed("ffn", dffn),
             **prefixed("ln2", dln2)}
    return dx, grads


class DecoderLayerCache(NamedTuple):
    self_attn: AttentionSublayerCache
    cross_attn: AttentionSublayerCache
    ffn: FFNSublayerCache


def decoder_layer_forward(y, memory, layer: Mapping, config: TransformerConfig, causal, pad_mask,
                          drop: _Dropout):
    """One decoder layer: causal self-attention, cross-attention over the encoder output
    ``memory`` (padding-masked), then the FFN, each Post-LN."""
    eps = config.norm_eps
    u, self_attn = attention_sublayer_forward(y, sub_params(layer, "self_attn"), sub_params(layer, "ln1"),
                                              config.n_heads, causal, drop, eps)
    r, cross_attn = attention_sublayer_forward(u, sub_params(layer, "cross_attn"), sub_params(layer, "ln2"),
                                               config.n_heads, pad_mask, drop, eps, context=memory)
    out, ffn = ffn_sublayer_forward(r, sub_params(layer, "ffn"), sub_params(layer, "ln3"), drop, eps)
    return out, DecoderLayerCache(self_attn, cross_attn, ffn)


def decoder_layer_backward(dout, cache: DecoderLayerCache):
    """Returns ``(dy, dmemory, grads)`` with the gradient names relative to the layer."""
    dr, dffn, dln3 = ffn_sublayer_backward(dout, cache.ffn)
    du, dmemory, dcross, dln2 = attention_sublayer_backward(dr, cache.cross_attn)
    dy, _, dself, dln1 = attention_sublayer_backward(du, cache.self_attn)
    grads = {**prefixed("self_attn", dself), **prefixed("ln1", dln1),
             **prefixed("cross_attn", dcross), **prefixed("ln2", dln2), **prefixed("ffn", dffn),
             **prefixed("ln3", dln3)}
    return dy, dmemory, grads


# ---- the two stacks ------------------------------------------------------------------------------

class StackCache(NamedTuple):
    embed: EmbedCache
    layers: tuple  # EncoderLayerCache or DecoderLayerCache per layer


def _encode(params, src, src_lengths, config, drop):
    pad = padding_mask(src_lengths, src.shape[1], dtype=params["tok_emb"].dtype)
    x, embed = embed_forward(src, params["tok_emb"], drop)
    layers = []
    for i in range(config.n_layers):
        x, layer = encoder_layer_forward(x, sub_params(params, f"encoder.layers.{i}"), config, pad, drop)
        layers.append(layer)
    return x, StackCache(embed, tuple(layers))


def _encode_backward(dmemory, cache: StackCache):
    grads, dx = {}, dmemory
    for i in reversed(range(len(cache.layers))):
        dx, layer_grads = encoder_layer_backward(dx, cache.layers[i])
        grads.update(prefixed(f"encoder.layers.{i}", layer_grads))
    return embed_backward(dx, cache.embed), grads


def _decode(params, memory, src_lengths, dec_in, config, drop):
    dtype = params["tok_emb"].dtype
    causal = causal_mask(dec_in.shape[1], dtype=dtype)
    pad = padding_mask(src_lengths, memory.shape[1], dtype=dtype)
    y, embed = embed_forward(dec_in, params["tok_emb"], drop)
    layers = []
    for i in range(config.n_layers):
        y, layer = decoder_layer_forward(y, memory, sub_params(params, f"decoder.layers.{i}"), config,
                                         causal, pad, drop)
        layers.append(layer)
    return y, StackCache(embed, tuple(layers))


def _decode_backward(dout, cache: StackCache):
    grads, dy, dmemory = {}, dout, 0.0
    for i in reversed(range(len(cache.layers))):
        dy, dmem, layer_grads = decoder_layer_backward(dy, cache.layers[i])
        dmemory = dmemory + dmem  # every decoder layer reads the same encoder output
        grads.update(prefixed(f"decoder.layers.{i}", layer_grads))
    return embed_backward(dy, cache.embed), dmemory, grads


def _output_weight(params, config):
    # Tied: W_vocab = E^T, the same E whose rows are multiplied by sqrt(d) on the way in. The paper
    # scales only in the embedding layers, so the pre-softmax projection uses E^T unscaled.
    return params["tok_emb"].T if config.tie_embeddings else params["lm_head"]


# ---- batches -------------------------------------------------------------------------------------

def shift_right(tgt, bos_id: int) -> np.ndarray:
    """The decoder input of L1: ``(BOS, y_1, ..., y_{T-1})`` for each row of ``tgt`` ``(B, T)``."""
    tgt = np.asarray(tgt)
    bos = np.full(tgt.shape[:-1] + (1,), bos_id, dtype=tgt.dtype)
    return np.concatenate([bos, tgt[..., :-1]], axis=-1)


def _check_tokens(name: str, ids, config: TransformerConfig, batch_size: int | None = None):
    ids = int_array(name, ids, config.vocab_size)
    check_ndim(name, ids, 2, "(B, T)")
    if ids.shape[1] < 1 or ids.shape[1] > config.max_seq_len:
        raise ValueError(
            f"{name} must have between 1 and max_seq_len = {config.max_seq_len} positions, "
            f"got shape {ids.shape}"
        )
    if batch_size is not None and ids.shape[0] != batch_size:
        raise ValueError(f"{name} must hold {batch_size} sequences like the source, got shape {ids.shape}")
    return ids


def _check_lengths(name: str, lengths, batch_size: int, low: int, high: int):
    """``(B,)`` integer lengths in ``[low, high]``."""
    lengths = int_array(name, lengths, high + 1)
    check_ndim(name, lengths, 1, "(B,)")
    if lengths.shape[0] != batch_size:
        raise ValueError(f"{name} must have shape ({batch_size},), got {lengths.shape}")
    if lengths.size and lengths.min() < low:
        raise ValueError(f"{name} must lie in [{low}, {high}], got {lengths}")
    return lengths


def _check_source(src, src_lengths, config, src_name="src", lengths_name="src_lengths"):
    src = _check_tokens(src_name, src, config)
    # A source of length 0 would leave the decoder nothing to attend to: almost surely a bug.
    src_lengths = _check_lengths(lengths_name, src_lengths, src.shape[0], 1, src.shape[1])
    return src, src_lengths


_BATCH_KEYS = ("src", "src_lengths", "tgt", "tgt_lengths")


def _check_batch(batch, config: TransformerConfig):
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a dict with keys {_BATCH_KEYS[:3]}, got {type(batch).__name__}")
    missing = [k for k in _BATCH_KEYS[:3] if k not in batch]
    extra = sorted(set(batch) - set(_BATCH_KEYS))
    if missing or extra:
        raise ValueError(
            f"batch must have keys {list(_BATCH_KEYS[:3])} and optionally 'tgt_lengths'; "
            f"missing {missing}, unexpected {extra}"
        )
    src, src_lengths = _check_source(batch["src"], batch["src_lengths"], config,
                                     "batch['src']", "batch['src_lengths']")
    tgt = _check_tokens("batch['tgt']", batch["tgt"], config, src.shape[0])
    tgt_lengths = None
    if batch.get("tgt_lengths") is not None:
        tgt_lengths = _check_lengths("batch['tgt_lengths']", batch["tgt_lengths"], tgt.shape[0], 0,
                                     tgt.shape[1])
    return src, src_lengths, tgt, tgt_lengths


def loss_targets(tgt, tgt_lengths, pad_id: int | None) -> np.ndarray:
    """``tgt`` with every uncounted token (past its length, or equal to ``pad_id``) replaced by
    :data:`IGNORE_INDEX`."""
    counted = np.ones(tgt.shape, dtype=bool)
    if tgt_lengths is not None:
        counted &= np.arange(tgt.shape[1])[None, :] < np.asarray(tgt_lengths)[:, None]
    if pad_id is not None:
        counted &= tgt != pad_id
    return np.where(counted, tgt, IGNORE_INDEX)


# ---- the model -----------------------------------------------------------------------------------

class TransformerCache(NamedTuple):
    config: TransformerConfig
    encoder: StackCache
    decoder: StackCache
    head: LinearCache  # the output projection W_vocab (E^T when tied)
    loss: CrossEntropyCache


def forward(params, batch, config: TransformerConfig, train: bool = False, rng=None):
    r"""Mean label-smoothed cross-entropy of the target given the source (M1, L1, L4).

    .. math::
        \ell = \frac1n \sum_{(b,t)\ \text{counted}} \operatorname{CE}_\varepsilon\big(
        z_{b,t},\ y_{b,t}\big),\qquad z = \operatorname{Dec}(\mathrm{BOS}\,y_{<T},\
        \operatorname{Enc}(x))\, W_{vocab}

    ``batch``: ``"src"`` ``(B, S)`` ids, ``"src_lengths"`` ``(B,)`` in ``[1, S]`` (source positions
    from the length on are padding, masked in both attentions that read them), ``"tgt"`` ``(B, T)``
    ids and optionally ``"tgt_lengths"`` ``(B,)``. The decoder input is ``shift_right(tgt,
    config.bos_id)``; every id must lie in ``[0, vocab_size)``, padding included. Dropout is active
    only with ``train=True`` and ``config.dropout > 0``, its masks drawn from ``rng`` (a Generator
    or a seed).

    Returns ``(loss, cache)``, ``loss`` a 0-d array in the parameters' dtype.
    """
    _check_params(params, config)
    src, src_lengths, tgt, tgt_lengths = _check_batch(batch, config)
    drop = _Dropout(config.dropout if train else 0.0, rng)
    memory, encoder = _encode(params, src, src_lengths, config, drop)
    h, decoder = _decode(params, memory, src_lengths, shift_right(tgt, config.bos_id), config, drop)
    z, head = linear_forward(h, _output_weight(params, config))
    loss, ce = cross_entropy_forward(z, loss_targets(tgt, tgt_lengths, config.pad_id),
                                     ignore_index=IGNORE_INDEX,
                                     label_smoothing=config.label_smoothing)
    return loss, TransformerCache(config, encoder, decoder, head, ce)


def backward(cache: TransformerCache) -> dict[str, np.ndarray]:
    """Gradients of the loss of :func:`forward` w.r.t. every parameter (the keys of ``params``).

    The shared table collects three terms: the source embedding, the target embedding and, when
    tied, the output projection (``dE += dW_vocab^T``). The encoder output receives the sum of the
    cross-attention gradients of all decoder layers.
    """
    config = cache.config
    dz = cross_entropy_backward(1.0, cache.loss)
    dh, dw_out, _ = linear_backward(dz, cache.head)
    demb_tgt, dmemory, dec_grads = _decode_backward(dh, cache.decoder)
    demb_src, enc_grads = _encode_backward(dmemory, cache.encoder)
    grads = {"tok_emb": demb_src + demb_tgt, **enc_grads, **dec_grads}
    if config.tie_embeddings:
        grads["tok_emb"] = grads["tok_emb"] + dw_out.T
    else:
        grads["lm_head"] = dw_out
    return {name: grads[name] for name in param_shapes(config)}


def encode(params, src, src_lengths, config: TransformerConfig) -> np.ndarray:
    """The encoder output ``Z`` ``(B, S, d)`` in eval mode (no dropout); rows past each length are
    computed but never read by the decoder."""
    _check_params(params, config)
    src, src_lengths = _check_source(src, src_lengths, config)
    memory, _ = _encode(params, src, src_lengths, config, _Dropout(0.0, None))
    return memory


def decode(params, memory, src_lengths, tokens, config: TransformerConfig) -> np.ndarray:
    """Next-token logits ``(B, T, V)`` for the decoder input ``tokens`` ``(B, T)`` (starting with
    BOS) given the encoder output ``memory`` ``(B, S, d)``, in eval mode. Position ``t`` predicts
    the token after ``tokens[:, t]``."""
    dtype = _check_params(params, config)
    memory = float_array("memory", memory)
    check_ndim("memory", memory, 3, "(B, S, d)")
    if memory.shape[2] != config.d_model or memory.dtype != dtype:
        raise ValueError(
            f"memory must be (B, S, d_model = {config.d_model}) in the parameters' dtype {dtype}, "
            f"got shape {memory.shape} and dtype {memory.dtype}"
        )
    src_lengths = _check_lengths("src_lengths", src_lengths, memory.shape[0], 1, memory.shape[1])
    tokens = _check_tokens("tokens", tokens, config, memory.shape[0])
    h, _ = _decode(params, memory, src_lengths, tokens, config, _Dropout(0.0, None))
    return h @ _output_weight(params, config)


def logits(params, src, src_lengths, tokens, config: TransformerConfig) -> np.ndarray:
    """Eval-mode logits ``(B, T, V)``: :func:`encode` the source, then :func:`decode` ``tokens``.

    The encoder-decoder needs the source besides the decoder input, hence the two extra arguments
    compared with the decoder-only models' ``logits(params, tokens, config)``.
    """
    return decode(params, encode(params, src, src_lengths, config), src_lengths, tokens, config)


# ---- gradient-check case -------------------------------------------------------------------------

def _case_make(config, train: bool):
    """Norm gains and shifts moved off their initial values, and every ReLU input kept near +-1
    (``b1 = +-1``, ``W_1`` shrunk) so that no finite-difference step crosses the kink; a source
    holding every real token, a target padded by length and by ``pad_id``."""
    def make(rng):
        params = init_params(config, seed=int(rng.integers(1 << 31)))
        for name, value in params.items():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("gamma", "beta", "b2"):
                value += 0.2 * rng.standard_normal(value.shape)
            elif leaf == "b1":
                value[:] = rng.choice([-1.0, 1.0], size=value.shape)
            elif leaf == "w1":
                value *= 0.25
        # the source holds every real token (ids 2..V-1), so every row of the table has a source term
        src = rng.permutation(np.resize(np.arange(2, config.vocab_size), 12)).reshape(2, 6)
        batch = {"src": src, "src_lengths": np.array([6, 5]),
                 "tgt": rng.integers(2, config.vocab_size, (2, 5)), "tgt_lengths": np.array([5, 4])}
        batch["tgt"][1, 2] = config.pad_id

        def loss(p):
            return forward(p, batch, config, train=train, rng=7)
        return params, loss
    return make


# step 2.5e-4: see the GPT case. One layer each side keeps the command fast; the two-layer stacks
# are checked in tests/models/test_transformer.py.
register_case(ParamCase("transformer", "1+1 layers, tied, dropout 0.2, label smoothing 0.1, padding",
                        ("M1",), _case_make(TransformerConfig(**{**asdict(TRANSFORMER_TINY), "n_layers": 1}),
                                            train=True),
                        backward, max_coords=2, step=2.5e-4))
