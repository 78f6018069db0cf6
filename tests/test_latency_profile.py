"""``train.latency_profile``: XLA:GPU's scheduler given the planner's price of each kernel and
collective (``jaxdist.plan.latency_profile``). Against the program XLA schedules on its own
estimates (``off``), the profiled one starts FSDP's weight gathers further ahead of their use,
read from the scheduled HLO, and the planner's replay of it exposes less; a profile file is taken
as it is; where the program keeps values in host memory, XLA's memory limit is raised by them,
and a profiled schedule that no longer fits gives way to the unprofiled one; on
CPU the key says in one line that it does nothing, and a missing file is refused before anything
runs. Other GPU tests compile with ``off`` where they read the program's structure (fusions,
collectives, memory), which the profile does not change, at half the compile time.

Needs JAX's CUDA plugin (the ``dev`` extra installs it); without it the GPU tests skip with that reason.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from jaxdist.config import load_config
from jaxdist.inspect.hlo import parse_hlo
from jaxdist.layout.mesh import parse_mesh

from helpers import TINY, subprocess_env

# llama3-8b's width cut to 4 layers, on 8 H100 (fsdp=8): what one weight gather costs against a
# layer's compute is the full model's
SHAPE = ("model.n_layers=4", "model.remat=save_matmuls", "parallel.mesh=fsdp=8")


def _gpu():
    pytest.importorskip("jax_plugins.xla_cuda12", reason="JAX's CUDA plugin is not installed (pip install -e '.[dev]')")
    from jaxdist.plan import gpu_target

    return gpu_target


def _compiled(setting: str, *extra: str, hardware=None):
    gpu_target = _gpu()
    config = load_config("llama3-8b", [*SHAPE, f"train.latency_profile={setting}", *extra])
    hardware = hardware or gpu_target.target_hardware("h100")
    trainer, compiled, options = gpu_target.compile_for_target(config, parse_mesh("fsdp=8"), hardware, 8, 8)
    return compiled.as_text(), gpu_target.target_report(trainer, compiled, hardware, options, 8)


def schedule(hlo: str) -> dict[str, list[str]]:
    """Each computation's instructions in XLA's schedule order (the scheduled HLO's text order)."""
    return {name: [i.name for i in body] for name, body in parse_hlo(hlo).computations.items()}


@pytest.fixture(scope="module")
def programs():
    return {setting: _compiled(setting) for setting in ("off", "model")}


@pytest.mark.heavy
def test_given_the_models_costs_xla_starts_weight_gathers_earlier_and_the_step_exposes_less(programs):
    (off_hlo, off), (model_hlo, model) = programs["off"], programs["model"]
    assert schedule(model_hlo) != schedule(off_hlo)
    gathers = (off["collectives"]["all-gather"]["exposed_s"], model["collectives"]["all-gather"]["exposed_s"])
    assert gathers[1] < 0.6 * gathers[0], gathers
    assert model["exposed_s"] < off["exposed_s"] and model["step_s"] < off["step_s"], (off["step_s"], model["step_s"])
    assert model["fits"], model["fits_note"]
    profile = model["xla_flags"]["xla_gpu_pgle_profile_file_or_directory_path"]
    assert "xla_gpu_pgle_profile_file_or_directory_path" not in off["xla_flags"]
    # every collective start of the program, and its GEMMs, are in the profile XLA was given
    with open(profile) as f:
        names = {line.split('"')[1] for line in f.read().splitlines()}
    module = parse_hlo(model_hlo)
    starts = {i.name for body in module.computations.values() for i in body if i.opcode.endswith("-start") and "gather" in i.opcode}
    assert starts and starts <= names


@pytest.mark.heavy
def test_a_profile_file_is_given_to_xla_as_it_is(programs, tmp_path):
    """The model profile handed back as a file compiles to the model's program in one compile."""
    model_hlo, model = programs["model"]
    copy = tmp_path / "measured.pbtxt"
    with open(model["xla_flags"]["xla_gpu_pgle_profile_file_or_directory_path"]) as f:
        copy.write_text(f.read())
    hlo, report = _compiled(str(copy))
    assert report["xla_flags"]["xla_gpu_pgle_profile_file_or_directory_path"] == str(copy.resolve())
    assert report["step_s"] == pytest.approx(model["step_s"]) and schedule(hlo) == schedule(model_hlo)


@pytest.mark.heavy
def test_host_buffers_raise_xlas_memory_limit_so_it_stops_recomputing_what_saves_nothing(capsys):
    """A 10 GB device: the step peaks at 7.1 GB with 2.5 GB of layer inputs and optimizer state in
    host memory, but XLA's rematerialisation adds the host buffers to the device's, finds 10.2 GiB
    over its 8.9 GiB limit and recomputes kernels. With the limit raised by the host bytes it
    recomputes none; the profiled schedule then peaks over what JAX may allocate (7.5 GB), so the
    step keeps the unprofiled one and says so."""
    from jaxdist.plan import latency_profile

    gpu_target = _gpu()
    small = dataclasses.replace(gpu_target.target_hardware("h100"), memory_bytes=10e9)
    offload = ("model.remat=offload_layer_inputs", "train.optimizer_offload=true")
    latency_profile._SAID.clear()
    (off_hlo, off), (model_hlo, model) = (_compiled(setting, *offload, hardware=small) for setting in ("off", "model"))
    fusions = [sum(1 for body in parse_hlo(h).computations.values() for i in body if i.opcode == "fusion") for h in (off_hlo, model_hlo)]
    assert fusions[1] < fusions[0], fusions
    assert int(model["xla_flags"]["xla_gpu_memory_limit_slop_factor"]) > 100
    assert "xla_gpu_pgle_profile_file_or_directory_path" not in model["xla_flags"]
    assert model["fits"] and off["fits"], (model["fits_note"], off["fits_note"])
    said = [x for x in capsys.readouterr().err.splitlines() if "latency_profile" in x]
    assert len(said) == 1 and "the step keeps XLA's own schedule: with the profile it peaks at" in said[0], said


@pytest.mark.heavy
def test_where_the_planner_prices_the_profiled_program_slower_the_step_keeps_xlas_own_and_says_so(monkeypatch, capsys):
    """Megatron-LM's 1.7B on data=48 is such a step (its gradient all-reduces hid less with the
    profile); here the price is made to say so of a small step."""
    from jaxdist.plan import latency_profile

    gpu_target = _gpu()
    latency_profile._SAID.clear()
    priced = []  # the programs priced, the plain one first
    monkeypatch.setattr(latency_profile, "priced_step", lambda program, *_: 1.0 if not priced.append(program) and len(priced) == 1 else 2.0)
    config = load_config(None, [*TINY, "model.dtype=bfloat16", "train.latency_profile=model"])
    hardware = gpu_target.target_hardware("h100")
    _, compiled, options = gpu_target.compile_for_target(config, parse_mesh("data=8"), hardware, 8, 8)
    assert "xla_gpu_pgle_profile_file_or_directory_path" not in options and len(priced) >= 2
    assert schedule(compiled.as_text()) == {name: [i.name for i in body] for name, body in priced[0].computations.items()}
    said = [x for x in capsys.readouterr().err.splitlines() if "latency_profile" in x]
    assert said == [
        "jaxdist: warning: train.latency_profile=model: the step keeps XLA's own schedule: "
        "the planner prices the profiled one slower (2 s against 1 s)"
    ], said


@pytest.mark.heavy
def test_a_run_on_gpus_schedules_its_step_with_the_profile_of_its_kind(monkeypatch, capsys):
    """``compile_on_devices`` is what a run's step compile calls on its own devices: an H100
    (here a compile-only one) gets the h100 profile's prices, its host's device count and the
    share of its memory JAX may take, and a program the planner prices no slower than XLA's
    own; a kind without a planner profile gets XLA's own schedule, said in one line."""
    import types

    from jaxdist.plan import latency_profile

    gpu_target = _gpu()
    latency_profile._SAID.clear()
    config = load_config(None, [*TINY, "model.dtype=bfloat16", "model.n_layers=3"])
    hardware = gpu_target.target_hardware("h100")
    with gpu_target.target_capability(hardware.device["compute_capability"]):
        trainer = gpu_target.build_trainer(config, parse_mesh("data=8"), gpu_target.target_devices(hardware, 8, 8))
        lowered = trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch(config.train.global_batch))
    calls, scheduled = [], latency_profile.compile_scheduled
    monkeypatch.setattr(latency_profile, "compile_scheduled", lambda *a: calls.append(a) or scheduled(*a))
    h100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
    run = latency_profile.compile_on_devices(lowered, "model", {"data": 8}, h100, 8)
    (_, options, setting, mesh_shape, priced_on, allowed), plain = calls[0], lowered.compile()
    assert (options, setting, mesh_shape, priced_on.key, priced_on.gpus_per_node) == ({}, "model", {"data": 8}, "h100", 8)
    assert allowed == pytest.approx(0.75 * 80e9)
    price = lambda c: latency_profile.priced_step(c.as_text(), {"data": 8}, priced_on)  # noqa: E731  (its text: parsed there)
    assert price(run) <= price(plain)
    unknown = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA B300")
    assert schedule(latency_profile.compile_on_devices(lowered, "model", {"data": 8}, unknown, 8).as_text()) == schedule(plain.as_text())
    assert len(calls) == 1
    said = [x for x in capsys.readouterr().err.splitlines() if "latency_profile" in x]
    assert said[-1] == (
        "jaxdist: warning: train.latency_profile=model: no planner profile for NVIDIA B300; the step is scheduled on XLA's own estimates"
    ), said


def test_on_cpu_a_setting_other_than_the_default_says_in_one_line_that_it_does_nothing(tmp_path):
    command = [sys.executable, "-m", "jaxdist.analyze", "--config", "tiny", "--mesh", "data=2", "train.latency_profile=off", "--json"]
    done = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    said = [x for x in done.stderr.splitlines() if "latency_profile" in x]
    assert said == ["jaxdist: warning: train.latency_profile=off has no effect on cpu devices (it is for XLA:GPU's scheduler)"], said


def test_a_profile_file_that_is_not_there_is_refused_in_one_line_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "jaxdist.train", "--config", "tiny", "--steps", "1", "--run-dir", str(run_dir)]
    done = subprocess.run(
        [*command, f"train.latency_profile={tmp_path / 'gone.pbtxt'}"], env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert lines[-1].startswith("jaxdist: error: train.latency_profile must be model, off or a profile file that exists"), lines
    assert not run_dir.exists()
