"""One vocabulary per concept, for every model and whatever reads them (issue 44, "Names and
surface"): a family added later that spells one differently fails here.

- The head width a layer computes with is ``d_h`` (the catalogue's notation) on every model
  configuration; ``head_dim`` is only ever what sets it (a field, a keyword), never a second name
  for the resolved width, as ``d_ff`` sets ``d_f`` and ``n_kv_heads`` sets ``kv_heads``.
- The FFN kind is a field named ``ffn`` whose values are :data:`refmath.ffn.FFN_KINDS`; the norm
  kind a field named ``norm`` with values of :data:`refmath.norms.NORM_KINDS`. The model configs,
  :mod:`refmath.sizing`, the blocks and the compiled decode layer take the same names.
- The retired spellings (CHANGELOG, "Public names that changed") are gone from every config and
  every public keyword.
"""
import dataclasses
import importlib
import inspect
from pathlib import Path

import numpy as np
import pytest

from refmath import kernels, sizing
from refmath.ffn import FFN_KINDS, GATED_FFN_KINDS
from refmath.models import (DECODER_ONLY, MODELS, RETIRED_CONFIG_FIELDS, blocks, config_class,
                            model_module)
from refmath.norms import NORM_KINDS

# Names that once meant one of these concepts, and no config or public keyword may use again
RETIRED = ("query_key_width", "d_k", "head_width", "mlp", "mlp_bias", "gelu_approximate",
           "layernorm_eps", "ln_eps")
# A value a saved configuration held for each retired field, to translate
SAVED_VALUES = {"gelu_approximate": (True, False), "layernorm_eps": (1e-5,), "ln_eps": (1e-6,)}
# How the kernels' binding spells the kinds: translated in refmath.kernels only
KERNEL_SPELLINGS = ("rms", "layer", "gelu_exact")

ROOT = Path(__file__).resolve().parents[1]


def small_config(name: str):
    """Model ``name``'s training recipe at a tiny vocabulary: a valid instance of its config."""
    recipe = model_module(name).TRAINING_RECIPE
    return config_class(name)(vocab_size=11, max_seq_len=8, **recipe.config)


def accepted(config, field: str, values) -> set:
    """The ``values`` that ``config``'s class takes for ``field``."""
    taken = set()
    for value in values:
        try:
            dataclasses.replace(config, **{field: value})
        except (ValueError, TypeError):
            continue
        taken.add(value)
    return taken


CONFIG_CLASSES = {name: config_class(name) for name in MODELS}


# ---- the head width ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_config_reads_its_head_width_as_d_h(name):
    cls, config = CONFIG_CLASSES[name], small_config(name)
    assert isinstance(inspect.getattr_static(cls, "d_h"), property), f"{cls.__name__}.d_h"
    assert isinstance(config.d_h, int) and config.d_h >= 1
    fields = {f.name for f in dataclasses.fields(cls)}
    # head_dim, where a config has it, is the field that sets d_h: never a resolved property
    if hasattr(cls, "head_dim") or "head_dim" in fields:
        assert "head_dim" in fields, f"{cls.__name__}.head_dim is not a field"
        given = dataclasses.replace(config, head_dim=2 * config.d_h)
        assert given.d_h == 2 * config.d_h


@pytest.mark.parametrize("cls", [*CONFIG_CLASSES.values(), sizing.ModelConfig],
                         ids=lambda cls: cls.__name__)
def test_no_config_has_a_retired_name(cls):
    names = {f.name for f in dataclasses.fields(cls)} | set(dir(cls))
    assert not names & set(RETIRED), f"{cls.__name__}: {sorted(names & set(RETIRED))}"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_config_names_its_norms_epsilon_norm_eps(name):
    # one name for the epsilon of a model's norms (MLA's latent norms may have a second one)
    fields = {f.name for f in dataclasses.fields(CONFIG_CLASSES[name])}
    assert "norm_eps" in fields
    assert {f for f in fields if f.endswith("eps")} <= {"norm_eps", "latent_norm_eps"}


def test_the_resolved_value_width_is_d_v_as_the_head_width_is_d_h():
    # v_head_dim sets the value width, d_v is the width (MLAConfig's and sizing's alike)
    mla = small_config("mla")
    assert mla.d_v == mla.d_h and dataclasses.replace(mla, v_head_dim=6).d_v == 6
    for cls in (CONFIG_CLASSES["mla"], sizing.ModelConfig):
        assert isinstance(inspect.getattr_static(cls, "d_v"), property)
        assert not hasattr(cls, "value_dim")


def test_sizing_describes_every_model_with_the_models_names():
    # a model's sizing_fields goes into ModelConfig unchanged: the same field names and kinds
    for name in DECODER_ONLY:
        config = small_config(name)
        fields = model_module(name).sizing_fields(config)
        assert fields["head_dim"] == config.d_h, name
        assert fields.get("ffn", "swiglu") in FFN_KINDS, name
        assert fields.get("norm", "rmsnorm") in NORM_KINDS, name
        sizing.ModelConfig(name=name, **fields)


