"""Does this config fit this mesh? Every mesh-dependent check, in one place.

Pure Python, so the CLI rejects a bad combination before JAX starts. A dimension that a
mesh axis does not divide is an error rather than a silent replication; where
replication is the right answer (e.g. ZeRO-1 on a mesh with nothing to shard over), the
check returns a one-line warning for the caller to print.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from jaxdist.config import Config
from jaxdist.errors import ConfigError, MeshError
from jaxdist.layout.capacity import capacity_rows, ceil_scaled
from jaxdist.layout.mesh import BATCH_AXES, MeshSizes
from jaxdist.layout.strategy import zero_stage
from jaxdist.parallel.pipeline_schedule import pipeline_spec, validate


def check_config_on_mesh(config: Config, sizes: MeshSizes, used: Collection[str] = ()) -> list[str]:
    """Raise ``MeshError`` / ``ConfigError`` for a config the mesh cannot run; return warnings.
    ``used``: keys the caller itself reads (``generate --chat`` renders with data.chat_template)."""
    warnings: list[str] = []
    _check_batch(config, sizes)
    _check_strategy(config, sizes, warnings)
    _check_context(config, sizes)
    _check_moe(config, sizes)
    if config.model.kind == "llama":
        _check_llama(config, sizes)
    else:
        _check_resnet(config, sizes)
    _check_diloco(config, sizes)
    if config.parallel.diloco_inner_steps and config.model.kind == "llama" and sizes.get("fsdp", 1) > 1:
        warnings.append(
            "DiLoCo with an fsdp axis: the embedding table's gradient is all-reduced whole over each replica's batch "
            "axes, then sharded (its per-device reduce-scatter, layout.sharding.summed_into_layout, does not run under DiLoCo's vmap)"
        )
    _check_fp8(config, sizes)
    _check_collective_matmul(config, sizes)
    if config.train.objective == "dpo":
        _check_preference(config, sizes)
    warnings.extend(unused_keys(config, sizes, used))
    warnings.extend(_short_schedule(config))
    if sizes["pipe"] > 1:
        _check_pipeline(config, sizes)
        if config.parallel.grad_reduce != "float32":
            raise ConfigError(f"parallel.grad_reduce={config.parallel.grad_reduce} does not support a pipe axis yet (use float32)")
    return warnings


def _short_schedule(config: Config) -> list[str]:
    """A warmup the user set longer than the schedule: the rate never reaches train.lr."""
    t, length = config.train, config.train.schedule_length()
    if t.warmup_steps > length and t.warmup_steps != Config().train.warmup_steps:
        return [f"train.warmup_steps={t.warmup_steps} is longer than the {length}-step schedule: the learning rate never reaches train.lr"]
    return []


def batch_shards(sizes: MeshSizes) -> int:
    """How many ways the global batch is split: replica x data x fsdp x expert."""
    return math.prod(sizes.get(a, 1) for a in BATCH_AXES)


def fitting_microbatches(config: Config, sizes: MeshSizes) -> int | None:
    """The largest ``train.microbatches`` up to the configured count whose microbatches
    still split over the batch axes and, on a pipe axis, into the pipeline's microbatches
    (what a resume on another mesh uses to keep the global batch); None if none does."""
    t = config.train
    spec = pipeline_spec(config.parallel, sizes.get("pipe", 1))
    per_microbatch = batch_shards(sizes) * (spec.microbatches if spec else 1)
    return next((m for m in range(t.microbatches, 0, -1) if t.global_batch % (per_microbatch * m) == 0), None)


def _check_batch(config: Config, sizes: MeshSizes) -> None:
    t = config.train
    shards = batch_shards(sizes)
    if t.global_batch % (shards * t.microbatches):
        raise MeshError(
            f"train.global_batch ({t.global_batch}) must be divisible by replica x data x fsdp x expert ({shards}) x train.microbatches ({t.microbatches})"
        )


def _check_preference(config: Config, sizes: MeshSizes) -> None:
    """DPO's pairs (rows 2i, 2i+1) stay whole on one device; the axes it does not run on yet."""
    schedule = config.parallel.schedule
    if sizes.get("pipe", 1) > 1 and schedule not in ("gpipe", "circular"):
        raise MeshError(
            f"train.objective=dpo on a pipe axis runs parallel.schedule=gpipe or circular, not {schedule} "
            "(its backward runs inside the forward, per microbatch, where DPO's loss needs each row's whole log-probability)"
        )
    for axis, why in (("context", "a pair's rows would be split"),
                      ("replica", "DiLoCo's replicas carry no reference model"), ("expert", "it needs an MoE model")):  # fmt: skip
        if sizes.get(axis, 1) > 1:
            raise MeshError(f"train.objective=dpo does not support a {axis} axis yet ({why})")
    rows = config.train.global_batch // batch_shards(sizes)
    if rows % 2:
        raise MeshError(
            f"train.objective=dpo: train.global_batch ({config.train.global_batch}) over replica x data x fsdp x expert "
            f"({batch_shards(sizes)}) gives {rows} rows per device, which would split a chosen/rejected pair: make it even"
        )


