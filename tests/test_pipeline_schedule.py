"""The pipeline schedules' tick algebra, checked by simulating every tick in plain Python,
the bubble formulas by hand, the configs they reject, and how the planner prices them."""

import itertools
import re

import pytest

from jaxdist.config import load_config
from jaxdist.layout.mesh import parse_mesh
from jaxdist.parallel.pipeline_schedule import PipelineSpec, executed_over_ideal, one_f_one_b_backward, one_f_one_b_forward
from jaxdist.parallel.pipeline_vtable import B0, B1, F0, F1, IDLE, NONE, W0, W1, line_table, v_table

from helpers import TINY

SHAPES = [(2, 2, 1), (2, 4, 1), (4, 4, 1), (3, 5, 1), (2, 4, 2), (4, 8, 2), (2, 6, 3), (4, 4, 3)]  # (S, M, V)


def _simulate(spec: PipelineSpec):
    """Every device's forwards and backwards over the ticks, by the schedule's index math, with
    each tick's phase (warm-up: forwards only; then both; cool-down: backwards only)."""
    S = spec.stages
    warm, steady, _ = spec.phases
    forwards, backwards, slots = {}, {}, {}
    for t, s in itertools.product(range(spec.ticks), range(S)):
        valid, i, m, v = one_f_one_b_forward(spec, s, t)
        if valid:
            assert t < warm + steady, ("a forward in the cool-down", t, s)
            assert (m, v * S + s) not in forwards
            forwards[m, v * S + s] = t
            slots[s, i] = t
        valid, m, v, i_f = one_f_one_b_backward(spec, s, t)
        if valid:
            assert t >= warm, ("a backward in the warm-up", t, s)
            assert (m, v * S + s) not in backwards
            backwards[m, v * S + s] = (t, s, i_f)
    return forwards, backwards, slots


@pytest.mark.parametrize(("stages", "microbatches", "virtual"), SHAPES)
def test_one_f_one_b_ticks_respect_every_dependency(stages, microbatches, virtual):
    """Each (microbatch, global stage g = v S + s) runs forward and backward exactly once; the
    forward of g one tick after g-1's (one ppermute right, the last device wrapping to device
    0), the backward of g one tick after g+1's (one to the left), the last stage's backward in
    its forward's tick (the head's cotangent); a ring slot is read before 2 V S - 1 later
    forwards could overwrite it; and each device executes V M + S - 1 chunk steps."""
    spec = PipelineSpec(stages, microbatches, virtual, "1f1b")
    S, M, G = stages, microbatches, stages * virtual
    forwards, backwards, slots = _simulate(spec)
    assert set(forwards) == set(backwards) == set(itertools.product(range(M), range(G)))
    for m, g in forwards:
        if g > 0:
            assert forwards[m, g] == forwards[m, g - 1] + 1
        t, s, i_f = backwards[m, g]
        if g < G - 1:
            assert t == backwards[m, g + 1][0] + 1
        else:
            assert t == forwards[m, g]
        assert slots[s, i_f] == forwards[m, g]  # the slot holds this microbatch chunk's forward
        assert 0 <= t - s - i_f < spec.ring_slots  # forwards since then on this device: fewer than the slots
    warm, steady, cool = spec.phases
    assert warm + steady + cool == spec.ticks == virtual * M + virtual * S + S - 2
    assert ((warm + steady) + (steady + cool)) / 2 == spec.work_units == virtual * M + S - 1  # forward ticks + backward ticks


