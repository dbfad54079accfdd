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
only does the missing work.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import AlmaError
from ..stream.atomic import atomic_write_json
from ..stream.records import ArrivalRecord
from ..stream.run_view import RunView
from ..stream.series import ReportSeries, series_from_records
from ..report import figures, tables
from .demo import PACKAGE_DIR, tool
from ..console import OneLineArgumentParser, run_console
from ..out_paths import check_dir_path


@dataclass(frozen=True)
class Run:
    """One stream of the demo: waiting time, MLP width and seed."""

    wait: int
    width: int
    seed: int

    @property
    def name(self) -> str:
        return f"sm_mlp{self.width}_w{self.wait}_s{self.seed}"


def train_command(run: Run, args: argparse.Namespace, save_dir: Path) -> list[str]:
    """The ``fairseq-train`` command of one run (App. B.1 values except epochs and B)."""
    return [
        tool("fairseq-train"), "digits", "--user-dir", str(PACKAGE_DIR),
        "--task", "alma_stream", "--vision-dataset", "digits",
        "--arch", "alma_vision",
        "--vision-method", "sm", "--vision-arch", "mlp", "--vision-width", str(run.width),
        "--num-megabatches", str(args.num_megabatches), "--wait", str(run.wait),
        "--epochs-per-stage", str(args.epochs_per_stage), "--batch-size", "128",
        "--vision-threads", "1", "--seed", str(run.seed), "--save-dir", str(save_dir),
        "--cpu", "--num-workers", "0", "--no-epoch-checkpoints", "--log-format", "simple",
    ]


def run_stream(run: Run, args: argparse.Namespace, out: Path) -> list[ArrivalRecord]:
    """Run (or reuse, or continue) one stream; return its records.  Exits on failure."""
    save_dir = out / "runs" / run.name
    done = RunView(save_dir).finished_records(args.num_megabatches)
    if done is not None:
        print(f"   {run.name}: complete, reused", flush=True)
        return done
    cmd = train_command(run, args, save_dir)
    log = out / "logs" / f"{run.name}.log"
    print(f"   {run.name}: $ {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    started = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with open(log, "w", encoding="utf-8") as handle:
        proc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, check=False)
    records = RunView(save_dir).finished_records(args.num_megabatches)
    if proc.returncode != 0 or records is None:
        text = log.read_text(encoding="utf-8", errors="replace")
        tail = "\n".join(text.splitlines()[-10:])
        raise AlmaError(f"{run.name} failed (exit {proc.returncode}, stream.jsonl incomplete); "
                        f"log: {log}\n{tail}")
    print(f"   {run.name}: done in {time.time() - started:.0f}s", flush=True)
    return records


def _mean_lists(lists: list[list[float]]) -> list[float]:
    return [statistics.mean(column) for column in zip(*lists, strict=True)]


def mean_series(wait: int, width: int, per_seed: list[ReportSeries]) -> ReportSeries:
    """One series per (w, width): per-arrival errors, FLOPs and |θ| averaged over the seeds
    (CER is linear in the errors, so the mean series' CER is the mean of the seeds' CERs)."""
    return ReportSeries(
        setting=f"SM_w{wait}",
        num_experts=f"h{width}",
        metric_by_arrival=_mean_lists([s.metric_by_arrival for s in per_seed]),
        train_flops_cum=_mean_lists([s.train_flops_cum for s in per_seed]),
        params_by_arrival=[round(p) for p in _mean_lists([s.params_by_arrival for s in per_seed])],
        trained=per_seed[0].trained,
        metric="error",
    )


def verdict(cers: dict[int, list[float]], num_megabatches: int) -> str:
    """Does an intermediate w have a lower mean CER than both w = 1 and w = B (§6.1)?"""
    mean = {w: statistics.mean(v) for w, v in cers.items()}
    middle = [w for w in mean if 1 < w < num_megabatches]
    if 1 not in mean or num_megabatches not in mean or not middle:
        return f"not tested (needs --waits with 1, {num_megabatches} and one in between)"
    best = min(middle, key=mean.get)
    holds = mean[best] < mean[1] and mean[best] < mean[num_megabatches]
    return (f"{'HOLDS' if holds else 'does NOT hold'}: best intermediate w={best} CER "
            f"{mean[best]:.3f} vs w=1 {mean[1]:.3f} and w={num_megabatches} "
            f"{mean[num_megabatches]:.3f}")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="alma-vision-demo", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--out", default="vision_demo_out", help="directory for runs, logs, table and plots")
    add("--num-megabatches", type=int, default=50,
        help="B (default 50: about 26 training examples per mega-batch; paper: 500 on MNIST)")
    add("--waits", type=int, nargs="+", default=[1, 2, 5, 50],
        help="waiting times w, each in [1, B] (default: 1 2 5 50)")
    add("--widths", type=int, nargs="+", default=[4, 8], help="MLP hidden widths (default: 4 8)")
    add("--seeds", type=int, nargs="+", default=[1, 2], help="seeds per setting (default: 1 2)")
    add("--epochs-per-stage", type=int, default=50, help="epochs per stage (default 50; paper 100)")
    add("--jobs", type=int, default=2, help="fairseq-train processes at a time (default 2)")
    return parser


