"""Scaling sweeps: jaxdist's strategies (and PyTorch DDP / FSDP) over 1..N devices, strong and weak.

    python experiments/scaling.py --out OUT [--strategies dp,zero1,fsdp,tp,pipe-1f1b,pipe-gpipe,dp+tp,fsdp+tp,3d]
        [--devices 1,2,4,8] [--modes strong,weak] [--kinds fake,proc] [--frameworks jaxdist,pytorch-ddp,pytorch-fsdp]
        [--steps 10] [--warmup 3] [--budget-min M] [--model small-cpu] [--profile/--no-profile]
        [--write-readme [PATH]] [--plots] [--hardware cpu|gpu] [--report-only] [--retry-failed]

Every finished point is one line of ``OUT/results.jsonl`` (written as soon as it is done, so
a sweep is resumable: a point whose identifying keys -- ``framework, model, mode, kind,
strategy, devices`` -- are already there is not rerun; ``--retry-failed`` reruns the failed
ones). ``--budget-min M`` starts no new point after M minutes. ``OUT/hardware.json`` records
the host (CPU model, cores, jax / torch versions, thread settings); ``OUT/runs/`` the run
directories, ``OUT/logs/`` each point's output, ``OUT/analyze/`` the cached compile reports.
After the sweep ``--write-readme`` regenerates the tables between ``<!-- scaling:begin -->``
and ``<!-- scaling:end -->`` of ``experiments/README.md`` (or PATH; the markers are appended
when absent) and ``--plots`` draws ``experiments/figures/scaling_*.png``; with
``--report-only`` nothing runs, the report is made from ``results.jsonl`` alone.

Points
- kind ``fake``: one ``python -m jaxdist.train`` process on N fake CPU devices (``XLA_FLAGS``'s
  device count removed, so jaxdist asks XLA for N devices itself). The devices share the
  process's cores and memory: collectives are memory copies and every device competes for
  the same two cores, so these points show jaxdist's overheads and the compiled program's
  communication, not a speed-up.
- kind ``proc``: ``python -m jaxdist.launch --nproc N --devices-per-proc 1``: N processes of
  one CPU device each, collectives over gloo on loopback: the closest this host gets to
  real inter-device communication (still sharing its cores).
- PyTorch (``--frameworks pytorch-ddp,pytorch-fsdp``): ``experiments/torch_baseline.py --json``
  with the same dims, batch, ``--threads 1`` and ``--nproc N`` (``single`` at N=1), kind
  ``proc`` only (one process is one device). Its ``strategy`` is recorded as the jaxdist
  strategy it is compared with: ``dp`` (DDP), ``fsdp`` (FSDP2), ``single``.
- N = 1: every strategy is the same one-device run; it runs once per (framework, mode, kind)
  as strategy ``single`` and is every strategy's 1-device point and the baseline.
- meshes: dp ``data=N``; zero1 ``data=N parallel.strategy=zero1``; fsdp ``fsdp=N``; tp
  ``tensor=N``; pipe-1f1b / pipe-gpipe ``pipe=N parallel.schedule=1f1b|gpipe`` with
  ``parallel.pipeline_microbatches`` = max(pipe size, 4); dp+tp ``data=N/2,tensor=2``; fsdp+tp
  ``fsdp=N/2,tensor=2``; 3d ``data=N/4,tensor=2,pipe=2`` (the combinations from N = 4, 4 and 8, so
  that every axis is > 1: dp+tp on 2 devices would be the tp row). A point the mesh cannot divide (N
  not a multiple of the fixed axes, tensor > kv heads, more stages than layers, a batch the
  pipeline microbatches cannot split) is checked with jaxdist's own config-vs-mesh
  validation before anything starts and recorded as ``skipped: <reason>``; a run that fails
  is recorded as ``failed: <its last error line>`` and the sweep goes on.
- models: ``small-cpu`` (default on cpu): jaxdist's llama, d_model 128, 4 layers, 8 heads,
  4 kv heads (so tensor splits up to 4), vocab 256, seq 128, fp32, AdamW, synthetic data;
  strong scaling: global batch 16; weak: 8 per device (8N). ``small-gpu`` (default with
  ``--hardware gpu``): the dims of ``configs/small.yaml`` (d_model 512, 8 layers), bf16, seq
  256, global batch 64 / 32 per device, on the visible GPUs (kind ``fake`` means one process
  over ``CUDA_VISIBLE_DEVICES=0..N-1``; ``proc`` and PyTorch points are skipped there: the
  launcher does not pin one GPU per process and the baseline is CPU/gloo only). The GPU mode
  is the same machinery and has not been run from this script yet.

Fields (``results.jsonl``; the contract keys first, then extras)
- ``step_time_s``: median of ``metrics.jsonl``'s ``step_time_s`` (jaxdist logs every step)
  over the steps after ``--warmup``, leaving out the profile window and the step right
  after it (the report is made there); ``step_times_s`` the list. A jaxdist run trains
  ``warmup + (3 if profiled) + steps`` steps, so ``--steps`` are timed. PyTorch: its own
  median over ``--steps`` after ``--warmup`` (rank 0's wall clock per step).
- ``tokens_per_sec`` = global_batch x seq_len / step_time_s; ``per_device_batch`` =
  global_batch / devices.
- ``efficiency``: strong scaling t1 / (N x tN), weak scaling t1 / tN, where tN is the point's
  step time and t1 the 1-device step time of the same framework family (PyTorch's is
  ``single``), model, mode and kind. Computed when a line is written and recomputed for
  lines whose baseline arrived later (at the end of a sweep, and by ``--write-readme``).
- ``memory_per_device_bytes``, ``comm_bytes_per_step``: ``python -m jaxdist.analyze --json`` on
  the same config and mesh (compile only, run once per (model, mode, strategy, devices) and
  cached in ``OUT/analyze/``): memory ``total`` (arguments + outputs + temp, less aliased
  buffers: states and activations), comm = sum over collective kinds of ``bytes`` (per
  device per step, loop trip counts multiplied in); ``memory_breakdown`` and ``collectives``
  keep the parts. PyTorch: its JSON's params + grads + Adam bytes per process (no
  activations) and its analytic gradient / FSDP payload bytes.
- ``bound``, ``fractions``, ``comm_time_s`` (with ``--profile``, the default): from
  ``RUN_DIR/profile/summary.json`` of ``--profile-steps A:B`` over the 2 steps right after
  the warmup; comm_time_s = the time some collective runs per step (exposed + overlapped),
  ``comm_exposed_s`` the exposed part. PyTorch has no profile; with ``--profile`` it also
  times the same steps without gradient communication (``compute_only_step_time_s``).
- ``mode``, ``kind``, ``threads`` (cores, XLA_FLAGS passed, torch threads, processes),
  ``status`` (ok | skipped: reason | failed: line), ``host`` (CPU model, cores, versions).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from scaling_analytic import ZERO_STATES_FP32, Dims, expected_state_bytes, expected_wire_bytes  # noqa: E402

TORCH_SCRIPT = HERE / "torch_baseline.py"
DEFAULT_README = HERE / "README.md"
FIGURES = HERE / "figures"
BEGIN, END = "<!-- scaling:begin -->", "<!-- scaling:end -->"

CONTRACT_KEYS = (
    "framework",
    "model",
    "params",
    "strategy",
    "mesh",
    "devices",
    "processes",
    "global_batch",
    "per_device_batch",
    "seq_len",
    "step_time_s",
    "tokens_per_sec",
    "efficiency",
    "memory_per_device_bytes",
    "comm_bytes_per_step",
    "bound",
)
# extras on every line (more where they apply: memory_breakdown, collectives, comm_exposed_s, command, ...)
EXTRA_KEYS = ("mode", "kind", "threads", "step_times_s", "fractions", "comm_time_s", "status", "host", "overrides")
KEY_FIELDS = ("framework", "model", "mode", "kind", "strategy", "devices")
STRATEGIES = ("dp", "zero1", "fsdp", "tp", "pipe-1f1b", "pipe-gpipe", "dp+tp", "fsdp+tp", "3d")
FRAMEWORKS = ("jaxdist", "pytorch-ddp", "pytorch-fsdp")
TORCH_STRATEGY = {"pytorch-ddp": ("ddp", "dp"), "pytorch-fsdp": ("fsdp", "fsdp")}  # framework -> (baseline --strategy, jaxdist strategy)
MODES, KINDS = ("strong", "weak"), ("fake", "proc")
PROFILE_STEPS = 2  # traced steps right after the warmup; they and the next step are not timed
SINGLE = "single"


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    hardware: str
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    seq_len: int
    strong_batch: int  # global batch, any N
    weak_batch: int  # per device
    dtype: str
    peak_flops: float = 0.0  # > 0 skips the CPU peak measurement at start-up (MFU is not used here)

    def global_batch(self, mode: str, n: int) -> int:
        return self.strong_batch if mode == "strong" else self.weak_batch * n

    def overrides(self, mode: str, n: int) -> list[str]:
        out = [
            f"model.d_model={self.d_model}",
            f"model.n_layers={self.n_layers}",
            f"model.n_heads={self.n_heads}",
            f"model.n_kv_heads={self.n_kv_heads}",
            f"model.vocab_size={self.vocab}",
            f"model.dtype={self.dtype}",
            f"train.seq_len={self.seq_len}",
            f"train.global_batch={self.global_batch(mode, n)}",
            "data.source=synthetic",
        ]
        return out + ([f"train.peak_flops={self.peak_flops:g}"] if self.peak_flops else [])


PRESETS = {
    "small-cpu": Preset("small-cpu", "cpu", 128, 4, 8, 4, 256, 128, 16, 8, "float32"),
    "small-gpu": Preset("small-gpu", "gpu", 512, 8, 8, 4, 256, 256, 64, 32, "bfloat16"),
    # hidden, for tests: seconds per point on a busy 2-core host
    "tiny-test": Preset("tiny-test", "cpu", 32, 2, 4, 2, 256, 16, 4, 2, "float32", peak_flops=1e11),
}


@dataclasses.dataclass(frozen=True)
class Point:
    framework: str
    model: str
    mode: str
    kind: str
    strategy: str
    devices: int

    @property
    def key(self) -> tuple:
        return tuple(getattr(self, f) for f in KEY_FIELDS)

    @property
    def name(self) -> str:
        return f"{self.framework}_{self.model}_{self.mode}_{self.kind}_{self.strategy}_n{self.devices}".replace("+", "-")


def row_key(row: dict) -> tuple:
    return tuple(row.get(f) for f in KEY_FIELDS)


def family(framework: str) -> str:
    """Whose 1-device run is the baseline: PyTorch's DDP and FSDP share ``pytorch`` (single)."""
    return "pytorch" if framework.startswith("pytorch") else framework


