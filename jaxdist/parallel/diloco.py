"""DiLoCo: replicas train apart for H steps, then one outer step on their averaged delta.

The ``replica`` mesh axis is outermost (across regions); inside each replica any data /
fsdp / tensor layout runs the usual train step. The inner parameters and optimizer
state carry a leading replica dimension sharded over ``replica``, and the inner step is
the ordinary step under ``jax.vmap(..., spmd_axis_name="replica")``, so each replica's
computation stays on its own devices and nothing crosses the replica axis.

Every H steps a separate program (the outer step) averages the pseudo-gradient
``outer - inner_r`` over replicas (fp32, or bf16 / int8 / fp4 through the compressed
reduction of ``grad_reduce``: ``parallel.diloco_outer_dtype``), applies it to the outer
parameters with Nesterov SGD (DiLoCo's outer optimizer), and resets every replica's inner
parameters to the result. Inner optimizer states are kept across rounds, as in the paper.

Streaming DiLoCo (Douillard et al., 2025): with ``parallel.diloco_fragments`` = P the model
is cut into P fragments (``diloco_fragments``), and fragment p runs its outer step at
offset p x H / P of each round, so one fragment's bytes cross the link at a time. With
``parallel.diloco_overlap_steps`` = tau, a fragment's average is sent (its program
reduces it across replicas into ``OuterState.pending``) and applied tau steps later, the
replicas having trained on meanwhile: the outer update lands on the outer parameters as
usual, and each replica keeps ``diloco_overlap_mix`` of its own fragment (the paper's
alpha) and takes the rest from the new outer parameters. On a simulated slow link the
transfer's time runs beside those tau steps; on real devices the reduction is a program of
its own, between two inner steps.

The trainer takes its replicas from ``replicas_for``: ``DiLoCo``, or ``OneModel`` (no replica
axis), which answer the same questions (how a step maps over replicas, what a fresh state
is, what the loop calls after compiling, whose metrics and parameters are the model's), so
the step itself has no DiLoCo branch.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.layout.mesh import INNER_BATCH_AXES
from jaxdist.parallel import grad_reduce, slow_link
from jaxdist.parallel.diloco_fragments import Fragment, split_into_fragments

AXIS = "replica"
log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class OuterState:
    params: Any  # the synchronised (outer) parameters, replicated over the replica axis
    momentum: Any  # the outer optimizer's state
    pending: Any = None  # diloco_overlap_steps > 0: per fragment, its replica-averaged delta on its way


def outer_optimizer(parallel_cfg) -> optax.GradientTransformation:
    momentum = parallel_cfg.diloco_outer_momentum
    return optax.sgd(parallel_cfg.diloco_outer_lr, momentum=momentum or None, nesterov=momentum > 0)


def stacked_shapes(tree: Any, replicas: int) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((replicas, *a.shape), a.dtype), tree)


def stacked_shardings(shardings: Any, mesh) -> Any:
    """A leading replica dimension, sharded over the replica axis, before each sharding."""
    return jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(AXIS, *s.spec)), shardings)


def stack(tree: Any, replicas: int) -> Any:
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (replicas, *x.shape)), tree)


def split_batch(batch: Any, replicas: int, mesh) -> Any:
    """[B, ...] -> [R, B/R, ...]: replica r trains on rows r*B/R ... (r+1)*B/R - 1 (its own
    slice: the batch is sharded over replica first, so this moves nothing)."""

    def split(x):
        x = x.reshape(replicas, x.shape[0] // replicas, *x.shape[1:])
        spec = PartitionSpec(AXIS, INNER_BATCH_AXES, *([None] * (x.ndim - 2)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(split, batch)


def average_metrics(metrics: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-replica step metrics (on the host) -> one value each (``skipped``: any replica skipped)."""
    return {k: (np.any(v) if k == "skipped" else np.mean(v)) for k, v in metrics.items()}


def outer_dtype(parallel_cfg) -> str:
    """What the outer average crosses the replica axis as."""
    return parallel_cfg.diloco_outer_dtype or parallel_cfg.diloco_reduce


