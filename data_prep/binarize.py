"""The shared fairseq dictionary, and binarization of every split into fairseq's mmap format.

One dictionary serves every split (DESIGN.md: the task refuses data whose dictionary checksum
disagrees with the manifest). Its symbols are every piece that occurs in the *training*
mega-batches, with those counts, plus every other piece of the tokenizer's vocabulary (the
sentencepiece model's, or GPT-2's ids) with count 0: the counts come only from training data,
yet any piece the tokenizer can produce has an id, so the evaluation mega-batch needs no
``<unk>``. ``Dictionary.finalize`` orders symbols by
frequency and pads the size to a multiple of 8, as ``fairseq-preprocess`` does.

Binarization writes exactly what ``fairseq-preprocess --only-source --srcdict dict.txt``
writes for each split's text (tests compare the bytes with fairseq's ``FileBinarizer`` and
``MMapIndexedDatasetBuilder``): each line becomes its piece ids plus one end-of-sentence, a
document separator a lone end-of-sentence. It works on the encoded ids, not text: a lookup array
maps tokenizer ids to dictionary ids and each chunk of documents is laid out with numpy, so the
pass runs at about I/O speed in one process. fairseq's own writer (``add_item`` per line, and a
Python loop over the sizes for the pointers) is replaced by ``MMapWriter``, which writes its
bytes; fairseq's dtype choice, header constants and ``Dictionary`` are used as they are.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from collections.abc import Iterator

import numpy as np
from fairseq.data import Dictionary, indexed_dataset

from fairseq_alma.stream.atomic import atomic_output
from fairseq_alma.stream.manifest import sha256_file

from .encoded import CHUNK_IDS, Encoded
from .fileio import PARTIAL_SUFFIX
from .progress_lines import Progress

PADDING_FACTOR = 8


def build_dictionary(counts_path: str, vocabulary: list[str], dict_path: str) -> dict:
    """Write ``dict.txt`` from the training pieces' counts plus, with count 0, every other
    piece of the tokenizer's ``vocabulary``; return its sha256 and size (specials included)."""
    with open(counts_path, encoding="utf-8") as f:
        counts: dict[str, int] = json.load(f)
    dictionary = Dictionary()
    for piece, count in sorted(counts.items()):
        dictionary.add_symbol(piece, n=count)
    for piece in vocabulary:
        if piece not in dictionary:
            dictionary.add_symbol(piece, n=0)
    dictionary.finalize(threshold=-1, nwords=-1, padding_factor=PADDING_FACTOR)
    with atomic_output(dict_path) as f:
        dictionary.save(f)
    return {"sha256": sha256_file(dict_path), "size": len(dictionary)}


class MMapWriter:
    """One fairseq mmap dataset (``.bin``/``.idx``) written from numpy chunks, in the exact
    layout of fairseq's ``MMapIndexedDatasetBuilder`` + ``MMapIndexedDataset.Index.writer``
    (its magic, version 1, dtype code, item count, int32 sizes, int64 byte pointers) without
    its per-item Python loops: the data streams to ``.bin``, the sizes to a side file that is
    read back in chunks for the pointers. Both files are hashed as written."""

    def __init__(self, prefix: str, dtype: type) -> None:
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        self._bin = open(prefix + ".bin" + PARTIAL_SUFFIX, "wb")
        self._sizes = open(prefix + ".sizes" + PARTIAL_SUFFIX, "wb")
        self.bin_hash = hashlib.sha256()
        self.items = self.tokens = 0

    def add(self, data: np.ndarray, sizes: np.ndarray) -> None:
        """Append items: ``data`` holds them back to back, ``sizes`` their lengths."""
        raw = np.ascontiguousarray(data, dtype=self.dtype).tobytes()
        self._bin.write(raw)
        self.bin_hash.update(raw)
        np.ascontiguousarray(sizes, dtype=np.int32).tofile(self._sizes)
        self.items += len(sizes)
        self.tokens += len(data)

    def finalize(self) -> dict:
        """Write the index, move both files into place; return their sha256."""
        self._bin.close()
        self._sizes.close()
        sizes_path = self.prefix + ".sizes" + PARTIAL_SUFFIX
        idx_hash = hashlib.sha256()
        code = indexed_dataset._dtype_header_code(self.dtype.type)
        header = (indexed_dataset.MMapIndexedDataset.Index._HDR_MAGIC + struct.pack("<Q", 1)
                  + struct.pack("<B", code) + struct.pack("<Q", self.items))
        with atomic_output(self.prefix + ".idx", "wb") as idx:
            for part in self._index_parts(header, sizes_path):
                idx.write(part)
                idx_hash.update(part)
        os.remove(sizes_path)
        os.replace(self.prefix + ".bin" + PARTIAL_SUFFIX, self.prefix + ".bin")
        return {"bin_sha256": self.bin_hash.hexdigest(), "idx_sha256": idx_hash.hexdigest()}

    def _index_parts(self, header: bytes, sizes_path: str) -> Iterator[bytes]:
        yield header
        with open(sizes_path, "rb") as f:
            while len(sizes := np.fromfile(f, dtype=np.int32, count=CHUNK_IDS)):
                yield sizes.tobytes()
        address = 0  # pointer of each item: byte offset of its data, as _get_pointers sums
        with open(sizes_path, "rb") as f:
            while len(sizes := np.fromfile(f, dtype=np.int32, count=CHUNK_IDS)):
                ends = np.cumsum(sizes, dtype=np.int64) * self.itemsize + address
                yield np.concatenate([[address], ends[:-1]]).astype(np.int64).tobytes()
                address = int(ends[-1])

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def close_quietly(self) -> None:
        """After an error: close and remove what was not finalized."""
        for f in (self._bin, self._sizes):
            f.close()
        for ext in (".bin", ".sizes"):
            path = self.prefix + ext + PARTIAL_SUFFIX
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def symbol_lookup(dictionary: Dictionary, symbols: list[str]) -> np.ndarray:
    """The dictionary id of each tokenizer symbol (``<unk>``'s for one the dictionary lacks,
    as ``Dictionary.index`` and fairseq's binarizer give it)."""
    return np.array([dictionary.index(symbol) for symbol in symbols], dtype=np.int64)


