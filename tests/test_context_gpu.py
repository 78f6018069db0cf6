"""Long-sequence attention in GPU programs, compiled for a target on this CPU host
(``analyze --target``; nothing runs, no GPU or driver needed): the ring's transfers overlap its
block computes on an H100, the context axis runs the blockwise XLA kernel and says so (but
all_to_all, whose devices attend whole sequences with cuDNN between its all-to-alls), and cuDNN
flash attention on packed documents is in every layer on Hopper, per device's own rows, while an
A100 falls back (auto) or refuses (explicit cudnn) in one line.

Needs JAX's CUDA plugin (the ``dev`` extra installs it); without it these tests skip with that one
reason.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="JAX's CUDA plugin is not installed (pip install -e '.[dev]')")

from jaxdist import analyze  # noqa: E402
from jaxdist.inspect.gpu_program import collective_schedule  # noqa: E402
from jaxdist.parallel.blockwise import BLOCK_SCOPE  # noqa: E402
from jaxdist.parallel.context import ring_overlap_in_hlo  # noqa: E402

LAYERS = 2
SMALL = ("model.d_model=256", f"model.n_layers={LAYERS}", "model.dtype=bfloat16", "train.seq_len=1024", "train.latency_profile=off")
_CUDNN_CALL_RE = re.compile(r'custom_call_target="(__cudnn\$fmha\w*)", operand_layout_constraints=\{(.*?)\}, api_version')
_SHAPE_RE = re.compile(r"(\w+)\[([\d,]*)\]")


def _target(tmp_path, capsys, target: str, mesh: str, gpus: int, *overrides: str) -> tuple[dict, str, list[str]]:
    """(report, optimized HLO, the run's ``jaxdist:`` lines on stderr) of ``analyze --target``."""
    hlo = tmp_path / "step.hlo"
    argv = ["--target", target, "--mesh", mesh, "--gpus", str(gpus), *SMALL, *overrides, "--json", "--hlo-out", str(hlo)]
    code = analyze.main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("jaxdist")]
    assert code == 0, lines
    return json.loads(out), hlo.read_text(), lines


@pytest.mark.heavy
def test_the_ring_on_h100_overlaps_its_permutes_with_the_block_computes_and_runs_the_blockwise_kernel(tmp_path, capsys):
    """context=4, 2 layers, 1,024 tokens: every collective-permute is asynchronous with compute in
    its window, and all but at most one per layer (the backward's first K/V transfer, issued before
    its ring: it may hide behind the layer's other backward work instead) have an attention block
    inside. Before the double-buffered ring XLA chained the transfers ahead of the blocks: 18 of 23
    async, 10 with a block inside, 5 synchronous."""
    report, hlo, lines = _target(tmp_path, capsys, "h100", "context=4", 4, "train.global_batch=4", "parallel.context_strategy=ring")
    permute = report["collectives"]["collective-permute"]
    assert permute["count"] > 0 and permute["async"] == permute["count"], permute
    assert permute["overlapped_fraction"] == 1.0, permute
    assert collective_schedule(hlo, report["mesh"])["collective-permute"]["async"] == permute["count"]
    ring = ring_overlap_in_hlo(hlo, report["mesh"])
    assert ring["over_context"] == ring["collective_permutes"] == permute["count"], ring
    assert ring["synchronous"] == 0 and ring["async_pairs"] == ring["collective_permutes"], ring
    assert ring["overlapped_pairs"] >= ring["async_pairs"] - LAYERS, ring
    # The per-block kernel on a GPU is the blockwise XLA one (loops named by its scope), never cuDNN's,
    # and the run says so, naming what auto would have picked.
    assert report["kernels"]["attention_cudnn_fwd"] == report["kernels"]["attention_cudnn_bwd"] == 0
    assert BLOCK_SCOPE in hlo and "__cudnn$fmha" not in hlo
    [note] = [line for line in lines if "context attention:" in line]
    assert "ring over context=4, per-block kernel xla (tiles of 128x128 tokens" in note, note
    assert "the cudnn attention model.attention=auto picks on these devices is not used here" in note, note


def _cudnn_calls(hlo: str) -> list[tuple[str, list[tuple[str, list[int]]]]]:
    """(target, operand shapes) of every cuDNN attention custom call."""
    calls = []
    for target, shapes in _CUDNN_CALL_RE.findall(hlo):
        calls.append((target, [(dtype, [int(d) for d in dims.split(",") if d]) for dtype, dims in _SHAPE_RE.findall(shapes)]))
    return calls


