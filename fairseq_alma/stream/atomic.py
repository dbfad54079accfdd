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
import shutil
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


def fsync_dir(directory: str) -> None:
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
    fsync_dir(directory)


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
