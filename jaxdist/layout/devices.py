"""The devices a mesh needs, arranged before JAX starts its backend: fake CPU devices
split over the processes (no accelerator), or the GPU communication-overlap XLA flags;
and a ``-1`` mesh axis sized to the devices there are."""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import importlib.util
import logging
import os
import re
import sys
import types

from jaxdist.config import Config
from jaxdist.errors import JaxdistError
from jaxdist.layout.mesh import MeshSizes, format_mesh, has_remaining_axis, mesh_device_count, parse_mesh, resolve_mesh
from jaxdist.layout.validate import check_config_on_mesh
from jaxdist.layout.xla_flags import apply_gpu_defaults

log = logging.getLogger(__name__)

DEFAULT_FAKE_DEVICES = 8  # `--mesh auto` without an accelerator


def prepare_devices(config: Config, num_processes: int = 1) -> MeshSizes | None:
    """Validate the mesh against the config; on CPU ask for enough fake devices (split
    over the processes), on GPU set the communication-overlap XLA flags.

    Runs before JAX starts its backend. Returns the mesh sizes (None for ``auto``; on GPU
    a ``-1`` axis stays unresolved until ``settle_remaining_axis`` sees the devices).
    Resolve the vocab first (``jaxdist.data.sources.resolve_vocab``) for the tensor axis's
    check to see it.
    """
    run_on_cpu_unless_gpu()
    settle_remaining_axis(config, num_processes)
    sizes = parse_mesh(config.parallel.mesh)
    if has_remaining_axis(sizes):  # GPU: sized and checked once the backend has started
        apply_gpu_defaults(config)
        return sizes
    if config.parallel.dcn_mesh:
        parse_mesh(config.parallel.dcn_mesh)  # reject a malformed spec before JAX starts
    if sizes is not None:
        check_config_on_mesh(config, sizes)  # warnings are printed once, by build_trainer
    if gpu_plugin_installed():
        apply_gpu_defaults(config)
        return sizes
    if sizes is not None:
        if mesh_device_count(sizes) % num_processes:
            raise JaxdistError(
                f"mesh {config.parallel.mesh} ({mesh_device_count(sizes)} devices) does not split over {num_processes} processes"
            )
        ensure_fake_cpu_devices(mesh_device_count(sizes) // num_processes, exact=num_processes > 1)
    else:
        ensure_fake_cpu_devices(DEFAULT_FAKE_DEVICES)
    return sizes


def settle_remaining_axis(config: Config, num_processes: int = 1, n_devices: int | None = None, *, quiet: bool = False) -> None:
    """Size a ``-1`` mesh axis and write the concrete mesh into the config (so the saved
    config.yaml says what ran). On CPU the device count is the fake devices per process x
    processes, known before JAX starts; on GPU it waits for ``n_devices``. ``quiet``: not
    process 0 (only it says what the axis became)."""
    sizes = parse_mesh(config.parallel.mesh)
    if not has_remaining_axis(sizes):
        return
    if n_devices is None:
        if gpu_plugin_installed():
            return
        n_devices = (forced_host_device_count() or DEFAULT_FAKE_DEVICES) * num_processes
    resolved = resolve_mesh(sizes, n_devices)
    if not quiet:
        log.info(f"mesh {config.parallel.mesh} on {n_devices} devices is {format_mesh(resolved)}")
    config.parallel.mesh = format_mesh(resolved)


CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def cuda_plugin_installed() -> bool:
    """Whether a JAX CUDA plugin is installed (it may have no GPU to run on)."""
    return any(_module_exists(p) for p in CUDA_PLUGINS)


def cuda_plugin_mismatch() -> str | None:
    """One line when the installed CUDA plugin is not built for the installed jaxlib (a
    plugin release ahead of jaxlib fails deep inside the compile); read from the packages'
    metadata, so JAX need not start."""
    try:
        jaxlib = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return None
    for package in ("jax-cuda12-plugin", "jax-cuda13-plugin"):
        try:
            plugin = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        if plugin != jaxlib:
            return f'{package} {plugin} is not built for jaxlib {jaxlib}: pip install "{package}=={jaxlib}" (or pip install -e ".[dev]")'
    return None


def gpu_plugin_installed() -> bool:
    """Whether this process trains on GPUs: a CUDA plugin, and a GPU the driver shows it
    (``JAX_PLATFORMS=cpu``: never). The plugin alone is not enough: CI machines and
    laptops have it for compiling GPU programs without a GPU (``jaxdist.analyze --target``)."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    return cuda_plugin_installed() and cuda_device_count() > 0


@functools.cache
def cuda_device_count() -> int:
    """GPUs the CUDA driver shows this process (``CUDA_VISIBLE_DEVICES`` applies); 0 without
    a driver. Asks libcuda directly, before JAX starts its backend."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def run_on_cpu_unless_gpu() -> None:
    """Before JAX starts: a process with no GPU to use (``JAX_PLATFORMS=cpu``, or a CUDA plugin
    with no GPU to see) runs on CPU and leaves the plugin unloaded. ``import jax`` would
    otherwise load the plugin's extensions and call its ``initialize()``, whose probes for a
    driver print "Could not find cuda drivers" lines a CPU run has no use for: stand-ins take
    the plugin's module names in this process. Without ``JAX_PLATFORMS`` set, one line says
    that the plugin found no GPU. (``analyze --target``, which compiles for a GPU, never calls this.)"""
    if not cuda_plugin_installed() or "jax" in sys.modules:
        return
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() != "cpu":
        if os.environ.get("JAX_PLATFORMS") or cuda_device_count() > 0:
            return  # a GPU run, or the user's own choice of platforms
        os.environ["JAX_PLATFORMS"] = "cpu"
        log.info("the CUDA plugin is installed but found no GPU (no driver or no visible device): training on CPU")
    for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"):
        stand_in = types.ModuleType(name, "jaxdist: the CUDA plugin, left unloaded in a process that runs on CPU")
        stand_in.initialize = lambda: None
        sys.modules.setdefault(name, stand_in)


def _module_exists(name: str) -> bool:
    if name in sys.modules:  # imported, or stood in for (run_on_cpu_unless_gpu)
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # parent package missing
        return False


def forced_host_device_count() -> int | None:
    match = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(match.group(1)) if match else None


def ensure_fake_cpu_devices(n: int, *, exact: bool = False) -> None:
    """Ask XLA for ``n`` host devices; must run before JAX starts its backend.

    ``exact``: one of several processes, each holding ``n`` of the mesh's devices: a larger
    count (a user's XLA_FLAGS) is cut to ``n``, else the mesh's first devices would all be
    process 0's and the others would hold none of the batch. Alone, more devices do no harm.
    On a machine with a GPU plugin nothing changes: a GPU mesh must match real devices.
    """
    run_on_cpu_unless_gpu()
    if gpu_plugin_installed() or "jax" in sys.modules and backend_started():
        return
    forced = forced_host_device_count()
    if (forced or 1) == n or not exact and (n <= 1 or forced is not None and forced > n):
        return
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    instead = f" (not XLA_FLAGS' {forced}: each process holds its share of the mesh)" if forced is not None else ""
    log.info(f"no accelerator; using {n} fake CPU devices for the mesh{instead}")


def backend_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)  # noqa: SLF001 - no public "is initialised" query
    except (ImportError, AttributeError):
        return False
