"""Lines native code writes straight to stderr (JAX's CUDA plugin without a GPU, the
coordination service's notice for recoverable tasks) stay out of what a user sees, and only
those: a refused ``analyze --target`` prints its one line alone, and ``--log-level debug``
still shows the plugin's lines."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from jaxdist.cluster.launcher import _pump
from jaxdist.layout.native_output import is_plugin_noise

from helpers import TINY, subprocess_env

# as the CUDA plugin (jax-cuda12-plugin 0.10.2) and the coordination service print them
PREAMBLE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
NO_DRIVER = "I0000 00:00:1796452953.438442   24310 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used."
RECOVERABLE = (
    "W0000 00:00:1796452953.440708   24310 coordination_service.cc:185] The recoverable task feature is experimental "
    "and may change or be removed"
)
KEPT = [
    "E0000 00:00:1796452953.441369   24310 pjrt_client.cc:77] a real error from the same library",
    "jaxdist: error: something to act on",
    "Traceback (most recent call last):",
]


def test_the_noise_is_named_and_nothing_else():
    assert all(is_plugin_noise(line + "\n") for line in (PREAMBLE, NO_DRIVER, RECOVERABLE))
    assert not any(is_plugin_noise(line) for line in KEPT)


def test_a_filtered_descriptor_drops_native_noise_and_keeps_the_rest_in_order():
    """Written with os.write (as C++ would) and print, in one process that exits normally."""
    script = (
        "import os, sys\n"
        "from jaxdist.layout.native_output import hide_plugin_noise\n"
        "hide_plugin_noise(debug=False)\n"
        f"lines = {[PREAMBLE, KEPT[0], NO_DRIVER, KEPT[1], RECOVERABLE]!r}\n"
        "for i, line in enumerate(lines):\n"
        "    os.write(2, (line + '\\n').encode()) if i % 2 == 0 else print(line, file=sys.stderr, flush=True)\n"
        f"print({KEPT[2]!r}, file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr.splitlines() == KEPT, proc.stderr


def test_the_launcher_drops_the_coordination_services_notice_from_its_processes_output():
    out = io.StringIO()
    _pump(0, io.StringIO(f"{RECOVERABLE}\nstep 1\n"), out)
    assert out.getvalue() == "[rank 0] step 1\n"


def test_the_launcher_drops_the_resource_trackers_warnings_after_a_kill_and_keeps_other_warnings():
    """Seen in a random-kill run: a process whose Grain worker shared memory with a killed peer
    warns of leaked semaphores as it exits (Python frees them); other warnings are kept."""
    leaked = (
        "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear to be 25 "
        "leaked semaphore objects to clean up at shutdown\n  warnings.warn('resource_tracker: There appear to be %d '\n"
    )
    other = "/x/y.py:3: UserWarning: something else\n  warnings.warn('something else')\n"
    out = io.StringIO()
    _pump(1, io.StringIO(leaked + "step 2\n" + other), out)
    assert out.getvalue().splitlines() == [
        "[rank 1] step 2",
        "[rank 1] /x/y.py:3: UserWarning: something else",
        "[rank 1]   warnings.warn('something else')",
    ]


def test_the_launcher_drops_a_peers_abort_when_the_coordination_service_dies():
    """Seen in a random-kill run (rank 0 killed): each survivor printed absl's error and fatal
    lines and gRPC's detail before its abort, around the launcher's own line."""
    abort = (
        "E1205 12:09:44.566427   14404 coordination_service_agent.cc:289] Polled an error from coordination service "
        "(this can be an error from this or another task).\n"
        "F1205 12:09:44.566473   14404 client.h:80] Terminating process because the JAX distributed service detected fatal "
        "errors. This most likely indicates that another task died; absl::Status: UNAVAILABLE: Failed to send RPC\n"
        "Additional GRPC error information from remote target coordination_service while calling "
        "/xla.coordination.CoordinationService/PollForError:\n"
        ':UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}\n'
    )
    out = io.StringIO()
    _pump(2, io.StringIO(abort + "E1205 12:09:44.566427   14404 other.cc:1] kept\n"), out)
    assert out.getvalue() == "[rank 2] E1205 12:09:44.566427   14404 other.cc:1] kept\n"


def test_the_launcher_drops_the_abort_stack_only_after_the_coordination_services_loss():
    """Seen in a random-kill run (rank 0 killed during an in-process recovery): the preemption
    notifier's two lines, then absl's check-failure stack under the fatal line. The same stack
    with no such loss before it (a real crash) is kept."""
    preemption = (
        "W1205 17:20:33.130491   24357 preemption_sync_manager.cc:147] Failed to retrieve preemption notice from "
        "coordination service: UNAVAILABLE: Socket closed\n"
        "E1205 17:20:33.130520   24357 preemption_sync_manager.cc:159] Failed to cancel preemption barrier: "
        "FAILED_PRECONDITION: Tried to cancel non-existent barrier PREEMPTION_SYNC_BARRIER. [type.googleapis.com/x='']\n"
    )
    stack = (
        "*** Check failure stack trace: ***\n"
        "    @     0x7fc84f140634  absl::lts_20260107::log_internal::LogMessage::SendToLog()\n"
        "    @     0x7fc84b2040ee  xla::CoordinationServiceAgent::SetError()\n"
    )
    out = io.StringIO()
    _pump(3, io.StringIO(preemption + stack + "step 9\n"), out)
    assert out.getvalue() == "[rank 3] step 9\n"
    out = io.StringIO()
    _pump(3, io.StringIO(stack), out)
    assert len(out.getvalue().splitlines()) == 3, out.getvalue()


# as Python 3.11 prints it in a Grain worker whose parent was killed while it started
ORPHANED_WORKER = """Traceback (most recent call last):
  File "<string>", line 1, in <module>
  File "/usr/lib/python3.11/multiprocessing/spawn.py", line 122, in spawn_main
    exitcode = _main(fd, parent_sentinel)
               ^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/usr/lib/python3.11/multiprocessing/spawn.py", line 132, in _main
    self = reduction.pickle.load(from_parent)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
