r"""Every layer of a decode step in one compiled call, for ``backend="cpu"`` (K2, K3).

A decode step at batch 1 streams every weight once, so its time should be the time to read them
(N5). Between the products, though, each layer has a dozen small operations: the two norms, RoPE
on the new query and key, the cache append, the attention, the activation, the residual adds. In
NumPy each is a call with its own checks and temporaries; measured inside real steps of a 12-layer
model of width 768 on one thread, they took 3.9 ms of an 18 ms step while the products took 14.
:class:`CompiledLayers` hands the whole stack of layers to one C++ call
(``csrc/decode_layers_cpu.cpp``), which runs the same products
(:func:`refmath.kernels.rows_matmul`'s kernel) and the same attention
(:func:`refmath.inference.decode.decode_attention`'s kernel) with the small work in between done
on buffers allocated once. The embedding and the head stay in Python: each runs once per step.
With weights stored in a narrower format, the head's product reads the stored head too
(:func:`refmath.kernels.format_rows_matmul`, the kernel of the layers' stored products, summed in
float32; :func:`refmath.inference.layer_formats.stored_head`), after the model's own final norm.

The NumPy layers (:func:`refmath.inference.kv_cache.decode_step` on the other backends) stay the
reference: this path gives their logits up to float32 rounding (the norms' sums are taken in
another order) and the same greedy tokens, which the tests check.

Each model says what its layers are in ``compiled_layer_spec(params, config)``, from an allow-list
of the config values the compiled layer computes (its ``COMPILED_FIELDS``, see
:mod:`refmath.models.contract`); a value or a field it does not list keeps the NumPy step. refmath's
decoder hands over its pre-norm sequential layers: RMSNorm, SwiGLU, optional query/key/value
biases, RoPE with or without a rope scaling (Llama 2 and 3.x, Mistral without its window, Qwen2);
GPT its pre-LN layers. A layer neither hands over (a mixture of experts, QK-norm, sliding windows,
a softcap, sandwich norms, GeGLU, GPT's post-LN, MLA's latent attention, the parallel blocks of
Falcon and Cohere) keeps the NumPy step:
:func:`compiled_layers` returns None for it.
"""
from __future__ import annotations

import numpy as np

from refmath import kernels
from refmath.fast.products import blas_products, kernel_products
from refmath.inference.layer_formats import HEAD, HEADS, LAYER_MATRICES
from refmath.positions import rope_angles

__all__ = ["compiled_layers", "CompiledLayers"]


def compiled_layers(module, params, config, stored=None,
                    weights: str = "f32") -> CompiledLayers | None:
    """The compiled decode layers of ``module`` with these ``params``, or None where the extension
    is missing, the parameters are not float32, or the model has no compiled layer or a layer
    with something it does not do: the model's ``compiled_layer_spec(params, config)`` (a hook
    every decoder-only model defines, :mod:`refmath.models.contract`) says what its layers are (``(shape, layers)``, the arguments of :func:`refmath.kernels.decode_layers`),
    or None.

    With ``weights`` ``"bf16"``, ``"f16"`` or ``"q8_0"``, ``params`` are
    :func:`refmath.inference.layer_formats.restored_params` and ``stored`` the
    :func:`~refmath.inference.layer_formats.stored_layer_weights` they were restored from: the
    layers' products then read the stored matrices (:func:`refmath.kernels.format_rows_matmul`'s
    kernel, summed in float32) and compute what the NumPy step computes on ``params``, up to
    float32 rounding. Where ``stored`` also holds the head
    (:data:`~refmath.inference.layer_formats.HEAD`, from
    :func:`~refmath.inference.layer_formats.stored_model`, with an untied ``config`` whose
    ``lm_head`` is the restored head) and the model's head is one of
    :data:`~refmath.inference.layer_formats.HEADS`, the head's product reads it too."""
    if not kernels.cpu_available():
        return None
    found = module.compiled_layer_spec(params, config)
    if found is None:
        return None
    shape, layers = found
    if weights != "f32":
        names = {id(value): key for key, value in params.items()}
        layers = [{key: stored.get(names.get(id(a)), a) if key in LAYER_MATRICES else a
                   for key, a in layer.items()} for layer in layers]
        if any(not isinstance(layer[key], np.ndarray) or layer[key].dtype == np.float32
               for layer in layers for key in LAYER_MATRICES if key in layer):
            return None  # a matrix without its stored form: the NumPy step keeps it
    arrays = [a for layer in layers for key, a in layer.items()
              if weights == "f32" or key not in LAYER_MATRICES]
    if not arrays or not all(isinstance(a, np.ndarray) and a.dtype == np.float32 for a in arrays):
        return None
    head = None
    if (weights != "f32" and stored is not None and HEAD in stored
            and getattr(module, "head", None) in HEADS and not config.tie_embeddings
            and isinstance(params.get("lm_head"), np.ndarray)):
        head = (params["lm_head"], np.ascontiguousarray(stored[HEAD]))
    return CompiledLayers(module, params, config, shape, layers, weights, head)


