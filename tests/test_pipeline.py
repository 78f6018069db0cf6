"""Pipeline parallelism: every schedule trains exactly like the plain model (losses and
gradients), 1F1B and interleaved 1F1B with and without recompute too, composes with
data / tensor axes, remat and gradient accumulation, and 1F1B keeps less alive than GPipe
(and less again recomputing)."""

import re

import jax
import numpy as np
import pytest

from jaxdist.config import load_config
from jaxdist.data.sources import resolve_vocab
from jaxdist.errors import MeshError
from jaxdist.layout.mesh import parse_mesh

from helpers import TINY, first_batch, first_batch_grads, train_losses

pytestmark = pytest.mark.heavy

EIGHT_LAYERS = ("model.n_layers=8",)
SCHEDULES = {
    "gpipe": ("parallel.schedule=gpipe",),
    "circular": ("parallel.schedule=circular", "parallel.virtual_stages=2"),
    "1f1b": ("parallel.schedule=1f1b",),
    "zb1": ("parallel.schedule=zb1",),
    "zbv": ("parallel.schedule=zbv",),
}
ONE_F_ONE_B = {  # 1F1B's choices: keep or recompute the stage's activations, plain or interleaved
    "1f1b-recompute": ("parallel.schedule=1f1b", "parallel.pipeline_recompute=true"),
    "interleaved-1f1b": ("parallel.schedule=1f1b", "parallel.virtual_stages=2"),
    "interleaved-1f1b-recompute": ("parallel.schedule=1f1b", "parallel.virtual_stages=2", "parallel.pipeline_recompute=true"),
}


# Training steps (the optimizer on the pipelined layout) for each schedule and each mesh once;
# every schedule's gradients on each mesh are the next test's (a step's losses follow from them).
@pytest.mark.parametrize(
    ("mesh", "schedule"), [("pipe=2", "gpipe"), ("pipe=4", "circular"), ("data=2,tensor=2,pipe=2", "1f1b"), ("data=2,pipe=2", "zb1")]
)
def test_losses_match_the_plain_model(mesh, schedule):
    pipelined = train_losses(mesh, (*EIGHT_LAYERS, *SCHEDULES[schedule], "parallel.pipeline_microbatches=4"))
    np.testing.assert_allclose(pipelined, train_losses("data=1", EIGHT_LAYERS), rtol=1e-5)


def _grads(mesh: str, *overrides: str):
    _, loss, grads = first_batch_grads(mesh, *EIGHT_LAYERS, *overrides)
    return loss, jax.tree.leaves(grads)


@pytest.mark.parametrize(
    ("mesh", "schedule"),
    [
        # (zb1 and zbv: the zero-bubble test below, on pipe=4 and on data, fsdp and tensor with pipe)
        *(("pipe=2", s) for s in sorted(SCHEDULES | ONE_F_ONE_B) if not s.startswith("zb")),
        ("pipe=4", "interleaved-1f1b"),
        ("data=2,tensor=2,pipe=2", "interleaved-1f1b"),
        # fsdp and tensor outside the pipeline's region: XLA's partitioner aborted on the loss's
        # target pick (a batched gather) there
        ("fsdp=2,tensor=2,pipe=2", "1f1b-recompute"),
        ("fsdp=2,tensor=2,pipe=2", "gpipe"),
    ],
)
def test_gradients_match_the_plain_model(mesh, schedule):
    loss, grads = _grads(mesh, *(SCHEDULES | ONE_F_ONE_B)[schedule], "parallel.pipeline_microbatches=4")
    ref_loss, ref_grads = _grads("data=1")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):  # relative error of each gradient tensor
        assert np.linalg.norm(g - r) <= 1e-5 * np.linalg.norm(r), (np.linalg.norm(g - r), np.linalg.norm(r))


@pytest.mark.parametrize(
    ("schedule", "mesh", "extra"),
    [
        ("zb1", "pipe=4", ("parallel.pipeline_microbatches=8",)),  # the table by hand in test_pipeline_schedule
        ("zb1", "fsdp=2,pipe=2", ("parallel.pipeline_microbatches=4", "train.microbatches=2")),
        ("zb1", "data=2,tensor=2,pipe=2", ("parallel.pipeline_microbatches=4",)),
        ("zbv", "pipe=4", ("parallel.pipeline_microbatches=8",)),
        ("zbv", "fsdp=2,pipe=2", ("parallel.pipeline_microbatches=4", "train.microbatches=2")),
        ("zbv", "data=2,pipe=2", ("parallel.pipeline_microbatches=2",)),
    ],
)
def test_zero_bubble_gradients_match_the_plain_model(schedule, mesh, extra):
    """zb1 and zbv split each chunk's backward into B and W (``parallel.split_backward``) and run
    W ticks later (zbv: each device runs two chunks, down the devices and back up): the loss and
    gradients are the plain model's."""
    loss, grads = _grads(mesh, f"parallel.schedule={schedule}", *extra)
    ref_loss, ref_grads = _grads("data=1", *(e for e in extra if e.startswith("train.")))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        assert np.linalg.norm(g - r) <= 1e-5 * np.linalg.norm(r), (np.linalg.norm(g - r), np.linalg.norm(r))