def _check_diloco(config: Config, sizes: MeshSizes) -> None:
    p = config.parallel
    if sizes.get("replica", 1) > 1 and p.diloco_inner_steps == 0:
        raise ConfigError(
            "the replica mesh axis is for DiLoCo: set parallel.diloco_inner_steps=H (> 0), or name the axis data for plain data parallelism"
        )
    if p.diloco_inner_steps == 0:
        return
    if sizes.get("replica", 1) == 1:
        raise ConfigError(
            f"parallel.diloco_inner_steps={p.diloco_inner_steps} needs a replica mesh axis of size > 1 (e.g. --mesh replica=2,data=-1); "
            "with one replica it would be a different optimizer (an outer step every H steps), not data parallelism"
        )
    if p.grad_reduce != "float32":
        raise ConfigError(
            f"parallel.grad_reduce={p.grad_reduce} with DiLoCo: inner steps reduce inside a replica in float32; "
            "compress the outer average with parallel.diloco_reduce"
        )
    if sizes["pipe"] > 1:
        raise ConfigError("DiLoCo (parallel.diloco_inner_steps > 0) does not support a pipe axis yet")
    if sizes.get("context", 1) > 1:
        raise ConfigError("DiLoCo (parallel.diloco_inner_steps > 0) does not compose with a context axis yet")
    if p.diloco_outer_dtype and p.diloco_reduce != "float32" and p.diloco_outer_dtype != p.diloco_reduce:
        raise ConfigError(
            f"parallel.diloco_outer_dtype={p.diloco_outer_dtype} and parallel.diloco_reduce={p.diloco_reduce} disagree: set one"
        )
    if p.diloco_overlap_steps >= p.diloco_inner_steps:
        raise ConfigError(
            f"parallel.diloco_overlap_steps={p.diloco_overlap_steps} must be below parallel.diloco_inner_steps={p.diloco_inner_steps}: "
            "a fragment's outer update has to land before its next round is sent"
        )
    if config.train.optimizer_offload:
        raise ConfigError(
            "train.optimizer_offload with DiLoCo: the inner optimizer's state is per replica under its vmap, "
            "which does not move between memories yet; offload activations with model.remat=offload_* instead"
        )


def _check_strategy(config: Config, sizes: MeshSizes, warnings: list[str]) -> None:
    name = config.parallel.strategy
    if "tp" in name.split("+") and sizes["tensor"] == 1:
        raise ConfigError(f"parallel.strategy {name!r} asks for tensor parallelism but the mesh has no tensor axis")
    zero = zero_stage(name, sizes)
    if zero == "fsdp" and sizes["fsdp"] == 1:
        raise ConfigError(
            f"parallel.strategy {name!r} shards parameters over the fsdp mesh axis, but the mesh has none (e.g. --mesh fsdp=8 or data=2,fsdp=4)"
        )
    if zero == "zero1" and sizes["data"] * sizes["fsdp"] == 1:
        warnings.append("parallel.strategy=zero1 on a mesh without data or fsdp axes: the optimizer state stays replicated")


