"""``jaxdist.analyze``: HLO collective accounting on hand-written HLO, then the compiled
train step of a tiny decoder under DP, FSDP and TP against the reference numbers."""

from __future__ import annotations

import functools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxdist.analyze import main
from jaxdist.config import load_config
from jaxdist.inspect.collectives import COLLECTIVE_KINDS, collective_kind, collective_ops, hlo_collectives
from jaxdist.inspect.hlo import loops_without_trip_count, parse_hlo, parse_instruction, shape_bytes
from jaxdist.inspect.step_report import build_report
from jaxdist.layout.mesh import mesh_device_count, parse_mesh
from jaxdist.training.aot import compile_train_step

from helpers import TINY

REPO = Path(__file__).resolve().parent.parent
CONTRACT_KEYS = {"devices", "mesh", "params", "flops_per_step", "memory_per_device_bytes", "collectives"}

# -- HLO parsing ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ("f32[8,128]{1,0}", 8 * 128 * 4),
        ("bf16[4,4]", 32),
        ("f32[]", 4),
        ("pred[3]{0}", 3),
        ("s8[5]", 5),
        ("u16[2,3]", 12),
        ("s64[2]", 16),
        ("f64[1,1]", 8),
        ("f16[10]", 20),
        ("f8e4m3fn[10]", 10),
        ("f8e5m2[3,2]", 6),
        ("s4[3]", 2),  # 12 bits round up to 2 bytes
        ("u32[<=8]", 32),  # bounded dynamic dimension: its bound
        ("(f32[2]{0}, bf16[4]{0})", 16),
        ("(s32[], /*index=1*/f32[8]{0}, (f32[2], u8[4]))", 4 + 32 + 8 + 4),
        ("token[]", 0),
        ("f32[8,128]{1,0:T(8,128)}", 8 * 128 * 4),  # TPU tiled layout
    ],
)
def test_shape_bytes(shape: str, expected: int) -> None:
    assert shape_bytes(shape) == expected


def test_shape_bytes_rejects_unknown_element_type() -> None:
    with pytest.raises(ValueError, match="unknown HLO element type"):
        shape_bytes("q7[4]")


def test_parse_instruction_tuple_shape_and_operands() -> None:
    line = (
        "  ROOT %all-reduce.3 = (f32[], /*index=1*/bf16[4,8]{1,0}) all-reduce(%a.1, %b-2), channel_id=1, "
        'replica_groups={{0,1}}, to_apply=%add, metadata={op_name="jit(f)/sum"}'
    )
    instruction = parse_instruction(line)
    assert instruction is not None
    assert (instruction.name, instruction.opcode, instruction.operands) == ("all-reduce.3", "all-reduce", ("%a.1", "%b-2"))
    assert shape_bytes(instruction.shape) == 4 + 64
    assert "to_apply=%add" in instruction.attributes
    assert parse_instruction("HloModule m") is None


def test_collective_kind() -> None:
    assert collective_kind("all-gather-start") == "all-gather"
    assert collective_kind("collective-permute") == "collective-permute"
    assert collective_kind("all-gather-done") is None
    assert collective_kind("fusion") is None


