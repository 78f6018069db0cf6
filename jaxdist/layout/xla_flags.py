"""XLA flags jaxdist sets on GPUs: overlap communication with compute.

Applied only where a CUDA plugin is installed, before the backend starts, and only for
flags the user has not set in ``XLA_FLAGS`` (theirs win). ``JAXDIST_XLA_DEFAULTS=0``
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

# None on CPUs: --xla_cpu_enable_concurrency_optimized_scheduler=false made a 2-process
# gloo step 14% faster (0.448 -> 0.386 s) but deadlocks fsdp x tensor meshes on jaxlib
# 0.10.2 (devices enter different collectives first: a rendezvous timeout with fake
# devices, a gloo size mismatch across processes); experiments/README.md, "ddp_gap.py".


# fp8 runs (model.fp8) need no flag of their own: models.fp8's dots take the fp8 arrays, which
# XLA:GPU can only run as fp8 GEMMs (a Triton fp8 gemm or cuBLASLt's). The flag route to them,
# --xla_gpu_enable_triton_gemm=false, would also move every bf16 GEMM from Triton to cuBLAS.


def gpu_flags(config=None) -> dict[str, str]:
    """The GPU flags a run of ``config`` gets (None: the ones every run gets)."""
    return dict(GPU_FLAGS)


def with_gpu_defaults(xla_flags: str, config=None) -> str:
    """``xla_flags`` plus every default flag it does not already set."""
    present = {token.split("=", 1)[0].lstrip("-") for token in xla_flags.split()}
    extra = [f"--{name}={value}" for name, value in gpu_flags(config).items() if name not in present]
    return " ".join([xla_flags.strip(), *extra]).strip()


def apply_gpu_defaults(config=None) -> None:
    if os.environ.get("JAXDIST_XLA_DEFAULTS", "1") != "0":
        os.environ["XLA_FLAGS"] = with_gpu_defaults(os.environ.get("XLA_FLAGS", ""), config)