# -- what runs ---------------------------------------------------------------------------


def mesh_for(strategy: str, n: int) -> tuple[str, list[str]] | str:
    """(mesh spec, extra overrides) for a jaxdist strategy on n devices, or why it cannot be built."""
    if strategy == SINGLE:
        return "data=1", []
    pipe_m = f"parallel.pipeline_microbatches={max(n, 4)}"
    fixed = {"dp+tp": 2, "fsdp+tp": 2, "3d": 4}.get(strategy, 1)
    if n % fixed or n < 2 * fixed:  # every axis > 1: on fewer devices the combination is another row (dp+tp on 2 is tp)
        return f"{strategy} needs a multiple of {fixed} devices, at least {2 * fixed} (every axis > 1), got {n}"
    table = {
        "dp": (f"data={n}", ["parallel.strategy=dp"]),
        "zero1": (f"data={n}", ["parallel.strategy=zero1"]),
        "fsdp": (f"fsdp={n}", []),
        "tp": (f"tensor={n}", []),
        "pipe-1f1b": (f"pipe={n}", ["parallel.schedule=1f1b", pipe_m]),
        "pipe-gpipe": (f"pipe={n}", ["parallel.schedule=gpipe", pipe_m]),
        "dp+tp": (f"data={n // 2},tensor=2", []),
        "fsdp+tp": (f"fsdp={n // 2},tensor=2", []),
        "3d": (f"data={n // 4},tensor=2,pipe=2", ["parallel.schedule=gpipe", "parallel.pipeline_microbatches=4"]),
    }
    if strategy not in table:
        return f"unknown strategy {strategy!r}"
    return table[strategy]


def check_point(preset: Preset, mode: str, n: int, mesh: str, extra: list[str]) -> str | None:
    """jaxdist's own config-vs-mesh validation (pure Python, no JAX): the reason a point cannot run."""
    from jaxdist.config import load_config
    from jaxdist.errors import JaxdistError
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.layout.validate import check_config_on_mesh

    try:
        check_config_on_mesh(load_config(None, [*preset.overrides(mode, n), *extra]), parse_mesh(mesh))
    except JaxdistError as e:
        return str(e)
    return None


