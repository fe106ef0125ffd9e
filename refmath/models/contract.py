"""The protocol every model of :data:`refmath.models.MODELS` defines, checked when its file is
first imported through the registry (:func:`refmath.models.model_module`).

A model is one module. The rest of refmath (training, generation, the KV cache, the compiled
decode step, the Hugging Face reader and writer, the sizes) reads only the names below; a module
that lacks one fails at import with an ``ImportError`` naming the module and the name, never later
with an ``AttributeError`` in the middle of a run or, worse, with a default that computes
something else.

Every model:

- ``<ConfigClass>`` (the name the registry gives): a frozen dataclass of the model's fields. A
  config is accepted only as exactly that class (:func:`refmath.models.check_config`): a subclass
  that adds a field may compute something the model's code does not know about.
- ``param_shapes(config)``, ``init_params(config, seed, dtype)``: the flat parameter dict.
- ``forward(params, batch, config, train, rng) -> (loss, cache)``, ``backward(cache) -> grads``,
  ``logits(...)``: training and evaluation.
- ``TRAINING_RECIPE``: how ``python -m refmath train`` trains it.
- ``HF_MODEL_TYPES``: the Hugging Face ``model_type`` values it reads (may be empty).

A model with Hugging Face types also defines ``config_from_hf(hf)``, ``params_from_hf(hf, config,
weights)``, ``to_hf(config, params)`` and ``sizing_fields(config)``.

A decoder-only model (``ModelEntry.decoder_only``) also defines its inference step, which
:mod:`refmath.inference.kv_cache` runs:

- ``cache_spec(config, batch, max_len)``: the cache it keeps (a
  :class:`refmath.models.common.CacheSpec`);
- ``embed(params, tokens, config, offset)``, ``cached_layer(x, params, layer, config, slot,
  offset, *, matmul, **options)``, ``head(params, x, config, *, matmul)``: one step, split where
  the cache sits. ``matmul`` (keyword, default :func:`refmath.ffn.matmul_rows_many`) computes
  every product of the layer and of the head: a function with that one's signature, ``(x, ws) ->
  [x @ w for w in ws]``, which the model passes down to each block it calls. The cache's steps
  hand it :mod:`refmath.fast.products`' choice (BLAS, or the C++ rows kernel for a few rows), so
  the model holds no switch of its own;
- ``cache_stale(config, length, n) -> bool``: whether appending ``n`` rows to a cache of
  ``length`` positions would mix keys computed at different RoPE frequencies (a length-dependent
  rope scaling); the decoding loop then prefills afresh. A model without such scalings returns
  False;
- ``rope_options(config, offset, length) -> dict | None``: the keyword arguments of
  :func:`refmath.positions.rope_forward` at positions ``offset..`` of a sequence ``length`` long
  (what the compiled step rotates with); None for a model whose positions do not enter by RoPE;
- ``compiled_layer_spec(params, config) -> (shape, layers) | None``: what
  :mod:`refmath.inference.compiled_step` runs of its layers in one compiled call, or None. It
  works from an allow-list (``COMPILED_FIELDS``): every field of the config is listed with the
  values the compiled layer computes, and a config with any other value, or with a field the list
  does not name, gets None (the NumPy step runs). A model without a compiled layer sets
  ``COMPILED_FIELDS = None`` and returns None.
"""
from __future__ import annotations

import dataclasses
from types import ModuleType

__all__ = ["required_names", "check_module", "ANY", "allowed"]

EVERY_MODEL = ("param_shapes", "init_params", "forward", "backward", "logits", "TRAINING_RECIPE",
               "HF_MODEL_TYPES")
HF_MODEL = ("config_from_hf", "params_from_hf", "to_hf", "sizing_fields")
DECODER_ONLY_MODEL = ("cache_spec", "embed", "cached_layer", "head", "cache_stale",
                      "rope_options", "compiled_layer_spec", "COMPILED_FIELDS")


def required_names(module: ModuleType, config_class: str, decoder_only: bool) -> tuple:
    """The names ``module`` must define, as the protocol above lists them."""
    names = (config_class,) + EVERY_MODEL
    if getattr(module, "HF_MODEL_TYPES", ()):
        names += HF_MODEL
    if decoder_only:
        names += DECODER_ONLY_MODEL
    return names


def check_module(module: ModuleType, config_class: str, decoder_only: bool) -> None:
    """Raise ``ImportError`` naming ``module`` and the first name of the protocol it lacks (or a
    compiled-layer allow-list that leaves a config field out)."""
    for name in required_names(module, config_class, decoder_only):
        if not hasattr(module, name):
            raise ImportError(f"model module {module.__name__} does not define {name!r}, which "
                              f"every {'decoder-only ' if name in DECODER_ONLY_MODEL else ''}"
                              f"model defines (see refmath.models.contract)",
                              name=module.__name__)
    cls = getattr(module, config_class)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ImportError(f"{module.__name__}.{config_class} is not a dataclass",
                          name=module.__name__)
    if decoder_only and module.COMPILED_FIELDS is not None:
        missing = unlisted_fields(cls, module.COMPILED_FIELDS)
        if missing:
            raise ImportError(f"{module.__name__}.COMPILED_FIELDS does not say what the compiled "
                              f"decode layer does with {config_class}.{', '.join(missing)}: list "
                              f"each field with the values it computes (or none)",
                              name=module.__name__)


def unlisted_fields(config_class: type, allowed: dict) -> list:
    """The fields of ``config_class`` that the allow-list ``allowed`` does not name."""
    return [f.name for f in dataclasses.fields(config_class) if f.name not in allowed]


ANY = object()  # an allow-list entry: every valid value of the field is computed


def allowed(config, fields: dict) -> bool:
    """Whether every field of ``config`` has a value the allow-list ``fields`` computes:
    ``{name: ANY}``, ``{name: (value, ...)}`` or ``{name: predicate(config) -> bool}``. A field
    the list does not name is not computed."""
    for f in dataclasses.fields(config):
        rule = fields.get(f.name)
        value = getattr(config, f.name)
        if rule is None:
            return False
        if rule is ANY:
            continue
        if callable(rule):
            if not rule(config):
                return False
        elif value not in rule:
            return False
    return True
