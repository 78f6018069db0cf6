"""What one device's compiled step does, per op class, read from its optimized HLO.

XLA's own ``cost_analysis()`` counts each loop body once, and a layer scan runs its body
once per layer; here every count is multiplied by the trip counts of the loops around it
(``jaxdist.inspect.hlo.computation_multipliers``):

- ``matmul_flops``: 2 x result elements x contracted size of every ``dot`` (fused or not);
  ``attention_flops`` the part inside attention (XLA computes every [seq, seq] score).
- ``memory_bytes``: bytes read and written by every other top-level op (fusions, copies,
  slices, reductions), the memory-bound work. A fusion reads its operands and writes its
  result, except that an operand only sliced inside reads just the slices, and a result
  updated in place (``dynamic-update-slice`` root: a scan writing one layer of a stacked
  buffer) writes just the update.
- ``layout_bytes``: the part outside attention spent in pure dtype and layout copies
  (fusions of converts, transposes, copies): XLA:CPU computes bf16 dots in f32 and
  converts every weight and activation around them, which a GPU's bf16 GEMMs do not.
- ``score_bytes``: the part of ``memory_bytes`` inside attention (the ``attention`` name
  scope of ``jaxdist.models.attention``, and unnamed score-shaped copies such as a scan's
  saved probabilities): the scores a fused (flash) kernel keeps on chip.

A fusion that contains a ``dot`` is a matmul (XLA:CPU fuses dots with their neighbours;
a GPU runs them as GEMMs): its time is the matmul's, and it adds no memory traffic.
- ``collectives``: ``jaxdist.inspect.collectives.collective_ops``, with each one's loop membership;
  ``attention_collectives`` names those inside attention (a context axis's K/V gathers, permutes
  and their gradients' reduce-scatters).
- ``skippable_flops`` / ``skippable_bytes``: the part of attention's work inside ``conditional``
  branches, which the counts above include in full (every branch is counted): the tiled kernel of
  context parallelism (``jaxdist.parallel.blockwise``) computes a pair of tiles only where some
  query sees some key, so about half of it never runs under a causal mask.
- ``grouped_flops``: the MoE experts' grouped matmuls as compiled (the dots in
  ``parallel.expert``'s ``expert_parallel`` name scope, but the small batched combine);
  ``grouped_expansion`` how many times the compiled program does the grouped work: XLA:CPU
  lowers ``jax.lax.ragged_dot`` to a dense product over every local expert with the other
  experts' rows masked (E/expert times the work, forward and backward), a GPU's grouped GEMM
  does each row once (nor the empty rows of ``parallel.expert``'s static receive buffer, which
  XLA:CPU multiplies too: the expansion includes the buffer's padding). With one expert per device there is no expansion, and XLA drops the
  names of the weight gradients' dots, so ``grouped_flops`` then misses them (nothing to price).
  The dispatch's sorts, scatters and masks stay in ``memory_bytes`` as compiled.

XLA:GPU's program (compiled for a target by ``plan.gpu_target``) is read kernel by kernel in
schedule order by ``plan.gpu_cost`` into the same ``ProgramCost`` (its ``schedule``), with the
byte counting above.
"""

from __future__ import annotations

import dataclasses
import math
import re

from jaxdist.inspect.collectives import CollectiveOp, collective_kind, collective_ops
from jaxdist.inspect.hlo import (
    ARRAY_RE,
    CALLS_RE,
    COMMENT_RE,
    NAME_RE,
    HloModule,
    Instruction,
    callees,
    computation_multipliers,
    parse_hlo,
    shape_bytes,
)
from jaxdist.models.attention import SCOPE

EXPERT_SCOPE = "expert_parallel"  # parallel.expert's jax.named_scope around its shard_map

