"""What a run refuses or says before it trains: a compile cache others can write to, a
config name that climbs out of runs/, keys that would do nothing; and a stop by signal
in library use, where there is no run directory to save into."""

import os
import signal
import stat
import subprocess
import sys

import jax
import pytest

from jaxdist.config import load_config
from jaxdist.errors import ConfigError, JaxdistError
from jaxdist.layout.mesh import parse_mesh
from jaxdist.layout.validate import check_config_on_mesh
from jaxdist.train import main
from jaxdist.training.run import build_trainer, run

from helpers import TINY, without_session_cache


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("jaxdist: error: "), err
    return err[0]


@pytest.mark.parametrize("kind", ["world-writable", "group-writable", "another user's"])
def test_a_compile_cache_others_can_write_is_refused(kind, tmp_path, capsys):
    """XLA runs the native code it finds in the cache: one line naming the directory and
    the fix, exit 2, and no run directory."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    if kind == "world-writable":
        cache.chmod(0o777)
    elif kind == "group-writable":
        cache.chmod(0o770)
    else:
        os.chown(cache, 65534, 65534)  # nobody (the tests run as root here)
    run_dir = tmp_path / "run"
    assert main(["--run-dir", str(run_dir), "--steps", "1", f"train.compile_cache={cache}"]) == 2
    line = _one_error_line(capsys)
    assert str(cache) in line
    assert ("chmod go-w" in line) if kind != "another user's" else ("belongs to another user" in line)
    assert not run_dir.exists()


def test_the_default_compile_cache_is_private_to_the_run(tmp_path):
    from jaxdist.training.compile_cache import compile_cache_dir

    config = load_config(None, [])
    path = compile_cache_dir(config, tmp_path / "run")
    assert path == tmp_path / "run" / "xla_cache"
    # an existing cache under the run dir is held to the same rule
    path.mkdir(parents=True)
    path.chmod(0o757)
    with pytest.raises(JaxdistError, match="writable by others"):
        compile_cache_dir(config, tmp_path / "run")


def test_enabled_cache_directory_is_created_private(tmp_path):
    code = (
        "import sys; from jaxdist.config import load_config; from jaxdist.training.compile_cache import enable_compile_cache;"
        "print(enable_compile_cache(load_config(None, []), __import__('pathlib').Path(sys.argv[1])))"
    )
    env = without_session_cache(os.environ)  # the run's own cache
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from jaxdist.training.compile_cache import program_family

    path = tmp_path / "run" / "xla_cache"
    assert proc.stdout.strip() == str(path / program_family(load_config(None, [])))  # the model's folder of it
    assert (
        stat.S_IMODE(path.stat().st_mode) == 0o700 and stat.S_IMODE((path / program_family(load_config(None, []))).stat().st_mode) == 0o700
    )


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", "", "my run", "x\ny"])
def test_a_name_that_is_not_one_path_component_is_refused(name, tmp_path, capsys):
    with pytest.raises(ConfigError, match="must be one path component"):
        load_config(None, [f"name={name}"])
    assert main(["--run-dir", str(tmp_path / "run"), f"name={name}"]) == 2
    assert "must be one path component" in _one_error_line(capsys)


def test_a_config_file_name_is_checked_too(tmp_path):
    bad = tmp_path / "my config.yaml"
    bad.write_text("train:\n  steps: 3\n")
    with pytest.raises(ConfigError, match="set name="):
        load_config(str(bad))
    assert load_config(str(bad), ["name=mine"]).name == "mine"


UNUSED = {
    "train.momentum=0.9": "train.optimizer=adamw",
    "train.loss_scale=1024": "model.dtype=float32",
    "parallel.error_feedback=true": "parallel.grad_reduce=float32",
    "parallel.compress_axes=dcn": "parallel.grad_reduce=float32",
    "parallel.grad_topk_fraction=0.05": "parallel.grad_reduce=float32",
    "parallel.schedule=1f1b": "without a pipe axis",
    "parallel.pipeline_microbatches=4": "without a pipe axis",
    "parallel.virtual_stages=2": "without a pipe axis",
    "parallel.diloco_outer_lr=0.5": "DiLoCo is off",
    "parallel.diloco_outer_momentum=0.5": "DiLoCo is off",
    "parallel.diloco_reduce=int8": "DiLoCo is off",
    "parallel.diloco_outer_dtype=fp4": "DiLoCo is off",
    "parallel.diloco_fragments=2": "DiLoCo is off",
    "parallel.diloco_overlap_steps=1": "DiLoCo is off",
    "parallel.context_strategy=ring": "without a context axis",
    "parallel.context_load_balance=false": "without a context axis",
    "model.moe_top_k=1": "model.moe_experts=0 (a dense model)",
    "model.moe_aux_loss_coef=0.01": "model.moe_experts=0 (a dense model)",
    "model.moe_bias_rate=0.001": "model.moe_experts=0 (a dense model)",
    "model.moe_capacity_factor=1.25": "model.moe_experts=0 (a dense model)",
    "parallel.expert_buffer_factor=2": "without an expert axis",
    "model.fp8_history=8": "model.fp8=off",
    "model.fp8_keep_ends=false": "model.fp8=off",
    "train.dpo_beta=0.5": "train.objective=lm",
    "train.dpo_label_smoothing=0.1": "train.objective=lm",
    "train.dpo_loss=ipo": "train.objective=lm",
    "data.reference_logps=ref.npz": "train.objective=lm",
    "train.harness_every=2": "train.harness_tasks empty",
    "train.harness_limit=5": "train.harness_tasks empty",
    "train.harness_chat_template=true": "train.harness_tasks empty",
}


@pytest.mark.parametrize("override", sorted(UNUSED))
def test_a_key_with_no_effect_says_so_in_one_line(override):
    config = load_config(None, [*TINY, "model.dtype=float32", override])
    lines = [x for x in check_config_on_mesh(config, parse_mesh("data=2")) if "has no effect" in x]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{override.split('=')[0]}=") and UNUSED[override] in lines[0], lines


def test_the_overlap_mix_without_an_overlap_says_it_has_no_effect():
    config = load_config(None, [*TINY, "parallel.diloco_inner_steps=4", "parallel.diloco_overlap_mix=0.3"])
    lines = [x for x in check_config_on_mesh(config, parse_mesh("replica=2")) if "has no effect" in x]
    assert len(lines) == 1 and lines[0].startswith("parallel.diloco_overlap_mix=0.3") and "diloco_overlap_steps=0" in lines[0], lines


def test_a_no_effect_warning_reaches_stderr_with_one_prefix(capsys):
    """The check returns bare messages; the logger adds ``jaxdist: warning:`` once."""
    build_trainer(load_config(None, [*TINY, "model.fp8_history=8"]), parse_mesh("data=1"), jax.devices()[:1])
    lines = [x for x in capsys.readouterr().err.splitlines() if "fp8_history" in x]
    assert lines and all(x.startswith("jaxdist: warning: model.fp8_history=8 has no effect") for x in lines), lines


@pytest.mark.parametrize(
    ("overrides", "warned"),
    [
        (("train.steps=5", "train.warmup_steps=8"), True),
        (("train.steps=5", "train.warmup_steps=8", "train.schedule_steps=20"), False),
        (("train.steps=8", "train.warmup_steps=8"), False),
    ],
)
def test_a_warmup_longer_than_the_schedule_is_one_warning(overrides, warned):
    """optax's warmup reaches train.lr at step warmup_steps: past the schedule, never."""
    import optax

    config = load_config(None, [*TINY, *overrides])
    lines = [x for x in check_config_on_mesh(config, parse_mesh("data=2")) if "warmup_steps" in x]
    t = config.train
    reached = float(optax.linear_schedule(0.0, t.lr, t.warmup_steps)(t.schedule_length())) >= t.lr
    assert warned == (not reached)
    assert lines == (
        [f"train.warmup_steps=8 is longer than the {t.schedule_length()}-step schedule: the learning rate never reaches train.lr"]
        if warned
        else []
    )


