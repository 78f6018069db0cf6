"""Pipeline schedules as plain numbers: stages, microbatches, ticks and the bubble.

Pure Python (no JAX), so configs are validated against a mesh before JAX starts.
"""

from __future__ import annotations

import dataclasses

SCHEDULES = ("gpipe", "circular", "1f1b")


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    stages: int  # S: the size of the pipe axis
    microbatches: int  # M
    virtual: int  # V: chunks per device (circular only; 1 otherwise)
    schedule: str

    @property
    def ticks(self) -> int:
        if self.schedule == "1f1b":
            return self.microbatches + 2 * self.stages - 2
        return self.virtual * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Idle share of the ticks: (ticks - useful ticks) / ticks."""
        return (self.ticks - self.virtual * self.microbatches) / self.ticks


def pipeline_spec(parallel_config, stages: int) -> PipelineSpec | None:
    """The schedule for a ``pipe`` axis of ``stages`` (None when there is no pipeline)."""
    if stages <= 1:
        return None
    p = parallel_config
    return PipelineSpec(stages, p.pipeline_microbatches or stages, p.virtual_stages, p.schedule)


def validate(spec: PipelineSpec, n_layers: int) -> str | None:
    """The reason this spec cannot stage ``n_layers`` layers, or None."""
    if spec.schedule not in SCHEDULES:
        return f"parallel.schedule must be one of {', '.join(SCHEDULES)}, got {spec.schedule!r}"
    if spec.schedule != "circular" and spec.virtual != 1:
        return f"parallel.virtual_stages={spec.virtual} needs parallel.schedule=circular"
    if n_layers % (spec.stages * spec.virtual):
        return f"model.n_layers ({n_layers}) must be divisible by pipe x virtual stages ({spec.stages} x {spec.virtual})"
    if spec.microbatches < spec.stages:
        return f"parallel.pipeline_microbatches ({spec.microbatches}) must be >= the pipe axis ({spec.stages}) for the {spec.schedule} schedule"
    return None
