"""Checkpoints in two tiers against a real S3 server on loopback (tests/s3_server.py): a run whose
``--run-dir`` is ``s3://`` saves to ``checkpoint.local_dir`` and copies finished steps behind
it, commit marker last. A new node with an empty local tier resumes from the durable copy,
onto another mesh, with the uninterrupted run's losses; a copy cut by SIGKILL is never
restored, and the next run finishes it from the local tier or discards it; ``--init-from`` and
``to-hf`` read a checkpoint in ``s3://``; bad input is one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxdist.config import load_config
from jaxdist.errors import JaxdistError
from jaxdist.layout.mesh import parse_mesh
from jaxdist.layout.validate import unused_keys
from jaxdist.training.checkpoint_tiers import COMMIT, DurableTier, run_tiers
from jaxdist.training.run import run

from helpers import TINY, subprocess_env

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[dev]')")

STEPS = ("train.steps=8", "checkpoint.every_steps=2")


def _run(run_dir, local, mesh="data=2", *overrides, resume="auto"):
    config = load_config(None, [*TINY, *STEPS, f"checkpoint.local_dir={local}", *overrides])
    sizes = parse_mesh(mesh)
    return run(config, sizes, run_dir, devices=jax.devices()[: int(np.prod(list(sizes.values())))], progress=False, resume=resume)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The 8 steps' losses of one run on local disk, never stopped."""
    config = load_config(None, [*TINY, *STEPS])
    return run(config, parse_mesh("data=2"), tmp_path_factory.mktemp("whole") / "run", devices=jax.devices()[:2], progress=False).losses


def _metrics_losses(lines: str) -> dict[int, float]:
    return {x["step"]: x["loss"] for x in map(json.loads, lines.splitlines()) if "loss" in x and "step" in x}


def test_a_new_node_resumes_from_s3_onto_another_mesh_with_the_uninterrupted_losses(s3_bucket, tmp_path, uninterrupted):
    url = f"{s3_bucket}/run"
    first = _run(url, tmp_path / "node-a", "data=2", "train.stop_after_step=4").losses
    tier = DurableTier(url)
    assert tier.steps() == ([2, 4], [])  # every copy complete, none in part
    assert COMMIT in tier.files("checkpoints/4") and "metrics.jsonl" in tier.files("")
    # node A's disk is gone: node B starts with an empty local tier, on another mesh
    second = _run(url, tmp_path / "node-b", "data=2,fsdp=2").losses
    assert (tmp_path / "node-b" / "checkpoints" / "4").is_dir()  # fetched, then resumed
    np.testing.assert_allclose(first + second, uninterrupted, rtol=1e-5)
    assert tier.steps()[0] == [4, 6, 8]  # checkpoint.keep=3 in the durable tier too
    # the mirrored metrics.jsonl holds both nodes' lines
    metrics = _metrics_losses(tier.fs.cat_file(f"{tier.root}/metrics.jsonl").decode())
    assert sorted(metrics) == list(range(1, 9))


def test_remote_every_steps_copies_fewer_and_always_the_last(s3_bucket, tmp_path):
    url = f"{s3_bucket}/sparse"
    _run(url, tmp_path / "local", "data=2", "checkpoint.remote_every_steps=4", "train.steps=6", "checkpoint.keep=5")
    assert DurableTier(url).steps() == ([2, 6], [])  # 2 is the first; 4 is 2 after it; 6 is the last
    assert [int(p.name) for p in sorted((tmp_path / "local" / "checkpoints").iterdir())] == [2, 4, 6]


