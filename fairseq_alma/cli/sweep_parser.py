"""``alma-sweep``'s command line: the parser, and the parsed arguments as typed requests
(``sweeps/``), so nothing below the console entry reads an ``argparse.Namespace``."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..console import OneLineArgumentParser
from ..sweeps.score_plan import SCORES_DIR
from ..sweeps.score_submit import SCORE_OWN_FLAGS, OptionValue, ScoreArrayRequest
from ..sweeps.train_submit import SubmitRequest


def _sweep_dir(text: str) -> str:
    """A sweep directory argument: never empty (``Path("")`` would be the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (it would mean the current directory); "
                                         "give the sweep's directory")
    return text


def score_flags() -> list[tuple[str, dict]]:
    """alma-score's own flag table (imports torch: only ``alma-sweep score`` asks for it)."""
    from ..scoring.flags import SCORE_FLAGS

    return SCORE_FLAGS


def _own_dest(flag: str) -> str:
    return "own_" + flag[2:].replace("-", "_")


def submit_request(args: argparse.Namespace) -> SubmitRequest:
    return SubmitRequest(
        config=args.config, sweep_dir=Path(args.sweep_dir).resolve(), grid=tuple(args.grid or ()),
        seeds=args.seeds, profile=args.profile, max_parallel=args.max_parallel,
        chain_stages=args.chain_stages, stages_per_link=args.stages_per_link,
        program=args.program)


def score_array_request(args: argparse.Namespace) -> ScoreArrayRequest:
    """The request of ``alma-sweep score``, alma-score's flags in alma-score's order (the order
    its refusals come in)."""
    options: list[tuple[str, OptionValue]] = []
    for flag, _ in score_flags():
        dest = _own_dest(flag) if flag in SCORE_OWN_FLAGS else flag[2:].replace("-", "_")
        options.append((flag, getattr(args, dest)))
    return ScoreArrayRequest(sweep_dir=Path(args.sweep_dir).resolve(), profile=args.profile,
                        max_parallel=args.max_parallel, options=tuple(options))


def _add_score_parser(commands: argparse._SubParsersAction, with_score_flags: bool) -> None:
    sub = commands.add_parser(
        "score", help="score every finished run, and every group of seeds as an ensemble, "
        "as one Slurm job array",
        description="Score a sweep as one Slurm job array: one alma-score task per finished run "
        "(--mode single), one per finished run trained with --stage-init scratch (--mode gens, "
        "task RUN.gens) and one per group of runs that differ only by their seed (--mode ens, "
        "when all its runs have finished). Writes SWEEP_DIR/score_jobs.json and "
        "SWEEP_DIR/score.sbatch; each task writes score.json, score.csv, score.txt, scored.json "
        f"and its log score.log to SWEEP_DIR/{SCORES_DIR}/TASK/. Runs not finished training are skipped "
        "with the reason. Running it again submits only the tasks not yet scored, or whose "
        "runs changed since.",
        epilog="alma-report SWEEP_DIR/scores/*/score.json --out DIR draws the tables and "
        "figures. More: slurm/README.md")
    sub.add_argument("sweep_dir", type=_sweep_dir, help="a directory made by alma-sweep submit")
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
            f"{', '.join(SCORE_OWN_FLAGS)} are alma-sweep score's to set, or of no use to its "
            "tasks: refused)")
        for flag, options in score_flags():
            if flag in SCORE_OWN_FLAGS:  # parsed only to be refused with the reason
                keep = {"action": "store_true"} if options.get("action") == "store_true" else {}
                sub.add_argument(flag, dest=_own_dest(flag), help=argparse.SUPPRESS, **keep)
            else:
                group.add_argument(flag, **options)


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
    sub.add_argument("--sweep-dir", required=True, type=_sweep_dir,
                     help="directory for jobs.json, sweep.sbatch, logs/ and one dir per run")
    sub.add_argument("--grid", action="append", metavar="FLAG=V1,V2",
                     help="add or replace a grid dimension (repeatable)")
    sub.add_argument("--seeds", metavar="1,2,3", help="seeds instead of the config's seeds")
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
    _add_score_parser(commands, with_score_flags)
    sub = commands.add_parser("status", help="done/running/pending/failed per run, and scoring")
    sub.add_argument("sweep_dir", type=_sweep_dir, help="a directory made by alma-sweep submit")
    sub.add_argument("--json", action="store_true", help="print the same as JSON: one object "
                     "per run (kind: training), then one per scoring task (kind: scoring)")
    sub = commands.add_parser("cancel", help="scancel every job of a sweep (scoring too)")
    sub.add_argument("sweep_dir", type=_sweep_dir, help="a directory made by alma-sweep submit")
    return parser