_pickle.UnpicklingError: pickle data was truncated
"""


def test_the_launcher_drops_an_orphaned_grain_workers_traceback_and_keeps_every_other_in_order():
    other = 'Traceback (most recent call last):\n  File "/x/train.py", line 3, in <module>\n    f()\nValueError: a real one\n'
    out = io.StringIO()
    _pump(1, io.StringIO("step 1\n" + ORPHANED_WORKER + other + "step 2\n"), out)
    assert out.getvalue().splitlines() == ["[rank 1] step 1", *(f"[rank 1] {x}" for x in other.splitlines()), "[rank 1] step 2"]
    out = io.StringIO()  # cut off mid-traceback (the process was killed): shown as it is
    _pump(1, io.StringIO(other.rsplit("ValueError", 1)[0]), out)
    assert len(out.getvalue().splitlines()) == 3
    out = io.StringIO()  # the same spawn traceback with another error is kept
    _pump(1, io.StringIO(ORPHANED_WORKER.replace("_pickle.UnpicklingError: pickle data was truncated", "ImportError: no module")), out)
    assert len(out.getvalue().splitlines()) == 9


@pytest.mark.heavy
def test_a_refused_analyze_target_prints_its_one_line_alone():
    pytest.importorskip("jax_plugins.xla_cuda12", reason="JAX's CUDA plugin is not installed (pip install -e '.[dev]')")
    cmd = [
        sys.executable,
        "-m",
        "jaxdist.analyze",
        "--target",
        "a100",
        *TINY,
        "model.dtype=bfloat16",
        "model.fp8=current",
        "model.fp8_keep_ends=false",
    ]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("jaxdist: error: model.fp8=current needs fp8 GEMMs"), proc.stderr
    debug = subprocess.run([*cmd, "--log-level", "debug"], env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert debug.returncode == 2 and "Could not find cuda drivers" in debug.stderr  # hidden, not gone
