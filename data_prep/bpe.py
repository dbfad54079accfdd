"""Sentencepiece BPE: train the model, then encode documents with a pool of worker processes.

Paper §5 uses a 50,000-unit BPE vocabulary (GPT-2's, which is byte-level). We train a
sentencepiece ``bpe`` model on the corpus itself, optionally with byte fallback so that, as with
GPT-2's byte-level BPE, no character is ever mapped to ``<unk>``. Encoding writes one line of
space-separated pieces per input line and a blank line after each document (fairseq's language
modeling format: ``--sample-break-mode complete_doc`` splits on those blank lines) and records
each document's token count as fairseq will binarize it (pieces + one end-of-line per line +
one for the blank separator), which is what the mega-batch split balances. The encoding pool
takes any ``LineEncoder`` (``SentencepieceLines`` here, ``gpt2_bpe.Gpt2Lines`` for ``--bpe
gpt2``), so both tokenizers write the same format and the later steps cannot tell them apart.
"""

from __future__ import annotations

import io
import os
import re
import shutil
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import pairwise
from multiprocessing import Pool
from typing import Protocol

import sentencepiece as spm

from fairseq_alma.errors import DataError

from .fileio import PARTIAL_SUFFIX, aligned_offsets, atomic_output, sha256_file
from .progress import Progress

# Sentence sampling uses its own fixed seed, so --seed (the split) never retrains the BPE model.
SPM_SAMPLE_SEED = 1
ENCODE_BATCH_BYTES = 1 << 18  # lines per sentencepiece call: about 256 kB of text
ENCODE_CHUNK_BYTES = 1 << 26  # a worker's unit of work: 64 MB of documents


def _training_lines(docs_path: str) -> Iterator[str]:
    with open(docs_path, encoding="utf-8") as f:
        for line in f:
            if line != "\n":
                yield line.rstrip("\n")


def train_sentencepiece(docs_path: str, out_dir: str, vocab_size: int, sample_sentences: int,
                        threads: int, byte_fallback: bool) -> dict:
    """Train ``out_dir/spm.model`` (and its ``spm.vocab`` listing), written atomically.

    Lines are streamed to sentencepiece and the model comes back in memory: given a file path
    sentencepiece would store that path inside the model, so the same corpus prepared into two
    directories would give two different models. ``threads`` changes the learnt merges
    (sentencepiece splits its counting by thread), so it is a flag of its own, apart from
    ``--workers``, and part of this step's key."""
    spm.set_random_generator_seed(SPM_SAMPLE_SEED)
    model_bytes = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_training_lines(docs_path), model_writer=model_bytes,
            model_type="bpe", vocab_size=vocab_size, input_sentence_size=sample_sentences,
            shuffle_input_sentence=True, num_threads=threads, byte_fallback=byte_fallback,
            minloglevel=2)
    except RuntimeError as exc:
        raise DataError(_explain_spm_error(str(exc), vocab_size)) from None
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
    first_line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return f"sentencepiece training failed ({first_line}); check --vocab-size and the inputs"


EncodeLines = Callable[[list[str]], list[list[str]]]


class LineEncoder(Protocol):
    """What a worker process needs to tokenize: picklable, loaded once per byte range."""

    def load(self) -> EncodeLines:
        """Return a function mapping lines to their pieces (strings without whitespace)."""
        ...


@dataclass(frozen=True)
class SentencepieceLines:
    model_path: str

    def load(self) -> EncodeLines:
        model = spm.SentencePieceProcessor(model_file=self.model_path)
        # One sentencepiece call per batch (not per document) keeps Python overhead small.
        return lambda lines: model.encode(lines, out_type=str, num_threads=1)


def sentencepiece_vocabulary(model_path: str) -> list[str]:
    """Every piece the model can produce, in id order, except ``<s>``, ``</s>`` and ``<unk>``
    (fairseq's Dictionary has its own)."""
    model = spm.SentencePieceProcessor(model_file=model_path)
    return [model.id_to_piece(i) for i in range(model.get_piece_size())
            if not (model.is_control(i) or model.is_unknown(i))]


