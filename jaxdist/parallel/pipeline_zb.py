"""zb1: the zero-bubble pipeline schedule (ZB-H1's idea in lockstep SPMD ticks).

1F1B's ticks (``pipeline_1f1b``: S - 1 forward-only, M with a forward and a backward, S - 1
backward-only) with each chunk's backward split in two (``split_backward``): the input
gradient B runs at 1F1B's tick, since the stage before waits for it; the weight gradient W
waits, its inputs (what B computed for it, and the residuals it reads) in a ring of
``ZeroBubbleTable.w_ring`` slots, until a slot of that device would otherwise idle. Each tick
has a forward slot, the head (when the last device finishes a microbatch), a backward slot
and, in the table's ``weight_ticks``, a W slot. A device picks what its slot runs with
``lax.switch`` (its own branch only: a forward, a B or a W), so a tick costs what its slots
cost, not a masked copy of every kind of work. The warm-up keeps 1F1B's forwards; the
forward slots freed after a device's last forward and the backward slots after its last
backward run its waiting W's, and the W slots take the rest. At S = 4, M = 8 that is 27
slots of a third of a chunk step against 1F1B's 33: the bubble 11% against 27%.

The price of lockstep: each device holds the inputs of the W's it has not run yet, up to
``w_ring`` microbatches, where ZB-H1's own (per-device, not lockstep) timeline runs them
sooner and keeps 1F1B's memory.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxdist.parallel.pipeline_1f1b import SEQ, on_stages
from jaxdist.parallel.pipeline_parts import StageResiduals, from_last_stage, index, my_piece, set_where, shift, sum_dtype
from jaxdist.parallel.pipeline_schedule import BACKWARD, FORWARD, WEIGHT, PipelineSpec, one_f_one_b_forward, zero_bubble_table
from jaxdist.parallel.split_backward import split_backward


def _ops(rows) -> tuple[jax.Array, jax.Array]:
    """A table's [ticks, stages] ops and microbatches, as arrays the ticks index."""
    table = np.asarray(rows, np.int32)  # [ticks, stages, 2]
    return jnp.asarray(table[..., 0]), jnp.asarray(table[..., 1])


