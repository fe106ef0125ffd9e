"""Hugging Face checkpoints written in bfloat16 and float16 (refmath.hf.save_checkpoint's dtype,
``convert --to-hf --dtype``): the rounding is refmath.weight_formats' (W1), the file is one that
safetensors and torch read as BF16/F16, and refmath.hf reads it back exactly."""
from __future__ import annotations

import dataclasses
import io
import json

import numpy as np
import pytest

from refmath import hf
from refmath import weight_formats as wf
from refmath.commands import main
from refmath.models import model_module
from refmath.models.decoder import DecoderConfig
from refmath.models.gpt import GPTConfig

pytest.importorskip("safetensors", reason="checkpoints are safetensors: install the 'hf' extra")

CONFIGS = {
    "gpt": GPTConfig(vocab_size=40, max_seq_len=16, n_layers=2, d_model=32, n_heads=4, d_ff=64),
    "llama": DecoderConfig(vocab_size=40, max_seq_len=16, d_model=32, n_layers=2, n_heads=4,
                           n_kv_heads=2, d_ff=64, rope_layout="half", tie_embeddings=False),
}


def _params(name):
    rng = np.random.default_rng(5)
    return {k: (v + 0.1 * rng.standard_normal(v.shape)).astype(np.float32)
            for k, v in model_module(name).init_params(CONFIGS[name], seed=5).items()}


def _rounded(value, dtype):
    flat = value.reshape(1, -1)
    back = (wf.from_bf16(wf.to_bf16(flat)) if dtype == "bf16" else wf.from_f16(wf.to_f16(flat)))
    return back.reshape(value.shape)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_16_bit_checkpoint_reads_back_as_the_rounded_parameters(name, dtype, tmp_path):
    params = _params(name)
    hf.save_checkpoint(tmp_path, name, CONFIGS[name], params, dtype=dtype)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == hf.WRITE_DTYPES[dtype][1]
    assert (tmp_path / "model.safetensors").stat().st_size < sum(v.nbytes for v in params.values()) / 2 + 8192
    model, config, back = hf.load_checkpoint(tmp_path, dtype=np.float32)
    assert model == name and set(back) == set(params)
    for key, value in params.items():
        np.testing.assert_array_equal(back[key], _rounded(value, dtype), err_msg=key)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_safetensors_and_torch_read_the_file_as_torchs_own_rounding(dtype, tmp_path):
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle; install the 'oracle' extra")
    from safetensors.torch import load_file

    params = _params("gpt")
    hf.save_checkpoint(tmp_path, "gpt", CONFIGS["gpt"], params, dtype=dtype)
    hf.save_checkpoint(tmp_path / "f32", "gpt", CONFIGS["gpt"], params)
    theirs = load_file(str(tmp_path / "model.safetensors"))
    full = load_file(str(tmp_path / "f32" / "model.safetensors"))
    want = torch.bfloat16 if dtype == "bf16" else torch.float16
    assert set(theirs) == set(full)
    for key, value in full.items():
        assert theirs[key].dtype == want, key
        assert torch.equal(theirs[key], value.to(want)), key  # torch's round to nearest even


def test_a_value_float16_cannot_hold_and_an_unknown_dtype_are_refused(tmp_path):
    params = _params("gpt")
    params["lm_head" if "lm_head" in params else "tok_emb"][0, 0] = 1e5
    with pytest.raises(ValueError, match="float16's range"):
        hf.save_checkpoint(tmp_path, "gpt", CONFIGS["gpt"], params, dtype="f16")
    with pytest.raises(ValueError, match="dtype must be None .* 'bf16', 'f16', got 'q8_0'"):
        hf.save_checkpoint(tmp_path, "gpt", CONFIGS["gpt"], _params("gpt"), dtype="q8_0")


def test_convert_writes_bf16_when_asked(tmp_path):
    pytest.importorskip("tokenizers", reason="convert writes tokenizer.json: install the 'hf' extra")
    from refmath.data import make_task
    from refmath.train import default_config, load_checkpoint as load_run, recipe, train

    task = {**recipe("gpt").task, "seq_len": 16}
    config = dataclasses.replace(default_config("gpt", make_task(task)), d_model=32)
    run = tmp_path / "run"
    train("gpt", run, steps=2, batch_size=4, eval_every=2, accuracy_examples=0, config=config,
          task=task, out=io.StringIO())
    assert main(["convert", "--to-hf", str(run), str(tmp_path / "hf"), "--dtype", "bf16"]) == 0
    _, _, back = hf.load_checkpoint(tmp_path / "hf", dtype=np.float32)
    for key, value in load_run(run).params.items():
        np.testing.assert_array_equal(back[key], _rounded(np.asarray(value, np.float32), "bf16"),
                                      err_msg=key)
