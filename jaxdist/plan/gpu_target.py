"""A GPU program without a GPU: the real train step compiled by XLA:GPU for a target
(``h100``, ``h200``, ``a100``, ``h100-hbm2e``) on this host.

JAX's CUDA plugin compiles for devices it only describes: a topology built from a
``GpuTargetConfig`` text (``jax.experimental.topologies.get_topology_desc``) gives
compile-only devices, and ``jit(...).lower(abstract shapes).compile()`` runs XLA:GPU's
whole pipeline (fusion, scheduling, PTX, cubin) with nothing allocated. The target text is
written here from the device facts of ``plan/hardware/NAME.yaml`` (its ``device``
section, sources named there). What needs a GPU is not done: there is no autotuning
(matmul kernels keep XLA's defaults) and cuDNN graphs are not built, so an unsupported
cuDNN configuration only fails on a real device.

Needs the plugin (``pip install -e ".[dev]"`` brings ``jax-cuda12-plugin``) and
``JAX_PLATFORMS=cpu`` before JAX starts (the plugin's own backend fails without a
driver): ``prepare_target`` sets it. So importing this module does not import JAX (the
commands call ``prepare_target`` first); the functions that compile import it, and what
imports it, themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxdist.config import Config
from jaxdist.errors import JaxdistError
from jaxdist.inspect.gpu_program import collective_schedule, kernel_counts, xla_flags_in_force
from jaxdist.inspect.hlo import parse_hlo
from jaxdist.inspect.host_offload import host_offload
from jaxdist.layout import devices
from jaxdist.layout.mesh import MeshSizes, mesh_device_count
from jaxdist.layout.native_output import hide_plugin_noise
from jaxdist.layout.xla_flags import gpu_flags, user_flags
from jaxdist.plan.hardware import Hardware, allowed_memory, load_hardware, memory_fraction
from jaxdist.plan.private_dir import private_directory
from jaxdist.training.run import build_trainer

log = logging.getLogger(__name__)

TARGETS = ("h100", "h200", "a100", "h100-hbm2e")
INSTALL_HINT = (
    'compiling for a GPU target needs JAX\'s CUDA plugin: pip install -e ".[dev]" (or pip install "jax-cuda12-plugin==<your jaxlib>")'
)


def prepare_target() -> None:
    """Before JAX starts: the compile-only route needs the plugin and a CPU backend."""
    if not devices.cuda_plugin_installed():
        raise JaxdistError(INSTALL_HINT)
    mismatch = devices.cuda_plugin_mismatch()
    if mismatch:
        raise JaxdistError(mismatch)
    if os.environ.get("JAX_PLATFORMS", "cpu").strip().lower() != "cpu":
        raise JaxdistError(f"compiling for a GPU target needs JAX_PLATFORMS=cpu, got {os.environ['JAX_PLATFORMS']!r}")
    os.environ["JAX_PLATFORMS"] = "cpu"
    hide_plugin_noise(logging.getLogger("jaxdist").isEnabledFor(logging.DEBUG))  # its "Could not find cuda drivers" lines


def target_hardware(name: str) -> Hardware:
    if name not in TARGETS:
        raise JaxdistError(f"unknown GPU target {name!r} (targets: {', '.join(TARGETS)})")
    return load_hardware(name)


def target_config_text(hardware: Hardware) -> str:
    """The ``GpuTargetConfig`` (text proto) of a profile's ``device`` facts."""
    d = hardware.device
    major, minor = (int(x) for x in str(d["compute_capability"]).split("."))
    info = {
        "threads_per_block_limit": d["threads_per_block"],
        "threads_per_warp": 32,
        "shared_memory_per_block": 48 * 1024,  # without opting in (CUDA's static limit)
        "shared_memory_per_core": d["shared_memory_per_sm"],
        "threads_per_core_limit": d["threads_per_sm"],
        "core_count": d["sm_count"],
        "fpus_per_core": d["fp32_cores_per_sm"],
        "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65535,
        "block_dim_limit_z": 65535,
        "memory_bandwidth": int(hardware.memory_bandwidth),
        "l2_cache_size": d["l2_cache_bytes"],
        "clock_rate_ghz": d["clock_ghz"],
        "device_memory_size": int(hardware.memory_bytes),
        "shared_memory_per_block_optin": d["shared_memory_per_block_optin"],
        "registers_per_core_limit": d["registers_per_sm"],
        "registers_per_block_limit": d["registers_per_block"],
    }
    lines = ["gpu_device_info {", *(f"  {k}: {v}" for k, v in info.items())]
    lines.append(f"  cuda_compute_capability {{ major: {major} minor: {minor} }}")
    # Without it XLA takes the target for CUDA < 12 and keeps fp8 dots off cuBLASLt's fp8 GEMM
    lines += [f'  runtime_version: "{_cuda_runtime_version()}"', "}", 'platform_name: "CUDA"']
    cudnn = _cudnn_version()
    if cudnn:
        lines.append(f"dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} patch: {cudnn[2]} }}")
    lines.append(f'device_description_str: "{d["description"]}"')
    return "\n".join(lines) + "\n"


