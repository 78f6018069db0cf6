"""Activation offload (``model.remat=offload_*``): every remat policy computes the gradients of
none; on CPU the offload policies move nothing and say so in one line; in XLA:GPU's program
for an H100 the kept values live in host memory, moved by asynchronous copies, and the peak
drops by what moved; the planner prices those copies on the host link, hidden by the kernels
in their window."""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdist.config import ModelConfig
from jaxdist.inspect.host_offload import host_offload
from jaxdist.models.llama import Llama
from jaxdist.plan.cost import HOST_TRANSFER, predict
from jaxdist.plan.gpu_cost import gpu_program_cost
from jaxdist.plan.hardware import load_hardware

from helpers import first_batch_grads, jaxpr_equations

POLICIES = ("full", "save_matmuls", "offload_matmuls", "offload_layer_inputs")


@pytest.mark.parametrize("policy", POLICIES)
def test_every_remat_policy_computes_the_gradients_of_none_and_cpu_offload_says_it_moves_nothing(policy, capsys):
    _, loss_none, grads_none = first_batch_grads("fsdp=2")
    capsys.readouterr()
    _, loss, grads = first_batch_grads("fsdp=2", f"model.remat={policy}")
    assert loss == pytest.approx(loss_none, rel=1e-6)
    chex.assert_trees_all_close(grads, grads_none, rtol=1e-5, atol=1e-8)
    lines = [x for x in capsys.readouterr().err.splitlines() if "nothing is offloaded" in x]
    if policy.startswith("offload_"):
        kept = {"offload_matmuls": "save_matmuls", "offload_layer_inputs": "full"}[policy]
        assert len(lines) == 1 and f"model.remat={policy}: cpu devices have no memory apart from the host's" in lines[0], lines
        assert f"it trains as model.remat={kept}" in lines[0]
    else:
        assert lines == []


def _projection_matmuls(remat: str, fused: bool) -> int:
    """Matmuls without batch dimensions (the projections and their gradients) in the gradient
    program of a 2-layer decoder under ``model.remat=remat``, counted in JAX's own jaxpr (the
    forward, the backward and whatever remat recomputes in between)."""
    cfg = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=48, fused_projections=fused, remat=remat)
    graphdef, params = nnx.split(Llama(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 5)), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: nnx.merge(graphdef, p).loss({"inputs": tokens, "targets": tokens})[0]))(params).jaxpr
    dots = (e for e in jaxpr_equations(jaxpr) if e.primitive.name == "dot_general")
    return sum(1 for e in dots if not e.params["dimension_numbers"][1][0])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_save_matmuls_recomputes_no_projection(fused):
    """``save_matmuls`` keeps every projection's output, the fused q/k/v and gate/up products
    included: its gradient program has as many projection matmuls as ``none``'s, while ``full``
    recomputes some (so the count sees a recompute)."""
    kept = _projection_matmuls("none", fused)
    assert _projection_matmuls("save_matmuls", fused) == kept
    assert _projection_matmuls("full", fused) > kept


# A loop of 2 iterations, each sending a 128 MiB bf16 value to host memory (memory space 5)
# asynchronously around GEMMS 8192^3 GEMMs, and bringing one back synchronously.
_OFFLOAD_LOOP = """HloModule m, is_scheduled=true

%gemm (p0: bf16[8192,8192], p1: bf16[8192,8192]) -> bf16[8192,8192] {
  %p0 = bf16[8192,8192]{1,0} parameter(0)
  %p1 = bf16[8192,8192]{1,0} parameter(1)
  ROOT %d = bf16[8192,8192]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (s32[], bf16[8192,8192])) -> (s32[], bf16[8192,8192]) {
  %p = (s32[], bf16[8192,8192]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[8192,8192]{1,0} get-tuple-element(%p), index=1
  %out = (bf16[8192,8192]{1,0:S(5)}, bf16[8192,8192]{1,0}, u32[]) copy-start(%x)
GEMMS
  %kept = bf16[8192,8192]{1,0:S(5)} copy-done(%out)
  %back = bf16[8192,8192]{1,0} copy(%kept)
  ROOT %t = (s32[], bf16[8192,8192]) tuple(%i, %back)
}

%cond (q: (s32[], bf16[8192,8192])) -> pred[] {
  %q = (s32[], bf16[8192,8192]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x0: bf16[8192,8192]) -> (s32[], bf16[8192,8192]) {
  %x0 = bf16[8192,8192]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8192,8192]) tuple(%zero, %x0)
  ROOT %w = (s32[], bf16[8192,8192]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"2"}}
}
"""
_GEMM = '  %g{k} = bf16[8192,8192]{{1,0}} fusion(%x, %x), kind=kCustom, calls=%gemm, backend_config={{"fusion_backend_config":{{"kind":"__triton_gemm"}}}}'