# Ops that move no data of their own (or whose work is counted elsewhere).
_NO_TRAFFIC = {
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional", "call",
    "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "copy-start", "copy-done",
    "send", "send-done", "recv", "recv-done", "async-start", "async-update", "async-done", "domain",
}  # fmt: skip
_SLICING = {"dynamic-slice", "slice", "gather"}
_CASTS = {"convert", "bitcast", "copy", "reshape"}
_REDUCER_RE = re.compile(r"\b(?:to_apply|comparator|select|scatter)=%?([\w.\-]+)")
_CONTRACTING_RE = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_PARAM_INDEX_RE = re.compile(r"^(\d+)")


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    matmul_flops: float
    attention_flops: float  # the part of matmul_flops in attention (scores and their weighted sum)
    memory_bytes: float
    score_bytes: float
    layout_bytes: float  # the part of memory_bytes (outside attention) in pure dtype / layout copies
    collectives: tuple[CollectiveOp, ...]
    loop_computations: frozenset[str]  # computations that run more than once per step
    f32_collectives: frozenset[str] = frozenset()  # names of the collectives that move f32
    dots: tuple[tuple[float, float], ...] = ()  # (FLOPs of one matrix product, products per step) of every dot
    op_executions: float = 0.0  # top-level ops executed per step (what a per-op dispatch cost multiplies)
    attention_collectives: frozenset[str] = frozenset()  # names of the collectives inside attention
    skippable_flops: float = 0.0  # the part of attention_flops inside conditional branches (tiles a causal mask skips)
    skippable_bytes: float = 0.0  # the part of score_bytes inside them
    grouped_flops: float = 0.0  # the part of matmul_flops in the experts' grouped matmuls, as compiled
    grouped_expansion: float = 1.0  # times the compiled program does the grouped work (XLA:CPU: the local experts)
    # XLA:GPU's program only: per computation on the compute stream, its events in schedule order
    # (``gpu_program_cost``); empty for XLA:CPU's
    schedule: tuple[tuple[str, tuple[tuple, ...]], ...] = ()
    entry: str = ""  # the computation a step runs (ENTRY)
    fp8_flops: float = 0.0  # the part of matmul_flops in fp8 GEMMs
    # the f32 collectives whose operand XLA:CPU converted from a 16-bit float (a GPU moves that);
    # None (a summary cached before this field): every f32 collective counts as widened
    widened_collectives: frozenset[str] | None = None

    @property
    def tiled_attention(self) -> bool:
        """Whether attention runs as tiles that ``lax.cond`` skips (context parallelism's kernel)."""
        return self.skippable_flops > 0

    def is_f32(self, op: CollectiveOp) -> bool:
        return op.name in self.f32_collectives

    def is_widened(self, op: CollectiveOp) -> bool:
        """Whether ``op`` moves f32 only because XLA:CPU widened a 16-bit value for it (not an f32
        value the program holds, such as Muon's momentum)."""
        return self.is_f32(op) if self.widened_collectives is None else op.name in self.widened_collectives

    def in_loop(self, op: CollectiveOp) -> bool:
        return op.computation in self.loop_computations

    def to_dict(self) -> dict:
        """A JSON-able summary (the planner's compile cache)."""
        ops = [dataclasses.asdict(op) | {"axes": list(op.axes) if op.axes is not None else None} for op in self.collectives]
        return {
            "matmul_flops": self.matmul_flops,
            "attention_flops": self.attention_flops,
            "memory_bytes": self.memory_bytes,
            "score_bytes": self.score_bytes,
            "layout_bytes": self.layout_bytes,
            "collectives": ops,
            "loop_computations": sorted(self.loop_computations),
            "f32_collectives": sorted(self.f32_collectives),
            "dots": [list(d) for d in self.dots],
            "op_executions": self.op_executions,
            "attention_collectives": sorted(self.attention_collectives),
            "skippable_flops": self.skippable_flops,
            "skippable_bytes": self.skippable_bytes,
            "grouped_flops": self.grouped_flops,
            "grouped_expansion": self.grouped_expansion,
            "schedule": [[name, [list(e) for e in events]] for name, events in self.schedule],
            "entry": self.entry,
            "fp8_flops": self.fp8_flops,
            "widened_collectives": None if self.widened_collectives is None else sorted(self.widened_collectives),
        }

    @classmethod
    def from_dict(cls, data: dict) -> ProgramCost:
        ops = tuple(CollectiveOp(**{**op, "axes": tuple(op["axes"]) if op["axes"] is not None else None}) for op in data["collectives"])
        return cls(
            data["matmul_flops"],
            data["attention_flops"],
            data["memory_bytes"],
            data["score_bytes"],
            data["layout_bytes"],
            ops,
            frozenset(data["loop_computations"]),
            frozenset(data.get("f32_collectives", ())),
            tuple((float(f), float(n)) for f, n in data.get("dots", ())),
            float(data.get("op_executions", 0.0)),
            frozenset(data.get("attention_collectives", ())),
            float(data.get("skippable_flops", 0.0)),
            float(data.get("skippable_bytes", 0.0)),
            float(data.get("grouped_flops", 0.0)),
            float(data.get("grouped_expansion", 1.0)),
            tuple((name, tuple(_event(e) for e in events)) for name, events in data.get("schedule", ())),
            data.get("entry", ""),
            float(data.get("fp8_flops", 0.0)),
            None if data.get("widened_collectives") is None else frozenset(data["widened_collectives"]),
        )


