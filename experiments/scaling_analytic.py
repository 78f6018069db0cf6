"""What the sweep's compiled programs should move and hold, from the model's dimensions
alone: the reference the README compares ``jaxdist.analyze``'s measured numbers against.

Wire bytes per device per step (fp32 gradients and weights, 4 bytes; ring collectives:
an all-reduce sends 2(n-1)/n of its buffer, an all-gather or reduce-scatter (n-1)/n), per
mesh axis, for a decoder of P parameters, L layers, width d, sequence T_s and global batch B
on ``data=D, fsdp=F, tensor=T`` (r(n) = (n-1)/n, G = 4P):

- data (dp): all-reduce of the gradients each device holds: 2 r(D) G/T;
- data (zero1): reduce-scatter of the gradients + all-gather of the updated weights:
  2 r(D) G (ideal); XLA's CPU backend has no reduce-scatter and runs an all-reduce plus a
  slice instead: 3 r(D) G;
- fsdp: the weights gathered in the forward and again in the backward pass, 2 r(F) G/T,
  plus the gradient reduce-scatter r(F) G/T (ideal) or all-reduce 2 r(F) G/T (CPU);
- tensor (Megatron): per layer 2 activation all-reduces forward and 2 backward, plus one
  each way for the vocab-parallel embedding and head: (4L + 2) x 2 r(T) x 4 B/(D F) T_s d.
  This is the program with ``model.fused_projections`` (the default; measured within 0.1%
  on small-cpu at tensor=2); with separate q, k, v and gate, up matrices XLA all-reduces
  each input gradient on its own, 7 activation all-reduces per layer (1.67x these bytes).

Model states per device (``jaxdist.analyze``'s ``arguments``: weights + Adam moments, fp32,
the batch is negligible): 12P for dp, 4P + 8P/D for zero1, 12P/(F T) for fsdp / tensor.
Pipelines and their combinations are left out: their traffic depends on the schedule's
ticks, which the analysis would have to take from jaxdist's own schedule code.
"""

from __future__ import annotations

import dataclasses

BYTES = 4  # fp32 weights, gradients and activations (the sweep's presets run fp32 on CPU)


@dataclasses.dataclass(frozen=True)
class Dims:
    params: int
    n_layers: int
    d_model: int
    seq_len: int
    global_batch: int


def mesh_sizes(mesh: str) -> dict[str, int]:
    sizes = {"data": 1, "fsdp": 1, "tensor": 1, "pipe": 1}
    for part in filter(None, (mesh or "").split(",")):
        axis, _, size = part.partition("=")
        sizes[axis.strip()] = int(size)
    return sizes


def _r(n: int) -> float:
    return (n - 1) / n


def expected_wire_bytes(strategy: str, mesh: str, dims: Dims) -> dict[str, dict[str, float]] | None:
    """Per mesh axis: {"cpu": bytes, "ideal": bytes}; None for strategies not modelled (pipelines)."""
    s = mesh_sizes(mesh)
    if s["pipe"] > 1 or strategy.startswith("pipe") or strategy == "3d":
        return None
    d, f, t = s["data"], s["fsdp"], s["tensor"]
    grads = BYTES * dims.params / t  # what one device's tensor shard of the weights holds
    out: dict[str, dict[str, float]] = {}
    if d > 1:
        if strategy == "zero1":
            out["data"] = {"cpu": 3 * _r(d) * grads, "ideal": 2 * _r(d) * grads}
        else:
            out["data"] = {"cpu": 2 * _r(d) * grads, "ideal": 2 * _r(d) * grads}
    if f > 1:
        gathers = 2 * _r(f) * grads
        out["fsdp"] = {"cpu": gathers + 2 * _r(f) * grads, "ideal": gathers + _r(f) * grads}
    if t > 1:
        activation = BYTES * dims.global_batch / (d * f) * dims.seq_len * dims.d_model
        wire = (4 * dims.n_layers + 2) * 2 * _r(t) * activation
        out["tensor"] = {"cpu": wire, "ideal": wire}
    return out


def expected_state_bytes(strategy: str, mesh: str, params: int) -> float | None:
    """Weights + Adam moments per device (fp32), or None where not modelled."""
    s = mesh_sizes(mesh)
    if s["pipe"] > 1 or strategy.startswith("pipe") or strategy == "3d":
        return None
    if strategy == "zero1":
        return 4 * params + 8 * params / s["data"]
    return 12 * params / (s["fsdp"] * s["tensor"])


ZERO_STATES_FP32 = {  # weights + Adam moments (what analyze's ``arguments`` holds), per device
    "replicated (12P)": lambda p, n: 12 * p,
    "ZeRO-1 (4P + 8P/N)": lambda p, n: 4 * p + 8 * p / n,
    "ZeRO-3 / FSDP (12P/N)": lambda p, n: 12 * p / n,
}
ZERO_PAPER = {  # the ZeRO paper's mixed-precision model states (fp16 weights and grads, fp32 master + Adam)
    "replicated (16P)": lambda p, n: 16 * p,
    "ZeRO-1 (4P + 12P/N)": lambda p, n: 4 * p + 12 * p / n,
    "ZeRO-2 (2P + 14P/N)": lambda p, n: 2 * p + 14 * p / n,
    "ZeRO-3 (16P/N)": lambda p, n: 16 * p / n,
}
