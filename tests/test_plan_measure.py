"""jaxdist.plan.measure: the on-the-spot ``cpu-local`` profile (timings, the latency +
bandwidth fit, subprocess clean-up, the per-host cache, the CLI)."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import psutil
import pytest

from jaxdist.plan import allreduce, measure


def _new_children(before: set[int]) -> list[psutil.Process]:
    """Children of this process that did not exist before (zombies included: unreaped is left behind)."""
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in before]


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


# ----------------------------------------------------------------------------- the fit


def test_fit_recovers_known_parameters():
    latency, bandwidth = 37e-6, 2.5e9
    sizes = [4096.0 * 8**k for k in range(6)]
    points = [(ring_bytes, latency + ring_bytes / bandwidth) for ring_bytes in (measure.ring_wire_bytes(s, 4) for s in sizes)]
    got_latency, got_bandwidth = measure.fit_latency_bandwidth(points)
    assert got_latency == pytest.approx(latency, rel=1e-6)
    assert got_bandwidth == pytest.approx(bandwidth, rel=1e-6)


def test_fit_clamps_negative_latency_and_rejects_no_signal():
    # exact line through the origin plus noise that would give a negative intercept
    points = [(1e3, 0.9e-6), (1e6, 1e-3), (1e7, 1e-2)]
    latency, bandwidth = measure.fit_latency_bandwidth(points)
    assert latency == 0.0
    assert bandwidth == pytest.approx(1e9, rel=0.05)
    with pytest.raises(ValueError, match="does not grow"):
        measure.fit_latency_bandwidth([(1e3, 2e-3), (1e6, 1e-3)])
    with pytest.raises(ValueError, match="distinct sizes"):
        measure.fit_latency_bandwidth([(1e3, 1e-3), (1e3, 2e-3)])


def test_ring_wire_bytes():
    assert measure.ring_wire_bytes(1000, 2) == 1000
    assert measure.ring_wire_bytes(1000, 4) == 1500
    assert measure.ring_wire_bytes(1000, 1) == 0


def test_best_time_warms_up_and_respects_repeats():
    calls = []
    best, times = measure.best_time(lambda: calls.append(time.perf_counter()), repeats=4, budget_s=10.0)
    assert len(calls) == 5  # one warm-up + four timed
    assert len(times) == 4 and best == min(times) >= 0


# ----------------------------------------------------------------------------- a real quick measurement


@pytest.fixture(scope="module")
def quick_profile():
    before = _children()
    profile = measure.measure_host(quick=True, timeout_s=60)
    return profile, _new_children(before)


def _numpy_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of np.dot (BLAS: a path independent of XLA), best of the repeats after a warm-up."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    np.dot(a, a)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.dot(a, a)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


@pytest.mark.heavy
def test_quick_profile_is_sane(quick_profile):
    profile, leftovers = quick_profile
    assert leftovers == []
    keys = [
        "matmul_flops_per_s",
        "matmul_flops_per_s_bf16",
        "memory_bytes_per_s",
        "collective_latency_s",
        "collective_bytes_per_s",
        "fake_device_collective_latency_s",
        "fake_device_collective_bytes_per_s",
    ]
    for key in keys:
        value = profile[key]
        assert isinstance(value, float) and math.isfinite(value), key
        assert value > 0 or (key.endswith("latency_s") and value >= 0), (key, value)
    assert 1e8 <= profile["matmul_flops_per_s"] <= 1e13
    assert 1e8 <= profile["memory_bytes_per_s"] <= 1e13
    assert profile["collective_latency_s"] < 1.0 and profile["fake_device_collective_latency_s"] < 1.0
    # a noisy shared machine: only a factor of 20 either way against BLAS
    ratio = profile["matmul_flops_per_s"] / _numpy_matmul_flops()
    assert 1 / 20 < ratio < 20, ratio
    assert profile["cores"] >= 1 and f"{profile['cores']} cores" in profile["host"]
    assert profile["quick"] is True
    assert set(profile["threads"]) == {"OMP_NUM_THREADS", "XLA_FLAGS"}
    # the raw points: matmuls at both sizes and dtypes, one all-reduce point per size
    expected = {(n, d) for n in (512, 1024) for d in ("float32", "bfloat16")} | {(n, "float32") for n in measure.QUICK["curve_sides"]}
    assert {(p["n"], p["dtype"]) for p in profile["raw"]["matmul"]} == expected
    # what the cost model uses on this host: the size curve (small matmuls slower), per-op time, fusion bandwidth
    curve = sorted(profile["matmul_curve"])
    assert len(curve) == len(measure.QUICK["curve_sides"]) + 2 and curve[0][1] < curve[-1][1]
    # each in a plausible range on its own: the fusion and the streaming copy are timed at different
    # moments, and under the suite's other workers one of them can run 5x slower than the other (a
    # loaded fresh-clone run: a copy at 1.0 GB/s against fusions at 4.9), so they are not compared
    assert 0 < profile["op_overhead_s"] < 1e-3 and 1e8 <= profile["fusion_bytes_per_s"] <= 1e13
    for key in ("all_reduce_gloo", "all_reduce_fake_devices"):
        assert [b for b, _ in profile["raw"][key]] == [float(s) for s in measure.QUICK["collective_bytes"]]
        assert all(t > 0 for _, t in profile["raw"][key])
    assert json.loads(json.dumps(profile)) == {**profile, "raw": json.loads(json.dumps(profile["raw"]))}


# ----------------------------------------------------------------------------- subprocess clean-up


@pytest.mark.heavy
def test_failed_worker_is_reported_and_all_are_reaped(monkeypatch):
    """Process 1 fails at once; process 0 would wait for it at the coordinator forever:
    one line names the failure, and both are gone afterwards."""
    real = allreduce._worker_command

    def broken_second(args):
        args = list(args)
        if args[2] == 1:  # [mode, n, process_id, ...]
            args[0] = "bogus"
        return real(args)

    monkeypatch.setattr(allreduce, "_worker_command", broken_second)
    before = _children()
    with pytest.raises(RuntimeError) as info:
        measure.measure_collective("gloo", 2, [4096, 65536], repeats=2, timeout_s=60)
    message = str(info.value)
    assert "\n" not in message
    assert "process 1 exited with code" in message and "unknown worker mode" in message
    assert _new_children(before) == []


def test_timeout_kills_and_reaps_workers():
    before = _children()
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"timed out after 0\.3s"):
        measure.measure_collective("gloo", 2, [4096, 65536], repeats=2, timeout_s=0.3)
    assert time.perf_counter() - t0 < 10
    assert _new_children(before) == []


def test_worker_env_sets_its_own_devices(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_cpu_use_thunk_runtime=true")
    env = allreduce.worker_env(1)
    assert env["XLA_FLAGS"].split() == ["--xla_cpu_use_thunk_runtime=true", "--xla_force_host_platform_device_count=1"]
    assert env["JAX_PLATFORMS"] == "cpu"


# ----------------------------------------------------------------------------- the cache and the CLI


@pytest.fixture
def fake_measure(monkeypatch):
    """``measure_host`` replaced by a counter that returns a small profile of this host."""
    calls = []

    def fake(*, quick=False, processes=2, timeout_s=120.0):
        calls.append(quick)
        return {
            "name": "cpu-local",
            "matmul_flops_per_s": 1e11 + len(calls),
            "matmul_flops_per_s_bf16": 5e10,
            "memory_bytes_per_s": 2e10,
            "collective_latency_s": 5e-4,
            "collective_bytes_per_s": 1e9,
            "fake_device_collective_latency_s": 1e-4,
            "fake_device_collective_bytes_per_s": 5e9,
            "matmul_curve": [[2 * 64**3, 5e9], [2 * 1024**3, 1e11]],
            "op_overhead_s": 1e-6,
            "fusion_bytes_per_s": 1e10,
            "collective_processes": processes,
            "cores": measure.cpu_count(),
            "host": measure.host_string(),
            "quick": quick,
            "threads": {"OMP_NUM_THREADS": None, "XLA_FLAGS": None},
            "measured_at": "2026-01-01T00:00:00+00:00",
            "raw": {"all_reduce_gloo": [[4096.0, 1e-3]]},
        }

    monkeypatch.setattr(measure, "measure_host", fake)
    return calls


def test_load_or_measure_caches_per_host(tmp_path, fake_measure):
    cache = tmp_path / "sub" / "cpu-local.json"
    first = measure.load_or_measure(cache)
    assert fake_measure == [False] and cache.exists()
    second = measure.load_or_measure(cache)
    assert fake_measure == [False] and second == first == json.loads(cache.read_text())
    # a quick request is answered by the full profile; refresh measures again
    assert measure.load_or_measure(cache, quick=True) == first and len(fake_measure) == 1
    refreshed = measure.load_or_measure(cache, refresh=True)
    assert len(fake_measure) == 2 and refreshed["matmul_flops_per_s"] != first["matmul_flops_per_s"]
    # another host (or core count) in the cache: measured again and overwritten
    cache.write_text(json.dumps({**refreshed, "host": "Some Other CPU, 96 cores, jax 0.10.2"}))
    again = measure.load_or_measure(cache)
    assert len(fake_measure) == 3 and again["host"] == measure.host_string()
    cache.write_text(json.dumps({**again, "cores": again["cores"] + 1}))
    measure.load_or_measure(cache)
    assert len(fake_measure) == 4
    # an unreadable cache is measured over, not an error
    cache.write_text("{not json")
    measure.load_or_measure(cache)
    assert len(fake_measure) == 5 and json.loads(cache.read_text())["host"] == measure.host_string()
    assert [p.name for p in cache.parent.iterdir()] == ["cpu-local.json"]  # no temporary file left


def test_quick_cache_does_not_answer_a_full_request(tmp_path, fake_measure):
    cache = tmp_path / "cpu-local.json"
    measure.load_or_measure(cache, quick=True)
    measure.load_or_measure(cache, quick=True)
    assert fake_measure == [True]
    assert measure.load_or_measure(cache)["quick"] is False
    assert fake_measure == [True, False]


def test_default_cache_follows_env(tmp_path, monkeypatch, fake_measure):
    monkeypatch.setenv(measure.ENV_CACHE_DIR, str(tmp_path))
    assert measure.default_cache() == tmp_path / "cpu-local.json"
    measure.load_or_measure()
    assert (tmp_path / "cpu-local.json").exists()
    monkeypatch.delenv(measure.ENV_CACHE_DIR)
    assert str(measure.default_cache()).endswith(".cache/jaxdist/cpu-local.json")


def test_cli_prints_json_and_table(tmp_path, fake_measure, capsys):
    cache = tmp_path / "cpu-local.json"
    assert measure.main(["--json", "--cache", str(cache)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(cache.read_text())
    assert measure.main(["--cache", str(cache)]) == 0
    table = capsys.readouterr().out
    assert "matmul fp32" in table and "100.00 GFLOP/s" in table and "gloo" in table
    assert fake_measure == [False]  # the second call read the cache


def test_unwritable_cache_still_returns_the_profile(tmp_path, fake_measure, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    profile = measure.load_or_measure(blocker / "cpu-local.json")
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"jaxdist: warning: could not write the profile cache {blocker / 'cpu-local.json'}: "), line
    assert profile["host"] == measure.host_string() and fake_measure == [False]


def test_a_profile_from_an_older_jaxdist_is_measured_again(tmp_path, fake_measure):
    cache = tmp_path / "cpu-local.json"
    old = measure.load_or_measure(cache)
    del old["fusion_bytes_per_s"]  # written before the fusion benchmark existed
    cache.write_text(json.dumps(old))
    assert "fusion_bytes_per_s" in measure.load_or_measure(cache) and len(fake_measure) == 2
