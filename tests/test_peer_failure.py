"""A peer's death off a step boundary under ``--recovery in-process``: one line and exit 78
(the launcher's restart path), never a traceback; any other error is still raised as it is.
The whole path, a process killed as it enters a save, runs in
``test_recovery.py::test_a_death_in_any_phase_recovers_or_restarts_and_ends_on_the_uninterrupted_losses`` (its restarts-only run)."""

from __future__ import annotations

import jax
import pytest

import jaxdist.train
from jaxdist.cluster import heartbeat, recoverable
from jaxdist.errors import EXIT_RECOVERY, JaxdistError
from jaxdist.training import recovery
from jaxdist.training import run as run_module
from jaxdist.training.peer_failure import leave_for_a_restart

GLOO_GONE = (
    "UNKNOWN: Gloo AllGather failed: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41231"
)


def _raised_in(function_name: str, error: BaseException) -> BaseException:
    """``error`` raised from inside a function called ``function_name`` (its traceback names it)."""
    namespace: dict = {}
    exec(f"def {function_name}(e):\n    raise e\n", namespace)
    try:
        namespace[function_name](error)
    except BaseException as raised:
        return raised
    raise AssertionError("not raised")


@pytest.mark.parametrize(
    ("error", "is_peer"),
    [
        (jax.errors.JaxRuntimeError(GLOO_GONE), True),
        (jax.errors.JaxRuntimeError("UNAVAILABLE: failed to connect to all addresses"), True),
        (jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB"), False),
        (ValueError(GLOO_GONE), True),  # as Orbax re-raises it
        (ValueError("Connection closed by peer"), False),  # not the runtime's word (no status code)
        (jax.errors.JaxRuntimeError("INTERNAL: Gloo is not built with TCP"), True),
    ],
    ids=["gloo", "coordination", "oom", "orbax", "not-jax", "gloo-internal"],
)
def test_only_jaxs_word_that_a_peer_is_gone_counts_as_a_peer_failure(error, is_peer):
    assert recoverable.is_peer_failure(error) is is_peer
    wrapped = RuntimeError("the save failed")
    wrapped.__cause__ = error  # as Orbax re-raises it
    assert recoverable.is_peer_failure(wrapped) is is_peer


@pytest.fixture(autouse=True)
def exits(monkeypatch) -> list[int]:
    """The exit past a save's blocked threads (``os._exit``), recorded instead: under pytest
    some thread is always alive, and the exit would end the test session."""
    codes: list[int] = []
    monkeypatch.setattr(recovery, "leave_past_abandoned_saves", lambda code, always=False: codes.append(code))
    monkeypatch.setattr(recoverable, "abandon_jax_shutdown", lambda: codes.append("no JAX shutdown"))
    return codes


def test_the_line_names_the_phase_and_the_traceback_is_kept(tmp_path, capsys, monkeypatch, exits):
    monkeypatch.setenv("JAXDIST_PROCESS_ID", "2")
    error = _raised_in("save", jax.errors.JaxRuntimeError(GLOO_GONE))
    assert leave_for_a_restart(error, tmp_path) == EXIT_RECOVERY
    assert exits == ["no JAX shutdown", EXIT_RECOVERY]  # no ShutdownTask (it aborts); past a save's threads
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "a peer process was lost during a checkpoint save (UNKNOWN: Gloo AllGather failed: Connection closed by peer" in err[0], err
    assert f"leaving for the launcher's restart (exit {EXIT_RECOVERY})" in err[0], err
    kept = tmp_path / "peer-failure.rank-2.txt"
    assert str(kept) in err[0] and "Traceback" in kept.read_text() and "in save" in kept.read_text()


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "default"])
def test_train_says_a_lost_peer_in_one_line_only_under_in_process_recovery(in_process, tmp_path, capsys, monkeypatch):
    """jaxdist.train with a start-up that loses its peer: exit 78 and one line under
    --recovery in-process; raised as it is otherwise (the default mode's launcher restarts
    on any failure, and shows the traceback)."""
    if in_process:
        monkeypatch.setenv(recoverable.ENV_RECOVERY, "in-process")
    else:
        monkeypatch.delenv(recoverable.ENV_RECOVERY, raising=False)

    def initialize(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(GLOO_GONE)

    monkeypatch.setattr(run_module, "_join", initialize)
    argv = ["--config", "tiny", "--run-dir", str(tmp_path / "run"), "--steps", "2"]
    if not in_process:
        with pytest.raises(jax.errors.JaxRuntimeError):
            jaxdist.train.main(argv)
        return
    assert jaxdist.train.main(argv) == EXIT_RECOVERY
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if "peer process was lost during" in line]) == 1 and "Traceback" not in err, err


