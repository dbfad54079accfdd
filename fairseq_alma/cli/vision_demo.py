"""``alma-vision-demo``: vision ALMA streams on the embedded digits, through ``fairseq-train``.

Paper §6.1 (Fig. 3, App. C.1): without replay, "an intermediate waiting time is best only for
small models" on MNIST - its cumulative error rate (CER, Eq. 1) is lower than both the greedy
learner (w = 1) and the tardy one (w = B).  This demo re-runs that comparison on scikit-learn's
bundled 8x8 digits (nothing is downloaded): a small MLP (SM) for several waiting times, each run a
real ``fairseq-train --task alma_stream --vision-dataset digits`` command (printed before it
runs), several seeds each.  It then prints the CER table (errors averaged over seeds), says
whether the paper's finding holds here, and writes Fig. 3 (error over the stream, one plot per
width) and Fig. 2 (CER vs compute and memory) as PNGs.

A run whose ``stream.jsonl`` holds all B + 1 arrivals is reused; an interrupted one is continued
by the same command (fairseq resumes from its ``checkpoint_last.pt``), so re-running the demo
only does the missing work.  Either only when the run was made with these settings: an --out
holding runs made with others (another --epochs-per-stage or --num-megabatches) is refused
before anything trains; use another --out.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..console import OneLineArgumentParser, run_console
from ..demos.vision_waiting import VisionDemoSettings, run_vision_demo
from ..errors import AlmaError
from ..out_paths import check_dir_path
from ..stream.progress import AUTO, parse_wait


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="alma-vision-demo", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--out", default="vision_demo_out", help="directory for runs, logs, table and plots")
    add("--num-megabatches", type=int, default=50,
        help="B (default 50: about 26 training examples per mega-batch; paper: 500 on MNIST)")
    add("--waits", type=parse_wait, nargs="+", default=[1, 2, 5, 50, AUTO],
        help="waiting times w, each in [1, B], and auto: train or wait decided at each arrival "
             "(default: 1 2 5 50 auto)")
    add("--widths", type=int, nargs="+", default=[4, 8], help="MLP hidden widths (default: 4 8)")
    add("--seeds", type=int, nargs="+", default=[1, 2], help="seeds per setting (default: 1 2)")
    add("--epochs-per-stage", type=int, default=50, help="epochs per stage (default 50; paper 100)")
    add("--jobs", type=int, default=2, help="fairseq-train processes at a time (default 2)")
    return parser


def check_args(args: argparse.Namespace) -> str | None:
    if args.num_megabatches < 1:
        return f"--num-megabatches must be >= 1, got {args.num_megabatches}"
    if not all(w == AUTO or 1 <= w <= args.num_megabatches for w in args.waits):
        return f"--waits must all be in [1, {args.num_megabatches}] (B), got {args.waits}"
    for flag, values in (("--widths", args.widths), ("--epochs-per-stage", [args.epochs_per_stage]),
                         ("--jobs", [args.jobs])):
        if min(values) < 1:
            return f"{flag} must be >= 1, got {min(values)}"
    if min(args.seeds) < 0:
        return f"--seeds must be >= 0, got {min(args.seeds)}"
    for flag, values in (("waits", args.waits), ("widths", args.widths), ("seeds", args.seeds)):
        if len(set(values)) != len(values):  # as alma-vision-sweep and alma-sweep: never dropped
            return f"--{flag} {values} repeat a value; list each {flag[:-1]} once"
    try:
        check_dir_path(args.out, "--out")
    except AlmaError as err:
        return str(err)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.getLogger().setLevel(logging.WARNING)  # importing fairseq set the root logger to DEBUG
    problem = check_args(args)
    if problem:
        parser.error(problem)
    settings = VisionDemoSettings(
        out=Path(args.out), num_megabatches=args.num_megabatches, waits=tuple(args.waits),
        widths=tuple(args.widths), seeds=tuple(args.seeds), epochs_per_stage=args.epochs_per_stage,
        jobs=args.jobs)
    return run_console("alma-vision-demo", lambda: run_vision_demo(settings))


if __name__ == "__main__":
    sys.exit(main())
