"""Energy per log interval (``joules_per_token``, ``power_w``) and the fp8-aware MFU field.

The meter is a test double: a counter the test moves by a known schedule (joules per
training step, large lumps during each eval and checkpoint save), so the expected
figures follow from the schedule alone. The NVML meter is checked against a fake
``pynvml`` module; on CPU there is no meter and the fields are null.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
import time
import types
from types import SimpleNamespace

import jax
import pytest

from jaxdist.config import load_config
from jaxdist.layout.mesh import parse_mesh
from jaxdist.training import energy
from jaxdist.training.run import run

from helpers import TINY

STEPS = 7
# log every 2; eval at 3 and 6; full saves at 4 and 7 (the end), a weights-only one at 5
CONFIG = (
    *TINY,
    f"train.steps={STEPS}",
    "train.log_every=2",
    "train.eval_every=3",
    "checkpoint.every_steps=4",
    "checkpoint.params_every_steps=5",
)
TOKENS_PER_STEP = 16 * 32  # TINY: global batch 16 x seq_len 32 targets
LUMP_J, LUMP_S = 1e4, 1.0  # what each eval and save costs on the fake meter


def step_joules(step: int) -> float:
    return 10.0 * step  # the fake GPUs' energy for training step ``step``


class FakeMeter:
    def __init__(self):
        self.counter = 1234.5  # an arbitrary start: only differences count

    def joules(self) -> float:
        return self.counter


def _strict(text: str) -> list[dict]:
    def no_constant(name):
        raise AssertionError(f"non-strict JSON constant {name}")

    return [json.loads(line, parse_constant=no_constant) for line in text.splitlines()]


def _run(run_dir, *extra: str) -> tuple[list[dict], str]:
    config = load_config(None, (*CONFIG, *extra))
    with contextlib.redirect_stderr(io.StringIO()) as err:
        run(config, parse_mesh("data=1"), run_dir, devices=jax.devices()[:1], progress=False)
    return _strict((run_dir / "metrics.jsonl").read_text()), err.getvalue()


@pytest.fixture(scope="module")
def metered(tmp_path_factory):
    """A run with the fake meter put where NVML's would be; each step adds
    ``step_joules(step)`` once it is done (when its metrics reach the host: the loop may
    already have queued the next step, whose energy is not spent yet), each eval and save
    adds LUMP_J and takes LUMP_S."""
    from jaxdist.training import loop
    from jaxdist.training.checkpoint import Checkpointer
    from jaxdist.training.step import Trainer

    meter = FakeMeter()
    fetch_metrics, evaluate = Trainer.fetch_metrics, loop.evaluate
    save, save_params = Checkpointer.save, Checkpointer.save_params
    done = iter(range(1, 10**6))

    def metered_fetch(self, pending):
        fetched = fetch_metrics(self, pending)
        for _ in fetched:
            meter.counter += step_joules(next(done))
        return fetched

    def costly(fn):
        def wrapped(*args, **kwargs):
            meter.counter += LUMP_J
            time.sleep(LUMP_S)
            return fn(*args, **kwargs)

        return wrapped

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(energy, "open_meter", lambda devices: (meter, ""))
        mp.setattr(Trainer, "fetch_metrics", metered_fetch)
        mp.setattr(loop, "evaluate", costly(evaluate))
        mp.setattr(Checkpointer, "save", costly(save))
        mp.setattr(Checkpointer, "save_params", costly(save_params))
        return _run(tmp_path_factory.mktemp("energy") / "metered")


def test_joules_per_token_and_power_follow_the_meter_leaving_out_eval_and_saves(metered):
    lines, err = metered
    train = [x for x in lines if "loss" in x]
    # log points: 2 (log_every), 3 (eval), 4 (save, log_every), 5 (weights-only save), 6 (eval, log_every), 7 (end)
    assert [x["step"] for x in train] == [2, 3, 4, 5, 6, 7]
    previous = 0
    for line in train:
        steps = range(previous + 1, line["step"] + 1)
        joules = sum(step_joules(s) for s in steps)  # from the schedule alone: no eval or save lump
        assert line["joules_per_token"] == pytest.approx(joules / (len(steps) * TOKENS_PER_STEP), rel=1e-9), line
        assert line["power_w"] == pytest.approx(joules / (len(steps) * line["step_time_s"]), rel=1e-9), line
        assert line["step_time_s"] < LUMP_S, line  # the eval's and the save's time are not in the interval either
        previous = line["step"]
    assert "energy is not measured" not in err


def test_metrics_are_strict_json_with_null_energy_on_cpu(tmp_path):
    lines, err = _run(tmp_path / "cpu", "train.steps=2", "train.eval_every=0")  # _run parses strictly: no NaN
    train = [x for x in lines if "loss" in x]
    assert len(train) == 1 and all(x["joules_per_token"] is None and x["power_w"] is None for x in train), train
    assert "mfu_fp8_peak" not in train[0]  # model.fp8 off: only the bf16-peak MFU
    said = [x for x in err.splitlines() if "energy is not measured" in x]
    assert said == ["jaxdist: energy is not measured (no energy counter on cpu devices): joules_per_token and power_w are null"], err


def test_interval_energy_sums_processes_and_is_null_when_a_read_fails():
    clock, meter = SimpleNamespace(t=100.0), SimpleNamespace(j=5.0)
    reads = SimpleNamespace(fail=False)
    fake = SimpleNamespace(joules=lambda: None if reads.fail else meter.j)
    interval = energy.IntervalEnergy(fake, total=lambda local: 3 * local, clock=lambda: clock.t)  # 3 "processes" alike
    interval.start()
    clock.t, meter.j = 102.0, 45.0
    seconds, joules = interval.stop()
    assert (seconds, joules) == (2.0, 120.0)
    assert energy.energy_fields(joules, seconds, 60) == {"joules_per_token": 2.0, "power_w": 60.0}
    interval.start()
    reads.fail = True  # NVML could not be read at the end of the interval
    assert interval.stop()[1] is None
    assert energy.energy_fields(None, 1.0, 60) == {"joules_per_token": None, "power_w": None}
    no_meter = energy.IntervalEnergy(None)
    no_meter.start()
    assert no_meter.stop()[1] is None


def _fake_nvml(monkeypatch, supported: bool = True):
    class NVMLError(Exception):
        pass

    gpus = {"0": 1_000_000, "1": 2_000_000, "2": 4_000_000, "3": 8_000_000}  # mJ since the driver loaded
    uuids = {f"GPU-{k}": k for k in gpus}

    def total(handle):
        if not supported:
            raise NVMLError("Not Supported")
        return gpus[handle]

    module = types.ModuleType("pynvml")
    module.NVMLError = NVMLError
    module.nvmlInit = lambda: None
    module.nvmlDeviceGetHandleByIndex = lambda i: str(i)
    module.nvmlDeviceGetHandleByUUID = lambda u: uuids[u]
    module.nvmlDeviceGetTotalEnergyConsumption = total
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return gpus


def _gpus(n: int) -> list:
    return [SimpleNamespace(platform="gpu", process_index=0, id=i, local_hardware_id=i) for i in range(n)]


@pytest.mark.parametrize("visible", ["2,3", "GPU-2,GPU-3"])
def test_nvml_meter_reads_the_gpus_this_process_sees(monkeypatch, visible):
    gpus = _fake_nvml(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    meter, why = energy.open_meter(_gpus(2))
    assert why == "" and meter.joules() == (4_000_000 + 8_000_000) / 1e3
    gpus["3"] += 500  # mJ
    assert meter.joules() == 12_000.5


def test_nvml_meter_without_the_counter_or_the_binding_is_absent(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _fake_nvml(monkeypatch, supported=False)
    meter, why = energy.open_meter(_gpus(2))
    assert meter is None and "NVML cannot read the GPUs' energy counters (Not Supported)" in why
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: the import fails
    meter, why = energy.open_meter(_gpus(1))
    assert meter is None and "nvidia-ml-py is not installed" in why
    assert energy.open_meter(jax.devices()[:1]) == (None, "no energy counter on cpu devices")


def test_fp8_peak_is_twice_bf16_where_the_gpu_has_fp8(tmp_path):
    """``mfu_fp8_peak`` = the same model FLOPs/s against the fp8 dense peak: present only
    with model.fp8 on, null where the device has no fp8 peak."""
    from jaxdist.data.batches import make_iterator
    from jaxdist.training.loop import train_loop
    from jaxdist.training.metrics import MetricsLogger, fp8_peak_flops_per_device, peak_flops_per_device
    from jaxdist.training.run import build_trainer

    for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 PCIe"):
        device = [SimpleNamespace(device_kind=kind, platform="gpu", process_index=0)]
        assert fp8_peak_flops_per_device(device) == pytest.approx(2 * peak_flops_per_device(device), rel=2e-3), kind  # datasheets round
    assert math.isnan(fp8_peak_flops_per_device([SimpleNamespace(device_kind="NVIDIA A100-SXM4-80GB", platform="gpu")]))
    assert math.isnan(fp8_peak_flops_per_device(jax.devices()[:1]))

    config = load_config(None, [*TINY, "train.steps=2"])
    trainer = build_trainer(config, parse_mesh("data=1"), jax.devices()[:1])
    records = {}
    for name, fp8_peak in (("known", 4e12), ("unknown", math.nan)):
        (tmp_path / name).mkdir()
        batches, logger = make_iterator(config, trainer.layout), MetricsLogger(tmp_path / name, 2, progress=False)
        common = {"steps": 2, "logger": logger, "flops_per_step": 1e9, "peak_flops": 1e12, "tokens_per_step": TOKENS_PER_STEP}
        train_loop(trainer, trainer.init_state(0), batches, **common, fp8_peak_flops=fp8_peak)
        batches.close()
        logger.close()
        records[name] = _strict((tmp_path / name / "metrics.jsonl").read_text())
    for line in records["known"]:
        assert line["mfu_fp8_peak"] == pytest.approx(line["mfu"] * 1e12 / 4e12, rel=1e-12), line
        assert line["mfu"] == pytest.approx(1e9 / (line["step_time_s"] * 1e12), rel=1e-12)
    assert all(line["mfu_fp8_peak"] is None for line in records["unknown"])
