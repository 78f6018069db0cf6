"""Weights & Biases (``log.wandb=true``) in wandb's offline mode: no network, no credentials.

What wandb itself wrote (each offline run folder's ``.wandb`` transaction log, read here
with wandb's own protobuf records) is held against what jaxdist wrote: every metrics.jsonl
line at its step, eval lines included; the resolved config.yaml as the run's config; one
W&B run id across a stop (``train.stop_after_step``) and the run that continues it; a
credential in the environment written nowhere. Then the one-line errors (no wandb package,
a W&B that does not start) and the gate that keeps processes other than 0 out.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
from pathlib import Path

import jax
import pytest
import yaml

from jaxdist.config import load_config
from jaxdist.errors import EXIT_PREEMPTED, JaxdistError
from jaxdist.layout.mesh import parse_mesh
from jaxdist.train import main
from jaxdist.training.preemption import Preempted
from jaxdist.training.run import run
from jaxdist.training.wandb_log import RUN_ID_FILE, WandbMirror, open_wandb_run

from helpers import TINY

pytest.importorskip("wandb", reason="the wandb extra is not installed: pip install -e '.[wandb]'")

CONFIG = (*TINY, "data.source=synthetic", "train.steps=6", "train.eval_every=2", "log.wandb=true", "log.wandb_project=jaxdist-tests")
FAKE_API_KEY = "jaxdist-test-key-" + "7" * 24  # in the environment of the runs: no file may hold it


@contextlib.contextmanager
def wandb_environment(tmp: Path, **variables: str):
    """wandb's environment for a test: none of the caller's WANDB_* variables, no netrc, a
    server address where nothing listens; offline unless ``variables`` say otherwise.
    wandb reads its settings once per process, so it is reset on the way in and out."""
    with pytest.MonkeyPatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("WANDB_")]:
            patch.delenv(name)
        defaults = {
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "WANDB_CONFIG_DIR": str(tmp / "wandb-config"),
            "WANDB_BASE_URL": "http://127.0.0.1:9",
            "NETRC": str(tmp / "no-netrc"),
        }
        for name, value in {**defaults, **variables}.items():
            patch.setenv(name, value)
        _reset_wandb()
        try:
            yield
        finally:
            _reset_wandb()


def _reset_wandb() -> None:
    if sys.modules.get("wandb") is not None:
        sys.modules["wandb"].teardown()


def _train(run_dir: Path, *overrides: str):
    config = load_config(None, (*CONFIG, *overrides))
    return run(config, parse_mesh("data=1"), run_dir, devices=jax.devices()[:1], progress=False)


@pytest.fixture(scope="module")
def stopped_and_continued(tmp_path_factory):
    """Six steps (eval every 2) in two processes' worth of runs: stopped after step 3, then
    continued in the same run directory; (run dir, config.yaml after the first run)."""
    tmp = tmp_path_factory.mktemp("wandb")
    run_dir = tmp / "run"
    with wandb_environment(tmp, WANDB_API_KEY=FAKE_API_KEY):
        _train(run_dir, "train.stop_after_step=3")
        first_config = yaml.safe_load((run_dir / "config.yaml").read_text())
        _train(run_dir)
    return run_dir, first_config


# -- reading what wandb wrote ----------------------------------------------------------------


def wandb_records(path: Path):
    """The records of a .wandb transaction log: a 7-byte header (":W&B", magic, version), then
    LevelDB-log framing (32 KiB blocks of chunks: crc32, length, type) around protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += block - pos % block
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _items(updates) -> dict:
    """A history row's or a config's items as a nested dict (wandb splits nested keys)."""
    out: dict = {}
    for item in updates:
        *parents, leaf = list(item.nested_key) or [item.key]
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = json.loads(item.value_json)
    return out


