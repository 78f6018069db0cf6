"""zb1 and zbv: the zero-bubble schedules, one operation per device per tick.

``pipeline_vtable`` decides, per tick and device, the one operation it runs (a forward, a B or
a W of one of its chunks: ``split_backward``) and the buffer slots its values live in. zb1 runs
a line (device s holds stage s; the loss is taken on the last device); zbv a V (device s holds
the first leg's chunk s and the second leg's chunk 2 S - 1 - s, ``pipeline_parts.stage_major``:
a microbatch runs down the devices and back up, and its loss is taken on device 0). A tick here

- runs that operation, picked with ``lax.switch`` (each device its own branch only);
- in the ticks where the head device ends a microbatch's last chunk, runs the head on every
  device, each on 1/S of that microbatch's sequence, as the other schedules do (a ``lax.cond``
  that every device takes together, since its reduce-scatter and all-gather are collectives);
  the head device files the head's cotangent for its B;
- sends its output one device right (a first-leg forward, a second-leg B) and one device left
  (a second-leg forward, a first-leg B): two collective-permutes without the ring's wrap, whose
  arrivals the table files in the mailbox.

Buffers: the mailbox (activations and cotangents between arrival and use), the residual ring
(a forward's residuals until its W: B and W both read them there, so nothing W needs is copied)
and the W ring (what B hands its W: B's interface, and the output cotangent where W reads it),
each of the size the table proved enough (``TickTable.residual_slots``, ``pending_slots``).
zbv holds at most 2 S half-stage chunks of residuals, S stages' worth; zb1's residual and W
rings together hold at most 2 S - 1 chunks, the lockstep 1F1B ring's count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxdist.parallel.pipeline_1f1b import SEQ, on_stages
from jaxdist.parallel.pipeline_parts import StageResiduals, from_last_stage, index, my_piece, set_where, sum_dtype
from jaxdist.parallel.pipeline_schedule import PipelineSpec
from jaxdist.parallel.pipeline_vtable import B0, B1, F0, F1
from jaxdist.parallel.split_backward import split_backward

_COLUMNS = ("op", "mb", "inbox", "residual", "pending", "from_left", "from_right", "local")


def _zeros(shapes):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def zero_bubble(stage_fn, head_loss_fn, spec: PipelineSpec, mesh: Mesh, layer_params, head_params, x, aux, targets, seed):
    """(loss sum, and the gradients of loss sum x ``seed`` by layer params, head params and x)."""
    S = spec.stages
    table = spec.tick_table
    column = {name: jnp.asarray(np.asarray(getattr(table, name), np.int32)) for name in _COLUMNS}  # [ticks, S] each
    head_ticks = jnp.asarray(np.asarray(table.head, bool))
    residuals = StageResiduals(stage_fn)
    acc = sum_dtype(x.dtype, mesh)

    def per_stage(params, head_params, x_mb, aux_mb, targets_mb, seed):
        s = jax.lax.axis_index("pipe")
        legs = [jax.tree.map(lambda p, leg=leg: p[leg], params) for leg in range(spec.virtual)]  # [K, ...] each
        mb_shape = x_mb.shape[1:]
        activation = jax.ShapeDtypeStruct(mb_shape, x_mb.dtype)
        kept_shapes = jax.eval_shape(lambda p, h: residuals.forward(p, h, index(aux_mb, 0))[1], legs[0], x_mb[0])
        split = split_backward(residuals.backward, legs[0], kept_shapes, activation)
        n_params = len(jax.tree.leaves(legs[0]))
        flat_shapes = jax.tree.leaves((legs[0], kept_shapes, activation))
        # what W reads beside the weights: residuals, from the ring (its slot lives until W), and the
        # chunk's output cotangent, if it needs it, handed over by B with B's interface
        cotangent = len(flat_shapes) - 1
        from_ring = [k for k in split.w_inputs if n_params <= k < cotangent]
        handed = [k for k in split.w_inputs if k == cotangent]
        w_shapes = [jax.ShapeDtypeStruct(flat_shapes[k].shape, flat_shapes[k].dtype) for k in handed] + list(split.interface_shapes)
        # a chunk's residuals and B's outputs: zeros made inside each branch that returns them (made
        # outside, they would be operands of the conditional, buffers held across the loop); the
        # output's, one activation, outside (made inside, XLA:GPU makes one of zbv's permutes synchronous)
        no_kept, no_store = (lambda shapes=shapes: _zeros(shapes) for shapes in (kept_shapes, w_shapes))
        no_out = _zeros(activation)

        # the branches, in the table's op order (IDLE, F0, F1, B1, B0, W0, W1); each hands the
        # gradients through, a W adding its chunk's into them
        def idle(h, aux_m, ring, wring, r_slot, w_slot, g_params):
            return no_out, no_kept(), no_store(), g_params

        def forward(leg):
            def run(h, aux_m, ring, wring, r_slot, w_slot, g_params):
                y, kept = residuals.forward(legs[leg], h, aux_m)
                return y, kept, no_store(), g_params

            return run

        def input_gradient(leg):
            def run(h, aux_m, ring, wring, r_slot, w_slot, g_params):
                flat = jax.tree.leaves((legs[leg], [buf[r_slot] for buf in ring], h))
                gx, interface = split.b(flat)
                return gx.astype(x_mb.dtype), no_kept(), [flat[k] for k in handed] + list(interface), g_params

            return run

        def weight_gradient(leg):
            def run(h, aux_m, ring, wring, r_slot, w_slot, g_params):
                held = [buf[w_slot] for buf in wring]  # read in the branch that needs it
                flat = jax.tree.leaves(legs[leg]) + [None] * (len(flat_shapes) - n_params)
                for k in from_ring:
                    flat[k] = ring[k - n_params][r_slot]
                for k, value in zip(handed, held, strict=False):
                    flat[k] = value
                grads = split.w(flat, held[len(handed) :])
                return no_out, no_kept(), no_store(), jax.tree.map(lambda a, g: a.at[leg].add(g.astype(jnp.float32)), g_params, grads)

            return run

        def second_leg(make):  # zb1 has one leg: its table never picks these
            return make(1) if len(legs) == 2 else idle

        branches = [
            idle,
            forward(0),
            second_leg(forward),
            second_leg(input_gradient),
            input_gradient(0),
            weight_gradient(0),
            second_leg(weight_gradient),
        ]
        head_device = table.head_device

        def head(t, out, loss, g_head):  # the last chunk's output, its loss spread over the stages
            mine = {k: my_piece(v, SEQ, S) for k, v in index(targets_mb, column["mb"][t, head_device]).items()}
            value, vjp = jax.vjp(
                lambda hp, yy: head_loss_fn(hp, yy, mine), head_params, from_last_stage(out, SEQ, S, acc, source=head_device)
            )
            dh, dy_mine = vjp(seed.astype(value.dtype))
            dy = jax.lax.all_gather(dy_mine, "pipe", axis=SEQ, tiled=True)
            return dy.astype(x_mb.dtype), loss + value, jax.tree.map(lambda a, g: a + g, g_head, dh)

        def no_head(t, out, loss, g_head):
            return no_out, loss, g_head

        def tick(carry, t):
            mail, ring, wring, loss, g_params, g_head, dx = carry
            slot = {name: column[name][t, s] for name in _COLUMNS}
            op, m = slot["op"], slot["mb"]
            r_slot, w_slot = jnp.maximum(slot["residual"], 0), jnp.maximum(slot["pending"], 0)
            h = jnp.where((s == 0) & (op == F0), x_mb[m], mail[jnp.maximum(slot["inbox"], 0)])
            # the rings go to the branches whole, each reading its slot there: sliced out here, every
            # tick would read a slot of each (more temp memory on CPU, no faster on H100)
            out, kept, store, g_params = jax.lax.switch(op, branches, h, index(aux_mb, m), ring, wring, r_slot, w_slot, g_params)
            ring = tuple(set_where(buf, r_slot, (op == F0) | (op == F1), leaf) for buf, leaf in zip(ring, kept, strict=True))
            wring = tuple(set_where(buf, w_slot, (op == B0) | (op == B1), v) for buf, v in zip(wring, store, strict=True))
            dx = set_where(dx, m, (s == 0) & (op == B0), out)
            dy, loss, g_head = jax.lax.cond(head_ticks[t], head, no_head, t, out, loss, g_head)
            # What the permutes send depends on the head's result: XLA:CPU runs operations no data
            # orders in any order, and a tick's permutes before the head's conditional on one
            # device and after it on another leave each waiting in a different collective (the
            # bf16 tests' data=2,pipe=2 runs did). In a head tick the head device's output goes to
            # the head, not over the permutes, so it sends the cotangent there: nobody files it.
            sent = jnp.where(head_ticks[t] & (s == head_device), dy, out)
            arrivals = {
                "from_left": jax.lax.ppermute(sent, "pipe", [(j, j + 1) for j in range(S - 1)]),
                "from_right": jax.lax.ppermute(sent, "pipe", [(j + 1, j) for j in range(S - 1)]),
                "local": jnp.where(s == head_device, dy, out),  # the head's cotangent; zbv's last device: its turn
            }
            for name, value in arrivals.items():
                mail = set_where(mail, jnp.maximum(slot[name], 0), slot[name] >= 0, value)
            return (mail, ring, wring, loss, g_params, g_head, dx), None

        init = (
            jnp.zeros((table.mail_slots, *mb_shape), x_mb.dtype),
            tuple(jnp.zeros((table.residual_slots, *a.shape), a.dtype) for a in kept_shapes),
            tuple(jnp.zeros((table.pending_slots, *a.shape), a.dtype) for a in w_shapes),
            jnp.zeros((), jnp.float32),
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), head_params),
            jnp.zeros_like(x_mb),
        )
        _, _, _, loss, g_params, g_head, dx = jax.lax.scan(tick, init, jnp.arange(table.ticks))[0]
        return loss, g_params, g_head, dx

    return on_stages(per_stage, spec, mesh, layer_params, head_params, x, aux, targets, seed)
