"""In-process sweeps: methods × sizes × waiting times × seeds, with a CER table (§5, §6.1).

The paper's first vision finding (§6.1, Fig. 3, App. C.1): without replay, an intermediate
waiting time often has a lower cumulative error rate (Eq. 1) than both w = 1 (greedy) and w = B
(tardy), "on MNIST ... only for small models".  This command re-runs that comparison on any of
the vision data sets (default: the embedded digits, nothing downloaded):

    python -m fairseq_alma.vision.sweep --out sweep_out --methods sm --widths 4 8 \\
        --waits 1 2 5 10 20 --num-megabatches 20 --epochs-per-stage 20 --seeds 1 2 3

Each run writes ``<out>/<method>_<arch><width>_w<w>[_replay]_s<seed>/stream.jsonl`` (the task's
record format, so ``alma-score`` reads it); a run whose file is complete is not run again, so an
interrupted sweep continues where it stopped.  ``summary.json`` holds the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import UsageError
from ..stream.atomic import atomic_write_json
from ..stream.metrics import cumulative, cumulative_error_rate
from ..stream.records import StreamLogError, read_records
from .data import DATASET_KINDS, VisionData, load_vision_data
from .learners import METHODS, LearnerSpec
from .stage_trainer import OptimizerSpec, StageTrainConfig
from .stream_runner import StreamSpec, run_stream


@dataclass(frozen=True)
class RunSummary:
    """One stream's totals: CER (Eq. 1), final error, Mem and Comp (Eq. 2)."""

    method: str
    arch: str
    width: int
    wait: int
    replay: bool
    seed: int
    cer: float
    final_error: float
    mem: float
    comp: float


def run_name(spec: LearnerSpec, stream: StreamSpec) -> str:
    replay = "_replay" if stream.replay else ""
    return f"{spec.method}_{spec.arch}{spec.width}_w{stream.wait}{replay}_s{spec.seed}"


def run_or_reuse(
    data: VisionData,
    spec: LearnerSpec,
    stream: StreamSpec,
    config: StageTrainConfig,
    out_dir: str,
    quiet: bool = False,
) -> RunSummary:
    """Run one stream unless ``out_dir/<run>/stream.jsonl`` already holds all B + 1 records."""
    path = os.path.join(out_dir, run_name(spec, stream), "stream.jsonl")
    records = None
    if os.path.isfile(path):
        try:
            records = [r.to_json() for r in read_records(path)]
        except StreamLogError:
            records = None
        if records is not None and len(records) != stream.num_megabatches + 1:
            records = None
    if records is None:
        records = run_stream(
            data, spec, stream, config, log=None if quiet else print, jsonl_path=path
        )
    errors = [r["test_error"] for r in records]
    return RunSummary(
        method=spec.method,
        arch=spec.arch,
        width=spec.width,
        wait=stream.wait,
        replay=stream.replay,
        seed=spec.seed,
        cer=cumulative_error_rate(errors),
        final_error=errors[-1],
        mem=cumulative([r["params_active"] for r in records])[-1],
        comp=records[-1]["train_flops_cum"],
    )