@pytest.mark.parametrize(("stages", "microbatches", "virtual"), [s for s in SHAPES if s[2] > 1])
def test_interleaved_heads_fall_in_the_head_ticks(stages, microbatches, virtual):
    """The last device finishes a microbatch's last chunk only in the S ticks starting at
    V S - 1 + k V S (k < M / S): the only ticks that run the head."""
    spec = PipelineSpec(stages, microbatches, virtual, "1f1b")
    S, V = stages, virtual
    head_ticks = {V * S - 1 + k * V * S + r for k in range(microbatches // S) for r in range(S)}
    last_device = [one_f_one_b_forward(spec, S - 1, t) for t in range(spec.ticks)]
    finished = {t for t, (valid, _, _, chunk) in enumerate(last_device) if valid and chunk == V - 1}
    assert finished == head_ticks and len(finished) == microbatches


def test_bubbles_by_hand():
    """(S-1)/(V M + S-1) for every schedule: GPipe S=4 M=16 3/19; circular V=2 3/35; 1F1B has
    GPipe's (its 2S-2 extra ticks are forward-only or backward-only); interleaved S=4 M=8 V=2
    3/19 over 26 ticks in phases (7, 12, 7)."""
    assert PipelineSpec(4, 16, 1, "gpipe").bubble == pytest.approx(3 / 19)
    assert PipelineSpec(4, 16, 2, "circular").bubble == pytest.approx(3 / 35)
    one = PipelineSpec(4, 16, 1, "1f1b")
    assert (one.ticks, one.phases, one.bubble) == (22, (3, 16, 3), pytest.approx(3 / 19))
    inter = PipelineSpec(4, 8, 2, "1f1b")
    assert (inter.ticks, inter.phases, inter.bubble, inter.interleaved) == (26, (7, 12, 7), pytest.approx(3 / 19), True)
    # executed / ideal: layers x (V M + S - 1) / (V M), the head once; recomputing (S=2, M=4:
    # 6 ticks of forward F, 5 backward ticks of 3F, over 4 x 3F; the head in 5 ticks, not 4)
    assert executed_over_ideal(PipelineSpec(2, 4, 1, "1f1b"), 0.9) == pytest.approx(0.9 * 5 / 4 + 0.1)
    assert executed_over_ideal(PipelineSpec(2, 4, 1, "1f1b", recompute=True), 0.9) == pytest.approx(0.9 * 21 / 12 + 0.1 * 5 / 4)
    assert executed_over_ideal(PipelineSpec(2, 4, 2, "circular", recompute=True), 1.0) == pytest.approx(9 / 8)  # no recompute there


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("parallel.schedule=1f1b", "parallel.virtual_stages=2", "parallel.pipeline_microbatches=3"),
            "must be a multiple of the pipe axis (2)",
        ),
        (("parallel.schedule=1f1b", "parallel.virtual_stages=4"), "must be divisible by pipe x virtual stages (2 x 4)"),
        (("train.seq_len=31",), "train.seq_len (31) must be divisible by the pipe axis (2)"),
        (("parallel.virtual_stages=2",), "needs parallel.schedule=circular or 1f1b"),
        (("parallel.schedule=zbv", "parallel.virtual_stages=3"), "the V-shaped schedule runs two chunks per device"),
        (("parallel.schedule=zbv", "model.n_layers=2"), "model.n_layers (2) must be divisible by pipe x virtual stages (2 x 2)"),
    ],
)
def test_pipeline_config_errors(overrides, message):
    from jaxdist.errors import MeshError
    from jaxdist.layout.validate import check_config_on_mesh

    config = load_config(None, [*TINY, "model.n_layers=4", *overrides])
    with pytest.raises(MeshError, match=re.escape(message)):
        check_config_on_mesh(config, parse_mesh("pipe=2"))


@pytest.mark.parametrize(
    ("mesh", "schedule", "warned"),
    [
        ("pipe=2", "gpipe", "parallel.schedule=gpipe"),
        ("pipe=2", "circular", "parallel.schedule=circular"),
        ("data=2", "1f1b", "a mesh without a pipe axis"),
        ("pipe=2", "1f1b", None),
        ("pipe=2", "zbv", "parallel.schedule=zbv"),
    ],
)
def test_recompute_without_effect_says_so(mesh, schedule, warned):
    from jaxdist.layout.validate import check_config_on_mesh

    overrides = [*TINY, "model.n_layers=4", f"parallel.schedule={schedule}", "parallel.pipeline_recompute=true"]
    overrides += ["parallel.virtual_stages=2"] if schedule == "circular" else []
    warnings = [w for w in check_config_on_mesh(load_config(None, overrides), parse_mesh(mesh)) if "pipeline_recompute" in w]
    if warned is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warned in warnings[0] and warnings[0].startswith("parallel.pipeline_recompute=True has no effect")


