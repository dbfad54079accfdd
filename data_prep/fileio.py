"""Checksums and byte ranges shared by the data_prep steps.

Outputs are written with ``fairseq_alma.stream.atomic.atomic_output`` (the one atomic write):
a killed run never leaves a half-written file under a final name.  Work files that grow over a
step (a binarizer's ``.bin``, a worker's share) carry ``PARTIAL_SUFFIX`` until they are moved
into place; ``out_dir`` removes both kinds of leftovers before the next run.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

PARTIAL_SUFFIX = ".partial"


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
