"""Elastic runs across nodes through a real etcd (``jaxdist.launch --nnodes MIN:MAX --rdzv
etcd://...``), every launcher a "node" on this machine, everything on 127.0.0.1.

The etcd client and the rendezvous keys against the server (transactions, leases, a
lease granted again after etcd was away); bad input (one line, exit 2, nothing started);
two launchers x 2 processes where node 0's launcher is SIGKILLed (its processes die with it,
the other continues alone within the lease time plus a margin), then a third launcher joins
and the run grows, every logged loss equal to an uninterrupted run's; etcd stopped for 10 s
under a running generation (training goes on, nothing restarts), then a node lost below
--nnodes MIN (the survivor stops at its last checkpoint with one line); a leaving node
whose processes ignore the signal is freed after the save's grace (stub trainers). No
process outlives its launcher.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import jaxdist.launch as launch
from jaxdist.cluster import launcher, node_launch, rendezvous
from jaxdist.cluster.etcd import Etcd, EtcdUnavailable, Tls, parse_endpoints
from jaxdist.cluster.node_launch import NodeElastic
from jaxdist.cluster.rendezvous import Ending, Generation, Registration, end_generation, propose, read_state
from jaxdist.errors import JaxdistError
from jaxdist.training.checkpoint import checkpoint_steps

from helpers import TINY, checked_goodput, membership_changes, run_stub_launcher, subprocess_env

ETCD = shutil.which("etcd")
pytestmark = pytest.mark.skipif(ETCD is None, reason="etcd is not installed (Debian: apt-get install etcd-server)")

MESH = "data=-1,tensor=2"  # 2 devices per process: data = processes (1 node x 2: data=2; 2 nodes x 2: data=4)
# Synthetic data read slowly (each example waits 100 ms), so that a run lasts long enough for the faults below.
OVERRIDES = (*TINY, "data.source=synthetic", "data.synthetic_latency_ms=100", "train.global_batch=8", "checkpoint.every_steps=4")


class EtcdServer:
    """A real etcd on free loopback ports, its data in ``data_dir``."""

    def __init__(self, data_dir: Path, tls_dir: Path | None = None):
        self.data_dir, self.tls_dir = data_dir, tls_dir
        self.port, self.peer_port = launcher.free_port(), launcher.free_port()
        self.proc: subprocess.Popen | None = None
        tls = Tls(str(tls_dir / "ca.pem"), str(tls_dir / "client.pem"), str(tls_dir / "client.key")) if tls_dir else None
        self.client = Etcd("127.0.0.1", self.port, tls=tls)
        self.url = f"etcd://127.0.0.1:{self.port}"

    def start(self) -> None:
        scheme = "https" if self.tls_dir else "http"
        client, peer = f"{scheme}://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        cmd = [ETCD, "--name", "test", "--data-dir", str(self.data_dir), "--listen-client-urls", client]
        cmd += ["--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer]
        cmd += ["--initial-cluster", f"test={peer}", "--log-level", "warn"]
        if self.tls_dir:  # HTTPS, and only clients with a certificate from the CA
            t = self.tls_dir
            cmd += ["--cert-file", str(t / "server.pem"), "--key-file", str(t / "server.key")]
            cmd += ["--trusted-ca-file", str(t / "ca.pem"), "--client-cert-auth"]
        log = open(self.data_dir.parent / "etcd.log", "a")  # noqa: SIM115 - etcd writes it while it runs
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client.range("/")
                return
            except EtcdUnavailable:
                assert self.proc.poll() is None, (self.data_dir.parent / "etcd.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "etcd did not answer within 30s"
                time.sleep(0.1)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory):
    """One etcd for the module (each test uses its own --rdzv-id)."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data")
    server.start()
    yield server
    server.stop()


# --- the rendezvous keys against the server (no launcher) ---