def _event(e: list) -> tuple:
    """A schedule event back from JSON (a conditional's branches as a tuple)."""
    return tuple(tuple(x) if isinstance(x, list) else x for x in e)


def dims(shape: str) -> list[list[int]]:
    """Every array's dimensions in an HLO shape string (a tuple gives several)."""
    return [[int(d.removeprefix("<=")) for d in ds.split(",") if d] for _, ds in ARRAY_RE.findall(COMMENT_RE.sub("", shape))]


def _operand_name(operand: str) -> str | None:
    match = NAME_RE.match(operand.split()[-1]) if operand.strip() else None
    return match.group(1) if match else None


def _operand_shape(operand: str, module: HloModule) -> str:
    if ARRAY_RE.search(operand):  # printed with its shape
        return operand.rsplit("%", 1)[0] if "%" in operand else operand
    name = _operand_name(operand)
    return module.shapes.get(name, "") if name else ""


_BATCH_RE = re.compile(r"lhs_batch_dims=\{([0-9,]*)\}")


def dot_batch(instruction: Instruction, module: HloModule) -> int:
    """How many independent matrix products a dot is (the product of its batch dimensions)."""
    match = _BATCH_RE.search(instruction.attributes)
    lhs = dims(_operand_shape(instruction.operands[0], module)) if instruction.operands else []
    if not match or not lhs or not match.group(1):
        return 1
    return max(math.prod(lhs[0][int(i)] for i in match.group(1).split(",") if i), 1)


def dot_flops(instruction: Instruction, module: HloModule, contracting: re.Pattern = _CONTRACTING_RE) -> float:
    """2 x output elements x the contracted dimensions' size (``contracting`` finds the lhs's
    contracted dimensions: a dot's attribute by default, a cuBLAS call's backend config on a GPU)."""
    out = dims(instruction.shape)
    lhs = dims(_operand_shape(instruction.operands[0], module)) if instruction.operands else []
    match = contracting.search(instruction.attributes)
    if not out or not lhs or not match:
        return 0.0
    contracted = math.prod(lhs[0][int(i)] for i in re.findall(r"\d+", match.group(1)))
    return 2.0 * math.prod(out[0]) * contracted


_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')


def _attention_tag(instruction: Instruction, module: HloModule, scope: str = SCOPE) -> bool | None:
    """True / False when the op (a fusion: the ops fused into it) names its origin: inside
    the ``scope`` name scope (attention's by default) or not; None when it carries no op name (a layout copy)."""
    texts = [instruction.attributes]
    if instruction.opcode == "fusion":
        callee = CALLS_RE.search(instruction.attributes)
        texts += [i.attributes for i in module.computations.get(callee.group(1), [])] if callee else []
    names = [m.group(1) for m in map(_OP_NAME_RE.search, texts) if m]
    if not names:
        return None
    return any(re.search(rf"\b{scope}\b", n) for n in names)


_LAYOUT_OPS = {"convert", "bitcast", "copy", "transpose", "reshape", "parameter", "tuple", "get-tuple-element"}


_NARROW = ("bf16", "f16")  # the float types XLA:CPU widens to f32 around a collective


def _widened(collective: Instruction, module: HloModule, by_name: dict[str, Instruction]) -> bool:
    """Whether an operand of ``collective`` is a convert from bf16 or f16 (alone or fused): the
    promotion XLA:CPU inserts around a 16-bit collective."""
    for operand in collective.operands:
        source = by_name.get(_operand_name(operand) or "")
        if source is None:
            continue
        if source.opcode == "convert" and source.operands and _operand_shape(source.operands[0], module).startswith(_NARROW):
            return True
        callee = CALLS_RE.search(source.attributes) if source.opcode == "fusion" else None
        body = module.computations.get(callee.group(1), []) if callee else []
        if any(i.opcode == "convert" for i in body) and any(i.opcode == "parameter" and i.shape.startswith(_NARROW) for i in body):
            return True
    return False


