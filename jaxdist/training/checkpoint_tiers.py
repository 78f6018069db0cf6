"""Checkpoints in two tiers: saved to a fast local folder, copied to durable storage behind the run.

Orbax 0.12 cannot write to ``s3://`` (it normalises the URL to a local path), so a run whose
``--run-dir`` is in object storage saves every checkpoint to ``checkpoint.local_dir`` (local
NVMe, ``/dev/shm``) as any run does, and a thread of process 0 copies finished full
checkpoints to the run directory (``checkpoint.remote_every_steps`` apart; the run's last
one always). A local ``--run-dir`` with ``checkpoint.local_dir`` works the same way (e.g.
``/dev/shm`` in front of a shared file system). The local folder is the run's working
directory: ``config.yaml``, ``metrics.jsonl`` and the other top-level files are written
there and copied with each checkpoint.

A copied step is complete only once its commit marker (``COMMIT``: every file and its size)
is written, last: a copy cut short (a process killed mid-upload) has none, is never restored,
and the next run finishes it from the local tier or discards it. ``--resume auto`` takes the
newest complete step of either tier, fetching it from the durable one when it is newer (a
node whose disk died with it). Every process of a run must see the same ``local_dir`` (one
node, or a shared folder): node-local tiers across nodes are not built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import queue
import shutil
import threading
import time
from pathlib import Path

from jaxdist.config_fields import credentials_violation
from jaxdist.errors import JaxdistError
from jaxdist.storage.remote import filesystem, is_remote, redact, storage_error
from jaxdist.training.checkpoint import CheckpointError, checkpoint_steps

log = logging.getLogger(__name__)
COMMIT = "COMMIT"  # written last into a copied step: {"step", "files": {relative path: bytes}}
CHECKPOINTS = "checkpoints"
WORK = ".tiers"  # inside the local tier: downloads and upload snapshots in progress
OWNER = "durable"  # in WORK: the durable tier this local tier belongs to (its identity)
COMMIT_WAIT_S = 3600.0  # how long the copier waits for Orbax to commit a step locally


def run_tiers(run_dir: str, local_dir: str) -> tuple[Path, str | None]:
    """(the folder the run writes to, the durable tier it is copied to or None) for
    ``--run-dir`` and ``checkpoint.local_dir``."""
    if credentials_violation(run_dir):
        raise JaxdistError(f"--run-dir {credentials_violation(run_dir)}")
    if not local_dir:
        if is_remote(run_dir):
            raise JaxdistError(
                f"--run-dir {redact(run_dir)} is in object storage: set checkpoint.local_dir to a local folder the run saves to "
                "first (local NVMe or /dev/shm); finished checkpoints are copied to the run directory behind the run"
            )
        return Path(run_dir), None
    if is_remote(local_dir):
        raise JaxdistError(f"checkpoint.local_dir={redact(local_dir)}: must be a local folder (the run directory may be remote)")
    # resolved: runs/../runs/x and a symlink to the run directory are the run directory too
    if not is_remote(run_dir) and Path(run_dir).expanduser().resolve() == Path(local_dir).expanduser().resolve():
        raise JaxdistError(
            f"checkpoint.local_dir is the run directory ({run_dir}): give a separate, faster local folder, or leave it unset"
        )
    return Path(local_dir), run_dir


class DurableTier:
    """The run directory checkpoints are copied to (a URL or a local path), through fsspec."""

    def __init__(self, location: str):
        self.location = location.rstrip("/")
        if is_remote(self.location):
            self.fs, self.root = filesystem(self.location)
        else:
            import fsspec

            self.fs, self.root = fsspec.filesystem("file", auto_mkdir=True), str(Path(self.location).absolute())

    def __str__(self) -> str:
        return redact(self.location)

    @property
    def identity(self) -> str:
        """What names this tier in a local tier's owner mark: the URL, or the resolved path."""
        return self.location if is_remote(self.location) else str(Path(self.location).expanduser().resolve())

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the storage client's errors, made one line
            raise storage_error(f"{self.location}/{what}", e) from None

    def files(self, prefix: str) -> dict[str, int]:
        """{path relative to ``prefix``: bytes} of every object below it (one listing)."""
        base = f"{self.root}/{prefix}".rstrip("/")
        self.fs.invalidate_cache(base)  # another process (or node) may have written since the last listing
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError as e:
            if "bucket" in str(e).lower():
                raise storage_error(self.location, e) from None
            return {}
        except Exception as e:  # noqa: BLE001
            raise storage_error(f"{self.location}/{prefix}", e) from None
        return {name[len(base) + 1 :]: int(info.get("size") or 0) for name, info in found.items() if info.get("type", "file") == "file"}

    def steps(self) -> tuple[list[int], list[int]]:
        """(complete steps, steps copied in part) in the durable tier's checkpoints, oldest first."""
        by_step: dict[int, set[str]] = {}
        for rel in self.files(CHECKPOINTS):
            head, _, rest = rel.partition("/")
            if head.isdigit():
                by_step.setdefault(int(head), set()).add(rest)
        complete = sorted(s for s, names in by_step.items() if COMMIT in names)
        return complete, sorted(by_step.keys() - set(complete))

    def upload_step(self, source: Path, step: int) -> float:
        """Copy the step folder ``source`` as ``checkpoints/STEP``, the commit marker last; seconds taken."""
        start = time.perf_counter()
        files = {p.relative_to(source).as_posix(): p.stat().st_size for p in sorted(source.rglob("*")) if p.is_file()}
        for rel in files:
            self._call(f"{CHECKPOINTS}/{step}/{rel}", self.fs.put_file, str(source / rel), f"{self.root}/{CHECKPOINTS}/{step}/{rel}")
        marker = json.dumps({"step": step, "files": files}).encode()
        self._call(f"{CHECKPOINTS}/{step}/{COMMIT}", self.fs.pipe_file, f"{self.root}/{CHECKPOINTS}/{step}/{COMMIT}", marker)
        return time.perf_counter() - start

    def remove_step(self, step: int) -> None:
        """Delete a copied step, its marker first (a half-deleted step is never taken for complete)."""
        prefix = f"{self.root}/{CHECKPOINTS}/{step}"
        with contextlib.suppress(FileNotFoundError):
            self._call(f"{CHECKPOINTS}/{step}/{COMMIT}", self.fs.rm_file, f"{prefix}/{COMMIT}")
        for rel in self.files(f"{CHECKPOINTS}/{step}"):
            with contextlib.suppress(FileNotFoundError):
                self._call(f"{CHECKPOINTS}/{step}/{rel}", self.fs.rm_file, f"{prefix}/{rel}")

    def download_step(self, step: int, target: Path) -> None:
        """Fetch complete step ``step`` into ``target`` (created through a temporary folder
        beside it, so a cut download is never taken for a checkpoint). Raises ``JaxdistError``
        when what is stored differs from its marker."""
        prefix = f"{CHECKPOINTS}/{step}"
        marker = json.loads(self._call(f"{prefix}/{COMMIT}", self.fs.cat_file, f"{self.root}/{prefix}/{COMMIT}"))
        partial = target.parent / f".{target.name}.download-{os.getpid()}"
        destinations = {rel: _inside(partial, rel, f"{redact(self.location)}/{prefix}") for rel in marker["files"]}
        stored = self.files(prefix)
        wrong = [rel for rel, size in marker["files"].items() if stored.get(rel) != size]
        if wrong:
            raise JaxdistError(f"{redact(self.location)}/{prefix}: {len(wrong)} file(s) differ from its commit marker, e.g. {wrong[0]}")
        shutil.rmtree(partial, ignore_errors=True)
        for rel, destination in destinations.items():
            destination.parent.mkdir(parents=True, exist_ok=True)
            self._call(f"{prefix}/{rel}", self.fs.get_file, f"{self.root}/{prefix}/{rel}", str(destination))
        partial.rename(target)

    def put_top_files(self, local: Path) -> None:
        """The run's top-level files (config.yaml, metrics.jsonl, ...) as they are now."""
        for path in sorted(local.iterdir()):
            if path.is_file() and not path.name.startswith("."):
                self._call(path.name, self.fs.put_file, str(path), f"{self.root}/{path.name}")

    def get_top_files(self, local: Path, *, below: bool = False) -> list[str]:
        """Fetch the top-level files the local folder lacks (``below``: every file outside the
        checkpoints, e.g. a converted model's tokenizer folder); their names."""
        fetched = []
        for rel in self.files(""):
            head = rel.partition("/")[0]
            wanted = "/" not in rel or (below and head not in (CHECKPOINTS, "params") and not head.startswith("."))
            if wanted and not (local / rel).exists():
                destination = _inside(local, rel, redact(self.location))
                destination.parent.mkdir(parents=True, exist_ok=True)
                self._call(rel, self.fs.get_file, f"{self.root}/{rel}", str(destination))
                fetched.append(rel)
        return fetched


