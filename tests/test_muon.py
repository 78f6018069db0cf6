"""Muon (``train.optimizer=muon``): the orthogonalisation against numpy's SVD, the momentum and
scales against ``optax.contrib.muon``, which parameters get it, the update of every mesh
against one device, a resume onto another mesh against the uninterrupted run, the extra
collectives the compiled step (and so ``analyze`` and the planner) shows, and the one-line
errors and notes."""

import functools
import math
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxdist.config import load_config
from jaxdist.data.sources import resolve_vocab
from jaxdist.errors import ConfigError
from jaxdist.layout.mesh import mesh_device_count, parse_mesh
from jaxdist.models.llama import Llama
from jaxdist.training import muon
from jaxdist.training.optim import make_optimizer
from jaxdist.training.run import build_trainer, run

from helpers import TINY

BF16 = ("model.dtype=bfloat16",)  # compute; the parameters and Muon's momentum stay f32

MUON = ("train.optimizer=muon",)
MOE = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_mlp_dim=32", "model.moe_shared_experts=1")
LR = 0.01
PLAIN = ("train.warmup_steps=0", "train.schedule=constant", f"train.lr={LR}", "train.grad_clip=0")
# Keller Jordan's quintic (3.4445, -4.7750, 2.0315), five steps, maps a singular value x of the
# Frobenius-normalised matrix to p^5(x): for x >= 0.002, into [0.682, 1.203] (the scalar map,
# iterated on a grid). The iteration keeps the singular vectors.
BAND, BAND_FROM = (0.68, 1.21), 0.002


def _config(*overrides: str):
    config = load_config(None, [*TINY, *MUON, *overrides])
    resolve_vocab(config)
    return config


def _params(config, seed: int = 0):
    return nnx.state(Llama(config.model, rngs=nnx.Rngs(params=seed)), nnx.Param)


def _random_like(tree, seed: int):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)])


def _at(tree, path: str):
    for key in path.split("/"):
        tree = tree[key]
    return np.asarray(tree[...], np.float64)


# -- the orthogonalisation against numpy -------------------------------------------------------


def _assert_orthogonalised(out: np.ndarray, grad: np.ndarray, what: str):
    """``out`` has ``grad``'s singular vectors and singular values in the quintic's band (numpy's
    SVD; nothing of the code's iteration)."""
    u, s, vt = np.linalg.svd(grad, full_matrices=False)
    inner = u.T @ out @ vt.T  # diagonal if out = U diag(d) V^T
    d = np.diag(inner)
    off = inner - np.diag(d)
    assert np.abs(off).max() < 2e-3, f"{what}: not grad's singular vectors ({np.abs(off).max():.2e})"
    residual = out - u @ inner @ vt  # any part of out outside grad's row and column spaces
    assert np.linalg.norm(residual) < 2e-3 * np.linalg.norm(out), what
    strong = s / np.linalg.norm(grad) >= BAND_FROM
    assert strong.any() and BAND[0] <= d[strong].min() and d.max() <= BAND[1], f"{what}: {d.min():.3f}..{d.max():.3f}"


