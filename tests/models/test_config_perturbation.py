"""Every fast path either refuses a configuration or computes it: perturb each field of each model
configuration, one at a time, and compare.

The fast paths are the decode step on ``backend="cpu"`` with the compiled decode layers and the
weights in :func:`refmath.inference.weight_layout.decode_layout` (products on
:func:`refmath.fast.products.kernel_products`), the decode step on ``backend="cpu"`` with
NumPy's layers around the attention kernel, and the training attention kernel
(``attention_backend="cpu"``). Each runs teacher-forced on a fixed token sequence: a prompt, then one decode step per token. Each must
either refuse (``ValueError``, or the compiled layer's None, which leaves the NumPy step) or give
the float64 NumPy logits within the float32 rule (tests/_support.py). A field added to a config
that some fast path ignores fails here as soon as the field is given a value other than its
default, which is what the allow-lists (``COMPILED_FIELDS``, :mod:`refmath.models.contract`) are
for.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from refmath import kernels
from refmath.fast.products import blas_products, kernel_products
from refmath.ffn import FFN_KINDS
from refmath.inference import compiled_step
from refmath.inference.kv_cache import decode_step, prefill
from refmath.inference.weight_layout import decode_layout
from refmath.models import MODELS, config_class, model_module
from refmath.moe import MoEConfig
from refmath.norms import NORM_KINDS
from refmath.positions import LENGTH_DEPENDENT
from _model_variants import VARIANTS
from _support import float32_rule

pytestmark = pytest.mark.skipif(not kernels.cpu_available(), reason="needs refmath._C")

# The configurations each field is perturbed from: every block shape each model has
# (tests/_model_variants.py).
BASES = {label: fields for label, (_, fields) in VARIANTS.items()}
MODEL_OF = {label: model for label, (model, _) in VARIANTS.items()}

# Values to try for a field besides the generic ones (the other flag, a nearby number): the
# choices of the string fields and a value for the fields whose default is None.
HINTS = {
    "norm": NORM_KINDS,  # every kind of the one vocabulary: a config refuses those it lacks
    "ffn": FFN_KINDS,
    "rope_layout": ("interleaved", "half"),
    "attention_backend": ("cpu", "numpy"),
    "norm_position": ("pre", "post"),
    "qk_norm": ("head", "projection", None, True, False),
    "head_dim": (16, None), "d_ff": (40,), "n_kv_heads": (1, 4, None),
    "sliding_window": (3, None), "window_layers": ((True, False), (False, True), None),
    "windows": ((None, 3), (3, 3), None), "generation": (2, 1),
    "local_rope_base": (100.0, None), "query_pre_attn_scalar": (16.0, None),
    "attn_softcap": (20.0, None), "final_softcap": (5.0, None),
    "rope_scaling": (dict(rope_type="linear", factor=2.0),
                     dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_seq_len=4),
                     dict(rope_type="dynamic", factor=2.0, original_max_seq_len=6),
                     dict(rope_type="yarn", factor=4.0, original_max_seq_len=4),
                     dict(rope_type="longrope", factor=4.0, original_max_seq_len=6,  # Phi-3's
                          short_factor=(1.0, 1.5, 2.0, 3.0), long_factor=(1.0, 2.0, 5.0, 9.0)),
                     None),
    "moe": (MoEConfig(n_experts=4, top_k=2, d_expert=16), None),
    "dropout": (0.1,), "v_head_dim": (4,), "q_lora_rank": (12,), "latent_norm_eps": (1e-3,),
}


def _candidates(name: str, value) -> list:
    """Values other than ``value`` to try for field ``name`` (the first valid ones are kept)."""
    out = [v for v in HINTS.get(name, ()) if v != value]
    if isinstance(value, bool):
        out.append(not value)
    elif isinstance(value, int):
        out += [2 * value, value + 1, value - 1, 1, 2]
    elif isinstance(value, float):
        out += [1.5 * value, value / 2, value + 1.0]  # nearby first: realistic weights and scales
    return out


def _perturbations(base: str) -> list:
    """``[(field, value, config)]``: each field of the base configuration set to up to two other
    values its class accepts."""
    model = MODEL_OF[base]
    cls = config_class(model)
    config = cls(**BASES[base])
    found = []
    for field in dataclasses.fields(cls):
        kept = 0
        for value in _candidates(field.name, getattr(config, field.name)):
            try:
                perturbed = dataclasses.replace(config, **{field.name: value})
            except (ValueError, TypeError):
                continue
            if perturbed == config:
                continue
            found.append((field.name, value, perturbed))
            kept += 1
            if kept == 2:
                break
    return found


CASES = [(base, field, value, config) for base in BASES
         for field, value, config in _perturbations(base)]


def _params(model: str, config, seed=0) -> dict:
    """float64 parameters moved off their initial values (unit gains and zero biases would hide a
    gain or bias a fast path forgot)."""
    rng = np.random.default_rng(seed)
    params = model_module(model).init_params(config, seed=seed)
    return {name: value + 0.05 * rng.standard_normal(value.shape) for name, value in params.items()}


PROMPT, TOKENS = 5, 9


def _cached_logits(model: str, params, config, tokens, backend: str, compiled: bool, products):
    """Logits of positions ``PROMPT - 1 .. TOKENS - 1``: a prefill of the prompt, then one decode
    step per token (on the compiled layers where they take the step, afresh from a prefill where
    the model's ``cache_stale`` says the cached keys no longer hold), the products on
    ``products``."""
    module = model_module(model)
    layers = compiled_step.compiled_layers(module, params, config) if compiled else None
    z, cache = prefill(model, params, config, tokens[:, :PROMPT], backend=backend,
                       products=products)
    out = [z]
    for t in range(PROMPT, TOKENS):
        if module.cache_stale(config, cache.length, 1):
            z, cache = prefill(model, params, config, tokens[:, :t + 1], backend=backend,
                               products=products)
        elif layers is not None and layers.runs(cache, products):
            z = layers.step(cache, tokens[:, t], products)
        else:
            z = decode_step(model, params, config, cache, tokens[:, t], products=products)
        out.append(z)
    return np.stack(out, axis=1), layers is not None


def _step_logits(module, params, tokens, config) -> np.ndarray:
    """What the decode steps of :func:`_cached_logits` compute, by the full forward: the logits
    of positions ``PROMPT - 1 .. TOKENS - 1``, each of its own prefix where the rope scaling's
    rotation depends on the sequence's length (dynamic NTK, LongRoPE: a prefix past the trained
    context rotates every position otherwise than the whole sequence does)."""
    scaling = getattr(config, "rope_scaling", None)
    if scaling is None or scaling.rope_type not in LENGTH_DEPENDENT:
        return module.logits(params, tokens, config)[:, PROMPT - 1:]
    return np.stack([module.logits(params, tokens[:, :t + 1], config)[:, t]
                     for t in range(PROMPT - 1, TOKENS)], axis=1)


RAN_COMPILED = set()  # the bases whose perturbations ran on the compiled layers at least once


@pytest.mark.parametrize("base, field, value, config", CASES,
                         ids=[f"{b}-{f}={v!r}"[:80] for b, f, v, _ in CASES])
def test_every_fast_path_refuses_or_computes_a_perturbed_config(base, field, value, config):
    model = MODEL_OF[base]
    module = model_module(model)
    params64 = _params(model, config)
    params32 = {name: v.astype(np.float32) for name, v in params64.items()}
    tokens = (np.arange(2 * TOKENS).reshape(2, TOKENS) * 7 + 3) % config.vocab_size
    # the reference computes attention in NumPy (attention_backend picks a fast path itself)
    reference = dataclasses.replace(config, attention_backend="numpy")
    ref64 = module.logits(params64, tokens, reference)
    plain = module.logits(params32, tokens, reference)
    floor = 4 * np.finfo(np.float32).eps * np.abs(ref64).max()
    steps64 = _step_logits(module, params64, tokens, reference)
    steps32 = _step_logits(module, params32, tokens, reference)
    label = f"{base} with {field} = {value!r}"

    # the compiled layers, the rows kernel, the decode layout
    try:
        fast, compiled = _cached_logits(model, decode_layout(params32), config, tokens, "cpu",
                                        compiled=True, products=kernel_products)
    except ValueError:  # refused in words (a kernel that does not take an option)
        fast = None
    if fast is not None:
        float32_rule(f"compiled decode step, {label}", fast, steps64, steps32, floor=floor)
        if compiled:
            RAN_COMPILED.add(base)
    # the attention kernel between NumPy's layers, BLAS's products
    try:
        fast = _cached_logits(model, params32, config, tokens, "cpu", compiled=False,
                              products=blas_products)[0]
    except ValueError:
        fast = None
    if fast is not None:
        float32_rule(f"cpu decode step, {label}", fast, steps64, steps32, floor=floor)
    try:  # the training attention kernel
        kernel_config = dataclasses.replace(config, attention_backend="cpu")
        fast = module.logits(params32, tokens, kernel_config)
    except ValueError:
        fast = None
    if fast is not None:
        float32_rule(f"attention kernel, {label}", fast, ref64, plain, floor=floor)


# Fields with one valid value, which no perturbation can change
ONE_VALUE = {("mla", "attention_backend")}  # MLAConfig refuses the kernels (keys and values differ)


def test_every_field_of_every_model_is_perturbed_somewhere():
    """No field escapes: each is given another value from at least one base."""
    perturbed = {(MODEL_OF[base], field) for base, field, _, _ in CASES}
    for model, entry in MODELS.items():
        if not entry.decoder_only:
            continue  # the encoder-decoder has no fast path to compare (no cache, no kernel)
        missing = [f.name for f in dataclasses.fields(config_class(model))
                   if (model, f.name) not in perturbed | ONE_VALUE]
        assert not missing, f"{model}: fields never perturbed: {missing}"


def test_the_bases_that_the_compiled_layers_take_do_run_them():
    """Not vacuous: the plain bases run the compiled layers (unperturbed, and in the cases above)."""
    for base in ("llama", "llama-biases", "gpt"):
        model = MODEL_OF[base]
        config = config_class(model)(**BASES[base])
        params = {n: v.astype(np.float32) for n, v in _params(model, config).items()}
        assert compiled_step.compiled_layers(model_module(model), params, config) is not None, base
    if len(RAN_COMPILED) == 0 and len(CASES) > 0:
        pytest.skip("run with the perturbation cases to see which bases ran compiled")
    assert {"llama", "llama-biases", "gpt"} <= RAN_COMPILED