def plan(args: argparse.Namespace, preset: Preset) -> list[Point]:
    """Every point, 1-device baselines first; N=1 collapses to one ``single`` run per (framework family, mode, kind)."""
    points: list[Point] = []
    for mode in args.modes:
        for n in sorted(args.devices):
            for kind in args.kinds:
                for framework in args.frameworks:
                    if framework != "jaxdist" and kind != "proc":
                        continue  # a PyTorch process is one device
                    if n == 1:
                        fw = framework if framework == "jaxdist" else "pytorch"
                        points.append(Point(fw, preset.name, mode, kind, SINGLE, 1))
                    elif framework == "jaxdist":
                        points.extend(Point(framework, preset.name, mode, kind, s, n) for s in args.strategies)
                    else:
                        points.append(Point(framework, preset.name, mode, kind, TORCH_STRATEGY[framework][1], n))
    return list(dict.fromkeys(points))  # ordered, without duplicates


# -- host facts ---------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def visible_gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def hardware_info(hardware: str) -> dict:
    info = {
        "hardware": hardware,
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": _affinity(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "jax": _version("jax"),
        "jaxlib": _version("jaxlib"),
        "torch": _version("torch"),
        "threads": {
            "XLA_FLAGS (parent)": os.environ.get("XLA_FLAGS"),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "jaxdist fake": "one process; XLA's CPU thread pool sized to the host's cores, shared by its N devices",
            "jaxdist proc": "N processes x 1 device (--xla_force_host_platform_device_count=1); each XLA pool sees every core",
            "pytorch": "torch.set_num_threads(1) in each of the N processes",
        },
    }
    if hardware == "gpu":
        info["gpus"] = visible_gpus()
    return info


def host_line(info: dict) -> str:
    return f"{info['cpu']}, {info['cores']} cores, jax {info['jax']}, torch {info['torch']}"


# -- running one point --------------------------------------------------------------------


def _strip_device_count(flags: str | None) -> str | None:
    kept = " ".join(t for t in (flags or "").split() if "xla_force_host_platform_device_count" not in t)
    return kept or None


def child_env(point: Point, preset: Preset) -> dict[str, str]:
    env = dict(os.environ)
    flags = _strip_device_count(env.get("XLA_FLAGS"))
    env.pop("XLA_FLAGS", None)
    if flags:
        env["XLA_FLAGS"] = flags
    if preset.hardware == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(point.devices))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def threads_of(point: Point, preset: Preset, env: dict[str, str]) -> dict:
    threads = {"cores": os.cpu_count(), "cores_usable": _affinity(), "processes": point.devices if point.kind == "proc" else 1}
    threads["omp_num_threads"] = env.get("OMP_NUM_THREADS")
    if point.framework == "jaxdist":
        flags = env.get("XLA_FLAGS")
        if point.kind == "proc":
            flags = f"{flags or ''} --xla_force_host_platform_device_count=1".strip()  # what jaxdist.launch adds
        threads["xla_flags"] = flags or None
        threads["torch_threads"] = None
    else:
        threads["xla_flags"] = None
        threads["torch_threads"] = 1
    return threads


class Runner:
    """Runs commands in their own process group (output to a log file, stdout optionally to
    another), stopped on timeout or Ctrl-C."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def run(self, cmd: list[str], env: dict[str, str], log: Path, stdout: Path | None = None) -> tuple[int, str]:
        """(exit code, the last error-looking line of the output)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as err, open(stdout, "w") if stdout else open(os.devnull, "w") as out:
            proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out if stdout else err, stderr=err, start_new_session=True)
            try:
                rc = proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                self._kill(proc)
                return 124, f"timed out after {self.timeout_s:g} s"
            except BaseException:  # Ctrl-C: the child is in its own session and did not get it
                self._kill(proc)
                raise
        return rc, last_error_line(log.read_text(errors="replace"))

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            if proc.poll() is not None:
                return
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


_BAR = re.compile(r"\d+%\||it/s\]|step/s\]|s/it\]|s/step\]")


def last_error_line(text: str) -> str:
    """The line that says what went wrong: the last error-looking line, else the last line."""
    lines = [ln.strip() for ln in re.split(r"[\r\n]+", text) if ln.strip() and not _BAR.search(ln)]
    lines = [re.sub(r"^\[rank \d+\] ", "", ln) for ln in lines]
    for ln in reversed(lines):
        if re.search(r"error|exception|killed|timed out", ln, re.IGNORECASE):
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def read_metrics(run_dir: Path) -> dict[int, float]:
    times = {}
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return times
    for line in path.read_text().splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in m and isinstance(m.get("step_time_s"), int | float):
            times[int(m["step"])] = float(m["step_time_s"])
    return times


def timed_steps(times: dict[int, float], warmup: int, window: tuple[int, int] | None) -> list[float]:
    """Step times after the warmup, without the profile window and the step after it."""
    out = []
    for step in sorted(times):
        if step <= warmup or (window and window[0] <= step <= window[1] + 1):
            continue
        out.append(times[step])
    return out


def analyze_point(point: Point, preset: Preset, mesh: str, extra: list[str], out: Path, runner: Runner) -> dict:
    """``jaxdist.analyze --json`` for (model, mode, strategy, devices): cached in OUT/analyze (kind-independent)."""
    path = out / "analyze" / f"{point.model}_{point.mode}_{point.strategy}_n{point.devices}.json".replace("+", "-")
    if path.exists():
        return json.loads(path.read_text())
    cmd = [sys.executable, "-m", "jaxdist.analyze", "--mesh", mesh, "--json", *preset.overrides(point.mode, point.devices), *extra]
    log = out / "logs" / f"{path.stem}.analyze.log"
    stdout = log.with_suffix(".stdout")
    rc, line = runner.run(cmd, child_env(point, preset), log, stdout=stdout)
    if rc != 0:
        return {"error": f"analyze exit {rc}: {line}"}
    try:
        report = json.loads(stdout.read_text())
    except json.JSONDecodeError:
        return {"error": "analyze printed no JSON"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, sort_keys=True))
    return report


