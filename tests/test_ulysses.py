"""Ulysses (all-to-all) context parallelism, ``parallel.context_strategy=all_to_all``: the kernel
against the unsplit attention (outputs and dq/dk/dv, fp32, with GQA repeats, in order and
load-balanced, its xla tiles and an index-masked kernel), training against one device on the packed
corpus beside data, fsdp and tensor, the one-line error for heads that do not split, the all-to-alls
over context in ``analyze`` (and the planner's model of them), and the planner pricing the third
strategy. The GPU program (cuDNN attention between the all-to-alls) is in tests/test_context_gpu.py."""

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest

from jaxdist import analyze as analyze_cli
from jaxdist.config import load_config
from jaxdist.data.sources import resolve_vocab
from jaxdist.errors import MeshError
from jaxdist.layout.mesh import parse_mesh
from jaxdist.layout.validate import check_config_on_mesh
from jaxdist.models.attention import causal_attention
from jaxdist.parallel.context import reorder, restore_order
from jaxdist.parallel.ulysses import UlyssesAttention, kv_repeats, shard_order, true_order

from helpers import TINY, context_mesh, first_batch_grads, packed_ids, train_losses

A2A = ("parallel.context_strategy=all_to_all",)
TOL = 1e-5

# -- the kernel ------------------------------------------------------------------------------------

B, T, H, KV, D = 4, 48, 8, 2, 8
DOCUMENTS = [[5, 13, 2, 19, 9], [48], [1, 1, 30, 16], [7, 20, 21]]  # crossing the chunk and shard edges
MESHES = {  # (data, context, tensor): what each exercises
    "context4": (1, 4, 1),  # 2 kv heads over 4: each repeated twice
    "context8": (1, 8, 1),  # one query head per device; kv heads repeated 4x
    "data2_context2_tensor2": (2, 2, 2),  # heads over tensor first, then over context
    "context2_tensor4": (1, 2, 4),  # kv heads (2) not divisible by tensor (4): repeated to the query heads first
}


def _inputs(t, h, kv, d, documents, seed=0):
    rng = np.random.default_rng(seed)
    q, cotangent = (rng.normal(size=(len(documents), t, h, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.normal(size=(len(documents), t, kv, d)).astype(np.float32) for _ in range(2))
    return [q, k, v, *packed_ids(documents), cotangent]


def _with_grads(attention):
    """jit: (q, k, v, segment_ids, positions, cotangent) -> (out, dq, dk, dv)."""

    def run(q, k, v, segments, positions, cotangent):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, segments, positions), q, k, v)
        return (out, *vjp(cotangent))

    return jax.jit(run)


def _unsplit(args):
    reference = _with_grads(lambda q, k, v, s, p: causal_attention(q, k, v, s, implementation="xla"))
    return [np.asarray(x) for x in reference(*args)]


def _split(attention: UlyssesAttention, args):
    """The kernel on args in the order it expects, results back in the true order."""
    n = attention.context_size
    if attention.load_balanced:
        args = [reorder(a, n) for a in args]
    results = [np.asarray(x) for x in _with_grads(attention)(*args)]
    return [restore_order(r, n) for r in results] if attention.load_balanced else results


def _assert_close(got, want, what):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert np.isfinite(g).all(), f"{what}: {name} has non-finite values"
        np.testing.assert_allclose(g, w, atol=TOL, rtol=0, err_msg=f"{what}: {name}")


@pytest.fixture(scope="module")
def inputs():
    args = _inputs(T, H, KV, D, DOCUMENTS)
    return args, _unsplit(args)


def test_the_order_functions_undo_the_load_balanced_order():
    """Against parallel.context's own reorder (a gather by its permutation): the gathered shards in
    their true order, and back."""
    x = np.arange(3 * 48 * 2).reshape(3, 48, 2)
    for n in (1, 2, 3, 4, 8):
        np.testing.assert_array_equal(np.asarray(true_order(reorder(x, n), n)), x)
        np.testing.assert_array_equal(np.asarray(shard_order(x, n)), reorder(x, n))
    assert [kv_repeats(8, kv, 4) for kv in (1, 2, 4, 8)] == [4, 2, 1, 1] and kv_repeats(2, 2, 8) == 4