def test_only_one_proposal_and_the_first_end_win(etcd_server):
    etcd, run = etcd_server.client, "keys"
    state = read_state(etcd, run)
    assert state.generation is None and state.nodes == []
    first = Generation(1, ("a", "b"), "127.0.0.1:1", 2, 0, {"reason": "start"}, "f")
    second = Generation(1, ("b",), "127.0.0.1:2", 2, 0, {"reason": "start"}, "f")
    assert propose(etcd, run, state, first)
    assert not propose(etcd, run, state, second)  # read the same state: it lost the transaction
    now = read_state(etcd, run)
    assert now.generation == first and now.generation.world == 4
    assert propose(etcd, run, now, Generation(2, ("a",), "127.0.0.1:3", 2, 1, {}, "f"))
    won = end_generation(etcd, run, 2, Ending("failure", "a", rank=1, exit_code=-9))
    later = end_generation(etcd, run, 2, Ending("lost", "b"))
    assert later == won and (won.reason, won.rank, won.exit_code) == ("failure", 1, -9)
    etcd.put(rendezvous.prefix(run) + "end/3", b"not json")  # what a stranger writes is ignored
    assert set(read_state(etcd, run).endings) == {2}


def test_a_lease_that_expired_while_etcd_was_away_is_granted_again(etcd_server):
    etcd, run = etcd_server.client, "lease"
    reg = Registration(etcd, run, "n1", "127.0.0.1", ttl_s=2)
    reg.join(0)
    try:
        (node,) = read_state(etcd, run).nodes
        assert (node.id, node.address, node.stopped) == ("n1", "127.0.0.1", 0)
        etcd.revoke(reg.lease)  # as etcd does to a lease it could not renew while it was stopped
        assert read_state(etcd, run).nodes == []
        deadline = time.monotonic() + 5
        while not read_state(etcd, run).nodes:
            assert time.monotonic() < deadline, "the node did not register again"
            time.sleep(0.1)
        reg.set_stopped(3)
        (node,) = read_state(etcd, run).nodes
        assert node.stopped == 3 and node.revision > reg.joined_revision  # a new key: it joined again
    finally:
        reg.done.set()
        reg.thread.join(timeout=5)
    deadline = time.monotonic() + 10  # not renewed any more: the key goes with its lease
    while read_state(etcd, run).nodes:
        assert time.monotonic() < deadline, "the key outlived its lease"
        time.sleep(0.2)


# --- bad input: one line, exit 2, nothing started (in-process; starting a process fails the test) ---


@pytest.fixture
def no_processes(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the launcher started a process")

    monkeypatch.setattr(launcher.subprocess, "Popen", refuse)


def _node_argv(rdzv: str, *flags: str, run_dir: Path | None = None, nnodes: str = "1:2") -> list[str]:
    argv = ["--nnodes", nnodes, "--nproc-per-node", "2", "--devices-per-proc", "2", "--rdzv", rdzv, "--rdzv-id", "bad", *flags]
    return [*argv, "--", "--mesh", MESH, *OVERRIDES, *(["--run-dir", str(run_dir)] if run_dir else [])]


BAD = {
    "min above max": (["--nnodes", "3:2"], "--nnodes 3:2: MIN must be from 1 to MAX"),
    "nnodes not numbers": (["--nnodes", "two"], "expected MIN:MAX or N"),
    "http url": (["--rdzv", "http://x"], "--rdzv 'http://x': expected etcd://HOST:PORT"),
    "no port": (["--rdzv", "etcd://host"], "--rdzv 'etcd://host': expected etcd://HOST:PORT"),
    "an empty endpoint in a list": (["--rdzv", "etcd://a:1,,b:2"], "--rdzv 'etcd://a:1,,b:2': expected etcd://HOST:PORT"),
    "a list item without a port": (["--rdzv", "etcd://a:1,b"], "--rdzv 'etcd://a:1,b': expected etcd://HOST:PORT"),
    "no rdzv id": (["--rdzv-id", None], "--nnodes needs --rdzv-id ID"),
    "no rdzv": (["--rdzv", None], "--nnodes needs --rdzv etcd://HOST:PORT"),
    "rdzv id with a slash": (["--rdzv-id", "a/b"], "--rdzv-id 'a/b': expected 1 to 128 letters"),
    "a local flag": (["--nproc", "2"], "--nproc is for processes on one machine"),
    "node flag without nnodes": (["--nnodes", None, "--nproc", "2"], "--nproc-per-node belongs to a run across nodes"),
    "not this machine's address": (["--coordinator-bind", "192.0.2.1"], "--coordinator-bind 192.0.2.1: not an address of this machine"),
    "no count fits": (["--nnodes", "3:3"], "no node count from --nnodes 3:3 can run this training"),
}


def _with(argv: list[str], changes: list) -> list[str]:
    argv = list(argv)
    for flag, value in zip(changes[::2], changes[1::2], strict=True):
        i = argv.index(flag) if flag in argv[: argv.index("--")] else None
        if i is not None:
            del argv[i : i + 2]
        if value is not None:
            argv[:0] = [flag, value]
    return argv


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys, no_processes, etcd_server):
    changes, message = BAD[case]
    argv = _with(_node_argv(etcd_server.url, run_dir=tmp_path / "run"), changes)
    assert launch.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxdist: error: ") and message in err[0], err
    assert not (tmp_path / "run").exists()
    assert read_state(etcd_server.client, "bad").nodes == []  # nothing registered