def test_a_non_peer_error_under_in_process_recovery_is_raised_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv(recoverable.ENV_RECOVERY, "in-process")

    def initialize(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("INTERNAL: a compiler bug")

    monkeypatch.setattr(run_module, "_join", initialize)
    with pytest.raises(jax.errors.JaxRuntimeError, match="a compiler bug"):
        jaxdist.train.main(["--config", "tiny", "--run-dir", str(tmp_path / "run"), "--steps", "2"])


@pytest.mark.parametrize(
    ("spec", "step", "phase"),
    [("1:5", 5, None), ("1:5:save", 5, "save"), ("1:7:eval", 7, "eval"), ("0:5:save", None, None)],
)
def test_the_kill_hook_takes_a_phase(spec, step, phase, monkeypatch):
    monkeypatch.setenv(heartbeat.ENV_KILL, spec)
    assert heartbeat._fault_point(heartbeat.ENV_KILL, 1) == (step, phase)


def test_a_kill_hook_at_an_unknown_phase_is_refused(monkeypatch):
    monkeypatch.setenv(heartbeat.ENV_KILL, "1:5:save,2:0:lunch")
    with pytest.raises(JaxdistError, match="PHASE one of start, init, compile, step, save, eval, gather, recovery, rejoin"):
        heartbeat._fault_point(heartbeat.ENV_KILL, 1)


def test_several_kills_each_fire_once_in_turn(tmp_path, monkeypatch):
    """Comma-separated kills: each of this rank's entries fires at its own point, at most once
    with the once-file (a restarted set goes on to the next entry); other ranks' are not its."""
    monkeypatch.setenv(heartbeat.ENV_KILL, "1:0:start,2:3,1:0:compile,1:7:save,1:*:rejoin")
    monkeypatch.setenv(heartbeat.ENV_KILL_ONCE, str(tmp_path / "killed"))
    assert heartbeat._fault_points(heartbeat.ENV_KILL, 1) == [(0, 0, "start"), (2, 0, "compile"), (3, 7, "save"), (4, None, "rejoin")]
    monkeypatch.setenv(heartbeat.ENV_RANK, "1")
    monkeypatch.setattr(heartbeat, "_kills", None)  # read again from this environment
    kills = []
    monkeypatch.setattr(heartbeat.os, "kill", lambda pid, sig: kills.append(sig))
    for step, phase in [(0, "start"), (0, "init"), (0, "start"), (0, "compile"), (3, None), (7, "save"), (7, "save")]:
        heartbeat._kill_if(step, phase)
    heartbeat._kill_if(17, "rejoin")  # any step
    heartbeat._kill_if(18, "rejoin")
    assert kills == [heartbeat.signal.SIGKILL] * 4
    assert sorted(x.name for x in tmp_path.iterdir()) == ["killed.0", "killed.2", "killed.3", "killed.4"]


def test_a_recovered_run_that_stops_on_an_error_exits_past_save_threads_waiting_for_the_dead(tmp_path, monkeypatch, exits):
    """Seen in a random-kill run: after a recovery, a save failed (exit 4) and the process hung
    in Python's exit, joining an Orbax thread blocked on the dead peer. The error's exit now
    goes past them (``leave_past_abandoned_saves``), once its line is said."""
    from jaxdist import errors
    from jaxdist.training.checkpoint import CheckpointError

    monkeypatch.setattr(errors, "BEFORE_ERROR_EXIT", [])
    monkeypatch.setenv(recoverable.ENV_RECOVERY, "in-process")
    monkeypatch.setattr(recoverable.MEMBERSHIP, "processes", [0, 2])  # a recovery happened

    def initialize(*args, **kwargs):
        raise CheckpointError("saving checkpoint at step 21 failed")

    monkeypatch.setattr(run_module, "_join", initialize)
    argv = ["--config", "tiny", "--run-dir", str(tmp_path / "run"), "--steps", "2"]
    assert jaxdist.train.main(argv) == CheckpointError.exit_code
    assert exits == [CheckpointError.exit_code]
    monkeypatch.setattr(recoverable.MEMBERSHIP, "processes", None)  # no recovery: a plain exit
    assert jaxdist.train.main(argv) == CheckpointError.exit_code
    assert exits == [CheckpointError.exit_code]


def test_a_commit_thread_that_lost_its_peers_logs_one_line_and_keeps_the_traceback(tmp_path, monkeypatch):
    """What Orbax's background commit thread logs when rank 0 (the coordination service) dies
    mid-commit: a TimeoutError raised from the runtime's UNAVAILABLE. The filter makes it one
    line naming the cause and the file that keeps the traceback; an unrelated failure's record
    keeps its traceback."""
    import io
    import logging

    from jaxdist.training.peer_failure import quiet_lost_peer_tracebacks

    monkeypatch.setenv("JAXDIST_PROCESS_ID", "2")
    absl = logging.getLogger("absl")
    monkeypatch.setattr(absl, "filters", [])
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    absl.addHandler(handler)
    try:
        quiet_lost_peer_tracebacks(tmp_path)
        quiet_lost_peer_tracebacks(tmp_path)  # once per process
        assert len(absl.filters) == 1
        try:
            try:
                raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was preempted/died")
            except RuntimeError as cause:
                raise TimeoutError("Timed out while waiting for async_write_complete barrier.") from cause
        except TimeoutError:
            absl.exception("[process=2] Failed to run 4 Handler Commit operations in background save thread")
        try:
            raise ValueError("a disk full of something else")
        except ValueError:
            absl.exception("[process=2] Failed to run 4 Handler Commit operations in background save thread")
    finally:
        absl.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    kept = tmp_path / "peer-failure.rank-2.txt"
    assert lines[0] == (
        "a checkpoint's background commit lost a peer process (UNAVAILABLE: Failed to send RPC to coordination service. "
        f"Either the leader task was preempted/died); its traceback is in {kept}"
    )
    assert "Timed out while waiting for async_write_complete barrier" in kept.read_text()
    assert lines[1].endswith("background save thread") and lines[2] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: a disk full of something else"


def test_a_run_ended_by_a_peers_death_does_not_wait_for_its_saves(monkeypatch):
    """Seen in a random-kill run: a survivor leaving for the restart waited in its cleanup for a
    save's commit, whose Orbax barrier waits for the dead process and never returns. Under
    in-process recovery a peer's death abandons the saves; any other ending waits for them."""
    lost = jax.errors.JaxRuntimeError(GLOO_GONE)
    monkeypatch.setenv(recoverable.ENV_RECOVERY, "in-process")
    assert run_module._saves_abandoned(lost)
    assert not run_module._saves_abandoned(None) and not run_module._saves_abandoned(ValueError("bad input"))
    monkeypatch.setenv(recoverable.ENV_RECOVERY, "restart")
    assert not run_module._saves_abandoned(lost)  # the default mode: every process is killed at once anyway
