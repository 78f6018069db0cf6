"""Collective matmuls over ``tensor`` (``parallel.collective_matmul``): the same losses and
gradients as one device, the activation all-reduces replaced by collective-permutes (on CPU and
in XLA:GPU's program, where each permute is async with a GEMM beside it), and the combinations
it does not run refused in one line."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxdist.config import load_config
from jaxdist.errors import ConfigError, MeshError
from jaxdist.inspect.collectives import collective_ops
from jaxdist.inspect.hlo import parse_hlo
from jaxdist.layout.mesh import parse_mesh
from jaxdist.layout.validate import check_config_on_mesh
from jaxdist.training.aot import compile_train_step

from helpers import TINY, first_batch_grads

ON = "parallel.collective_matmul=true"


def _relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.fixture(scope="module")
def one_device():
    return first_batch_grads("data=1")[1:]


@pytest.mark.parametrize(
    ("mesh", "overrides"),
    # microbatches: the step accumulates per device in a region manual over the batch axes, the rings' region inside it
    [("data=2,tensor=2", ()), ("fsdp=2,tensor=4", ()), ("data=2,tensor=2", ("train.microbatches=2",))],
    ids=["data-tensor", "fsdp-tensor4", "microbatches"],
)
def test_losses_and_gradients_equal_one_device(mesh, overrides, one_device):
    trainer, loss, grads = first_batch_grads(mesh, ON, *overrides)
    assert trainer.layout.strategy.collective_matmul
    ref_loss, ref_grads = one_device
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-6)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True):
        assert _relative_error(g, r) < 1e-5, jax.tree_util.keystr(path)


def test_bfloat16_stays_as_close_to_one_device_as_plain_tensor_parallelism():
    """bf16 sums its rings in bf16, as the plain layout's activation all-reduce does: its
    distance from the float32 one-device gradients is of the plain layout's size."""
    reference = first_batch_grads("data=1")[2]
    errors = {}
    for name, overrides in {"plain": (), "collective": (ON,)}.items():
        _, loss, grads = first_batch_grads("data=2,tensor=2", "model.dtype=bfloat16", *overrides)
        errors[name] = max(_relative_error(g, r) for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True))
    print(errors)
    assert errors["collective"] < 1.5 * errors["plain"] + 1e-3, errors


def _tensor_collectives(*overrides: str) -> dict[str, int]:
    """Executions per step of each collective kind over ``tensor`` moving at least one
    device's [batch, seq, d_model] activations (the norms' small weight-gradient sums left out)."""
    from jaxdist.data.sources import resolve_vocab

    config = load_config(None, [*TINY, *overrides])
    resolve_vocab(config)
    trainer, compiled = compile_train_step(config, parse_mesh("data=2,tensor=2"), jax.devices()[:4])
    m = config.model
    chunk = config.train.global_batch // 2 * config.train.seq_len // 2 * m.d_model * 4  # a quarter of one data shard's, f32
    counts: dict[str, int] = {}
    for op in collective_ops(parse_hlo(compiled.as_text()), dict(trainer.layout.mesh.shape)):
        if op.axes == ("tensor",) and op.bytes >= chunk:
            counts[op.kind] = counts.get(op.kind, 0) + op.executions
    return counts


def test_the_activation_all_reduces_become_permutes():
    plain, collective = _tensor_collectives(), _tensor_collectives(ON)
    layers = 2
    # plain: 2 all-reduces per layer forward and 2 backward; collective: none in the layers (the
    # vocabulary-split embedding's and head's stay), one permute per ring step: 4 rings of
    # T-1 = 1 step forward and 4 backward per layer
    assert plain.get("all-reduce", 0) - collective.get("all-reduce", 0) >= 4 * layers, (plain, collective)
    assert collective.get("collective-permute", 0) >= 8 * layers, collective
    assert plain.get("collective-permute", 0) == 0, plain


@pytest.mark.parametrize(
    ("overrides", "error", "says"),
    [
        (("model.fp8=current", "model.dtype=bfloat16", "model.fp8_keep_ends=false"), ConfigError, "model.fp8=current"),
        (("model.fused_projections=false",), ConfigError, "fused_projections"),
        (("parallel.diloco_inner_steps=2",), ConfigError, "DiLoCo"),
        (("train.seq_len=30",), MeshError, "train.seq_len (30) must be divisible by tensor (4)"),
    ],
)
def test_what_it_does_not_run_is_refused_in_one_line(overrides, error, says):
    config = load_config(None, [*TINY, ON, *overrides])
    sizes = parse_mesh("replica=2,tensor=4" if "diloco" in overrides[0] else "data=2,tensor=4")
    with pytest.raises(error) as caught:
        check_config_on_mesh(config, sizes)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_context_and_pipe_axes_are_refused_and_no_tensor_axis_is_said():
    config = load_config(None, [*TINY, ON])
    for mesh in ("context=2,tensor=2", "pipe=2,tensor=2"):
        with pytest.raises(ConfigError, match="collective_matmul=true does not compose with a (context|pipe) axis"):
            check_config_on_mesh(config, parse_mesh(mesh))
    warnings = check_config_on_mesh(config, parse_mesh("data=4"))
    assert "parallel.collective_matmul=True has no effect with a mesh without a tensor axis (no projection is split)" in warnings


@pytest.mark.heavy
def test_xla_gpu_runs_each_permute_async_with_a_gemm_beside_it():
    pytest.importorskip("jax_plugins.xla_cuda12", reason="JAX's CUDA plugin is not installed (pip install -e '.[dev]')")
    from jaxdist.data.sources import resolve_vocab
    from jaxdist.inspect.gpu_program import collective_schedule
    from jaxdist.plan.gpu_target import compile_for_target, target_hardware

    cut = ("model.n_layers=2", "train.seq_len=8192", "train.global_batch=8", "model.remat=full", "train.latency_profile=off")
    config = load_config("llama3-8b", [*cut, "parallel.mesh=fsdp=4,tensor=2", ON])
    resolve_vocab(config)
    trainer, compiled, _ = compile_for_target(config, parse_mesh("fsdp=4,tensor=2"), target_hardware("h100"), 8, 8)
    text = compiled.as_text()
    on_tensor = [op for op in collective_ops(parse_hlo(text), dict(trainer.layout.mesh.shape)) if op.axes == ("tensor",)]
    activation = 8 // 4 * 8192 * 4096 * 2  # one device's [batch, seq, d_model] bf16
    # inside the layer loops (the entry's are the vocabulary-split embedding's and head's)
    in_layers = [op for op in on_tensor if not op.computation.startswith("main")]
    assert not [op for op in in_layers if op.kind == "all-reduce" and op.bytes >= activation // 2], in_layers
    assert [op for op in in_layers if op.kind == "collective-permute"], in_layers
    permutes = collective_schedule(text)["collective-permute"]
    assert permutes["count"] == permutes["async"] > 0 and permutes["overlapped_fraction"] == 1.0, permutes
