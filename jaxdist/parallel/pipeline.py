"""Pipeline parallelism over the ``pipe`` mesh axis: GPipe, circular, 1F1B and interleaved 1F1B.

Applied from outside the model (``pipelined_loss``), to any model that exposes its parts
(``StagedModel``: embedding, stacked blocks, head and loss), the way torchtitan's
parallelize step does. The decoder's stacked layers ([L, ...], ``layers`` sharded over ``pipe``) are cut into
S stages of L/S layers. Inside ``jax.shard_map`` -- manual over ``pipe`` only, so the
data / fsdp / tensor axes stay with the partitioner inside each stage -- a scan of
ticks runs every stage in lockstep and ``ppermute`` moves activations to the next
stage (and, in 1F1B, cotangents to the previous one). On XLA:CPU their bf16 sums over pipe
run in float32 (``pipeline_parts``: in a partial-manual region the CPU compiler aborts on them).

- ``gpipe``: every microbatch through every stage, the backward pass from autodiff.
  Ticks M + S - 1; bubble (S-1)/(M+S-1); keeps O(M) microbatches of activations.
- ``circular``: each device holds V chunks of L/(S V) layers; a microbatch loops the
  ring V times. Bubble (S-1)/(V M + S - 1). Needs M >= S (a microbatch waits at stage 0
  for its next lap).
- ``1f1b`` (``pipeline_1f1b``): forward and backward interleaved in one explicit schedule,
  with V > 1 interleaved over virtual stages; keeps O(S) microbatches' activations
  (or only stage inputs, recomputing the stage in the backward).

The final norm, head and loss run once per microbatch, spread over the stages: the last
stage's output is reduce-scattered along the sequence so each stage takes the loss of 1/S
of every sequence (GPipe and circular after the loop, 1F1B in the tick that needs the
cotangent), instead of every stage computing the whole head.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxdist.layout import step_context
from jaxdist.layout.sharding import active_layout
from jaxdist.parallel.microbatch import merge_microbatches, split_microbatches
from jaxdist.parallel.pipeline_1f1b import one_f_one_b_loss
from jaxdist.parallel.pipeline_parts import from_last_stage, index, promote, restore, set_where, shift, stage_major, sum_dtype
from jaxdist.parallel.pipeline_schedule import PipelineSpec
from jaxdist.parallel.pipeline_zb import zero_bubble

# the schedules that run their backward inside the loss's forward (None: 1F1B's own)
EXPLICIT = {"1f1b": None, "zb1": zero_bubble, "zbv": zero_bubble}

StageFn = Callable[[Any, jax.Array, dict[str, jax.Array]], jax.Array]
HeadLossFn = Callable[[Any, jax.Array, dict[str, jax.Array]], jax.Array]  # (head params, y, targets) -> loss sum
SEQ = 1  # the sequence axis of a microbatch [b, T, D]: what the head is split over


# -- GPipe and circular: forward schedule, backward by autodiff ----------------------------


def pipeline_loss(
    stage_fn: StageFn,
    head_loss_fn: HeadLossFn,
    layer_params: Any,
    head_params: Any,
    x: jax.Array,
    aux: dict[str, jax.Array],
    targets: dict[str, jax.Array],
    spec: PipelineSpec,
    mesh: Mesh,
) -> jax.Array:
    """The loss sum of x [B, T, D] through all L layers and the head (GPipe or circular)."""

    def head(params, y, targets):
        return jax.lax.psum(head_loss_fn(params, y, targets), ("pipe", "data"))

    y_mb = _forward_schedule(stage_fn, layer_params, x, aux, spec, mesh)
    return _on_pieces(head, head_params, y_mb, targets, spec, mesh, PartitionSpec())


def pipeline_row_sums(
    stage_fn: StageFn, row_fn: HeadLossFn, layer_params: Any, head_params: Any, x: jax.Array, aux: dict, targets: dict, spec, mesh
) -> jax.Array:
    """Per row of x [B, T, D], the sum over its sequence of ``row_fn``'s [rows, T] values (GPipe or circular):
    each stage sums its piece of the sequence, and the pieces are summed over pipe."""

    def head(params, y, targets):
        return jax.lax.psum(jnp.sum(row_fn(params, y, targets), axis=-1), "pipe")

    y_mb = _forward_schedule(stage_fn, layer_params, x, aux, spec, mesh)
    return _on_pieces(head, head_params, y_mb, targets, spec, mesh, PartitionSpec("data"))


def _forward_schedule(stage_fn: StageFn, layer_params: Any, x: jax.Array, aux: dict, spec: PipelineSpec, mesh: Mesh) -> jax.Array:
    """The last stage's outputs of every microbatch, stage s holding 1/S of every sequence: [M, b, T/S, D] per stage."""
    S, M, V = spec.stages, spec.microbatches, spec.virtual
    staged = stage_major(layer_params, spec)
    x_mb = split_microbatches(x, M)
    aux_mb = {k: split_microbatches(v, M) for k, v in aux.items()}
    acc = sum_dtype(x.dtype, mesh)  # what the sums over pipe run in (pipeline_parts: bf16 on CPU)

    def per_stage(params, x_in, aux_mb):
        params = jax.tree.map(lambda p: p[0], params)  # this stage's [V, K, ...]
        x_mb = restore(x_in, x)
        s = jax.lax.axis_index("pipe")

        def tick(carry, t):
            inbox, outputs, received = carry
            # what arrived at stage 0 from the last stage: a microbatch due for its next lap
            arrived = t - S
            lap_due = (s == 0) & (arrived >= 0) & (arrived < (V - 1) * M)
            inbox = set_where(inbox, jnp.clip(arrived, 0, V * M - 1) % M, lap_due, received)

            i = t - s  # this stage's iteration: microbatch i % M on chunk i // M
            valid = (i >= 0) & (i < V * M)
            i = jnp.clip(i, 0, V * M - 1)
            m, v = i % M, i // M
            first_lap_input = jnp.where(v == 0, x_mb[m], inbox[m])
            h = jnp.where(s == 0, first_lap_input, received)
            out = stage_fn(index(params, v), h, index(aux_mb, m))
            outputs = set_where(outputs, m, valid & (s == S - 1) & (v == V - 1), out)
            return (inbox, outputs, shift(out, S, 1)), None

        zeros = jnp.zeros_like(x_mb)
        (_, outputs, _), _ = jax.lax.scan(tick, (zeros, zeros, jnp.zeros_like(x_mb[0])), jnp.arange(spec.ticks))
        return from_last_stage(outputs, SEQ + 1, S, acc)  # stage s gets 1/S of every sequence: [M, b, T/S, D]

    pieces = PartitionSpec(None, None, "pipe")
    run = jax.shard_map(
        per_stage,
        mesh=mesh,
        in_specs=(PartitionSpec("pipe"), PartitionSpec(), PartitionSpec()),
        out_specs=pieces,
        axis_names={"pipe"},
        check_vma=False,
    )
    return run(staged, promote(x_mb, mesh), aux_mb)  # replicated over pipe: autodiff sums its gradient over pipe


