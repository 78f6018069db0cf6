"""Compile-only (an H100 target, no GPU): in which dtype gradients and weights cross devices.

With ``parallel.grad_reduce=float32`` (the default) every gradient reduction over the batch
axes (the DP all-reduce, the FSDP reduce-scatter) must move fp32, and FSDP's all-gather of
the embedding table the compute dtype (bf16). XLA:CPU promotes bf16 reductions to fp32, so
only the GPU program shows what crosses devices: these tests compile the real train step of
Llama 3 8B's layer shapes (2 layers: the layers are one scan, so depth costs nothing) for 8
H100s and read the optimized HLO's collectives.

Which collectives are gradients: the reductions (all-reduce, reduce-scatter) whose groups span
a batch axis (``replica``, ``data``, ``fsdp``, ``expert``), the loss and metric scalars aside.
The forward pass reduces nothing else over the batch axes, which the tests check two ways:
each one reduces something the backward pass computed (``transpose(...)`` in the op_name
metadata of the nearest instructions up its operands that carry one: XLA drops the metadata
of what it combines), and together they move exactly 4 bytes per parameter a device reduces
(each gradient crosses once, in fp32), counted from the model's parameter shardings.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="JAX's CUDA plugin is not installed (pip install -e '.[dev]')")

import jax  # noqa: E402

from jaxdist.config import load_config  # noqa: E402
from jaxdist.data.sources import resolve_vocab  # noqa: E402
from jaxdist.inspect.collectives import collective_ops  # noqa: E402
from jaxdist.inspect.hlo import ARRAY_RE, NAME_RE, HloModule, parse_hlo  # noqa: E402
from jaxdist.layout.mesh import BATCH_AXES, mesh_device_count, parse_mesh  # noqa: E402
from jaxdist.plan.gpu_target import compile_for_target, target_hardware  # noqa: E402

pytestmark = pytest.mark.heavy  # each program compiles in ~25 s (shared by the module's tests)

LAYERS_8B = (
    "model.n_layers=2",
    "train.seq_len=1024",
    "train.latency_profile=off",
)  # llama3-8b's layer shapes (d 4096, GQA 32/8, mlp 14336, vocab 128256)
VOCAB, D_MODEL = 128256, 4096
SCALARS = 64  # bytes: the loss, its weight and the metrics, reduced with the gradients but not gradients
PROGRAMS = {  # name -> (preset, mesh, overrides)
    "fsdp=8": ("llama3-8b", "fsdp=8", ()),
    "data=8": ("llama3-8b", "data=8", ("parallel.strategy=dp",)),
    "fsdp=4,tensor=2": ("llama3-8b", "fsdp=4,tensor=2", ("parallel.strategy=fsdp+tp",)),
}


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[str, ...]
    arrays: tuple[tuple[str, tuple[int, ...]], ...]  # the operands' (dtype, dims); all-gathers: the results'
    payload: int  # bytes per step (larger of operands and result, times the enclosing loops' trip counts)
    origins: frozenset[str]  # op_names of what it reduces or gathers (``_origins``)

    @property
    def backward(self) -> bool:
        """Whether it reduces something the backward pass computed (the forward never depends on it)."""
        return any("transpose(" in origin for origin in self.origins)

    def __str__(self) -> str:
        arrays = " ".join(f"{dtype}[{','.join(map(str, dims))}]" for dtype, dims in self.arrays)
        return f"{self.kind} over {','.join(self.axes)}: {arrays} <- {' | '.join(o[:100] for o in sorted(self.origins)[:3])}"


@dataclasses.dataclass(frozen=True)
class Program:
    collectives: list[Collective]
    gradient_bytes: int  # 4 bytes x each parameter's elements as one device reduces them (split only over non-batch axes)

    def gradient_reductions(self) -> list[Collective]:
        return [
            c
            for c in self.collectives
            if c.kind in ("all-reduce", "reduce-scatter") and set(c.axes) & set(BATCH_AXES) and c.payload > SCALARS
        ]


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in ARRAY_RE.findall(re.sub(r"/\*.*?\*/", "", shape))]


def _origins(name: str, instructions: dict, seen: set | None = None, depth: int = 0) -> set[str]:
    """The op_names of the nearest instructions up every operand path that carry one (XLA drops
    the metadata of what it combines: a combined collective, a concatenate of several gradients)."""
    seen = set() if seen is None else seen
    instruction = instructions.get(name)
    if instruction is None or name in seen or depth > 8:
        return set()
    seen.add(name)
    found = re.search(r'op_name="([^"]*)"', instruction.attributes)
    if found:
        return {found.group(1)}
    names = (NAME_RE.match(operand.split()[-1]) for operand in instruction.operands)
    return {origin for n in names if n for origin in _origins(n.group(1), instructions, seen, depth + 1)}


def _collectives(module: HloModule, mesh: dict[str, int]) -> list[Collective]:
    instructions = {i.name: i for body in module.computations.values() for i in body}
    results = {}  # an async start's name -> its done's result shape
    for i in instructions.values():
        if i.opcode.endswith("-done"):
            results[NAME_RE.match(i.operands[0].split()[-1]).group(1)] = i.shape
    out = []
    for op in collective_ops(module, mesh):
        if op.executions and op.kind in ("all-reduce", "reduce-scatter", "all-gather"):
            instruction = instructions[op.name]
            if op.kind == "all-gather":
                arrays = _arrays(results.get(op.name, instruction.shape))
            else:
                arrays = [
                    a for operand in instruction.operands for a in _arrays(module.shapes[NAME_RE.match(operand.split()[-1]).group(1)])
                ]
            out.append(Collective(op.kind, op.axes, tuple(arrays), op.bytes * op.executions, frozenset(_origins(op.name, instructions))))
    return out


def _gradient_bytes(trainer) -> int:
    total = 0
    for leaf in jax.tree.leaves(trainer.abstract_params()):
        mesh, spec = leaf.sharding.mesh, leaf.sharding.spec
        axes = [a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)]
        total += 4 * math.prod(leaf.shape) // math.prod(mesh.shape[a] for a in axes if a not in BATCH_AXES)
    return total


def _compile(preset: str, mesh: str, overrides: tuple[str, ...]) -> Program:
    config = load_config(preset, [*LAYERS_8B, *overrides])
    resolve_vocab(config)
    sizes = parse_mesh(mesh)
    trainer, compiled, _ = compile_for_target(config, sizes, target_hardware("h100"), mesh_device_count(sizes), 8)
    assert config.parallel.grad_reduce == "float32" and config.model.dtype == "bfloat16"
    return Program(_collectives(parse_hlo(compiled.as_text()), dict(trainer.layout.mesh.shape)), _gradient_bytes(trainer))


@pytest.fixture(scope="module", params=list(PROGRAMS))
def program(request) -> tuple[str, Program]:
    """(mesh, its compiled program): ~25 s each to compile, shared by the module's tests."""
    return request.param, _compile(*PROGRAMS[request.param])


