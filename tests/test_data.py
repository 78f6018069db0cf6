"""The input pipeline: deterministic, identical for any process or worker count,
exactly packed, checkpointable, and masked so packed documents stay apart."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.config import ModelConfig
from jaxdist.data.batches import PackedExamples, ProcessSlice, batches_dataset, make_iterator, pack_window
from jaxdist.data.sources import ArrayStream
from jaxdist.models.llama import Llama
from jaxdist.train import main

from helpers import data_config as _config
from helpers import data_layout as _layout
from helpers import first_batch

EOD = 999


def _counting_examples(n_examples: int, seq_len: int = 8) -> PackedExamples:
    """Windows of a stream 0, 1, 2, ...: example i's first input is i * seq_len."""
    stream = ArrayStream(np.arange(n_examples * seq_len + 1))
    return PackedExamples(stream, 0, n_examples, seq_len, eod_id=-1, document_mask=True)


def _global_batches(source, global_batch: int, processes: int, steps: int, seed: int = 0) -> list[np.ndarray]:
    """What ``processes`` processes feed together, step by step (their rows stacked)."""
    rows = global_batch // processes
    datasets = [batches_dataset(source, ProcessSlice(global_batch, rows, p), seed=seed, shuffle=True) for p in range(processes)]
    return [np.concatenate([ds[k]["inputs"] for ds in datasets]) for k in range(steps)]


