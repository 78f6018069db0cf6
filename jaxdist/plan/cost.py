"""Step time from a compiled program and a hardware profile.

    compute    = matmul_flops / (peak x matmul_efficiency) + memory_bytes / (HBM x memory_efficiency)
                 on a GPU: attention's FLOPs halved (causal flash skips masked blocks), its score
                 traffic and XLA:CPU's f32 conversion copies left out (see hlo_cost); where
                 attention is parallel.context's tiled XLA kernel (a context axis, but all_to_all
                 with a fused kernel, which attends whole sequences):
                 half its tiles' FLOPs and score traffic are skipped (lax.cond), the rest of its
                 score traffic stays (no flash kernel keeps it on chip); an MoE model's grouped
                 matmuls at their grouped FLOPs on a GPU (XLA:CPU's dense lowering of ragged_dot
                 does them once per local expert, which cpu-local prices as it runs)
    collective = ring steps x link latency + wire bytes / (link bandwidth x link efficiency)
                 on the link its groups cross: within a node, or across nodes when any mesh
                 axis they span is split over nodes (data first, then fsdp, as jaxdist's
                 hybrid mesh does)
    exposed    = collectives on the critical path (tensor-parallel activations, pipeline
                 sends, attention's K/V gathers and their reduce-scatters over context,
                 Ulysses's all-to-alls of q, k, v and the output (attention waits for them),
                 the experts' all-to-alls: the experts wait for their tokens, the layer for the results,
                 everything outside the layer loop but gradient reductions)
                 + max(0, the hideable ones - overlap x compute); hideable: the layer loop's
                 other collectives (a ring's K/V permutes among them), and on GPUs the gradient
                 reductions over the batch axes
                 (XLA's loop pipeliner moves them into the backward loop)
    step       = compute + exposed

XLA:GPU's program (a GPU plan compiles each layout for the target, ``plan.gpu_target``) is
priced kernel by kernel instead, by replaying its schedule (``gpu_cost.gpu_schedule``) on two
streams, compute and collectives:

    kernel     = max(FLOPs / rate, bytes / (HBM x memory_efficiency)); rate: a GEMM's the
                 sustained matmul rate (an fp8 GEMM's ``fp8_flops_per_s``), cuDNN attention's a
                 share of it (``attention_fwd_share`` / ``_bwd_share``); a memory-bound fusion, a
                 copy and the rest by their bytes
    collective = as above, on its link (an all-reduce's latency the shorter of a ring's and a
                 tree's, as NCCL picks); an async one starts when the collective stream is free
                 and its start is reached, and the compute stream waits for it only at its done;
                 a synchronous one waits for both
    loop       = trip count x one iteration in steady state (a collective started at the end of
                 one iteration and done in the next overlaps the next one)
    conditional = the mean of its branches
    step       = ENTRY's time; compute = the kernels' busy time; exposed = step - compute, the
                 compute stream's waits, each counted to the collective kind it waited for
                 (``exposed_s``: per kind, they add up to the step's exposed time)

so what overlaps is what XLA:GPU's latency-hiding scheduler put between a collective's start and
done, with the kernels' own times.

A pipeline's bubble is already in the compiled program (every stage runs every tick); its
share of the step is the schedule's bubble fraction. ``shared_host`` profiles (cpu-local) run
all devices on one host's cores, so their compute adds up. Ring steps: all-reduce 2(n-1),
all-gather / reduce-scatter / all-to-all n-1, a permute 1.
"""

from __future__ import annotations

import dataclasses
import math

from jaxdist.inspect.collectives import CollectiveOp
from jaxdist.layout.mesh import MESH_AXES, split_across_hosts
from jaxdist.plan.gpu_cost import CAUSAL_SKIP, MATMUL_KINDS
from jaxdist.plan.hardware import Hardware, Link
from jaxdist.plan.hlo_cost import ProgramCost

