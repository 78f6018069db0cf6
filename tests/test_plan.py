"""The planner: per-op costs against XLA's own analysis, collective times against the ring
formula, monotonicity, layout enumeration, the CLI (with its compile cache) and bad input."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxdist.config import load_config
from jaxdist.inspect.collectives import CollectiveOp
from jaxdist.layout.devices import cuda_plugin_installed
from jaxdist.plan import __main__ as plan_cli
from jaxdist.plan import compile_cache, search
from jaxdist.plan.cost import collective_time, node_split, predict, ring_steps
from jaxdist.plan.hardware import Link, load_hardware
from jaxdist.plan.hlo_cost import ProgramCost, program_cost
from jaxdist.plan.search import enumerate_candidates, estimated_memory

# Start JAX's backend with conftest's 8 fake devices now: plan_cli.main asks for --gpus devices
# when it runs before the backend has started (whichever test runs first).
assert len(jax.devices()) == 8

TINY = [
    "data.source=synthetic",
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "train.seq_len=32",
    "train.global_batch=16",
]


@pytest.fixture
def cpu_compiles(monkeypatch):
    """A GPU profile's plan as on a machine without JAX's CUDA plugin: each layout compiled against
    fake CPU devices and priced for the GPU by rule (the planner says so in one line). The tests
    that use it are about the search and the CLI, not about XLA:GPU's program (tests/test_plan_gpu.py)."""
    import jaxdist.layout.devices as devices

    monkeypatch.setattr(devices, "cuda_plugin_installed", lambda: False)


def _xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, list | tuple) else cost)["flops"])


def test_matmul_flops_are_xlas_and_loops_multiply_them():
    """A lone matmul: the same FLOPs as XLA's cost analysis. Inside a 5-step scan: five
    times them, where XLA's analysis counts the loop body once."""
    a, b = jnp.ones((64, 96)), jnp.ones((96, 48))
    once = jax.jit(lambda a, b: a @ b).lower(a, b).compile()
    assert program_cost(once.as_text()).matmul_flops == _xla_flops(once) == 2 * 64 * 96 * 48

    def looped(a, b):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ b) @ b.T, None), a, None, length=5)[0]

    loop = jax.jit(looped).lower(a, b).compile()
    per_step = 2 * (2 * 64 * 96 * 48)
    assert program_cost(loop.as_text()).matmul_flops == 5 * per_step
    assert _xla_flops(loop) < 2 * per_step  # what the planner corrects for


def test_a_scan_writing_one_slice_of_a_stacked_buffer_moves_the_slice():
    """A scan filling one row of a [steps, n] buffer per step: an in-place update, so its
    traffic is a few rows per step, not the whole buffer."""

    def fill(x):
        def step(buf, i):
            return jax.lax.dynamic_update_index_in_dim(buf, jnp.sin(x * i), i, 0), None

        return jax.lax.scan(step, jnp.zeros((16, x.shape[0])), jnp.arange(16.0).astype(jnp.int32))[0]

    compiled = jax.jit(fill).lower(jnp.ones(4096)).compile()
    row, buffer = 4096 * 4, 16 * 4096 * 4
    memory = program_cost(compiled.as_text()).memory_bytes
    assert memory < 16 * buffer / 4  # far below rewriting the buffer every step
    assert memory >= 16 * row  # but each step writes its row


def test_ring_all_reduce_time_is_the_formula():
    link = Link(bandwidth=450e9, latency=8e-6, efficiency=0.8)
    size = 2**30
    wire = 2 * 7 / 8 * size
    assert collective_time("all-reduce", wire, 8, link) == pytest.approx(14 * 8e-6 + wire / (450e9 * 0.8), rel=1e-12)
    assert ring_steps("all-gather", 8) == ring_steps("reduce-scatter", 8) == 7 and ring_steps("all-reduce", 1) == 0
    # in a program: one all-reduce over data outside any loop, nothing else, is exposed as it is
    op = CollectiveOp("all-reduce", "ar", size, 1, "main", 8, ("data",), int(wire))
    h100 = load_hardware("h100")
    p = predict(ProgramCost(0, 0, 0, 0, 0, (op,), frozenset()), h100, {"data": 8}, model_flops_per_step=1, tokens_per_step=1)
    assert p.step_time_s == pytest.approx(collective_time("all-reduce", wire, 8, h100.intra_node)) and p.bound == "communication"
    # across two nodes the same all-reduce takes the slower link
    across = predict(ProgramCost(0, 0, 0, 0, 0, (op,), frozenset()), h100, {"data": 16}, model_flops_per_step=1, tokens_per_step=1)
    assert across.step_time_s == pytest.approx(collective_time("all-reduce", wire, 8, h100.inter_node))


def test_data_crosses_nodes_before_fsdp_and_tensor_stays_inside():
    assert node_split({"data": 2, "fsdp": 8, "tensor": 4}, 8) == {
        "replica": 1,
        "data": 2,
        "pipe": 1,
        "fsdp": 4,
        "expert": 1,
        "context": 1,
        "tensor": 1,
    }
    assert node_split({"fsdp": 8}, 8)["fsdp"] == 1


def _program(hideable_bytes: float, critical_bytes: float) -> ProgramCost:
    ops = (
        CollectiveOp("all-gather", "ag", 0, 10, "body", 8, ("fsdp",), int(hideable_bytes)),
        CollectiveOp("all-reduce", "ar", 0, 10, "body", 2, ("tensor",), int(critical_bytes)),
    )
    return ProgramCost(5e14, 0, 2e11, 0, 0, ops, frozenset({"body"}))


