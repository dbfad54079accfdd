"""Runs written by fairseq-alma before 0.3, as far as scoring is concerned.

Why apart: such a run kept no checkpoint of its initialised model (stage 0), so the arrivals
before its first training (--wait > 1) cannot be evaluated like today's runs'.  Everything
scoring does differently for those runs is in this one function.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from . import LOGGER_NAME
from .runs import StreamRun

logger = logging.getLogger(LOGGER_NAME)


def untrained_arrivals_before_0_3(values: list[float | None], members: list[StreamRun],
                                  mode: str, settings: Any, whole_split: bool) -> str:
    """How the arrivals before the first training of a run without a stage-0 checkpoint are
    scored, filling ``values`` in place; the JSON's ``untrained_arrivals`` line.

    For a single model scored with the run's own evaluation (data, whole split, block length)
    the stream log's arrival-0 perplexity is that same number.  Otherwise (a --max-eval-tokens
    slice included) the anytime metric is left undefined (never guessed), and a warning says
    why."""
    from ..lm.ensemble_eval import EvalSettings

    first = members[0]
    initial_name = first.view.stage_checkpoint(0).name
    own = EvalSettings.from_config(first.cfg, batch_size=settings.batch_size)
    same = whole_split and (
        os.path.realpath(own.data) == os.path.realpath(settings.data)
        and (own.subset, own.tokens_per_sample) == (settings.subset, settings.tokens_per_sample))
    if mode == "single" and same:
        for record in first.records:
            if record.stage == 0:
                values[record.arrival] = record.eval_ppl
        return (f"{first.view.stream_log.name}: the initialised model's perplexity, logged at "
                f"arrival 0")
    logger.warning("%s has no %s (trained before fairseq-alma 0.3)%s: the "
                   "arrivals before its first training are not scored, so anytime_nll is "
                   "undefined; train the stream again to get it", first.path, initial_name,
                   "" if mode == "single" else f" and --mode {mode} needs every member's")
    return f"not scored: no {initial_name}"