def test_no_run_dir_and_an_unreachable_etcd_are_one_line(tmp_path, capsys, no_processes):
    assert launch.main(_node_argv("etcd://127.0.0.1:2379")) == 2
    assert "--nnodes needs the run's --run-dir DIR after --, on storage every node shares" in capsys.readouterr().err
    unused = launcher.free_port()  # nothing listens there
    started = time.monotonic()
    assert launch.main(_node_argv(f"etcd://127.0.0.1:{unused}", run_dir=tmp_path / "run")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot use the rendezvous --rdzv etcd://127.0.0.1:{unused}" in err[0], err
    assert time.monotonic() - started < 10 and not (tmp_path / "run").exists()


def test_a_finished_run_starts_no_generation(etcd_server, tmp_path, capsys, no_processes):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "40").mkdir(parents=True)  # its last step (no JAX looks at it)
    argv = _node_argv(etcd_server.url, "--node-id", "a", run_dir=run_dir)
    argv[argv.index("--rdzv-id") + 1] = "finished"
    assert launch.main([*argv, "train.steps=40"]) == 0
    assert capsys.readouterr().err.splitlines() == ["jaxdist: already at step 40 (train.steps=40): nothing to train"]
    state = read_state(etcd_server.client, "finished")
    assert state.nodes == [] and state.generation is None  # nothing registered, no generation
    assert not (run_dir / "elastic.jsonl").exists()  # no start record


# --- several endpoints (an etcd cluster's members): fail over ---


def test_a_node_still_registered_after_it_left_is_not_counted_for_the_next_generation():
    """m2 reported leaving generation 3 (at revision 40) and has stopped its processes, but its
    key (created at revision 12) is not deleted yet: the next generation cannot count on it (the
    fresh-clone CI run where m1 proposed a generation with m2 and recorded a "leave" change).
    A new registration of m2 after the leave (revision 50) counts again."""
    gen = Generation(3, ("m1", "m2"), "127.0.0.1:1", 1, 0, {}, "")
    left = {3: Ending("leave", "m2", revision=40)}
    m1, m2 = rendezvous.Node("m1", "a", 3, 10), rendezvous.Node("m2", "b", 3, 12)
    assert [n.id for n in rendezvous.State(45, [m1, m2], gen, 30, left).candidates()] == ["m1"]
    again = rendezvous.Node("m2", "b", 3, 50)
    assert [n.id for n in rendezvous.State(55, [m1, again], gen, 30, left).candidates()] == ["m1", "m2"]
    failed = {3: Ending("failure", "m2", rank=1, exit_code=1, revision=40)}  # a failed node's launcher stays: it counts
    assert [n.id for n in rendezvous.State(45, [m1, m2], gen, 30, failed).candidates()] == ["m1", "m2"]


def test_an_endpoint_list_parses_like_etcdctls():
    assert parse_endpoints("etcd://a:1,etcd://b:2,a:1,[::1]:3") == [("a", 1), ("b", 2), ("::1", 3)]
    assert parse_endpoints("etcd://a:1") == [("a", 1)]


def test_requests_fail_over_to_the_endpoint_that_answers(etcd_server):
    dead = launcher.free_port()  # nothing listens there: connection refused
    etcd = Etcd("127.0.0.1", dead, others=[("127.0.0.1", etcd_server.port)])
    assert etcd.describe() == f"etcd://127.0.0.1:{dead},127.0.0.1:{etcd_server.port}"
    etcd.put("/failover/k", b"v")
    assert etcd.answering() == etcd_server.url  # asked first from now on
    assert [kv.value for kv in etcd.range("/failover/")[1]] == [b"v"]
    other = next(p for p in iter(launcher.free_port, None) if p != dead)
    with pytest.raises(EtcdUnavailable, match=rf"^etcd://127.0.0.1:{dead}: .*; etcd://127.0.0.1:{other}: "):  # each one tried, said
        Etcd("127.0.0.1", dead, others=[("127.0.0.1", other)]).range("/")


