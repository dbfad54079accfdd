"""``alma-sweep status`` and ``cancel``: where each run and each scoring task of a sweep stands,
from the sweep's records and run directories, the queue telling running from pending.

Two calls for status, runs first, then scoring: what is known about the runs is shown even when
the scoring plan cannot be read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .score_plan import load_plan, scored_signature, task_state
from .slurm_commands import query_queue, queued_jobs, run_slurm
from .train_records import RunStatus, load_jobs, load_submissions, run_status


@dataclass(frozen=True)
class TrainingStatus:
    """Every run of a sweep; ``queue_unreachable``: submitted, but squeue did not answer."""

    sweep_dir: Path
    runs: list[RunStatus]
    queue_unreachable: bool


@dataclass(frozen=True)
class ScoreTaskStatus:
    """One task of the latest scoring plan: its state and Slurm job ("-" when not submitted);
    a failed task's ``score_log`` says why, and ``stale_outputs`` that its outputs are an
    earlier scoring's (its rescore failed)."""

    index: int
    name: str
    mode: str
    state: str
    slurm_job: str
    score_log: str | None = None
    stale_outputs: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"kind": "scoring", **self.__dict__}


def training_status(sweep_dir: Path) -> TrainingStatus:
    """The state of every run (``train_records.run_status``)."""
    table = load_jobs(sweep_dir)
    submissions = load_submissions(sweep_dir)
    queue = query_queue({str(s["job_id"]) for s in submissions}) if submissions else None
    runs = [run_status(job, bool(submissions), queue) for job in table["jobs"]]
    return TrainingStatus(sweep_dir, runs, queue is None and bool(submissions))


def scoring_status(sweep_dir: Path) -> list[ScoreTaskStatus] | None:
    """Every task of the latest scoring plan (None before the first ``alma-sweep score``): the
    queue's word while it is queued, else what its output directory says (scored / stale /
    failed / not scored)."""
    plan = load_plan(sweep_dir)
    if plan is None:
        return None
    submissions = plan.get("submissions") or []
    last = submissions[-1] if submissions else None
    queue = query_queue({str(last["job_id"])}) if last else {}
    return [_task_status(task, last, queue, sweep_dir) for task in plan["tasks"]]


def _task_status(task: dict[str, Any], last: dict[str, Any] | None,
                 queue: dict[int, tuple[str, str]] | None, sweep_dir: Path) -> ScoreTaskStatus:
    queued = (queue or {}).get(task["index"])
    if queued is not None:
        state = "running" if queued[0] == "RUNNING" else queued[0].lower()
        return ScoreTaskStatus(task["index"], task["name"], task["mode"], state, queued[1])
    state = task_state(task)
    submitted = last is not None and task["index"] in last.get("tasks", [])
    job = f"{last['job_id']}_{task['index']}" if submitted else "-"
    left_queue = submitted and queue is not None
    # left the queue without the outputs it was submitted for: OUT_DIR/score.log says why.
    # A rescore's outputs are the earlier scoring's (stale) unless it succeeded: its
    # scored.json then holds the signature the plan submitted it with.
    stale_outputs = (left_queue and state == "stale"
                     and scored_signature(Path(task["out_dir"])) != task["signature"])
    if (left_queue and state == "not scored") or stale_outputs:
        # Slurm opens a task's output file when it starts: none, and it never ran (cancelled
        # while pending), so its score.log holds nothing about it (it was called "failed",
        # pointing at a log whose last line was an earlier success)
        if not (sweep_dir / "logs" / f"score_{job}.out").exists():
            return ScoreTaskStatus(task["index"], task["name"], task["mode"], "not run", job,
                                   None, stale_outputs)
        return ScoreTaskStatus(task["index"], task["name"], task["mode"], "failed", job,
                               str(Path(task["out_dir"]) / "score.log"), stale_outputs)
    return ScoreTaskStatus(task["index"], task["name"], task["mode"], state, job)


@dataclass(frozen=True)
class Cancelled:
    """What ``cancel_sweep`` did: ``job_ids`` it asked Slurm to cancel (those still in the
    queue, or all of the sweep's when the queue did not answer), ``submitted`` all of them."""

    job_ids: list[str]
    submitted: list[str]
    queue_unreachable: bool


def cancel_sweep(sweep_dir: Path) -> Cancelled:
    """scancel every job submitted from ``sweep_dir`` (training and scoring) that is still
    queued or running: a finished sweep has nothing to cancel, and saying it cancelled its
    jobs would be false."""
    load_jobs(sweep_dir)
    job_ids = [str(s["job_id"]) for s in load_submissions(sweep_dir)]
    job_ids += [str(s["job_id"]) for s in (load_plan(sweep_dir) or {}).get("submissions", [])]
    if not job_ids:
        raise UsageError(f"{sweep_dir}: nothing was submitted from this sweep directory")
    queued = queued_jobs(set(job_ids))
    to_cancel = job_ids if queued is None else [job for job in job_ids if job in queued]
    if to_cancel:
        run_slurm(["scancel", *to_cancel])
    return Cancelled(to_cancel, job_ids, queued is None)
