"""Scored checkpoints turned into Table 2 series: one per run (single) or per ensemble.

Each series comes with its JSON extras (``ScoredSeries``): how every number was obtained (source,
evaluation settings, precision, the slice scored, the members answering each arrival, the
--matrix results), which ``outputs.py`` writes under the series' ``scoring`` key.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import UsageError
from ..stream.eval_batching import batch_size_problem
from ..stream.manifest import data_identity, load_manifest, split_note
from ..stream.metrics import perplexity_from_nll
from ..stream.series import ReportSeries, flops_convention
from .old_runs import untrained_arrivals_before_0_3
from .request import ScoreRequest
from .rules import SERIES_PREFIX, costs, initial_predictor, member_groups, predictors_by_stage
from .runs import StreamRun

ScoredSeries = tuple[ReportSeries, dict[str, Any]]


def settings_for(run: StreamRun, request: ScoreRequest) -> Any:
    """The evaluation the task itself ran after each arrival, unless the request says otherwise."""
    from ..lm.ensemble_eval import EvalSettings

    settings = EvalSettings.from_config(run.cfg, data=request.data, subset=request.subset,
                                        tokens_per_sample=request.tokens_per_sample,
                                        batch_size=request.batch_size,
                                        max_eval_tokens=request.max_eval_tokens)
    problem = batch_size_problem(run.cfg, settings.batch_size, run.path)
    if problem is not None:
        raise UsageError(problem)
    return settings


def _scored_data_identity(data: str) -> dict[str, Any]:
    """The identity (``stream/manifest.data_identity``) of the stream a series was scored on;
    scoring has read its manifest already, so it is there."""
    return data_identity(load_manifest(data.split(os.pathsep)[0]))


def _ppl(nll: float, ntokens: int, what: str) -> float:
    if ntokens < 1:
        raise UsageError(f"{what}: no token scored; check --subset and --tokens-per-sample")
    try:
        return perplexity_from_nll(nll, ntokens)
    except ValueError as err:
        raise UsageError(f"{what}: {err}") from None


def build_series(runs: list[StreamRun], request: ScoreRequest, scorer: Any) -> list[ScoredSeries]:
    """One (series, JSON extras) per run (single) or one for the ensemble (ens, gens);
    ``scorer`` (``lm/ensemble_eval.CheckpointScorer``) is None with --from-log."""
    from ..lm.ensemble_eval import score_predictors

    out = []
    for members in member_groups(runs, request.mode):
        first, records = members[0], members[0].records
        predictors = predictors_by_stage(members, request.mode)
        # what was scored, kept with the numbers: alma-report reads a JSON long after, when a
        # run directory may hold a run trained again (another fingerprint) or its data moved
        extra: dict[str, Any] = {"mode": request.mode,
                                 "runs": [str(run.path) for run in members],
                                 "fingerprints": [run.fingerprint for run in members]}
        if request.from_log:
            values = first.logged_metric()
            extra["source"] = str(first.view.stream_log)
        else:
            settings = settings_for(first, request)
            untrained = initial_predictor(members, request.mode)
            if untrained:
                predictors[0] = untrained
            nll = score_predictors(scorer, predictors, settings)
            stage_ppl = {s: _ppl(*nll[s], f"stage {s} of {first.path}") for s in nll}
            values = [stage_ppl.get(r.stage) for r in records]
            scored = scorer.eval_slice(settings)
            extra |= {"source": "evaluated", "settings": vars(settings),
                      "data_identity": _scored_data_identity(settings.data),
                      "precision": "fp16" if scorer.fp16 else "fp32", **scored.as_json(),
                      "nll_tokens_by_stage": {str(s): list(v) for s, v in nll.items()}}
            if split_note(settings.subset):
                extra["split_note"] = split_note(settings.subset)
            if request.max_eval_tokens:
                extra["eval_slice_note"] = scored.describe(settings.subset)
            if first.waits:
                extra["untrained_arrivals"] = (
                    f"evaluated: {first.view.stage_checkpoint(0).name} (the initialised model)"
                    if untrained else
                    untrained_arrivals_before_0_3(values, members, request.mode, settings,
                                                  scored.whole))
            if request.matrix:
                extra["eval_matrix"] = _eval_matrix(first, scorer, settings)
        extra["members_by_arrival"] = [predictors.get(r.stage, []) for r in records]
        flops, params, label = costs(members, request.mode)
        series = ReportSeries(
            setting=request.setting or first.default_setting(SERIES_PREFIX.get(request.mode)),
            num_experts=label, metric_by_arrival=values, train_flops_cum=flops,
            params_by_arrival=params, trained=[r.trained for r in records], metric=first.metric,
            flops_convention=flops_convention(records))
        out.append((series, extra))
    return out


def _eval_matrix(run: StreamRun, scorer: Any, settings: Any) -> dict[str, Any]:
    """--matrix: the run's stage checkpoints on every period (lm/score_matrix.py), as JSON."""
    from ..lm.score_matrix import check_period_splits, score_matrix

    b = len(run.records) - 1
    facts = check_period_splits(settings.data, b)
    arrivals = {r.stage: r.arrival for r in run.records if r.trained}
    matrix, scored = score_matrix(scorer, {s: run.checkpoints[s] for s in run.stages}, arrivals,
                                  settings, b)
    return {**matrix.as_json(), **scored, **facts}
