"""experiments/resnet_case_study.py: which repeat a variant is reported by, and the table's arithmetic."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
_spec = importlib.util.spec_from_file_location("resnet_case_study", ROOT / "experiments" / "resnet_case_study.py")
case = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(case)


def _run(variant: str, t: float, compute: float = 0.5, status: str = "ok") -> dict:
    fractions = {"compute": compute, "data_wait": 0.3, "communication_exposed": 0.1, "communication_overlapped": 0.05, "idle": 0.05}
    row = {"variant": variant, "status": status, "step_time_s": t, "bound": "compute", "fractions": fractions}
    return {**row, "images_per_sec": 64 / t if t else None, "efficiency": compute + 0.05}


def test_a_variant_is_reported_by_its_lower_median_run() -> None:
    runs = [_run("naive", 0.5), _run("naive", 0.3), _run("naive", 0.4), _run("naive", None, status="failed: exit 1: x")]
    picked = case.median_run(runs)
    assert picked["step_time_s"] == 0.4 and picked["repeat_step_times_s"] == [0.5, 0.3, 0.4]
    assert case.median_run(runs[:2])["step_time_s"] == 0.3  # two repeats: the faster
    assert case.median_run([runs[-1]])["status"].startswith("failed")


def test_table_speed_up_and_efficiency() -> None:
    text = case.table([_run("naive", 0.4, compute=0.45), _run("best", 0.2, compute=0.8)], 1.0)
    assert "| naive | 400 ms | 160 | 1.00x | compute | 45% | 30% | 10% | 5% | 50% |" in text
    assert "| best | 200 ms | 320 | 2.00x | compute | 80% | 30% | 10% | 5% | 85% |" in text