class CompiledLayers:
    """A model's layers, ready to run decode steps on ``backend="cpu"`` caches in one call each.

    Built once per generation by :func:`compiled_layers`; :meth:`step` binds the layers to a cache
    the first time it sees that cache (its blocks are checked once, by the extension)."""

    def __init__(self, module, params, config, shape: dict, layers: list, weights: str = "f32",
                 head=None):
        self.module, self.params, self.config = module, params, config
        self.weights = weights  # the layers' matrices: "f32", or the format they are stored in
        # (the restored lm_head the model's head multiplies by, the head stored in weights), or
        # None: the head's product is the caller's products' on params' head
        self._head = head
        self._shape, self._layers = shape, layers
        self._bound = None  # (cache, the extension's DecodeLayers over its blocks)
        self._no_rotation = np.zeros(0, np.float32)

    def runs(self, cache, products=None) -> bool:
        """Whether :meth:`step` takes this :class:`refmath.inference.kv_cache.KVCache` now: one on
        ``backend="cpu"`` with room for the step, whose layers keep every position (no ring),
        for a caller whose ``products`` are :func:`refmath.fast.products.kernel_products` (the
        NumPy step's products then run on the kernel too; for stored weights, also when the caller
        named none: None), and no
        rope scaling whose frequencies would change at this step (the NumPy step raises for that,
        see :func:`refmath.models.decoder.cache_stale`)."""
        chosen = products is kernel_products or (products is None and self.weights != "f32")
        if not (chosen and cache.backend == "cpu" and cache.max_len > cache.length):
            return False
        if any(cache.ring_size(i) is not None for i in range(cache.n_layers)):
            return False
        return not self.module.cache_stale(self.config, cache.length, 1)

    def step(self, cache, ids: np.ndarray, products=None) -> np.ndarray:
        """Feed ``ids`` ``(B,)`` at position ``cache.length`` through every layer, appending each
        layer's key and value to ``cache`` (whose length then grows by one); returns the logits
        ``(B, V)``, the head's product computed by ``products`` (None:
        :func:`refmath.fast.products.blas_products`). The caller has checked :meth:`runs`."""
        if self._bound is None or self._bound[0] is not cache:
            layers = [dict(layer, keys=k, values=v)
                      for layer, k, v in zip(self._layers, cache.keys, cache.values)]
            self._bound = (cache, kernels.decode_layers(cache.batch, layers, **self._shape,
                                                        weights=self.weights))
        offset = cache.length
        x = np.ascontiguousarray(self.module.embed(self.params, ids[:, None], self.config,
                                                   offset)[:, 0], dtype=np.float32)
        cos, sin = self._rotation(offset)
        self._bound[1].step(x, offset, cos, sin)
        for layer in range(cache.n_layers):
            cache.counts.record_step(layer, offset + 1, offset + 1)
        cache.length = offset + 1
        matmul = blas_products if products is None else products
        if self._head is not None:
            matmul = self._stored_head_products(matmul)
        return self.module.head(self.params, x[:, None], self.config, matmul=matmul)[:, 0]

    def _stored_head_products(self, others):
        """``products`` for the model's head: its product with the restored ``lm_head`` (that
        array, by identity: the one :data:`~refmath.inference.layer_formats.HEADS` multiply by)
        read from the stored head by :func:`refmath.kernels.format_rows_matmul`, summed in float32;
        any other product goes to ``others``."""
        restored, stored = self._head

        def products(x, ws):
            if not (len(ws) == 1 and ws[0] is restored and x.dtype == np.float32):
                return others(x, ws)
            rows = x.reshape(-1, x.shape[-1])
            y = kernels.format_rows_matmul(rows, stored, self.weights)
            return [y.reshape(x.shape[:-1] + (stored.shape[0],))]

        return products

    def _rotation(self, position: int):
        """RoPE's cos and sin at ``position`` in float32, as :func:`refmath.positions.rope_forward`
        computes them (with the rope scaling's frequencies and attention factor)."""
        if self._shape["rope"] == "none":
            return self._no_rotation, self._no_rotation
        rope = self.module.rope_options(self.config, position, position + 1)
        inv_freq = rope.get("inv_freq")
        if inv_freq is None:
            angles = rope_angles(np.array([position]), self._shape["head_dim"], rope["base"])[0]
        else:
            angles = position * np.asarray(inv_freq, dtype=np.float64)
        cos, sin = np.cos(angles), np.sin(angles)
        factor = rope.get("attention_factor", 1.0)
        if factor != 1.0:
            cos, sin = factor * cos, factor * sin
        return cos.astype(np.float32), sin.astype(np.float32)
