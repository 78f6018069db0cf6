"""Goodput accounting (``jaxdist.cluster.goodput``) on records written by hand, each share
counted by hand; the launched runs' accounts are checked in test_elastic (a restart) and
test_recovery (an in-process recovery and a rejoin), a single process's in test_training."""

from __future__ import annotations

import json

import pytest

from jaxdist.cluster import goodput


def _write(run_dir, metrics, elastic):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in metrics))
    (run_dir / "elastic.jsonl").write_text("".join(json.dumps(x) + "\n" for x in elastic))


def _span(kind, start, end):
    return {"step": 0, "goodput_span": goodput.span_record(kind, start, end - start)}


def _window(step, start, end, wait=0.0):
    return {"step": step, "loss": 1.0, "step_time_s": end - start, "data_wait_s": wait, "wall_time": end, "window_steps": 1}


def test_a_restart_from_an_earlier_checkpoint_is_lost_and_retrained_time(tmp_path):
    """Set 1 trains steps 1-3, saves after 2, dies in step 4; set 2 starts 2 s after its last
    record, resumes at 2 and trains 3-4; the launcher ends 1 s after the last step."""
    metrics = [
        _span("startup", 100, 104), _span("restore", 104, 104.5), _span("setup", 104.5, 106), _span("compile", 106, 110),
        _window(1, 110.2, 111, wait=0.1), _window(2, 111, 112), _span("checkpoint", 112, 113), _window(3, 113, 114),
        _span("startup", 116, 120), _span("restore", 120, 121), _span("setup", 121, 121.5), _span("compile", 121.5, 123),
        _window(3, 123, 124), _window(4, 124, 125),
    ]  # fmt: skip
    _write(tmp_path, metrics, [{"time": 100.0, "reason": "start"}, {"time": 115.0, "reason": "failure"}])
    result = goodput.account(tmp_path, goodput.run_started(tmp_path), 126.0)
    want = {
        "productive": 0.7 + 1 + 1 + 1, "retrained": 1.0, "data_wait": 0.1, "loop_host": 0.2,  # 110 -> 110.2: the loop's start
        "startup": 4 + 1.5 + 4 + 0.5, "restore": 1.5, "compile": 5.5, "checkpoint": 1.0, "eval": 0.0,
        "recovery": 0.0, "rejoin": 0.0, "lost": 2.0, "shutdown": 1.0, "idle": 0.0,
    }  # fmt: skip
    assert result["seconds"] == pytest.approx(want, abs=1e-3)
    assert result["wall_s"] == pytest.approx(26.0) and result["goodput"] == pytest.approx(3.7 / 26)
    assert result["steps"] == {"productive": 4, "retrained": 1} and result["restarts"] == 1 and result["recoveries"] == 0
    assert result["shares"]["lost"] == pytest.approx(2 / 26, abs=1e-4)


def test_an_in_process_recovery_counts_from_the_last_record_to_its_first_step(tmp_path):
    """The record is written after the first step following the recovery (0.2 s); its timed phases
    are the 5 s before that, and the 0.8 s between the last window and them (the failed step,
    the unwinding) are the recovery's too. A stretch no record explains is idle."""
    metrics = [
        _span("startup", 100, 101), _span("compile", 101, 102), _window(1, 102, 103), _window(2, 103, 104),
        _window(3, 109.8, 110), _window(4, 111, 112),
    ]  # fmt: skip
    seconds = {"detect": 3.0, "agree": 0.5, "reshard": 0.5, "recompile": 1.0, "first_step": 0.2}
    _write(tmp_path, metrics, [{"time": 100.0, "reason": "start"}, {"time": 110.0, "reason": "in-process", "seconds": seconds}])
    result = goodput.account(tmp_path, 100.0, 112.0)
    assert result["seconds"]["recovery"] == pytest.approx(5.0 + 0.8)
    assert result["seconds"]["productive"] == pytest.approx(1 + 1 + 0.2 + 1)
    assert result["seconds"]["loop_host"] == pytest.approx(1.0)  # 110 -> 111 between two windows
    assert result["recoveries"] == 1 and result["restarts"] == 0
    assert sum(result["seconds"].values()) == pytest.approx(12.0)


def test_the_summary_line_names_the_shares_that_took_time(tmp_path):
    _write(tmp_path, [_span("startup", 0, 3), _span("compile", 3, 5), _window(1, 5, 10)], [])
    result = goodput.write(tmp_path, 0.0, 10.0)
    assert json.loads((tmp_path / goodput.FILE).read_text()) == result
    assert goodput.summary_line(result) == "goodput 50% of 10.0s (startup 30%, compile 20%); goodput.json has every share"
