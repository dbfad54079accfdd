"""Sentencepiece BPE: train the model, then encode documents with a pool of worker processes.

Paper §5 uses a 50,000-unit BPE vocabulary (GPT-2's, which is byte-level). We train a
sentencepiece ``bpe`` model on the corpus itself, optionally with byte fallback so that, as with
GPT-2's byte-level BPE, no character is ever mapped to ``<unk>``. Encoding turns each line into
tokenizer ids, written as binary arrays (``encoded.py``) with each document's token count as
fairseq will binarize it (ids + one end-of-line per line + one for the blank separator), which is
what the mega-batch split balances. Workers each encode whole byte ranges of the extracted text
into files of their own (the main process ships no text), read in blocks of whole documents, one
tokenizer call per block. The pool takes any ``LineEncoder`` (``SentencepieceLines`` here,
``gpt2_bpe.Gpt2Lines`` for ``--bpe gpt2``), so the later steps cannot tell them apart.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from itertools import chain, pairwise
from typing import Protocol

import numpy as np
import sentencepiece as spm

from fairseq_alma.errors import DataError
from fairseq_alma.stream.atomic import atomic_output
from fairseq_alma.stream.manifest import sha256_file

from .encoded import PartWriter, concatenate_parts
from .fileio import PARTIAL_SUFFIX, aligned_offsets
from .progress_lines import Progress, log

# Sentence sampling uses its own fixed seed, so --seed (the split) never retrains the BPE model.
SPM_SAMPLE_SEED = 1
ENCODE_BLOCK_BYTES = 1 << 20  # lines per tokenizer call: about 1 MB of text
ENCODE_CHUNK_BYTES = 1 << 26  # a worker's unit of work: 64 MB of documents


# sentencepiece's trainer skips every line longer than this many UTF-8 bytes: its default
# max_sentence_length. Left at that default, not raised: the trainer holds up to
# --spm-sample-sentences lines in memory, and a corpus of documents one per line would then hold
# whole documents, a million of them. Not passed either: an explicit value is stored in
# spm.model's trainer spec, so every model (and every stream after it) would change bytes.
SPM_MAX_SENTENCE_BYTES = 4192


class TrainingLines:
    """The non-blank lines of the extracted text, as sentencepiece's trainer reads them, and
    how many it will skip for being longer than ``SPM_MAX_SENTENCE_BYTES``: it skips them in
    silence, so a corpus of long lines would train on the few short ones (or fail with an
    internal error when there are none)."""

    def __init__(self, docs_path: str) -> None:
        self.docs_path = docs_path
        self.lines = 0
        self.too_long = 0

    @property
    def are(self) -> str:
        return "is" if self.too_long == 1 else "are"

    @property
    def were(self) -> str:
        return "was" if self.too_long == 1 else "were"

    def __iter__(self) -> Iterator[str]:
        limit = SPM_MAX_SENTENCE_BYTES
        with open(self.docs_path, encoding="utf-8") as f:
            for line in f:
                if line != "\n":
                    line = line.rstrip("\n")
                    self.lines += 1
                    # A character is at most 4 bytes: only long strings need encoding.
                    if len(line) > limit // 4 and len(line.encode("utf-8")) > limit:
                        self.too_long += 1
                    yield line


def train_sentencepiece(docs_path: str, out_dir: str, vocab_size: int, sample_sentences: int,
                        threads: int, byte_fallback: bool,
                        before_writing: Callable[[], None] | None = None) -> dict:
    """Train ``out_dir/spm.model`` (and its ``spm.vocab`` listing), written atomically.

    Lines are streamed to sentencepiece and the model comes back in memory: given a file path
    sentencepiece would store that path inside the model, so the same corpus prepared into two
    directories would give two different models. ``threads`` changes the learnt merges
    (sentencepiece splits its counting by thread), so it is a flag of its own, apart from
    ``--workers``, and part of this step's key. ``before_writing`` runs once training has
    succeeded, before the first file is replaced: a refused training changes nothing."""
    spm.set_random_generator_seed(SPM_SAMPLE_SEED)
    model_bytes = io.BytesIO()
    lines = TrainingLines(docs_path)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model_bytes,
            model_type="bpe", vocab_size=vocab_size, input_sentence_size=sample_sentences,
            shuffle_input_sentence=True, num_threads=threads, byte_fallback=byte_fallback,
            minloglevel=2)
    except RuntimeError as exc:
        if lines.too_long and lines.too_long == lines.lines:
            raise DataError(
                f"every line of the corpus ({lines.lines:,}) is longer than "
                f"{SPM_MAX_SENTENCE_BYTES:,} bytes, which sentencepiece's BPE trainer skips, so "
                "it has nothing to learn from; are documents one per line? Put a line break "
                "after each sentence or paragraph and a blank line between documents (or use "
                "--bpe gpt2, which has no such limit)") from None
        skipped = (f"; {lines.too_long:,} of {lines.lines:,} lines {lines.were} longer than "
                   f"{SPM_MAX_SENTENCE_BYTES:,} bytes and skipped by the trainer (documents one "
                   "per line?)") if lines.too_long else ""
        raise DataError(_explain_spm_error(str(exc), vocab_size) + skipped) from None
    if lines.too_long:
        log(f"warning: {lines.too_long:,} of {lines.lines:,} lines {lines.are} longer than "
            f"{SPM_MAX_SENTENCE_BYTES:,} bytes, which sentencepiece's BPE trainer skips: the BPE "
            "model learnt from the other lines (every line is still encoded); if documents are "
            "one per line, break them into lines")
    if before_writing is not None:
        before_writing()
    model = spm.SentencePieceProcessor(model_proto=model_bytes.getvalue())
    with atomic_output(os.path.join(out_dir, "spm.vocab")) as f:  # sentencepiece's own format
        for piece_id in range(model.get_piece_size()):
            f.write(f"{model.id_to_piece(piece_id)}\t{model.get_score(piece_id):g}\n")
    model_path = os.path.join(out_dir, "spm.model")
    with atomic_output(model_path, "wb") as f:
        f.write(model_bytes.getvalue())
    return {"sha256": sha256_file(model_path), "vocab_size": vocab_size}


def _explain_spm_error(message: str, vocab_size: int) -> str:
    too_high = re.search(r"Vocabulary size too high.*<= (\d+)", message)
    if too_high:
        return (f"--vocab-size {vocab_size} is too large for this corpus (sentencepiece can "
                f"learn at most {too_high.group(1)} pieces from it); pass a smaller --vocab-size "
                "or add text")
    too_low = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", message)
    if too_low:
        return (f"--vocab-size {vocab_size} is too small: this corpus needs at least "
                f"{too_low.group(2)} pieces for its characters alone; pass a larger --vocab-size")
    if "insert_id" in message or "_id(" in message:  # no room left for <s>, </s>, <unk>
        return (f"--vocab-size {vocab_size} is too small: sentencepiece needs room for its "
                f"special pieces and this corpus's characters; pass a larger --vocab-size")
    first_line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return f"sentencepiece training failed ({first_line}); check --vocab-size and the inputs"


class EncodeLines(Protocol):
    def __call__(self, lines: list[str], extra: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
        """Ids of every line, concatenated (int32), and the number per line (int64). A piece
        without an id gets ``vocab_size + extra.setdefault(piece, len(extra))``."""
        ...


class LineEncoder(Protocol):
    """What a worker process needs to tokenize: picklable, loaded once per byte range."""

    def load(self) -> EncodeLines:
        ...

    def piece_table(self) -> list[str]:
        """The symbol of each of the tokenizer's ids, in id order (the dictionary's names)."""
        ...


def flatten(encoded: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Lists of ids per line -> (all ids as int32, ids per line)."""
    lens = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    ids = np.fromiter(chain.from_iterable(encoded), dtype=np.int32, count=int(lens.sum()))
    return ids, lens


