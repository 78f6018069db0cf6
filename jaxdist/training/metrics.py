"""Throughput and MFU, and where metrics go: metrics.jsonl, TensorBoard, a progress bar (and,
with ``log.wandb``, Weights & Biases: ``training.wandb_log``).

Only process 0 writes or prints.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

# Dense bf16 peak per device (FLOP/s) from the vendors' datasheets, by substring of jax's
# device_kind; the first match wins, so the PCIe and NVL variants come before plain H100.
GPU_PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200", 989e12),
    ("H100", 989e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 125e12),
)

# Dense fp8 peak per device (FLOP/s): twice the bf16 dense peak on Hopper and Ada (the
# datasheets' fp8 figures are with sparsity: halved here); A100 and A10G have no fp8.
GPU_FP8_PEAK_FLOPS = (
    ("H100 PCIe", 1513e12),
    ("H100 NVL", 1671e12),
    ("H200", 1979e12),
    ("H100", 1979e12),
    ("L40S", 733e12),
)


@functools.cache
def measured_cpu_peak_flops(n: int = 1024, repeats: int = 5) -> float:
    """Peak of the whole host, by a large fp32 matmul on one device (median of repeats)."""
    import jax
    import jax.numpy as jnp

    device = jax.local_devices(backend="cpu")[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / sorted(times)[len(times) // 2]


def peak_flops_per_device(devices: list, override: float = 0.0) -> float:
    """Peak FLOP/s of one device; fake CPU devices share the host, so they split its peak."""
    if override > 0:
        return override
    kind = devices[0].device_kind
    for name, peak in GPU_PEAK_FLOPS:
        if name.lower() in kind.lower():
            return peak
    if devices[0].platform == "cpu":
        local = sum(1 for d in devices if d.process_index == devices[0].process_index)
        return measured_cpu_peak_flops() / max(local, 1)
    return math.nan  # unknown accelerator: MFU is logged as null rather than guessed (set train.peak_flops)


def fp8_peak_flops_per_device(devices: list) -> float:
    """Dense fp8 peak FLOP/s of one device: NaN (``mfu_fp8_peak`` null) on CPU and on GPUs
    without fp8 or not in the table."""
    kind = devices[0].device_kind.lower()
    for name, peak in GPU_FP8_PEAK_FLOPS:
        if name.lower() in kind:
            return peak
    return math.nan


TIMELINE_KEYS = {"wall_time", "window_steps"}  # a window line's place in time (cluster.goodput): not charted


class MetricsLogger:
    """Writes one JSON object per logged step to metrics.jsonl, scalars to TensorBoard,
    and keeps a progress bar with loss and tokens/s. A no-op on processes other than 0 and
    without a run directory (messages are the ``jaxdist`` logger's)."""

    def __init__(self, run_dir: Path | None, total_steps: int, *, enabled: bool = True, progress: bool = True, print_lines: bool = False):
        self.enabled = enabled and run_dir is not None
        self.print_lines = print_lines
        self._jsonl = None
        self._tb = None
        self._bar = None
        self.mirror = None  # another place every line also goes (training.wandb_log's W&B run), set by the run
        if not self.enabled:
            return
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()
        self._tb_dir = run_dir / "tensorboard"  # opened at the first line (a finished run, rerun, writes no empty event file)
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, leave=True, file=sys.stderr)

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in values.items()}}
        self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")  # strict JSON: unknown is null
        if self.mirror is not None:
            self.mirror.log(step, {k: v for k, v in record.items() if k not in TIMELINE_KEYS})
        if self._tb is None:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=str(self._tb_dir))
        for key, value in record.items():
            if key != "step" and key not in TIMELINE_KEYS and isinstance(value, int | float):
                self._tb.add_scalar(key, value, step)
        if "loss" in record and self._bar is not None:
            self._bar.set_postfix(loss=_show(record["loss"], ".4f"), tok_s=_show(record.get("tokens_per_sec"), ".0f"), refresh=False)
        elif "loss" in record and self.print_lines:  # no terminal: one line per logged step
            print(
                f"step {step} | loss {_show(record['loss'], '.4f')} | {_show(record.get('tokens_per_sec'), ',.0f')} tok/s "
                f"| mfu {_show(record.get('mfu'), '.3f')}",
                file=sys.stderr,
                flush=True,
            )

    def span(self, step: int, kind: str, start: float, seconds: float) -> None:
        """A ``goodput_span`` line (``cluster.goodput``): metrics.jsonl only, not charted."""
        if self.enabled:
            from jaxdist.cluster.goodput import span_record

            self._jsonl.write(json.dumps({"step": step, "goodput_span": span_record(kind, start, seconds)}) + "\n")

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def messages_above_the_bar(self):
        """Within this block, jaxdist's log lines print above the progress bar (when there is one)."""
        if self._bar is None:
            return contextlib.nullcontext()
        from tqdm.contrib.logging import logging_redirect_tqdm

        return logging_redirect_tqdm(loggers=[logging.getLogger("jaxdist")])

    def close(self, error: BaseException | None = None) -> None:
        """``error``: what stopped the run, if anything (the mirror's run ends as failed)."""
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self.mirror is not None:  # last: W&B's closing summary prints below the bar
            self.mirror.close(error)


def _show(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _plain(value: Any) -> Any:
    """A JSON value: numbers as float, NaN / inf as null (strict JSON has no NaN)."""
    if isinstance(value, int | str | bool) or value is None:
        return value
    if isinstance(value, dict):  # a record of its own (a straggler's)
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return number if math.isfinite(number) else None