def apply_analysis(row: dict, report: dict) -> None:
    """Memory and communication fields of a jaxdist line from its ``jaxdist.analyze`` report."""
    if "error" in report:
        row["analyze_error"] = report["error"]
        return
    row.pop("analyze_error", None)
    row["params"] = report.get("params")
    mem = report.get("memory_per_device_bytes") or {}
    row["memory_per_device_bytes"] = mem.get("total")
    row["states_bytes_per_device"] = mem.get("arguments")  # weights + optimizer state (+ the batch)
    row["memory_breakdown"] = {k: mem[k] for k in sorted(mem)}
    coll = {k: v for k, v in sorted((report.get("collectives") or {}).items()) if v.get("count")}
    wire = [v.get("wire_bytes") for v in coll.values()]
    row["comm_buffer_bytes_per_step"] = int(sum(v.get("bytes", 0) for v in coll.values()))
    # on the wire (ring formulas, jaxdist/inspect/wire.py); buffer bytes where a group size was not printed
    row["comm_bytes_per_step"] = int(sum(w if w is not None else v["bytes"] for w, v in zip(wire, coll.values(), strict=True)))
    row["collectives"] = {k: {"count": v.get("count"), "bytes": v.get("bytes"), "wire_bytes": v.get("wire_bytes")} for k, v in coll.items()}
    row["comm_by_axes"] = report.get("collectives_by_axes")


def refresh_analysis(args: argparse.Namespace, preset: Preset, results: Path) -> None:
    """Recompute every jaxdist line's analyze fields (compile only; reports without the
    per-axis breakdown are compiled again), keeping the timings."""
    rows, runner = read_results(results), Runner(args.point_timeout)
    for row in rows:
        if row.get("framework") != "jaxdist" or not row.get("mesh") or row.get("model") != preset.name:
            continue
        point = Point(row["framework"], row["model"], row["mode"], row["kind"], row["strategy"], row["devices"])
        cached = args.out / "analyze" / f"{point.model}_{point.mode}_{point.strategy}_n{point.devices}.json".replace("+", "-")
        if cached.exists() and "collectives_by_axes" not in json.loads(cached.read_text()):
            cached.unlink()
        apply_analysis(row, analyze_point(point, preset, row["mesh"], row.get("overrides") or [], args.out, runner))
    write_results(results, rows)


def base_row(point: Point, preset: Preset, host: str) -> dict:
    n = point.devices
    gb = preset.global_batch(point.mode, n)
    row = {k: None for k in CONTRACT_KEYS}
    row.update({k: None for k in EXTRA_KEYS})
    row.update(
        framework=point.framework,
        model=point.model,
        strategy=point.strategy,
        devices=n,
        processes=n if point.kind == "proc" else 1,
        global_batch=gb,
        per_device_batch=gb / n if gb % n else gb // n,
        seq_len=preset.seq_len,
    )
    row.update(mode=point.mode, kind=point.kind, host=host, status="ok")
    return row


def run_jaxdist(point: Point, preset: Preset, args: argparse.Namespace, runner: Runner, row: dict) -> dict:
    built = mesh_for(point.strategy, point.devices)
    if isinstance(built, str):
        return {**row, "status": f"skipped: {built}"}
    mesh, extra = built
    row["mesh"], row["overrides"] = mesh, extra
    problem = check_point(preset, point.mode, point.devices, mesh, extra)
    if problem:
        return {**row, "status": f"skipped: {problem}"}
    if preset.hardware == "gpu":
        if point.kind == "proc":
            return {**row, "status": "skipped: proc points on GPUs need one GPU per process, which jaxdist.launch does not pin"}
        if point.devices > args.gpus:
            return {**row, "status": f"skipped: {point.devices} GPUs asked, {args.gpus} visible"}
    out: Path = args.out
    run_dir = out / "runs" / point.name
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a run interrupted earlier: start it over
    window = (args.warmup + 1, args.warmup + PROFILE_STEPS) if args.profile else None
    total = args.warmup + args.steps + (PROFILE_STEPS + 1 if window else 0)
    train_args = ["--mesh", mesh, "--steps", str(total), "--run-dir", str(run_dir), "--log-every", "1"]
    train_args += ["checkpoint.every_steps=0", "train.compile_cache=off", *preset.overrides(point.mode, point.devices), *extra]
    if window:
        train_args += ["--profile-steps", f"{window[0]}:{window[1]}"]
    if point.kind == "proc":
        cmd = [sys.executable, "-m", "jaxdist.launch", "--nproc", str(point.devices), "--devices-per-proc", "1", "--", *train_args]
    else:
        cmd = [sys.executable, "-m", "jaxdist.train", *train_args]
    env = child_env(point, preset)
    row["threads"] = threads_of(point, preset, env)
    row["command"] = " ".join(cmd[1:]).replace(str(out), "OUT")

    # compile-only report first (cached): memory and collective bytes
    apply_analysis(row, analyze_point(point, preset, mesh, extra, out, runner))

    rc, line = runner.run(cmd, env, out / "logs" / f"{point.name}.log")
    times = read_metrics(run_dir)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # only the timings are wanted
    if rc != 0:
        return {**row, "status": f"failed: exit {rc}: {line}"}
    timed = timed_steps(times, args.warmup, window)
    if not timed:
        return {**row, "status": f"failed: no timed steps in {run_dir / 'metrics.jsonl'}"}
    row["step_times_s"] = timed
    row["step_time_s"] = statistics.median(timed)
    row["tokens_per_sec"] = row["global_batch"] * preset.seq_len / row["step_time_s"]
    if window:
        summary = run_dir / "profile" / "summary.json"
        if summary.exists():
            s = json.loads(summary.read_text())
            b = s.get("breakdown_s") or {}
            row["bound"] = s.get("bound")
            row["fractions"] = s.get("fractions")
            row["comm_time_s"] = b.get("communication_exposed", 0.0) + b.get("communication_overlapped", 0.0)
            row["comm_exposed_s"] = b.get("communication_exposed")
            row["profile_step_time_s"] = s.get("step_time_s")
        else:
            row["profile_error"] = "no profile/summary.json (see the log)"
    return row


def torch_wire_bytes(strategy: str, buffer_bytes: int, n: int) -> int:
    """DDP all-reduces its gradient buckets (2(n-1)/n on a ring); FSDP's payload is all-gathers
    and reduce-scatters ((n-1)/n each)."""
    if n == 1:
        return 0
    return round(buffer_bytes * (2 if strategy == "ddp" else 1) * (n - 1) / n)


