"""``convert --to-hf`` never leaves a half-written OUT_DIR: it checks its packages before it reads or
writes anything, and writes into a hidden folder that becomes OUT_DIR only when it is complete."""
import os
import sys

import pytest

from refmath import hf
from refmath import train as T
from refmath.commands import main
from refmath.models.gpt import GPTConfig

pytest.importorskip("safetensors", reason="convert writes safetensors: pip install 'refmath[hf]'")
pytest.importorskip("tokenizers", reason="convert writes tokenizer.json: pip install 'refmath[hf]'")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A one-step run of a tiny GPT."""
    path = tmp_path_factory.mktemp("convert") / "run"
    config = GPTConfig(vocab_size=32, max_seq_len=16, n_layers=1, d_model=16, n_heads=2, d_ff=32,
                       dropout=0.0)
    T.train("gpt", path, steps=1, batch_size=2, accuracy_examples=0, config=config,
            task={"name": "chars", "seq_len": 16, "n_sentences": 300}, out=open(os.devnull, "w"))
    return path


def convert(run_dir, out_dir, capsys):
    status = main(["convert", "--to-hf", str(run_dir), str(out_dir)])
    out, err = capsys.readouterr()
    return status, out, err


def test_without_tokenizers_it_refuses_before_writing_and_the_retry_works(run_dir, tmp_path,
                                                                          monkeypatch, capsys):
    out_dir = tmp_path / "hf"
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError
        status, _, err = convert(run_dir, out_dir, capsys)
    assert status == 2
    assert err == "refmath convert: convert needs the tokenizers package: pip install 'refmath[hf]'\n"
    assert not out_dir.exists() and os.listdir(tmp_path) == []
    status, out, err = convert(run_dir, out_dir, capsys)  # tokenizers back: the retry succeeds
    assert status == 0 and err == "", err
    assert sorted(os.listdir(out_dir)) == ["config.json", "model.safetensors", "tokenizer.json",
                                           "tokenizer_config.json"]
    assert hf.load_checkpoint(out_dir)[0] == "gpt"


@pytest.mark.parametrize("failure", [OSError("No space left on device"), KeyboardInterrupt()])
def test_a_failure_part_way_leaves_nothing_behind(failure, run_dir, tmp_path, monkeypatch, capsys):
    def fails(directory, tokenizer):
        assert (directory / "model.safetensors").exists()  # the weights are written by now
        raise failure

    out_dir = tmp_path / "hf"
    with monkeypatch.context() as m:
        m.setattr(hf, "save_tokenizer", fails)
        if isinstance(failure, KeyboardInterrupt):
            assert convert(run_dir, out_dir, capsys)[0] == 130
        else:
            with pytest.raises(OSError, match="No space left"):
                convert(run_dir, out_dir, capsys)
    assert os.listdir(tmp_path) == []  # neither OUT_DIR nor the hidden partial folder
    assert convert(run_dir, out_dir, capsys)[0] == 0


def test_out_dir_must_be_new_or_empty(run_dir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert convert(run_dir, tmp_path / "empty", capsys)[0] == 0
    assert (tmp_path / "empty" / "config.json").exists()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README").write_text("mine")
    status, _, err = convert(run_dir, tmp_path / "notes", capsys)
    assert status == 2 and "exists and is not an empty folder: choose a new OUT_DIR" in err
    assert os.listdir(tmp_path / "notes") == ["README"]


def test_help_names_the_packages_it_needs(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    assert "tokenizers" in " ".join(capsys.readouterr().out.split())