def _zeros(shapes):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def zero_bubble(stage_fn, head_loss_fn, spec: PipelineSpec, mesh: Mesh, layer_params, head_params, x, aux, targets, seed):
    """(loss sum, and the gradients of loss sum x ``seed`` by layer params, head params and x)."""
    S, M = spec.stages, spec.microbatches
    R = spec.ring_slots
    table = zero_bubble_table(S, M)
    slots = {name: _ops(getattr(table, name)) for name in ("forward", "backward", "weight")}
    residuals = StageResiduals(stage_fn)
    acc = sum_dtype(x.dtype, mesh)

    def per_stage(params, head_params, x_mb, aux_mb, targets_mb, seed):
        params = jax.tree.map(lambda p: p[0], params)  # [K, ...]: one chunk
        s = jax.lax.axis_index("pipe")
        mb_shape = x_mb.shape[1:]
        activation = jax.ShapeDtypeStruct(mb_shape, x_mb.dtype)
        kept_shapes = jax.eval_shape(lambda p, h: residuals.forward(p, h, index(aux_mb, 0))[1], params, x_mb[0])
        split = split_backward(residuals.backward, params, kept_shapes, activation)
        n_params = len(jax.tree.leaves(params))
        flat_shapes = jax.tree.leaves((params, kept_shapes, activation))
        stored = [k for k in split.w_inputs if k >= n_params]  # the residuals (and cotangent) W reads
        w_shapes = [jax.ShapeDtypeStruct(flat_shapes[k].shape, flat_shapes[k].dtype) for k in stored] + list(split.interface_shapes)
        no_y, no_kept, no_gx = _zeros(activation), _zeros(kept_shapes), _zeros(activation)
        no_store = _zeros(w_shapes)

        def weight(wring, m, g_params):
            w_slot = [buf[m % table.w_ring] for buf in wring]  # read in the branch that needs it
            flat = [None] * len(flat_shapes)
            for k, leaf in enumerate(jax.tree.leaves(params)):
                flat[k] = leaf
            for k, value in zip(stored, w_slot, strict=False):
                flat[k] = value
            grads = split.w(flat, list(w_slot[len(stored) :]))
            return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), g_params, grads)

        def tick(carry, t, head: bool, backward_slot: bool, weight_slot: bool, forwards: bool):
            act_in, cot_in, ring, wring, loss, g_params, g_head, dx = carry
            op, m = slots["forward"][0][t, s], slots["forward"][1][t, s]
            h = jnp.where(s == 0, x_mb[m], act_in)
            aux_m = index(aux_mb, m)

            # each branch adds its W into the gradients it is handed: no zeros of the weights' size
            def f_idle(h, aux_m, wring, m, g_params):
                return no_y, no_kept, g_params

            def f_forward(h, aux_m, wring, m, g_params):
                y, kept = residuals.forward(params, h, aux_m)
                return y, kept, g_params

            def f_weight(h, aux_m, wring, m, g_params):
                return no_y, no_kept, weight(wring, m, g_params)

            branches = [f_idle, f_forward if forwards else f_idle, f_idle, f_weight]
            y, kept, g_params = jax.lax.switch(op, branches, h, aux_m, wring, m, g_params)
            ring = tuple(set_where(buf, m % R, op == FORWARD, leaf) for buf, leaf in zip(ring, kept, strict=True))
            dy = jnp.zeros(mb_shape, x_mb.dtype)
            if head:  # the last device's forward of this tick, its loss spread over the stages
                valid, _, m_last, _ = one_f_one_b_forward(spec, S - 1, t)
                mine = {k: my_piece(v, SEQ, S) for k, v in index(targets_mb, jnp.clip(m_last, 0, M - 1)).items()}
                value, vjp = jax.vjp(lambda hp, yy: head_loss_fn(hp, yy, mine), head_params, from_last_stage(y, SEQ, S, acc))
                dh, dy_mine = vjp(seed.astype(value.dtype))
                dy = jax.lax.all_gather(dy_mine, "pipe", axis=SEQ, tiled=True)
                loss = loss + jnp.where(valid, value, 0.0)
                g_head = jax.tree.map(lambda a, g: a + jnp.where(valid, g, 0), g_head, dh)
            gx = no_gx
            if backward_slot:
                op, m = slots["backward"][0][t, s], slots["backward"][1][t, s]
                cot = jnp.where(s == S - 1, dy, cot_in).astype(x_mb.dtype)

                def b_idle(ring, cot, wring, m, g_params):
                    return no_gx, no_store, g_params

                def b_backward(ring, cot, wring, m, g_params):
                    flat = jax.tree.leaves((params, [buf[m % R] for buf in ring], cot))
                    gx, interface = split.b(flat)
                    return gx.astype(x_mb.dtype), [flat[k] for k in stored] + list(interface), g_params

                def b_weight(ring, cot, wring, m, g_params):
                    return no_gx, no_store, weight(wring, m, g_params)

                branches = [b_idle, b_idle, b_backward, b_weight]
                gx, store, g_params = jax.lax.switch(op, branches, ring, cot, wring, m, g_params)
                wring = tuple(set_where(buf, m % table.w_ring, op == BACKWARD, v) for buf, v in zip(wring, store, strict=True))
                dx = set_where(dx, m, (s == 0) & (op == BACKWARD), gx)
            if weight_slot:
                op, m = slots["weight"][0][t, s], slots["weight"][1][t, s]
                g_params = jax.lax.cond(op == WEIGHT, weight, lambda wring, m, g: g, wring, m, g_params)
            act_in = shift(y, S, 1) if forwards else act_in
            cot_in = shift(gx, S, -1) if backward_slot else cot_in
            return (act_in, cot_in, ring, wring, loss, g_params, g_head, dx), None

        init = (
            jnp.zeros(mb_shape, x_mb.dtype),
            jnp.zeros(mb_shape, x_mb.dtype),
            tuple(jnp.zeros((R, *a.shape), a.dtype) for a in kept_shapes),
            tuple(jnp.zeros((table.w_ring, *a.shape), a.dtype) for a in w_shapes),
            jnp.zeros((), jnp.float32),
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), head_params),
            jnp.zeros_like(x_mb),
        )
        # ticks in runs of the same slots: warm-up (forwards), steady (forward, head, backward),
        # cool-down (backward; the forward slot runs W's), each with or without a W slot
        warm, steady = S - 1, M

        def kind(t):
            phase = 0 if t < warm else (1 if t < warm + steady else 2)
            return phase, t in table.weight_ticks

        carry = init
        for (phase, has_w), run in itertools.groupby(range(table.ticks), key=kind):
            ticks = list(run)
            flags = {"head": phase == 1, "backward_slot": phase > 0, "weight_slot": has_w, "forwards": phase < 2}
            carry = jax.lax.scan(lambda c, t, f=flags: tick(c, t, **f), carry, jnp.asarray(ticks, jnp.int32))[0]
        _, _, _, _, loss, g_params, g_head, dx = carry
        return loss, jax.tree.map(lambda g: g[None], g_params), g_head, dx

    return on_stages(per_stage, spec, mesh, layer_params, head_params, x, aux, targets, seed)
