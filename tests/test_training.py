"""End-to-end training: the CLI's run directory contract, ResNet under DP, layouts, NaN stop."""

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import yaml

from jaxdist.config import load_config
from jaxdist.errors import NonFiniteLoss
from jaxdist.mesh import parse_mesh
from jaxdist.run import build_trainer, run

from helpers import TINY

CONTRACT_KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s", "data_wait_s", "mfu"}


def test_cli_writes_metrics_config_and_tensorboard(tmp_path):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI must ask for fake devices itself
    cmd = [
        sys.executable,
        "-m",
        "jaxdist.train",
        "--mesh",
        "data=2,fsdp=2",
        "--steps",
        "6",
        "--run-dir",
        str(run_dir),
        "--log-every",
        "2",
        *TINY[:-1],
        "train.eval_every=3",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "using 4 fake CPU devices" in proc.stderr
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_lines = [line for line in lines if "loss" in line]
    assert [line["step"] for line in train_lines] == [2, 3, 4, 6]  # every 2nd step, and at each eval
    for line in train_lines:
        assert set(line) >= CONTRACT_KEYS, line
        assert all(math.isfinite(line[k]) for k in CONTRACT_KEYS)
        assert line["tokens_per_sec"] > 0 and 0 < line["mfu"] < 1
    eval_lines = [line for line in lines if "eval_loss" in line]
    assert [line["step"] for line in eval_lines] == [3, 6] and all(line["eval_loss"] > 0 for line in eval_lines)
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["parallel"]["mesh"] == "data=2,fsdp=2" and resolved["train"]["steps"] == 6
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tensorboard").iterdir())


def test_resnet_loss_falls_under_data_parallel():
    config = load_config(
        "resnet",
        [
            "train.steps=24",
            "train.global_batch=32",
            "model.image_size=16",
            "train.lr=1e-2",
            "model.resnet_widths=[8,16]",
            "model.resnet_blocks=1",
            "model.dtype=float32",
        ],
    )
    losses = run(config, parse_mesh("data=8"), None, progress=False).losses
    assert np.mean(losses[-4:]) < 0.75 * np.mean(losses[:4]), losses


def _spec_axes(sharding) -> set:
    return {a for entry in sharding.spec if entry for a in (entry if isinstance(entry, tuple) else (entry,))}


def _param_and_moment_shardings(mesh: str, *overrides: str):
    trainer = build_trainer(load_config(None, [*TINY, *overrides]), parse_mesh(mesh), jax.devices())
    state = trainer.abstract_state()
    wq = state.params["blocks"]["attn"]["wq"]
    moments = [v for v in jax.tree.leaves(state.opt_state) if getattr(v, "shape", None) == wq.shape]
    return wq.sharding, moments[0].sharding


@pytest.mark.parametrize(
    ("mesh", "strategy", "param_axes", "moment_axes"),
    [
        ("data=8", "auto", set(), set()),
        ("fsdp=8", "auto", {"fsdp"}, {"fsdp"}),
        ("data=8", "zero1", set(), {"data"}),
        ("data=2,fsdp=2,tensor=2", "auto", {"fsdp", "tensor"}, {"fsdp", "tensor"}),
        ("data=2,fsdp=2,tensor=2", "zero1", {"tensor"}, {"data", "fsdp", "tensor"}),
    ],
)
def test_strategies_lay_out_params_and_moments(mesh, strategy, param_axes, moment_axes):
    param, moment = _param_and_moment_shardings(mesh, f"parallel.strategy={strategy}")
    assert _spec_axes(param) == param_axes
    assert _spec_axes(moment) == moment_axes


def test_init_lands_sharded():
    """Parameters are created inside jit straight into their shards (1/8 per device)."""
    trainer = build_trainer(load_config(None, list(TINY)), parse_mesh("fsdp=8"), jax.devices())
    state = trainer.init_state(seed=0)
    embed = state.params["embed"][...]
    assert {s.data.shape for s in embed.addressable_shards} == {(embed.shape[0], embed.shape[1] // 8)}


def test_non_finite_loss_stops_the_run():
    config = load_config(None, [*TINY, "train.steps=4", "train.lr=1e30", "train.warmup_steps=0", "train.grad_clip=0"])
    with pytest.raises(NonFiniteLoss, match="loss is (nan|inf) at step"):
        run(config, parse_mesh("data=2"), None, devices=jax.devices()[:2], progress=False)


def test_same_seed_same_losses_different_seed_differs():
    from helpers import train_losses

    np.testing.assert_array_equal(train_losses("data=1"), train_losses("data=1", ("train.seed=0",)))
    assert train_losses("data=1", ("train.seed=1",))[0] != train_losses("data=1")[0]