# Outer loop x32 containing an inner loop x4 (an all-reduce), an all-gather and a call to
# a computation with an all-to-all; at top level async forms, a tuple all-reduce, a
# reduce-scatter wrapped in async-start/async-done, and a loop without a known trip count.
HLO = """\
HloModule test, is_scheduled=true, entry_computation_layout={(f32[8,8]{1,0})->f32[16]{0}}, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%inner_body (p: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %p = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[1024]{0} get-tuple-element(%p), index=1
  %ar = f32[1024]{0} all-reduce(%v), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s32[], f32[1024]{0}) tuple(%i, %ar)
}

%cond (p: (s32[], f32[1024])) -> pred[] {
  %p.1 = (s32[], f32[1024]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%swap (q: f32[4,4]) -> f32[4,4] {
  %q = f32[4,4]{1,0} parameter(0)
  ROOT %a2a = f32[4,4]{1,0} all-to-all(%q), channel_id=2, replica_groups={{0,1}}, dimensions={0}
}

%outer_body (o: (s32[], f32[1024], f32[8,8])) -> (s32[], f32[1024], f32[8,8]) {
  %o = (s32[], f32[1024]{0}, f32[8,8]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%o), index=0
  %init = (s32[], f32[1024]{0}) tuple(%j, %j)
  %w = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"4"}}
  %shard = f32[8,8]{1,0} get-tuple-element(%o), index=2
  %ag = f32[64,8]{1,0} all-gather(%shard), channel_id=3, dimensions={0}, metadata={op_name="body=%swap"}
  %sq = f32[4,4]{1,0} slice(%shard), slice={[0:4], [0:4]}
  %called = f32[4,4]{1,0} call(%sq), to_apply=%swap
  ROOT %r = (s32[], f32[1024]{0}, f32[8,8]{1,0}) tuple(%j, %j, %shard)
}

%wrapped_rs (big: f32[128]) -> f32[16] {
  %big = f32[128]{0} parameter(0)
  ROOT %rs = f32[16]{0} reduce-scatter(%big), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
}

ENTRY %main (x8: f32[8,8]) -> f32[16] {
  %x8 = f32[8,8]{1,0} parameter(0)
  %loop_init = (s32[], f32[1024]{0}, f32[8,8]{1,0}) tuple(%x8, %x8, %x8)
  %loop = (s32[], f32[1024]{0}, f32[8,8]{1,0}) while(%loop_init), condition=%cond, body=%outer_body, backend_config={"known_trip_count":{"n":"32"}}
  %unknown = (s32[], f32[1024]{0}, f32[8,8]{1,0}) while(%loop_init), condition=%cond, body=%outer_body
  %ags = (f32[8,8]{1,0}, f32[64,8]{1,0}) all-gather-start(%x8), channel_id=5, dimensions={0}
  %agd = f32[64,8]{1,0} all-gather-done(%ags)
  %a = f32[10]{0} slice(%agd), slice={[0:10]}
  %b = bf16[20]{0} convert(%agd)
  %tar = (f32[10]{0}, bf16[20]{0}) all-reduce(%a, f32[20]{0} %b), channel_id=6, to_apply=%add
  %cps = (f32[32]{0}, f32[32]{0}, u32[], u32[]) collective-permute-start(%a), channel_id=7, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[32]{0} collective-permute-done(%cps)
  %big = f32[128]{0} reshape(%agd)
  %as = ((f32[128]{0}), f32[16]{0}, s32[]) async-start(%big), calls=%wrapped_rs
  ROOT %ad = f32[16]{0} async-done(%as), calls=%wrapped_rs
}
"""


@functools.cache
def hand_written_stats() -> dict[str, dict[str, int]]:
    return hlo_collectives(HLO)


def test_nested_loops_multiply_trip_counts() -> None:
    # the inner all-reduce runs 32 x 4 times from the known loop and 4 more from the unknown one
    assert hand_written_stats()["all-reduce"]["count"] == 32 * 4 + 4 + 1
    inner = (32 * 4 + 4) * 1024 * 4
    assert hand_written_stats()["all-reduce"]["bytes"] == inner + (10 * 4 + 20 * 4)  # + the tuple all-reduce
    # wire: the inner ones over {0,1} send 2 x 1/2 of their buffer; the tuple one, printed without
    # groups, spans all 8 partitions of the header: 2 x 7/8
    assert hand_written_stats()["all-reduce"]["wire_bytes"] == inner + round((10 * 4 + 20 * 4) * 2 * 7 / 8)


def test_calls_inherit_the_loop_multiplier() -> None:
    assert hand_written_stats()["all-to-all"] == {"count": 33, "bytes": 33 * 64, "wire_bytes": 33 * 32, "largest": 64}


