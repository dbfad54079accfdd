"""Seeded document shuffle and the carving of a stream: validation, evaluation, B mega-batches.

Paper §3/§5: the training data is cut at random into B mega-batches of equal size that arrive
one after another, plus one held-out evaluation mega-batch of about the same size (tested after
every arrival) and a small validation set for model selection. We shuffle *documents* with a
local ``numpy.random.Generator(seed)`` (never the global RNG), then carve the shuffled sequence
in this order: validation set, evaluation mega-batch, then the rest into B parts whose token
counts are as equal as document boundaries allow (each cut is the document boundary nearest to
its ideal position, so every part is within one document of total/B). Inside a split, documents
keep their corpus order: membership is random, and the training task shuffles batches anyway,
which lets every split be written in one sequential pass over any corpus size.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from fairseq_alma.errors import DataError

from .encoded import Encoded
from .fileio import atomic_output
from .progress import Progress

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgKMG]?)\s*$")
SAME_AS_MEGABATCH = "megabatch"


@dataclass(frozen=True)
class SizeSpec:
    """A split size: a fraction of all tokens, a token count, or one training mega-batch."""

    fraction: float | None = None
    tokens: int | None = None

    def target(self, total_tokens: int) -> int | None:
        if self.fraction is not None:
            return round(self.fraction * total_tokens)
        return self.tokens


def parse_size(text: str) -> SizeSpec:
    """``0.2`` -> 20% of the tokens; ``500000``, ``500k``, ``0.5M``, ``1G`` -> token counts;
    ``megabatch`` -> the size of one training mega-batch. Raises ValueError with the rule."""
    if text.strip().lower() == SAME_AS_MEGABATCH:
        return SizeSpec()
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"{text!r} is neither a fraction (0.2) nor a token count "
                         "(500000, 500k, 0.5M)")
    number, suffix = float(match.group(1)), match.group(2).lower()
    if not suffix and "." in match.group(1):
        if not 0 < number < 1:
            raise ValueError(f"{text!r}: a fraction must be strictly between 0 and 1")
        return SizeSpec(fraction=number)
    tokens = number * _SUFFIXES[suffix]
    if tokens < 1 or tokens != int(tokens):
        raise ValueError(f"{text!r}: a token count must be a whole number >= 1")
    return SizeSpec(tokens=int(tokens))


def split_names(num_megabatches: int) -> list[str]:
    """Split names in carving order (also the shard file names)."""
    return ["valid", "eval", *(f"megabatch{k}" for k in range(num_megabatches))]


def check_document_count(documents: int, num_megabatches: int) -> None:
    """Every split needs a document: B mega-batches, eval and valid."""
    if documents < num_megabatches + 2:
        raise DataError(
            f"the corpus has {documents} documents but --num-megabatches {num_megabatches} "
            f"needs at least {num_megabatches + 2} (one per mega-batch, plus eval and valid); "
            "add text or lower it")


def _nearest_cut(cum: np.ndarray, target: float, lo: int, hi: int) -> int:
    """The document boundary in [lo, hi] whose cumulative token count is nearest ``target``."""
    above = int(np.searchsorted(cum, target, side="left"))
    candidates = {min(max(i, lo), hi) for i in (above - 1, above)}
    return min(candidates, key=lambda i: (abs(float(cum[i]) - target), i))


def carve(tokens: np.ndarray, num_megabatches: int, valid: SizeSpec,
          eval_size: SizeSpec) -> list[int]:
    """Cut points (document indices into ``tokens``, already shuffled) for every split.

    Returns B+3 increasing indices ``[0, end_valid, end_eval, end_mb0, ..., n]``; every split
    gets at least one document."""
    n, parts = len(tokens), num_megabatches
    check_document_count(n, parts)
    cum = np.concatenate([[0], np.cumsum(tokens, dtype=np.int64)])
    total = int(cum[-1])
    valid_target = valid.target(total)
    eval_target = eval_size.target(total)
    assert valid_target is not None, "the validation size cannot be 'megabatch'"
    if valid_target + (eval_target or 0) >= total:
        raise DataError(
            f"--valid-size ({valid_target:,} tokens) and --eval-size "
            f"({eval_target or 0:,} tokens) leave nothing of the corpus's {total:,} tokens for "
            "the training mega-batches; lower them")
    cuts = [0, _nearest_cut(cum, valid_target, 1, n - parts - 1)]
    if eval_target is None:  # paper §5: the evaluation mega-batch is as large as a training one
        eval_target = (total - int(cum[cuts[1]])) / (parts + 1)
    cuts.append(_nearest_cut(cum, int(cum[cuts[1]]) + eval_target, cuts[1] + 1, n - parts))
    start = int(cum[cuts[2]])
    for k in range(1, parts):
        cuts.append(_nearest_cut(cum, start + k * (total - start) / parts, cuts[-1] + 1,
                                 n - parts + k))
    cuts.append(n)
    return cuts


def assign_documents(tokens: np.ndarray, seed: int, num_megabatches: int, valid: SizeSpec,
                     eval_size: SizeSpec) -> tuple[np.ndarray, dict[str, dict]]:
    """Shuffle with a local seeded generator and carve; return each document's split index
    (into ``split_names``) and per-split document and token counts."""
    order = np.random.default_rng(seed).permutation(len(tokens))
    cuts = carve(tokens[order], num_megabatches, valid, eval_size)
    labels = np.empty(len(tokens), dtype=np.int32)
    stats = {}
    for index, (name, lo, hi) in enumerate(zip(split_names(num_megabatches), cuts, cuts[1:])):
        labels[order[lo:hi]] = index
        stats[name] = {"documents": hi - lo, "tokens": int(tokens[order[lo:hi]].sum())}
    return labels, stats


def count_training_pieces(encoded: Encoded, labels: np.ndarray, names: list[str],
                          symbols: list[str], counts_path: str) -> None:
    """Count the pieces of the training mega-batches' documents (for the dictionary) in one
    chunked pass over the encoded ids: ``np.bincount`` over the tokenizer's id space, then one
    count per symbol (``symbols``: the tokenizer's pieces, then the extra ones), written as JSON
    sorted by symbol."""
    training = np.array([name.startswith("megabatch") for name in names])
    counts = np.zeros(len(symbols), dtype=np.int64)
    progress = Progress("count")
    for first, end, _, ids in encoded.chunks():
        train = np.repeat(training[labels[first:end]], encoded.pieces[first:end])
        chosen = ids[train]
        if len(chosen) and (chosen.min() < 0 or chosen.max() >= len(symbols)):
            raise RuntimeError(f"{encoded.prefix}.ids: ids outside the {len(symbols)} symbols; "
                               "delete the encode stamp and re-run")
        counts += np.bincount(chosen, minlength=len(symbols))
        progress.update(end - first, 4 * len(ids))
    progress.finish()
    by_symbol: dict[str, int] = {}
    for index in np.flatnonzero(counts):
        symbol = symbols[index]  # an extra piece equal to a piece's name is that piece
        by_symbol[symbol] = by_symbol.get(symbol, 0) + int(counts[index])
    with atomic_output(counts_path) as f:
        json.dump(dict(sorted(by_symbol.items())), f, ensure_ascii=False)
