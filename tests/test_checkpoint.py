"""Checkpoints: exact resume, restore onto another mesh, corrupt-latest fallback,
branches retrained from an older step, non-finite policies, and a run directory that
cannot be written.

Interruptions are real ones past the warmup: the runs stop with ``train.stop_after_step``
inside a 10-step schedule (2 warmup steps), so a resume that re-stretched the cosine or
lost the optimizer's step count would change the losses."""

import jax
import numpy as np
import pytest

from jaxdist.config import load_config
from jaxdist.errors import JaxdistError, NonFiniteLoss
from jaxdist.layout.mesh import mesh_device_count, parse_mesh
from jaxdist.training.checkpoint import Checkpointer, checkpoint_steps
from jaxdist.training.run import build_trainer, run

from helpers import TINY

STEPS = 10  # the schedule every run here shares; shorter runs stop early with train.stop_after_step


def _run(run_dir, mesh: str, stop: int = STEPS, *overrides: str, resume: str = "auto"):
    """The 10-step training on ``mesh``, stopped (and saved) after step ``stop``."""
    overrides = (f"train.steps={STEPS}", "train.warmup_steps=2", "checkpoint.every_steps=4", f"train.stop_after_step={stop}", *overrides)
    config = load_config(None, [*TINY, *overrides])
    sizes = parse_mesh(mesh)
    return run(config, sizes, run_dir, devices=jax.devices()[: mesh_device_count(sizes)], progress=False, resume=resume)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Ten steps in one go on data=2,fsdp=4: the reference every resumed run must meet."""
    return _run(tmp_path_factory.mktemp("reference"), "data=2,fsdp=4").losses


def test_resume_is_exact(tmp_path, uninterrupted):
    first = _run(tmp_path, "data=2,fsdp=4", 6)
    assert checkpoint_steps(tmp_path / "checkpoints") == [4, 6]
    resumed = _run(tmp_path, "data=2,fsdp=4")
    np.testing.assert_array_equal(first.losses + resumed.losses, uninterrupted)  # bitwise, fp32 on CPU


def test_resume_moves_the_optimizer_state_between_host_and_device_memory(tmp_path, uninterrupted):
    """train.optimizer_offload changes where the state lives, not what is saved: a run saved
    with it resumes without it and back, and meets the uninterrupted run bitwise."""
    first = _run(tmp_path, "data=2,fsdp=4", 4, "train.optimizer_offload=true")
    second = _run(tmp_path, "data=2,fsdp=4", 8)
    third = _run(tmp_path, "data=2,fsdp=4", STEPS, "train.optimizer_offload=true")
    np.testing.assert_array_equal(first.losses + second.losses + third.losses, uninterrupted)


@pytest.mark.parametrize("new_mesh", ["fsdp=4", "tensor=2,fsdp=2", "data=8"])
@pytest.mark.heavy
def test_resume_on_another_mesh(tmp_path, uninterrupted, new_mesh):
    _run(tmp_path, "data=2,fsdp=4", 6)
    resumed = _run(tmp_path, new_mesh)
    np.testing.assert_allclose(resumed.losses, uninterrupted[6:], rtol=1e-5)


def test_restore_lands_in_the_new_shardings(tmp_path):
    _run(tmp_path, "data=2,fsdp=4", 4)
    config = load_config(None, [*TINY])
    trainer = build_trainer(config, parse_mesh("tensor=2,fsdp=2"), jax.devices()[:4])
    restored = Checkpointer(tmp_path / "checkpoints", config.checkpoint, read_only=True).restore(4, trainer.abstract_state())
    wqkv = restored.state.params["blocks"]["attn"]["wqkv"][...]  # [layers, embed (fsdp), kv_heads (tensor), q heads + k + v, head_dim]
    assert wqkv.sharding.is_equivalent_to(trainer.state_shardings.params["blocks"]["attn"]["wqkv"].get_value(), wqkv.ndim)
    assert {s.data.shape for s in wqkv.addressable_shards} == {(wqkv.shape[0], wqkv.shape[1] // 2, wqkv.shape[2] // 2, *wqkv.shape[3:])}
    assert restored.data_state == {"start_step": 0, "workers": 0, "grain": {"next_index": 4}}  # absolute: start + Grain's position


def _corrupt(step_dir):
    data_files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data_files
    for p in data_files:
        p.write_bytes(b"\0" * 7)


def _files(directory) -> dict[str, tuple[int, int]]:
    """Every file under ``directory`` with its size and modification time."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(directory.rglob("*")) if p.is_file()}