def format_table(runs: Sequence[RunSummary]) -> str:
    """CER per (method, size, w): mean ± stdev over seeds, plus final error, Mem, Comp."""
    groups: dict[tuple, list[RunSummary]] = {}
    for run in runs:
        groups.setdefault((run.method, run.arch, run.width, run.replay, run.wait), []).append(run)
    lines = [
        (
            f"{'method':<7}{'model':<8}{'replay':<7}{'w':>4}{'seeds':>6}{'CER':>9}{'±':>7}"
            f"{'final err':>10}{'Mem':>11}{'Comp (FLOPs)':>14}"
        )
    ]
    for key in sorted(groups):
        group = groups[key]
        cers = [run.cer for run in group]
        spread = statistics.stdev(cers) if len(cers) > 1 else 0.0
        lines.append(
            f"{key[0]:<7}{key[1] + str(key[2]):<8}{'yes' if key[3] else 'no':<7}{key[4]:>4}"
            f"{len(group):>6}{statistics.mean(cers):>9.3f}{spread:>7.3f}"
            f"{statistics.mean(r.final_error for r in group):>10.3f}"
            f"{statistics.mean(r.mem for r in group):>11.3g}"
            f"{statistics.mean(r.comp for r in group):>14.3g}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fairseq_alma.vision.sweep",
        description="Run vision ALMA streams over methods, sizes and waiting times; print CER.",
    )
    parser.add_argument(
        "--out", required=True, help="directory for per-run stream.jsonl and summary.json"
    )
    parser.add_argument(
        "--dataset",
        default="digits",
        choices=DATASET_KINDS,
        help="data set (default: embedded digits)",
    )
    parser.add_argument(
        "--data-path", default=None, help="MNIST IDX dir, CIFAR-10 batches dir or .npz file"
    )
    parser.add_argument(
        "--arch",
        default="mlp",
        choices=("mlp", "vgg"),
        help="backbone (paper: mlp on MNIST, vgg on CIFAR)",
    )
    parser.add_argument(
        "--methods", nargs="+", default=["sm"], choices=METHODS, help="learners to run"
    )
    for flag, default, text in (
        ("--widths", [8], "hidden width h / channels c"),
        ("--waits", [1, 2, 5, 10, 20], "waiting times w"),
        ("--seeds", [1], "seeds (partition, init, data order)"),
    ):
        parser.add_argument(flag, nargs="+", type=int, default=default, help=text)
    parser.add_argument(
        "--num-megabatches", type=int, default=20, help="B (paper: 500 MNIST, 100 CIFAR)"
    )
    parser.add_argument(
        "--replay", action="store_true", help="train on every mega-batch seen so far"
    )
    parser.add_argument(
        "--epochs-per-stage", type=int, default=20, help="epochs per stage (paper: 100)"
    )
    parser.add_argument("--members", type=int, default=5, help="N for ens and umix (paper: 5)")
    parser.add_argument("--gating", default="soft", choices=("soft", "hard"), help="gMoE gating")
    parser.add_argument(
        "--optimizer",
        default=None,
        choices=("adadelta", "sgd"),
        help="default: adadelta lr 1 (MNIST, digits, npz) or sgd lr 0.01 m 0.9 wd 1e-4 (CIFAR)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: these small models gain nothing from more, "
        "and spare threads spin-wait on a busy machine)",
    )
    parser.add_argument("--quiet", action="store_true", help="only print the final table")
    return parser


def _check_lists(args: argparse.Namespace) -> str | None:
    if min(args.widths) < 1:
        return f"--widths must all be >= 1, got {args.widths}"
    if args.num_megabatches < 1:
        return f"--num-megabatches must be >= 1, got {args.num_megabatches}"
    if not all(1 <= wait <= args.num_megabatches for wait in args.waits):
        return f"--waits must all be between 1 and --num-megabatches ({args.num_megabatches}), got {args.waits}"
    if min(args.seeds) < 0:
        return f"--seeds must all be >= 0, got {args.seeds}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads < 1:
        print("fairseq-alma: error: --threads must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    problem = _check_lists(args)
    if problem:
        print(f"fairseq-alma: error: {problem}", file=sys.stderr)
        return 2
    try:
        cifar = args.dataset == "cifar10"
        if args.optimizer is None:
            optimizer = OptimizerSpec.paper_cifar() if cifar else OptimizerSpec.paper_mnist()
        else:
            optimizer = (
                OptimizerSpec.paper_cifar()
                if args.optimizer == "sgd"
                else OptimizerSpec.paper_mnist()
            )
        data = load_vision_data(args.dataset, args.data_path)
        fill = tuple(-m / s for m, s in zip(data.mean, data.std)) if cifar else None
        config = StageTrainConfig(
            epochs=args.epochs_per_stage, optimizer=optimizer, augment=cifar, augment_fill=fill
        )
        runs = []
        for method in args.methods:
            for width in args.widths:
                for wait in args.waits:
                    for seed in args.seeds:
                        spec = LearnerSpec(
                            method,
                            args.arch,
                            width,
                            members=args.members,
                            gating=args.gating,
                            seed=seed,
                        )
                        stream = StreamSpec(args.num_megabatches, wait, args.replay, seed=seed)
                        runs.append(run_or_reuse(data, spec, stream, config, args.out, args.quiet))
    except UsageError as err:
        print(err.code, file=sys.stderr)
        return 2
    table = format_table(runs)
    atomic_write_json(
        os.path.join(args.out, "summary.json"),
        {
            "dataset": data.name,
            "epochs": args.epochs_per_stage,
            "num_megabatches": args.num_megabatches,
            "runs": [run.__dict__ for run in runs],
        },
    )
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
