"""Bad input gets one line on stderr, exit code 2, and no run directory."""

import subprocess
import sys

import pytest

from jaxdist.config import load_config
from jaxdist.errors import ConfigError, MeshError
from jaxdist.mesh import parse_mesh
from jaxdist.train import main

BAD_INPUTS = {
    "unknown mesh axis": (["--mesh", "data=2,expert=4"], "unknown axis 'expert'"),
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
    "unknown key": (["model.n_layer=2"], "unknown config key 'model.n_layer'"),
    "unknown section": (["optim.lr=2"], "unknown config key 'optim'"),
    "wrong type": (["model.n_layers=two"], "model.n_layers: expected int, got 'two'"),
    "bool for int": (["train.steps=true"], "train.steps: expected int"),
    "bad enum": (["model.dtype=float16"], "model.dtype must be"),
    "not key=value": (["model.n_layers"], "not of the form key=value"),
    "missing config file": (["--config", "/nonexistent/cfg.yaml"], "not found"),
    "unknown preset": (["--config", "no-such-preset"], "presets:"),
    "unknown flag": (["--meshh", "8"], "unrecognized arguments"),
    "strategy tp without tensor axis": (["--mesh", "data=2", "parallel.strategy=fsdp+tp"], "no tensor axis"),
    "resnet on tensor axis": (["--config", "resnet", "--mesh", "data=2,tensor=2"], "not tensor"),
}


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
        ("8x4", {"data": 8, "pipe": 1, "fsdp": 1, "tensor": 4}),
        ("8", {"data": 8, "pipe": 1, "fsdp": 1, "tensor": 1}),
        ("data=2,fsdp=2,tensor=2", {"data": 2, "pipe": 1, "fsdp": 2, "tensor": 2}),
        ("fsdp=4", {"data": 1, "pipe": 1, "fsdp": 4, "tensor": 1}),
    ],
)
def test_mesh_specs(spec, sizes):
    assert parse_mesh(spec) == sizes
    assert parse_mesh("auto") is None


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
    assert proc.stderr.strip() == "jaxdist: error: mesh 'foo=2': unknown axis 'foo' (axes: data, pipe, fsdp, tensor)"
