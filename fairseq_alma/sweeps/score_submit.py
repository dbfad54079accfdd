"""``alma-sweep score``: from a request to the scoring array of a sweep, and submitting it.

The steps, in the order their errors must come: ``prepare_scoring`` (the sweep directory, its
profile, alma-score's options for every task); the caller then applies alma-score's own rules to
those options (they belong to alma-score); ``plan_score_array`` (the queue, the tasks of the
finished runs, which are due); ``render_score_array`` (the sbatch script); ``submit_score_array``
(writes and submits, and leaves the sweep directory as it was when sbatch fails).  What goes in
the array is score_plan.py's business, the script's score_script.py's.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import ClusterError, UsageError
from ..stream.atomic import atomic_write_json, atomic_write_text
from .resource_profile import ResourceProfile, load_profile, parse_profile
from .score_plan import (
    PLAN_FILE,
    SCORES_DIR,
    SCRIPT_FILE,
    ScoreTask,
    Skipped,
    load_plan,
    plan_scoring,
    task_state,
)
from .score_script import render_score_script
from .slurm_commands import query_queue, require_queue, run_slurm
from .train_records import load_jobs, load_submissions, run_status
from .train_script import array_spec, check_max_parallel, check_sbatch_path
from .undo_writes import UndoWrites

# alma-score flags that `alma-sweep score` sets itself, and why (a user's is refused with this).
SCORE_OWN_FLAGS = {
    "--mode": "it scores each run alone (single) and each group of seeds as an ensemble (ens)",
    "--json": f"each task writes SWEEP_DIR/{SCORES_DIR}/TASK/score.json",
    "--csv": f"each task writes SWEEP_DIR/{SCORES_DIR}/TASK/score.csv",
    "--plot": f"draw figures from SWEEP_DIR/{SCORES_DIR}/*/score.json with alma-report",
    "--setting": "each series keeps alma-score's own name (SM_w1, Ens_w1, ...)",
    "--from-log": "it would evaluate nothing; alma-report reads the runs' logged perplexities",
    "--matrix": "not for sweeps: their Ens and gEns tasks cannot score one; run alma-score RUN "
                "--matrix on the runs and pass its --json to alma-report",
}

OptionValue = str | int | bool | None


@dataclass(frozen=True)
class ScoreArrayRequest:
    """What ``alma-sweep score`` was asked. ``options``: every alma-score flag in alma-score's
    order with its parsed value (True/False for a switch, None when not given), the flags this
    command sets itself included, so a user's is refused with the reason."""

    sweep_dir: Path
    profile: str | None = None
    max_parallel: int | None = None
    options: tuple[tuple[str, OptionValue], ...] = ()


@dataclass(frozen=True)
class ScoringSetup:
    """The sweep to score, the profile of its tasks and alma-score's options for every task."""

    sweep_dir: Path
    table: dict[str, Any]
    profile: ResourceProfile
    options: list[str]
    max_parallel: int | None


@dataclass(frozen=True)
class ScorePlan:
    """The tasks of the finished runs, what is skipped and why, and which tasks are due."""

    setup: ScoringSetup
    tasks: list[ScoreTask]
    states: list[str]
    skipped: list[Skipped]
    todo: list[int]
    submissions: list[dict[str, Any]]

    @property
    def finished_runs(self) -> int:
        return sum(task.mode == "single" for task in self.tasks)


@dataclass(frozen=True)
class ScoreArray:
    """The scoring array to submit: the script and the sbatch command."""

    program: list[str]
    script: str
    script_path: Path
    command: list[str]
    max_parallel: int


def _score_profile(name: str | None, table: dict, sweep_dir: Path) -> ResourceProfile:
    """``--profile``, else the profile the sweep was trained with: the settings its jobs.json
    keeps (``train_submit.submit_links``), so a user's own ``myprofiles/gpu-1.yaml`` is not
    taken for the shipped ``gpu-1``; a jobs.json written before it kept them names the profile
    only, looked up in slurm/profiles/ as then."""
    if name is not None:
        return load_profile(name)
    trained = table.get("profile")
    settings = table.get("profile_settings")
    if isinstance(settings, dict):
        where = f"{sweep_dir / 'jobs.json'}: profile_settings"
        return replace(parse_profile(settings, str(trained or "inline"), where),
                       source=str(table.get("profile_source") or where))
    try:
        if not trained or trained == "inline":
            raise UsageError("")
        return load_profile(trained)
    except UsageError:
        raise UsageError(f"{sweep_dir / 'jobs.json'}: trained with profile "
                         f"'{trained or '?'}', which is not in slurm/profiles/; pass "
                         "--profile NAME|PATH for the scoring jobs") from None


def _score_options(given: tuple[tuple[str, OptionValue], ...],
                   profile: ResourceProfile) -> list[str]:
    """alma-score's options for every task, as argv tokens (paths made absolute); ``--cpu`` on
    a profile without GPUs."""
    tokens: list[str] = []
    for flag, value in given:
        if flag in SCORE_OWN_FLAGS:
            if value not in (None, False):
                raise UsageError(f"{flag}: alma-sweep score sets it ({SCORE_OWN_FLAGS[flag]}); "
                                 f"drop {flag}")
            continue
        if isinstance(value, bool):  # a switch
            tokens += [flag] if value else []
        elif value is not None:
            if flag == "--data":
                parts = [Path(part).resolve() for part in str(value).split(os.pathsep)]
                missing = [str(part) for part in parts if not part.is_dir()]
                if missing:
                    raise UsageError(f"--data {missing[0]}: not a directory; pass the stream "
                                     "directory made by alma-data-prep")
                value = os.pathsep.join(str(part) for part in parts)
            tokens += [flag, str(value)]
    if profile.device == "cpu" and "--cpu" not in tokens:
        tokens.append("--cpu")
    if "--fp16" in tokens and "--cpu" in tokens:
        raise UsageError(
            f"--fp16 needs a CUDA device, but profile {profile.name} has no GPUs; drop --fp16 "
            "or pass --profile with gpus_per_node" if profile.device == "cpu"
            else "--fp16 needs a CUDA device; drop --cpu or --fp16")
    return tokens


