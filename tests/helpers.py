"""Shared, cached training runs so each (config, mesh) compiles once per test session."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import stat
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import jax
import pytest
from flax import nnx

from jaxdist.config import load_config
from jaxdist.data.batches import make_iterator
from jaxdist.data.sources import resolve_vocab
from jaxdist.layout.mesh import mesh_device_count, parse_mesh
from jaxdist.models.llama import Llama
from jaxdist.training.run import build_trainer, run
from jaxdist.training.weights import checkpoint_config, find_checkpoint, restore_params

from conftest import TEST_XLA_FLAGS

# Real text, but the 5 files of the stdlib's json package (~50 KB) rather than the whole
# standard library: every process a test starts tokenizes its corpus (~4 s of CPU for 31M tokens).
HIDDEN_FROM_PROCESSES = Path(__file__).with_name("hidden") / "processes"
SMALL_TEXT = ("data.source=text", f"data.path={Path(sysconfig.get_paths()['stdlib']) / 'json' / '*.py'}")

# A tiny decoder whose heads split 4 ways (tensor=4) and whose batch splits 8 ways.
TINY = (
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.dtype=float32",
    "train.global_batch=16",
    "train.seq_len=32",
    "train.log_every=1",
)


def jaxpr_equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs inside it (scan, remat, custom rules, pjit)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from jaxpr_equations(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from jaxpr_equations(sub)


@functools.cache
def train_losses(mesh: str, overrides: tuple[str, ...] = (), steps: int = 5) -> tuple[float, ...]:
    config = load_config(None, (*TINY, f"train.steps={steps}", *overrides))
    sizes = parse_mesh(mesh)
    devices = jax.devices()[: mesh_device_count(sizes)]
    return tuple(run(config, sizes, None, devices=devices, progress=False).losses)


def first_batch(config, layout):
    """The first global batch; the iterator is closed (an open one keeps a read-ahead thread
    and its batches alive for the rest of the session)."""
    iterator = make_iterator(config, layout)
    try:
        return next(iterator)
    finally:
        iterator.close()


@functools.cache
def first_batch_grads(mesh: str, *overrides: str):
    """(trainer, mean loss, gradients as a plain dict) of the first data batch at init
    (cached: the reference of many comparisons; callers read it and change nothing)."""
    config = load_config(None, [*TINY, *overrides])
    resolve_vocab(config)
    sizes = parse_mesh(mesh)
    trainer = build_trainer(config, sizes, jax.devices()[: mesh_device_count(sizes)])
    state = trainer.init_state(0)
    batch = first_batch(config, trainer.layout)
    loss, grads = jax.jit(trainer.loss_and_grads)(state.params, batch)
    return trainer, float(loss), jax.device_get(nnx.to_pure_dict(grads))


def load_model(out) -> Llama:
    """The Llama of a checkpoint (run dir, converted model or step dir) on one device."""
    step_dir = find_checkpoint(out)
    cfg = checkpoint_config(step_dir).model
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
    return nnx.merge(graphdef, restore_params(step_dir, abstract))


def without_session_cache(env: dict[str, str]) -> dict[str, str]:
    """An environment for a process whose own compile cache a test checks (conftest.py
    gives every process the session's)."""
    return {k: v for k, v in env.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}


def subprocess_env(devices: int | None = None) -> dict[str, str]:
    """The environment for a process a test starts: the session's XLA flags and compile
    cache (conftest.py), without the fake-device count (the CLIs and the launcher ask for
    their own), or with ``devices`` of them."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).split()
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    # packages those processes run without (tests/hidden/processes says why)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HIDDEN_FROM_PROCESSES), env.get("PYTHONPATH")]))
    return env


def optimized_env(devices: int | None = None) -> dict[str, str]:
    """``subprocess_env`` with XLA's full optimisation: for runs whose speed matters
    (timing shares, hundreds of steps) rather than their compile time."""
    env = subprocess_env(devices)
    env["XLA_FLAGS"] = " ".join(f for f in env["XLA_FLAGS"].split() if f not in TEST_XLA_FLAGS.split())
    return env


_RUNS_SCRIPT = """
import json, sys
import jax
from jaxdist.config import load_config
from jaxdist.layout.mesh import mesh_device_count, parse_mesh
from jaxdist.training.run import run
results = []
for mesh, overrides in json.loads(sys.argv[1]):
    sizes = parse_mesh(mesh)
    result = run(load_config(None, overrides), sizes, None, devices=jax.devices()[: mesh_device_count(sizes)], progress=False)
    results.append({"losses": result.losses, "eval_losses": result.eval_losses})
print("RESULTS " + json.dumps(results))
"""


def long_runs(*runs: tuple[str, tuple[str, ...], int], optimized: bool = True) -> list[dict]:
    """TINY runs of hundreds of steps, (mesh, overrides, steps) each, in one fresh process
    compiled with XLA's full optimisation (the session's -O0 would triple their step
    time; ``optimized=False`` for runs short enough that the optimised compiles cost more):
    [{"losses": [...], "eval_losses": {step: loss}}] in order."""
    import json
    import subprocess
    import sys

    args = [(mesh, [*TINY, f"train.steps={steps}", *overrides]) for mesh, overrides, steps in runs]
    proc = subprocess.run(
        [sys.executable, "-c", _RUNS_SCRIPT, json.dumps(args)],
        env=optimized_env(8) if optimized else subprocess_env(8),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")]
    results = json.loads(line.removeprefix("RESULTS "))
    return [{"losses": r["losses"], "eval_losses": {int(k): v for k, v in r["eval_losses"].items()}} for r in results]


def data_layout(mesh: str = "data=2,fsdp=2"):
    """A Layout on this process's fake devices (the data tests' default mesh)."""
    from jaxdist.layout.mesh import build_mesh
    from jaxdist.layout.sharding import Layout
    from jaxdist.layout.strategy import resolve_strategy

    sizes = parse_mesh(mesh)
    return Layout(build_mesh(sizes, jax.devices()), resolve_strategy("auto", sizes))


def data_config(*overrides: str):
    """The default config at batch 8 x 32 with its vocabulary resolved."""
    config = load_config(None, ["train.global_batch=8", "train.seq_len=32", *overrides])
    resolve_vocab(config)
    return config


def context_mesh(shape: tuple[int, int, int]):
    """A (data, context, tensor) mesh of explicit sizes for the context-attention tests."""
    from jax.sharding import AxisType

    return jax.make_mesh(shape, ("data", "context", "tensor"), axis_types=(AxisType.Auto,) * 3)


def packed_ids(documents: list[list[int]]):
    """(segment ids, positions) of rows packed with documents of these lengths."""
    import numpy as np

    segments = np.stack([np.repeat(np.arange(len(row)), row) for row in documents]).astype(np.int32)
    positions = np.stack([np.concatenate([np.arange(n) for n in row]) for row in documents]).astype(np.int32)
    return segments, positions


def membership_changes(run_dir: Path) -> list[dict]:
    """The records of elastic.jsonl that change who trains (start, failure, in-process, ...).
    Straggler records share the file but change nobody; on a loaded 2-core machine a process
    can really fall behind, so tests about membership leave them out (tests/test_stragglers.py
    checks them)."""
    path = Path(run_dir) / "elastic.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [r for r in records if r["reason"] != "straggler"]


def checked_goodput(run_dir: Path, steps: int, idle_share: float = 0.02) -> dict:
    """RUN_DIR/goodput.json of a finished launched run, checked against the run's own files: its
    wall time is the first start record's to the file's writing, its shares add up to that wall
    time with at most ``idle_share`` unaccounted, each of the ``steps`` steps is productive once,
    and the steps logged again after a restart (metrics.jsonl, train.log_every=1) are the retrained ones."""
    path = Path(run_dir) / "goodput.json"
    result = json.loads(path.read_text())
    first_start = min(r["time"] for r in membership_changes(run_dir) if r["reason"] == "start")
    assert result["wall_s"] == pytest.approx(path.stat().st_mtime - first_start, abs=1.5), result  # + the first process's creation
    seconds = result["seconds"]
    assert sum(seconds.values()) == pytest.approx(result["wall_s"], rel=1e-3, abs=0.01), result
    assert seconds["idle"] <= idle_share * result["wall_s"], result
    assert result["goodput"] == pytest.approx(seconds["productive"] / result["wall_s"], rel=1e-3) and 0 < result["goodput"] < 1
    logged = [json.loads(x)["step"] for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert result["steps"] == {"productive": steps, "retrained": len(logged) - len(set(logged))}, (result, logged)
    return result


# lm-evaluation-harness tasks defined in the tests (YAML over a local JSON Lines file: nothing is
# downloaded); ``.format(data=PATH)``
MC_TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

GEN_TASK = """task: tiny_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["e"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""

ROLLING_TASK = """task: tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""


# their questions (multiple choice: question, choices, the right one) and generation prompts
QUESTIONS = [
    ("two and two", ["four", "five", "six"], 0),
    ("sky colour", ["blue", "green"], 1),
    ("a cat says", ["meow", "woof", "moo", "hiss"], 2),
    ("first letter", ["a", "zz"], 0),
    ("opposite of up", ["down", "left", "right"], 1),
]
PROMPTS = ["The quick brown", "Once upon a time", "def f(x):", "1, 2, 3,"]


# --- the launcher's logic against stub trainers (a script in place of the Python interpreter) ---

STUB_HEAD = f"""#!{sys.executable}
import os, signal, socket, sys, time
rank = int(os.environ.get("JAXDIST_PROCESS_ID", "0"))
host, port = os.environ["JAXDIST_COORDINATOR"].rsplit(":", 1)
log = os.environ["STUB_LOG"]
"""


def run_stub_launcher(
    tmp_path: Path, body: str, launch_args: list[str], *, timeout: float = 60, patch: str = "", term_when: list[Path] = (), **env: str
):
    """``python -m jaxdist.launch LAUNCH_ARGS`` whose trainers are the stub BODY; returns (code, output).
    ``term_when``: SIGTERM the launcher alone once those files exist."""
    stub = tmp_path / "stub-python"
    stub.write_text(STUB_HEAD + textwrap.dedent(body))
    stub.chmod(stat.S_IRWXU)
    (tmp_path / "log").mkdir(exist_ok=True)
    code = f"import sys, jaxdist.cluster.launcher as L, jaxdist.launch as launch_cli\nsys.executable = {str(stub)!r}\n{patch}\nsys.exit(launch_cli.main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, *launch_args]
    proc = subprocess.Popen(
        cmd,
        env={**subprocess_env(), "STUB_LOG": str(tmp_path / "log"), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        if term_when:
            deadline = time.monotonic() + timeout
            while not all(p.exists() for p in term_when) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the launcher did not end within {timeout}s:\n{out[-3000:]}")
    return proc.returncode, out
