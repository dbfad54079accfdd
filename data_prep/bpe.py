"""Sentencepiece BPE: train the model, then encode documents with a pool of worker processes.

Paper §5 uses a 50,000-unit BPE vocabulary (GPT-2's, which is byte-level). We train a
sentencepiece ``bpe`` model on the corpus itself, optionally with byte fallback so that, as with
GPT-2's byte-level BPE, no character is ever mapped to ``<unk>``. Encoding writes one line of
space-separated pieces per input line and a blank line after each document (fairseq's language
modeling format: ``--sample-break-mode complete_doc`` splits on those blank lines) and records
each document's token count as fairseq will binarize it (pieces + one end-of-line per line +
one for the blank separator), which is what the mega-batch split balances.
"""

from __future__ import annotations

import io
import os
import re
from array import array
from collections.abc import Iterator
from multiprocessing import Pool

import sentencepiece as spm

from .corpus import iter_documents
from .errors import DataPrepError
from .fileio import atomic_output, sha256_file
from .progress import Progress

# Sentence sampling uses its own fixed seed, so --seed (the split) never retrains the BPE model.
SPM_SAMPLE_SEED = 1
ENCODE_BATCH_BYTES = 1 << 18  # documents are sent to workers in batches of about 256 kB


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
        raise DataPrepError(_explain_spm_error(str(exc), vocab_size)) from None
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


_worker_model: spm.SentencePieceProcessor | None = None


def _load_worker_model(model_path: str) -> None:
    """Pool initializer: each worker process loads the model once."""
    global _worker_model
    _worker_model = spm.SentencePieceProcessor(model_file=model_path)


def _encode_batch(docs: list[list[str]]) -> tuple[bytes, list[int]]:
    """Encode documents; return their text in the encoded format and their token counts.

    One sentencepiece call per batch (not per document) keeps Python overhead small. A line
    whose pieces are empty (sentencepiece dropped all its characters) is left out, and a
    document left without lines too: an empty line would read as a document separator."""
    assert _worker_model is not None
    encoded = _worker_model.encode([line for doc in docs for line in doc], out_type=str,
                                   num_threads=1)
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


def _batches(docs_path: str) -> Iterator[list[list[str]]]:
    batch: list[list[str]] = []
    size = 0
    with open(docs_path, encoding="utf-8") as f:
        for doc in iter_documents(f):
            batch.append(doc)
            size += sum(len(line) for line in doc)
            if size >= ENCODE_BATCH_BYTES:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def encode_documents(docs_path: str, model_path: str, encoded_path: str, tokens_path: str,
                     workers: int) -> dict:
    """Encode every document of ``docs_path`` with ``workers`` processes, in input order.

    Writes the pieces to ``encoded_path`` and each document's token count (int64, native
    order) to ``tokens_path``. The output does not depend on ``workers``."""
    progress = Progress("encode")
    total_tokens = documents = 0
    pool = Pool(workers, _load_worker_model, (model_path,)) if workers > 1 else None
    if pool is None:
        _load_worker_model(model_path)
    try:
        results = pool.imap(_encode_batch, _batches(docs_path)) if pool else \
            map(_encode_batch, _batches(docs_path))
        with atomic_output(encoded_path, "wb") as text_out, \
                atomic_output(tokens_path, "wb") as tokens_out:
            for data, counts in results:
                text_out.write(data)
                array("q", counts).tofile(tokens_out)
                documents += len(counts)
                total_tokens += sum(counts)
                progress.update(len(counts), len(data))
    finally:
        if pool is not None:
            pool.terminate()
    progress.finish()
    return {"documents": documents, "tokens": total_tokens}