def test_the_rendezvous_goes_through_the_second_endpoint_when_the_first_refuses(etcd_server, tmp_path, no_processes):
    dead = launcher.free_port()
    a = _node(etcd_server, tmp_path, "failover", "a", "--rdzv", f"etcd://127.0.0.1:{dead},127.0.0.1:{etcd_server.port}")
    try:
        a.reg.join(0)
        gen = a.rendezvous()
    finally:
        a.reg.leave()
    assert gen.number == 1 and gen.members == ("a",)
    assert read_state(etcd_server.client, "failover").generation == gen  # written through the second endpoint
    assert a.plan.etcd.answering() == etcd_server.url


# --- HTTPS with client certificates (etcd --client-cert-auth) ---


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    """An etcd that speaks HTTPS only and admits clients with a certificate from its CA."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificates for the TLS etcd")
    d = tmp_path_factory.mktemp("tls")
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test-ca", cwd=d
    )
    for name, usage in (("server", "serverAuth,clientAuth"), ("client", "clientAuth")):  # etcd's gateway dials etcd with the server's
        (d / f"{name}.ext").write_text(f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", f"{name}.pem",
                 "-days", "1", "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    server = EtcdServer(d / "data", tls_dir=d)
    server.start()
    yield server
    server.stop()


def test_https_with_a_client_certificate(tls_etcd, tmp_path, capsys, no_processes):
    d = tls_etcd.tls_dir
    certs = ["--rdzv-cacert", str(d / "ca.pem"), "--rdzv-cert", str(d / "client.pem"), "--rdzv-key", str(d / "client.key")]
    for without in ([], certs[:2], None):  # plain HTTP; HTTPS without a client certificate: refused
        tls = None if without is None else Tls(str(d / "ca.pem")) if without else None
        with pytest.raises(EtcdUnavailable):
            Etcd("127.0.0.1", tls_etcd.port, tls=tls).range("/")
    argv = _node_argv(tls_etcd.url, *certs[:2], run_dir=tmp_path / "run")
    argv[argv.index("--rdzv-id") + 1] = "tls"
    assert launch.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot use the rendezvous --rdzv {tls_etcd.url}" in err[0], err
    # With the certificate the launcher registers, waits for a second node and stops after --rdzv-timeout.
    argv = _node_argv(tls_etcd.url, *certs, "--rdzv-timeout", "1", run_dir=tmp_path / "run", nnodes="2:2")
    argv[argv.index("--rdzv-id") + 1] = "tls"
    assert launch.main(argv) == 75
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "jaxdist: error: fewer than 2 nodes for 1s (--rdzv-timeout; 1 node here); "
        "the run stopped before its first checkpoint: rerun to start it again"
    ], err
    assert launch.main(_with(argv, ["--rdzv-key", None])) == 2
    assert "--rdzv-cert and --rdzv-key go together, with --rdzv-cacert" in capsys.readouterr().err


# --- the node loop's decisions against the server (no process is started) ---


def _node(etcd_server, tmp_path: Path, run: str, node: str, *flags: str, train: tuple[str, ...] = ()) -> NodeElastic:
    argv = _node_argv(etcd_server.url, "--node-id", node, "--rdzv-settle", "0", *flags, run_dir=tmp_path / "run")
    argv[argv.index("--rdzv-id") + 1] = run
    return NodeElastic(launch.node_plan(launch.parse_args([*argv, *train])))


def test_failures_past_max_restarts_stop_every_node(etcd_server, tmp_path, capsys, no_processes):
    etcd, run = etcd_server.client, "restarts"
    a, b = (_node(etcd_server, tmp_path, run, n, "--max-restarts", "0") for n in ("a", "b"))
    assert propose(etcd, run, read_state(etcd, run), Generation(1, ("a", "b"), "127.0.0.1:1", 2, 0, {"reason": "start"}, a.fingerprint))
    end_generation(etcd, run, 1, Ending("failure", "b", rank=3, exit_code=1))
    try:
        a.reg.join(1)  # both stopped their processes of generation 1
        b.reg.join(1)
        assert a.rendezvous() == 1  # the lowest node proposes the end, with the failure's code
        assert b.rendezvous() == 1  # and the other follows it
    finally:
        a.reg.leave()
        b.reg.leave()
    line = (
        "jaxdist: error: rank 3 exited with code 1 and --max-restarts 0 are used up; "
        "the run stopped before its first checkpoint: rerun to start it again"
    )
    assert capsys.readouterr().err.strip().splitlines() == [line, line]
    gen = read_state(etcd, run).generation
    assert (gen.number, gen.members, gen.stop["code"]) == (2, (), 1)


def test_a_leaving_nodes_processes_that_ignore_the_signal_are_killed_after_the_saves_grace(etcd_server, tmp_path):
    """A launcher told to leave (SIGTERM) whose processes never finish their save (one stuck in a
    collective with a peer that saved at another step) must not hold the node: they are killed
    after the save's grace, in one line."""
    body = """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(f"{log}/rank{rank}.started", "w").close()
    time.sleep(600)
    """
    argv = _node_argv(etcd_server.url, "--node-id", "a", "--rdzv-settle", "0", run_dir=tmp_path / "run", nnodes="1:1")
    argv[argv.index("--rdzv-id") + 1] = "stuck-leave"
    started = [tmp_path / f"log/rank{rank}.started" for rank in (0, 1)]
    code, out = run_stub_launcher(tmp_path, body, argv, patch="L.SAVE_GRACE_S = 1", term_when=started)
    assert code == 128 + signal.SIGKILL, out
    assert "SIGTERM: this node's processes save, then it leaves the run" in out
    assert "rank 0, 1 still running 1s after the signal; killing them" in out
    assert read_state(etcd_server.client, "stuck-leave").nodes == []


