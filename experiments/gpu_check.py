"""The GPU acceptance check: one command, one GPU, at most ~8 minutes, one table.

    python experiments/gpu_check.py [--steps 30] [--budget-s 470] [--json PATH] [key=value ...]
    python experiments/gpu_check.py --compile-only [--target h100] [key=value ...]   # no GPU needed

What it measures on the GPU it finds (each row says how):

- a 1B-class decoder (d_model 2048, 20 layers, ~1.0B parameters) in bf16 on real packed text
  (``data.source=stdlib``: documents packed with segment ids, so the packed cuDNN attention
  path) vs synthetic tokens: step time, tokens/s, MFU, the attention implementation chosen,
  joules per token (NVML), and, from a traced window of the packed run, the profile report's
  bound; the planner's predicted step time for the same layout beside the measured one;
- bf16 vs fp8 current vs fp8 delayed on the same model and data: tokens/s, the loss after N
  steps, the number of cuBLASLt fp8 GEMM custom calls in the compiled step (3 per fp8 matmul
  expected) and XLA's planned memory per device;
- the chunked loss's planned memory against the whole-sequence loss (compile only);
- the MoE grouped matmul's lowering in the compiled ``moe-tiny`` step (ragged-dot kept, a Triton
  kernel, or a dense expansion), and its step time with the Pallas/Triton lowering off and on;
- with more than one GPU visible, the context ring's overlap (collective-permute start/done
  pairs with attention-block compute between them).

Rows past the time budget are printed as skipped. Without a GPU it prints one line and exits 0.
Trainings run as ``python -m jaxdist.train`` subprocesses (their metrics.jsonl is the source);
compile-only checks run in this process. ``key=value`` words override every row's config (last).

``--compile-only`` runs every structural check on this host, no GPU needed: each row's program
is compiled by XLA:GPU for ``--target`` (``jaxdist.plan.gpu_target``: compile-only devices, the
flags a GPU run sets) and read: the kernels (cuDNN attention forward and backward, gemms), the
fp8 GEMMs, planned and peak memory, the chunked loss's memory, the planner's prediction, the MoE
grouped matmul's lowering and the context ring's overlap. What needs a device to measure (step
time, tokens/s, MFU, losses, joules, the traced profile, measured step times) is skipped with
one line each. Differences from a real GPU: no autotuning (matmuls keep XLA's default kernels,
so an fp8 GEMM may be a Triton kernel rather than cuBLASLt's) and cuDNN graphs are not built.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ONE_B = (  # ~1.0B parameters with the byte-level vocab of the stdlib corpus
    "model.d_model=2048",
    "model.n_layers=20",
    "model.n_heads=16",
    "model.n_kv_heads=8",
    "model.dtype=bfloat16",
    "train.global_batch=8",
    "train.seq_len=2048",
    "train.warmup_steps=5",
    "train.log_every=1",
    "checkpoint.every_steps=0",
)
PLANNER_HARDWARE = {"H200": "h200", "H100": "h100", "A100": "a100"}
FP8_GEMM = "__cublas$lt$matmul$f8"
RING = ("parallel.context_strategy=ring", "model.dtype=bfloat16", "train.seq_len=4096", "train.global_batch=2")
DEVICE_ONLY = "needs a device to measure"


def gpu_devices():
    import jax

    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def train(name: str, overrides: tuple[str, ...], steps: int, work: Path, *, dump_hlo: bool = False, extra=(), timeout: float = 240.0):
    """One ``python -m jaxdist.train`` run; its metrics, stderr and (``dump_hlo``) the
    optimized HLO of its largest program."""
    run_dir = work / name
    env = dict(os.environ)
    if dump_hlo:
        dump = work / f"{name}-hlo"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text".strip()
    cmd = [sys.executable, "-m", "jaxdist.train", "--run-dir", str(run_dir), *extra, f"train.steps={steps}", *overrides]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = {"rc": proc.returncode, "stderr": proc.stderr, "wall_s": time.monotonic() - started, "run_dir": run_dir}
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    out["metrics"] = [m for m in map(json.loads, lines) if "loss" in m]
    if dump_hlo:
        texts = sorted((work / f"{name}-hlo").glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
        out["hlo"] = texts[-1].read_text() if texts else ""
    return out


def steady(metrics: list[dict], key: str, skip: int = 3):
    """Median of ``key`` over the logged steps after the first ``skip`` (compile, warm-up)."""
    values = [m[key] for m in metrics[skip:] if m.get(key) is not None]
    return statistics.median(values) if values else None


def target_program(hardware, overrides: tuple[str, ...], config: str | None = None, mesh: dict | None = None):
    """(``analyze --target``'s report, optimized HLO) of a row's step compiled for ``hardware``
    on this host: compile-only devices, one per mesh position (``--compile-only``)."""
    from jaxdist.config import load_config
    from jaxdist.data.sources import resolve_vocab
    from jaxdist.layout.mesh import MESH_AXES, mesh_device_count
    from jaxdist.plan.gpu_target import compile_for_target, target_report

    cfg = load_config(config, list(overrides))
    resolve_vocab(cfg)
    sizes = {a: (mesh or {}).get(a, 1) for a in MESH_AXES}
    trainer, compiled, options = compile_for_target(cfg, sizes, hardware, mesh_device_count(sizes), 8)
    return target_report(trainer, compiled, hardware, options, 8), compiled.as_text()


def planned_memory_gib(overrides: tuple[str, ...], config: str | None = None) -> float:
    """XLA's planned memory per device (arguments + outputs + temporaries) of the compiled step."""
    from jaxdist.config import load_config
    from jaxdist.data.sources import resolve_vocab
    from jaxdist.training.aot import analyze

    cfg = load_config(config, list(overrides))
    resolve_vocab(cfg)
    report = analyze(cfg, {"data": 1})
    return report["memory_per_device_bytes"]["total"] / 2**30


def compiled_hlo(overrides: tuple[str, ...], config: str | None = None, mesh: dict | None = None) -> str:
    from jaxdist.config import load_config
    from jaxdist.data.sources import resolve_vocab
    from jaxdist.layout.mesh import MESH_AXES
    from jaxdist.training.aot import compile_train_step

    cfg = load_config(config, list(overrides))
    resolve_vocab(cfg)
    sizes = {a: (mesh or {}).get(a, 1) for a in MESH_AXES}
    return compile_train_step(cfg, sizes)[1].as_text()


def attention_path(overrides: tuple[str, ...], compute_capability: str | None) -> str:
    """The attention kernel ``model.attention`` chooses on GPUs of ``compute_capability`` (packed
    documents need it: cuDNN packs sequences from Hopper on)."""
    from jaxdist.config import load_config
    from jaxdist.models import build_task

    cfg = load_config(None, list(overrides))
    cfg.model.vocab_size = cfg.model.vocab_size or 384
    return build_task(cfg, "gpu", compute_capability).attention or "?"


def grouped_matmul_lowering(hlo: str) -> str:
    """How the compiled program computes ragged_dot: kept as ragged-dot ops, a Triton kernel,
    or neither (a dense expansion: dots over every expert)."""
    ragged = len(re.findall(r"= [^=]*\bragged-dot\(", hlo))
    triton = len(re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton"', hlo))
    if ragged:
        return f"grouped ({ragged} ragged-dot ops)"
    if triton:
        return f"Triton kernels ({triton} custom calls)"
    return "dense expansion (no ragged-dot or Triton call left)"


def planner_step_s(hardware: str, overrides: tuple[str, ...]) -> float | None:
    cmd = [sys.executable, "-m", "jaxdist.plan", "--gpus", "1", "--hardware", hardware, "--json", "--max-compiles", "2", *overrides]
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # the planner compiles against fake CPU devices
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    if proc.returncode:
        return None
    candidates = json.loads(proc.stdout.strip().splitlines()[-1])["candidates"]
    plain = [c for c in candidates if c.get("microbatches", 1) == 1 and c.get("remat", "none") == "none"] or candidates
    return plain[0]["step_time_s"] if plain else None


def fmt(value, spec: str = ".3g", unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def compile_only(args) -> int:
    """Every structural check against programs compiled for ``args.target`` here (no device)."""
    from jaxdist.errors import JaxdistError
    from jaxdist.plan.gpu_target import prepare_target, target_hardware

    try:
        prepare_target()  # before JAX starts: compile-only devices need the plugin and a CPU backend
        hardware = target_hardware(args.target)
    except JaxdistError as e:
        print(f"gpu_check --compile-only: {e}")
        return 2
    import jax

    print(
        f"gpu_check --compile-only: {hardware.name} ({hardware.key}) programs compiled on this host, no device; "
        f"jax {jax.__version__}, {time.strftime('%Y-%m-%d')}",
        flush=True,
    )
    rows = []

    def row(check: str, value: str, how: str) -> None:
        rows.append({"check": check, "value": value, "how": how})
        print(f"  {check:<44} {value:<34} {how}", flush=True)

    def failed(check: str, e: Exception) -> None:
        row(check, "failed", f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}")

    extra = tuple(args.overrides)
    packed = (*ONE_B, "data.source=stdlib", *extra)
    synthetic = (*ONE_B, "data.source=synthetic", *extra)
    programs: dict[str, dict] = {}
    for name, overrides in (
        ("bf16 packed", packed),
        ("bf16 synthetic", synthetic),
        ("fp8 current", (*packed, "model.fp8=current")),
        ("fp8 delayed", (*packed, "model.fp8=delayed")),
    ):
        row(name, "skipped", f"{DEVICE_ONLY}: step time, tokens/s, MFU, the loss, joules/token")
        try:
            report, hlo = target_program(hardware, overrides)
        except Exception as e:  # one row per failed check; the others still run
            failed(f"  {name}: compiled program", e)
            continue
        programs[name] = report
        k = report["kernels"]
        row(
            f"  {name}: kernels per step",
            f"{k['gemm']} gemm, {k['gemm_fp8']} fp8 gemm, {k['attention_cudnn_fwd']}/{k['attention_cudnn_bwd']} cuDNN attn",
            "the target program's kernels (cuDNN attention forward / backward)",
        )
        if "fp8" in name:
            row(
                f"  {name}: fp8 GEMMs in the step",
                f"{k['gemm_fp8']} ({hlo.count(FP8_GEMM)} cuBLASLt)",
                f"fp8 gemm kernels in the target program (3 per fp8 matmul); in brackets the '{FP8_GEMM}' calls",
            )
        peak = report["memory_per_device_bytes"]["peak"]
        row(f"  {name}: peak memory", f"{peak / 2**30:.2f} GiB ({'fits' if report['fits'] else 'does not fit'})", report["fits_note"])
    for name, overrides in (("bf16 packed", packed), ("bf16 synthetic", synthetic)):
        try:
            capability = str(hardware.device["compute_capability"])
            row(
                f"attention path ({name})",
                attention_path(overrides, capability),
                f"models.attention.choose_implementation on gpu {capability}",
            )
        except Exception as e:
            failed(f"attention path ({name})", e)
    row("profile report bound (bf16 packed)", "skipped", f"{DEVICE_ONLY}: a traced window of the run")
    memory = [
        programs.get(name, {}).get("memory_per_device_bytes", {}).get("total") for name in ("bf16 synthetic", "fp8 current", "fp8 delayed")
    ]
    row(
        "planned memory: bf16 / fp8 current / fp8 delayed",
        " / ".join("-" if m is None else f"{m / 2**30:.2f}" for m in memory) + " GiB",
        "XLA's memory analysis of the target programs (bf16 on synthetic tokens, fp8 on packed)",
    )
    try:
        chunk_set = any(word.startswith("model.loss_chunk=") for word in extra)
        whole = programs.get("bf16 synthetic") if not chunk_set else None  # loss_chunk's default (0) is the whole loss
        if whole is None:
            whole = target_program(hardware, (*synthetic, "model.loss_chunk=0"))[0]
        chunked = target_program(hardware, (*synthetic, "model.loss_chunk=512"))[0]
        whole, chunked = (r["memory_per_device_bytes"]["total"] for r in (whole, chunked))
        row(
            "planned memory: whole loss / loss_chunk=512",
            f"{whole / 2**30:.2f} / {chunked / 2**30:.2f} GiB ({whole / chunked:.2f}x)",
            "XLA's memory analysis of the target programs",
        )
    except Exception as e:
        failed("planned memory: whole loss / loss_chunk=512", e)
    predicted = planner_step_s(hardware.key, synthetic)
    row(
        "planner step time vs measured (bf16 synthetic)",
        f"{fmt(predicted, '.3g', ' s')} predicted",
        f"python -m jaxdist.plan --hardware {hardware.key}; measured: {DEVICE_ONLY}",
    )
    try:
        moe = ("model.dtype=bfloat16", *extra)
        row(
            "MoE grouped matmul lowering (moe-tiny)",
            grouped_matmul_lowering(target_program(hardware, moe, "moe-tiny")[1]),
            f"the target program's HLO; step time with the Pallas/Triton lowering off and on: {DEVICE_ONLY}",
        )
    except Exception as e:
        failed("MoE grouped matmul lowering (moe-tiny)", e)
    try:
        from jaxdist.parallel.context import ring_overlap_in_hlo

        report, hlo = target_program(hardware, (*RING, *extra), None, {"context": 2})
        found = ring_overlap_in_hlo(hlo, report["mesh"])
        row(
            "context ring overlap (context=2, ring)",
            f"{found['overlapped_pairs']}/{found['async_pairs']} pairs overlapped",
            "collective-permute start/done around attention blocks, 2 target GPUs",
        )
    except Exception as e:
        failed("context ring overlap (context=2, ring)", e)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": f"{hardware.name} (compile-only)", "gpus": 0, "rows": rows}, indent=1))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps per run")
    parser.add_argument("--budget-s", type=float, default=470.0, help="stop starting new rows after this many seconds")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="no GPU: compile every row for --target on this host and run the structural checks (what needs a device is skipped)",
    )
    parser.add_argument("--target", default="h100", help="--compile-only: h100 | h200 | a100 | h100-hbm2e")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every row (applied last)")
    args = parser.parse_args(argv)
    if args.compile_only:
        return compile_only(args)
    gpus = gpu_devices()
    if not gpus:
        print("gpu_check: no GPU visible to JAX (nothing to check here); run it where a GPU is lent")
        return 0
    import jax

    budget, rows = Budget(args.budget_s), []
    kind = gpus[0].device_kind
    hardware = next((v for k, v in PLANNER_HARDWARE.items() if k in kind), None)
    print(f"gpu_check: {len(gpus)} x {kind}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}", flush=True)

    def row(check: str, value: str, how: str) -> None:
        rows.append({"check": check, "value": value, "how": how})
        print(f"  {check:<44} {value:<34} {how}", flush=True)

    def skipped(check: str) -> None:
        row(check, "skipped", f"time budget ({args.budget_s:.0f} s) spent")

    extra = tuple(args.overrides)
    packed = (*ONE_B, "data.source=stdlib", *extra)
    synthetic = (*ONE_B, "data.source=synthetic", *extra)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        work = Path(tmp)
        runs: dict[str, dict] = {}
        plan = [
            ("bf16 packed", packed, ("--profile-steps", f"{args.steps - 4}:{args.steps - 3}")),
            ("bf16 synthetic", synthetic, ()),
            ("fp8 current", (*packed, "model.fp8=current"), ()),
            ("fp8 delayed", (*packed, "model.fp8=delayed"), ()),
        ]
        for name, overrides, flags in plan:
            if budget.left() < 90:
                skipped(name)
                continue
            r = runs[name] = train(name.replace(" ", "_"), overrides, args.steps, work, dump_hlo=True, extra=flags)
            if r["rc"]:
                row(name, f"failed (exit {r['rc']})", r["stderr"].strip().splitlines()[-1][:120] if r["stderr"].strip() else "")
                continue
            m = r["metrics"]
            fp8_calls = r["hlo"].count(FP8_GEMM)
            row(
                name,
                f"{fmt(steady(m, 'step_time_s'), '.3f', ' s')} / {fmt(steady(m, 'tokens_per_sec'), ',.0f', ' tok/s')}",
                f"median step time / tokens/s over steps 4..{args.steps}",
            )
            row(
                f"  {name}: MFU, loss@{args.steps}",
                f"{fmt(steady(m, 'mfu'), '.1%')} / {fmt(m[-1]['loss'], '.4f')}",
                "bf16 dense peak / last logged loss",
            )
            if "fp8" in name:
                row(
                    f"  {name}: MFU against the fp8 peak",
                    fmt(steady(m, "mfu_fp8_peak"), ".1%"),
                    "mfu_fp8_peak: model FLOPs over the fp8 dense peak",
                )
            row(f"  {name}: fp8 GEMMs in the step", str(fp8_calls), f"'{FP8_GEMM}' custom calls in the optimized HLO (3 per fp8 matmul)")
            row(f"  {name}: joules/token", fmt(steady(m, "joules_per_token"), ".3g", " J"), "NVML board energy, eval and saves left out")
        for name, overrides in (("bf16 packed", packed), ("bf16 synthetic", synthetic)):
            row(
                f"attention path ({name})",
                attention_path(overrides, getattr(gpus[0], "compute_capability", None)),
                "models.attention.choose_implementation on gpu",
            )
        if "bf16 packed" in runs and runs["bf16 packed"]["rc"] == 0:
            profile = subprocess.run(
                [sys.executable, "-m", "jaxdist.profile", "--json", str(runs["bf16 packed"]["run_dir"])],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120,
            )
            bound = json.loads(profile.stdout.strip().splitlines()[-1]).get("bound") if profile.returncode == 0 else None
            row("profile report bound (bf16 packed)", str(bound), "python -m jaxdist.profile on the traced window")
        for check, fn in (
            ("planned memory: bf16 / fp8 current / fp8 delayed", "fp8_memory"),
            ("planned memory: whole loss / loss_chunk=512", "chunk_memory"),
            ("planner step time vs measured (bf16 synthetic)", "planner"),
            ("MoE grouped matmul lowering (moe-tiny)", "moe"),
            ("context ring overlap (context=2, ring)", "ring"),
        ):
            if budget.left() < 45:
                skipped(check)
                continue
            try:
                if fn == "fp8_memory":
                    values = [planned_memory_gib((*synthetic, *x)) for x in ((), ("model.fp8=current",), ("model.fp8=delayed",))]
                    row(check, " / ".join(f"{v:.1f}" for v in values) + " GiB", "XLA's memory analysis of the compiled step")
                elif fn == "chunk_memory":
                    whole, chunked = (planned_memory_gib((*synthetic, f"model.loss_chunk={c}")) for c in (0, 512))
                    row(check, f"{whole:.1f} / {chunked:.1f} GiB ({whole / chunked:.2f}x)", "XLA's memory analysis of the compiled step")
                elif fn == "planner":
                    measured = steady(runs.get("bf16 synthetic", {}).get("metrics", []), "step_time_s")
                    predicted = planner_step_s(hardware, synthetic) if hardware else None
                    ratio = f" ({predicted / measured:.2f}x)" if predicted and measured else ""
                    row(
                        check,
                        f"{fmt(predicted, '.3f', ' s')} vs {fmt(measured, '.3f', ' s')}{ratio}",
                        f"python -m jaxdist.plan --hardware {hardware}",
                    )
                elif fn == "moe":
                    moe = ("model.dtype=bfloat16", *extra)
                    lowering = grouped_matmul_lowering(compiled_hlo(moe, "moe-tiny"))
                    times = []
                    for triton in ("false", "true"):
                        env_flag = ("JAX_RAGGED_DOT_USE_GPU_PALLAS_TRITON_LOWERING", triton)
                        os.environ[env_flag[0]] = env_flag[1]
                        r = train(f"moe-triton-{triton}", ("--config", "moe-tiny", *moe), 20, work)
                        times.append(steady(r["metrics"], "step_time_s"))
                    os.environ.pop("JAX_RAGGED_DOT_USE_GPU_PALLAS_TRITON_LOWERING", None)
                    row(check, lowering, f"step {fmt(times[0], '.4f', ' s')} (XLA) vs {fmt(times[1], '.4f', ' s')} (Pallas/Triton)")
                elif fn == "ring":
                    if len(gpus) < 2:
                        row(check, "n/a", "one GPU visible")
                        continue
                    from jaxdist.parallel.context import ring_overlap_in_hlo

                    ring = (*RING, *extra)
                    found = ring_overlap_in_hlo(compiled_hlo(ring, None, {"context": 2}), {"context": 2})
                    row(
                        check,
                        f"{found['overlapped_pairs']}/{found['async_pairs']} pairs overlapped",
                        "collective-permute start/done around attention blocks",
                    )
            except Exception as e:  # one row per failed check; the others still run
                row(check, "failed", f"{type(e).__name__}: {str(e).splitlines()[0][:100]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": kind, "gpus": len(gpus), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
