"""analyze and the planner on an MoE decoder: the experts' all-to-all bytes and the grouped
matmuls' FLOPs read from the compiled program, each against a count made here by hand."""

from __future__ import annotations

import functools

import jax
import pytest

from jaxdist.config import load_config
from jaxdist.layout.mesh import parse_mesh

from helpers import TINY

# 2 MoE layers of 4 experts (width 64), top-2; the buffer holds exactly the even share.
MOE = (*TINY, "model.moe_experts=4", "model.moe_mlp_dim=64", "parallel.expert_buffer_factor=1", "data.source=synthetic")
LAYERS, TOKENS, K, D, F, E = 2, 16 * 32, 2, 64, 64, 4


@functools.cache
def _compiled(mesh: str, *overrides: str):
    from jaxdist.inspect.step_report import build_report
    from jaxdist.training.aot import compile_train_step

    config = load_config(None, [*MOE, f"parallel.mesh={mesh}", *overrides])
    sizes = parse_mesh(mesh)
    trainer, compiled = compile_train_step(config, sizes, jax.devices()[: sizes_count(sizes)])
    return config, trainer, compiled, build_report(trainer, compiled)


def sizes_count(sizes) -> int:
    import math

    return math.prod(sizes.values())


@pytest.mark.parametrize("mesh, remat", [("expert=4", "none"), ("data=2,expert=2", "full")])
def test_analyze_counts_the_experts_all_to_all_bytes_of_the_analytical_count(mesh, remat):
    """Per MoE layer the tokens go to the experts and back (2 all-to-alls of T_dev x k x d in
    fp32) forward and 2 again backward (2 more with remat's recomputed forward); analyze's
    all-to-all bytes over expert match that within 5%, and the int32 id exchange (one id per row,
    each forward) is the rest, a small part of it."""
    from jaxdist.inspect.step_report import format_report

    _, _, _, report = _compiled(mesh, f"model.remat={remat}")
    sizes = parse_mesh(mesh)
    ep = sizes["expert"]
    t_dev = TOKENS // (sizes["data"] * ep)
    forwards = 1 + (remat != "none")
    per_transfer = t_dev * K * D * 4
    analytical = LAYERS * (2 * forwards + 2) * per_transfer
    ids = LAYERS * forwards * t_dev * K * 4  # the buffer holds n x k rows at factor 1
    over_expert = report["collectives_by_axes"]["expert"]["kinds"]["all-to-all"]["bytes"]
    assert over_expert == pytest.approx(analytical + ids, rel=0.05)
    assert over_expert - ids == pytest.approx(analytical, rel=0.05)
    section = report["experts"]
    assert section["measured_bytes"] == pytest.approx(analytical, rel=0.05) and section["id_bytes"] == ids
    assert section["measured_over_analytical"] == pytest.approx(1.0, rel=0.05) and section["id_share"] < 0.05
    assert report["collectives"]["all-to-all"]["bytes"] == over_expert  # no all-to-all outside the expert axis
    assert "all-to-all" in format_report(report) and "ratio 1.000" in format_report(report)


