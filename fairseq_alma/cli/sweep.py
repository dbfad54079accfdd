"""``alma-sweep``: run a config's grid x seeds as one Slurm job array, and follow it (issue 5).

    alma-sweep submit CONFIG --sweep-dir DIR [--grid FLAG=V1,V2 ...] [--seeds 1,2,3]
                      [--profile NAME] [--max-parallel M] [--chain-stages K --stages-per-link N]
                      [--program CMD] [--dry-run]
    alma-sweep score DIR [--profile NAME] [--max-parallel M] [alma-score options] [--dry-run]
    alma-sweep status DIR [--json]
    alma-sweep cancel DIR

``submit`` writes DIR/jobs.json (the job table), DIR/sweep.sbatch (one array script, task i =
job i) and submits it; running it again on the same DIR submits only the runs that are not done,
and each resumes from its checkpoint. ``score`` scores every finished run, and every group of
runs that differ only by their seed as an ensemble, as one more array (configs/score_plan.py,
configs/score_script.py); its records are DIR/score_jobs.json and DIR/score.sbatch. See
slurm/README.md for the trainer contract.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import re
import shlex
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..configs import ResourceProfile, load_profile, load_run_config, plan_sweep, resolve_profile
from ..configs.global_batch import apply_global_batch
from ..configs.fairseq_flags import check_config_flags
from ..configs.sbatch_script import (
    array_spec,
    check_sbatch_path,
    render_sweep_script,
    sbatch_command,
    task_command,
)
from ..configs.score_plan import (
    PLAN_FILE,
    SCORES_DIR,
    SCRIPT_FILE,
    ScoreTask,
    Skipped,
    load_plan,
    plan_scoring,
    task_state,
)
from ..configs.score_script import render_score_script, task_srun_command
from ..configs.sweep_plan import SweepJob, parse_grid_option, parse_seeds_option
from ..configs.sweep_records import load_jobs, load_submissions, record_submission, run_status
from ..errors import ClusterError, UsageError
from ..slurm_commands import run_slurm as _slurm
from ..stream.atomic import atomic_write_json, atomic_write_text
from ..tables import format_table
from ..console import OneLineArgumentParser, run_console
from ..out_paths import check_dir_path
from .sweep_args import check_max_parallel


def query_queue(array_job_ids: set[str]) -> dict[int, tuple[str, str]] | None:
    """Array task index -> (state, job id) for this sweep's jobs in squeue; None if unreachable."""
    try:
        out = _slurm(["squeue", "-h", "-r", "-u", getpass.getuser(), "-o", "%F|%K|%T|%i"], 30)
    except ClusterError:
        return None
    queue: dict[int, tuple[str, str]] = {}
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4 or parts[0] not in array_job_ids or not parts[1].isdigit():
            continue
        index, state = int(parts[1]), parts[2]
        if index not in queue or state == "RUNNING":  # a running link outranks a pending one
            queue[index] = (state, parts[3])
    return queue


def _resolve_program(text: str) -> list[str]:
    """``--program`` as absolute tokens: a bare name is looked up next to this Python first (the
    venv's console scripts), then on PATH, so jobs run the same installation as alma-sweep."""
    tokens = shlex.split(text)
    if not tokens:
        raise UsageError("--program is empty; give a command such as fairseq-train")
    head = tokens[0]
    if "/" in head:
        found = Path(head).resolve() if Path(head).exists() else None
    else:
        beside = Path(sys.executable).parent / head
        found = beside if beside.exists() else (Path(p) if (p := shutil.which(head)) else None)
    if found is None:
        raise UsageError(f"--program: '{head}' not found next to {sys.executable} nor on PATH")
    return [str(found)] + tokens[1:]


def _print_table(jobs: list[SweepJob]) -> None:
    rows = [
        [str(job.index), job.name, str(job.seed),
         " ".join(f"{k}={v}" for k, v in job.overrides.items()) or "-"]
        for job in jobs
    ]
    # all left-aligned: overrides is free text (format_table right-aligns columns after `left`)
    print(format_table(["#", "run", "seed", "overrides"], rows, left=4), end="")


