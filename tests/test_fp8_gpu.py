"""fp8 in the GPU program (compile-only, ``jaxdist.plan.gpu_target``): for ``model.fp8=current``
and ``delayed`` every fp8 matmul of the model is an fp8 GEMM in the default compiled H100 step
(counted against the model's own structure, three GEMMs per matmul), delayed scaling's amax
all-reduces are asynchronous, and a compute capability 8.0 GPU (A100) refuses model.fp8 in one line.

Needs JAX's CUDA plugin (the ``dev`` extra installs it); without it these tests skip with that reason.
"""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
import pytest
from flax import nnx

pytest.importorskip("jax_plugins.xla_cuda12", reason="JAX's CUDA plugin is not installed (pip install -e '.[dev]')")

from jaxdist import analyze  # noqa: E402
from jaxdist.config import load_config  # noqa: E402
from jaxdist.data.sources import resolve_vocab  # noqa: E402
from jaxdist.errors import ConfigError  # noqa: E402
from jaxdist.inspect.gpu_program import control_computations, kernel_counts, kernel_kind  # noqa: E402
from jaxdist.inspect.hlo import ARRAY_RE, CALLS_RE, COMMENT_RE, computation_multipliers, parse_hlo  # noqa: E402
from jaxdist.layout.mesh import parse_mesh  # noqa: E402
from jaxdist.models import build_task, fp8  # noqa: E402
from jaxdist.models.llama import Llama  # noqa: E402
from jaxdist.plan.gpu_target import compile_for_target, target_hardware  # noqa: E402

from helpers import TINY  # noqa: E402

LAYERS = 6  # model.fp8_keep_ends (the default) keeps layers 0 and 5 in bf16: 4 fp8 layers, one scan
BASE = (*TINY, "model.dtype=bfloat16", f"model.n_layers={LAYERS}", "train.latency_profile=off")
MESH, GPUS = "fsdp=2", 2  # the batch and the weights split: every amax is an all-reduce over fsdp


def _config(mode: str):
    config = load_config(None, [*BASE, f"model.fp8={mode}"])
    resolve_vocab(config)
    return config


@pytest.fixture(scope="module", params=["current", "delayed"])
def program(request):
    """(config, parsed optimized HLO) of the default H100 compile (jaxdist's flags, nothing added)."""
    config = _config(request.param)
    _, compiled, _ = compile_for_target(config, parse_mesh(MESH), target_hardware("h100"), GPUS, 8)
    return config, parse_hlo(compiled.as_text())


