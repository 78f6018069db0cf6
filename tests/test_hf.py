"""Hugging Face Llama in and out, checked against the checkpoint's own tensors (no PyTorch):
``jaxdist.convert from-hf`` / ``to-hf``, ``--init-from`` on a 3-axis mesh, ``jaxdist.eval``,
and bad input. ``tests/hf_reference.py`` is the numpy Llama the logits are compared with;
``tests/test_hf_parity.py`` holds both against ``transformers`` where PyTorch is installed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import hf_reference as ref
import jax
import ml_dtypes
import numpy as np
import pytest

from jaxdist import convert
from jaxdist import eval as eval_cli
from jaxdist.hf import import_export as hf_convert

from helpers import first_batch, load_model

VARIANTS = {
    # GQA 8/2, Llama 3 rope scaling, a vocab 128 does not divide, untied head, fp32, a tokenizer
    "untied": dict(vocab=1000, tied=False, dtype="float32"),
    # tied embeddings, no rope scaling, bf16 weights, a vocab of whole 128s
    "tied": dict(vocab=640, tied=True, dtype="bfloat16", scaling=None, kv_heads=4),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """variant -> (Hugging Face directory, converted jaxdist directory)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, kwargs in VARIANTS.items():
        hf_dir = root / f"hf-{name}"
        ref.write_random_llama(hf_dir, ref.hf_config(**kwargs), seed=len(name))
        if name == "untied":
            ref.write_tokenizer(hf_dir / "tokenizer.json", 1000)
        assert convert.main(["from-hf", str(hf_dir), str(root / name)]) == 0
        out[name] = (hf_dir, root / name)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_from_hf_logits_match_the_checkpoint(converted, variant):
    hf_dir, out = converted[variant]
    config, tensors = ref.read_llama(hf_dir)
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (2, 300))  # long: RoPE mistakes grow with position
    want = ref.logits(config, tensors, ids)
    got = np.asarray(load_model(out)(jax.numpy.asarray(ids)))
    vocab = config["vocab_size"]
    assert got.shape[-1] % 128 == 0 and got.shape[-1] >= vocab
    np.testing.assert_allclose(got[..., :vocab], want, atol=1e-4, rtol=0)
    assert np.isneginf(got[..., vocab:]).all()  # padding ids are never predicted