@pytest.mark.parametrize("hideable, critical", [(1e9, 1e8), (5e10, 0), (0, 3e9)])
def test_more_bandwidth_is_never_slower(hideable, critical):
    h100 = load_hardware("h100")
    mesh = {"fsdp": 8, "tensor": 2}
    slow = predict(_program(hideable, critical), h100, mesh, model_flops_per_step=1e15, tokens_per_step=1e4)
    for link in ("intra_node", "inter_node"):
        faster = dataclasses.replace(h100, **{link: dataclasses.replace(getattr(h100, link), bandwidth=2 * getattr(h100, link).bandwidth)})
        fast = predict(_program(hideable, critical), faster, mesh, model_flops_per_step=1e15, tokens_per_step=1e4)
        assert fast.step_time_s <= slow.step_time_s and fast.comm_exposed_s <= slow.comm_exposed_s
    hbm = dataclasses.replace(h100, memory_bandwidth=2 * h100.memory_bandwidth)
    assert predict(_program(hideable, critical), hbm, mesh, model_flops_per_step=1e15, tokens_per_step=1e4).step_time_s <= slow.step_time_s


def test_the_loops_collectives_hide_behind_compute_and_tensor_ones_do_not():
    h100 = load_hardware("h100")
    p = predict(_program(1e9, 1e9), h100, {"fsdp": 8, "tensor": 2}, model_flops_per_step=1e15, tokens_per_step=1e4)
    tensor = 10 * collective_time("all-reduce", 1e9, 2, h100.intra_node)
    assert p.comm_exposed_s == pytest.approx(tensor)  # the fsdp gathers fit under 90% of the compute


def test_more_devices_never_need_more_memory_under_fsdp():
    """The screen's estimate and the compiled program agree: memory per device falls as
    the fsdp axis grows (compiled: the argument bytes, i.e. the sharded train state)."""
    from jaxdist.inspect.step_report import memory as _memory
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.plan.search import Candidate
    from jaxdist.training.aot import compile_train_step

    config = load_config(None, TINY)
    config.model.vocab_size = 256
    estimates, compiled = [], []
    for n in (1, 2, 4, 8):
        candidate = Candidate((("data", 1), ("fsdp", n), ("tensor", 1), ("pipe", 1)), 1, "none")
        estimates.append(estimated_memory(config, candidate, 10**8, True))
        if n in (2, 8):
            config.parallel.mesh = candidate.mesh_spec
            compiled.append(_memory(compile_train_step(config, parse_mesh(candidate.mesh_spec), jax.devices()[:n])[1])["arguments"])
    assert estimates == sorted(estimates, reverse=True) and estimates[0] > estimates[-1]
    assert compiled[0] > compiled[1]


def test_enumeration_respects_divisibility():
    config = load_config(None, [*TINY, "model.mlp_dim=192"])
    config.model.vocab_size = 256
    candidates = enumerate_candidates(config, 8, 8)
    assert candidates
    for c in candidates:
        s = c.sizes
        assert math.prod(s.values()) == 8
        assert config.model.n_kv_heads % s["tensor"] == 0 and config.model.n_layers % s["pipe"] == 0
        assert config.train.global_batch % (s["data"] * s["fsdp"] * c.microbatches) == 0
    assert {c.sizes["tensor"] for c in candidates} == {1, 2, 4}  # 8 does not divide the 4 kv heads
    assert not [c for c in enumerate_candidates(config, 8, 2) if c.sizes["tensor"] > 2]  # tensor stays in a node of 2


@pytest.mark.heavy
def test_the_cli_ranks_compiled_layouts_and_reuses_its_cache(tmp_path, cpu_compiles, monkeypatch, capsys):
    monkeypatch.setenv("JAXDIST_CACHE_DIR", str(tmp_path))
    argv = ["--gpus", "4", "--hardware", "h100", "--max-compiles", "2", "--json", *TINY]
    assert plan_cli.main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    keys = {"mesh", "microbatches", "remat", "step_time_s", "tokens_per_sec_per_device", "mfu", "memory_per_device_bytes", "bound"}
    assert len(first["candidates"]) == 2 and all(keys <= set(c) for c in first["candidates"])
    times = [c["step_time_s"] for c in first["candidates"]]
    assert times == sorted(times) and not any(c["cached"] for c in first["candidates"])
    assert plan_cli.main(argv) == 0
    again = json.loads(capsys.readouterr().out)
    assert all(c["cached"] for c in again["candidates"]) and [c["step_time_s"] for c in again["candidates"]] == times
    assert plan_cli.main(argv[: -len(TINY) - 1] + TINY) == 0  # the table
    assert "tok/s/dev" in capsys.readouterr().out
    monkeypatch.setattr(search, "program_source", lambda: "edited")  # another jaxdist: its own program
    assert plan_cli.main(argv) == 0
    assert not any(c["cached"] for c in json.loads(capsys.readouterr().out)["candidates"])


def test_the_source_digest_follows_every_python_file(tmp_path):
    """The compile cache's key holds a digest of jaxdist's source: an edit anywhere changes it."""
    package = tmp_path / "pkg"
    shutil.copytree(Path(search.__file__).resolve().parents[1], package, ignore=shutil.ignore_patterns("__pycache__"))
    before = compile_cache.source_digest(package)
    assert compile_cache.source_digest(package) == before and before == compile_cache.program_source()
    target = package / "models" / "fp8.py"
    target.write_text(target.read_text() + "\n# an edit\n")
    assert compile_cache.source_digest(package) != before


