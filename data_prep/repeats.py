"""Exact repeats of a document: found by a digest of each document, every copy after the first dropped.

Why: large text collections (paper §5's is Books, Wikipedia and Common Crawl) hold many exact
copies of one document: licence boilerplate, mirrored pages, a file saved under two names. The
seeded split scatters the copies at random, so one copy can land in the evaluation mega-batch (or
the validation set) and another in a training mega-batch. The model is then tested on text it
was trained on, and every perplexity the stream reports comes out too low, with nothing to say
so. Dropping the later copies before the split keeps held-out text held out. ``--keep-duplicates``
keeps them: a stream byte for byte as earlier versions prepared it, or a corpus whose repeats are
meant to be there.

A document's digest is a 128-bit BLAKE2b of its normalised text (of its token ids on the
``--from-binarized`` route). That is 16 bytes per document, and the first copies are found with
one ``np.unique``, so memory stays small next to the corpus (the ~4M documents of §5: 64 MB).
Two different documents share a digest with probability about n^2 / 2^129: never, in practice.
"""

from __future__ import annotations

import hashlib

import numpy as np

from .progress_lines import log

DIGEST_BYTES = 16


def document_digest(data: bytes) -> bytes:
    """The digest that decides whether two documents are the same."""
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def later_copies(digests: bytes | bytearray) -> np.ndarray:
    """One bool per document (``digests`` concatenated in corpus order): True for every document
    that repeats an earlier one, so the first copy, in corpus order, is the one kept."""
    keys = np.frombuffer(bytes(digests), dtype=f"V{DIGEST_BYTES}")
    repeated = np.ones(len(keys), dtype=bool)
    _, first = np.unique(keys, return_index=True)  # indices of the first occurrences
    repeated[first] = False
    return repeated


def log_repeats(repeated: int, documents: int, dropped: bool) -> None:
    """One line when the corpus holds repeats: how many, and what was done about them."""
    if not repeated:
        return
    share = f"{repeated:,} of {documents:,} documents ({100 * repeated / documents:.2f}%)"
    if dropped:
        log(f"repeats: dropped {share} that repeat an earlier document exactly; the first copy "
            "of each is kept (--keep-duplicates keeps them all)")
    else:
        log(f"warning: {share} repeat an earlier document exactly and are kept "
            "(--keep-duplicates): a copy can land in the evaluation mega-batch and in a training "
            "mega-batch at once, which lowers the evaluation perplexity")


def repeats_entry(facts: dict) -> dict:
    """The manifest's record of what was found and done (from a step's stamped facts)."""
    return {"count": int(facts.get("repeated_documents", 0)),
            "dropped": bool(facts.get("repeats_dropped", False))}


def repeats_key(keep_duplicates: bool) -> dict:
    """The entry of a step key that reads every document: what is done with repeats. Always
    present, so a stamp written before repeats were looked for (it kept them, and counted none)
    is never taken for a current one."""
    return {"repeats": "keep" if keep_duplicates else "drop"}
