"""Muon (``train.optimizer=muon``): momentum orthogonalised by Newton-Schulz on the hidden
matrices, AdamW on everything else.

Which parameter is which is read from its logical axes (``models.params``): a hidden matrix
maps the residual stream (``embed``) to or from a hidden space (``heads``, ``kv_heads``,
``mlp``): the attention and MLP projections, an MoE layer's routed and shared experts. The
embedding and the head (``vocab``), the router (``embed`` x experts), the norms and the
router bias get AdamW, as Keller Jordan's and Moonlight's Muon do.

Each matrix is orthogonalised alone: the ``layers`` and ``expert`` dimensions of a stacked
parameter hold separate matrices, and a fused projection is cut into its projections
first (q, k and v of ``wqkv``; gate and up of ``w_gate_up``), so the update is the same
whether ``model.fused_projections`` is on or off. The momentum follows optax's
``scale_by_muon`` (Nesterov, bias-corrected) and the Newton-Schulz iteration is optax's.

On a mesh, the momentum is stored like the parameter; before Newton-Schulz each matrix is
moved whole onto one device (the mesh axes that split its rows or columns move to its
``layers`` / ``expert`` dimension: one all-to-all), so the five iterations run without a
collective, and the update moves back (a second all-to-all). Where the stack does not divide
over an axis, the matrices are gathered over that axis and every device of it repeats the
work (said in one line).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from optax.contrib import MuonDimensionNumbers

from jaxdist.config import TrainConfig
from jaxdist.errors import ConfigError
from jaxdist.layout.sharding import Layout, logical_to_spec

log = logging.getLogger(__name__)

HIDDEN_AXES = frozenset({"heads", "kv_heads", "mlp"})  # with ``embed``: a projection to or from a hidden space
STACK_AXES = ("layers", "expert")  # dimensions that stack separate matrices
MATCH_ADAMW_RMS = 0.2  # Moonlight: 0.2 sqrt(max(m, n)) gives an orthogonal update AdamW's typical RMS


def _axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    return tuple(variable.get_metadata().get("axes") or ())


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def is_hidden_matrix(_path: Any, variable: Any) -> bool:
    """Whether a parameter gets Muon (an ``nnx.split_state`` filter)."""
    if not isinstance(variable, nnx.Variable):
        return False
    axes = set(_axes(variable))
    return "embed" in axes and bool(axes & HIDDEN_AXES) and "vocab" not in axes


def split(tree: Any) -> tuple[Any, Any]:
    """(the hidden matrices, everything else) of a parameter-shaped ``nnx.State``."""
    return nnx.split_state(tree, is_hidden_matrix, ...)


# -- a parameter read as matrices ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FusedParts:
    """Where a fused projection is cut: along ``axis``, into parts of ``sizes`` named ``names``."""

    axis: int
    sizes: tuple[int, ...]
    names: tuple[str, ...]


def fused_parts(variable: nnx.Variable) -> FusedParts | None:
    """The unnamed axis of a fused projection (None: not fused). ``wqkv``'s
    [.., kv_heads, h/kv + 2, ..] holds each group's h/kv query heads, then its key and its
    value head (``models.llama``); ``w_gate_up``'s [.., 2, mlp] the gate, then the up."""
    axes = _axes(variable)
    if None not in axes:
        return None
    axis = axes.index(None)
    size = variable.shape[axis]
    if "kv_heads" in axes:
        return FusedParts(axis, (size - 2, 1, 1), ("q", "k", "v"))
    return FusedParts(axis, (1,) * size, ("gate", "up") if size == 2 else tuple(f"part{i}" for i in range(size)))