def offline_runs(run_dir: Path) -> list[dict]:
    """Each offline run folder wandb made for this run directory, oldest first: its run
    record, its history rows by step (wandb's own keys left out) and its config."""
    found = []
    for folder in run_dir.glob("wandb/offline-run-*"):
        (log_file,) = folder.glob("*.wandb")
        runs, rows, config = [], {}, {}
        for record in wandb_records(log_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                runs.append(record.run)
            elif kind == "history":
                row = {k: v for k, v in _items(record.history.item).items() if not k.startswith("_")}
                rows[record.history.step.num] = row
            elif kind == "config":
                config.update({k: v for k, v in _items(record.config.update).items() if k != "_wandb"})
        (run_record,) = runs
        found.append({"run": run_record, "rows": rows, "config": config, "folder": folder})
    return sorted(found, key=lambda r: r["run"].start_time.ToNanoseconds())


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl's lines, those of one step (training, eval) merged as W&B merges them; the
    goodput timeline (spans, each line's place in time) is not charted, in W&B or TensorBoard."""
    from jaxdist.training.metrics import TIMELINE_KEYS

    merged: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "goodput_span" not in record:
            merged.setdefault(record.pop("step"), {}).update({k: v for k, v in record.items() if k not in TIMELINE_KEYS})
    return merged


# -- the offline run against the run directory ------------------------------------------------


def test_every_metrics_line_is_in_wandb_at_its_step(stopped_and_continued):
    run_dir, _ = stopped_and_continued
    expected = metrics_by_step(run_dir)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6] and all("eval_loss" in expected[s] for s in (2, 4, 6))
    first, second = offline_runs(run_dir)
    assert sorted(first["rows"]) == [1, 2, 3] and sorted(second["rows"]) == [4, 5, 6]
    assert {**first["rows"], **second["rows"]} == expected  # same keys, same values (null included), same steps


def test_the_resolved_config_is_the_runs_config(stopped_and_continued):
    run_dir, first_config = stopped_and_continued
    first, second = offline_runs(run_dir)
    assert first["config"] == first_config
    assert second["config"] == yaml.safe_load((run_dir / "config.yaml").read_text())
    assert first_config["train"]["stop_after_step"] == 3 and second["config"]["train"]["stop_after_step"] == 0


def test_the_continued_run_is_the_same_wandb_run(stopped_and_continued):
    run_dir, _ = stopped_and_continued
    run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    runs = [r["run"] for r in offline_runs(run_dir)]
    assert [r.run_id for r in runs] == [run_id, run_id]
    assert [r.project for r in runs] == ["jaxdist-tests"] * 2
    assert [r.display_name for r in runs] == ["run"] * 2  # log.wandb_name "": the run directory's name


def test_no_credential_is_written(stopped_and_continued):
    run_dir, _ = stopped_and_continued
    files = [p for p in run_dir.parent.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.suffix == ".wandb" for p in files) and (run_dir / "config.yaml") in files
    holding = [str(p) for p in files if FAKE_API_KEY.encode() in p.read_bytes()]
    assert holding == []


# -- errors and the process gate ----------------------------------------------------------------


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("jaxdist: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "compiled" not in err, err  # said before the step compiles
    return lines[0]


def test_without_the_wandb_package_one_line_before_anything_is_built(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec and import fail
    run_dir = tmp_path / "run"
    assert main(["--run-dir", str(run_dir), "--mesh", "data=1", *CONFIG]) == 2
    assert "pip install 'jaxdist[wandb]'" in _one_error_line(capsys)
    assert not run_dir.exists()


def test_wandb_that_does_not_start_is_one_line(tmp_path, capsys):
    """Online with no credential (none in the environment, no netrc): wandb refuses at once;
    the run stops in one line, exit 2, before compiling (a run that asked for W&B and would
    log nothing there is worth stopping while it is cheap)."""
    with wandb_environment(tmp_path, WANDB_MODE="online"):
        assert main(["--run-dir", str(tmp_path / "run"), "--mesh", "data=1", *CONFIG]) == 2
    line = _one_error_line(capsys)
    assert "Weights & Biases did not start" in line and "WANDB_API_KEY" in line and "WANDB_MODE=offline" in line, line


@pytest.mark.parametrize(
    ("overrides", "process_index", "has_run_dir"),
    [(["log.wandb=true"], 1, True), (["log.wandb=false"], 0, True), (["log.wandb=true"], 0, False)],
    ids=["process 1", "log.wandb=false", "no run directory"],
)
def test_no_wandb_run_is_opened(overrides, process_index, has_run_dir, tmp_path, monkeypatch):
    """Only process 0 of a run with a run directory and log.wandb=true opens a W&B run; the
    others neither import wandb (an import here would fail) nor write anything."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = load_config(None, overrides)
    assert open_wandb_run(config, run_dir if has_run_dir else None, None, process_index) is None
    assert list(run_dir.iterdir()) == []


class _FakeRun:
    """What WandbMirror uses of a wandb run, recording the calls."""

    def __init__(self, starting_step: int = 0, fail_log: bool = False):
        self.id, self.starting_step, self.fail_log, self.calls = "abc", starting_step, fail_log, []

    def log(self, values, step):
        if self.fail_log:
            raise RuntimeError(f"service gone (key {os.environ.get('WANDB_API_KEY')})")
        self.calls.append(("log", step, values))

    def mark_preempting(self):
        self.calls.append(("preempting",))

    def finish(self, exit_code):
        self.calls.append(("finish", exit_code))


def test_steps_wandb_has_already_are_not_sent_again():
    """An online resume continues after the steps W&B already has (its starting_step): the
    steps replayed from the checkpoint are left out, the rest sent as they are."""
    run = _FakeRun(starting_step=5)
    mirror = WandbMirror(run)
    for step in (4, 5, 5, 6):
        mirror.log(step, {"step": step, "loss": float(step)})
    assert run.calls == [("log", 5, {"loss": 5.0}), ("log", 5, {"loss": 5.0}), ("log", 6, {"loss": 6.0})]


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (None, [("finish", 0)]),
        (Preempted(4, "SIGTERM"), [("preempting",), ("finish", EXIT_PREEMPTED)]),
        (JaxdistError("bad"), [("finish", 2)]),
        (KeyboardInterrupt(), [("finish", 1)]),
    ],
    ids=["done", "preempted", "bad input", "other"],
)
def test_the_wandb_run_ends_as_the_run_did(error, expected):
    run = _FakeRun()
    WandbMirror(run).close(error)
    assert run.calls == expected


def test_a_wandb_failure_mid_run_does_not_stop_the_training(capsys, monkeypatch):
    """metrics.jsonl has every line: W&B's trouble is one warning (without the API key its
    message may hold), and nothing more is tried."""
    monkeypatch.setenv("WANDB_API_KEY", FAKE_API_KEY)
    run = _FakeRun(fail_log=True)
    mirror = WandbMirror(run)
    mirror.log(1, {"step": 1, "loss": 1.0})
    mirror.log(2, {"step": 2, "loss": 1.0})
    warnings = [x for x in capsys.readouterr().err.splitlines() if "stopped taking metrics" in x]
    expected = "Weights & Biases stopped taking metrics at step 1 (service gone (key ***)); training goes on, metrics.jsonl has them all"
    assert warnings == [f"jaxdist: warning: {expected}"]
