"""XLA:GPU's scheduler told what each kernel and collective costs (``train.latency_profile``).

XLA's latency-hiding scheduler places each async collective's start as far ahead of its done as
it thinks the transfer takes. Without a profile its estimates are rough: in llama3-70b's step on
64 H100 (``fsdp=16,tensor=4``) it starts each layer's 8.7 ms of weight gathers one kernel before
their done, and 1.3 s of them a step wait in the open. XLA's profile-guided latency estimator
(PGLE: ``xla_gpu_pgle_profile_file_or_directory_path``, a ``ProfiledInstructionsProto`` of
per-instruction costs) is the cure JAX offers, fed from a profiled run on the GPUs.

``model`` feeds it without a run: the step is compiled once, each kernel and collective of that
program is priced by the planner's model (``plan.cost``: what ``analyze
--target`` reports as ``step_s``), and the step is compiled again with those costs. The profile
is advice XLA's scheduler can take badly (Megatron-LM's 1.7B on ``data=48`` hid less of its
gradient all-reduces with it): the program the planner prices faster is kept. A measured profile
(a path) is taken as it is.

Where the program keeps values in host memory (``model.remat=offload_*``,
``train.optimizer_offload``), XLA:GPU's rematerialisation pass counts the host buffers against
the device's memory limit, finds the program over it, and recomputes values to no avail (its
log: "Can't reduce memory use below 65.04GiB ... only reduced to 98.13GiB" for a step whose
device peak is 44.1 GiB). There the step is compiled again with that limit raised by the host
bytes (``xla_gpu_memory_limit_slop_factor``) before it is priced; the device peak is checked
against the target as before.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from pathlib import Path
from typing import Any

from jaxdist.errors import JaxdistError
from jaxdist.inspect.collectives import collective_kind, collective_ops
from jaxdist.inspect.gpu_program import kernel_kind
from jaxdist.inspect.hlo import HloModule, parse_hlo
from jaxdist.inspect.host_offload import host_offload
from jaxdist.layout.xla_flags import user_flags
from jaxdist.plan.cost import _op_time, kernel_time, node_split, predict
from jaxdist.plan.gpu_cost import _wrapped, gpu_program_cost, kernel_work
from jaxdist.plan.hardware import Hardware, allowed_memory, default_hardware, load_hardware
from jaxdist.plan.private_dir import private_directory

log = logging.getLogger(__name__)

PROFILE_FLAG = "xla_gpu_pgle_profile_file_or_directory_path"
SLOP_FLAG = "xla_gpu_memory_limit_slop_factor"
MODES = ("model", "off")
# Profiled compiles at most: the first profile prices a program scheduled on XLA's own estimates,
# the second the program the first gave (llama3-70b's pick: 10.22 s, then 9.66 s; a third repeats it)
ROUNDS = 2


def priced_costs(module: HloModule, mesh_shape: dict[str, int], hardware: Hardware) -> dict[str, float]:
    """Seconds of every kernel and collective start of XLA:GPU's program ``module``, by name."""
    ops = collective_ops(module, mesh_shape)
    index = {op.name: k for k, op in enumerate(ops)}
    crossing = node_split(mesh_shape, hardware.gpus_per_node)
    costs: dict[str, float] = {}
    for body in module.computations.values():
        for i in body:
            inner = _wrapped(i, module) if i.opcode == "async-start" else (i if collective_kind(i.opcode) else None)
            if inner is not None:
                if inner.name in index:
                    costs[i.name] = _op_time(ops[index[inner.name]], hardware, crossing, nccl=True)
                continue
            # A host transfer's start is priced as the kernel model prices it: a copy of its bytes in
            # device memory, not the host link's time. llama3-70b's pick: 9.66 s a step so, 10.05 s
            # at the host link's speed (XLA then holds compute back for transfers the copy engine
            # runs beside it), 10.22 s on XLA's own estimate.
            kind = kernel_kind(i, module)
            if kind is not None:
                costs[i.name] = kernel_time(hardware, kind, *kernel_work(i, kind, module))
    return costs


def _costly(costs: dict[str, float]) -> dict[str, float]:
    """``costs`` less the free instructions (a copy XLA turned into a bitcast comes and goes between compiles)."""
    return {name: seconds for name, seconds in costs.items() if seconds >= 5e-10}


def profile_text(costs: dict[str, float]) -> str:
    """``costs`` as a ``ProfiledInstructionsProto`` in text format (microseconds), sorted by name."""
    return "".join(f'costs {{ name: "{name}" cost_us: {seconds * 1e6:.3f} }}\n' for name, seconds in sorted(costs.items()))


def host_slop_factor(hlo_text: str, hardware: Hardware) -> int | None:
    """``xla_gpu_memory_limit_slop_factor`` (percent of the device's limit) that leaves room for
    the host buffers of ``hlo_text`` XLA counts as device memory; None without host buffers."""
    offload = host_offload(hlo_text)
    host = offload["host_bytes"] + offload["to_host"]["bytes"]
    return 100 + math.ceil(100 * host / hardware.memory_bytes) if host else None


def profile_directory() -> Path:
    """This user's directory of profiles (``private_dir``). A profile's path is in XLA's compile
    options, so it is named by its content: the same program gets the same path and stays a hit
    in the persistent compilation cache."""
    return private_directory("jaxdist-latency-profiles", "train.latency_profile=off compiles without")


def write_profile(text: str) -> Path:
    path = profile_directory() / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.pbtxt"
    if not path.exists():
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(text)
        partial.replace(path)
    return path


