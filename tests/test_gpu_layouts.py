"""Every layout the CPU suite trains compiles for H100: llama3-8b's width cut to 4 layers at
seq 8192, compiled by XLA:GPU for 8 compile-only H100s (``jaxdist.plan.gpu_target``).

The layouts other GPU-target tests compile already are not compiled again here (each compile
costs 10-35 s of CPU): ``fsdp`` and ``fsdp`` with microbatches (test_gpu_fits: llama3-8b on
fsdp=8, the 70B pick), ``dp`` and ``fsdp+tp`` (test_gpu_precision: llama3-8b on data=8 and
fsdp=4,tensor=2), ``pipe`` with gpipe and 1f1b (test_gpu_target), context ring and all-to-all
(test_context_gpu), ``expert`` (test_moe_gpu), fp8 (test_fp8_gpu), activation offload
(test_offload). ``tests/README.md`` has the whole matrix.
"""

from __future__ import annotations

import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="JAX's CUDA plugin is not installed (pip install -e '.[dev]')")

from jaxdist.config import load_config  # noqa: E402
from jaxdist.data.sources import resolve_vocab  # noqa: E402
from jaxdist.inspect.gpu_program import collective_schedule, kernel_counts  # noqa: E402
from jaxdist.layout.mesh import parse_mesh  # noqa: E402
from jaxdist.plan.gpu_target import compile_for_target, target_hardware  # noqa: E402

# llama3-8b's width, packed text; XLA's own schedule (what they compile to is the point, tests/test_latency_profile.py the profile)
CUT = ("model.n_layers=4", "train.seq_len=8192", "train.global_batch=16", "model.remat=full", "train.latency_profile=off")
LAYOUTS = {
    # the layout the planner's search found XLA:GPU refusing: accumulation on a data axis without fsdp
    "dp-microbatches": ("data=8", "parallel.strategy=dp", "train.microbatches=2"),
    "zero1": ("data=8", "parallel.strategy=zero1"),
    # with tensor too: the loss's target pick inside the pipeline's region aborted XLA's partitioner
    "pipe-circular-fsdp-tensor": ("fsdp=2,tensor=2,pipe=2", "parallel.schedule=circular", "parallel.virtual_stages=2"),
    "pipe-interleaved-1f1b-microbatches": ("fsdp=4,pipe=2", "parallel.schedule=1f1b", "parallel.virtual_stages=2", "train.microbatches=2"),
    "context-all-gather": ("fsdp=4,context=2", "parallel.context_strategy=all_gather"),
    # DiLoCo vmaps the step over its replicas: cuDNN's packed attention batches itself there
    "diloco": ("replica=2,fsdp=4", "parallel.diloco_inner_steps=4"),
    "compressed-int8": ("data=8", "parallel.strategy=dp", "parallel.grad_reduce=int8"),
    "float16": ("fsdp=8", "model.dtype=float16"),
    "muon": ("fsdp=8", "train.optimizer=muon"),
    # zero bubble: its slots are conditionals per device; the ring's permutes stay async
    "pipe-zb1": ("fsdp=2,pipe=4", "parallel.schedule=zb1", "parallel.pipeline_microbatches=8"),
    # zero bubble in a V: one operation per device per tick, the head in a conditional all devices take
    "pipe-zbv": ("fsdp=4,pipe=2", "parallel.schedule=zbv", "parallel.pipeline_microbatches=4"),
}


@pytest.mark.heavy
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_each_layout_compiles_for_h100_with_cudnn_attention_in_every_layer(layout):
    mesh, *overrides = layout
    config = load_config("llama3-8b", [*CUT, f"parallel.mesh={mesh}", *overrides])
    resolve_vocab(config)
    _, compiled, _ = compile_for_target(config, parse_mesh(mesh), target_hardware("h100"), 8, 8)
    kernels = kernel_counts(compiled.as_text())
    # packed documents on Hopper: cuDNN's flash attention in each layer, forward and backward
    # (context all-gather runs its own blockwise kernel: the split sequence's mask needs positions)
    if "parallel.context_strategy=all_gather" not in overrides:
        assert kernels.get("attention_cudnn_fwd", 0) >= 4 and kernels.get("attention_cudnn_bwd", 0) >= 4, kernels
    assert kernels["gemm"] > 0, kernels
    if any(o.startswith("parallel.schedule=zb") for o in overrides):
        # every stage-to-stage permute (the tick loop's) asynchronous, with kernels in its window;
        # zbv's once-a-step move of its second leg's weights across pipe is XLA's to schedule
        permutes = collective_schedule(compiled.as_text(), in_loops=True)["collective-permute"]
        assert permutes["count"] == permutes["async"] > 0 and permutes["overlapped_fraction"] == 1.0, permutes