def submit(args: argparse.Namespace) -> int:
    sweep_dir = Path(args.sweep_dir).resolve()
    check_sbatch_path(sweep_dir, "--sweep-dir")
    check_dir_path(args.sweep_dir, "--sweep-dir")
    check_max_parallel(args.max_parallel)
    if args.chain_stages < 1:
        raise UsageError("--chain-stages must be >= 1")
    if args.chain_stages > 1 and not args.stages_per_link:
        raise UsageError(
            f"--chain-stages {args.chain_stages} needs --stages-per-link N "
            "(each job trains N more stages; the last one runs to the end)"
        )
    if args.stages_per_link is not None and (args.chain_stages == 1 or args.stages_per_link < 1):
        raise UsageError("--stages-per-link N needs N >= 1 and --chain-stages K > 1")
    grid: dict[str, list] = {}
    for text in args.grid or []:
        flag, values = parse_grid_option(text)
        if flag in grid:
            raise UsageError(f"--grid {flag} given twice; list all its values in one --grid")
        grid[flag] = values
    config = load_run_config(args.config, check_flags=False).with_grid(grid)
    if args.seeds:
        config = config.with_seeds(parse_seeds_option(args.seeds))
    profile = resolve_profile(args.profile, config.resources, config.path)
    points = len(config.grid_points())
    print(f"alma-sweep: checking {points} grid point(s) of {config.path} against fairseq-train's "
          "flags (imports fairseq: a few seconds)", file=sys.stderr, flush=True)
    check_config_flags(config)
    program = _resolve_program(args.program)
    jobs = apply_global_batch(plan_sweep(config, sweep_dir), config.global_batch,
                              profile.world_size, str(config.path))
    max_parallel = args.max_parallel or len(jobs)
    if max_parallel < 1:
        raise UsageError("--max-parallel must be >= 1")
    job_name = "alma-" + re.sub(r"[^A-Za-z0-9._-]", "_", sweep_dir.name)
    script = render_sweep_script(
        jobs, profile, program=program, sweep_dir=sweep_dir, workdir=Path.cwd(),
        job_name=job_name, max_parallel=max_parallel, source=str(config.path),
    )
    links = [
        (link, link * args.stages_per_link if link < args.chain_stages else None)
        for link in range(1, args.chain_stages + 1)
    ]
    print(f"{len(jobs)} run(s) of {config.path.name} on profile {profile.name} "
          f"({profile.world_size} process(es) per run, {len(links)} chained job(s) per run)")
    _print_table(jobs)
    if args.dry_run:
        print("\n# commands (one per array task; srun starts the processes):")
        for job in jobs:
            print(f"[{job.index}] {shlex.join(task_command(job, profile, program))}")
        print(f"\n# {sweep_dir}/sweep.sbatch\n{script}")
        print("# would submit:")
        array = array_spec([job.index for job in jobs], max_parallel)
        for link, stop in links:
            after = None if link == 1 else f"<job id of link {link - 1}>"
            print(shlex.join(sbatch_command(sweep_dir / "sweep.sbatch", array, after, stop)))
        return 0
    return _submit_links(sweep_dir, config, profile, program, jobs, script, links, max_parallel)