def profile_setting(setting: str) -> str:
    """``train.latency_profile`` checked before anything compiles: a mode, or a readable profile file."""
    if setting in MODES:
        return setting
    path = Path(setting).expanduser()
    if not path.is_file():
        raise JaxdistError(f"train.latency_profile={setting}: not model, off, or a profile file that exists")
    return str(path.resolve())


def compile_scheduled(
    lowered: Any, options: dict[str, Any], setting: str, mesh_shape: dict[str, int], hardware: Hardware, allowed: float | None = None
):
    """(compiled, the options of the compile kept) of ``lowered`` under ``train.latency_profile``
    ``setting``: off, a profile file, or ``model`` (see the module doc: 2 to 4 compiles). A
    profile the user set in ``XLA_FLAGS`` wins: one compile, theirs. ``allowed``: the device
    bytes the program may peak at. The profiled program is kept where the planner prices it
    faster and it fits where the plain one does (the scheduler, hiding more, keeps more buffers
    live); otherwise the plain one, said in one line."""
    setting = profile_setting(setting)
    if setting == "off" or PROFILE_FLAG in user_flags():
        return lowered.compile(options), options
    if setting != "model":
        options = options | {PROFILE_FLAG: setting}
        return lowered.compile(options), options
    compiled = lowered.compile(options)
    slop = host_slop_factor(compiled.as_text(), hardware)
    if slop is not None and SLOP_FLAG not in user_flags():
        # the program XLA makes once its limit leaves room for the host buffers is the one to price
        raised = options | {SLOP_FLAG: slop}
        compiled, options = _fitting((lowered.compile(raised), raised), (compiled, options), allowed)
    plain, module = (compiled, options), parse_hlo(compiled.as_text())
    kept, why = (priced_step(module, mesh_shape, hardware), *plain), ""
    used: dict[str, float] | None = None
    for _ in range(ROUNDS):
        costs = priced_costs(module, mesh_shape, hardware)
        if used is not None and _costly(costs) == _costly(used):
            break  # the profile's program has the profile's kernels: another compile would repeat it
        profiled = plain[1] | {PROFILE_FLAG: str(write_profile(profile_text(costs)))}
        compiled, used = lowered.compile(profiled), costs
        module = parse_hlo(compiled.as_text())
        seconds, over = priced_step(module, mesh_shape, hardware), _over(compiled, plain[0], allowed)
        if over:
            why = why or over
        elif seconds < kept[0]:
            kept = (seconds, compiled, profiled)
        else:
            why = why or f"the planner prices the profiled one slower ({seconds:.4g} s against {kept[0]:.4g} s)"
    if kept[2] is plain[1]:
        _say_once(f"train.latency_profile=model: the step keeps XLA's own schedule: {why}")
    return kept[1:]


def _over(compiled: Any, plain: Any, allowed: float | None) -> str:
    """Why ``compiled`` may not replace ``plain``: it peaks over ``allowed`` bytes where ``plain`` does not ("" if it may)."""
    if allowed is None:
        return ""
    from jaxdist.inspect.step_report import device_peak  # imports JAX

    peak, before = device_peak(compiled), device_peak(plain)
    if peak <= allowed or before > allowed:
        return ""
    gib = 2**30
    return (
        f"with the profile it peaks at {peak / gib:.1f} GiB, over the {allowed / gib:.1f} GiB it may take ({before / gib:.1f} GiB without)"
    )


def priced_step(program: str | HloModule, mesh_shape: dict[str, int], hardware: Hardware) -> float:
    """Seconds the planner prices one step of XLA:GPU's ``program`` (its text, or parsed) at (``plan.cost``)."""
    return predict(gpu_program_cost(program, mesh_shape), hardware, mesh_shape, model_flops_per_step=1.0, tokens_per_step=1.0).step_time_s


def _fitting(candidate: tuple, fallback: tuple, allowed: float | None) -> tuple:
    """``candidate`` (compiled, options) with the memory limit raised, unless it peaks over ``allowed`` where ``fallback`` does not."""
    over = _over(candidate[0], fallback[0], allowed)
    if over:
        _say_once(
            f"train.latency_profile=model: XLA's memory limit is left as it is for the host buffers: {over.removeprefix('with the profile ')}"
        )
        return fallback
    return candidate


def compile_on_devices(lowered: Any, setting: str, mesh_shape: dict[str, int], device: Any, devices_per_host: int):
    """``lowered`` compiled for the devices a run has (``device``: one of them) under
    ``train.latency_profile``: on GPUs as ``compile_scheduled`` with the planner's profile of
    their kind; elsewhere (XLA:CPU has no latency-hiding scheduler) plainly, saying so in one
    line when the key was set away from its default."""
    setting = profile_setting(setting)
    if device.platform != "gpu":
        if setting != "model":
            _say_once(f"train.latency_profile={setting} has no effect on {device.platform} devices (it is for XLA:GPU's scheduler)")
        return lowered.compile()
    key = default_hardware("gpu", device.device_kind)
    if key is None and setting == "model":
        _say_once(f"train.latency_profile=model: no planner profile for {device.device_kind}; the step is scheduled on XLA's own estimates")
        return lowered.compile()
    hardware = load_hardware(key or "h100", gpus_per_node=devices_per_host)
    # what the step may peak at, from the profile (not this device's allocator): every process
    # of a run must choose the same program, or their collectives would not match
    return compile_scheduled(lowered, {}, setting, mesh_shape, hardware, allowed_memory(hardware))[0]


_SAID: set[str] = set()


def _say_once(line: str) -> None:
    """A warning once per process (a run compiles its step again for each mesh a recovery may need)."""
    if line not in _SAID:
        _SAID.add(line)
        log.warning(line)
