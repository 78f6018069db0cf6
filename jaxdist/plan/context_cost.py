"""The planner's screen for a context axis: what each ``parallel.context_strategy`` moves over
``context``, what its attention kernel keeps in memory, and the attention scores it moves through
memory (``plan.search`` adds these to its rough time and memory; the compiled programs are priced
by ``plan.cost``).

- ``all_gather``: K/V (and the ids) gathered whole for every layer, on the critical path; the
  whole sequence's K/V held per layer; parallel.blockwise's XLA tiles (scores through memory).
- ``ring``: the same K/V passed around the ring twice plus fp32 dK/dV, hidden behind up to
  ``hardware.overlap`` of the attention it feeds; the XLA tiles.
- ``all_to_all`` (Ulysses): q, k, v and the output exchanged for heads, twice forward and twice
  backward, on the critical path (attention waits for them); each device attends the whole sequence
  with 1/N of the heads, so with a flash kernel (cuDNN on GPUs) no score reaches memory and the
  working set is the kernel's; with XLA, tiles of the whole sequence on fewer heads.
"""

from __future__ import annotations

from jaxdist.config import Config
from jaxdist.parallel.ulysses import kv_repeats

CONTEXT_STRATEGIES = ("all_gather", "ring", "all_to_all")
KERNEL_TILE = 512  # tokens per tile of the context kernel (parallel.context's DEFAULT_TILE): bounds its fp32 scores
# fp32 bytes each visible attention score moves through memory where no flash kernel keeps the
# scores on chip (scores and probabilities written and read; the backward also their gradients)
SCORE_BYTES_FORWARD, SCORE_BYTES_BACKWARD = 16, 32


def compute_bytes(config: Config) -> int:
    return 4 if config.model.dtype == "float32" else 2


def flash_kernel(candidate, fused_attention: bool) -> bool:
    """Whether attention keeps its scores on chip: a fused kernel on the whole sequence (no context
    axis, or all_to_all, whose devices each hold whole sequences); the other strategies' blocks run
    parallel.blockwise's XLA tiles on any hardware."""
    return fused_attention and (candidate.sizes["context"] == 1 or candidate.context_strategy == "all_to_all")


def attention_memory(config: Config, candidate, fused_attention: bool) -> tuple[float, float]:
    """(bytes per layer and row that a context strategy adds to the kept activations, the kernel's
    working set per row for one layer at a time), for a context axis (0, 0 without one)."""
    m, t, sizes = config.model, config.train, candidate.sizes
    context, tp = sizes["context"], sizes["tensor"]
    if context == 1:
        return 0.0, 0.0
    heads, kv_heads = max(m.n_heads // tp, 1), max(m.n_kv_heads // tp, 1)
    if candidate.context_strategy == "all_to_all":  # the whole sequence, 1/context of the heads
        if flash_kernel(candidate, fused_attention):
            return 0.0, 0.0
        tile = min(KERNEL_TILE, t.seq_len)
        return 0.0, 3 * 4 * max(heads // context, 1) * tile * tile
    tile = min(KERNEL_TILE, t.seq_len // context)
    working = 3 * 4 * heads * tile * tile  # fp32 scores, probabilities and their gradient for one pair of tiles
    if candidate.context_strategy == "all_gather":  # the gathered K and V
        return 2 * t.seq_len * kv_heads * m.resolved_head_dim * compute_bytes(config), working
    return 0.0, working


def context_traffic(config: Config, candidate) -> tuple[float, int]:
    """(bytes one device sends over the context axis per step, collectives per step) for attention,
    as jaxdist's compiled program moves them (checked against it in tests/test_plan.py and
    tests/test_ulysses.py). Per layer and row, with K/V the whole sequence's keys and values and ids
    its segment ids and positions:

    - all_gather: each forward (the recomputed one too, under remat) gathers (N-1)/N of K/V and
      ids; the backward reduce-scatters (N-1)/N of dK/dV (in the compute dtype).
    - ring: K/V and ids travel N-1 shifts forward and again backward (XLA merges the backward's
      with a recomputed forward's), (N-1)/N of them each time; dK/dV (fp32) travel N-1 shifts.
    - all_to_all: each forward sends (N-1)/N of the device's q, k, v (kv heads repeated as
      ``parallel.ulysses.kv_repeats`` says) in one all-to-all and of the output in another, and
      gathers (N-1)/N of the ids (XLA tiles' ids, in one collective); the backward sends the
      output's and q, k, v's gradients the same way (compute dtype).
    """
    sizes, m = candidate.sizes, config.model
    n = sizes["context"]
    if n <= 1:
        return 0.0, 0
    rows = config.train.global_batch // (sizes["data"] * sizes["fsdp"] * sizes["expert"])
    tokens = rows * config.train.seq_len
    kv_elements = 2 * tokens * max(m.n_kv_heads // sizes["tensor"], 1) * m.resolved_head_dim
    kv, ids, share = kv_elements * compute_bytes(config), 2 * 4 * tokens, (n - 1) / n
    layers, mb = m.n_layers // sizes["pipe"], candidate.microbatches
    forwards = 1 + (candidate.remat != "none")
    if candidate.context_strategy == "all_gather":
        return layers * (forwards * share * (kv + ids) + share * kv), layers * mb * (4 * forwards + 2)
    if candidate.context_strategy == "all_to_all":
        heads, kv_heads = m.n_heads // sizes["tensor"], m.n_kv_heads // sizes["tensor"]
        width = 2 * heads + 2 * kv_heads * kv_repeats(heads, kv_heads, n)  # q, out, k, v per token, in heads
        exchanged = tokens / n * width * m.resolved_head_dim * compute_bytes(config)
        return layers * share * ((forwards + 1) * exchanged + forwards * ids), layers * mb * (3 * forwards + 2)
    return layers * (2 * share * (kv + ids) + share * 4 * kv_elements), layers * mb * (2 * 4 * (n - 1) + 2 * (n - 1))


def score_traffic(config: Config, candidate, fused_attention: bool) -> float:
    """Bytes per device per step of attention scores through memory: none with a flash kernel
    (``flash_kernel``); XLA's full scores without one and without a context axis; with a context
    axis, the tiled XLA kernel, which skips the masked half of them on any hardware."""
    sizes, m, t = candidate.sizes, config.model, config.train
    context = sizes["context"]
    if flash_kernel(candidate, fused_attention):
        return 0.0
    rows = t.global_batch // (sizes["data"] * sizes["fsdp"] * sizes["expert"])
    scores = rows * (m.n_layers // sizes["pipe"]) * max(m.n_heads // sizes["tensor"], 1) * (t.seq_len // context) * t.seq_len
    visible = 0.5 if context > 1 else 1.0
    passes = SCORE_BYTES_FORWARD * (1 + (candidate.remat != "none")) + SCORE_BYTES_BACKWARD
    return scores * visible * passes


def exposed_context_time(config: Config, candidate, hardware, attention_s: float) -> float:
    """Seconds per step the context traffic adds (inside a node): all_gather's gathers and
    all_to_all's exchanges are on the critical path, a ring's permutes hide behind up to
    ``hardware.overlap`` of the attention they feed (``attention_s``)."""
    wire, count = context_traffic(config, candidate)
    link, n = hardware.intra_node, candidate.sizes["context"]
    steps = 1 if candidate.context_strategy == "ring" else n - 1  # ring steps per collective (a permute: 1)
    seconds = wire / (link.bandwidth * link.efficiency) + count * steps * link.latency
    return max(0.0, seconds - hardware.overlap * attention_s) if candidate.context_strategy == "ring" else seconds
