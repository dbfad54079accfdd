"""``alma-sweep``: run a config's grid x seeds as one Slurm job array, and follow it (issue 5).

    alma-sweep submit CONFIG --sweep-dir DIR [--grid FLAG=V1,V2 ...] [--seeds 1,2,3]
                      [--profile NAME] [--max-parallel M] [--chain-stages K --stages-per-link N]
                      [--program CMD] [--dry-run]
    alma-sweep status DIR [--json]
    alma-sweep cancel DIR

``submit`` writes DIR/jobs.json (the job table), DIR/sweep.sbatch (one array script, task i =
job i) and submits it; running it again on the same DIR submits only the runs that are not done,
and each resumes from its checkpoint. See slurm/README.md for the trainer contract.
"""

from __future__ import annotations

import argparse
import getpass
import json
import re
import shlex
import shutil
import sys
from pathlib import Path

from ..configs import load_run_config, plan_sweep, resolve_profile
from ..configs.global_batch import apply_global_batch
from ..configs.fairseq_flags import check_config_flags
from ..configs.sbatch_script import (
    array_spec,
    check_sbatch_path,
    render_sweep_script,
    sbatch_command,
    task_command,
)
from ..configs.sweep_plan import SweepJob, parse_grid_option, parse_seeds_option
from ..configs.sweep_records import load_jobs, load_submissions, record_submission, run_status
from ..errors import ClusterError, UsageError
from ..slurm_commands import run_slurm as _slurm
from ..stream.atomic import atomic_write_json, atomic_write_text
from ..tables import format_table
from .entry import OneLineArgumentParser, run_console


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
    points = len(config.grid_points())
    print(f"alma-sweep: checking {points} grid point(s) of {config.path} against fairseq-train's "
          "flags (imports fairseq: a few seconds)", file=sys.stderr, flush=True)
    check_config_flags(config)
    profile = resolve_profile(args.profile, config.resources, config.path)
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
    return 0


def cancel(args: argparse.Namespace) -> int:
    sweep_dir = Path(args.sweep_dir).resolve()
    load_jobs(sweep_dir)
    job_ids = [str(s["job_id"]) for s in load_submissions(sweep_dir)]
    if not job_ids:
        raise UsageError(f"{sweep_dir}: nothing was submitted from this sweep directory")
    _slurm(["scancel", *job_ids])
    print(f"cancelled Slurm job(s) {', '.join(job_ids)} of {sweep_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
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
    sub = commands.add_parser("status", help="done/running/pending/failed per run")
    sub.add_argument("sweep_dir", help="a directory made by alma-sweep submit")
    sub.add_argument("--json", action="store_true", help="print one JSON object per run")
    sub.set_defaults(handler=status)
    sub = commands.add_parser("cancel", help="scancel every job of a sweep")
    sub.add_argument("sweep_dir", help="a directory made by alma-sweep submit")
    sub.set_defaults(handler=cancel)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point ``alma-sweep``: one line on stderr and exit status 2 on a bad config,
    flag or sweep directory, or when a Slurm command fails."""
    args = build_parser().parse_args(argv)
    return run_console("alma-sweep", lambda: args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
