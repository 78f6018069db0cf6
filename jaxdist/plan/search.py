"""The planner's search: enumerate layouts, screen them, compile the promising ones.

Candidates are every (data, fsdp, expert, context, tensor, pipe) mesh whose product is the GPU
count, with ``expert``, ``context`` and ``tensor`` inside a node (``expert`` > 1 only for an MoE
model, dividing its experts), every microbatch count and remat policy (and,
with a context axis, each of the three context strategies) that ``jaxdist.layout.validate.check_config_on_mesh``
accepts (a context axis needs the sequence divisible by 2 x context). Each is screened without
compiling: model states (16 bytes per parameter, sharded as the mesh shards them: fsdp, context,
tensor, pipe, and the experts' weights over expert too) plus activations (Korthikanti et al.
2022's per-layer counts, for the device's share of the sequence, plus an MoE layer's dispatched
rows) must fit the device, and a rough time (6 x active params x tokens plus causal attention,
remat's recompute, the pipeline's executed chunk steps (its bubble) and 1F1B's recompute or kept activations, the traffic of a context
axis (``plan.context_cost``), the experts' all-to-alls) orders them. Then they are compiled best-first until the time budget runs out: for a
GPU (``GpuTarget``) by XLA:GPU for compile-only devices of the target (``plan.gpu_target``), for
``cpu-local`` against fake CPU devices; each compile is cached on disk (``~/.cache/jaxdist/plan``),
keyed by the resolved config, the JAX version and the target, so a rerun is fast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from jaxdist.config import Config
from jaxdist.errors import JaxdistError
from jaxdist.inspect.hlo import parse_hlo
from jaxdist.inspect.step_report import device_peak, memory, pipeline_of
from jaxdist.layout.mesh import parse_mesh
from jaxdist.models.experts import capacity_rows
from jaxdist.parallel.expert import buffer_rows
from jaxdist.parallel.pipeline_schedule import executed_over_ideal
from jaxdist.plan.candidates import (  # noqa: F401 - the planner's names for them, imported from here
    LAYOUT_AXES,
    OFFLOAD_REMATS,
    OPTIMIZER_OFFLOAD_REMATS,
    PIPELINE_SCHEDULES,
    REMATS,
    Candidate,
    candidate_pipeline,
    configured,
    divisors,
    enumerate_candidates,
    schedule_settings,
)
from jaxdist.plan.compile_cache import cache_dir, program_source
from jaxdist.plan.context_cost import (  # noqa: F401 - CONTEXT_STRATEGIES, context_traffic: the planner's names for them
    CONTEXT_STRATEGIES,
    attention_memory,
    compute_bytes,
    context_traffic,
    exposed_context_time,
    score_traffic,
)
from jaxdist.plan.gpu_cost import gpu_program_cost, schedule_kernel_counts
from jaxdist.plan.gpu_target import compile_for_target, compiler_options, target_config_text
from jaxdist.plan.hardware import Hardware
from jaxdist.plan.hlo_cost import program_cost
from jaxdist.training.aot import compile_train_step

RECOMPUTE = {"none": 1.0, "save_matmuls": 1.1, "full": 4 / 3, "offload_layer_inputs": 4 / 3}  # training FLOPs with remat / without
STATE_BYTES_PER_PARAM = 16  # fp32 params, grads, Adam's two moments
OPTIMIZER_BYTES_PER_PARAM = 8  # Adam's two fp32 moments: what train.optimizer_offload keeps on host
HEADROOM = 0.9  # plan to use at most this share of device memory

log = logging.getLogger(__name__)
# A GPU plan's screen keeps a layout whose estimate is within this factor of the memory JAX may
# allocate, and XLA:GPU's peak decides. XLA:GPU's peak / the estimate, llama3-8b on 8 H100: 0.92-0.97
# without remat, 1.12 with 2 microbatches, 0.92 with full remat, 0.62-0.74 with save_matmuls (the
# estimate keeps half of each layer; XLA:GPU's program keeps little more than with full remat)
PREFILTER_MARGIN = 1.6


# ---------------------------------------------------------------------------------------------
# Screening without compiling


def routed_expert_params(config: Config) -> int:
    """Parameters of the routed experts (every MoE layer's E SwiGLUs of width moe_mlp_dim)."""
    m = config.model
    if m.kind != "llama" or not m.moe_experts:
        return 0
    return (m.n_layers - m.moe_first_dense) * m.moe_experts * 3 * m.d_model * m.resolved_moe_mlp_dim


def states_bytes(candidate: Candidate, n_params: int, expert_params: int = 0) -> float:
    """Model states per device: sharded over fsdp, context (as FSDP shards them), tensor and pipe;
    the routed experts' ``expert_params`` (part of ``n_params``) over expert too."""
    return (STATE_BYTES_PER_PARAM - OPTIMIZER_BYTES_PER_PARAM * candidate.optimizer_offload) * params_per_device(
        candidate, n_params, expert_params
    )


def params_per_device(candidate: Candidate, n_params: int, expert_params: int = 0) -> float:
    """Parameters one device holds: split over fsdp, context, tensor and pipe; the routed
    experts' ``expert_params`` (part of ``n_params``) over expert too."""
    sizes = candidate.sizes
    split = sizes["fsdp"] * sizes["context"] * sizes["tensor"] * sizes["pipe"]
    return (n_params - expert_params) / split + expert_params / (split * sizes["expert"])


def estimated_memory(config: Config, candidate: Candidate, n_params: int, fused_attention: bool) -> float:
    """Bytes per device: model states sharded by fsdp x context x tensor x pipe, plus activations.

    Activations per layer and microbatch row (Korthikanti et al. 2022, 16-bit, tensor size
    t, no sequence parallelism) for the device's s = seq_len / context tokens: s d (10 + 24 / t)
    bytes, plus 5 h s^2 / t without a fused attention; an MoE layer adds its k dispatched rows per
    token, s k (8 d + 10 f / t) bytes (send, receive, return and the fp32 combine of d, the fp32
    gate/up and bf16 hidden of the expert width f). A context axis keeps no [s, s] scores: its
    kernel's working set and what its strategy keeps are ``context_cost.attention_memory``'s (a
    few fp32 tiles, the gathered K/V of all_gather, nothing more for all_to_all with a fused
    kernel). Full remat keeps only each layer's input (2 s d) plus one layer's working set;
    offload_layer_inputs keeps those inputs on host (two in flight on the device); save_matmuls
    about half. The fp32 logits (and their gradient) of one microbatch (one
    ``model.loss_chunk`` of it, when set) come on top.
    """
    m, t = config.model, config.train
    sizes = candidate.sizes
    rows = t.global_batch // (sizes["data"] * sizes["fsdp"] * sizes["expert"] * candidate.microbatches)
    context, tp = sizes["context"], sizes["tensor"]
    s, d = t.seq_len // context, m.d_model
    per_layer = s * d * (10 + 24 / tp)
    if routed_expert_params(config):
        moe_share = (m.n_layers - m.moe_first_dense) / m.n_layers  # spread over the layers: the screen keeps one per-layer figure
        per_layer += moe_share * s * m.moe_top_k * (8 * d + 10 * m.resolved_moe_mlp_dim / tp)
    strategy_kept, working = attention_memory(config, candidate, fused_attention)  # working: the kernel's, one layer at a time
    per_layer += strategy_kept
    if context == 1 and not fused_attention:
        per_layer += 5 * m.n_heads * s * s / tp
    layers = m.n_layers // sizes["pipe"]
    kept = {
        "none": per_layer * layers,
        "save_matmuls": per_layer * layers / 2,
        "full": 2 * s * d * layers + per_layer,
        "offload_layer_inputs": 2 * 2 * s * d + per_layer,  # the layer inputs on host; two in flight
    }[candidate.remat]
    spec = candidate_pipeline(config, candidate)
    activations, head_rows, head_tokens = rows * kept, rows, s
    if spec is not None:  # rows / M per pipeline microbatch; the head runs on 1/S of each sequence per stage
        activations = rows / spec.microbatches * kept * spec.activations_alive()
        if spec.schedule == "1f1b" and spec.recompute:  # the ring of stage inputs the backward recomputes from
            activations += rows / spec.microbatches * spec.ring_slots / spec.virtual * s * d * compute_bytes(config)
        explicit = spec.schedule in ("1f1b", "zb1", "zbv")  # one microbatch's head at a time
        head_rows = rows / spec.microbatches if explicit else rows
        head_tokens = s // spec.stages
    logit_tokens = min(head_tokens, m.loss_chunk) if m.loss_chunk > 0 else head_tokens
    logits = 2 * 4 * logit_tokens * m.vocab_size / tp
    return states_bytes(candidate, n_params, routed_expert_params(config)) + activations + head_rows * logits + rows * working


def attention_flops_per_sequence(config: Config) -> float:
    """Training FLOPs of causal attention for one sequence: forward QK^T and PV (4 s^2 h hd per
    layer), half of it masked, times 3 for the backward."""
    m, s = config.model, config.train.seq_len
    return 6.0 * m.n_layers * s * s * m.n_heads * m.resolved_head_dim


def expert_traffic(config: Config, candidate: Candidate) -> tuple[float, int]:
    """(bytes one device sends over the expert axis per step, all-to-alls per step) for the
    experts, as parallel.expert's compiled program moves them (checked against it in
    tests/test_moe_plan.py): per MoE layer and microbatch, its send buffer (R rows per
    destination, ``parallel.expert.buffer_rows``, x d in the compute dtype) goes out and comes
    back in the forward, again in the backward and in remat's recomputed forward, with one
    int32 id per row each forward; a device keeps (1/N) of each buffer."""
    sizes, m, t = candidate.sizes, config.model, config.train
    n = sizes["expert"]
    if n <= 1 or not routed_expert_params(config):
        return 0.0, 0
    mb = candidate.microbatches
    tokens = t.global_batch // (sizes["data"] * sizes["fsdp"] * n * mb) * (t.seq_len // sizes["context"])
    capacity = capacity_rows(tokens, m.moe_top_k, m.moe_experts, m.moe_capacity_factor)
    rows = n * buffer_rows(tokens, m.moe_top_k, m.moe_experts, n, capacity, config.parallel.expert_buffer_factor)
    forwards = 1 + (candidate.remat != "none")
    calls = (m.n_layers - m.moe_first_dense) // sizes["pipe"] * mb
    per_call = (2 * forwards + 2) * rows * m.d_model * compute_bytes(config) + forwards * rows * 4
    return calls * per_call * (n - 1) / n, calls * (2 * forwards + 2 + forwards)


def fsdp_traffic(config: Config, candidate: Candidate, n_params: int, gpu: bool) -> float:
    """Bytes one device sends over the fsdp axis per step for FSDP's weights, roughly: each
    microbatch gathers its (N-1)/N of the weights it holds a shard of in the forward and again in
    the backward (in bf16 on a GPU, f32 on XLA:CPU), and reduce-scatters the f32 gradients. An
    MoE model's routed experts are split over expert too, so each device gathers only its own."""
    sizes = candidate.sizes
    n = sizes["fsdp"] * sizes["context"]
    if n <= 1:
        return 0.0
    routed = routed_expert_params(config)
    held = (n_params - routed + routed / sizes["expert"]) / (sizes["tensor"] * sizes["pipe"])
    per_microbatch = held * (2 * (2 if gpu else 4) + 4)
    return candidate.microbatches * per_microbatch * (n - 1) / n


def buffer_padding(config: Config, mesh_shape: dict[str, int]) -> float:
    """Rows an MoE layer's experts receive per device (parallel.expert's static buffer: expert x R)
    over the rows routed to them (tokens x k): 1 without an expert axis or with
    ``parallel.expert_buffer_factor=1``; up to expert x min(k, E / expert) / k with the worst case."""
    m, t = config.model, config.train
    ep = mesh_shape.get("expert", 1)
    if m.kind != "llama" or not m.moe_experts or ep <= 1:
        return 1.0
    shards = math.prod(mesh_shape.get(a, 1) for a in ("replica", "data", "fsdp", "expert", "context"))
    tokens = t.global_batch * t.seq_len // (shards * max(t.microbatches, 1))
    capacity = capacity_rows(tokens, m.moe_top_k, m.moe_experts, m.moe_capacity_factor)
    rows = ep * buffer_rows(tokens, m.moe_top_k, m.moe_experts, ep, capacity, config.parallel.expert_buffer_factor)
    return rows / (tokens * m.moe_top_k)


def estimated_time(config: Config, candidate: Candidate, n_params: int, hardware) -> float:
    """Seconds per step, roughly: compute (matmuls, an MoE layer's active experts only (on
    cpu-local once per local expert, as XLA:CPU's dense ragged_dot runs them), and causal
    attention, plus the attention scores' memory traffic where no flash kernel keeps them on
    chip) with remat's recompute, stretched by the bubble, plus the exposed traffic of a context
    axis (``context_cost.exposed_context_time``: all_gather's gathers and all_to_all's exchanges on
    the critical path; ring's hides behind the attention it feeds, up to ``hardware.overlap`` of
    it), the experts' all-to-alls (critical) and what
    compute cannot hide of FSDP's weight gathers (``fsdp_traffic``: they grow with the
    microbatches and, for an MoE model, with its total, not its active, parameters)."""
    t, sizes = config.train, candidate.sizes
    devices = math.prod(sizes.values())
    rate = hardware.matmul_flops_per_s
    attention = attention_flops_per_sequence(config) * t.global_batch / devices / rate * RECOMPUTE[candidate.remat]
    if sizes["context"] > 1 and not config.parallel.context_load_balance and candidate.context_strategy != "all_to_all":
        attention *= (2 * sizes["context"] - 1) / sizes["context"]  # the last shard's causal share: (2N-1)/N of the mean
    attention += score_traffic(config, candidate, hardware.fused_attention) / (hardware.memory_bandwidth * hardware.memory_efficiency)
    routed, m = routed_expert_params(config), config.model
    active_experts = routed * m.moe_top_k / m.moe_experts if routed else 0
    expansion = m.moe_experts // sizes["expert"] if routed and hardware.shared_host else 1  # XLA:CPU's dense ragged_dot
    flop_params = n_params - routed + active_experts * expansion
    compute = 6 * flop_params * t.global_batch * t.seq_len / devices / rate * RECOMPUTE[candidate.remat] + attention
    spec = candidate_pipeline(config, candidate)
    if spec is not None:  # every device executes the schedule's masked chunk steps too; 1F1B's recompute runs the forward twice
        compute *= executed_over_ideal(spec, 1.0)
    comm_penalty = 1 + 0.05 * (sizes["tensor"] > 1) + 0.02 * math.log2(sizes["tensor"])
    kv = exposed_context_time(config, candidate, hardware, attention)  # context stays inside a node
    link = hardware.intra_node
    wire, count = expert_traffic(config, candidate)  # on the critical path, inside a node
    experts = wire / (link.bandwidth * link.efficiency) + count * (sizes["expert"] - 1) * link.latency
    nodes = max(1, devices // hardware.gpus_per_node)
    fsdp_link = hardware.inter_node if nodes > sizes["data"] else hardware.intra_node  # data crosses nodes first, then fsdp
    gather = fsdp_traffic(config, candidate, n_params, not hardware.shared_host) / (fsdp_link.bandwidth * fsdp_link.efficiency)
    gather = max(0.0, gather - hardware.overlap * compute)  # the layer loop's gathers hide behind its compute
    host = 0.0
    if candidate.optimizer_offload and hardware.host_link is not None:  # the state in and out, behind the backward
        moved = 2 * OPTIMIZER_BYTES_PER_PARAM * params_per_device(candidate, n_params, routed)
        host = moved / (hardware.host_link.bandwidth * hardware.host_link.efficiency)
    return compute * comm_penalty + kv + experts + gather + host


# ---------------------------------------------------------------------------------------------
# Compiling (cached)


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """What a GPU plan compiles for: ``gpus`` compile-only devices of ``hardware``, ``gpus_per_node`` per host."""

    hardware: Hardware
    gpus: int
    gpus_per_node: int

    def describe(self, config: Config) -> dict[str, Any]:
        """What the compiled program depends on besides the config (the compile cache's key)."""
        options = {name: str(value) for name, value in sorted(compiler_options(config).items())}
        return {"target": target_config_text(self.hardware), "gpus": self.gpus, "per_node": self.gpus_per_node, "options": options}


def cache_key(config: Config, target: GpuTarget | None = None) -> str:
    payload = {"config": config.to_dict(), "jax": jax.__version__, "source": program_source(), "format": 9}  # 9: notes
    if target is not None:
        payload["gpu"] = target.describe(config) | {"format": 2}  # 2: loops XLA:GPU left without a trip count
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def compile_summary(
    config: Config, *, cache: Path | None = None, target: GpuTarget | None = None, compiler: Callable | None = None
) -> tuple[dict[str, Any], bool]:
    """(what the cost model needs from ``config``'s compiled train step, whether it came
    from the cache). ``target``: compiled by XLA:GPU for it (``plan.gpu_target``); without
    one, against as many fake CPU devices as the config's mesh (JAX must have them).
    ``compiler(config, target)``: where a cache miss compiles (``compile_program`` in this
    process by default; the planner's search uses ``plan.compile_worker``'s child)."""
    cache = cache_dir() if cache is None else cache
    path = cache / f"{cache_key(config, target)}.json"
    if path.is_file():
        try:
            return json.loads(path.read_text()), True
        except (OSError, ValueError):
            pass  # a damaged entry is compiled again
    summary = (compiler or compile_program)(config, target)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary))
        os.replace(tmp, path)
    except OSError:
        pass  # no cache is slower, not wrong
    return summary, False


