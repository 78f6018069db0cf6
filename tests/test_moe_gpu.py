"""MoE's grouped matmuls on a GPU: jaxdist's Pallas Triton grouped GEMM (``models.grouped_gemm``).

XLA:GPU (jaxlib 0.10.2) expands ``jax.lax.ragged_dot`` densely (rows x local experts), so on a
GPU the experts run jaxdist's own grouped GEMM kernels, forward and both gradients. Here: the
kernels (through Pallas' interpreter, on CPU) against a loop over groups and, inside the
experts, against the dense loop of ``tests/test_moe.py``; then the real train step compiled for
an H100 (compile-only, no GPU needed): each MoE layer's two projections run as grouped GEMMs
forward, for the input gradient and for the weight gradient, with JAX's Pallas/Triton
ragged_dot flag off and on, no [rows, local experts, ...] array is left, and the planner prices
the kernels' FLOPs.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_moe import EP_MESHES, _kernel, assert_matches_dense_loop, nan_sentinels  # noqa: F401 - the fixture

from jaxdist.models import experts as experts_lib

B, T, D = 8, 4, 8  # test_moe's shapes


def _loop_over_groups(x, w, sizes, dy):
    """(out, dx, dw) in numpy float64, one group at a time; rows past the groups: 0."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    out, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros(x.shape), np.zeros(w.shape)
    start = 0
    for g, size in enumerate(np.asarray(sizes)):
        rows = slice(start, start + size)
        out[rows] = x[rows] @ w[g]
        dx[rows] = dy[rows] @ w[g].T
        dw[g] = x[rows].T @ dy[rows]
        start += size
    return out, dx, dw


@pytest.mark.heavy
def test_the_grouped_gemm_and_its_gradients_match_a_loop_over_groups():
    """300 rows in 5 groups (one empty, one of a single row; 3 row tiles, so tiles straddle
    groups) and 39 rows past the groups holding NaN: those come out 0 with a 0 input gradient
    and never reach a weight gradient. K and N are not multiples of the blocks."""
    from jaxdist.models.grouped_gemm import grouped_matmul

    rng = np.random.default_rng(0)
    sizes = jnp.asarray([70, 0, 130, 1, 60], jnp.int32)
    m, k, n = 300, 24, 40
    x = rng.normal(size=(m, k)).astype(np.float32)
    x[int(sizes.sum()) :] = np.nan
    w = rng.normal(size=(len(sizes), k, n)).astype(np.float32)
    dy = rng.normal(size=(m, n)).astype(np.float32)
    out, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, sizes, True), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(dy))
    want = _loop_over_groups(np.nan_to_num(x), w, sizes, dy)
    assert out.dtype == jnp.float32 and dx.dtype == jnp.float32 and dw.dtype == jnp.float32
    for name, got, expected in zip(("output", "input gradient", "weight gradient"), (out, dx, dw), want, strict=True):
        assert np.all(np.isfinite(got)), name
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4, err_msg=name)
    assert not np.any(np.asarray(out)[int(sizes.sum()) :]) and not np.any(np.asarray(dx)[int(sizes.sum()) :])
    assert not np.any(np.asarray(dw)[1])  # the empty group's weight gradient


@pytest.mark.heavy
@pytest.mark.parametrize(("ep", "routing"), [(1, "empty experts"), (2, "random"), (4, "all to one")])
def test_experts_on_the_grouped_gemm_match_the_dense_loop(ep, routing, nan_sentinels):  # noqa: F811 - the fixture
    """The GPU's expert computation (``expert_compute("gpu")``, here through Pallas' interpreter)
    inside ``parallel.expert`` against test_moe's dense loop over experts: outputs and the
    gradients of the input, the gates and both expert weights, on one device's experts, on
    expert=2 with their width split over tensor=2 and on fsdp=2,expert=4 (the weight gradients
    summed over the axes the weights do not vary over)."""
    assert_matches_dense_loop(_kernel(EP_MESHES[ep], compute=experts_lib.expert_compute("gpu", interpret=True)), routing)


def test_the_kernel_choice_and_the_one_line_where_experts_run_densely(monkeypatch):
    """A GPU takes the grouped GEMM and says nothing; ``JAXDIST_MOE_KERNEL=ragged_dot`` keeps
    ragged_dot there and says in one line that XLA:GPU expands it; CPU keeps ragged_dot and its note."""
    monkeypatch.delenv(experts_lib.KERNEL_ENV, raising=False)
    assert experts_lib.kernel_choice("gpu") == "grouped_gemm" and experts_lib.kernel_note("gpu", 4) is None
    assert experts_lib.kernel_choice("cpu") == "ragged_dot" and experts_lib.kernel_choice("tpu") == "ragged_dot"
    assert experts_lib.kernel_note("cpu", 4).startswith("MoE on CPU: jax.lax.ragged_dot runs as a dense expansion")
    assert experts_lib.expert_compute("cpu") is experts_lib.swiglu_groups
    monkeypatch.setenv(experts_lib.KERNEL_ENV, "ragged_dot")
    note = experts_lib.kernel_note("gpu", 4)
    assert experts_lib.kernel_choice("gpu") == "ragged_dot" and "\n" not in note
    assert "XLA:GPU expands jax.lax.ragged_dot densely" in note and "4x the expert FLOPs" in note
    monkeypatch.setenv(experts_lib.KERNEL_ENV, "triton")
    with pytest.raises(ValueError, match="grouped_gemm or ragged_dot"):
        experts_lib.kernel_choice("gpu")


