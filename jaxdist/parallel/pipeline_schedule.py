"""Pipeline schedules as plain numbers: stages, microbatches, ticks, phases and the bubble.

Pure Python (no JAX), so configs are validated against a mesh before JAX starts.

Work is counted in chunk steps: one chunk (L / (S V) layers) of one microbatch, forward
and backward. Every schedule runs in lockstep SPMD, so a stage also executes the masked
work of the ticks where it has nothing to do; ``work_units`` is what each device executes,
``V M`` of it useful, and the bubble is the idle share, (S-1)/(V M + S-1) for all three:

- gpipe / circular: V M + S - 1 forward ticks, and autodiff's backward mirrors them.
- 1f1b (V = 1) and interleaved 1F1B (V > 1): V M + V S + S - 2 ticks in three phases --
  V S - 1 forward-only ticks (warm-up), V M - V S + S ticks with a forward and a
  backward, V S - 1 backward-only ticks (cool-down) -- so the same V M + S - 1 units.
- zb1 (zero bubble, V = 1): 1F1B's ticks with each backward split into its input gradient
  (B, at 1F1B's tick) and its weight gradient (W), which a device runs later in a slot of its
  own that would otherwise idle: the forward slot once its forwards are done, the backward
  slot once its backwards are, and a W slot that some ticks add for every device
  (``ZeroBubbleTable``). Counted in thirds of a chunk step (F, B and W one each), a tick costs
  the slots it has: the bubble is (cost - 3 M) / cost.
- zbv (zero bubble in a V, V = 2): the model's chunks down the devices and back up, B and W
  split as in zb1, one operation per device per tick (``pipeline_vtable``): the bubble is
  (cost - 6 M) / cost, in thirds of a chunk step.
"""

from __future__ import annotations

import dataclasses
import functools

from jaxdist.parallel.pipeline_vtable import v_table

