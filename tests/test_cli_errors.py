"""Bad input gets one line on stderr, exit code 2, and no run directory."""

import subprocess
import sys

import pytest
import yaml

from jaxdist.config import load_config
from jaxdist.errors import ConfigError, MeshError
from jaxdist.layout.mesh import format_mesh, parse_mesh, resolve_mesh
from jaxdist.train import main

BAD_INPUTS = {
    "unknown mesh axis": (["--mesh", "data=2,experts=4"], "unknown axis 'experts'"),
    "malformed mesh": (["--mesh", "8x"], "malformed mesh"),
    "too many positional factors": (["--mesh", "2x2x2x2"], "positional mesh"),
    "zero-size axis": (["--mesh", "data=0"], "sizes must be >= 1"),
    "batch not divisible": (["--mesh", "data=8", "train.global_batch=12"], "train.global_batch (12) must be divisible"),
    "batch vs microbatches": (["--mesh", "data=4", "train.global_batch=16", "train.microbatches=8"], "x train.microbatches (8)"),
    "heads vs tensor": (
        ["--mesh", "tensor=8", "model.n_heads=4", "model.n_kv_heads=4"],
        "model.n_heads (4) must be divisible by the tensor axis (8)",
    ),
    "kv heads vs tensor": (["--mesh", "tensor=4", "model.n_heads=8", "model.n_kv_heads=2"], "model.n_kv_heads (2)"),
    "mlp vs tensor": (["--mesh", "tensor=2", "model.n_heads=4", "model.n_kv_heads=2", "model.mlp_dim=99"], "mlp width (99)"),
    "unknown key": (["model.n_layer=2"], "unknown config key 'model.n_layer' (did you mean model.n_layers?)"),
    "unknown key far from any": (["model.zzz=2"], "unknown config key 'model.zzz' (python -m jaxdist.train --print-config lists the keys)"),
    "unknown section": (["optim.lr=2"], "unknown config key 'optim'"),
    "misspelt section": (["trian.lr=2"], "unknown config key 'trian' (did you mean train?)"),
    "wrong type": (["model.n_layers=two"], "model.n_layers: expected int, got 'two'"),
    "bool for int": (["train.steps=true"], "train.steps: expected int"),
    "bad enum": (["model.dtype=float8"], "model.dtype must be"),
    "unknown gradient reduction": (["parallel.grad_reduce=int4"], "parallel.grad_reduce must be one of float32, bfloat16, int8, topk"),
    "topk fraction zero": (["parallel.grad_reduce=topk", "parallel.grad_topk_fraction=0"], "parallel.grad_topk_fraction must be in (0, 1]"),
    "topk fraction above one": (["parallel.grad_reduce=topk", "parallel.grad_topk_fraction=1.5"], "must be in (0, 1], got 1.5"),
    "unknown compress axes": (["parallel.compress_axes=ici"], "parallel.compress_axes must be one of all, dcn"),
    "fp16 with zero loss scale": (["model.dtype=float16", "train.loss_scale=0"], "train.loss_scale must be dynamic or a positive number"),
    "fp16 with a word for loss scale": (["model.dtype=float16", "train.loss_scale=auto"], "got 'auto'"),
    "compressed reduction with a pipe axis": (
        ["--mesh", "data=2,pipe=2", "parallel.grad_reduce=int8"],
        "parallel.grad_reduce=int8 does not support a pipe axis",
    ),
    "unknown optimizer": (["train.optimizer=lion"], "train.optimizer must be one of adamw, sgd"),
    "negative weights-only checkpoint interval": (["checkpoint.params_every_steps=-1"], "checkpoint.params_every_steps must be >= 0"),
    "replica axis without diloco": (["--mesh", "replica=2,data=2"], "the replica mesh axis is for DiLoCo"),
    "negative diloco inner steps": (["parallel.diloco_inner_steps=-1"], "parallel.diloco_inner_steps must be >= 0"),
    "diloco without a replica axis": (["--mesh", "data=2", "parallel.diloco_inner_steps=4"], "needs a replica mesh axis of size > 1"),
    "name climbing out of runs/": (["name=../../x"], "must be one path component"),
    "sequence the context split cannot divide": (
        ["--mesh", "context=4", "train.seq_len=36"],
        "train.seq_len (36) must be divisible by 2 x context = 8 chunks",
    ),
    "sequence without load balancing": (
        ["--mesh", "context=4", "train.seq_len=34", "parallel.context_load_balance=false"],
        "train.seq_len (34) must be divisible by the context axis (4)",
    ),
    "context with the resnet task": (
        ["--config", "resnet", "--mesh", "context=2"],
        "a context axis splits token sequences; model.kind=resnet",
    ),
    "unknown context strategy": (
        ["--mesh", "context=2", "parallel.context_strategy=ulysses"],
        "parallel.context_strategy must be one of all_gather, ring",
    ),
    "context with a pipe axis": (["--mesh", "pipe=2,context=2"], "a context axis does not compose with a pipe axis yet"),
    "context with compression": (["--mesh", "data=2,context=2", "parallel.grad_reduce=int8"], "does not compose with a context axis yet"),
    "context with diloco": (
        ["--mesh", "replica=2,context=2", "parallel.diloco_inner_steps=4"],
        "DiLoCo (parallel.diloco_inner_steps > 0) does not compose with a context axis yet",
    ),
    "experts the expert axis cannot split": (
        ["--mesh", "expert=4", "model.moe_experts=6"],
        "model.moe_experts (6) must be divisible by the expert axis (4)",
    ),
    "top-k above the experts": (
        ["model.moe_experts=4", "model.moe_top_k=5"],
        "model.moe_top_k (5) must be between 1 and model.moe_experts (4)",
    ),
    "expert axis on a dense model": (["--mesh", "data=2,expert=4"], "an expert axis splits an MoE layer's experts; this model has none"),
    "capacity the buffer cannot hold": (
        ["--mesh", "expert=4", "model.moe_experts=8", "model.moe_capacity_factor=2", "parallel.expert_buffer_factor=1"],
        "parallel.expert_buffer_factor=1 gives",
    ),
    "capacity rounded exactly, not truncated": (  # 33 tokens x 1.1 / 4 experts: 10 rows (9.075 up), so 2 experts per device need 20
        ["--mesh", "expert=2", "model.moe_experts=4", "model.moe_top_k=1", "model.moe_capacity_factor=1.1"]
        + ["parallel.expert_buffer_factor=1.1", "train.global_batch=2", "train.seq_len=33"],
        "parallel.expert_buffer_factor=1.1 gives 19 rows per destination, fewer than the 20",
    ),
    "unknown router": (["model.moe_experts=4", "model.moe_router=relu"], "model.moe_router must be one of softmax, sigmoid"),
    "unknown fp8 mode": (["model.fp8=e4m3"], "model.fp8 must be one of off, current, delayed"),
    "fp8 history of zero": (["model.fp8=delayed", "model.fp8_history=0"], "model.fp8_history must be >= 1"),
    "fp8 with float32 compute": (["model.fp8=current", "model.dtype=float32"], "needs bfloat16 compute (model.dtype=bfloat16)"),
    "fp8 with auto compute on cpu": (
        ["model.fp8=current", "model.n_layers=3"],
        "model.dtype=auto is float32 on cpu: set model.dtype=bfloat16",
    ),
    "fp8 on resnet": (["--config", "resnet", "model.fp8=current"], "model.fp8 is for the llama decoder's matmuls, not model.kind=resnet"),
    "fp8 keeping every layer": (["model.fp8=current", "model.dtype=bfloat16", "model.n_layers=2"], "leaves none of the 2 layers in fp8"),
    "delayed fp8 on a pipeline": (
        ["--mesh", "pipe=2", "model.fp8=delayed", "model.dtype=bfloat16", "model.fp8_keep_ends=false"],
        "model.fp8=delayed does not compose with a pipe axis",
    ),
    "no MoE layer left": (["model.moe_experts=4", "model.moe_first_dense=2", "model.n_layers=2"], "must leave at least one"),
    "MoE with a pipe axis": (
        ["--mesh", "pipe=2", "model.moe_experts=4"],
        "MoE (model.moe_experts > 0) does not compose with a pipe axis yet",
    ),
    "negative schedule steps": (["train.schedule_steps=-1"], "train.schedule_steps must be >= 0"),
    "stop after the last step": (["train.stop_after_step=5"], "train.stop_after_step must be in 0..train.steps (1)"),
    "diloco with compressed inner reduction": (
        ["--mesh", "replica=2", "parallel.diloco_inner_steps=4", "parallel.grad_reduce=int8"],
        "compress the outer average with parallel.diloco_reduce",
    ),
    "diloco with a pipe axis": (["--mesh", "replica=2,pipe=2", "parallel.diloco_inner_steps=4"], "does not support a pipe axis"),
    "unknown diloco reduce": (["parallel.diloco_reduce=topk"], "parallel.diloco_reduce must be one of float32, bfloat16, int8"),
    "two remaining axes": (["--mesh", "data=-1,fsdp=-1"], "only one axis may be -1"),
    "remaining axis that cannot fit": (["--mesh", "data=-1,tensor=3"], "do not divide the 8 devices"),
    "negative link latency": (["parallel.replica_link_latency_ms=-5"], "must be >= 0"),
    "not key=value": (["model.n_layers"], "not of the form key=value"),
    "missing config file": (["--config", "/nonexistent/cfg.yaml"], "not found"),
    "unknown preset": (["--config", "no-such-preset"], "presets:"),
    "unknown flag": (["--meshh", "8"], "unrecognized arguments"),
    "strategy tp without tensor axis": (["--mesh", "data=2", "parallel.strategy=fsdp+tp"], "no tensor axis"),
    "resnet on tensor axis": (["--config", "resnet", "--mesh", "data=2,tensor=2"], "not tensor"),
    "profile window backwards": (["--profile-steps", "5:3"], "train.profile_steps 5:3: need 1 <= A <= B"),
    "profile window past the run": (["--profile-steps", "1:50"], "<= train.steps (1)"),
    "profile window malformed": (["--profile-steps", "five"], "expected A:B"),
}