def run_torch(point: Point, preset: Preset, args: argparse.Namespace, runner: Runner, row: dict) -> dict:
    if preset.hardware == "gpu":
        return {**row, "status": "skipped: experiments/torch_baseline.py runs on CPU (gloo) only"}
    torch_strategy = SINGLE if point.devices == 1 else TORCH_STRATEGY[point.framework][0]
    row["mesh"] = f"{torch_strategy}={point.devices}"
    if row["global_batch"] % point.devices:
        return {**row, "status": f"skipped: global batch {row['global_batch']} not divisible by {point.devices} processes"}
    if _version("torch") is None:
        return {**row, "status": "skipped: torch is not installed"}
    cmd = [sys.executable, str(TORCH_SCRIPT), "--json", "--nproc", str(point.devices), "--strategy", torch_strategy]
    cmd += ["--d-model", str(preset.d_model), "--layers", str(preset.n_layers), "--heads", str(preset.n_heads)]
    cmd += ["--kv-heads", str(preset.n_kv_heads), "--vocab", str(preset.vocab), "--seq-len", str(preset.seq_len)]
    cmd += ["--global-batch", str(row["global_batch"]), "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", "1"]
    cmd += ["--timeout", str(int(args.point_timeout))]
    if not args.profile:
        cmd.append("--no-compute-only")
    env = child_env(point, preset)
    row["threads"] = threads_of(point, preset, env)
    row["command"] = " ".join(cmd[1:]).replace(str(ROOT) + "/", "")
    log = args.out / "logs" / f"{point.name}.log"
    stdout = log.with_suffix(".stdout")
    rc, line = runner.run(cmd, env, log, stdout=stdout)
    if rc != 0:
        return {**row, "status": f"failed: exit {rc}: {line}"}
    try:
        result = json.loads(stdout.read_text())
    except json.JSONDecodeError:
        return {**row, "status": "failed: torch_baseline printed no JSON"}
    row.update(
        params=result["params"],
        step_time_s=result["step_time_s"],
        step_times_s=result["step_times_s"],
        tokens_per_sec=result["tokens_per_sec"],
        memory_per_device_bytes=result["memory_per_device_bytes"],
        comm_buffer_bytes_per_step=result["comm_bytes_per_step"],
        comm_bytes_per_step=torch_wire_bytes(torch_strategy, result["comm_bytes_per_step"], point.devices),
        compute_only_step_time_s=result.get("compute_only_step_time_s"),
        torch_strategy=torch_strategy,
        torch_version=result.get("torch_version"),
        memory_note="params + grads + Adam moments per process (no activations)",
        comm_note=result.get("comm_bytes_note"),
    )
    row["threads"]["torch_threads"] = result.get("threads_per_process", 1)
    return row


# -- results ------------------------------------------------------------------------------


def read_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"scaling: warning: {path}:{n} is not JSON; ignored", file=sys.stderr)
    return rows


