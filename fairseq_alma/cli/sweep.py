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
runs that differ only by their seed as an ensemble, as one more array (sweeps/score_plan.py,
sweeps/score_script.py); its records are DIR/score_jobs.json and DIR/score.sbatch. See
slurm/README.md for the trainer contract.

This file parses (``sweep_parser.py``), calls the planning in ``fairseq_alma/sweeps/`` and
prints what it returns (``sweeps/sweep_text.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..console import run_console
from ..sweeps import score_submit, sweep_status, sweep_text, train_submit
from ..sweeps.held_runs import holds_trained_run
from ..sweeps.run_config import check_config_flags
from .sweep_parser import build_parser, score_array_request, submit_request


def _register_with_fairseq() -> None:
    """submit and score check flags with fairseq's parsers and the plugin's rules; alma-sweep
    starts without fairseq (fairseq_alma.FAIRSEQ_FREE_TOOLS: status and cancel never need it)."""
    import fairseq_alma

    fairseq_alma.register()


def submit(args: argparse.Namespace) -> int:
    request = submit_request(args)
    config = train_submit.load_sweep_config(request)
    profile = train_submit.sweep_profile(request, config)
    points = len(config.grid_points())
    print(f"alma-sweep: checking {points} grid point(s) of {config.path} against fairseq-train's "
          "flags and the values its runs check before training (imports fairseq: seconds, then "
          "fairseq's config of each point: under a second each)",
          file=sys.stderr, flush=True)
    _register_with_fairseq()
    stages = check_config_flags(config, profile)
    train_submit.check_chain_length(request, stages)
    plan = train_submit.plan_submission(request, config, profile)
    print(sweep_text.submission_plan(plan), end="")
    if args.dry_run:
        print(sweep_text.submission_dry_run(plan), end="")
        missing = train_submit.missing_data(plan)
        if missing is not None:  # its grid looked fine, and submit would refuse it
            print(f"alma-sweep: note: data directory {missing} not found here, so the checks that "
                  "read the stream (each run's --wait within its B, ...) were not made; submit "
                  "refuses until it exists", file=sys.stderr, flush=True)
        return 0
    trained = sum(holds_trained_run(job.run_dir) for job in plan.jobs)
    if trained:
        print(f"alma-sweep: checking the {trained} run director(ies) that hold a trained run "
              "against the run each job would train (run.json's fingerprint, as fairseq-train "
              "checks its --save-dir: about a second each)", file=sys.stderr, flush=True)
    todo = train_submit.runs_to_submit(plan)
    if not todo:
        print(f"all {len(plan.jobs)} run(s) in {plan.sweep_dir} are done; nothing to submit")
        return 0
    for done in train_submit.submit_links(plan, todo):
        print(sweep_text.submitted_line(done), end="")
    return 0


def status(args: argparse.Namespace) -> int:
    sweep_dir = Path(args.sweep_dir).resolve()
    training = sweep_status.training_status(sweep_dir)
    if not args.json:
        print(sweep_text.training_status_table(training), end="", flush=True)
    scoring = sweep_status.scoring_status(sweep_dir)
    if args.json:  # the same rows as the tables: every run, then every scoring task
        rows = [{"kind": "training", **run.to_json()} for run in training.runs]
        rows += [task.to_json() for task in scoring or []]
        print(json.dumps(rows, indent=1))
    elif scoring is not None:
        print(sweep_text.scoring_status_table(sweep_dir, scoring), end="")
    return 0


def cancel(args: argparse.Namespace) -> int:
    sweep_dir = Path(args.sweep_dir).resolve()
    cancelled = sweep_status.cancel_sweep(sweep_dir)
    if not cancelled.job_ids:
        print(f"nothing to cancel: no job of {sweep_dir} is queued or running (its job(s) "
              f"{', '.join(cancelled.submitted)} have all left the queue)")
    elif cancelled.queue_unreachable:
        print(f"asked Slurm to cancel job(s) {', '.join(cancelled.job_ids)} of {sweep_dir} "
              "(squeue did not answer: those that had already ended were not running)")
    else:
        print(f"cancelled Slurm job(s) {', '.join(cancelled.job_ids)} of {sweep_dir}")
    return 0


def _check_score_options(options: list[str]) -> None:
    """alma-score's own rules on the options every task gets (they belong to alma-score)."""
    from .score import build_parser as score_parser
    from .score import request_from_args

    request_from_args(score_parser().parse_intermixed_args(["RUN_DIR", *options]))


def score(args: argparse.Namespace) -> int:
    _register_with_fairseq()
    setup = score_submit.prepare_scoring(score_array_request(args))
    _check_score_options(setup.options)
    plan = score_submit.plan_score_array(setup)
    print(sweep_text.score_plan_table(plan), end="")
    score_submit.require_tasks(plan)
    if not plan.todo:
        print(sweep_text.nothing_to_score(plan), end="")
        return 0
    array = score_submit.render_score_array(plan)
    if args.dry_run:
        print(sweep_text.score_dry_run(plan, array), end="")
        return 0
    job_id, spec = score_submit.submit_score_array(plan, array)
    print(sweep_text.score_submitted_line(setup.sweep_dir, job_id, spec), end="")
    return 0


HANDLERS = {"submit": submit, "score": score, "status": status, "cancel": cancel}


def main(argv: list[str] | None = None) -> int:
    """Console entry point ``alma-sweep``: one line on stderr and exit status 2 on a bad config,
    flag or sweep directory, or when a Slurm command fails."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(with_score_flags=argv[:1] == ["score"]).parse_args(argv)
    return run_console("alma-sweep", lambda: HANDLERS[args.command](args))


if __name__ == "__main__":
    sys.exit(main())