def _submit_links(sweep_dir, config, profile, program, jobs, script, links, max_parallel) -> int:
    for part in config.data.split(":"):
        if not Path(part).exists():
            raise UsageError(f"{config.path}: data directory {Path(part).resolve()} not found")
    table = {
        "config": str(config.path),
        "sources": [str(p) for p in config.sources],
        "program": program,
        "profile": profile.name,
        "sbatch_options": profile.sbatch_options(),
        "jobs": [job.to_json() for job in jobs],
    }
    if (sweep_dir / "jobs.json").exists():
        old = load_jobs(sweep_dir)
        # Same runs = same names and flags; the program may change (a fixed wrapper, say).
        if [(j["name"], j["argv"]) for j in old["jobs"]] != [(j.name, j.argv) for j in jobs]:
            raise UsageError(
                f"{sweep_dir} holds a different sweep (its jobs.json has other runs or flags); "
                "use a new --sweep-dir, or delete the old one"
            )
        queued = query_queue({str(s["job_id"]) for s in load_submissions(sweep_dir)})
        if queued:
            raise UsageError(
                f"{sweep_dir} still has {len(queued)} run(s) queued or running; "
                "wait (alma-sweep status) or alma-sweep cancel first"
            )
    submitted = bool(load_submissions(sweep_dir)) if sweep_dir.exists() else False
    todo = [job.index for job in jobs if run_status(job.to_json(), submitted, {}).state != "done"]
    if not todo:
        print(f"all {len(jobs)} run(s) in {sweep_dir} are done; nothing to submit")
        return 0
    (sweep_dir / "logs").mkdir(parents=True, exist_ok=True)
    atomic_write_json(sweep_dir / "jobs.json", table)
    script_path = sweep_dir / "sweep.sbatch"
    atomic_write_text(script_path, script)
    script_path.chmod(0o755)  # a script, executable as before (atomic writes follow the umask)
    array = array_spec(todo, max_parallel)
    previous = None
    for link, stop in links:
        command = sbatch_command(script_path, array, previous, stop)
        job_id = _slurm(command).strip().split(";")[0]
        record_submission(sweep_dir, {"job_id": job_id, "array": array, "link": link,
                                      "links": len(links), "stop_after_stage": stop,
                                      "after": previous, "command": command})
        print(f"submitted job {job_id} (array {array}, link {link}/{len(links)}"
              + (f", stops after stage {stop})" if stop else ")"))
        previous = job_id
    return 0


def status(args: argparse.Namespace) -> int:
    sweep_dir = Path(args.sweep_dir).resolve()
    table = load_jobs(sweep_dir)
    submissions = load_submissions(sweep_dir)
    queue = query_queue({str(s["job_id"]) for s in submissions}) if submissions else None
    runs = [run_status(job, bool(submissions), queue) for job in table["jobs"]]
    if args.json:
        print(json.dumps([run.to_json() for run in runs], indent=1))
        return 0
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.state] = counts.get(run.state, 0) + 1
    print(f"{sweep_dir}: {len(runs)} run(s): "
          + ", ".join(f"{state} {n}" for state, n in sorted(counts.items())))
    if queue is None and submissions:
        print("(squeue not reachable: states come from the run directories only)")
    rows = [
        [str(run.index), run.name, run.state,
         "-" if run.last_arrival is None else str(run.last_arrival),
         f"{run.metric} {run.best:.4g}" if run.best is not None else "-",
         str(run.restarts), run.slurm_job or "-"]
        for run in runs
    ]
    header = ["#", "run", "state", "arrival", "best", "restarts", "slurm job"]
    print(format_table(header, rows, left=3), end="")
    plan = load_plan(sweep_dir)
    if plan is not None:
        _print_score_status(sweep_dir, plan)
    return 0


def _score_states(plan: dict) -> list[tuple[str, str]]:
    """(state, Slurm job) of every task of the latest scoring plan: the queue's word while it
    is queued, else what its output directory says (scored / stale / failed / not scored)."""
    submissions = plan.get("submissions") or []
    last = submissions[-1] if submissions else None
    queue = query_queue({str(last["job_id"])}) if last else {}
    out = []
    for task in plan["tasks"]:
        queued = (queue or {}).get(task["index"])
        if queued is not None:
            state = "running" if queued[0] == "RUNNING" else queued[0].lower()
            out.append((state, queued[1]))
            continue
        state = task_state(task)
        submitted = last is not None and task["index"] in last.get("tasks", [])
        if state == "not scored" and submitted and queue is not None:
            state = "failed"  # left the queue without outputs: OUT_DIR/score.log says why
        job = f"{last['job_id']}_{task['index']}" if submitted else "-"
        out.append((state, job))
    return out


def _print_score_status(sweep_dir: Path, plan: dict) -> None:
    states = _score_states(plan)
    counts: dict[str, int] = {}
    for state, _ in states:
        counts[state] = counts.get(state, 0) + 1
    print(f"\nscoring ({sweep_dir / PLAN_FILE}): {len(states)} task(s): "
          + ", ".join(f"{state} {n}" for state, n in sorted(counts.items())))
    rows = [[str(task["index"]), task["name"], task["mode"], state, job]
            for task, (state, job) in zip(plan["tasks"], states)]
    print(format_table(["#", "task", "mode", "state", "slurm job"], rows, left=4), end="")
    if counts.get("failed"):
        print(f"failed tasks: see {sweep_dir / SCORES_DIR}/TASK/score.log; "
              "alma-sweep score submits them again")