def _cuda_runtime_version() -> str:
    """The CUDA runtime the installed plugin was built against ("12.9.0"): what it would load on a GPU."""
    try:
        from jax._src.lib import cuda_versions  # noqa: PLC0415 - the plugin's own version queries

        version = cuda_versions.cuda_runtime_build_version()
    except Exception:  # noqa: BLE001 - no plugin versions: CUDA 12's first release
        version = 12000
    return f"{version // 1000}.{version % 1000 // 10}.{version % 10}"


def _cudnn_version() -> tuple[int, int, int] | None:
    """The installed cuDNN's version (what the compiled program would load), if any."""
    try:
        from jax._src.lib import cuda_versions  # noqa: PLC0415 - the plugin's own version queries

        version = cuda_versions.cudnn_get_version() if cuda_versions is not None else 0
    except Exception:  # noqa: BLE001 - no cuDNN: attention falls back, said elsewhere
        return None
    return (version // 10000, version // 100 % 100, version % 100) if version >= 10000 else None


def target_devices(hardware: Hardware, gpus: int, gpus_per_node: int) -> list[Any]:
    """``gpus`` compile-only devices of the target, ``gpus_per_node`` per host (a multi-node
    target's devices carry their host as their process index)."""
    from jax.experimental import topologies

    if gpus < 1 or gpus_per_node < 1 or gpus % min(gpus, gpus_per_node):
        raise JaxdistError(f"--gpus {gpus} must be a positive multiple of --gpus-per-node {gpus_per_node} (or fewer)")
    per_host = min(gpus, gpus_per_node)
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=target_config_text(hardware), topology=f"1x{gpus // per_host}x{per_host}"
        )
    except Exception as e:  # noqa: BLE001 - the plugin's reasons are one line each
        raise JaxdistError(f"cannot describe {gpus} {hardware.name} devices: {(str(e).splitlines() or [type(e).__name__])[0]}") from None
    return list(topology.devices)