def test_corrupt_latest_falls_back_to_previous_and_is_moved_aside(tmp_path, uninterrupted, capsys):
    _run(tmp_path, "data=2,fsdp=4", 8)
    _corrupt(tmp_path / "checkpoints" / "8")
    damaged_files = _files(tmp_path / "checkpoints" / "8")
    resumed = _run(tmp_path, "data=2,fsdp=4")
    np.testing.assert_array_equal(resumed.losses, uninterrupted[4:10])  # resumed from step 4
    err = capsys.readouterr().err.splitlines()
    warning = [line for line in err if "checkpoint step 8" in line]
    assert len(warning) == 1 and "damaged" in warning[0] and str(tmp_path / "checkpoints" / "8") in warning[0], warning
    # moved aside in one line, files untouched, so --resume auto never picks it again
    (aside,) = (tmp_path / "checkpoints").glob("damaged-*")
    moved = [line for line in err if "moved to" in line]
    assert len(moved) == 1 and "step(s) 8" in moved[0] and str(aside) in moved[0], moved
    assert _files(aside / "8") == damaged_files
    assert checkpoint_steps(tmp_path / "checkpoints") == [4, 8, 10]  # the new branch saved its own step 8
    again = _run(tmp_path, "data=2,fsdp=4", 10, resume="8")  # the new step 8 is the resumed run's, not the damaged one
    np.testing.assert_array_equal(again.losses, uninterrupted[8:10])


def test_every_checkpoint_damaged_is_an_error_and_nothing_is_deleted(tmp_path):
    _run(tmp_path, "data=2,fsdp=4", 8)  # checkpoints 4 and 8
    for step in (4, 8):
        _corrupt(tmp_path / "checkpoints" / str(step))
    before = _files(tmp_path / "checkpoints")
    with pytest.raises(
        JaxdistError, match=r"no checkpoint in .* can be read \(steps 4, 8 are damaged.*--resume never with a new --run-dir"
    ):
        _run(tmp_path, "data=2,fsdp=4", 10)  # never a silent fresh start at step 0
    assert _files(tmp_path / "checkpoints") == before


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """A run directory with one checkpoint (step 4) of the TINY model, grad_clip=1.0."""
    run_dir = tmp_path_factory.mktemp("four-steps")
    _run(run_dir, "data=2,fsdp=4", 4)
    return run_dir


def test_toggled_grad_clip_is_an_error_naming_the_difference(four_steps, tmp_path, capsys):
    """Another optax chain is another state tree: exit 2 with one line, nothing touched."""
    import shutil

    from jaxdist.train import main

    run_dir = tmp_path / "run"
    shutil.copytree(four_steps, run_dir)
    before = _files(run_dir / "checkpoints")
    argv = ["--run-dir", str(run_dir), "--mesh", "data=2,fsdp=4", "--steps", "8", *TINY, "checkpoint.every_steps=4", "train.grad_clip=0"]
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxdist: error:")]
    assert len(errors) == 1, errors
    assert "checkpoint step 4" in errors[0] and "does not fit" in errors[0]
    assert "opt_state/" in errors[0]  # the differing tree paths
    assert "train.grad_clip 1.0 -> 0" in errors[0]  # and the config change behind them
    assert _files(run_dir / "checkpoints") == before


def test_other_model_shape_is_an_error_naming_the_shape(four_steps, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(four_steps, run_dir)
    before = _files(run_dir / "checkpoints")
    with pytest.raises(
        JaxdistError,
        match=r"does not fit.*params/blocks/attn/wqkv/value \(2, 64, 4, 4, 8\) vs \(2, 128, 4, 4, 16\).*model.d_model 64 -> 128",
    ):
        _run(run_dir, "data=2,fsdp=4", 8, "model.d_model=128")
    assert _files(run_dir / "checkpoints") == before


def test_explicit_resume_step_and_never(tmp_path, uninterrupted):
    _run(tmp_path, "data=2,fsdp=4", 8)
    from_four = _run(tmp_path, "data=2,fsdp=4", 6, resume="4")
    np.testing.assert_array_equal(from_four.losses, uninterrupted[4:6])
    assert checkpoint_steps(tmp_path / "checkpoints") == [4, 6]  # step 8 of the first branch was moved aside
    with pytest.raises(JaxdistError, match="already has checkpoints"):
        _run(tmp_path, "data=2,fsdp=4", 6, resume="never")
    with pytest.raises(JaxdistError, match="no checkpoint at step 5"):
        _run(tmp_path, "data=2,fsdp=4", 6, resume="5")


def _saved_params(step_dir, like) -> list:
    """The parameters stored in one step folder, read onto one device."""
    from jaxdist.training.weights import restore_params

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), like)
    return jax.tree.leaves(jax.device_get(restore_params(step_dir, target)))


