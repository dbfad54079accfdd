"""What ``alma-sweep`` prints: job tables, dry runs, status tables, as text for the console to
print (every string ends with a newline).

Kept apart from the planning so the planning returns facts and the console entry only prints;
the wording is part of the interface (users and tests read it).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from ..text_table import format_table
from .score_plan import PLAN_FILE, SCORES_DIR
from .score_script import task_srun_command
from .score_submit import ScoreArray, ScorePlan
from .sweep_status import ScoreTaskStatus, TrainingStatus
from .train_plan import SweepJob
from .train_script import array_spec, sbatch_command, task_command
from .train_submit import Submitted, TrainSubmission


def _counts(states: list[str]) -> str:
    counts: dict[str, int] = {}
    for state in states:
        counts[state] = counts.get(state, 0) + 1
    return ", ".join(f"{state} {n}" for state, n in sorted(counts.items()))


def job_table(jobs: list[SweepJob]) -> str:
    rows = [
        [str(job.index), job.name, str(job.seed),
         " ".join(f"{k}={v}" for k, v in job.overrides.items()) or "-"]
        for job in jobs
    ]
    # all left-aligned: overrides is free text (format_table right-aligns columns after `left`)
    return format_table(["#", "run", "seed", "overrides"], rows, left=4)


def submission_plan(plan: TrainSubmission) -> str:
    """The headline and the job table of ``alma-sweep submit``."""
    profile = plan.profile
    return (f"{len(plan.jobs)} run(s) of {plan.config.path.name} on profile {profile.name} "
            f"({profile.world_size} process(es) per run, {len(plan.links)} chained job(s) per "
            f"run)\n" + job_table(plan.jobs))


def submission_dry_run(plan: TrainSubmission) -> str:
    """Every task's command, the script and the sbatch calls a submission would make."""
    lines = ["", "# commands (one per array task; srun starts the processes):"]
    lines += [f"[{job.index}] {shlex.join(task_command(job, plan.profile, plan.program))}"
              for job in plan.jobs]
    lines += ["", f"# {plan.sweep_dir}/sweep.sbatch\n{plan.script}", "# would submit:"]
    array = array_spec([job.index for job in plan.jobs], plan.max_parallel)
    for link in plan.links:
        after = None if link.link == 1 else f"<job id of link {link.link - 1}>"
        command = sbatch_command(plan.sweep_dir / "sweep.sbatch", array, after,
                                 link.stop_after_stage)
        lines.append(shlex.join(command))
    return "\n".join(lines) + "\n"


def submitted_line(done: Submitted) -> str:
    stop = done.link.stop_after_stage
    return (f"submitted job {done.job_id} (array {done.array}, link {done.link.link}/"
            f"{done.links}" + (f", stops after stage {stop})" if stop else ")") + "\n")


def training_status_table(status: TrainingStatus) -> str:
    runs = status.runs
    text = (f"{status.sweep_dir}: {len(runs)} run(s): "
            + _counts([run.state for run in runs]) + "\n")
    if status.queue_unreachable:
        text += "(squeue not reachable: states come from the run directories only)\n"
    rows = [
        [str(run.index), run.name, run.state,
         "-" if run.last_arrival is None else str(run.last_arrival),
         f"{run.metric} {run.best:.4g}" if run.best is not None else "-",
         str(run.restarts), run.slurm_job or "-"]
        for run in runs
    ]
    header = ["#", "run", "state", "arrival", "best", "restarts", "slurm job"]
    return text + format_table(header, rows, left=3)


def scoring_status_table(sweep_dir: Path, tasks: list[ScoreTaskStatus]) -> str:
    states = [task.state for task in tasks]
    text = (f"\nscoring ({sweep_dir / PLAN_FILE}): {len(tasks)} task(s): "
            + _counts(states) + "\n")
    rows = [[str(task.index), task.name, task.mode, task.state, task.slurm_job]
            for task in tasks]
    text += format_table(["#", "task", "mode", "state", "slurm job"], rows, left=4)
    if "failed" in states:
        text += (f"failed tasks: see {sweep_dir / SCORES_DIR}/TASK/score.log; "
                 "alma-sweep score submits them again\n")
    stale = [task.name for task in tasks if task.stale_outputs]
    if stale:
        text += (f"(the outputs of {', '.join(stale)} are an earlier scoring's, of inputs "
                 "changed since: stale until a rescore succeeds)\n")
    if "not run" in states:
        text += ("tasks not run: cancelled before they started (no Slurm output in "
                 f"{sweep_dir}/logs); alma-sweep score submits them again\n")
    return text


def score_plan_table(plan: ScorePlan) -> str:
    """The headline, the task table and one line per skipped run or ensemble."""
    setup = plan.setup
    profile = setup.profile
    text = (f"{len(plan.tasks)} scoring task(s) for {plan.finished_runs} finished run(s) of "
            f"{setup.sweep_dir} on profile {profile.name} ({profile.world_size} process(es) "
            f"per task); {len(plan.todo)} to submit\n")
    words = {"scored": "scored", "stale": "rescore (inputs changed)", "not scored": "to score"}
    rows = [[str(task.index), task.name, task.mode, " ".join(task.runs), words[state]]
            for task, state in zip(plan.tasks, plan.states)]
    if rows:
        text += format_table(["#", "task", "mode", "runs", "state"], rows, left=5)
    for item in plan.skipped:
        text += f"skipped {item.name}: {item.reason}\n"
    return text


def nothing_to_score(plan: ScorePlan) -> str:
    return (f"all {len(plan.tasks)} scoring task(s) are scored from their current checkpoints; "
            f"nothing to submit (outputs: {plan.setup.sweep_dir / SCORES_DIR}/TASK/)\n")


def score_dry_run(plan: ScorePlan, array: ScoreArray) -> str:
    lines = ["", "# commands (one per array task to submit):"]
    lines += [f"[{task.index}] "
              f"{shlex.join(task_srun_command(task, plan.setup.profile, array.program))}"
              for task in plan.tasks if task.index in plan.todo]
    lines += ["", f"# {array.script_path}\n{array.script}",
              f"# would submit:\n{shlex.join(array.command)}"]
    return "\n".join(lines) + "\n"


def score_submitted_line(sweep_dir: Path, job_id: str, array: str) -> str:
    return (f"submitted job {job_id} (array {array}): outputs in {sweep_dir / SCORES_DIR}/TASK/; "
            f"follow it with alma-sweep status {sweep_dir}\n")