@pytest.mark.parametrize("variant", VARIANTS)
def test_to_hf_reproduces_every_tensor(converted, variant, tmp_path):
    hf_dir, out = converted[variant]
    assert convert.main(["to-hf", str(out), str(tmp_path / "back")]) == 0
    config, tensors = ref.read_llama(hf_dir)
    back_config, back = ref.read_llama(tmp_path / "back")
    assert sorted(back) == sorted(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert np.array_equal(back[name].view(np.uint8), tensor.view(np.uint8)), name  # bit for bit
    for key in ("vocab_size", "hidden_size", "num_key_value_heads", "tie_word_embeddings", "rope_theta", "rope_scaling", "eos_token_id"):
        assert back_config[key] == config[key], key
    assert (tmp_path / "back" / "tokenizer.json").is_file() == (variant == "untied")


def _first_batch_loss(hf_dir: Path, config, sizes) -> float:
    """The Hugging Face model's mean loss (numpy) on the run's first batch."""
    from jaxdist.training.run import build_trainer

    first = first_batch(config, build_trainer(config, sizes).layout)
    inputs, targets = (np.asarray(jax.device_get(first[k])) for k in ("inputs", "targets"))
    return ref.mean_loss(*ref.read_llama(hf_dir), inputs, targets, np.ones(targets.shape))


def test_resume_from_a_weights_checkpoint_starts_from_its_weights(converted, tmp_path, capsys):
    """``--resume OUT`` of a converted model: as ``--init-from OUT``, saying so."""
    from jaxdist.config import load_config
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.training.run import run

    hf_dir, out = converted["tied"]
    config = load_config(str(out / "config.yaml"), ["data.source=synthetic", "train.global_batch=2", "train.seq_len=32", "train.steps=1"])
    want = _first_batch_loss(hf_dir, config, parse_mesh("1"))
    result = run(config, parse_mesh("1"), tmp_path / "run", progress=False, resume=str(out))
    assert result.losses[0] == pytest.approx(want, rel=1e-5)
    assert f"--resume {out} holds weights only: starting from them at step 0 with a fresh optimizer" in capsys.readouterr().err


def test_to_hf_shards_and_casts(converted, tmp_path, monkeypatch):
    hf_dir, out = converted["untied"]
    monkeypatch.setattr(hf_convert, "MAX_SHARD_BYTES", 100_000)
    assert convert.main(["to-hf", str(out), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    files = set(json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(files) > 2 and files == {p.name for p in (tmp_path / "bf16").glob("*.safetensors")}
    config, tensors = ref.read_llama(hf_dir)
    back_config, back = ref.read_llama(tmp_path / "bf16")
    assert back_config["torch_dtype"] == "bfloat16"
    for name, tensor in tensors.items():
        np.testing.assert_array_equal(back[name], tensor.astype(ml_dtypes.bfloat16), err_msg=name)


def test_diloco_checkpoints_give_their_outer_weights(tmp_path):
    """A DiLoCo state holds per-replica params and the outer (synchronised) ones: weights
    readers take the outer."""
    import orbax.checkpoint as ocp

    from jaxdist.training.weights import restore_params

    outer, replicas = np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros((2, 2, 3), np.float32)
    state = {"step": np.int32(4), "params": {"w": {"value": replicas}}, "outer": {"params": {"w": {"value": outer}}, "opt_state": {}}}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "7" / "state", state)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    got = restore_params(tmp_path / "7", {"w": {"value": jax.ShapeDtypeStruct((2, 3), np.float32, sharding=device)}})
    np.testing.assert_array_equal(np.asarray(got["w"]["value"]), outer)


@pytest.mark.heavy
def test_init_from_on_three_axes_starts_at_the_converted_loss(converted, tmp_path, capsys):
    """Fine-tuning on data=2,fsdp=2,tensor=2 from the converted weights: the first step's
    loss is the Hugging Face model's on that batch; the run then resumes as its own."""
    from jaxdist.config import load_config
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.training.run import run

    hf_dir, out = converted["untied"]
    overrides = ["data.source=synthetic", "train.global_batch=8", "train.seq_len=48", "train.steps=2", "checkpoint.every_steps=2"]
    config = load_config(str(out / "config.yaml"), overrides)
    sizes = parse_mesh("data=2,fsdp=2,tensor=2")
    want = _first_batch_loss(hf_dir, config, sizes)
    result = run(config, sizes, tmp_path / "ft", progress=False, init_from=str(out))
    assert result.losses[0] == pytest.approx(want, rel=1e-5)
    assert "weights from" in capsys.readouterr().err
    # the fine-tuned run exports its own (trained) weights, and the tokenizer comes along
    assert convert.main(["to-hf", str(tmp_path / "ft"), str(tmp_path / "ft-hf")]) == 0
    _, exported = ref.read_llama(tmp_path / "ft-hf")
    assert (tmp_path / "ft-hf" / "tokenizer.json").is_file()
    trained = np.asarray(load_model(tmp_path / "ft").embed[...])
    np.testing.assert_array_equal(exported["model.embed_tokens.weight"], trained[:1000])
    assert not np.array_equal(trained[:1000], ref.read_llama(hf_dir)[1]["model.embed_tokens.weight"])
    # run again with the same --init-from: it resumes from its own checkpoint instead
    config = load_config(str(out / "config.yaml"), [*overrides, "train.steps=3"])
    resumed = run(config, sizes, tmp_path / "ft", progress=False, init_from=str(out))
    assert len(resumed.losses) == 1  # step 3 only
    assert f"--init-from {out} is not used: the run resumes from its own checkpoint step 2" in capsys.readouterr().err


def test_eval_scores_the_held_out_batches(converted, capsys):
    from jaxdist.config import load_config
    from jaxdist.data.batches import eval_batches
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.training.run import build_trainer

    hf_dir, out = converted["untied"]
    keys = ["data.source=synthetic", "train.global_batch=4", "train.seq_len=40", "train.eval_batches=2"]
    assert eval_cli.main(["--checkpoint", str(out), "--mesh", "tensor=2", "--json", *keys]) == 0
    result = json.loads(capsys.readouterr().out)
    config = load_config(str(out / "config.yaml"), keys)
    batches = list(eval_batches(config, build_trainer(config, parse_mesh("1")).layout))
    model = ref.read_llama(hf_dir)
    losses = [ref.mean_loss(*model, *(np.asarray(jax.device_get(b[k])) for k in ("inputs", "targets")), np.ones((4, 40))) for b in batches]
    assert result["tokens"] == 2 * 4 * 40
    assert result["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))


def test_eval_scores_each_held_out_window_once(converted, tmp_path, capsys):
    """A corpus whose held-out split is one window: eval scores that window once, however
    many batches are asked, says so, and its loss is the numpy model's on that window."""
    hf_dir, out = converted["untied"]
    words = [f"w{i}" for i in np.random.default_rng(5).integers(0, 997, 150)]
    (tmp_path / "doc.txt").write_text(" ".join(words))
    keys = ["data.source=text", f"data.path={tmp_path / 'doc.txt'}", "train.global_batch=4", "train.seq_len=40"]
    assert eval_cli.main(["--checkpoint", str(out), "--json", "--batches", "5", *keys]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert "the held-out split has 1 window(s) of 40 tokens: 1 batch(es) of 4, not the 5 asked" in captured.err
    assert (result["batches"], result["windows"], result["tokens"]) == (1, 1, 40)
    # the stream is the words' ids (w_i is i + 3) then "</s>" (2); 150 // 40 windows, the last held out one token past the train's
    stream = np.asarray([int(w[1:]) + 3 for w in words] + [2])
    window = stream[2 * 40 + 1 : 3 * 40 + 2]
    want = ref.mean_loss(*ref.read_llama(hf_dir), window[None, :-1], window[None, 1:], np.ones((1, 40)))
    assert result["loss"] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("in_place", [True, False], ids=["gpu-path", "cpu-path"])
def test_layer_stacks_fill_the_same_either_way(in_place):
    """A layer stack lands in its shards the same whether filled layer by layer on the
    devices (GPU) or assembled once on the host (CPU)."""
    from jaxdist.hf.import_export import _to_device
    from jaxdist.hf.llama import Stacked

    layers = [np.random.default_rng(i).standard_normal((16, 4, 8)).astype(np.float32) for i in range(3)]
    mesh = jax.make_mesh((4, 2), ("a", "b"), devices=jax.devices()[:8])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "a", None, "b"))
    want = jax.ShapeDtypeStruct((3, 16, 4, 8), np.float32)
    got = _to_device(Stacked(3, lambda i: layers[i]), want, sharding, "x", in_place=in_place)
    assert got.sharding == sharding
    np.testing.assert_array_equal(np.asarray(got), np.stack(layers))


def _broken(root: Path, how: str) -> Path:
    """A Hugging Face directory damaged in one way."""
    hf_dir = root / how
    ref.write_random_llama(hf_dir, ref.hf_config(vocab=256, layers=1))
    config = json.loads((hf_dir / "config.json").read_text())
    if how == "not llama":
        config["model_type"] = "mistral"
    elif how == "biases":
        config["attention_bias"] = True
    elif how == "yarn rope":
        config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    elif how == "missing shard":
        next(hf_dir.glob("model-00002-*.safetensors")).unlink()
    elif how == "missing tensor":
        index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
        del index["weight_map"]["model.layers.0.mlp.up_proj.weight"]
        (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    elif how == "unreadable tokenizer":
        (hf_dir / "tokenizer.json").write_text("{not json")
    elif how == "unknown tokenizer":
        (hf_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TiktokenTokenizer"}))
    (hf_dir / "config.json").write_text(json.dumps(config))
    return hf_dir


BAD_SOURCES = {
    "not llama": "model_type 'mistral' is not a Llama checkpoint",
    "yarn rope": "rope_scaling type 'yarn' is not supported",
    "biases": "attention_bias is true: jaxdist's Llama has no biases",
    "missing shard": "missing shard(s) model-00002-of-00002.safetensors",
    "missing tensor": "tensors missing from the checkpoint: model.layers.0.mlp.up_proj.weight",
    "unreadable tokenizer": "invalid tokenizer file",
    "unknown tokenizer": "tokenizer TiktokenTokenizer has no tokenizer.json or tokenizer.model",
}


@pytest.mark.parametrize("how", BAD_SOURCES)
def test_bad_source_is_one_line_and_writes_nothing(how, tmp_path, capsys):
    hf_dir = _broken(tmp_path, how)
    assert convert.main(["from-hf", str(hf_dir), str(tmp_path / "out")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("jaxdist: error:") and BAD_SOURCES[how] in last
    assert not (tmp_path / "out").exists()


def test_bad_targets_are_one_line(converted, tmp_path, capsys):
    hf_dir, out = converted["tied"]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    cases = [
        (["from-hf", str(hf_dir), str(tmp_path / "full")], "already exists and is not empty"),
        (["to-hf", str(out), str(tmp_path / "full")], "already exists and is not empty"),
        (["to-hf", str(tmp_path / "nowhere"), str(tmp_path / "x")], "no such file or directory"),
        (["to-hf", str(hf_dir), str(tmp_path / "x")], "not a checkpoint"),
        (["to-hf", str(out), str(tmp_path / "x"), "--dtype", "int8"], "invalid choice"),
    ]
    for argv, message in cases:
        assert convert.main(argv) == 2, argv
        assert message in capsys.readouterr().err.strip().splitlines()[-1], argv
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine" and not (tmp_path / "x").exists()


def test_init_from_a_model_that_does_not_fit_is_one_line(converted, tmp_path, capsys):
    from jaxdist.train import main as train

    _, out = converted["tied"]
    argv = ["--init-from", str(out), "--mesh", "1", "--run-dir", str(tmp_path / "run"), "--steps", "1", "data.source=synthetic"]
    assert train(argv) == 2  # the built-in tiny model is not the converted one
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "its parameters do not fit this model" in last and "params/embed/value" in last
    assert not (tmp_path / "run").exists()