CRITICAL_AXES = ("tensor", "pipe")  # their collectives feed the next op: nothing to hide them behind
HOST_TRANSFER = "host_transfer"  # exposed time of offloaded values crossing to and from host memory


def ring_steps(kind: str, n: int) -> int:
    if n <= 1:
        return 0
    return {"all-reduce": 2 * (n - 1), "collective-permute": 1}.get(kind, n - 1)


def collective_time(kind: str, wire_bytes: float, group_size: int, link: Link) -> float:
    """One execution's time on ``link``."""
    return ring_steps(kind, group_size) * link.latency + wire_bytes / (link.bandwidth * link.efficiency)


def node_split(mesh_shape: dict[str, int], devices_per_node: int) -> dict[str, int]:
    """How many nodes each mesh axis spans (jaxdist's hybrid mesh: data crosses first, then fsdp)."""
    devices = math.prod(mesh_shape.values())
    nodes = max(1, devices // devices_per_node) if devices > devices_per_node else 1
    sizes = {a: mesh_shape.get(a, 1) for a in MESH_AXES}
    return split_across_hosts(sizes, nodes)[1]


@dataclasses.dataclass(frozen=True)
class Prediction:
    step_time_s: float
    compute_s: float
    matmul_s: float
    memory_s: float
    comm_s: float  # every collective, hidden or not
    comm_exposed_s: float
    bubble_s: float
    bound: str  # compute | communication | bubble
    mfu: float
    tokens_per_sec_per_device: float
    kernel_s: dict[str, float] | None = None  # XLA:GPU's program: busy seconds per step by kernel kind
    # XLA:GPU's program: seconds per step the compute stream waits for each collective kind (at its
    # done, or through a synchronous one): the part of its time no kernel in its window covers
    exposed_s: dict[str, float] | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def predict(
    cost: ProgramCost,
    hardware: Hardware,
    mesh_shape: dict[str, int],
    *,
    model_flops_per_step: float,
    tokens_per_step: float,
    bubble: float = 0.0,
) -> Prediction:
    if cost.schedule:  # XLA:GPU's program: its kernels and collectives in schedule order
        return _predict_schedule(cost, hardware, mesh_shape, model_flops_per_step, tokens_per_step, bubble)
    devices = math.prod(mesh_shape.values())
    share = devices if hardware.shared_host else 1
    flops = cost.matmul_flops
    if cost.tiled_attention:  # the context kernel's lax.cond skips the masked tiles, on any backend
        flops -= CAUSAL_SKIP * cost.skippable_flops
    elif hardware.fused_attention:  # a causal flash kernel skips the masked half of the scores
        flops -= CAUSAL_SKIP * cost.attention_flops
    if not hardware.shared_host and cost.grouped_expansion > 1:  # a GPU's grouped GEMM does each row once
        flops -= cost.grouped_flops * (1 - 1 / cost.grouped_expansion)
    if hardware.matmul_curve and cost.dots:  # each matmul at the rate of its size (small ones run slower)
        kept = flops / cost.matmul_flops if cost.matmul_flops else 1.0  # the skipped share, spread over every size
        matmul_s = share * kept * sum(calls * f / hardware.matmul_rate(f) for f, calls in cost.dots)
    else:
        matmul_s = share * flops / hardware.matmul_flops_per_s
    memory = cost.memory_bytes
    if cost.tiled_attention:
        memory -= CAUSAL_SKIP * cost.skippable_bytes
    if not hardware.shared_host:  # a GPU: flash attention keeps the scores on chip; bf16 GEMMs need no f32 copies
        memory -= (cost.score_bytes if hardware.fused_attention and not cost.tiled_attention else 0.0) + cost.layout_bytes
    memory_s = share * memory / (hardware.memory_bandwidth * hardware.memory_efficiency)
    compute = matmul_s + memory_s + share * cost.op_executions * hardware.op_overhead_s
    crossing = node_split(mesh_shape, hardware.gpus_per_node)
    critical = hideable = 0.0
    for op in cost.collectives:
        t = op.executions * _op_time(op, hardware, crossing) * _gpu_bytes_factor(op, cost, hardware)
        if _hideable(op, cost, hardware):
            hideable += t
        else:
            critical += t
    exposed = critical + max(0.0, hideable - hardware.overlap * compute)
    step = compute + exposed
    bubble_s = compute * bubble  # the ticks where a stage computes nothing useful
    parts = {"compute": compute - bubble_s, "communication": exposed, "bubble": bubble_s}
    return Prediction(
        step_time_s=step,
        compute_s=compute,
        matmul_s=matmul_s,
        memory_s=memory_s,
        comm_s=critical + hideable,
        comm_exposed_s=exposed,
        bubble_s=bubble_s,
        bound=max(parts, key=parts.get),
        mfu=model_flops_per_step / (step * devices * hardware.peak_flops) if step else 0.0,
        tokens_per_sec_per_device=tokens_per_step / (step * devices) if step else 0.0,
    )


GRADIENT_AXES = {"data", "fsdp", "replica", "expert"}  # the batch axes (expert splits the batch outside the experts)


def predict_summary(cost: ProgramCost, hardware: Hardware, summary: dict) -> Prediction:
    """``predict`` for a compiled step's summary (``plan.search.compile_summary``): its mesh,
    model FLOPs, tokens and pipeline bubble."""
    return predict(
        cost,
        hardware,
        summary["mesh"],
        model_flops_per_step=summary["model_flops_per_step"],
        tokens_per_step=summary["tokens_per_step"],
        bubble=summary["bubble"],
    )


def _hideable(op: CollectiveOp, cost: ProgramCost, hardware: Hardware) -> bool:
    """Whether compute can hide ``op``: the layer loop's collectives off the critical path
    (FSDP's gathers and reduce-scatters), and on a GPU every gradient reduction over the
    batch axes, which XLA's loop pipeliner (``xla_gpu_enable_pipelined_all_reduce``, set by
    ``jaxdist.layout.xla_flags``; it pipelines FSDP's reduce-scatters too) moves into the backward loop."""
    axes = set(op.axes or ())
    if axes & set(CRITICAL_AXES) or op.kind in ("all-to-all", "ragged-all-to-all"):
        return False  # all-to-all: the experts' dispatch and return, between the router and the next layer
    if op.name in cost.attention_collectives and op.kind != "collective-permute":
        return False  # K/V gathered for the attention that follows (and dK/dV scattered back): nothing to hide them behind
    if cost.in_loop(op):
        return True
    return not hardware.shared_host and op.kind in ("all-reduce", "reduce-scatter") and bool(axes) and axes <= GRADIENT_AXES


def _gpu_bytes_factor(op: CollectiveOp, cost: ProgramCost, hardware: Hardware) -> float:
    """What a GPU moves for a collective of the CPU-compiled program, as a share of it.

    XLA:CPU promotes bf16 collectives to f32, so the weight all-gathers, tensor-parallel
    activation all-reduces and the experts' token all-to-alls of a bf16 model (the planner
    compiles GPU plans in bf16) move half on a GPU; and it reduces FSDP gradients
    with an all-reduce plus a slice where XLA:GPU forms a reduce-scatter (half the bytes).
    An all-to-all is halved only where XLA:CPU widened its operand: Muon's, which move the
    f32 momentum, move f32 on a GPU too.
    The time is scaled as a whole (latency included): a slight overestimate of the saving.
    """
    if hardware.shared_host:
        return 1.0
    axes = set(op.axes or ())
    factor = 1.0
    if op.kind == "all-to-all":
        factor *= 0.5 if cost.is_widened(op) else 1.0
    elif cost.is_f32(op) and (op.kind == "all-gather" or (op.kind == "all-reduce" and "tensor" in axes)):
        factor *= 0.5
    if op.kind == "all-reduce" and "fsdp" in axes and "tensor" not in axes:
        factor *= 0.5
    return factor


def _op_time(op: CollectiveOp, hardware: Hardware, nodes_per_axis: dict[str, int], nccl: bool = False) -> float:
    """One execution of ``op`` on the link its groups cross; ``nccl``: an all-reduce's latency as
    the shorter of a ring's 2(n-1) steps and a tree's 2 log2(n) (NCCL's double binary trees take
    the small, latency-bound ones, such as fp8 scaling's amax reductions)."""
    across = any(nodes_per_axis.get(axis, 1) > 1 for axis in op.axes or ())
    link = hardware.inter_node if across else hardware.intra_node
    n = op.group_size or 1
    if nccl and op.kind == "all-reduce" and n > 2:
        steps = min(ring_steps(op.kind, n), 2 * math.ceil(math.log2(n)))
        return steps * link.latency + (op.wire_bytes or 0) / (link.bandwidth * link.efficiency)
    return collective_time(op.kind, op.wire_bytes or 0, n, link)


# ---------------------------------------------------------------------------------------------
# XLA:GPU's program: its schedule replayed


def kernel_time(hardware: Hardware, kind: str, flops: float, nbytes: float) -> float:
    """One kernel's seconds: its FLOPs at its kind's rate or its bytes at HBM speed, whichever is longer."""
    rate = hardware.matmul_flops_per_s
    if kind == "gemm_fp8":
        rate = hardware.fp8_flops_per_s
    elif kind == "attention_cudnn_fwd":
        rate *= hardware.attention_fwd_share
    elif kind == "attention_cudnn_bwd":
        rate *= hardware.attention_bwd_share
    return max(flops / rate, nbytes / (hardware.memory_bandwidth * hardware.memory_efficiency))


@dataclasses.dataclass
class _Run:
    elapsed: float = 0.0
    busy: float = 0.0
    kinds: dict[str, float] = dataclasses.field(default_factory=dict)
    exposed: dict[str, float] = dataclasses.field(default_factory=dict)  # collective kind -> seconds waited for it

    def wait(self, kind: str, seconds: float) -> None:
        if seconds > 0:
            self.exposed[kind] = self.exposed.get(kind, 0.0) + seconds


class _Replay:
    """A scheduled program on one compute and one collective stream (``predict``'s GPU path)."""

    def __init__(self, cost: ProgramCost, hardware: Hardware, op_seconds: list[float]):
        self.events = dict(cost.schedule)
        self.hardware, self.op_seconds = hardware, op_seconds
        self.op_kinds = [op.kind for op in cost.collectives]
        self.done: dict[str, _Run] = {}

    def run(self, name: str, loop: bool = True) -> _Run:
        """One execution of computation ``name`` (a loop body's in steady state)."""
        if name not in self.done:
            self.done[name] = _Run()  # a (malformed) recursive schedule counts as free
            events = self.events.get(name, ())
            first, free, pending = self._pass(events, {"collective": 0.0, "host": 0.0}, {})
            if pending and loop:  # transfers in flight at the end: a pipelined loop's, done in the next iteration
                shifted = {stream: at - first.elapsed for stream, at in free.items()}
                second, _, _ = self._pass(events, shifted, {k: t - first.elapsed for k, t in pending.items()})
                first.elapsed, first.exposed = second.elapsed, second.exposed
            elif pending:
                last = max(pending, key=pending.get)
                first.wait(self._kind(last), pending[last] - first.elapsed)
                first.elapsed = max(first.elapsed, *pending.values())
            self.done[name] = first
        return self.done[name]

    def _kind(self, key: int | str) -> str:
        """What a pending transfer is: a collective's kind (by its index) or a host transfer (by its name)."""
        return self.op_kinds[key] if isinstance(key, int) else HOST_TRANSFER

    def _host_seconds(self, nbytes: float) -> float:
        link = self.hardware.host_link
        if link is None:
            return 0.0  # a profile without a host link (cpu-local: host memory is the devices')
        return link.latency + nbytes / (link.bandwidth * link.efficiency)

    def _pass(
        self, events: tuple[tuple, ...], free: dict[str, float], pending: dict[int | str, float]
    ) -> tuple[_Run, dict[str, float], dict[int | str, float]]:
        """One pass over ``events``: the compute stream's clock, and when the collective and the
        host-copy streams are next free (``free``); ``pending``: started transfers -> their end."""
        run, t, free = _Run(), 0.0, dict(free)
        for event in events:
            tag = event[0]
            if tag == "k":
                seconds = kernel_time(self.hardware, event[1], event[2], event[3])
                t += seconds
                run.busy += seconds
                run.kinds[event[1]] = run.kinds.get(event[1], 0.0) + seconds
            elif tag in ("s", "hs"):  # starts once it is reached and its stream is free
                stream, seconds = ("collective", self.op_seconds[event[1]]) if tag == "s" else ("host", self._host_seconds(event[2]))
                free[stream] = max(t, free[stream]) + seconds
                pending[event[1]] = free[stream]
            elif tag in ("d", "hd"):
                ready = pending.pop(event[1], t)
                run.wait(self._kind(event[1]), ready - t)
                t = max(t, ready)
            elif tag in ("c", "hc"):
                stream, seconds = ("collective", self.op_seconds[event[1]]) if tag == "c" else ("host", self._host_seconds(event[1]))
                free[stream] = max(t, free[stream]) + seconds
                run.wait(self._kind(event[1]) if tag == "c" else HOST_TRANSFER, free[stream] - t)
                t = free[stream]
            else:  # a loop ("l", body, trips) or a conditional's branches ("b", names): their mean
                parts = [(self.run(event[1]), event[2])] if tag == "l" else [(self.run(b), 1 / len(event[1])) for b in event[1]]
                for part, times in parts:
                    t += times * part.elapsed
                    run.busy += times * part.busy
                    for kind, seconds in part.kinds.items():
                        run.kinds[kind] = run.kinds.get(kind, 0.0) + times * seconds
                    for kind, seconds in part.exposed.items():
                        run.wait(kind, times * seconds)
        run.elapsed = t
        return run, free, pending


def _predict_schedule(
    cost: ProgramCost, hardware: Hardware, mesh_shape: dict[str, int], model_flops_per_step: float, tokens_per_step: float, bubble: float
) -> Prediction:
    devices = math.prod(mesh_shape.values())
    crossing = node_split(mesh_shape, hardware.gpus_per_node)
    op_seconds = [_op_time(op, hardware, crossing, nccl=True) for op in cost.collectives]
    replay = _Replay(cost, hardware, op_seconds)
    run = replay.run(cost.entry, loop=False)
    step, compute = run.elapsed, run.busy
    exposed = max(0.0, step - compute)
    matmul_s = sum(s for kind, s in run.kinds.items() if kind in MATMUL_KINDS)
    bubble_s = compute * bubble
    parts = {"compute": compute - bubble_s, "communication": exposed, "bubble": bubble_s}
    return Prediction(
        step_time_s=step,
        compute_s=compute,
        matmul_s=matmul_s,
        memory_s=compute - matmul_s,
        comm_s=sum(op.executions * t for op, t in zip(cost.collectives, op_seconds, strict=True)),
        comm_exposed_s=exposed,
        bubble_s=bubble_s,
        bound=max(parts, key=parts.get),
        mfu=model_flops_per_step / (step * devices * hardware.peak_flops) if step else 0.0,
        tokens_per_sec_per_device=tokens_per_step / (step * devices) if step else 0.0,
        kernel_s=dict(sorted(run.kinds.items())),
        exposed_s=dict(sorted(run.exposed.items())),
    )
