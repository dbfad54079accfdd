"""How many held-out documents of a prepared stream also sit in one of its training mega-batches.

Why: ``alma-data-prep`` drops repeated documents before it splits (``repeats.py``), but a stream
prepared before it did, with ``--keep-duplicates``, or cut by ``--from-binarized`` from someone
else's data-bin may hold a document both in the evaluation mega-batch (or the validation set, or
an ``evalmb{k}``) and in a training mega-batch. Its perplexities are then measured partly on
text the model trained on. ``alma-data-prep --verify DIR`` counts them from the binaries
themselves, so the answer does not depend on how (or by which version) the stream was made.

A document is what the splits store: its lines, each ending in end-of-sentence, followed by one
end-of-sentence-only separator (``from_binarized.py`` reads the same layout); two documents are
the same when their token ids are.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from fairseq_alma.stream.manifest import expected_splits

from .from_binarized import document_digests, load_source_dictionary, read_documents
from .repeats import DIGEST_BYTES

if TYPE_CHECKING:
    from fairseq.data import Dictionary


def split_digests(data_dir: str, name: str, dictionary: Dictionary) -> list[bytes]:
    """The digest of every document of split ``name`` of the stream in ``data_dir``."""
    prefix = os.path.join(data_dir, name)
    digests = document_digests([prefix], read_documents([prefix], dictionary), f"overlap {name}")
    return [bytes(digests[i:i + DIGEST_BYTES]) for i in range(0, len(digests), DIGEST_BYTES)]


def held_out_overlap(data_dir: str, manifest: dict) -> dict[str, tuple[int, int]]:
    """For every held-out split (valid, eval, evalmb{k}): (documents also in a training
    mega-batch, documents)."""
    dictionary = load_source_dictionary(data_dir)
    names = expected_splits(int(manifest["num_megabatches"]),
                            manifest.get("eval_per_megabatch") is not None)
    training: set[bytes] = set()
    for name in names:
        if name.startswith("megabatch"):
            training.update(split_digests(data_dir, name, dictionary))
    found = {}
    for name in names:
        if not name.startswith("megabatch"):
            held_out = split_digests(data_dir, name, dictionary)
            found[name] = (sum(digest in training for digest in held_out), len(held_out))
    return found


def overlap_lines(data_dir: str, found: dict[str, tuple[int, int]]) -> list[str]:
    """What ``--verify`` prints: one line, and a warning line when any held-out document is
    also trained on."""
    counts = ", ".join(f"{name} {shared:,} of {total:,}" for name, (shared, total) in found.items())
    lines = [f"{data_dir}: held-out documents also in a training mega-batch: {counts}"]
    if any(shared for shared, _ in found.values()):
        lines.append(f"{data_dir}: warning: the perplexity of those splits is partly measured on "
                     "text the model trains on; prepare the stream again with alma-data-prep "
                     "(without --keep-duplicates it drops repeated documents)")
    return lines
