"""Expert parallelism: the experts split over the ``expert`` mesh axis, tokens sent to them
and back by ``all_to_all``.

While a train or eval step is traced, MoE layers (``models.moe``) hand their routed tokens to
``ExpertParallel``: a ``shard_map`` manual over every mesh axis, in which each device

1. sorts its own tokens x k assignments by expert (``models.experts.dispatch``) and packs them
   into a static send buffer of R rows per destination (the device holding the expert),
2. exchanges the buffers over ``expert`` (``all_to_all``: rows, and their local expert ids),
3. groups what it received by local expert and runs one grouped matmul per projection
   (``models.experts.expert_compute`` of the mesh's platform: a GPU's grouped GEMM),
4. sends the results back by the reverse ``all_to_all`` and combines them in float32.

Expert weights arrive split over ``expert`` (and their width over ``tensor``: the partial
outputs are summed over it before the return trip); the dimension FSDP shards is gathered
inside (its transpose reduce-scatters the gradient). Without an expert axis the same
kernel runs per device with nothing exchanged, so data parallelism never gathers tokens.

The buffer R: with a capacity factor, an expert's capacity times the experts a device holds;
dropless, the worst case (every assignment of a device to one destination) unless
``parallel.expert_buffer_factor`` f > 0 states ceil(f x n x k / expert) rows. Rows that do not
fit are dropped and counted (``moe_dropped_fraction``), never lost silently.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxdist.config import Config
from jaxdist.layout.mesh import BATCH_AXES
from jaxdist.layout.sharding import Rules, logical_to_spec, rules_for
from jaxdist.layout.strategy import resolve_strategy
from jaxdist.models import experts as experts_lib
from jaxdist.models.experts import ExpertCompute, capacity_rows, ceil_scaled, combine, dispatch, expert_compute, local_experts

AXIS = "expert"
log = logging.getLogger(__name__)
GATE_UP_AXES = ("expert", "embed", None, "mlp")  # models.moe's parameter axes
DOWN_AXES = ("expert", "mlp", "embed")


def buffer_rows(tokens: int, top_k: int, experts: int, ep: int, capacity: int | None, factor: float) -> int:
    """Rows one device's send buffer holds for each destination."""
    local = experts // ep
    worst = tokens * min(top_k, local)  # every assignment of these tokens to one device's experts
    if capacity is not None:
        worst = min(worst, local * capacity)
    if factor > 0:
        return min(worst, ceil_scaled(tokens * top_k, factor, ep))  # exact: a float product may land a hair above an integer
    return worst


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    mesh: jax.sharding.Mesh
    rules: Rules
    buffer_factor: float = 0.0  # parallel.expert_buffer_factor
    compute: ExpertCompute | None = None  # the experts' computation on grouped rows (None: the platform's; tests: the identity)

    @property
    def ep(self) -> int:
        return self.mesh.shape[AXIS]

    @property
    def platform(self) -> str:
        return self.mesh.devices.flat[0].platform

    def __call__(self, x, ids, gates, w_gate_up, w_down, capacity_factor: float):
        mesh = self.mesh
        context = ("context",) if mesh.shape["context"] > 1 else ()
        token_spec = PartitionSpec(BATCH_AXES, context[0] if context else None, None)
        gate_up_spec = logical_to_spec(GATE_UP_AXES, w_gate_up.shape, self.rules, mesh)
        down_spec = logical_to_spec(DOWN_AXES, w_down.shape, self.rules, mesh)
        tensor = mesh.shape["tensor"] > 1 and gate_up_spec[3] == "tensor"
        shards = math.prod(mesh.shape[a] for a in (*BATCH_AXES, *context))
        b, t, _ = x.shape
        tokens = b * t // shards
        experts, k = w_gate_up.shape[0], ids.shape[-1]
        capacity = capacity_rows(tokens, k, experts, capacity_factor)
        rows = buffer_rows(tokens, k, experts, self.ep, capacity, self.buffer_factor)
        compute = self.compute or expert_compute(self.platform)

        def local(x, ids, gates, w_gate_up, w_down):
            w_gate_up = _gather_sharded(w_gate_up, gate_up_spec, (1,))
            w_down = _gather_sharded(w_down, down_spec, (2,))
            reduce_hidden = (lambda y: jax.lax.psum(y, "tensor")) if tensor else (lambda y: y)
            lb, lt, dim = x.shape
            flat = (x.reshape(lb * lt, dim), ids.reshape(lb * lt, k), gates.reshape(lb * lt, k))
            if self.ep == 1:
                y, dropped = local_experts(*flat, w_gate_up, w_down, capacity, reduce_hidden, compute)
            else:
                y, dropped = _exchange(*flat, w_gate_up, w_down, capacity, rows, self.ep, reduce_hidden, compute)
            return y.reshape(lb, lt, dim), jax.lax.psum(dropped, (*BATCH_AXES, *context))

        run = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(token_spec, token_spec, token_spec, gate_up_spec, down_spec),
            out_specs=(token_spec, PartitionSpec()),
            axis_names=set(mesh.axis_names),  # manual over every axis (see parallel.context: partial-manual aborts XLA:CPU)
        )
        with jax.named_scope("expert_parallel"):
            return run(x, ids.astype(jnp.int32), gates, w_gate_up, w_down)

    def note(self, experts: int) -> str:
        local = experts // self.ep
        buffer = f"buffer {self.buffer_factor:g}x the even share" if self.buffer_factor > 0 else "worst-case buffer"
        return f"experts: {experts} over expert={self.ep} ({local} per device), all-to-all dispatch, dropless rows use a {buffer}"


