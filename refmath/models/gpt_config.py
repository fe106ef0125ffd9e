"""The configuration of GPT (catalogue M2): :class:`GPTConfig`, each layer's window
(:func:`layer_window`, :func:`layer_config`) and the named configurations :data:`GPT_CONFIGS`;
:mod:`refmath.models.gpt` computes them."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from refmath._validate import (check_choice, check_field, check_flag, check_int, check_real,
                               check_window_layers)
from refmath.attention import ATTENTION_BACKENDS

__all__ = ["NORM_POSITIONS", "FFNS", "GPTConfig", "layer_window", "layer_config", "GPT_CONFIGS"]

NORM_POSITIONS = ("pre", "post")
FFNS = ("gelu", "gelu_tanh")  # of refmath.ffn.FFN_KINDS: the plain FFN with exact or tanh GELU


# ---- configuration -------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPTConfig:
    """Sizes and switches of a GPT; the defaults are GPT-2 small.

    - ``d_ff`` (FFN hidden width) defaults to ``4 * d_model``, as in GPT-1 and GPT-2; the resolved
      value is stored, so ``dataclasses.asdict`` round-trips through JSON.
    - ``norm_position``: ``"post"`` is GPT-1's ``LN(x + F(x))`` with no final norm; ``"pre"`` is
      GPT-2's ``x + F(LN(x))`` with the final LayerNorm ``ln_f``.
    - ``tie_embeddings``: the output projection is the token table transposed (GPT-1 and GPT-2);
      ``False`` adds a separate ``lm_head`` of shape ``(d_model, vocab_size)``.
    - ``ffn``: the FFN kind (:data:`FFNS`, of :data:`refmath.ffn.FFN_KINDS`): ``"gelu_tanh"``,
      the tanh form of GELU, or ``"gelu"``, the exact ``x Phi(x)``. The tanh form is the default
      because OpenAI's GPT and GPT-2 code use it, so weights trained there only reproduce their
      outputs with the same form; the exact one differs from it by less than 5e-4 (see
      ``refmath.ffn.gelu_forward``).
    - ``dropout``: one rate for the embedding sum, both residual branches and the attention
      weights (GPT-1 used 0.1 on all three); only active in ``forward(..., train=True)``.
    - ``init_std``: the std of every weight matrix and embedding at initialisation (0.02), divided
      by ``sqrt(2 n_layers)`` for the residual output projections (catalogue N11).
    - ``attention_backend``: ``"numpy"`` (the reference, :func:`refmath.attention.mha_forward`) or
      ``"cpu"`` (the FlashAttention kernel, float32; it has no attention dropout, so ``dropout``
      must be 0).
    - ``sliding_window`` = ``w``: a sliding layer's query sees itself and the ``w - 1`` positions
      before it (A12, :func:`refmath.attention.local_window_mask`), in training, evaluation and
      the KV cache alike, on either backend. Positions stay absolute (the learned table is read at
      ``0..T-1`` whatever the window). ``None``: every layer attends to every earlier position.
    - ``window_layers``: one ``True``/``False`` per layer, the layers that slide ``sliding_window``
      (the others are dense); ``None`` with a window means every layer slides. GPT-3 alternates
      dense and locally banded layers, after the Sparse Transformer (Brown et al. 2020, section
      2.1), without publishing the band's width or which layer comes first;
      ``window_layers = (False, True) * (n_layers // 2)`` is that alternation, dense first (see
      ``GPT_CONFIGS["gpt-3-175b"]``).
    """

    vocab_size: int = 50257
    max_seq_len: int = 1024
    n_layers: int = 12
    d_model: int = 768
    n_heads: int = 12
    d_ff: int | None = None
    norm_position: str = "pre"
    tie_embeddings: bool = True
    ffn: str = "gelu_tanh"
    dropout: float = 0.1
    norm_eps: float = 1e-5
    init_std: float = 0.02
    attention_backend: str = "numpy"
    sliding_window: int | None = None
    window_layers: tuple | None = None

    def __post_init__(self):
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model if isinstance(self.d_model, int) else None)
        for field in ("vocab_size", "max_seq_len", "n_layers", "d_model", "n_heads", "d_ff"):
            check_field(self, field, check_int, 1)
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.n_heads = {self.n_heads} must divide GPTConfig.d_model = {self.d_model}"
            )
        check_field(self, "norm_position", check_choice, NORM_POSITIONS)
        check_field(self, "tie_embeddings", check_flag)
        check_field(self, "ffn", check_choice, FFNS)
        # 0 switches dropout off; 1 would keep nothing (and divide by 1 - p = 0)
        check_field(self, "dropout", check_real, 0.0, 1.0, high_open=True)
        for field in ("norm_eps", "init_std"):
            check_field(self, field, check_real, 0.0, low_open=True)
        check_field(self, "attention_backend", check_choice, ATTENTION_BACKENDS)
        if self.attention_backend != "numpy" and self.dropout:
            raise ValueError(f"GPTConfig.attention_backend = {self.attention_backend!r} needs "
                             f"dropout = 0 (the kernel has no dropout on the attention weights), "
                             f"got dropout = {self.dropout}")
        check_field(self, "sliding_window", check_int, 1, optional=True)
        check_window_layers(self)

    @property
    def d_h(self) -> int:
        """The head width :math:`d_h = d / h`."""
        return self.d_model // self.n_heads


def layer_window(config: GPTConfig, layer: int) -> int | None:
    """The window of layer ``layer``: ``sliding_window`` on a sliding layer, None on a dense one."""
    if config.window_layers is not None and not config.window_layers[layer]:
        return None
    return config.sliding_window


def layer_config(config: GPTConfig, layer: int) -> GPTConfig:
    """The configuration layer ``layer``'s attention computes with: ``config`` itself, or, with
    ``window_layers``, ``config`` with that layer's window as ``sliding_window`` (None on a dense
    layer) and no ``window_layers``, so that the attention reads one field, as the decoder's
    (:func:`refmath.models.decoder.layer_config`) does. Built once per layer and kept."""
    if config.window_layers is None:
        return config
    return _layer_config(config, layer)


@functools.lru_cache(maxsize=1024)
def _layer_config(config: GPTConfig, layer: int) -> GPTConfig:
    return dataclasses.replace(config, window_layers=None,
                               sliding_window=layer_window(config, layer))


GPT_CONFIGS = {
    # Radford et al. 2019 with the released hparams: 12 layers, width 768, 12 heads, context 1024,
    # 50257 BPE tokens, FFN width 4 * 768, tied output, Pre-LN; 124,439,808 parameters. The paper
    # gives no dropout rate: 0.1 is GPT-1's, the usual choice when training this shape.
    "gpt2-small": GPTConfig(vocab_size=50257, max_seq_len=1024, n_layers=12, d_model=768,
                            n_heads=12, d_ff=3072, norm_position="pre", tie_embeddings=True,
                            ffn="gelu_tanh", dropout=0.1),
    # Brown et al. 2020, Table 2.1 (as refmath.sizing's gpt-3-175b): 96 layers, width 12288, 96
    # heads of 128, context 2048, FFN width 4 d, GPT-2's 50257 tokens and Pre-LN; 174,604,259,328
    # parameters with the output tied to the token table. The layers alternate dense and locally
    # banded attention (section 2.1), but the paper gives neither the band's width nor which layer
    # comes first: 256 and dense-first are GPT-Neo's (EleutherAI's open GPT-3-like models:
    # window_size = 256, attention_types [["global", "local"], ...]), an example, not GPT-3's own.
    # No dropout rate is published either; 0 here.
    "gpt-3-175b": GPTConfig(vocab_size=50257, max_seq_len=2048, n_layers=96, d_model=12288,
                            n_heads=96, d_ff=4 * 12288, norm_position="pre", tie_embeddings=True,
                            ffn="gelu_tanh", dropout=0.0, sliding_window=256,
                            window_layers=(False, True) * 48),
    # Small enough for gradient checks and lessons.
    "tiny": GPTConfig(vocab_size=17, max_seq_len=16, n_layers=2, d_model=16, n_heads=2, d_ff=32,
                      norm_position="pre", tie_embeddings=True, ffn="gelu_tanh", dropout=0.1),
}
