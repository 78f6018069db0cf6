"""Compressed gradient reduction (parallel.grad_reduce): bytes, accuracy, convergence, resume.

Each check compares against an independent path: float32 reduction (GSPMD's own), the
plain sum of the per-device gradients, XLA's compiled program, an uninterrupted run.
"""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.cluster.launcher import free_port
from jaxdist.config import load_config
from jaxdist.inspect.collectives import collective_ops
from jaxdist.inspect.hlo import parse_hlo
from jaxdist.layout.mesh import build_mesh, mesh_device_count, parse_mesh
from jaxdist.parallel.grad_reduce import ReducePlan, reduce_gradients
from jaxdist.training.aot import analyze
from jaxdist.training.compile_cache import enable_compile_cache
from jaxdist.training.run import build_trainer, run

from helpers import SMALL_TEXT, TINY, long_runs, train_losses

MODES = {"float32": (), "bfloat16": (), "int8": (), "topk": ()}


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """XLA's persistent compilation cache in this process (as any run with a run directory
    turns it on; an earlier one is kept): the runs of each reduction mode compile their
    shared programs, the parameter init above all (~7 s on CPU), once."""
    return enable_compile_cache(load_config(None, []), tmp_path_factory.mktemp("compile_cache"))


def _config(mesh: str, *overrides: str):
    return load_config(None, (*TINY, f"parallel.mesh={mesh}", *overrides))


def _gradient_wire_bytes(mode: str, mesh: str = "data=8") -> float:
    report = analyze(_config(mesh, f"parallel.grad_reduce={mode}"), parse_mesh(mesh))
    return sum(stats["wire_bytes"] for stats in report["collectives"].values() if stats["count"])


@pytest.mark.heavy
def test_wire_bytes_per_step_under_data_8():
    """Bytes each device puts on the wire per step, from the compiled programs (the loss's
    scalar all-reduce included)."""
    full = _gradient_wire_bytes("float32")
    ratios = {mode: _gradient_wire_bytes(mode) / full for mode in ("bfloat16", "int8", "topk")}
    assert ratios["bfloat16"] == pytest.approx(0.5, abs=0.005), ratios
    assert ratios["int8"] <= 0.27, ratios  # int8 values + one fp32 scale per 256
    assert ratios["topk"] <= 0.03, ratios  # 1%: values + int32 indices, twice (to the owner, back)


def _batch(trainer, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (trainer.config.train.global_batch, trainer.config.train.seq_len + 1))
    batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}
    return jax.device_put(batch, trainer.layout.batch_sharding(2))


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


@pytest.mark.heavy
def test_gradients_match_float32_within_the_compression_error(capsys):
    """FSDP x TP: one step's gradients against GSPMD's fp32 reduction; topk with fraction 1
    keeps every entry, so it must be exact. (Plain DP is the convergence test's layout.)"""
    mesh, grads, params = "data=2,fsdp=2,tensor=2", {}, None
    for mode in ("float32", "int8", "topk;parallel.grad_topk_fraction=1.0"):  # bf16: see the convergence test
        trainer = build_trainer(_config(mesh, *f"parallel.grad_reduce={mode}".split(";")), parse_mesh(mesh))
        if params is None:  # one init (the modes lay the parameters out alike): every mode at the same point
            params = trainer.init_state(0).params
        _, grads[mode.split(";")[0]] = jax.jit(trainer.loss_and_grads)(params, _batch(trainer))
    reference = _flat(grads["float32"])
    error = {mode: np.linalg.norm(_flat(g) - reference) / np.linalg.norm(reference) for mode, g in grads.items()}
    assert error["topk"] < 1e-6, error
    # the weaker FSDP path (parameters gathered once per step) is said in one line
    assert "parallel.grad_reduce=int8 with fsdp: parameters are gathered once per step" in capsys.readouterr().err
    assert 0 < error["int8"] < 0.03, error