def cancel(args: argparse.Namespace) -> int:
    sweep_dir = Path(args.sweep_dir).resolve()
    load_jobs(sweep_dir)
    job_ids = [str(s["job_id"]) for s in load_submissions(sweep_dir)]
    job_ids += [str(s["job_id"]) for s in (load_plan(sweep_dir) or {}).get("submissions", [])]
    if not job_ids:
        raise UsageError(f"{sweep_dir}: nothing was submitted from this sweep directory")
    _slurm(["scancel", *job_ids])
    print(f"cancelled Slurm job(s) {', '.join(job_ids)} of {sweep_dir}")
    return 0


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


def _score_flags() -> list[tuple[str, dict]]:
    """alma-score's own flag table (imports torch: only ``alma-sweep score`` asks for it)."""
    from .score import _FLAGS

    return _FLAGS


def _own_dest(flag: str) -> str:
    return "own_" + flag[2:].replace("-", "_")


def _score_options(args: argparse.Namespace, profile: ResourceProfile) -> list[str]:
    """alma-score's options for every task, as argv tokens (paths made absolute); ``--cpu`` on
    a profile without GPUs. Checked with alma-score's own rules before anything is written."""
    from .score import _check_flags, build_parser as score_parser

    tokens: list[str] = []
    for flag, options in _score_flags():
        if flag in SCORE_OWN_FLAGS:
            if getattr(args, _own_dest(flag)) not in (None, False):
                raise UsageError(f"{flag}: alma-sweep score sets it ({SCORE_OWN_FLAGS[flag]}); "
                                 f"drop {flag}")
            continue
        value = getattr(args, flag[2:].replace("-", "_"))
        if options.get("action") == "store_true":
            tokens += [flag] if value else []
        elif value is not None:
            if flag == "--data":
                parts = [Path(part).resolve() for part in value.split(os.pathsep)]
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
    _check_flags(score_parser().parse_intermixed_args(["RUN_DIR", *tokens]))
    return tokens


def _score_profile(name: str | None, table: dict, sweep_dir: Path) -> ResourceProfile:
    """``--profile``, else the profile the sweep was trained with (by name)."""
    if name is not None:
        return load_profile(name)
    trained = table.get("profile")
    try:
        if not trained or trained == "inline":
            raise UsageError("")
        return load_profile(trained)
    except UsageError:
        raise UsageError(f"{sweep_dir / 'jobs.json'}: trained with profile "
                         f"'{trained or '?'}', which is not in slurm/profiles/; pass "
                         "--profile NAME|PATH for the scoring jobs") from None


def _print_score_plan(tasks: list[ScoreTask], states: list[str], skipped: list[Skipped]) -> None:
    words = {"scored": "scored", "stale": "rescore (inputs changed)", "not scored": "to score"}
    rows = [[str(task.index), task.name, task.mode, " ".join(task.runs), words[state]]
            for task, state in zip(tasks, states)]
    if rows:
        print(format_table(["#", "task", "mode", "runs", "state"], rows, left=5), end="")
    for item in skipped:
        print(f"skipped {item.name}: {item.reason}")