# Every numeric key: (is 0 valid, is a negative value valid). Written out here, apart from
# the config's own ranges, so that a key added without a range, or with the wrong one, fails.
NUMERIC_KEYS = {
    **dict.fromkeys(["model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.rope_theta"], (False, False)),
    **dict.fromkeys(["model.rope_low_freq_factor", "model.rope_high_freq_factor", "model.rope_original_max_len"], (False, False)),
    **dict.fromkeys(["model.norm_eps", "model.moe_top_k", "model.fp8_history", "model.image_size", "model.num_classes"], (False, False)),
    **dict.fromkeys(["model.resnet_widths", "model.resnet_blocks"], (False, False)),
    **dict.fromkeys(
        ["model.vocab_size", "model.valid_vocab", "model.head_dim", "model.mlp_dim", "model.rope_scaling_factor"], (True, False)
    ),
    **dict.fromkeys(["model.loss_chunk", "model.moe_experts", "model.moe_shared_experts", "model.moe_mlp_dim"], (True, False)),
    **dict.fromkeys(["model.moe_first_dense", "model.moe_aux_loss_coef", "model.moe_z_loss_coef", "model.moe_bias_rate"], (True, False)),
    "model.moe_capacity_factor": (True, True),  # <= 0: dropless
    **dict.fromkeys(["train.steps", "train.global_batch", "train.seq_len", "train.microbatches", "train.lr"], (False, False)),
    **dict.fromkeys(["train.decay_fraction", "train.log_every", "train.eval_batches", "train.max_skips"], (False, False)),
    **dict.fromkeys(["train.schedule_steps", "train.stop_after_step", "train.min_lr_ratio", "train.warmup_steps"], (True, False)),
    **dict.fromkeys(["train.momentum", "train.weight_decay", "train.beta1", "train.beta2", "train.grad_clip", "train.seed"], (True, False)),
    **dict.fromkeys(["train.eval_every", "train.peak_flops", "train.straggler_window"], (True, False)),
    "train.straggler_factor": (False, False),  # >= 1
    "train.muon_ns_steps": (False, False),
    "train.muon_momentum": (True, False),
    "train.dpo_beta": (False, False),
    "train.dpo_label_smoothing": (True, False),
    **dict.fromkeys(["train.harness_every", "train.harness_limit"], (True, False)),
    "train.harness_num_fewshot": (True, True),  # >= -1
    "train.harness_batch_size": (False, False),
    **dict.fromkeys(["data.workers", "data.prefetch", "data.synthetic_latency_ms"], (True, False)),
    "data.eval_fraction": (False, False),
    "data.cache_gb": (False, False),
    **dict.fromkeys(
        [
            "checkpoint.every_steps",
            "checkpoint.every_minutes",
            "checkpoint.keep_best",
            "checkpoint.params_every_steps",
            "checkpoint.remote_every_steps",
        ],
        (True, False),
    ),
    "checkpoint.keep": (False, False),
    **dict.fromkeys(["parallel.virtual_stages", "parallel.grad_topk_fraction", "parallel.diloco_outer_lr"], (False, False)),
    **dict.fromkeys(["parallel.pipeline_microbatches", "parallel.diloco_inner_steps", "parallel.diloco_outer_momentum"], (True, False)),
    "parallel.diloco_fragments": (False, False),
    **dict.fromkeys(["parallel.diloco_overlap_steps", "parallel.diloco_overlap_mix"], (True, False)),
    **dict.fromkeys(["parallel.replica_link_latency_ms", "parallel.replica_link_gbps", "parallel.expert_buffer_factor"], (True, False)),
}