def test_hierarchical_reduction_compresses_only_the_outer_axis():
    """compress_axes=dcn's scheme on one process: fp32 over fsdp (a host), int8 over data
    (across hosts). The sum must match the plain sum of the per-device gradients, and in
    the compiled program only the collectives over ``data`` may carry int8."""
    mesh = build_mesh(parse_mesh("data=2,fsdp=2"), jax.devices()[:4])
    shardings = {"w": jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())}
    local = {"w": jax.random.normal(jax.random.key(0), (4, 96, 40))}  # one gradient per device
    residual = {"w": jnp.zeros((4, 96, 40))}
    device_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))
    local, residual = jax.device_put((local, residual), device_sharding)
    for mode, tolerance in (("int8", 0.02), ("topk", 1e-6)):
        plan = ReducePlan(mode, compressed_axes=("data",), full_axes=("fsdp",), topk_fraction=1.0, error_feedback=True)
        reduce = jax.jit(lambda g, r, plan=plan: reduce_gradients(g, r, plan, shardings, mesh))
        total, new_residual = reduce(local, residual)
        expected = np.asarray(local["w"]).sum(0)
        assert np.linalg.norm(np.asarray(total["w"]) - expected) / np.linalg.norm(expected) < tolerance
        # error feedback: what went on the wire plus what was kept back is the exact sum
        kept = np.asarray(new_residual["w"]).sum(0)
        np.testing.assert_allclose(np.asarray(total["w"]) + kept, expected, rtol=1e-5, atol=1e-5)
    int8_plan = ReducePlan("int8", ("data",), ("fsdp",), 1.0, True)
    module = parse_hlo(jax.jit(lambda g, r: reduce_gradients(g, r, int8_plan, shardings, mesh)).lower(local, residual).compile().as_text())
    dtypes = {}
    for op in collective_ops(module, {"data": 2, "fsdp": 2}):
        dtypes.setdefault(op.axes, set()).update(t.split("[")[0] for t in module.shapes[op.name].replace("(", "").split(", "))
    assert dtypes[("fsdp",)] == {"f32"}, dtypes
    assert "s8" in dtypes[("data",)], dtypes


def test_dcn_compression_on_one_process_says_nothing_crosses_hosts(capsys):
    """compress_axes=dcn compresses only what crosses hosts; on one process nothing does:
    one line says so and the run reduces in fp32 (it used to compress every batch axis)."""
    overrides = ("parallel.grad_reduce=int8", "parallel.compress_axes=dcn")
    trainer = build_trainer(_config("data=2", *overrides), parse_mesh("data=2"), jax.devices()[:2])
    lines = [x for x in capsys.readouterr().err.splitlines() if "compress_axes=dcn" in x]
    assert len(lines) == 1 and "on one process" in lines[0] and "reduce in float32" in lines[0], lines
    assert trainer.reduce_plan is None and trainer.abstract_state().residual is None
    assert train_losses("data=2", overrides, 3) == train_losses("data=2", (), 3)  # GSPMD's fp32 reduction, bitwise


@pytest.mark.heavy
def test_error_feedback_residuals_do_not_depend_on_the_loss_scale():
    """fp16 + int8 with error feedback: after a step at scale S, the next step's update is
    the same whether the scale stayed S or an overflow halved it (residuals are stored
    unscaled; in scale units they counted twice after the halving)."""
    from jaxdist.training.loss_scale import LossScale

    sgd = ("train.optimizer=sgd", "train.grad_clip=0", "train.warmup_steps=0", "train.lr=0.1", "train.weight_decay=0")
    trainer = build_trainer(_config("data=2", "model.dtype=float16", "parallel.grad_reduce=int8", *sgd), parse_mesh("data=2"))
    state, _ = trainer.train_step(trainer.init_state(0), _batch(trainer, 0))
    assert any(float(np.abs(np.asarray(r)).max()) > 0 for r in jax.tree.leaves(state.residual))
    before = _flat(state.params)

    def next_update(scale: float) -> np.ndarray:
        s = state.loss_scale
        at = state.__class__(**{**vars(state), "loss_scale": LossScale(jnp.asarray(scale, jnp.float32), s.clean_steps, s.overflows)})
        at = jax.tree.map(jnp.copy, at)  # the step donates its input
        after, metrics = trainer.train_step(at, _batch(trainer, 1))
        assert not bool(metrics["skipped"])
        return _flat(after.params) - before

    kept, halved = next_update(2.0**16), next_update(2.0**15)
    assert np.linalg.norm(halved - kept) <= 1e-4 * np.linalg.norm(kept), np.linalg.norm(halved - kept) / np.linalg.norm(kept)


@pytest.mark.heavy
def test_bfloat16_and_int8_reductions_train_like_float32():
    """60 steps of ``tiny`` on the stdlib corpus, fp32 compute, data=2 (mean of the last 10
    steps' losses). The 200-step comparison of every mode, top-k
    with and without error feedback included (which needs the length to tell them apart), is
    ``experiments/convergence.py --only grad_reduce``."""
    modes = {"float32": (), "bfloat16": ("parallel.grad_reduce=bfloat16",), "int8": ("parallel.grad_reduce=int8",)}
    # compiled at the session's -O0: 60 steps cost less than XLA's full optimisation of 3 programs
    runs = long_runs(*(("data=2", (*overrides, "train.log_every=10"), 60) for overrides in modes.values()), optimized=False)
    final = {name: float(np.mean(r["losses"][-10:])) for name, r in zip(modes, runs, strict=True)}
    gap = {name: value / final["float32"] - 1 for name, value in final.items()}
    assert runs[1]["losses"] != runs[0]["losses"] and runs[2]["losses"] != runs[0]["losses"]  # each mode changed the sums
    assert abs(gap["bfloat16"]) <= 0.01, gap
    assert abs(gap["int8"]) <= 0.03, gap


