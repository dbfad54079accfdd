"""``alma-demo`` (``make demo``): the main job end to end on the embedded default data.

Steps, each a real command a user could type (printed before it runs), each skipped or resumed
when its outputs already exist, so re-running after an interruption continues:
  1. ``alma-demo-corpus``: a few MB of real English prose from the Python standard library;
  2. ``alma-data-prep``: sentencepiece BPE, seeded split into 4 mega-batches + eval + valid,
     fairseq binaries and manifest.json;
  3. ``fairseq-train --task alma_stream`` with a tiny Switch LM (4 experts), once per setting of
     Table 2: SM w=1, a second seed (for Ens of 2), SM w=4 with 4x steps, gEns (scratch init per
     stage) and gMoE (experts grown 4 -> 6 -> 8 -> 12 by copying the highest-loss experts);
  4. ``alma-score`` per setting (single / ens / gens), then one Table-2 style table with both
     stream averages (the paper's over trained arrivals, and the anytime one over all arrivals),
     CSV/JSON and the Fig. 5 plot (average perplexity vs cumulative compute and vs parameters).

``alma-demo --drift`` runs the drifting-stream variant instead (cli/drift_demo.py): the same
corpus cut in module order, trained without replay, with 25% replay and with full replay, each
scored on every period, and a plain-words verdict on which forgets least per unit of compute.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from ..errors import AlmaError
from ..console import OneLineArgumentParser, run_console
from ..out_paths import check_dir_path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the --user-dir


def tool(name: str) -> str:
    """Console script next to the running interpreter (the venv's), else from PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def step(title: str, cmd: list[str], log: Path) -> str:
    """Run one command, echoing it; output goes to ``log`` and is returned.  Exits on failure."""
    print(f"\n== {title}\n$ {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    start = time.time()
    # One intra-op thread unless the user says otherwise: the demo's models are tiny, and on a
    # busy machine OpenMP threads spin-waiting for each other slow them down many times over.
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **os.environ}
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True, env=env)
    text = log.read_text(encoding="utf-8", errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(text.splitlines()[-15:])
        raise AlmaError(f"step '{title}' failed (exit {proc.returncode}); log: {log}\n{tail}")
    print(f"   done in {time.time() - start:.0f}s (log: {log})", flush=True)
    return text


COMMON_TRAIN = [
    "--task", "alma_stream", "--arch", "switch_transformer_lm_tiny", "--criterion", "switch_cross_entropy",
    "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "0.003", "--lr-scheduler", "alma_stage_linear",
    "--tokens-per-sample", "128", "--batch-size", "8", "--dropout", "0.1", "--cpu", "--num-workers", "0",
    "--log-format", "simple", "--log-interval", "50", "--save-interval-updates", "50", "--no-epoch-checkpoints",
]

# (name, extra flags, alma-score mode, run dirs for scoring) — Table 2's rows at demo scale
RUNS = [
    ("SM_w1", ["--moe-experts", "4", "--seed", "1"]),
    ("SM_w1_seed2", ["--moe-experts", "4", "--seed", "2"]),
    ("SM_w4_4x", ["--moe-experts", "4", "--wait", "4", "--scale-updates-by-wait", "--seed", "1"]),
    ("gEns_w1", ["--moe-experts", "4", "--stage-init", "scratch", "--seed", "3"]),
    ("gMoE_w1", ["--moe-experts", "4", "--moe-max-experts", "12", "--grow-experts", "2,2,4", "--seed", "1"]),
]
SCORES = [
    ("SM_w1", "single", ["SM_w1"]),
    ("SM_w4 (4x steps)", "single", ["SM_w4_4x"]),
    ("Ens_w1", "ens", ["SM_w1", "SM_w1_seed2"]),
    ("gEns_w1", "gens", ["gEns_w1"]),
    ("gMoE_w1", "single", ["gMoE_w1"]),
]


def prepare_stream(args: argparse.Namespace, corpus: Path, data: Path, logs: Path, total: int,
                   what: str, prep_flags: tuple[str, ...] = ()) -> None:
    """Steps 1 and 2 of both demos: the embedded corpus, then ``alma-data-prep`` into ``data``
    (4 mega-batches, 4% evaluation, 2% validation; ``prep_flags`` add to that)."""
    step(f"1/{total} build the demo corpus (Python stdlib prose, module by module)",
         [tool("alma-demo-corpus"), "--out", str(corpus), "--max-mb", str(args.corpus_mb)], logs / "corpus.log")
    step(f"2/{total} prepare {what}",
         [tool("alma-data-prep"), str(corpus), "--out", str(data), "--vocab-size", str(args.vocab_size),
          "--num-megabatches", "4", "--eval-size", "0.04", "--valid-size", "0.02", "--workers", str(args.workers),
          *prep_flags],
         logs / "data_prep.log")


def train_settings(args: argparse.Namespace, data: Path, runs: Path, logs: Path,
                   settings: list[tuple[str, list[str]]], first: int, total: int) -> None:
    """One ``fairseq-train --task alma_stream`` over the whole stream per (name, flags)."""
    warmup = str(max(1, args.updates_per_stage // 10))
    for i, (name, flags) in enumerate(settings, start=first):
        step(f"{i}/{total} train {name}: the whole stream in one fairseq-train",
             [tool("fairseq-train"), str(data), "--user-dir", str(PACKAGE_DIR), *COMMON_TRAIN,
              "--updates-per-stage", str(args.updates_per_stage), "--warmup-updates", warmup,
              "--save-dir", str(runs / name), *flags],
             logs / f"train_{name}.log")


def demo_problem(args: argparse.Namespace) -> str | None:
    """The first flag of the demo that cannot work, as one line (None: all can); checked
    before anything is built, not when the step that uses it fails minutes later."""
    if args.updates_per_stage < 20:
        return f"--updates-per-stage must be >= 20 (got {args.updates_per_stage})"
    if not args.corpus_mb > 0:
        return f"--corpus-mb must be > 0 (got {args.corpus_mb:g}); the default is 3"
    for flag in ("vocab_size", "workers"):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} must be >= 1 (got {getattr(args, flag)})"
    try:
        check_dir_path(args.out, "--out")
    except AlmaError as err:
        return str(err)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="alma-demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="demo_out", help="working directory for every output (default: demo_out)")
    parser.add_argument("--corpus-mb", type=float, default=3.0, help="size of the demo corpus in MB (default 3)")
    parser.add_argument("--vocab-size", type=int, default=2000, help="BPE vocabulary of the demo (paper: 50000)")
    parser.add_argument("--updates-per-stage", type=int, default=100, help="updates per stage U (paper: 120000)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes for data preparation")
    parser.add_argument("--drift", action="store_true",
                        help="the drifting-stream demo instead (corpus in module order, no replay vs "
                             "--replay-ratio 0.25 vs --replay, every stage scored on every period); "
                             "its outputs go to OUT/drift/")
    args = parser.parse_args(argv)
    problem = demo_problem(args)
    if problem:
        parser.error(problem)

    logging.getLogger().setLevel(logging.WARNING)  # importing fairseq set the root logger to DEBUG
    if args.drift:
        from .drift_demo import run_drift_demo

        return run_console("alma-demo", lambda: run_drift_demo(args))
    return run_console("alma-demo", lambda: run_demo(args))


def run_demo(args: argparse.Namespace) -> int:
    """The demo's steps (module doc); a failed step raises with its log's tail."""
    out = Path(args.out).resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus" / "demo_corpus.txt"
    corpus.parent.mkdir(parents=True, exist_ok=True)
    data = out / "data"
    runs = out / "runs"
    reports = out / "report"
    reports.mkdir(parents=True, exist_ok=True)
    total = 2 + len(RUNS) + len(SCORES) + 1

    prepare_stream(args, corpus, data, logs, total, "a 4-mega-batch stream (BPE, seeded split, binarize, manifest)")
    train_settings(args, data, runs, logs, RUNS, 3, total)
    jsons = []
    for i, (setting, mode, dirs) in enumerate(SCORES, start=3 + len(RUNS)):
        target = reports / f"{setting.split()[0]}.json"
        step(f"{i}/{total} score {setting} ({mode})",
             [tool("alma-score"), *[str(runs / d) for d in dirs], "--mode", mode, "--setting", setting,
              "--tokens-per-sample", "128", "--batch-size", "16", "--cpu", "--json", str(target)],
             logs / f"score_{setting.split()[0]}.log")
        jsons.append(target)

    from ..report.figures import plot_tradeoffs
    from ..report.tables import format_table, load_report_json, write_csv, write_json

    series = [s for path in jsons for s in load_report_json(path)]
    write_json(series, reports / "table2.json")
    write_csv(series, reports / "table2.csv")
    plot_tradeoffs(series, reports / "fig5_tradeoffs.png")
    print(f"\n== {total}/{total} Table 2 at demo scale (perplexity on the evaluation mega-batch)\n")
    print(format_table(series))
    print("avg ppl (trained): the paper's Table 2 average, over the arrivals after the first training.\n"
          "anytime ppl: 2 ** (mean cross-entropy in bits over every arrival 1..B), the arrivals before\n"
          "the first training charged with the initialised model, so waiting is not free (README).")
    print(f"\nreport: {reports / 'table2.json'}, {reports / 'table2.csv'}, plot: {reports / 'fig5_tradeoffs.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
