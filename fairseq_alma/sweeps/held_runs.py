"""What a sweep's run directories already hold, before ``alma-sweep submit`` calls a run done.

Why: a run directory is named by its grid point and seed only.  Submitting a config with
another ``lr`` (or arch, updates...) into a directory that holds a run of the old config, or a
run directory copied from another sweep, found the old run's ``slurm_events.jsonl`` saying
``completed``: the run was "done", nothing trained, and ``alma-report`` published the old
run's numbers under the new config.  ``fairseq-train`` refuses another run in its
``--save-dir`` by ``run.json``'s fingerprint; here the same question is asked with the same
comparison (``stream/held_run.held_run_records``: ``same_run``, the same list of differences)
on the fingerprint each job's task would claim its directory with, before anything is written
or submitted, and "done" also needs the run's own records to say it finished
(``stream.jsonl`` holds every arrival), as the trainer's own finished-run check does.

The fingerprint is built as the task builds it (``point_values.training_config``: the job's
argv with the launcher's flags), from fairseq's config and the stream's manifest (a language
model) or the data set's digest (a vision stream); about a second per run directory that holds
a trained run, nothing for one that does not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import AlmaError
from ..fairseq_glue.config import given
from ..stream.held_run import held_run_records
from ..stream.run_dir import RUN_FILE, RunDirectory
from .resource_profile import ResourceProfile
from .train_plan import SweepJob


def _other_run_advice(sweep_dir: Path) -> str:
    return (f"use a new --sweep-dir, or move that run directory out of {sweep_dir} to train "
            "this config's run there")


def holds_trained_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a ``run.json`` and more than a run that never trained leaves
    (``RunDirectory.never_trained``: a refused command's bookkeeping is anyone's to take)."""
    if not (run_dir / RUN_FILE).is_file():
        return False
    return not RunDirectory.for_reading(run_dir).never_trained()


def expected_run(job: SweepJob, profile: ResourceProfile,
                 digests: dict[str, str]) -> tuple[dict[str, Any], int | None] | None:
    """The fingerprint ``job``'s task on ``profile`` claims its run directory with, and the
    mega-batches of its stream, None when the job stops before the stream's end (``--max-epoch``:
    its records never hold every arrival, and its Slurm events say when it is done); None when
    its task keeps no fingerprint (not a stream).  ``digests`` caches a vision data set's digest
    (hashing it takes a while)."""
    import torch
    from fairseq import models, tasks

    from ..fairseq_glue.config import run_fingerprint
    from ..stream.manifest import data_identity
    from ..stream.stop import stage_limit
    from .point_values import quiet_logger, training_config

    cfg = training_config(job.argv, profile)
    if str(given(cfg, "model", "_name") or "") == "alma_vision":
        from ..fairseq_glue.vision_entry import vision_run
        from ..vision.data import load_vision_data
        from ..vision.fingerprint import vision_fingerprint
        from ..vision.runner import data_digest

        run = vision_run(cfg.task, cfg.model, machine_checks=False)
        key = f"{run.dataset}:{run.data_path}"
        if key not in digests:
            digests[key] = data_digest(load_vision_data(run.dataset, run.data_path))
        return vision_fingerprint(run, digests[key]), run.plan.num_megabatches
    if str(given(cfg, "task", "_name") or "") != "alma_stream":
        return None
    task = tasks.setup_task(cfg.task)
    # what the model's build_model fills in (--max-target-positions from --tokens-per-sample,
    # an arch's defaults) is in the run's fingerprint: build it as the task does before it
    # claims the directory, on the meta device (no memory, no weights: a paper-sized model on
    # a login node costs what a tiny one costs)
    with quiet_logger("fairseq_alma"):
        try:
            with torch.device("meta"):
                models.build_model(cfg.model, task)
        except AlmaError:
            raise
        except Exception:  # a model whose construction reads its weights: build it for real
            models.build_model(cfg.model, task)
    fingerprint = {"config": run_fingerprint(cfg), "data": data_identity(task.manifest)}
    limited = stage_limit(task.plan.max_stages, task.cfg.max_epoch or None, env={}) < task.plan.max_stages
    return fingerprint, None if limited else task.plan.num_megabatches


def held_runs(jobs: list[SweepJob], profile: ResourceProfile, sweep_dir: Path) -> dict[int, bool]:
    """Job index -> whether its directory holds its run finished, for every job whose
    directory holds a trained run; ``UsageError`` in one line (the directory and the first
    settings that differ) when one holds another run.  Jobs not in the answer have nothing
    trained there, or a program that keeps no ``run.json``: their Slurm events alone say."""
    digests: dict[str, str] = {}
    held: dict[int, bool] = {}
    for job in jobs:
        if not holds_trained_run(job.run_dir):
            continue
        expected = expected_run(job, profile, digests)
        if expected is None:
            continue
        fingerprint, megabatches = expected
        # the run there must be this job's; whether it finished, its records say (a job that
        # stops early by --max-epoch: its Slurm events, as `alma-sweep status` reads them)
        records = held_run_records(job.run_dir, fingerprint, megabatches or 1,
                                   _other_run_advice(sweep_dir))
        held[job.index] = megabatches is None or records is not None
    return held