def _embed_shards(config: Config, sizes: MeshSizes) -> tuple[int, str]:
    """How many ways the ``embed`` dimension of parameters or moments is split, and over what."""
    zero, context = zero_stage(config.parallel.strategy, sizes), sizes.get("context", 1)
    if zero == "fsdp":
        shards, over = sizes["fsdp"], "the fsdp axis"
    elif zero == "zero1":
        shards, over = sizes["data"] * sizes["fsdp"], "data x fsdp (ZeRO-1 optimizer state)"
    else:
        shards, over = 1, ""
    if context > 1:  # model states are sharded over context as well
        shards, over = shards * context, (f"{over} x context" if over else "the context axis")
    return shards, over


def _check_llama(config: Config, sizes: MeshSizes) -> None:
    m = config.model
    tensor = sizes["tensor"]
    if tensor > 1:
        dims = [("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads), ("mlp width", m.resolved_mlp_dim)]
        if m.vocab_size:  # 0 is resolved from the tokenizer (a multiple of 128) before the mesh is built
            dims.append(("model.vocab_size", m.vocab_size))
        for name, value in dims:
            if value % tensor:
                raise MeshError(f"{name} ({value}) must be divisible by the tensor axis ({tensor})")
    shards, over = _embed_shards(config, sizes)
    if shards > 1 and m.d_model % shards:
        raise MeshError(f"model.d_model ({m.d_model}) must be divisible by {over} ({shards}): it is the dimension that is sharded")


def _check_moe(config: Config, sizes: MeshSizes) -> None:
    m, p, expert = config.model, config.parallel, sizes.get("expert", 1)
    if m.moe_experts == 0 or m.kind != "llama":
        if expert > 1:
            raise MeshError(
                f"an expert axis splits an MoE layer's experts; this model has none (set model.moe_experts, or drop expert={expert})"
            )
        if m.moe_experts and m.kind != "llama":
            raise ConfigError(f"model.moe_experts is for the llama decoder, not model.kind={m.kind}")
        return
    # (top-k, first dense layers, routers and ranges: config.validate, before any mesh)
    if m.moe_experts % expert:
        raise MeshError(f"model.moe_experts ({m.moe_experts}) must be divisible by the expert axis ({expert})")
    if sizes["tensor"] > 1 and m.resolved_moe_mlp_dim % sizes["tensor"]:
        raise MeshError(f"the expert width ({m.resolved_moe_mlp_dim}) must be divisible by the tensor axis ({sizes['tensor']})")
    for axis, what in (("pipe", "a pipe axis"), ("replica", "DiLoCo's replica axis")):
        if sizes.get(axis, 1) > 1:
            raise MeshError(
                f"MoE (model.moe_experts > 0) does not compose with {what} yet (its router statistics leave the layers by the scan)"
            )
    if p.grad_reduce != "float32":
        raise ConfigError(f"parallel.grad_reduce={p.grad_reduce} does not compose with MoE yet (use float32)")
    if m.moe_capacity_factor > 0 and p.expert_buffer_factor > 0 and expert > 1:
        # a device's send buffer per destination must hold the capacity of the experts there
        tokens = (
            config.train.global_batch * config.train.seq_len // (batch_shards(sizes) * sizes.get("context", 1) * config.train.microbatches)
        )
        capacity = capacity_rows(tokens, m.moe_top_k, m.moe_experts, m.moe_capacity_factor)
        needed = m.moe_experts // expert * capacity
        buffer = ceil_scaled(tokens * m.moe_top_k, p.expert_buffer_factor, expert)
        if buffer < needed:
            raise ConfigError(
                f"parallel.expert_buffer_factor={p.expert_buffer_factor:g} gives {buffer} rows per destination, fewer than the "
                f"{needed} that model.moe_capacity_factor={m.moe_capacity_factor:g} lets its experts keep (raise it to >= the capacity factor, or 0)"
            )


def _check_fp8(config: Config, sizes: MeshSizes) -> None:
    m, p = config.model, config.parallel
    if m.fp8 == "off":
        return
    if sizes["pipe"] > 1 and m.fp8_keep_ends:
        raise MeshError("model.fp8_keep_ends does not compose with a pipe axis yet (a stage cannot tell the first layer; set it false)")
    if m.fp8 != "delayed":
        return
    # Paths that add the amax observations rather than taking their max, or average them as weights
    for problem, what in (
        (sizes["pipe"] > 1, "a pipe axis (its ticks would add the amax observations)"),
        (p.grad_reduce != "float32", f"parallel.grad_reduce={p.grad_reduce} (the codec would add the amax observations)"),
        (p.diloco_inner_steps > 0, "DiLoCo (its outer step would average the amax histories as weights)"),
    ):
        if problem:
            raise ConfigError(f"model.fp8=delayed does not compose with {what} yet; use model.fp8=current")


def _check_collective_matmul(config: Config, sizes: MeshSizes) -> None:
    """``parallel.collective_matmul`` runs the fused dense projections of a whole-sequence llama step (models.collective_matmul)."""
    m, p, tensor = config.model, config.parallel, sizes.get("tensor", 1)
    if not p.collective_matmul or tensor == 1:
        return  # without a tensor axis: unused_keys says it has no effect
    for problem, what in (
        (m.kind != "llama", f"model.kind={m.kind} (it is the llama decoder's)"),
        (m.moe_experts > 0, "an MoE model (its experts' layers are not in sequence-parallel form)"),
        (not m.fused_projections, "model.fused_projections=false (it rings the fused QKV and gate/up projections)"),
        (m.fp8 != "off", f"model.fp8={m.fp8} (its rings multiply in the compute dtype)"),
        (sizes.get("context", 1) > 1, "a context axis (both split the sequence)"),
        (sizes.get("pipe", 1) > 1, "a pipe axis (a stage's region is manual over pipe already)"),
        (p.diloco_inner_steps > 0, "DiLoCo (its replicas are a vmap, not a mesh region)"),
    ):
        if problem:
            raise ConfigError(f"parallel.collective_matmul=true does not compose with {what} yet; set it false")
    if tensor > 1 and config.train.seq_len % tensor:
        raise MeshError(
            f"parallel.collective_matmul=true splits the sequence over tensor: train.seq_len ({config.train.seq_len}) "
            f"must be divisible by tensor ({tensor})"
        )


def _check_context(config: Config, sizes: MeshSizes) -> None:
    p, context = config.parallel, sizes.get("context", 1)
    if context == 1:
        return
    if config.model.kind != "llama":
        raise MeshError(f"a context axis splits token sequences; model.kind={config.model.kind} has none (drop context={context})")
    chunks = 2 * context if p.context_load_balance else context
    if config.train.seq_len % chunks:
        how = f"2 x context = {chunks} chunks (load balancing)" if p.context_load_balance else f"the context axis ({context})"
        raise MeshError(f"train.seq_len ({config.train.seq_len}) must be divisible by {how}")
    heads, tensor = config.model.n_heads, sizes["tensor"]
    if p.context_strategy == "all_to_all" and heads % (tensor * context):
        raise MeshError(
            f"parallel.context_strategy=all_to_all splits the heads over tensor x context: model.n_heads ({heads}) must be "
            f"divisible by tensor x context ({tensor} x {context} = {tensor * context}); use parallel.context_strategy=all_gather or ring"
        )
    if sizes["pipe"] > 1:
        raise MeshError(
            "a context axis does not compose with a pipe axis yet (the pipeline's stages would need the sequence split inside them)"
        )
    if p.grad_reduce != "float32":
        raise ConfigError(f"parallel.grad_reduce={p.grad_reduce} does not compose with a context axis yet (use float32)")


def _check_resnet(config: Config, sizes: MeshSizes) -> None:
    if sizes["tensor"] > 1 or sizes["pipe"] > 1:
        raise MeshError("model.kind=resnet supports data and fsdp axes, not tensor or pipe (it cannot be staged)")
    shards, over = _embed_shards(config, sizes)
    for width in config.model.resnet_widths:
        if shards > 1 and width % shards:
            raise MeshError(f"model.resnet_widths entry {width} must be divisible by {over} ({shards}): channels are what is sharded")


def _check_pipeline(config: Config, sizes: MeshSizes) -> None:
    t = config.train
    spec = pipeline_spec(config.parallel, sizes["pipe"])
    problem = validate(spec, config.model.n_layers, config.train.seq_len)
    if problem:
        raise MeshError(problem)
    shards = sizes["data"] * sizes["fsdp"]
    if t.global_batch % (shards * t.microbatches * spec.microbatches):
        raise MeshError(
            f"train.global_batch ({t.global_batch}) must be divisible by data x fsdp ({shards}) x train.microbatches "
            f"({t.microbatches}) x parallel.pipeline_microbatches ({spec.microbatches})"
        )


def unused_keys(config: Config, sizes: MeshSizes, used: Collection[str] = ()) -> list[str]:
    """One warning line per key set away from its default that this config and mesh
    ignore (a key must never be accepted and silently do nothing)."""
    defaults = Config()
    m, t, p = config.model, config.train, config.parallel
    found: list[tuple[str, str]] = []

    def changed(section: str, key: str) -> bool:
        return getattr(getattr(config, section), key) != getattr(getattr(defaults, section), key)

    if t.optimizer != "sgd" and changed("train", "momentum"):
        found.append(("train.momentum", f"train.optimizer={t.optimizer} (momentum is SGD's; AdamW uses train.beta1)"))
    if m.dtype != "float16" and changed("train", "loss_scale"):
        found.append(("train.loss_scale", f"model.dtype={m.dtype} (loss scaling is for float16)"))
    if p.grad_reduce == "float32":
        for key in ("error_feedback", "grad_topk_fraction", "compress_axes"):
            if changed("parallel", key):
                found.append((f"parallel.{key}", "parallel.grad_reduce=float32 (nothing is compressed)"))
    elif p.grad_reduce != "topk" and changed("parallel", "grad_topk_fraction"):
        found.append(("parallel.grad_topk_fraction", f"parallel.grad_reduce={p.grad_reduce} (it is topk's)"))
    if sizes.get("pipe", 1) == 1:
        for key in ("schedule", "pipeline_microbatches", "virtual_stages", "pipeline_recompute"):
            if changed("parallel", key):
                found.append((f"parallel.{key}", "a mesh without a pipe axis"))
    elif p.schedule != "1f1b" and changed("parallel", "pipeline_recompute"):
        why = "it keeps each chunk's activations for its B and W" if p.schedule in ("zb1", "zbv") else "its backward is autodiff's"
        found.append(("parallel.pipeline_recompute", f"parallel.schedule={p.schedule} ({why}; model.remat recomputes)"))
    if sizes.get("context", 1) == 1:
        for key in ("context_strategy", "context_load_balance"):
            if changed("parallel", key):
                found.append((f"parallel.{key}", "a mesh without a context axis"))
    if m.kind != "llama" or m.moe_experts == 0:
        for key in ("moe_top_k", "moe_shared_experts", "moe_mlp_dim", "moe_first_dense", "moe_router", "moe_renormalize",
                    "moe_capacity_factor", "moe_aux_loss_coef", "moe_z_loss_coef", "moe_bias_rate"):  # fmt: skip
            if changed("model", key):
                found.append((f"model.{key}", "model.moe_experts=0 (a dense model)"))
    elif m.moe_router == "sigmoid" and changed("model", "moe_renormalize"):
        found.append(("model.moe_renormalize", "model.moe_router=sigmoid (its k scores are always normalised)"))
    if m.fp8 != "delayed" and changed("model", "fp8_history"):
        found.append(("model.fp8_history", f"model.fp8={m.fp8} (the history is delayed scaling's)"))
    if m.fp8 == "off" and changed("model", "fp8_keep_ends"):
        found.append(("model.fp8_keep_ends", "model.fp8=off (every layer runs in the compute dtype)"))
    if sizes.get("tensor", 1) == 1 and changed("parallel", "collective_matmul"):
        found.append(("parallel.collective_matmul", "a mesh without a tensor axis (no projection is split)"))
    if sizes.get("expert", 1) == 1 and changed("parallel", "expert_buffer_factor"):
        found.append(("parallel.expert_buffer_factor", "a mesh without an expert axis (nothing is dispatched across devices)"))
    if p.diloco_inner_steps == 0:
        keys = ("diloco_outer_lr", "diloco_outer_momentum", "diloco_reduce", "diloco_outer_dtype", "diloco_fragments")
        for key in (*keys, "diloco_overlap_steps", "diloco_overlap_mix"):
            if changed("parallel", key):
                found.append((f"parallel.{key}", "parallel.diloco_inner_steps=0 (DiLoCo is off)"))
    elif p.diloco_overlap_steps == 0 and changed("parallel", "diloco_overlap_mix"):
        found.append(("parallel.diloco_overlap_mix", "parallel.diloco_overlap_steps=0 (each outer update lands at once and replaces)"))
    if t.optimizer != "muon":
        for key in ("muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_scale"):
            if changed("train", key):
                found.append((f"train.{key}", f"train.optimizer={t.optimizer} (it is Muon's)"))
    if config.data.source != "chat":
        for key in ("chat_template", "loss_on", "chat_overflow"):
            templated = config.data.source == "preference" or (t.harness_chat_template and t.harness_tasks.strip())
            if changed("data", key) and not (key == "chat_template" and templated):
                found.append((f"data.{key}", f"data.source={config.data.source} (it is for chat data)"))
    if t.objective != "dpo":
        for key in ("dpo_beta", "dpo_label_smoothing", "dpo_loss"):
            if changed("train", key):
                found.append((f"train.{key}", f"train.objective={t.objective} (it is DPO's)"))
        if changed("data", "reference_logps"):
            found.append(("data.reference_logps", f"train.objective={t.objective} (it is DPO's)"))
    elif t.dpo_loss == "ipo" and changed("train", "dpo_label_smoothing"):
        found.append(("train.dpo_label_smoothing", "train.dpo_loss=ipo (label smoothing is the sigmoid loss's)"))
    if not t.harness_tasks.strip():
        keys = ("harness_every", "harness_include_path", "harness_limit", "harness_num_fewshot", "harness_batch_size")
        for key in (*keys, "harness_chat_template"):
            if changed("train", key):
                found.append((f"train.{key}", "train.harness_tasks empty (no lm-eval task runs during training)"))
    if t.objective == "dpo" and changed("model", "loss_chunk"):
        found.append(("model.loss_chunk", "train.objective=dpo (its log-probabilities take the whole sequence's logits)"))
    if not config.log.wandb:
        for key in ("wandb_project", "wandb_entity", "wandb_name"):
            if changed("log", key):
                found.append((f"log.{key}", "log.wandb=false (nothing is sent to Weights & Biases)"))
    if not config.checkpoint.local_dir and changed("checkpoint", "remote_every_steps"):
        found.append(("checkpoint.remote_every_steps", "checkpoint.local_dir unset (checkpoints are saved to the run directory directly)"))
    return [f"{key}={_show(config, key)} has no effect with {why}" for key, why in found if key not in used]


def _show(config: Config, key: str) -> str:
    section, name = key.split(".")
    return str(getattr(getattr(config, section), name))
