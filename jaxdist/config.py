"""Typed config tree: dataclasses, YAML presets and dotted ``key=value`` overrides.

Pure Python on purpose: the CLI validates a config before JAX starts, so bad input
costs no backend start-up and writes nothing.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from jaxdist.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
# A config's name becomes a folder under runs/: one path component, nothing that could climb out.
NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]+")


@dataclasses.dataclass
class ModelConfig:
    kind: str = "llama"  # llama | resnet
    vocab_size: int = 0  # 0: what the data's tokenizer needs, rounded up to a multiple of 128
    valid_vocab: int = 0  # ids >= this are padding rows (an imported vocab padded to 128): logits -inf, never sampled; 0: all ids
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 0  # 0 -> d_model // n_heads
    mlp_dim: int = 0  # 0 -> SwiGLU width 8/3 * d_model rounded up to a multiple of 64
    rope_theta: float = 10000.0
    # Llama 3's RoPE frequency scaling (rope_scaling.rope_type "llama3" in Hugging Face configs); factor 0: off
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "auto"  # compute dtype: auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16
    param_dtype: str = "float32"
    remat: str = "none"  # none | full | save_matmuls
    scan_layers: bool = True  # one lax.scan over the layer stack (compile time flat in depth); false: a Python loop
    attention: str = "auto"  # auto (cuDNN flash attention on GPU when it applies, packed documents too) | xla | cudnn | pallas
    fused_projections: bool = True  # one QKV matmul and one gate/up matmul per layer; false: separate wq/wk/wv, w_gate/w_up
    loss_chunk: int = 0  # tokens of the sequence per cross-entropy chunk (logits never whole); 0: whole sequence
    # mixture of experts (models.moe): 0 experts = a dense decoder
    moe_experts: int = 0  # routed SwiGLU experts per MoE layer
    moe_top_k: int = 2  # experts each token is sent to
    moe_shared_experts: int = 0  # always-on experts beside the routed ones (DeepSeek)
    moe_mlp_dim: int = 0  # each expert's SwiGLU width; 0: model.mlp_dim's resolved width
    moe_first_dense: int = 0  # leading layers that keep a dense MLP
    moe_router: str = "softmax"  # softmax (top-k of the softmax, renormalised) | sigmoid (DeepSeek-V3 scores)
    moe_renormalize: bool = True  # softmax: rescale the k chosen probabilities to sum to 1 (Mixtral)
    moe_capacity_factor: float = 0.0  # <= 0: dropless; > 0: each expert takes ceil(tokens x k / experts x factor), the rest drop
    moe_aux_loss_coef: float = 0.0  # Switch / Megatron load-balancing loss E x sum_i f_i P_i (from global counts)
    moe_z_loss_coef: float = 0.0  # router z-loss: mean logsumexp(logits)^2
    moe_bias_rate: float = 0.0  # aux-loss-free balancing: per-expert selection bias moved by this much per step; 0: off
    # fp8 matmuls (models.fp8): off | current (scales from this step's amax) | delayed (from an amax history)
    fp8: str = "off"
    fp8_history: int = 16  # delayed scaling: steps of amax history per tensor
    fp8_keep_ends: bool = True  # the first and last decoder layers stay in the compute dtype
    # resnet only
    image_size: int = 32
    num_classes: int = 10
    resnet_widths: tuple[int, ...] = (16, 32, 64)
    resnet_blocks: int = 2  # residual blocks per stage

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
class TrainConfig:
    steps: int = 100
    schedule_steps: int = 0  # length of the warmup + cosine schedule; 0: train.steps (saved, so a resume can keep it)
    stop_after_step: int = 0  # end this invocation after this step, saving a checkpoint (a planned interruption); 0: off
    global_batch: int = 16
    seq_len: int = 64
    microbatches: int = 1  # gradient accumulation
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    optimizer: str = "adamw"  # adamw | sgd
    momentum: float = 0.0  # sgd only: heavy-ball momentum (0: plain SGD)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    seed: int = 0
    log_every: int = 1
    eval_every: int = 0  # 0: no periodic eval
    eval_batches: int = 2
    peak_flops: float = 0.0  # per device, for MFU; 0: look up (GPU) or measure (CPU)
    nonfinite: str = "halt"  # a NaN/inf loss: halt (exit 3, last checkpoint intact) | skip (drop that update)
    max_skips: int = 10  # with nonfinite=skip: halt (exit 3) after this many non-finite steps in a row
    compile_cache: str = "auto"  # XLA's persistent compilation cache: auto (RUN_DIR/xla_cache) | off | a directory
    profile_steps: str = ""  # "A:B": trace steps A..B into RUN_DIR/profile (--profile-steps)
    loss_scale: str = "dynamic"  # model.dtype=float16 only: dynamic (GradScaler's schedule) | a fixed number


@dataclasses.dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib | text | tokens | synthetic
    path: str = ""  # text: files, globs or a directory; tokens: a `jaxdist.data prepare` output dir
    tokenizer: str = ""  # "" = byte-level; or a Hugging Face tokenizer.json / SentencePiece .model file
    text_unit: str = "file"  # text: one document per file | line
    workers: int = 0  # Grain worker processes (0: read in the training process)
    prefetch: int = 2  # batches read ahead
    eval_fraction: float = 0.01  # the held-out tail of the corpus
    shuffle: bool = True
    document_mask: bool = True  # packed documents do not attend to each other
    synthetic_latency_ms: float = 0.0  # benchmarking knob: every synthetic example read first waits this long (slow storage)


@dataclasses.dataclass
class CheckpointConfig:
    every_steps: int = 100  # 0: only at the end and on preemption
    every_minutes: float = 0.0  # also save when this much time passed since the last save
    keep: int = 3  # the newest N
    keep_best: int = 0  # also keep the best N by eval loss
    params_every_steps: int = 0  # weights-only checkpoints (RUN_DIR/params/STEP) between the full ones; 0: off
    async_save: bool = True


@dataclasses.dataclass
class ParallelConfig:
    mesh: str = "auto"  # the --mesh flag overrides this
    dcn_mesh: str = ""  # across-host part of the mesh (--dcn-mesh); "" derives it: data, then fsdp, cross hosts
    strategy: str = "auto"  # auto | dp | fsdp | zero1, optionally "+tp"
    schedule: str = "gpipe"  # pipeline schedule on a pipe axis: gpipe | circular | 1f1b
    pipeline_microbatches: int = 0  # M per step (per gradient-accumulation microbatch); 0: the pipe size
    virtual_stages: int = 1  # V layer chunks per device (circular; with 1f1b: interleaved 1F1B)
    pipeline_recompute: bool = False  # 1f1b: recompute each stage's forward in its backward instead of keeping its activations
    grad_reduce: str = "float32"  # what gradients cross devices as: float32 | bfloat16 | int8 (block-quantized) | topk
    grad_topk_fraction: float = 0.01  # topk: the fraction of entries each device sends
    error_feedback: bool | None = None  # keep what compression dropped for the next step; None: on for int8 and topk
    compress_axes: str = "all"  # all | dcn (compress only across hosts; fp32 inside a host)
    diloco_inner_steps: int = 0  # DiLoCo: H local steps per replica between outer steps (0: off; needs a replica axis > 1)
    diloco_outer_lr: float = 0.7  # the outer step's learning rate on the replica-averaged parameter delta
    diloco_outer_momentum: float = 0.9  # its Nesterov momentum (0: plain SGD)
    diloco_reduce: str = "float32"  # what the delta crosses the replica axis as: float32 | bfloat16 | int8
    replica_link_latency_ms: float = 0.0  # simulated slow link between replicas (experiments): per collective
    replica_link_gbps: float = 0.0  # its bandwidth in Gbit/s (0: not simulated)
    context_strategy: str = "all_gather"  # attention over a context axis: all_gather (K/V gathered) | ring (K/V passed around)
    context_load_balance: bool = True  # give context shard r sequence chunks r and 2N-1-r (even causal work)
    # expert axis, dropless routing: rows each device may send each other device, as a multiple of its
    # even share (tokens x k / expert); 0: the worst case (never overflows); overflow is dropped and counted
    expert_buffer_factor: float = 0.0


@dataclasses.dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    name: str = "default"

    def to_dict(self) -> dict[str, Any]:
        def plain(value: Any) -> Any:
            return list(value) if isinstance(value, tuple) else value

        return {k: ({f: plain(x) for f, x in v.items()} if isinstance(v, dict) else v) for k, v in dataclasses.asdict(self).items()}


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check one value against its field's type; ints widen to floats, lists to tuples."""
    origin = typing.get_origin(annotation)
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


