"""The big presets' GPU programs, compiled by XLA:GPU for H100s on this host (no GPU: the devices
are compile-only, ``jaxdist.plan.gpu_target``), with the flags a GPU run sets
(``layout/xla_flags.py``): they fit, FSDP's per-layer all-gathers and reduce-scatters run
asynchronously and overlapped with compute, and on a 2-node target only the collectives over
``data`` cross hosts.

The fits are compile-only figures: XLA's buffer assignment of the real step against the share of
an 80 GB H100 JAX's allocator may take (``XLA_PYTHON_CLIENT_MEM_FRACTION``, 0.75 by default). The
overlap is read from the scheduled HLO (``jaxdist.inspect.gpu_program``): a collective counts as
overlapped when compute runs between its start and its done. Every compile here is heavy (30 s to
2 min on two cores); each is a module fixture shared by the tests that read it.

Needs JAX's CUDA plugin (the ``dev`` extra installs it); without it these tests skip with that
one reason.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="JAX's CUDA plugin is not installed (pip install -e '.[dev]')")

from jaxdist.config import load_config  # noqa: E402
from jaxdist.data.sources import resolve_vocab  # noqa: E402
from jaxdist.inspect.collectives import collective_kind  # noqa: E402
from jaxdist.inspect.hlo import STRING_RE, parse_hlo  # noqa: E402
from jaxdist.inspect.wire import device_groups, spanned_axes  # noqa: E402
from jaxdist.layout.mesh import parse_mesh  # noqa: E402
from jaxdist.plan.gpu_target import compile_for_target, target_hardware, target_report  # noqa: E402

pytestmark = pytest.mark.heavy

GIB = 2**30
# llama3-70b on 64 H100s (8 hosts of 8): the planner's pick, from
#   python -m jaxdist.plan --config llama3-70b --gpus 64 --hardware h100 --json
# (its best candidate: it compiles the screened layouts with XLA:GPU for 64 target H100s and keeps
# those whose XLA:GPU peak fits; data=2,fsdp=8,tensor=4, its pick before, peaks at 73.9 GB with
# 2 microbatches and 87.6 GB with 1: over the 60 GB JAX may allocate).
# Taken 2026-12-02, jax 0.10.2: the planner's peak for it was 48.4 GB.
LLAMA70B_PICK = {"mesh": "fsdp=32,tensor=2", "microbatches": 1, "remat": "full"}
FSDP_KINDS = ("all-gather", "reduce-scatter")


def compile_target(name: str, mesh: str, gpus: int, overrides=(), extra=None, target="h100"):
    """(trainer, ``analyze --target`` report, optimized HLO) of preset ``name`` on ``gpus`` target GPUs, 8 per host."""
    # XLA's own schedule: half the compiles, and what these read (fits, async, overlap) holds with the profile too
    config = load_config(name, ["train.latency_profile=off", *overrides, f"parallel.mesh={mesh}"])
    resolve_vocab(config)
    hardware = target_hardware(target)
    trainer, compiled, options = compile_for_target(config, parse_mesh(mesh), hardware, gpus, 8, extra)
    return trainer, target_report(trainer, compiled, hardware, options, 8), compiled.as_text()


def fsdp_overlap_problems(report: dict, axis: str = "fsdp") -> list[str]:
    """What keeps FSDP's gathers and scatters from being hidden: a kind that is missing (none over
    ``axis``), has more than one synchronous collective (XLA makes one synchronous when its
    schedule leaves no compute for its window: the 70B pick's last gradient scatter, with two
    collectives allowed in flight), or has at most 80% of its bytes overlapped."""
    problems = []
    for kind in FSDP_KINDS:
        entry = report["collectives"][kind]
        over_axis = sum(
            v["kinds"].get(kind, {}).get("count", 0) for axes, v in report["collectives_by_axes"].items() if axis in axes.split(",")
        )
        if entry["count"] == 0 or over_axis == 0:
            problems.append(f"no {kind} over {axis}")
            continue
        if entry["async"] < entry["count"] - 1:
            problems.append(f"{kind}: {entry['async']} of {entry['count']} asynchronous")
        if not entry["overlapped_fraction"] > 0.8:
            problems.append(f"{kind}: overlapped_fraction {entry['overlapped_fraction']:.2f}")
    return problems


def assert_fits(report: dict) -> None:
    """Against the allocator's share of an 80 GB H100, computed here (not the report's own rule)."""
    peak, allowed = report["memory_per_device_bytes"]["peak"], 0.75 * 80e9
    assert report["target"]["memory_bytes"] == 80e9, report["target"]
    assert report["fits"] and 0 < peak <= allowed, (peak / GIB, report["fits_note"])


@pytest.fixture(scope="module")
def llama8b_fsdp8():
    return compile_target("llama3-8b", "fsdp=8", 8)


@pytest.fixture(scope="module")
def llama70b_pick():
    pick = LLAMA70B_PICK
    return compile_target("llama3-70b", pick["mesh"], 64, (f"train.microbatches={pick['microbatches']}", f"model.remat={pick['remat']}"))


@pytest.fixture(scope="module")
def llama8b_128k():
    config = load_config("llama3-8b-128k")
    assert config.parallel.mesh == "fsdp=2,context=4"  # the mesh its YAML and the README document
    return compile_target("llama3-8b-128k", config.parallel.mesh, 8)


def test_llama3_8b_on_fsdp8_fits_an_h100_with_room_to_spare_and_hides_its_fsdp_collectives(llama8b_fsdp8):
    trainer, report, hlo = llama8b_fsdp8
    assert_fits(report)
    # full remat on 8 x H100: under half the allocator's share (the README's "25.5 GB of 80")
    assert report["memory_per_device_bytes"]["peak"] < 0.5 * 0.75 * 80e9, report["fits_note"]
    assert fsdp_overlap_problems(report) == []
    # per layer: every layer's weights gathered (forward and again in the backward) and its gradients scattered
    layers = trainer.config.model.n_layers
    assert report["collectives"]["all-gather"]["count"] >= 2 * layers and report["collectives"]["reduce-scatter"]["count"] >= layers
    assert set(report["collectives_by_axes"]) == {"fsdp"}, report["collectives_by_axes"]
    # the layer scans (forward, backward) pipelined and double-buffered: 32 layers run as 15
    # iterations of two plus two peeled (32 iterations without the flags: H100 overlaps even then)
    loops = sorted(int(n) for n in re.findall(r'known_trip_count":\{"n":"(\d+)"\}', hlo))
    assert loops == [(layers - 2) // 2] * 2, loops


def test_llama3_70b_on_64_gpus_with_the_planners_pick_fits_and_hides_its_fsdp_collectives(llama70b_pick):
    _, report, _ = llama70b_pick
    assert report["devices"] == 64 and report["target"]["hosts"] == 8
    assert report["mesh"]["fsdp"] * report["mesh"]["tensor"] * report["mesh"]["data"] == 64
    assert_fits(report)
    assert fsdp_overlap_problems(report) == []
    # priced by the planner: the gradient scatters hide behind the backward (24% of the step was
    # exposed with one collective in flight at a time, 2% with two)
    assert report["collectives"]["reduce-scatter"]["exposed_s"] < 0.1 * report["step_s"], report["collectives"]["reduce-scatter"]


def test_llama3_8b_128k_on_its_documented_mesh_fits(llama8b_128k):
    _, report, _ = llama8b_128k
    assert report["mesh"]["fsdp"] == 2 and report["mesh"]["context"] == 4
    assert_fits(report)
    # its model states are sharded over fsdp x context: the FSDP collectives span both
    assert fsdp_overlap_problems(report, "fsdp") == []


def test_the_overlap_check_bites_without_the_latency_hiding_scheduler_on_an_a100():
    """The same check fails on a program that does not hide its collectives. On Hopper targets
    XLA 0.10.2 runs its latency-hiding scheduler whatever ``xla_gpu_enable_latency_hiding_scheduler``
    says (its analytical latency estimator turns it on), so the flag is shown where it decides:
    on an A100, llama3-8b on fsdp=8 with it hides everything, without it the reduce-scatters
    run partly synchronously and under 80% of their bytes are overlapped."""
    with_flags = compile_target("llama3-8b", "fsdp=8", 8, target="a100")[1]
    without = compile_target("llama3-8b", "fsdp=8", 8, extra={"xla_gpu_enable_latency_hiding_scheduler": False}, target="a100")[1]
    assert without["xla_flags"]["xla_gpu_enable_latency_hiding_scheduler"] == "false"
    assert fsdp_overlap_problems(with_flags) == []
    problems = fsdp_overlap_problems(without)
    assert any(p.startswith("reduce-scatter: ") and "asynchronous" in p for p in problems), problems
    assert without["collectives"]["reduce-scatter"]["overlapped_fraction"] < 0.8


# Megatron-LM's 1.7B GPT (experiments/plan_validation.py's row) with 8 of its 24 layers: the
# scanned layers' schedule, not the depth, decides what the gradient all-reduces overlap
MEGATRON_1P7B_DP = (
    "model.vocab_size=131072", "model.d_model=2048", "model.n_layers=8", "model.n_heads=16", "model.n_kv_heads=16",
    "model.mlp_dim=5464", "train.seq_len=4096", "train.global_batch=192", "parallel.strategy=dp", "model.remat=save_matmuls",
)  # fmt: skip
OVERLAP_LIMIT = "xla_gpu_experimental_parallel_collective_overlap_limit"


def most_in_flight(hlo: str) -> int:
    """The most async all-reduces any computation of the program holds open at once."""
    most = 0
    for body in parse_hlo(hlo).computations.values():
        open_now = 0
        for instruction in body:
            open_now += {"all-reduce-start": 1, "all-reduce-done": -1}.get(instruction.opcode, 0)
            most = max(most, open_now)
    return most


DOUBLE_BUFFERING = "xla_gpu_enable_while_loop_double_buffering"


def test_data_parallel_gradients_of_a_layer_reduce_together_behind_the_next_layer_across_hosts():
    """Data parallelism over 48 H100s (6 hosts): with jaxdist's flags the backward loop holds both
    of a layer's gradient all-reduces open across the layer's compute, and XLA:GPU's schedule,
    priced by the planner, exposes less of them than with XLA's default of one collective in
    flight (the second starts one GEMM before the layer ends), and less than with the layer scan
    double-buffered (two layers an iteration: the second layer's all-reduces have one GEMM left
    in the iteration), which jaxdist keeps for layouts that gather weights in the loop."""
    with_flags = compile_target(None, "data=48", 48, MEGATRON_1P7B_DP)
    one_at_a_time = compile_target(None, "data=48", 48, MEGATRON_1P7B_DP, extra={OVERLAP_LIMIT: 1})
    paired = compile_target(None, "data=48", 48, MEGATRON_1P7B_DP, extra={DOUBLE_BUFFERING: True})
    assert with_flags[1]["xla_flags"][OVERLAP_LIMIT] == "2" and one_at_a_time[1]["xla_flags"][OVERLAP_LIMIT] == "1"
    assert with_flags[1]["xla_flags"][DOUBLE_BUFFERING] == "false" and paired[1]["xla_flags"][DOUBLE_BUFFERING] == "true"
    assert most_in_flight(with_flags[2]) >= 2 and most_in_flight(one_at_a_time[2]) == 1
    exposed = {
        name: run[1]["collectives"]["all-reduce"]["exposed_s"]
        for name, run in (("flags", with_flags), ("one", one_at_a_time), ("paired", paired))
    }
    # (one: 11% more exposed; paired: 4% more since the loss's gradient became one pass, over 5% before)
    assert exposed["flags"] < 0.95 * exposed["one"] and exposed["flags"] < 0.98 * exposed["paired"], exposed
    assert with_flags[1]["step_s"] < paired[1]["step_s"], (with_flags[1]["step_s"], paired[1]["step_s"])


@pytest.mark.parametrize(
    "mesh, strategy, double_buffered, collective_matmul",
    [
        ("data=8", "dp", False, False),
        ("data=48,tensor=2", "dp", False, False),
        ("data=-1", "zero1", False, False),
        ("8x4", "auto", False, False),
        ("fsdp=8", "auto", True, False),
        ("data=2,fsdp=4", "auto", True, False),
        ("data=4,pipe=2", "dp", True, False),
        ("data=4,context=2", "dp", True, False),
        ("tensor=8", "dp", True, False),
        ("auto", "auto", True, False),
        ("fsdp=4,tensor=2", "auto", False, True),
        ("fsdp=4,tensor=-1", "auto", False, True),
        # without a tensor axis the key has no effect (said in one line): the flag stays
        ("fsdp=8", "auto", True, True),
        ("auto", "auto", True, True),  # the mesh decided later: the flag as for every run
    ],
)
def test_the_layer_scan_is_double_buffered_where_it_gathers_weights(mesh, strategy, double_buffered, collective_matmul):
    """The flag a run gets (and a compile for a target, ``compiler_options``): off for data
    parallelism without weight-sharding or pipeline axes, where the test above shows it exposes
    more, and for collective matmuls over a tensor axis."""
    from jaxdist.layout.xla_flags import gpu_flags
    from jaxdist.plan.gpu_target import compiler_options

    overrides = [f"parallel.mesh={mesh}", f"parallel.strategy={strategy}", f"parallel.collective_matmul={collective_matmul}"]
    config = load_config(None, overrides)
    want = "true" if double_buffered else "false"
    assert gpu_flags(config)[DOUBLE_BUFFERING] == want and gpu_flags(None)[DOUBLE_BUFFERING] == "true"
    assert compiler_options(config)[DOUBLE_BUFFERING] is double_buffered


def host_crossing(hlo: str, mesh_shape: dict[str, int], hosts: np.ndarray) -> list[tuple[str, tuple[str, ...], bool]]:
    """(kind, mesh axes spanned, whether some group holds devices of two hosts) per collective;
    ``hosts[k]`` is the host of the program's k-th device (the mesh's devices in order)."""
    module = parse_hlo(hlo)
    out = []
    for body in module.computations.values():
        for instruction in body:
            kind = collective_kind(instruction.opcode)
            if kind is None:
                continue
            groups = device_groups(STRING_RE.sub('""', instruction.attributes), len(hosts))
            assert groups, instruction.name  # every collective names its groups
            crosses = any(len({int(hosts[d]) for d in group}) > 1 for group in groups)
            out.append((kind, spanned_axes(groups, mesh_shape), crosses))
    return out


@pytest.fixture(scope="module")
def two_nodes():
    """llama3-8b's layers (2 of them: the layout, not the depth, decides what crosses) on
    data=2,fsdp=8 over 16 H100s, 8 per host, one 8K sequence per GPU."""
    return compile_target("llama3-8b", "data=2,fsdp=8", 16, ("model.n_layers=2", "train.global_batch=16"))


def test_on_two_nodes_only_the_collectives_over_data_cross_hosts(two_nodes):
    trainer, report, hlo = two_nodes
    devices = trainer.layout.mesh.devices.reshape(-1)
    hosts = np.array([d.process_index for d in devices])
    # the hybrid mesh: data is the host, fsdp the GPU within it
    assert report["target"]["hosts"] == 2 and sorted(np.bincount(hosts)) == [8, 8]
    assert (hosts.reshape(2, 8) == np.array([[0] * 8, [1] * 8])).all()
    crossing = host_crossing(hlo, report["mesh"], hosts)
    assert {axes for _, axes, crosses in crossing if crosses} == {axes for _, axes, _ in crossing if "data" in axes}
    assert any(crosses for _, _, crosses in crossing) and any(not crosses for _, _, crosses in crossing)
    assert all(("data" in axes) == crosses for _, axes, crosses in crossing), crossing
    # the report's by-axes table agrees: fsdp's gathers and scatters stay within a host
    assert {"fsdp", "data"} <= set(report["collectives_by_axes"]) and not any("tensor" in k for k in report["collectives_by_axes"])
    # the check sees a crossing when there is one: were the hosts interleaved, fsdp would cross them
    interleaved = host_crossing(hlo, report["mesh"], np.arange(16) % 2)
    assert any(crosses and axes == ("fsdp",) for _, axes, crosses in interleaved)


def test_on_two_nodes_each_gradient_crosses_hosts_once_as_its_fsdp_shard(two_nodes):
    """Across hosts (over data) each fp32 gradient is all-reduced once, as the eighth of it its host's
    fsdp shard holds: the embedding table's too. Its lookup's gradient is a scatter, whose partial
    sums the partitioner all-reduced whole over data and fsdp (2.1 GB crossing hosts, on top of the
    shards); it is reduce-scattered within the host first (``layout.sharding.summed_into_layout``)."""
    trainer, report, _ = two_nodes
    by_axes = report["collectives_by_axes"]
    assert by_axes["data,fsdp"]["bytes"] < 1e6, by_axes["data,fsdp"]  # the step's scalars only
    shards = 4 * trainer.task.n_params / 8
    assert by_axes["data"]["kinds"].keys() == {"all-reduce"}
    assert by_axes["data"]["bytes"] == pytest.approx(shards, rel=0.01), (by_axes["data"], shards)


ALL_REDUCE_COMBINE = "xla_gpu_all_reduce_combine_threshold_bytes"


@pytest.mark.parametrize(
    "mesh, strategy, threshold_mib",
    [("data=6,fsdp=8", "auto", 16), ("data=-1,fsdp=8", "auto", 16), ("fsdp=8", "auto", 128), ("data=8", "dp", 128),
     ("data=2,fsdp=4,tensor=2", "auto", 128), ("data=6,fsdp=8", "zero1", 128), ("auto", "auto", 128)],
)  # fmt: skip
def test_hybrid_sharded_layouts_all_reduce_gradient_shards_in_small_groups(mesh, strategy, threshold_mib):
    from jaxdist.layout.xla_flags import gpu_flags

    config = load_config(None, [f"parallel.mesh={mesh}", f"parallel.strategy={strategy}"])
    assert gpu_flags(config)[ALL_REDUCE_COMBINE] == str(threshold_mib * 2**20)


def test_hybrid_sharded_gradient_shards_reduce_behind_their_layers_across_hosts():
    """FSDP within each of 6 hosts, data parallelism across them (48 H100s, Megatron-LM's 1.7B, all
    24 layers: with 8 or 12 the all-reduces' exposure drops as well, but the step is as long,
    other collectives taking their place): with the fsdp shards' all-reduces over data combined up
    to 16 MiB, XLA:GPU's schedule, priced by the planner, exposes less of them and predicts a
    shorter step than with 128 MiB, where several layers' shards wait to be combined."""
    keep = lambda o: not o.startswith(("parallel.strategy", "model.n_layers", "model.remat"))  # noqa: E731
    overrides = (*filter(keep, MEGATRON_1P7B_DP), "model.n_layers=24", "model.remat=none")
    small = compile_target(None, "data=6,fsdp=8", 48, overrides)
    large = compile_target(None, "data=6,fsdp=8", 48, overrides, extra={ALL_REDUCE_COMBINE: 128 * 2**20})
    assert small[1]["xla_flags"][ALL_REDUCE_COMBINE] == str(16 * 2**20)
    exposed = [run[1]["collectives"]["all-reduce"]["exposed_s"] for run in (small, large)]
    assert exposed[0] < 0.9 * exposed[1], exposed
    assert small[1]["step_s"] < large[1]["step_s"], (small[1]["step_s"], large[1]["step_s"])