# With JAX's CUDA plugin a GPU profile's search adds offload_layer_inputs, which keeps least on the device
# With the plugin (a GPU target) the smallest layout keeps activations and Adam's moments on host:
# 70.55e9 parameters x 8 bytes of moments = 525.6 GiB fewer than the activation offload alone
LEAST = "offload_layer_inputs optimizer_offload" if cuda_plugin_installed() else "full"
BAD = {
    "unknown hardware": (["--gpus", "8", "--hardware", "tpu-v9"], "unknown hardware 'tpu-v9' (profiles: a100, cpu-local, h100"),
    "more gpus than the mesh can use": (["--gpus", "1024", "--hardware", "h100", *TINY], "no layout of default uses 1024 GPUs"),
    "a model that fits nowhere": (
        ["--config", "llama3-70b", "--gpus", "1", "--hardware", "h100"],
        f"llama3-70b fits no layout on 1 x H100 SXM 80GB: the smallest (data=1 mb=16 remat={LEAST}) needs "
        + ("566.5" if LEAST != "full" else "1131.1")
        + " GiB per device",
    ),
    "zero gpus": (["--gpus", "0", "--hardware", "h100"], "--gpus must be >= 1"),
    "zero compiles": (["--gpus", "4", "--hardware", "h100", "--max-compiles", "0", *TINY], "--max-compiles must be >= 1, got 0"),
    "negative budget": (["--gpus", "4", "--hardware", "h100", "--time-budget", "-1", *TINY], "--time-budget must be > 0 seconds, got -1"),
    "zero top": (["--gpus", "4", "--hardware", "h100", "--top", "0", *TINY], "--top must be >= 1, got 0"),
    "zero per node": (["--gpus", "4", "--hardware", "h100", "--gpus-per-node", "0", *TINY], "--gpus-per-node must be >= 1, got 0"),
    "unknown context strategy": (
        ["--gpus", "4", "--hardware", "h100", "parallel.context_strategy=rings", *TINY],
        "parallel.context_strategy must be one of all_gather, ring, all_to_all, got 'rings'",
    ),
    "an unknown pipeline schedule": (
        ["--gpus", "4", "--hardware", "h100", "--schedules", "1f1b,zbx", *TINY],
        "--schedules: zbx is not a pipeline schedule (gpipe, circular, 1f1b, interleaved, zb1, zbv or all)",
    ),
    "a sequence that fits nowhere": (
        ["--config", "llama3-8b-128k", "--gpus", "2", "--hardware", "h100", "train.seq_len=1048576"],
        f"llama3-8b-128k fits no layout on 2 x H100 SXM 80GB: the smallest (context=2 all_to_all mb=2 remat={LEAST}) needs",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line(case, capsys):
    argv, message = BAD[case]
    assert plan_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("jaxdist: error:") and message in err[-1], err[-1]


def test_a_layout_that_does_not_compile_is_reported_and_skipped(tmp_path, cpu_compiles, monkeypatch, capsys):

    monkeypatch.setenv("JAXDIST_CACHE_DIR", str(tmp_path))
    real, calls = search.compile_summary, []

    def first_fails(config, **kwargs):
        calls.append(config.parallel.mesh)
        if len(calls) == 1:
            raise RuntimeError("INTERNAL: RET_CHECK failure (spmd_partitioner.cc) somewhere\nmore detail")
        return real(config, **kwargs)

    monkeypatch.setattr(search, "compile_summary", first_fails)
    assert plan_cli.main(["--gpus", "2", "--hardware", "h100", "--max-compiles", "2", "--json", *TINY]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert len(result["candidates"]) == 1 and result["failed_to_compile"][0]["error"].startswith("INTERNAL: RET_CHECK failure")
    assert "does not compile (INTERNAL: RET_CHECK failure (spmd_partitioner.cc) somewhere); left out of the ranking" in captured.err


def test_small_matmuls_run_at_the_rate_measured_for_their_size():
    from jaxdist.plan.hardware import cpu_local

    profile = {
        "matmul_flops_per_s": 1e11, "memory_bytes_per_s": 4e10, "fusion_bytes_per_s": 1e10, "op_overhead_s": 1e-6,
        "matmul_curve": [[1e6, 1e9], [1e8, 1e10], [1e10, 1e11]],
        "collective_latency_s": 1e-3, "collective_bytes_per_s": 1e9, "fake_device_collective_latency_s": 1e-4,
        "fake_device_collective_bytes_per_s": 5e9,
    }  # fmt: skip
    host = cpu_local(profile)
    assert host.matmul_rate(1e8) == pytest.approx(1e10) and host.matmul_rate(1e3) == 1e9 and host.matmul_rate(1e12) == 1e11
    assert host.matmul_rate(1e7) == pytest.approx(10**9.5)  # halfway in log-log
    assert host.memory_bandwidth == 1e10 and host.inter_node.latency == pytest.approx(5e-4)  # 2 ring steps per fitted all-reduce
    one_dot = ProgramCost(1e9, 0, 0, 0, 0, (), frozenset(), dots=((1e7, 100.0),), op_executions=1000.0)
    p = predict(one_dot, host, {"data": 1}, model_flops_per_step=1e9, tokens_per_step=1)
    assert p.step_time_s == pytest.approx(1e9 / 10**9.5 + 1000 * 1e-6)


# ---------------------------------------------------------------------------------------------
# Long sequences: the context axis (issue 25)

CONTEXT_TINY = [*TINY[:-2], "model.vocab_size=256", "model.dtype=float32", "train.seq_len=256", "train.global_batch=4"]


def _candidate(mesh: str, remat: str = "none", strategy: str = "", microbatches: int = 1):
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.plan.search import LAYOUT_AXES, Candidate

    sizes = parse_mesh(mesh)
    return Candidate(tuple((a, sizes[a]) for a in LAYOUT_AXES), microbatches, remat, strategy)


@pytest.mark.parametrize(
    "mesh, strategy, remat",
    [("fsdp=2,context=4", "all_gather", "none"), ("fsdp=2,context=4", "ring", "full"), ("data=2,context=2,tensor=2", "all_gather", "full")],
)
def test_the_kv_traffic_over_context_is_the_compiled_programs(mesh, strategy, remat):
    """analyze's per-axis table has a `context` row (and prints it); in the compiled program the
    attention's collectives run over context alone (gathers and reduce-scatters, or permutes) and
    move exactly the bytes and the number of collectives the planner's screen charges."""
    from jaxdist.inspect.step_report import build_report, format_report
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.plan.search import configured, context_traffic
    from jaxdist.training.run import build_trainer

    candidate = _candidate(mesh, remat, strategy)
    config = configured(load_config(None, CONTEXT_TINY), candidate)
    trainer = build_trainer(config, parse_mesh(mesh), jax.devices()[:8])
    # the program a run compiles: with the suite's older loop emitters (conftest.py), XLA:CPU
    # merges two of the remat's gathers in the all_gather case
    lowered = trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch(config.train.global_batch))
    compiled = lowered.compile(compiler_options={"xla_cpu_use_fusion_emitters": True})
    report = build_report(trainer, compiled)
    assert report["collectives_by_axes"]["context"]["wire_bytes"] > 0 and "over context" in format_report(report)
    cost = program_cost(compiled.as_text(), {a: int(n) for a, n in trainer.layout.mesh.shape.items()})
    attention = [op for op in cost.collectives if op.name in cost.attention_collectives]
    assert attention and all(op.axes == ("context",) for op in attention)
    assert {op.kind for op in attention} == ({"all-gather", "reduce-scatter"} if strategy == "all_gather" else {"collective-permute"})
    wire, count = sum(op.executions * op.wire_bytes for op in attention), sum(op.executions for op in attention)
    assert (wire, count) == context_traffic(config, candidate)
    assert report["collectives_by_axes"]["context"]["wire_bytes"] >= wire
    # the tiled kernel's attention runs inside lax.cond: the cost model knows what a causal mask skips
    assert cost.tiled_attention and cost.skippable_flops == pytest.approx(cost.attention_flops, rel=0.05)


def test_kv_gathers_are_exposed_and_ring_permutes_hide():
    """Attention's all-gather over context feeds the attention right after it: exposed even in the
    layer loop; the same bytes as a ring's permutes hide behind the loop's compute; a tiled
    attention's skippable FLOPs are halved on any hardware, and keeps its score traffic on a GPU."""
    h100 = load_hardware("h100")

    def program(kind: str, in_attention: bool, skippable: float = 0.0) -> ProgramCost:
        op = CollectiveOp(kind, "kv", 0, 10, "body", 4, ("context",), int(1e9))
        names = frozenset({"kv"}) if in_attention else frozenset()
        return ProgramCost(5e14, 2e14, 2e11, 1e11, 0, (op,), frozenset({"body"}), attention_collectives=names, skippable_flops=skippable)

    def run(p):
        return predict(p, h100, {"context": 4}, model_flops_per_step=1e15, tokens_per_step=1e4)

    gather = run(program("all-gather", True))
    assert gather.comm_exposed_s == pytest.approx(10 * collective_time("all-gather", 1e9, 4, h100.intra_node))
    assert run(program("all-gather", False)).comm_exposed_s == 0.0  # an FSDP weight gather in the loop hides
    assert run(program("collective-permute", True)).comm_exposed_s == 0.0
    flash, tiled = run(program("all-gather", False)), run(program("all-gather", False, skippable=2e14))
    assert flash.matmul_s == pytest.approx(tiled.matmul_s)  # both skip half of attention's FLOPs
    assert tiled.memory_s > flash.memory_s  # but only flash keeps the scores on chip


def test_context_sizes_are_searched_inside_a_node_where_the_sequence_divides():
    config = load_config(None, [*CONTEXT_TINY, "train.seq_len=96"])
    candidates = enumerate_candidates(config, 8, 4)
    contexts = {c.sizes["context"] for c in candidates}
    assert contexts == {1, 2, 4}  # 2 x 8 = 16 chunks do not divide 96 tokens; 8 would not fit a node of 4 anyway
    assert all(c.sizes["context"] * c.sizes["tensor"] <= 4 for c in candidates)
    assert all(c.sizes["pipe"] == 1 for c in candidates if c.sizes["context"] > 1)  # context does not compose with pipe yet
    for c in candidates:
        assert (c.context_strategy in ("all_gather", "ring", "all_to_all")) == (c.sizes["context"] > 1)
        assert ("parallel.context_strategy=" + c.context_strategy in c.overrides()) == bool(c.context_strategy)


def test_the_screen_splits_activations_and_states_over_context():
    """Per device the screen's activations and logits fall with the sequence's share and the model
    states with the extra shards; the compiled program agrees (arguments and temp both fall). On
    XLA:CPU (no fused attention) the context-free layout also holds the [seq, seq] scores."""
    from jaxdist.inspect.step_report import memory as _memory
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.plan.search import configured, states_bytes
    from jaxdist.training.aot import compile_train_step

    config = load_config(None, [*CONTEXT_TINY, "train.seq_len=1024", "train.global_batch=2"])
    n_params = 10**6
    estimates, compiled = [], []
    for mesh in ("fsdp=2", "fsdp=2,context=2", "fsdp=2,context=4"):
        candidate = _candidate(mesh, "full", "all_gather" if "context" in mesh else "")
        estimates.append(estimated_memory(config, candidate, n_params, False))
        assert states_bytes(candidate, n_params) == 16 * n_params / math.prod(candidate.sizes.values())
        if mesh != "fsdp=2,context=2":
            _, step = compile_train_step(configured(config, candidate), parse_mesh(mesh), jax.devices()[:8])
            compiled.append(_memory(step))
    assert estimates == sorted(estimates, reverse=True) and estimates[0] > 2 * estimates[-1]
    assert compiled[0]["arguments"] > 2 * compiled[1]["arguments"] and compiled[0]["temp"] > 2 * compiled[1]["temp"]


def test_program_costs_survive_the_cache_whole():
    """The compile cache stores a ProgramCost as JSON: every field comes back (f32 collectives,
    dot sizes, op counts and the attention facts feed the prediction)."""
    ops = (CollectiveOp("all-gather", "ag", 8, 2, "body", 4, ("context",), 6),)
    cost = ProgramCost(
        1e9, 2e8, 3e7, 1e7, 1e6, ops, frozenset({"body"}), frozenset({"ag"}), ((1e6, 3.0),), 42.0, frozenset({"ag"}), 1e8, 5e6
    )
    assert ProgramCost.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost


@pytest.mark.heavy
def test_a_long_sequence_makes_the_planner_pick_a_context_axis(tmp_path, cpu_compiles, monkeypatch, capsys):
    """On a device with half the memory that XLA's compiled program of the leanest context-free
    layout of a 2,048-token sequence needs, the planner ranks a context layout first: the
    context-free layouts its screen lets through are compiled and found too big, and XLA's memory
    for the context layout fits."""
    import jaxdist.plan.hardware as hardware_module
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.plan.search import compile_summary, configured

    monkeypatch.setenv("JAXDIST_CACHE_DIR", str(tmp_path))
    words = [*CONTEXT_TINY[:-3], "train.seq_len=2048", "train.global_batch=2"]
    config = load_config(None, [*words, "model.dtype=bfloat16", "data.source=synthetic"])  # as the planner loads it for a GPU
    free = [c for c in enumerate_candidates(config, 4, 4) if c.sizes["context"] == 1]
    leanest = min(free, key=lambda c: estimated_memory(config, c, 10**5, False))
    need_free = compile_summary(configured(config, leanest))[0]["memory"]["total"]
    device = need_free / 2 / 0.9  # 90% of it usable
    small = dataclasses.replace(load_hardware("h100"), memory_bytes=device, fused_attention=False)  # memory as XLA compiles it
    monkeypatch.setattr(hardware_module, "load_hardware", lambda key, **_: small)
    assert plan_cli.main(["--gpus", "4", "--hardware", "h100", "--max-compiles", "4", "--json", *words]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["candidates"], result["did_not_fit"]
    best = result["candidates"][0]
    assert parse_mesh(best["mesh"])["context"] > 1 and best["context_strategy"] in ("all_gather", "ring", "all_to_all")
    assert best["memory_source"] == "compiled" and best["memory_per_device_bytes"] <= need_free / 2
    assert all(parse_mesh(c["mesh"])["context"] > 1 for c in result["candidates"])
    assert all(parse_mesh(c["mesh"])["context"] == 1 for c in result["did_not_fit"])  # what XLA found too big


def test_the_128k_preset_fits_an_80gb_device():
    """configs/llama3-8b-128k on its mesh (fsdp=2,context=4, 8 devices): XLA's compiled program
    holds under 90% of 80 GB per device, with the sequence split four ways."""
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.training.aot import analyze

    config = load_config("llama3-8b-128k", [])
    assert config.train.seq_len == 131072 and config.parallel.mesh == "fsdp=2,context=4"
    report = analyze(config, parse_mesh(config.parallel.mesh), jax.devices()[:8])
    assert report["mesh"]["context"] == 4 and report["mesh"]["fsdp"] == 2 and report["params"] > 8e9
    assert report["memory_per_device_bytes"]["total"] <= 0.9 * 80e9
    assert report["collectives_by_axes"]["context"]["bytes"] > 0


def test_the_screen_takes_a_context_axis_only_where_nothing_else_fits():
    """On a flash-attention GPU a context-free layout keeps the scores on chip while the context
    kernel's XLA tiles move them through memory: the screen ranks a fitting context-free layout
    first (Llama 3 8B at 32K tokens on 8 H100), and a context layout where none fits (at 256K);
    without load balancing the last context shard's causal share stretches the step. (The tiled
    strategies; all_to_all keeps the flash kernel on whole sequences: tests/test_ulysses.py.)"""
    from jaxdist.models.counts import count_params
    from jaxdist.plan.search import estimated_time

    h100 = load_hardware("h100")
    shapes = ["model.vocab_size=128256", "model.d_model=4096", "model.n_layers=32", "model.n_heads=32", "model.n_kv_heads=8"]
    for seq, batch, context_wanted in ((32768, 8, False), (262144, 1, True)):
        config = load_config(
            None, [*shapes, "model.mlp_dim=14336", "model.dtype=bfloat16", f"train.seq_len={seq}", f"train.global_batch={batch}"]
        )
        n = count_params(config.model)
        tiled = [c for c in enumerate_candidates(config, 8, 8) if c.context_strategy != "all_to_all"]
        fitting = [c for c in tiled if estimated_memory(config, c, n, True) <= 0.9 * h100.memory_bytes]
        assert fitting and any(c.sizes["context"] > 1 for c in fitting)
        best = min(fitting, key=lambda c: estimated_time(config, c, n, h100))
        assert (best.sizes["context"] > 1) == context_wanted, best.label()
        if context_wanted:
            unbalanced = load_config(
                None,
                [*shapes, "model.mlp_dim=14336", f"train.seq_len={seq}", "train.global_batch=1", "parallel.context_load_balance=false"],
            )
            assert estimated_time(unbalanced, best, n, h100) > estimated_time(config, best, n, h100)


# ---------------------------------------------------------------------------------------------
# What the CLI prints (issue 33)


def test_the_table_gives_small_step_times_in_significant_figures():
    """A small model's step (387 us) and its MFU and memory read as numbers, not 0.000 / 0.0% / 0.0."""
    c = {"mesh": "data=4", "microbatches": 1, "remat": "none", "context_strategy": None, "step_time_s": 3.87e-4}
    c |= {"tokens_per_sec_per_device": 662242.0, "mfu": 8.8e-3, "memory_per_device_bytes": 117 * 2**20, "bound": "communication"}
    result = {"config": "tiny", "gpus": 4, "hardware_name": "H100", "gpus_per_node": 4, "global_batch": 16, "seq_len": 64}
    result |= {
        "layouts": {"compiled": 1, "fitting_estimate": 1},
        "candidates": [c, c | {"step_time_s": 1.4e-3}, c | {"step_time_s": 12.345}],
    }
    table = plan_cli.format_table(result, 5)
    rows = table.splitlines()[2:]
    assert "387 us" in rows[0] and "0.88%" in rows[0] and "117 MiB" in rows[0], table
    assert "1.40 ms" in rows[1] and "12.3 s" in rows[2] and "0.000" not in table and " 0.0 " not in table, table


@pytest.mark.heavy
def test_build_notes_are_said_once_and_cpu_backend_notes_not_for_a_gpu_plan(tmp_path, cpu_compiles, monkeypatch, capsys):
    """Each compiled layout's build prints its notes; the planner says each once, and leaves out of
    an H100 plan the one on how XLA:CPU runs ragged_dot (the plan prices a GPU's grouped GEMM). The
    notes are kept in the compile cache, so a cached rerun says the same."""
    from jaxdist.plan.search import CPU_BACKEND_NOTE, plan_notes

    monkeypatch.setenv("JAXDIST_CACHE_DIR", str(tmp_path))
    argv = ["--gpus", "2", "--hardware", "h100", "--max-compiles", "2", "--json", *TINY, "model.moe_experts=4", "model.moe_mlp_dim=64"]
    said = []
    for _ in range(2):  # compiled, then cached
        assert plan_cli.main(argv) == 0
        captured = capsys.readouterr()
        result = json.loads(captured.out)
        lines = [line for line in captured.err.splitlines() if line.startswith("jaxdist: ")]
        assert len(lines) == len(set(lines)) and not [line for line in lines if CPU_BACKEND_NOTE.search(line)], lines
        assert len(result["candidates"]) == 2 and not [n for c in result["candidates"] for n in c["notes"] if CPU_BACKEND_NOTE.search(n)]
        said.append([line for line in lines if "screened layouts" not in line])  # its count of new and cached compiles differs
    assert said[0] == said[1]
    cached = [n for path in (tmp_path / "plan").glob("*.json") for n in json.loads(path.read_text())["notes"]]
    cpu_notes = [n for n in cached if CPU_BACKEND_NOTE.search(n)]
    assert len(cpu_notes) == 2  # the build said it (ragged_dot's dense expansion) for each compile; the plan did not
    assert plan_notes([*cached, *cached], shared_host=True) == list(dict.fromkeys(cached))  # a CPU plan: each once


def test_a_compiler_that_aborts_on_one_layout_costs_that_layout_not_the_search(tmp_path, cpu_compiles, monkeypatch, capsys):
    """XLA ends its process on a failed internal check: the search compiles each layout in a child
    process, so a layout whose compile aborts (the fault hook does as XLA's CHECK does: a check
    line, then SIGABRT) is reported in one line with that check line, and the layouts after it
    compile in a fresh child. Nothing is left running and the child's stderr file is removed."""
    import psutil

    from jaxdist.plan.compile_worker import ENV_ABORT

    monkeypatch.setenv("JAXDIST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(ENV_ABORT, "remat=none")  # the rough time's first layout keeps every activation
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the child's stderr file goes
    assert plan_cli.main(["--gpus", "2", "--hardware", "h100", "--max-compiles", "3", "--json", *TINY]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    failed = result["failed_to_compile"]
    assert failed and all(f["layout"].split()[2] == "remat=none" for f in failed), failed
    reason = f"the compiler process died (SIGABRT): Check failed: fault injection ({ENV_ABORT}=remat=none)"
    assert all(f["error"] == reason for f in failed), failed
    for f in failed:  # one line each, and no traceback
        assert f"jaxdist: warning: {f['layout']} does not compile ({reason}); left out of the ranking" in captured.err.splitlines()
    assert "Traceback" not in captured.err
    assert len(result["candidates"]) == 3 - len(failed) >= 1 and all(c["remat"] != "none" for c in result["candidates"])
    assert psutil.Process().children(recursive=True) == []
    assert list(tmp_path.glob("jaxdist-plan-compiler-*")) == []


def test_each_memory_kinds_best_layout_is_compiled_before_the_rest():
    """The rough time's order, with the best of each remat policy and optimizer placement moved to the front."""
    from jaxdist.plan.__main__ import compile_order
    from jaxdist.plan.search import Candidate

    def layout(fsdp: int, remat: str, offload: bool = False) -> tuple[Candidate, float]:
        return Candidate((("fsdp", fsdp),), 1, remat, optimizer_offload=offload), 0.0

    ranked = [layout(8, "none"), layout(4, "none"), layout(2, "none"), layout(8, "save_matmuls"), layout(4, "full"),
              layout(2, "save_matmuls"), layout(8, "full", True), layout(1, "none")]  # fmt: skip
    order = compile_order(ranked)
    assert order == [ranked[i] for i in (0, 3, 4, 6, 1, 2, 5, 7)]
    assert sorted(map(id, order)) == sorted(map(id, ranked))


def test_a_compiled_layout_that_does_not_fit_hands_its_place_to_the_next_of_its_kind(monkeypatch):
    """Each memory kind's best layout is compiled first; one whose XLA:GPU peak is over the memory
    is followed by the next of its kind whose estimate, scaled by the peaks seen, may fit (here the
    peak is the estimate): the search compiles a fitting layout of every kind before the rest."""
    import types

    from jaxdist.plan import cost as plan_cost
    from jaxdist.plan.search import Candidate

    gib = 2**30
    hardware = load_hardware("h100")

    def layout(mesh: str, remat: str, estimate_gib: float) -> tuple[Candidate, float]:
        return Candidate(tuple((a, int(n)) for a, n in (part.split("=") for part in mesh.split(","))), 1, remat), estimate_gib * gib

    ranked = [layout("data=4", "none", 70), layout("data=4", "save_matmuls", 70), layout("data=2,fsdp=2", "none", 60),
              layout("fsdp=4", "none", 40), layout("fsdp=4", "save_matmuls", 30), layout("tensor=4", "none", 20)]  # fmt: skip
    estimates, compiled = {c: e for c, e in ranked}, []

    def fake_compile(config, target, compiler):
        candidate = next(c for c in estimates if c.mesh_spec == config.parallel.mesh and c.remat == config.model.remat)
        compiled.append(candidate)
        peak = estimates[candidate]
        return {"memory": {"peak": peak, "arguments": 0, "total": peak}, "program": {}, "notes": [], "params": 1}, False

    monkeypatch.setattr(search, "compile_summary", fake_compile)
    monkeypatch.setattr(ProgramCost, "from_dict", staticmethod(lambda data: None))
    monkeypatch.setattr(plan_cost, "predict_summary", lambda *a: types.SimpleNamespace(to_dict=lambda: {"step_time_s": 1.0}))
    args = types.SimpleNamespace(max_compiles=4, time_budget=1e9, gpus=4)
    config = load_config(None, ["model.d_model=64", "model.n_layers=2", "model.n_heads=8", "model.n_kv_heads=4"])
    result = plan_cli._price(config, plan_cli.compile_order(ranked), hardware, args, target=object())
    assert [(c.mesh_spec, c.remat) for c in compiled] == [
        ("data=4", "none"), ("fsdp=4", "none"), ("data=4", "save_matmuls"), ("fsdp=4", "save_matmuls")
    ]  # fmt: skip
    assert {(c["mesh"], c["remat"]) for c in result["candidates"]} == {("fsdp=4", "none"), ("fsdp=4", "save_matmuls")}


def test_after_each_kinds_first_compile_the_rest_follow_what_the_compiles_of_their_kind_showed(monkeypatch):
    """Once every memory kind's best layout is compiled, the rest go by rough time scaled by their
    kind's compiled step over its rough time: a kind whose program came out slower than the rough
    time said (``none`` near the memory limit, where XLA rematerializes by itself) gives its place
    to the next layout of a kind that came out faster. Without the rough times (the order before),
    the search compiles the rough-faster ``none`` layout instead."""
    import types

    from jaxdist.plan import cost as plan_cost
    from jaxdist.plan.search import Candidate

    def layout(mesh: str, remat: str) -> Candidate:
        return Candidate(tuple((a, int(n)) for a, n in (part.split("=") for part in mesh.split(","))), 1, remat)

    rough = {layout("fsdp=4", "none"): 1.0, layout("data=2,fsdp=2", "none"): 1.02, layout("fsdp=4", "save_matmuls"): 1.1,
             layout("data=4", "save_matmuls"): 1.12}  # fmt: skip
    step = {layout("fsdp=4", "none"): 2.0, layout("fsdp=4", "save_matmuls"): 1.2, layout("data=2,fsdp=2", "none"): 2.1,
            layout("data=4", "save_matmuls"): 1.15}  # fmt: skip
    ranked = [(c, 2**30) for c in sorted(rough, key=rough.get)]

    def compiled_by(rough_times):
        compiled = []

        def fake_compile(config, target, compiler):
            candidate = next(c for c in rough if c.mesh_spec == config.parallel.mesh and c.remat == config.model.remat)
            compiled.append(candidate)
            return {"memory": {"peak": 2**30, "arguments": 0, "total": 2**30}, "program": step[candidate], "notes": [], "params": 1}, False

        monkeypatch.setattr(search, "compile_summary", fake_compile)
        monkeypatch.setattr(ProgramCost, "from_dict", staticmethod(lambda data: data))
        monkeypatch.setattr(
            plan_cost,
            "predict_summary",
            lambda program, *a: types.SimpleNamespace(step_time_s=program, to_dict=lambda: {"step_time_s": program}),
        )
        args = types.SimpleNamespace(max_compiles=3, time_budget=1e9, gpus=4)
        config = load_config(None, ["model.d_model=64", "model.n_layers=2", "model.n_heads=8", "model.n_kv_heads=4"])
        result = plan_cli._price(config, plan_cli.compile_order(ranked), load_hardware("h100"), args, target=object(), rough=rough_times)
        return [(c.mesh_spec, c.remat) for c in compiled], result["candidates"][0]

    order, best = compiled_by(rough)
    # then the fastest once more with its layers in a Python loop (the next test)
    assert order == [("fsdp=4", "none"), ("fsdp=4", "save_matmuls"), ("data=4", "save_matmuls"), ("data=4", "save_matmuls")]
    assert (best["mesh"], best["remat"], best["step_time_s"]) == ("data=4", "save_matmuls", 1.15)
    assert compiled_by(None)[0] == [("fsdp=4", "none"), ("fsdp=4", "save_matmuls"), ("data=2,fsdp=2", "none")]


def _searched(monkeypatch, steps: dict, rough: dict, target) -> tuple[list[tuple], dict]:
    """``plan._price`` over the layouts of ``rough`` (their rough times), each "compile" priced at
    ``steps[(candidate, collective_matmul, scan_layers)]``: (what compiled, in order, as (remat,
    collective_matmul, scan_layers); the result). One candidate per remat policy."""
    import types

    from jaxdist.plan import cost as plan_cost

    compiled = []

    def fake_compile(config, target, compiler):
        candidate = next(c for c in rough if c.remat == config.model.remat)
        key = (candidate.remat, config.parallel.collective_matmul, config.model.scan_layers)
        compiled.append(key)
        program = steps[(candidate, *key[1:])]
        return {"memory": {"peak": 2**30, "arguments": 0, "total": 2**30}, "program": program, "notes": [], "params": 1}, False

    monkeypatch.setattr(search, "compile_summary", fake_compile)
    monkeypatch.setattr(ProgramCost, "from_dict", staticmethod(lambda data: data))
    priced = {"tokens_per_sec_per_device": 1.0, "mfu": 0.5, "bound": "compute"}
    monkeypatch.setattr(
        plan_cost,
        "predict_summary",
        lambda program, *a: types.SimpleNamespace(step_time_s=program, to_dict=lambda: {"step_time_s": program, **priced}),
    )
    args = types.SimpleNamespace(max_compiles=2, time_budget=1e9, gpus=4)
    config = load_config(None, ["model.d_model=64", "model.n_layers=2", "model.n_heads=8", "model.n_kv_heads=4", "train.seq_len=64"])
    ranked = plan_cli.compile_order([(c, 2**30) for c in rough])
    return compiled, plan_cli._price(config, ranked, load_hardware("h100"), args, target=target, rough=rough)


def test_the_fastest_layout_that_fits_compiles_once_more_with_its_layers_in_a_python_loop(monkeypatch):
    """On a GPU target the search ends with one more compile, past --max-compiles: its fastest
    layout that fits with ``model.scan_layers=false`` (the scan's stacked residuals and paired
    iterations cost llama3-8b's fsdp=8 step a tenth), ranked with the rest (``+loop`` in the
    table). A CPU plan does not try it."""
    from jaxdist.plan.search import Candidate

    fast, slow = Candidate((("fsdp", 4),), 1, "save_matmuls"), Candidate((("fsdp", 4),), 1, "none")
    steps = {(slow, False, True): 2.0, (fast, False, True): 1.2, (fast, False, False): 1.0}
    rough = {slow: 1.0, fast: 1.1}
    compiled, result = _searched(monkeypatch, steps, rough, object())
    assert compiled == [("none", False, True), ("save_matmuls", False, True), ("save_matmuls", False, False)]
    best = result["candidates"][0]
    assert (best["remat"], best["scan_layers"], best["step_time_s"]) == ("save_matmuls", False, 1.0)
    assert "save_matmuls+loop" in plan_cli.format_table({**result, "layouts": {"compiled": 3, "fitting_estimate": 2}}, 3)
    assert _searched(monkeypatch, steps, rough, None)[0] == [("none", False, True), ("save_matmuls", False, True)]


def test_the_fastest_layout_with_a_tensor_axis_compiles_once_more_with_collective_matmuls(monkeypatch):
    """Before the Python loop, a GPU search's fastest layout that fits compiles once more with
    ``parallel.collective_matmul=true`` where it has a tensor axis (``+cm`` in the table); the
    loop variant is then tried on the fastest without them (unrolled rings compile for long)."""
    from jaxdist.plan.search import Candidate

    tensor, plain = Candidate((("fsdp", 2), ("tensor", 2)), 1, "full"), Candidate((("fsdp", 4),), 1, "none")
    steps = {(plain, False, True): 2.0, (tensor, False, True): 1.2, (tensor, True, True): 1.0, (tensor, False, False): 1.1}
    compiled, result = _searched(monkeypatch, steps, {plain: 1.0, tensor: 1.1}, object())
    assert compiled == [("none", False, True), ("full", False, True), ("full", True, True), ("full", False, False)]
    best = result["candidates"][0]
    assert (best["mesh"], best["collective_matmul"], best["scan_layers"], best["step_time_s"]) == ("fsdp=2,tensor=2", True, True, 1.0)
    assert "full+cm" in plan_cli.format_table({**result, "layouts": {"compiled": 4, "fitting_estimate": 2}}, 4)


def test_a_partial_validation_run_keeps_the_readme_sections_it_did_not_rerun(monkeypatch, tmp_path):
    """``experiments/plan_validation.py --gpu --write-readme`` rewrites its generated block: the CPU
    and planner sections it did not run stay as the README has them, each up to the next section."""
    import importlib.util
    import os

    for key in ("XLA_FLAGS", "JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL"):  # the script sets them at import
        monkeypatch.setenv(key, os.environ.get(key, ""))
    path = Path(__file__).resolve().parents[1] / "experiments" / "plan_validation.py"
    spec = importlib.util.spec_from_file_location("plan_validation_under_test", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    bodies = {heading: f"| {n} | table |\n\nnote {n}\n" for n, heading in enumerate(script.HEADINGS)}
    block = "".join(f"{heading}\n\n{body}\n" for heading, body in bodies.items())
    (tmp_path / "README.md").write_text(f"intro\n\n{script.BEGIN}\n{block}{script.END}\n\nafter\n")
    monkeypatch.setattr(script, "HERE", tmp_path)
    for heading, body in bodies.items():
        assert script.kept_section(heading) == f"{heading}\n\n{body.rstrip()}\n"
    (tmp_path / "README.md").write_text(f"{script.BEGIN}\n{script.GPU_HEADING}\n\nrows\n{script.END}\n")
    assert script.kept_section(script.CPU_HEADING) is None
    assert script.kept_section(script.GPU_HEADING) == f"{script.GPU_HEADING}\n\nrows\n"