def dimension_numbers(axes: tuple[str | None, ...]) -> MuonDimensionNumbers:
    """The matrices of a parameter with these logical axes, as optax names them: ``layers``
    and ``expert`` stack separate matrices (optax's batch axes, the ones not named); the
    rest are a matrix's rows (its inputs: ``x @ W``) and columns. With ``embed`` first the
    rows are ``embed`` (q, k, v, gate, up); otherwise the columns are (o, down)."""
    inner = [i for i, name in enumerate(axes) if name not in STACK_AXES]
    embed = axes.index("embed")
    if embed == inner[0]:
        return MuonDimensionNumbers(reduction_axis=(embed,), output_axis=tuple(inner[1:]))
    return MuonDimensionNumbers(reduction_axis=tuple(i for i in inner if i != embed), output_axis=(embed,))


def fans(variable: nnx.Variable) -> tuple[int, int]:
    """(fan_in, fan_out) of each matrix of a parameter (or of a view's part)."""
    dims = dimension_numbers(_axes(variable))
    return tuple(math.prod(variable.shape[i] for i in group) for group in (dims.reduction_axis, dims.output_axis))


def shape_scale(setting: str, fan_in: int, fan_out: int) -> float:
    """The factor on the orthogonalised update of a ``fan_in`` x ``fan_out`` matrix (singular
    values ~1): ``match_adamw`` 0.2 sqrt(max(fan_in, fan_out)), an RMS near AdamW's, so
    AdamW's lr and weight decay carry over (Moonlight); ``spectral`` sqrt(max(1, fan_out /
    fan_in)) (Keller Jordan's); ``none`` 1."""
    if setting == "match_adamw":
        return MATCH_ADAMW_RMS * math.sqrt(max(fan_in, fan_out))
    if setting == "spectral":
        return math.sqrt(max(1.0, fan_out / fan_in))
    return 1.0


# -- the view: every matrix (or fused part) a leaf of its own ------------------------------


def to_view(matrices: Any) -> Any:
    """The hidden matrices with each fused projection cut into its parts, one ``nnx.Variable``
    each with the parameter's rank and logical axes (so its momentum is laid out alike)."""
    flat = []
    for path, variable in nnx.to_flat_state(matrices):
        parts = fused_parts(variable)
        if parts is None:
            flat.append((path, variable))
            continue
        starts = [sum(parts.sizes[:i]) for i in range(len(parts.sizes))]
        for name, start, size in zip(parts.names, starts, parts.sizes, strict=True):
            piece = jax.lax.slice_in_dim(variable[...], start, start + size, axis=parts.axis)
            flat.append(((*path, name), variable.replace(piece)))
    return nnx.from_flat_state(flat)


def from_view(view: Any, like: Any) -> Any:
    """``to_view``'s inverse: the parts joined back into the parameters of ``like``."""
    flat = []
    for path, variable in nnx.to_flat_state(like):
        parts = fused_parts(variable)
        if parts is None:
            flat.append((path, _at(view, path)))
        else:
            pieces = [_at(view, (*path, name))[...] for name in parts.names]
            flat.append((path, variable.replace(jnp.concatenate(pieces, axis=parts.axis))))
    return nnx.from_flat_state(flat)


def _at(state: Any, path: tuple) -> Any:
    for key in path:
        state = state[key]
    return state


# -- where each matrix is orthogonalised -----------------------------------------------------


