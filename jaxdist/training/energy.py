"""Energy of training: a meter of this process's GPUs and the joules of each log interval.

A meter returns a total energy counter in joules over this process's local GPUs (or None
when it cannot be read). The one real meter reads NVML's board energy counter
(``nvmlDeviceGetTotalEnergyConsumption``: millijoules since the driver loaded) through
``nvidia-ml-py`` (the ``cuda12`` extra). It counts the GPU boards only: not the CPUs, host
memory, network, storage or cooling. Without a GPU, NVML or an energy counter there is
no meter, and ``joules_per_token`` / ``power_w`` are logged as null.

``IntervalEnergy`` turns two readings into the joules of one interval of training,
summed over the processes (one all-gather at each log point, only with several).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Protocol


class Meter(Protocol):
    def joules(self) -> float | None:
        """The energy counter over this process's GPUs, in joules (None: unreadable now)."""


class NvmlMeter:
    """NVML's total-energy counters of some GPUs, summed."""

    def __init__(self, nvml, handles: list):
        self._nvml, self._handles = nvml, handles

    def joules(self) -> float | None:
        try:
            return sum(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self._handles) / 1e3
        except self._nvml.NVMLError:
            return None


def _nvml_handles(nvml, devices: list) -> list:
    """NVML's handle for each local JAX GPU. JAX numbers the GPUs CUDA shows it
    (``CUDA_VISIBLE_DEVICES``: indices or UUIDs) while NVML sees every GPU of the node."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    handles = []
    for device in devices:
        ordinal = device.local_hardware_id if device.local_hardware_id is not None else device.id
        name = visible[ordinal] if ordinal < len(visible) else str(ordinal)
        if name.isdigit():
            handles.append(nvml.nvmlDeviceGetHandleByIndex(int(name)))
        else:  # GPU-<uuid> (a MIG-<uuid> slice has no energy counter of its own: NVML raises)
            handles.append(nvml.nvmlDeviceGetHandleByUUID(name))
    return handles


def open_meter(devices: list) -> tuple[Meter | None, str]:
    """The meter of this process's devices among ``devices``, or (None, why there is none)."""
    import jax

    local = [d for d in devices if d.process_index == jax.process_index()]
    platform = local[0].platform if local else "none"
    if platform != "gpu":
        return None, f"no energy counter on {platform} devices"
    try:
        import pynvml  # nvidia-ml-py: imported only on GPUs
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install 'jaxdist[cuda12]')"
    try:
        pynvml.nvmlInit()
        meter = NvmlMeter(pynvml, _nvml_handles(pynvml, local))
        for handle in meter._handles:  # a GPU without the counter (pre-Volta, a MIG slice) raises here
            pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except (pynvml.NVMLError, IndexError) as e:
        return None, f"NVML cannot read the GPUs' energy counters ({e})"
    return meter, ""


def agree_on_meter(meter: Meter | None, reason: str) -> tuple[Meter | None, str]:
    """Every process measures, or none does: with several processes, one all-gather of
    whether each has a meter (the per-interval all-gather must happen on all or none)."""
    import jax

    if jax.process_count() == 1:
        return meter, reason
    import numpy as np
    from jax.experimental import multihost_utils

    have = np.asarray(multihost_utils.process_allgather(np.int32(meter is not None)))
    if have.all():
        return meter, reason
    return None, reason or f"process(es) {', '.join(map(str, np.flatnonzero(have == 0)))} cannot read their GPUs' energy counters"


def sum_over_processes(value: float) -> float:
    """``value`` summed over every process (NaN where any is unknown)."""
    import numpy as np

    from jaxdist.cluster import recoverable

    # float32 (JAX's default width): the joules of one interval, not the counters' totals, so 7 digits suffice
    return float(np.sum(np.asarray(recoverable.process_allgather(np.float32(value), "energy"), np.float64)))


class IntervalEnergy:
    """Wall time and joules of the training between ``start()`` and ``stop()`` (or ``lap()``).

    Intervals tile the training's wall clock: a log point read while the next step already
    runs ends its interval with ``lap()``, which starts the next one at the same instant and
    meter reading. After a log point's eval or checkpoint save, where nothing trains, the
    loop ``stop()``s and ``start()``s again once they are done, so neither is in an interval.
    ``stop()`` sums the joules over the processes (``total``; the identity on one).
    """

    def __init__(self, meter: Meter | None = None, *, total: Callable[[float], float] | None = None, clock=time.perf_counter):
        import jax

        self.meter, self._clock = meter, clock
        self._total = total or (sum_over_processes if jax.process_count() > 1 else (lambda x: x))
        self._time = self._joules = None

    def start(self) -> None:
        self._time = self._clock()
        self._joules = self._read()

    def stop(self) -> tuple[float, float | None]:
        """(seconds, joules over every process or None) since ``start()``."""
        return self._since(self._clock(), self._read())

    def lap(self) -> tuple[float, float | None]:
        """``stop()``, and the next interval starts at that same clock and meter reading."""
        now, reading = self._clock(), self._read()
        interval = self._since(now, reading)
        self._time, self._joules = now, reading
        return interval

    def _since(self, now: float, reading: float | None) -> tuple[float, float | None]:
        seconds = now - self._time
        if self.meter is None:
            return seconds, None
        local = math.nan if reading is None or self._joules is None else reading - self._joules
        joules = self._total(local)
        return seconds, joules if math.isfinite(joules) else None

    def _read(self) -> float | None:
        return None if self.meter is None else self.meter.joules()


def energy_fields(joules: float | None, seconds: float, tokens: int) -> dict[str, float | None]:
    """metrics.jsonl's ``joules_per_token`` and ``power_w`` of one interval (null: no meter)."""
    if joules is None:
        return {"joules_per_token": None, "power_w": None}
    return {"joules_per_token": joules / tokens, "power_w": joules / seconds if seconds > 0 else None}
