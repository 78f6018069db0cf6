"""Rerunning a finished run: one line ("already at step N"), exit 0, nothing compiled, no
process started by a launcher and no start record in ``elastic.jsonl``. A run stopped by
``train.stop_after_step`` is finished at that step; ``--resume STEP`` at an older step, or
more ``--steps``, is training left. (The launcher across nodes: tests/test_rendezvous.py.)"""

from pathlib import Path

import jax
import pytest

import jaxdist.launch as launch
from jaxdist.cluster import elastic, launcher
from jaxdist.config import load_config
from jaxdist.layout.mesh import parse_mesh
from jaxdist.training.checkpoint import Checkpointer
from jaxdist.training.run import build_trainer, run, write_config
from jaxdist.training.step import Trainer

from helpers import TINY

OVERRIDES = (*TINY, "data.source=synthetic", "train.global_batch=8")


def _config(*overrides: str):
    return load_config(None, [*OVERRIDES, *overrides])


def _with_checkpoints(run_dir: Path, *steps: int) -> Path:
    for step in steps:  # the launchers look at the step folders only (no JAX)
        (run_dir / "checkpoints" / str(step)).mkdir(parents=True)
    return run_dir


FINISHED = {  # (overrides, checkpoint steps, --resume): the step a rerun would stay at, or None
    "at train.steps": (["train.steps=4"], [2, 4], "auto", 4),
    "past train.steps": (["train.steps=3"], [2, 4], "auto", 4),
    "more steps asked": (["train.steps=6"], [2, 4], "auto", None),
    "no checkpoint": (["train.steps=4"], [], "auto", None),
    "at stop_after_step": (["train.steps=8", "train.stop_after_step=4"], [4], "auto", 4),
    "stopped, run on without it": (["train.steps=8"], [4], "auto", None),
    "resume the last step": (["train.steps=4"], [2, 4], "4", 4),
    "resume an older step": (["train.steps=4"], [2, 4], "2", None),
    "resume never": (["train.steps=4"], [2, 4], "never", None),  # the processes refuse it
    "resume a path": (["train.steps=4"], [2, 4], "/elsewhere/checkpoints/4", None),  # the processes decide
}


@pytest.mark.parametrize("case", FINISHED, ids=list(FINISHED))
def test_which_runs_are_finished(case, tmp_path):
    overrides, steps, resume, expected = FINISHED[case]
    assert elastic.finished_step(_config(*overrides), _with_checkpoints(tmp_path, *steps), resume) == expected


@pytest.fixture
def no_processes(monkeypatch):
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda *a, **k: pytest.fail("the launcher started a process"))


@pytest.mark.parametrize(
    "flags", [["--nproc", "2"], ["--nproc", "2", "--min-nproc", "1", "--devices-per-proc", "2"]], ids=["plain", "elastic"]
)
def test_a_launcher_starts_nothing_for_a_finished_run(flags, tmp_path, capsys, no_processes):
    run_dir = _with_checkpoints(tmp_path / "run", 2, 4)
    argv = [*flags, "--", "--mesh", "data=-1,tensor=2", *OVERRIDES, "train.steps=4", "--run-dir", str(run_dir)]
    assert launch.main(argv) == 0
    assert capsys.readouterr().err.splitlines() == ["jaxdist: already at step 4 (train.steps=4): nothing to train"]
    assert not (run_dir / "elastic.jsonl").exists()  # no start record


def test_a_finished_run_says_so_and_compiles_nothing(tmp_path, capsys, monkeypatch):
    devices, sizes = [jax.devices()[0]], parse_mesh("data=1")
    config = _config("train.steps=2")
    config.train.schedule_steps = 2  # as run() records it
    trainer = build_trainer(config, sizes, devices)
    state = trainer.init_state(0)  # a run's state at steps 1 and 2, without compiling its step
    checkpointer = Checkpointer(tmp_path / "checkpoints", config.checkpoint)
    for step in (1, 2):
        state.step = jax.numpy.asarray(step, jax.numpy.int32)
        checkpointer.save(step, state, {}, config.to_dict())
    checkpointer.wait()
    checkpointer.close()
    write_config(tmp_path, config)

    def rerun(*overrides: str, resume: str = "auto"):
        return run(_config(*overrides), sizes, tmp_path, devices=devices, progress=False, resume=resume)

    class Compiled(Exception):
        pass

    def compile_step(*args, **kwargs):
        raise Compiled

    monkeypatch.setattr(Trainer, "compile_step", compile_step)
    config_yaml = (tmp_path / "config.yaml").read_text()
    assert rerun("train.steps=2").losses == []
    assert capsys.readouterr().err.splitlines()[-1] == "jaxdist: already at step 2 (train.steps=2): nothing to train"
    assert rerun("train.steps=4", "train.stop_after_step=2").losses == []
    assert capsys.readouterr().err.splitlines()[-1] == "jaxdist: already at step 2 (train.stop_after_step=2): nothing to train"
    assert (tmp_path / "config.yaml").read_text() == config_yaml  # nothing written
    assert not list(tmp_path.glob("tensorboard/*"))  # not even an empty event file
    with pytest.raises(Compiled):  # training left: more steps
        rerun("train.steps=3")
    with pytest.raises(Compiled):  # an older step is not finished
        rerun("train.steps=2", resume="1")
