"""Crash-safe file writes: the one write helper of fairseq-alma (temp file, fsync, ``os.replace``).

Why: an ALMA stream runs for days (paper App. B.2: 120k updates per stage, 4 stages) and may be
killed at any point (pre-emption, Slurm requeue).  Every output it leaves behind (stage
checkpoints, ``stream.jsonl``, reports) must be either the old complete file or the new complete
file, never a half-written one, so that the same command run again can trust what it finds.
``os.replace`` is atomic on POSIX when source and target are on the same file system, hence the
temp file lives in the target's own directory.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from typing import IO, Any, BinaryIO

_COPY_CHUNK = 16 * 1024 * 1024
# A killed writer leaves ``.<name>.<random>.tmp`` next to ``<name>``; never a final name.
TEMP_SUFFIX = ".tmp"


@functools.lru_cache(maxsize=1)
def _default_mode() -> int:
    """Mode a plain ``open(path, "w")`` would give (0o666 minus the umask); mkstemp uses 0o600.

    The umask is read from /proc when possible: ``os.umask`` can only be read by setting it,
    which briefly changes it for every thread of the process (data loaders, loggers).
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _fsync_dir(directory: str) -> None:
    """Make the rename itself durable (POSIX needs the directory entry flushed too)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some file systems do not let us open directories; the data is synced
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, mode: str = "w", encoding: str = "utf-8",
                  file_mode: int | None = None) -> Iterator[IO[Any]]:
    """Open a temporary file next to ``path`` for writing (``mode`` "w" or "wb"); when the block
    ends without an exception it is flushed, fsynced and renamed over ``path``, otherwise it is
    removed.  For outputs written piece by piece (data preparation streams GBs through it)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_output: mode must be 'w' or 'wb', got {mode!r}")
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=TEMP_SUFFIX,
                               dir=directory)
    try:
        text = {"encoding": encoding} if mode == "w" else {}
        with os.fdopen(fd, mode, **text) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, _default_mode() if file_mode is None else file_mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _atomic_write_with(
    path: str | os.PathLike, write: Callable[[BinaryIO], None], mode: int
) -> None:
    with atomic_output(path, "wb", file_mode=mode) as handle:
        write(handle)