def test_async_start_counts_once_with_the_done_result() -> None:
    # all-gather-start's tuple bundles operand and result; the payload is the result (the done's shape)
    gathered = 64 * 8 * 4
    assert hand_written_stats()["all-gather"] == {
        "count": 33 + 1,
        "bytes": 34 * gathered,
        "wire_bytes": 34 * gathered * 7 // 8,  # no groups printed: all 8 partitions
        "largest": gathered,
    }
    assert hand_written_stats()["collective-permute"] == {"count": 1, "bytes": 32 * 4, "wire_bytes": 32 * 4, "largest": 32 * 4}
    # a reduce-scatter inside async-start/async-done is counted once, by its operand size
    assert hand_written_stats()["reduce-scatter"] == {"count": 1, "bytes": 128 * 4, "wire_bytes": 128 * 4 * 7 // 8, "largest": 128 * 4}


def test_loop_without_trip_count_is_reported() -> None:
    module = parse_hlo(HLO)
    assert module.entry == "main"
    assert loops_without_trip_count(module) == 1
    assert set(hand_written_stats()) == set(COLLECTIVE_KINDS)


# -- compiled train steps of the tiny decoder -------------------------------------------

TINY_ANALYZE = tuple(o for o in TINY if not o.startswith("train.log_every"))


@functools.cache
def compiled_step(mesh: str, overrides: tuple[str, ...] = ()):
    config = load_config(None, (*TINY_ANALYZE, *overrides))
    sizes = parse_mesh(mesh)
    return compile_train_step(config, sizes, jax.devices()[: mesh_device_count(sizes)])


@functools.cache
def report(mesh: str, overrides: tuple[str, ...] = ()) -> dict:
    return build_report(*compiled_step(mesh, overrides))


def _grad_bytes(r: dict) -> int:
    return r["params"] * 4  # fp32 gradients


def test_report_has_the_contract_keys() -> None:
    r = report("data=8")
    assert set(r) >= CONTRACT_KEYS
    assert r["devices"] == 8 and r["mesh"] == {"replica": 1, "data": 8, "pipe": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    assert set(r["memory_per_device_bytes"]) >= {"arguments", "outputs", "temp", "total"}
    mem = r["memory_per_device_bytes"]
    assert mem["total"] == mem["arguments"] + mem["outputs"] - mem["alias"] + mem["temp"]
    assert set(r["collectives"]) == set(COLLECTIVE_KINDS)
    trainer, _ = compiled_step("data=8")
    assert r["params"] == trainer.n_params and r["param_bytes"] == 4 * r["params"]


def test_model_flops_agree_with_xla_cost_analysis() -> None:
    """The analytic FLOPs per step against XLA's own count of the compiled 1-device step.

    One layer, so the layer scan (whose body XLA's cost analysis counts once) runs once.
    XLA counts somewhat more: it computes the full [T, T] attention scores where the model
    counts the causal half (+3.8% at T=128, H*hd=256 here), plus elementwise and optimizer
    work (~1%); a wrong factor in the formula (backward pass, head, layers) is far outside.
    """
    shapes = ("model.d_model=256", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2", "train.seq_len=128", "train.global_batch=8")
    trainer, compiled = compiled_step("data=1", shapes)
    cost = compiled.cost_analysis()
    xla_flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
    model_flops = build_report(trainer, compiled)["flops_per_step"]
    assert 0.02 < xla_flops / model_flops - 1 < 0.08, (xla_flops, model_flops)


def test_data_parallel_all_reduces_the_gradients() -> None:
    r = report("data=8")
    assert r["collectives"]["all-reduce"]["bytes"] == pytest.approx(_grad_bytes(r), rel=0.10)
    assert all(r["collectives"][k]["count"] == 0 for k in COLLECTIVE_KINDS if k != "all-reduce")


def test_gradient_accumulation_reduces_once_under_dp() -> None:
    # DP accumulates each device's gradients over the microbatches and all-reduces once
    one, two = report("data=8"), report("data=8", ("train.microbatches=2",))
    assert two["collectives"]["all-reduce"]["bytes"] == pytest.approx(_grad_bytes(two), rel=0.10)
    assert two["collectives"]["all-reduce"]["bytes"] <= 1.05 * one["collectives"]["all-reduce"]["bytes"]


def test_gradient_accumulation_loop_multiplies_collectives() -> None:
    # FSDP gathers the parameters inside the microbatch loop: twice the trips, about twice
    # the gathers (XLA hoists a few loop-invariant ones out of the loop)
    one, two = report("fsdp=8"), report("fsdp=8", ("train.microbatches=2",))
    assert two["collectives"]["all-gather"]["count"] >= 1.8 * one["collectives"]["all-gather"]["count"]
    assert two["collectives"]["all-gather"]["bytes"] >= 1.8 * one["collectives"]["all-gather"]["bytes"]


def test_fsdp_gathers_params_and_reduces_gradients() -> None:
    r = report("fsdp=8")
    collectives = r["collectives"]
    param_bytes_compute = r["params"] * 4  # float32 compute in TINY
    # forward gathers every param; the backward gathers them again unless XLA keeps them
    assert param_bytes_compute <= collectives["all-gather"]["bytes"] <= 2 * param_bytes_compute
    # XLA's CPU backend emits all-reduce + dynamic-slice where a GPU forms reduce-scatters,
    # so the gradient reduction is counted over both kinds (same payload by our measure)
    reduced = collectives["reduce-scatter"]["bytes"] + collectives["all-reduce"]["bytes"]
    assert reduced == pytest.approx(_grad_bytes(r), rel=0.15)
    if collectives["reduce-scatter"]["count"] == 0:
        assert any("no reduce-scatter" in note for note in r["notes"])


def test_fsdp_shards_argument_memory() -> None:
    dp = report("data=8")["memory_per_device_bytes"]["arguments"]
    fsdp = report("fsdp=8")["memory_per_device_bytes"]["arguments"]
    assert fsdp <= dp / 8 * 1.10


def test_tensor_parallel_all_reduces_activations_per_layer() -> None:
    config = load_config(None, TINY_ANALYZE)
    layers, m = config.model.n_layers, config.model
    activation = config.train.global_batch * config.train.seq_len * m.d_model * 4
    _, compiled = compiled_step("tensor=4")
    ops = collective_ops(parse_hlo(compiled.as_text()))
    in_layer_loop = [op for op in ops if op.kind == "all-reduce" and op.executions == layers]
    # Megatron: 2 activation all-reduces per layer forward and 2 backward; XLA may combine
    # several into one tuple all-reduce (one execution, summed bytes), and with
    # model.fused_projections=false it splits the backward ones per matmul (q, k, v and
    # gate, up), so allow up to 8 activations per layer (tests/test_fused_and_chunked.py
    # counts them exactly)
    assert sum(op.executions for op in in_layer_loop) >= 4 * layers
    assert all(op.bytes % activation == 0 for op in in_layer_loop)
    loop_bytes = sum(op.bytes * op.executions for op in in_layer_loop)
    assert 4 * layers * activation <= loop_bytes <= 8 * layers * activation
    # the report multiplies by the trip count; the rest (embedding, vocab-split logits) is small
    r = report("tensor=4")
    assert r["collectives"]["all-reduce"]["count"] == sum(op.executions for op in ops if op.kind == "all-reduce")
    assert loop_bytes <= r["collectives"]["all-reduce"]["bytes"] <= loop_bytes + 4 * activation


def test_tensor_parallel_never_gathers_a_full_weight() -> None:
    m = load_config(None, TINY_ANALYZE).model
    d, h, kv, hd, f = m.d_model, m.n_heads, m.n_kv_heads, m.resolved_head_dim, m.resolved_mlp_dim
    smallest_weight = 4 * min(d * h * hd, d * kv * (h // kv + 2) * hd, d * f)  # wo, wqkv, w_down (w_gate_up: 2 d f) in fp32
    r = report("tensor=4")
    assert r["collectives"]["all-gather"]["largest"] < smallest_weight
    assert r["mesh"]["tensor"] == 4 and r["strategy"] == "dp+tp"


def test_the_attention_scores_note_is_there_only_where_the_scores_are() -> None:
    """XLA:CPU's plain attention holds fp32 [batch, kv heads, group, seq, seq] scores (read from the
    compiled HLO) and the report says so; a context axis's blockwise kernel holds none, and its
    report (JSON notes and the printed table) says nothing of them."""
    from jaxdist.inspect.step_report import format_report

    long = ("train.seq_len=256",)
    for mesh, held in (("data=2", True), ("context=2", False)):
        _, compiled = compiled_step(mesh, long)
        scores = re.findall(r"f32\[[\d,]*,256,256\]", compiled.as_text())
        r = report(mesh, long)
        said = [n for n in r["notes"] if "[batch, heads, seq, seq] scores" in n]
        assert bool(scores) == held and len(said) == held, (mesh, scores, r["notes"])
        assert ("[batch, heads, seq, seq] scores" in format_report(r)) == held


# -- the CLI ------------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxdist.analyze", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_cli_prints_one_json_object() -> None:
    result = _cli("--mesh", "data=2", *TINY_ANALYZE, "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert set(out) >= CONTRACT_KEYS
    assert out["devices"] == 2 and out["mesh"]["data"] == 2
    assert set(out["memory_per_device_bytes"]) >= {"arguments", "outputs", "temp", "total"}
    assert all(set(out["collectives"][k]) >= {"count", "bytes"} for k in COLLECTIVE_KINDS)
    assert out["collectives"]["all-reduce"]["bytes"] == pytest.approx(out["params"] * 4, rel=0.10)
    assert math.isclose(out["flops_per_step"], report("data=8")["flops_per_step"])


@pytest.mark.parametrize("args", [("--mesh", "data=3x"), ("--mesh", "data=3"), ("model.no_such_key=1",)])
def test_cli_bad_input_is_one_line_and_exit_2(args: tuple[str, ...]) -> None:
    result = _cli(*args, "--json")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxdist: error: "), result.stderr
    assert result.stdout == ""


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--mesh", "fsdp=2", *TINY_ANALYZE]) == 0
    out = capsys.readouterr().out
    assert "fsdp=2" in out
    assert "all-gather" in out and "all-to-all" not in out  # only the kinds the step runs
    assert "over fsdp" in out  # the mesh axes they span
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)


def test_wire_bytes_and_axes_of_compiled_steps() -> None:
    """Against the parameter count (not the HLO): DP's gradient ring all-reduce sends
    2(n-1)/n of the gradients, over the data axis only; FSDP's collectives span fsdp and TP's tensor."""
    dp = report("data=8")
    assert set(dp["collectives_by_axes"]) == {"data"}
    assert dp["collectives"]["all-reduce"]["wire_bytes"] == pytest.approx(2 * 7 / 8 * _grad_bytes(dp), rel=0.02)
    assert dp["collectives_by_axes"]["data"]["wire_bytes"] == dp["collectives"]["all-reduce"]["wire_bytes"]
    fsdp = report("fsdp=8")
    assert set(fsdp["collectives_by_axes"]) == {"fsdp"}
    assert fsdp["collectives"]["all-gather"]["wire_bytes"] == pytest.approx(7 / 8 * fsdp["collectives"]["all-gather"]["bytes"], rel=1e-3)
    assert set(report("tensor=4")["collectives_by_axes"]) == {"tensor"}
