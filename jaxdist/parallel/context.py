"""Attention for a sequence split over the mesh's ``context`` axis (context parallelism), and the
load-balanced token order it is fed in.

``ContextAttention`` replaces ``models.attention.causal_attention`` inside ``jit``, on global
arrays: a ``shard_map`` over the batch axes, ``context`` and the heads axis gives each device its
queries' share of the sequence, and one of two strategies brings it the keys:

- ``all_gather``: K/V (at kv_heads, never expanded to the query heads), segment ids and positions
  are gathered over ``context``; the local queries attend to the whole sequence. Its backward is
  autodiff's: the gather's transpose reduce-scatters dK/dV to their owners.
- ``ring``: K/V travel around the ring by ``ppermute`` (``parallel.ring``), merged by an online
  softmax, with an explicit backward.

The third strategy, ``all_to_all`` (Ulysses: heads scattered, the sequence gathered), is
``parallel.ulysses.UlyssesAttention``; ``with_context_attention`` picks either kernel.

Either way the per-block kernel is ``parallel.blockwise`` (XLA, fp32 scores, tiles where nothing is
visible skipped; a chunk no good tile length divides is padded with masked tokens). The mask comes
from positions and segment ids only, so the sequence may be in any order; a negative segment id marks
padding (sees nothing, seen by nothing, output 0).

Load balancing: under a causal mask the device holding the sequence's end does the most work. The
sequence is cut in 2N chunks and device r holds chunks r and 2N-1-r (``load_balance_order``),
applied once to the token arrays in the input pipeline (``reorder``) and undone with
``restore_order``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxdist.config import Config
from jaxdist.inspect.collectives import collective_ops
from jaxdist.inspect.hlo import NAME_RE, computation_multipliers, parse_hlo
from jaxdist.layout.mesh import BATCH_AXES
from jaxdist.models.attention import IMPLEMENTATIONS
from jaxdist.parallel import blockwise
from jaxdist.parallel.blockwise import BLOCK_SCOPE, TilePlan, pad_chunks, plan_tiles, unpad_chunks
from jaxdist.parallel.ring import Ring, ring_attention, ring_forward
from jaxdist.parallel.ulysses import UlyssesAttention

CONTEXT_AXIS = "context"
log = logging.getLogger(__name__)
STRATEGIES = ("all_gather", "ring")
DEFAULT_TILE = 512  # tokens per query / key tile of the per-block kernel: bounds its fp32 scores
_KERNEL_IMPLEMENTATIONS = (*IMPLEMENTATIONS, "xla_fp32")


# -- the load-balanced order ---------------------------------------------------------------------


def load_balance_order(seq_len: int, n: int) -> np.ndarray:
    """int32 [seq_len] permutation: the reordered sequence's token i is the original token order[i].
    The sequence is cut in 2n equal chunks; device r (the r-th of n equal shards of the reordered
    sequence) holds chunks r and 2n-1-r."""
    if n < 1 or seq_len < 1 or seq_len % (2 * n):
        raise ValueError(f"sequence length {seq_len} must be divisible by 2 x context = {2 * n} chunks for load balancing")
    chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * n, seq_len // (2 * n))
    return chunks[[c for r in range(n) for c in (r, 2 * n - 1 - r)]].reshape(-1)


def _take(x, index: np.ndarray, axis: int):
    return np.take(x, index, axis=axis) if isinstance(x, np.ndarray) else jnp.take(x, jnp.asarray(index), axis=axis)


def reorder(x, n: int, axis: int = 1):
    """``x`` in the load-balanced order along ``axis`` (numpy in, numpy out; jax arrays too)."""
    return _take(x, load_balance_order(x.shape[axis], n), axis)


def restore_order(x, n: int, axis: int = 1):
    """The inverse of ``reorder``."""
    return _take(x, np.argsort(load_balance_order(x.shape[axis], n)).astype(np.int32), axis)


# -- attention -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ContextAttention:
    """Causal attention within documents for a sequence split over the mesh's ``context`` axis;
    called by the model in place of ``models.attention.causal_attention``, inside jit, on global
    arrays."""

    mesh: jax.sharding.Mesh
    strategy: str  # all_gather | ring
    implementation: str = "xla"  # the model's choice; the per-block kernel is XLA's (kernel_note says why)
    batch_axes: tuple[str, ...] = ("data", "fsdp")  # mesh axes that split the batch
    heads_axis: str | None = "tensor"  # mesh axis splitting q heads (None: replicated)
    kv_heads_axis: str | None = "tensor"  # the same axis, or None when kv_heads is not divisible by it
    block_q: int = DEFAULT_TILE  # tile lengths of the per-block kernel (at most; chunks are padded to a multiple)
    block_kv: int = DEFAULT_TILE
    requested: str | None = None  # model.attention as the user set it (auto: the note names what auto picked)

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"context attention strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.implementation not in _KERNEL_IMPLEMENTATIONS:
            raise ValueError(f"attention implementation must be one of {', '.join(_KERNEL_IMPLEMENTATIONS)}, got {self.implementation!r}")
        if self.kv_heads_axis is not None and self.kv_heads_axis != self.heads_axis:
            raise ValueError(f"kv_heads_axis must be heads_axis ({self.heads_axis!r}) or None, got {self.kv_heads_axis!r}")
        missing = [a for a in (CONTEXT_AXIS, *self.batch_axes, self.heads_axis) if a is not None and a not in self.mesh.shape]
        if missing:
            raise ValueError(f"context attention: the mesh ({', '.join(self.mesh.axis_names)}) has no axis {', '.join(missing)}")

    @property
    def context_size(self) -> int:
        return self.mesh.shape[CONTEXT_AXIS]

    def kernel_note(self, seq_len: int | None = None) -> str:
        """One line for the run's log: the strategy, the context size and the per-block kernel, with
        the tiles a sequence of ``seq_len`` tokens gets (None: only their limits)."""
        if seq_len is None:
            tiles = f"tiles of up to {self.block_q}x{self.block_kv} tokens"
        else:
            plan = self.tile_plan(seq_len // self.context_size)
            tiles = f"tiles of {plan.tiles.q}x{plan.tiles.kv} tokens"
            if plan.pad:
                tiles += f", each {plan.chunk}-token chunk padded to {plan.padded} with masked tokens"
        note = (
            f"context attention: {self.strategy} over context={self.context_size}, per-block kernel xla "
            f"({tiles}, fp32 scores, fully masked tiles skipped)"
        )
        if self.implementation not in ("xla", "xla_fp32"):
            asked = (
                f"the {self.implementation} attention model.attention=auto picks on these devices"
                if self.requested == "auto"
                else f"model.attention={self.implementation}"
            )
            note += (
                f"; {asked} is not used here: cuDNN's and Pallas's masks follow array indices,"
                " while a split (load-balanced) sequence needs the mask from positions and segment ids"
            )
        return note

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, positions: jax.Array) -> jax.Array:
        """q [B, T, H, D]; k, v [B, T, KV, D] (H a multiple of KV); segment_ids (None: one document
        per row), positions [B, T] int32. Visible iff segment_q == segment_kv >= 0 and position_q >=
        position_kv. Returns [B, T, H, D] in q's dtype."""
        return self._run(q, k, v, segment_ids, positions, count=False)

    def tile_pairs_computed(self, q, k, v, segment_ids, positions) -> np.ndarray:
        """How many (query tile, key tile) pairs each device's forward computes (the rest are
        skipped as fully masked): int32 [batch shards, context]."""
        return np.asarray(jax.jit(lambda *a: self._run(*a, count=True))(q, k, v, segment_ids, positions))

    # -- internals --

    def _run(self, q, k, v, segment_ids, positions, *, count: bool):
        self._check_shapes(q, k, positions)
        dtype = q.dtype
        if self.implementation == "xla_fp32":  # float16 on CPU: no f16 x f16 -> f32 dot there
            q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        if segment_ids is None:
            segment_ids = jnp.zeros(positions.shape, jnp.int32)
        batch = tuple(self.batch_axes) or None
        q_spec = PartitionSpec(batch, CONTEXT_AXIS, self.heads_axis, None)
        kv_spec = PartitionSpec(batch, CONTEXT_AXIS, self.kv_heads_axis, None)
        token_spec = PartitionSpec(batch, CONTEXT_AXIS)
        # Manual over every mesh axis (those the specs leave out are replicated): with a partial-manual shard_map the
        # transpose of a bf16 all_gather is a reduce-scatter whose reducer XLA:CPU's all-reduce promotion aborts on.
        axes = set(self.mesh.axis_names)
        run = jax.shard_map(
            lambda *a: self._local(*a, count=count),
            mesh=self.mesh,
            in_specs=(q_spec, kv_spec, kv_spec, token_spec, token_spec),
            out_specs=token_spec if count else q_spec,
            axis_names=axes,
        )
        with jax.named_scope("context_attention"):
            out = run(q, k, v, segment_ids.astype(jnp.int32), positions.astype(jnp.int32))
        return out if count else out.astype(dtype)

    def _check_shapes(self, q, k, positions) -> None:
        b, t, h, _ = q.shape
        kv = k.shape[2]
        sizes = self.mesh.shape
        batch_shards = math.prod(sizes[a] for a in self.batch_axes)
        problems = []
        if h % kv:
            problems.append(f"heads ({h}) must be a multiple of kv_heads ({kv})")
        if b % batch_shards:
            problems.append(f"batch ({b}) must be divisible by {' x '.join(self.batch_axes)} ({batch_shards})")
        if t % self.context_size:
            problems.append(f"sequence length ({t}) must be divisible by context ({self.context_size})")
        if self.heads_axis and h % sizes[self.heads_axis]:
            problems.append(f"heads ({h}) must be divisible by {self.heads_axis} ({sizes[self.heads_axis]})")
        if self.kv_heads_axis and kv % sizes[self.kv_heads_axis]:
            problems.append(
                f"kv_heads ({kv}) must be divisible by {self.kv_heads_axis} ({sizes[self.kv_heads_axis]}); pass kv_heads_axis=None"
            )
        if positions.shape != (b, t):
            problems.append(f"positions must be [batch, seq] = [{b}, {t}], got {list(positions.shape)}")
        if problems:
            raise ValueError("context attention: " + "; ".join(problems))

    def tile_plan(self, local_len: int) -> TilePlan:
        """The tiling of a device's ``local_len`` tokens: two chunks (the load-balanced order's) when
        the length is even, each padded to a multiple of the tiles (``blockwise.plan_tiles``)."""
        chunk = local_len // 2 if local_len % 2 == 0 else local_len
        return plan_tiles(chunk, self.block_q, self.block_kv)

    def _local_kv_heads(self, local_heads: int, k, v):
        """The kv heads this device's query heads read, in the standard grouping (local q head i
        reads local kv head i // (local_heads / local kv heads)). Only needed when q heads are split
        over an axis that kv heads are not: then each device takes its share before any transfer."""
        if self.heads_axis is None or self.kv_heads_axis == self.heads_axis:
            return k, v
        group = local_heads * self.mesh.shape[self.heads_axis] // k.shape[2]  # q heads per kv head
        first = jax.lax.axis_index(self.heads_axis) * local_heads
        index = (first + jnp.arange(local_heads)) // group
        if group % local_heads == 0:  # all local q heads read one kv head
            index = index[:1]
        elif local_heads % group == 0:  # whole groups
            index = index[::group]
        return jnp.take(k, index, axis=2), jnp.take(v, index, axis=2)

    def _local(self, q, k, v, segment_ids, positions, *, count: bool):
        if not count:
            # Segment ids and positions are the same in every layer: under grad JAX hoists the masks built from them
            # out of the model's layer scan, one [tile, tile] mask per tile pair at once ([T/c, T] per device). Tying
            # them to q keeps the masks inside the loop.
            q, segment_ids, positions = jax.lax.optimization_barrier((q, segment_ids, positions))
        k, v = self._local_kv_heads(q.shape[2], k, v)
        plan = self.tile_plan(q.shape[1])
        chunks = q.shape[1] // plan.chunk

        # Chunks no good tile length divides are padded with masked tokens (segment id -1: they see nothing
        # and nobody sees them), outside the custom VJPs: autodiff slices their gradients off.
        def padded(x, segments: bool = False, n: int = chunks):
            return pad_chunks(x, n, plan.padded, -1 if segments else 0)

        q_local, seg_q, pos_q = padded(q), padded(segment_ids, True), padded(positions)
        if self.strategy == "ring":
            ring = Ring(CONTEXT_AXIS, self.context_size, plan.tiles)
            args = (q_local, padded(k), padded(v), seg_q, pos_q)
            if count:
                computed = ring_forward(ring, *args)[2].reshape(1, 1)
                # the ring's step boundaries tie each block to the (head-split) state: the count, equal over the heads
                # axis, comes out varying over it too
                return jax.lax.pmax(computed, self.heads_axis) if self.heads_axis else computed
            return unpad_chunks(ring_attention(ring, *args), chunks, plan.chunk)
        # gathered unpadded (no padding on the wire), then each of the whole sequence's chunks padded
        n = chunks * self.context_size
        k_all, v_all, seg_k, pos_k = (jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True) for x in (k, v, segment_ids, positions))
        keys = (padded(k_all, n=n), padded(v_all, n=n), padded(seg_k, True, n), padded(pos_k, n=n))
        if count:
            return blockwise.attention_forward(plan.tiles, q_local, *keys[:2], seg_q, pos_q, *keys[2:])[2].reshape(1, 1)
        return unpad_chunks(blockwise.attend(plan.tiles, q_local, *keys[:2], seg_q, pos_q, *keys[2:]), chunks, plan.chunk)


