"""A simulated slow link (experiments): the replica axis of a DiLoCo run, or the data axis
of any run, as if it crossed regions. After each program whose collectives cross the
link, every process sleeps for what the link would have cost."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxdist.inspect.collectives import collective_ops
from jaxdist.inspect.hlo import parse_hlo


@dataclasses.dataclass
class SlowLink:
    """A simulated link between replicas (experiments): after a program whose collectives
    cross it, every process sleeps ``latency x collectives + bytes / bandwidth``.

    ``bytes`` and ``collectives`` are the compiled program's, counted over the collectives
    whose device groups span ``axis`` (``jaxdist.inspect.wire``); a ring over the link pays one
    latency per collective, not per hop. This models the cost, it does not shape traffic.
    """

    latency_s: float
    bytes_per_s: float
    axis: str

    @classmethod
    def from_config(cls, parallel_cfg, axis: str) -> SlowLink | None:
        if parallel_cfg.replica_link_latency_ms == 0 and parallel_cfg.replica_link_gbps == 0:
            return None
        bandwidth = parallel_cfg.replica_link_gbps * 1e9 / 8 if parallel_cfg.replica_link_gbps else float("inf")
        return cls(parallel_cfg.replica_link_latency_ms / 1e3, bandwidth, axis)

    def delay_s(self, compiled, mesh) -> tuple[float, int, int]:
        """(seconds one run of ``compiled`` spends on the link, its collectives over the
        link, the bytes each device sends over it)."""
        mesh_shape = {a: int(n) for a, n in mesh.shape.items()}
        ops = [op for op in collective_ops(parse_hlo(compiled.as_text()), mesh_shape) if op.axes and self.axis in op.axes]
        count = sum(op.executions for op in ops)
        sent = sum((op.wire_bytes or 0) * op.executions for op in ops)
        return self.latency_s * count + sent / self.bytes_per_s, count, sent


def wait_for_link(state: Any, seconds: float) -> None:
    """The simulated link: the collectives finish, then the link's extra time passes."""
    jax.block_until_ready(state)
    time.sleep(seconds)


class LinkedStep:
    """A compiled step followed by the simulated link's delay (when it crosses the link)."""

    def __init__(self, step: Callable, delay_s: float):
        self.step, self.delay_s = step, delay_s
        self.compiled = step  # what the analysis reads (``as_text``)

    def __call__(self, state, batch):
        state, metrics = self.step(state, batch)
        if self.delay_s:
            wait_for_link(state, self.delay_s)
        return state, metrics