def prepare_scoring(request: ScoreArrayRequest) -> ScoringSetup:
    """The sweep directory, the tasks' profile and alma-score's options (not yet checked
    against alma-score's own rules: the caller does that with alma-score's parser)."""
    sweep_dir = request.sweep_dir
    check_sbatch_path(sweep_dir, "SWEEP_DIR")
    table = load_jobs(sweep_dir)
    check_max_parallel(request.max_parallel)
    profile = _score_profile(request.profile, table, sweep_dir)
    options = _score_options(request.options, profile)
    return ScoringSetup(sweep_dir, table, profile, options, request.max_parallel)


def plan_score_array(setup: ScoringSetup) -> ScorePlan:
    """Refuses while an earlier scoring array is queued; else every task of the finished runs,
    the skipped ones with the reason (and, for a run, where its training stands)."""
    sweep_dir, table = setup.sweep_dir, setup.table
    old = load_plan(sweep_dir) or {}
    submissions = old.get("submissions") or []
    if submissions:
        queued = require_queue(
            {str(submissions[-1]["job_id"])},
            f"whether scoring job {submissions[-1]['job_id']} of {sweep_dir} is still queued is "
            "unknown (scoring again now could score its tasks twice)",
            "retry alma-sweep score when squeue answers")
        if queued:
            raise UsageError(f"{sweep_dir}: {len(queued)} scoring task(s) of job "
                             f"{submissions[-1]['job_id']} still queued or running; wait "
                             "(alma-sweep status) or alma-sweep cancel first")
    tasks, skipped = plan_scoring(sweep_dir, table["jobs"], setup.options)
    train_submissions = load_submissions(sweep_dir)
    if skipped and train_submissions:  # say where each unfinished run's training stands
        queue = query_queue({str(s["job_id"]) for s in train_submissions})
        training = {job["name"]: run_status(job, True, queue).state for job in table["jobs"]}
        skipped = [replace(item, reason=f"{item.reason} (training: {training[item.name]})")
                   if item.name in training else item for item in skipped]
    states = [task_state(task) for task in tasks]
    todo = [task.index for task, state in zip(tasks, states) if state != "scored"]
    return ScorePlan(setup, tasks, states, skipped, todo, submissions)


def require_tasks(plan: ScorePlan) -> None:
    """Refuse a sweep none of whose runs has finished training."""
    sweep_dir = plan.setup.sweep_dir
    if not plan.tasks:
        raise UsageError(f"no run of {sweep_dir} has finished training (skipped lines above); "
                         f"alma-sweep status {sweep_dir} shows where each run is")


def render_score_array(plan: ScorePlan) -> ScoreArray:
    """The sbatch script over the due tasks (``plan.todo``, not empty) and its command."""
    setup = plan.setup
    sweep_dir = setup.sweep_dir
    max_parallel = setup.max_parallel or len(plan.todo)
    program = [sys.executable, "-m", "fairseq_alma.cli.score"]
    job_name = "alma-score-" + re.sub(r"[^A-Za-z0-9._-]", "_", sweep_dir.name)
    script = render_score_script(plan.tasks, plan.todo, setup.profile, program=program,
                                 sweep_dir=sweep_dir, job_name=job_name,
                                 max_parallel=max_parallel)
    script_path = sweep_dir / SCRIPT_FILE
    command = ["sbatch", "--parsable", str(script_path)]
    return ScoreArray(program, script, script_path, command, max_parallel)


def submit_score_array(plan: ScorePlan, array: ScoreArray) -> tuple[str, str]:
    """Write the script, submit it and record the plan; returns (Slurm job id, array spec).
    When sbatch fails the sweep directory is left as it was."""
    setup = plan.setup
    sweep_dir, script_path = setup.sweep_dir, array.script_path
    logs = sweep_dir / "logs"
    undo = UndoWrites([script_path], [logs])
    logs.mkdir(exist_ok=True)  # Slurm writes each task's output there
    atomic_write_text(script_path, array.script)
    script_path.chmod(0o755)
    try:
        job_id = run_slurm(array.command).strip().split(";")[0]
    except ClusterError:  # leave the sweep directory as it was
        undo.undo()
        raise
    spec = array_spec(plan.todo, array.max_parallel)
    submissions = [*plan.submissions, {"job_id": job_id, "array": spec, "tasks": plan.todo,
                                       "command": array.command,
                                       "time": time.strftime("%Y-%m-%d %H:%M:%S")}]
    atomic_write_json(sweep_dir / PLAN_FILE, {
        "program": array.program, "options": setup.options, "profile": setup.profile.name,
        "sbatch_options": setup.profile.sbatch_options(),
        "tasks": [task.to_json() for task in plan.tasks], "submissions": submissions})
    return job_id, spec
