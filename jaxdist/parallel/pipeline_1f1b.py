"""1F1B and interleaved 1F1B: the forward and backward of the pipeline in one explicit schedule.

Lockstep SPMD over ``pipe`` (inside ``jax.shard_map``, manual over pipe and data). Each
device holds V chunks of K = L/(S V) layers, chunk (s, v) being global stage v S + s
(``pipeline_parts.stage_major``); microbatches move through the chunks in groups of S
(V = 1: plain 1F1B, one group). At tick t device s runs

- the forward of its iteration i = t - s: microbatch (i // (S V)) S + i % S on chunk
  (i // S) % V. The last device's output wraps to device 0, where it is exactly the next
  chunk's input one tick later, so nothing waits in an inbox;
- the backward of its iteration j = t - (V S - 1) - (S - 1 - s): the same microbatch
  formula on chunk V - 1 - (j // S) % V; cotangents go left and wrap the same way;
- in the ticks where the last device finishes a microbatch's last chunk, the head and the
  loss on 1/S of its sequence each (``pipeline_parts.from_last_stage``), whose cotangents
  are gathered back for the last device's backward in the same tick.

The ticks run as three phases (``PipelineSpec.phases``): V S - 1 forward-only, then
forward and backward, then V S - 1 backward-only, so each device executes V M + S - 1
chunk steps of which V M are useful: the bubble (S-1)/(V M + S-1). With V > 1 the
middle phase repeats a period of S head ticks and (V-1) S ticks without a head.
Recomputing, the cool-down ticks run in the middle phase's loop instead, with their
forwards (and heads) masked: V S - 1 more chunk forwards for one working set less.

Between a chunk's forward and backward (at most 2 V S - 2 ticks) its activations wait
in a ring of 2 V S - 1 slots: by default the residuals of ``jax.vjp`` (the chunk's
saved activations, weights left out since the backward has them), so the backward runs
only the backward; with ``spec.recompute`` only the chunk's input, and the backward
recomputes its forward (about 4/3 of the layer work; a ring of [b, T, D] inputs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxdist.parallel.microbatch import merge_microbatches, split_microbatches
from jaxdist.parallel.pipeline_parts import (
    StageResiduals,
    from_last_stage,
    index,
    layer_major,
    my_piece,
    psum_in,
    set_where,
    shift,
    stage_major,
    sum_dtype,
)
from jaxdist.parallel.pipeline_schedule import PipelineSpec, one_f_one_b_backward, one_f_one_b_forward

SEQ = 1  # the sequence axis of a microbatch [b, T, D]: what the head is split over


def _one_f_one_b(stage_fn, head_loss_fn, spec: PipelineSpec, mesh: Mesh, layer_params, head_params, x, aux, targets, seed):
    """(loss sum, and the gradients of loss sum x ``seed`` by layer params, head params and x)."""
    S, M, V = spec.stages, spec.microbatches, spec.virtual
    R = spec.ring_slots
    residuals = StageResiduals(stage_fn)
    acc = sum_dtype(x.dtype, mesh)  # what the sums over pipe run in (pipeline_parts: bf16 on CPU)

    def per_stage(params, head_params, x_mb, aux_mb, targets_mb, seed):
        s = jax.lax.axis_index("pipe")
        mb_shape = x_mb.shape[1:]

        def clipped(k):
            return jnp.clip(k, 0, M - 1)

        def tick(carry, t, forward: bool, head: bool, backward: bool):
            act_in, cot_in, ring, loss, g_params, g_head, dx = carry
            y = jnp.zeros(mb_shape, x_mb.dtype)
            if forward:
                f_valid, i, fm, fv = one_f_one_b_forward(spec, s, t)
                i, fm, fv = jnp.clip(i, 0, V * M - 1), clipped(fm), jnp.clip(fv, 0, V - 1)
                h = jnp.where((s == 0) & (fv == 0), x_mb[fm], act_in)
                if spec.recompute:
                    y = stage_fn(index(params, fv), h, index(aux_mb, fm))
                    ring = (set_where(ring[0], i % R, f_valid, h),)
                else:
                    y, kept = residuals.forward(index(params, fv), h, index(aux_mb, fm))
                    ring = tuple(set_where(buf, i % R, f_valid, leaf) for buf, leaf in zip(ring, kept, strict=True))
            dy = jnp.zeros(mb_shape, x_mb.dtype)
            if head:
                # the loss of the microbatch the last device finishes this tick, 1/S of it per stage
                valid, _, m_last, v_last = one_f_one_b_forward(spec, S - 1, t)
                valid = valid & (v_last == V - 1)
                mine = {k: my_piece(v, SEQ, S) for k, v in index(targets_mb, clipped(m_last)).items()}
                value, vjp = jax.vjp(lambda hp, yy: head_loss_fn(hp, yy, mine), head_params, from_last_stage(y, SEQ, S, acc))
                dh, dy_mine = vjp(seed.astype(value.dtype))  # the backward starts from ``seed``, as autodiff's would
                dy = jax.lax.all_gather(dy_mine, "pipe", axis=SEQ, tiled=True)
                loss = loss + jnp.where(valid, value, 0.0)
                g_head = jax.tree.map(lambda acc, g: acc + jnp.where(valid, g, 0), g_head, dh)
            gx = jnp.zeros(mb_shape, x_mb.dtype)
            if backward:
                b_valid, bm, bv, i_f = one_f_one_b_backward(spec, s, t)  # i_f: the forward iteration that filled its slot
                bm, bv, i_f = clipped(bm), jnp.clip(bv, 0, V - 1), jnp.clip(i_f, 0, V * M - 1)
                cot = jnp.where((s == S - 1) & (bv == V - 1), dy, cot_in).astype(x_mb.dtype)
                chunk = index(params, bv)
                if spec.recompute:
                    aux_b = index(aux_mb, bm)
                    _, vjp = jax.vjp(lambda p, h_in: stage_fn(p, h_in, aux_b), chunk, ring[0][i_f % R])
                    gp, gx = vjp(cot)
                else:
                    if not forward:  # trace the chunk's vjp once for its structure (dead code: XLA drops it)
                        residuals.forward(chunk, jnp.zeros(mb_shape, x_mb.dtype), index(aux_mb, bm))
                    gp, gx = residuals.backward(chunk, [buf[i_f % R] for buf in ring], cot)
                g_params = jax.tree.map(lambda acc, g: acc.at[bv].add(jnp.where(b_valid, g, 0)), g_params, gp)
                dx = set_where(dx, bm, (s == 0) & (bv == 0) & b_valid, gx)
            act_in = shift(y, S, 1) if forward else act_in
            cot_in = shift(gx, S, -1) if backward else cot_in
            return (act_in, cot_in, ring, loss, g_params, g_head, dx), None

        def run(carry, start, length, **phase):
            if length == 0:
                return carry
            return jax.lax.scan(lambda c, t: tick(c, t, **phase), carry, start + jnp.arange(length))[0]

        # the ring's slots: the chunk's input (recompute) or its vjp residuals
        aux0 = index(aux_mb, 0)
        chunk0 = index(params, 0)
        if spec.recompute:
            slot_shapes = [jax.ShapeDtypeStruct(mb_shape, x_mb.dtype)]
        else:
            slot_shapes = jax.eval_shape(lambda p, h: residuals.forward(p, h, aux0)[1], chunk0, x_mb[0])
        init = (
            jnp.zeros(mb_shape, x_mb.dtype),
            jnp.zeros(mb_shape, x_mb.dtype),
            tuple(jnp.zeros((R, *a.shape), a.dtype) for a in slot_shapes),
            jnp.zeros((), jnp.float32),
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), head_params),
            jnp.zeros_like(x_mb),
        )
        warm, steady, cool = spec.phases
        # Recomputing, the cool-down runs in the middle's loop (its forwards and heads masked):
        # XLA:CPU gives each while loop its own temporaries, and a backward-only loop's are
        # another full working set (45.8 against 27.9 MB of temp at S=2, M=8; see schedule.py).
        tail = cool if spec.recompute else 0
        carry = run(init, 0, warm, forward=True, head=False, backward=False)
        if V == 1:
            carry = run(carry, warm, steady + tail, forward=True, head=True, backward=True)
        else:  # periods of S head ticks and (V-1) S without, then the last S head ticks
            period = V * S

            def one_period(c, start):
                c = run(c, start, S, forward=True, head=True, backward=True)
                return run(c, start + S, period - S, forward=True, head=False, backward=True), None

            starts = warm + period * jnp.arange(M // S - 1)
            carry = jax.lax.scan(one_period, carry, starts)[0] if M // S > 1 else carry
            carry = run(carry, warm + steady - S, S + tail, forward=True, head=True, backward=True)
        if not tail:
            carry = run(carry, warm + steady, cool, forward=False, head=False, backward=True)
        _, _, _, loss, g_params, g_head, dx = carry
        return loss, g_params, g_head, dx

    return on_stages(per_stage, spec, mesh, layer_params, head_params, x, aux, targets, seed)


def on_stages(per_stage, spec: PipelineSpec, mesh: Mesh, layer_params, head_params, x, aux, targets, seed):
    """Run a schedule's ``per_stage(chunk params [V, K, ...], head params, x_mb, aux_mb,
    targets_mb, seed) -> (loss, chunk grads, head grads, dx_mb)`` (each a sum over this device's
    rows, and its sequence piece) on every stage, and complete the sums: (loss sum, layer grads,
    head grads, dx)."""
    M = spec.microbatches
    acc = sum_dtype(x.dtype, mesh)

    def completed(params, head_params, x_mb, aux_mb, targets_mb, seed):
        params = jax.tree.map(lambda p: p[0], params)  # [V, K, ...]
        loss, g_params, g_head, dx = per_stage(params, head_params, x_mb, aux_mb, targets_mb, seed)
        # loss, head grads and dx are sums over this device's rows (and sequence piece);
        # they are completed over 'data' once, after the schedule (like DDP's bucket)
        loss = jax.lax.psum(loss, ("pipe", "data"))
        g_head = jax.lax.psum(g_head, ("pipe", "data"))
        g_params = jax.lax.psum(g_params, "data")
        dx = psum_in(dx, "pipe", acc)
        return loss, jax.tree.map(lambda g: g[None], g_params), g_head, dx

    # Manual over 'data' as well: XLA's SPMD partitioner (jaxlib 0.10) fails a check when
    # it has to place the per-microbatch gradient reductions over data inside this
    # loop while tensor is partitioned too; reducing explicitly at the end avoids it.
    rows = PartitionSpec(None, "data")
    run = jax.shard_map(
        completed,
        mesh=mesh,
        in_specs=(PartitionSpec("pipe"), PartitionSpec(), rows, rows, rows, PartitionSpec()),
        out_specs=(PartitionSpec(), PartitionSpec("pipe"), PartitionSpec(), rows),
        axis_names={"pipe", "data"},
        check_vma=False,
    )
    staged = stage_major(layer_params, spec)  # [S, V, K, ...]
    x_mb = split_microbatches(x, M)
    aux_mb = {k: split_microbatches(v, M) for k, v in aux.items()}
    targets_mb = {k: split_microbatches(v, M) for k, v in targets.items()}
    loss, g_staged, g_head, dx = run(staged, head_params, x_mb, aux_mb, targets_mb, seed)
    g_head = jax.tree.map(lambda g, p: g.astype(p.dtype), g_head, head_params)
    return loss, layer_major(g_staged, layer_params, spec), g_head, merge_microbatches(dx).astype(x.dtype)


def one_f_one_b_loss(stage_fn, head_loss_fn, spec: PipelineSpec, mesh: Mesh, schedule=None):
    """loss(layer_params, head_params, x, aux, targets, seed) -> summed loss, whose gradient
    comes from the explicit 1F1B schedule (computed together with the loss), started from
    the cotangent ``seed`` (the loss scale autodiff will bring; its own cotangent then
    only rescales, by g / seed). ``schedule``: another explicit schedule of the same signature
    as 1F1B's (``pipeline_zb.zero_bubble``)."""
    run = _one_f_one_b if schedule is None else schedule

    @jax.custom_vjp
    def loss(layer_params, head_params, x, aux, targets, seed):
        return run(stage_fn, head_loss_fn, spec, mesh, layer_params, head_params, x, aux, targets, seed)[0]

    def forward(layer_params, head_params, x, aux, targets, seed):
        value, g_layers, g_head, dx = run(stage_fn, head_loss_fn, spec, mesh, layer_params, head_params, x, aux, targets, seed)
        return value, (g_layers, g_head, dx, aux, targets, seed)

    def backward(residuals, g):
        g_layers, g_head, dx, aux, targets, seed = residuals
        factor = g / seed  # 1 when autodiff brings the seed itself

        def scale(tree):
            return jax.tree.map(lambda x: (x * factor).astype(x.dtype), tree)

        def no_gradient(tree):  # integer inputs (positions, targets) take float0 zeros
            return jax.tree.map(
                lambda x: np.zeros(x.shape, jax.dtypes.float0) if not jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros_like(x), tree
            )

        return scale(g_layers), scale(g_head), scale(dx), no_gradient(aux), no_gradient(targets), jnp.zeros_like(seed)

    loss.defvjp(forward, backward)
    return loss