def check_args(args: argparse.Namespace) -> str | None:
    if args.num_megabatches < 1:
        return f"--num-megabatches must be >= 1, got {args.num_megabatches}"
    if not all(1 <= w <= args.num_megabatches for w in args.waits):
        return f"--waits must all be in [1, {args.num_megabatches}] (B), got {args.waits}"
    if min(args.widths) < 1 or args.epochs_per_stage < 1 or args.jobs < 1 or min(args.seeds) < 0:
        return "--widths, --epochs-per-stage and --jobs must be >= 1 and --seeds >= 0"
    try:
        check_dir_path(args.out, "--out")
    except AlmaError as err:
        return str(err)
    return None


def write_report(args: argparse.Namespace, out: Path, results: dict[Run, list]) -> None:
    """CER table, per-seed CERs, the §6.1 verdict, plots and summary.json."""
    waits, widths, seeds = (sorted(set(values)) for values in (args.waits, args.widths, args.seeds))
    series, cers, finding = [], {}, {}
    for h in widths:
        cers[h] = {}
        for w in waits:
            per_seed = [series_from_records(f"SM_w{w}", f"h{h}", results[Run(w, h, s)])
                        for s in seeds]
            cers[h][w] = [s.summary()["cer"] for s in per_seed]
            series.append(mean_series(w, h, per_seed))
    print(f"\n== CER table (errors averaged over seeds {seeds}; CER sums the test error after "
          f"each of the B + 1 = {args.num_megabatches + 1} arrivals, Eq. 1)\n")
    print(tables.format_table(series))
    print("CER per seed:")
    for h in widths:
        for w in waits:
            spread = statistics.stdev(cers[h][w]) if len(seeds) > 1 else 0.0
            values = " ".join(f"{c:7.3f}" for c in cers[h][w])
            print(f"  h{h:<3} w={w:<3} {values}   (± {spread:.3f})")
    print("\n== paper §6.1: an intermediate waiting time beats w=1 and w=B for small models")
    for h in widths:
        finding[f"h{h}"] = verdict(cers[h], args.num_megabatches)
        print(f"  h{h}: {finding[f'h{h}']}")
    plots = []
    for h in widths:
        plots.append(out / f"error_curves_h{h}.png")
        figures.plot_error_curves([s for s in series if s.num_experts == f"h{h}"], plots[-1])
    plots.append(out / "cer_tradeoffs.png")
    figures.plot_cer_tradeoffs(series, plots[-1])
    tables.write_json(series, out / "report.json")
    atomic_write_json(out / "summary.json", {
        "num_megabatches": args.num_megabatches, "epochs_per_stage": args.epochs_per_stage,
        "seeds": seeds, "finding": finding,
        "cer": {f"h{h}": {str(w): cers[h][w] for w in waits} for h in widths},
    })
    print(f"\nplots: {', '.join(str(p) for p in plots)}\nsummary: {out / 'summary.json'}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.getLogger().setLevel(logging.WARNING)  # importing fairseq set the root logger to DEBUG
    problem = check_args(args)
    if problem:
        parser.error(problem)
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    runs = [Run(w, h, s) for h in sorted(set(args.widths)) for w in sorted(set(args.waits))
            for s in sorted(set(args.seeds))]
    print(f"== {len(runs)} streams on the embedded digits (B={args.num_megabatches}, "
          f"{args.epochs_per_stage} epochs per stage), {args.jobs} at a time", flush=True)
    started = time.time()

    def demo() -> None:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = dict(zip(runs, pool.map(lambda r: run_stream(r, args, out), runs), strict=True))
        write_report(args, out, results)
        print(f"total {time.time() - started:.0f}s")

    return run_console("alma-vision-demo", demo)


if __name__ == "__main__":
    sys.exit(main())