def test_planner_prices_recompute_keep_and_interleaving():
    """Recomputing costs time (the forward again in every backward tick), keeping costs memory (the ring of
    residuals instead of stage inputs), interleaving lowers the executed chunk steps; the
    candidates of a 1F1B config include both choices, and their overrides set them."""
    from jaxdist.plan.hardware import load_hardware
    from jaxdist.plan.search import Candidate, enumerate_candidates, estimated_memory, estimated_time

    hardware = load_hardware("h100")
    config = load_config(None, ["model.n_layers=8", "parallel.schedule=1f1b", "parallel.pipeline_microbatches=8", "train.global_batch=64"])
    mesh = (("data", 1), ("fsdp", 1), ("expert", 1), ("context", 1), ("tensor", 1), ("pipe", 4))
    keep, recompute = Candidate(mesh, 1, "none", "", False), Candidate(mesh, 1, "none", "", True)
    n = 10**8
    assert estimated_time(config, recompute, n, hardware) > 1.2 * estimated_time(config, keep, n, hardware)
    assert estimated_memory(config, keep, n, True) > estimated_memory(config, recompute, n, True)
    interleaved = load_config(
        None,
        [
            "model.n_layers=8",
            "parallel.schedule=1f1b",
            "parallel.pipeline_microbatches=8",
            "train.global_batch=64",
            "parallel.virtual_stages=2",
        ],
    )
    # work units 8 + 3 = 11 of 8 against 16 + 3 = 19 of 16 (the layers' share of the time)
    assert estimated_time(interleaved, keep, n, hardware) < 0.95 * estimated_time(config, keep, n, hardware)
    assert "parallel.pipeline_recompute=true" in recompute.overrides() and "recompute" in recompute.label()
    choices = {c.pipeline_recompute for c in enumerate_candidates(config, 4, 8) if c.sizes["pipe"] > 1}
    assert choices == {False, True}
    assert {c.pipeline_recompute for c in enumerate_candidates(load_config(None, ["model.n_layers=8"]), 4, 8)} == {None}


