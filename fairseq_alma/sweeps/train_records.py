"""A sweep directory's records, and what they say about each run.

``DIR/jobs.json`` (the job table), ``DIR/submissions.json`` (every sbatch call) and, per run,
``RUN_DIR/slurm_events.jsonl`` (written by the batch script) and ``RUN_DIR/stream.jsonl`` (one
record per arrival, written by the trainer; DESIGN.md) are all ``alma-sweep status`` needs: it
works from files alone, and uses the queue only to tell running from pending.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..errors import UsageError
from ..stream.atomic import atomic_write_json
from ..stream.run_view import RunView

# Slurm job states (squeue %T) grouped the way status reports them.
_QUEUE_RUNNING = {"RUNNING", "COMPLETING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "RESIZING"}
# What the last lifecycle event means when the queue does not know the job (or is unreachable).
_EVENT_STATE = {
    "completed": "done",
    "failed": "failed",
    "stopped_after_stage": "stopped",
    "requeue_failed": "failed",
    "terminated": "interrupted",
    "started": "interrupted",
    "usr1": "interrupted",
    "requeued": "interrupted",
}
# Without the queue, an unfinished last event is the best guess there is.
_EVENT_STATE_NO_QUEUE = {**_EVENT_STATE, "started": "running", "usr1": "running",
                         "requeued": "pending", "stopped_after_stage": "pending"}


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(
            f"{path.parent} has no {path.name}: not a sweep directory (run alma-sweep submit)"
        ) from None
    except (OSError, json.JSONDecodeError) as err:
        raise UsageError(f"{path}: unreadable {what} ({err}); was it edited by hand?") from None


def load_jobs(sweep_dir: Path) -> dict[str, Any]:
    """``DIR/jobs.json``, refused when its runs are not ``DIR/NAME`` (``check_sweep_location``)."""
    table = read_json(sweep_dir / "jobs.json", "job table")
    check_sweep_location(sweep_dir, table)
    return table


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a == b or os.path.samefile(a, b)
    except OSError:  # one of them is gone
        return False


def check_sweep_location(sweep_dir: Path, table: Mapping[str, Any]) -> None:
    """Refuse a sweep directory moved or copied from where it was submitted.

    Why refuse rather than read ``DIR/NAME``: a sweep's records name more than its run
    directories. ``submissions.json`` names the Slurm jobs that train (and requeue) into the
    original's runs, ``sweep.sbatch`` writes there, and every run's ``slurm_events.jsonl`` was
    logged by those jobs. A copy reading ``DIR/NAME`` would still report the original's queued
    jobs as its own runs' states, and ``cancel`` would cancel them; refusing is the only way
    that never reports, scores or cancels another directory's runs."""
    jobs = table.get("jobs") if isinstance(table, Mapping) else None
    for job in jobs if isinstance(jobs, list) else []:
        if not isinstance(job, Mapping) or "run_dir" not in job or "name" not in job:
            continue
        recorded = Path(str(job["run_dir"]))
        if recorded == sweep_dir / str(job["name"]) or _same_dir(recorded.parent, sweep_dir):
            continue
        origin = recorded.parent
        where = f"{sweep_dir / 'jobs.json'}: its runs are in {origin}, not here"
        if (origin / "jobs.json").is_file():
            raise UsageError(f"{where}: {sweep_dir} is a copy of the sweep {origin}, whose Slurm "
                             f"jobs and run directories its records name; use alma-sweep on "
                             f"{origin}, or submit a new sweep with another --sweep-dir")
        raise UsageError(f"{where}: the sweep was moved from {origin}, which its records "
                         f"(Slurm jobs, sweep.sbatch, run directories) name; move it back to "
                         f"{origin} to use alma-sweep on it, or submit a new sweep with another "
                         f"--sweep-dir")


def load_submissions(sweep_dir: Path) -> list[dict[str, Any]]:
    path = sweep_dir / "submissions.json"
    return read_json(path, "submission record") if path.exists() else []


def record_submission(sweep_dir: Path, submission: dict[str, Any]) -> None:
    submissions = load_submissions(sweep_dir)
    submissions.append({**submission, "time": time.strftime("%Y-%m-%d %H:%M:%S")})
    atomic_write_json(sweep_dir / "submissions.json", submissions)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file; a torn last line (killed writer) is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


@dataclass(frozen=True)
class RunStatus:
    """One job of a sweep as ``alma-sweep status`` reports it."""

    index: int
    name: str
    state: str  # done / running / pending / failed / stopped / interrupted / not started
    last_arrival: int | None
    metric: str | None  # eval_ppl (LM) or test_error (vision)
    best: float | None
    restarts: int
    slurm_job: str | None

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


def best_metric(records: list[dict[str, Any]]) -> tuple[str | None, float | None]:
    """Min ``eval_ppl`` if any record has it, else min ``test_error`` (paper §3: lower wins)."""
    for metric in ("eval_ppl", "test_error"):
        values = [r[metric] for r in records if isinstance(r.get(metric), (int, float))]
        if values:
            return metric, min(values)
    return None, None


def run_status(
    job: Mapping[str, Any],
    submitted: bool,
    queue: Mapping[int, tuple[str, str]] | None,
) -> RunStatus:
    """Status of one job. ``queue`` maps array task index -> (Slurm state, job id) for this
    sweep's queued jobs, or is None when squeue could not be asked."""
    view = RunView(job["run_dir"])
    events = read_jsonl(view.slurm_events)
    stream = read_jsonl(view.stream_log)  # lenient: a run still training may be mid-write
    last = events[-1] if events else None
    slurm_job = None
    if last is not None and last.get("array_job_id") is not None:
        slurm_job = f"{last['array_job_id']}_{last['array_task_id']}"
    queued = queue.get(job["index"]) if queue is not None else None
    if queued is not None:
        state = "running" if queued[0] in _QUEUE_RUNNING else "pending"
        slurm_job = queued[1]
    elif last is not None:
        state = (_EVENT_STATE if queue is not None else _EVENT_STATE_NO_QUEUE).get(
            last.get("event"), "interrupted"
        )
    else:
        state = "not started" if queue is not None or not submitted else "pending"
    metric, best = best_metric(stream)
    arrival = stream[-1].get("arrival") if stream else None
    restarts_per_job: dict[Any, int] = {}
    for event in events:  # SLURM_RESTART_COUNT counts per Slurm job; chained links add up
        job_id, count = event.get("job_id"), int(event.get("restart") or 0)
        restarts_per_job[job_id] = max(count, restarts_per_job.get(job_id, 0))
    restarts = sum(restarts_per_job.values())
    return RunStatus(job["index"], job["name"], state, arrival, metric, best, restarts, slurm_job)
