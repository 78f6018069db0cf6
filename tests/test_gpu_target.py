"""GPU programs without a GPU: the train step compiled by XLA:GPU for an H100 on this host
(``jaxdist.plan.gpu_target``), read by ``jaxdist.inspect.gpu_program``.

Needs JAX's CUDA plugin (the ``dev`` extra installs it); without it these tests skip with
that one reason. The compile-only devices come from a target description, so nothing here
needs a GPU or a driver.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="JAX's CUDA plugin is not installed (pip install -e '.[dev]')")

from jaxdist import analyze  # noqa: E402
from jaxdist.config import load_config  # noqa: E402
from jaxdist.data.sources import resolve_vocab  # noqa: E402
from jaxdist.inspect.gpu_program import collective_schedule, kernel_counts  # noqa: E402
from jaxdist.layout.mesh import parse_mesh  # noqa: E402
from jaxdist.plan.cost import predict  # noqa: E402
from jaxdist.plan.gpu_cost import gpu_program_cost  # noqa: E402
from jaxdist.plan.gpu_target import compile_for_target, target_hardware, target_report  # noqa: E402

from helpers import TINY, subprocess_env, without_session_cache  # noqa: E402


def test_the_jax_internals_the_cudnn_capability_guard_replaces_exist():
    """``gpu_target.target_capability`` swaps two functions of JAX's cuDNN attention module for
    the duration of a target compile; a JAX upgrade that moves them must fail here, loudly."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    assert callable(cudnn_attention.check_compute_capability)
    assert callable(cudnn_attention.is_cuda_compute_capability_equal)


# XLA's own schedule where a test reads what the program is made of (tests/test_latency_profile.py
# tests the scheduler's costs; the cache test below keeps them, to see both compiles hit)
STRUCTURE = ("model.dtype=bfloat16", "train.latency_profile=off")


def _compile(overrides=(), mesh="data=8", gpus=8, target="h100"):
    config = load_config(None, [*TINY, *STRUCTURE, *overrides])
    resolve_vocab(config)
    hardware = target_hardware(target)
    trainer, compiled, options = compile_for_target(config, parse_mesh(mesh), hardware, gpus, 8)
    return target_report(trainer, compiled, hardware, options, 8), compiled.as_text()


@pytest.fixture(scope="module")
def tiny_h100():
    return _compile(("model.n_layers=3",))


@pytest.mark.heavy
def test_cheap_code_generation_leaves_the_program_a_target_compile_reads_as_it_was(tiny_h100):
    """A target compile turns ptxas and LLVM's expensive passes down and reuses kernels (``deviceless_codegen_options``):
    the same step compiled with XLA's defaults has the same scheduled HLO and the same buffers.
    A flag the user set in XLA_FLAGS is left to them."""
    import jax

    from jaxdist.inspect.step_report import device_peak
    from jaxdist.plan import gpu_target

    config = load_config(None, [*TINY, *STRUCTURE, "model.n_layers=3"])
    resolve_vocab(config)
    hardware = target_hardware("h100")
    with gpu_target.target_capability(hardware.device["compute_capability"]):
        trainer = gpu_target.build_trainer(config, parse_mesh("data=8"), gpu_target.target_devices(hardware, 8, 8))
        lowered = trainer.train_step.lower(trainer.abstract_state(), trainer.abstract_batch(config.train.global_batch))
    defaults = lowered.compile(gpu_target.compiler_options(config))
    program = _instructions(defaults.as_text())
    assert len(program) > 500 and program == _instructions(tiny_h100[1])
    assert device_peak(defaults) == tiny_h100[0]["memory_per_device_bytes"]["peak"]
    assert jax.default_backend() == "cpu"  # nothing here ran on a GPU


def _instructions(hlo: str) -> list[str]:
    """The program's computations and instructions, without source locations (which differ by call site)."""
    kept, in_table = [], False
    for line in hlo.splitlines():
        in_table = line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames") or (in_table and line != "")
        if not in_table:
            kept.append(re.sub(r", metadata=\{[^}]*\}", "", line))
    return kept