@pytest.mark.parametrize("shape", ["line", "v"])
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 2), (2, 4), (2, 8), (3, 5), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_tables_replayed_hand_every_operation_what_it_reads(shape, stages, microbatches):
    """zb1's (a line) and zbv's (a V) tables replayed on symbols, the way ``pipeline_zb``
    executes them: each device's mailbox, residual ring and W ring hold named values; every
    forward reads the previous chunk's output of its microbatch (device 0's first: the
    microbatch itself), every B the next chunk's cotangent (the last chunk's: the head's, on the
    head device in the tick of its forward), every B and W the residuals of their forward, every
    W what its B left; nothing lands on a live slot, every message sent is filed, each chunk runs
    each microbatch's F, B and W once, and the buffers end empty."""
    S, M = stages, microbatches
    table = line_table(S, M) if shape == "line" else v_table(S, M)
    legs = 2 if shape == "v" else 1
    G = legs * S  # chunks
    chunk = {(s, leg): s if leg == 0 else 2 * S - 1 - s for s in range(S) for leg in range(legs)}
    leg_of = {F0: 0, B0: 0, W0: 0, F1: 1, B1: 1, W1: 1}
    head_device = 0 if shape == "v" else S - 1
    mail, ring, wring = ([{} for _ in range(S)] for _ in range(3))
    done, dx = set(), set()

    def put(buffer, slot, size, value):
        assert 0 <= slot < size and slot not in buffer, (slot, size, buffer)
        buffer[slot] = value

    for t in range(table.ticks):
        out = [None] * S
        for s in range(S):
            op, m = table.op[t][s], table.mb[t][s]
            if op == IDLE:
                continue
            c = chunk[s, leg_of[op]]
            assert (op, c, m) not in done
            done.add((op, c, m))
            if op in (F0, F1):
                wanted = ("x", m) if c == 0 else ("act", c - 1, m)
                got = ("x", m) if c == 0 and table.inbox[t][s] == NONE else mail[s].pop(table.inbox[t][s])
                assert got == wanted, (t, s, got, wanted)
                put(ring[s], table.residual[t][s], table.residual_slots, ("res", c, m))
                out[s] = ("act", c, m)
            elif op in (B0, B1):
                assert mail[s].pop(table.inbox[t][s]) == ("cot", c + 1, m), (t, s)
                assert ring[s][table.residual[t][s]] == ("res", c, m), (t, s)  # read; its W frees it
                put(wring[s], table.pending[t][s], table.pending_slots, ("w", c, m))
                out[s] = ("cot", c, m)
                if c == 0:
                    dx.add(m)
            else:
                assert wring[s].pop(table.pending[t][s]) == ("w", c, m), (t, s)
                assert ring[s].pop(table.residual[t][s]) == ("res", c, m), (t, s)
        assert table.head[t] == (out[head_device] is not None and out[head_device][:2] == ("act", G - 1))
        # what moves at the end of the tick: right, left, or to the device itself
        for s in range(S):
            arrivals = {
                "from_left": out[s - 1] if s > 0 and table.op[t][s - 1] in (F0, B1) else None,
                "from_right": out[s + 1] if s < S - 1 and table.op[t][s + 1] in (F1, B0) else None,
                "local": None,
            }
            if s == head_device and table.head[t]:
                arrivals["local"] = ("cot", G, table.mb[t][s])
            if shape == "v" and s == S - 1 and table.op[t][s] in (F0, B1):
                arrivals["local"] = out[s]
            for name, value in arrivals.items():
                slot = getattr(table, name)[t][s]
                if value is None or (value[0] == "act" and value[1] == G - 1) or (value[0] == "cot" and value[1] == 0):
                    assert slot == NONE, (t, s, name, value)  # nothing to file: no message (or one that ends here)
                else:
                    put(mail[s], slot, table.mail_slots, value)
    assert len(done) == 3 * G * M and dx == set(range(M))
    assert not any(mail) and not any(ring) and not any(wring)
    assert table.cost == sum(any(op != IDLE for op in row) for row in table.op)
    if shape == "line":  # residuals and W inputs together within the lockstep 1F1B ring's 2 S - 1 chunks
        assert table.residual_slots + table.pending_slots <= 2 * S - 1


def test_zb1_table_by_hand_and_its_bubble_against_one_f_one_b():
    """S = 4, M = 8, in thirds of a chunk step: 1F1B runs 3 warm-up forwards, 8 ticks of F + B +
    W and 3 of B + W: 3 + 24 + 6 = 33 for 24 of work, a bubble of 9/33. zb1 takes 28 ticks for the
    same 24 (a bubble of 4/28: ZB-H1's 3/27 with one tick more) holding 4 chunks' residuals and 3
    of B's outputs, the 7 chunks 1F1B's ring holds. With M = 16: 52 ticks against 57."""
    zb, one_f_one_b = PipelineSpec(4, 8, 1, "zb1"), PipelineSpec(4, 8, 1, "1f1b")
    table = line_table(4, 8)
    assert (table.ticks, table.cost, table.residual_slots, table.pending_slots) == (28, 28, 4, 3)
    assert zb.bubble == pytest.approx(4 / 28) and one_f_one_b.bubble == pytest.approx(9 / 33)
    assert executed_over_ideal(zb, 1.0) == pytest.approx(28 / 24)
    longer = PipelineSpec(4, 16, 1, "zb1")
    assert longer.bubble == pytest.approx(4 / 52) and longer.bubble < PipelineSpec(4, 16, 1, "1f1b").bubble / 2
    # the first device's rows: forwards until 4 are held, then B, F and W as they come
    first = [(table.op[t][0], table.mb[t][0]) for t in range(8)]
    assert first[:4] == [(F0, 0), (F0, 1), (F0, 2), (F0, 3)] and IDLE in [op for op, _ in first[4:]]


