"""``alma-demo`` (``make demo``): the main job end to end on the embedded default data.

Steps, each a real command a user could type (printed before it runs), each skipped or resumed
when its outputs already exist, so re-running after an interruption continues:
  1. ``alma-demo-corpus``: a few MB of real English prose from the Python standard library;
  2. ``alma-data-prep``: sentencepiece BPE, seeded split into 4 mega-batches + eval + valid,
     fairseq binaries and manifest.json;
  3. ``fairseq-train --task alma_stream`` with a tiny Switch LM (4 experts), once per setting of
     Table 2: SM w=1, a second seed (for Ens of 2), SM w=4 with 4x steps, SM with --wait auto
     (SM_wauto, beyond the paper: train or wait decided at each arrival), gEns (scratch init per
     stage) and gMoE (experts grown 4 -> 6 -> 8 -> 12 by copying the highest-loss experts);
  4. ``alma-score`` per setting (single / ens / gens), then one Table-2 style table with both
     stream averages (the paper's over trained arrivals, and the anytime one over all arrivals),
     CSV/JSON and the Fig. 5 plot (average perplexity vs cumulative compute and vs parameters).

Re-running into the same --out reuses what is finished, but only with the flags it was made
with: OUT/demo_flags.json records --corpus-mb, --vocab-size and --updates-per-stage, and other
values are refused before step 1, with nothing in OUT changed (they would rebuild the corpus
and stream under the finished runs): use another --out for them.  Each step's log under
OUT/logs keeps every attempt.

``alma-demo --drift`` runs the drifting-stream variant instead (demos/drift.py): the same
corpus cut in module order, trained without replay, with 25% replay and with full replay, each
scored on every period, and a plain-words verdict on which forgets least per unit of compute.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

from ..console import OneLineArgumentParser, run_console
from ..demos.demo_flags import DemoFlagsRecord
from ..demos.drift import run_drift_demo
from ..demos.lm_stream import LmDemoSettings
from ..demos.table2 import run_table2_demo
from ..errors import AlmaError
from ..out_paths import check_dir_path


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="alma-demo", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--out", default="demo_out", help="working directory for every output (default: demo_out)")
    add("--corpus-mb", type=float, default=3.0, help="size of the demo corpus in MB (default 3)")
    add("--vocab-size", type=int, default=2000, help="BPE vocabulary of the demo (paper: 50000)")
    add("--updates-per-stage", type=int, default=100, help="updates per stage U (paper: 120000)")
    add("--workers", type=int, default=2, help="worker processes for data preparation")
    add("--drift", action="store_true",
        help="the drifting-stream demo instead (corpus in module order, no replay vs "
             "--replay-ratio 0.25 vs --replay, every stage scored on every period); "
             "its outputs go to OUT/drift/")
    return parser


def settings_of(args: argparse.Namespace) -> LmDemoSettings:
    return LmDemoSettings(out=Path(args.out), corpus_mb=args.corpus_mb, vocab_size=args.vocab_size,
                          updates_per_stage=args.updates_per_stage, workers=args.workers)


def demo_problem(args: argparse.Namespace) -> str | None:
    """The first flag of the demo that cannot work, as one line (None: all can); checked
    before anything is built, not when the step that uses it fails minutes later.  That
    includes an --out holding a demo made with other flags (``demos/demo_flags.py``): its
    steps would rebuild the corpus and stream under its finished runs."""
    if args.updates_per_stage < 20:
        return f"--updates-per-stage must be >= 20 (got {args.updates_per_stage})"
    if not (math.isfinite(args.corpus_mb) and args.corpus_mb > 0):
        return f"--corpus-mb must be a finite number > 0 (got {args.corpus_mb:g}); the default is 3"
    for flag in ("vocab_size", "workers"):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} must be >= 1 (got {getattr(args, flag)})"
    try:
        check_dir_path(args.out, "--out")
        return DemoFlagsRecord(Path(args.out), "drift" if args.drift else "main").problem(
            settings_of(args).flag_values())
    except AlmaError as err:
        return str(err)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = demo_problem(args)
    if problem:
        parser.error(problem)
    settings = settings_of(args)
    logging.getLogger().setLevel(logging.WARNING)  # the demo prints its own steps; no INFO lines
    demo = run_drift_demo if args.drift else run_table2_demo
    return run_console("alma-demo", lambda: demo(settings))


if __name__ == "__main__":
    sys.exit(main())