@pytest.mark.parametrize("schedule", ["zb1", "zbv"])
def test_zero_bubble_permutes_wait_for_the_heads_collectives(schedule):
    """XLA:CPU runs the operations of a device's program that no data orders in any order, so a
    tick's permutes and the head's conditional (its reduce-scatter and all-gather over pipe) ran in
    one order on one device and the other on its peer, each then waiting in a different collective
    until the 40 s rendezvous timeout aborted the process (the bf16 runs on data=2,pipe=2, about one
    run in two under a second test worker's load). In the compiled CPU program every permute of the
    tick loop reads a value computed from the head's conditional."""
    from jaxdist.inspect.hlo import attribute_computations, parse_hlo
    from jaxdist.training.run import build_trainer

    config = load_config(None, [*TINY, f"parallel.schedule={schedule}", "parallel.pipeline_microbatches=2", "model.n_layers=4"])
    resolve_vocab(config)
    trainer = build_trainer(config, parse_mesh("pipe=2"), jax.devices()[:2])
    state = trainer.init_state(0)
    module = parse_hlo(jax.jit(trainer.loss_and_grads).lower(state.params, first_batch(config, trainer.layout)).compile().as_text())

    def runs_reduce_scatter(computation: str) -> bool:
        body = module.computations[computation]
        called = [c for i in body for key in ("calls", "branch_computations", "to_apply") for c in attribute_computations(i, key)]
        return any(i.opcode == "reduce-scatter" for i in body) or any(runs_reduce_scatter(c) for c in called)

    def is_head(instruction) -> bool:
        branches = attribute_computations(instruction, "branch_computations")
        return instruction.opcode == "conditional" and any(runs_reduce_scatter(b) for b in branches)

    checked = 0
    for body in module.computations.values():  # the tick loop's body: the one with the head in it
        if not any(is_head(i) for i in body):
            continue  # (zbv's once-a-step weight move across pipe is outside the loop)
        by_name = {i.name: i for i in body}
        for permute in (i for i in body if i.opcode == "collective-permute"):
            seen, todo, after_head = set(), [permute.name], False
            while todo and not after_head:
                node = by_name.get(todo.pop())
                if node is None or node.name in seen:
                    continue
                seen.add(node.name)
                after_head = node.opcode == "conditional" and any(
                    runs_reduce_scatter(b) for b in attribute_computations(node, "branch_computations")
                )
                todo.extend(o.split()[-1].lstrip("%") for o in node.operands if o.strip())
            assert after_head, f"{permute.name} does not wait for the head's conditional"
            checked += 1
    assert checked >= 2  # the tick's two permutes (left and right)


def test_zero_bubble_resumes_a_one_f_one_b_checkpoint(tmp_path):
    """The schedule changes how the step runs, not the state: a 1F1B run saved at step 2 goes
    on under zb1, saved at step 4 goes on under zbv, and meets the uninterrupted 1F1B run."""
    from jaxdist.training.run import run

    def steps(schedule: str, stop: int, run_dir):
        overrides = (*TINY, *EIGHT_LAYERS, "train.steps=6", "checkpoint.every_steps=2", f"train.stop_after_step={stop}")
        config = load_config(None, [*overrides, f"parallel.schedule={schedule}", "parallel.pipeline_microbatches=4"])
        return run(config, parse_mesh("pipe=2"), run_dir, devices=jax.devices()[:2], progress=False).losses

    uninterrupted = steps("1f1b", 6, tmp_path / "whole")
    resumed = steps("1f1b", 2, tmp_path / "split") + steps("zb1", 4, tmp_path / "split") + steps("zbv", 6, tmp_path / "split")
    np.testing.assert_allclose(resumed, uninterrupted, rtol=1e-5)