def compile_program(config: Config, target: GpuTarget | None = None) -> dict[str, Any]:
    """``compile_summary``'s summary of ``config``'s train step, compiled in this process."""
    return _compile(config) if target is None else _compile_target(config, target)


def _built_quietly(build):
    """``build()`` with the trainer's notes captured as the lines they print (kept with the
    summary, said once by the planner: ``say_note``); anything not jaxdist's (JAX's own
    warnings) passed on as it came."""
    with contextlib.redirect_stderr(io.StringIO()) as printed:
        built = build()
    notes = [line for line in printed.getvalue().splitlines() if line.startswith("jaxdist: ")]
    for line in printed.getvalue().splitlines():
        if line and not line.startswith("jaxdist: "):
            print(line, file=sys.stderr)
    return built, notes


def _summary(config: Config, trainer, compiled, cost, notes: list[str]) -> dict[str, Any]:
    spec = pipeline_of(trainer)
    return {
        "program": cost.to_dict(),
        "memory": memory(compiled),
        "params": int(trainer.n_params),
        "model_flops_per_step": float(trainer.task.flops_per_example * config.train.global_batch),
        "tokens_per_step": float(trainer.task.tokens_per_example * config.train.global_batch),
        "bubble": float(spec.bubble) if spec is not None else 0.0,
        "mesh": {a: int(n) for a, n in trainer.layout.mesh.shape.items()},
        "notes": notes,
    }


