"""The planner's search: enumerate layouts, screen them, compile the promising ones.

Candidates are every (data, fsdp, tensor, pipe) mesh whose product is the GPU count, with
``tensor`` inside a node, every microbatch count and remat policy that
``jaxdist.layout.validate.check_config_on_mesh`` accepts. Each is screened without compiling:
model states (16 bytes per parameter, sharded as the mesh shards them) plus activations
(Korthikanti et al. 2022's per-layer counts) must fit the device, and a rough time (6 x
params x tokens, remat's recompute, the pipeline bubble) orders them. Then they are
compiled best-first against fake CPU devices until the time budget runs out; each compile
is cached on disk (``~/.cache/jaxdist/plan``), keyed by the resolved config and the JAX
version, so a rerun is fast.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from jaxdist.config import Config
from jaxdist.errors import JaxdistError
from jaxdist.layout.mesh import format_mesh, parse_mesh

REMATS = ("none", "save_matmuls", "full")
RECOMPUTE = {"none": 1.0, "save_matmuls": 1.1, "full": 4 / 3}  # training FLOPs with remat / without
STATE_BYTES_PER_PARAM = 16  # fp32 params, grads, Adam's two moments
HEADROOM = 0.9  # plan to use at most this share of device memory


@dataclasses.dataclass(frozen=True)
class Candidate:
    mesh: tuple[tuple[str, int], ...]  # (axis, size) for data, fsdp, tensor, pipe
    microbatches: int
    remat: str

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def mesh_spec(self) -> str:
        return format_mesh(parse_mesh(",".join(f"{a}={n}" for a, n in self.mesh)))

    def overrides(self) -> list[str]:
        return [f"parallel.mesh={self.mesh_spec}", f"train.microbatches={self.microbatches}", f"model.remat={self.remat}"]

    def label(self) -> str:
        return f"{self.mesh_spec} mb={self.microbatches} remat={self.remat}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def configured(config: Config, candidate: Candidate) -> Config:
    out = copy.deepcopy(config)
    out.parallel.mesh, out.train.microbatches, out.model.remat = candidate.mesh_spec, candidate.microbatches, candidate.remat
    out.parallel.strategy = "auto"  # fsdp where the mesh has an fsdp axis, tensor parallel where it has a tensor axis
    return out


def enumerate_candidates(config: Config, gpus: int, gpus_per_node: int) -> list[Candidate]:
    """Every layout of ``config`` on ``gpus`` devices that jaxdist accepts."""
    from jaxdist.layout.validate import check_config_on_mesh

    out = []
    batch = config.train.global_batch
    for pipe in divisors(gpus):
        for tensor in (t for t in divisors(gpus // pipe) if t <= gpus_per_node):
            for fsdp in divisors(gpus // (pipe * tensor)):
                data = gpus // (pipe * tensor * fsdp)
                mesh = (("data", data), ("fsdp", fsdp), ("tensor", tensor), ("pipe", pipe))
                shards = data * fsdp
                for microbatches in (m for m in (1, 2, 4, 8, 16) if batch % (shards * m) == 0):
                    for remat in REMATS:
                        candidate = Candidate(mesh, microbatches, remat)
                        try:
                            check_config_on_mesh(configured(config, candidate), parse_mesh(candidate.mesh_spec))
                        except JaxdistError:
                            continue
                        out.append(candidate)
    return out


# ---------------------------------------------------------------------------------------------
# Screening without compiling


def estimated_memory(config: Config, candidate: Candidate, n_params: int, fused_attention: bool) -> float:
    """Bytes per device: model states sharded by fsdp x tensor x pipe, plus activations.

    Activations per layer and microbatch row (Korthikanti et al. 2022, 16-bit, tensor size
    t, no sequence parallelism): s d (10 + 24 / t) bytes, plus 5 h s^2 / t without a fused
    attention; full remat keeps only each layer's input (2 s d) plus one layer's working
    set; save_matmuls about half. The fp32 logits (and their gradient) of one microbatch
    come on top.
    """
    m, t = config.model, config.train
    sizes = candidate.sizes
    shards = sizes["fsdp"] * sizes["tensor"] * sizes["pipe"]
    states = STATE_BYTES_PER_PARAM * n_params / shards
    rows = t.global_batch // (sizes["data"] * sizes["fsdp"] * candidate.microbatches)
    s, d, tp = t.seq_len, m.d_model, sizes["tensor"]
    per_layer = s * d * (10 + 24 / tp) + (0 if fused_attention else 5 * m.n_heads * s * s / tp)
    layers = m.n_layers // sizes["pipe"]
    in_flight = sizes["pipe"] if sizes["pipe"] > 1 else 1  # 1F1B-like: S microbatches alive per stage
    kept = {"none": per_layer * layers, "save_matmuls": per_layer * layers / 2, "full": 2 * s * d * layers + per_layer}[candidate.remat]
    logits = 2 * 4 * s * m.vocab_size / tp
    return states + rows * (kept * in_flight + logits)


def estimated_time(config: Config, candidate: Candidate, n_params: int, flops_per_device: float) -> float:
    """Seconds per step, roughly: compute with remat's recompute, stretched by the bubble."""
    t, sizes = config.train, candidate.sizes
    devices = math.prod(sizes.values())
    compute = 6 * n_params * t.global_batch * t.seq_len / devices / flops_per_device * RECOMPUTE[candidate.remat]
    pipe = sizes["pipe"]
    if pipe > 1:
        m = max(config.parallel.pipeline_microbatches or pipe, 1)
        compute *= (m + pipe - 1) / m
    comm_penalty = 1 + 0.05 * (sizes["tensor"] > 1) + 0.02 * math.log2(sizes["tensor"])
    return compute * comm_penalty


