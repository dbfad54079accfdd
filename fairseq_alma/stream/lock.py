"""One writer per run directory: on one node, across nodes, and across Slurm requeues.

Why two mechanisms.  ``flock`` is exact and free on a local disk: the kernel drops the lock when
the holder dies (kill -9 included), so a second process on the same node is stopped at once.
On shared file systems it cannot be trusted alone: NFS and Lustre mounts often make ``flock``
node-local (two nodes both "get" it) or refuse it, and a job that Slurm requeues may restart on
another node while the file system still shows the old holder.  So the holder also writes a
record, ``run.lock.json`` (host, pid, Slurm job, a heartbeat refreshed every
``HEARTBEAT_SECONDS``), and a process takes over a directory only when

* it holds ``flock`` and the record is from its own host (the recorded process is gone: on one
  node ``flock`` is exact), or
* the record is from the same Slurm job (an earlier run of a requeued job: Slurm runs one at a
  time), or
* the record's heartbeat is older than ``EXPIRE_SECONDS`` (its holder stopped beating).

Otherwise it stops with one line naming the holder.  The record is removed on a clean exit.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import RunDirError
from .atomic import atomic_write_text

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
HOLDER_FILE = "run.lock.json"
HEARTBEAT_SECONDS = 30.0
EXPIRE_SECONDS = 600.0  # 20 missed heartbeats: generous to clock skew between nodes


def try_flock(path: str | os.PathLike) -> tuple[int, bool] | None:
    """Open ``path`` (created if missing) and take an exclusive ``flock`` without waiting.

    Returns ``(fd, True)`` when this process now holds it (closing ``fd`` drops it, and so does
    the process dying), ``(fd, False)`` on a file system without ``flock`` (some NFS/Lustre
    mounts: the caller decides what else protects it), and ``None`` when another process holds
    it.  The one ``flock`` of fairseq-alma: run directories (``RunLock``) and data preparation
    outputs both take it here.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as err:
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            os.close(fd)
            raise
        return fd, False
    return fd, True


@dataclass(frozen=True)
class Holder:
    """Who holds a run directory."""

    host: str
    pid: int
    slurm_job: str  # "" outside Slurm; array tasks as <array job>_<task>
    started: float
    heartbeat: float

    @classmethod
    def me(cls) -> Holder:
        now = time.time()
        return cls(socket.gethostname(), os.getpid(), _slurm_job(), now, now)

    def describe(self) -> str:
        job = f", Slurm job {self.slurm_job}" if self.slurm_job else ""
        age = max(0.0, time.time() - self.heartbeat)
        return f"pid {self.pid} on {self.host}{job}, last heartbeat {age:.0f}s ago"


def _slurm_job() -> str:
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return os.environ.get("SLURM_JOB_ID", "")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_HELD: dict[str, RunLock] = {}  # realpath -> this process's lock on it (acquire is reentrant)


class RunLock:
    """The writer's claim on one run directory (module doc).  ``acquire``, then ``release``
    (also registered with ``atexit``); acquiring a directory this process already holds
    returns the same lock, counted, so nested users do not lock themselves out."""

    def __init__(self, directory: str | os.PathLike, heartbeat_seconds: float = HEARTBEAT_SECONDS,
                 expire_seconds: float = EXPIRE_SECONDS) -> None:
        self.directory = Path(directory)
        self.heartbeat_seconds = heartbeat_seconds
        self.expire_seconds = expire_seconds
        self.holder = Holder.me()
        self._fd: int | None = None
        self._users = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def record_path(self) -> Path:
        return self.directory / HOLDER_FILE

    def read_holder(self) -> Holder | None:
        try:
            return Holder(**json.loads(self.record_path.read_text("utf-8")))
        except (FileNotFoundError, ValueError, TypeError):
            return None

    def acquire(self) -> RunLock:
        self.directory.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(self.directory)
        held = _HELD.get(key)
        if held is not None:
            held._users += 1
            return held
        taken = try_flock(self.directory / LOCK_FILE)
        if taken is None:
            raise RunDirError(self._busy_message(self.read_holder()))
        fd, have_flock = taken
        other = self.read_holder()
        if other is not None and not self._may_take_over(other, have_flock):
            os.close(fd)
            raise RunDirError(self._busy_message(other))
        if other is not None and (other.host, other.pid) != (self.holder.host, self.holder.pid):
            logger.warning("%s: taking over from %s", self.directory, other.describe())
        self._fd = fd
        self._users = 1
        _HELD[key] = self
        self._beat()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="alma-run-lock",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.release, True)
        return self

    def _may_take_over(self, other: Holder, have_flock: bool) -> bool:
        if (other.host, other.pid) == (self.holder.host, self.holder.pid):
            return True
        if other.host == self.holder.host and (have_flock or not pid_alive(other.pid)):
            return True
        if other.slurm_job and other.slurm_job == self.holder.slurm_job:
            return True
        return time.time() - other.heartbeat > self.expire_seconds

    def _busy_message(self, other: Holder | None) -> str:
        who = other.describe() if other is not None else "another process on this node"
        return (f"{self.directory} is in use by {who}; wait for that run to end or stop it, or use "
                f"another --save-dir")

    def _beat(self) -> None:
        now = time.time()
        self.holder = Holder(self.holder.host, self.holder.pid, self.holder.slurm_job,
                             self.holder.started, now)
        atomic_write_text(self.record_path, json.dumps(asdict(self.holder)) + "\n")

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            try:
                self._beat()
            except OSError as err:  # a full or vanished disk: the run itself will report it
                logger.warning("%s: heartbeat not written (%s)", self.record_path, err)

    def release(self, everyone: bool = False) -> None:
        """Stop the heartbeat, remove the record if it is still ours, drop ``flock`` (once the
        last user released it, or at once with ``everyone``, as at exit)."""
        if self._fd is None:
            return
        self._users -= 1
        if self._users > 0 and not everyone:
            return
        _HELD.pop(os.path.realpath(self.directory), None)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        current = self.read_holder()
        if current is not None and (current.host, current.pid) == (self.holder.host, self.holder.pid):
            try:
                self.record_path.unlink()
            except FileNotFoundError:
                pass
        os.close(self._fd)  # closing drops the flock
        self._fd = None
