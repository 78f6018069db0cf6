"""``convert from-hf`` on Hugging Face folders built to hurt: links and index entries that
lead out of the folder, absurd sizes in config.json, damaged safetensors headers, tensors
in the wrong shape. Each is one line on stderr, exit 2, and nothing in OUT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import hf_reference as ref
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxdist import convert


def _config() -> dict:
    config = ref.hf_config(vocab=256, d=64, layers=2, heads=4, kv_heads=2, mlp=96)
    config["head_dim"] = 32  # q_proj is [128, 64]: not square, so a transposed one has another shape
    return config


def _shard_of(hf_dir: Path, name: str) -> Path:
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    return hf_dir / index["weight_map"][name]


def _replace_tensor(hf_dir: Path, name: str, tensor: np.ndarray) -> None:
    shard = _shard_of(hf_dir, name)
    tensors = load_file(shard)
    tensors[name] = tensor
    save_file(tensors, shard, metadata={"format": "pt"})


def _edit_config(hf_dir: Path, **fields) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **fields}))


def _edit_index(hf_dir: Path, name: str, file: str) -> None:
    path = hf_dir / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"][name] = file
    path.write_text(json.dumps(index))


def _damage(hf_dir: Path, how: str) -> None:
    outside = hf_dir.parent / "outside"
    outside.mkdir(exist_ok=True)
    first = _shard_of(hf_dir, "model.embed_tokens.weight")  # in model-00001-of-00002
    if how == "template links out":
        (hf_dir.parent / "secret.txt").write_text("the neighbour's secret")
        (hf_dir / "chat_template.jinja").symlink_to("../secret.txt")
    elif how == "config links out":
        (outside / "config.json").write_text((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").unlink()
        (hf_dir / "config.json").symlink_to(outside / "config.json")
    elif how == "shard links out":
        os.replace(first, outside / first.name)
        first.symlink_to(outside / first.name)
    elif how == "absolute index entry":
        os.replace(first, outside / first.name)
        for name, file in json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"].items():
            if file == first.name:
                _edit_index(hf_dir, name, str(outside / first.name))
    elif how == "dot-dot index entry":
        os.replace(first, outside / first.name)
        _edit_index(hf_dir, "model.embed_tokens.weight", f"../outside/{first.name}")
    elif how == "layers 1e9 as a float":
        _edit_config(hf_dir, num_hidden_layers=1e9)
    elif how == "layers 1e9":
        _edit_config(hf_dir, num_hidden_layers=10**9)
    elif how == "hidden size 1e12":
        _edit_config(hf_dir, hidden_size=10**12)
    elif how == "vocab 1e12":
        _edit_config(hf_dir, vocab_size=10**12)
    elif how == "heads 1e9":
        _edit_config(hf_dir, num_attention_heads=10**9, num_key_value_heads=10**9)
    elif how == "truncated shard":
        first.write_bytes(first.read_bytes()[:-100])
    elif how == "garbage header":
        first.write_bytes(b"\xff" * 64)
    elif how == "transposed q_proj":
        name = "model.layers.1.self_attn.q_proj.weight"
        _replace_tensor(hf_dir, name, np.ascontiguousarray(load_file(_shard_of(hf_dir, name))[name].T))
    elif how == "norm of shape (1,)":
        _replace_tensor(hf_dir, "model.layers.1.input_layernorm.weight", np.ones(1, np.float32))
    elif how == "integer weights":
        _replace_tensor(hf_dir, "model.norm.weight", np.ones(64, np.int64))
    else:
        raise AssertionError(how)


HOSTILE = {
    "template links out": "chat_template.jinja leads outside the folder",
    "config links out": "config.json leads outside the folder",
    "shard links out": "model-00001-of-00002.safetensors leads outside the folder",
    "absolute index entry": "/outside/model-00001-of-00002.safetensors leads outside the folder",
    "dot-dot index entry": "../outside/model-00001-of-00002.safetensors leads outside the folder",
    "layers 1e9 as a float": "num_hidden_layers 1000000000.0 is not a positive integer",
    "layers 1e9": "num_hidden_layers is 1000000000, but the checkpoint holds layers 0..1 (2 in all)",
    "hidden size 1e12": "tensor model.embed_tokens.weight has shape (256, 64)",
    "vocab 1e12": "tensor model.embed_tokens.weight has shape (256, 64)",
    "heads 1e9": "tensor model.layers.0.self_attn.q_proj.weight has shape (128, 64)",
    "truncated shard": "model-00001-of-00002.safetensors: unreadable safetensors file (Error while deserializing header",
    "garbage header": "model-00001-of-00002.safetensors: unreadable safetensors file (Error while deserializing header",
    "transposed q_proj": "tensor model.layers.1.self_attn.q_proj.weight has shape (64, 128); ",
    "norm of shape (1,)": "tensor model.layers.1.input_layernorm.weight has shape (1,); ",
    "integer weights": "tensor model.norm.weight is I64",
}


@pytest.mark.parametrize("how", HOSTILE)
def test_hostile_folder_is_one_line_exit_2_and_writes_nothing(how, tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    ref.write_random_llama(hf_dir, _config())
    _damage(hf_dir, how)
    out = tmp_path / "out"
    assert convert.main(["from-hf", str(hf_dir), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxdist: error: "), err
    assert HOSTILE[how] in err[0], err[0]
    assert not out.exists()


def test_an_empty_out_stays_empty(tmp_path, capsys):
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    ref.write_random_llama(hf_dir, _config())
    _damage(hf_dir, "norm of shape (1,)")
    out.mkdir()
    assert convert.main(["from-hf", str(hf_dir), str(out)]) == 2
    assert "input_layernorm" in capsys.readouterr().err and list(out.iterdir()) == []


def test_the_cli_process_exits_2_on_a_damaged_header(tmp_path):
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    ref.write_random_llama(hf_dir, _config())
    _damage(hf_dir, "garbage header")
    done = subprocess.run(
        [sys.executable, "-m", "jaxdist.convert", "from-hf", str(hf_dir), str(out)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxdist: error: ") and "unreadable safetensors file" in lines[0]
    assert not out.exists()


def test_a_hub_cache_snapshot_converts_and_nothing_outside_is_copied(tmp_path):
    """The Hugging Face cache links a snapshot's files into its repository's blobs/: those
    links are inside the model; what from-hf keeps is the files' contents, not links."""
    repo = tmp_path / "models--org--tiny"
    plain = tmp_path / "plain"
    ref.write_random_llama(plain, _config())
    ref.write_tokenizer(plain / "tokenizer.json", 256)
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(plain.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        os.replace(file, blob)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    out = tmp_path / "out"
    assert convert.main(["from-hf", str(snapshot), str(out)]) == 0
    kept = sorted(p.name for p in (out / "hf_source").iterdir())
    assert kept == ["config.json", "tokenizer.json"] and not any(p.is_symlink() for p in (out / "hf_source").iterdir())
    # a link from the snapshot to anywhere but its blobs is still refused
    (tmp_path / "secret.txt").write_text("no")
    (snapshot / "chat_template.jinja").symlink_to(tmp_path / "secret.txt")
    assert convert.main(["from-hf", str(snapshot), str(tmp_path / "out2")]) == 2
    assert not (tmp_path / "out2").exists()


def test_to_hf_does_not_follow_a_link_out_of_hf_source(tmp_path, capsys):
    """A converted folder whose hf_source holds a link out (made by hand, or by an older
    from-hf) is refused by to-hf, which would otherwise export the linked file."""
    hf_dir, out = tmp_path / "hf", tmp_path / "out"
    ref.write_random_llama(hf_dir, _config())
    assert convert.main(["from-hf", str(hf_dir), str(out)]) == 0
    (tmp_path / "secret.txt").write_text("the neighbour's secret")
    (out / "hf_source" / "chat_template.jinja").symlink_to(tmp_path / "secret.txt")
    capsys.readouterr()
    assert convert.main(["to-hf", str(out), str(tmp_path / "back")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "chat_template.jinja leads outside the folder" in err[0]
    assert not (tmp_path / "back").exists()
