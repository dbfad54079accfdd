"""``alma-score --matrix``: every stage checkpoint of a run scored on every period's held-out slice.

The numbers and their summaries are defined in ``stream/period_matrix.py``; this module finds
the period splits (``evalmb{k}``, written by ``alma-data-prep --eval-per-megabatch SIZE``) and
scores them.  Why no evaluator of its own: each cell is ``score_predictors`` of the existing
``CheckpointScorer`` with the split swapped in the ``EvalSettings``, so batching, the
``--max-eval-tokens`` slice (the first blocks of *each* period split), data-parallel ranks and
``--fp16`` are exactly those of the single-split table, and a cell equals what ``alma-score
--subset evalmb{k}`` (and ``fairseq-eval-lm --gen-subset evalmb{k}``) gives for that checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from ..errors import CheckpointError, DataError
from ..stream.metrics import perplexity_from_nll
from ..stream.period_matrix import PeriodMatrix
from .ensemble_eval import CheckpointScorer, EvalSettings, score_predictors


def period_split(period: int) -> str:
    """The split holding period ``period``'s slice (period p = mega-batch p - 1)."""
    return f"evalmb{period - 1}"


def check_period_splits(data: str, num_megabatches: int) -> dict[str, Any]:
    """The manifest's facts about the period splits of ``data`` (``eval_per_megabatch``), after
    checking that ``evalmb0 .. evalmb{B-1}`` are listed and their files have the recorded sizes;
    a ``DataError`` naming the data dir (or file) and the way out otherwise."""
    from fairseq_alma.stream.manifest import load_manifest

    data = data.split(os.pathsep)[0]  # fairseq's DATA may list several directories; the first
    manifest = load_manifest(data)
    names = [period_split(p) for p in range(1, num_megabatches + 1)]
    missing = [name for name in names if name not in manifest["splits"]]
    if missing:
        lacks = "has none" if len(missing) == num_megabatches else f"lacks {missing[0]}"
        raise DataError(f"{data} {lacks} of the per-mega-batch evaluation splits evalmb0.."
                        f"evalmb{num_megabatches - 1} that --matrix scores; prepare the stream "
                        f"with alma-data-prep --eval-per-megabatch SIZE")
    for name in names:
        for ext in ("bin", "idx"):
            path = os.path.join(data, f"{name}.{ext}")
            expected = manifest["splits"][name].get(f"{ext}_bytes")
            size = os.path.getsize(path) if os.path.isfile(path) else None
            if size is None or (expected is not None and size != expected):
                found = "missing" if size is None else f"{size} bytes, the manifest says {expected}"
                raise DataError(f"{path}: {found} (listed in {data}/manifest.json); prepare the "
                                f"stream again with alma-data-prep --eval-per-megabatch SIZE")
    return {"eval_per_megabatch": manifest.get("eval_per_megabatch")}


def score_matrix(scorer: CheckpointScorer, checkpoints: dict[int, str], arrivals: dict[int, int],
                 settings: EvalSettings, num_megabatches: int) -> tuple[PeriodMatrix, dict[str, Any]]:
    """Each stage's checkpoint (``checkpoints[s]``, trained at ``arrivals[s]``) on every period's
    split, with ``settings`` otherwise; the matrix, and what was scored per period (its slice:
    ``eval_tokens``, ``eval_tokens_total``, ``eval_blocks``, ``eval_blocks_total``, lists over
    periods; ``max_eval_tokens``)."""
    stages = sorted(checkpoints)
    bits: list[list[float]] = [[] for _ in stages]
    slices: dict[str, list[int]] = {}
    for period in range(1, num_megabatches + 1):
        split = dataclasses.replace(settings, subset=period_split(period))
        nll = score_predictors(scorer, {s: [checkpoints[s]] for s in stages}, split)
        for row, stage in enumerate(stages):
            total, ntokens = nll[stage]
            try:  # the checks of every perplexity alma-score prints (tokens scored, no overflow)
                perplexity_from_nll(total, ntokens)
            except ValueError as err:
                raise CheckpointError(f"{checkpoints[stage]} on {settings.data} split "
                                      f"{split.subset}: {err}") from None
            bits[row].append(total / ntokens / math.log(2))
        for key, value in scorer.eval_slice(split).as_json().items():
            if key != "max_eval_tokens":
                slices.setdefault(key, []).append(value)
    matrix = PeriodMatrix(stages, [arrivals[s] for s in stages], bits)
    return matrix, {**slices, "max_eval_tokens": settings.max_eval_tokens}
