"""``alma-vision-sweep``: vision streams over methods, sizes, waiting times and seeds, with the
CER table (paper §5, §6.1).  The runs are ``vision/runner.py``'s, the code ``fairseq-train
--task alma_stream --vision-dataset`` and ``alma-vision-demo`` run too; see ``vision/sweep_runs.py``.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from ..console import OneLineArgumentParser, run_console, write_stdout
from ..stream.progress import parse_wait
from ..vision.data import DATASET_KINDS
from ..vision.devices import AMP_MODES
from ..vision.learners import METHODS
from ..vision.sweep_runs import format_sweep_table, run_sweep


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="alma-vision-sweep",
        description="Run vision ALMA streams over methods, sizes and waiting times; print CER.",
    )
    parser.add_argument(
        "--out", required=True,
        help="directory for per-run stream.jsonl and summary.json (the runs of this call)"
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
        default=None,
        choices=("mlp", "vgg"),
        help="backbone (default, as the paper: vgg on cifar10, mlp otherwise)",
    )
    parser.add_argument(
        "--methods", nargs="+", default=["sm"], choices=METHODS,
        help="learners to run (default: sm)"
    )
    for flag, default, text, kind in (
        ("--widths", [8], "hidden width h / channels c (default: 8)", int),
        ("--waits", [1, 2, 5, 10, 20], "waiting times w, or auto (decided at each arrival; "
         "default: 1 2 5 10 20)", parse_wait),
        ("--seeds", [1], "seeds (partition, init, data order; default: 1)", int),
    ):
        parser.add_argument(flag, nargs="+", type=kind, default=default, help=text)
    parser.add_argument(
        "--num-megabatches", type=int, default=20,
        help="B (default 20, a quick sweep; paper: 500 MNIST, 100 CIFAR)"
    )
    parser.add_argument(
        "--replay", action="store_true", help="train on every mega-batch seen so far"
    )
    parser.add_argument(
        "--epochs-per-stage", type=int, default=20,
        help="epochs per stage (default 20, a quick sweep; paper: 100)"
    )
    parser.add_argument("--members", type=int, default=5, help="N for ens and umix (paper: 5)")
    parser.add_argument("--gating", default="soft", choices=("soft", "hard"), help="gMoE gating")
    parser.add_argument("--mixture-layers", default="", metavar="I,J,...",
                        help="gMoE layers that grow, 0-based (default: the first two, paper §5)")
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
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where the learners train (default auto: the GPU when there is one)")
    parser.add_argument("--amp", default="off", choices=AMP_MODES,
                        help="mixed precision of the forward passes (fp16 needs CUDA)")
    parser.add_argument("--quiet", action="store_true",
                        help="only print the final table (and warnings, on stderr)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # importing fairseq left the root logger at INFO with a handler: without this, --quiet
    # still printed the runner's per-stage lines
    logging.basicConfig(format="%(asctime)s | %(message)s", datefmt="%H:%M:%S", force=True,
                        level=logging.WARNING)
    runner_logger = logging.getLogger("fairseq_alma.vision.runner")
    runner_logger.setLevel(logging.WARNING if args.quiet else logging.INFO)

    def sweep() -> None:
        write_stdout(format_sweep_table(run_sweep(args)))

    return run_console("alma-vision-sweep", sweep)


if __name__ == "__main__":
    raise SystemExit(main())