def _only_casts(instruction: Instruction, module: HloModule) -> bool:
    """A dtype or layout copy: the op, or every op fused into it, only converts or moves data."""
    if instruction.opcode != "fusion":
        return instruction.opcode in _LAYOUT_OPS
    callee = CALLS_RE.search(instruction.attributes)
    body = module.computations.get(callee.group(1), []) if callee else []
    return bool(body) and all(i.opcode in _LAYOUT_OPS for i in body)


def _fusion_traffic(instruction: Instruction, body: list[Instruction], module: HloModule) -> tuple[int, list[str]]:
    """(bytes a fusion reads and writes, the shapes it touches)."""
    params: dict[str, int] = {}
    for i in body:
        if i.opcode == "parameter":
            index = _PARAM_INDEX_RE.match(i.operands[0].strip()) if i.operands else None
            if index:
                params[i.name] = int(index.group(1))
    users: dict[str, list[Instruction]] = {name: [] for name in params}
    for i in body:
        for operand in i.operands:
            name = _operand_name(operand)
            if name in users:
                users[name].append(i)
    by_name = {i.name: i for i in body}

    def through_casts(i: Instruction) -> Instruction:  # XLA:CPU wraps a bf16 in-place update in converts
        while i.opcode in _CASTS and i.operands and _operand_name(i.operands[0]) in by_name:
            i = by_name[_operand_name(i.operands[0])]
        return i

    root = body[-1]
    outputs = [by_name[n] for n in map(_operand_name, root.operands) if n in by_name] if root.opcode == "tuple" else [root]
    roots = [through_casts(r) for r in outputs]
    updated = [_operand_name(r.operands[0]) for r in roots if r.opcode == "dynamic-update-slice" and r.operands]
    in_place = {through_casts(by_name[n]).name for n in updated if n in by_name}
    shapes, traffic = [], 0
    for name, index in params.items():
        if name in in_place:
            continue  # the buffer updated in place: only the update is written (below)
        if users[name] and all(u.opcode in _SLICING for u in users[name]):
            traffic += sum(shape_bytes(u.shape) for u in users[name])
            shapes += [u.shape for u in users[name]]
        elif index < len(instruction.operands):
            shape = _operand_shape(instruction.operands[index], module)
            traffic += shape_bytes(shape)
            shapes.append(shape)
    written = [r.operands[1] for r in roots if r.opcode == "dynamic-update-slice" and len(r.operands) > 1]
    if written:
        shapes += [_operand_shape(o, module) for o in written]
        traffic += sum(shape_bytes(_operand_shape(o, module)) for o in written)
        traffic += sum(shape_bytes(r.shape) for r in roots if r.opcode != "dynamic-update-slice")
    else:
        traffic += shape_bytes(instruction.shape)
        shapes.append(instruction.shape)
    return traffic, shapes


def _traffic(instruction: Instruction, module: HloModule) -> tuple[int, list[str]]:
    """(bytes one execution of a top-level op reads and writes, the shapes it touches)."""
    op = instruction.opcode
    if op == "fusion":
        callee = CALLS_RE.search(instruction.attributes)
        body = module.computations.get(callee.group(1), []) if callee else []
        if body:
            return _fusion_traffic(instruction, body, module)
    if op == "dynamic-update-slice" and len(instruction.operands) > 1:
        update = _operand_shape(instruction.operands[1], module)
        return 2 * shape_bytes(update), [update]
    if op in _SLICING:
        return 2 * shape_bytes(instruction.shape), [instruction.shape]
    shapes = [instruction.shape, *(_operand_shape(o, module) for o in instruction.operands)]
    return sum(shape_bytes(s) for s in shapes), shapes


def _score_shaped(shapes: list[str], seq_len: int, min_elements: int) -> bool:
    """An attention-score array (XLA:CPU reshapes them): two dims that are multiples of seq_len
    and at least heads-per-device x seq_len^2 elements (activations [b, seq, d] have fewer)."""
    for d in (d for shape in shapes for d in dims(shape)):
        if sum(1 for n in d if n % seq_len == 0) >= 2 and math.prod(d) >= min_elements:
            return True
    return False


def conditional_computations(module: HloModule) -> set[str]:
    """Every computation that runs inside a ``conditional``'s branches (and what they call)."""
    todo = [name for body in module.computations.values() for i in body if i.opcode == "conditional" for name, _ in callees(i)]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [callee for i in module.computations.get(name, []) for callee, _ in callees(i)]
    return seen


