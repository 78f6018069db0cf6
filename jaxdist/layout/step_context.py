"""What a step installs while it is traced: one context, set once per train, eval or
generation step, read by the model and the parallel pieces.

The model knows nothing of the mesh; what depends on it reaches it here:

- ``layout``: the activation sharding constraints (``layout.sharding.constrain``) and, for
  a pipeline schedule, the mesh;
- ``sequence_kernel``: attention over a sequence split across devices (context parallelism,
  ``parallel.context``), called instead of the model's own attention;
- ``expert_kernel``: where an MoE layer's routed tokens go (expert parallelism's all-to-all,
  ``parallel.expert``), instead of the experts on one device;
- ``row_logps_kernel``: each row's answer log-probability (DPO's) through the pipeline
  schedule on a pipe axis, instead of the model's own forward;
- ``loss_cotangent``: the scale the loss's gradient is taken with (fp16 loss scaling), which
  1F1B needs inside the forward pass, where it runs the backward;
- ``vmapped``: the model runs under ``jax.vmap`` (DiLoCo's replicas), where a kernel whose JAX
  batching rule is wrong must batch itself (cuDNN's packed attention, ``models.attention``).

The fp8 fields are the model's own, changed around parts of it (``changed``): ``fp8_off`` (the
first and last layers that ``model.fp8_keep_ends`` keeps in the compute dtype),
``fp8_grouped`` (an MoE layer's grouped matmuls, which quantise-dequantise), and the weights
quantised ahead of the loops (``fp8_weights`` per layer, ``fp8_stacks`` per step).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any


@dataclasses.dataclass(frozen=True)
class StepContext:
    layout: Any = None  # layout.sharding.Layout
    sequence_kernel: Callable | None = None  # (q, k, v, segment_ids, positions) -> attention output
    expert_kernel: Callable | None = None  # (x, ids, gates, w_gate_up, w_down, capacity factor) -> (y, dropped)
    row_logps_kernel: Callable | None = None  # (model, batch) -> each row's answer log-probability: a pipeline's forward
    loss_cotangent: Any = None  # jax.Array scalar: the loss sum's gradient is taken of loss sum x this (None: 1)
    vmapped: bool = False
    fp8_off: bool = False
    fp8_grouped: bool = False
    fp8_weights: Any = None  # {id(Fp8Einsum): QuantizedWeight}: this layer's weights, quantised before the layer loop
    fp8_stacks: Any = None  # each layer stack's quantised weights, computed before the microbatch loop


_EMPTY = StepContext()
_CURRENT: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar("jaxdist_step_context", default=None)


def current() -> StepContext:
    """The context being traced under (an empty one outside any step)."""
    return _CURRENT.get() or _EMPTY


@contextlib.contextmanager
def installed(context: StepContext) -> Iterator[StepContext]:
    """Trace a step under ``context``."""
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def changed(**fields: Any) -> Iterator[StepContext]:
    """The current context with some fields changed, within this block (the model's own fields)."""
    with installed(dataclasses.replace(current(), **fields)) as context:
        yield context
