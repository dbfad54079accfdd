"""Atomic writes, checksums and small JSON files shared by the data_prep steps.

Every output is written to ``<path>.partial`` and moved into place with ``os.replace``, so a
killed run never leaves a half-written file under a final name; the next run overwrites any
stale ``.partial`` and continues.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from typing import IO, Any

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


def aligned_offsets(path: str, chunks: int, at_blank_line: bool = False) -> list[int]:
    """Increasing byte offsets ``[0, ..., size]`` cutting ``path`` into at most ``chunks``
    non-empty ranges, each starting at a line start (or, with ``at_blank_line``, at a
    document start: right after a blank line), so workers can process ranges independently."""
    size = os.path.getsize(path)
    offsets = [0]
    with open(path, "rb") as f:
        for k in range(1, chunks):
            target = max(size * k // chunks, offsets[-1])
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
