"""Test set-up: 8 fake CPU devices, requested before JAX starts its backend, XLA flags
that make compiling cheap, and one XLA compilation cache for the whole session.

The cache is shared by both xdist workers and every process a test starts (launchers,
trainers, CLIs inherit the environment): the suite compiles a few dozen small programs
again and again (each elastic generation, each restart, each CLI run of the same
config), and a hit skips XLA's compile. It lives in a private temporary directory made
for this session and removed after it, so every session starts cold.
"""

import collections
import gc
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import pytest

# Tests compile cheaply: the suite is compile-bound (a tiny model's train step compiles in
# seconds and runs in milliseconds). LLVM's optimisation off and XLA:CPU's older loop emitters
# instead of its MLIR fusion emitters together halve XLA:CPU's compile time (a train step on
# three meshes: 11.9 s of CPU with -O0 alone, 6.0 s with both). They move results in the last
# bits, so every process of a session uses them (helpers.subprocess_env keeps them for the
# processes tests start); benchmarks and helpers.long_runs do not. A JAX whose XLA no longer
# knows a flag would abort at start-up on it: the flags are tried once, in a child process.
WANTED_TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
_FLAGS_ENV = "JAXDIST_TEST_XLA_FLAGS"  # the accepted ones, found by the first process (xdist's controller)


def _accepted(flags: tuple[str, ...]) -> str:
    import subprocess

    def ok(tried: str) -> bool:
        env = {**os.environ, "XLA_FLAGS": tried, "JAX_PLATFORMS": "cpu"}
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, timeout=120)
        return probe.returncode == 0

    return " ".join(flags) if ok(" ".join(flags)) else " ".join(f for f in flags if ok(f))


if _FLAGS_ENV not in os.environ:
    os.environ[_FLAGS_ENV] = _accepted(WANTED_TEST_XLA_FLAGS)
TEST_XLA_FLAGS = os.environ[_FLAGS_ENV]
os.environ["XLA_FLAGS"] = " ".join(
    [
        re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")),
        TEST_XLA_FLAGS,
        "--xla_force_host_platform_device_count=8",
    ]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Packages the suite's processes run without (tests/hidden says why): first on the path of this
# process and of every process it starts (xdist's workers, launchers, trainers, CLIs).
HIDDEN = str(Path(__file__).with_name("hidden") / "everywhere")
if HIDDEN not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HIDDEN, os.environ.get("PYTHONPATH")]))
if HIDDEN not in sys.path:  # an xdist worker starts with the variable but not the path
    sys.path.insert(0, HIDDEN)
# XLA:CPU sizes its execution thread pool max(NPROC or the core count, devices): on 2 cores,
# exactly one thread per fake device. A host callback that runs a computation of its own
# (Pallas' interpreter inside a shard_map, tests/test_moe_gpu.py) then waits for a thread that
# every device's execution holds, and hangs the worker about one run in two on 8 devices. One
# spare thread removes the deadlock.
os.environ.setdefault("NPROC", "9")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_OWN_CACHE = None  # the directory this (controller) process made, removed at the end


def pytest_configure(config):
    """In the controller (or a run without xdist), before any worker or JAX starts."""
    global _OWN_CACHE
    if hasattr(config, "workerinput") or os.environ.get(CACHE_ENV):
        return  # an xdist worker inherits the controller's; a cache given from outside is kept
    _OWN_CACHE = tempfile.mkdtemp(prefix="jaxdist-tests-xla-cache-")  # mode 0700
    os.environ[CACHE_ENV] = _OWN_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # small programs too: most of the suite's are
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    # fetched checkpoints, tokenized corpora (shared by every process of the session): never the user's home
    os.environ.setdefault("JAXDIST_CACHE", os.path.join(_OWN_CACHE, "jaxdist"))
    # Python's default, bytecode in __pycache__ (git ignores it): with PYTHONDONTWRITEBYTECODE
    # (set on this project's machines) each of the few hundred trainers, launchers and CLIs the
    # suite starts compiled jaxdist's sources again (0.15 s of CPU each).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# Seconds each test file took in a recorded full run (``--record-file-seconds`` rewrites it):
# the files are handed out longest first, so the run ends on short files, not on one long
# file while the other worker idles.
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
_seconds: collections.Counter = collections.Counter()


def pytest_addoption(parser):
    parser.addoption("--record-file-seconds", action="store_true", help=f"write each test file's total seconds to {FILE_SECONDS.name}")
    parser.addoption(
        "--record-cpu-seconds",
        metavar="PATH",
        help="append each test's CPU seconds (its worker's and every process it started and waited for) to PATH, one JSON line each",
    )


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Where the suite's CPU goes (wall seconds hide it: three workers share two cores)."""
    path = item.config.getoption("--record-cpu-seconds")
    before = _cpu_seconds() if path else 0.0
    yield
    if path:
        with open(path, "a") as out:  # one short write per line: the workers' lines do not interleave
            out.write(json.dumps({"test": item.nodeid, "cpu_s": round(_cpu_seconds() - before, 2)}) + "\n")


def pytest_collection_modifyitems(config, items):
    """Longest recorded files first (a file not on record: by its heavy tests, then as a
    median file), so that with one file per worker (``-n 2 --dist loadfile``) the short
    files fill in at the end."""
    recorded = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
    median = statistics.median(recorded.values()) if recorded else 0.0
    heavy = collections.Counter(item.path for item in items if item.get_closest_marker("heavy"))

    def cost(item) -> float:
        name = item.path.name
        return recorded.get(name, median + 60.0 * heavy[item.path])

    items.sort(key=lambda item: -cost(item))  # stable: a file's tests keep their order


def pytest_collection_finish(session):
    """A worker traces and compiles for the whole session in one process: what imports and
    collection built is frozen out of the garbage collector's passes, and a collection waits for
    20,000 new objects, not 700 (a trace makes many that live briefly). Two test files in one
    process: 81.4 -> 75.8 s of CPU, the collector's share 4.2 -> 1.2 s."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


def pytest_runtest_logreport(report):
    _seconds[Path(report.nodeid.split("::")[0]).name] += report.duration  # setup, call and teardown


def pytest_sessionfinish(session):
    if session.config.getoption("--record-file-seconds") and not hasattr(session.config, "workerinput") and _seconds:
        FILE_SECONDS.write_text(json.dumps({k: round(v, 1) for k, v in sorted(_seconds.items(), key=lambda kv: -kv[1])}, indent=1) + "\n")


_bucket_numbers = iter(range(10**6))


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 server on 127.0.0.1 for this worker's session (tests/s3_server.py)."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[dev]')")
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[dev]')")
    from s3_server import s3_server

    with s3_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A new, empty bucket on the session's S3 server: its ``s3://`` URL."""
    import s3fs

    name = f"jaxdist-test-{os.getpid()}-{next(_bucket_numbers)}"
    s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True).mkdir(name)
    return f"s3://{name}"