def _apply(config: Config, key: str, value: Any, raw: str | None = None) -> None:
    """Set ``key``; ``raw`` is the override's text, taken as is for string fields (YAML
    would read ``off`` or ``no`` as a boolean)."""
    parts = key.split(".")
    target: Any = config
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(target) or part not in _field_types(type(target)):
            raise ConfigError(f"unknown config key {'.'.join(parts[: i + 1])!r}")
        annotation = _field_types(type(target))[part]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(getattr(target, part)):
                if not isinstance(value, dict):
                    raise ConfigError(f"{key}: expected a mapping, got {value!r}")
                for sub, subvalue in value.items():
                    _apply(config, f"{key}.{sub}", subvalue)
            else:
                if annotation is str and raw is not None and not isinstance(value, str):
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
    if isinstance(section, dict) and isinstance(section.get("tokenizer"), str) and section["tokenizer"] not in ("", "byte"):
        # a file's tokenizer path is relative to the file (``convert from-hf`` writes hf_source/tokenizer.json): the folder can move
        data["data"] = {**section, "tokenizer": str(path.parent.absolute() / Path(section["tokenizer"]).expanduser())}
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


def profile_window(spec: str) -> tuple[int, int]:
    """``"A:B"`` -> (A, B), the first and last traced step."""
    first, sep, last = spec.partition(":")
    if not (sep and first.strip().isdigit() and last.strip().isdigit()):
        raise ConfigError(f"train.profile_steps {spec!r}: expected A:B, e.g. 5:8")
    return int(first), int(last)


