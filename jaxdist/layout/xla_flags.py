"""XLA flags jaxdist sets: on GPUs, overlap communication with compute; under the launcher,
bounded collectives (``with_collective_timeouts``).

Applied only where a CUDA plugin is installed, before the backend starts, and only for
flags the user has not set in ``XLA_FLAGS`` (theirs win). ``JAXDIST_XLA_DEFAULTS=0``
turns all of them off. Every flag here must parse on the jaxlib in use: a flag XLA does
not know aborts the process, so ``tests/test_distributed.py`` starts a backend with them.
"""

from __future__ import annotations

import math
import os

from jaxdist.errors import MeshError
from jaxdist.layout.mesh import parse_mesh
from jaxdist.layout.strategy import zero_stage

GPU_FLAGS: dict[str, str] = {
    # What each flag changes in llama3-8b's compiled step (exposed collective bytes, overlap,
    # memory, with and without it): experiments/README.md, "xla_flags_table.py". Left out as
    # changing nothing there: xla_gpu_enable_pipelined_reduce_scatter (XLA's default, and off it
    # changes nothing either) and the collective matmul flags (xla_gpu_threshold_for_windowed_einsum_mib,
    # xla_gpu_multi_streamed_windowed_einsum): jaxdist's tensor parallelism all-reduces, so XLA
    # finds no all-gather or reduce-scatter beside a matmul to window.
    #
    # schedule collectives early and overlap them with independent compute. On Hopper XLA 0.10.2
    # runs this scheduler anyway (its analytical latency estimator turns it on); on an A100,
    # llama3-8b on fsdp=8 leaves 14 GB of collectives a step exposed without it
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # XLA's collective pipeliner moves a layer's collectives into the neighbouring iteration of
    # the layer scan. jaxlib 0.10.2's CUDA plugin links and runs it (its pass dumps show it
    # rewriting the step; openxla/xla#44228 looked for it in libjax_common.so, not the plugin):
    # the next layer's weights are gathered during this one (matmul-free windows 6.7 GB
    # instead of 11.7 GB on fsdp=8)
    "xla_gpu_enable_pipelined_all_gather": "true",
    # ... and each layer's gradient reduce-scatter (an all-reduce until after this pass) runs
    # during the previous layer's backward (6.7 GB instead of 40 GB; +1.7 GiB peak)
    "xla_gpu_enable_pipelined_all_reduce": "true",
    # fewer, larger NCCL calls (combine small collectives up to 128 MiB; XLA's default 30 MiB):
    # 194 all-gathers and 35 reduce-scatters a step instead of 321 and 131, and on
    # data=2,fsdp=4 68 all-reduces instead of 164, fewer of them exposed
    "xla_gpu_all_gather_combine_threshold_bytes": str(128 * 2**20),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(128 * 2**20),
    "xla_gpu_all_reduce_combine_threshold_bytes": str(128 * 2**20),
    # unroll the layer scan by two so the pipelined buffers alternate instead of being copied
    # every iteration (131 copy kernels a step instead of 859)
    "xla_gpu_enable_while_loop_double_buffering": "true",
    # let the scheduler start a second collective while one is in flight (XLA's default 1). XLA
    # 0.10.2 still runs every collective on its one collective stream, in order (one operation
    # queue in the scheduled HLO): each starts earlier, none runs beside another, so no NCCL
    # ordering hazard. The data-parallel step of Megatron-LM's 1.7B row on 48 H100 exposes
    # 0.200 s of all-reduce instead of 0.257 s (both backward all-reduces of a scanned layer pair
    # now open across the pair, not one after the other); no published row got slower, the
    # largest peak +0.3 GiB (experiments/README.md, "Data-parallel gradients behind the backward")
    "xla_gpu_experimental_parallel_collective_overlap_limit": "2",
}

# None on CPUs: --xla_cpu_enable_concurrency_optimized_scheduler=false made a 2-process
# gloo step 14% faster (0.448 -> 0.386 s) but deadlocks fsdp x tensor meshes on jaxlib
# 0.10.2 (devices enter different collectives first: a rendezvous timeout with fake
# devices, a gloo size mismatch across processes); experiments/README.md, "ddp_gap.py".


# fp8 runs (model.fp8) need no flag of their own: models.fp8's dots take the fp8 arrays, which
# XLA:GPU can only run as fp8 GEMMs (a Triton fp8 gemm or cuBLASLt's). The flag route to them,
# --xla_gpu_enable_triton_gemm=false, would also move every bf16 GEMM from Triton to cuBLAS.


def flag_values(xla_flags: str) -> dict[str, str]:
    """The flags an ``XLA_FLAGS`` string sets, by name without dashes (a bare flag's value is its name)."""
    return {token.split("=", 1)[0].lstrip("-"): token.split("=", 1)[-1] for token in xla_flags.split()}


def user_flags() -> dict[str, str]:
    """The flags this process's ``XLA_FLAGS`` sets (theirs win over jaxdist's)."""
    return flag_values(os.environ.get("XLA_FLAGS", ""))