# ---- the FFN and norm kinds ----------------------------------------------------------------------

def test_the_kinds_are_written_once():
    assert set(GATED_FFN_KINDS) <= set(FFN_KINDS) and len(set(FFN_KINDS)) == len(FFN_KINDS)
    assert len(set(NORM_KINDS)) == len(NORM_KINDS)
    assert not hasattr(blocks, "NORMS")  # the blocks take refmath.norms' names


def test_sizing_counts_every_kind_and_no_other():
    llama = sizing.PRESETS["llama-3-8b"]
    assert accepted(llama, "ffn", FFN_KINDS + ("mlp", "silu", "gelu_exact")) == set(FFN_KINDS)
    assert accepted(llama, "norm", NORM_KINDS + ("rms", "layer", "rms_norm")) == set(NORM_KINDS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_model_config_names_its_kinds_ffn_and_norm_from_the_one_vocabulary(name):
    cls, config = CONFIG_CLASSES[name], small_config(name)
    fields = {f.name for f in dataclasses.fields(cls)}
    for field, kinds in (("ffn", FFN_KINDS), ("norm", NORM_KINDS)):
        if field not in fields:
            continue
        taken = accepted(config, field, kinds + KERNEL_SPELLINGS + ("mlp", "silu", "rms_norm"))
        assert taken and taken <= set(kinds), f"{cls.__name__}.{field} takes {sorted(taken)}"
        assert getattr(config, field) in kinds
    # a family's own list of the kinds it takes is a subset of the vocabulary
    module = model_module(name)
    for constant, kinds in (("FFNS", FFN_KINDS), ("NORMS", NORM_KINDS)):
        if hasattr(module, constant):
            assert set(getattr(module, constant)) <= set(kinds), f"{name}.{constant}"


def test_the_compiled_layer_takes_the_one_vocabulary():
    assert set(kernels.DECODE_LAYER_NORMS) <= set(NORM_KINDS)
    assert set(kernels.DECODE_LAYER_FFNS) <= set(FFN_KINDS)
    # and every model that hands its layers over says them so
    for name in DECODER_ONLY:
        module, config = model_module(name), small_config(name)
        params = {k: v.astype(np.float32) for k, v in module.init_params(config, seed=0).items()}
        spec = module.compiled_layer_spec(params, config)
        if spec is not None:
            shape, _ = spec
            assert shape["norm"] in NORM_KINDS and shape["ffn"] in FFN_KINDS, (name, shape)


def test_the_blocks_refuse_another_spelling_of_a_norm():
    x, gamma = np.ones((2, 4)), np.ones(4)
    for kind in NORM_KINDS:
        blocks.norm_forward(x, kind, gamma, np.zeros(4) if kind == "layernorm" else None, 1e-5)
    with pytest.raises(ValueError, match="kind must be one of 'rmsnorm', 'layernorm'"):
        blocks.norm_forward(x, "rms", gamma, None, 1e-5)


# ---- no public keyword and no saved field under a retired name -----------------------------------

def public_modules() -> list[str]:
    """The refmath modules whose names a caller passes these concepts to: the models, the ops,
    sizing, the kernels' door, inference, hf and train."""
    names = ["refmath.sizing", "refmath.kernels", "refmath.ffn", "refmath.norms", "refmath.hf",
             "refmath.train", "refmath.attention", "refmath.positions"]
    for folder in ("models", "inference"):
        for path in sorted((ROOT / "refmath" / folder).glob("*.py")):
            if not path.name.startswith("_"):
                names.append(f"refmath.{folder}.{path.stem}")
    return names


@pytest.mark.parametrize("module_name", public_modules())
def test_no_public_keyword_uses_a_retired_name(module_name):
    module = importlib.import_module(module_name)
    # d_k stays a keyword of RoPE's ops (refmath.positions): the width rotated, N10's d_k, which
    # is no head width (MLA rotates d_R)
    retired = set(RETIRED) - ({"d_k"} if module_name == "refmath.positions" else set())
    found = []
    for attr in getattr(module, "__all__", ()):
        value = getattr(module, attr)
        functions = [value] if callable(value) else []
        if inspect.isclass(value):
            functions = [getattr(value, m) for m in vars(value)
                         if not m.startswith("_") and callable(getattr(value, m))]
        for function in functions:
            try:
                parameters = inspect.signature(function).parameters
            except (TypeError, ValueError):
                continue
            found += [f"{attr}({p})" for p in parameters if p in retired]
    assert not found, f"{module_name}: {found}"


def test_every_retired_config_field_is_translated_to_current_fields():
    for (model, field), translate in RETIRED_CONFIG_FIELDS.items():
        assert field in RETIRED and model in MODELS
        config = small_config(model)
        for value in SAVED_VALUES[field]:
            current = translate(value)
            assert not set(current) & set(RETIRED)
            dataclasses.replace(config, **current)  # today's fields, valid values
