"""The encoded corpus as binary arrays: what the encode step writes and the later steps read.

Encoding turns each line into tokenizer ids; everything after it (the split, the piece counts
of the dictionary, binarization) is arithmetic over these arrays, read in bounded chunks. For a
prefix ``P`` (``work/encoded``, an encode worker's part, or one Slurm shard):

- ``P.ids``: int32, every line's ids, lines and documents in corpus order;
- ``P.lens``: int32, ids per line (never 0: lines the tokenizer left empty are dropped);
- ``P.docs``: int64, lines per document (never 0: documents left empty are dropped);
- ``P.tokens``: int64, tokens per document as fairseq stores them: ids, plus one end-of-line per
  line, plus one for the blank separator line (what the split balances);
- ``P.extra.json``: the pieces the tokenizer could not map to an id (sentencepiece without byte
  fallback returns such characters as their own surface string, and they enter the dictionary
  as symbols of their own); the ids ``V, V+1, ...`` after the tokenizer's ``V`` ids name them.

A part is written by one process; parts are joined in corpus order (``concatenate_parts``), which
renumbers each part's extra pieces into the corpus-wide list (ordered by first occurrence), so the
joined arrays do not depend on how the corpus was cut into parts.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from fairseq_alma.stream.atomic import atomic_output

ARRAYS = {"ids": np.int32, "lens": np.int32, "docs": np.int64, "tokens": np.int64}
EXTRA = "extra.json"
FORMAT = 2  # in the encode step's key: 1 was text (encoded.txt)
CHUNK_IDS = 1 << 21  # ids per chunk of the later passes (a chunk holds whole documents)


def files(prefix: str) -> list[str]:
    """Every file of an encoded prefix (the encode step's outputs)."""
    return [f"{prefix}.{name}" for name in (*ARRAYS, EXTRA)]


class PartWriter:
    """Appends encoded documents to the files of one part (no atomicity: a part is a
    ``.partial`` file of its step, or a shard whose stamp is written after it)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.files = {name: open(f"{prefix}.{name}", "wb") for name in ARRAYS}
        self.extra: dict[str, int] = {}  # surface string -> index after the tokenizer's ids
        self.documents = self.tokens = 0

    def write(self, ids: np.ndarray, lens: np.ndarray, docs: np.ndarray,
              tokens: np.ndarray) -> None:
        for name, array in (("ids", ids), ("lens", lens), ("docs", docs), ("tokens", tokens)):
            np.asarray(array, dtype=ARRAYS[name]).tofile(self.files[name])
        self.documents += len(docs)
        self.tokens += int(tokens.sum())

    def close(self) -> dict:
        for f in self.files.values():
            f.close()
        with open(f"{self.prefix}.{EXTRA}", "w", encoding="utf-8") as f:
            json.dump(list(self.extra), f, ensure_ascii=False)
        return {"documents": self.documents, "tokens": self.tokens}


def read_extra(prefix: str) -> list[str]:
    with open(f"{prefix}.{EXTRA}", encoding="utf-8") as f:
        return json.load(f)


def concatenate_parts(parts: list[str], out_prefix: str, vocab_size: int,
                      remove: bool = True) -> dict:
    """Join the parts (in order) into ``out_prefix``'s files, written atomically; renumber
    each part's extra pieces into one list. Returns documents, tokens and extra pieces."""
    extra: dict[str, int] = {}
    renumber = []
    for part in parts:
        local = read_extra(part)
        renumber.append(np.array([vocab_size + extra.setdefault(s, len(extra)) for s in local],
                                 dtype=np.int64))
    for name, dtype in ARRAYS.items():
        with atomic_output(f"{out_prefix}.{name}", "wb") as out:
            for part, mapping in zip(parts, renumber):
                path = f"{part}.{name}"
                if name != "ids" or not len(mapping):
                    with open(path, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 22)
                else:
                    with open(path, "rb") as f:
                        while len(ids := np.fromfile(f, dtype=dtype, count=CHUNK_IDS)):
                            unknown = ids >= vocab_size
                            ids[unknown] = mapping[ids[unknown] - vocab_size]
                            ids.tofile(out)
    with atomic_output(f"{out_prefix}.{EXTRA}") as f:
        json.dump(list(extra), f, ensure_ascii=False)
    tokens = documents = 0
    for part in parts:
        part_tokens = np.fromfile(f"{part}.tokens", dtype=np.int64)
        documents += len(part_tokens)
        tokens += int(part_tokens.sum())
    if remove:
        for part in parts:
            for path in files(part):
                os.remove(path)
    return {"documents": documents, "tokens": tokens, "extra_pieces": len(extra)}


@dataclass
class Encoded:
    """The per-document arrays of an encoded corpus (small: one entry per document) and
    chunked access to its per-line and per-id arrays."""

    prefix: str
    docs: np.ndarray  # lines per document
    tokens: np.ndarray  # fairseq tokens per document
    pieces: np.ndarray  # ids per document
    chunk_ids: int = CHUNK_IDS  # ids per chunk of ``chunks``

    @classmethod
    def open(cls, prefix: str) -> Encoded:
        docs = np.fromfile(f"{prefix}.docs", dtype=np.int64)
        tokens = np.fromfile(f"{prefix}.tokens", dtype=np.int64)
        if len(docs) != len(tokens):
            raise RuntimeError(f"{prefix}: {len(docs)} documents in .docs, {len(tokens)} in "
                               ".tokens; delete the encode stamp and re-run")
        pieces = tokens - docs - 1
        for name, expected in (("lens", int(docs.sum())), ("ids", int(pieces.sum()))):
            found = os.path.getsize(f"{prefix}.{name}") // np.dtype(ARRAYS[name]).itemsize
            if found != expected:
                raise RuntimeError(f"{prefix}.{name}: {found} entries, the per-document counts "
                                   f"say {expected}; delete the encode stamp and re-run")
        return cls(prefix, docs, tokens, pieces)

    def chunks(self) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
        """``(first document, end document, lens, ids)`` for runs of whole documents of about
        ``chunk_ids`` ids each (one document larger than that is a chunk of its own)."""
        piece_cum = np.concatenate([[0], np.cumsum(self.pieces)])
        line_cum = np.concatenate([[0], np.cumsum(self.docs)])
        n = len(self.docs)
        with open(f"{self.prefix}.lens", "rb") as lens_file, \
                open(f"{self.prefix}.ids", "rb") as ids_file:
            first = 0
            while first < n:
                end = int(np.searchsorted(piece_cum, piece_cum[first] + self.chunk_ids,
                                           "right")) - 1
                end = min(max(end, first + 1), n)
                lens = np.fromfile(lens_file, dtype=np.int32,
                                   count=int(line_cum[end] - line_cum[first]))
                ids = np.fromfile(ids_file, dtype=np.int32,
                                  count=int(piece_cum[end] - piece_cum[first]))
                yield first, end, lens, ids
                first = end
