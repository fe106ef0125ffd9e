"""Whole networks composed from the ops of refmath, each with a hand-written forward and backward.

:data:`MODELS` is the one list of them, under the one name each has everywhere (training,
generation, the KV cache, the Hugging Face reader and writer, the sizes, the gradient checks, the
command line): the module path of its file and the name of its configuration class. Each model is
defined in its own file, which offers:

- ``param_shapes``, ``init_params``, ``forward``, ``backward`` and ``logits`` (training and
  evaluation), and its gradient cases (:mod:`refmath.registry`);
- ``TRAINING_RECIPE`` (:class:`refmath.models.common.TrainingRecipe`: how ``train`` trains it);
- ``HF_MODEL_TYPES`` (empty when no Hugging Face type computes it) and, when not empty,
  ``config_from_hf``, ``params_from_hf``, ``to_hf`` and ``sizing_fields``;
- for a decoder-only model, its inference step: ``cache_spec`` (a
  :class:`refmath.models.common.CacheSpec`), ``embed``, ``cached_layer`` and ``head``, which
  :mod:`refmath.inference.kv_cache` runs, and the hooks ``cache_stale``, ``rope_options``,
  ``compiled_layer_spec`` with its allow-list ``COMPILED_FIELDS``.

:mod:`refmath.models.contract` is that protocol in full; :func:`model_module` checks it the first
time it imports a model (a missing name is an ``ImportError`` naming the module and the name), and
:func:`check_config` accepts a configuration only as exactly its model's class.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import NamedTuple

from refmath._validate import check_choice
from refmath.models.contract import check_module

__all__ = [
    "ModelEntry", "MODELS", "DECODER_ONLY", "model_module", "config_class", "check_config",
    "model_name", "RETIRED_CONFIG_FIELDS", "saved_config_fields"
]


class ModelEntry(NamedTuple):
    module: str  # import path of the model's file
    config_class: str  # its configuration dataclass
    catalogue_id: str  # its ID in the equation catalogue
    decoder_only: bool  # generates from a prompt alone (the encoder-decoder needs a source)


MODELS = {
    "transformer": ModelEntry("refmath.models.transformer", "TransformerConfig", "M1", False),
    "gpt": ModelEntry("refmath.models.gpt", "GPTConfig", "M2", True),
    "llama": ModelEntry("refmath.models.decoder", "DecoderConfig", "M3", True),
    "mla": ModelEntry("refmath.models.mla", "MLAConfig", "M4", True),
    "cohere": ModelEntry("refmath.models.cohere", "CohereConfig", "M5", True),
    "falcon": ModelEntry("refmath.models.falcon", "FalconConfig", "M3", True),
    "olmo2": ModelEntry("refmath.models.olmo2", "OLMo2Config", "M3", True),
    "gemma": ModelEntry("refmath.models.gemma", "GemmaConfig", "M3", True),
    "phi3": ModelEntry("refmath.models.phi3", "Phi3Config", "M3", True),
}
DECODER_ONLY = tuple(name for name, entry in MODELS.items() if entry.decoder_only)


_CHECKED: set = set()  # the model names whose module passed the contract check


def model_module(name: str) -> ModuleType:
    """The module of model ``name`` (one of :data:`MODELS`), imported on first use and checked
    against the protocol of :mod:`refmath.models.contract` then."""
    entry = MODELS[check_choice("model", name, tuple(MODELS))]
    module = importlib.import_module(entry.module)
    if name not in _CHECKED:
        check_module(module, entry.config_class, entry.decoder_only)
        _CHECKED.add(name)
    return module


def config_class(name: str) -> type:
    """The configuration dataclass of model ``name``."""
    return getattr(model_module(name), MODELS[name].config_class)


def check_config(name: str, config, argument: str = "config") -> None:
    """Require ``config`` to be exactly model ``name``'s configuration class: a subclass may add
    fields that the model's code (and its fast paths) would silently ignore."""
    cls = config_class(name)
    if type(config) is not cls:
        raise TypeError(f"model {name!r} needs a {cls.__name__} ({cls.__module__}, exactly that "
                        f"class, not a subclass) as {argument}, got "
                        f"{type(config).__module__}.{type(config).__name__}")


def model_name(module: ModuleType) -> str:
    """The registry name of a model module (``refmath.models.decoder`` is ``"llama"``)."""
    for name, entry in MODELS.items():
        if entry.module == module.__name__:
            return name
    raise ValueError(f"{module.__name__} is not one of refmath's models: "
                     f"{', '.join(e.module for e in MODELS.values())}")


# Fields that an older refmath saved in a configuration (a training run's config.json) under a name
# since retired (CHANGELOG, "Public names that changed"), by (model, field): each gives today's
# fields for the saved value. refmath.train reads a saved configuration through
# saved_config_fields, the one place they are translated, so that older runs still load; the files
# are left as they were written.
RETIRED_CONFIG_FIELDS = {
    # GPT's FFN kind was a flag: True the tanh form of GELU, False the exact one
    ("gpt", "gelu_approximate"): lambda value: {
        "ffn": "gelu_tanh" if value is True else "gelu" if value is False else value},
    # the norms' epsilon is norm_eps in every family
    ("gpt", "layernorm_eps"): lambda value: {"norm_eps": value},
    ("transformer", "ln_eps"): lambda value: {"norm_eps": value},
}


def saved_config_fields(name: str, fields: dict) -> dict:
    """The fields of a saved configuration of model ``name``, each field of
    :data:`RETIRED_CONFIG_FIELDS` under today's name."""
    if not isinstance(fields, dict):
        return fields  # not a configuration: refused where it is unpacked
    current = {}
    for field, value in fields.items():
        translate = RETIRED_CONFIG_FIELDS.get((name, field))
        current.update(translate(value) if translate else {field: value})
    return current