def _on_pieces(head: Callable, head_params: Any, y_mb: jax.Array, targets: dict, spec: PipelineSpec, mesh: Mesh, out_spec) -> Any:
    """``head(head params, y, targets)`` on each stage's piece of the sequences, not all of it everywhere.
    Manual over 'data' too: with it left to the partitioner inside a pipe-manual region, XLA's SPMD
    partitioner (jaxlib 0.10) fails a check on the loss's gather once tensor is partitioned."""
    targets_mb = {k: split_microbatches(v, spec.microbatches) for k, v in targets.items()}

    def on_piece(head_in, y_mb, targets_mb):
        params = restore(head_in, head_params)
        return head(params, merge_microbatches(y_mb), {k: merge_microbatches(v) for k, v in targets_mb.items()})

    rows_pieces = PartitionSpec(None, "data", "pipe")
    run_head = jax.shard_map(
        on_piece,
        mesh=mesh,
        in_specs=(PartitionSpec(), rows_pieces, rows_pieces),
        out_specs=out_spec,
        axis_names={"pipe", "data"},
        check_vma=False,
    )
    return run_head(promote(head_params, mesh), y_mb, targets_mb)  # replicated over pipe and data, like x above


# -- applying a schedule to a model from outside ------------------------------------------


class StagedModel(Protocol):
    """The parts a model exposes so that a schedule can run it (``models.llama.Llama`` does)."""

    def embed_tokens(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]: ...  # (x, per-row aux)

    def layer_stack(self) -> tuple[Any, Any]: ...  # (graphdef, params stacked on a leading layer axis)

    def run_layers(self, graphdef: Any, stacked: Any, x: jax.Array, aux: dict[str, jax.Array]) -> jax.Array: ...

    def head_params(self) -> Any: ...

    def head_loss(self, head: Any, y: jax.Array, targets: dict[str, jax.Array]) -> jax.Array: ...  # summed loss, per token

    def head_target_logps(self, head: Any, y: jax.Array, targets: jax.Array) -> jax.Array: ...  # [rows, T] (DPO's)

    def loss_targets(self, batch: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], jax.Array]: ...  # (targets, weight)