def test_one_f_one_b_carries_the_float16_loss_scale_into_its_backward():
    """fp16 gradients against fp32's: a tiny loss scale (0.0625) lets small cotangents
    underflow, a large one (65536) does not, so the error must grow as the scale shrinks
    -- for 1F1B as for GPipe. 1F1B ran its backward from the unscaled loss and multiplied
    the scale in at the end, so its error did not move with the scale (0.0015 at both)."""
    from jaxdist.layout.mesh import mesh_device_count
    from jaxdist.training.run import build_trainer

    def flat_grads(mesh: str, *overrides: str, scale: float | None = None) -> np.ndarray:
        config = load_config(None, [*TINY, "model.n_layers=2", *overrides])
        resolve_vocab(config)
        sizes = parse_mesh(mesh)
        trainer = build_trainer(config, sizes, jax.devices()[: mesh_device_count(sizes)])
        batch = first_batch(config, trainer.layout)
        _, grads = jax.jit(lambda p, b: trainer.loss_and_grads(p, b, loss_scale=scale))(trainer.init_state(0).params, batch)
        return np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(grads))])

    reference = flat_grads("data=1")
    error = {}
    for schedule in ("gpipe", "1f1b"):
        for scale in (2.0**16, 2.0**-4):
            fp16 = ("model.dtype=float16", f"parallel.schedule={schedule}", "parallel.pipeline_microbatches=2")
            g = flat_grads("pipe=2", *fp16, scale=scale)
            error[schedule, scale] = float(np.linalg.norm(g - reference) / np.linalg.norm(reference))
    for schedule in ("gpipe", "1f1b"):
        assert error[schedule, 2.0**-4] > 2 * error[schedule, 2.0**16], error
    assert error["1f1b", 2.0**16] < 2e-3 and error["1f1b", 2.0**-4] > 0.5 * error["gpipe", 2.0**-4], error


def test_composes_with_remat_and_gradient_accumulation():
    extra = (*EIGHT_LAYERS, *SCHEDULES["1f1b"], "parallel.pipeline_microbatches=2", "model.remat=full", "train.microbatches=2")
    np.testing.assert_allclose(train_losses("data=2,pipe=2", extra), train_losses("data=1", EIGHT_LAYERS), rtol=1e-5)


def test_one_f_one_b_keeps_less_alive_than_gpipe():
    """GPipe keeps all M = 16 microbatches' activations, 1F1B a ring of 2S - 1 = 3 (its vjp
    residuals), recomputing only the ring's stage inputs and one microbatch's working set."""
    from jaxdist.training.aot import analyze

    def temp(schedule: str, *extra: str) -> int:
        config = load_config(
            None,
            [
                *TINY,
                "model.n_layers=4",
                "train.global_batch=64",
                "train.seq_len=64",
                f"parallel.schedule={schedule}",
                "parallel.pipeline_microbatches=16",
                *extra,
            ],
        )
        resolve_vocab(config)
        report = analyze(config, parse_mesh("pipe=2"), jax.devices()[:2])
        assert report["pipeline"]["microbatches"] == 16 and report["collectives"]["collective-permute"]["count"] > 0
        return report["memory_per_device_bytes"]["temp"]

    keep = temp("1f1b")
    assert keep < 0.75 * temp("gpipe")
    assert temp("1f1b", "parallel.pipeline_recompute=true") < 0.9 * keep


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("model.n_layers=3",), "must be divisible by pipe x virtual stages"),
        (("parallel.schedule=circular", "parallel.virtual_stages=4"), "must be divisible by pipe x virtual stages"),
        (("parallel.pipeline_microbatches=1",), "must be >= the pipe axis"),
        (("parallel.virtual_stages=2",), "needs parallel.schedule=circular"),
        (("train.global_batch=12", "parallel.pipeline_microbatches=8"), "x parallel.pipeline_microbatches (8)"),
    ],
)
def test_pipeline_errors(overrides, message):
    from jaxdist.layout.validate import check_config_on_mesh

    config = load_config(None, [*TINY, "model.n_layers=4", *overrides])
    with pytest.raises(MeshError, match=re.escape(message)):
        check_config_on_mesh(config, parse_mesh("pipe=2"))


def test_resnet_cannot_be_staged():
    from jaxdist.layout.validate import check_config_on_mesh

    with pytest.raises(MeshError, match="cannot be staged"):
        check_config_on_mesh(load_config("resnet"), parse_mesh("data=2,pipe=2"))


def test_positional_three_factors_are_data_tensor_pipe():
    assert parse_mesh("2x2x2") == {"replica": 1, "data": 2, "pipe": 2, "fsdp": 1, "expert": 1, "context": 1, "tensor": 2}