# -- the compiled program ------------------------------------------------------------------------

_COMPUTE_OPCODES = ("fusion", "dot", "convolution", "custom-call", "while", "conditional", "call")
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
_IS_SYNC_RE = re.compile(r'"is_sync":true')


def ring_overlap_in_hlo(hlo_text: str, mesh_shape: dict[str, int] | None = None) -> dict[str, int | None]:
    """Whether the ring's transfers can overlap its attention blocks, from a compiled program's
    (scheduled) HLO text: for each asynchronous ``collective-permute-start`` / ``-done`` pair, is
    some attention-block compute (an op whose metadata names the per-block kernel's scope)
    scheduled between them? Returns, all in executions per step (loop trip counts included),
    ``collective_permutes``, ``over_context`` (those whose groups span only ``context``; None
    without ``mesh_shape``), ``async_pairs``, ``overlapped_pairs`` and ``synchronous`` (permutes
    with no start/done split, or a start XLA marked ``is_sync``: it found nothing to overlap and
    runs it in line)."""
    module = parse_hlo(hlo_text)
    ops = [op for op in collective_ops(module, mesh_shape) if op.kind == "collective-permute"]
    times = computation_multipliers(module)
    pairs = overlapped = synchronous = 0
    for computation, body in module.computations.items():
        n = times.get(computation, 0)
        done_at = {}
        for index, instruction in enumerate(body):
            if instruction.opcode == "collective-permute-done" and instruction.operands:
                name = NAME_RE.match(instruction.operands[0].split()[-1])
                if name:
                    done_at[name.group(1)] = index
        for index, instruction in enumerate(body):
            if instruction.opcode == "collective-permute" or (
                instruction.opcode == "collective-permute-start" and _IS_SYNC_RE.search(instruction.attributes)
            ):
                synchronous += n
            elif instruction.opcode == "collective-permute-start" and instruction.name in done_at:
                pairs += n
                between = body[index + 1 : done_at[instruction.name]]
                overlapped += n * any(
                    i.opcode in _COMPUTE_OPCODES and BLOCK_SCOPE in " ".join(_OP_NAME_RE.findall(i.attributes)) for i in between
                )
    over_context = None if mesh_shape is None else sum(op.executions for op in ops if op.axes == (CONTEXT_AXIS,))
    return {
        "collective_permutes": sum(op.executions for op in ops),
        "over_context": over_context,
        "async_pairs": pairs,
        "overlapped_pairs": overlapped,
        "synchronous": synchronous,
    }