def test_the_arguments_that_count_are_the_running_generations_else_the_first_nodes():
    def state(gen=None, endings=(), **stopped_and_fingerprints):
        nodes = [rendezvous.Node(n, "h", stopped, i, fp) for i, (n, (stopped, fp)) in enumerate(stopped_and_fingerprints.items(), 1)]
        return rendezvous.State(9, nodes, gen, 1, {e: Ending("failure", "a") for e in endings})

    gen = Generation(3, ("a", "b"), "h:1", 1, 0, {}, "running")
    assert rendezvous.agreed_fingerprint(state()) is None
    assert rendezvous.agreed_fingerprint(state(x=(0, "first"), a=(0, "second"))) == "first"
    assert rendezvous.agreed_fingerprint(state(gen, x=(3, "newcomer"), a=(2, "running"))) == "running"  # a runs generation 3
    assert rendezvous.agreed_fingerprint(state(gen, (3,), x=(3, "new"), a=(2, "running"))) == "new"  # it ended: the first node's
    # Left behind by launchers all killed: "a" registered again since (stopped = 3) with new arguments.
    assert rendezvous.agreed_fingerprint(state(gen, a=(3, "new"), b=(3, "new"))) == "new"


def test_launchers_with_other_arguments_never_share_a_generation(etcd_server, tmp_path, capsys, no_processes):
    """Two launchers with different training arguments registered at the same moment: the
    first proposes a generation without the other (their fingerprints are in their keys),
    and the other refuses in one line instead of joining and leaving it 'lost'."""
    etcd, run = etcd_server.client, "mismatch"
    a = _node(etcd_server, tmp_path, run, "a")
    b = _node(etcd_server, tmp_path, run, "b", train=("train.lr=0.5",))  # other training arguments
    assert a.fingerprint != b.fingerprint
    try:
        a.reg.join(0)
        b.reg.join(0)  # before either read the other's key
        gen = a.rendezvous()
        assert gen.number == 1 and gen.members == ("a",) and gen.fingerprint == a.fingerprint
        with pytest.raises(JaxdistError, match=r"--rdzv-id mismatch runs with other training arguments.*\(node a: "):
            b.rendezvous()
    finally:
        a.reg.leave()
        b.reg.leave()
    assert 1 not in read_state(etcd, run).endings  # the generation goes on
    assert "the launchers of --rdzv-id" not in capsys.readouterr().err