def test_every_gradient_crosses_devices_in_fp32(program):
    """wo, w_down and the head reduced their gradients in bf16 (autodiff's bf16 matmul output is
    the partial sum XLA reduces): every gradient reduction over the batch axes is fp32 now."""
    name, prog = program
    reductions = prog.gradient_reductions()
    assert reductions, f"{name}: no gradient reduction found"
    not_backward = [str(c) for c in reductions if not c.backward]
    assert not not_backward, f"{name}: reductions over the batch axes outside the backward pass:\n" + "\n".join(not_backward)
    low = [str(c) for c in reductions if {dtype for dtype, _ in c.arrays} != {"f32"}]
    assert not low, f"{name}: gradients crossing devices below fp32:\n" + "\n".join(low)
    if "tensor" in name:  # Megatron's activation all-reduces (over 'tensor' alone) stay in the compute dtype
        forward = [c for c in prog.collectives if c.kind == "all-reduce" and c.axes == ("tensor",) and not c.backward]
        assert any(dtype == "bf16" for c in forward for dtype, dims in c.arrays if len(dims) == 3), [str(c) for c in forward]


def test_each_parameter_gradient_crosses_once_in_fp32(program):
    """The gradient reductions' fp32 payload is 4 bytes x every parameter a device reduces: none
    is left out, none reduced in bf16 (which moved 2 bytes for wo, w_down and the head)."""
    name, prog = program
    reductions = prog.gradient_reductions()
    fp32 = sum(c.payload for c in reductions if {dtype for dtype, _ in c.arrays} == {"f32"})
    assert abs(fp32 - prog.gradient_bytes) <= SCALARS, (name, fp32, prog.gradient_bytes, [str(c) for c in reductions])


@pytest.mark.parametrize("program", ["fsdp=8", "fsdp=4,tensor=2"], indirect=True)  # data=8 replicates the table
def test_the_embedding_table_is_gathered_in_the_compute_dtype(program):
    """FSDP gathers the table for the lookup: bf16 (it was fp32, 2.1 GB per device per step at
    8B's 128K x 4096, while every other weight moved bf16); under tensor=2 each device gathers
    its half of the vocabulary."""
    name, prog = program
    shapes = ((VOCAB, D_MODEL), (VOCAB // 2, D_MODEL))
    tables = [c for c in prog.collectives if c.kind == "all-gather" and any(dims in shapes for _, dims in c.arrays)]
    assert tables, f"{name}: no all-gather of the embedding table"
    assert {dtype for c in tables for dtype, dims in c.arrays if dims in shapes} == {"bf16"}, [str(c) for c in tables]


def test_expert_weight_gradients_cross_devices_in_fp32():
    """The routed experts' weights are gathered over fsdp inside the expert-parallel region (a
    shard_map): autodiff's transpose reduce-scattered their gradients in bf16, a custom gather
    now reduce-scatters them in fp32, like every other gradient."""
    config = load_config("moe-tiny", ["model.dtype=bfloat16", "train.latency_profile=off"])
    resolve_vocab(config)
    sizes = parse_mesh("fsdp=4,expert=2")
    trainer, compiled, _ = compile_for_target(config, sizes, target_hardware("h100"), 8, 8)
    collectives = _collectives(parse_hlo(compiled.as_text()), dict(trainer.layout.mesh.shape))
    scatters = [c for c in collectives if c.kind == "reduce-scatter"]
    assert scatters and all({dtype for dtype, _ in c.arrays} == {"f32"} for c in scatters), [str(c) for c in scatters]
