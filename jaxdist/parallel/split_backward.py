"""A backward pass split in two: the input gradient (B) and the weight gradient (W).

Zero-bubble pipeline schedules run a stage's B as soon as its output cotangent arrives (the
stage before it waits for that), and its W later, in a tick that would otherwise idle. Both
halves come from the one backward autodiff traces, so nothing is computed twice:

- B: every equation the input gradient needs (the cotangent's chain back through the layers:
  the matmuls' input-gradient dots, attention's backward, the norms' and activations').
- W: the rest, which only the weight gradients need (each weight's dot of its matmul's input
  with its output's cotangent), reading what B computed for it: the ``interface``, handed from
  B to W and kept in between.

The layer loop's backward is one ``scan``; an equation needed by both halves stays in B, and a
``scan`` needed by both is split into two scans over the same layers: B's carries the cotangent
(and whatever carry it depends on), W's the rest, and B's emits per layer what W's reads of it.
The halves are run by a small interpreter over the traced equations (``jax.extend.core``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var


class Key:
    """An environment key for a value the split itself introduces (a scan's per-layer interface)."""


def _reads(item: Any) -> list[Any]:
    return [v for v in item.invars if not isinstance(v, Literal)]


@dataclasses.dataclass
class ScanPart:
    """One half of a split ``scan``: its consts, the carries it keeps and the xs it reads, run
    over the same layers with the body's half (``items``); ``outvars`` are the outer names it
    writes (carries, then ys), ``invars`` the outer names it reads."""

    items: list[Any]
    length: int
    reverse: bool
    consts: list[tuple[Any, Any]]  # (outer name, body name)
    carries: list[tuple[Any, Any, Any, Any]]  # (outer init, body in, body out, outer out)
    xs: list[tuple[Any, Any]]  # (outer name, body name)
    ys: list[tuple[Any, Any]]  # (body name, outer name)

    @property
    def invars(self) -> list[Any]:
        return [o for o, _ in self.consts] + [c[0] for c in self.carries] + [o for o, _ in self.xs]

    @property
    def outvars(self) -> list[Any]:
        return [c[3] for c in self.carries] + [o for _, o in self.ys]

    def run(self, env: dict) -> None:
        consts = [env_read(env, o) for o, _ in self.consts]

        def body(carry, xs):
            local = {b: v for (_, b), v in zip(self.consts, consts, strict=True)}
            local.update({c[1]: v for c, v in zip(self.carries, carry, strict=True)})
            local.update({b: v for (_, b), v in zip(self.xs, xs, strict=True)})
            run_items(self.items, local)
            return [env_read(local, c[2]) for c in self.carries], [env_read(local, b) for b, _ in self.ys]

        init = [env_read(env, c[0]) for c in self.carries]
        xs = [env_read(env, o) for o, _ in self.xs]
        carry, ys = jax.lax.scan(body, init, xs, length=self.length, reverse=self.reverse)
        for c, v in zip(self.carries, carry, strict=True):
            env[c[3]] = v
        for (_, o), v in zip(self.ys, ys, strict=True):
            env[o] = v


def env_read(env: dict, v: Any) -> Any:
    return v.val if isinstance(v, Literal) else env[v]


def run_items(items: Sequence[Any], env: dict) -> None:
    """Evaluate equations and scan halves in order, reading and writing ``env``."""
    for item in items:
        if isinstance(item, ScanPart):
            item.run(env)
            continue
        params = item.primitive.get_bind_params(item.params)
        subfuns, params = params if isinstance(params, tuple) else ([], params)  # (sub-functions, params) before JAX 0.10
        out = item.primitive.bind(*subfuns, *[env_read(env, v) for v in item.invars], **params)
        outs = out if item.primitive.multiple_results else [out]
        for v, x in zip(item.outvars, outs, strict=True):
            if isinstance(v, Var):
                env[v] = x


@dataclasses.dataclass
class Halves:
    b_items: list[Any]
    w_items: list[Any]
    interface: list[Any]  # names B defines and W reads


INLINED = ("remat2", "checkpoint", "pjit", "jit", "closed_call")  # calls whose equations the split looks into


def inlined(jaxpr: Jaxpr) -> Jaxpr:
    """``jaxpr`` with the calls of ``INLINED`` replaced by their own equations (fresh names, so a
    jaxpr called twice stays two): a rematted layer's backward is one ``remat2`` call holding
    both its input and its weight gradients, which the split must see apart."""
    eqns: list[JaxprEqn] = []
    alias: dict[Any, Any] = {}  # a call's output -> what computes it inside (or the input it passes on)

    def renamed(v):
        return v if isinstance(v, Literal) else alias.get(v, v)

    for eqn in jaxpr.eqns:
        eqn = eqn.replace(invars=[renamed(v) for v in eqn.invars])
        inner = eqn.params.get("jaxpr") if eqn.primitive.name in INLINED else None
        closed = None if inner is None else (inner if isinstance(inner, ClosedJaxpr) else ClosedJaxpr(inner, ()))
        if closed is None or closed.consts or closed.jaxpr.constvars:
            eqns.append(eqn)
            continue
        body = inlined(closed.jaxpr)
        names: dict[Any, Any] = dict(zip(body.invars, eqn.invars, strict=True))
        for inner_eqn in body.eqns:
            invars = [names.get(v, v) if isinstance(v, Var) else v for v in inner_eqn.invars]
            outvars = [
                names.setdefault(v, Var(v.aval)) if isinstance(v, Var) and not isinstance(v, DropVar) else v for v in inner_eqn.outvars
            ]
            eqns.append(inner_eqn.replace(invars=invars, outvars=outvars))
        for outer, v in zip(eqn.outvars, body.outvars, strict=True):
            if isinstance(outer, Var) and not isinstance(outer, DropVar):
                alias[outer] = names.get(v, v) if isinstance(v, Var) else v
    return jaxpr.replace(eqns=eqns, outvars=[renamed(v) for v in jaxpr.outvars])


def partition(eqns: Sequence[JaxprEqn], b_out: Sequence[Any], w_out: Sequence[Any]) -> Halves:
    """Split ``eqns`` into what computes ``b_out`` (B) and what else computes ``w_out`` (W)."""
    need_b = {v for v in b_out if not isinstance(v, Literal)}
    need_w = {v for v in w_out if not isinstance(v, Literal)}
    b_items: list[Any] = []
    w_items: list[Any] = []
    for eqn in reversed(eqns):
        for_b = any(o in need_b for o in eqn.outvars)
        for_w = any(o in need_w for o in eqn.outvars)
        if for_b and for_w and eqn.primitive.name == "scan":
            b_part, w_part = split_scan(eqn, [o in need_b for o in eqn.outvars], [o in need_w for o in eqn.outvars])
            b_items.append(b_part)
            w_items.append(w_part)
            need_b.update(_reads(b_part))
            need_w.update(_reads(w_part))
        elif for_b:
            b_items.append(eqn)
            need_b.update(_reads(eqn))
        elif for_w:
            w_items.append(eqn)
            need_w.update(_reads(eqn))
    b_items.reverse()
    w_items.reverse()
    w_reads = {v for item in w_items for v in _reads(item)} | {v for v in w_out if not isinstance(v, Literal)}
    defined_by_w = {v for item in w_items for v in item.outvars}
    # in B's order of definition: the same program in every process (an order by id would not be)
    interface = [v for item in b_items for v in item.outvars if v in w_reads and v not in defined_by_w]
    return Halves(b_items, w_items, list(dict.fromkeys(interface)))


def split_scan(eqn: JaxprEqn, b_wants: list[bool], w_wants: list[bool]) -> tuple[ScanPart, ScanPart]:
    """A ``scan`` whose outputs both halves need, as two scans over the same iterations: B's
    keeps the carries B's outputs depend on (closed over the loop), W's the others, and B's
    emits per iteration the values of its body that W's body reads (as ys; W takes them as xs)."""
    p = eqn.params
    assert not p["jaxpr"].consts and not p["jaxpr"].jaxpr.constvars, "a scan body with closed-over constants"
    body = inlined(p["jaxpr"].jaxpr)
    n_consts, n_carry = p["num_consts"], p["num_carry"]
    b_ins, carry_ins, x_ins = body.invars[:n_consts], body.invars[n_consts : n_consts + n_carry], body.invars[n_consts + n_carry :]
    carry_outs, y_outs = body.outvars[:n_carry], body.outvars[n_carry:]
    b_carries = {j for j in range(n_carry) if b_wants[j]}
    b_ys = [i for i in range(len(y_outs)) if b_wants[n_carry + i]]
    while True:  # the carries B needs: those its outputs read, through the loop, to a fixpoint
        halves = partition(body.eqns, [carry_outs[j] for j in sorted(b_carries)] + [y_outs[i] for i in b_ys], [])
        reads = {v for item in halves.b_items for v in _reads(item)} | {carry_outs[j] for j in b_carries}
        more = {j for j in range(n_carry) if carry_ins[j] in reads} - b_carries
        if not more:
            break
        b_carries |= more
    w_carries = [j for j in range(n_carry) if j not in b_carries]
    w_ys = [i for i in range(len(y_outs)) if w_wants[n_carry + i] and i not in b_ys]
    halves = partition(
        body.eqns,
        [carry_outs[j] for j in sorted(b_carries)] + [y_outs[i] for i in b_ys],
        [y_outs[i] for i in w_ys] + [carry_outs[j] for j in w_carries],
    )
    # W reads B's carries' per-iteration values too: B emits them beside its interface
    w_reads = {v for item in halves.w_items for v in _reads(item)} | {y_outs[i] for i in w_ys} | {carry_outs[j] for j in w_carries}
    handed = halves.interface + [carry_ins[j] for j in sorted(b_carries) if carry_ins[j] in w_reads]
    stacked = [Key() for _ in handed]  # the per-iteration values, stacked by the B scan
    outer_in, outer_out = eqn.invars, eqn.outvars
    consts = list(zip(outer_in[:n_consts], b_ins, strict=True))
    xs = list(zip(outer_in[n_consts + n_carry :], x_ins, strict=True))

    def carry(j):
        return (outer_in[n_consts + j], carry_ins[j], carry_outs[j], outer_out[j])

    b_ys_out = [(y_outs[i], outer_out[n_carry + i]) for i in b_ys] + list(zip(handed, stacked, strict=True))
    w_ys_out = [(y_outs[i], outer_out[n_carry + i]) for i in w_ys]
    b_carry_list, w_carry_list = [carry(j) for j in sorted(b_carries)], [carry(j) for j in w_carries]

    def used(items, outs):  # each half takes only the consts and xs its body reads
        reads = {v for item in items for v in _reads(item)} | set(outs)
        return [c for c in consts if c[1] in reads], [x for x in xs if x[1] in reads]

    b_consts, b_xs = used(halves.b_items, [b for b, _ in b_ys_out] + [c[2] for c in b_carry_list])
    w_consts, w_xs = used(halves.w_items, [b for b, _ in w_ys_out] + [c[2] for c in w_carry_list])
    b_part = ScanPart(halves.b_items, p["length"], p["reverse"], b_consts, b_carry_list, b_xs, b_ys_out)
    w_part = ScanPart(
        halves.w_items, p["length"], p["reverse"], w_consts, w_carry_list, w_xs + list(zip(stacked, handed, strict=True)), w_ys_out
    )
    return b_part, w_part


@dataclasses.dataclass
class SplitBackward:
    """``backward(inputs, cotangent) -> (weight grads, input grad)`` as ``b(inputs, cotangent)
    -> (input grad, interface)`` and ``w(inputs, cotangent, interface) -> weight grads``; the
    interface is a list of arrays (``interface_shapes``), what W needs of B's work."""

    jaxpr: ClosedJaxpr
    halves: Halves
    treedef: Any  # of the weight grads
    interface_shapes: list[jax.ShapeDtypeStruct]

    @property
    def w_inputs(self) -> list[int]:
        """The positions of the flat inputs W reads (what must wait with the interface until W)."""
        reads = {v for item in self.halves.w_items for v in _reads(item)} | set(self.jaxpr.jaxpr.outvars[:-1])
        return [k for k, v in enumerate(self.jaxpr.jaxpr.invars) if v in reads]

    def _env(self, flat_inputs: list[Any]) -> dict:
        env = dict(zip(self.jaxpr.jaxpr.constvars, self.jaxpr.consts, strict=True))
        env.update(zip(self.jaxpr.jaxpr.invars, flat_inputs, strict=True))
        return env

    def b(self, flat_inputs: list[Any]) -> tuple[Any, list[Any]]:
        env = self._env(flat_inputs)
        run_items(self.halves.b_items, env)
        return env_read(env, self.jaxpr.jaxpr.outvars[-1]), [env_read(env, v) for v in self.halves.interface]

    def w(self, flat_inputs: list[Any], interface: list[Any]) -> Any:
        """The weight gradients; ``flat_inputs`` needs only the positions ``w_inputs`` (None elsewhere)."""
        env = self._env(flat_inputs)
        env.update(zip(self.halves.interface, interface, strict=True))
        run_items(self.halves.w_items, env)
        return jax.tree_util.tree_unflatten(self.treedef, [env_read(env, v) for v in self.jaxpr.jaxpr.outvars[:-1]])


def split_backward(backward: Callable[..., tuple[Any, jax.Array]], *example_inputs: Any) -> SplitBackward:
    """``backward(*inputs) -> (weight grads pytree, input grad)`` traced at ``example_inputs``
    (arrays or shapes; flattened: B and W take the flat list) and split in two."""
    flat, in_tree = jax.tree_util.tree_flatten(example_inputs)
    out_tree = []

    def flat_backward(*leaves):
        grads, gx = backward(*jax.tree_util.tree_unflatten(in_tree, list(leaves)))
        g_leaves, treedef = jax.tree_util.tree_flatten(grads)
        out_tree.append(treedef)
        return (*g_leaves, gx)

    closed = jax.make_jaxpr(flat_backward)(*flat)
    closed = ClosedJaxpr(inlined(closed.jaxpr), closed.consts)
    outs = closed.jaxpr.outvars
    halves = partition(closed.jaxpr.eqns, [outs[-1]], outs[:-1])
    split = SplitBackward(closed, halves, out_tree[0], [])
    split.interface_shapes = jax.eval_shape(lambda *leaves: split.b(list(leaves))[1], *flat)
    return split