def _inside(folder: Path, rel: str, source: str) -> Path:
    """``folder / rel``, refused when a stored name would lead out of ``folder`` (absolute, or ``..``)."""
    parts = Path(rel).parts
    if not parts or Path(rel).is_absolute() or ".." in parts:
        raise JaxdistError(f"{source}: refusing the stored name {rel!r}: it leads out of the folder it is fetched into")
    return folder / rel


@contextlib.contextmanager
def _locked(folder: Path):
    """Hold ``folder``'s tier lock (the processes of a run prepare the local tier one at a time)."""
    (folder / WORK).mkdir(parents=True, exist_ok=True)
    with open(folder / WORK / "lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare_local_tier(local: Path, durable: str, resume: str) -> None:
    """Before a run resolves its start: bring the durable tier's newest complete step (or the
    one ``--resume STEP`` names) into the local tier when the local tier lacks it, and the
    top-level files it lacks; finish copies a killed run cut short (the local tier still
    has the step) and discard the others. Every process calls it; one does the work."""
    tier = DurableTier(durable)
    tier.steps()  # an unreachable store or a missing bucket is refused before anything is written locally
    try:
        local.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JaxdistError(f"checkpoint.local_dir {local}: cannot create it ({e.strerror})") from None
    with _locked(local):
        complete, partial = tier.steps()
        have = checkpoint_steps(local / CHECKPOINTS)
        _claim(local, tier, have, complete)
        for step in partial:
            if step in have:
                seconds = tier.upload_step(local / CHECKPOINTS / str(step), step)
                log.info(
                    f"checkpoint step {step} was copied to {tier} in part by an earlier run: finished from the local tier ({seconds:.1f}s)"
                )
                complete = sorted({*complete, step})
            else:
                tier.remove_step(step)
                log.info(f"checkpoint step {step} in {tier} was copied in part by an earlier run and the local tier lacks it: discarded")
        fetched = tier.get_top_files(local)
        if fetched:
            log.info(f"fetched {', '.join(fetched)} from {tier}")
        if resume == "never" or not complete:
            return
        wanted = int(resume) if resume.isdigit() else complete[-1] if resume == "auto" else None
        if wanted is None or wanted in have or wanted not in complete or (resume == "auto" and have and have[-1] > wanted):
            return
        start = time.perf_counter()
        (local / CHECKPOINTS).mkdir(exist_ok=True)
        tier.download_step(wanted, local / CHECKPOINTS / str(wanted))
        log.info(f"checkpoint step {wanted} fetched from {tier} into {local} ({time.perf_counter() - start:.1f}s)")


def _claim(local: Path, tier: DurableTier, have: list[int], complete: list[int]) -> None:
    """Tie the local tier to its durable tier (an owner mark written at first use): a folder
    another run wrote is refused, never continued as if it were this run's."""
    mark = local / WORK / OWNER
    if mark.is_file():
        owner = mark.read_text(encoding="utf-8").strip()
        if owner != tier.identity:
            raise JaxdistError(
                f"checkpoint.local_dir {local} is the local tier of another run ({redact(owner)}), not of --run-dir {tier}: "
                "give each run its own local_dir (or remove that folder)"
            )
        return
    # a folder with a run's files but no mark: an unrelated run's, unless the durable tier has this run
    if (have or (local / "config.yaml").exists()) and not complete:
        raise JaxdistError(
            f"checkpoint.local_dir {local} holds another run's files (no mark of --run-dir {tier}, which has no checkpoint): "
            "give this run an empty local_dir"
        )
    mark.write_text(tier.identity + "\n", encoding="utf-8")


def durable_steps(durable: str) -> list[int]:
    """The complete steps in a durable tier."""
    return DurableTier(durable).steps()[0]


@dataclasses.dataclass
class _Failure:
    step: int
    message: str


class Replicator:
    """Copies committed local checkpoints to the durable tier on a thread of its own (process 0)."""

    def __init__(self, local: Path, durable: str, every_steps: int, keep: int):
        self.local, self.tier, self.every, self.keep = local, DurableTier(durable), every_steps, keep
        complete, _ = self.tier.steps()
        self.last_copied = complete[-1] if complete else None
        self._queued_after: int | None = self.last_copied
        self.failure: _Failure | None = None
        self.copy_seconds: dict[int, float] = {}  # step -> seconds its copy took
        self._queue: queue.Queue = queue.Queue()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._work, name="jaxdist-checkpoint-copy", daemon=True)
        self._thread.start()
        local_steps = checkpoint_steps(local / CHECKPOINTS)
        if local_steps and (self.last_copied is None or local_steps[-1] > self.last_copied):
            self.submit(local_steps[-1], last=True)  # an earlier run's save it could not copy (killed, or the store was down)

    def submit(self, step: int, *, last: bool = False) -> None:
        """A full checkpoint was saved at ``step``: copy it if it is due (``last``: the run's last save)."""
        due = last or self.every <= 0 or self._queued_after is None or step - self._queued_after >= self.every
        if due and step != self._queued_after:
            self._queued_after = step
            self._queue.put(step)

    def wait(self) -> None:
        """Block until every submitted copy is done; a failed copy of the run's last checkpoint is an error."""
        self._queue.join()
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise CheckpointError(f"{failure.message}; the local tier ({self.local}) has the step, the next run copies it")

    def close(self) -> None:
        self._closing.set()
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _work(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:  # copies queued behind a slow one: only the newest is worth copying
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            steps = sorted(s for s in batch if s is not None)
            try:
                if steps:
                    if len(steps) > 1:
                        log.info(f"checkpoint steps {', '.join(map(str, steps[:-1]))} not copied to {self.tier}: step {steps[-1]} is newer")
                    self._copy(steps[-1])
                    self.failure = None
            except _Removed as e:  # not a failure: a newer step is saved, and is copied next
                log.warning(str(e))
            except Exception as e:  # noqa: BLE001 - training goes on from the local tier; said in one line
                message = f"copying checkpoint step {steps[-1]} to {self.tier} failed: {redact(str(e).splitlines()[0] if str(e) else type(e).__name__)}"
                log.warning(message)
                self.failure = _Failure(steps[-1], message)
            finally:
                for _ in batch:
                    self._queue.task_done()
            if None in batch:
                return

    def _removed(self, step: int) -> _Removed:
        return _Removed(
            f"checkpoint step {step} was removed from the local tier before it was copied to {self.tier} "
            "(checkpoint.keep is smaller than the copies behind): skipped, the newer step is copied"
        )

    def _copy(self, step: int) -> None:
        committed = self.local / CHECKPOINTS / str(step)
        deadline = time.monotonic() + COMMIT_WAIT_S
        while not committed.is_dir():  # Orbax renames the step's folder into place when every process is done
            if any(s > step for s in checkpoint_steps(self.local / CHECKPOINTS)):  # saved, then deleted by the keep policy
                raise self._removed(step)
            if self._closing.is_set() or time.monotonic() > deadline:
                raise JaxdistError(f"step {step} was not committed locally")
            time.sleep(0.05)
        snapshot = self.local / WORK / f"upload-{step}"
        if self.tier.files(f"{CHECKPOINTS}/{step}"):  # another branch's step of that number: replaced, marker first
            self.tier.remove_step(step)
        try:
            _link_tree(committed, snapshot)  # the local tier's keep policy may delete the step while it uploads
        except OSError:
            shutil.rmtree(snapshot, ignore_errors=True)
            if not committed.is_dir():  # deleted while it was being linked
                raise self._removed(step) from None
            raise
        try:
            seconds = self.tier.upload_step(snapshot, step)
        finally:
            shutil.rmtree(snapshot, ignore_errors=True)
        self.last_copied, self.copy_seconds[step] = step, seconds
        complete, _ = self.tier.steps()
        for old in complete[: max(0, len(complete) - self.keep)]:
            self.tier.remove_step(old)
        self.tier.put_top_files(self.local)
        log.info(f"checkpoint step {step} copied to {self.tier} in {seconds:.1f}s")


class _Removed(Exception):
    """A step the local tier deleted before its copy began."""


def _link_tree(source: Path, target: Path) -> None:
    """``target`` as hard links to ``source``'s files (a copy where links are refused)."""
    shutil.rmtree(target, ignore_errors=True)
    try:
        shutil.copytree(source, target, copy_function=os.link)
    except OSError:
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target)


