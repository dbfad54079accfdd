"""``--from-binarized DATA_BIN``: cut an existing fairseq data-bin into an ALMA stream.

Users often have a corpus already tokenized and binarized by ``fairseq-preprocess`` (e.g. GPT-2
BPE ids, paper §5). Decoding it back to text would be slow and could change the tokens, so we
read the binaries directly. ``fairseq-preprocess`` stores one item per text line, each ending in
end-of-sentence, and a blank line as an item holding only end-of-sentence: a *document* is a
maximal run of other items, as ``corpus.py`` reads blank-line-separated text (extra blank lines
are dropped, a file's end also ends its document; ``train``, ``train1``, ... are files read in
that order, as fairseq's ``combine`` does). Each document is written back as its items plus one
separator, and its token count is the text path's (items with their end-of-sentence, plus one),
so ``split.assign_documents`` makes the same seeded split as the text path on the same tokens.

The data-bin's ``dict.txt`` is kept as it is: token ids stay the user's, and a data-bin that
``fairseq-preprocess --srcdict`` made with our dictionary gives our text path's bytes.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fairseq_alma.errors import DataError
from fairseq_alma.stream.atomic import atomic_output, atomic_write_json
from fairseq_alma.stream.manifest import MANIFEST_NAME, sha256_file

from .corpus import SourceFile
from .fileio import PARTIAL_SUFFIX
from .out_dir import output_dir
from .pipeline import (
    PIPELINE_VERSION,
    PrepOptions,
    order_key,
    per_megabatch_size,
    remove_files,
    remove_stale_megabatches,
    stream_manifest,
    withdraw_manifest,
)
from .progress_lines import Progress
from .repeats import document_digest, later_copies, log_repeats, repeats_entry, repeats_key
from .split import (
    assign_documents,
    check_megabatch_bound,
    documents_needed,
    parse_size,
    split_names,
)
from .steps import StepRunner

if TYPE_CHECKING:  # fairseq (and torch) are imported only where a step needs them
    from fairseq.data import Dictionary

SPLIT = "train"  # what fairseq-preprocess --trainpref writes


@dataclass
class Documents:
    """Every document of the train split: where its items lie in which shard, and counts."""

    shard: np.ndarray  # (D,) index into the shard list
    first: np.ndarray  # (D,) first item of the document in its shard
    last: np.ndarray  # (D,) last item (inclusive)
    tokens: np.ndarray  # (D,) int64: item tokens + 1 for the separator, as the text path counts
    unk: np.ndarray  # (D,) <unk> tokens

    def subset(self, keep: np.ndarray) -> Documents:
        """The documents where ``keep`` is True, in the same order."""
        return Documents(self.shard[keep], self.first[keep], self.last[keep], self.tokens[keep],
                         self.unk[keep])


def _prefix(data_bin: str, k: int) -> str:
    return os.path.join(data_bin, SPLIT if k == 0 else f"{SPLIT}{k}")


def find_shards(data_bin: str) -> list[str]:
    """``DATA_BIN/train``, then ``train1``, ``train2``, ... while they exist (path prefixes),
    each checked to be a whole mmap shard before anything reads it (``_check_index``)."""
    from fairseq.data import indexed_dataset

    prefixes = []
    while os.path.exists(indexed_dataset.index_file_path(_prefix(data_bin, len(prefixes)))):
        prefixes.append(_prefix(data_bin, len(prefixes)))
    for name in ("idx", "bin"):
        path = f"{_prefix(data_bin, 0)}.{name}"
        if not os.path.isfile(path):
            raise DataError(f"{path}: missing; --from-binarized reads the train split: run "
                            f"fairseq-preprocess --only-source --trainpref TEXT --destdir "
                            f"{data_bin}")
    orphan = f"{_prefix(data_bin, len(prefixes))}.bin"
    if prefixes and os.path.isfile(orphan):  # the shards end at the first .idx missing
        raise DataError(f"{orphan[:-4]}.idx: missing, while {orphan} is there; copy it from the "
                        f"--destdir of fairseq-preprocess, or remove {orphan} if that shard is "
                        "not part of the data")
    for prefix in prefixes:
        # fairseq's infer_dataset_impl says None for a .idx without its .bin: say it is gone.
        if not os.path.isfile(f"{prefix}.bin"):
            raise DataError(f"{prefix}.bin: missing, while {prefix}.idx is there; copy it from "
                            f"the --destdir of fairseq-preprocess, or remove {prefix}.idx if "
                            "that shard is not part of the data")
        impl = indexed_dataset.infer_dataset_impl(prefix)
        if impl != "mmap":
            raise DataError(f"{prefix}.idx: dataset-impl {impl or 'unknown'}, not mmap; re-run "
                            "fairseq-preprocess with --dataset-impl mmap (its default)")
        _check_index(prefix)
    return prefixes


MMAP_INDEX_HEADER = "<9sQBQ"  # magic, version, dtype code, lines: fairseq's mmap Index writer


def _check_index(prefix: str) -> None:
    """Refuse a damaged mmap ``.idx`` before fairseq reads it.

    Why here: fairseq's reader trusts the header's line count, so a truncated file (a copy cut
    short, a full disk) ends in a bare ``ValueError: buffer is smaller than requested size``,
    or a ``struct.error`` and an "Exception ignored" from its ``__del__``, naming no file.
    The header and the file's size say it all: two arrays of one entry per line follow."""
    from fairseq.data import indexed_dataset

    path = indexed_dataset.index_file_path(prefix)
    header = struct.calcsize(MMAP_INDEX_HEADER)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(header)
    redo = "re-run fairseq-preprocess (or copy the file again)"
    if len(head) < header:
        raise DataError(f"{path}: truncated ({size:,} bytes, shorter than the {header}-byte "
                        f"header of an mmap index); {redo}")
    _, version, code, lines = struct.unpack(MMAP_INDEX_HEADER, head)
    if version != 1 or code not in indexed_dataset._code_to_dtype:  # the reader's own table
        raise DataError(f"{path}: damaged header (version {version}, dtype code {code}); {redo}")
    needed = header + lines * (4 + 8)  # an int32 size and an int64 pointer per line
    if size < needed:
        raise DataError(f"{path}: truncated ({size:,} bytes; its header lists {lines:,} lines, "
                        f"which need {needed:,}); {redo}")