# --- the H100 program (compile-only; needs JAX's CUDA plugin) ---------------------------------

LAYERS, EXPERTS, TOP_K, WIDTH, DIM, BATCH, SEQ = 2, 12, 2, 48, 64, 16, 32
MOE = (
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.dtype=bfloat16",
    f"model.moe_experts={EXPERTS}",
    f"model.moe_top_k={TOP_K}",
    f"model.moe_mlp_dim={WIDTH}",
    f"train.global_batch={BATCH}",
    f"train.seq_len={SEQ}",
    "data.source=synthetic",
    "train.latency_profile=off",  # XLA's own schedule: the GEMMs are the point
)


def _h100_program(mesh: str, remat: str, pallas_flag: bool) -> str:
    pytest.importorskip("jax_plugins.xla_cuda12", reason="JAX's CUDA plugin is not installed (pip install -e '.[dev]')")
    from jaxdist.config import load_config
    from jaxdist.layout.mesh import mesh_device_count, parse_mesh
    from jaxdist.plan.gpu_target import compile_for_target, target_hardware

    config = load_config(None, [*MOE, f"model.remat={remat}"])
    sizes = parse_mesh(mesh)
    saved = jax.config.jax_ragged_dot_use_gpu_pallas_triton_lowering
    jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", pallas_flag)
    try:
        _, compiled, _ = compile_for_target(config, sizes, target_hardware("h100"), mesh_device_count(sizes), 8)
    finally:
        jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", saved)
    return compiled.as_text()


def _grouped_gemm_calls(hlo: str) -> tuple[dict[str, int], float]:
    """Per step (loop trip counts multiplied in): how often each named Triton call runs, and the
    FLOPs the planner prices the grouped GEMM calls at (``plan.gpu_cost.kernel_work``)."""
    from jaxdist.inspect.hlo import computation_multipliers, parse_hlo
    from jaxdist.plan.gpu_cost import kernel_work

    module = parse_hlo(hlo)
    multipliers = computation_multipliers(module)
    counts: dict[str, int] = {}
    flops = 0.0
    for name, body in module.computations.items():
        for i in body:
            if i.opcode == "custom-call" and "__gpu$xla.gpu.triton" in i.attributes:
                kernel = re.findall(r'\bname = "([^"]*)"', i.attributes)[-1]
                counts[kernel] = counts.get(kernel, 0) + multipliers.get(name, 0)
                if kernel.startswith("jaxdist_grouped_gemm"):
                    flops += multipliers.get(name, 0) * kernel_work(i, "grouped_gemm", module)[0]
    return counts, flops


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("mesh", "remat", "pallas_flag"),
    [("data=8", "none", False), ("data=2,expert=4", "full", True)],
    ids=["data8-flag-off", "data2-expert4-remat-flag-on"],
)
def test_the_h100_step_runs_every_moe_projection_as_grouped_gemms(mesh, remat, pallas_flag):
    """Per MoE layer and projection (gate/up, down): a grouped GEMM forward (twice with full
    remat), one for the input gradient and one for the weight gradient, whatever JAX's
    ``jax_ragged_dot_use_gpu_pallas_triton_lowering`` says (set, it fails to import its lowering in
    jax 0.10.2: jaxdist does not go through ragged_dot on a GPU). No ragged_dot is left, as a dot
    or expanded: no array has both the rows the experts receive and the local experts among its
    dimensions. ``analyze``'s kernel count and the planner's FLOPs read the same kernels."""
    from jaxdist.inspect.gpu_program import kernel_counts
    from jaxdist.layout.mesh import parse_mesh

    hlo = _h100_program(mesh, remat, pallas_flag)
    sizes = parse_mesh(mesh)
    ep = sizes.get("expert", 1)
    local, forwards = EXPERTS // ep, 1 + (remat != "none")
    tokens = BATCH * SEQ // math.prod(sizes.values())  # per device: the batch splits over data and expert
    rows = ep * tokens * min(TOP_K, local)  # what the experts receive: the worst-case buffer (tokens x k without an expert axis)
    expected = {"fwd": LAYERS * 2 * forwards, "dx": LAYERS * 2, "dw": LAYERS * 2}
    counts, flops = _grouped_gemm_calls(hlo)
    assert {k.removeprefix("jaxdist_grouped_gemm_"): v for k, v in counts.items() if "grouped_gemm" in k} == expected, counts
    assert kernel_counts(hlo)["grouped_gemm"] == sum(expected.values())

    assert "ragged_dot_general" not in hlo and " ragged-dot(" not in hlo
    expanded = {
        shape
        for shape, dims in re.findall(r"\b([a-z0-9]+\[([0-9,]+)\])", hlo)
        if len(dims.split(",")) >= 3 and {str(rows), str(local)} <= set(dims.split(","))
    }
    assert not expanded, sorted(expanded)

    # each call: 2 x rows x the group's matrix, gate/up d x 2f and down f x d
    assert flops == LAYERS * (forwards + 2) * 2 * rows * (DIM * 2 * WIDTH + WIDTH * DIM)
