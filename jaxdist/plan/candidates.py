"""The planner's candidates: one layout each (a mesh, microbatches, a remat policy and the
other levers the search tries), the config it runs as, and the enumeration of every candidate
``jaxdist.layout.validate`` accepts. ``plan.search`` screens, ranks and compiles them."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections import Counter

from jaxdist.config import Config
from jaxdist.errors import JaxdistError
from jaxdist.layout.mesh import format_mesh, parse_mesh
from jaxdist.layout.validate import check_config_on_mesh
from jaxdist.parallel.pipeline_schedule import pipeline_spec
from jaxdist.plan.context_cost import CONTEXT_STRATEGIES

REMATS = ("none", "save_matmuls", "full")
# On a GPU target only (a host link in the profile, XLA:GPU's program to show the copies): CPU
# devices offload nothing. offload_matmuls is left out: it saves little over save_matmuls
# (training/README.md, "Recomputation and activation offload").
OFFLOAD_REMATS = ("offload_layer_inputs",)
# train.optimizer_offload is tried (GPU targets) where activations are already at their least:
# it trades two moves of the state over the host link per step for its 8 bytes a parameter
OPTIMIZER_OFFLOAD_REMATS = ("full", "offload_layer_inputs")
LAYOUT_AXES = ("data", "fsdp", "expert", "context", "tensor", "pipe")


@dataclasses.dataclass(frozen=True)
class Candidate:
    mesh: tuple[tuple[str, int], ...]  # (axis, size) for data, fsdp, expert, context, tensor, pipe (an axis left out is 1)
    microbatches: int
    remat: str
    context_strategy: str = ""  # all_gather | ring | all_to_all with a context axis; "" without one
    pipeline_recompute: bool | None = None  # 1F1B on a pipe axis: recompute each stage's forward (True) or keep it (False)
    optimizer_offload: bool = False  # train.optimizer_offload: the optimizer state in host memory
    scan_layers: bool = True  # model.scan_layers: false for the layers in a Python loop (tried last, on the fastest)
    collective_matmul: bool = False  # parallel.collective_matmul (tried on the fastest with a tensor axis)
    schedule: str = ""  # on a pipe axis, where the search tries schedules (plan --schedules): a PIPELINE_SCHEDULES name

    @property
    def sizes(self) -> dict[str, int]:
        return {axis: 1 for axis in LAYOUT_AXES} | dict(self.mesh)

    @property
    def mesh_spec(self) -> str:
        return format_mesh(parse_mesh(",".join(f"{a}={n}" for a, n in self.mesh)))

    def overrides(self) -> list[str]:
        out = [f"parallel.mesh={self.mesh_spec}", f"train.microbatches={self.microbatches}", f"model.remat={self.remat}"]
        out += [f"parallel.pipeline_recompute={str(self.pipeline_recompute).lower()}"] if self.pipeline_recompute is not None else []
        out += ["train.optimizer_offload=true"] if self.optimizer_offload else []
        out += [] if self.scan_layers else ["model.scan_layers=false"]
        out += ["parallel.collective_matmul=true"] if self.collective_matmul else []
        if self.schedule:
            schedule, virtual = schedule_settings(self.schedule)
            out += [f"parallel.schedule={schedule}", f"parallel.virtual_stages={virtual}"]
        return out + ([f"parallel.context_strategy={self.context_strategy}"] if self.context_strategy else [])

    def label(self) -> str:
        strategy = f" {self.context_strategy}" if self.context_strategy else ""
        stages = self.schedule or ("1f1b" if self.pipeline_recompute is not None else "")
        stages += "" if self.pipeline_recompute is None else (" recompute" if self.pipeline_recompute else " keep")
        stages = f" {stages}" if stages else ""
        offload = " optimizer_offload" if self.optimizer_offload else ""
        loop = ("" if self.scan_layers else " scan_layers=false") + (" collective_matmul" if self.collective_matmul else "")
        return f"{self.mesh_spec}{strategy}{stages} mb={self.microbatches} remat={self.remat}{offload}{loop}"


# What ``plan --schedules`` may name: parallel.schedule's values, and interleaved 1F1B (two
# chunks per device, as circular runs them)
PIPELINE_SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved", "zb1", "zbv")


def schedule_settings(name: str) -> tuple[str, int]:
    """(parallel.schedule, parallel.virtual_stages) of a ``PIPELINE_SCHEDULES`` name (zbv's two chunks are its own)."""
    if name == "interleaved":
        return "1f1b", 2
    return name, 2 if name == "circular" else 1


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def configured(config: Config, candidate: Candidate) -> Config:
    out = copy.deepcopy(config)
    out.parallel.mesh, out.train.microbatches, out.model.remat = candidate.mesh_spec, candidate.microbatches, candidate.remat
    out.parallel.strategy = "auto"  # fsdp where the mesh has an fsdp axis, tensor parallel where it has a tensor axis
    if candidate.context_strategy:
        out.parallel.context_strategy = candidate.context_strategy
    if candidate.pipeline_recompute is not None:
        out.parallel.pipeline_recompute = candidate.pipeline_recompute
    if candidate.schedule:
        out.parallel.schedule, out.parallel.virtual_stages = schedule_settings(candidate.schedule)
    out.train.optimizer_offload = candidate.optimizer_offload
    out.model.scan_layers = out.model.scan_layers and candidate.scan_layers
    out.parallel.collective_matmul = out.parallel.collective_matmul or candidate.collective_matmul
    return out


def candidate_pipeline(config: Config, candidate: Candidate):
    """The pipeline schedule ``candidate`` runs (None without a pipe axis)."""
    p = config.parallel
    recompute = p.pipeline_recompute if candidate.pipeline_recompute is None else candidate.pipeline_recompute
    if candidate.schedule:
        schedule, virtual = schedule_settings(candidate.schedule)
        p = dataclasses.replace(p, schedule=schedule, virtual_stages=virtual)
    return pipeline_spec(dataclasses.replace(p, pipeline_recompute=recompute), candidate.sizes["pipe"])


def enumerate_candidates(
    config: Config,
    gpus: int,
    gpus_per_node: int,
    rejected: Counter | None = None,
    remats: tuple[str, ...] = REMATS,
    optimizer_offload: bool = False,
    schedules: tuple[str, ...] = (),
) -> list[Candidate]:
    """Every layout of ``config`` on ``gpus`` devices that jaxdist accepts, with each of ``remats``,
    and with ``optimizer_offload`` each of the memory-tight ones (``OPTIMIZER_OFFLOAD_REMATS``) also
    with the optimizer state in host memory; on a pipe axis each of ``schedules`` (none given: the
    config's own); ``rejected`` (if given) counts the validator's reasons for the others."""
    out = []
    batch, experts = config.train.global_batch, config.model.moe_experts if config.model.kind == "llama" else 0
    for pipe in divisors(gpus):
        for tensor in (t for t in divisors(gpus // pipe) if t <= gpus_per_node):
            for context in (c for c in divisors(gpus // (pipe * tensor)) if c * tensor <= gpus_per_node):  # both inside a node
                inner = context * tensor
                rest = gpus // (pipe * inner)
                for expert in (e for e in divisors(rest) if e * inner <= gpus_per_node and (e == 1 or experts % e == 0)):
                    for fsdp in divisors(rest // expert):
                        data = rest // (expert * fsdp)
                        sizes = {"data": data, "fsdp": fsdp, "expert": expert, "context": context, "tensor": tensor, "pipe": pipe}
                        mesh = tuple((a, sizes[a]) for a in LAYOUT_AXES)
                        shards = data * fsdp * expert
                        for microbatches, schedule in itertools.product(
                            (m for m in (1, 2, 4, 8, 16) if batch % (shards * m) == 0), schedules if pipe > 1 and schedules else ("",)
                        ):
                            one_f_one_b = pipe > 1 and (schedule_settings(schedule)[0] if schedule else config.parallel.schedule) == "1f1b"
                            for remat, recompute in itertools.product(remats, (False, True) if one_f_one_b else (None,)):
                                offloads = (False, True) if optimizer_offload and remat in OPTIMIZER_OFFLOAD_REMATS else (False,)
                                for strategy, offload in itertools.product(CONTEXT_STRATEGIES if context > 1 else ("",), offloads):
                                    candidate = Candidate(mesh, microbatches, remat, strategy, recompute, offload, schedule=schedule)
                                    try:
                                        check_config_on_mesh(configured(config, candidate), parse_mesh(candidate.mesh_spec))
                                    except JaxdistError as e:
                                        if rejected is not None:
                                            rejected[str(e)] += 1
                                        continue
                                    out.append(candidate)
    return out
