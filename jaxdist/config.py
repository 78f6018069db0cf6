"""Typed config tree: dataclasses, YAML presets and dotted ``key=value`` overrides.

Every field carries its documentation and, for numbers, its valid range (``knob``): the
loader checks types, choices (``Literal``), finiteness and ranges itself, and
``configs/README.md``'s key reference is generated from the same fields
(``reference_markdown``). Pure Python on purpose: the CLI validates a config before JAX
starts, so bad input costs no backend start-up and writes nothing.
"""

from __future__ import annotations

import copy as copy_module
import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxdist.config_fields import credentials_violation, knob, range_violation
from jaxdist.config_rules import check_rules, profile_window  # noqa: F401  (profile_window: public here)
from jaxdist.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
# A config's name becomes a folder under runs/: one path component, nothing that could climb out.
NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]+")


Dtype = Literal["auto", "float32", "bfloat16", "float16"]


class _Freezable:
    """A config node that ``freeze`` can make read-only: once a run is resolved
    (``jaxdist.training.run_plan``), setting a field raises instead of silently changing
    what the saved config.yaml and the checkpoints record."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen"):
            raise dataclasses.FrozenInstanceError(
                f"cannot set {type(self).__name__}.{name}: the config is frozen once the run is resolved "
                "(copy it with jaxdist.config.unfrozen to derive another)"
            )
        object.__setattr__(self, name, value)


@dataclasses.dataclass
class ModelConfig(_Freezable):
    kind: Literal["llama", "resnet"] = knob("llama", "the model: a Llama-style decoder (dense or MoE) or a small ResNet")
    vocab_size: int = knob(0, "embedding rows; 0: what the data's tokenizer needs, rounded up to a multiple of 128", ">= 0")
    valid_vocab: int = knob(
        0, "ids >= this are padding rows (an imported vocab padded to 128): logits -inf, never sampled; 0: all ids", ">= 0"
    )
    d_model: int = knob(64, "model width", "> 0")
    n_layers: int = knob(2, "decoder layers", "> 0")
    n_heads: int = knob(8, "attention (query) heads", "> 0")
    n_kv_heads: int = knob(4, "key/value heads (grouped-query attention); divides n_heads", "> 0")
    head_dim: int = knob(0, "per-head width; 0: d_model / n_heads", ">= 0")
    mlp_dim: int = knob(0, "SwiGLU width; 0: 8/3 x d_model rounded up to a multiple of 64", ">= 0")
    rope_theta: float = knob(10000.0, "RoPE base frequency", "> 0")
    rope_scaling_factor: float = knob(0.0, "Llama 3 RoPE frequency scaling (Hugging Face rope_type llama3); 0: off, else >= 1", ">= 0")
    rope_low_freq_factor: float = knob(1.0, "Llama 3 RoPE scaling: low-frequency factor", "> 0")
    rope_high_freq_factor: float = knob(4.0, "Llama 3 RoPE scaling: high-frequency factor", "> 0")
    rope_original_max_len: int = knob(8192, "Llama 3 RoPE scaling: the original context length", "> 0")
    norm_eps: float = knob(1e-5, "RMSNorm epsilon", "> 0")
    tie_embeddings: bool = knob(False, "the output head is the transposed embedding (initialised at the head's scale)")
    dtype: Dtype = knob("auto", "compute dtype: auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16 | float16")
    param_dtype: Literal["float32", "bfloat16"] = knob("float32", "dtype the parameters are stored (and updated) in")
    remat: Literal["none", "full", "save_matmuls", "offload_matmuls", "offload_layer_inputs"] = knob(
        "none",
        "activation recomputation per layer in the backward pass; offload_*: what the backward keeps waits in host memory "
        "(offload_matmuls: the matmul outputs save_matmuls keeps; offload_layer_inputs: full remat's layer inputs)",
    )
    scan_layers: bool = knob(True, "one lax.scan over the layer stack (compile time flat in depth); false: a Python loop")
    attention: Literal["auto", "xla", "cudnn", "pallas"] = knob(
        "auto", "attention kernel: auto (cuDNN flash attention on GPU when it applies, packed documents too) | xla | cudnn | pallas"
    )
    fused_projections: bool = knob(True, "one QKV matmul and one gate/up matmul per layer; false: separate wq/wk/wv, w_gate/w_up")
    loss_chunk: int = knob(0, "tokens of the sequence per cross-entropy chunk (logits never whole); 0: the whole sequence", ">= 0")
    moe_experts: int = knob(0, "routed SwiGLU experts per MoE layer; 0: a dense decoder", ">= 0")
    moe_top_k: int = knob(2, "experts each token is sent to", ">= 1")
    moe_shared_experts: int = knob(0, "always-on experts beside the routed ones (DeepSeek)", ">= 0")
    moe_mlp_dim: int = knob(0, "each expert's SwiGLU width; 0: model.mlp_dim's resolved width", ">= 0")
    moe_first_dense: int = knob(0, "leading layers that keep a dense MLP", ">= 0")
    moe_router: Literal["softmax", "sigmoid"] = knob("softmax", "softmax: top k of the softmax (Mixtral) | sigmoid: DeepSeek-V3 scores")
    moe_renormalize: bool = knob(True, "softmax router: rescale the k chosen probabilities to sum to 1 (Mixtral)")
    moe_capacity_factor: float = knob(
        0.0, "<= 0: dropless; > 0: each expert takes ceil(tokens x k / experts x factor) rows, the rest drop", "any"
    )
    moe_aux_loss_coef: float = knob(0.0, "Switch / Megatron load-balancing loss coefficient (E x sum_i f_i P_i)", ">= 0")
    moe_z_loss_coef: float = knob(0.0, "router z-loss coefficient (mean logsumexp(logits)^2)", ">= 0")
    moe_bias_rate: float = knob(0.0, "aux-loss-free balancing: per-expert selection bias step per train step; 0: off", ">= 0")
    fp8: Literal["off", "current", "delayed"] = knob(
        "off", "fp8 matmuls: off | current (scales from this step's amax) | delayed (from an amax history)"
    )
    fp8_history: int = knob(16, "delayed scaling: steps of amax history per tensor", ">= 1")
    fp8_keep_ends: bool = knob(True, "the first and last decoder layers stay in the compute dtype")
    image_size: int = knob(32, "resnet: image height and width", "> 0")
    num_classes: int = knob(10, "resnet: classes", "> 0")
    resnet_widths: tuple[int, ...] = knob(None, "resnet: channels per stage", "> 0", factory=lambda: (16, 32, 64))
    resnet_blocks: int = knob(2, "resnet: residual blocks per stage", "> 0")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def resolved_mlp_dim(self) -> int:
        if self.mlp_dim:
            return self.mlp_dim
        return -(-int(8 * self.d_model / 3) // 64) * 64

    @property
    def resolved_moe_mlp_dim(self) -> int:
        return self.moe_mlp_dim or self.resolved_mlp_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe_experts > 0 and layer >= self.moe_first_dense


@dataclasses.dataclass
class TrainConfig(_Freezable):
    steps: int = knob(100, "the last step (--steps)", "> 0")
    schedule_steps: int = knob(0, "length of the learning-rate schedule; 0: train.steps (saved, so a resume can keep it)", ">= 0")
    stop_after_step: int = knob(0, "end this invocation after this step, saving a checkpoint (a planned interruption); 0: off", ">= 0")
    global_batch: int = knob(16, "sequences per step, over every device", "> 0")
    seq_len: int = knob(64, "tokens per sequence", "> 0")
    microbatches: int = knob(1, "gradient accumulation: the global batch in this many pieces per step", "> 0")
    lr: float = knob(3e-3, "peak learning rate", "> 0")
    schedule: Literal["cosine", "linear", "wsd", "constant"] = knob(
        "cosine", "after the warmup: cosine or linear decay to lr x min_lr_ratio, wsd (stable, then a linear decay), or constant"
    )
    min_lr_ratio: float = knob(0.1, "the schedule's floor as a fraction of train.lr", "[0, 1]")
    warmup_steps: int = knob(10, "linear warmup: step k of the first N trains at lr x k / N", ">= 0")
    decay_fraction: float = knob(0.2, "wsd: the last fraction of the schedule that decays", "(0, 1]")
    optimizer: Literal["adamw", "sgd", "muon"] = knob(
        "adamw", "adamw | sgd | muon (orthogonalised momentum on the hidden matrices; AdamW on embeddings, head, norms, router)"
    )
    muon_momentum: float = knob(0.95, "muon: momentum of the orthogonalised update", "[0, 1)")
    muon_nesterov: bool = knob(True, "muon: Nesterov momentum")
    muon_ns_steps: int = knob(5, "muon: Newton-Schulz iterations per orthogonalisation", ">= 1")
    muon_scale: Literal["match_adamw", "spectral", "none"] = knob(
        "match_adamw", "muon: update scale: match_adamw (0.2 sqrt(max(m,n)), AdamW's lr carries over) | spectral (sqrt(max(1,m/n))) | none"
    )
    momentum: float = knob(0.0, "sgd only: heavy-ball momentum (0: plain SGD)", "[0, 1)")
    weight_decay: float = knob(0.1, "decoupled (AdamW) or coupled (SGD) weight decay on matrices", ">= 0")
    beta1: float = knob(0.9, "Adam's first-moment decay", "[0, 1)")
    beta2: float = knob(0.95, "Adam's second-moment decay", "[0, 1)")
    grad_clip: float = knob(1.0, "global-norm clipping; 0 disables", ">= 0")
    optimizer_offload: bool = knob(
        False, "keep the optimizer state in pinned host memory; each step brings it to the devices for the update and back"
    )
    seed: int = knob(0, "initialisation and data-order seed (--seed)", "[0, 9223372036854775807]")
    log_every: int = knob(1, "steps between metrics.jsonl lines (--log-every)", "> 0")
    eval_every: int = knob(0, "steps between evaluations on the held-out tail; 0: none", ">= 0")
    eval_batches: int = knob(2, "batches per evaluation", "> 0")
    harness_tasks: str = knob("", "lm-evaluation-harness tasks run on the live weights during training, comma-separated; empty: none")
    harness_every: int = knob(0, "steps between harness_tasks evaluations; 0: at the last step only", ">= 0")
    harness_include_path: str = knob("", "a directory of lm-eval task YAMLs for harness_tasks (as jaxdist eval --include-path)")
    harness_limit: int = knob(0, "harness_tasks: at most this many documents per task (lm-eval's --limit); 0: all", ">= 0")
    harness_num_fewshot: int = knob(-1, "harness_tasks: few-shot examples per request; -1: each task's own", ">= -1")
    harness_batch_size: int = knob(16, "harness_tasks: requests per batch (rounded up to the batch axes' shards)", "> 0")
    harness_chat_template: bool = knob(False, "harness_tasks: render requests with the run's chat template (--apply-chat-template)")
    peak_flops: float = knob(0.0, "per-device peak FLOP/s for MFU; 0: look up (GPU) or measure (CPU)", ">= 0")
    nonfinite: Literal["halt", "skip"] = knob("halt", "a NaN/inf loss: halt (exit 3, last checkpoint intact) | skip (drop that update)")
    max_skips: int = knob(10, "with nonfinite=skip: halt (exit 3) after this many non-finite steps in a row", ">= 1")
    compile_cache: str = knob("auto", "XLA's persistent compilation cache: auto (RUN_DIR/xla_cache) | off | a directory")
    latency_profile: str = knob("model", "XLA:GPU's scheduler costs: model (the planner's price of each kernel) | off | a profile file")
    profile_steps: str = knob("", '"A:B": trace steps A..B into RUN_DIR/profile (--profile-steps)')
    loss_scale: str = knob("dynamic", "model.dtype=float16 only: dynamic (GradScaler's schedule) | a fixed positive number")
    straggler_factor: float = knob(1.3, "name a process whose own work per step is this many times the others' median", ">= 1")
    straggler_window: int = knob(50, "steps per straggler comparison (--straggler-window); 0: off", ">= 0")
    objective: Literal["lm", "dpo"] = knob(
        "lm", "lm: next-token cross-entropy | dpo: Direct Preference Optimization on data.source=preference pairs"
    )
    dpo_beta: float = knob(0.1, "dpo: the KL penalty's strength beta (rewards are beta x the log-ratio to the reference)", "> 0")
    dpo_label_smoothing: float = knob(0.0, "dpo (sigmoid): the share of pairs assumed mislabelled (cDPO)", "[0, 0.5)")
    dpo_loss: Literal["sigmoid", "ipo"] = knob(
        "sigmoid", "dpo: sigmoid (-log sigmoid(beta x margin)) | ipo ((margin - 1/(2 beta))^2 on per-token mean log-probs)"
    )

    def schedule_length(self) -> int:
        """Steps the learning-rate schedule spans: ``schedule_steps``, else ``steps``."""
        return self.schedule_steps or self.steps


@dataclasses.dataclass
class DataConfig(_Freezable):
    source: Literal["stdlib", "text", "tokens", "synthetic", "chat", "preference"] = knob(
        "stdlib",
        "stdlib (this Python's own sources, no download) | text (your files) | tokens (prepared shards) | synthetic | "
        'chat ({"messages": [...]} JSON Lines) | preference ({"prompt", "chosen", "rejected"} JSON Lines, for train.objective=dpo)',
    )
    path: str = knob("", "text: files, globs or a directory; tokens: a `jaxdist.data prepare` output directory")
    tokenizer: str = knob("", '"" or byte: byte-level; or a Hugging Face tokenizer.json / SentencePiece .model file')
    text_unit: Literal["file", "line"] = knob("file", "text: one document per file | per line (JSON Lines / Parquet: one per record)")
    text_field: str = knob("text", "text: the field (JSON Lines) or column (Parquet) that holds a record's text")
    bad_records: Literal["stop", "skip"] = knob(
        "stop", "text, chat, preference: a bad record (no such field, not UTF-8, a truncated file) stops the read | is skipped and counted"
    )
    cache_dir: str = knob("", 'tokens in object storage: a local folder keeping the blocks read across runs and processes ("": memory)')
    cache_gb: float = knob(10.0, "the size limit of data.cache_dir (least recently used blocks removed first)", "> 0")
    workers: int = knob(0, "Grain worker processes (0: read in the training process)", ">= 0")
    prefetch: int = knob(2, "global batches read ahead onto the devices", ">= 0")
    eval_fraction: float = knob(0.01, "the held-out tail of the corpus", "(0, 1)")
    shuffle: bool = knob(True, "shuffle the documents by seed")
    document_mask: bool = knob(True, "packed documents do not attend to each other")
    chat_template: str = knob(
        "", 'chat, preference: a Jinja chat template file; "": the chat_template of the tokenizer\'s tokenizer_config.json'
    )
    loss_on: Literal["assistant", "all"] = knob("assistant", "chat: the loss on the assistant's tokens only | on every token")
    chat_overflow: Literal["truncate", "drop"] = knob(
        "truncate", "chat: a conversation longer than train.seq_len is cut to it | left out (both counted in the log)"
    )
    reference_logps: str = knob("", 'preference: "": the reference model runs in each DPO step | an .npz of its log-probs (made if absent)')
    synthetic_latency_ms: float = knob(0.0, "benchmarking: every synthetic example first waits this long (slow storage)", ">= 0")


@dataclasses.dataclass
class CheckpointConfig(_Freezable):
    every_steps: int = knob(100, "steps between full checkpoints; 0: only at the end and on preemption", ">= 0")
    every_minutes: float = knob(0.0, "also save when this much time passed since the last save; 0: off", ">= 0")
    keep: int = knob(3, "the newest N full checkpoints are kept", ">= 1")
    keep_best: int = knob(0, "also keep the best N by eval loss", ">= 0")
    params_every_steps: int = knob(0, "weights-only checkpoints (RUN_DIR/params/STEP) between the full ones; 0: off", ">= 0")
    async_save: bool = knob(True, "write checkpoints in the background while training continues")
    local_dir: str = knob("", "save here first (NVMe, /dev/shm), copy finished checkpoints to the run dir behind the run; needed for s3://")
    remote_every_steps: int = knob(
        0, "with local_dir: steps from one copied checkpoint to the next (0: every one; the last always)", ">= 0"
    )


@dataclasses.dataclass
class ParallelConfig(_Freezable):
    mesh: str = knob("auto", "the device mesh (--mesh): AxB, name=size,... or auto")
    dcn_mesh: str = knob("", 'across-host part of the mesh (--dcn-mesh); "" derives it: data, then fsdp, cross hosts')
    strategy: str = knob("auto", "auto | dp | fsdp | zero1, optionally +tp")
    schedule: Literal["gpipe", "circular", "1f1b", "zb1", "zbv"] = knob(
        "gpipe",
        "pipeline schedule on a pipe axis (zb1: zero bubble in a line, each weight gradient run where the device would wait; "
        "zbv: zero bubble in a V, two chunks per device)",
    )
    pipeline_microbatches: int = knob(0, "pipeline microbatches per step (per accumulation microbatch); 0: the pipe size", ">= 0")
    virtual_stages: int = knob(1, "layer chunks per device (circular; with 1f1b: interleaved 1F1B)", ">= 1")
    pipeline_recompute: bool = knob(False, "1f1b: recompute each stage's forward in its backward instead of keeping its activations")
    grad_reduce: Literal["float32", "bfloat16", "int8", "topk"] = knob(
        "float32", "what gradients cross devices as: float32 | bfloat16 | int8 (block-quantized) | topk"
    )
    grad_topk_fraction: float = knob(0.01, "topk: the fraction of entries each device sends", "(0, 1]")
    error_feedback: bool | None = knob(None, "keep what compression dropped for the next step; unset: on for int8 and topk")
    compress_axes: Literal["all", "dcn"] = knob("all", "all | dcn (compress only across hosts; float32 inside a host)")
    diloco_inner_steps: int = knob(0, "DiLoCo: local steps per replica between outer steps (0: off; needs a replica axis > 1)", ">= 0")
    diloco_outer_lr: float = knob(0.7, "DiLoCo: the outer step's learning rate on the replica-averaged parameter delta", "> 0")
    diloco_outer_momentum: float = knob(0.9, "DiLoCo: the outer step's Nesterov momentum (0: plain SGD)", "[0, 1)")
    diloco_reduce: Literal["float32", "bfloat16", "int8"] = knob("float32", "DiLoCo: what the delta crosses the replica axis as")
    diloco_outer_dtype: Literal["", "float32", "bfloat16", "int8", "fp4"] = knob(
        "", "DiLoCo: what the outer average crosses the replica axis as (int8, fp4: a scale per block); unset: parallel.diloco_reduce"
    )
    diloco_fragments: int = knob(
        1, "Streaming DiLoCo: parts of the model, each synced at its own offset in a round (1: all at once)", ">= 1"
    )
    diloco_overlap_steps: int = knob(
        0, "Streaming DiLoCo: inner steps a fragment's outer average travels beside before it is applied (0: at once)", ">= 0"
    )
    diloco_overlap_mix: float = knob(
        0.5, "Streaming DiLoCo: the share of its own parameters a replica keeps when a late outer update lands", "[0, 1]"
    )
    replica_link_latency_ms: float = knob(0.0, "simulated slow link between replicas (experiments): latency per collective", ">= 0")
    replica_link_gbps: float = knob(0.0, "simulated slow link: bandwidth in Gbit/s (0: not simulated)", ">= 0")
    context_strategy: Literal["all_gather", "ring", "all_to_all"] = knob(
        "all_gather", "attention over a context axis: all_gather (K/V gathered) | ring | all_to_all (Ulysses: heads split, sequence whole)"
    )
    context_load_balance: bool = knob(True, "give context shard r sequence chunks r and 2N-1-r (even causal work)")
    expert_buffer_factor: float = knob(
        0.0, "expert axis, dropless: rows each device may send each other, as a multiple of its even share; 0: the worst case", ">= 0"
    )
    collective_matmul: bool = knob(False, "tensor axis: sequence-parallel layers whose gathers and reduce-scatters run beside the matmuls")


@dataclasses.dataclass
class LogConfig(_Freezable):
    wandb: bool = knob(False, "also log to Weights & Biases (process 0; the extra `wandb`; WANDB_MODE=offline works without a network)")
    wandb_project: str = knob("jaxdist", "W&B project")
    wandb_entity: str = knob("", 'W&B entity (team or user); "": the account\'s default')
    wandb_name: str = knob("", 'W&B run name; "": the run directory\'s name')


SECTIONS = {
    "model": ModelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "parallel": ParallelConfig,
    "log": LogConfig,
}


@dataclasses.dataclass
class Config(_Freezable):
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    name: str = "default"

    def to_dict(self) -> dict[str, Any]:
        def plain(value: Any) -> Any:
            return list(value) if isinstance(value, tuple) else value

        return {k: ({f: plain(x) for f, x in v.items()} if isinstance(v, dict) else v) for k, v in dataclasses.asdict(self).items()}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _nodes(config: Config) -> list[_Freezable]:
    return [config, *(getattr(config, section) for section in SECTIONS)]


def freeze(config: Config) -> Config:
    """Make ``config`` read-only (in place) and return it."""
    for node in _nodes(config):
        object.__setattr__(node, "_frozen", True)
    return config


def is_frozen(config: Config) -> bool:
    return bool(config.__dict__.get("_frozen"))


def unfrozen(config: Config) -> Config:
    """A copy of ``config`` that can be changed (the original stays as it is)."""
    copy = copy_module.deepcopy(config)
    for node in _nodes(copy):
        node.__dict__.pop("_frozen", None)
    return copy


def keys() -> dict[str, dataclasses.Field]:
    """Every dotted config key and its field."""
    return {f"{section}.{f.name}": f for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _choices(annotation: Any) -> tuple | None:
    return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else None


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check one value against its field's type; ints widen to floats, lists to tuples."""
    origin = typing.get_origin(annotation)
    choices = _choices(annotation)
    if choices is not None:
        if isinstance(value, bool):  # YAML 1.1 reads off/on/no/yes as booleans
            value = next((c for c in choices if yaml.safe_load(str(c)) is value), value)
        if isinstance(value, bool) or value not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    if origin in (tuple,):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = {a for a in typing.get_args(annotation) if a is not Ellipsis}
        return tuple(_coerce(key, v, item) for v in value)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            if option is type(None) and value is None:
                return None
            try:
                return _coerce(key, value, option)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {annotation}, got {value!r}")
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
        try:
            return float(value)
        except ValueError:
            pass
    if annotation is str and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)  # e.g. data.path=2024
    if annotation in (int, float, str, bool) and type(value) is not annotation:
        raise ConfigError(f"{key}: expected {annotation.__name__}, got {value!r}")
    return value