@pytest.mark.parametrize(
    ("mesh_name", "balanced", "tile"),  # tiles of 5: the 48 tokens padded to 50 with masked tokens
    [
        ("context4", True, 8),
        ("context4", False, 8),
        ("context8", True, 5),
        ("data2_context2_tensor2", True, 5),
        ("context2_tensor4", False, 8),
    ],
)
def test_outputs_and_gradients_match_unsplit_attention(inputs, mesh_name, balanced, tile):
    args, want = inputs
    attention = UlyssesAttention(context_mesh(MESHES[mesh_name]), batch_axes=("data",), load_balanced=balanced, block_q=tile, block_kv=tile)
    assert attention.tile_plan(T).padded == (50 if tile == 5 else 48)
    _assert_close(_split(attention, args), want, f"all_to_all on {mesh_name}, load-balanced={balanced}, tiles of {tile}")


def test_an_index_masked_kernel_sees_the_true_order():
    """Pallas's flash attention (interpreted on CPU) builds its mask from array indices: it matches
    the unsplit attention only because the gathered sequence is put back in its true order; told
    the wrong order, the same kernel is far off."""
    args = _inputs(16, 4, 2, 16, [[5, 9, 2], [16]], seed=1)  # Pallas: a power-of-two sequence, head_dim >= 16
    want = _unsplit(args)
    mesh = context_mesh((1, 4, 1))
    right = UlyssesAttention(mesh, implementation="pallas", batch_axes=("data",), load_balanced=True)
    _assert_close(_split(right, args), want, "pallas, load-balanced")
    wrong = UlyssesAttention(mesh, implementation="pallas", batch_axes=("data",), load_balanced=False)
    q, k, v, segments, positions, _ = (reorder(a, 4) for a in args)  # load-balanced arrays, read as if in order
    got = restore_order(np.asarray(jax.jit(wrong)(q, k, v, segments, positions)), 4)
    assert np.abs(got - want[0]).max() > 0.1


def test_bad_shapes_are_one_line_errors(inputs):
    q, k, v, segments, positions, _ = inputs[0]
    mesh = context_mesh((1, 8, 1))
    cases = [
        (lambda: UlyssesAttention(mesh, batch_axes=("data",))(q[:, :, :4], k, v, segments, positions), "heads (4) must be divisible"),
        (lambda: UlyssesAttention(mesh, batch_axes=("data",))(q[:, :40], k[:, :40], v[:, :40], None, positions[:, :40]), "(40)"),
        (lambda: UlyssesAttention(mesh, batch_axes=("fsdp",)), "no axis fsdp"),
        (lambda: UlyssesAttention(mesh, implementation="flash"), "flash"),
    ]
    for make, expected in cases:
        with pytest.raises(ValueError) as error:
            make()
        assert expected in str(error.value) and "\n" not in str(error.value), str(error.value)


# -- training --------------------------------------------------------------------------------------

STEPS = 4


@pytest.fixture(scope="module")
def one_device() -> np.ndarray:
    return np.array(train_losses("data=1", (), STEPS))


@pytest.mark.parametrize(
    ("mesh", "overrides"),
    [
        pytest.param("context=4", A2A, marks=pytest.mark.heavy),
        ("data=2,context=2,tensor=2", A2A),
        pytest.param("fsdp=2,context=2", A2A, marks=pytest.mark.heavy),
        pytest.param("context=4,tensor=2", A2A, marks=pytest.mark.heavy),  # 4 kv heads: 2 per tensor shard, repeated for 4
        pytest.param("context=4", (*A2A, "parallel.context_load_balance=false"), marks=pytest.mark.heavy),
    ],
)
def test_all_to_all_trains_like_one_device(mesh, overrides, one_device):
    """fp32, the default packed corpus (documents cross the shard and chunk edges)."""
    np.testing.assert_allclose(np.array(train_losses(mesh, overrides, STEPS)), one_device, rtol=0, atol=TOL)