SCHEDULES = ("gpipe", "circular", "1f1b", "zb1", "zbv")


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    stages: int  # S: the size of the pipe axis
    microbatches: int  # M
    virtual: int  # V: chunks per device (circular, interleaved 1F1B; 1 otherwise)
    schedule: str
    recompute: bool = False  # 1F1B: recompute the stage's forward in its backward instead of keeping its activations

    @property
    def interleaved(self) -> bool:
        return self.schedule == "1f1b" and self.virtual > 1

    @property
    def ticks(self) -> int:
        """Scan steps of the schedule (a 1F1B tick may hold a forward, a backward or both)."""
        s, m, v = self.stages, self.microbatches, self.virtual
        if self.schedule == "zbv":
            return v_table(s, m).ticks
        if self.schedule in ("1f1b", "zb1"):
            return v * m + v * s + s - 2
        return v * m + s - 1

    @property
    def phases(self) -> tuple[int, int, int]:
        """1F1B's (forward-only, forward-and-backward, backward-only) tick counts."""
        s, m, v = self.stages, self.microbatches, self.virtual
        return v * s - 1, v * m - v * s + s, v * s - 1

    @property
    def work_units(self) -> float:
        """Chunk steps (forward + backward of one chunk) each device executes, masked ones included
        (zb1, zbv: their slots' cost in chunk steps, a third each)."""
        if self.schedule == "zb1":
            return zero_bubble_table(self.stages, self.microbatches).cost / 3
        if self.schedule == "zbv":
            return v_table(self.stages, self.microbatches).cost / 3
        return self.virtual * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Idle share of the executed work: (S-1)/(V M + S-1) (zb1, zbv: their tables')."""
        return (self.work_units - self.virtual * self.microbatches) / self.work_units

    @property
    def ring_slots(self) -> int:
        """1F1B: microbatch chunks a device holds between their forward and backward (at most 2 V S - 2 ticks apart)."""
        return 2 * self.virtual * self.stages - 1

    def activations_alive(self) -> float:
        """Microbatches of a stage's full activations a device keeps at once (the planner's count):
        GPipe and circular keep every microbatch; 1F1B keeps its ring of chunk residuals
        (``ring_slots`` chunks of 1/V of a stage), or with ``recompute`` one microbatch's
        (its backward's working set) while the ring holds only stage inputs."""
        if self.schedule == "zb1":  # 1F1B's ring, and the weight gradients' inputs waiting in theirs
            return self.ring_slots + zero_bubble_table(self.stages, self.microbatches).w_ring
        if self.schedule == "zbv":  # its rings of half-stage chunks: residuals, and W inputs
            table = v_table(self.stages, self.microbatches)
            return (table.residual_slots + table.pending_slots) / self.virtual
        if self.schedule != "1f1b":
            return float(self.microbatches)
        return 1.0 if self.recompute else self.ring_slots / self.virtual


def one_f_one_b_forward(spec: PipelineSpec, stage, tick):
    """1F1B's forward at ``tick`` on device ``stage``: (valid, iteration i, microbatch, chunk v).
    Plain integers or JAX arrays (the schedule's own index math; i is unclipped)."""
    s, v = spec.stages, spec.virtual
    i = tick - stage
    return (i >= 0) & (i < v * spec.microbatches), i, (i // (s * v)) * s + i % s, (i // s) % v


def one_f_one_b_backward(spec: PipelineSpec, stage, tick):
    """1F1B's backward at ``tick`` on device ``stage``: (valid, microbatch, chunk v, the forward
    iteration whose ring slot holds its activations). Unclipped, like ``one_f_one_b_forward``."""
    s, v = spec.stages, spec.virtual
    j = tick - (v * s - 1) - (s - 1 - stage)
    chunk = v - 1 - (j // s) % v
    return (j >= 0) & (j < v * spec.microbatches), (j // (s * v)) * s + j % s, chunk, (j // (s * v)) * s * v + chunk * s + j % s


IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3  # what a zero-bubble slot runs


@dataclasses.dataclass(frozen=True)
class ZeroBubbleTable:
    """zb1's slots, per tick and device: ``forward[t][s]`` is (op, microbatch) with op FORWARD,
    WEIGHT or IDLE; ``backward[t][s]`` BACKWARD, WEIGHT or IDLE; ``weight[t][s]`` WEIGHT or IDLE,
    in the ticks ``weight_ticks`` that have a W slot. A tick runs its forward slot, the head
    (steady ticks), its backward slot, then its W slot. ``w_ring``: weight gradients a device
    holds the inputs of at once (B done, W not)."""

    stages: int
    microbatches: int
    forward: tuple[tuple[tuple[int, int], ...], ...]
    backward: tuple[tuple[tuple[int, int], ...], ...]
    weight: tuple[tuple[tuple[int, int], ...], ...]
    weight_ticks: frozenset[int]
    w_ring: int

    @property
    def ticks(self) -> int:
        return len(self.forward)

    @property
    def cost(self) -> int:
        """Slots executed, in thirds of a chunk step: the warm-up's forward slot, then a forward
        and a backward slot a tick, and a W slot in ``weight_ticks``."""
        warm = self.stages - 1
        return warm + 2 * (self.ticks - warm) + len(self.weight_ticks)


def _place_weights(stages: int, microbatches: int, weight_ticks: frozenset[int]):
    """Each device's W in the first free slot after its B (forward slots once its forwards are
    done, backward slots once its backwards are, then the W slots): the table, and the most W
    inputs a device holds at once, or None when a W is left over."""
    s_, m_ = stages, microbatches
    ticks = m_ + 2 * s_ - 2
    rows = {slot: [[(IDLE, 0)] * s_ for _ in range(ticks)] for slot in ("forward", "backward", "weight")}
    held = 0
    for s in range(s_):
        pending: list[int] = []
        for t in range(ticks):
            m = t - s
            if 0 <= m < m_:
                rows["forward"][t][s] = (FORWARD, m)
            elif pending:
                rows["forward"][t][s] = (WEIGHT, pending.pop(0))
            m = t - (2 * s_ - 2 - s)
            if 0 <= m < m_:
                rows["backward"][t][s] = (BACKWARD, m)
                pending.append(m)
            elif pending:
                rows["backward"][t][s] = (WEIGHT, pending.pop(0))
            held = max(held, len(pending))
            if t in weight_ticks and pending:
                rows["weight"][t][s] = (WEIGHT, pending.pop(0))
        if pending:
            return None
    return rows, held


@functools.cache
def zero_bubble_table(stages: int, microbatches: int) -> ZeroBubbleTable:
    """zb1's table: the fewest W slots that finish every W (max(1, M - 2 S + 2): each device has
    2 S - 2 free slots after its first B), in one run of ticks (the latest of those that hold the
    fewest W inputs at once), so that the schedule's loops are few: a run of ticks with a W slot is
    a loop of its own, and XLA gives every loop its own temporaries. Lockstep ticks cost the slots
    they have on every device, so each added W slot costs a third of a chunk step: this table
    takes the least time; its W inputs wait longer than 1F1B's activations (``w_ring``)."""
    ticks = microbatches + 2 * stages - 2
    count = max(1, microbatches - 2 * stages + 2)
    best = None
    while best is None:
        for low in range(ticks - count + 1):
            chosen = frozenset(range(low, low + count))
            placed = _place_weights(stages, microbatches, chosen)
            if placed is not None and (best is None or placed[1] <= best[1][1]):
                best = (chosen, placed)
        count += 1
    chosen, (rows, held) = best
    freeze = lambda table: tuple(tuple(row) for row in table)  # noqa: E731
    return ZeroBubbleTable(stages, microbatches, freeze(rows["forward"]), freeze(rows["backward"]), freeze(rows["weight"]), chosen, held)


def executed_over_ideal(spec: PipelineSpec, layer_share: float) -> float:
    """The matmul FLOPs a device executes per step over the ideal (the unpipelined step's / S),
    by the tick algebra: the layers' share of the work (``layer_share``; the rest is the
    head, spread over the stages, 1/S each) runs ``work_units / (V M)`` times, and the head
    once per microbatch. 1F1B recomputing runs its cool-down in the middle phase's loop
    (one loop's temporaries less): every tick has a chunk forward (F), the V M + S - 1
    backward ticks add the recomputed forward and the backward (3F), and the middle's head
    ticks grow by the cool-down's V S - 1."""
    s, m, v = spec.stages, spec.microbatches, spec.virtual
    if spec.schedule in ("zb1", "zbv"):  # each slot runs a third of a chunk step (F, B or W)
        return layer_share * spec.work_units / (v * m) + (1 - layer_share)
    if spec.schedule == "1f1b" and spec.recompute:
        return layer_share * (spec.ticks + 3 * spec.work_units) / (3 * v * m) + (1 - layer_share) * (m + v * s - 1) / m
    return layer_share * spec.work_units / (v * m) + (1 - layer_share)


def pipeline_spec(parallel_config, stages: int) -> PipelineSpec | None:
    """The schedule for a ``pipe`` axis of ``stages`` (None when there is no pipeline)."""
    if stages <= 1:
        return None
    p = parallel_config
    recompute = bool(getattr(p, "pipeline_recompute", False))
    virtual = 2 if p.schedule == "zbv" and p.virtual_stages == 1 else p.virtual_stages  # zbv's V: its two legs
    return PipelineSpec(stages, p.pipeline_microbatches or stages, virtual, p.schedule, recompute)


def validate(spec: PipelineSpec, n_layers: int, seq_len: int | None = None) -> str | None:
    """The reason this spec cannot stage ``n_layers`` layers (and split a ``seq_len`` sequence's head over the stages), or None."""
    if spec.schedule not in SCHEDULES:
        return f"parallel.schedule must be one of {', '.join(SCHEDULES)}, got {spec.schedule!r}"
    if spec.schedule == "gpipe" and spec.virtual != 1:
        return f"parallel.virtual_stages={spec.virtual} needs parallel.schedule=circular or 1f1b (interleaved)"
    if spec.schedule == "zb1" and spec.virtual != 1:
        return f"parallel.virtual_stages={spec.virtual} with parallel.schedule=zb1: the zero-bubble schedule runs one chunk per device"
    if spec.schedule == "zbv" and spec.virtual != 2:
        return f"parallel.virtual_stages={spec.virtual} with parallel.schedule=zbv: the V-shaped schedule runs two chunks per device (leave it at 1 or 2)"
    if n_layers % (spec.stages * spec.virtual):
        return f"model.n_layers ({n_layers}) must be divisible by pipe x virtual stages ({spec.stages} x {spec.virtual})"
    if spec.microbatches < spec.stages:
        return f"parallel.pipeline_microbatches ({spec.microbatches}) must be >= the pipe axis ({spec.stages}) for the {spec.schedule} schedule"
    if spec.interleaved and spec.microbatches % spec.stages:
        return (
            f"parallel.pipeline_microbatches ({spec.microbatches}) must be a multiple of the pipe axis ({spec.stages}) "
            "for interleaved 1F1B (parallel.virtual_stages > 1): microbatches move through the chunks in groups of S"
        )
    if seq_len is not None and seq_len % spec.stages:
        return f"train.seq_len ({seq_len}) must be divisible by the pipe axis ({spec.stages}): each stage runs the head and loss on 1/S of every sequence"
    return None