def _gather_sharded(w: jax.Array, spec: PartitionSpec, dims: tuple[int, ...]) -> jax.Array:
    """Gather ``w``'s FSDP-sharded dimensions (those in ``dims``) over their mesh axes."""
    for dim in dims:
        entry = spec[dim] if dim < len(spec) else None
        for axis in reversed((entry,) if isinstance(entry, str) else (entry or ())):
            w = _gather(w, axis, dim)
    return w


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(w: jax.Array, axis: str, dim: int) -> jax.Array:
    """An all-gather of (compute-dtype) weights whose backward reduce-scatters the gradient in
    f32, as XLA's reductions of every other weight gradient do (autodiff's would be bf16)."""
    return jax.lax.all_gather(w, axis, axis=dim, tiled=True)


def _gather_fwd(w, axis, dim):
    return _gather(w, axis, dim), None


def _gather_bwd(axis, dim, _, g):
    return (jax.lax.psum_scatter(g.astype(jnp.float32), axis, scatter_dimension=dim, tiled=True).astype(g.dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def _exchange(x, ids, gates, w_gate_up, w_down, capacity, rows: int, ep: int, reduce_hidden, compute: ExpertCompute):
    """Dispatch over ``expert``, compute the local experts, return and combine."""
    n, k = ids.shape
    local_experts_n = w_gate_up.shape[0]
    d = dispatch(ids, local_experts_n * ep, capacity)
    kept_counts = d.counts if capacity is None else jnp.minimum(d.counts, capacity)
    per_dest = kept_counts.reshape(ep, local_experts_n)
    before = (jnp.cumsum(per_dest, axis=1) - per_dest).reshape(-1)  # kept rows of the destination's earlier experts
    position = before[d.expert] + d.rank
    fits = d.kept & (position < rows)
    total = ep * rows
    slot = jnp.where(fits, (d.expert // local_experts_n) * rows + position, total + jnp.arange(fits.shape[0]))  # unique, dropped
    send = jnp.full((total, x.shape[1]), experts_lib.UNWRITTEN, x.dtype).at[slot].set(x[d.order // k], mode="drop", unique_indices=True)
    send_ids = jnp.full((total,), local_experts_n, jnp.int32).at[slot].set(d.expert % local_experts_n, mode="drop", unique_indices=True)
    received = jax.lax.all_to_all(send, AXIS, 0, 0, tiled=True)  # block q: what device q sent here
    received_ids = jax.lax.all_to_all(send_ids, AXIS, 0, 0, tiled=True)
    by_expert = jnp.argsort(received_ids, stable=True)  # empty rows (id = local count) sort last
    group_sizes = jnp.zeros((local_experts_n,), jnp.int32).at[received_ids].add(1, mode="drop")
    out = reduce_hidden(compute(received[by_expert], group_sizes, w_gate_up, w_down))
    results = out[jnp.argsort(by_expert)].astype(x.dtype)
    returned = jax.lax.all_to_all(results, AXIS, 0, 0, tiled=True)  # my rows' results, in my send layout
    per_row = jnp.where(fits[:, None], returned[jnp.minimum(slot, total - 1)], 0.0)
    return combine(per_row, d, gates, x.dtype), jnp.sum(~fits).astype(jnp.float32)


# -- the task ----------------------------------------------------------------------------------


def with_expert_parallelism(task, config: Config, mesh: jax.sharding.Mesh):
    """The task whose MoE layers dispatch their tokens with ``ExpertParallel`` (each step
    installs it, ``layout.step_context``)."""
    rules = rules_for(resolve_strategy(config.parallel.strategy, dict(mesh.shape)))
    kernel = ExpertParallel(mesh=mesh, rules=rules, buffer_factor=config.parallel.expert_buffer_factor)
    if kernel.ep > 1:
        log.info(kernel.note(config.model.moe_experts))
    dense = experts_lib.kernel_note(kernel.platform, config.model.moe_experts // kernel.ep)  # where the grouped matmuls run densely
    if dense:
        log.info(dense)
    return dataclasses.replace(task, expert_kernel=kernel)