def _encode_batch(encode: EncodeLines, docs: list[list[str]]) -> tuple[bytes, list[int]]:
    """Encode documents; return their text in the encoded format and their token counts.

    A line whose pieces are empty (the tokenizer dropped all its characters) is left out, and a
    document left without lines too: an empty line would read as a document separator."""
    encoded = encode([line for doc in docs for line in doc])
    chunks, counts = [], []
    start = 0
    for doc in docs:
        lines = [pieces for pieces in encoded[start:start + len(doc)] if pieces]
        start += len(doc)
        if not lines:
            continue
        chunks.append("\n".join(" ".join(pieces) for pieces in lines) + "\n\n")
        counts.append(sum(len(pieces) + 1 for pieces in lines) + 1)
    return "".join(chunks).encode("utf-8"), counts


def _document_batches(docs_path: str, start: int, end: int) -> Iterator[list[list[str]]]:
    """Documents of ``docs_path`` (already normalised by extraction) in the byte range
    [start, end), which begins at a document start, in batches of about 256 kB."""
    batch: list[list[str]] = []
    doc: list[str] = []
    size = 0
    with open(docs_path, "rb") as f:
        f.seek(start)
        position = start
        while position < end and (line := f.readline()):
            position += len(line)
            if line != b"\n":
                doc.append(line[:-1].decode("utf-8"))
                size += len(line)
                continue
            batch.append(doc)
            doc = []
            if size >= ENCODE_BATCH_BYTES:
                yield batch
                batch, size = [], 0
    if doc:
        batch.append(doc)
    if batch:
        yield batch


def _encode_range(docs_path: str, start: int, end: int, encoder: LineEncoder, text_path: str,
                  tokens_path: str) -> tuple[int, int, int]:
    """Encode the documents in one byte range into their own text and token-count files;
    return (documents, tokens, bytes read)."""
    model = encoder.load()
    documents = tokens = 0
    with open(text_path, "wb") as text_out, open(tokens_path, "wb") as tokens_out:
        for batch in _document_batches(docs_path, start, end):
            data, counts = _encode_batch(model, batch)
            text_out.write(data)
            array("q", counts).tofile(tokens_out)
            documents += len(counts)
            tokens += sum(counts)
    return documents, tokens, end - start


def _encode_range_star(task: tuple) -> tuple[int, int, int]:
    return _encode_range(*task)


def encode_documents(docs_path: str, encoder: LineEncoder, encoded_path: str, tokens_path: str,
                     workers: int) -> dict:
    """Encode every document of ``docs_path`` with ``workers`` processes, in input order.

    Each worker encodes whole byte ranges of the file into files of its own, concatenated in
    order at the end, so the main process ships no text and the speed scales with workers.
    Writes the pieces to ``encoded_path`` and each document's token count (int64, native
    order) to ``tokens_path``. The output does not depend on ``workers``."""
    size = os.path.getsize(docs_path)
    chunks = max(-(-size // ENCODE_CHUNK_BYTES), 4 * workers if workers > 1 else 1)
    offsets = aligned_offsets(docs_path, chunks, at_blank_line=True)
    parts = [(docs_path, a, b, encoder, f"{encoded_path}{PARTIAL_SUFFIX}.{k}",
              f"{tokens_path}{PARTIAL_SUFFIX}.{k}")
             for k, (a, b) in enumerate(pairwise(offsets))]
    progress = Progress("encode")
    pool = Pool(workers) if workers > 1 else None
    try:
        results = list(_with_progress(
            pool.imap(_encode_range_star, parts) if pool else map(_encode_range_star, parts),
            progress))
    finally:
        if pool is not None:
            pool.terminate()
    for final, index in ((encoded_path, 4), (tokens_path, 5)):
        with atomic_output(final, "wb") as out:
            for part in parts:
                with open(part[index], "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
                os.remove(part[index])
    progress.finish()
    return {"documents": sum(r[0] for r in results), "tokens": sum(r[1] for r in results)}


def _with_progress(results: Iterator[tuple[int, int, int]],
                   progress: Progress) -> Iterator[tuple[int, int, int]]:
    for result in results:
        progress.update(result[0], result[2])
        yield result
