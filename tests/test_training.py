"""End-to-end training: the CLI's run directory contract, ResNet under DP, layouts, NaN stop."""

import json
import math
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml

from jaxdist.config import load_config
from jaxdist.errors import NonFiniteLoss
from jaxdist.layout.mesh import parse_mesh
from jaxdist.training.run import build_trainer, run

from helpers import SMALL_TEXT, TINY, first_batch_grads, subprocess_env, without_session_cache

CONTRACT_KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s", "data_wait_s", "mfu"}


@pytest.mark.heavy
def test_cli_writes_metrics_config_and_tensorboard(tmp_path):
    run_dir = tmp_path / "run"
    env = subprocess_env()  # the CLI must ask for fake devices itself
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
    started = time.time()
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
    # goodput.json: the process's wall time, from its creation to the file, in shares that add up to it
    accounted = json.loads((run_dir / "goodput.json").read_text())
    assert accounted["wall_s"] == pytest.approx((run_dir / "goodput.json").stat().st_mtime - started, abs=2.0)
    assert sum(accounted["seconds"].values()) == pytest.approx(accounted["wall_s"], rel=1e-3, abs=0.01)
    assert accounted["seconds"]["idle"] <= 0.02 * accounted["wall_s"] and accounted["steps"] == {"productive": 6, "retrained": 0}
    assert accounted["seconds"]["compile"] > 0 and accounted["seconds"]["eval"] > 0 and accounted["seconds"]["checkpoint"] > 0
    assert f"jaxdist: goodput {accounted['goodput']:.0%} of {accounted['wall_s']:.1f}s (" in proc.stderr


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
    wqkv = state.params["blocks"]["attn"]["wqkv"]
    moments = [v for v in jax.tree.leaves(state.opt_state) if getattr(v, "shape", None) == wqkv.shape]
    return wqkv.sharding, moments[0].sharding


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


@pytest.mark.parametrize("tied", [False, True])
def test_the_first_loss_is_near_uniform_tied_or_not(tied):
    """At init the logits are near uniform: the loss is within 1 nat of ln(vocab), tied
    embeddings included (they started at std 1 once: loss 28.7 on the 256 bytes)."""
    trainer, loss, _ = first_batch_grads("data=1", f"model.tie_embeddings={str(tied).lower()}")
    vocab = trainer.config.model.vocab_size
    assert abs(loss - math.log(vocab)) < 1.0, (loss, math.log(vocab))


def test_non_finite_loss_stops_the_run():
    config = load_config(None, [*TINY, "train.steps=4", "train.lr=1e30", "train.warmup_steps=0", "train.grad_clip=0"])
    with pytest.raises(NonFiniteLoss, match="loss is (nan|inf) at step"):
        run(config, parse_mesh("data=2"), None, devices=jax.devices()[:2], progress=False)


def test_same_seed_same_losses_different_seed_differs():
    from helpers import train_losses

    def fresh_run(seed: int) -> list[float]:  # not the cached helper: a second, independent run
        config = load_config(None, [*TINY, "train.steps=5", f"train.seed={seed}"])
        return run(config, parse_mesh("data=1"), None, devices=jax.devices()[:1], progress=False).losses

    np.testing.assert_array_equal(fresh_run(1), train_losses("data=1", ("train.seed=1",)))
    assert fresh_run(2)[0] != train_losses("data=1", ("train.seed=1",))[0]


EXPLODE = ("train.lr=1e30", "train.warmup_steps=0", "train.grad_clip=0", "train.nonfinite=skip")


def test_skipped_steps_do_not_advance_the_logged_learning_rate(tmp_path):
    """After step 1 every update overflows and is dropped: the optimizer's step count stays
    at 1, so the rate it would apply (and the logged lr) stays at the schedule's step-1 value."""
    config = load_config(None, [*TINY, "train.steps=5", *EXPLODE, "checkpoint.every_steps=0"])
    result = run(config, parse_mesh("data=2"), tmp_path, devices=jax.devices()[:2], progress=False)
    lrs = [line["lr"] for line in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "lr" in line]
    assert result.skipped_steps == 4 and len(lrs) == 5
    assert lrs[1] < lrs[0] and lrs[1:] == [lrs[1]] * 4, lrs  # cosine decay moved once, then the count stood still
    from jaxdist.training.state import optimizer_step

    assert int(optimizer_step(result.state.opt_state)) == 1


