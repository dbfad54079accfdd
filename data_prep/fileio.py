"""Atomic writes, checksums and small JSON files shared by the data_prep steps.

Every output is written to ``<path>.partial`` and moved into place with ``os.replace``, so a
killed run never leaves a half-written file under a final name; the next run overwrites any
stale ``.partial`` and continues.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from typing import IO, Any

from fairseq_alma.errors import DataError

PARTIAL_SUFFIX = ".partial"


@contextlib.contextmanager
def atomic_output(path: str, mode: str = "w", **open_kwargs: Any) -> Iterator[IO[Any]]:
    """Open ``path + '.partial'`` for writing; on success rename it to ``path``."""
    partial = path + PARTIAL_SUFFIX
    if "b" not in mode:
        open_kwargs.setdefault("encoding", "utf-8")
    try:
        with open(partial, mode, **open_kwargs) as f:
            yield f
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
        raise


def write_json_atomic(path: str, obj: Any) -> None:
    with atomic_output(path) as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def sha256_file(path: str, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def digest_of(obj: Any) -> str:
    """A stable digest of a JSON-able value (keys sorted), used to chain step keys."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode("utf-8")).hexdigest()


def aligned_offsets(path: str, chunks: int, at_blank_line: bool = False, start: int = 0,
                    end: int | None = None) -> list[int]:
    """Increasing byte offsets ``[start, ..., end]`` cutting ``path`` (by default all of it)
    into at most ``chunks`` non-empty ranges, each starting at a line start (or, with
    ``at_blank_line``, at a document start: right after a blank line), so workers can process
    ranges independently. ``start`` must itself be such a start."""
    size = os.path.getsize(path) if end is None else end
    offsets = [start]
    with open(path, "rb") as f:
        for k in range(1, chunks):
            target = max(start + (size - start) * k // chunks, offsets[-1])
            f.seek(max(target - 1, 0))
            if target > 0:
                f.readline()  # now at the first line that starts at or after target
            if at_blank_line:
                while (line := f.readline()) and line != b"\n":
                    pass
            if offsets[-1] < f.tell() < size:
                offsets.append(f.tell())
    offsets.append(size)
    return offsets


def lock_file(path: str, busy: str) -> int:
    """Hold an exclusive lock on ``path`` (created if needed) until the fd is closed; raise
    ``DataError(busy)`` if another process holds it."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataError(busy) from None
    return fd