def _loop(gemms: int) -> str:
    return _OFFLOAD_LOOP.replace("GEMMS", "\n".join(_GEMM.format(k=k) for k in range(gemms)))


def test_host_transfers_are_read_from_the_program_per_step():
    moved = 8192 * 8192 * 2
    assert host_offload(_loop(1)) == {
        "host_bytes": 0,  # the loop writes into a buffer it was handed: nothing allocated here
        "to_host": {"count": 2, "async": 2, "bytes": 2 * moved},
        "from_host": {"count": 2, "async": 0, "bytes": 2 * moved},
    }


@pytest.mark.parametrize("gemms", [1, 2])
def test_a_host_transfer_is_exposed_by_what_the_kernels_in_its_window_do_not_cover(gemms):
    """h100.yaml's host link: 64 GB/s at 80%, 10 us a transfer. One 8192^3 GEMM (1.48 ms at the
    sustained bf16 rate) covers part of the 2.63 ms a 128 MiB copy takes; two cover all of it.
    The synchronous copy back is exposed whole."""
    h100 = load_hardware("h100")
    copy_s = 10e-6 + 8192 * 8192 * 2 / (64e9 * 0.8)
    gemm_s = 2.0 * 8192**3 / (989e12 * 0.75)
    p = predict(gpu_program_cost(_loop(gemms), {"data": 1}), h100, {"data": 1}, model_flops_per_step=1.0, tokens_per_step=1.0)
    exposed_async = max(0.0, copy_s - gemms * gemm_s)
    assert p.exposed_s[HOST_TRANSFER] == pytest.approx(2 * (exposed_async + copy_s), rel=1e-6)
    assert p.step_time_s == pytest.approx(2 * (gemms * gemm_s + exposed_async + copy_s), rel=1e-6)


def _h100_words(layers: int, width: int, seq: int) -> list[str]:
    """TINY in bf16, cut to these shapes, on XLA's own schedule (the buffers are the point here)."""
    from helpers import TINY

    return [
        *TINY,
        "model.dtype=bfloat16",
        f"model.n_layers={layers}",
        f"model.d_model={width}",
        f"train.seq_len={seq}",
        "train.latency_profile=off",
    ]


