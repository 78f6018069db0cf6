"""zbv's tick table: the V-shaped zero-bubble schedule, one operation per device per tick.

Pure Python (no JAX), like ``pipeline_schedule``. The model's 2 S chunks run down and back up
the devices: device s holds chunk s of the first leg (stages 0..S-1, left to right) and chunk
2 S - 1 - s of the second (right to left), so the last device hands its first-leg output to
itself, and the loss is taken where the second leg ends, on device 0 (ZB-V's shape, Qi et al.
2024). Each chunk's backward is split into its input gradient (B) and weight gradient (W), as
in ``zb1``; forward, B and W each count as a third of a chunk step.

The table is built by running the devices tick by tick, each taking one ready operation: a B
first (the devices before it wait for it), then a forward (second leg first: it brings a
microbatch to its loss) while the device holds fewer than 2 S chunks' activations, 1F1B's
memory (S stages' worth), then a waiting W. A message sent in one tick is read from the next
on. Every device then holds at most 2 S chunks' residuals (forward done, W not) and
``pending_slots`` chunks' B outputs that their W reads (B done, W not).

Beside what each device runs, the table assigns the buffer slots each value lives in (the
mailbox for activations and cotangents between their arrival and their use, the residual ring,
whose slot a chunk's forward fills and its W frees (B and W both read the residuals, so they are
kept once), and the W ring of what B hands W), so the executor (``pipeline_zbv``) indexes buffers of the sizes this
simulation proved enough.
"""

from __future__ import annotations

import dataclasses
import functools

IDLE, F0, F1, B1, B0, W0, W1 = range(7)  # F0/B0/W0 on the first leg's chunk, F1/B1/W1 on the second's
FORWARDS, BACKWARDS, WEIGHTS = (F0, F1), (B0, B1), (W0, W1)
NONE = -1  # no slot


@dataclasses.dataclass(frozen=True)
class VTable:
    """Per tick t and device s (``[t][s]``): ``op`` and its microbatch ``mb``; ``inbox``: the
    mailbox slot a forward or B reads (NONE for the first leg's forward on device 0, which reads
    the microbatch itself); ``residual``: the ring slot a forward writes and its B and W read (W frees it);
    ``pending``: the W ring slot a B writes and its W reads. At the end of a tick a device files
    what arrived: ``from_left`` (sent by device s - 1: a first-leg forward or second-leg B),
    ``from_right`` (by device s + 1: a second-leg forward or first-leg B) and ``local`` (its own
    output: the last device's turn at the bottom of the V, or on device 0 the head's cotangent)
    into those mailbox slots, NONE when nothing arrives. ``head[t]``: device 0 ends a
    microbatch's second leg at tick t, so every device runs its piece of the head."""

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
    def ticks(self) -> int:
        return len(self.op)

    @property
    def cost(self) -> int:
        """Ticks in which some device works, in thirds of a chunk step (a lockstep tick lasts
        one operation on every device)."""
        return sum(any(row) for row in self.op)


def _operations(stages: int, microbatches: int) -> list[list[tuple[int, int]]]:
    """[tick][device] (op, microbatch), by the greedy rule in the module's docstring."""
    S, M = stages, microbatches
    ready = [{kind: [] for kind in (F0, F1, B1, B0)} for _ in range(S)]  # (first tick it can run, microbatch)
    ready[0][F0] = [(0, m) for m in range(M)]
    waiting_w = [[] for _ in range(S)]
    held = [0] * S  # chunks whose forward ran and whose W has not
    rows, done, t = [], 0, 0
    while done < 2 * S * M:
        if t > 8 * (M + 2 * S):
            raise AssertionError(f"zbv's table did not finish for S={S}, M={M}")  # the rule above always does
        row, sent = [], []
        for s in range(S):
            op = (IDLE, 0)
            for kind in (B0, B1, F1, F0):
                if kind in FORWARDS and held[s] >= 2 * S:
                    continue
                arrived = [x for x in ready[s][kind] if x[0] <= t]
                if arrived:
                    first = min(arrived, key=lambda x: x[1])
                    ready[s][kind].remove(first)
                    op = (kind, first[1])
                    break
            else:
                if waiting_w[s]:
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
            if kind == F0:
                sent.append((s + 1, F0, m) if s < S - 1 else (s, F1, m))
            elif kind == F1:
                sent.append((s - 1, F1, m) if s > 0 else (0, B1, m))  # device 0: the head, then its B
            elif kind == B1:
                sent.append((s + 1, B1, m) if s < S - 1 else (s, B0, m))
            elif kind == B0 and s > 0:
                sent.append((s - 1, B0, m))
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


@functools.cache
def v_table(stages: int, microbatches: int) -> VTable:
    """zbv's table for S = ``stages``, M = ``microbatches``, its buffers' slots assigned."""
    S = stages
    rows = _operations(stages, microbatches)
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
            if kind == F0:
                target, into, what = (s + 1, from_left, F0) if s < S - 1 else (s, local, F1)
            elif kind == F1:
                target, into, what = (s - 1, from_right, F1) if s > 0 else (0, local, B1)
            elif kind == B1:
                target, into, what = (s + 1, from_left, B1) if s < S - 1 else (s, local, B0)
            elif kind == B0 and s > 0:
                target, into, what = s - 1, from_right, B0
            else:
                continue
            into[t][target] = mail[target].take((what, m))
    freeze = lambda table: tuple(tuple(row) for row in table)  # noqa: E731
    return VTable(
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
        tuple(row[0][0] == F1 for row in rows),
        max(slots.size for slots in mail),
        max(slots.size for slots in rings),
        max(slots.size for slots in w_rings),
    )