def _positive_number(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(config: Config) -> None:
    """Checks that need no devices; mesh-dependent checks live in ``validate.check_config_on_mesh``."""
    _require(
        bool(NAME_PATTERN.fullmatch(config.name)) and config.name not in (".", ".."),
        f"name {config.name!r} must be one path component of letters, digits, '.', '_' and '-' (it names the run directory); "
        "set name=... (a config file's name defaults to its file name)",
    )
    m, t = config.model, config.train
    _require(m.kind in ("llama", "resnet"), f"model.kind must be llama or resnet, got {m.kind!r}")
    _require(
        m.dtype in ("auto", "float32", "bfloat16", "float16"), f"model.dtype must be auto, float32, bfloat16 or float16, got {m.dtype!r}"
    )
    _require(m.param_dtype in ("float32", "bfloat16"), f"model.param_dtype must be float32 or bfloat16, got {m.param_dtype!r}")
    _require(m.attention in ("auto", "xla", "cudnn", "pallas"), f"model.attention must be auto, xla, cudnn or pallas, got {m.attention!r}")
    _require(m.remat in ("none", "full", "save_matmuls"), f"model.remat must be none, full or save_matmuls, got {m.remat!r}")
    _require(m.fp8 in ("off", "current", "delayed"), f"model.fp8 must be off, current or delayed, got {m.fp8!r}")
    _require(m.fp8_history >= 1, f"model.fp8_history must be >= 1, got {m.fp8_history}")
    if m.fp8 != "off":
        _require(m.kind == "llama", f"model.fp8 is for the llama decoder's matmuls, not model.kind={m.kind}")
        _require(
            m.dtype in ("auto", "bfloat16"),
            f"model.fp8={m.fp8} needs bfloat16 compute (model.dtype=bfloat16), got model.dtype={m.dtype}",
        )
        _require(
            not m.fp8_keep_ends or m.n_layers > 2,
            f"model.fp8={m.fp8} with model.fp8_keep_ends=true leaves none of the {m.n_layers} layers in fp8 (set model.fp8_keep_ends=false)",
        )
    _require(m.loss_chunk >= 0, f"model.loss_chunk must be >= 0 (0: the whole sequence), got {m.loss_chunk}")
    _require(m.vocab_size >= 0, f"model.vocab_size must be >= 0 (0: from the tokenizer), got {m.vocab_size}")
    _require(
        m.valid_vocab == 0 or (m.valid_vocab > 0 and (m.vocab_size == 0 or m.valid_vocab <= m.vocab_size)),
        f"model.valid_vocab must be 0 (all ids) or in 1..model.vocab_size ({m.vocab_size}), got {m.valid_vocab}",
    )
    if m.rope_scaling_factor:
        _require(
            m.rope_scaling_factor >= 1 and m.rope_high_freq_factor > m.rope_low_freq_factor > 0 and m.rope_original_max_len > 0,
            "model.rope_scaling_factor needs factor >= 1, rope_high_freq_factor > rope_low_freq_factor > 0 and rope_original_max_len > 0",
        )
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads"):
        _require(getattr(m, name) > 0, f"model.{name} must be positive, got {getattr(m, name)}")
    _require(m.n_heads % m.n_kv_heads == 0, f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({m.n_kv_heads})")
    _require(
        m.head_dim > 0 or m.d_model % m.n_heads == 0,
        f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads}) unless model.head_dim is set",
    )
    _require(m.resolved_head_dim % 2 == 0, f"head dim must be even for RoPE, got {m.resolved_head_dim}")
    for name in ("steps", "global_batch", "seq_len", "microbatches", "log_every", "eval_batches"):
        _require(getattr(t, name) > 0, f"train.{name} must be positive, got {getattr(t, name)}")
    _require(t.schedule_steps >= 0, f"train.schedule_steps must be >= 0 (0: train.steps), got {t.schedule_steps}")
    _require(
        0 <= t.stop_after_step <= t.steps, f"train.stop_after_step must be in 0..train.steps ({t.steps}) (0: off), got {t.stop_after_step}"
    )
    _require(t.lr > 0, f"train.lr must be positive, got {t.lr}")
    _require(t.optimizer in ("adamw", "sgd"), f"train.optimizer must be adamw or sgd, got {t.optimizer!r}")
    _require(0 <= t.momentum < 1, f"train.momentum must be in [0, 1), got {t.momentum}")
    _require(t.nonfinite in ("halt", "skip"), f"train.nonfinite must be halt or skip, got {t.nonfinite!r}")
    _require(t.max_skips >= 1, f"train.max_skips must be >= 1, got {t.max_skips}")
    if t.profile_steps:
        first, last = profile_window(t.profile_steps)
        _require(1 <= first <= last <= t.steps, f"train.profile_steps {t.profile_steps}: need 1 <= A <= B <= train.steps ({t.steps})")
    if m.dtype == "float16":
        _require(
            t.loss_scale == "dynamic" or _positive_number(t.loss_scale),
            f"train.loss_scale must be dynamic or a positive number with model.dtype=float16, got {t.loss_scale!r}",
        )
    _require(t.warmup_steps >= 0 and t.eval_every >= 0, "train.warmup_steps and train.eval_every must be >= 0")
    _require(
        t.global_batch % t.microbatches == 0,
        f"train.global_batch ({t.global_batch}) must be divisible by train.microbatches ({t.microbatches})",
    )
    d = config.data
    _require(
        d.source in ("stdlib", "text", "tokens", "synthetic"), f"data.source must be stdlib, text, tokens or synthetic, got {d.source!r}"
    )
    _require(d.text_unit in ("file", "line"), f"data.text_unit must be file or line, got {d.text_unit!r}")
    _require(d.workers >= 0 and d.prefetch >= 0, "data.workers and data.prefetch must be >= 0")
    _require(d.synthetic_latency_ms >= 0, f"data.synthetic_latency_ms must be >= 0, got {d.synthetic_latency_ms}")
    _require(0 < d.eval_fraction < 1, f"data.eval_fraction must be in (0, 1), got {d.eval_fraction}")
    _require(
        config.checkpoint.params_every_steps >= 0,
        f"checkpoint.params_every_steps must be >= 0 (0: no weights-only checkpoints), got {config.checkpoint.params_every_steps}",
    )
    p = config.parallel
    _require(p.schedule in ("gpipe", "circular", "1f1b"), f"parallel.schedule must be gpipe, circular or 1f1b, got {p.schedule!r}")
    _require(
        p.pipeline_microbatches >= 0 and p.virtual_stages >= 1,
        "parallel.pipeline_microbatches must be >= 0 and parallel.virtual_stages >= 1",
    )
    _require(
        p.grad_reduce in ("float32", "bfloat16", "int8", "topk"),
        f"parallel.grad_reduce must be float32, bfloat16, int8 or topk, got {p.grad_reduce!r}",
    )
    _require(0 < p.grad_topk_fraction <= 1, f"parallel.grad_topk_fraction must be in (0, 1], got {p.grad_topk_fraction}")
    _require(p.compress_axes in ("all", "dcn"), f"parallel.compress_axes must be all or dcn, got {p.compress_axes!r}")
    _require(p.diloco_inner_steps >= 0, f"parallel.diloco_inner_steps must be >= 0 (0: off), got {p.diloco_inner_steps}")
    _require(p.diloco_outer_lr > 0, f"parallel.diloco_outer_lr must be positive, got {p.diloco_outer_lr}")
    _require(0 <= p.diloco_outer_momentum < 1, f"parallel.diloco_outer_momentum must be in [0, 1), got {p.diloco_outer_momentum}")
    _require(
        p.diloco_reduce in ("float32", "bfloat16", "int8"),
        f"parallel.diloco_reduce must be float32, bfloat16 or int8, got {p.diloco_reduce!r}",
    )
    _require(
        p.replica_link_latency_ms >= 0 and p.replica_link_gbps >= 0,
        "parallel.replica_link_latency_ms and parallel.replica_link_gbps must be >= 0",
    )
    strategy_parts = set(config.parallel.strategy.split("+"))
    _require(
        strategy_parts <= {"auto", "dp", "fsdp", "zero1", "tp"} and len(strategy_parts & {"auto", "dp", "fsdp", "zero1"}) <= 1,
        f"parallel.strategy must be auto, dp, fsdp or zero1, optionally with +tp, got {config.parallel.strategy!r}",
    )