def binarize_splits(encoded: Encoded, labels: np.ndarray, names: list[str], symbols: list[str],
                    dict_path: str, out_dir: str) -> dict[str, dict]:
    """Write every split as ``out_dir/<split>.bin/.idx`` in one chunked pass over the encoded
    ids; return fairseq's counts per split.

    Each document of a split (corpus order) is its lines, each line its dictionary ids plus
    end-of-sentence, then one item of only end-of-sentence (the blank separator line): exactly
    what ``fairseq-preprocess --only-source --srcdict dict.txt`` writes for the split's text.
    ``tokens`` counts ids plus one end-of-sentence per item and ``unk_tokens`` the ids that map
    to ``<unk>``, as ``fairseq-preprocess`` reports them."""
    dictionary = Dictionary.load(dict_path)
    lookup = symbol_lookup(dictionary, symbols)
    eos, unk = dictionary.eos(), dictionary.unk()
    dtype = indexed_dataset.best_fitting_int_dtype(len(dictionary))  # as make_builder picks
    writers = [MMapWriter(os.path.join(out_dir, name), dtype) for name in names]
    unk_tokens = [0] * len(names)
    progress = Progress("binarize")
    try:
        for first, end, lens, ids in encoded.chunks():
            doc_lines, chunk_labels = encoded.docs[first:end], labels[first:end]
            # Output layout of the chunk (all documents, corpus order): an item per line and
            # one separator item per document; every position not holding an id is an eos.
            line_doc = np.repeat(np.arange(len(doc_lines)), doc_lines)
            id_line = np.repeat(np.arange(len(lens)), lens)
            data = np.full(len(ids) + len(lens) + len(doc_lines), eos, dtype=np.int64)
            data[np.arange(len(ids)) + id_line + line_doc[id_line]] = lookup[ids]
            sizes = np.ones(len(lens) + len(doc_lines), dtype=np.int32)
            sizes[np.arange(len(lens)) + line_doc] = lens + 1
            data_label = np.repeat(chunk_labels, encoded.tokens[first:end])
            item_label = np.repeat(chunk_labels, doc_lines + 1)
            for index in np.unique(chunk_labels):
                chosen = data[data_label == index]
                writers[index].add(chosen, sizes[item_label == index])
                unk_tokens[index] += int(np.count_nonzero(chosen == unk))
            progress.update(end - first, 4 * len(ids))
        info = {}
        for index, (name, writer) in enumerate(zip(names, writers)):
            info[name] = {"lines": writer.items, "tokens": writer.tokens,
                          "unk_tokens": unk_tokens[index], **writer.finalize()}
    finally:
        for writer in writers:
            writer.close_quietly()
    progress.finish()
    return info
