"""The planner on a GPU profile prices XLA:GPU's program: each layout compiled for the target
(``plan.gpu_target``), its memory XLA:GPU's peak, its kernels priced by kind (fp8 GEMMs at the
fp8 rate) and its collectives as scheduled; ``cpu-local`` keeps XLA:CPU's program.

Needs JAX's CUDA plugin (the ``dev`` extra installs it); without it these tests skip with that
one reason. Nothing here needs a GPU or a driver: the devices are compile-only.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="JAX's CUDA plugin is not installed (pip install -e '.[dev]')")

from jaxdist.plan import __main__ as plan_cli  # noqa: E402
from jaxdist.plan.cost import collective_time, predict  # noqa: E402
from jaxdist.plan.hardware import load_hardware  # noqa: E402

# The reduction and the 8192^3 GEMM the hand-written schedules below share
ADD_AND_GEMM = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%gemm (p0: bf16[8192,8192], p1: bf16[8192,8192]) -> bf16[8192,8192] {
  %p0 = bf16[8192,8192]{1,0} parameter(0)
  %p1 = bf16[8192,8192]{1,0} parameter(1)
  ROOT %d = bf16[8192,8192]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
BF16_RATE = 989e12 * 0.75  # h100.yaml: the dense bf16 peak at its sustained matmul share

SMALL = [
    "data.source=synthetic",
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "train.seq_len=64",
    "train.global_batch=16",
]


@pytest.mark.heavy
def test_a_gpu_plan_compiles_its_layouts_for_the_target_and_takes_xla_gpus_peak_memory(tmp_path, monkeypatch, capsys):
    """``--hardware h100 --gpus 8``: the two layouts it compiles, and the faster of them again with
    its layers in a Python loop, are XLA:GPU programs for 8 H100s (cuDNN attention in them), each
    with XLA:GPU's peak memory per device, the same peak and fit that ``analyze --target``
    (``target_report``) gives for that layout compiled on its own."""
    from jaxdist.config import load_config
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.plan.gpu_target import compile_for_target, target_hardware, target_report

    monkeypatch.setenv("JAXDIST_CACHE_DIR", str(tmp_path))
    # one row per device: no microbatch layouts (see the report: XLA:GPU rejects data x mb>1); XLA's own schedule (one compile each)
    words = [*SMALL, "train.global_batch=8", "train.latency_profile=off"]
    assert plan_cli.main(["--gpus", "8", "--hardware", "h100", "--max-compiles", "2", "--json", *words]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    compiled = [*result["candidates"], *result["did_not_fit"]]
    ringed = sum(c["collective_matmul"] for c in compiled)  # the fastest again with collective matmuls, if it has a tensor axis
    assert result["compiler"] == "XLA:GPU" and len(compiled) == 3 + ringed and ringed <= 1, result
    assert [c["scan_layers"] for c in compiled].count(False) == 1
    assert "jaxdist: compiled 2 of" in captured.err and "with XLA:GPU for 8 x H100 SXM 80GB and the fastest again" in captured.err
    summaries = [json.loads(path.read_text()) for path in (tmp_path / "plan").glob("*.json")]
    assert len(summaries) == len(compiled) and all(s["kernels"]["attention_cudnn_fwd"] > 0 and s["program"]["schedule"] for s in summaries)
    best = compiled[0]
    assert best["memory_source"] == "XLA:GPU peak" and best["kernel_s"]["gemm"] > 0

    words += ["model.dtype=bfloat16", f"train.microbatches={best['microbatches']}", f"model.remat={best['remat']}"]
    words += [
        f"model.scan_layers={str(best['scan_layers']).lower()}",
        f"parallel.collective_matmul={str(best['collective_matmul']).lower()}",
    ]
    config = load_config(None, [*words, "model.vocab_size=32768", f"parallel.mesh={best['mesh']}"])  # the planner's 32K vocab
    hardware = target_hardware("h100")
    trainer, step, options = compile_for_target(config, parse_mesh(best["mesh"]), hardware, 8, 8)
    report = target_report(trainer, step, hardware, options, 8)
    assert best["memory_per_device_bytes"] == report["memory_per_device_bytes"]["peak"]
    assert best["fits"] == report["fits"]


def _compile_dot(dtype) -> str:
    """XLA:GPU's program (one H100) of a [1024, 4096] x [4096, 2048] matmul of ``dtype`` operands."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxdist.plan.gpu_target import compiler_options, target_devices, target_hardware

    mesh = Mesh(np.array(target_devices(target_hardware("h100"), 1, 8)), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec())
    a, b = (jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape in ((1024, 4096), (4096, 2048)))
    step = jax.jit(lambda x, y: jax.numpy.dot(x, y, preferred_element_type=jax.numpy.bfloat16))
    return step.lower(a, b).compile(compiler_options()).as_text()