@pytest.mark.heavy
def test_the_first_gradients_equal_one_devices():
    _, loss, grads = first_batch_grads("data=2,context=2,tensor=2", *A2A)
    _, want_loss, want = first_batch_grads("data=1")
    assert loss == pytest.approx(want_loss, abs=TOL)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        w = functools.reduce(lambda tree, key: tree[key.key], path, want)
        np.testing.assert_allclose(g, w, atol=TOL, rtol=0, err_msg=jax.tree_util.keystr(path))


def test_heads_that_do_not_split_are_a_one_line_error(capsys):
    """Checked before JAX builds anything; the CLI prints one line and exits 2."""
    config = load_config(None, [*TINY, *A2A, "model.n_heads=4", "model.n_kv_heads=2"])
    with pytest.raises(MeshError, match=r"model\.n_heads \(4\) must be divisible by tensor x context \(2 x 4 = 8\)"):
        check_config_on_mesh(config, parse_mesh("context=4,tensor=2"))
    check_config_on_mesh(config, parse_mesh("context=4"))  # 4 heads over 4: fine
    assert analyze_cli.main(["--mesh", "context=4,tensor=2", *TINY, *A2A, "model.n_heads=4", "model.n_kv_heads=2", "--json"]) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert out == "" and len(lines) == 1 and "parallel.context_strategy=all_to_all" in lines[0], lines
    assert "use parallel.context_strategy=all_gather or ring" in lines[0], lines


def test_the_run_says_which_kernel_each_device_runs(capsys):
    from jaxdist.training.run import build_trainer

    config = load_config(None, [*TINY, *A2A])
    resolve_vocab(config)
    build_trainer(config, parse_mesh("context=4,tensor=2"), jax.devices())
    [line] = [line for line in capsys.readouterr().err.splitlines() if "context attention:" in line]
    assert "all_to_all over context=4 (Ulysses: each device attends the whole 32-token sequence with 1 of 8 query heads" in line
    assert "1 of 4 kv heads (each repeated 2x for the split)), kernel xla (tiles of 32x32 tokens" in line, line


# -- the compiled program and the planner ----------------------------------------------------------

PLAN_TINY = [*TINY[:-2], "train.seq_len=256", "train.global_batch=4"]


@pytest.mark.parametrize(
    ("mesh", "remat"), [("context=4", "none"), pytest.param("data=2,context=2,tensor=2", "full", marks=pytest.mark.heavy)]
)
def test_analyze_shows_the_all_to_alls_over_context_and_the_planner_counts_them(mesh, remat, capsys, tmp_path):
    """python -m jaxdist.analyze --json: attention's collectives run over context alone, all-to-alls
    (q, k, v and the output, and their gradients) beside one all-gather of its ids per forward, no
    K/V gather or permute; their bytes and count are the planner's (``search.context_traffic``)."""
    from jaxdist.plan.hlo_cost import program_cost
    from jaxdist.plan.search import LAYOUT_AXES, Candidate, configured, context_traffic

    overrides = [*PLAN_TINY, *A2A, f"model.remat={remat}"]
    assert analyze_cli.main(["--mesh", mesh, *overrides, "--json", "--hlo-out", str(tmp_path / "step.hlo")]) == 0
    report = json.loads(capsys.readouterr().out)
    a2a = report["collectives"]["all-to-all"]
    assert a2a["count"] > 0 and report["collectives_by_axes"]["context"]["kinds"]["all-to-all"] == {
        k: a2a[k] for k in ("count", "bytes", "wire_bytes")
    }
    cost = program_cost((tmp_path / "step.hlo").read_text(), report["mesh"])
    attention = [op for op in cost.collectives if op.name in cost.attention_collectives]
    assert attention and all(op.axes == ("context",) for op in attention)
    assert {op.kind for op in attention} == {"all-to-all", "all-gather"}, {op.kind for op in attention}
    assert sum(op.executions for op in attention if op.kind == "all-to-all") == a2a["count"]
    sizes = parse_mesh(mesh)
    candidate = Candidate(tuple((a, sizes.get(a, 1)) for a in LAYOUT_AXES), 1, remat, "all_to_all")
    wire, count = sum(op.executions * op.wire_bytes for op in attention), sum(op.executions for op in attention)
    assert (wire, count) == context_traffic(configured(load_config(None, overrides), candidate), candidate)


