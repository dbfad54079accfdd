"""``--wait auto`` against every fixed waiting time, under a protocol fixed before the runs.

Protocol (written before any run; the defaults are the vision demo's, not tuned for this):

* Streams: the embedded 8x8 digits (always; B = 50, about 26 training examples per mega-batch,
  the ``alma-vision-demo`` default), MNIST (``--mnist DIR``, B = 500 as in the paper) and
  CIFAR-10 (``--cifar10 DIR``, B = 100) when their files are given; and an LM stream (the
  demo corpus, B = 8: ``adaptive_wait_lm.py`` gives its protocol; ``--no-lm`` skips it).
* Learners: the single model (SM) of two sizes per stream: MLP widths 8 and 64 (digits,
  MNIST), VGG widths 4 and 16 (CIFAR-10); the paper's optimizers; 50 epochs per stage (digits)
  or the paper's 100 (MNIST, CIFAR-10); no replay (``--replay`` runs the replay variant).
* Waiting times: w in {1, 2, 4, 8, ...} up to B, plus w = B, and ``auto``; seeds 1, 2, 3.
* Reported per stream and size: anytime CER (Eq. 1: the sum of the test errors after each of
  the B + 1 arrivals; LM: the anytime NLL in bits per token), final error, compute (training
  FLOPs spent, Comp) and |θ| (final parameters; Mem = their sum over arrivals), mean ± std
  over the seeds.
* Verdict: ``auto`` meets the target when its mean CER is at most the best fixed w's mean CER
  plus the larger of the two seed spreads, at no more mean compute than that w (1% tolerance:
  FLOPs differ by the last mega-batches a schedule leaves untrained).
* Figure: CER against compute per stream and size, each fixed w a labelled point, ``auto`` a
  star.

Runs go through the vision sweep's in-process path (``vision/sweep_runs.py``, the code
``fairseq-train --arch alma_vision`` runs), one thread each; finished runs in ``--out`` are
reused, so an interrupted benchmark continues.  About 1 minute for digits and 10 for the LM
stream on 2 CPU cores.

The committed results (``benchmarks/results/adaptive_wait``, shown in the README) are this
protocol's, and the default ``--out`` is written only by it: ``--quick`` (the test suite's
mode) writes to a fresh scratch directory unless ``--out`` says where, and a run with any other
protocol flag (``--seeds``, ``--replay``, ``--no-lm``, ``--mnist``, ``--cifar10``) needs an
``--out`` of its own; both are refused there, before any run.

Usage: python benchmarks/adaptive_wait.py [--out DIR] [--mnist DIR] [--cifar10 DIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from adaptive_wait_lm import lm_stream_problem, run_lm

from fairseq_alma.cli.vision_sweep import build_parser as sweep_parser
from fairseq_alma.console import OneLineArgumentParser
from fairseq_alma.stream.progress import AUTO, wait_order
from fairseq_alma.stream.run_view import RunView
from fairseq_alma.text_table import format_table
from fairseq_alma.vision.sweep_runs import RunSummary, run_sweep

REPO = Path(__file__).resolve().parent.parent
COMMITTED = REPO / "benchmarks" / "results" / "adaptive_wait"  # the README's results
PROTOCOL_SEEDS = [1, 2, 3]


@dataclass(frozen=True)
class Stream:
    name: str
    dataset: str
    data_path: str | None
    arch: str
    widths: tuple[int, ...]
    num_megabatches: int
    epochs: int


def power_of_two_waits(num_megabatches: int) -> list[int]:
    waits, wait = [], 1
    while wait < num_megabatches:
        waits.append(wait)
        wait *= 2
    return waits + [num_megabatches]


def streams(args: argparse.Namespace) -> list[Stream]:
    if args.quick:  # the test suite's: the code paths, not the numbers
        return [Stream("digits", "digits", None, "mlp", (4,), 4, 2)]
    found = [Stream("digits", "digits", None, "mlp", (8, 64), 50, 50)]
    if args.mnist:
        found.append(Stream("mnist", "mnist", args.mnist, "mlp", (8, 64), 500, 100))
    if args.cifar10:
        found.append(Stream("cifar10", "cifar10", args.cifar10, "vgg", (4, 16), 100, 100))
    return found


def run_stream(stream: Stream, args: argparse.Namespace) -> list[RunSummary]:
    waits = [str(w) for w in power_of_two_waits(stream.num_megabatches)] + [AUTO]
    argv = ["--out", str(Path(args.out) / stream.name), "--dataset", stream.dataset,
            "--arch", stream.arch, "--widths", *map(str, stream.widths), "--waits", *waits,
            "--seeds", *map(str, args.seeds), "--num-megabatches", str(stream.num_megabatches),
            "--epochs-per-stage", str(stream.epochs), "--threads", "1", "--quiet"]
    if stream.data_path:
        argv += ["--data-path", stream.data_path]
    if args.replay:
        argv.append("--replay")
    print(f"== {stream.name}: B={stream.num_megabatches}, {stream.epochs} epochs per stage, "
          f"{stream.arch} widths {list(stream.widths)}, w in {waits}, seeds {args.seeds}",
          flush=True)
    return run_sweep(sweep_parser().parse_args(argv))


def final_params(out: Path, run: RunSummary) -> int:
    replay = "_replay" if run.replay else ""
    name = f"{run.method}_{run.arch}{run.width}_w{run.wait}{replay}_s{run.seed}"
    return RunView(out / name).records[-1].params_active


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def vision_rows(stream: Stream, runs: list[RunSummary], out: Path) -> dict[str, dict]:
    """Per size, one row per w: means over the seeds."""
    table = {}
    for width in stream.widths:
        rows = {}
        for wait in sorted({r.wait for r in runs}, key=wait_order):
            group = [r for r in runs if r.width == width and r.wait == wait]
            cer, cer_std = mean_std([r.cer for r in group])
            rows[str(wait)] = {
                "cer": cer, "cer_std": cer_std,
                "final_error": statistics.mean(r.final_error for r in group),
                "compute": statistics.mean(r.comp for r in group),
                "mem": statistics.mean(r.mem for r in group),
                "params": statistics.mean(final_params(out, r) for r in group),
                "seeds": len(group)}
        table[f"{stream.arch}{width}"] = rows
    return table


def judge(rows: dict[str, dict], metric: str) -> dict:
    """The protocol's verdict on one stream and size (module doc)."""
    fixed = {w: row for w, row in rows.items() if w != AUTO}
    best = min(fixed, key=lambda w: fixed[w]["cer"])
    auto = rows[AUTO]
    slack = max(auto["cer_std"], fixed[best]["cer_std"])
    quality = auto["cer"] <= fixed[best]["cer"] + slack
    compute = auto["compute"] <= fixed[best]["compute"] * 1.01
    return {"rows": rows, "metric": metric, "best_fixed": best,
            "auto_meets_target": quality and compute,
            "verdict": (f"auto {metric} {auto['cer']:.3f} ± {auto['cer_std']:.3f} vs best fixed "
                        f"w={best} {fixed[best]['cer']:.3f} ± {fixed[best]['cer_std']:.3f}: "
                        f"{'within' if quality else 'ABOVE'} the seed spread, compute "
                        f"{auto['compute'] / fixed[best]['compute']:.2f}x that w's "
                        f"-> {'MEETS' if quality and compute else 'MISSES'} the target")}


