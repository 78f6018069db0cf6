"""``python -m jaxdist.commbench``: the byte counts XLA's compiled collectives move, nccl-tests'
bus bandwidth, a complete table, the planner's side (its datasheet column and the link
profile it reads back), one line for bad input, and a 2-process sweep under jaxdist.launch."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import psutil
import pytest

from jaxdist import commbench as cli
from jaxdist.inspect.collectives import collective_ops
from jaxdist.inspect.hlo import NAME_RE, parse_hlo, shape_bytes
from jaxdist.layout.mesh import build_mesh, parse_mesh
from jaxdist.plan import link_bench as commbench
from jaxdist.plan.hardware import load_hardware
from jaxdist.plan.link_profile import read_link_profile, with_links

from helpers import subprocess_env

REPO = Path(__file__).resolve().parent.parent
# Start JAX's backend with conftest's 8 fake devices now: run first, commbench would ask for as many
# as its mesh needs (data=16 would then get 16, not "needs 16 devices but 8").
assert len(jax.devices()) == 8
MESH = "data=2,tensor=4"  # two axes, of 2 and 4 devices: 2(n-1)/n and (n-1)/n differ on both
# 64 KiB to 1 MiB: a 16x range, so that the all-reduce time grows with size on CPU even while the
# other test worker loads both cores (over 64K:256K a busy neighbour's noise could hide the growth)
SIZES = tuple(2**k * 2**10 for k in range(6, 11))
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# nccl-tests' doc/PERFORMANCE.md, written out here rather than taken from the code under test:
# busbw / algbw for n ranks, and the ring steps the planner's latency term counts.
NCCL_BUS_FACTOR = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1,
}
RING_STEPS = {"all-reduce": lambda n: 2 * (n - 1), "collective-permute": lambda n: 1}


def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One in-process sweep over 8 fake CPU devices, with the table and the link profile it wrote."""
    path = tmp_path_factory.mktemp("commbench") / "links.json"
    argv = ["--mesh", MESH, "--sizes", "64K:1M", "--iters", "3", "--warmup", "1", "--hardware", "h100", "--out", str(path)]
    code, out, err = _run_cli(argv)
    assert code == 0, err
    return {"table": out, "stderr": err, "profile": json.loads(path.read_text()), "path": path}


def test_the_table_has_every_axis_kind_and_size(sweep):
    rows = sweep["profile"]["results"]
    expected = {(axis, kind, size) for axis in ("data", "tensor") for kind in KINDS for size in SIZES}
    assert {(r["axis"], r["kind"], r["bytes"]) for r in rows} == expected
    assert len(rows) == len(expected)
    printed = [line.split() for line in sweep["table"].splitlines() if line.startswith("  ") and line.split()[0] in KINDS]
    assert len(printed) == len(expected)  # one printed line per row
    for axis, n in (("data", 2), ("tensor", 4)):
        assert f"axis {axis} ({n} devices, intra-node link)" in sweep["table"]