def score(args: argparse.Namespace) -> int:
    sweep_dir = Path(args.sweep_dir).resolve()
    check_sbatch_path(sweep_dir, "SWEEP_DIR")
    table = load_jobs(sweep_dir)
    check_max_parallel(args.max_parallel)
    profile = _score_profile(args.profile, table, sweep_dir)
    options = _score_options(args, profile)
    old = load_plan(sweep_dir) or {}
    submissions = old.get("submissions") or []
    if submissions:
        queued = query_queue({str(submissions[-1]["job_id"])})
        if queued:
            raise UsageError(f"{sweep_dir}: {len(queued)} scoring task(s) of job "
                             f"{submissions[-1]['job_id']} still queued or running; wait "
                             "(alma-sweep status) or alma-sweep cancel first")
    tasks, skipped = plan_scoring(sweep_dir, table["jobs"], options)
    train_submissions = load_submissions(sweep_dir)
    if skipped and train_submissions:  # say where each unfinished run's training stands
        queue = query_queue({str(s["job_id"]) for s in train_submissions})
        training = {job["name"]: run_status(job, True, queue).state for job in table["jobs"]}
        skipped = [replace(item, reason=f"{item.reason} (training: {training[item.name]})")
                   if item.name in training else item for item in skipped]
    states = [task_state(task) for task in tasks]
    todo = [task.index for task, state in zip(tasks, states) if state != "scored"]
    runs = sum(task.mode == "single" for task in tasks)
    print(f"{len(tasks)} scoring task(s) for {runs} finished run(s) of {sweep_dir} on profile "
          f"{profile.name} ({profile.world_size} process(es) per task); {len(todo)} to submit")
    _print_score_plan(tasks, states, skipped)
    if not tasks:
        raise UsageError(f"no run of {sweep_dir} has finished training (skipped lines above); "
                         f"alma-sweep status {sweep_dir} shows where each run is")
    if not todo:
        print(f"all {len(tasks)} scoring task(s) are scored from their current checkpoints; "
              f"nothing to submit (outputs: {sweep_dir / SCORES_DIR}/TASK/)")
        return 0
    max_parallel = args.max_parallel or len(todo)
    program = [sys.executable, "-m", "fairseq_alma.cli.score"]
    job_name = "alma-score-" + re.sub(r"[^A-Za-z0-9._-]", "_", sweep_dir.name)
    script = render_score_script(tasks, todo, profile, program=program, sweep_dir=sweep_dir,
                                 job_name=job_name, max_parallel=max_parallel)
    script_path = sweep_dir / SCRIPT_FILE
    command = ["sbatch", "--parsable", str(script_path)]
    if args.dry_run:
        print("\n# commands (one per array task to submit):")
        for task in tasks:
            if task.index in todo:
                print(f"[{task.index}] {shlex.join(task_srun_command(task, profile, program))}")
        print(f"\n# {script_path}\n{script}")
        print(f"# would submit:\n{shlex.join(command)}")
        return 0
    logs = sweep_dir / "logs"
    new_logs = not logs.exists()
    logs.mkdir(exist_ok=True)  # Slurm writes each task's output there
    previous = script_path.read_text() if script_path.exists() else None
    atomic_write_text(script_path, script)
    script_path.chmod(0o755)
    try:
        job_id = _slurm(command).strip().split(";")[0]
    except ClusterError:  # leave the sweep directory as it was
        if previous is None:
            script_path.unlink()
        else:
            atomic_write_text(script_path, previous)
            script_path.chmod(0o755)
        if new_logs:
            logs.rmdir()
        raise
    array = array_spec(todo, max_parallel)
    submissions.append({"job_id": job_id, "array": array, "tasks": todo, "command": command,
                        "time": time.strftime("%Y-%m-%d %H:%M:%S")})
    atomic_write_json(sweep_dir / PLAN_FILE, {
        "program": program, "options": options, "profile": profile.name,
        "sbatch_options": profile.sbatch_options(),
        "tasks": [task.to_json() for task in tasks], "submissions": submissions})
    print(f"submitted job {job_id} (array {array}): outputs in {sweep_dir / SCORES_DIR}/TASK/; "
          f"follow it with alma-sweep status {sweep_dir}")
    return 0


