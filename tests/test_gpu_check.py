"""experiments/gpu_check.py: without a GPU it says so in one line and exits 0; its HLO reading;
``--compile-only`` runs its structural checks against programs compiled for an H100 target."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import subprocess_env

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "gpu_check.py"


def test_without_a_gpu_it_prints_one_line_and_exits_0():
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["gpu_check: no GPU visible to JAX (nothing to check here); run it where a GPU is lent"]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_grouped_matmul_lowering_is_read_from_the_compiled_program():
    read = _module().grouped_matmul_lowering
    kept = "%r = bf16[64,32]{1,0} ragged-dot(bf16[64,16]{1,0} %a, bf16[4,16,32]{2,1,0} %b, s32[4]{0} %g), lhs_contracting_dims={1}"
    triton = '%t = bf16[64,32]{1,0} custom-call(%a, %b), custom_call_target="__gpu$xla.gpu.triton", backend_config={}'
    dense = "%d = bf16[4,64,32]{2,1,0} dot(bf16[4,64,16]{2,1,0} %a, bf16[4,16,32]{2,1,0} %b), lhs_batch_dims={0}"
    assert read(kept) == "grouped (1 ragged-dot ops)"
    assert read(triton) == "Triton kernels (1 custom calls)"
    assert read(dense).startswith("dense expansion")


# A 2-layer stand-in for the 1B model (every layer in fp8 for the fp8 rows): the checks, not the size.
SMALL = (
    "model.d_model=256",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "train.seq_len=256",
    "train.global_batch=2",
    "model.fp8_keep_ends=false",
    "train.latency_profile=off",  # XLA's own schedule: structural checks at half the compiles
)
DEVICE_ONLY = {"bf16 packed", "bf16 synthetic", "fp8 current", "fp8 delayed", "profile report bound (bf16 packed)"}
KERNELS = re.compile(r"(\d+) gemm, (\d+) fp8 gemm, (\d+)/(\d+) cuDNN attn")


@pytest.mark.heavy
def test_compile_only_runs_every_structural_check_against_h100_programs_and_skips_what_needs_a_device(tmp_path, capsys):
    """``--compile-only`` on this GPU-less host: each row's program compiled for an H100 target and
    read (kernels, fp8 GEMMs, memory, the MoE lowering, the ring's overlap, the planner's
    prediction); each measurement that needs a device is one 'skipped' row saying so."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="JAX's CUDA plugin is not installed (pip install -e '.[dev]')")
    out = tmp_path / "rows.json"
    assert _module().main(["--compile-only", "--json", str(out), *SMALL]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("gpu_check --compile-only: H100 SXM 80GB (h100)") and "no device" in header, header
    rows = json.loads(out.read_text())["rows"]
    by_check = {r["check"].strip(): r for r in rows}
    assert len(by_check) == len(rows)  # one row per check
    assert not [r for r in rows if r["value"] == "failed"], [r for r in rows if r["value"] == "failed"]
    skipped = {r["check"] for r in rows if r["value"] == "skipped"}
    assert skipped == DEVICE_ONLY and all(by_check[c]["how"].startswith("needs a device to measure: ") for c in skipped)

    kernels = {
        name: tuple(map(int, KERNELS.fullmatch(by_check[f"{name}: kernels per step"]["value"]).groups()))
        for name in DEVICE_ONLY - {"profile report bound (bf16 packed)"}
    }
    for name, (gemm, fp8, attention_fwd, attention_bwd) in kernels.items():
        assert (attention_fwd, attention_bwd) == (2, 2), (name, kernels)  # cuDNN flash attention in each of the 2 layers
        if name.startswith("bf16"):
            assert gemm > 0 and fp8 == 0, (name, kernels)
        else:  # every projection of both layers in fp8: forward + two backward GEMMs each
            assert fp8 > 0 and fp8 % (3 * 2) == 0, (name, kernels)
            assert by_check[f"{name}: fp8 GEMMs in the step"]["value"].startswith(f"{fp8} (")
    assert all(by_check[f"{name}: peak memory"]["value"].endswith("GiB (fits)") for name in kernels)
    assert by_check["attention path (bf16 packed)"]["value"] == "cudnn" and by_check["attention path (bf16 synthetic)"]["value"] == "cudnn"
    assert re.fullmatch(r"[\d.]+ / [\d.]+ / [\d.]+ GiB", by_check["planned memory: bf16 / fp8 current / fp8 delayed"]["value"])
    assert re.fullmatch(r"[\d.]+ / [\d.]+ GiB \([\d.]+x\)", by_check["planned memory: whole loss / loss_chunk=512"]["value"])
    assert re.fullmatch(r"[\d.e-]+ s predicted", by_check["planner step time vs measured (bf16 synthetic)"]["value"])
    assert by_check["MoE grouped matmul lowering (moe-tiny)"]["value"].startswith(("grouped (", "Triton kernels (", "dense expansion"))
    ring = re.fullmatch(r"(\d+)/(\d+) pairs overlapped", by_check["context ring overlap (context=2, ring)"]["value"])
    assert ring and 0 < int(ring.group(1)) <= int(ring.group(2)), by_check["context ring overlap (context=2, ring)"]
