"""Object storage against a real S3 server on loopback (tests/s3_server.py): prepared token
shards read from ``s3://`` give every batch of the same shards on local disk and a run trains to
the same losses; ``prepare`` reads Parquet / JSON Lines from ``s3://`` and writes its shards
there, meta.json last, so a prepare killed half way is invisible and the next one replaces it;
bad input is one line, in bounded time, and never shows a credential."""

from __future__ import annotations

import os
import time

import jax
import numpy as np
import pytest

from jaxdist.config import load_config
from jaxdist.data.batches import make_iterator
from jaxdist.data.prepare import prepare, read_meta
from jaxdist.data.sources import RemoteShard, open_corpus, resolve_vocab
from jaxdist.errors import ConfigError, JaxdistError
from jaxdist.layout.mesh import parse_mesh
from jaxdist.storage.remote import Folder, redact
from jaxdist.training.run import run

from helpers import TINY, data_layout
from s3_server import free_port, s3_server_process

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[dev]')")

DOCUMENTS = [f"document {i}: " + "tokens in object storage " * (1 + i % 9) for i in range(400)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A corpus prepared on local disk in three shards."""
    folder = tmp_path_factory.mktemp("corpus")
    for i, document in enumerate(DOCUMENTS):
        (folder / f"doc_{i:04d}.txt").write_text(document)
    out = folder.parent / "prepared"
    prepare(str(folder / "*.txt"), out, progress=False, shard_tokens=9000)
    return out


def _s3fs():
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"], skip_instance_cache=True)


def _upload(local, url):
    fs = _s3fs()
    for path in sorted(local.iterdir()):
        fs.put_file(str(path), f"{url.removeprefix('s3://')}/{path.name}")
    return fs


def _batches(path, steps, mesh="data=2,fsdp=2", *overrides):
    config = load_config(None, ["train.global_batch=8", "train.seq_len=32", "data.source=tokens", f"data.path={path}", *overrides])
    resolve_vocab(config)
    iterator = make_iterator(config, data_layout(mesh))
    try:
        return [jax.device_get(next(iterator)) for _ in range(steps)]
    finally:
        iterator.close()


def test_every_batch_from_s3_equals_the_local_shards(prepared, s3_bucket, monkeypatch):
    url = f"{s3_bucket}/prepared"
    _upload(prepared, url)
    assert len(read_meta(url)["shards"]) >= 3
    monkeypatch.setattr(RemoteShard, "BLOCK_TOKENS", 97)  # windows straddle blocks and shards
    local, remote = _batches(prepared, 12), _batches(url, 12)
    for step, (a, b) in enumerate(zip(local, remote, strict=True)):
        assert a.keys() == b.keys() and a.keys() >= {"inputs", "targets"}
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"step {step + 1} {key}")


def test_remote_shards_are_read_by_grain_threads_local_ones_are_not(prepared, s3_bucket):
    from jaxdist.data.batches import example_source, read_threads

    url = f"{s3_bucket}/prepared"
    _upload(prepared, url)

    def source(path):
        config = load_config(None, ["train.seq_len=32", "data.source=tokens", f"data.path={path}"])
        resolve_vocab(config)
        return example_source(config, "train")

    assert read_threads(source(url), prefetch=2) == 2 and read_threads(source(prepared), prefetch=2) == 0


def _local_losses(prepared, steps=3):
    config = load_config(None, [*TINY, f"train.steps={steps}", "data.source=tokens", f"data.path={prepared}"])
    return run(config, parse_mesh("data=2"), None, devices=jax.devices()[:2], progress=False).losses


def test_a_run_on_s3_shards_trains_to_the_local_losses(prepared, s3_bucket):
    url = f"{s3_bucket}/prepared"
    _upload(prepared, url)
    config = load_config(None, [*TINY, "train.steps=3", "data.source=tokens", f"data.path={url}"])
    remote = run(config, parse_mesh("data=2"), None, devices=jax.devices()[:2], progress=False).losses
    assert remote == _local_losses(prepared)


@pytest.mark.heavy
def test_two_processes_on_s3_shards_train_like_one_on_local_shards(prepared, s3_bucket, tmp_path):
    """Each process reads its own rows of every batch by range requests; together they train
    as one process on the same shards on local disk does (the launcher, 2 x 1 device)."""
    import json
    import subprocess
    import sys

    from helpers import subprocess_env

    url = f"{s3_bucket}/prepared"
    _upload(prepared, url)
    run_dir = tmp_path / "run"
    overrides = [*TINY, "train.steps=3", "data.source=tokens", f"data.path={url}"]
    cmd = [
        sys.executable,
        "-m",
        "jaxdist.launch",
        "--nproc",
        "2",
        "--devices-per-proc",
        "1",
        "--",
        "--mesh",
        "data=2",
        "--run-dir",
        str(run_dir),
        *overrides,
    ]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "loss" in x and "step" in x]
    np.testing.assert_allclose(losses, _local_losses(prepared), rtol=1e-6)


def test_arrayrecord_shards_in_object_storage_are_one_line(tmp_path, s3_bucket):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("a document")
    prepare(str(tmp_path / "docs"), tmp_path / "ar", fmt="arrayrecord", progress=False)
    _upload(tmp_path / "ar", f"{s3_bucket}/ar")
    with pytest.raises(JaxdistError, match="ArrayRecord shards cannot be read from object storage; prepare it with --format bin"):
        read_meta(f"{s3_bucket}/ar")


def test_a_shard_shorter_than_its_metadata_is_refused(prepared, s3_bucket, tmp_path):
    import shutil

    short = tmp_path / "short"
    shutil.copytree(prepared, short)
    shard = sorted(short.glob("tokens-*.bin"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    _upload(short, f"{s3_bucket}/short")
    with pytest.raises(JaxdistError, match=rf"shard {shard.name} has \d+ bytes, expected \d+"):
        read_meta(f"{s3_bucket}/short")
    meta = read_meta(prepared)  # and an object cut after it was listed: the range read says so
    _upload(short, f"{s3_bucket}/cut")
    tokens = meta["shards"][1]["tokens"]
    remote = RemoteShard(f"{s3_bucket}/cut", shard.name, meta["dtype"], tokens)
    with pytest.raises(JaxdistError, match="is shorter than its metadata says"):
        remote.read(tokens - 3, tokens)


def test_a_missing_bucket_or_folder_is_one_line(s3_bucket):
    with pytest.raises(JaxdistError, match=r"s3://jaxdist-no-such-bucket/x: no such bucket"):
        read_meta("s3://jaxdist-no-such-bucket/x")
    with pytest.raises(JaxdistError, match=rf"{s3_bucket}/nothing is not a prepared data directory"):
        read_meta(f"{s3_bucket}/nothing")


def test_an_unreachable_endpoint_is_one_line_in_bounded_time(s3_endpoint, monkeypatch):
    port = free_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    start = time.monotonic()
    with pytest.raises(JaxdistError, match=rf"cannot reach http://127.0.0.1:{port} after \d+ attempts") as error:
        Folder("s3://bucket/prepared").sizes()
    assert time.monotonic() - start < 30 and "\n" not in str(error.value)


def test_no_credential_reaches_a_message(s3_bucket):
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    key = os.environ["AWS_ACCESS_KEY_ID"]
    assert redact(f"s3://{key}:{secret}@bucket/x") == "s3://bucket/x"
    assert secret not in redact(f"failed with {secret} in it")
    with pytest.raises(JaxdistError, match="data.path names credentials in its URL") as error:  # config.yaml would keep them
        open_corpus(load_config(None, ["data.source=tokens", f"data.path=s3://{key}:{secret}@jaxdist-no-such-bucket/x"]))
    assert secret not in str(error.value) and key not in str(error.value)
    from jaxdist.training.checkpoint_tiers import run_tiers

    with pytest.raises(JaxdistError, match="--run-dir names credentials in its URL") as error:
        run_tiers(f"s3://{key}:{secret}@bucket/run", "/tmp/local")
    assert secret not in str(error.value) and key not in str(error.value)


def test_prepare_reads_parquet_and_jsonl_gz_from_s3_and_writes_shards_there(tmp_path, s3_bucket, monkeypatch):
    """prepare --input s3://.../* --output s3://...: the shards equal a local prepare of the
    same files; each shard leaves local disk once uploaded and meta.json is uploaded last."""
    import gzip
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from jaxdist.data import remote_output

    local = tmp_path / "in"
    local.mkdir()
    pq.write_table(pa.table({"text": DOCUMENTS[:200]}), local / "a.parquet", row_group_size=50)
    (local / "b.jsonl.gz").write_bytes(gzip.compress(b"".join(json.dumps({"text": d}).encode() + b"\n" for d in DOCUMENTS[200:])))
    _upload(local, f"{s3_bucket}/raw")
    uploads = []
    shard_closed, commit = remote_output.RemoteOutput.shard_closed, remote_output.RemoteOutput.commit

    def watched_shard(self, local_dir, name):
        shard_closed(self, local_dir, name)
        uploads.append((name, sorted(p.name for p in local_dir.glob("tokens-*.bin"))))

    def watched_commit(self, local_dir):
        assert "meta.json" not in self.folder.sizes()  # nothing reads the folder before its meta
        commit(self, local_dir)
        uploads.append(("meta.json", []))

    monkeypatch.setattr(remote_output.RemoteOutput, "shard_closed", watched_shard)
    monkeypatch.setattr(remote_output.RemoteOutput, "commit", watched_commit)
    meta = prepare(f"{s3_bucket}/raw/*", f"{s3_bucket}/prepared", progress=False, shard_tokens=9000)
    expected = prepare(str(local / "*"), tmp_path / "local", progress=False, shard_tokens=9000)
    assert meta["shards"] == expected["shards"] and meta["documents"] == len(DOCUMENTS)
    assert [name for name, _ in uploads] == [s["path"] for s in meta["shards"]] + ["meta.json"]
    assert all(not left for _, left in uploads)  # no shard stays on local disk after its upload
    fs = _s3fs()
    for shard in meta["shards"]:
        assert (
            fs.cat_file(f"{s3_bucket.removeprefix('s3://')}/prepared/{shard['path']}") == (tmp_path / "local" / shard["path"]).read_bytes()
        )
    with pytest.raises(JaxdistError, match="is not empty"):
        prepare(f"{s3_bucket}/raw/*", f"{s3_bucket}/prepared", progress=False)


def test_a_prepare_killed_mid_upload_is_invisible_and_replaced_by_the_next(tmp_path, s3_bucket, monkeypatch):
    from jaxdist.data import remote_output

    (tmp_path / "in").mkdir()
    for i, document in enumerate(DOCUMENTS):
        (tmp_path / "in" / f"doc_{i:04d}.txt").write_text(document)
    shard_closed = remote_output.RemoteOutput.shard_closed
    calls = iter(range(100))

    def dies_on_the_second(self, local_dir, name):
        if next(calls) == 1:
            raise KeyboardInterrupt  # as a kill would stop it: between two uploads
        shard_closed(self, local_dir, name)

    monkeypatch.setattr(remote_output.RemoteOutput, "shard_closed", dies_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(tmp_path / "in"), f"{s3_bucket}/prepared", progress=False, shard_tokens=9000)
    assert Folder(f"{s3_bucket}/prepared").sizes().keys() == {"tokens-00000.bin"}
    with pytest.raises(JaxdistError, match="not a prepared data directory"):
        read_meta(f"{s3_bucket}/prepared")
    monkeypatch.undo()
    meta = prepare(str(tmp_path / "in"), f"{s3_bucket}/prepared", progress=False, shard_tokens=9000)
    assert read_meta(f"{s3_bucket}/prepared") == meta


def test_the_text_source_reads_a_glob_of_records_in_s3_like_the_local_files(tmp_path, s3_bucket):
    import pyarrow as pa
    import pyarrow.parquet as pq

    local = tmp_path / "in"
    local.mkdir()
    pq.write_table(pa.table({"body": DOCUMENTS[:150]}), local / "a.parquet", row_group_size=40)
    pq.write_table(pa.table({"body": DOCUMENTS[150:]}), local / "b.parquet", row_group_size=40)
    _upload(local, f"{s3_bucket}/raw")

    def stream(path):
        corpus = open_corpus(load_config(None, ["data.source=text", f"data.path={path}", "data.text_field=body"]))
        return corpus.stream.read(0, corpus.stream.n_tokens)

    np.testing.assert_array_equal(stream(f"{s3_bucket}/raw/*.parquet"), stream(local / "*.parquet"))
    with pytest.raises(JaxdistError, match=rf"no input files match '{s3_bucket}/raw/\*.jsonl'"):
        stream(f"{s3_bucket}/raw/*.jsonl")


def test_a_server_that_stops_mid_run_ends_the_run_in_one_line_not_a_hang(prepared, tmp_path, monkeypatch):
    """moto's server in its own process, killed once step 2's metrics are fetched; the blocks
    are small and few are cached, so the next batches need requests: they are retried, then the
    run ends with one line naming the object, in bounded time."""
    from jaxdist.training.step import Trainer

    with s3_server_process("stopping") as (server, endpoint):
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "stopping-server-key")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "stopping-server-secret")
        _upload(prepared, "s3://stopping/prepared")
        monkeypatch.setattr(RemoteShard, "BLOCK_TOKENS", 64)
        monkeypatch.setattr(RemoteShard, "CACHE_BLOCKS", 2)
        fetch, fetched = Trainer.fetch_metrics, []

        def fetch_then_stop(self, pending):
            out = fetch(self, pending)
            fetched.extend(out)
            if len(fetched) >= 2 and server.poll() is None:
                server.kill()
                server.wait()
            return out

        monkeypatch.setattr(Trainer, "fetch_metrics", fetch_then_stop)
        config = load_config(
            None, [*TINY, "train.steps=200", "train.log_every=1", "data.source=tokens", "data.path=s3://stopping/prepared"]
        )
        start = time.monotonic()
        with pytest.raises(
            JaxdistError, match=r"s3://stopping/prepared/tokens-\d+\.bin: cannot reach http://127.0.0.1:\d+ after 3 attempts"
        ) as error:
            run(config, parse_mesh("data=2"), tmp_path / "run", devices=jax.devices()[:2], progress=False)
        assert time.monotonic() - start < 120 and "\n" not in str(error.value) and 2 <= len(fetched) < 200


def test_the_disk_cache_serves_a_second_run_without_requests_and_stays_under_its_limit(prepared, s3_bucket, tmp_path, monkeypatch):
    """data.cache_dir: a second reader (another run, another process) gets every block from
    local disk and the batches are the local shards'; a small data.cache_gb keeps the folder
    under it, least recently used blocks removed first."""
    url = f"{s3_bucket}/prepared"
    _upload(prepared, url)
    monkeypatch.setattr(RemoteShard, "BLOCK_TOKENS", 256)
    cache = tmp_path / "cache"
    first = _batches(url, 16, "data=2", "data.cache_dir=" + str(cache))[:6]  # past what the second reads ahead
    assert list(cache.glob("*.blk"))

    read_bytes = Folder.read_bytes

    def no_requests(self, name, *args, **kwargs):
        assert not name.endswith(".bin"), "a request for a block on disk"
        return read_bytes(self, name, *args, **kwargs)  # meta.json is read each time

    monkeypatch.setattr(Folder, "read_bytes", no_requests)
    second = _batches(url, 6, "data=2", "data.cache_dir=" + str(cache))
    local = _batches(prepared, 6, "data=2")
    for a, b, c in zip(first, second, local, strict=True):
        for key in c:
            np.testing.assert_array_equal(a[key], c[key])
            np.testing.assert_array_equal(b[key], c[key])
    monkeypatch.undo()
    monkeypatch.setattr(RemoteShard, "BLOCK_TOKENS", 256)
    small = tmp_path / "small"
    limit = 20 * 256 * 2  # 20 blocks of uint16 tokens
    _batches(url, 20, "data=2", f"data.cache_dir={small}", f"data.cache_gb={limit / 1e9}")
    used = sum(_size_if_kept(p) for p in small.glob("*.blk"))
    assert 0 < used <= limit
    with pytest.raises(ConfigError, match=r"data.cache_gb=5e-07 is less than one cached block .* \(0.000001 GB\)") as error:
        _batches(url, 1, "data=2", f"data.cache_dir={tmp_path / 'tiny'}", "data.cache_gb=5e-7")  # a block is 512 bytes here
    assert "\n" not in str(error.value) and not (tmp_path / "tiny").exists()


def test_wrong_credentials_are_one_line_that_shows_none_of_them(prepared, tmp_path, monkeypatch):
    """A server that checks signatures (moto's, with authentication on) refuses every key: the
    shards, a tiered run directory and a checkpoint URL are each one line saying so, with no
    key or secret in it."""
    from jaxdist.data.prepared import read_meta
    from jaxdist.training.checkpoint_tiers import fetch_checkpoint, prepare_local_tier

    with s3_server_process("locked", check_credentials=True) as (_, endpoint):
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong-key-id-7f3e")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-9c1d")
        attempts = [
            lambda: read_meta("s3://locked/prepared"),
            lambda: prepare_local_tier(tmp_path / "local", "s3://locked/run", "auto"),
            lambda: fetch_checkpoint("s3://locked/run/checkpoints/2"),
        ]
        for attempt in attempts:
            with pytest.raises(JaxdistError, match=r"s3://locked/\S*: access denied: check the credentials") as error:
                attempt()
            message = str(error.value)
            assert "\n" not in message and "wrong-key-id" not in message and "wrong-secret" not in message


def _size_if_kept(path) -> int:
    """A cached block's size; 0 for one evicted between the folder's listing and the stat (the
    read-ahead's last blocks may still be evicting others)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