def _add_score_parser(commands: argparse._SubParsersAction, with_score_flags: bool) -> None:
    sub = commands.add_parser(
        "score", help="score every finished run, and every group of seeds as an ensemble, "
        "as one Slurm job array",
        description="Score a sweep as one Slurm job array: one alma-score task per finished run "
        "(--mode single) and one per group of runs that differ only by their seed (--mode ens, "
        "when all its runs have finished). Writes SWEEP_DIR/score_jobs.json and "
        "SWEEP_DIR/score.sbatch; each task writes score.json, score.csv, score.txt and "
        f"scored.json to SWEEP_DIR/{SCORES_DIR}/TASK/. Runs not finished training are skipped "
        "with the reason. Running it again submits only the tasks not yet scored, or whose "
        "runs changed since.",
        epilog="alma-report SWEEP_DIR/scores/*/score.json --out DIR draws the tables and "
        "figures. More: slurm/README.md")
    sub.add_argument("sweep_dir", help="a directory made by alma-sweep submit")
    sub.add_argument("--profile", help="resource profile for each task: a name in "
                     "slurm/profiles/ or a YAML path (default: the sweep's training profile); "
                     "more than one process per task scores data-parallel")
    sub.add_argument("--max-parallel", type=int, metavar="M",
                     help="at most M tasks at once (--array ...%%M); default: all")
    sub.add_argument("--dry-run", action="store_true",
                     help="print the task table, commands and sbatch script; write nothing")
    if with_score_flags:
        group = sub.add_argument_group(
            "alma-score options, passed to every task (see alma-score --help; "
            f"{', '.join(SCORE_OWN_FLAGS)} are set by alma-sweep score)")
        for flag, options in _score_flags():
            if flag in SCORE_OWN_FLAGS:  # parsed only to be refused with the reason
                keep = {"action": "store_true"} if options.get("action") == "store_true" else {}
                sub.add_argument(flag, dest=_own_dest(flag), help=argparse.SUPPRESS, **keep)
            else:
                group.add_argument(flag, **options)
    sub.set_defaults(handler=score)


def build_parser(with_score_flags: bool = False) -> argparse.ArgumentParser:
    """``with_score_flags``: add alma-score's options to ``score`` (imports torch, so only
    when the command is ``score``)."""
    parser = OneLineArgumentParser(
        prog="alma-sweep",
        description="Run a config's grid x seeds as one Slurm job array, and follow it.",
        epilog="Trainer contract, profiles and examples: slurm/README.md")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub = commands.add_parser("submit", help="expand a config into a job array and submit it")
    sub.add_argument("config", help="run config YAML (train_configs/...)")
    sub.add_argument("--sweep-dir", required=True,
                     help="directory for jobs.json, sweep.sbatch, logs/ and one dir per run")
    sub.add_argument("--grid", action="append", metavar="FLAG=V1,V2",
                     help="add or replace a grid dimension (repeatable)")
    sub.add_argument("--seeds", metavar="1,2,3", help="seeds instead of the config's seeds:")
    sub.add_argument("--profile", help="resource profile: a name in slurm/profiles/ or a YAML "
                     "path; overrides the config's resources:")
    sub.add_argument("--max-parallel", type=int, metavar="M",
                     help="at most M runs at once (--array ...%%M); default: all")
    sub.add_argument("--chain-stages", type=int, default=1, metavar="K",
                     help="split each run into K jobs chained with --dependency (default 1)")
    sub.add_argument("--stages-per-link", type=int, metavar="N",
                     help="with --chain-stages: job k stops after stage k*N "
                     "(ALMA_STOP_AFTER_STAGE); the last job runs to the end")
    sub.add_argument("--program", default="fairseq-train",
                     help="training command that receives the run's flags "
                     "(default fairseq-train; e.g. 'python slurm/contract_trainer.py')")
    sub.add_argument("--dry-run", action="store_true",
                     help="print the job table, commands and sbatch script; submit nothing")
    sub.set_defaults(handler=submit)
    _add_score_parser(commands, with_score_flags)
    sub = commands.add_parser("status", help="done/running/pending/failed per run, and scoring")
    sub.add_argument("sweep_dir", help="a directory made by alma-sweep submit")
    sub.add_argument("--json", action="store_true", help="print one JSON object per run")
    sub.set_defaults(handler=status)
    sub = commands.add_parser("cancel", help="scancel every job of a sweep (scoring too)")
    sub.add_argument("sweep_dir", help="a directory made by alma-sweep submit")
    sub.set_defaults(handler=cancel)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point ``alma-sweep``: one line on stderr and exit status 2 on a bad config,
    flag or sweep directory, or when a Slurm command fails."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(with_score_flags=argv[:1] == ["score"]).parse_args(argv)
    return run_console("alma-sweep", lambda: args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
