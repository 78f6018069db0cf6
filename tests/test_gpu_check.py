"""experiments/gpu_check.py: without a GPU it says so in one line and exits 0; its HLO reading."""

import importlib.util
import subprocess
import sys
from pathlib import Path

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