def _numeric_keys() -> dict[str, type]:
    import typing

    from jaxdist.config import SECTIONS, keys

    out = {}
    for key in keys():
        section, name = key.split(".")
        kind = typing.get_type_hints(SECTIONS[section])[name]
        kind = typing.get_args(kind)[0] if typing.get_origin(kind) is tuple else kind
        if kind in (int, float):
            out[key] = kind
    return out


def test_the_numeric_key_table_names_every_numeric_key():
    assert set(NUMERIC_KEYS) == set(_numeric_keys())


def _invalid_values(key: str, kind: type) -> list[str]:
    zero_ok, negative_ok = NUMERIC_KEYS[key]
    values = ["nan", ".inf", "-.inf"] + ([] if negative_ok else ["-1"]) + ([] if zero_ok else ["0"])
    return [f"[{v}]" for v in values] if key == "model.resnet_widths" else values


@pytest.mark.parametrize("key", sorted(NUMERIC_KEYS))
def test_every_numeric_key_refuses_nan_inf_and_out_of_range_values_in_one_line(key, tmp_path, capsys):
    """nan, +-inf, and negatives or zero where they mean nothing: one line naming the key,
    exit 2, no run directory (the values that are valid load)."""
    kind = _numeric_keys()[key]
    for value in _invalid_values(key, kind):
        run_dir = tmp_path / "run"
        assert main([f"{key}={value}", "--run-dir", str(run_dir)]) == 2, (key, value)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"jaxdist: error: {key}"), (key, value, err)
        assert not run_dir.exists()
    zero_ok, negative_ok = NUMERIC_KEYS[key]
    for value, ok in (("0", zero_ok), ("-1", negative_ok)):
        if ok:
            load_config(None, [f"{key}={value}"])


