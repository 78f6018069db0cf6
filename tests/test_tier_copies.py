"""The two checkpoint tiers when things go wrong, against real S3 servers on loopback
(tests/s3_server.py), without training: the copier through a store outage (each copy fails
in one line, a step the local tier deleted is skipped, the run's last copy failing is an
error, all in bounded time; the next copy after the outage lands), a local tier that belongs
to another run, a missing bucket, and a local_dir that resolves to the run directory."""

from __future__ import annotations

import threading

import pytest

from jaxdist.errors import JaxdistError
from jaxdist.training.checkpoint import CheckpointError
from jaxdist.training.checkpoint_tiers import CHECKPOINTS, WORK, DurableTier, Replicator, prepare_local_tier, run_tiers

from s3_server import free_port, s3_server_process

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[dev]')")


def _save(local, step: int) -> None:
    """A committed local step as the copier sees one: its folder, files inside."""
    folder = local / CHECKPOINTS / str(step) / "state"
    folder.mkdir(parents=True)
    (folder / "array").write_bytes(bytes([step]) * 1000)


def _wait_bounded(replicator: Replicator, seconds: float) -> BaseException | None:
    """``replicator.wait()`` on a thread: what it raised, or a failure if it is still waiting."""
    raised: list[BaseException | None] = []

    def wait():
        try:
            replicator.wait()
            raised.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            raised.append(e)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the copier's wait still blocks after {seconds:.0f}s (a copy waits for a step that will never come)"
    return raised[0]


def test_copies_through_an_outage_fail_in_one_line_each_and_never_hang(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "outage-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "outage-secret")
    local, port, url = tmp_path / "local", free_port(), "s3://outage/run"
    with s3_server_process("outage", port=port) as (server, endpoint):
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        _save(local, 5)
        replicator = Replicator(local, url, every_steps=0, keep=2)
        replicator.submit(5)
        assert _wait_bounded(replicator, 60) is None
        assert DurableTier(url).steps() == ([5], [])
        server.kill()
        server.wait()
        capsys.readouterr()
        _save(local, 15)  # step 10 was saved, then deleted by checkpoint.keep before its copy began
        replicator.submit(10)
        assert _wait_bounded(replicator, 120) is None  # skipped: not a failure, and no wait for a folder that never comes
        replicator.submit(15, last=True)
        error = _wait_bounded(replicator, 120)
        assert isinstance(error, CheckpointError), error
        assert f"copying checkpoint step 15 to {url} failed: " in str(error) and "the local tier" in str(error)
        warnings = [x.removeprefix("jaxdist: warning: ") for x in capsys.readouterr().err.splitlines() if x.startswith("jaxdist: warning")]
        assert len(warnings) == 2, warnings
        assert warnings[0].startswith(f"checkpoint step 10 was removed from the local tier before it was copied to {url}")
        assert warnings[1].startswith(f"copying checkpoint step 15 to {url} failed: ") and "\n" not in warnings[1]
    with s3_server_process("outage", port=port):  # the store is back (empty): the next copy lands
        _save(local, 20)
        replicator.submit(20, last=True)
        assert _wait_bounded(replicator, 60) is None
        assert DurableTier(url).steps() == ([20], [])
        replicator.close()


def test_copies_queued_behind_a_slow_one_coalesce_to_the_newest(s3_bucket, tmp_path, monkeypatch, capsys):
    """While one copy runs, three more steps are saved: only the newest of them is copied next."""
    local, url = tmp_path / "local", f"{s3_bucket}/behind"
    gate, started = threading.Event(), threading.Event()
    upload = DurableTier.upload_step

    def slow_upload(self, source, step):
        started.set()
        gate.wait(60)
        return upload(self, source, step)

    monkeypatch.setattr(DurableTier, "upload_step", slow_upload)
    _save(local, 2)
    replicator = Replicator(local, url, every_steps=0, keep=5)
    replicator.submit(2)
    assert started.wait(60)
    for step in (4, 6, 8):
        _save(local, step)
        replicator.submit(step)
    gate.set()
    assert _wait_bounded(replicator, 60) is None
    replicator.close()
    assert DurableTier(url).steps() == ([2, 8], [])
    assert f"jaxdist: checkpoint steps 4, 6 not copied to {url}: step 8 is newer\n" in capsys.readouterr().err


def test_a_local_tier_of_another_run_is_refused_not_continued(s3_bucket, tmp_path):
    local = tmp_path / "local"
    prepare_local_tier(local, f"{s3_bucket}/r1", "auto")
    _save(local, 8)  # r1's step 8
    (local / "config.yaml").write_text("train:\n  lr: 0.003\n")
    prepare_local_tier(local, f"{s3_bucket}/r1", "auto")  # r1 itself continues
    with pytest.raises(JaxdistError, match=rf"checkpoint.local_dir {local} is the local tier of another run \({s3_bucket}/r1\)") as error:
        prepare_local_tier(local, f"{s3_bucket}/r3", "auto")
    assert "\n" not in str(error.value) and DurableTier(f"{s3_bucket}/r3").files("") == {}
    # a folder with a run's files and no owner mark (another tool, an older jaxdist) is not adopted by a new run
    (local / WORK / "durable").unlink()
    with pytest.raises(JaxdistError, match="holds another run's files"):
        prepare_local_tier(local, f"{s3_bucket}/r4", "auto")


def test_a_missing_bucket_writes_nothing_locally(s3_endpoint, tmp_path):
    with pytest.raises(JaxdistError, match="nobucket") as error:
        prepare_local_tier(tmp_path / "nb", "s3://nobucket-jaxdist/r", "auto")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "nb").exists()


def test_a_local_dir_that_resolves_to_the_run_directory_is_refused(tmp_path):
    (tmp_path / "runs" / "lt2").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "runs" / "lt2")
    for local_dir in (tmp_path / "runs" / ".." / "runs" / "lt2", tmp_path / "link"):
        with pytest.raises(JaxdistError, match="checkpoint.local_dir is the run directory"):
            run_tiers(str(tmp_path / "runs" / "lt2"), str(local_dir))


def test_only_top_level_files_are_copied_with_a_checkpoint(s3_bucket, tmp_path):
    """As the README says: tensorboard/, profile/ and W&B's offline wandb/ stay in the local tier."""
    local = tmp_path / "local"
    for name in ("config.yaml", "metrics.jsonl", "wandb/offline-run-1/run.wandb", "tensorboard/events", "profile/trace"):
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_text(name)
    tier = DurableTier(f"{s3_bucket}/top")
    tier.put_top_files(local)
    assert sorted(tier.files("")) == ["config.yaml", "metrics.jsonl"]