def load_source_dictionary(data_bin: str) -> Dictionary:
    """fairseq's Dictionary of ``DATA_BIN/dict.txt``; a missing or malformed file is named."""
    from fairseq.data import Dictionary

    path = os.path.join(data_bin, "dict.txt")
    if not os.path.isfile(path):
        raise DataError(f"{path}: missing; --from-binarized needs the dictionary the binaries "
                        "were made with (fairseq-preprocess writes it to --destdir)")
    try:
        return Dictionary.load(path)
    except (ValueError, RuntimeError, UnicodeDecodeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{path}: not a fairseq dictionary ({first}); pass the dict.txt "
                        "fairseq-preprocess wrote") from None


def _shard_tokens(prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """(sizes, tokens) of one mmap shard; tokens is the flat memory map of the .bin."""
    from fairseq.data.indexed_dataset import MMapIndexedDataset, data_file_path, index_file_path

    index = MMapIndexedDataset.Index(index_file_path(prefix))
    sizes = np.array(index.sizes, dtype=np.int64)
    dtype = index.dtype
    del index  # closes its memory map
    path = data_file_path(prefix)
    if os.path.getsize(path) != int(sizes.sum()) * np.dtype(dtype).itemsize:
        raise DataError(f"{path}: {os.path.getsize(path)} bytes, its .idx lists "
                        f"{int(sizes.sum())} tokens; re-run fairseq-preprocess")
    tokens = np.memmap(path, dtype=dtype, mode="r") if sizes.sum() else np.zeros(0, dtype)
    return sizes, tokens


def _shard_documents(prefix: str, dictionary: Dictionary) -> tuple[np.ndarray, ...]:
    """(first, last, tokens, unk) per document of one shard, checking that it is language
    modeling data binarized with ``dictionary``."""
    sizes, tokens = _shard_tokens(prefix)
    eos, unk = dictionary.eos(), dictionary.unk()
    ends = np.cumsum(sizes)  # (N,) one past each item's last token
    starts = ends - sizes
    if len(sizes) and (sizes.min() < 1 or np.any(tokens[ends - 1] != eos)):
        raise DataError(f"{prefix}.bin: some lines do not end in end-of-sentence, so documents "
                        "cannot be found; binarize with fairseq-preprocess --only-source")
    if len(tokens) and int(tokens.max()) >= len(dictionary):
        raise DataError(f"{prefix}.bin: token id {int(tokens.max())} is beyond the "
                        f"{len(dictionary)} symbols of dict.txt; the binaries were made with "
                        "another dictionary: put that one in the data-bin")
    separator = sizes == 1  # an item of only end-of-sentence: a blank line
    content = np.flatnonzero(~separator)
    if len(content) == 0:
        return tuple(np.zeros(0, dtype=np.int64) for _ in range(4))
    new_doc = np.ones(len(content), dtype=bool)
    new_doc[1:] = np.diff(content) > 1  # a separator lies between two content items
    first = content[new_doc]
    last = content[np.append(new_doc[1:], True)]
    doc_tokens = ends[last] - starts[first] + 1
    unk_at = np.flatnonzero(tokens == unk)
    unk_docs = np.bincount(np.searchsorted(starts[first], unk_at, side="right") - 1,
                           minlength=len(first))
    return first, last, doc_tokens, unk_docs


def read_documents(prefixes: list[str], dictionary: Dictionary) -> Documents:
    """Every document of the shards, in order: only sizes and token arrays, no per-line loop,
    so the ~2.2B-token corpus of paper §5 is scanned at numpy speed."""
    parts = [_shard_documents(prefix, dictionary) for prefix in prefixes]
    return Documents(
        shard=np.concatenate([np.full(len(p[0]), k) for k, p in enumerate(parts)]),
        first=np.concatenate([p[0] for p in parts]), last=np.concatenate([p[1] for p in parts]),
        tokens=np.concatenate([p[2] for p in parts]).astype(np.int64),
        unk=np.concatenate([p[3] for p in parts]))


def _document_items(prefixes: list[str],
                    docs: Documents) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(index, token ids, item sizes) of every document of ``docs``, in order, as views of the
    shards' memory maps: whole documents as slices, no per-line loop."""
    for k, prefix in enumerate(prefixes):
        shard_sizes, tokens = _shard_tokens(prefix)
        ends = np.cumsum(shard_sizes)
        for d in np.flatnonzero(docs.shard == k):
            a, b = int(docs.first[d]), int(docs.last[d])
            yield int(d), tokens[ends[a] - shard_sizes[a]:ends[b]], shard_sizes[a:b + 1]


def document_digests(prefixes: list[str], docs: Documents, step: str = "repeats") -> bytearray:
    """The digest of every document's token ids (as int64, whatever the shard's dtype), in
    order: what finds the documents that repeat an earlier one (``repeats.py``); ``step``
    names the progress lines."""
    digests = bytearray()
    progress = Progress(step)
    for _, ids, _ in _document_items(prefixes, docs):
        data = np.asarray(ids, dtype="<i8").tobytes()
        digests += document_digest(data)
        progress.update(1, len(data))
    progress.finish()
    return digests


def write_shards(prefixes: list[str], docs: Documents, labels: np.ndarray, names: list[str],
                 vocab_size: int, eos: int, out_dir: str) -> dict[str, dict]:
    """Write each split's documents (corpus order), each followed by one separator, as fairseq
    mmap shards -- the bytes fairseq's builder writes for ``vocab_size`` symbols -- and return
    per-split facts. Whole documents are copied as slices of the source: no per-line loop."""
    from fairseq.data.indexed_dataset import MMapIndexedDataset, best_fitting_int_dtype

    dtype = best_fitting_int_dtype(vocab_size)  # as make_builder("mmap", vocab_size) picks
    separator = np.array([eos], dtype=dtype).tobytes()
    sizes: dict[str, list[np.ndarray]] = {name: [] for name in names}
    progress = Progress("cut")
    with ExitStack() as stack:
        files = {name: stack.enter_context(atomic_output(os.path.join(out_dir, f"{name}.bin"),
                                                         "wb")) for name in names}
        for d, ids, item_sizes in _document_items(prefixes, docs):
            name = names[labels[d]]
            files[name].write(np.asarray(ids, dtype=dtype).tobytes() + separator)
            sizes[name] += [item_sizes, np.ones(1, dtype=np.int64)]
            progress.update(1, int(docs.tokens[d]) * np.dtype(dtype).itemsize)
    progress.finish()
    info = {}
    for index_of_split, name in enumerate(names):
        split_sizes = np.concatenate(sizes[name]) if sizes[name] else np.zeros(0, np.int64)
        idx_path = os.path.join(out_dir, f"{name}.idx")
        with MMapIndexedDataset.Index.writer(idx_path + PARTIAL_SUFFIX, dtype) as index:
            index.write(split_sizes.tolist())
        os.replace(idx_path + PARTIAL_SUFFIX, idx_path)
        chosen = labels == index_of_split
        info[name] = {"lines": len(split_sizes), "tokens": int(split_sizes.sum()),
                      "unk_tokens": int(docs.unk[chosen].sum()), "documents": int(chosen.sum()),
                      "bin_sha256": sha256_file(os.path.join(out_dir, f"{name}.bin")),
                      "idx_sha256": sha256_file(idx_path)}
    return info


def _copy_dictionary(source: str, out_dir: str) -> dict:
    target = os.path.join(out_dir, "dict.txt")
    with open(source, "rb") as f, atomic_output(target, "wb") as out:
        shutil.copyfileobj(f, out)
    return {"sha256": sha256_file(target)}


def _sources(prefixes: list[str]) -> list[SourceFile]:
    found = []
    for prefix in prefixes:
        for ext in ("bin", "idx"):
            st = os.stat(f"{prefix}.{ext}")
            found.append(SourceFile(os.path.abspath(f"{prefix}.{ext}"), st.st_size,
                                    st.st_mtime_ns, st.st_ctime_ns))
    return found


def prepare_from_binarized(options: PrepOptions, command: str) -> dict:
    """Cut ``options.from_binarized`` into ``options.out``; return the manifest."""
    o = options
    data_bin = o.from_binarized
    assert data_bin is not None
    if not os.path.isdir(data_bin):
        raise DataError(f"--from-binarized {data_bin}: not a directory; give the --destdir of "
                        "fairseq-preprocess")
    dictionary = load_source_dictionary(data_bin)
    prefixes = find_shards(data_bin)
    # Before any work, and before B names a split: a document holds at least one token, of at
    # least one byte.
    token_bytes = sum(os.path.getsize(f"{prefix}.bin") for prefix in prefixes)
    check_megabatch_bound(token_bytes, o.num_megabatches, o.eval_per_megabatch is not None,
                          f"{data_bin} ({token_bytes:,} bytes of tokens in its train split)")
    with output_dir(o):
        dict_source = os.path.join(data_bin, "dict.txt")
        dict_sha = sha256_file(dict_source)
        sources = _sources(prefixes)
        names = split_names(o.num_megabatches, o.eval_per_megabatch is not None)
        runner = StepRunner(o.out, lambda: withdraw_manifest(o.out))
        dict_info = runner.ensure("dictionary", {"version": PIPELINE_VERSION, "dict": dict_sha},
                                  ["dict.txt"], lambda: _copy_dictionary(dict_source, o.out))
        key = {"version": PIPELINE_VERSION, "dict": dict_sha,
               # ctime as in the text path's extract key (corpus.SourceFile): a shard corrected
               # with its size and mtime kept (cp -p, rsync -a) would be reused stale.
               "sources": [[s.path, s.bytes, s.mtime_ns, s.ctime_ns] for s in sources],
               "seed": o.seed,
               "num_megabatches": o.num_megabatches, "eval_size": o.eval_size,
               "valid_size": o.valid_size, **order_key(o.order, o.eval_per_megabatch),
               **repeats_key(o.keep_duplicates)}

        def build() -> dict:
            docs = read_documents(prefixes, dictionary)
            repeated = later_copies(document_digests(prefixes, docs))
            found, drop = int(repeated.sum()), not o.keep_duplicates
            log_repeats(found, len(repeated), dropped=drop)
            if found and drop:
                docs = docs.subset(~repeated)
            needed = documents_needed(o.num_megabatches, o.eval_per_megabatch is not None)
            if len(docs.tokens) < needed:
                distinct = " distinct" if found and drop else ""
                raise DataError(
                    f"{data_bin}: the train split has {len(docs.tokens)}{distinct} documents "
                    f"(empty lines separate them) but --num-megabatches {o.num_megabatches} "
                    f"needs at least {needed}; binarize text with blank lines between documents "
                    "or lower it")
            labels, stats = assign_documents(docs.tokens, o.seed, o.num_megabatches,
                                             parse_size(o.valid_size), parse_size(o.eval_size),
                                             o.order, per_megabatch_size(o.eval_per_megabatch))
            runner.changing_stream()  # every refusal is above: only now are shards replaced
            info = write_shards(prefixes, docs, labels, names, len(dictionary),
                                dictionary.eos(), o.out)
            for name, split in info.items():
                if split["tokens"] != stats[name]["tokens"]:  # written vs counted
                    raise RuntimeError(f"{name}: wrote {split['tokens']} tokens, the split "
                                       f"counted {stats[name]['tokens']}")
            return {**info, "repeated_documents": found, "repeats_dropped": bool(found and drop)}
        outputs = [f"{name}.{ext}" for name in names for ext in ("bin", "idx")]
        info = runner.ensure("cut", key, outputs, build, checks_first=True)
        splits = {name: info[name] for name in [*names[2:], "eval", "valid"]}
        remove_stale_megabatches(o.out, names)
        remove_files(o.out, ["spm.model", "spm.vocab"])
        tokenizer = {"kind": "from-binarized", "source": os.path.abspath(data_bin),
                     "dict_sha256": dict_sha}
        manifest = stream_manifest(o, splits, {**dict_info, "size": len(dictionary)},
                                   {"tokenizer": tokenizer}, sources, runner.seconds, command,
                                   repeats_entry(info))
        atomic_write_json(os.path.join(o.out, MANIFEST_NAME), manifest)
        if o.clean:
            shutil.rmtree(os.path.join(o.out, "work"))
        return manifest