def test_the_planner_tries_all_to_all_where_the_heads_split_and_prices_it_apart():
    """Every context mesh whose heads split over tensor x context gets all three strategies, the
    others two; the screen prices the three differently: on an H100 (cuDNN keeps the scores on
    chip for whole sequences) all_to_all is the fastest at 4,096 tokens and holds the least, and
    without a fused kernel it still differs from the other two (its exchange, its tiles)."""
    from jaxdist.plan.hardware import load_hardware
    from jaxdist.plan.search import CONTEXT_STRATEGIES, enumerate_candidates, estimated_memory, estimated_time

    config = load_config(None, [*PLAN_TINY, "model.n_heads=4", "model.n_kv_heads=2", "train.seq_len=4096", "model.dtype=bfloat16"])
    strategies: dict[str, set[str]] = {}
    for candidate in enumerate_candidates(config, 8, 8):
        strategies.setdefault(candidate.mesh_spec, set()).add(candidate.context_strategy)
    assert strategies["fsdp=2,context=4"] == strategies["data=2,context=2,tensor=2"] == set(CONTEXT_STRATEGIES)
    assert strategies["context=8"] == strategies["context=4,tensor=2"] == {"all_gather", "ring"}  # 4 heads over 8
    assert CONTEXT_STRATEGIES == ("all_gather", "ring", "all_to_all")
    h100 = load_hardware("h100")
    for hardware in (h100, dataclasses.replace(h100, fused_attention=False)):
        by_strategy = {}
        for strategy in CONTEXT_STRATEGIES:
            candidate = next(
                c for c in enumerate_candidates(config, 8, 8)
                if c.mesh_spec == "fsdp=2,context=4" and c.context_strategy == strategy and c.remat == "none" and c.microbatches == 1
            )  # fmt: skip
            by_strategy[strategy] = (
                estimated_time(config, candidate, 10**6, hardware),
                estimated_memory(config, candidate, 10**6, hardware.fused_attention),
            )
        assert len({t for t, _ in by_strategy.values()}) == 3, by_strategy
        if hardware.fused_attention:
            assert min(by_strategy, key=lambda s: by_strategy[s]) == "all_to_all", by_strategy
            assert by_strategy["all_to_all"][1] < min(m for s, (_, m) in by_strategy.items() if s != "all_to_all"), by_strategy


def test_on_h100_the_screen_takes_all_to_all_where_the_tiled_strategies_lose_the_flash_kernel():
    """Llama 3 8B at 32K tokens on 8 H100: all_gather and ring run XLA's tiles, so a context-free
    layout ranks above them (tests/test_plan.py); all_to_all keeps cuDNN's flash attention on whole
    sequences, and the screen ranks it first. Load balancing does not change its time (each device
    attends every token of the sequence for its heads) where it stretches the ring's."""
    from jaxdist.models.counts import count_params
    from jaxdist.plan.hardware import load_hardware
    from jaxdist.plan.search import enumerate_candidates, estimated_memory, estimated_time

    h100 = load_hardware("h100")
    shapes = ["model.vocab_size=128256", "model.d_model=4096", "model.n_layers=32", "model.n_heads=32", "model.n_kv_heads=8"]
    words = [*shapes, "model.mlp_dim=14336", "model.dtype=bfloat16", "train.seq_len=32768", "train.global_batch=8"]
    config, unbalanced = load_config(None, words), load_config(None, [*words, "parallel.context_load_balance=false"])
    n = count_params(config.model)
    fitting = [c for c in enumerate_candidates(config, 8, 8) if estimated_memory(config, c, n, True) <= 0.9 * h100.memory_bytes]
    best = min(fitting, key=lambda c: estimated_time(config, c, n, h100))
    assert best.sizes["context"] > 1 and best.context_strategy == "all_to_all", best.label()
    assert estimated_time(unbalanced, best, n, h100) == estimated_time(config, best, n, h100)
    ring = dataclasses.replace(best, context_strategy="ring")
    assert estimated_time(unbalanced, ring, n, h100) > estimated_time(config, ring, n, h100)