def test_fp8_gemms_are_priced_at_the_fp8_rate():
    """The same matmul compiled by XLA:GPU with fp8 and with bf16 operands: both are one GEMM of
    2 x 1024 x 4096 x 2048 FLOPs; the fp8 one is priced at the H100's fp8 rate (twice the bf16
    peak at the same sustained share), so in fewer seconds."""
    import jax.numpy as jnp

    h100 = load_hardware("h100")
    flops = 2.0 * 1024 * 4096 * 2048
    seconds = {}
    from jaxdist.plan.gpu_cost import gpu_program_cost

    for dtype in (jnp.float8_e4m3fn, jnp.bfloat16):
        cost = gpu_program_cost(_compile_dot(dtype), {"x": 1})
        p = predict(cost, h100, {"x": 1}, model_flops_per_step=flops, tokens_per_step=1)
        kind = "gemm_fp8" if dtype == jnp.float8_e4m3fn else "gemm"
        assert cost.matmul_flops == flops and (cost.fp8_flops == flops) == (kind == "gemm_fp8")
        assert set(p.kernel_s) == {kind} and p.kernel_s[kind] == pytest.approx(flops / ({"gemm_fp8": 2, "gemm": 1}[kind] * BF16_RATE))
        seconds[kind] = p.step_time_s
    assert seconds["gemm_fp8"] == pytest.approx(seconds["gemm"] / 2)