class MatrixPlacement:
    """Where each leaf of the view lives: its momentum where the rules put the parameter
    (``logical_to_spec`` with the optimizer-state rules), and every matrix whole on one device
    while Newton-Schulz runs: the mesh axes that split a matrix's rows or columns move onto
    its ``layers`` / ``expert`` dimension, one axis at a time (one all-to-all each; two at
    once become an all-gather on XLA:CPU). An axis the stack does not divide over is gathered
    instead, and its devices repeat the work (the weaker path, said once). Without a layout
    (one device, a unit test) nothing is constrained."""

    def __init__(self, layout: Layout | None):
        self.layout = layout
        self.gathered: dict[str, str] = {}  # leaf -> the mesh axes its matrices are gathered over
        self.said = False

    def route(self, path: str, variable: nnx.Variable) -> list[PartitionSpec]:
        """The layouts from the momentum's (first) to Newton-Schulz's (last), one mesh axis moved per step."""
        mesh, axes, shape = self.layout.mesh, _axes(variable), variable.shape
        current = [list(_names(s)) for s in logical_to_spec(axes, shape, self.layout.opt_rules, mesh)]
        route, left = [_spec(current)], []
        stacks = [i for i, name in enumerate(axes) if name in STACK_AXES]
        for i in (i for i in range(len(axes)) if i not in stacks):
            while current[i]:
                axis = current[i].pop()  # the minor axis first: the rest of the dimension's split stays as it was
                fits = [j for j in stacks if shape[j] % (math.prod(mesh.shape[a] for a in current[j]) * mesh.shape[axis]) == 0]
                if fits:
                    current[fits[0]].append(axis)
                else:
                    left.append(f"{axis} ({mesh.shape[axis]})")
                route.append(_spec(current))
        if left:
            # why: what each stack holds once the earlier axes moved onto it (a stack may divide
            # over each axis alone, not over all of them together)
            held = ", ".join(
                f"{shape[j]} {axes[j]}"
                + (f" split {math.prod(mesh.shape[a] for a in current[j])} ways over {' x '.join(current[j])}" if current[j] else "")
                for j in stacks
            )
            self.gathered[path] = f"{' x '.join(left)}; {held or 'no layer or expert stack'}"
        return route

    def to_whole(self, view: Any) -> Any:
        """The view with every matrix whole on one device (its route followed forwards)."""
        return self._follow(view, forwards=True)

    def to_stored(self, view: Any) -> Any:
        """The view in the momentum's layout (the route followed backwards)."""
        return self._follow(view, forwards=False)

    def _follow(self, view: Any, forwards: bool) -> Any:
        if self.layout is None:
            return view

        def one(path, variable):
            route = self.route(_path(path), variable)
            x = variable[...]
            for spec in route if forwards else route[::-1]:
                x = jax.lax.with_sharding_constraint(x, NamedSharding(self.layout.mesh, spec))
            return variable.replace(x)

        return jax.tree_util.tree_map_with_path(one, view, is_leaf=_is_variable)

    def say(self, view: Any) -> None:
        """One line, once, naming the matrices that devices gather and orthogonalise again (the weaker path)."""
        if self.layout is None or self.said:
            return
        self.said = True
        jax.tree_util.tree_map_with_path(lambda path, v: self.route(_path(path), v), view, is_leaf=_is_variable)
        by_axes: dict[str, list[str]] = {}
        for path, axes in sorted(self.gathered.items()):
            by_axes.setdefault(axes, []).append(path)
        if by_axes:
            said = " | ".join(f"over {axes}: {', '.join(paths)}" for axes, paths in by_axes.items())
            log.info(
                "muon: the layer/expert stacks of these matrices cannot take every mesh axis that shards them, so each "
                f"device of the axes left gathers them and repeats their Newton-Schulz work ({said})"
            )


