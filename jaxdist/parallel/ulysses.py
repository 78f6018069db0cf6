"""Ulysses (all-to-all) context parallelism: heads scattered, sequence gathered.

Each device holds 1/N of every sequence (N the size of the ``context`` axis) with all of its heads
(all of its tensor shard's heads). Before attention one all-to-all over ``context`` trades that for
the whole sequence with 1/N of the heads: q, k and v go in one collective, packed along the heads.
Every device then runs ordinary full-sequence causal attention on its heads, and one more all-to-all
brings the output back to the sequence split. The backward is autodiff's: the transpose of an
all-to-all is the reverse all-to-all, so the gradients take the same two trips.

Because each device attends a whole sequence, any kernel works, including those whose mask follows
array indices (cuDNN's and Pallas's flash attention): the gathered sequence is first put back in its
true order (``true_order``: the load-balanced order of ``parallel.context`` is undone with a
reshape, a reverse and a concatenation, no gather) and taken back to the shard order afterwards.
``implementation`` xla (and xla_fp32) runs ``parallel.blockwise``'s tiles, the kernel of the other two
strategies (fp32 scores, fully masked tiles skipped, no [seq, seq] scores in memory); cudnn and pallas
run the model's own ``causal_attention`` on the device's heads.

Head counts: the query heads a device holds (``heads / tensor``) must divide by N. Grouped-query
attention with fewer kv heads than that is fine: the kv heads are repeated the fewest times r that
makes ``r x kv heads`` divide by N (r divides the group size, so every query head still reads its own
kv head), and only then exchanged; r = 1 whenever the kv heads divide by N.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxdist.layout import step_context
from jaxdist.models.attention import IMPLEMENTATIONS, causal_attention
from jaxdist.parallel import blockwise
from jaxdist.parallel.blockwise import TilePlan, pad_chunks, plan_tiles, unpad_chunks

_TILED = ("auto", "xla", "xla_fp32")  # run by parallel.blockwise's tiles; the rest by the model's own kernel
_KERNEL_IMPLEMENTATIONS = (*IMPLEMENTATIONS, "xla_fp32")


# -- the sequence's order ------------------------------------------------------------------------


def true_order(x: jax.Array, n: int) -> jax.Array:
    """A whole sequence [B, T, ...] gathered from n load-balanced shards (shard r holds chunks r and
    2n-1-r of 2n, ``parallel.context.load_balance_order``) in its true order: the shards' first
    halves are chunks 0..n-1 in order, their second halves chunks 2n-1..n."""
    b, t = x.shape[:2]
    shards = x.reshape(b, n, 2, t // (2 * n), *x.shape[2:])
    return jnp.concatenate([shards[:, :, 0], jnp.flip(shards[:, :, 1], axis=1)], axis=1).reshape(x.shape)


def shard_order(x: jax.Array, n: int) -> jax.Array:
    """The inverse of ``true_order``: shard r's two chunks next to each other, shard after shard."""
    b, t = x.shape[:2]
    chunks = x.reshape(b, 2, n, t // (2 * n), *x.shape[2:])
    return jnp.stack([chunks[:, 0], jnp.flip(chunks[:, 1], axis=1)], axis=2).reshape(x.shape)


def kv_repeats(local_heads: int, local_kv_heads: int, n: int) -> int:
    """How many times each kv head is repeated so that the kv heads split n ways like the query
    heads: the fewest r with r x kv heads divisible by n (r divides the group size when the query
    heads divide by n)."""
    return n // math.gcd(local_kv_heads, n)


# -- the exchange --------------------------------------------------------------------------------


def heads_to_sequence(arrays: list[jax.Array], axis: str, n: int) -> list[jax.Array]:
    """[B, T/n, h_i, D] each (the local sequence, all local heads) -> [B, T, h_i/n, D] (the whole
    sequence in shard order, this device's share of the heads), in one all-to-all: the arrays are
    packed along the heads so that the c-th slice of every array goes to device c together."""
    b, t, _, d = arrays[0].shape
    widths = [x.shape[2] // n for x in arrays]
    packed = jnp.concatenate([x.reshape(b, t, n, w, d) for x, w in zip(arrays, widths, strict=True)], axis=3)
    gathered = jax.lax.all_to_all(packed.reshape(b, t, n * sum(widths), d), axis, 2, 1, tiled=True)
    bounds = [sum(widths[:i]) for i in range(len(widths) + 1)]
    return [gathered[:, :, lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def sequence_to_heads(x: jax.Array, axis: str) -> jax.Array:
    """The inverse exchange: [B, T, h/n, D] -> [B, T/n, h, D]."""
    return jax.lax.all_to_all(x, axis, 1, 2, tiled=True)


# -- attention -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class UlyssesAttention:
    """Causal attention within documents for a sequence split over ``axis``, by all-to-all; called
    by the model in place of ``models.attention.causal_attention``, inside jit, on global arrays
    (the interface of ``parallel.context.ContextAttention``)."""

    mesh: jax.sharding.Mesh
    implementation: str = "xla"  # the model's kernel (xla: parallel.blockwise's tiles)
    batch_axes: tuple[str, ...] = ("data", "fsdp")  # mesh axes that split the batch
    heads_axis: str | None = "tensor"  # mesh axis splitting the heads (None: replicated)
    load_balanced: bool = True  # the token arrays arrive in parallel.context's load-balanced order
    block_q: int = 512  # tile lengths of the xla kernel (at most; the sequence is padded to a multiple)
    block_kv: int = 512
    requested: str | None = None  # model.attention as the user set it (auto: the note says what auto picked)
    axis: str = "context"
    strategy = "all_to_all"

    def __post_init__(self):
        if self.implementation not in _KERNEL_IMPLEMENTATIONS:
            raise ValueError(f"attention implementation must be one of {', '.join(_KERNEL_IMPLEMENTATIONS)}, got {self.implementation!r}")
        missing = [a for a in (self.axis, *self.batch_axes, self.heads_axis) if a is not None and a not in self.mesh.shape]
        if missing:
            raise ValueError(f"all-to-all context attention: the mesh ({', '.join(self.mesh.axis_names)}) has no axis {', '.join(missing)}")

    @property
    def context_size(self) -> int:
        return self.mesh.shape[self.axis]

    @property
    def tiled(self) -> bool:
        return self.implementation in _TILED

    def tile_plan(self, seq_len: int) -> TilePlan:
        """The xla kernel's tiling of a whole sequence (one chunk: it is in its true order)."""
        return plan_tiles(seq_len, self.block_q, self.block_kv)

    def kernel_note(self, seq_len: int | None = None, heads: int | None = None, kv_heads: int | None = None) -> str:
        """One line for the run's log: the strategy, what each device attends, and its kernel."""
        n = self.context_size
        tensor = self.mesh.shape[self.heads_axis] if self.heads_axis else 1
        what = "the whole sequence" if seq_len is None else f"the whole {seq_len:,}-token sequence"
        if heads is not None:
            local = heads // tensor
            what += f" with {local // n} of {heads} query heads"
            if kv_heads is not None:
                local_kv = kv_heads // tensor
                r = kv_repeats(local, local_kv, n)
                what += f" and {local_kv * r // n} of {kv_heads} kv heads" + (f" (each repeated {r}x for the split)" if r > 1 else "")
        if self.tiled:
            if seq_len is None:
                tiles = f"tiles of up to {self.block_q}x{self.block_kv} tokens"
            else:
                plan = self.tile_plan(seq_len)
                tiles = f"tiles of {plan.tiles.q}x{plan.tiles.kv} tokens" + (f", padded to {plan.padded}" if plan.pad else "")
            kernel = f"kernel xla ({tiles}, fp32 scores, fully masked tiles skipped)"
        else:
            chosen = (
                "model.attention=auto picks it on these devices" if self.requested == "auto" else f"model.attention={self.implementation}"
            )
            kernel = f"kernel {self.implementation} ({chosen}; the sequence is put back in its true order first)"
        return f"context attention: all_to_all over context={n} (Ulysses: each device attends {what}), {kernel}"

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, positions: jax.Array) -> jax.Array:
        """q [B, T, H, D]; k, v [B, T, KV, D] (H a multiple of KV); segment_ids (None: one document
        per row), positions [B, T] int32. Returns [B, T, H, D] in q's dtype."""
        self._check_shapes(q, k, positions)
        dtype = q.dtype
        if self.heads_axis and k.shape[2] % self.mesh.shape[self.heads_axis]:
            # kv heads the heads axis cannot split: every query head gets its own copy first
            k, v = (jnp.repeat(x, q.shape[2] // k.shape[2], axis=2) for x in (k, v))
        if self.implementation == "xla_fp32":  # float16 on CPU: no f16 x f16 -> f32 dot there
            q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        packed = segment_ids is not None
        segment_ids = jnp.zeros(positions.shape, jnp.int32) if segment_ids is None else segment_ids
        batch = tuple(self.batch_axes) or None
        heads_spec = PartitionSpec(batch, self.axis, self.heads_axis, None)
        token_spec = PartitionSpec(batch, self.axis)
        run = jax.shard_map(
            lambda *a: self._local(*a, packed=packed),
            mesh=self.mesh,
            in_specs=(heads_spec, heads_spec, heads_spec, token_spec, token_spec),
            out_specs=heads_spec,
            axis_names=set(self.mesh.axis_names),  # manual over every axis, as parallel.context's kernel (same reason)
            check_vma=self.tiled,  # Pallas's and cuDNN's calls declare no varying mesh axes for their outputs
        )
        with jax.named_scope("context_attention"):
            out = run(q, k, v, segment_ids.astype(jnp.int32), positions.astype(jnp.int32))
        return out.astype(dtype)

    def _check_shapes(self, q, k, positions) -> None:
        b, t, h, _ = q.shape
        kv, n = k.shape[2], self.context_size
        tensor = self.mesh.shape[self.heads_axis] if self.heads_axis else 1
        batch_shards = math.prod(self.mesh.shape[a] for a in self.batch_axes)
        chunks = 2 * n if self.load_balanced else n
        problems = []
        if h % kv:
            problems.append(f"heads ({h}) must be a multiple of kv_heads ({kv})")
        if b % batch_shards:
            problems.append(f"batch ({b}) must be divisible by {' x '.join(self.batch_axes)} ({batch_shards})")
        if t % chunks:
            problems.append(f"sequence length ({t}) must be divisible by {chunks} chunks")
        if h % (tensor * n):
            problems.append(f"heads ({h}) must be divisible by {self.heads_axis or 'tensor'} x {self.axis} ({tensor} x {n})")
        if positions.shape != (b, t):
            problems.append(f"positions must be [batch, seq] = [{b}, {t}], got {list(positions.shape)}")
        if problems:
            raise ValueError("all-to-all context attention: " + "; ".join(problems))

    # -- per device --

    def _local(self, q, k, v, segment_ids, positions, *, packed: bool):
        n = self.context_size
        if self.tiled:
            # As in parallel.context: tied to q, the masks built from the ids stay inside the layer loop under grad.
            q, segment_ids, positions = jax.lax.optimization_barrier((q, segment_ids, positions))
        r = kv_repeats(q.shape[2], k.shape[2], n)
        if r > 1:
            k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
        q, k, v = heads_to_sequence([q, k, v], self.axis, n)
        # the tiles' mask reads segment ids and positions, an index-masked kernel the segment ids alone (when packed)
        ids = [segment_ids, positions] if self.tiled else [segment_ids] if packed else []
        if ids:
            ids = list(jax.lax.all_gather(jnp.stack(ids), self.axis, axis=2, tiled=True))  # one collective for both
        if self.load_balanced:
            q, k, v, *ids = (true_order(x, n) for x in (q, k, v, *ids))
        out = self._attend(q, k, v, *(ids or [None]))
        if self.load_balanced:
            out = shard_order(out, n)
        return sequence_to_heads(out, self.axis)

    def _attend(self, q, k, v, segment_ids, positions=None):
        """Whole-sequence causal attention (true order) of this device's heads."""
        if not self.tiled:
            # every mesh axis is manual here: the kernel runs per device, with no layout to shard it by
            with step_context.changed(layout=None):
                return causal_attention(q, k, v, segment_ids, implementation=self.implementation)
        plan = self.tile_plan(q.shape[1])
        pad = lambda x, value=0: pad_chunks(x, 1, plan.padded, value)  # noqa: E731
        seg = pad(segment_ids, -1)  # padding tokens see nothing and nobody sees them
        out = blockwise.attend(plan.tiles, pad(q), pad(k), pad(v), seg, pad(positions), seg, pad(positions))
        return unpad_chunks(out, 1, plan.chunk)
