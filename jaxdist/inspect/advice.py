"""``advice``: the few concrete things to try for a run's bound and strategy, each
naming the config key (or command) to change."""

from __future__ import annotations

import math
from typing import Any

_MISSING = object()


def advice(bound: str, fractions: dict[str, float], phases: dict[str, float], step_s: float, ctx: dict[str, Any]) -> list[dict[str, str]]:
    """A few concrete things to try for this bound and strategy, each naming a config key."""
    cfg = ctx.get("config") or {}

    def get(path: str, default: Any = None) -> Any:
        node: Any = cfg
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    out: list[dict[str, str]] = []

    def add(key: str, action: str, reason: str) -> None:
        # only keys this version of jaxdist has (the run's resolved config names them all)
        is_config_key = key[:1].islower() and " " not in key and "." in key  # not a flag, a command or an env variable
        if not is_config_key or not cfg or get(key, _MISSING) is not _MISSING:
            out.append({"key": key, "action": action, "reason": reason})

    strategy = str(ctx.get("strategy") or get("parallel.strategy") or "")
    mesh = ctx.get("mesh") or {}
    batch_ways = math.prod(int(mesh.get(a, 1) or 1) for a in ("replica", "data", "fsdp")) or 1
    global_batch = get("train.global_batch")
    per_device = f"{global_batch / batch_ways:g} sequences per batch shard" if global_batch else "now"
    if bound == "data":
        add(
            "data.workers",
            f"raise data.workers (now {get('data.workers', '?')}) so Grain worker processes read and pack batches in parallel",
            f"devices waited for the next batch {fractions['data_wait']:.0%} of each step",
        )
        if get("data.source") in ("text", "stdlib"):
            add(
                "python -m jaxdist.data prepare",
                "tokenize and pack the corpus once, offline, then train with data.source=tokens",
                "the loader then only reads ready token arrays",
            )
        add(
            "data.prefetch",
            f"read more batches ahead (now {get('data.prefetch', '?')})",
            "a deeper queue hides uneven read latency once workers keep up on average",
        )
        if get("data.source") == "synthetic" and (get("data.synthetic_latency_ms") or 0) > 0:
            add(
                "data.synthetic_latency_ms",
                f"set it to 0 (now {get('data.synthetic_latency_ms')})",
                "this benchmarking knob simulates slow storage on purpose",
            )
    elif bound == "communication":
        add(
            "train.global_batch",
            f"a larger per-device batch (now {per_device}), with train.microbatches if memory is short",
            "the gradient reduction moves the same bytes per step however large the batch; compute grows with it",
        )
        if strategy.startswith("dp"):
            add(
                "parallel.strategy",
                "parallel.strategy=zero1 instead of dp",
                "shards the optimizer update and its state: the all-reduce becomes reduce-scatter + all-gather and memory frees up for a larger batch",
            )
        elif strategy.startswith("fsdp"):
            add(
                "parallel.strategy",
                "parallel.strategy=zero1 (or dp) if the parameters fit replicated",
                "FSDP all-gathers the parameters in forward and again in backward, ~3x the bytes of DP",
            )
        if "tp" in strategy or int(mesh.get("tensor", 1) or 1) > 1:
            add("--mesh", "a smaller tensor axis kept within one node", "tensor parallelism all-reduces activations in every layer")
        add("parallel.grad_reduce", "parallel.grad_reduce=bfloat16 (int8 / topk cut further)", "halves the bytes of the gradient reduction")
        flags = str((ctx.get("threads") or {}).get("XLA_FLAGS") or "")
        if ctx["platform"] == "gpu" and "latency_hiding_scheduler=true" not in flags:
            add(
                "JAXDIST_XLA_DEFAULTS",
                "leave JAXDIST_XLA_DEFAULTS unset so jaxdist's overlap flags (latency hiding scheduler, pipelined collectives) are on",
                "they were off in this run's XLA_FLAGS",
            )
        elif ctx["platform"] == "gpu":
            add(
                "JAXDIST_XLA_DEFAULTS",
                "the overlap flags are on; check the combine thresholds and that collectives run inside the layer scan",
                f"{fractions['communication_exposed']:.0%} of the step is still exposed",
            )
        else:
            add(
                "JAXDIST_XLA_DEFAULTS",
                "the overlap flags apply on GPU only",
                "on CPU devices collectives also include waiting for the other devices' threads",
            )
    elif bound == "compute":
        dtype = str(get("model.dtype") or "")
        if dtype == "float32" or (dtype == "auto" and ctx["platform"] != "gpu"):
            add("model.dtype", "model.dtype=bfloat16", "halves the bytes moved and runs on the tensor cores on GPU")
        remat = str(get("model.remat") or "none")
        if remat != "none":
            add(
                "model.remat",
                f"model.remat=save_matmuls or none (now {remat}) if memory allows",
                "full remat recomputes the forward pass in the backward (~1.33x the FLOPs)",
            )
        if ctx["platform"] == "gpu" and get("model.attention") not in (None, "cudnn", "auto"):
            add(
                "model.attention", "model.attention=cudnn (fused flash attention)", "attention without fusion materializes the score matrix"
            )
        elif ctx["platform"] == "gpu":
            add(
                "model.attention",
                "keep model.attention=auto/cudnn; profile the top ops for unfused attention",
                "fused attention is the largest single kernel win",
            )
        add(
            "train.global_batch",
            f"compute-bound is the goal: raise the per-device batch (now {per_device}) while MFU still grows",
            "larger matmuls use the device better",
        )
    else:  # host
        add(
            "train.global_batch",
            f"a larger per-device batch (now {per_device})",
            "each dispatched step then does more device work for the same host work",
        )
        if phases.get("log", 0.0) > 0.1 * step_s:
            add(
                "train.log_every",
                f"log less often (now every {get('train.log_every', '?')} steps)",
                f"fetching metrics waits for the devices: {phases['log'] * 1e3:.1f} ms per step",
            )
        else:
            add(
                "train.log_every",
                f"log less often (now every {get('train.log_every', '?')} steps) and avoid other host syncs",
                "each fetch stops the host from dispatching ahead",
            )
        if phases.get("checkpoint", 0.0) > 0.1 * step_s:
            add(
                "checkpoint.every_steps",
                f"save less often (now every {get('checkpoint.every_steps', '?')} steps)",
                f"checkpointing costs {phases['checkpoint'] * 1e3:.1f} ms per step",
            )
        if phases.get("eval", 0.0) > 0.1 * step_s:
            add(
                "train.eval_every",
                f"evaluate less often (now every {get('train.eval_every', '?')} steps)",
                f"eval costs {phases['eval'] * 1e3:.1f} ms per step",
            )
    return out