def test_byte_counts_are_what_the_compiled_collectives_move(sweep):
    """S per row against XLA's compiled program: the payload inspect.collectives reads from
    the HLO (larger of operand and result), the operand and result sizes nccl-tests' S
    implies for each kind, the group size, and the ring wire bytes inspect.wire derives
    from them equal busbw x time."""
    mesh = build_mesh(parse_mesh(MESH), jax.devices()[:8])
    shape = {a: int(mesh.shape[a]) for a in mesh.axis_names}
    for row in sweep["profile"]["results"]:
        kind, n, size = row["kind"], row["group_size"], row["bytes"]
        fn, x = commbench.program(mesh, row["axis"], kind, size // 4)
        text = fn.lower(x).compile().as_text()
        module = parse_hlo(text)
        (op,) = collective_ops(module, shape)
        group = mesh.size if kind == "collective-permute" else n  # a permute's pairs: every device sends, along the axis only
        assert (op.kind, op.group_size, op.axes, op.bytes) == (kind, group, (row["axis"],), size), row
        instruction = next(i for body in module.computations.values() for i in body if i.name == op.name)
        operand = sum(shape_bytes(module.shapes[NAME_RE.match(o.split()[-1]).group(1)]) for o in instruction.operands)
        result = shape_bytes(instruction.shape)
        want = {"all-gather": (size // n, size), "reduce-scatter": (size, size // n)}.get(kind, (size, size))
        assert (operand, result) == want, row
        assert math.isclose(row["busbw"] * row["time_s"], op.wire_bytes, rel_tol=1e-6), row  # bus bytes = ring wire bytes
        assert math.isclose(row["algbw"], size / row["time_s"], rel_tol=1e-9)
        assert math.isclose(row["busbw"] / row["algbw"], NCCL_BUS_FACTOR[kind](n), rel_tol=1e-9)


def test_the_planner_column_is_the_datasheet_link(sweep):
    """h100's intra-node link (450 GB/s x 0.8, 8 us per ring step), priced by hand."""
    for row in sweep["profile"]["results"]:
        kind, n = row["kind"], row["group_size"]
        bus_bytes = row["bytes"] * NCCL_BUS_FACTOR[kind](n)
        steps = RING_STEPS.get(kind, lambda n: n - 1)(n)
        assert math.isclose(row["planner_time_s"], steps * 8e-6 + bus_bytes / (450e9 * 0.8), rel_tol=1e-9), row
        assert math.isclose(row["datasheet_bytes_per_s"], 360e9)
    assert "planner profile h100: 450 GB/s x 0.8, 8 us per ring step" in sweep["table"]


def test_the_link_profile_round_trips_into_the_planner(sweep):
    """The planner reads the intra-node link commbench fitted: its all-reduce points, fitted
    again here by numpy (time = latency + wire / bandwidth, relative error), give the same link."""
    profile = sweep["profile"]
    fitted = profile["links"]["intra_node"]
    assert set(profile["links"]) == {"intra_node"}  # one process: nothing crosses nodes
    assert (fitted["axis"], fitted["group_size"]) == ("tensor", 4)
    rows = [r for r in profile["results"] if r["axis"] == "tensor" and r["kind"] == "all-reduce"]
    assert fitted["all_reduce"] == [[r["bytes"], r["time_s"]] for r in rows]
    wire = np.array([1.5 * r["bytes"] for r in rows])
    t = np.array([r["time_s"] for r in rows])
    slope, intercept = np.polyfit(wire, t, 1, w=1 / t)
    if intercept < 0:  # the fit's rule: latency >= 0, the best line through the origin
        slope, intercept = np.sum(wire * t / t**2) / np.sum(wire**2 / t**2), 0.0
    assert math.isclose(fitted["bytes_per_s"], 1 / slope, rel_tol=1e-6)
    assert math.isclose(fitted["latency_s"], intercept, rel_tol=1e-6, abs_tol=1e-12)
    links = read_link_profile(sweep["path"])
    assert set(links) == {"intra_node"}
    assert math.isclose(links["intra_node"].bandwidth, 1 / slope, rel_tol=1e-6)
    assert math.isclose(links["intra_node"].latency, intercept / 6, rel_tol=1e-6, abs_tol=1e-12)  # 2(n-1) ring steps
    hardware = with_links(load_hardware("h100"), links, str(sweep["path"]))
    assert hardware.intra_node == links["intra_node"] and hardware.inter_node == load_hardware("h100").inter_node


def test_the_planner_takes_links_and_rejects_a_bad_file_in_one_line(sweep, tmp_path):
    from jaxdist.plan.__main__ import main as plan_main

    bad = tmp_path / "bad.json"
    for text in ("{not json", json.dumps({"format": "jaxdist-link-profile", "version": 1, "links": {"intra_node": {"latency_s": -1}}})):
        bad.write_text(text)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = plan_main(["--gpus", "8", "--hardware", "h100", "--links", str(bad)])
        assert code == 2 and len(err.getvalue().splitlines()) == 1 and err.getvalue().startswith("jaxdist: error: --links"), err.getvalue()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--sizes", "2K:1K"], "larger than the last"),
        (["--sizes", "1X"], "not a size"),
        (["--sizes", "3K:3K"], "no power of 2"),
        (["--sizes", "0"], ">= 1 byte"),
        (["--mesh", "data=2,bogus=2"], "unknown axis 'bogus'"),
        (["--mesh", "data=16"], "needs 16 devices but 8"),
        (["--mesh", "data=1"], "nothing to measure"),
        (["--iters", "0"], "--iters must be >= 1"),
        (["--hardware", "tpu9"], "unknown hardware"),
        (["--out", "/nonexistent-dir/links.json"], "--out /nonexistent-dir/links.json: no directory"),
        (["--json", "/nonexistent-dir/links.json"], "--json /nonexistent-dir/links.json: no directory"),  # the old spelling of --out
        (["--json", "a.json", "--out", "b.json"], "--out PATH writes the profile"),
        (["--out", "links.json"], "a link profile needs two sizes or more per axis"),  # --sizes 4K: one point per axis
        (["--mesh", "tensor=4", "--sizes", "1:8", "--out", "links.json"], "two sizes or more"),  # four sizes, one buffer
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, says):
    code, out, err = _run_cli([*argv, "--sizes", "4K"] if "--sizes" not in argv else argv)
    assert code == 2 and out == "", (code, out, err)
    assert err.count("\n") == 1 and err.startswith("jaxdist: error: ") and says in err, err


def test_cpu_local_without_a_cached_profile_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDIST_CACHE_DIR", str(tmp_path))  # an empty cache: measuring would start JAX before the join
    code, _, err = _run_cli(["--mesh", "data=2", "--sizes", "4K", "--hardware", "cpu-local"])
    assert code == 2 and err.count("\n") == 1 and "no cpu-local profile of this host is cached" in err, err


def test_on_cpu_the_planner_column_is_this_hosts_cached_profile_or_says_it_is_left_out(tmp_path, monkeypatch):
    from jaxdist.plan.measure import cpu_count, host_string

    monkeypatch.setenv("JAXDIST_CACHE_DIR", str(tmp_path))
    argv = ["--mesh", "data=2", "--sizes", "4K:8K", "--iters", "1", "--warmup", "0"]
    code, out, err = _run_cli(argv)
    assert code == 0 and "planner busbw" not in out
    assert [line for line in err.splitlines() if "planner" in line] == [
        f"jaxdist: warning: the planner's column is left out: no cpu-local profile of this host is cached in {tmp_path / 'cpu-local.json'} "
        "(python -m jaxdist.plan.measure writes it; or pass --hardware)"
    ]
    profile = {  # a cached cpu-local profile of this host: 2-device all-reduce fits of 100 us + 1 GB/s (fake devices)
        "host": host_string(),
        "cores": cpu_count(),
        "quick": True,
        "matmul_flops_per_s": 1e10,
        "matmul_curve": [],
        "op_overhead_s": 1e-6,
        "fusion_bytes_per_s": 1e10,
        "memory_bytes_per_s": 1e10,
        "fake_device_collective_latency_s": 100e-6,
        "fake_device_collective_bytes_per_s": 1e9,
        "collective_latency_s": 300e-6,
        "collective_bytes_per_s": 0.5e9,
    }
    (tmp_path / "cpu-local.json").write_text(json.dumps(profile))
    # the library's report (no link profile: two sizes timed once may not grow, and then there is no file to read)
    report, hardware = commbench.commbench("data=2", commbench.Sweep((4096, 8192), 1, 0), None, None)
    assert "planner profile cpu-local: 1 GB/s x 1, 50 us per ring step" in commbench.format_report(report, hardware)
    for row in report["results"]:
        bus_bytes = row["bytes"] * NCCL_BUS_FACTOR[row["kind"]](2)
        steps = RING_STEPS.get(row["kind"], lambda n: n - 1)(2)
        assert math.isclose(row["planner_time_s"], steps * 50e-6 + bus_bytes / 1e9, rel_tol=1e-9), row


def test_sizes_that_round_to_one_buffer_are_measured_once_and_said_so():
    """1 to 8 bytes over 4 devices are all one float32 element per device (16 bytes): one row per
    collective, not four of the same measurement, and one line naming the rounding."""
    code, out, err = _run_cli(["--mesh", "tensor=4", "--sizes", "1:8", "--iters", "1", "--warmup", "0", "--hardware", "h100"])
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if line.startswith("  ") and line.split()[0] in KINDS]
    assert sorted(r[0] for r in rows) == sorted(KINDS) and {r[1] for r in rows} == {"16"}
    notes = [line for line in err.splitlines() if "rounded" in line or "->" in line]
    assert len(notes) == 1 and notes[0].startswith("jaxdist: note: ") and "tensor=4: 1/2/4/8 -> 16" in notes[0], err


def _fake_times(monkeypatch, times):
    """Every point "measured" at the next of ``times`` (no timing: the CLI's plumbing is under test)."""
    it = iter(times)
    monkeypatch.setattr(commbench, "median_time", lambda run, **_: next(it))


@pytest.mark.parametrize("flag", ["--out", "--json"])
def test_a_profile_with_no_link_is_an_error_and_nothing_is_written(flag, tmp_path, monkeypatch):
    """All-reduce times that do not grow with size fit no link: the planner could not read the
    file, so none is written (also under the old spelling --json PATH), in one line, exit 2."""
    _fake_times(monkeypatch, itertools.repeat(1e-3))
    path = tmp_path / "links.json"
    code, out, err = _run_cli(
        ["--mesh", "data=2", "--sizes", "4K:8K", "--iters", "1", "--warmup", "0", "--hardware", "h100", flag, str(path)]
    )
    assert code == 2 and not path.exists() and not list(tmp_path.iterdir()), (code, err)
    assert [line for line in err.splitlines() if line.startswith("jaxdist: error")] == [err.splitlines()[-1]]
    assert err.splitlines()[-1].startswith(
        "jaxdist: error: no link profile written: the intra_node link (data) is left out of the profile: its all-reduce time does not grow"
    ), err
    assert "warning: the intra_node link" not in err  # said once, in the error


def test_json_prints_the_profile_out_writes_it_and_json_path_still_writes_it(tmp_path, monkeypatch):
    """--json prints one JSON object on stdout (as every jaxdist CLI's --json; no table), --out PATH
    writes the same profile, and --json PATH (the old spelling of --out) writes it with one deprecation line."""
    _fake_times(monkeypatch, (1e-4 * k for k in itertools.count(1)))  # growing with size: a link fits
    argv = ["--mesh", "data=2", "--sizes", "4K:8K", "--iters", "1", "--warmup", "0", "--hardware", "h100"]
    code, out, err = _run_cli([*argv, "--json", "--out", str(tmp_path / "a.json")])
    assert code == 0, err
    printed = json.loads(out)  # the whole of stdout is one object
    assert printed == json.loads((tmp_path / "a.json").read_text()) and printed["format"] == "jaxdist-link-profile"
    assert set(read_link_profile(tmp_path / "a.json")) == {"intra_node"} and "deprecated" not in err
    code, out, err = _run_cli([*argv, "--json", str(tmp_path / "b.json")])
    assert code == 0 and "axis data (2 devices, intra-node link)" in out, err  # the table, as with --out
    assert json.loads((tmp_path / "b.json").read_text())["links"]["intra_node"]["axis"] == "data"
    assert [line for line in err.splitlines() if "deprecated" in line] == [
        f"jaxdist: warning: --json PATH is deprecated: --out {tmp_path / 'b.json'} writes the link profile, --json alone prints it"
    ]


def test_the_planner_says_when_the_links_were_measured_on_other_devices(sweep, monkeypatch):
    """A profile measured on fake CPU devices priced into an H100 plan: legal, said in one line;
    links measured on the plan's own kind of device say nothing."""
    import dataclasses

    import jaxdist.plan.search as search
    from jaxdist.plan.__main__ import main as plan_main

    def not_compiled(config, **kwargs):  # the warning comes before any compile: none is needed
        raise RuntimeError("not compiled in this test")

    monkeypatch.setattr(search, "compile_summary", not_compiled)
    tiny = ["data.source=synthetic", "model.d_model=64", "model.n_layers=2", "model.n_heads=8", "model.n_kv_heads=4"]
    tiny += ["train.seq_len=32", "train.global_batch=16"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = plan_main(["--gpus", "2", "--hardware", "h100", "--max-compiles", "1", "--links", str(sweep["path"]), *tiny])
    assert code == 0, err.getvalue()
    said = [line for line in err.getvalue().splitlines() if "measured on" in line]
    assert said == [
        f"jaxdist: warning: --links {sweep['path']} was measured on 8 cpu devices, not on the plan's H100 SXM 80GB: its links price this plan's collectives"
    ]
    from jaxdist.plan.link_profile import measured_elsewhere

    h100 = load_hardware("h100")
    cpu_local = dataclasses.replace(h100, key="cpu-local")
    assert measured_elsewhere({"platform": "cpu", "device_kind": "cpu", "devices": 8}, cpu_local) is None
    assert measured_elsewhere({"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3", "devices": 8}, h100) is None
    assert measured_elsewhere({"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3"}, load_hardware("h100-hbm2e")) is None
    assert "NVIDIA A100" in measured_elsewhere({"platform": "gpu", "device_kind": "NVIDIA A100-SXM4-80GB"}, h100)
    assert "H100" in measured_elsewhere({"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3"}, cpu_local)


def test_a_bad_size_from_the_command_line_exits_2_before_jax_starts():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxdist.commbench", "--sizes", "64M:1K"], env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["jaxdist: error: --sizes 64M:1K: the first size is larger than the last"]


@pytest.mark.heavy
def test_two_processes_under_the_launcher(tmp_path):
    """2 processes x 2 fake devices under jaxdist.launch: the data axis crosses processes (the
    inter-node link: gloo), tensor stays inside each; the profile carries both links."""
    path = tmp_path / "links.json"
    cmd = [sys.executable, "-m", "jaxdist.launch", "--nproc", "2", "--devices-per-proc", "2", "--module", "jaxdist.commbench", "--"]
    cmd += ["--mesh", "data=2,tensor=2", "--sizes", "64K:1M", "--iters", "3", "--warmup", "1", "--hardware", "h100", "--out", str(path)]
    proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    launcher = psutil.Process(proc.pid)
    try:
        out, _ = proc.communicate(timeout=120)
        children = launcher.children(recursive=True) if launcher.is_running() else []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert not [p for p in children if p.is_running()]
    profile = json.loads(path.read_text())
    assert (profile["processes"], profile["devices"]) == (2, 4)
    rows = profile["results"]
    assert {(r["axis"], r["kind"], r["bytes"]) for r in rows} == {(a, k, s) for a in ("data", "tensor") for k in KINDS for s in SIZES}
    assert {r["axis"]: r["link"] for r in rows} == {"data": "inter_node", "tensor": "intra_node"}
    for r in rows:
        assert math.isclose(r["busbw"] / r["algbw"], NCCL_BUS_FACTOR[r["kind"]](2), rel_tol=1e-9)
    assert "[rank 0] axis data (2 devices, inter-node link)" in out and "[rank 1] axis" not in out  # process 0 prints the table
    # Each link is in the profile, or (gloo on a busy 2-core host can time a larger all-reduce
    # faster than a smaller one) left out in one line that says so: never silently.
    links = read_link_profile(path)  # refuses a profile with no link at all
    assert set(links) == set(profile["links"])
    for name, axis in (("intra_node", "tensor"), ("inter_node", "data")):
        if name in links:
            assert (links[name].bandwidth, profile["links"][name]["axis"]) == (profile["links"][name]["bytes_per_s"], axis)
        else:
            assert f"[rank 0] jaxdist: warning: the {name} link ({axis}) is left out of the profile" in out


def test_commbench_under_an_elastic_launch_is_refused():
    from jaxdist.errors import JaxdistError
    from jaxdist.launch import parse_args

    with pytest.raises(JaxdistError, match="--module jaxdist.commbench"):
        parse_args(["--nproc", "2", "--min-nproc", "1", "--devices-per-proc", "2", "--module", "jaxdist.commbench", "--", "--sizes", "4K"])