def test_a_branch_retrained_from_an_older_step_is_saved_and_the_old_one_kept_aside(tmp_path, capsys):
    """--resume 4 with another lr on a run that reached 8: the new branch's step 8 is
    saved (it was silently skipped), and the old branch's step 8 moves aside untouched."""
    old = _run(tmp_path, "data=2", 8)
    old_files = _files(tmp_path / "checkpoints" / "8")
    capsys.readouterr()
    new = _run(tmp_path, "data=2", 8, "train.lr=1e-4", resume="4")
    moved = [line for line in capsys.readouterr().err.splitlines() if "moved to" in line]
    (aside,) = (tmp_path / "checkpoints").glob("superseded-*")
    assert len(moved) == 1 and "step(s) 8" in moved[0] and "continues from step 4" in moved[0], moved
    assert _files(aside / "8") == old_files
    assert checkpoint_steps(tmp_path / "checkpoints") == [4, 8]
    for saved, final in zip(
        _saved_params(tmp_path / "checkpoints" / "8", new.state.params), jax.tree.leaves(jax.device_get(new.state.params)), strict=True
    ):
        np.testing.assert_array_equal(saved, final)  # the new branch
    old_params = jax.tree.leaves(jax.device_get(old.state.params))
    for saved, final in zip(_saved_params(aside / "8", new.state.params), old_params, strict=True):
        np.testing.assert_array_equal(saved, final)  # the old branch, kept


EXPLODE = ("train.lr=1e30", "train.warmup_steps=0", "train.grad_clip=0")


def test_nonfinite_halt_keeps_last_good_checkpoint(tmp_path):
    with pytest.raises(NonFiniteLoss, match="last checkpoint: step 1"):
        _run(tmp_path, "data=2", 6, *EXPLODE, "checkpoint.every_steps=1")
    assert checkpoint_steps(tmp_path / "checkpoints") == [1]  # the exploded state was never saved


def test_nonfinite_skip_drops_the_updates(tmp_path):
    result = _run(tmp_path, "data=2", 5, *EXPLODE, "train.nonfinite=skip")
    # after step 1's huge update the gradients overflow: every later update is dropped,
    # so the parameters, and with them the loss, stay where step 1 left them
    assert result.skipped_steps == 4
    assert len(set(result.losses[1:])) == 1 and np.isfinite(result.losses[1])
    first_only = _run(tmp_path / "one", "data=2", 1, *EXPLODE)
    params = jax.tree.leaves(jax.device_get(result.state.params))
    expected = jax.tree.leaves(jax.device_get(first_only.state.params))
    for a, b in zip(params, expected, strict=True):
        np.testing.assert_array_equal(a, b)  # every update after step 1 was dropped


def test_unwritable_run_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(JaxdistError, match="cannot write run directory"):
        _run(blocker / "run", "data=2", 2)


def test_failed_save_is_a_clear_error_and_keeps_the_last_checkpoint(tmp_path, uninterrupted, monkeypatch):
    import orbax.checkpoint as ocp

    from jaxdist.training.checkpoint import CheckpointError

    _run(tmp_path, "data=2,fsdp=4", 4)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ocp.CheckpointManager, "save", disk_full)
    with pytest.raises(CheckpointError, match=r"No space left on device.*last good checkpoint: step 4"):
        _run(tmp_path, "data=2,fsdp=4")
    monkeypatch.undo()
    assert checkpoint_steps(tmp_path / "checkpoints") == [4]
    resumed = _run(tmp_path, "data=2,fsdp=4")
    np.testing.assert_array_equal(resumed.losses, uninterrupted[4:])


