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

``--order given`` (a stream that drifts: mega-batch i must hold period i) keeps the corpus
order for the training mega-batches. Validation and evaluation are still the documents the
seeded shuffle carves first -- exactly those ``shuffle`` holds out with the same seed -- so they
are a uniform sample of the whole time span: neither leaks one period's future into another
nor takes its tokens out of one period only. The remaining documents, in corpus order, are cut
into B contiguous parts of equal token count (the same nearest-boundary rule).

``--eval-per-megabatch SIZE`` then holds out, from every mega-batch k, whole documents drawn
with their own seeded generator (``[seed, k]``) up to SIZE tokens (a fraction of that
mega-batch or a token count) as the split ``evalmb{k}``: the held-out text of period k+1 that
``alma-score --matrix`` scores every stage on. They are not trained on, and the dictionary's
counts (``count_training_pieces``) never see them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from fairseq_alma.errors import DataError
from fairseq_alma.stream.atomic import atomic_output

from .encoded import Encoded
from .progress_lines import Progress

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgKMG]?)\s*$")
SAME_AS_MEGABATCH = "megabatch"
ORDERS = ("shuffle", "given")  # --order: the first is the default
PERIOD_PREFIX = "evalmb"  # --eval-per-megabatch: evalmb{k} is held out of megabatch{k}


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


def split_names(num_megabatches: int, per_megabatch_eval: bool = False) -> list[str]:
    """Split names in carving order (also the shard file names); with
    ``per_megabatch_eval`` the held-out ``evalmb{k}`` follow the mega-batches (appended, so
    the indices of the others, which the labels store, do not move)."""
    names = ["valid", "eval", *(f"megabatch{k}" for k in range(num_megabatches))]
    if per_megabatch_eval:
        names += [f"{PERIOD_PREFIX}{k}" for k in range(num_megabatches)]
    return names


def documents_needed(num_megabatches: int, per_megabatch_eval: bool = False) -> int:
    """Every split needs a document: B mega-batches, eval and valid (and with
    ``--eval-per-megabatch`` a held-out document per mega-batch)."""
    return (2 if per_megabatch_eval else 1) * num_megabatches + 2


def _needs(per_megabatch_eval: bool) -> str:
    return ("two per mega-batch (one held out by --eval-per-megabatch)" if per_megabatch_eval
            else "one per mega-batch")


def check_document_count(documents: int, num_megabatches: int,
                         per_megabatch_eval: bool = False) -> None:
    """Refuse a B the corpus has too few documents for (``documents_needed``)."""
    needed = documents_needed(num_megabatches, per_megabatch_eval)
    if documents < needed:
        raise DataError(
            f"the corpus has {documents} documents but --num-megabatches {num_megabatches} "
            f"needs at least {needed} ({_needs(per_megabatch_eval)}, plus eval and valid); add "
            "text or lower it")


def check_megabatch_bound(most_documents: int, num_megabatches: int, per_megabatch_eval: bool,
                          holder: str) -> None:
    """Refuse, before any work, a B beyond ``most_documents``, an upper bound on the documents
    of ``holder`` (the inputs, in words) from their sizes: that many mega-batches can never
    each get one. Only B itself is compared, so a small B on tiny or blank inputs still gets
    the exact message of the extraction (no text, or ``check_document_count``)."""
    if num_megabatches > most_documents:
        raise DataError(
            f"--num-megabatches {num_megabatches} needs at least "
            f"{documents_needed(num_megabatches, per_megabatch_eval):,} documents "
            f"({_needs(per_megabatch_eval)}, plus eval and valid) but {holder} can hold at most "
            f"{most_documents:,}; lower it")


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
    if eval_target is None and valid_target >= total:  # 'megabatch' is sized from the rest
        raise DataError(
            f"--valid-size ({valid_target:,} tokens) leaves nothing of the corpus's {total:,} "
            f"tokens for the training mega-batches, nor for the evaluation mega-batch (--eval-size "
            f"{SAME_AS_MEGABATCH}: as large as one of them); lower --valid-size, e.g. to a "
            "fraction (0.05)")
    if valid_target + (eval_target or 0) >= total:
        raise DataError(
            f"--valid-size ({valid_target:,} tokens) and --eval-size "
            f"({eval_target or 0:,} tokens) leave nothing of the corpus's {total:,} tokens for "
            "the training mega-batches; lower them")
    cuts = [0, _nearest_cut(cum, valid_target, 1, n - parts - 1)]
    if eval_target is None:  # paper §5: the evaluation mega-batch is as large as a training one
        eval_target = (total - int(cum[cuts[1]])) / (parts + 1)
    cuts.append(_nearest_cut(cum, int(cum[cuts[1]]) + eval_target, cuts[1] + 1, n - parts))
    return cuts + equal_parts(cum, cuts[2], parts)