def print_tables(name: str, result: dict) -> None:
    for size, entry in result.items():
        final = "final err" if entry["metric"] == "CER" else "final bits"
        header = ["w", entry["metric"], "±", final, "Comp (FLOPs)", "|θ| final", "Mem"]
        rows = [[w, f"{r['cer']:.3f}", f"{r['cer_std']:.3f}", f"{r['final_error']:.3f}",
                 f"{r['compute']:.3g}", f"{r['params']:.0f}", f"{r['mem']:.3g}"]
                for w, r in entry["rows"].items()]
        print(f"\n{name}, {size} (mean over seeds)\n{format_table(header, rows, left=1)}")
        print(f"  {entry['verdict']}")


def plot(results: dict, path: Path) -> None:
    """CER against compute: a point per fixed w, a star for auto; a panel per stream and size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(stream, size, entry) for stream, sizes in results.items()
              for size, entry in sizes.items()]
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for axis, (stream, size, entry) in zip(axes[0], panels):
        for wait, row in entry["rows"].items():
            star = wait == AUTO
            axis.errorbar(row["compute"], row["cer"], yerr=row["cer_std"],
                          marker="*" if star else "o", markersize=16 if star else 6,
                          color="tab:red" if star else "tab:blue", capsize=3, linestyle="none")
            axis.annotate("auto" if star else f"w={wait}", (row["compute"], row["cer"]),
                          fontsize=8, color="tab:red" if star else "black",
                          textcoords="offset points", xytext=(-12, -16) if star else (5, 5))
        ylabel = ("anytime CER (sum of errors, Eq. 1)" if entry["metric"] == "CER"
                  else "anytime NLL (bits per token)")
        axis.set(title=f"{stream} {size}", xlabel="training compute (FLOPs)", ylabel=ylabel)
        axis.grid(alpha=0.3)
    figure.suptitle("--wait auto (star) against fixed waiting times (mean ± std over seeds)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def protocol_changes(args: argparse.Namespace) -> list[str]:
    """The flags by which this run's protocol differs from the committed results' (module doc)."""
    changes = [flag for flag, given in (("--quick", args.quick), ("--replay", args.replay),
                                        ("--no-lm", args.no_lm), ("--mnist", args.mnist),
                                        ("--cifar10", args.cifar10)) if given]
    if args.seeds != PROTOCOL_SEEDS:
        changes.append("--seeds " + " ".join(map(str, args.seeds)))
    return changes


def output_dir(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Path:
    """``--out``, never the committed results for another protocol (module doc); exits 2."""
    changes = protocol_changes(args)
    committed = COMMITTED.relative_to(REPO)
    if args.out is None:
        if not changes:
            return COMMITTED
        if args.quick:
            scratch = Path(tempfile.mkdtemp(prefix="adaptive_wait_quick."))
            print(f"--quick: results go to the scratch directory {scratch} (--out sets another; "
                  f"{committed} holds the committed results)", flush=True)
            return scratch
        parser.error(f"{', '.join(changes)}: not the protocol of the committed results in "
                     f"{committed}; pass --out DIR for this run's results")
    out = Path(args.out)
    if changes and out.resolve() == COMMITTED.resolve():
        parser.error(f"--out {args.out} holds the committed results of the protocol in this "
                     f"script's docstring, and {', '.join(changes)} changes that protocol; pass "
                     f"another --out")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="adaptive_wait.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None,
                        help=f"results and run directories (default: {COMMITTED.relative_to(REPO)}, "
                        "the committed results, for this protocol only; --quick: a new scratch "
                        "directory)")
    parser.add_argument("--mnist", default=None, help="MNIST IDX directory (B = 500)")
    parser.add_argument("--cifar10", default=None, help="CIFAR-10 python batches (B = 100)")
    parser.add_argument("--seeds", type=int, nargs="+", default=PROTOCOL_SEEDS)
    parser.add_argument("--replay", action="store_true", help="the replay variant")
    parser.add_argument("--no-lm", action="store_true", help="skip the LM stream")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run for the test suite (never into the committed results)")
    args = parser.parse_args(argv)
    out = output_dir(args, parser)
    args.out = str(out)
    if not args.no_lm and (problem := lm_stream_problem(out / "lm", args.quick)):
        parser.error(problem)
    logging.getLogger().setLevel(logging.WARNING)  # importing fairseq set the root logger to DEBUG
    if args.quick:
        args.seeds = args.seeds[:2]
    results = {}
    for stream in streams(args):
        runs = run_stream(stream, args)
        rows = vision_rows(stream, runs, out / stream.name)
        results[stream.name] = {size: judge(r, "CER") for size, r in rows.items()}
        print_tables(stream.name, results[stream.name])
    if not args.no_lm:
        rows = run_lm(out / "lm", args.seeds, args.quick)
        results["lm"] = {size: judge(r, "anytime NLL") for size, r in rows.items()}
        print_tables("lm", results["lm"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "adaptive_wait.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out / "adaptive_wait.png")
    print(f"\nwrote {out / 'adaptive_wait.json'} and {out / 'adaptive_wait.png'}")
    missed = [f"{s}/{size}" for s, sizes in results.items() for size, e in sizes.items()
              if not e["auto_meets_target"]]
    print(f"auto misses the target on: {', '.join(missed)}" if missed
          else "auto meets the target on every stream and size")
    return 0


if __name__ == "__main__":
    sys.exit(main())