def test_bf16_all_to_alls_promoted_by_the_cpu_backend_are_said_to_be():
    """XLA:CPU moves a bf16 model's token all-to-alls in f32: twice the analytical count, which
    the report says in a note rather than hiding it."""
    _, _, _, report = _compiled("expert=4", "model.dtype=bfloat16")
    section = report["experts"]
    analytical = LAYERS * 4 * (TOKENS // 4) * K * D * 2
    assert section["analytical_bytes"] == analytical
    assert section["moved_dtype"] == "f32" and section["measured_bytes"] == pytest.approx(2 * analytical, rel=0.05)
    assert any("promotes them" in note for note in report["notes"])


def _grouped_flops_by_hand(t_dev: int) -> float:
    """Training FLOPs of the routed experts one device runs: each of its t_dev x k rows through
    a SwiGLU (gate, up, down: 3 d f multiply-adds), forward 2x, backward 4x."""
    return LAYERS * 6 * t_dev * K * 3 * D * F


@pytest.mark.parametrize(
    "mesh, remat, factor, padding", [("expert=1", "none", 1, 1.0), ("data=2,expert=2", "full", 1, 1.0), ("data=2,expert=2", "none", 0, 2.0)]
)
def test_the_planner_prices_grouped_matmuls_at_the_active_experts_flops(mesh, remat, factor, padding, tmp_path):
    """XLA:CPU's ragged_dot runs every local expert over every received row (E/expert times the
    work, and the worst-case buffer's empty rows too: 2 x the routed rows at expert=2, top-2): the
    planner's compiled summary holds the grouped FLOPs, which divided by that expansion are the
    active experts' FLOPs counted by hand; on a GPU profile its matmul time drops by exactly the
    expansion, on a shared host (XLA:CPU) it keeps it."""
    from jaxdist.plan.cost import predict, predict_summary
    from jaxdist.plan.hardware import load_hardware
    from jaxdist.plan.hlo_cost import ProgramCost
    from jaxdist.plan.search import compile_summary

    config = load_config(None, [*MOE, f"parallel.mesh={mesh}", f"model.remat={remat}", f"parallel.expert_buffer_factor={factor}"])
    summary, cached = compile_summary(config, cache=tmp_path)
    cost = ProgramCost.from_dict(summary["program"])
    sizes = parse_mesh(mesh)
    ep = sizes["expert"]
    local = E // ep
    recompute = 8 / 6 if remat == "full" else 1.0  # remat runs the forward (2 of the 6) again
    assert not cached and cost.grouped_expansion == local * padding
    assert cost.grouped_flops / (local * padding) == pytest.approx(
        recompute * _grouped_flops_by_hand(TOKENS // (sizes["data"] * ep)), rel=1e-6
    )
    assert cost.matmul_flops > cost.grouped_flops
    h100 = load_hardware("h100")
    gpu = predict_summary(cost, h100, summary)
    dense = predict_summary(dataclasses_replace(cost, grouped_expansion=1.0), h100, summary)
    saved = cost.grouped_flops * (1 - 1 / (local * padding)) / h100.matmul_flops_per_s
    assert dense.matmul_s - gpu.matmul_s == pytest.approx(saved, rel=1e-9)
    cpu_like = dataclasses_replace(h100, shared_host=True, fused_attention=False)
    cpu = predict(cost, cpu_like, summary["mesh"], model_flops_per_step=1, tokens_per_step=1)
    devices = sizes["data"] * ep
    assert cpu.matmul_s == pytest.approx(devices * cost.matmul_flops / h100.matmul_flops_per_s)  # what XLA:CPU runs


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def test_the_planner_prices_the_all_to_all_bytes_of_the_analytical_count_on_the_expert_link():
    """The screen's expert traffic is the compiled program's all-to-all wire bytes over expert,
    and both are the analytical count x (N-1)/N; the cost model puts them on the critical path
    over NVLink (inside a node), in full for an f32 model, halved for a bf16 one (XLA:CPU widened
    its tokens to f32; a GPU moves bf16)."""
    from jaxdist.plan.cost import _gpu_bytes_factor, _hideable, _op_time, node_split
    from jaxdist.plan.hardware import load_hardware
    from jaxdist.plan.hlo_cost import program_cost
    from jaxdist.plan.search import LAYOUT_AXES, Candidate, configured, expert_traffic

    for mesh, remat in (("expert=4", "none"), ("data=2,expert=2", "full")):
        config, trainer, compiled, _ = _compiled(mesh, f"model.remat={remat}")
        sizes = parse_mesh(mesh)
        candidate = Candidate(tuple((a, sizes[a]) for a in LAYOUT_AXES), 1, remat)
        mesh_shape = {a: int(n) for a, n in trainer.layout.mesh.shape.items()}
        cost = program_cost(compiled.as_text(), mesh_shape, 32, 8, E // sizes["expert"])
        a2a = [op for op in cost.collectives if op.kind == "all-to-all"]
        assert a2a and all(op.axes == ("expert",) for op in a2a)
        wire, count = sum(op.executions * op.wire_bytes for op in a2a), sum(op.executions for op in a2a)
        n = sizes["expert"]
        t_dev = TOKENS // (sizes["data"] * n)
        forwards = 1 + (remat != "none")
        by_hand = LAYERS * ((2 * forwards + 2) * t_dev * K * D * 4 + forwards * t_dev * K * 4) * (n - 1) / n
        assert wire == pytest.approx(by_hand, rel=0.01)
        assert expert_traffic(configured(config, candidate), candidate) == (pytest.approx(wire, rel=0.01), count)
        h100 = load_hardware("h100")
        assert not any(_hideable(op, cost, h100) for op in a2a)
        crossing = node_split(mesh_shape, h100.gpus_per_node)
        link = h100.intra_node
        tokens_op = next(op for op in a2a if cost.is_f32(op))  # an f32 model's tokens: f32 on a GPU too, every byte priced
        priced = _op_time(tokens_op, h100, crossing) * _gpu_bytes_factor(tokens_op, cost, h100)
        assert priced == pytest.approx((n - 1) * link.latency + tokens_op.wire_bytes / (link.bandwidth * link.efficiency))
    # a bf16 model (as the planner compiles GPU plans): XLA:CPU widens the tokens to f32, a GPU moves bf16
    _, trainer, compiled, _ = _compiled("expert=4", "model.dtype=bfloat16")
    cost = program_cost(compiled.as_text(), {a: int(n) for a, n in trainer.layout.mesh.shape.items()}, 32, 8, E // 4)
    tokens = [op for op in cost.collectives if op.kind == "all-to-all" and cost.is_f32(op)]
    assert tokens and all(cost.is_widened(op) and _gpu_bytes_factor(op, cost, h100) == 0.5 for op in tokens)


def test_the_search_considers_an_expert_axis_only_for_moe_models_and_splits_their_states():
    """An expert axis appears among the candidates only for an MoE model, dividing its experts
    and inside a node; it splits the experts' states (not the rest) and the batch."""
    from jaxdist.plan.search import enumerate_candidates, estimated_memory, routed_expert_params, states_bytes

    moe = load_config(None, [*MOE, "model.vocab_size=256"])
    dense = load_config(None, [*TINY, "model.vocab_size=256"])
    moe_experts = {c.sizes["expert"] for c in enumerate_candidates(moe, 8, 8)}
    assert moe_experts == {1, 2, 4}  # 8 does not divide 4 experts
    assert {c.sizes["expert"] for c in enumerate_candidates(dense, 8, 8)} == {1}
    assert {c.sizes["expert"] for c in enumerate_candidates(moe, 8, 2)} == {1, 2}  # 2 devices per node
    routed = routed_expert_params(moe)
    assert routed == LAYERS * E * 3 * D * F
    by_axis = {c.sizes["expert"]: c for c in enumerate_candidates(moe, 4, 8) if c.sizes["data"] * c.sizes["expert"] == 4}
    total = 10**6 + routed
    one, four = (states_bytes(by_axis[e], total, routed) for e in (1, 4))
    assert one - four == pytest.approx(16 * routed * 3 / 4)
    assert estimated_memory(moe, by_axis[4], total, False) < estimated_memory(moe, by_axis[1], total, False)
