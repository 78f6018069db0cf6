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
- zb1 (zero bubble, V = 1) and zbv (zero bubble in a V, V = 2): each chunk's backward split
  into its input gradient (B) and its weight gradient (W), which a device runs later, in a
  tick where it would otherwise idle; one operation per device per tick (``pipeline_vtable``),
  a third of a chunk step each: the bubble is (cost - 3 V M) / cost. zb1 runs the stages in a
  line within 1F1B's memory; zbv runs its 2 S chunks down the devices and back up.
"""

from __future__ import annotations

import dataclasses

from jaxdist.parallel.pipeline_vtable import TickTable, line_table, v_table

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
        if self.schedule in ("zb1", "zbv"):
            return self.tick_table.ticks
        if self.schedule == "1f1b":
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
        if self.schedule in ("zb1", "zbv"):
            return self.tick_table.cost / 3
        return self.virtual * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Idle share of the executed work: (S-1)/(V M + S-1) (zb1, zbv: their tables')."""
        return (self.work_units - self.virtual * self.microbatches) / self.work_units

    @property
    def tick_table(self) -> TickTable:
        """zb1's and zbv's table of operations (``pipeline_vtable``)."""
        return v_table(self.stages, self.microbatches) if self.schedule == "zbv" else line_table(self.stages, self.microbatches)

    @property
    def ring_slots(self) -> int:
        """1F1B: microbatch chunks a device holds between their forward and backward (at most 2 V S - 2 ticks apart)."""
        return 2 * self.virtual * self.stages - 1

    def activations_alive(self) -> float:
        """Microbatches of a stage's full activations a device keeps at once (the planner's count):
        GPipe and circular keep every microbatch; 1F1B keeps its ring of chunk residuals
        (``ring_slots`` chunks of 1/V of a stage), or with ``recompute`` one microbatch's
        (its backward's working set) while the ring holds only stage inputs."""
        if self.schedule in ("zb1", "zbv"):  # their rings of 1/V-stage chunks: residuals, and W inputs
            table = self.tick_table
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
