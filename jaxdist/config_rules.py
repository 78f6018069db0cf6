"""The config's cross-key rules: checks that relate several keys and need no devices
(types, choices and ranges are checked as the keys are set, in ``jaxdist.config``;
mesh-dependent checks live in ``layout.validate.check_config_on_mesh``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from jaxdist.errors import ConfigError


def profile_window(spec: str) -> tuple[int, int]:
    """``"A:B"`` -> (A, B), the first and last traced step."""
    first, sep, last = spec.partition(":")
    if not (sep and first.strip().isdigit() and last.strip().isdigit()):
        raise ConfigError(f"train.profile_steps {spec!r}: expected A:B, e.g. 5:8")
    return int(first), int(last)


def _positive_number(text: str) -> bool:
    try:
        return math.isfinite(float(text)) and float(text) > 0
    except ValueError:
        return False


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def check_rules(config: Any) -> None:
    """Raise ``ConfigError`` on the first rule a ``jaxdist.config.Config`` breaks (typed ``Any``:
    this module sits below ``jaxdist.config``, which calls it)."""
    m, t = config.model, config.train
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
    _require(
        m.valid_vocab == 0 or m.vocab_size == 0 or m.valid_vocab <= m.vocab_size,
        f"model.valid_vocab must be 0 (all ids) or in 1..model.vocab_size ({m.vocab_size}), got {m.valid_vocab}",
    )
    if m.rope_scaling_factor:
        _require(
            m.rope_scaling_factor >= 1 and m.rope_high_freq_factor > m.rope_low_freq_factor,
            "model.rope_scaling_factor needs factor >= 1 and rope_high_freq_factor > rope_low_freq_factor",
        )
    _require(m.n_heads % m.n_kv_heads == 0, f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({m.n_kv_heads})")
    _require(
        m.head_dim > 0 or m.d_model % m.n_heads == 0,
        f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads}) unless model.head_dim is set",
    )
    _require(m.resolved_head_dim % 2 == 0, f"head dim must be even for RoPE, got {m.resolved_head_dim}")
    if m.moe_experts and m.kind == "llama":
        _require(
            1 <= m.moe_top_k <= m.moe_experts, f"model.moe_top_k ({m.moe_top_k}) must be between 1 and model.moe_experts ({m.moe_experts})"
        )
        _require(
            m.moe_first_dense < m.n_layers,
            f"model.moe_first_dense ({m.moe_first_dense}) must leave at least one of the {m.n_layers} layers an MoE layer",
        )
    _require(t.stop_after_step <= t.steps, f"train.stop_after_step must be in 0..train.steps ({t.steps}) (0: off), got {t.stop_after_step}")
    if t.profile_steps:
        first, last = profile_window(t.profile_steps)
        _require(1 <= first <= last <= t.steps, f"train.profile_steps {t.profile_steps}: need 1 <= A <= B <= train.steps ({t.steps})")
    if m.dtype == "float16":
        _require(
            t.loss_scale == "dynamic" or _positive_number(t.loss_scale),
            f"train.loss_scale must be dynamic or a positive number with model.dtype=float16, got {t.loss_scale!r}",
        )
    _require(
        t.global_batch % t.microbatches == 0,
        f"train.global_batch ({t.global_batch}) must be divisible by train.microbatches ({t.microbatches})",
    )
    _require(
        t.latency_profile in ("model", "off") or Path(t.latency_profile).expanduser().is_file(),
        f"train.latency_profile must be model, off or a profile file that exists, got {t.latency_profile!r}",
    )
    _check_objective(config)
    strategy_parts = set(config.parallel.strategy.split("+"))
    _require(
        strategy_parts <= {"auto", "dp", "fsdp", "zero1", "tp"} and len(strategy_parts & {"auto", "dp", "fsdp", "zero1"}) <= 1,
        f"parallel.strategy must be auto, dp, fsdp or zero1, optionally with +tp, got {config.parallel.strategy!r}",
    )


def _check_objective(config: Any) -> None:
    """``train.objective=dpo``: preference pairs, a dense decoder, one step one batch (the mesh's
    part is ``layout.validate``'s)."""
    m, t, d = config.model, config.train, config.data
    dpo = t.objective == "dpo"
    _require(
        dpo == (d.source == "preference"),
        "train.objective=dpo trains on data.source=preference (prompt/chosen/rejected pairs), and that source is only for it; "
        f"got train.objective={t.objective} with data.source={d.source}",
    )
    if not dpo:
        return
    _require(m.kind == "llama", f"train.objective=dpo is for the llama decoder, not model.kind={m.kind}")
    _require(
        m.moe_experts == 0,
        "train.objective=dpo does not support MoE (model.moe_experts > 0) yet: its balancing terms are an lm objective's",
    )
    _require(t.microbatches == 1, f"train.objective=dpo does not support train.microbatches={t.microbatches} yet (use 1)")
    _require(t.eval_every == 0, "train.objective=dpo has no held-out evaluation yet: set train.eval_every=0")
    _require(
        m.fp8 != "delayed", "train.objective=dpo does not support model.fp8=delayed (the frozen reference would keep stale amax histories)"
    )