def _fp8_einsums_per_layer(config) -> int:
    """The fp8 einsums one decoder layer holds, read off the model itself (its ``Fp8Einsum`` modules)."""
    model = nnx.eval_shape(lambda: Llama(config.model, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    return sum(isinstance(node, fp8.Fp8Einsum) for _, node in nnx.iter_graph(model.blocks))


def _f8_dots_per_step(module) -> int:
    """Per step, the GEMMs whose two operands are f8 arrays: dots (in Triton gemm fusions) reading
    f8 values, and cuBLASLt's fp8 matmul calls; a dot on operands dequantised to bf16 is not one."""
    multipliers, count = computation_multipliers(module), 0
    for name, body in module.computations.items():
        for i in body:
            names = [re.sub(r"^.*%", "", op).strip() for op in i.operands]
            if i.opcode == "dot":
                f8 = all(module.shapes.get(n, "").startswith("f8e") for n in names[:2])
            else:
                f8 = i.opcode == "custom-call" and 'custom_call_target="__cublas$lt$matmul$f8"' in i.attributes
            count += multipliers.get(name, 0) * f8
    return count


@pytest.mark.heavy
def test_every_fp8_matmul_is_an_fp8_gemm_in_the_default_h100_program(program):
    """3 fp8 GEMMs (forward, input and weight gradient) per fp8 einsum of each fp8 layer, counted by
    the kernel reading and, independently, as dots whose operands are f8 (XLA cannot dequantise
    them into a bf16 GEMM); the run's one-line check then has nothing to say."""
    config, module = program
    per_layer = _fp8_einsums_per_layer(config)
    assert per_layer == 4  # fused qkv, attention output, fused gate/up, down
    expected = per_layer * (LAYERS - 2) * 3
    counts = kernel_counts(module)
    hint = "(without a CUDA runtime_version in the target description XLA refuses cuBLASLt's fp8 GEMM and computes in f16)"
    assert counts["gemm_fp8"] == expected, (counts, hint)
    assert _f8_dots_per_step(module) == expected
    assert counts["gemm"] > 0  # the bf16 matmuls (embedding side, LM head, kept end layers) stay bf16 GEMMs
    assert fp8.fp8_gemm_note(config.model, counts["gemm_fp8"]) is None
    line = fp8.fp8_gemm_note(config.model, counts["gemm_fp8"] - 3)
    assert f"runs {expected - 3} fp8 GEMMs per step, expected {expected}" in line and "\n" not in line


def _amax_all_reduces(module) -> list[bool]:
    """Per max-all-reduce (the amaxes; sums and gradients reduce with add): whether it runs asynchronously."""
    maximum = {name for name, body in module.computations.items() if body and body[-1].opcode == "maximum"}
    out = []
    for body in module.computations.values():
        for i in body:
            reduction = re.search(r"to_apply=%?([\w.\-]+)", i.attributes)
            if i.opcode in ("all-reduce", "all-reduce-start") and reduction.group(1) in maximum:
                out.append(i.opcode == "all-reduce-start" and '"is_sync":true' not in i.attributes)
    return out


@pytest.mark.heavy
def test_delayed_scaling_amax_all_reduces_are_asynchronous(program):
    """Delayed scaling quantises with the history's scales, so this step's amaxes only feed the new
    history: their all-reduces leave the critical path (XLA combines them, overlaps them with
    compute, or moves them out of the layer loop). Current scaling needs each amax before it can
    quantise (a data dependency XLA cannot hide): only delayed is held to this."""
    config, module = program
    asynchronous = _amax_all_reduces(module)
    if config.model.fp8 == "delayed":
        assert asynchronous and all(asynchronous), asynchronous
    else:  # the limit the README states: most of current scaling's amax all-reduces stay synchronous
        assert asynchronous and sum(asynchronous) < len(asynchronous) / 2, asynchronous


def test_a100_refuses_fp8_in_one_line(capsys):
    """Compute capability 8.0 has no fp8 GEMM (XLA would compute every one in f16): refused where the
    mesh's devices are known, for a target compile and for a real A100 run alike."""
    argv = ["--target", "a100", "--mesh", "data=2", "--gpus", "2", *BASE, "model.fp8=current", "--json"]
    assert analyze.main(argv) == 2
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.startswith("jaxdist")]
    assert len(err) == 1 and "needs fp8 GEMMs: compute capability 8.9" in err[0] and "are 8.0" in err[0], err
    assert captured.out == ""
    config = _config("delayed")
    with pytest.raises(ConfigError, match="compute capability 8.9 or newer"):
        build_task(config, "gpu", "8.0")  # what jaxdist.train's build_trainer passes for a real A100
    assert build_task(config, "gpu", "9.0") is not None and build_task(config, "gpu", "8.9") is not None
    assert build_task(_config("off"), "gpu", "8.0") is not None


def test_current_scalings_synchronous_amax_all_reduces_are_said_in_one_line(program):
    """What XLA cannot hide is said at compile time (the run's line and ``analyze --target``'s
    notes), counted from the schedule; delayed scaling, whose all-reduces are hidden, says nothing."""
    from jaxdist.inspect.gpu_program import collective_schedule
    from jaxdist.models.fp8 import amax_sync_note

    config, module = program
    all_reduce = collective_schedule(module)["all-reduce"]
    note = amax_sync_note(config.model, all_reduce)
    if config.model.fp8 == "current":
        synchronous = all_reduce["count"] - all_reduce["async"]
        assert synchronous >= sum(not a for a in _amax_all_reduces(module)) > 0
        assert note.startswith(f"model.fp8=current: {synchronous} of {all_reduce['count']} all-reduces per step run synchronously")
    else:
        assert note is None


def _kernel_results(module) -> list[tuple[str, int, set[str]]]:
    """(element type, element count, opcodes fused) of every array a memory-bound kernel of the step writes."""
    results = []
    for name in control_computations(module):
        for i in module.computations[name]:
            if kernel_kind(i, module) not in ("other_fusion", "copy", "other"):  # not a GEMM, attention or collective
                continue
            fused = {f.opcode for callee in CALLS_RE.findall(i.attributes) for f in module.computations.get(callee, [])}
            for dtype, dims in ARRAY_RE.findall(COMMENT_RE.sub("", i.shape)):
                results.append((dtype, math.prod(int(d.removeprefix("<=")) for d in dims.split(",") if d), fused | {i.opcode}))
    return results


@pytest.mark.heavy
def test_the_mlp_and_loss_gradients_are_each_one_pass_in_the_compute_dtype(program):
    """The fp8 MLP's SwiGLU gradient is written once, joined, in bf16 (``layers.swiglu_joined``):
    the program before wrote its sigmoid as an fp32 [tokens, mlp] tensor and then joined the gate's
    and the up part's gradients by a copy; the loss's gradient is one elementwise pass
    (``layers.cross_entropy_sum``), not a scatter of the targets into a [tokens, vocab] fp32 tensor."""
    config, module = program
    tokens = config.train.global_batch * config.train.seq_len // GPUS  # per device (the batch split over fsdp)
    mlp, vocab = config.model.resolved_mlp_dim, config.model.vocab_size
    results = _kernel_results(module)
    assert any(dtype == "bf16" and n == 2 * tokens * mlp for dtype, n, _ in results)  # the joined gradient
    assert not [r for r in results if r[0] == "f32" and r[1] in (tokens * mlp, 2 * tokens * mlp)], "an fp32 [tokens, mlp] pass"
    assert not [r for r in results if r[1] == tokens * vocab and "scatter" in r[2]], "a vocabulary-wide scatter"


def _weight_quantizations_per_step(module) -> dict[str, int]:
    """Per e4m3 result shape, how many converts a step runs inside ``fp8.quantize_weight``'s
    named scope (loop trip counts included)."""
    multipliers, counts = computation_multipliers(module), {}
    for name, body in module.computations.items():
        for i in body:
            if i.opcode == "convert" and i.shape.startswith("f8e4m3") and fp8.WEIGHT_SCOPE in i.attributes:
                shape = i.shape.split("{")[0]
                counts[shape] = counts.get(shape, 0) + multipliers.get(name, 0)
    return {shape: n for shape, n in counts.items() if n}


@pytest.mark.heavy
def test_weights_are_quantised_once_per_step_on_their_shards_and_gathered_in_fp8():
    """With 4 microbatches on fsdp=2, each fp8 weight stack is quantised outside the microbatch and
    layer loops (one convert per stack, two where XLA gives the forward and backward loops a
    copy of the fusion each; the program before this had 48 per stack: 6 layers x 4 microbatches
    x forward and recomputation), on each device's shard, and every multi-dimensional all-gather
    in the layer loops moves f8 values (torchtitan's float8 all-gather)."""
    config = load_config(None, [*BASE, "model.fp8=current", "model.fp8_keep_ends=false", "train.microbatches=4"])
    resolve_vocab(config)
    _, compiled, _ = compile_for_target(config, parse_mesh(MESH), target_hardware("h100"), GPUS, 8)
    module = parse_hlo(compiled.as_text())
    quantized = _weight_quantizations_per_step(module)
    stacks = _fp8_einsums_per_layer(config)  # one weight per fp8 einsum, stacked over the layers
    assert stacks <= sum(quantized.values()) <= 2 * stacks, quantized
    for shape in quantized:  # [layers, ...] with the fsdp-split dimension halved: each device its shard
        dims = [int(d) for d in re.findall(r"\d+", shape.split("[", 1)[1])]
        assert LAYERS in dims and math.prod(dims) * GPUS in _stacked_weight_sizes(config), shape
    multipliers = computation_multipliers(module)
    gathered = {
        i.shape.split("{")[0]
        for name, body in module.computations.items()
        if multipliers.get(name, 0) > 1
        for i in body
        if i.opcode in ("all-gather", "all-gather-start")
    }
    element_types = {t for shape in gathered for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape) if "," in dims}
    assert element_types == {"f8e4m3fn"}, gathered


def _stacked_weight_sizes(config) -> set[int]:
    """The element counts of the model's fp8 weight stacks ([layers, ...])."""
    model = nnx.eval_shape(lambda: Llama(config.model, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    sizes = set()
    for path, node in nnx.iter_graph(model.blocks):
        if isinstance(node, fp8.Fp8Einsum):
            holder = model.blocks
            for name in path[:-1]:
                holder = getattr(holder, name)
            sizes.add(math.prod(getattr(holder, node.weight).shape))
    return sizes
