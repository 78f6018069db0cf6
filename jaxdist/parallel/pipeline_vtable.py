"""The zero-bubble schedules' tick tables: one operation per device per tick.

Pure Python (no JAX), like ``pipeline_schedule``. Each chunk's backward is split into its input
gradient (B) and weight gradient (W) (``split_backward``); forward, B and W each count as a
third of a chunk step, and a lockstep tick lasts one operation on every device. Two shapes:

- ``line`` (zb1, ZB-H1's idea): device s holds stage s; a microbatch runs down the devices, the
  head takes the last device's output, and the cotangents run back up.
- ``v`` (zbv, ZB-V's shape, Qi et al. 2024): the model's 2 S chunks run down and back up the
  devices: device s holds chunk s of the first leg (stages 0..S-1, left to right) and chunk
  2 S - 1 - s of the second (right to left), so the last device hands its first-leg output to
  itself, and the loss is taken where the second leg ends, on device 0.

The table is built by running the devices tick by tick, each taking one ready operation: a B
first (the devices before it wait for it), then a forward (zbv: second leg first, as it brings
a microbatch to its loss), then a waiting W. A message sent in one tick is read from the next
on. Two caps bound the memory: a device starts no forward while it holds ``held`` chunks'
residuals (forward done, W not), and while ``pending`` B outputs wait for their W it runs a W
first. zbv holds at most 2 S chunks, S stages' worth, 1F1B's memory, with no pending cap. zb1
takes, of the caps whose sum is at most 2 S - 1 (the chunks jaxdist's lockstep 1F1B ring holds;
a W's inputs from B are no larger than a forward's residuals), those that finish in the fewest
ticks.

Beside what each device runs, the table assigns the buffer slots each value lives in (the
mailbox for activations and cotangents between their arrival and their use, the residual ring,
whose slot a chunk's forward fills and its W frees (B and W both read the residuals, so they are
kept once), and the W ring of what B hands W), so the executor (``pipeline_zb``) indexes buffers
of the sizes this simulation proved enough.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

IDLE, F0, F1, B1, B0, W0, W1 = range(7)  # F0/B0/W0 on the first leg's chunk, F1/B1/W1 on the second's (zbv)
FORWARDS, BACKWARDS, WEIGHTS = (F0, F1), (B0, B1), (W0, W1)
NONE = -1  # no slot
_PREFERENCE = {"line": (B0, F0), "v": (B0, B1, F1, F0)}  # the order a device takes ready operations in


@dataclasses.dataclass(frozen=True)
class TickTable:
    """Per tick t and device s (``[t][s]``): ``op`` and its microbatch ``mb``; ``inbox``: the
    mailbox slot a forward or B reads (NONE for the first forward on device 0, which reads
    the microbatch itself); ``residual``: the ring slot a forward writes and its B and W read (W frees it);
    ``pending``: the W ring slot a B writes and its W reads. At the end of a tick a device files
    what arrived: ``from_left`` (sent by device s - 1), ``from_right`` (by device s + 1) and
    ``local`` (its own output: zbv's last device at the bottom of the V, or the head's cotangent
    on ``head_device``) into those mailbox slots, NONE when nothing arrives. ``head[t]``:
    ``head_device`` ends a microbatch's last chunk at tick t, so every device runs its piece of
    the head."""

    shape: str
    stages: int
    microbatches: int
    op: tuple[tuple[int, ...], ...]
    mb: tuple[tuple[int, ...], ...]
    inbox: tuple[tuple[int, ...], ...]
    residual: tuple[tuple[int, ...], ...]
    pending: tuple[tuple[int, ...], ...]
    from_left: tuple[tuple[int, ...], ...]
    from_right: tuple[tuple[int, ...], ...]
    local: tuple[tuple[int, ...], ...]
    head: tuple[bool, ...]
    mail_slots: int
    residual_slots: int
    pending_slots: int

    @property
    def head_device(self) -> int:
        return 0 if self.shape == "v" else self.stages - 1

    @property
    def ticks(self) -> int:
        return len(self.op)

    @property
    def cost(self) -> int:
        """Ticks in which some device works, in thirds of a chunk step (a lockstep tick lasts
        one operation on every device)."""
        return sum(any(row) for row in self.op)


def _route(shape: str, stages: int, s: int, kind: int) -> tuple[int, int] | None:
    """Where device s's output of ``kind`` goes: (the device, the operation that reads it), or
    None where it ends (device 0's first-leg B: the input gradient). The head sits between a
    microbatch's last forward and its first B, on the same device."""
    last = stages - 1
    if kind == F0:
        return (s + 1, F0) if s < last else ((s, F1) if shape == "v" else (s, B0))
    if kind == F1:
        return (s - 1, F1) if s > 0 else (0, B1)
    if kind == B1:
        return (s + 1, B1) if s < last else (s, B0)
    if kind == B0 and s > 0:
        return s - 1, B0
    return None


def _operations(shape: str, stages: int, microbatches: int, held_cap: int, pending_cap: int) -> list[list[tuple[int, int]]] | None:
    """[tick][device] (op, microbatch), by the greedy rule in the module's docstring; None if
    the caps stall the pipeline."""
    S, M = stages, microbatches
    legs = 2 if shape == "v" else 1
    ready = [{kind: [] for kind in _PREFERENCE[shape]} for _ in range(S)]  # (first tick it can run, microbatch)
    ready[0][F0] = [(0, m) for m in range(M)]
    waiting_w = [[] for _ in range(S)]
    held = [0] * S  # chunks whose forward ran and whose W has not
    rows, done, t = [], 0, 0
    while done < legs * S * M:
        if t > 8 * (M + 2 * S):
            return None
        row, sent = [], []
        for s in range(S):
            op = (IDLE, 0)
            choices = _PREFERENCE[shape] if len(waiting_w[s]) < pending_cap else ()  # W ring full: a W first
            for kind in choices:
                if kind in FORWARDS and held[s] >= held_cap:
                    continue
                arrived = [x for x in ready[s][kind] if x[0] <= t]
                if arrived:
                    first = min(arrived, key=lambda x: x[1])
                    ready[s][kind].remove(first)
                    op = (kind, first[1])
                    break
            if op[0] == IDLE and waiting_w[s]:
                leg, m = waiting_w[s].pop(0)
                op = ((W0, W1)[leg], m)
            kind, m = op
            if kind in FORWARDS:
                held[s] += 1
            elif kind in WEIGHTS:
                held[s] -= 1
                done += 1
            elif kind in BACKWARDS:
                waiting_w[s].append((int(kind == B1), m))
            if kind != IDLE and (to := _route(shape, S, s, kind)) is not None:
                sent.append((*to, m))
            row.append(op)
        for device, kind, m in sent:
            ready[device][kind].append((t + 1, m))
        rows.append(row)
        t += 1
    return rows


class _Slots:
    """Lowest free slot first; ``size`` is the most ever held at once."""

    def __init__(self):
        self.free: list[int] = []
        self.size = 0
        self.held: dict = {}

    def take(self, key) -> int:
        if self.free:
            slot = min(self.free)
            self.free.remove(slot)
        else:
            slot, self.size = self.size, self.size + 1
        self.held[key] = slot
        return slot

    def give(self, key) -> int:
        slot = self.held.pop(key)
        self.free.append(slot)
        return slot


def _table(shape: str, stages: int, microbatches: int, rows: list[list[tuple[int, int]]]) -> TickTable:
    """``rows`` with their buffers' slots assigned."""
    S = stages
    ticks = len(rows)
    grid = lambda: [[NONE] * S for _ in range(ticks)]  # noqa: E731
    inbox, residual, pending, from_left, from_right, local = (grid() for _ in range(6))
    mail, rings, w_rings = [_Slots() for _ in range(S)], [_Slots() for _ in range(S)], [_Slots() for _ in range(S)]
    for t, row in enumerate(rows):
        for s, (kind, m) in enumerate(row):
            if kind == F0 and s == 0:
                pass  # reads the microbatch itself
            elif kind in FORWARDS or kind in BACKWARDS:
                inbox[t][s] = mail[s].give((kind, m))
            if kind in FORWARDS:
                residual[t][s] = rings[s].take((kind - F0, m))
            elif kind in BACKWARDS:  # reads its residuals; its W reads them again and frees the slot
                leg = int(kind == B1)
                residual[t][s] = rings[s].held[(leg, m)]
                pending[t][s] = w_rings[s].take((leg, m))
            elif kind in WEIGHTS:
                residual[t][s] = rings[s].give((kind - W0, m))
                pending[t][s] = w_rings[s].give((kind - W0, m))
        # what arrives at the end of the tick, for the kind of operation that will read it
        for s, (kind, m) in enumerate(row):
            if kind == IDLE or (to := _route(shape, S, s, kind)) is None:
                continue
            target, what = to
            into = {s + 1: from_left, s - 1: from_right, s: local}[target]
            into[t][target] = mail[target].take((what, m))
    head_device, last_forward = (0, F1) if shape == "v" else (S - 1, F0)
    freeze = lambda table: tuple(tuple(row) for row in table)  # noqa: E731
    return TickTable(
        shape,
        stages,
        microbatches,
        freeze([[kind for kind, _ in row] for row in rows]),
        freeze([[m for _, m in row] for row in rows]),
        freeze(inbox),
        freeze(residual),
        freeze(pending),
        freeze(from_left),
        freeze(from_right),
        freeze(local),
        tuple(row[head_device][0] == last_forward for row in rows),
        max(slots.size for slots in mail),
        max(slots.size for slots in rings),
        max(slots.size for slots in w_rings),
    )


@functools.cache
def v_table(stages: int, microbatches: int) -> TickTable:
    """zbv's table for S = ``stages``, M = ``microbatches``: at most 2 S chunks held, no pending cap."""
    return _table("v", stages, microbatches, _operations("v", stages, microbatches, 2 * stages, 2 * stages * microbatches))


@functools.cache
def line_table(stages: int, microbatches: int) -> TickTable:
    """zb1's table for S = ``stages``, M = ``microbatches``: of the caps (held, pending) whose sum is
    at most 2 S - 1, the fewest ticks, then the least memory, then the fewest residuals."""
    tried = []
    for held, pending in itertools.product(range(1, 2 * stages - 1), range(1, 2 * stages - 1)):
        if held + pending <= 2 * stages - 1 and (rows := _operations("line", stages, microbatches, held, pending)) is not None:
            tried.append((len(rows), held + pending, held, rows))
    _, _, _, rows = min(tried, key=lambda x: x[:3])
    return _table("line", stages, microbatches, rows)
