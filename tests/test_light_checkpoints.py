"""Weights-only ("light") checkpoints between the full ones (``checkpoint.params_every_steps``).

One run of TINY for 12 steps (full saves every 6, light every 2, keep 2, eval every 5) is
shared by the module; copies of its run directory are resumed from a full and from a
light checkpoint and compared with the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import hf_reference as ref
import jax
import pytest

from jaxdist import convert
from jaxdist import eval as eval_cli
from jaxdist.config import load_config
from jaxdist.layout.mesh import parse_mesh
from jaxdist.training.checkpoint import checkpoint_steps
from jaxdist.training.run import run
from jaxdist.training.weights import is_weights_only

from helpers import TINY, load_model

CONFIG = (*TINY, "train.steps=12", "train.eval_every=5", "checkpoint.every_steps=6", "checkpoint.params_every_steps=2", "checkpoint.keep=2")


def _train(run_dir, *extra: str, resume: str = "auto"):
    """(LoopResult, stderr, metrics.jsonl's training lines by step) of one run on one device."""
    config = load_config(None, (*CONFIG, *extra))
    with contextlib.redirect_stderr(io.StringIO()) as err:
        result = run(config, parse_mesh("data=1"), run_dir, devices=jax.devices()[:1], progress=False, resume=resume)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return result, err.getvalue(), {x["step"]: x for x in lines if "loss" in x}


def _bytes(path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _copy(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("tensorboard", "xla_cache"))
    return dst


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("light") / "base"
    result, _, metrics = _train(run_dir)
    return run_dir, result, metrics


def test_keep_counts_each_kind_separately(base):
    run_dir, _, _ = base
    # full at 6 and 12 (the end); light at 2, 4, 8, 10 (not at 6 or 12, where a full one is saved); keep=2 of each
    assert checkpoint_steps(run_dir / "checkpoints") == [6, 12]
    assert checkpoint_steps(run_dir / "params") == [8, 10]


def test_weights_only_is_about_a_third_of_a_full_adamw_checkpoint(base):
    run_dir, _, _ = base
    light, full = run_dir / "params" / "10", run_dir / "checkpoints" / "12"
    assert is_weights_only(light) and not is_weights_only(full)
    ratio = _bytes(light / "state") / _bytes(full / "state")  # params vs params + Adam's two moments, all fp32
    assert 0.28 < ratio < 0.40, ratio


def test_resume_auto_picks_the_newest_full_checkpoint(base, tmp_path):
    """After a crash the newest checkpoint may be a light one (10): auto takes full 6 and
    trains on exactly as the uninterrupted run did; the light 8 and 10 of the old branch
    are moved aside (not deleted)."""
    run_dir, _, metrics = base
    copy = _copy(run_dir, tmp_path / "crashed")
    shutil.rmtree(copy / "checkpoints" / "12")  # as if killed after the light save at 10
    _, err, resumed = _train(copy, "train.stop_after_step=7")
    assert f"resumed from step 6 ({copy / 'checkpoints' / '6'}" in err, err
    assert "weights-only checkpoint step(s) 8, 10 moved to" in err, err
    assert resumed[7]["loss"] == metrics[7]["loss"]  # exact resume (fp32, one device)
    assert checkpoint_steps(copy / "params") == [] and checkpoint_steps(copy / "checkpoints") == [6, 7]


def test_named_weights_only_resume_says_so_and_continues_from_its_weights(base, tmp_path):
    """``--resume params:10``: one line says the optimizer starts fresh; the first resumed
    step's loss (weights of step 10 on batch 11) equals the uninterrupted run's, and its
    learning rate is the fresh schedule's first (lr / warmup_steps) rather than the run's."""
    run_dir, _, metrics = base
    copy = _copy(run_dir, tmp_path / "named")
    _, err, resumed = _train(copy, resume="params:10")
    lines = [x for x in err.splitlines() if "optimizer state starts fresh" in x]
    assert len(lines) == 1 and "holds weights only: continuing from its weights at step 10" in lines[0], err
    assert resumed[11]["loss"] == pytest.approx(metrics[11]["loss"], rel=1e-6)
    assert resumed[11]["lr"] == pytest.approx(3e-3 / 10) and metrics[11]["lr"] > 2 * resumed[11]["lr"]  # TINY: lr 3e-3, 10 warmup steps
    assert "checkpoint step(s) 12 moved to" in err, err  # the old branch's full 12
    assert checkpoint_steps(copy / "checkpoints") == [6, 12] and not is_weights_only(copy / "checkpoints" / "12")


def test_named_weights_only_resume_of_a_missing_step_is_one_line(base, tmp_path):
    run_dir, _, _ = base
    from jaxdist.train import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["--run-dir", str(run_dir), "--resume", "params:4", *CONFIG])
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1 and "--resume params:4: no weights-only checkpoint at step 4" in lines[0], lines
    assert "(have 8, 10)" in lines[0]


def test_eval_and_export_take_a_weights_only_checkpoint(base, tmp_path):
    """``jaxdist.eval`` of params/10 equals the run's own eval at step 10; ``to-hf`` exports its weights."""
    run_dir, result, _ = base
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert eval_cli.main(["--checkpoint", str(run_dir / "params" / "10"), "--json"]) == 0
    assert json.loads(out.getvalue())["loss"] == pytest.approx(result.eval_losses[10], rel=1e-5)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert convert.main(["to-hf", str(run_dir / "params" / "10"), str(tmp_path / "hf")]) == 0
    exported = ref.read_llama(tmp_path / "hf")[1]["model.embed_tokens.weight"]
    trained = jax.device_get(load_model(run_dir / "params" / "10").embed[...])
    assert (exported == trained[: exported.shape[0]]).all()


def test_resume_auto_with_only_weights_only_checkpoints_stops_in_one_line(base, tmp_path):
    """No full checkpoint to resume exactly: one line naming the weights-only ones, exit 2,
    and nothing of them is touched (auto neither starts over nor takes one silently)."""
    from jaxdist.train import main

    run_dir, _, _ = base
    copy = _copy(run_dir, tmp_path / "light-only")
    shutil.rmtree(copy / "checkpoints")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["--run-dir", str(copy), *CONFIG])
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "has weights-only checkpoints (steps 8, 10) but no full one" in lines[0] and "--resume params:10" in lines[0], lines
    assert checkpoint_steps(copy / "params") == [8, 10]