@dataclass(frozen=True)
class SentencepieceLines:
    model_path: str

    def load(self) -> EncodeLines:
        model = spm.SentencePieceProcessor(model_file=self.model_path)
        unk, size = model.unk_id(), model.get_piece_size()

        def encode(lines: list[str], extra: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
            # One sentencepiece call per block of lines keeps Python overhead small.
            ids, lens = flatten(model.encode(lines, out_type=int, num_threads=1))
            unknown = np.flatnonzero(ids == unk)
            if len(unknown):  # no byte fallback: the text route kept the surface string
                _name_unknown_pieces(model, lines, ids, lens, unknown, size, extra)
            return ids, lens
        return encode

    def piece_table(self) -> list[str]:
        model = spm.SentencePieceProcessor(model_file=self.model_path)
        return [model.id_to_piece(i) for i in range(model.get_piece_size())]


def _name_unknown_pieces(model: spm.SentencePieceProcessor, lines: list[str], ids: np.ndarray,
                         lens: np.ndarray, unknown: np.ndarray, size: int,
                         extra: dict[str, int]) -> None:
    """Give each ``<unk>`` id the id of its surface string (``encode(out_type=str)``'s piece
    there), as the encoded text held it before ids: ``size + index`` into ``extra``."""
    ends = np.cumsum(lens)
    line_of = np.searchsorted(ends, unknown, side="right")
    for line in np.unique(line_of):
        pieces = model.encode(lines[line], out_type=str)
        if len(pieces) != lens[line]:
            raise RuntimeError(f"sentencepiece gave {len(pieces)} pieces and {lens[line]} ids "
                               f"for the same line: {lines[line][:80]!r}")
        start = ends[line] - lens[line]
        for position in unknown[line_of == line]:
            ids[position] = size + extra.setdefault(pieces[position - start], len(extra))


def sentencepiece_vocabulary(model_path: str) -> list[str]:
    """Every piece the model can produce, in id order, except ``<s>``, ``</s>`` and ``<unk>``
    (fairseq's Dictionary has its own)."""
    model = spm.SentencePieceProcessor(model_file=model_path)
    return [model.id_to_piece(i) for i in range(model.get_piece_size())
            if not (model.is_control(i) or model.is_unknown(i))]


def _encode_block(encode: EncodeLines, text: str, writer: PartWriter) -> int:
    """Encode the whole documents in ``text`` (``line\n...\n\n`` each) into ``writer``; return
    the number of documents read.

    A line whose ids are empty (the tokenizer dropped all its characters) is left out, and a
    document left without lines too: an empty line would read as a document separator."""
    lines = text.split("\n")[:-1]  # "" marks the end of a document
    blank = np.fromiter(map(len, lines), dtype=np.int64, count=len(lines)) == 0
    doc_of_line = (np.cumsum(blank) - blank)[~blank]
    documents = int(blank.sum())
    ids, lens = encode([line for line in lines if line], writer.extra)
    kept = lens > 0
    doc_of_line, lens = doc_of_line[kept], lens[kept]
    doc_lines = np.bincount(doc_of_line, minlength=documents)
    doc_pieces = np.zeros(documents, dtype=np.int64)
    np.add.at(doc_pieces, doc_of_line, lens)
    nonempty = doc_lines > 0
    writer.write(ids, lens, doc_lines[nonempty],
                 doc_pieces[nonempty] + doc_lines[nonempty] + 1)
    return documents


def document_blocks(docs_path: str, start: int, end: int,
                    block_bytes: int = ENCODE_BLOCK_BYTES) -> Iterator[str]:
    """The text of ``docs_path`` (already normalised by extraction: one blank line after every
    document) in [start, end), which begins at a document start, as blocks of whole documents
    of about ``block_bytes``."""
    with open(docs_path, "rb") as f:
        f.seek(start)
        remaining, carry = end - start, b""
        while remaining > 0:
            data = f.read(min(block_bytes, remaining))
            if not data:
                break
            remaining -= len(data)
            data = carry + data
            cut = data.rfind(b"\n\n") + 2  # "\n\n" only ends documents: no line is empty
            if cut == 1:
                carry = data
                continue
            carry = data[cut:]
            yield data[:cut].decode("utf-8")
    if carry:
        raise RuntimeError(f"{docs_path}: bytes {start}-{end} do not end at a document end; "
                           "delete it (and its stamp) and re-run")


def encode_range(docs_path: str, start: int, end: int, encoder: LineEncoder,
                 prefix: str) -> tuple[int, int, int, list[str]]:
    """Encode the documents in one byte range into the files of ``prefix``; return (documents
    read, documents written, bytes read, pieces without an id)."""
    encode = encoder.load()
    writer = PartWriter(prefix)
    read = 0
    try:
        for block in document_blocks(docs_path, start, end):
            read += _encode_block(encode, block, writer)
    finally:
        facts = writer.close()
    return read, facts["documents"], end - start, list(writer.extra)


def _encode_range_star(task: tuple) -> tuple[int, int, int, list[str]]:
    return encode_range(*task)


def encode_ranges(docs_path: str, encoder: LineEncoder, ranges: list[tuple[int, int]],
                  prefixes: list[str], workers: int) -> None:
    """Encode each byte range into its prefix with ``workers`` processes (each range is read
    and written by one worker: the main process ships no text).

    A pool of ``concurrent.futures``, not ``multiprocessing.Pool``: when a worker dies (the
    out-of-memory killer, a signal) the latter waits for its result forever, with no word;
    this one raises ``BrokenProcessPool``, turned into one line."""
    tasks = [(docs_path, a, b, encoder, prefix) for (a, b), prefix in zip(ranges, prefixes)]
    progress = Progress("encode")
    if workers <= 1 or len(tasks) <= 1:
        for result in map(_encode_range_star, tasks):
            progress.update(result[0], result[2])
        progress.finish()
        return
    pool = ProcessPoolExecutor(workers)
    finished = False
    try:
        for result in pool.map(_encode_range_star, tasks):
            progress.update(result[0], result[2])
        finished = True
    except BrokenProcessPool:
        raise DataError(f"encoding {docs_path}: a --workers process died (killed, or out of "
                        "memory?); run the same command again, or "
                        "with fewer --workers") from None
    finally:
        if not finished:  # stop the other workers now, as Pool.terminate did (3.11 has no API)
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.terminate()
        pool.shutdown(wait=finished, cancel_futures=True)
    progress.finish()


def encode_documents(docs_path: str, encoder: LineEncoder, out_prefix: str, workers: int,
                     start: int = 0, end: int | None = None) -> dict:
    """Encode the documents of ``docs_path`` (all, or those in the byte range [start, end))
    into ``out_prefix``'s files (``encoded.py``), with ``workers`` processes over byte ranges
    whose parts are joined in order at the end. The output does not depend on ``workers``."""
    end = os.path.getsize(docs_path) if end is None else end
    chunks = max(-(-(end - start) // ENCODE_CHUNK_BYTES), 4 * workers if workers > 1 else 1)
    offsets = aligned_offsets(docs_path, chunks, at_blank_line=True, start=start, end=end)
    prefixes = [f"{out_prefix}{PARTIAL_SUFFIX}.{k}" for k in range(len(offsets) - 1)]
    encode_ranges(docs_path, encoder, list(pairwise(offsets)), prefixes, workers)
    return concatenate_parts(prefixes, out_prefix, len(encoder.piece_table()))