def test_init_from_and_to_hf_read_a_checkpoint_in_s3(s3_bucket, tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    from jaxdist import convert

    monkeypatch.setenv("JAXDIST_CACHE", str(tmp_path / "cache"))
    url = f"{s3_bucket}/source"
    _run(url, tmp_path / "local", "data=2", "train.steps=2")
    assert convert.main(["to-hf", f"{url}/checkpoints/2", str(tmp_path / "from-s3")]) == 0
    assert convert.main(["to-hf", str(tmp_path / "local" / "checkpoints" / "2"), str(tmp_path / "from-local")]) == 0
    name = "model-00001-of-00001.safetensors"
    remote, local = load_file(tmp_path / "from-s3" / name), load_file(tmp_path / "from-local" / name)
    assert remote.keys() == local.keys() and all(np.array_equal(remote[k], local[k]) for k in local)
    # --init-from a run directory in s3://: its newest complete step starts a new run as the local copy does
    config = load_config(None, [*TINY, "train.steps=1"])

    def first_loss(**kwargs):
        return run(config, parse_mesh("data=2"), None, devices=jax.devices()[:2], progress=False, **kwargs).losses[0]

    from_s3 = first_loss(init_from=url)
    assert from_s3 == first_loss(init_from=str(tmp_path / "local")) and from_s3 != first_loss()


def _copying(fs, root: str) -> int | None:
    """A step that has objects in the durable tier but no commit marker yet (a copy in flight)."""
    by_step: dict[str, set[str]] = {}
    for key in fs.find(f"{root}/checkpoints", refresh=True):
        step, _, rest = key[len(root) + len("/checkpoints/") :].partition("/")
        by_step.setdefault(step, set()).add(rest)
    partial = [int(s) for s, names in by_step.items() if s.isdigit() and COMMIT not in names]
    return max(partial) if partial else None


def _corpus_in_s3(tmp_path, bucket, fs) -> tuple[str, str]:
    """A Parquet and a JSON Lines (gzip) corpus in s3://, prepared into s3://; the same files
    prepared on local disk: (the s3 shards' URL, the local shards' folder)."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from jaxdist.data.prepare import prepare

    documents = [f"record {i}: " + "checkpoints in tiers " * (1 + i % 7) for i in range(300)]
    raw = tmp_path / "raw"
    raw.mkdir()
    pq.write_table(pa.table({"text": documents[:150]}), raw / "a.parquet", row_group_size=40)
    (raw / "b.jsonl.gz").write_bytes(gzip.compress(b"".join(json.dumps({"text": d}).encode() + b"\n" for d in documents[150:])))
    for path in raw.iterdir():
        fs.put_file(str(path), f"{bucket.removeprefix('s3://')}/raw/{path.name}")
    prepare(f"{bucket}/raw/*", f"{bucket}/prepared", progress=False, shard_tokens=4000)
    prepare(str(raw / "*"), tmp_path / "prepared", progress=False, shard_tokens=4000)
    return f"{bucket}/prepared", str(tmp_path / "prepared")


@pytest.mark.heavy
def test_a_copy_cut_by_sigkill_is_never_restored_and_the_next_run_finishes_or_discards_it(s3_bucket, tmp_path):
    """On a Parquet + JSON Lines corpus prepared from s3:// into s3://, the training process is
    SIGKILLed while a step's objects are going up. The durable tier's previous step stays
    complete and the step in flight has no marker. On the same node (its local tier has the
    step) the next run finishes the copy; on a new node it discards the part and resumes from
    the previous complete step, to the losses of the same run on local files (1e-6)."""
    import s3fs

    from jaxdist.training.checkpoint_tiers import prepare_local_tier

    url = f"{s3_bucket}/killed"
    fs = s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"], skip_instance_cache=True)
    root = url.removeprefix("s3://")
    remote_data, local_data = _corpus_in_s3(tmp_path, s3_bucket, fs)
    data = ["data.source=tokens"]
    overrides = [*TINY, *data, f"data.path={remote_data}", "train.steps=400", "checkpoint.every_steps=2", "checkpoint.keep=100"]
    cmd = [
        sys.executable,
        "-m",
        "jaxdist.train",
        "--mesh",
        "data=2",
        "--run-dir",
        url,
        *overrides,
        f"checkpoint.local_dir={tmp_path / 'a'}",
    ]
    proc = subprocess.Popen(cmd, env=subprocess_env(2), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cut = None
    try:
        deadline = time.monotonic() + 240
        while cut is None and proc.poll() is None and time.monotonic() < deadline:
            cut = _copying(fs, root)
            cut = cut if cut is not None and cut >= 4 else None  # one complete copy before it
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        stderr = proc.communicate(timeout=60)[1]
    assert cut is not None, f"no copy was caught in flight: {stderr[-1500:]}"
    complete, partial = DurableTier(url).steps()
    # the previous copy is intact (cut - 2, or older: saves queued behind a slow copy go up newest first)
    assert partial == [cut] and complete and complete[-1] < cut, (complete, partial)
    fs.invalidate_cache()
    for key in fs.find(root):  # the same cut state, for the new node below
        fs.copy(key, f"{root}-copy{key[len(root) :]}")

    prepare_local_tier(tmp_path / "a", url, "auto")  # the same node: finished from its local tier
    assert DurableTier(url).steps() == ([*complete, cut], [])
    fs.invalidate_cache()  # the listings above are stale
    marker = json.loads(fs.cat_file(f"{root}/checkpoints/{cut}/{COMMIT}"))
    local_step = tmp_path / "a" / "checkpoints" / str(cut)
    assert marker["files"] == {p.relative_to(local_step).as_posix(): p.stat().st_size for p in local_step.rglob("*") if p.is_file()}

    resumed = load_config(None, [*overrides, f"train.stop_after_step={cut + 2}", f"checkpoint.local_dir={tmp_path / 'b'}"])
    later = run(resumed, parse_mesh("data=2"), f"{url}-copy", devices=jax.devices()[:2], progress=False).losses
    assert DurableTier(f"{url}-copy").steps()[1] == []  # the part was discarded (and step cut saved anew)
    whole = load_config(None, [*TINY, *data, f"data.path={local_data}", f"train.steps={cut + 2}", "train.schedule_steps=400"])
    reference = run(whole, parse_mesh("data=2"), tmp_path / "local-run", devices=jax.devices()[:2], progress=False).losses
    np.testing.assert_allclose(later, reference[complete[-1] :], rtol=1e-6)


def test_bad_tier_settings_are_one_line(tmp_path):
    with pytest.raises(JaxdistError, match=r"--run-dir s3://bucket/run is in object storage: set checkpoint.local_dir") as error:
        run_tiers("s3://bucket/run", "")
    assert "\n" not in str(error.value)
    with pytest.raises(JaxdistError, match=r"checkpoint.local_dir=s3://bucket/fast: must be a local folder"):
        run_tiers("s3://bucket/run", "s3://bucket/fast")
    with pytest.raises(JaxdistError, match=r"checkpoint.local_dir is the run directory"):
        run_tiers(str(tmp_path / "run"), str(tmp_path / "run"))
    assert run_tiers(str(tmp_path / "run"), "") == (tmp_path / "run", None)
    config = load_config(None, ["checkpoint.remote_every_steps=10"])
    assert any("checkpoint.remote_every_steps=10 has no effect with checkpoint.local_dir unset" in line for line in unused_keys(config, {}))


def test_the_cli_refuses_an_s3_run_dir_without_a_local_tier_before_starting(tmp_path):
    cmd = [sys.executable, "-m", "jaxdist.train", "--config", "tiny", "--run-dir", "s3://bucket/run", "--steps", "1"]
    proc = subprocess.run(cmd, env=subprocess_env(1), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "set checkpoint.local_dir" in lines[0], proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.heavy
def test_two_processes_save_to_one_local_tier_and_copy_to_s3(s3_bucket, tmp_path, uninterrupted):
    """The launcher's 2 processes x 1 device share the local tier; process 0 copies; the durable
    tier's newest step resumes in one process to the uninterrupted losses."""
    url = f"{s3_bucket}/two"
    overrides = [*TINY, *STEPS, "train.stop_after_step=4", f"checkpoint.local_dir={tmp_path / 'shared'}"]
    cmd = [sys.executable, "-m", "jaxdist.launch", "--nproc", "2", "--devices-per-proc", "1", "--", "--mesh", "data=2"]
    proc = subprocess.run([*cmd, "--run-dir", url, *overrides], env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert DurableTier(url).steps() == ([2, 4], [])
    later = _run(url, tmp_path / "one", "data=2").losses
    np.testing.assert_allclose(later, uninterrupted[4:], rtol=1e-5)


def test_a_hostile_commit_marker_cannot_write_outside_the_local_tier(s3_bucket, tmp_path):
    """A marker naming '../' paths (or an absolute one) is refused in one line; nothing is written outside."""
    tier = DurableTier(f"{s3_bucket}/hostile")
    for name in ("../../escaped", "/tmp/escaped-absolute"):
        marker = json.dumps({"step": 2, "files": {name: 1}}).encode()
        tier.fs.pipe_file(f"{tier.root}/checkpoints/2/{COMMIT}", marker)
        tier.fs.pipe_file(f"{tier.root}/checkpoints/2/x", b"x")
        with pytest.raises(JaxdistError, match="leads out of the folder"):
            tier.download_step(2, tmp_path / "local" / "checkpoints" / "2")
    assert not (tmp_path / "escaped").exists() and not os.path.exists("/tmp/escaped-absolute")