def program_cost(
    hlo_text: str | HloModule,
    mesh_shape: dict[str, int] | None = None,
    seq_len: int = 0,
    heads_per_device: int = 1,
    local_experts: int = 0,
    buffer_padding: float = 1.0,
) -> ProgramCost:
    """``local_experts``: an MoE model's experts per device (experts / the expert axis), the
    factor XLA:CPU's dense lowering of ``ragged_dot`` multiplies the grouped matmuls by;
    ``buffer_padding``: the rows the experts receive (parallel.expert's static buffer) over the
    rows routed to them, which XLA:CPU computes too (a GPU's grouped GEMM skips rows past the groups).
    XLA:GPU's program is read by ``plan.gpu_cost.gpu_program_cost``."""
    module = parse_hlo(hlo_text) if isinstance(hlo_text, str) else hlo_text
    counts = computation_multipliers(module)
    fused, reducers = set(), set()
    for body in module.computations.values():
        for i in body:
            if i.opcode == "fusion":
                fused.update(CALLS_RE.findall(i.attributes))
            reducers.update(_REDUCER_RE.findall(i.attributes))
    with_dot = {name for name in fused if any(i.opcode in ("dot", "convolution") for i in module.computations.get(name, []))}
    branches = conditional_computations(module)
    matmul = attention_flops = memory = scores = layout = skippable_flops = skippable_bytes = 0.0
    f32, widened, dots, ops, in_attention = set(), set(), {}, 0.0, set()
    by_name = {i.name: i for body in module.computations.values() for i in body}
    grouped_flops = 0.0
    for name, executions in counts.items():
        if name in reducers or not executions:
            continue
        attention: set[str] = set()  # ops of this computation that belong to attention
        for i in module.computations.get(name, []):
            tag = _attention_tag(i, module)
            if tag or (tag is None and any(_operand_name(o) in attention for o in i.operands)):
                attention.add(i.name)  # an unnamed op (a layout copy) inherits its operands' origin
            if i.opcode == "dot":
                one = dot_flops(i, module)
                flops = executions * one
                matmul += flops
                batch = dot_batch(i, module)  # a batched dot is that many small matmuls (their rate is a small one's)
                dots[one / batch] = dots.get(one / batch, 0) + executions * batch
                # XLA:CPU drops the metadata of dots it fuses; a dot with batch dimensions is then
                # attention's (scores or their weighted sum): the projections contract weights.
                attention_dot = bool(tag or (tag is None and "lhs_batch_dims" in i.attributes))
                attention_flops += flops if attention_dot else 0.0
                skippable_flops += flops if attention_dot and name in branches else 0.0
                if local_experts and _attention_tag(i, module, EXPERT_SCOPE) and batch in (1, local_experts):
                    grouped_flops += flops  # the combine's einsum is batched over tokens: not a grouped matmul
            if collective_kind(i.opcode) and i.shape.lstrip("(").startswith("f32"):
                f32.add(i.name)
                if _widened(i, module, by_name):
                    widened.add(i.name)
            if collective_kind(i.opcode) and tag:
                in_attention.add(i.name)
            if name in fused or i.opcode in _NO_TRAFFIC or i.opcode.endswith("-done") or collective_kind(i.opcode):
                continue
            ops += executions
            if i.opcode == "dot" or (i.opcode == "fusion" and set(CALLS_RE.findall(i.attributes)) & with_dot):
                continue  # a matmul's operands and result are part of its (compute-bound) time
            traffic, shapes = _traffic(i, module)
            memory += executions * traffic
            if i.name in attention or (seq_len > 1 and _score_shaped(shapes, seq_len, heads_per_device * seq_len**2)):
                scores += executions * traffic
                skippable_bytes += executions * traffic if name in branches else 0.0
            elif _only_casts(i, module):
                layout += executions * traffic
    loops = frozenset(name for name, n in counts.items() if n > 1)
    return ProgramCost(
        matmul,
        attention_flops,
        memory,
        scores,
        layout,
        tuple(collective_ops(module, mesh_shape)),
        loops,
        frozenset(f32),
        tuple(sorted(dots.items())),
        ops,
        frozenset(in_attention),
        skippable_flops,
        skippable_bytes,
        grouped_flops,
        float(local_experts * buffer_padding) if local_experts and grouped_flops else 1.0,
        widened_collectives=frozenset(widened),
    )