def average_delta(stacked_inner: Any, outer: Any, parallel_cfg, param_shardings: Any, mesh) -> Any:
    """The replica average of ``outer - inner_r`` in fp32, crossing the replica axis as
    ``outer_dtype`` says."""
    replicas = mesh.shape[AXIS]
    deltas = jax.tree.map(lambda o, i: o.astype(jnp.float32)[None] - i.astype(jnp.float32), outer, stacked_inner)
    mode = outer_dtype(parallel_cfg)
    if mode == "float32":
        mean = jax.tree.map(lambda d: jnp.mean(d, axis=0), deltas)
        return jax.lax.with_sharding_constraint(mean, param_shardings)
    plan = grad_reduce.ReducePlan(mode, (AXIS,), (), 0.0, error_feedback=False)
    device_specs = jax.tree.map(lambda s: s.spec, stacked_shardings(param_shardings, mesh))
    total, _ = grad_reduce.reduce_gradients(deltas, None, plan, param_shardings, mesh, device_specs=device_specs)
    return jax.tree.map(lambda t: t / replicas, total)


def outer_update(stacked_inner: Any, outer: OuterState, tx: optax.GradientTransformation, parallel_cfg, param_shardings, mesh):
    """(new stacked inner parameters: every replica restarts from the new outer ones, new
    outer state, the norm of the averaged delta)."""
    delta = average_delta(stacked_inner, outer.params, parallel_cfg, param_shardings, mesh)
    updates, momentum = tx.update(delta, outer.momentum, outer.params)
    params = optax.apply_updates(outer.params, updates)
    inner = jax.tree.map(lambda p, i: jnp.broadcast_to(p.astype(i.dtype), i.shape), params, stacked_inner)
    inner = jax.lax.with_sharding_constraint(inner, stacked_shardings(param_shardings, mesh))
    return inner, OuterState(params, momentum), optax.tree.norm(delta)


def _is_params_like(treedef) -> Callable[[Any], bool]:
    return lambda x: not isinstance(x, jax.Array) and jax.tree.structure(x) == treedef


def take_state(fragment: Fragment, state: Any, treedef) -> Any:
    """An optimizer state with each parameter-shaped tree in it cut to the fragment's slices."""
    is_params = _is_params_like(treedef)
    return jax.tree.map(lambda t: fragment.take(t) if is_params(t) else t, state, is_leaf=is_params)


def put_state(fragment: Fragment, state: Any, parts: Any, treedef) -> Any:
    """``state`` with the slices ``take_state`` cut replaced by ``parts``'s."""
    leaves, outer_def = jax.tree.flatten(state, is_leaf=_is_params_like(treedef))
    new = jax.tree.leaves(parts, is_leaf=lambda x: isinstance(x, list))
    merged = [fragment.put(old, part) if isinstance(part, list) else part for old, part in zip(leaves, new, strict=True)]
    return jax.tree.unflatten(outer_def, merged)


def fragment_delta(stacked_inner: Any, outer: OuterState, fragment: Fragment, parallel_cfg, part_shardings: list, mesh) -> list:
    """The replica average of the fragment's ``outer - inner_r`` (this crosses the link)."""
    return average_delta(fragment.take(stacked_inner, lead=1), fragment.take(outer.params), parallel_cfg, part_shardings, mesh)


def apply_fragment(stacked_inner: Any, outer: OuterState, fragment: Fragment, delta: list, tx, keep: float, part_shardings, mesh):
    """The outer step on the fragment's slices: (new stacked inner, new outer state). Each
    replica keeps ``keep`` of its own slices and takes the rest from the new outer ones."""
    treedef = jax.tree.structure(outer.params)
    outer_parts = fragment.take(outer.params)
    updates, momentum = tx.update(delta, take_state(fragment, outer.momentum, treedef), outer_parts)
    new_parts = optax.apply_updates(outer_parts, updates)
    inner_parts = fragment.take(stacked_inner, lead=1)
    merged = [
        (keep * i.astype(jnp.float32) + (1 - keep) * o.astype(jnp.float32)[None]) if keep else jnp.broadcast_to(o[None], i.shape)
        for i, o in zip(inner_parts, new_parts, strict=True)
    ]
    merged = jax.lax.with_sharding_constraint(merged, [NamedSharding(mesh, PartitionSpec(AXIS, *s.spec)) for s in part_shardings])
    params = fragment.put(outer.params, new_parts)
    new_outer = OuterState(params, put_state(fragment, outer.momentum, momentum, treedef), outer.pending)
    return fragment.put(stacked_inner, merged, lead=1), new_outer


@dataclasses.dataclass
class FragmentPrograms:
    """One fragment's outer step: ``send`` (the whole sync when nothing overlaps) and, with an
    overlap, ``apply``; ``delay_s``: the simulated link's time for one send."""

    fragment: Fragment
    send: Callable
    apply: Callable | None
    delay_s: float = 0.0