def test_same_seed_same_batches_other_seed_differs():
    source = _counting_examples(64)
    a, b = _global_batches(source, 8, 1, 5), _global_batches(source, 8, 1, 5)
    c = _global_batches(source, 8, 1, 5, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_together_feed_the_single_process_batches(processes):
    source = _counting_examples(64)
    single = _global_batches(source, 8, 1, 20)  # 20 steps cross 2 epochs of 8 batches
    multi = _global_batches(source, 8, processes, 20)
    for k, (x, y) in enumerate(zip(single, multi, strict=True)):
        np.testing.assert_array_equal(x, y, err_msg=f"step {k}")


def test_every_example_once_per_epoch_then_reshuffled():
    source, batch = _counting_examples(64), 8
    steps = _global_batches(source, batch, 4, 16)
    first_ids = [row[0] // 8 for step in steps for row in step]
    epoch1, epoch2 = first_ids[:64], first_ids[64:]
    assert sorted(epoch1) == list(range(64)) and sorted(epoch2) == list(range(64))
    assert epoch1 != epoch2 and epoch1 != sorted(epoch1)  # shuffled, and differently each epoch


def test_packing_keeps_every_token_once_and_marks_documents():
    docs = [np.arange(1, 6), np.arange(10, 13), np.arange(20, 31)]
    stream_tokens = np.concatenate([np.append(d, EOD) for d in docs])
    seq = 5
    examples = PackedExamples(ArrayStream(stream_tokens), 0, (len(stream_tokens) - 1) // seq, seq, EOD, True)
    inputs = np.concatenate([examples[i]["inputs"] for i in range(len(examples))])
    np.testing.assert_array_equal(inputs, stream_tokens[: len(inputs)])  # nothing lost, nothing twice
    assert len(stream_tokens) - 1 - len(inputs) < seq  # only the tail shorter than a window is left

    window = np.array([3, 4, EOD, 7, 8, EOD, 9])
    example = pack_window(window, EOD, document_mask=True)
    np.testing.assert_array_equal(example["targets"], [4, EOD, 7, 8, EOD, 9])
    np.testing.assert_array_equal(example["segment_ids"], [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(example["positions"], [0, 1, 2, 0, 1, 2])
    np.testing.assert_array_equal(example["loss_mask"], [1, 1, 0, 1, 1, 0])  # no loss predicting across an EOD


def test_attention_does_not_cross_documents():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, dtype="float32")
    model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.array([[5, 6, 7, 1, 8, 9, 10, 11]])
    other = tokens.at[0, :3].set(jnp.array([30, 31, 32]))  # change only the first document
    segments = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1]])
    positions = jnp.array([[0, 1, 2, 3, 0, 1, 2, 3]])
    masked = [model(t, positions, segments) for t in (tokens, other)]
    np.testing.assert_allclose(masked[0][0, 4:], masked[1][0, 4:], atol=1e-6)  # second document unaffected
    assert not np.allclose(masked[0][0, :3], masked[1][0, :3])
    unmasked = [model(t, positions) for t in (tokens, other)]
    assert not np.allclose(unmasked[0][0, 4:], unmasked[1][0, 4:])  # without the mask it would leak


def _take(iterator, n: int) -> list[dict[str, np.ndarray]]:
    return [jax.tree.map(np.asarray, next(iterator)) for _ in range(n)]


def _assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def test_stdlib_batches_are_global_arrays_in_the_batch_sharding():
    layout = _layout()
    batch = first_batch(_config(), layout)
    assert set(batch) == {"inputs", "targets", "loss_mask", "segment_ids", "positions"}
    assert batch["inputs"].shape == (8, 32) and batch["inputs"].sharding.is_equivalent_to(layout.batch_sharding(2), 2)
    assert int(batch["inputs"].max()) < 257


def test_restored_iterator_state_continues_identically():
    layout, config = _layout(), _config()
    reference = _take(make_iterator(config, layout), 6)
    iterator = make_iterator(config, layout)
    _take(iterator, 3)
    state = iterator.get_state()
    resumed = make_iterator(config, layout)
    resumed.set_state(state)
    _assert_same(_take(resumed, 3), reference[3:])
    _assert_same(_take(make_iterator(config, layout, start_step=3), 3), reference[3:])


@pytest.mark.heavy
def test_worker_processes_do_not_change_the_batches():
    layout = _layout()
    in_process = _take(make_iterator(_config(), layout), 4)
    iterator = make_iterator(_config("data.workers=2"), layout)
    with_workers = _take(iterator, 4)
    iterator.close()
    _assert_same(in_process, with_workers)


def test_eval_split_is_held_out_and_fixed(tmp_path):
    """A corpus of distinct tokens (each word once): over a whole epoch of training batches
    no token of any eval window (input or target) appears in a training window; every
    held-out window is scored exactly once; and eval sees the same batches each time."""
    import hf_reference as ref

    from jaxdist.data.batches import eval_batches

    ref.write_tokenizer(tmp_path / "tok.json", 1600)
    (tmp_path / "doc.txt").write_text(" ".join(f"w{i}" for i in range(1500)))  # ids 3..1502, then EOD 2
    keys = ["data.source=text", f"data.path={tmp_path / 'doc.txt'}", f"data.tokenizer={tmp_path / 'tok.json'}"]
    layout, config = _layout(), _config(*keys, "data.eval_fraction=0.2", "train.eval_batches=100")
    n_windows = (1501 - 2) // 32
    n_eval = round(n_windows * 0.2)
    first, again = list(eval_batches(config, layout)), list(eval_batches(config, layout))
    _assert_same(jax.tree.map(np.asarray, first), jax.tree.map(np.asarray, again))
    rows = [
        (x, y) for b in first for x, y, m in zip(*(np.asarray(b[k]) for k in ("inputs", "targets", "loss_mask")), strict=True) if m.any()
    ]
    eval_tokens = {int(t) for x, y in rows for t in (*x, *y)}
    n_train = n_windows - n_eval
    train = _take(make_iterator(config, layout), -(-n_train // 8))  # at least one whole epoch
    train_tokens = {int(t) for b in train for key in ("inputs", "targets") for t in b[key].ravel()}
    assert len({int(x[0]) for b in train for x in b["inputs"]}) == n_train  # every training window was seen
    assert not eval_tokens & train_tokens
    assert len(rows) == n_eval and len({int(x[0]) for x, _ in rows}) == n_eval  # each held-out window once
    assert len(eval_tokens) == n_eval * 32 + 1


def _bad(argv, tmp_path, capsys) -> str:
    run_dir = tmp_path / "run"
    assert main([*argv, "--run-dir", str(run_dir), "--steps", "1", "--mesh", "data=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxdist: error: "), err
    assert not run_dir.exists()
    return err[0]


def test_data_errors_are_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    short = tmp_path / "short.txt"
    short.write_text("hello world\n")
    bad_tok = tmp_path / "tok.json"
    bad_tok.write_text("{not json")
    assert "no input files match" in _bad(["data.source=text", f"data.path={tmp_path}/missing/*.txt"], tmp_path, capsys)
    assert "empty" in _bad(["data.source=text", f"data.path={empty}"], tmp_path, capsys)
    assert "shorter than two sequences" in _bad(["data.source=text", f"data.path={short}"], tmp_path, capsys)
    assert "invalid tokenizer file" in _bad(["data.source=text", f"data.path={short}", f"data.tokenizer={bad_tok}"], tmp_path, capsys)
    assert "smaller than the tokenizer's 257 ids" in _bad(["model.vocab_size=64"], tmp_path, capsys)
    broken = tmp_path / "broken.txt"
    broken.symlink_to(tmp_path / "nowhere.txt")
    assert "broken.txt" in _bad(["data.source=text", f"data.path={broken}"], tmp_path, capsys)


def test_prepared_shards_feed_the_same_batches_as_raw_text(tmp_path):
    """text files -> prepare (bin or ArrayRecord, several shards) -> the same batches as
    tokenizing the text at start-up."""
    from jaxdist.data.prepare import prepare

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    for i in range(12):
        words = rng.choice(["alpha", "beta", "gamma", "delta", "pipeline", "mesh"], size=rng.integers(20, 200))
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(words))
    layout = _layout()
    reference = _take(make_iterator(_config("data.source=text", f"data.path={corpus}"), layout), 3)
    for fmt in ("bin", "arrayrecord"):
        out = tmp_path / f"prepared-{fmt}"
        meta = prepare([str(corpus)], str(out), fmt=fmt, shard_tokens=2000, progress=False)
        assert len(meta["shards"]) > 1
        batches = _take(make_iterator(_config("data.source=tokens", f"data.path={out}"), layout), 3)
        _assert_same(batches, reference)


def test_corrupt_prepared_data_is_one_line(tmp_path, capsys):
    from jaxdist.data.prepare import prepare

    text = tmp_path / "t.txt"
    text.write_text("some words " * 500)
    out = tmp_path / "prepared"
    meta = prepare([str(text)], str(out), progress=False)
    shard = out / meta["shards"][0]["path"]
    shard.write_bytes(shard.read_bytes()[:-10])
    assert "corrupt prepared data" in _bad(["data.source=tokens", f"data.path={out}"], tmp_path, capsys)
    assert "not a prepared data directory" in _bad(["data.source=tokens", f"data.path={tmp_path}"], tmp_path, capsys)