def _matrices(name: str, g: np.ndarray, config) -> list[tuple[str, np.ndarray]]:
    """Each matrix of a stacked parameter, cut by hand from the model's layout (models.llama)."""
    h, kv = config.model.n_heads, config.model.n_kv_heads
    out = []
    for layer, w in enumerate(g):
        if name == "wqkv":  # [d, kv, h/kv + 2, hd]: each group's queries, then its k, then its v
            out += [(f"q{layer}", w[:, :, : h // kv].reshape(w.shape[0], -1))]
            out += [(f"k{layer}", w[:, :, h // kv].reshape(w.shape[0], -1)), (f"v{layer}", w[:, :, h // kv + 1].reshape(w.shape[0], -1))]
        elif name == "wo":  # [h, hd, d]
            out.append((f"o{layer}", w.reshape(-1, w.shape[-1])))
        elif name == "w_gate_up":  # [d, 2, f]
            out += [(f"gate{layer}", w[:, 0]), (f"up{layer}", w[:, 1])]
        else:  # w_down [f, d]
            out.append((f"down{layer}", w))
    return out


def test_first_update_is_the_orthogonalised_gradient_of_each_matrix():
    """Step 1 of Muon (momentum and Nesterov only scale the gradient) on the tiny decoder: each
    projection of each layer, q, k and v and gate and up apart, is -lr x 0.2 sqrt(max(m, n)) x
    an orthogonalisation of its own gradient, checked against numpy's SVD of that matrix."""
    config = _config(*PLAIN, "train.weight_decay=0")
    params = _params(config)
    grads = _random_like(params, 1)
    tx = make_optimizer(config.train)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    paths = {"wqkv": "blocks/attn/wqkv", "wo": "blocks/attn/wo", "w_gate_up": "blocks/mlp/w_gate_up", "w_down": "blocks/mlp/w_down"}
    for name, path in paths.items():
        for (what, g), (_, u) in zip(_matrices(name, _at(grads, path), config), _matrices(name, _at(updates, path), config), strict=True):
            scale = 0.2 * math.sqrt(max(g.shape))
            _assert_orthogonalised(-u / (LR * scale), g, f"{path} {what}")
    # the fused matrix as a whole would be another update: q, k and v were orthogonalised apart
    g, u = (_at(tree, "blocks/attn/wqkv")[0].reshape(config.model.d_model, -1) for tree in (grads, updates))
    with pytest.raises(AssertionError, match="not grad's singular vectors"):
        _assert_orthogonalised(-u / (LR * 0.2 * math.sqrt(max(g.shape))), g, "the fused matrix")
    # the rest got AdamW: its first step is -lr x sign(g) (elementwise, before epsilon)
    np.testing.assert_allclose(_at(updates, "embed"), -LR * np.sign(_at(grads, "embed")), rtol=2e-3)


def test_fused_and_separate_projections_get_the_same_update():
    """model.fused_projections is a storage choice: the same gradients, fused or apart, update alike."""
    fused, apart = _config(*PLAIN), _config(*PLAIN, "model.fused_projections=false")
    g = _random_like(_params(fused), 2)
    p = _params(fused)
    g_apart, p_apart = _params(apart), _params(apart)
    groups = fused.model.n_heads // fused.model.n_kv_heads

    def unfuse(src, dst):
        qkv, gu = src["blocks"]["attn"]["wqkv"][...], src["blocks"]["mlp"]["w_gate_up"][...]
        layers, d, kv, _, hd = qkv.shape
        dst["blocks"]["attn"]["wq"][...] = qkv[:, :, :, :groups].reshape(layers, d, kv * groups, hd)
        dst["blocks"]["attn"]["wk"][...], dst["blocks"]["attn"]["wv"][...] = qkv[:, :, :, groups], qkv[:, :, :, groups + 1]
        dst["blocks"]["mlp"]["w_gate"][...], dst["blocks"]["mlp"]["w_up"][...] = gu[:, :, 0], gu[:, :, 1]
        for path in (("blocks", "attn", "wo"), ("blocks", "mlp", "w_down"), ("embed",), ("head",)):
            s, t = src, dst
            for key in path:
                s, t = s[key], t[key]
            t[...] = s[...]

    unfuse(g, g_apart)
    unfuse(p, p_apart)
    tx_fused, tx_apart = make_optimizer(fused.train), make_optimizer(apart.train)
    u_fused, _ = jax.jit(tx_fused.update)(g, tx_fused.init(p), p)
    u_apart, _ = jax.jit(tx_apart.update)(g_apart, tx_apart.init(p_apart), p_apart)
    unfused = _params(apart)
    unfuse(u_fused, unfused)
    for name in ("wq", "wk", "wv"):
        np.testing.assert_allclose(unfused["blocks"]["attn"][name][...], u_apart["blocks"]["attn"][name][...], rtol=1e-5, atol=1e-8)
    for name in ("w_gate", "w_up"):
        np.testing.assert_allclose(unfused["blocks"]["mlp"][name][...], u_apart["blocks"]["mlp"][name][...], rtol=1e-5, atol=1e-8)


class _Plain(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jax.random.normal(jax.random.key(0), (24, 40)), axes=("embed", "mlp"))


@pytest.mark.parametrize(("scale", "consistent_rms"), [("match_adamw", 0.2), ("spectral", None)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_scale_and_decay_match_optax_contrib_muon(scale, consistent_rms, nesterov):
    """On one plain matrix, three steps: the momentum (Nesterov or not), the shape scale, the
    decoupled weight decay and the lr are optax.contrib.muon's (Moonlight's consistent RMS 0.2,
    or Keller Jordan's width scale)."""
    cfg = load_config(None, [*MUON, *PLAIN, "train.weight_decay=0.1", f"train.muon_scale={scale}", f"train.muon_nesterov={nesterov}"]).train
    params = nnx.state(_Plain(), nnx.Param)
    ours, theirs = make_optimizer(cfg), optax.contrib.muon(LR, weight_decay=0.1, nesterov=nesterov, consistent_rms=consistent_rms)
    ours_state, theirs_state = ours.init(params), theirs.init({"w": params["w"][...]})
    for step in range(3):
        g = jax.random.normal(jax.random.key(10 + step), (24, 40))
        grads = nnx.State({"w": params["w"].replace(g)})
        mine, ours_state = ours.update(grads, ours_state, params)
        want, theirs_state = theirs.update({"w": g}, theirs_state, {"w": params["w"][...]})
        np.testing.assert_allclose(mine["w"][...], want["w"], rtol=2e-5, atol=1e-9)
        params = optax.apply_updates(params, mine)


def test_the_hidden_matrices_get_muon_the_rest_adamw():
    config = _config(*MOE, "model.moe_first_dense=1", "model.moe_bias_rate=0.001")
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Llama(config.model, rngs=nnx.Rngs(0))))
    matrices, rest = muon.split(params)
    names = lambda tree: sorted("/".join(map(str, p)) for p, _ in nnx.to_flat_state(tree))  # noqa: E731
    stacks = ("blocks", "dense_blocks")
    assert names(matrices) == sorted(
        [f"{s}/attn/{w}" for s in stacks for w in ("wo", "wqkv")]
        + [f"blocks/mlp/{w}" for w in ("w_gate_up", "w_down", "shared_gate_up", "shared_down")]
        + ["dense_blocks/mlp/w_gate_up", "dense_blocks/mlp/w_down"]
    )
    assert names(rest) == sorted(
        ["embed", "head", "final_norm/scale", "blocks/mlp/router", "blocks/mlp/bias"]
        + [f"{s}/{n}/scale" for s in stacks for n in ("attn_norm", "mlp_norm")]
    )
    state = jax.eval_shape(make_optimizer(config.train).init, params)
    (momentum,) = [s.mu for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, muon.MuonState)) if isinstance(s, muon.MuonState)]
    assert names(momentum) == sorted(  # fused projections cut into their parts
        [f"{s}/attn/{w}" for s in stacks for w in ("wo", "wqkv/q", "wqkv/k", "wqkv/v")]
        + [
            f"blocks/mlp/{w}"
            for w in ("w_gate_up/gate", "w_gate_up/up", "w_down", "shared_gate_up/gate", "shared_gate_up/up", "shared_down")
        ]
        + ["dense_blocks/mlp/w_gate_up/gate", "dense_blocks/mlp/w_gate_up/up", "dense_blocks/mlp/w_down"]
    )


# -- every mesh against one device ------------------------------------------------------------


@functools.cache
def _two_updates(mesh: str, overrides: tuple[str, ...]) -> tuple:
    """The second Muon update (the momentum in play) of fixed random parameters and gradients,
    computed in ``mesh``'s shardings by the trainer's optimizer."""
    config = _config(*PLAIN, *overrides)
    sizes = parse_mesh(mesh)
    trainer = build_trainer(config, sizes, jax.devices()[: mesh_device_count(sizes)])
    params_s, opt_s = trainer.state_shardings.params, trainer.state_shardings.opt_state
    params = jax.device_put(_random_like(trainer.state_layout.abstract_params, 3), params_s)
    state = jax.jit(trainer.tx.init, out_shardings=opt_s)(params)
    update = jax.jit(trainer.tx.update, in_shardings=(params_s, opt_s, params_s), out_shardings=(params_s, opt_s))
    for seed in (4, 5):
        grads = jax.device_put(_random_like(trainer.state_layout.abstract_params, seed), params_s)
        updates, state = update(grads, state, params)
    return jax.device_get(nnx.to_pure_dict(updates))


HEAVY = pytest.mark.heavy  # the layouts the others already combine
MESHES = [
    pytest.param("data=8", (), marks=HEAVY),
    pytest.param("fsdp=8", ()),
    pytest.param("tensor=4", (), marks=HEAVY),
    pytest.param("data=2,fsdp=2,tensor=2", ()),
    pytest.param("data=4,fsdp=2", ("parallel.strategy=zero1",)),
    pytest.param("data=2,pipe=2", ("parallel.pipeline_microbatches=2",)),
    pytest.param("fsdp=2,context=2", ()),
    pytest.param("expert=4", MOE, marks=HEAVY),
    pytest.param("data=2,expert=2,tensor=2", MOE),
    pytest.param("fsdp=2,expert=4", MOE, marks=HEAVY),
]


@pytest.mark.parametrize(("mesh", "overrides"), MESHES, ids=[p.values[0] for p in MESHES])
def test_sharded_update_equals_one_device(mesh, overrides):
    moe = tuple(o for o in overrides if o.startswith("model."))
    reference, sharded = _two_updates("data=1", moe), _two_updates(mesh, overrides)
    for (path, want), (_, got) in zip(
        jax.tree_util.tree_leaves_with_path(reference), jax.tree_util.tree_leaves_with_path(sharded), strict=True
    ):
        # fp32 sums in another order, through five Newton-Schulz iterations: 1e-5 of the update's size
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=jax.tree_util.keystr(path))


# -- training, and a resume onto another mesh -------------------------------------------------

STEPS = 6


def _run(mesh: str, run_dir=None, *overrides: str):
    config = load_config(None, [*TINY, *MUON, f"train.steps={STEPS}", "train.warmup_steps=2", "checkpoint.every_steps=3", *overrides])
    sizes = parse_mesh(mesh)
    return run(config, sizes, run_dir, devices=jax.devices()[: mesh_device_count(sizes)], progress=False)


@pytest.mark.heavy  # three runs, two compiled steps: ~20 s
def test_stopped_on_one_mesh_resumed_on_another_matches_the_uninterrupted_run(tmp_path):
    """Three steps on fsdp=2,tensor=2, saved (Muon's momentum with the rest), three more on
    data=2,fsdp=4: the losses of the uninterrupted run (a momentum restored as zeros or in
    the wrong layout would change steps 4 to 6)."""
    uninterrupted = _run("fsdp=2,tensor=2").losses
    first = _run("fsdp=2,tensor=2", tmp_path, "train.stop_after_step=3").losses
    resumed = _run("data=2,fsdp=4", tmp_path).losses
    np.testing.assert_allclose(first + resumed, uninterrupted, rtol=1e-5)


# -- the compiled step's extra collectives, and the planner's price ---------------------------


def test_muon_adds_one_all_to_all_each_way_per_matrix_and_the_planner_prices_them(tmp_path):
    """On fsdp=2 the compiled step of Muon has AdamW's collectives plus, per hidden matrix, one
    all-to-all over fsdp to bring it whole onto a device and one back: 2 x its bytes / 2 per
    device; and AdamW's matmuls plus the Newton-Schulz iterations of one layer per device. The
    planner compiles the same step, so it charges both."""
    from jaxdist.plan.cost import predict_summary
    from jaxdist.plan.hardware import cpu_local
    from jaxdist.plan.hlo_cost import ProgramCost
    from jaxdist.plan.search import compile_summary

    def compiled(optimizer: str):
        config = load_config(None, [*TINY, f"train.optimizer={optimizer}", "parallel.mesh=fsdp=2", *BF16])
        resolve_vocab(config)
        summary, _ = compile_summary(config, cache=tmp_path)
        return summary, ProgramCost.from_dict(summary["program"])

    (adamw_summary, adamw), (muon_summary, muon_cost) = compiled("adamw"), compiled("muon")
    kinds = lambda cost: sorted((op.kind, op.axes, op.bytes) for op in cost.collectives)  # noqa: E731
    extra = kinds(muon_cost)
    for op in kinds(adamw):
        extra.remove(op)
    assert {(kind, axes) for kind, axes, _ in extra} == {("all-to-all", ("fsdp",))}
    m = _config().model
    d, f, q, kv = m.d_model, m.resolved_mlp_dim, m.n_heads * m.resolved_head_dim, m.n_kv_heads * m.resolved_head_dim
    shapes = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]  # one layer's q, k, v, o, gate, up, down
    assert len(extra) == 2 * len(shapes)  # there and back
    assert sum(b for _, _, b in extra) == 2 * m.n_layers * sum(a * b * 4 for a, b in shapes) // 2  # fp32, over 2 devices
    # the Newton-Schulz matmuls are in the priced compute: each device orthogonalises one of the 2 layers
    newton_schulz = sum(5 * (4 * min(a, b) ** 2 * max(a, b) + 2 * min(a, b) ** 3) for a, b in shapes)
    assert muon_cost.matmul_flops - adamw.matmul_flops == newton_schulz
    profile = {
        "matmul_flops_per_s": 1e11, "memory_bytes_per_s": 4e10, "fusion_bytes_per_s": 1e10, "op_overhead_s": 1e-6,
        "collective_latency_s": 1e-4, "collective_bytes_per_s": 1e9, "fake_device_collective_latency_s": 1e-5,
        "fake_device_collective_bytes_per_s": 5e9,
    }  # fmt: skip
    host = cpu_local(profile)
    assert predict_summary(muon_cost, host, muon_summary).comm_s > predict_summary(adamw, host, adamw_summary).comm_s
    # bf16 compute, f32 momentum: XLA:CPU widened no operand of these (as it does the experts'
    # bf16 tokens), so a GPU moves their f32 too and the screen prices every byte
    from jaxdist.plan.cost import _gpu_bytes_factor
    from jaxdist.plan.hardware import load_hardware

    muon_a2a = [op for op in muon_cost.collectives if op.kind == "all-to-all"]
    assert all(muon_cost.is_f32(op) and not muon_cost.is_widened(op) for op in muon_a2a)
    assert all(_gpu_bytes_factor(op, muon_cost, load_hardware("h100")) == 1.0 for op in muon_a2a)


def test_xla_gpu_moves_muons_all_to_alls_in_f32_as_the_screen_prices_them():
    """The same step compiled for 2 H100s (no GPU needed): XLA:GPU's all-to-alls are Muon's, one
    each way per matrix, and move f32: what the screen above charges in full."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="JAX's CUDA plugin is not installed (pip install -e '.[dev]')")
    from jaxdist.inspect.hlo import parse_hlo
    from jaxdist.plan.gpu_target import compile_for_target, target_hardware

    config = load_config(None, [*TINY, "train.optimizer=muon", "parallel.mesh=fsdp=2", *BF16, "train.latency_profile=off"])
    resolve_vocab(config)
    _, compiled, _ = compile_for_target(config, parse_mesh("fsdp=2"), target_hardware("h100"), 2, 8)
    module = parse_hlo(compiled.as_text())
    starts = [i for body in module.computations.values() for i in body if i.opcode in ("all-to-all", "all-to-all-start")]
    m = _config().model
    d, f, q, kv = m.d_model, m.resolved_mlp_dim, m.n_heads * m.resolved_head_dim, m.n_kv_heads * m.resolved_head_dim
    shapes = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]  # one layer's q, k, v, o, gate, up, down
    assert len(starts) == 2 * len(shapes)  # there and back, as on XLA:CPU
    received = sum(4 * math.prod(int(n) for n in re.findall(r"f32\[([\d,]*)\]", i.shape)[-1].split(",")) for i in starts)
    assert received == 2 * m.n_layers * sum(a * b * 4 for a, b in shapes) // 2  # f32 (not bf16), over 2 devices
    assert all(i.shape.lstrip("(").startswith("f32") for i in starts), [i.shape for i in starts]


# -- bad input and the weaker path -------------------------------------------------------------


def test_a_model_without_hidden_matrices_is_one_line():
    config = load_config("resnet", [*MUON])
    with pytest.raises(ConfigError, match="train.optimizer=muon: the model has no hidden matrices") as raised:
        build_trainer(config, parse_mesh("data=1"), jax.devices()[:1])
    assert "\n" not in str(raised.value)


def test_matrices_gathered_over_an_axis_are_said_once(capsys):
    """TINY stacks 2 layers: over fsdp=8 its matrices cannot be spread one per device, so the
    fsdp devices gather them and repeat the work: one info line. fsdp=2 spreads them: silence."""
    build_trainer(_config(), parse_mesh("fsdp=2"), jax.devices()[:2])
    assert "muon:" not in capsys.readouterr().err
    build_trainer(_config(), parse_mesh("fsdp=8"), jax.devices()[:8])
    lines = [line for line in capsys.readouterr().err.splitlines() if "muon:" in line]
    assert len(lines) == 1 and "over fsdp (8); 2 layers: blocks/attn/wo, blocks/attn/wqkv/k" in lines[0], lines
    # 2 layers divide over fsdp=2 or context=2, not both: the line says which axis took the stack
    build_trainer(_config(), parse_mesh("fsdp=2,context=2"), jax.devices()[:4])
    lines = [line for line in capsys.readouterr().err.splitlines() if "muon:" in line]
    assert len(lines) == 1 and "over fsdp (2); 2 layers split 2 ways over context: blocks/attn/wo" in lines[0], lines