@pytest.mark.heavy
def test_the_h100_program_keeps_each_layers_input_on_host_with_async_copies_and_a_lower_peak():
    """Full remat against offload_layer_inputs, 16 layers, [2, 2048, 256] bf16 layer inputs per
    device: XLA:GPU's program writes each layer's input to pinned host memory and reads it back
    (one async transfer each way per layer), partly hidden by the kernels scheduled in their
    windows; the [layers, rows, seq, width] stack that full remat keeps on the device lives only in
    host memory (memory space 5), and the peak (XLA's memory analysis) is lower. Not by the whole
    stack: without it the step's peak sits elsewhere (6.8 MB lower here, 0.20 of the stack; 1.2
    GiB of 2 on llama3-8b's fsdp=8 program, training/README.md)."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="JAX's CUDA plugin is not installed (pip install -e '.[dev]')")
    from jaxdist.config import load_config
    from jaxdist.data.sources import resolve_vocab
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.plan.gpu_target import compile_for_target, target_hardware, target_report

    layers, rows, seq, width = 16, 2, 2048, 256
    reports, stacks = {}, {}
    for policy in ("full", "offload_layer_inputs"):
        words = _h100_words(layers, width, seq)
        config = load_config(None, [*words, f"train.global_batch={8 * rows}", f"model.remat={policy}"])
        resolve_vocab(config)
        hardware = target_hardware("h100")
        trainer, compiled, options = compile_for_target(config, parse_mesh("data=8"), hardware, 8, 8)
        reports[policy] = target_report(trainer, compiled, hardware, options, 8)
        # the stack's layouts in the optimized program: {3,2,1,0} on the device, {3,2,1,0:S(5)} on host
        stacks[policy] = set(re.findall(rf"bf16\[{layers},{rows},{seq},{width}\]\{{([^}}]*)\}}", compiled.as_text()))
    stack = layers * rows * seq * width * 2  # bf16
    offload = reports["offload_layer_inputs"]["host_offload"]
    assert reports["full"]["host_offload"]["host_bytes"] == 0 and reports["full"]["host_offload"]["to_host"]["count"] == 0
    assert offload["host_bytes"] == stack
    assert offload["to_host"] == {"count": layers, "async": layers, "bytes": stack}
    assert offload["from_host"] == {"count": layers, "async": layers, "bytes": stack}
    assert stacks == {"full": {"3,2,1,0"}, "offload_layer_inputs": {"3,2,1,0:S(5)"}}, stacks
    peaks = {policy: r["memory_per_device_bytes"]["peak"] for policy, r in reports.items()}
    assert peaks["offload_layer_inputs"] < peaks["full"], peaks
    link = target_hardware("h100").host_link  # the kernels scheduled inside the copies' windows hide part of them
    assert 0.0 <= offload["exposed_s"] < 2 * layers * (link.latency + stack / layers / (link.bandwidth * link.efficiency))


def test_remat_without_the_layer_scan_on_cpu_says_in_one_line_that_it_keeps_what_none_keeps(capsys):
    """What the line says, against XLA:CPU's own memory analysis: with the layers in a Python
    loop the step's temporaries under full remat are none's, where in the scan they are far
    fewer; the line comes once, and not for the scan or for none."""
    from jaxdist.config import load_config
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.models import build_task
    from jaxdist.training.run import build_trainer

    def temp_mib(remat: str, scan: str) -> float:
        words = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4", "model.dtype=float32"]
        words += ["train.global_batch=8", "train.seq_len=256", "data.source=synthetic", f"model.remat={remat}", f"model.scan_layers={scan}"]
        trainer = build_trainer(load_config(None, words), parse_mesh("data=1"), jax.devices()[:1])
        compiled = trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch(8)).compile()
        return compiled.memory_analysis().temp_size_in_bytes / 2**20

    assert temp_mib("full", "false") == temp_mib("none", "false")
    assert temp_mib("full", "true") < 0.6 * temp_mib("none", "true")
    capsys.readouterr()
    for words in (["model.remat=full", "model.scan_layers=false"], ["model.remat=full"], ["model.remat=none", "model.scan_layers=false"]):
        build_task(load_config(None, words), platform="cpu")
    lines = [x for x in capsys.readouterr().err.splitlines() if "model.scan_layers=false" in x]
    assert (
        len(lines) == 1
        and "model.remat=full with model.scan_layers=false: on cpu devices XLA keeps what model.remat=none keeps" in lines[0]
    )


@pytest.mark.heavy
def test_remat_keeps_less_than_none_without_the_layer_scan_in_the_h100_program():
    """``model.scan_layers=false`` runs the layers in a Python loop, where XLA could merge the
    backward's recomputation with the forward it repeats: every policy then compiled to none's
    program (4 layers of [2, 2048, 512] per device: the same 511.3 MiB peak for none, full and
    save_matmuls; llama3-8b on fsdp=8 with full remat 56.7 GiB, 22.0 in the scan). The
    recomputation is now kept apart from the forward, and full remat's peak is below none's."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="JAX's CUDA plugin is not installed (pip install -e '.[dev]')")
    from jaxdist.config import load_config
    from jaxdist.data.sources import resolve_vocab
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.plan.gpu_target import compile_for_target, target_hardware, target_report

    layers, rows, seq, width = 4, 2, 2048, 512
    hardware, peaks = target_hardware("h100"), {}
    for policy in ("none", "full"):
        words = _h100_words(layers, width, seq)
        config = load_config(None, [*words, f"train.global_batch={8 * rows}", f"model.remat={policy}", "model.scan_layers=false"])
        resolve_vocab(config)
        trainer, compiled, options = compile_for_target(config, parse_mesh("data=8"), hardware, 8, 8)
        peaks[policy] = target_report(trainer, compiled, hardware, options, 8)["memory_per_device_bytes"]["peak"]
    assert peaks["full"] < 0.97 * peaks["none"], peaks


def test_the_planner_offers_offload_only_where_asked_and_screens_it_below_full_remat():
    """A GPU target's search adds offload_layer_inputs beside every full-remat layout (CPU
    devices offload nothing: cpu-local's search leaves it out); its screened memory is below
    full remat's, by the layer inputs it keeps on host (llama3-8b, seq 8192, fsdp=8)."""
    from jaxdist.config import load_config
    from jaxdist.models.counts import count_params
    from jaxdist.plan.search import OFFLOAD_REMATS, REMATS, enumerate_candidates, estimated_memory

    config = load_config("llama3-8b", ["model.vocab_size=32768"])
    plain = enumerate_candidates(config, 8, 8)
    offered = enumerate_candidates(config, 8, 8, remats=REMATS + OFFLOAD_REMATS)
    assert {c.remat for c in plain} == set(REMATS)
    full = [c for c in offered if c.remat == "full"]
    offload = [c for c in offered if c.remat == "offload_layer_inputs"]
    assert len(offload) == len(full) > 0 and len(offered) == len(plain) + len(offload)
    n_params = count_params(config.model)
    by_mesh = {(c.mesh, c.microbatches): c for c in full}
    for candidate in offload:
        twin = by_mesh[(candidate.mesh, candidate.microbatches)]
        saved = estimated_memory(config, twin, n_params, True) - estimated_memory(config, candidate, n_params, True)
        assert saved > 0, candidate.label()