def test_a_codegen_flag_the_user_sets_is_theirs(monkeypatch, tmp_path):
    from jaxdist.plan.gpu_target import DEVICELESS_CODEGEN, KERNEL_CACHE_OPTION, deviceless_codegen_options

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert deviceless_codegen_options() == {**DEVICELESS_CODEGEN, KERNEL_CACHE_OPTION: str(_kernel_cache(tmp_path))}
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_gpu_disable_gpuasm_optimizations=false")
    assert deviceless_codegen_options() == {"xla_llvm_disable_expensive_passes": True, KERNEL_CACHE_OPTION: str(_kernel_cache(tmp_path))}
    monkeypatch.setenv("XLA_FLAGS", f"--{KERNEL_CACHE_OPTION}={tmp_path / 'mine.pb'}")
    assert KERNEL_CACHE_OPTION not in deviceless_codegen_options()


def _kernel_cache(tmp: Path) -> Path:
    import os

    import jaxlib

    return tmp / f"jaxdist-gpu-kernels-{os.getuid()}" / f"kernels-jaxlib-{jaxlib.__version__}.pb"


def test_target_compiles_keep_their_kernels_in_a_private_file_and_start_it_again_when_it_is_unreadable(monkeypatch, tmp_path, capsys):
    """The kernels XLA generated for one target compile are kept in a file of this user's for the
    next (``gpu_target.kernel_cache_file``); a file cut short is said in one line and replaced."""
    import os
    import stat

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    cache = _kernel_cache(tmp_path)
    _compile(("model.n_layers=2",), mesh="fsdp=8")
    assert cache.stat().st_size > 0 and stat.S_IMODE(cache.parent.stat().st_mode) == 0o700 and cache.parent.stat().st_uid == os.getuid()
    cache.write_bytes(cache.read_bytes()[:1000])  # cut short
    capsys.readouterr()
    report, _ = _compile(("model.n_layers=2",), mesh="data=4,fsdp=2")
    said = [x for x in capsys.readouterr().err.splitlines() if "kernel cache" in x]
    assert said == [
        f"jaxdist: warning: the GPU kernel cache {cache} is not a whole cache file (cut short or overwritten); starting it again"
    ], said
    assert report["fits"] and cache.stat().st_size > 1000  # compiled, and the file written anew


@pytest.mark.heavy
def test_the_h100_program_has_cudnn_attention_in_every_layer_and_async_gradient_reductions(tiny_h100):
    report, hlo = tiny_h100
    assert report["target"]["compute_capability"] == "9.0" and report["platform"] == "gpu"
    kernels = report["kernels"]
    assert kernels == kernel_counts(hlo)
    # 3 layers on packed documents (the stdlib corpus): one cuDNN forward and one backward each
    assert kernels["attention_cudnn_fwd"] == 3 and kernels["attention_cudnn_bwd"] == 3, kernels
    assert kernels["gemm"] > 0 and kernels["other_fusion"] > 0
    reduce = report["collectives"]["all-reduce"]
    assert reduce["count"] > 0 and reduce["async"] == reduce["count"] and reduce["overlapped_fraction"] > 0
    assert report["memory_per_device_bytes"]["peak"] > 0 and report["fits"]
    assert "xla_gpu_enable_latency_hiding_scheduler" in report["xla_flags"]
    # exposure: the planner's replay of the same program says the same step and waits, split by kind
    predicted = predict(
        gpu_program_cost(hlo, report["mesh"]), target_hardware("h100"), report["mesh"], model_flops_per_step=1, tokens_per_step=1
    )
    kinds = {kind: s["exposed_s"] for kind, s in report["collectives"].items()}
    assert report["step_s"] == pytest.approx(predicted.step_time_s) and report["step_s"] > 0
    assert report["exposed_s"] == pytest.approx(predicted.step_time_s - predicted.compute_s) == pytest.approx(sum(kinds.values()))
    assert report["exposed_fraction"] == pytest.approx(report["exposed_s"] / report["step_s"]) and 0 <= report["exposed_fraction"] < 1
    assert all(seconds == 0 for kind, seconds in kinds.items() if not report["collectives"][kind]["count"])


