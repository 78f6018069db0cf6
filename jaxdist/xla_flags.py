"""XLA flags jaxdist sets by default: on GPUs, overlap communication with compute; on
CPUs, XLA's memory-minimising scheduler.

Applied before the backend starts (the GPU set only where a CUDA plugin is installed, the
CPU set otherwise), and only for flags the user has not set in ``XLA_FLAGS`` (theirs win). ``JAXDIST_XLA_DEFAULTS=0``
turns all of them off. Every flag here must parse on the jaxlib in use: a flag XLA does
not know aborts the process, so ``tests/test_distributed.py`` starts a backend with them.
"""

from __future__ import annotations

import os

GPU_FLAGS: dict[str, str] = {
    # schedule collectives early and overlap them with independent compute
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # overlap per-layer FSDP all-gathers / reduce-scatters with the neighbouring layers
    # (accepted by jaxlib 0.10; whether the pipeliner pass runs depends on the XLA build,
    # see openxla/xla#44228)
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    # fewer, larger NCCL calls (combine small collectives up to 128 MiB)
    "xla_gpu_all_gather_combine_threshold_bytes": str(128 * 2**20),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(128 * 2**20),
    "xla_gpu_all_reduce_combine_threshold_bytes": str(128 * 2**20),
    # double-buffer the layer scan so the next layer's gather overlaps this layer
    "xla_gpu_enable_while_loop_double_buffering": "true",
}

CPU_FLAGS: dict[str, str] = {
    # The concurrency-optimised scheduler keeps more buffers live to run more thunks at
    # once; with two cores shared by several processes that only adds contention. Off:
    # 2 processes x 1 device over gloo 0.448 -> 0.386 s/step, 1 process 0.201 -> 0.188 s,
    # fake devices unchanged (experiments/README.md, "Closing the gap to DDP").
    "xla_cpu_enable_concurrency_optimized_scheduler": "false",
}


def with_defaults(xla_flags: str, defaults: dict[str, str]) -> str:
    """``xla_flags`` plus every flag of ``defaults`` it does not already set."""
    present = {token.split("=", 1)[0].lstrip("-") for token in xla_flags.split()}
    extra = [f"--{name}={value}" for name, value in defaults.items() if name not in present]
    return " ".join([xla_flags.strip(), *extra]).strip()


def with_gpu_defaults(xla_flags: str) -> str:
    return with_defaults(xla_flags, GPU_FLAGS)


def with_cpu_defaults(xla_flags: str) -> str:
    return with_defaults(xla_flags, CPU_FLAGS)


def apply_defaults(gpu: bool) -> None:
    """Add the platform's defaults to ``XLA_FLAGS`` unless ``JAXDIST_XLA_DEFAULTS=0``."""
    if os.environ.get("JAXDIST_XLA_DEFAULTS", "1") != "0":
        os.environ["XLA_FLAGS"] = (with_gpu_defaults if gpu else with_cpu_defaults)(os.environ.get("XLA_FLAGS", ""))