def fetch_checkpoint(url: str) -> Path:
    """A durable checkpoint named by URL (a step folder, a checkpoints folder or a run directory:
    its newest complete step) fetched into a local cache once; the local step folder."""
    tier_url, _, step_name = url.rstrip("/").rpartition("/")
    if step_name.isdigit() and tier_url.endswith(f"/{CHECKPOINTS}"):
        tier, step = DurableTier(tier_url[: -len(CHECKPOINTS) - 1]), int(step_name)
        if step not in tier.steps()[0]:
            raise JaxdistError(f"checkpoint {redact(url)}: no complete checkpoint there (no {COMMIT} marker)")
    else:
        run_url = url.rstrip("/").removesuffix(f"/{CHECKPOINTS}")
        tier = DurableTier(run_url)
        complete = tier.steps()[0]
        if not complete:
            raise JaxdistError(f"checkpoint {redact(url)}: no complete checkpoint in it")
        step = complete[-1]
    marker = tier._call(f"{CHECKPOINTS}/{step}/{COMMIT}", tier.fs.cat_file, f"{tier.root}/{CHECKPOINTS}/{step}/{COMMIT}")
    cache = Path(os.environ.get("JAXDIST_CACHE", Path.home() / ".cache" / "jaxdist")) / "checkpoints"
    local = cache / hashlib.sha256(tier.location.encode() + marker).hexdigest()[:16]  # a step saved anew is fetched anew
    target = local / CHECKPOINTS / str(step)
    local.mkdir(parents=True, exist_ok=True)
    with _locked(local):
        if not target.is_dir():
            (local / CHECKPOINTS).mkdir(exist_ok=True)
            tier.download_step(step, target)
            tier.get_top_files(local, below=True)
            log.info(f"checkpoint {tier}/{CHECKPOINTS}/{step} fetched into {target}")
    return target.absolute()