def gpu_flags(config=None) -> dict[str, str]:
    """The GPU flags a run of ``config`` gets (None: the ones every run gets)."""
    flags = dict(GPU_FLAGS)
    if config is not None and _replicated_weights(config):
        # Double buffering pays for pipelined weight gathers. With the weights whole on every
        # device, the unrolled pair's second gradient all-reduce starts one GEMM before the pair
        # ends and must finish there; one layer per iteration leaves it the next layer's compute
        # (Megatron-LM's 1.7B row on 48 H100: 0.527 s predicted instead of 0.623, 0.103 s of
        # all-reduce exposed instead of 0.200; experiments/README.md, "Data-parallel gradients
        # behind the backward")
        flags["xla_gpu_enable_while_loop_double_buffering"] = "false"
    if config is not None and _collective_matmuls(config):
        # Collective matmuls (models.collective_matmul) keep a permute in flight beside nearly
        # every GEMM of a layer; the unrolled pair then leaves the next pair's FSDP weight gathers
        # no room to start early. One layer per iteration: llama3-70b's pick on 64 H100 (fsdp=16,
        # tensor=4) 9.08 s predicted instead of 10.14, all-gathers exposed 0.02 s instead of 1.32
        # (experiments/README.md, "Tensor-parallel collective matmuls")
        flags["xla_gpu_enable_while_loop_double_buffering"] = "false"
    if config is not None and _hybrid_sharded(config):
        # FSDP inside data parallelism (HSDP): each layer's gradient shards are all-reduced over
        # data once its reduce-scatter over fsdp is done. Combined up to 128 MiB they wait for
        # several layers and run late in the backward; at 16 MiB each starts behind its own layer
        # (Megatron-LM's 7.1B on data=12,fsdp=8, 96 H100: 0.852 s predicted instead of 0.914;
        # 1.7B on data=6,fsdp=8: 0.404 instead of 0.409; llama3-8b on data=2,fsdp=4, one host:
        # 0.984 instead of 0.985; experiments/README.md, "Data-parallel gradients behind the backward")
        flags["xla_gpu_all_reduce_combine_threshold_bytes"] = str(HYBRID_ALL_REDUCE_COMBINE)
    return flags


HYBRID_ALL_REDUCE_COMBINE = 16 * 2**20


def _split_axes(config) -> tuple[dict[str, int], set[str]] | None:
    """The mesh's sizes and its axes above 1 (-1: sized later, above 1 too); None for a mesh
    refused where it is built (with its own line) or ``auto`` (decided later)."""
    try:
        sizes = parse_mesh(config.parallel.mesh)
    except MeshError:
        return None
    if not sizes:
        return None
    return sizes, {axis for axis, n in sizes.items() if n > 1 or n == -1}


def _hybrid_sharded(config) -> bool:
    """Weights sharded over fsdp and gradients also all-reduced over data (both axes above 1),
    without tensor, context, expert or pipe axes (what was measured)."""
    if (mesh := _split_axes(config)) is None:
        return False
    sizes, split = mesh
    hybrid = {"data", "fsdp"} <= split and not split & {"tensor", "context", "expert", "pipe"}
    return hybrid and zero_stage(config.parallel.strategy, sizes) == "fsdp"


def _collective_matmuls(config) -> bool:
    """``parallel.collective_matmul`` on a mesh with a tensor axis (without one the key has no effect)."""
    mesh = _split_axes(config)
    return bool(config.parallel.collective_matmul) and mesh is not None and "tensor" in mesh[1]


def _replicated_weights(config) -> bool:
    """A data-parallel layout whose layer scans gather no weights: dp or zero1 over a batch
    axis, without fsdp, context, expert or pipe axes (what was measured)."""
    if (mesh := _split_axes(config)) is None:
        return False
    sizes, split = mesh
    batched = bool(split & {"data", "replica"})
    sharded = bool(split & {"fsdp", "context", "expert", "pipe"})
    return zero_stage(config.parallel.strategy, sizes) in ("dp", "zero1") and batched and not sharded


def with_gpu_defaults(xla_flags: str, config=None) -> str:
    """``xla_flags`` plus every default flag it does not already set."""
    present = flag_values(xla_flags)
    extra = [f"--{name}={value}" for name, value in gpu_flags(config).items() if name not in present]
    return " ".join([xla_flags.strip(), *extra]).strip()


def apply_gpu_defaults(config=None) -> None:
    if os.environ.get("JAXDIST_XLA_DEFAULTS", "1") != "0":
        os.environ["XLA_FLAGS"] = with_gpu_defaults(os.environ.get("XLA_FLAGS", ""), config)


# A collective whose peer is gone fails after this long instead of XLA's 30 minutes (jaxlib
# 0.10.2's names, found in its flag parser; tests/test_distributed.py starts a backend with
# them, so a jaxlib that renames one fails there). The launcher sizes them from --hang-timeout
# and --first-step-timeout (the first collective waits for every process's compile).
COLLECTIVE_TIMEOUTS = {
    "xla_cpu_collective_timeout_seconds": "each",  # gloo's send/receive on CPU
    "xla_cpu_collective_call_terminate_timeout_seconds": "each",  # the devices of one process meeting
    "xla_gpu_nccl_termination_timeout_seconds": "each",  # a rendezvous for an NCCL collective
    "xla_gpu_first_collective_call_terminate_timeout_seconds": "first",
}


def with_collective_timeouts(xla_flags: str, each_s: float, first_s: float) -> str:
    """``xla_flags`` with the collective timeouts it does not set itself, put first: XLA reads its
    flags up to the first token that is not one (``intra_op_parallelism_threads=1`` in many
    recipes), and a flag after it would be ignored."""
    present = flag_values(xla_flags)
    seconds = {"each": max(1, math.ceil(each_s)), "first": max(1, math.ceil(max(first_s, each_s)))}
    extra = [f"--{name}={seconds[kind]}" for name, kind in COLLECTIVE_TIMEOUTS.items() if name not in present]
    return " ".join([*extra, xla_flags.strip()]).strip()