def write_results(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


def append_result(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def is_ok(row: dict) -> bool:
    return row.get("status") == "ok" and isinstance(row.get("step_time_s"), int | float) and row["step_time_s"] > 0


def baselines(rows: list[dict]) -> dict[tuple, float]:
    """(framework family, model, mode, kind) -> the 1-device step time."""
    return {
        (family(r["framework"]), r.get("model"), r.get("mode"), r.get("kind")): r["step_time_s"]
        for r in rows
        if is_ok(r) and r.get("devices") == 1
    }


def efficiency(row: dict, base: dict[tuple, float]) -> float | None:
    """strong: t1 / (N x tN); weak: t1 / tN (None without a baseline or a time)."""
    if not is_ok(row):
        return None
    t1 = base.get((family(row["framework"]), row.get("model"), row.get("mode"), row.get("kind")))
    if t1 is None:
        return None
    n, tn = row["devices"], row["step_time_s"]
    return t1 / (n * tn) if row.get("mode") == "strong" else t1 / tn


def refresh_efficiency(rows: list[dict]) -> bool:
    """Recompute every line's efficiency in place; whether any changed."""
    base = baselines(rows)
    changed = False
    for r in rows:
        e = efficiency(r, base)
        if r.get("efficiency") != e:
            r["efficiency"] = e
            changed = True
    return changed


# -- the README tables ---------------------------------------------------------------------


def _fmt_time(t: float) -> str:
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def _fmt_mib(b: float | None) -> str:
    return "—" if b is None else f"{b / 2**20:.2f}"


def _strategy_order(name: str) -> tuple:
    return (STRATEGIES.index(name), "") if name in STRATEGIES else (len(STRATEGIES), name)


def _framework_order(name: str) -> tuple:
    order = ("jaxdist", "pytorch", "pytorch-ddp", "pytorch-fsdp")
    return (order.index(name), "") if name in order else (len(order), name)


def _status_word(row: dict) -> str:
    return "skipped" if row["status"].startswith("skipped") else "failed"


def _grid(rows: list[dict]) -> tuple[list[int], list[tuple[str, str]], dict]:
    """Devices (columns), (framework, strategy) rows, and (framework, strategy, devices) -> line;
    the one-device ``single`` line fills column 1 of each row of its framework family."""
    devices = sorted({r["devices"] for r in rows})
    keys = sorted(
        {(r["framework"], r["strategy"]) for r in rows if r["strategy"] != SINGLE},
        key=lambda k: (_framework_order(k[0]), _strategy_order(k[1])),
    )
    singles = {family(r["framework"]): r for r in rows if r["strategy"] == SINGLE}
    if not keys:
        keys = sorted({(r["framework"], SINGLE) for r in rows}, key=lambda k: _framework_order(k[0]))
    cells = {(r["framework"], r["strategy"], r["devices"]): r for r in rows}
    for fw, strategy in keys:
        if family(fw) in singles and 1 in devices:
            cells.setdefault((fw, strategy, 1), singles[family(fw)])
    return devices, keys, cells


def _notes(rows: list[dict]) -> list[str]:
    return sorted(f"- {r['framework']} {r['strategy']} on {r['devices']}: {r['status']}" for r in rows if r.get("status", "ok") != "ok")


def render_tables(rows: list[dict]) -> str:
    """The markdown between the markers; a pure function of the lines (sorted, no timestamps)."""
    rows = [dict(r) for r in rows if all(r.get(k) is not None for k in ("framework", "model", "mode", "kind", "strategy", "devices"))]
    rows.sort(key=lambda r: json.dumps({k: r.get(k) for k in KEY_FIELDS}, sort_keys=True))
    dedup = {}
    for r in rows:
        dedup[row_key(r)] = r  # the last line of a key wins
    rows = sorted(dedup.values(), key=lambda r: json.dumps({k: r.get(k) for k in KEY_FIELDS}, sort_keys=True))
    refresh_efficiency(rows)
    out = [
        "<!-- generated by `python experiments/scaling.py --out OUT --write-readme` from OUT/results.jsonl: edits here are overwritten -->",
        "",
    ]
    if not rows:
        return "\n".join([*out, "No results yet.", ""])
    hosts = sorted({r["host"] for r in rows if r.get("host")})
    if hosts:
        out += [f"Host: {h}." for h in hosts] + [""]
    out += [
        "Cells: median step time · tokens/s · efficiency. Efficiency: strong scaling t1 / (N x tN), weak scaling t1 / tN, "
        "with t1 the same framework's one-device step in the same mode and kind (PyTorch: `single`); the 1-device column "
        "is that one run, shared by every strategy. `fake`: N fake CPU devices in one process; `proc`: N processes x 1 "
        "device over gloo (`jaxdist.launch`).",
        "",
    ]
    models = sorted({r["model"] for r in rows})
    for model in models:
        mrows = [r for r in rows if r["model"] == model]
        for mode in sorted({r["mode"] for r in mrows}, key=lambda m: (MODES.index(m) if m in MODES else 9, m)):
            for kind in sorted({r["kind"] for r in mrows if r["mode"] == mode}, key=lambda k: (KINDS.index(k) if k in KINDS else 9, k)):
                sub = [r for r in mrows if r["mode"] == mode and r["kind"] == kind]
                out += _speed_table(model, mode, kind, sub)
        out += _torch_table(model, mrows)
        out += _memory_tables(model, mrows)
        out += _analytic_table(model, mrows)
        out += _bound_table(model, mrows)
    return "\n".join(out).rstrip("\n") + "\n"


def _batch_words(mode: str, rows: list[dict]) -> str:
    if mode == "strong":
        gbs = sorted({r["global_batch"] for r in rows if r.get("global_batch")})
        return f"global batch {', '.join(map(str, gbs))}"
    pdb = sorted({r["per_device_batch"] for r in rows if r.get("per_device_batch")})
    return f"{', '.join(map(str, pdb))} per device"


def _device_grid(devices: list[int], keys: list[tuple[str, str]], cells: dict, cell) -> list[str]:
    """A markdown table: one row per (framework, strategy), one column per device count."""
    lines = [
        "| framework | strategy | " + " | ".join(f"{n} dev" for n in devices) + " |",
        "| --- | --- | " + " | ".join("---" for _ in devices) + " |",
    ]
    for fw, strategy in keys:
        cols = ["—" if (r := cells.get((fw, strategy, n))) is None else cell(r) for n in devices]
        lines.append(f"| {fw} | {strategy} | " + " | ".join(cols) + " |")
    return lines


def _speed_table(model: str, mode: str, kind: str, rows: list[dict]) -> list[str]:
    devices, keys, cells = _grid(rows)
    seq = sorted({r["seq_len"] for r in rows if r.get("seq_len")})
    out = [
        f"### {model}: {mode} scaling, {kind} ({_batch_words(mode, rows)}, seq {', '.join(map(str, seq))})",
        "",
    ]

    def cell(r: dict) -> str:
        if not is_ok(r):
            return _status_word(r)
        eff = "—" if r.get("efficiency") is None else f"{r['efficiency']:.2f}"
        return f"{_fmt_time(r['step_time_s'])} · {r['tokens_per_sec']:,.0f} · {eff}"

    out += _device_grid(devices, keys, cells, cell)
    notes = _notes(rows)
    return out + ([""] + notes if notes else []) + [""]


def _torch_table(model: str, rows: list[dict]) -> list[str]:
    """jaxdist / PyTorch step time for each matching (mode, strategy, devices) on processes;
    the 1-device column compares the two ``single`` runs."""
    proc = {(r["framework"], r["mode"], r["strategy"], r["devices"]): r for r in rows if r["kind"] == "proc" and is_ok(r)}
    lines = {}  # (mode, jaxdist strategy, torch framework) -> {devices: (jaxdist row, torch row)}
    for (fw, mode, strategy, n), t in proc.items():
        if not fw.startswith("pytorch"):
            continue
        j = proc.get(("jaxdist", mode, strategy, n))
        if j is None:
            continue
        if strategy == SINGLE:
            label = [(s, f) for f, (_, s) in TORCH_STRATEGY.items() if any(k[0] == f and k[1] == mode for k in proc)]
            for key in label or [(SINGLE, fw)]:
                lines.setdefault((mode, *key), {})[1] = (j, t)
        else:
            lines.setdefault((mode, strategy, fw), {})[n] = (j, t)
    if not lines:
        return []
    devices = sorted({n for cells in lines.values() for n in cells})
    out = [
        f"### {model}: jaxdist / PyTorch step time (processes over gloo, same model, batch and process count)",
        "",
        "Cells: jaxdist / PyTorch median step time = ratio (below 1: jaxdist is faster). dp is compared with DDP, fsdp "
        "with FSDP2, and on 1 device jaxdist's one-process run with PyTorch's `single` (1 thread per PyTorch process).",
        "",
        "| mode | jaxdist vs PyTorch | " + " | ".join(f"{n} dev" for n in devices) + " |",
        "| --- | --- | " + " | ".join("---" for _ in devices) + " |",
    ]
    order = sorted(lines, key=lambda k: (MODES.index(k[0]) if k[0] in MODES else 9, k[0], _strategy_order(k[1]), _framework_order(k[2])))
    for mode, strategy, fw in order:
        cols = []
        for n in devices:
            pair = lines[(mode, strategy, fw)].get(n)
            if pair is None:
                cols.append("—")
            else:
                tj, tt = pair[0]["step_time_s"], pair[1]["step_time_s"]
                cols.append(f"{_fmt_time(tj)} / {_fmt_time(tt)} = {tj / tt:.2f}")
        out.append(f"| {mode} | {strategy} vs {fw} | " + " | ".join(cols) + " |")
    return out + [""]


def _analyzed_once(rows: list[dict]) -> list[dict]:
    """analyze is kind-independent: one line per (framework, mode, strategy, devices), the fake one first."""
    first: dict = {}
    for r in sorted(rows, key=lambda r: (KINDS.index(r["kind"]) if r["kind"] in KINDS else 9, r["kind"])):
        first.setdefault((r["framework"], r["mode"], r["strategy"], r["devices"]), r)
    return list(first.values())


def _memory_tables(model: str, rows: list[dict]) -> list[str]:
    out = []
    for mode in sorted({r["mode"] for r in rows}, key=lambda m: (MODES.index(m) if m in MODES else 9, m)):
        sub = _analyzed_once([r for r in rows if r["mode"] == mode and r.get("memory_per_device_bytes") is not None])
        if not sub:
            continue
        devices, keys, cells = _grid(sub)
        params = sorted({r["params"] for r in sub if r["framework"] == "jaxdist" and r.get("params")})
        out += [
            f"### {model}: memory and communication per device, {mode} scaling ({_batch_words(mode, sub)})",
            "",
            "Cells, MiB per device: total · states · wire. jaxdist (`jaxdist.analyze`, compile only): total = arguments + "
            "outputs + temp less aliased buffers (states and activations), states = the step's arguments (weights and Adam "
            "moments as sharded, plus the batch), wire = the bytes its collectives send per step (ring formulas, "
            "`jaxdist/inspect/wire.py`). PyTorch: states = params + grads + Adam moments per process (no activations, so no total), "
            "wire = its gradient all-reduce (DDP) or all-gather + reduce-scatter payload (FSDP2) on a ring. Formula rows: "
            "weights + Adam moments in fp32 (`experiments/scaling_analytic.py`), comparable with the states.",
            "",
        ]

        def cell(r: dict) -> str:
            total = "—" if r["framework"] != "jaxdist" else _fmt_mib(r["memory_per_device_bytes"])
            states = r.get("states_bytes_per_device") if r["framework"] == "jaxdist" else r["memory_per_device_bytes"]
            return f"{total} · {_fmt_mib(states)} · {_fmt_mib(r.get('comm_bytes_per_step'))}"

        out += _device_grid(devices, keys, cells, cell)
        if len(params) == 1:
            p = params[0]
            for name, f in ZERO_STATES_FP32.items():
                out.append(f"| formula, P = {p:,} | {name} | " + " | ".join(_fmt_mib(f(p, n)) for n in devices) + " |")
        out.append("")
    return out


def _ratio(measured: float | None, expected: float | None) -> str:
    return "—" if not measured or not expected else f"{measured / expected:.3f}"


def _analytic_table(model: str, rows: list[dict]) -> list[str]:
    """Measured (compiled program) vs expected (model dimensions) wire bytes per mesh axis and states per device."""
    preset = PRESETS.get(model)
    lines = []
    for r in _analyzed_once([r for r in rows if r["framework"] == "jaxdist" and r.get("comm_by_axes") is not None]):
        if preset is None or r["devices"] == 1:
            continue
        dims = Dims(r["params"], preset.n_layers, preset.d_model, preset.seq_len, r["global_batch"])
        expected = expected_wire_bytes(r["strategy"], r["mesh"], dims)
        states = expected_state_bytes(r["strategy"], r["mesh"], r["params"])
        if expected is None:
            continue
        measured_states = r.get("states_bytes_per_device")
        for axis, want in expected.items():
            got = (r["comm_by_axes"].get(axis) or {}).get("wire_bytes")
            lines.append(
                (
                    MODES.index(r["mode"]) if r["mode"] in MODES else 9,
                    _strategy_order(r["strategy"]),
                    r["devices"],
                    axis,
                    f"| {r['mode']} | {r['strategy']} | {r['mesh']} | {axis} | {_fmt_mib(got)} | {_fmt_mib(want['cpu'])} | "
                    f"{_ratio(got, want['cpu'])} | {_fmt_mib(want['ideal'])} | {_fmt_mib(measured_states)} | {_fmt_mib(states)} | "
                    f"{_ratio(measured_states, states)} |",
                )
            )
    if not lines:
        return []
    return [
        f"### {model}: measured vs expected communication and model states",
        "",
        "Measured: `jaxdist.analyze`'s wire bytes of the collectives spanning that mesh axis, and its arguments (states). "
        "Expected: `experiments/scaling_analytic.py`, from the parameter count and the model's dimensions only "
        "(ring formulas; the CPU column runs the gradient reduce-scatter as all-reduce + slice, as XLA's CPU backend "
        "does; ideal uses reduce-scatters). MiB per device per step.",
        "",
        "| mode | strategy | mesh | axis | wire measured | expected (CPU) | ratio | expected (ideal) | states measured | "
        "states expected | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(line[-1] for line in sorted(lines, key=lambda x: x[:4])),
        "",
    ]


def _bound_table(model: str, rows: list[dict]) -> list[str]:
    prof = [r for r in rows if r.get("bound")]
    if not prof:
        return []
    out = []
    for mode in sorted({r["mode"] for r in prof}, key=lambda m: (MODES.index(m) if m in MODES else 9, m)):
        for kind in sorted({r["kind"] for r in prof if r["mode"] == mode}):
            sub = [r for r in prof if r["mode"] == mode and r["kind"] == kind]
            devices, keys, cells = _grid(sub)
            out += [
                f"### {model}: profile, {mode} scaling, {kind}",
                "",
                "Cells: the bound of the traced steps (`jaxdist.profile`), then the collective time per step (exposed + "
                "overlapped) over the step time.",
                "",
            ]

            def cell(r: dict) -> str:
                ct, st = r.get("comm_time_s"), r.get("profile_step_time_s") or r.get("step_time_s")
                share = f", comm {ct / st:.0%}" if isinstance(ct, int | float) and st else ""
                return f"{r['bound']}{share}"

            out += [*_device_grid(devices, keys, cells, cell), ""]
    return out


def write_readme(path: Path, rows: list[dict]) -> None:
    """Replace the text between the markers (appending them at the end when absent); nothing else changes."""
    body = render_tables(rows)
    text = path.read_text() if path.exists() else ""
    b, e = text.find(BEGIN), text.find(END)
    if b >= 0 and e > b:
        new = text[: b + len(BEGIN)] + "\n" + body + text[e:]
    elif b < 0 and e < 0:
        sep = "" if not text else "\n" if text.endswith("\n") else "\n\n"
        new = text + sep + BEGIN + "\n" + body + END + "\n"
    else:
        raise SystemExit(f"scaling: {path} has only one of the markers {BEGIN} / {END}, or they are out of order")
    if new != text:
        path.write_text(new)


# -- the CLI -------------------------------------------------------------------------------


def _csv(kind: str, allowed: tuple[str, ...] | None = None):
    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"empty {kind} list")
        if allowed is not None:
            bad = [t for t in items if t not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {kind} {', '.join(bad)} (choose from {', '.join(allowed)})")
            return items
        try:
            values = [int(t) for t in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{kind}: expected integers, got {text!r}") from None
        if any(v < 1 for v in values):
            raise argparse.ArgumentTypeError(f"{kind} must be >= 1")
        return values

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python experiments/scaling.py",
        description="Scaling sweeps (jaxdist strategies, PyTorch DDP/FSDP) -> OUT/results.jsonl, README tables, plots.",
    )
    p.add_argument("--out", type=Path, required=True, help="results folder (results.jsonl, hardware.json, runs/, logs/, analyze/)")
    p.add_argument("--strategies", type=_csv("strategy", STRATEGIES), default=list(STRATEGIES), help="comma list: " + ",".join(STRATEGIES))
    p.add_argument("--devices", type=_csv("devices"), default=[1, 2, 4, 8], help="comma list of device counts (default 1,2,4,8)")
    p.add_argument("--modes", type=_csv("mode", MODES), default=list(MODES), help="strong,weak")
    p.add_argument("--kinds", type=_csv("kind", KINDS), default=list(KINDS), help="fake (N fake devices, 1 process), proc (N processes)")
    p.add_argument("--frameworks", type=_csv("framework", FRAMEWORKS), default=list(FRAMEWORKS), help=",".join(FRAMEWORKS))
    p.add_argument("--steps", type=int, default=10, help="timed steps per point (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--budget-min", type=float, default=None, help="start no new point after this many minutes")
    p.add_argument("--point-timeout", type=float, default=1800.0, help="seconds before a run is stopped and recorded as failed")
    p.add_argument("--model", default=None, help="small-cpu (default on cpu) | small-gpu (default with --hardware gpu)")
    p.add_argument(
        "--profile", action=argparse.BooleanOptionalAction, default=True, help="trace 2 steps per jaxdist point (bound, comm time)"
    )
    p.add_argument("--write-readme", nargs="?", type=Path, const=DEFAULT_README, default=None, metavar="PATH", help="regenerate the tables")
    p.add_argument("--plots", action="store_true", help="draw PNGs into experiments/figures/")
    p.add_argument("--figures", type=Path, default=FIGURES, help=argparse.SUPPRESS)
    p.add_argument("--hardware", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--report-only", action="store_true", help="run nothing: README / plots from results.jsonl only")
    p.add_argument("--retry-failed", action="store_true", help="rerun points recorded as failed")
    p.add_argument(
        "--refresh-analyze", action="store_true", help="recompute memory / communication of every jaxdist line (compile only), keep timings"
    )
    args = p.parse_args(argv)
    args.model = args.model or ("small-gpu" if args.hardware == "gpu" else "small-cpu")
    if args.model not in PRESETS:
        p.error(f"unknown --model {args.model!r} (choose from small-cpu, small-gpu)")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def sweep(args: argparse.Namespace, preset: Preset, results: Path) -> int:
    from tqdm import tqdm

    info = hardware_info(args.hardware)
    hw_path = args.out / "hardware.json"
    if hw_path.exists():
        old = json.loads(hw_path.read_text())
        if {k: old.get(k) for k in ("cpu", "cores", "jax", "torch")} != {k: info.get(k) for k in ("cpu", "cores", "jax", "torch")}:
            print(f"scaling: warning: {hw_path} described another host or versions; results.jsonl now mixes them", file=sys.stderr)
    hw_path.write_text(json.dumps(info, indent=1) + "\n")
    print("hardware: " + json.dumps(info))
    host = host_line(info)
    args.gpus = info.get("gpus", 0)

    rows = read_results(results)
    if args.retry_failed:
        kept = [r for r in rows if not str(r.get("status", "")).startswith("failed")]
        if len(kept) != len(rows):
            write_results(results, kept)
            rows = kept
    done = {row_key(r) for r in rows}
    points = plan(args, preset)
    todo = [p for p in points if p.key not in done]
    if "proc" not in args.kinds and any(f != "jaxdist" for f in args.frameworks):
        print("scaling: PyTorch points run as processes only (--kinds proc); none planned", file=sys.stderr)
    print(f"scaling: {len(points)} points, {len(points) - len(todo)} already in {results}, {len(todo)} to run")
    runner = Runner(args.point_timeout)
    start = time.monotonic()
    bar = tqdm(total=len(points), initial=len(points) - len(todo), unit="point", dynamic_ncols=True, file=sys.stderr)
    try:
        for i, point in enumerate(todo):
            if args.budget_min is not None and time.monotonic() - start >= args.budget_min * 60:
                bar.write(
                    f"scaling: the {args.budget_min:g}-minute budget is spent: {len(todo) - i} points not started; "
                    "run the same command again to continue"
                )
                break
            bar.set_postfix_str(f"{point.framework} {point.strategy} {point.mode} {point.kind} N={point.devices}")
            row = base_row(point, preset, host)
            t0 = time.monotonic()
            run = run_jaxdist if point.framework == "jaxdist" else run_torch
            row = run(point, preset, args, runner, row)
            row["wall_s"] = round(time.monotonic() - t0, 1)
            rows.append(row)
            row["efficiency"] = efficiency(row, baselines(rows))
            append_result(results, row)
            status = row["status"] if row["status"] != "ok" else f"{row['step_time_s'] * 1e3:.1f} ms/step"
            bar.write(f"{point.framework} {point.strategy} {point.mode} {point.kind} N={point.devices}: {status}")
            bar.update(1)
    except KeyboardInterrupt:
        bar.close()
        print("scaling: interrupted; finished points are in results.jsonl", file=sys.stderr)
        return 130
    bar.close()
    rows = read_results(results)
    if refresh_efficiency(rows):
        write_results(results, rows)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preset = PRESETS[args.model]
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    if args.refresh_analyze:
        refresh_analysis(args, preset, results)
    if not args.report_only:
        code = sweep(args, preset, results)
        if code:
            return code
    rows = read_results(results)
    refresh_efficiency(rows)
    if args.write_readme is not None:
        write_readme(args.write_readme, rows)
        print(f"scaling: tables written into {args.write_readme} between {BEGIN} and {END}")
    if args.plots:
        sys.path.insert(0, str(HERE))
        from scaling_plots import draw_all

        for path in draw_all(rows, args.figures):
            print(f"scaling: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