def _all_keys() -> list[str]:
    return ["name", *SECTIONS, *keys()]


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, _all_keys(), n=1, cutoff=0.75)
    hint = f" (did you mean {close[0]}?)" if close else " (python -m jaxdist.train --print-config lists the keys)"
    return ConfigError(f"unknown config key {key!r}{hint}")


def _apply(config: Config, key: str, value: Any, raw: str | None = None) -> None:
    """Set ``key``; ``raw`` is the override's text, taken as is for string fields (YAML
    would read ``off`` or ``no`` as a boolean)."""
    parts = key.split(".")
    target: Any = config
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(target) or part not in _field_types(type(target)):
            raise _unknown(".".join(parts[: i + 1]))
        annotation = _field_types(type(target))[part]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(getattr(target, part)):
                if not isinstance(value, dict):
                    raise ConfigError(f"{key}: expected a mapping, got {value!r}")
                for sub, subvalue in value.items():
                    _apply(config, f"{key}.{sub}", subvalue)
            else:
                if (annotation is str or _choices(annotation)) and raw is not None and not isinstance(value, str):
                    value = raw
                setattr(target, part, _coerce(key, value, annotation))
        else:
            target = getattr(target, part)


def resolve_config_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        candidate = path
    else:
        candidate = CONFIG_DIR / f"{name_or_path}.yaml"
    if not candidate.is_file():
        presets = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
        raise ConfigError(f"config {name_or_path!r} not found (no file {candidate}; presets: {presets})")
    return candidate