def test_print_config_prints_the_resolved_config_that_loads_back(tmp_path, capsys):
    assert main(["--config", "tiny", "model.n_layers=3", "--steps", "7", "--print-config", "--run-dir", str(tmp_path / "run")]) == 0
    printed = capsys.readouterr().out
    saved = tmp_path / "printed.yaml"
    saved.write_text(printed)
    again = load_config(str(saved))
    assert again.model.n_layers == 3 and again.train.steps == 7 and again.train.schedule_steps == 7
    assert again.model.vocab_size > 0  # resolved from the (byte-level) tokenizer
    assert {k: v for k, v in again.to_dict().items() if k != "name"} == {k: v for k, v in yaml.safe_load(printed).items() if k != "name"}
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("mesh", "expected"),
    [("dta=2", "unknown axis 'dta'"), ("data=3", "train.global_batch (16) must be divisible by"), ("data=2,tensor=3", "tensor")],
)
def test_print_config_refuses_what_the_run_refuses(mesh, expected, capsys):
    """The same derivation as the run: a mesh the run would refuse is exit 2 here too."""
    assert main(["--config", "tiny", "--mesh", mesh, "--steps", "1", "--run-dir", "unused"]) == 2  # the run itself
    run_said = capsys.readouterr().err.strip()
    assert main(["--config", "tiny", "--mesh", mesh, "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == run_said and len(err.splitlines()) == 1 and expected in err, (err, run_said)


def test_print_config_records_the_sized_axis_and_says_what_has_no_effect(capsys):
    import jax

    assert main(["--config", "tiny", "--mesh", "data=-1,tensor=2", "model.fp8_history=8", "--print-config"]) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["parallel"]["mesh"] == f"data={jax.device_count() // 2},tensor=2"  # this session's fake devices
    (line,) = [x for x in err.splitlines() if "fp8_history" in x]
    assert line.startswith("jaxdist: warning: model.fp8_history=8 has no effect with model.fp8=off"), err


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(case, tmp_path, capsys):
    argv, expected = BAD_INPUTS[case]
    run_dir = tmp_path / "run"
    assert main([*argv, "--run-dir", str(run_dir), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("jaxdist: error: ") and expected in err[0], err
    assert not run_dir.exists()


def test_config_file_with_bad_yaml(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert main(["--config", str(bad), "--run-dir", str(tmp_path / "run")]) == 2
    assert "invalid YAML" in capsys.readouterr().err


def test_unknown_key_inside_config_file(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  d_modle: 64\n")
    with pytest.raises(ConfigError, match="model.d_modle"):
        load_config(str(cfg))


def test_overrides_are_typed():
    config = load_config("tiny", ["train.lr=1e-2", "model.n_layers=3", "train.steps=7", "data.path=2024"])
    assert (config.train.lr, config.model.n_layers, config.train.steps, config.data.path) == (0.01, 3, 7, "2024")
    assert isinstance(load_config(None, ["train.lr=1"]).train.lr, float)


@pytest.mark.parametrize(
    ("spec", "sizes"),
    [
        ("8x4", {"replica": 1, "data": 8, "pipe": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 4}),
        ("8", {"replica": 1, "data": 8, "pipe": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}),
        ("data=2,fsdp=2,tensor=2", {"replica": 1, "data": 2, "pipe": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}),
        ("fsdp=4", {"replica": 1, "data": 1, "pipe": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 1}),
        ("replica=2,data=-1", {"replica": 2, "data": -1, "pipe": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}),
    ],
)
def test_mesh_specs(spec, sizes):
    assert parse_mesh(spec) == sizes
    assert parse_mesh("auto") is None


@pytest.mark.parametrize(
    ("spec", "devices", "resolved"),
    [("data=-1,tensor=2", 8, "data=4,tensor=2"), ("replica=2,fsdp=-1", 4, "replica=2,fsdp=2"), ("data=-1", 3, "data=3")],
)
def test_remaining_axis_takes_the_devices_left(spec, devices, resolved):
    assert format_mesh(resolve_mesh(parse_mesh(spec), devices)) == resolved


@pytest.mark.parametrize(
    ("spec", "match"),
    [("data=-1,fsdp=-1", "only one axis may be -1"), ("data=-2", "-1 for the devices that remain"), ("tensor=0", ">= 1")],
)
def test_bad_remaining_axis(spec, match):
    with pytest.raises(MeshError, match=match):
        parse_mesh(spec)
    with pytest.raises(MeshError, match="do not divide the 6 devices"):
        resolve_mesh(parse_mesh("data=-1,tensor=4"), 6)


def test_duplicate_axis_is_an_error():
    with pytest.raises(MeshError, match="given twice"):
        parse_mesh("data=2,data=2")


def test_errors_come_before_jax_starts(tmp_path):
    """A bad mesh is rejected from the command line without importing JAX."""
    code = (
        "import sys; from jaxdist.train import main; rc = main(['--mesh', 'foo=2']);"
        "assert 'jax' not in sys.modules, 'jax imported'; sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.strip() == "jaxdist: error: mesh 'foo=2': unknown axis 'foo' (axes: replica, data, pipe, fsdp, expert, context, tensor)"
    )


@pytest.mark.parametrize("tool", ["train", "analyze"])
def test_flags_and_overrides_mix_in_any_order(tool):
    from jaxdist import analyze, train
    from jaxdist.cli import config_from_args, parse_args

    parser = {"train": train, "analyze": analyze}[tool].build_arg_parser()
    argv = ["--config", "tiny", "model.dtype=float32", "--mesh", "data=2", "--steps", "2", "train.lr=0.001", "model.n_layers=3"]
    config = config_from_args(parse_args(parser, argv))
    assert (config.model.dtype, config.parallel.mesh, config.train.steps) == ("float32", "data=2", 2)
    assert (config.train.lr, config.model.n_layers) == (0.001, 3)


NO_SILENT_REPLICATION = {
    "d_model vs fsdp": (
        ["--mesh", "fsdp=8", "model.d_model=36", "model.n_heads=2", "model.n_kv_heads=2"],
        "model.d_model (36) must be divisible by the fsdp axis (8)",
    ),
    "d_model vs zero1 shards": (
        ["--mesh", "data=8", "parallel.strategy=zero1", "model.d_model=36", "model.n_heads=2", "model.n_kv_heads=2"],
        "model.d_model (36) must be divisible by data x fsdp",
    ),
    "vocab vs tensor": (["--mesh", "tensor=4", "model.vocab_size=258"], "model.vocab_size (258) must be divisible by the tensor axis (4)"),
    "fsdp strategy without fsdp axis": (["--mesh", "data=8", "parallel.strategy=fsdp"], "the mesh has none"),
    "resnet width vs fsdp": (["--config", "resnet", "--mesh", "fsdp=8", "model.resnet_widths=[12,24]"], "resnet_widths entry 12"),
}


@pytest.mark.parametrize("case", sorted(NO_SILENT_REPLICATION))
def test_dimensions_a_mesh_axis_cannot_split_are_errors(case, tmp_path, capsys):
    argv, expected = NO_SILENT_REPLICATION[case]
    assert main([*argv, "--run-dir", str(tmp_path / "run"), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "run").exists()


def test_zero1_with_nothing_to_shard_over_warns():
    from jaxdist.layout.validate import check_config_on_mesh

    config = load_config(None, ["parallel.strategy=zero1"])
    warnings = check_config_on_mesh(config, parse_mesh("tensor=2"))
    assert len(warnings) == 1 and "optimizer state stays replicated" in warnings[0]
    assert check_config_on_mesh(config, parse_mesh("data=2")) == []


def test_a_custom_model_dimension_that_does_not_divide_is_reported(capsys):
    """The rules' own guard, for any NNX model: a dimension that a mesh axis cannot split
    is replicated over it and named in one warning line."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxdist.layout.mesh import build_mesh
    from jaxdist.layout.sharding import rules_for, tree_shardings
    from jaxdist.layout.strategy import Strategy

    class Odd(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros((6, 16)), axes=("embed", "mlp"))
            self.v = nnx.Param(jnp.zeros((16, 8)), axes=("embed", "mlp"))

    params = nnx.state(nnx.eval_shape(Odd))
    mesh = build_mesh(parse_mesh("fsdp=4"), jax.devices()[:4])
    replicated: dict = {}
    shardings = tree_shardings(params, rules_for(Strategy("fsdp", False)), mesh, replicated=replicated)
    assert shardings["w"].get_value().spec == jax.sharding.PartitionSpec(None, None)
    assert shardings["v"].get_value().spec == jax.sharding.PartitionSpec("fsdp", None)
    (line,) = replicated.values()
    assert "['w']" in line and "'embed' dimension (6)" in line and "'fsdp' (4)" in line