def pipelined_loss(spec: PipelineSpec) -> Callable[[StagedModel, dict[str, jax.Array]], tuple[jax.Array, jax.Array, dict]]:
    """A task loss ``(model, batch) -> (loss sum, weight, {})`` that runs the model's layers
    through ``spec``'s schedule over the mesh's pipe axis; the embedding runs outside the
    pipeline, the head and loss inside it, spread over the stages."""

    def loss(model: StagedModel, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array, dict]:
        x, aux = model.embed_tokens(batch)
        graphdef, stacked = model.layer_stack()
        stage = functools.partial(model.run_layers, graphdef)
        targets, weight = model.loss_targets(batch)
        mesh = active_layout().mesh
        if spec.schedule in EXPLICIT:
            seed = step_context.current().loss_cotangent  # 1F1B runs its backward inside the forward: it needs fp16's scale now
            seed = jnp.ones((), jnp.float32) if seed is None else jnp.asarray(seed, jnp.float32)
            explicit = one_f_one_b_loss(stage, model.head_loss, spec, mesh, EXPLICIT[spec.schedule])
            return explicit(stacked, model.head_params(), x, aux, targets, seed), weight, {}
        # dense layers only (validate: no MoE here)
        return pipeline_loss(stage, model.head_loss, stacked, model.head_params(), x, aux, targets, spec, mesh), weight, {}

    return loss


def pipelined_row_logps(spec: PipelineSpec) -> Callable[[StagedModel, dict[str, jax.Array]], jax.Array]:
    """``(model, batch) -> [rows]``: each row's log-probability of its targets under the loss mask
    (DPO's, ``training.dpo.row_logps``), the layers through ``spec``'s forward schedule (GPipe or
    circular: autodiff takes its backward, so DPO's loss of whole rows can follow it)."""

    def row_logps(model: StagedModel, batch: dict[str, jax.Array]) -> jax.Array:
        x, aux = model.embed_tokens(batch)
        graphdef, stacked = model.layer_stack()
        stage = functools.partial(model.run_layers, graphdef)
        targets, _ = model.loss_targets(batch)

        def masked_logps(head, y, targets):
            return model.head_target_logps(head, y, targets["targets"]) * targets["loss_mask"]

        mesh = active_layout().mesh
        return pipeline_row_sums(stage, masked_logps, stacked, model.head_params(), x, aux, targets, spec, mesh)

    return row_logps