def replicator_for(local: Path, durable: str, cfg) -> Replicator | None:
    """The run's copier (process 0; None on the others), once every process is seen to share ``local``."""
    import jax

    if jax.process_count() > 1:
        _check_shared(local)
    if cfg.params_every_steps > 0:
        log.info(f"weights-only checkpoints stay in the local tier ({local}): only full ones are copied to {redact(durable)}")
    if jax.process_index() != 0:
        return None
    return Replicator(local, durable, cfg.remote_every_steps, cfg.keep)


def _check_shared(local: Path) -> None:
    """Raise unless every process sees the file process 0 writes into ``local``."""
    import secrets

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from jaxdist.training.checkpoint import _all_processes_ok

    token = secrets.randbits(31) if jax.process_index() == 0 else 0  # int32: JAX runs without x64
    probe = local / WORK / f"shared-{os.getpid()}"
    if jax.process_index() == 0:
        probe.write_text(str(token))
    token = int(multihost_utils.broadcast_one_to_all(np.int32(token)))
    seen = any(p.read_text() == str(token) for p in (local / WORK).glob("shared-*") if p.is_file())
    ok = _all_processes_ok(seen)
    if jax.process_index() == 0:
        probe.unlink(missing_ok=True)
    if not ok:
        raise JaxdistError(
            f"checkpoint.local_dir {local} is not one folder for every process of the run (node-local tiers across nodes are not built): "
            "give a folder every process sees"
        )
