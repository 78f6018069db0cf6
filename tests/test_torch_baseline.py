"""The PyTorch baseline (experiments/torch_baseline.py) is jaxdist's model, and its DDP launcher works."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "torch_baseline.py"

_spec = importlib.util.spec_from_file_location("torch_baseline", SCRIPT)
tb = importlib.util.module_from_spec(_spec)
sys.modules["torch_baseline"] = tb
_spec.loader.exec_module(tb)

TINY = ["--d-model", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "64", "--seq-len", "16", "--global-batch", "4"]


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)], ids=["gqa", "mha"])
def test_param_count_matches_jaxdist(heads, kv_heads):
    from jaxdist.config import ModelConfig
    from jaxdist.models.counts import count_params

    cfg = ModelConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=heads, n_kv_heads=kv_heads)
    model = tb.Llama(tb.Dims(vocab_size=256, d_model=128, n_layers=4, n_heads=heads, n_kv_heads=kv_heads))
    assert tb.num_params(model) == count_params(cfg)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_logits_match_jaxdist(fused):
    import jax
    from flax import nnx

    from jaxdist.config import ModelConfig
    from jaxdist.models.llama import Llama

    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, dtype="float32", fused_projections=fused)
    jax_model = Llama(cfg, rngs=nnx.Rngs(0))
    tokens = np.array(jax.random.randint(jax.random.key(1), (2, 64), 0, cfg.vocab_size))
    expected = np.asarray(jax_model(tokens))

    model = tb.Llama(tb.Dims(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2))
    tb.load_jaxdist_params(model, nnx.to_pure_dict(nnx.state(jax_model, nnx.Param)))
    with torch.no_grad():
        got = model(torch.from_numpy(tokens).long()).numpy()
    assert got.shape == expected.shape == (2, 64, 256)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def _single_losses(argv: list[str]) -> list[float]:
    """Per-step losses of one in-process run (the single strategy, no process group)."""
    args = tb.parse_args(argv)
    torch.manual_seed(0)
    model = tb.Llama(tb.dims_from_args(args))
    model.reset_parameters(args.seed)
    _, losses = tb.train_steps(model, tb.make_optimizer(model, args.lr), tb.global_batches(args), 0, args.global_batch)
    return [float(x) for x in losses]


def test_loss_falls_on_a_fixed_batch():
    losses = _single_losses([*TINY, "--steps", "12", "--warmup", "0", "--data", "fixed"])
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--nproc", "3", "--strategy", "ddp"], "not divisible"),
        (["--strategy", "zero9"], "unknown --strategy"),
        (["--nproc", "2", "--strategy", "single"], "one process"),
    ],
)
def test_bad_input_exits_2(argv, message, capsys):
    assert tb.main([*argv, "--global-batch", "16"]) == 2
    err = capsys.readouterr()
    assert err.out == ""
    assert len(err.err.strip().splitlines()) == 1 and message in err.err


def _tagged_processes(tag: str) -> list:
    psutil = pytest.importorskip("psutil")
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("TORCH_BASELINE_TEST_TAG") == tag:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


@pytest.mark.heavy
def test_two_process_ddp_json():
    tag = uuid.uuid4().hex
    env = {**os.environ, "TORCH_BASELINE_TEST_TAG": tag, "PYTHONPATH": str(ROOT)}
    argv = [*TINY, "--steps", "6", "--warmup", "2", "--threads", "1"]
    cmd = [sys.executable, str(SCRIPT), "--nproc", "2", "--strategy", "ddp", *argv, "--json", "--timeout", "100"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    finally:
        deadline = time.monotonic() + 10
        while _tagged_processes(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _tagged_processes(tag)
        for p in left:
            p.kill()
    assert not left, f"processes left running: {left}"
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    result = json.loads(lines[0])
    keys = {
        "framework", "torch_version", "params", "processes", "threads_per_process", "global_batch", "per_device_batch", "seq_len",
        "step_time_s", "step_times_s", "compute_only_step_time_s", "tokens_per_sec", "final_loss", "first_loss",
        "memory_per_device_bytes", "comm_bytes_per_step",
    }  # fmt: skip
    assert keys <= result.keys()
    assert result["framework"] == "pytorch-ddp" and result["processes"] == 2 and result["per_device_batch"] == 2
    assert result["threads_per_process"] == 1 and len(result["step_times_s"]) == 6
    assert result["step_time_s"] > 0 and result["compute_only_step_time_s"] > 0
    params = result["params"]
    assert result["comm_bytes_per_step"] == 4 * params
    assert result["memory_per_device_bytes"] == 16 * params  # params + grads + two Adam moments, fp32, replicated
    assert math.isfinite(result["first_loss"]) and math.isfinite(result["final_loss"])
    # DDP averages gradients over ranks: the same trajectory as one process on the global batch.
    single = _single_losses(argv)
    assert result["first_loss"] == pytest.approx(single[0], abs=1e-5)
    assert result["final_loss"] == pytest.approx(single[-1], abs=1e-4)