class DiLoCoStep:
    """The host side of a DiLoCo round: the inner step every step; after step t, each fragment
    whose offset t is in its round sends (and, without overlap, applies) its outer step, and
    with an overlap of tau steps the one sent at t - tau applies. The round position follows
    the global step, so a run resumed mid-round finishes that round exactly as it would have."""

    def __init__(self, inner: Callable, fragments: list[FragmentPrograms], inner_steps: int, overlap_steps: int, start_step: int):
        self.inner, self.fragments, self.inner_steps, self.overlap = inner, fragments, inner_steps, overlap_steps
        self.step = start_step
        self.sent_at: dict[int, float] = {}
        self.compiled = inner  # what the analysis reads; it compiles the outer steps itself

    def __call__(self, state, batch):
        state, metrics = self.inner(state, batch)
        self.step += 1
        for programs in self.fragments:
            offset = programs.fragment.offset
            if self.overlap and self.step > self.overlap and (self.step - self.overlap) % self.inner_steps == offset:
                if programs.delay_s:  # the link ran beside the inner steps since the send
                    sent = self.sent_at.get(offset, time.monotonic())
                    slow_link.wait_for_link(state, max(0.0, programs.delay_s - (time.monotonic() - sent)))
                state = programs.apply(state)
            if self.step % self.inner_steps == offset:
                state = programs.send(state)
                self.sent_at[offset] = time.monotonic()
                if programs.delay_s and not self.overlap:
                    slow_link.wait_for_link(state, programs.delay_s)
        return state, metrics


# -- the trainer's replicas: one model, or DiLoCo's ---------------------------------------


class OneModel:
    """No replica axis: every step is synchronous and the state is the model's."""

    count = 0
    outer_tx = None
    link_axis = "data"  # a simulated slow link (experiments) crosses the data axis

    def per_replica(self, step: Callable, mesh, state_axes) -> Callable:
        return step

    def pending_layout(self, abstract_params: Any, param_shardings: Any) -> tuple[Any, Any]:
        return None, None

    def fresh(self, params, opt_state) -> tuple[Any, Any, Any]:
        """(params, optimizer state, outer state) of a fresh start."""
        return params, opt_state, None

    def host_step(self, compiled, state, mesh, start_step: int, link: slow_link.SlowLink | None, state_layout=None) -> Callable:
        if link is None:
            return compiled
        delay, count, sent = link.delay_s(compiled, mesh)
        log.info(
            f"simulated link on the data axis: {count} collectives, {sent / 2**20:.2f} MiB per device per step -> +{delay * 1e3:.1f} ms per step"
        )
        return slow_link.LinkedStep(compiled, delay)

    def fetch_metrics(self, pending: list) -> list:
        return jax.device_get(pending)

    def model_params(self, state):
        return state.params