def test_v_table_bubble_is_under_half_of_one_f_one_b_at_its_memory():
    """S = 4, M = 8: zbv's 51 ticks of a third of a chunk step hold 48 of work (2 chunks x 8
    microbatches x F, B, W), a bubble of 3/51 against 1F1B's 9/33 and zb1's 4/28; a device holds
    at most 2 S = 8 chunks' residuals, S stages' worth, where the lockstep 1F1B ring holds 2 S - 1
    stages."""
    zbv, one_f_one_b = PipelineSpec(4, 8, 2, "zbv"), PipelineSpec(4, 8, 1, "1f1b")
    table = v_table(4, 8)
    assert (table.ticks, table.cost) == (51, 51)
    assert zbv.bubble == pytest.approx(3 / 51) and zbv.bubble <= one_f_one_b.bubble / 2
    assert table.residual_slots == 8 and table.residual_slots / zbv.virtual < one_f_one_b.ring_slots
    assert executed_over_ideal(zbv, 1.0) == pytest.approx(51 / 48)


def test_the_planner_searches_the_pipeline_schedules_it_is_given():
    """``plan --schedules``: every pipe layout once per schedule (1F1B and interleaved 1F1B with both
    recompute choices), each candidate's config running it (zbv only where the layers divide into
    2 S chunks), layouts without a pipe axis once; the rough time follows each schedule's executed
    chunk steps (zbv's third-of-a-chunk ticks under 1F1B's at S = 4, M = 8), and the schedules that
    run their backward inside the forward keep one microbatch's logits at a time."""
    from jaxdist.parallel.pipeline_schedule import pipeline_spec
    from jaxdist.plan.__main__ import pipeline_name
    from jaxdist.plan.hardware import load_hardware
    from jaxdist.plan.search import PIPELINE_SCHEDULES, configured, enumerate_candidates, estimated_memory, estimated_time

    config = load_config(None, ["model.n_layers=8", "parallel.pipeline_microbatches=8", "train.global_batch=64"])
    candidates = enumerate_candidates(config, 4, 8, schedules=PIPELINE_SCHEDULES)
    piped = [c for c in candidates if c.sizes["pipe"] > 1]
    assert {c.schedule for c in candidates if c.sizes["pipe"] == 1} == {""}
    assert {c.schedule for c in piped} == set(PIPELINE_SCHEDULES)
    for c in piped:
        run = configured(config, c)
        spec = pipeline_spec(run.parallel, c.sizes["pipe"])
        label = "interleaved" if spec.interleaved else spec.schedule
        assert label == c.schedule and (c.pipeline_recompute is not None) == (spec.schedule == "1f1b"), c
        assert f"parallel.schedule={run.parallel.schedule}" in c.overrides() and c.schedule in c.label()
        assert pipeline_name(config, c) == c.schedule  # what the table and JSON call it
    four = {c.schedule for c in piped if c.sizes["pipe"] == 4}
    assert "zbv" in four  # 8 layers into 2 x 4 chunks
    assert {c.schedule for c in enumerate_candidates(load_config(None, ["model.n_layers=4"]), 4, 8, schedules=("zbv",))} == {"", "zbv"}
    assert not [c for c in enumerate_candidates(load_config(None, ["model.n_layers=4"]), 4, 8, schedules=("zbv",)) if c.sizes["pipe"] == 4]

    hardware = load_hardware("h100")
    same = {c.schedule: c for c in piped if c.sizes["pipe"] == 4 and c.microbatches == 1 and c.remat == "none" and not c.pipeline_recompute}
    n = 10**8
    assert estimated_time(config, same["zbv"], n, hardware) < estimated_time(config, same["1f1b"], n, hardware)
    assert estimated_memory(config, same["zbv"], n, True) < estimated_memory(config, same["gpipe"], n, True)
