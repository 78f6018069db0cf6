"""The tokenizer travels with the model: ``prepare`` records it, training records it in the
run's config, ``generate`` and ``eval`` use it without the training data, and a
converted folder keeps it relative to itself so the folder can move."""

from __future__ import annotations

import json
import os
import shutil

import hf_reference as ref
import numpy as np
import pytest

from jaxdist import convert
from jaxdist import eval as eval_cli
from jaxdist import generate as generate_cli
from jaxdist.config import load_config
from jaxdist.data.prepare import prepare
from jaxdist.train import main as train

from helpers import TINY


def _json(capsys, cli, argv) -> dict:
    assert cli.main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _error(capsys, cli, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("jaxdist: error: "), err
    return err[-1]


@pytest.fixture(scope="module")
def tokens_run(tmp_path_factory):
    """README's two commands: ``prepare --tokenizer`` a word corpus, train on
    ``data.source=tokens``; then the prepared data is deleted. -> (root, tokenizer, run dir)."""
    root = tmp_path_factory.mktemp("tokflow")
    tokenizer = root / "tokenizer.json"
    ref.write_tokenizer(tokenizer, 1000)
    rng = np.random.default_rng(0)
    (root / "docs").mkdir()
    for i in range(12):
        (root / "docs" / f"d{i}.txt").write_text(" ".join(f"w{j}" for j in rng.integers(0, 997, 150)))
    prepare([str(root / "docs")], str(root / "prepared"), tokenizer_path=str(tokenizer), progress=False)
    argv = [*TINY, "train.global_batch=4", "checkpoint.every_steps=2", "data.source=tokens", f"data.path={root / 'prepared'}"]
    assert train([*argv, "--mesh", "1", "--steps", "2", "--run-dir", str(root / "run")]) == 0
    shutil.rmtree(root / "prepared")  # generate and eval must not need it
    return root, tokenizer, root / "run"


def test_training_on_prepared_tokens_records_their_tokenizer(tokens_run):
    _, tokenizer, run = tokens_run
    assert load_config(str(run / "config.yaml")).data.tokenizer == str(tokenizer.absolute())


def test_generate_encodes_the_prompt_with_the_runs_tokenizer_without_its_data(tokens_run, capsys):
    from tokenizers import Tokenizer

    _, tokenizer, run = tokens_run
    got = _json(capsys, generate_cli, ["--checkpoint", str(run), "--prompt", "w5 w7 w9", "--max-new-tokens", "6"])
    assert got["prompt_ids"] == [8, 10, 12]  # WordLevel: w_i is id i + 3 (bytes would be [119, 53, 32, ...])
    assert got["text"] == Tokenizer.from_file(str(tokenizer)).decode(got["ids"])
    assert 2 in got["stop_ids"]  # the tokenizer's end of document ("</s>")


def test_eval_tokenizes_other_text_with_the_runs_tokenizer(tokens_run, tmp_path, capsys):
    """Scoring a text file gives the loss of scoring the same text prepared with the run's
    tokenizer; prepared data of another tokenizer is refused."""
    root, tokenizer, run = tokens_run
    keys = ["--checkpoint", str(run), "train.global_batch=2", "train.eval_batches=4"]
    prepare([str(root / "docs")], str(tmp_path / "again"), tokenizer_path=str(tokenizer), progress=False)
    from_tokens = _json(capsys, eval_cli, [*keys, "data.source=tokens", f"data.path={tmp_path / 'again'}"])
    from_text = _json(capsys, eval_cli, [*keys, "data.source=text", f"data.path={root / 'docs'}"])
    assert from_text["tokens"] == from_tokens["tokens"] > 0
    assert from_text["loss"] == pytest.approx(from_tokens["loss"], rel=1e-6)
    prepare([str(root / "docs")], str(tmp_path / "bytes"), progress=False)
    message = _error(capsys, eval_cli, [*keys, "data.source=tokens", f"data.path={tmp_path / 'bytes'}"])
    assert f"was tokenized with bytes, but data.tokenizer is {tokenizer.absolute()}" in message


def test_record_tokenizer(tmp_path, monkeypatch):
    """Text runs record bytes, prepared data its tokenizer, relative paths become absolute,
    and a recorded tokenizer that is gone is one line."""
    from jaxdist.data.sources import record_tokenizer
    from jaxdist.errors import JaxdistError

    (tmp_path / "doc.txt").write_text("w1 w2 w3 " * 20)
    ref.write_tokenizer(tmp_path / "tok.json", 100)
    monkeypatch.chdir(tmp_path)
    cases = {
        ("data.source=stdlib",): "byte",
        ("data.source=text", "data.path=doc.txt", "data.tokenizer=tok.json"): str(tmp_path / "tok.json"),
        ("data.source=synthetic",): "",
    }
    for overrides, want in cases.items():
        config = load_config(None, list(overrides))
        record_tokenizer(config)
        assert config.data.tokenizer == want, overrides
    prepare(["doc.txt"], "prepared", tokenizer_path="tok.json", progress=False)
    config = load_config(None, ["data.source=tokens", "data.path=prepared"])
    record_tokenizer(config)
    assert config.data.tokenizer == str(tmp_path / "tok.json")
    os.rename("tok.json", "moved.json")
    with pytest.raises(JaxdistError, match="was tokenized with .*tok.json, which is gone; pass data.tokenizer=FILE"):
        record_tokenizer(load_config(None, ["data.source=tokens", "data.path=prepared"]))
    config = load_config(None, ["data.source=tokens", "data.path=prepared", "data.tokenizer=moved.json"])
    record_tokenizer(config)  # the same file, moved: accepted
    assert config.data.tokenizer == str(tmp_path / "moved.json")


def test_a_converted_folder_can_move(tmp_path, capsys):
    ref.write_random_llama(tmp_path / "hf", ref.hf_config(vocab=1000, d=64, layers=1, heads=4, kv_heads=2))
    ref.write_tokenizer(tmp_path / "hf" / "tokenizer.json", 1000)
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "first")]) == 0
    os.rename(tmp_path / "first", tmp_path / "moved")
    moved = tmp_path / "moved"
    got = _json(capsys, generate_cli, ["--checkpoint", str(moved), "--prompt", "w5 w7 w9", "--max-new-tokens", "2"])
    assert got["prompt_ids"] == [8, 10, 12]
    # training from the moved folder's config.yaml records where its tokenizer now is
    assert load_config(str(moved / "config.yaml")).data.tokenizer == str(moved / "hf_source" / "tokenizer.json")
    assert convert.main(["to-hf", str(moved), str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()


def test_a_model_without_tokenizer_takes_ids_not_text(tmp_path, capsys):
    ref.write_random_llama(tmp_path / "hf", ref.hf_config(vocab=256, d=64, layers=1, heads=4, kv_heads=2))
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 0
    capsys.readouterr()
    message = _error(capsys, generate_cli, ["--checkpoint", str(tmp_path / "out"), "--prompt", "hello"])
    assert "the checkpoint names no tokenizer (converted without one): give --prompt-ids" in message
    got = _json(capsys, generate_cli, ["--checkpoint", str(tmp_path / "out"), "--prompt-ids", "5,6,7", "--max-new-tokens", "3"])
    assert got["text"] is None and len(got["ids"]) <= 3
