"""Checkpoints: exact resume, restore onto another mesh, corrupt-latest fallback,
non-finite policies, and a run directory that cannot be written."""

import jax
import numpy as np
import pytest

from jaxdist.checkpoint import Checkpointer, checkpoint_steps
from jaxdist.config import load_config
from jaxdist.errors import JaxdistError, NonFiniteLoss
from jaxdist.mesh import mesh_device_count, parse_mesh
from jaxdist.run import build_trainer, run

from helpers import TINY


def _run(run_dir, mesh: str, steps: int, *overrides: str, resume: str = "auto"):
    config = load_config(None, [*TINY, f"train.steps={steps}", "checkpoint.every_steps=4", *overrides])
    sizes = parse_mesh(mesh)
    return run(config, sizes, run_dir, devices=jax.devices()[: mesh_device_count(sizes)], progress=False, resume=resume)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Ten steps in one go on data=2,fsdp=4: the reference every resumed run must meet."""
    return _run(tmp_path_factory.mktemp("reference"), "data=2,fsdp=4", 10).losses


def test_resume_is_exact(tmp_path, uninterrupted):
    first = _run(tmp_path, "data=2,fsdp=4", 6)
    assert checkpoint_steps(tmp_path / "checkpoints") == [4, 6]
    resumed = _run(tmp_path, "data=2,fsdp=4", 10)
    np.testing.assert_array_equal(first.losses + resumed.losses, uninterrupted)  # bitwise, fp32 on CPU


@pytest.mark.parametrize("new_mesh", ["fsdp=4", "tensor=2,fsdp=2", "data=8"])
def test_resume_on_another_mesh(tmp_path, uninterrupted, new_mesh):
    _run(tmp_path, "data=2,fsdp=4", 6)
    resumed = _run(tmp_path, new_mesh, 10)
    np.testing.assert_allclose(resumed.losses, uninterrupted[6:], rtol=1e-5)


def test_restore_lands_in_the_new_shardings(tmp_path):
    _run(tmp_path, "data=2,fsdp=4", 4)
    config = load_config(None, [*TINY])
    trainer = build_trainer(config, parse_mesh("tensor=2,fsdp=2"), jax.devices()[:4])
    restored = Checkpointer(tmp_path / "checkpoints", config.checkpoint, read_only=True).restore(4, trainer.abstract_state())
    wq = restored.state.params["blocks"]["attn"]["wq"][...]
    assert wq.sharding.is_equivalent_to(trainer.state_shardings.params["blocks"]["attn"]["wq"].get_value(), wq.ndim)
    assert {s.data.shape for s in wq.addressable_shards} == {(wq.shape[0], wq.shape[1] // 2, wq.shape[2] // 2, wq.shape[3])}
    assert restored.data_state == {"next_index": 4}


def _corrupt(step_dir):
    data_files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data_files
    for p in data_files:
        p.write_bytes(b"\0" * 7)


def test_corrupt_latest_falls_back_to_previous(tmp_path, uninterrupted, capsys):
    _run(tmp_path, "data=2,fsdp=4", 8)
    _corrupt(tmp_path / "checkpoints" / "8")
    resumed = _run(tmp_path, "data=2,fsdp=4", 10)
    np.testing.assert_array_equal(resumed.losses, uninterrupted[4:10])  # resumed from step 4
    assert "checkpoint step 8" in capsys.readouterr().err
    assert (tmp_path / "checkpoints" / "8").exists()  # nothing deleted


def test_explicit_resume_step_and_never(tmp_path, uninterrupted):
    _run(tmp_path, "data=2,fsdp=4", 8)
    from_four = _run(tmp_path, "data=2,fsdp=4", 6, resume="4")
    np.testing.assert_array_equal(from_four.losses, uninterrupted[4:6])
    with pytest.raises(JaxdistError, match="already has checkpoints"):
        _run(tmp_path, "data=2,fsdp=4", 6, resume="never")
    with pytest.raises(JaxdistError, match="no checkpoint at step 5"):
        _run(tmp_path, "data=2,fsdp=4", 6, resume="5")


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

    from jaxdist.checkpoint import CheckpointError

    _run(tmp_path, "data=2,fsdp=4", 4)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ocp.CheckpointManager, "save", disk_full)
    with pytest.raises(CheckpointError, match=r"No space left on device.*last good checkpoint: step 4"):
        _run(tmp_path, "data=2,fsdp=4", 10)
    monkeypatch.undo()
    assert checkpoint_steps(tmp_path / "checkpoints") == [4]
    resumed = _run(tmp_path, "data=2,fsdp=4", 10)
    np.testing.assert_array_equal(resumed.losses, uninterrupted[4:])
