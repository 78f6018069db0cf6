"""experiments/scaling.py: a smoke sweep (valid, resumable), skipped and failed points, efficiency
by hand, and deterministic README tables."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "scaling.py"

_spec = importlib.util.spec_from_file_location("scaling", SCRIPT)
scaling = importlib.util.module_from_spec(_spec)
sys.modules["scaling"] = scaling
_spec.loader.exec_module(scaling)

HAS_TORCH = importlib.util.find_spec("torch") is not None


def _cli(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


@pytest.mark.heavy
def test_smoke_sweep_writes_contract_lines_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    tiny = ["--out", out, "--model", "tiny-test", "--modes", "strong", "--steps", "4", "--warmup", "1", "--no-profile"]
    commands = [[*tiny, "--frameworks", "jaxdist", "--strategies", "dp", "--devices", "1,2", "--kinds", "fake"]]
    if HAS_TORCH:
        commands.append([*tiny, "--frameworks", "pytorch-ddp", "--devices", "1", "--kinds", "proc"])
    for cmd in commands:
        r = _cli(cmd)
        assert r.returncode == 0, r.stderr[-3000:]

    rows = _rows(out)
    assert len(rows) == 2 + HAS_TORCH
    for row in rows:
        assert set(scaling.CONTRACT_KEYS) <= set(row), set(scaling.CONTRACT_KEYS) - set(row)
        assert row["status"] == "ok", row["status"]
        assert row["model"] == "tiny-test" and row["seq_len"] == 16 and row["global_batch"] == 4
        assert row["step_time_s"] > 0 and row["params"] > 0 and row["memory_per_device_bytes"] > 0
        assert row["tokens_per_sec"] == pytest.approx(4 * 16 / row["step_time_s"])
        assert row["threads"]["cores"] >= 1
    by = {(r["framework"], r["strategy"], r["devices"]): r for r in rows}
    one, two = by[("jaxdist", "single", 1)], by[("jaxdist", "dp", 2)]
    assert one["efficiency"] == 1.0 and one["comm_bytes_per_step"] == 0 and one["mesh"] == "data=1"
    assert two["efficiency"] == pytest.approx(one["step_time_s"] / (2 * two["step_time_s"]))
    assert two["comm_bytes_per_step"] > 0 and two["mesh"] == "data=2" and two["per_device_batch"] == 2
    assert len(two["step_times_s"]) == 4 and two["kind"] == "fake" and two["processes"] == 1
    assert "xla_force_host_platform_device_count" not in (two["threads"]["xla_flags"] or "")  # jaxdist asked for the devices
    if HAS_TORCH:
        torch_row = by[("pytorch", "single", 1)]
        assert torch_row["kind"] == "proc" and torch_row["efficiency"] == 1.0 and torch_row["threads"]["torch_threads"] == 1
        assert torch_row["params"] == one["params"]  # the same model
    assert json.loads((out / "hardware.json").read_text())["cores"] >= 1

    before = (out / "results.jsonl").read_text()
    for cmd in commands:
        r = _cli(cmd, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "0 to run" in r.stdout
    assert (out / "results.jsonl").read_text() == before


def test_unrunnable_points_are_skipped_and_failures_recorded(tmp_path: Path, monkeypatch, capsys) -> None:
    out = tmp_path / "out"
    # small-cpu has 4 kv heads and 4 layers: tensor=8 and pipe=8 cannot be built; 3d needs 4 | N
    argv = ["--out", str(out), "--strategies", "tp,pipe-gpipe,3d", "--devices", "6,8", "--modes", "strong", "--kinds", "fake"]
    argv += ["--frameworks", "jaxdist", "--no-profile"]
    monkeypatch.setattr(scaling.Runner, "run", lambda self, cmd, env, log, stdout=None: (1, "RuntimeError: boom"))
    assert scaling.main(argv) == 0
    rows = {(r["strategy"], r["devices"]): r for r in _rows(out)}
    assert len(rows) == 6
    assert rows[("tp", 8)]["status"].startswith("skipped:") and "n_kv_heads" in rows[("tp", 8)]["status"]
    assert rows[("pipe-gpipe", 8)]["status"].startswith("skipped:") and "n_layers" in rows[("pipe-gpipe", 8)]["status"]
    assert rows[("3d", 6)]["status"] == "skipped: 3d needs a multiple of 4 devices, at least 8 (every axis > 1), got 6"
    assert rows[("tp", 6)]["status"].startswith("skipped:")  # 6 does not divide 8 heads
    # 3d on 8 (data=2,tensor=2,pipe=2) can be built: its run "fails" (the runner is stubbed) and is recorded
    failed = rows[("3d", 8)]
    assert failed["status"] == "failed: exit 1: RuntimeError: boom" and failed["mesh"] == "data=2,tensor=2,pipe=2"
    assert failed["step_time_s"] is None and failed["efficiency"] is None
    assert set(scaling.CONTRACT_KEYS) <= set(failed)
    # resumable: nothing reruns; --retry-failed reruns only the failed point
    assert scaling.main(argv) == 0
    assert len(_rows(out)) == 6
    assert scaling.main([*argv, "--retry-failed"]) == 0
    assert len(_rows(out)) == 6 and sum(r["status"].startswith("failed") for r in _rows(out)) == 1
    # a budget of 0 minutes starts nothing
    capsys.readouterr()
    assert scaling.main([*argv, "--out", str(tmp_path / "other"), "--budget-min", "0"]) == 0
    assert "budget is spent: 6 points not started" in capsys.readouterr().out
    assert not (tmp_path / "other" / "results.jsonl").exists()


def test_last_error_line_skips_progress_bars() -> None:
    text = "step 1\n[rank 1] Traceback ...\n[rank 1] ValueError: bad shape\n 50%|#####     | 1/2 [00:01<00:01, 1.0step/s]\r\n"
    assert scaling.last_error_line(text) == "ValueError: bad shape"
    assert scaling.timed_steps({s: float(s) for s in range(1, 11)}, 3, (4, 5)) == [7.0, 8.0, 9.0, 10.0]


def _line(framework: str, strategy: str, devices: int, mode: str, kind: str, t: float | None, status: str = "ok", **extra) -> dict:
    gb = 16 if mode == "strong" else 8 * devices
    row = {k: None for k in scaling.CONTRACT_KEYS}
    row.update(
        framework=framework,
        model="small-cpu",
        params=853120,
        strategy=strategy,
        mesh=f"data={devices}",
        devices=devices,
        processes=devices if kind == "proc" else 1,
        global_batch=gb,
        per_device_batch=gb // devices,
        seq_len=128,
        step_time_s=t,
        tokens_per_sec=gb * 128 / t if t else None,
        efficiency=0.123,  # stale on purpose: the tables recompute it
        mode=mode,
        kind=kind,
        status=status,
        host="Test CPU, 2 cores, jax 0.10.2, torch 2.13.0",
    )
    if t:
        row.update(memory_per_device_bytes=int(16 * 853120 / devices) + 1000, comm_bytes_per_step=4 * 853120 * (devices > 1))
        if framework == "jaxdist" and devices > 1:  # what analyze reports: a ring all-reduce of the grads over data
            row.update(states_bytes_per_device=12 * 853120 + 512, comm_by_axes={"data": {"count": 5, "wire_bytes": 4 * 853120}})
    row.update(extra)
    return row


FIXED = [
    _line("jaxdist", "single", 1, "strong", "fake", 0.4),
    _line("jaxdist", "dp", 2, "strong", "fake", 0.25, bound="communication", comm_time_s=0.05),
    _line("jaxdist", "fsdp", 2, "strong", "fake", 0.3),
    _line("jaxdist", "tp", 8, "strong", "fake", None, "skipped: model.n_kv_heads (4) must be divisible by the tensor axis (8)"),
    _line("jaxdist", "pipe-1f1b", 2, "strong", "fake", None, "failed: exit 1: RuntimeError: boom"),
    _line("jaxdist", "single", 1, "weak", "fake", 0.4),
    _line("jaxdist", "dp", 2, "weak", "fake", 0.5),
    _line("jaxdist", "single", 1, "strong", "proc", 0.2),
    _line("jaxdist", "dp", 2, "strong", "proc", 0.25),
    _line("pytorch", "single", 1, "strong", "proc", 0.1),
    _line("pytorch-ddp", "dp", 2, "strong", "proc", 0.1),
]


def test_efficiency_by_hand() -> None:
    rows = [dict(r) for r in FIXED]
    scaling.refresh_efficiency(rows)
    eff = {(r["framework"], r["strategy"], r["devices"], r["mode"], r["kind"]): r["efficiency"] for r in rows}
    assert eff[("jaxdist", "single", 1, "strong", "fake")] == 1.0
    assert eff[("jaxdist", "dp", 2, "strong", "fake")] == pytest.approx(0.8)  # 0.4 / (2 x 0.25)
    assert eff[("jaxdist", "dp", 2, "weak", "fake")] == pytest.approx(0.8)  # 0.4 / 0.5
    assert eff[("jaxdist", "dp", 2, "strong", "proc")] == pytest.approx(0.4)  # its own kind's baseline: 0.2 / (2 x 0.25)
    assert eff[("pytorch-ddp", "dp", 2, "strong", "proc")] == pytest.approx(0.5)  # PyTorch's single: 0.1 / (2 x 0.1)
    assert eff[("jaxdist", "tp", 8, "strong", "fake")] is None and eff[("jaxdist", "pipe-1f1b", 2, "strong", "fake")] is None
    # a baseline that arrives later is picked up
    late = [dict(FIXED[1])]
    assert not scaling.refresh_efficiency(late) or late[0]["efficiency"] is None
    late.append(dict(FIXED[0]))
    assert scaling.refresh_efficiency(late) and late[0]["efficiency"] == pytest.approx(0.8)


def test_write_readme_is_deterministic_and_keeps_the_rest(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in FIXED))
    shuffled = tmp_path / "shuffled"
    shuffled.mkdir()
    lines = [json.dumps(r) for r in FIXED]
    random.Random(0).shuffle(lines)
    (shuffled / "results.jsonl").write_text("\n".join(lines) + "\n")

    original = (ROOT / "experiments" / "README.md").read_text()
    plain = tmp_path / "plain.md"
    plain.write_text(original.replace(scaling.BEGIN, "").replace(scaling.END, ""))
    head, tail = "# Experiments\n\nbefore the tables\n\n", "\nafter the tables\n"
    marked = tmp_path / "marked.md"
    marked.write_text(head + scaling.BEGIN + "\nold tables\n" + scaling.END + tail)
    plain_before = plain.read_text()

    outputs = {}
    for name, path in (("plain", plain), ("marked", marked)):
        copies = []
        for results in (out, out, shuffled):
            assert scaling.main(["--out", str(results), "--report-only", "--write-readme", str(path)]) == 0
            copies.append(path.read_bytes())
        assert copies[0] == copies[1] == copies[2], name
        outputs[name] = copies[0].decode()
    assert outputs["plain"].startswith(plain_before) and outputs["plain"].endswith(scaling.END + "\n")
    text = outputs["marked"]
    assert text.startswith(head + scaling.BEGIN + "\n") and text.endswith(scaling.END + tail)
    body = text[len(head) + len(scaling.BEGIN) + 1 : -len(scaling.END + tail)]
    assert "old tables" not in body and body == scaling.render_tables(FIXED)
    assert outputs["plain"].endswith(scaling.BEGIN + "\n" + body + scaling.END + "\n")
    # the numbers: strong dp on 2 fake devices (0.25 s, 0.80), the skip and the failure, the PyTorch ratio
    assert "250.0 ms · 8,192 · 0.80" in body
    assert "skipped: model.n_kv_heads (4)" in body and "failed: exit 1: RuntimeError: boom" in body
    assert "| strong | dp vs pytorch-ddp | 200.0 ms / 100.0 ms = 2.00 | 250.0 ms / 100.0 ms = 2.50 |" in body
    assert "ZeRO-3 / FSDP (12P/N)" in body and "communication" in body
    # measured vs expected: DP on 2 devices sends 2 x 1/2 x 4P = 3.25 MiB over data and holds 12P of states
    assert "| strong | dp | data=2 | data | 3.25 | 3.25 | 1.000 | 3.25 | 9.76 | 9.76 | 1.000 |" in body
    assert "| weak | dp | data=2 | data | 3.25 |" in body  # each mode has its rows
    assert json.loads((out / "results.jsonl").read_text().splitlines()[1])["efficiency"] == 0.123  # the report does not rewrite results


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")
def test_plots_are_written(tmp_path: Path) -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    from scaling_plots import draw_all

    rows = [dict(r) for r in FIXED]
    scaling.refresh_efficiency(rows)
    paths = draw_all(rows, tmp_path / "figures")
    assert sorted(p.name for p in paths) == ["scaling_comm.png", "scaling_efficiency.png", "scaling_memory.png", "scaling_throughput.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