def test_a_replicated_state_is_saved_from_one_replica_without_a_compile_per_device(tmp_path):
    """The train state's handler writes each array from one replica's shards: saving arrays
    replicated over 8 devices compiles nothing, where Orbax's default handler (replica-parallel
    saving) compiles a slice per array and device; what is read back is what was saved."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxdist.training.orbax_manager import state_handler

    mesh = jax.make_mesh((8,), ("data",))

    def state(rows: int) -> dict:  # each call's own shapes: no slice compiled for an earlier one is reused
        replicated, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
        return {
            "w": jax.device_put(jnp.arange(rows * 64.0).reshape(rows, 64), replicated),
            "b": jax.device_put(jnp.arange(rows * 8.0), split),
        }

    def compiles_saving(handler, tree, path) -> int:
        events = []

        def listen(event: str, seconds: float, **kwargs) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                events.append(seconds)

        jax.monitoring.register_event_duration_secs_listener(listen)
        try:
            with ocp.Checkpointer(handler) as checkpointer:
                checkpointer.save(path, args=ocp.args.PyTreeSave(tree))
        finally:
            jax.monitoring.unregister_event_duration_listener(listen)
        return len(events)

    saved = state(96)
    assert compiles_saving(state_handler(), saved, tmp_path / "ours") == 0
    assert compiles_saving(ocp.PyTreeCheckpointHandler(), state(80), tmp_path / "default") >= 8  # the test can see them
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), saved)
    args = ocp.args.PyTreeRestore(item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))
    with ocp.Checkpointer(state_handler()) as checkpointer:
        restored = checkpointer.restore(tmp_path / "ours", args=args)
    for key in saved:
        np.testing.assert_array_equal(np.asarray(restored[key]), np.asarray(saved[key]))
        assert restored[key].sharding == saved[key].sharding


def test_orbax_never_asks_the_preemption_sync_point(tmp_path, monkeypatch):
    """Orbax asks JAX's preemption sync point itself, also from the thread that finalises an
    async save, with that save's older step: the sync manager would publish a step the loop
    has passed, and the processes would disagree on the step to save (a hang;
    ``training/orbax_manager.py``). Only the loop may ask, once a step, in order."""
    import threading

    from jax.experimental import multihost_utils

    asked = []
    monkeypatch.setattr(
        multihost_utils, "reached_preemption_sync_point", lambda step: asked.append((step, threading.current_thread().name))
    )
    _run(tmp_path, "data=2", 6, "checkpoint.async_save=true")  # saves at steps 4 and 6, each finalised on Orbax's thread
    assert checkpoint_steps(tmp_path / "checkpoints") == [4, 6]
    assert asked == []


def test_time_based_saves_wait_for_the_interval(tmp_path, monkeypatch):
    """``checkpoint.every_minutes`` alone: due once the interval has passed since the last
    save (or the start), not before. (Across processes, process 0's clock decides: see
    tests/test_distributed.py.)"""
    import types

    import jaxdist.training.checkpoint

    now = [1000.0]
    monkeypatch.setattr(jaxdist.training.checkpoint, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    config = load_config(None, ["checkpoint.every_steps=0", "checkpoint.every_minutes=2"])
    checkpointer = Checkpointer(tmp_path / "checkpoints", config.checkpoint)
    try:
        now[0] += 119
        assert not checkpointer.due(1)
        now[0] += 1
        assert checkpointer.due(2)
    finally:
        checkpointer.close()


def test_resume_adapts_microbatches_with_a_pipeline_too(tmp_path, capsys):
    """Saved with global batch 16, 2 microbatches of 4 pipeline microbatches each; resumed
    on data=4,pipe=2, 2 x 4 x 4 rows do not fit 16 but 1 x 4 x 4 do: microbatches 1, said
    in one line (the pipeline's microbatches used to be left out, and the resume refused)."""
    from jaxdist.cluster.elastic import fit_problem
    from jaxdist.layout.validate import check_config_on_mesh
    from jaxdist.training.run_plan import resolve_run

    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    overrides = [*TINY, "train.global_batch=16", "train.microbatches=2", "parallel.pipeline_microbatches=4", "parallel.mesh=data=4,pipe=2"]
    config = load_config(None, overrides)
    assert fit_problem(config, 4, 2, resuming=True) is None  # the elastic launcher agrees (4 processes x 2 devices)
    plan = resolve_run(config, tmp_path)
    assert plan.start == "resume" and plan.config.train.microbatches == 1
    assert config.train.microbatches == 2  # the caller's config is left as given
    assert "train.microbatches 2 -> 1 keeps the global batch 16" in capsys.readouterr().err
    check_config_on_mesh(plan.config, parse_mesh("data=4,pipe=2"))  # and the run accepts it