def test_a_newcomer_with_other_arguments_is_refused_and_the_run_goes_on(etcd_server, tmp_path, capsys, no_processes, monkeypatch):
    etcd, run = etcd_server.client, "newcomer"
    monkeypatch.setattr(node_launch, "STOP_WAIT_S", 0)  # a launcher that joined would not wait for the busy node
    a = _node(etcd_server, tmp_path, run, "a")
    try:
        a.reg.join(0)
        assert a.rendezvous().members == ("a",)  # generation 1 runs on a
        argv = _node_argv(etcd_server.url, "--node-id", "b", "--rdzv-settle", "0", "--rdzv-timeout", "2", run_dir=tmp_path / "run")
        argv[argv.index("--rdzv-id") + 1] = run
        assert launch.main([*argv, "train.lr=0.5"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("jaxdist: error: --rdzv-id newcomer runs with other training arguments"), err
        assert "(node a: " in err[0] and "it does not join" in err[0]
        state = read_state(etcd, run)
        assert state.node_ids() == ["a"] and state.endings == {} and state.generation.number == 1  # b never registered
        assert a.read().node_ids() == ["a"]  # a carries on
    finally:
        a.reg.leave()


# --- real launchers ---


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """One XLA cache for the launches below: each world size compiles once."""
    return tmp_path_factory.mktemp("xla_cache")


class Nodes:
    """Launchers started by a test, each in its own session; their processes are watched."""

    def __init__(self, tmp_path: Path, etcd: EtcdServer, cache: Path):
        self.tmp_path, self.etcd, self.cache = tmp_path, etcd, cache
        self.procs: dict[str, subprocess.Popen] = {}
        self.seen: dict[int, psutil.Process] = {}  # every process a launcher started, seen while it ran

    def start(self, node: str, run: str, nnodes: str, nproc: int, steps: int, *flags: str, env: dict | None = None) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "jaxdist.launch", "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--devices-per-proc", "2"]
        cmd += ["--rdzv", self.etcd.url, "--rdzv-id", run, "--node-id", node, "--rdzv-settle", "4", *flags]
        cmd += ["--", "--mesh", MESH, "--run-dir", str(self.tmp_path / "run"), *OVERRIDES, f"train.steps={steps}"]
        cmd += [f"train.compile_cache={self.cache}"]
        with open(self.tmp_path / f"{node}.log", "w") as log:
            self.procs[node] = subprocess.Popen(
                cmd, env={**subprocess_env(), **(env or {})}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self.procs[node]

    def log(self, node: str) -> str:
        return (self.tmp_path / f"{node}.log").read_text()

    def logs(self) -> str:
        return "\n".join(f"== {node}\n{self.log(node)[-3000:]}" for node in self.procs)

    def trainers(self, node: str) -> list[psutil.Process]:
        family = psutil.Process(self.procs[node].pid).children(recursive=True)
        self.seen.update({p.pid: p for p in family})
        return [p for p in family if "jaxdist.train" in " ".join(p.cmdline())]

    def watch(self) -> None:
        for node, proc in self.procs.items():
            if proc.poll() is None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    self.trainers(node)

    def wait_for(self, predicate, timeout: float, what: str) -> float:
        """Seconds until ``predicate()``; fails when time runs out (the logs then say why)."""
        start = time.monotonic()
        while not predicate():
            assert time.monotonic() - start < timeout, f"not within {timeout}s: {what}\n{self.logs()}"
            self.watch()
            time.sleep(0.2)
        return time.monotonic() - start

    def exit_code(self, node: str, timeout: float) -> int:
        """``node``'s launcher's exit status; fails when it still runs after ``timeout`` (the logs then say why)."""
        try:
            return self.procs[node].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{node}'s launcher still runs after {timeout}s\n{self.logs()}")

    def left(self, seconds: float) -> list[str]:
        """Processes the launchers started that still run after ``seconds`` (each then killed)."""
        deadline = time.monotonic() + seconds
        alive = self._alive()
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = self._alive()
        out = []
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
                p.kill()
        return out

    def _alive(self) -> list[psutil.Process]:
        out = []
        for p in self.seen.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    def cleanup(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        self.left(0)


@pytest.fixture
def nodes(tmp_path, etcd_server, compile_cache):
    started = Nodes(tmp_path, etcd_server, compile_cache)
    yield started
    started.cleanup()


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip().endswith("}") and '"loss"' in line]


def _left_after(procs: list[psutil.Process], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while True:
        alive = []
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p.pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _listening(proc: psutil.Process) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


@pytest.fixture(scope="module")
def reference_losses():
    """The same 40 steps uninterrupted, in this process on 2 devices (mesh tensor=2)."""
    import jax

    from jaxdist.config import load_config
    from jaxdist.layout.mesh import parse_mesh
    from jaxdist.training.run import run

    config = load_config(None, [*OVERRIDES, "data.synthetic_latency_ms=0", "train.steps=40"])
    return run(config, parse_mesh("tensor=2"), None, devices=jax.devices()[:2], progress=False).losses


@pytest.mark.heavy
def test_a_killed_node_drops_out_and_a_new_one_joins_with_the_same_losses(nodes, tmp_path, etcd_server, reference_losses):
    run_dir, run = tmp_path / "run", "grow"
    # The survivor alone trains 2 s a step, so the third launcher joins before the run's end however loaded the machine.
    shrunk_slow = {"JAXDIST_FAULT_SLOW_SHRUNK": "4:2"}
    for node in ("n1", "n2"):
        nodes.start(node, run, "1:3", 2, 40, env=shrunk_slow)
    nodes.wait_for(lambda: len(_metrics(run_dir)) >= 2, 240, "two steps on 2 nodes")
    gen = read_state(etcd_server.client, run).generation
    assert gen.number == 1 and sorted(gen.members) == ["n1", "n2"] and gen.world == 4
    node0, node1 = gen.members
    ids = {node: sorted(int(p.environ()["JAXDIST_PROCESS_ID"]) for p in nodes.trainers(node)) for node in gen.members}
    assert ids == {node0: [0, 1], node1: [2, 3]}  # global ids: node rank x 2 + local
    # Trust: the launchers listen on nothing; the coordinator listens on node 0's address only (here 127.0.0.1).
    assert not _listening(psutil.Process(nodes.procs[node0].pid)) and not _listening(psutil.Process(nodes.procs[node1].pid))
    rank0 = next(p for p in nodes.trainers(node0) if p.environ()["JAXDIST_PROCESS_ID"] == "0")
    port = int(gen.coordinator.rsplit(":", 1)[1])
    assert {ip for ip, p in _listening(rank0) if p == port} <= {"127.0.0.1", "::ffff:127.0.0.1"} and gen.coordinator.startswith(
        "127.0.0.1:"
    )
    assert all("JAXDIST_COORDINATOR_BIND" not in p.environ() for p in nodes.trainers(node1))

    nodes.wait_for(lambda: checkpoint_steps(run_dir / "checkpoints"), 120, "the first checkpoint")
    victims = nodes.trainers(node0)
    os.kill(nodes.procs[node0].pid, signal.SIGKILL)  # node 0's launcher alone, with the coordinator's node
    killed_at = time.monotonic()
    nodes.procs[node0].wait(timeout=30)
    assert not _left_after(victims, 5.0)  # its processes died with it
    nodes.wait_for(lambda: len(membership_changes(run_dir)) == 2, rendezvous.LEASE_TTL_S + 30, "the next generation without the lost node")
    regrouped = time.monotonic() - killed_at
    logged = len(_metrics(run_dir))
    nodes.wait_for(lambda: len(_metrics(run_dir)) > logged, 120, "a step by the survivor")
    failover = time.monotonic() - killed_at
    print(f"\nfailover: node 0's launcher SIGKILLed -> next generation {regrouped:.1f}s -> next step logged {failover:.1f}s")
    assert regrouped < rendezvous.LEASE_TTL_S + 10  # the lease time plus a margin

    survivor_log = len(nodes.log(node1))
    nodes.start("n3", run, "1:3", 2, 40, env=shrunk_slow)  # a third launcher: the run grows back to 2 nodes
    assert nodes.exit_code(node1, 240) == 0, nodes.logs()
    assert nodes.exit_code("n3", 60) == 0, nodes.logs()

    start, lost, grow = membership_changes(run_dir)
    assert (start["reason"], start["from"], start["to"], start["nodes"]) == ("start", None, 4, 2)
    assert (lost["from"], lost["to"], lost["node_ids"], lost["left"], lost["joined"]) == (4, 2, [node1], [node0], []), lost
    # Who reported the end first: the survivor's processes abort once their coordinator is gone
    # (a failure on node 1), or, if they hang instead, node 1 finds node 0's lease expired.
    assert (lost["reason"], lost["node"]) in (("failure", node1), ("lost", node0)), lost
    assert lost["mesh"] == "data=2,tensor=2" and lost["restarts"] == 1
    assert (grow["reason"], grow["node"], grow["from"], grow["to"], grow["node_ids"]) == ("grow", "n3", 2, 4, [node1, "n3"]), grow
    assert (grow["left"], grow["joined"]) == ([], ["n3"])
    assert 4 <= lost["step"] <= grow["step"] < 40 and grow["restarts"] == 1
    tail = nodes.log(node1)[survivor_log:]
    assert f"jaxdist: elastic: 1 -> 2 nodes (2 -> 4 processes, grow), resuming at step {grow['step']}" in tail, tail[-3000:]
    assert f"resumed from step {grow['step']}" in tail and "done at step 40" in tail  # process 0 says it: on node 0, the survivor

    logged = [(m["step"], m["loss"]) for m in _metrics(run_dir)]  # steps trained again after the loss appear twice
    assert {s for s, _ in logged} == set(range(1, 41))
    worst = max(abs(loss - reference_losses[s - 1]) / abs(reference_losses[s - 1]) for s, loss in logged)
    assert worst < 1e-5, worst
    assert not nodes.left(5.0)
    # the survivor, process 0's node at the end, accounted the run over all three generations: the node's
    # loss (the lease running out) is lost time, the steps since the last checkpoint retrained
    accounted = checked_goodput(run_dir, 40, idle_share=0.05)
    assert accounted["restarts"] == 2 and accounted["seconds"]["lost"] > 0, accounted


@pytest.mark.heavy
def test_training_goes_on_while_etcd_is_stopped_and_a_node_leaving_below_min_saves_and_stops(nodes, tmp_path, etcd_server):
    run_dir, run = tmp_path / "run", "outage"
    for node in ("m1", "m2"):
        nodes.start(node, run, "2:2", 1, 400, "--rdzv-timeout", "5")
    nodes.wait_for(lambda: len(_metrics(run_dir)) >= 3, 240, "three steps on 2 nodes")
    etcd_server.pause()
    try:
        before = len(_metrics(run_dir))
        time.sleep(10)
        during = len(_metrics(run_dir)) - before
    finally:
        etcd_server.resume()
    assert during >= 5, f"{during} steps in the 10s etcd was stopped\n{nodes.logs()}"
    nodes.wait_for(lambda: all("etcd answers again" in nodes.log(n) for n in ("m1", "m2")), 20, "both launchers reconnected")
    time.sleep(rendezvous.LEASE_TTL_S + 6)  # time for a false "lost": none comes
    assert all(p.poll() is None for p in nodes.procs.values()), nodes.logs()
    assert [c["reason"] for c in membership_changes(run_dir)] == ["start"], nodes.logs()
    for node in ("m1", "m2"):  # the leases expired while etcd was stopped: granted again, the generation untouched
        assert "etcd does not answer" in nodes.log(node) and "registered again" in nodes.log(node), nodes.log(node)[-3000:]

    nodes.watch()
    os.kill(nodes.procs["m2"].pid, signal.SIGTERM)  # m2's launcher alone (its node is going away): it saves and leaves
    signalled_at = time.monotonic()
    assert nodes.exit_code("m2", 150) == 75, nodes.log("m2")[-3000:]  # past the launcher's 120 s save grace
    code = nodes.exit_code("m1", 60)
    took = time.monotonic() - signalled_at
    out = nodes.log("m1")
    assert code == 75, out[-3000:]
    saved = {
        int(line.split("state saved at step ")[1].split(";")[0])
        for n in ("m1", "m2")
        for line in nodes.log(n).splitlines()
        if "state saved at step" in line
    }
    step = checkpoint_steps(run_dir / "checkpoints")[-1]
    assert saved == {step}, saved  # both processes saved the same step, the newest checkpoint
    assert "SIGTERM: this node's processes save, then it leaves the run" in nodes.log("m2")
    assert "generation 1 ended (leave, node m2); this node's processes save" in out
    errors = [line for line in out.splitlines() if line.startswith("jaxdist: error:")]
    assert errors == [
        "jaxdist: error: fewer than 2 nodes for 5s (--rdzv-timeout; 1 node here); "
        f"the run stopped at its last checkpoint (step {step}): rerun to resume"
    ], out[-3000:]
    assert took < 60 and [c["reason"] for c in membership_changes(run_dir)] == ["start"]
    assert read_state(etcd_server.client, run).nodes == []  # both left: their keys are gone at once
    assert not nodes.left(5.0)