def test_too_many_skips_in_a_row_halt_the_run():
    config = load_config(None, [*TINY, "train.steps=8", *EXPLODE, "train.max_skips=2"])
    with pytest.raises(NonFiniteLoss, match=r"3 non-finite steps in a row up to step 4 \(train.max_skips=2\)"):
        run(config, parse_mesh("data=2"), None, devices=jax.devices()[:2], progress=False)


def test_metrics_are_strict_json_with_null_for_unknown(tmp_path):
    from jaxdist.training.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, 1, progress=False, print_lines=True)
    logger.log(1, {"loss": 2.5, "mfu": float("nan"), "grad_norm": np.float32(np.inf)})
    logger.close()

    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line, parse_constant=reject) == {"step": 1, "loss": 2.5, "mfu": None, "grad_norm": None}


@pytest.mark.parametrize(
    ("kind", "peak"),
    [
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("Mystery X1", None),
    ],
)
def test_peak_flops_by_device_kind(kind, peak):
    from types import SimpleNamespace

    from jaxdist.training.metrics import peak_flops_per_device

    found = peak_flops_per_device([SimpleNamespace(device_kind=kind, platform="gpu", process_index=0)])
    assert found == peak if peak else math.isnan(found)


def test_logged_mfu_matches_xla_flops_and_the_wall_clock(tmp_path, monkeypatch):
    """MFU's two halves checked against independent measures: the FLOPs per step it uses
    against XLA's cost analysis of the compiled step (no layer loop, so XLA counts every
    op once; XLA also counts elementwise work, the optimizer and causal attention's masked
    half, hence a little more), and the logged step times against the wall clock this test
    reads at every log line: they tile it (their sum over 40 steps is the time between the
    first and last line within 2%)."""
    from jaxdist.data.sources import resolve_vocab
    from jaxdist.training.aot import compile_train_step
    from jaxdist.training.metrics import MetricsLogger

    peak = 1e12
    overrides = [*TINY, "model.scan_layers=false", f"train.peak_flops={peak}", "checkpoint.every_steps=0"]
    config = load_config(None, [*overrides, "train.steps=40"])
    logged_at, log = [], MetricsLogger.log

    def timed_log(self, step, values):
        if "loss" in values:
            logged_at.append(time.perf_counter())
        log(self, step, values)

    monkeypatch.setattr(MetricsLogger, "log", timed_log)
    run(config, parse_mesh("data=2"), tmp_path, devices=jax.devices()[:2], progress=False)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]

    analysed = load_config(None, overrides)
    resolve_vocab(analysed)
    _, compiled = compile_train_step(analysed, parse_mesh("data=1"), jax.devices()[:1])
    cost = compiled.cost_analysis()
    xla_flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
    for line in lines:  # MFU = flops per step / (step time x devices x peak)
        flops_per_step = line["mfu"] * line["step_time_s"] * 2 * peak
        assert 0.85 * xla_flops <= flops_per_step <= xla_flops, (flops_per_step, xla_flops)
    assert len(lines) == len(logged_at) == 40  # log_every=1
    logged = sum(line["step_time_s"] for line in lines[1:])
    assert logged == pytest.approx(logged_at[-1] - logged_at[0], rel=0.02), (logged, logged_at[-1] - logged_at[0])


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = without_session_cache(subprocess_env())  # the run's own cache
    cmd = [sys.executable, "-m", "jaxdist.train", "--mesh", "data=2", "--steps", "2", *TINY[:-1], "checkpoint.every_steps=0"]
    cmd += [*SMALL_TEXT, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


@pytest.mark.heavy
def test_compilation_cache_is_reused_by_the_next_start(tmp_path):
    """A restarted run finds its programs in the persistent cache: ``auto`` keeps it in the
    run directory (a folder per model configuration), and a second start pointed at it adds
    no entry (every program was a hit)."""
    _cli("--run-dir", str(tmp_path / "a"))
    cache = tmp_path / "a" / "xla_cache"
    (family,) = cache.iterdir()
    entries = sorted(p.name for p in family.iterdir())
    assert entries
    _cli("--run-dir", str(tmp_path / "b"), f"train.compile_cache={cache}")
    assert list(cache.iterdir()) == [family] and sorted(p.name for p in family.iterdir()) == entries


def test_compilation_cache_off_and_without_a_run_dir(tmp_path):
    import jax

    from jaxdist.training.compile_cache import enable_compile_cache

    before = jax.config.jax_compilation_cache_dir
    assert enable_compile_cache(load_config(None, ["train.compile_cache=off"]), tmp_path) is None
    assert enable_compile_cache(load_config(None, []), None) is None
    assert jax.config.jax_compilation_cache_dir == before and not (tmp_path / "xla_cache").exists()