def test_kernel_and_overlap_reading_on_a_hand_written_schedule():
    """The reader against HLO written here: a loop of 4 runs a cuBLAS gemm and a collective whose
    window holds the gemm (overlapped), and a synchronous one with nothing in its window."""
    hlo = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {
  %p = (s32[], f32[64,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[64,64]{1,0} get-tuple-element(%p), index=1
  %ars = f32[64,64]{1,0} all-reduce-start(%x), replica_groups={{0,1}}, to_apply=%add, backend_config={"collective_backend_config":{"is_sync":false}}
  %g = f32[64,64]{1,0} custom-call(%x, %x), custom_call_target="__cublas$gemm"
  %ard = f32[64,64]{1,0} all-reduce-done(%ars)
  %s2 = f32[64,64]{1,0} all-reduce-start(%g), replica_groups={{0,1}}, to_apply=%add, backend_config={"collective_backend_config":{"is_sync":true}}
  %d2 = f32[64,64]{1,0} all-reduce-done(%s2)
  ROOT %t = (s32[], f32[64,64]) tuple(%i, %d2)
}

%cond (q: (s32[], f32[64,64])) -> pred[] {
  %q = (s32[], f32[64,64]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x0: f32[64,64]) -> (s32[], f32[64,64]) {
  %x0 = f32[64,64]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[64,64]) tuple(%zero, %x0)
  ROOT %w = (s32[], f32[64,64]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""
    kernels = kernel_counts(hlo)
    assert kernels["gemm"] == 4 and kernels["collective"] == 8, kernels
    reduce = collective_schedule(hlo)["all-reduce"]
    assert reduce["count"] == 8 and reduce["async"] == 4 and reduce["overlapped_fraction"] == 0.5, reduce


@pytest.mark.heavy
def test_analyze_target_cli_prints_the_report_and_writes_the_hlo(tmp_path, capsys):
    hlo = tmp_path / "step.hlo"
    argv = ["--target", "h100", "--mesh", "data=2", "--gpus", "2", *TINY, *STRUCTURE, "--json", "--hlo-out", str(hlo)]
    assert analyze.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["target"]["name"] == "h100" and report["devices"] == 2 and set(report["kernels"]) >= {"gemm", "gemm_fp8", "grouped_gemm"}
    assert hlo.read_text().startswith("HloModule") and "__cudnn$fmha" in hlo.read_text()
    assert analyze.main(argv[: argv.index("--json")]) == 0  # the table says the same
    table = capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3 (compute capability 9.0), 1 host(s) of 2" in table
    assert f"attention_cudnn_fwd {report['kernels']['attention_cudnn_fwd']}" in table and "fits            yes" in table
    exposed = f"exposed         {report['exposed_s'] * 1e3:.1f} ms of a {report['step_s'] * 1e3:.1f} ms step predicted"
    assert exposed in table, table


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--target", "v100"], "unknown GPU target 'v100'"),
        (["--target", "h100", "--mesh", "data=4", "--gpus", "8"], "mesh of 4 devices on 8 target GPUs"),
        (["--mesh", "data=2", "--gpus", "2"], "--gpus needs --target"),
        (["--target", "h100", "--gpus", "0"], "--gpus 0: the run needs at least one GPU"),  # not the default's 8
        (["--target", "h100", "--gpus", "-4"], "--gpus -4: the run needs at least one GPU"),
    ],
)
def test_analyze_target_bad_input_is_one_line(argv, expected, capsys):
    assert analyze.main([*argv, *TINY]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jaxdist")]
    assert len(err) == 1 and expected in err[0], err


def test_without_the_plugin_analyze_target_says_how_to_install_it(monkeypatch, capsys):
    import jaxdist.layout.devices as devices

    monkeypatch.setattr(devices, "cuda_plugin_installed", lambda: False)
    assert analyze.main(["--target", "h100", *TINY]) == 2
    assert "needs JAX's CUDA plugin: pip install" in capsys.readouterr().err


def test_a_plugin_built_for_another_jaxlib_is_one_line(monkeypatch, capsys):
    import importlib.metadata

    installed = importlib.metadata.version
    assert installed("jax-cuda12-plugin") == installed("jaxlib")  # what pip install -e ".[dev]" resolves (jax's pin)
    monkeypatch.setattr(importlib.metadata, "version", lambda p: "9.9.9" if p == "jax-cuda12-plugin" else installed(p))
    assert analyze.main(["--target", "h100", *TINY]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [
        f"jaxdist: error: jax-cuda12-plugin 9.9.9 is not built for jaxlib {installed('jaxlib')}: "
        f'pip install "jax-cuda12-plugin=={installed("jaxlib")}" (or pip install -e ".[dev]")'
    ], err


@pytest.mark.heavy
def test_a_machine_with_the_plugin_and_no_gpu_trains_on_fake_cpu_devices(tmp_path):
    """The plugin alone no longer switches jaxdist to its GPU defaults: without a GPU the run
    says so in one line and trains on fake CPU devices (JAX_PLATFORMS left unset, as a user has it)."""
    env = {k: v for k, v in subprocess_env().items() if k != "JAX_PLATFORMS"}
    cmd = [sys.executable, "-m", "jaxdist.train", "--mesh", "data=2", "--steps", "1", "--run-dir", str(tmp_path / "run"), *TINY]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the CUDA plugin is installed but found no GPU" in proc.stderr
    assert "using 2 fake CPU devices" in proc.stderr and "(2 cpu)" in proc.stderr
    assert "cuda" not in proc.stderr.replace("the CUDA plugin", "").lower(), proc.stderr  # the plugin's driver probes stay quiet


@pytest.mark.heavy
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_stages_run_cudnn_attention(schedule):
    """Inside a pipeline stage (a region manual over 'pipe' only) JAX 0.10's cuDNN partitioning rule
    failed ('GSPMDSharding' object has no attribute 'spec'); the call now runs manual over the other
    axes too. A stage executes M + S - 1 = 3 chunk steps (masked ones included), each a forward and a
    backward of its 2 layers: 6 cuDNN calls each way, for either schedule."""
    report, _ = _compile(("model.n_layers=4", f"parallel.schedule={schedule}"), mesh="data=2,pipe=2", gpus=4)
    steps, layers_per_stage = 2 + 2 - 1, 4 // 2
    assert report["pipeline"]["chunk_steps"] == steps
    assert report["kernels"]["attention_cudnn_fwd"] == report["kernels"]["attention_cudnn_bwd"] == layers_per_stage * steps, report[
        "kernels"
    ]


def test_a_program_that_does_not_fit_says_so_in_one_line_when_run_as_a_module(tmp_path):
    """``python -m jaxdist.analyze`` (the module is ``__main__`` then): the line that a program
    does not fit reaches stderr, with the amount (it went to a logger outside jaxdist's)."""
    import subprocess
    import sys

    from helpers import subprocess_env

    env = {**subprocess_env(), "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.00001", "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "jaxdist.analyze", "--target", "h100", "--mesh", "data=2", "--gpus", "2", *TINY, *STRUCTURE, "--json"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "does not fit" in line]
    assert len(lines) == 1 and "does not fit H100" in lines[0] and "GiB" in lines[0], proc.stderr[-2000:]
    assert json.loads(proc.stdout)["fits"] is False


_CACHED_COMPILE = """
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
from jaxdist.plan.gpu_target import compile_for_target, prepare_target, target_hardware
prepare_target()
from jaxdist.config import load_config
from jaxdist.data.sources import resolve_vocab
from jaxdist.inspect.gpu_program import kernel_counts
from jaxdist.layout.mesh import parse_mesh
from jaxdist.training.compile_cache import enable_compile_cache
config = load_config(None, sys.argv[2:] + ["train.compile_cache=" + sys.argv[1]])
resolve_vocab(config)
enable_compile_cache(config, None)
_, compiled, _ = compile_for_target(config, parse_mesh("fsdp=2"), target_hardware("h100"), 2, 8)
print(kernel_counts(compiled.as_text()).get("attention_cudnn_fwd", 0))
"""


@pytest.mark.heavy
def test_a_second_process_finds_the_gpu_step_with_cudnn_attention_in_the_compile_cache(tmp_path):
    """cuDNN attention is a JAX ``custom_partitioning`` op whose program text holds a Python
    object's address (jax-ml/jax#21159): each process keyed the same step differently, so a
    restarted run or a replacement process compiled it again. With jaxdist's compile cache a
    second process compiling the same H100 step adds no entry (both of its compiles were hits); a
    different model configuration gets a folder of its own."""
    cache = tmp_path / "cache"
    env = without_session_cache(subprocess_env())

    def compile_once(*overrides: str) -> int:
        argv = [sys.executable, "-c", _CACHED_COMPILE, str(cache), *TINY, "model.dtype=bfloat16", *overrides]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return int(proc.stdout.split()[-1])

    assert compile_once() > 0  # the program has cuDNN attention: the op that made keys differ
    (family,) = cache.iterdir()
    entries = sorted(p.name for p in family.iterdir() if p.name.startswith("jit__train_step"))
    # the step on XLA's own estimates, and on the planner's (train.latency_profile=model): the
    # profile is named by its content, so the second process's key is the first's
    assert len(entries) == 2, entries
    assert compile_once() > 0
    assert sorted(p.name for p in family.iterdir() if p.name.startswith("jit__train_step")) == entries
    compile_once("model.n_layers=3")
    assert len(list(cache.iterdir())) == 2