def _compile(config: Config) -> dict[str, Any]:
    sizes = parse_mesh(config.parallel.mesh)
    devices = math.prod(sizes.values())
    if len(jax.devices("cpu")) < devices:
        raise JaxdistError(
            f"compiling for {devices} devices needs XLA_FLAGS=--xla_force_host_platform_device_count={devices} before JAX starts"
        )
    (trainer, compiled), notes = _built_quietly(
        lambda: compile_train_step(config, sizes, jax.devices("cpu")[:devices])
    )  # CPU even on a GPU machine
    mesh_shape = {a: int(n) for a, n in trainer.layout.mesh.shape.items()}
    heads = max(config.model.n_heads // mesh_shape.get("tensor", 1), 1)
    local_experts = config.model.moe_experts // mesh_shape.get("expert", 1) if config.model.kind == "llama" else 0
    cost = program_cost(compiled.as_text(), mesh_shape, config.train.seq_len, heads, local_experts, buffer_padding(config, mesh_shape))
    return _summary(config, trainer, compiled, cost, notes)


def _compile_target(config: Config, target: GpuTarget) -> dict[str, Any]:
    """``_compile``'s summary of XLA:GPU's program for ``target``, plus its ``memory.peak`` (XLA:GPU's
    peak memory per device), ``kernels`` (per kind, per step) and ``target``."""
    sizes = parse_mesh(config.parallel.mesh)
    (trainer, compiled, _), notes = _built_quietly(
        lambda: compile_for_target(config, sizes, target.hardware, target.gpus, target.gpus_per_node)
    )
    cost = gpu_program_cost(parse_hlo(compiled.as_text()), {a: int(n) for a, n in trainer.layout.mesh.shape.items()})
    summary = _summary(config, trainer, compiled, cost, notes)
    summary["memory"]["peak"] = device_peak(compiled)
    summary["kernels"] = {kind: round(n) for kind, n in schedule_kernel_counts(cost).items()}
    summary["target"] = {"name": target.hardware.key, "gpus": target.gpus, "gpus_per_node": target.gpus_per_node}
    return summary


# The compile runs on fake CPU devices: a note on how XLA:CPU runs the program (ragged_dot's dense
# expansion, fp16 attention in f32) describes that compile, not a GPU plan, which prices GPU kernels.
CPU_BACKEND_NOTE = re.compile(r"\bon CPU\b|XLA:CPU|\bCPU backend\b")
# A note as the build printed it -> the level it was said at (jaxdist's one-line format)
NOTE_LEVELS = (
    ("jaxdist: debug: ", logging.DEBUG),
    ("jaxdist: warning: ", logging.WARNING),
    ("jaxdist: error: ", logging.ERROR),
    ("jaxdist: ", logging.INFO),
)


def say_note(note: str) -> None:
    """A captured build note (``jaxdist: [warning: ]TEXT``) said again at its own level."""
    for prefix, level in NOTE_LEVELS:
        if note.startswith(prefix):
            log.log(level, note[len(prefix) :])
            return
    log.info(note)


def plan_notes(notes: list[str], shared_host: bool) -> list[str]:
    """The build notes that apply to a plan for this hardware: each once, in order; CPU-backend notes only on a shared host."""
    return list(dict.fromkeys(n for n in notes if shared_host or not CPU_BACKEND_NOTE.search(n)))