def load_config(name_or_path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML preset or file <- ``key=value`` overrides, then validated."""
    if not name_or_path:
        return config_from_dict({}, overrides)
    path = resolve_config_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path}: invalid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: expected a mapping at the top level")
    section = data.get("data")
    for key in ("tokenizer", "chat_template"):
        if isinstance(section, dict) and isinstance(section.get(key), str) and section[key] not in ("", "byte"):
            # a file's tokenizer path is relative to the file (``convert from-hf`` writes hf_source/tokenizer.json): the folder can move
            section = data["data"] = {**section, key: str(path.parent.absolute() / Path(section[key]).expanduser())}
    return config_from_dict({"name": path.stem, **data}, overrides)


def config_from_dict(data: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- a mapping (a preset's, or a checkpoint's saved config) <- overrides, validated."""
    config = Config()
    for key, value in data.items():
        if key == "name":
            config.name = str(value)
        else:
            _apply(config, key, value)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        _apply(config, key.strip(), value, raw)
    validate(config)
    return config


def _check_ranges(config: Config) -> None:
    """Every number against its field's range (finite first: nan and inf pass every ``<``); no
    credential in a URL (config.yaml would keep it)."""
    for key, field in keys().items():
        section, name = key.split(".")
        value, valid = getattr(getattr(config, section), name), field.metadata.get("valid")
        for item in value if isinstance(value, tuple) else (value,):
            why = range_violation(item, valid) if valid else credentials_violation(item)
            if why:
                raise ConfigError(f"{key} {why}" if not valid else f"{key} {why}, got {item!r}")


def validate(config: Config) -> None:
    """Checks that need no devices (types and choices were checked as the keys were set);
    mesh-dependent checks live in ``layout.validate.check_config_on_mesh``."""
    if not (NAME_PATTERN.fullmatch(config.name) and config.name not in (".", "..")):
        raise ConfigError(
            f"name {config.name!r} must be one path component of letters, digits, '.', '_' and '-' (it names the run directory); "
            "set name=... (a config file's name defaults to its file name)"
        )
    _check_ranges(config)
    check_rules(config)