def _run(tmp_path, name: str, mesh: str, stop: int, *overrides: str, resume: str = "auto"):
    """10 steps (2 warmup), stopped after ``stop``."""
    config = _config(
        mesh,
        "train.steps=10",
        "train.warmup_steps=2",
        f"train.stop_after_step={stop}",
        "checkpoint.every_steps=3",
        "checkpoint.async_save=false",
        *overrides,
    )
    sizes = parse_mesh(mesh)
    return run(config, sizes, tmp_path / name, devices=jax.devices()[: mesh_device_count(sizes)], progress=False, resume=resume)


@pytest.mark.heavy
def test_resume_with_residuals_is_exact_and_survives_a_mesh_change(tmp_path, capsys):
    int8 = ("parallel.grad_reduce=int8",)
    whole = _run(tmp_path, "whole", "data=4", 10, *int8)
    _run(tmp_path, "split", "data=4", 3, *int8)
    resumed = _run(tmp_path, "split", "data=4", 10, *int8)
    assert resumed.losses == whole.losses[3:]  # bitwise
    for a, b in zip(jax.tree.leaves(whole.state.residual), jax.tree.leaves(resumed.state.residual), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(np.abs(np.asarray(r)).max() > 0 for r in jax.tree.leaves(whole.state.residual))

    # Step 6 of the 4-device run, continued on 2 devices: the residuals' sum (what the
    # devices still owe the model) is spread over the 2, and steps 7-10 follow the
    # uninterrupted 4-device run. Measured: 4.8e-6 relative at most; with the residuals
    # dropped on restore 1.9e-5, doubled 9.7e-5, fp32 instead of int8 1.0e-4.
    capsys.readouterr()
    moved = _run(tmp_path, "moved", "data=2", 10, *int8, resume=str(tmp_path / "whole" / "checkpoints" / "6"))
    assert "their sum is spread evenly over this run's 2" in capsys.readouterr().err
    np.testing.assert_allclose(moved.losses, whole.losses[6:], rtol=1e-5, atol=0)


@pytest.mark.heavy
def test_dcn_compression_on_two_processes(tmp_path):
    """2 processes x 2 devices, mesh data=2 (across processes) x fsdp=2 (inside each): the
    compiled step's collectives over data carry int8, those over fsdp fp32 (analysis.json,
    written by process 0 from the program the run compiled)."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "jaxdist.launch",
        "--nproc",
        "2",
        "--devices-per-proc",
        "2",
        "--port",
        str(free_port()),
        "--",
        "--mesh",
        "data=2,fsdp=2",
        "--steps",
        "2",
        "--run-dir",
        str(run_dir),
        "--profile-steps",
        "2:2",
        *TINY,
        *SMALL_TEXT,
        "parallel.strategy=dp",
        "parallel.grad_reduce=int8",
        "parallel.compress_axes=dcn",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "reduce in float32 over fsdp (inside hosts) and in int8 over data (across hosts)" in proc.stdout + proc.stderr
    by_axes = json.loads((run_dir / "profile" / "analysis.json").read_text())["collectives_by_axes"]
    params = json.loads((run_dir / "profile" / "analysis.json").read_text())["params"]
    fp32_inside = 2 * (1 / 2) * 4 * params  # reduce-scatter + all-gather of fp32 gradients over fsdp=2
    assert by_axes["fsdp"]["wire_bytes"] == pytest.approx(fp32_inside, rel=0.05), by_axes
    fp32_across = 2 * (1 / 2) * 4 * params / 2  # an fp32 all-reduce of each device's half over data=2
    assert by_axes["data"]["wire_bytes"] < 0.3 * fp32_across, by_axes  # int8 + one scale per 256 values


def test_switching_compression_on_and_off_between_runs(tmp_path, capsys):
    """A run saved with float32 reduction resumes with int8 (residuals start at zero, said
    in one line) and back (the residuals are left behind, said in one line)."""
    _run(tmp_path, "run", "data=2", 3)
    on = _run(tmp_path, "run", "data=2", 6, "parallel.grad_reduce=int8")
    assert "has no error-feedback residuals" in capsys.readouterr().err
    assert len(on.losses) == 3 and all(np.isfinite(on.losses))
    off = _run(tmp_path, "run", "data=2", 9)
    assert "error-feedback residuals are not used by this run" in capsys.readouterr().err
    assert len(off.losses) == 3 and all(np.isfinite(off.losses))