def equal_parts(cum: np.ndarray, first: int, parts: int) -> list[int]:
    """The cuts after ``first`` that divide documents ``first..n`` (``cum``: cumulative tokens
    of the whole sequence) into ``parts`` of nearly equal tokens: ``parts - 1`` inner cuts, then
    ``n``. Each part gets at least one document (the caller checked there are enough)."""
    n = len(cum) - 1
    start, total = int(cum[first]), int(cum[-1])
    cuts = [first]
    for k in range(1, parts):
        cuts.append(_nearest_cut(cum, start + k * (total - start) / parts, cuts[-1] + 1,
                                 n - parts + k))
    return cuts[1:] + [n]


def hold_out(tokens: np.ndarray, size: SizeSpec, name: str) -> int:
    """How many of the (already shuffled) documents ``tokens`` of mega-batch ``name`` to hold
    out for ``--eval-per-megabatch``: the document boundary nearest to the target, at least
    one document held out and one kept."""
    cum = np.concatenate([[0], np.cumsum(tokens, dtype=np.int64)])
    total = int(cum[-1])
    target = size.target(total)
    assert target is not None, "--eval-per-megabatch cannot be 'megabatch'"
    if len(tokens) < 2 or target >= total:
        raise DataError(
            f"--eval-per-megabatch ({target:,} tokens) leaves nothing of {name} ({total:,} "
            f"tokens, {len(tokens)} documents) to train on; lower it or add text")
    return _nearest_cut(cum, target, 1, len(tokens) - 1)


def assign_documents(tokens: np.ndarray, seed: int, num_megabatches: int, valid: SizeSpec,
                     eval_size: SizeSpec, order: str = ORDERS[0],
                     per_megabatch: SizeSpec | None = None) -> tuple[np.ndarray, dict[str, dict]]:
    """Shuffle with a local seeded generator and carve (module doc: ``order`` and
    ``per_megabatch``); return each document's split index (into ``split_names``) and
    per-split document and token counts."""
    if order not in ORDERS:
        raise ValueError(f"order {order!r}: expected one of {ORDERS}")
    check_document_count(len(tokens), num_megabatches, per_megabatch is not None)
    sequence = np.random.default_rng(seed).permutation(len(tokens))
    cuts = carve(tokens[sequence], num_megabatches, valid, eval_size)
    if order == "given":  # held-out as shuffled; the training documents back in corpus order
        sequence = np.concatenate([sequence[:cuts[2]], np.sort(sequence[cuts[2]:])])
        cum = np.concatenate([[0], np.cumsum(tokens[sequence], dtype=np.int64)])
        cuts = cuts[:3] + equal_parts(cum, cuts[2], num_megabatches)
    names = split_names(num_megabatches, per_megabatch is not None)
    members = {name: sequence[lo:hi] for name, lo, hi in zip(names, cuts, cuts[1:])}
    if per_megabatch is not None:
        for k in range(num_megabatches):
            part = members[f"megabatch{k}"]
            drawn = part[np.random.default_rng([seed, k]).permutation(len(part))]
            held = hold_out(tokens[drawn], per_megabatch, f"megabatch{k}")
            members[f"{PERIOD_PREFIX}{k}"] = np.sort(drawn[:held])
            members[f"megabatch{k}"] = np.sort(drawn[held:])
    labels = np.full(len(tokens), -1, dtype=np.int32)
    stats = {}
    for index, name in enumerate(names):
        labels[members[name]] = index
        stats[name] = {"documents": len(members[name]), "tokens": int(tokens[members[name]].sum())}
    assert labels.min() >= 0, "every document belongs to exactly one split"
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