# ---------------------------------------------------------------------------------------------
# Compiling (cached)


def cache_dir() -> Path:
    root = os.environ.get("JAXDIST_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "jaxdist") / "plan"


def cache_key(config: Config) -> str:
    import jax

    payload = json.dumps({"config": config.to_dict(), "jax": jax.__version__, "format": 5}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def compile_summary(config: Config, *, cache: Path | None = None) -> tuple[dict[str, Any], bool]:
    """(what the cost model needs from ``config``'s compiled train step, whether it came
    from the cache). Needs as many JAX devices as the config's mesh."""
    cache = cache_dir() if cache is None else cache
    path = cache / f"{cache_key(config)}.json"
    if path.is_file():
        try:
            return json.loads(path.read_text()), True
        except (OSError, ValueError):
            pass  # a damaged entry is compiled again
    summary = _compile(config)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary))
        os.replace(tmp, path)
    except OSError:
        pass  # no cache is slower, not wrong
    return summary, False


def _compile(config: Config) -> dict[str, Any]:
    import jax

    from jaxdist.inspect.step_report import memory, pipeline_of
    from jaxdist.plan.hlo_cost import program_cost
    from jaxdist.training.compiled import compile_train_step

    sizes = parse_mesh(config.parallel.mesh)
    devices = math.prod(sizes.values())
    if len(jax.devices("cpu")) < devices:
        raise JaxdistError(
            f"compiling for {devices} devices needs XLA_FLAGS=--xla_force_host_platform_device_count={devices} before JAX starts"
        )
    trainer, compiled = compile_train_step(config, sizes, jax.devices("cpu")[:devices])  # CPU even on a GPU machine
    mesh_shape = {a: int(n) for a, n in trainer.layout.mesh.shape.items()}
    heads = max(config.model.n_heads // mesh_shape.get("tensor", 1), 1)
    cost = program_cost(compiled.as_text(), mesh_shape, config.train.seq_len, heads)
    spec = pipeline_of(trainer)
    return {
        "program": cost.to_dict(),
        "memory": memory(compiled),
        "params": int(trainer.n_params),
        "model_flops_per_step": float(trainer.task.flops_per_example * config.train.global_batch),
        "tokens_per_step": float(trainer.task.tokens_per_example * config.train.global_batch),
        "bubble": float(spec.bubble) if spec is not None else 0.0,
        "mesh": mesh_shape,
    }