def test_keys_that_apply_are_not_warned_about():
    config = load_config(None, [*TINY, "train.optimizer=sgd", "train.momentum=0.9", "parallel.grad_reduce=topk"])
    assert not [x for x in check_config_on_mesh(config, parse_mesh("data=2")) if "has no effect" in x]
    config = load_config(None, [*TINY, "parallel.schedule=1f1b", "model.n_layers=2"])
    assert not [x for x in check_config_on_mesh(config, parse_mesh("pipe=2")) if "has no effect" in x]
    moe = ("model.moe_experts=4", "model.moe_top_k=1", "model.moe_aux_loss_coef=0.01", "parallel.expert_buffer_factor=2")
    config = load_config(None, [*TINY, *moe])
    assert not [x for x in check_config_on_mesh(config, parse_mesh("data=2,expert=4")) if "has no effect" in x]
    config = load_config(None, [*TINY, "model.moe_experts=4", "model.moe_router=sigmoid", "model.moe_renormalize=false"])
    (line,) = [x for x in check_config_on_mesh(config, parse_mesh("data=2")) if "has no effect" in x]
    assert "model.moe_renormalize=False has no effect with model.moe_router=sigmoid" in line


def test_messages_are_printed_without_a_run_directory(capsys):
    """Library use (no run directory): nothing is written, but what the run says still
    reaches stderr (the start line, and a key that has no effect)."""
    config = load_config(None, [*TINY, "train.steps=1", "train.momentum=0.5"])
    run(config, parse_mesh("data=1"), None, devices=jax.devices()[:1], progress=False)
    err = capsys.readouterr().err
    assert "params | mesh data=1" in err  # the start line (went nowhere before)
    assert err.count("train.momentum=0.5 has no effect") == 1


def test_sigterm_without_a_run_directory_stops_cleanly():
    """No run directory, nothing to save: the loop stops after the step it is in and says
    so (it used to crash waiting on a checkpointer that does not exist)."""
    from jaxdist.data.batches import make_iterator
    from jaxdist.training.loop import LoopHooks, train_loop
    from jaxdist.training.metrics import MetricsLogger
    from jaxdist.training.preemption import Preempted, PreemptionWatcher

    config = load_config(None, [*TINY, "train.steps=10"])
    trainer = build_trainer(config, parse_mesh("data=1"), jax.devices()[:1])
    batches = make_iterator(config, trainer.layout)

    def signalled():
        for i, batch in enumerate(batches):
            if i == 2:  # while the third step is being set up
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch

    logger = MetricsLogger(None, 10, progress=False)
    with PreemptionWatcher() as watcher, pytest.raises(Preempted, match="nothing saved") as stopped:
        hooks = LoopHooks(preemption=watcher)
        train_loop(
            trainer,
            trainer.init_state(0),
            signalled(),
            steps=10,
            logger=logger,
            flops_per_step=1.0,
            peak_flops=1.0,
            tokens_per_step=1,
            hooks=hooks,
        )
    assert stopped.value.step == 3 and not stopped.value.saved
    batches.close()