# -- the task ----------------------------------------------------------------------------------


def with_context_attention(task, config: Config, mesh: jax.sharding.Mesh):
    """The task with its attention split over ``context``: the sequence of every token array is
    sharded over it (the layout's rules and ``data.loader.split_sequences``: positions carried,
    load-balanced order) and each step installs the strategy's kernel (``ContextAttention``, or
    ``UlyssesAttention`` for all_to_all) in place of the model's attention
    (``layout.step_context``); the rest of the decoder is per token and needs nothing."""
    p, m = config.parallel, config.model
    heads_axis = "tensor" if mesh.shape["tensor"] > 1 else None  # validate: heads and kv heads divide over tensor
    common = dict(mesh=mesh, implementation=task.attention or "xla", requested=m.attention, batch_axes=BATCH_AXES, heads_axis=heads_axis)
    if p.context_strategy == "all_to_all":  # validate: the heads divide over tensor x context
        kernel = UlyssesAttention(**common, load_balanced=p.context_load_balance, block_q=DEFAULT_TILE, block_kv=DEFAULT_TILE)
        note = kernel.kernel_note(config.train.seq_len, m.n_heads, m.n_kv_heads)
    else:
        kernel = ContextAttention(**common, strategy=p.context_strategy, kv_heads_axis=heads_axis)
        note = kernel.kernel_note(config.train.seq_len)
    inner_spec = task.batch_spec

    def batch_spec(global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
        spec = dict(inner_spec(global_batch))
        spec.setdefault("positions", jax.ShapeDtypeStruct(spec["inputs"].shape, "int32"))  # the loader always carries them
        return spec

    order = "load-balanced (shard r holds chunks r and 2N-1-r)" if p.context_load_balance else "in order (no load balancing)"
    log.info(f"{note}; sequence {order}")
    return dataclasses.replace(task, sequence_kernel=kernel, batch_spec=batch_spec)