class DiLoCo(OneModel):
    """``parallel.diloco_inner_steps`` = H local steps per replica, then the outer step."""

    link_axis = AXIS

    def __init__(self, parallel_cfg, mesh):
        self.parallel_cfg, self.inner_steps, self.count = parallel_cfg, parallel_cfg.diloco_inner_steps, mesh.shape[AXIS]
        self.overlap = parallel_cfg.diloco_overlap_steps
        self.outer_tx = outer_optimizer(parallel_cfg)

    def fragments(self, params: Any) -> list[Fragment]:
        """The fragments of a parameter tree (shapes suffice: the cut depends on them only)."""
        return split_into_fragments(params, self.parallel_cfg.diloco_fragments, self.inner_steps)

    def per_replica(self, step: Callable, mesh, state_axes) -> Callable:
        """Every replica takes one ordinary step on its slice of the batch; nothing crosses the
        replica axis (vmap with ``spmd_axis_name`` keeps each replica on its devices).
        ``state_axes``: the state's mapped axes (``training.state.PER_REPLICA``)."""
        mapped = jax.vmap(step, in_axes=(state_axes, 0), out_axes=(state_axes, 0), spmd_axis_name=AXIS)

        def inner(state, batch):
            new, metrics = mapped(dataclasses.replace(state, outer=None), split_batch(batch, self.count, mesh))
            return dataclasses.replace(new, outer=state.outer), metrics

        return inner

    def pending_layout(self, abstract_params: Any, param_shardings: Any) -> tuple[Any, Any]:
        """(shapes, shardings) of ``OuterState.pending``: per fragment its slices in fp32, when
        outer steps overlap inner ones; (None, None) otherwise."""
        if not self.overlap:
            return None, None
        pairs = [f.abstract(abstract_params, param_shardings) for f in self.fragments(abstract_params)]
        return tuple(a for a, _ in pairs), tuple(s for _, s in pairs)

    def fresh(self, params, opt_state) -> tuple[Any, Any, Any]:
        """Every replica starts from the same parameters; the outer ones are those too."""
        pending = None
        if self.overlap:
            pending = tuple([jnp.zeros(x.shape, jnp.float32) for x in f.take(params)] for f in self.fragments(params))
        return stack(params, self.count), stack(opt_state, self.count), OuterState(params, self.outer_tx.init(params), pending)

    def outer_programs(self, state_layout) -> list[FragmentPrograms]:
        """Each fragment's outer step, jitted: its replicas' averaged delta applied to its outer
        parameters, every replica restarted from (or, overlapped, mixed with) them."""
        param_shardings, mesh, cfg = state_layout.param_shardings, state_layout.layout.mesh, self.parallel_cfg
        shardings = state_layout.shardings

        def jitted(fn):
            return jax.jit(fn, in_shardings=(shardings,), out_shardings=shardings, donate_argnums=0)

        out = []
        for fragment in self.fragments(state_layout.abstract_params):
            _, part_shardings = fragment.abstract(state_layout.abstract_params, param_shardings)
            if fragment.whole and not self.overlap:  # DiLoCo as the paper has it: one sync of everything

                def outer(state):
                    params, new_outer, _ = outer_update(state.params, state.outer, self.outer_tx, cfg, param_shardings, mesh)
                    return dataclasses.replace(state, params=params, outer=new_outer)

                out.append(FragmentPrograms(fragment, jitted(outer), None))
                continue

            def sync(state, fragment=fragment, part_shardings=part_shardings):
                delta = fragment_delta(state.params, state.outer, fragment, cfg, part_shardings, mesh)
                inner, outer = apply_fragment(state.params, state.outer, fragment, delta, self.outer_tx, 0.0, part_shardings, mesh)
                return dataclasses.replace(state, params=inner, outer=outer)

            def send(state, fragment=fragment, part_shardings=part_shardings):
                pending = list(state.outer.pending)
                pending[fragment.index] = fragment_delta(state.params, state.outer, fragment, cfg, part_shardings, mesh)
                return dataclasses.replace(state, outer=dataclasses.replace(state.outer, pending=tuple(pending)))

            def apply(state, fragment=fragment, part_shardings=part_shardings):
                delta = state.outer.pending[fragment.index]
                keep = cfg.diloco_overlap_mix
                inner, outer = apply_fragment(state.params, state.outer, fragment, delta, self.outer_tx, keep, part_shardings, mesh)
                return dataclasses.replace(state, params=inner, outer=outer)

            if self.overlap:
                out.append(FragmentPrograms(fragment, jitted(send), jitted(apply)))
            else:
                out.append(FragmentPrograms(fragment, jitted(sync), None))
        return out

    def host_step(self, compiled, state, mesh, start_step: int, link: slow_link.SlowLink | None, state_layout=None) -> Callable:
        programs = self.outer_programs(state_layout)
        count = sent = most = 0
        for p in programs:
            p.send = p.send.lower(state).compile()
            p.apply = p.apply.lower(state).compile() if p.apply is not None else None
            if link is not None:
                p.delay_s, n, b = link.delay_s(p.send, mesh)
                count, sent, most = count + n, sent + b, max(most, b)
        if link is not None:
            delay = sum(p.delay_s for p in programs)
            streaming = ""
            if len(programs) > 1 or self.overlap:
                streaming = f" ({len(programs)} fragments, at most {most / 2**20:.2f} MiB a sync, each beside {self.overlap} inner steps)"
            log.info(
                f"simulated replica link: {count} collectives, {sent / 2**20:.2f} MiB per device per outer step -> "
                f"+{delay * 1e3:.1f} ms every {self.inner_steps} steps{streaming}"
            )
        return DiLoCoStep(compiled, programs, self.inner_steps, self.overlap, start_step)

    def fetch_metrics(self, pending: list) -> list:
        """Per-replica metrics, gathered (at log points only) and averaged."""
        if jax.process_count() > 1:
            pending = multihost_utils.process_allgather(pending, tiled=True)
        return [average_metrics(m) for m in jax.device_get(pending)]

    def model_params(self, state):
        return state.outer.params


def replicas_for(parallel_cfg, mesh) -> OneModel:
    return DiLoCo(parallel_cfg, mesh) if parallel_cfg.diloco_inner_steps else OneModel()