def test_the_schedule_decides_what_a_collective_hides_behind():
    """A loop of 4 runs a GEMM with an asynchronous all-reduce in flight across it (hidden), and
    a synchronous all-reduce after it (exposed): the step is 4 x (GEMM + one all-reduce)."""
    hlo = (
        ADD_AND_GEMM
        + """
%body (p: (s32[], bf16[8192,8192], f32[1048576])) -> (s32[], bf16[8192,8192], f32[1048576]) {
  %p = (s32[], bf16[8192,8192], f32[1048576]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[8192,8192]{1,0} get-tuple-element(%p), index=1
  %y = f32[1048576]{0} get-tuple-element(%p), index=2
  %ars = f32[1048576]{0} all-reduce-start(%y), replica_groups={{0,1}}, to_apply=%add, backend_config={"collective_backend_config":{"is_sync":false}}
  %g = bf16[8192,8192]{1,0} fusion(%x, %x), kind=kCustom, calls=%gemm, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %ard = f32[1048576]{0} all-reduce-done(%ars)
  %sync = f32[1048576]{0} all-reduce(%ard), replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s32[], bf16[8192,8192], f32[1048576]) tuple(%i, %g, %sync)
}

%cond (q: (s32[], bf16[8192,8192], f32[1048576])) -> pred[] {
  %q = (s32[], bf16[8192,8192], f32[1048576]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x0: bf16[8192,8192], y0: f32[1048576]) -> (s32[], bf16[8192,8192], f32[1048576]) {
  %x0 = bf16[8192,8192]{1,0} parameter(0)
  %y0 = f32[1048576]{0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8192,8192], f32[1048576]) tuple(%zero, %x0, %y0)
  ROOT %w = (s32[], bf16[8192,8192], f32[1048576]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""
    )
    from jaxdist.plan.gpu_cost import gpu_program_cost

    h100 = load_hardware("h100")
    cost = gpu_program_cost(hlo, {"data": 2})
    p = predict(cost, h100, {"data": 2}, model_flops_per_step=1.0, tokens_per_step=1.0)
    gemm = 2.0 * 8192**3 / BF16_RATE  # its FLOPs decide (its 384 MiB at HBM speed take a tenth of that)
    reduce = collective_time("all-reduce", 4 * 2**20, 2, h100.intra_node)  # 2(n-1)/n of 4 MiB on the wire
    assert reduce < gemm  # the GEMM can hide it
    assert cost.matmul_flops == 4 * 2.0 * 8192**3
    assert p.compute_s == pytest.approx(4 * gemm) and p.comm_s == pytest.approx(8 * reduce)
    assert p.step_time_s == pytest.approx(4 * (gemm + reduce)) and p.comm_exposed_s == pytest.approx(4 * reduce)


def test_cpu_local_keeps_xla_cpus_program(tmp_path, monkeypatch, capsys):
    """A cpu-local plan compiles against fake CPU devices and prices XLA:CPU's program, as before:
    no target compile, no GPU schedule, memory from XLA:CPU's compile."""
    import jaxdist.plan.gpu_target as gpu_target
    import jaxdist.plan.measure as measure

    profile = {
        "host": "test",
        "measured_at": "2026-01-01T00:00",
        "matmul_flops_per_s": 1e11,
        "memory_bytes_per_s": 1e10,
        "collective_bytes_per_s": 1e9,
        "collective_latency_s": 1e-4,
        "fake_device_collective_bytes_per_s": 5e9,
        "fake_device_collective_latency_s": 1e-4,
    }
    monkeypatch.setattr(measure, "load_or_measure", lambda *a, **k: profile)
    monkeypatch.setattr(gpu_target, "compile_for_target", lambda *a, **k: pytest.fail("a cpu-local plan compiled for a GPU target"))
    monkeypatch.setenv("JAXDIST_CACHE_DIR", str(tmp_path))
    assert plan_cli.main(["--gpus", "2", "--hardware", "cpu-local", "--max-compiles", "1", "--json", *SMALL]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    (candidate,) = result["candidates"]
    assert result["compiler"] == "XLA:CPU" and candidate["memory_source"] == "compiled" and candidate["kernel_s"] is None
    assert "jaxdist: compiled 1 of" in captured.err and "screened layouts against 2 fake CPU devices" in captured.err
    (summary,) = [json.loads(path.read_text()) for path in (tmp_path / "plan").glob("*.json")]
    assert not summary["program"]["schedule"] and "peak" not in summary["memory"]


def test_a_gpu_count_that_is_not_whole_nodes_is_one_line(capsys):
    """12 GPUs at 8 per node cannot be described as target hosts: one line, exit 2, before any compile."""
    argv = ["--gpus", "12", "--gpus-per-node", "8", "--hardware", "h100", *SMALL, "train.global_batch=48"]
    assert plan_cli.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxdist")]
    assert err == ["jaxdist: error: --gpus 12 is not a whole number of nodes of 8 (--gpus-per-node)"]


def test_exposure_is_what_each_collective_kind_makes_the_compute_stream_wait():
    """A loop of 4: an asynchronous all-reduce longer than the one GEMM in its window (its window
    holds compute, so ``overlapped_fraction`` calls it overlapped, yet its excess over the GEMM
    shows), then a synchronous all-gather (all of it exposed). Counted by hand, per kind."""
    hlo = (
        ADD_AND_GEMM
        + """
%body (p: (s32[], bf16[8192,8192], f32[268435456], f32[1048576])) -> (s32[], bf16[8192,8192], f32[268435456], f32[2097152]) {
  %p = (s32[], bf16[8192,8192], f32[268435456], f32[1048576]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[8192,8192]{1,0} get-tuple-element(%p), index=1
  %y = f32[268435456]{0} get-tuple-element(%p), index=2
  %z = f32[1048576]{0} get-tuple-element(%p), index=3
  %ars = f32[268435456]{0} all-reduce-start(%y), replica_groups={{0,1}}, to_apply=%add, backend_config={"collective_backend_config":{"is_sync":false}}
  %g = bf16[8192,8192]{1,0} fusion(%x, %x), kind=kCustom, calls=%gemm, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %ard = f32[268435456]{0} all-reduce-done(%ars)
  %ag = f32[2097152]{0} all-gather(%z), replica_groups={{0,1}}, dimensions={0}
  ROOT %t = (s32[], bf16[8192,8192], f32[268435456], f32[2097152]) tuple(%i, %g, %ard, %ag)
}

%cond (q: (s32[], bf16[8192,8192], f32[268435456], f32[1048576])) -> pred[] {
  %q = (s32[], bf16[8192,8192], f32[268435456], f32[1048576]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x0: bf16[8192,8192], y0: f32[268435456], z0: f32[1048576]) -> (s32[], bf16[8192,8192], f32[268435456], f32[2097152]) {
  %x0 = bf16[8192,8192]{1,0} parameter(0)
  %y0 = f32[268435456]{0} parameter(1)
  %z0 = f32[1048576]{0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8192,8192], f32[268435456], f32[1048576]) tuple(%zero, %x0, %y0, %z0)
  ROOT %w = (s32[], bf16[8192,8192], f32[268435456], f32[2097152]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""
    )
    from jaxdist.inspect.gpu_program import collective_schedule
    from jaxdist.plan.gpu_cost import gpu_program_cost

    h100 = load_hardware("h100")
    p = predict(gpu_program_cost(hlo, {"data": 2}), h100, {"data": 2}, model_flops_per_step=1.0, tokens_per_step=1.0)
    gemm = 2.0 * 8192**3 / BF16_RATE
    reduce = collective_time("all-reduce", 2 * (1 / 2) * 2**30, 2, h100.intra_node)  # 2(n-1)/n of 1 GiB on the wire
    gather = collective_time("all-gather", (1 / 2) * 8 * 2**20, 2, h100.intra_node)  # (n-1)/n of its 8 MiB result
    assert reduce > gemm  # the GEMM in its window hides only part of it
    assert collective_schedule(hlo)["all-reduce"]["overlapped_fraction"] == 1.0  # what that figure cannot tell
    assert p.exposed_s == pytest.approx({"all-gather": 4 * gather, "all-reduce": 4 * (reduce - gemm)})
    assert p.comm_exposed_s == pytest.approx(sum(p.exposed_s.values())) and p.step_time_s == pytest.approx(4 * (reduce + gather))