def atomic_write_stream(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Replace ``path`` with whatever ``write(handle)`` writes (e.g. ``torch.save(obj, handle)``,
    streamed: a multi-GB checkpoint never sits in memory twice)."""
    _atomic_write_with(path, write, _default_mode())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one step; parent directories are created if missing."""
    _atomic_write_with(path, lambda handle: handle.write(data), _default_mode())


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Replace ``path`` with ``text`` (UTF-8 by default) in one step."""
    atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> None:
    """Replace ``path`` with ``obj`` as strict JSON (NaN/inf are refused: many readers choke)."""
    try:
        text = json.dumps(obj, indent=indent, allow_nan=False, ensure_ascii=False)
    except ValueError as err:
        raise ValueError(
            f"{os.fspath(path)}: cannot write as JSON ({err}); replace NaN/inf values"
        ) from None
    atomic_write_text(path, text + "\n")


def atomic_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy ``src`` over ``dst`` atomically (streamed, so multi-GB checkpoints are fine).

    ``dst`` keeps ``src``'s permission bits, like ``shutil.copy``.
    """
    src = os.fspath(src)
    if not os.path.isfile(src):
        raise FileNotFoundError(f"{src}: no such file to copy")

    def copy_into(handle: BinaryIO) -> None:
        with open(src, "rb") as source:
            shutil.copyfileobj(source, handle, _COPY_CHUNK)

    _atomic_write_with(dst, copy_into, os.stat(src).st_mode & 0o7777)


# ---- several outputs that change together --------------------------------------------------
# A staging directory is named ``<prefix><pid>@<host>-<random>``: a later run on the same host
# can tell that its writer is gone (``remove_stale_staging``) without a record file.
_STAGING_NAME = re.compile(r"(?P<pid>\d+)@(?P<host>.+)-[a-z0-9_]+")
_STAGING_LOCK = ".lock"  # held (flock) by the writer for as long as it stages
_NEW, _OLD = "new", "old"  # staged files; the files they replace, kept until all are moved


def remove_stale_staging(folder: str | os.PathLike, prefix: str) -> list[str]:
    """Remove the staging directories (``StagedOutputs(prefix)``) in ``folder`` whose writer is
    gone, and return them.

    Why: a writer killed by SIGKILL (or a SIGTERM it does not handle) cannot remove its staging
    directory, and one per interruption piled up in an output folder forever.  One is stale only
    when its name says it was made on this host by a process that no longer exists and nobody
    holds its lock: a directory of a live writer (of this host, of another node of a shared file
    system, or of another pid namespace of this host) is never touched."""
    from .lock import pid_alive, try_flock  # lock.py writes through this module

    removed = []
    host = socket.gethostname()
    with contextlib.suppress(OSError):
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            found = _STAGING_NAME.fullmatch(entry.name[len(prefix):]) \
                if entry.name.startswith(prefix) else None
            if found is None or found["host"] != host or not entry.is_dir(follow_symlinks=False):
                continue
            if int(found["pid"]) == os.getpid() or pid_alive(int(found["pid"])):
                continue
            try:
                held = try_flock(os.path.join(entry.path, _STAGING_LOCK))
            except OSError:
                continue
            if held is None:  # its writer lives (a pid of another namespace)
                continue
            os.close(held[0])
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


class StagedOutputs:
    """Files drawn first into a staging directory next to each, then moved into place together
    (``publish``): a failure while drawing or moving leaves every target as it was.

    Why: a command that writes several files (a table, its CSV and JSON, figures) one after
    another, each atomically, left the earlier ones replaced and the later ones from the
    previous run when one failed (full disk, a directory under a file's name, Ctrl-C): a mix
    that no command made.  Use as a context manager; leaving it removes the staging
    directories (``discard``), whatever happened."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix  # e.g. ".alma-report-": hidden, and names the command
        self._scratch: dict[str, tuple[str, int]] = {}  # folder -> staging dir, its lock's fd
        self._staged: list[tuple[str, str]] = []  # (staged file, target)

    def __enter__(self) -> StagedOutputs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()

    def path_for(self, target: str | os.PathLike) -> str:
        """Where to draw ``target`` (same base name, so its extension still names its format);
        the first call for a folder removes its stale staging directories and makes one."""
        target = os.path.abspath(os.fspath(target))
        folder = os.path.dirname(target)
        if folder not in self._scratch:
            from .lock import try_flock

            os.makedirs(folder, exist_ok=True)
            remove_stale_staging(folder, self._prefix)
            scratch = tempfile.mkdtemp(prefix=f"{self._prefix}{os.getpid()}@{socket.gethostname()}-",
                                       dir=folder)
            self._scratch[folder] = (scratch, -1)
            held = try_flock(os.path.join(scratch, _STAGING_LOCK))
            self._scratch[folder] = (scratch, held[0] if held else -1)
            for sub in (_NEW, _OLD):
                os.mkdir(os.path.join(scratch, sub))
        staged = os.path.join(self._scratch[folder][0], _NEW, os.path.basename(target))
        self._staged.append((staged, target))
        return staged

    def publish(self) -> None:
        """Move every staged file onto its target, in the order they were staged.  When a move
        fails (or is interrupted), those already made are undone (the earlier files put back)
        and the ``OSError`` is raised with the target as its ``filename``."""
        done: list[tuple[str, str | None]] = []  # target, the earlier file's copy (None: none)
        target = ""
        try:
            for staged, target in self._staged:
                backup = None
                if os.path.lexists(target):
                    backup = os.path.join(os.path.dirname(os.path.dirname(staged)), _OLD,
                                          os.path.basename(target))
                    try:
                        os.link(target, backup, follow_symlinks=False)
                    except OSError:  # a file system without hard links, or not a file
                        shutil.copy2(target, backup, follow_symlinks=False)
                os.replace(staged, target)
                done.append((target, backup))
        except BaseException as err:
            for moved, backup in reversed(done):
                with contextlib.suppress(OSError):
                    if backup is None:
                        os.unlink(moved)
                    else:
                        os.replace(backup, moved)
            if isinstance(err, OSError):
                raise OSError(err.errno, err.strerror, target) from None
            raise
        for folder in self._scratch:
            _fsync_dir(folder)

    def discard(self) -> None:
        """Remove the staging directories (and whatever is still staged in them)."""
        for scratch, fd in self._scratch.values():
            shutil.rmtree(scratch, ignore_errors=True)
            if fd >= 0:
                os.close(fd)
        self._scratch.clear()
        self._staged.clear()