def _path(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def _spec(dims: list[list[str]]) -> PartitionSpec:
    return PartitionSpec(*(tuple(d) if len(d) > 1 else (d[0] if d else None) for d in dims))


def _names(spec_entry: Any) -> tuple[str, ...]:
    if spec_entry is None:
        return ()
    return (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


# -- the transformation --------------------------------------------------------------------


class MuonState(NamedTuple):
    count: jax.Array  # updates so far (int32)
    mu: Any  # the momentum, in the view's shape (fused projections cut into parts)


def newton_schulz(ns_steps: int) -> Callable[[Any], Any]:
    """optax's Newton-Schulz orthogonalisation (quintic, Frobenius-normalised, its default
    coefficients) of each matrix of each view leaf: its ``scale_by_muon`` with no momentum
    (beta 0: the update is its input) and our dimension numbers."""

    def orthogonalise(view: Any) -> Any:
        dims = jax.tree.map(lambda v: v.replace(dimension_numbers(_axes(v))), view, is_leaf=_is_variable)
        tx = optax.contrib.scale_by_muon(ns_steps=ns_steps, beta=0.0, nesterov=False, weight_dimension_numbers=dims)
        return tx.update(view, tx.init(view))[0]

    return orthogonalise


def scale_by_muon(cfg: TrainConfig, placement: MatrixPlacement) -> optax.GradientTransformation:
    """The orthogonalised momentum of each hidden matrix, times its ``shape_scale``. Momentum as
    optax's ``scale_by_muon``: mu = b mu + (1 - b) g; Nesterov's look-ahead b mu / (1 -
    b^(t+1)) + (1 - b) g / (1 - b^t), or mu / (1 - b^t)."""
    beta, orthogonalise = cfg.muon_momentum, newton_schulz(cfg.muon_ns_steps)

    def init(params):
        view = to_view(params)
        placement.say(view)
        return MuonState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, view))

    def update(updates, state, params=None):
        del params
        grads = to_view(updates)
        mu = optax.tree.update_moment(grads, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        if cfg.muon_nesterov:
            look_ahead = optax.tree.bias_correction(mu, beta, optax.safe_increment(count))
            mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g, look_ahead, optax.tree.bias_correction(grads, beta, count))
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        # Each move pinned on both sides, so XLA moves mu_hat and the result once (left free,
        # it moves the momentum and the gradient apart, and both terms of the last iteration).
        ortho = orthogonalise(placement.to_whole(mu_hat))
        scaled = jax.tree.map(lambda v: v.replace(v[...] * shape_scale(cfg.muon_scale, *fans(v))), ortho, is_leaf=_is_variable)
        return from_view(placement.to_stored(scaled), updates), MuonState(count, mu)

    return optax.GradientTransformation(init, update)


class MuonAdamWState(NamedTuple):
    muon: Any  # the hidden matrices'
    adamw: Any  # everything else's


def muon_with_adamw(
    cfg: TrainConfig, schedule: optax.Schedule, adamw: optax.GradientTransformation, layout: Layout | None = None
) -> optax.GradientTransformation:
    """Muon on the hidden matrices, with AdamW's decoupled weight decay (``p -= lr * wd * p``);
    ``adamw`` on the rest. The parameters are split (``split``) so that each part's state holds
    only its own parameters, with their logical axes (and so their layout)."""
    if cfg.muon_scale != "match_adamw":
        log.info(
            f"train.muon_scale={cfg.muon_scale}: train.lr ({cfg.lr:g}) is both Muon's rate on the hidden matrices and AdamW's "
            "on the rest, and this scale wants a larger one for the matrices (Keller Jordan's Muon: ~0.02); match_adamw lets them share it"
        )
    placement = MatrixPlacement(layout)
    muon = optax.chain(
        scale_by_muon(cfg, placement),
        optax.add_decayed_weights(cfg.weight_decay) if cfg.weight_decay else optax.identity(),
        optax.scale_by_learning_rate(schedule),
    )

    def init(params):
        matrices, rest = split(params)
        if not jax.tree.leaves(matrices):
            raise ConfigError(
                "train.optimizer=muon: the model has no hidden matrices (attention or MLP projections) to orthogonalise; use adamw or sgd"
            )
        return MuonAdamWState(muon.init(matrices), adamw.init(rest))

    def update(updates, state, params=None):
        matrices, rest = split(updates)
        matrix_params, rest_params = (None, None) if params is None else split(params)
        matrices, muon_state = muon.update(matrices, state.muon, matrix_params)
        rest, adamw_state = adamw.update(rest, state.adamw, rest_params)
        return nnx.merge_state(matrices, rest), MuonAdamWState(muon_state, adamw_state)

    return optax.GradientTransformation(init, update)
