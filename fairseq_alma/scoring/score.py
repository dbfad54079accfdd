"""``score(request, world)``: one scoring, from run directories to series (paper §6.2, Table 2).

Data-parallel: with a ``world`` of N processes (torchrun/srun) the processes share every
checkpoint's evaluation batches and add their sums (``lm/score_distributed.py``); each gets the
same series, which equal a single process's.  The caller decides who prints and writes.
"""

from __future__ import annotations

import logging
import os

from ..errors import DataError, UsageError
from ..lm.score_distributed import ScoreWorld, check_same_request, choose_backend, scoring_group
from . import LOGGER_NAME
from .request import ScoreRequest
from .rules import checkpoints_to_score
from .runs import StreamRun, check_members, load_run
from .series import ScoredSeries, build_series, settings_for

logger = logging.getLogger(LOGGER_NAME)


def score(request: ScoreRequest, world: ScoreWorld | None = None) -> list[ScoredSeries]:
    """Check the runs, score them (sharing the batches among ``world``'s processes); every user
    mistake raises ``UsageError``."""
    import torch

    from ..checkpoint_load import trust_checkpoints

    world = world or ScoreWorld()
    trust_checkpoints(request.trust_checkpoint)
    use_cuda = torch.cuda.is_available() and not request.cpu
    if request.fp16 and not use_cuda:
        raise UsageError("--fp16 needs a CUDA device; drop it to score in fp32 on CPU")
    if world.size > 1 and request.from_log:
        raise UsageError(f"--from-log evaluates nothing, so there is nothing to share among "
                         f"{world.size} processes; run it as one process (no torchrun/srun)")
    backend = choose_backend(use_cuda, request.distributed_backend)
    with scoring_group(world, backend):
        if world.size > 1:
            check_same_request(_request_settings(request))
        return _score_runs(request, use_cuda)


def _request_settings(request: ScoreRequest) -> dict:
    """What ``request`` scores, paths resolved: the ranks of one scoring must agree on it."""
    import dataclasses

    settings = dataclasses.asdict(request)
    settings["run_dirs"] = [os.path.realpath(d) for d in request.run_dirs]
    if request.data is not None:
        settings["data"] = os.path.realpath(request.data)
    return settings


def _score_runs(request: ScoreRequest, use_cuda: bool) -> list[ScoredSeries]:
    runs = [load_run(path, request.data, request.from_log) for path in request.run_dirs]
    if request.mode != "single":
        check_members(runs, request.mode)  # members of one stream, in its own words
    _check_one_stream_shape(runs)
    scorer = None
    if not request.from_log:
        from ..lm.ensemble_eval import CheckpointScorer

        total = checkpoints_to_score(runs, request.mode)
        if request.matrix:  # before anything is scored: a stream without period splits stops here
            from ..lm.score_matrix import check_period_splits

            for run in runs:
                check_period_splits(settings_for(run, request).data, len(run.records) - 1)
                total += len(run.stages) * (len(run.records) - 1)
        _verify_scored_splits(runs, request)
        scorer = CheckpointScorer(use_cuda=use_cuda, total=total, fp16=request.fp16)
        logger.info("scoring %d checkpoint(s) on %s", total, scorer.device)
    results = build_series(runs, request, scorer)
    if scorer is not None and scorer.seconds > 0:
        rate = f"{scorer.tokens / scorer.seconds:,.0f}"
        logger.info("scored %s tokens in %.2fs: %s tokens/s", f"{scorer.tokens:,}", scorer.seconds,
                    rate)
    return results


def _check_one_stream_shape(runs: list[StreamRun]) -> None:
    """Runs of other metrics or stream lengths make no one table: refused before any checkpoint
    is scored (the table's own check came after scoring every checkpoint, hours on large
    models)."""
    def kind(run: StreamRun) -> str:
        metric = "perplexity" if run.metric == "ppl" else "test error"
        return f"{metric}, B = {len(run.records) - 1}"

    for run in runs[1:]:
        if kind(run) != kind(runs[0]):
            raise UsageError(f"{runs[0].view.path} ({kind(runs[0])}) and {run.view.path} ({kind(run)}) "
                             f"are not one stream's results; score them separately")


def _verify_scored_splits(runs: list[StreamRun], request: ScoreRequest) -> None:
    """The splits this scoring reads, against their sha256 in the manifest, before any is
    scored (``stream/manifest.verify_split_hashes``): each stream's once per call."""
    from ..stream.manifest import verify_split_hashes

    wanted: dict[str, set[str]] = {}
    for run in runs:
        settings = settings_for(run, request)
        names = wanted.setdefault(settings.data.split(os.pathsep)[0], set())
        names.add(settings.subset)
        if request.matrix:  # check_period_splits made sure they exist
            names.update(f"evalmb{k}" for k in range(len(run.records) - 1))
    for data, names in wanted.items():
        try:
            verify_split_hashes(data, sorted(names))
        except DataError as err:
            raise UsageError(str(err)) from None