def compiler_options(config: Config | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """jaxdist's GPU XLA flags for ``config`` (``layout.xla_flags.gpu_flags``: what a GPU run of it
    sets) as per-compile options, with ``extra`` on top. Per compile rather than ``XLA_FLAGS``:
    this process's CPU backend started with its own. A flag the user set in ``XLA_FLAGS`` wins,
    as on a GPU."""

    def value(text: str) -> Any:
        return {"true": True, "false": False}.get(text, int(text) if text.lstrip("-").isdigit() else text)

    user = user_flags()
    defaults = gpu_flags(config) if os.environ.get("JAXDIST_XLA_DEFAULTS", "1") != "0" else {}
    options = {name: value(text) for name, text in defaults.items() if name not in user}
    return options | dict(extra or {})


@contextlib.contextmanager
def target_capability(compute_capability: str) -> Iterator[None]:
    """JAX's cuDNN attention checks the *default* backend's first GPU for Hopper features
    (packed documents, head dims), which on this host is a CPU: during a target compile the
    checks answer for the target instead. The two names are JAX internals, isolated here;
    ``tests/test_gpu_target.py`` fails loudly when a JAX upgrade moves them."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    target = tuple(int(x) for x in compute_capability.split("."))
    saved = cudnn_attention.check_compute_capability, cudnn_attention.is_cuda_compute_capability_equal
    cudnn_attention.check_compute_capability = lambda c: target >= tuple(int(x) for x in c.split("."))
    cudnn_attention.is_cuda_compute_capability_equal = lambda c: target == tuple(int(x) for x in c.split("."))
    try:
        yield
    finally:
        cudnn_attention.check_compute_capability, cudnn_attention.is_cuda_compute_capability_equal = saved


def compile_for_target(
    config: Config, mesh_sizes: MeshSizes | None, hardware: Hardware, gpus: int, gpus_per_node: int, extra_options: dict | None = None
) -> tuple[Any, Any, dict[str, Any]]:
    """(trainer, compiled step, compiler options) of ``config`` on ``gpus`` target devices:
    the same trainer ``jaxdist.train`` builds, lowered on abstract shapes."""
    devices = target_devices(hardware, gpus, gpus_per_node)
    if mesh_sizes is not None and mesh_device_count(mesh_sizes) != gpus:
        raise JaxdistError(f"mesh of {mesh_device_count(mesh_sizes)} devices on {gpus} target GPUs: size it to all of them (or --gpus)")
    import jax

    from jaxdist.plan.latency_profile import compile_scheduled  # imports JAX (its pricing reads the model's attention)
    from jaxdist.training.state import needs_mesh_context

    options = compiler_options(config, extra_options)
    with target_capability(hardware.device["compute_capability"]):
        trainer = build_trainer(config, mesh_sizes, devices)
        batch = trainer.abstract_batch(config.train.global_batch)
        # a state in host memory is described on the abstract mesh (training.state.in_memory)
        mesh_context = jax.set_mesh(trainer.layout.mesh) if needs_mesh_context(trainer.state_shardings) else contextlib.nullcontext()
        with mesh_context:
            lowered = trainer.train_step.lower(trainer.abstract_state(), batch)
    on_target = dataclasses.replace(hardware, gpus_per_node=gpus_per_node)
    mesh_shape = dict(trainer.layout.mesh.shape)
    codegen = deviceless_codegen_options()
    schedule = lambda codegen: compile_scheduled(  # noqa: E731
        lowered, options | codegen, config.train.latency_profile, mesh_shape, on_target, allowed_memory(on_target)
    )
    try:
        compiled, options = schedule(codegen)
    except Exception as e:  # the kernel cache could not be written (a full disk, say): it is only a cache
        cache = codegen.get(KERNEL_CACHE_OPTION)
        if cache is None or cache not in str(e):
            raise
        log.warning(f"the GPU kernel cache {cache} could not be used ({str(e).strip().splitlines()[0]}); compiling without it")
        codegen = {name: value for name, value in codegen.items() if name != KERNEL_CACHE_OPTION}
        compiled, options = schedule(codegen)
    return trainer, compiled, {name: value for name, value in options.items() if name not in {*DEVICELESS_CODEGEN, *codegen}}


# A program compiled for a target is read (its schedule, buffers and kernels, all fixed before
# code generation) and never run: ptxas at -O0 (run once per kernel) takes a third less CPU on
# the same kernels, LLVM skips its expensive passes (tests/test_gpu_target.py compares the programs).
DEVICELESS_CODEGEN = {"xla_gpu_disable_gpuasm_optimizations": True, "xla_llvm_disable_expensive_passes": True}
# The kernels a target compile generates are kept for the next one (the latency profile's second
# compile, the planner's layouts, the next analyze of the model): XLA looks each up by its fused
# computation and launch sizes, and replaces the file atomically, so processes share it. XLA reads
# and rewrites the whole file at each compile: past KERNEL_CACHE_LIMIT it starts again.
KERNEL_CACHE_OPTION = "xla_gpu_kernel_cache_file"
KERNEL_CACHE_LIMIT = 256 << 20


def deviceless_codegen_options() -> dict[str, Any]:
    """``DEVICELESS_CODEGEN`` and the kernel cache (``kernel_cache_file``), less any flag the user set in ``XLA_FLAGS``."""
    user = user_flags()
    options = {name: value for name, value in DEVICELESS_CODEGEN.items() if name not in user}
    if KERNEL_CACHE_OPTION not in user:
        options[KERNEL_CACHE_OPTION] = str(kernel_cache_file())
    return options


def kernel_cache_file() -> Path:
    """This user's file of kernels generated by target compiles (``private_dir``), one per jaxlib."""
    import jaxlib

    directory = private_directory("jaxdist-gpu-kernels", f"or name your own file with --{KERNEL_CACHE_OPTION} in XLA_FLAGS")
    path = directory / f"kernels-jaxlib-{jaxlib.__version__}.pb"
    try:
        data = path.read_bytes() if path.stat().st_size <= KERNEL_CACHE_LIMIT else None
    except FileNotFoundError:
        return path
    if data is None:
        path.unlink(missing_ok=True)
    elif not _well_formed(data):  # XLA would fail the compile on it (XLA writes it whole: damaged from outside)
        log.warning(f"the GPU kernel cache {path} is not a whole cache file (cut short or overwritten); starting it again")
        path.unlink(missing_ok=True)
    return path


def _well_formed(data: bytes) -> bool:
    """Whether ``data`` walks as a protocol buffer message's fields to its end (their contents unread)."""

    def varint(i: int) -> tuple[int, int]:
        value, shift = 0, 0
        while i < len(data) and shift < 64:
            value |= (data[i] & 0x7F) << shift
            i, shift = i + 1, shift + 7
            if not data[i - 1] & 0x80:
                return value, i
        raise ValueError("varint")

    i = 0
    try:
        while i < len(data):
            key, i = varint(i)
            wire = key & 7
            if wire == 0:
                _, i = varint(i)
            elif wire == 2:
                size, i = varint(i)
                i += size
            elif wire in (1, 5):
                i += 8 if wire == 1 else 4
            else:
                return False
            if i > len(data):
                return False
    except ValueError:
        return False
    return True


def target_report(trainer: Any, compiled: Any, hardware: Hardware, options: dict[str, Any], gpus_per_node: int) -> dict[str, Any]:
    """``analyze --target``'s JSON: the CPU report's keys for the GPU program, plus ``target``,
    ``memory_per_device_bytes.peak``, ``fits`` (and ``fits_note``), ``kernels``, ``host_offload``
    (what the program keeps in host memory and its transfers: ``inspect.host_offload``), each
    collective kind's ``async``, ``overlapped_fraction`` and ``exposed_s``, ``step_s``,
    ``exposed_s`` and ``exposed_fraction`` (``exposure``), and ``xla_flags``."""
    from jaxdist.inspect.step_report import build_report, device_peak  # imports JAX (see the module doc)
    from jaxdist.models.fp8 import amax_sync_note

    report = build_report(trainer, compiled)
    module = parse_hlo(compiled.as_text())
    peak = device_peak(compiled)
    report["memory_per_device_bytes"]["peak"] = peak
    allowed = allowed_memory(hardware)
    report["target"] = {
        "name": hardware.key,
        "description": hardware.device["description"],
        "compute_capability": str(hardware.device["compute_capability"]),
        "memory_bytes": int(hardware.memory_bytes),
        "gpus_per_node": min(gpus_per_node, report["devices"]),
        "hosts": max(1, report["devices"] // gpus_per_node),
    }
    report["fits"] = peak <= allowed
    report["fits_note"] = (
        f"peak {peak / 2**30:.1f} GiB of the {allowed / 2**30:.1f} GiB JAX may allocate "
        f"(XLA_PYTHON_CLIENT_MEM_FRACTION {memory_fraction():g} of {hardware.memory_bytes / 2**30:.1f} GiB)"
    )
    report["kernels"] = kernel_counts(module)
    report["host_offload"] = host_offload(module)
    for kind, schedule in collective_schedule(module, report["mesh"]).items():
        if kind in report["collectives"]:
            report["collectives"][kind]["async"] = schedule["async"]
            report["collectives"][kind]["overlapped_fraction"] = schedule["overlapped_fraction"]
    report.update(exposure(trainer, module, dataclasses.replace(hardware, gpus_per_node=gpus_per_node), report))
    report["xla_flags"] = xla_flags_in_force(options)
    report["notes"] = [note for note in report["notes"] if "xla_flops_per_device" not in note]
    amax_note = amax_sync_note(trainer.config.model, collective_schedule(module).get("all-reduce", {}))
    if amax_note:
        report["notes"].append(amax_note)
    return report


def exposure(trainer: Any, module: Any, hardware: Hardware, report: dict[str, Any]) -> dict[str, Any]:
    """The planner's price of XLA:GPU's schedule (``plan.cost``'s replay, its kernel model):
    ``step_s`` (one step, predicted), per collective kind in ``collectives`` its ``exposed_s``
    (the seconds per step the compute stream waits for that kind: the part of its time no kernel
    in its start..done window covers, loops' trip counts included), and their sum ``exposed_s``
    with its share of the step ``exposed_fraction``. Unlike ``overlapped_fraction`` (a window
    with any kernel in it counts as overlapped), a collective longer than its window's compute
    shows here by how much."""
    from jaxdist.plan.cost import HOST_TRANSFER, predict
    from jaxdist.plan.gpu_cost import gpu_program_cost

    config = trainer.config
    cost = gpu_program_cost(module, report["mesh"])
    prediction = predict(
        cost,
        hardware,
        report["mesh"],
        model_flops_per_step=report["flops_per_step"],
        tokens_per_step=float(trainer.task.tokens_per_example * config.train.global_batch),
        bubble=float(report.get("pipeline", {}).get("bubble", 0.0)),
    )
    by_kind = prediction.exposed_s or {}
    if "host_offload" in report:
        report["host_offload"]["exposed_s"] = by_kind.get(HOST_TRANSFER, 0.0)
    for kind, stats in report["collectives"].items():
        stats["exposed_s"] = by_kind.get(kind, 0.0) if stats["count"] else 0.0
    total = sum(by_kind.values())
    step = prediction.step_time_s
    return {"step_s": step, "exposed_s": total, "exposed_fraction": total / step if step else 0.0}
