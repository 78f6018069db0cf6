"""Streaming DiLoCo's fragments: the model cut into ``parallel.diloco_fragments`` parts, each
synchronised on its own offset schedule, so that one part crosses the slow link at a time.

The units are the layers of each stacked block group (``blocks``, MoE's ``dense_blocks``:
one slice of every leaf's leading ``layers`` dimension) and every other leaf whole (the
embedding, the head, the final norm). They are dealt out largest first, each to the
fragment holding the fewest bytes so far: equal layers go round robin (Streaming DiLoCo's
strided fragments) and the embedding and head land in different fragments, so each
fragment holds about 1/P of the bytes.

A fragment reads and writes its slices of any tree shaped like the parameters (``take``,
``put``), with an extra leading dimension where the tree has one (the replicas' stacked
inner parameters). One fragment holding everything reads and writes the leaves themselves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxdist.errors import ConfigError

STACKED_GROUPS = ("dense_blocks", "blocks")  # top-level parameter groups whose leaves carry a leading layers dimension


@dataclasses.dataclass(frozen=True)
class Piece:
    leaf: int  # index into the flattened parameter tree
    layers: tuple[int, ...] | None  # the stacked layers this fragment holds; None: the whole leaf


@dataclasses.dataclass(frozen=True)
class Fragment:
    index: int
    offset: int  # the fragment syncs after steps t with t % H == offset
    pieces: tuple[Piece, ...]
    leaves: int  # leaves in the parameter tree
    bytes: int  # parameter bytes it holds

    @property
    def whole(self) -> bool:
        """One fragment holding every leaf whole: today's DiLoCo, read and written as it is."""
        return len(self.pieces) == self.leaves and all(p.layers is None for p in self.pieces)

    def take(self, tree: Any, lead: int = 0) -> list:
        """The fragment's slices of ``tree`` (shaped like the parameters, with ``lead`` extra
        leading dimensions), one per piece."""
        leaves = jax.tree.leaves(tree)
        return [_slice(leaves[p.leaf], p.layers, lead) for p in self.pieces]

    def put(self, tree: Any, parts: list, lead: int = 0) -> Any:
        """``tree`` with the fragment's slices replaced by ``parts`` (as ``take`` returns them)."""
        leaves, treedef = jax.tree.flatten(tree)
        for piece, part in zip(self.pieces, parts, strict=True):
            old = jnp.asarray(leaves[piece.leaf])
            part = part.astype(old.dtype)
            if piece.layers is None:
                leaves[piece.leaf] = part
            else:
                index = (slice(None),) * lead + (jnp.asarray(piece.layers),)
                leaves[piece.leaf] = old.at[index].set(part)
        return jax.tree.unflatten(treedef, leaves)

    def abstract(self, abstract_params: Any, param_shardings: Any) -> tuple[list, list]:
        """(shapes, shardings) of ``take(params)``: the slices keep their leaf's sharding (DiLoCo
        has no pipe axis, so nothing splits the layers dimension)."""
        leaves, shardings = jax.tree.leaves(abstract_params), jax.tree.leaves(param_shardings, is_leaf=_is_sharding)
        shapes, out = [], []
        for p in self.pieces:
            a = leaves[p.leaf]
            shape = a.shape if p.layers is None else (len(p.layers), *a.shape[1:])
            shapes.append(jax.ShapeDtypeStruct(shape, jnp.float32))
            out.append(shardings[p.leaf])
        return shapes, out


def _is_sharding(x: Any) -> bool:
    return isinstance(x, NamedSharding)


def _slice(x: jax.Array, layers: tuple[int, ...] | None, lead: int) -> jax.Array:
    if layers is None:
        return x
    start, stop = layers[0], layers[-1] + 1
    if layers == tuple(range(start, stop)):
        return jax.lax.slice_in_dim(x, start, stop, axis=lead)
    return jnp.take(x, jnp.asarray(layers), axis=lead)


def _stacked_group(path) -> str | None:
    first = path[0]
    name = getattr(first, "key", getattr(first, "name", None))
    return name if name in STACKED_GROUPS else None


def split_into_fragments(abstract_params: Any, fragments: int, inner_steps: int) -> list[Fragment]:
    """``abstract_params`` (shapes) cut into ``fragments`` parts of about equal bytes; fragment
    p syncs at offset ``p x H // P`` in each round of H steps."""
    flat = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    depth: dict[str, int] = {}
    units: list[tuple[int, str | None, int]] = []  # (bytes, group or None, layer or leaf index)
    group_bytes: dict[str, int] = {}
    for i, (path, leaf) in enumerate(flat):
        nbytes = leaf.size * jnp.dtype(leaf.dtype).itemsize
        group = _stacked_group(path)
        if group is None:
            units.append((nbytes, None, i))
            continue
        depth.setdefault(group, leaf.shape[0])
        group_bytes[group] = group_bytes.get(group, 0) + nbytes
    for group, layers in depth.items():
        units += [(group_bytes[group] // layers, group, layer) for layer in range(layers)]
    if fragments > len(units):
        raise ConfigError(
            f"parallel.diloco_fragments={fragments}: the model has {len(units)} parts to share out "
            f"({sum(depth.values())} layers and {len(units) - sum(depth.values())} other tensors); use at most that many"
        )
    if fragments > inner_steps:
        raise ConfigError(
            f"parallel.diloco_fragments={fragments} exceeds parallel.diloco_inner_steps={inner_steps}: each fragment needs its own step in a round"
        )
    held: list[list] = [[] for _ in range(fragments)]
    load = [0] * fragments
    for unit in sorted(units, key=lambda u: -u[0]):  # stable: layers in order, then leaves in order
        lightest = min(range(fragments), key=lambda f: (load[f], f))
        held[lightest].append(unit)
        load[lightest] += unit[0]
    out = []
    for f in range(fragments):
        pieces = []
        for i, (path, _leaf) in enumerate(flat):
            group = _stacked_group(path)
            if group is None:
                if any(u[1] is None and u[2] == i for u in held[f]):
                    pieces.append(Piece(i, None))
                continue
            layers = tuple(sorted(u[2] for u in held[f] if u[1] == group))
            if layers:
                pieces.append(Piece(i, None if len(layers) == depth[group] else layers))
        out.append(Fragment(f, f * inner_steps // fragments, tuple(pieces), len(flat), load[f]))
    return out
