"""Model registry: what the trainer needs to know about a model, for any NNX module.

The trainer takes a ``Task``: how to build the module, how to turn it and a batch into a
summed loss, a weight (so gradient accumulation averages exactly) and statistics (sums
that add over microbatches and devices: MoE's balancing), and its FLOPs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxdist.config import Config
from jaxdist.errors import ConfigError
from jaxdist.models import counts, llama, resnet
from jaxdist.models.attention import choose_implementation
from jaxdist.models.fp8 import FP8_MIN_CAPABILITY, fp8_capable
from jaxdist.models.moe import metrics_from_sums, update_router_bias
from jaxdist.models.remat import offload_note, unscanned_note

log = logging.getLogger(__name__)

Batch = dict[str, jax.Array]
Stats = dict[str, jax.Array]
LossFn = Callable[[nnx.Module, Batch], tuple[jax.Array, jax.Array, Stats]]


@dataclasses.dataclass(frozen=True)
class Task:
    make_model: Callable[[nnx.Rngs], nnx.Module]
    loss_fn: LossFn  # (model, batch) -> (sum of per-example losses, number of examples/tokens, statistics)
    flops_per_example: float  # training FLOPs (forward + backward) per batch row
    tokens_per_example: int  # what "tokens/s" counts per batch row
    n_params: int
    batch_spec: Callable[[int], dict[str, jax.ShapeDtypeStruct]]  # global batch size -> shapes
    attention: str | None = None  # the attention implementation chosen (decoders): xla | xla_fp32 | cudnn | pallas
    metrics_from: Callable[[Stats, jax.Array], dict[str, jax.Array]] | None = None  # statistics, weight -> metrics
    after_update: Callable[[Any, Stats], Any] | None = None  # params, statistics -> params (state moved outside the optimizer)
    # a frozen reference model (train.objective=dpo): (reference model, batch) -> the batch with what the loss reads from it
    with_reference: Callable[[nnx.Module, Batch], Batch] | None = None
    # set from outside by parallel.parallelize, installed in each step's context (layout.step_context)
    sequence_kernel: Callable | None = None  # context parallelism's attention
    expert_kernel: Callable | None = None  # expert parallelism's dispatch
    row_logps_kernel: Callable | None = None  # a pipe axis's forward of each row's log-probability (train.objective=dpo)


def lm_loss(model: nnx.Module, batch: Batch) -> tuple[jax.Array, jax.Array, Stats]:
    """Next-token cross-entropy summed over the unmasked target tokens (MoE: plus the balancing losses)."""
    return model.loss(batch)


def classification_loss(model: nnx.Module, batch: Batch) -> tuple[jax.Array, jax.Array, Stats]:
    logits = model(batch["images"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    return jnp.sum(losses), jnp.asarray(losses.shape[0], jnp.float32), {}


def compute_dtype(config: Config, platform: str) -> Any:
    name = config.model.dtype
    if name == "auto":
        name = "bfloat16" if platform == "gpu" else "float32"
    return jnp.dtype(name)


def moe_hooks(cfg) -> dict[str, Any]:
    """The Task fields of an MoE decoder: its balancing metrics and router-bias update."""
    hooks: dict[str, Any] = {"metrics_from": metrics_from_sums}
    if cfg.moe_bias_rate > 0:
        hooks["after_update"] = lambda params, stats: update_router_bias(params, stats["moe_counts"], cfg.moe_bias_rate)
    return hooks


def fp8_note(cfg) -> str | None:
    """The line an MoE decoder under ``model.fp8`` prints about its routed experts."""
    if cfg.fp8 == "off" or not cfg.moe_experts:
        return None
    return (
        f"model.fp8={cfg.fp8}: the routed experts' grouped matmuls quantise-dequantise their inputs (fp8 rounding, bf16 compute: "
        "XLA has no fp8 grouped GEMM), scaled per device from the current amax"
    )


def microbatch_balancing_note(config: Config) -> str | None:
    """The line an MoE run with a balancing loss prints when the step is split into microbatches:
    the objective's term sees one microbatch's counts at a time (the exact whole-step term would
    need the step's counts before any microbatch's backward: a second forward pass)."""
    cfg, m = config.model, config.train.microbatches
    if not cfg.moe_experts or cfg.moe_aux_loss_coef <= 0 or m <= 1:
        return None
    return (
        f"model.moe_aux_loss_coef with train.microbatches={m}: the training objective's balancing term is computed from each "
        "microbatch's expert counts and router probabilities (averaged over microbatches weighted by their targets), so it "
        "depends on the microbatch count; the logged moe_aux_loss and moe_load_max are the whole step's"
    )


def build_task(config: Config, platform: str = "cpu", compute_capability: str | None = None) -> Task:
    """The task for ``config``'s model; parallelism is applied afterwards (``jaxdist.parallel.parallelize``).
    ``compute_capability``: the mesh's GPUs' (e.g. "9.0"), which decides kernels; read from
    the mesh's own devices, so a program compiled for a GPU target on a CPU host sees its target."""
    cfg, dtype = config.model, compute_dtype(config, platform)
    if cfg.fp8 != "off" and dtype != jnp.bfloat16:  # config.validate refused the other dtypes; auto is float32 off GPU
        raise ConfigError(
            f"model.fp8={cfg.fp8} needs bfloat16 compute; model.dtype=auto is {dtype.name} on {platform}: set model.dtype=bfloat16"
        )
    if cfg.fp8 != "off" and platform == "gpu" and compute_capability and not fp8_capable(compute_capability):
        raise ConfigError(
            f"model.fp8={cfg.fp8} needs fp8 GEMMs: compute capability {FP8_MIN_CAPABILITY} or newer (Ada, Hopper); "
            f"these GPUs are {compute_capability} (XLA would compute every fp8 matmul in f16): set model.fp8=off"
        )
    if cfg.kind == "llama":
        seq = config.train.seq_len
        keys = ["inputs", "targets"]
        packed = config.data.source != "synthetic" and config.data.document_mask
        if config.data.source != "synthetic":  # packed text: mask the EOD successors, maybe the documents
            keys += ["loss_mask", *(("segment_ids", "positions") if packed else ())]
        attention, note = choose_implementation(
            cfg.attention,
            platform=platform,
            dtype=dtype,
            head_dim=cfg.resolved_head_dim,
            packed=packed,
            compute_capability=compute_capability,
        )
        for line in (
            note,
            fp8_note(cfg),
            microbatch_balancing_note(config),
            offload_note(cfg.remat, platform),
            unscanned_note(cfg.remat, cfg.scan_layers, platform),
        ):  # the weaker paths this model takes
            if line:
                log.info(line)
        return Task(
            make_model=lambda rngs: llama.Llama(cfg, dtype=dtype, attention=attention, rngs=rngs),
            loss_fn=lm_loss,
            flops_per_example=counts.flops_per_token(cfg, seq) * seq,
            tokens_per_example=seq,
            n_params=counts.count_params(cfg),
            batch_spec=lambda b: {k: jax.ShapeDtypeStruct((b, seq), jnp.float32 if k == "loss_mask" else jnp.int32) for k in keys},
            attention=attention,
            **(moe_hooks(cfg) if cfg.moe_experts else {}),
        )
    return Task(
        make_model=lambda rngs: resnet.ResNet(cfg, dtype=dtype, rngs=rngs),
        loss_fn=classification_loss,
        flops_per_example=resnet.flops_per_image(cfg),
        tokens_per_example=1,  # images/s
        n_params=resnet.count_params(cfg),
        batch_spec=lambda b: {
            "images": jax.ShapeDtypeStruct((b, cfg.image_size, cfg.image_size, 3), jnp.float32),
            "labels": jax.ShapeDtypeStruct((b,), jnp.int32),
        },
    )