@pytest.mark.heavy
def test_cudnn_on_packed_documents_on_h100_runs_in_every_layer_on_each_devices_own_rows(tmp_path, capsys):
    """data=2, full remat, the packed default corpus: one cuDNN forward per layer and one more in the
    recomputed forward, one backward per layer; and each call's sequence lengths and offsets
    (the int32 operands) have the device's own rows, as q does. Before, the offsets were built by a
    scatter the partitioner left whole: every device's call got all 4 rows' documents for its 2."""
    report, hlo, lines = _target(tmp_path, capsys, "h100", "data=2", 2, "train.global_batch=4", "model.remat=full")
    assert report["kernels"]["attention_cudnn_fwd"] == 2 * LAYERS and report["kernels"]["attention_cudnn_bwd"] == LAYERS, report["kernels"]
    assert not [line for line in lines if "attention:" in line], lines  # no fallback
    calls = _cudnn_calls(hlo)
    assert {target for target, _ in calls} == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
    for target, shapes in calls:
        q_rows = shapes[0][1][0]
        packing = [dims for dtype, dims in shapes if dtype == "s32"]
        assert q_rows == 2 and len(packing) == 4 and all(dims[0] == q_rows for dims in packing), (target, shapes)


@pytest.mark.heavy
def test_all_to_all_on_h100_runs_cudnn_on_whole_sequences_between_all_to_alls_over_context(tmp_path, capsys):
    """Ulysses on context=4 (8 heads, 4 kv heads, packed documents): every layer's cuDNN flash
    attention, forward and backward, sees the whole 1,024-token sequence of its 2 query heads (kv
    heads repeated to them for cuDNN's packing), no blockwise XLA tiles run, and the step's
    all-to-alls (q, k, v and the output, forward and backward: 4 per layer) span context alone."""
    report, hlo, lines = _target(tmp_path, capsys, "h100", "context=4", 4, "train.global_batch=4", "parallel.context_strategy=all_to_all")
    assert report["kernels"]["attention_cudnn_fwd"] == report["kernels"]["attention_cudnn_bwd"] == LAYERS, report["kernels"]
    assert "__cudnn$fmha" in hlo and BLOCK_SCOPE not in hlo
    for target, shapes in _cudnn_calls(hlo):
        assert [dims for dtype, dims in shapes if dtype == "bf16"][:3] == [[4, 1024, 2, 32]] * 3, (target, shapes)
    a2a = report["collectives"]["all-to-all"]
    assert a2a["count"] == 4 * LAYERS and report["collectives_by_axes"]["context"]["kinds"]["all-to-all"]["count"] == a2a["count"]
    assert a2a["async"] == a2a["count"], a2a
    assert report["collectives"]["collective-permute"]["count"] == 0
    [note] = [line for line in lines if "context attention:" in line]
    assert "all_to_all over context=4" in note and "kernel cudnn (model.attention=auto picks it" in note, note


@pytest.mark.heavy
def test_auto_on_a100_with_packed_documents_falls_back_to_xla_in_one_line(tmp_path, capsys):
    """Sequence packing needs Hopper: auto takes XLA's attention on an A100 and says why and which kernel runs."""
    report, hlo, lines = _target(tmp_path, capsys, "a100", "data=2", 2, "train.global_batch=2", "model.n_layers=1")
    [note] = [line for line in lines if "attention:" in line]
    assert "needs compute capability >= 9.0, these GPUs are 8.0" in note and "runs XLA's kernel (model.attention=xla)" in note, note
    assert report["kernels"]["attention_cudnn_fwd"] == report["kernels"]["attention_cudnn_bwd"] == 0 and "__cudnn$fmha" not in hlo


def test_explicit_cudnn_on_a100_with_packed_documents_is_refused_in_one_line(capsys):
    argv = ["--target", "a100", "--mesh", "data=2", "--gpus", "2", *SMALL, "train.global_batch=2", "model.attention=cudnn", "--json"]
    assert analyze.main(argv) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert out == "" and len(lines) == 1, lines
    assert lines[0].startswith("jaxdist: error: model.attention=cudnn: cuDNN flash attention on packed documents"), lines
    assert "compute capability >= 9.0 (Hopper), these GPUs are 8.0" in lines[0] and "model.attention=auto" in lines[0], lines
