"""In-process sweeps: methods × sizes × waiting times × seeds, with a CER table (§5, §6.1).

The library behind ``alma-vision-sweep`` (``cli/vision_sweep.py``).  The paper's first vision
finding (§6.1, Fig. 3, App. C.1): without replay, an intermediate
waiting time often has a lower cumulative error rate (Eq. 1) than both w = 1 (greedy) and w = B
(tardy), "on MNIST ... only for small models".  This command re-runs that comparison on any of
the vision data sets (default: the embedded digits, nothing downloaded):

    alma-vision-sweep --out sweep_out --methods sm --widths 4 8 \\
        --waits 1 2 5 10 20 --num-megabatches 20 --epochs-per-stage 20 --seeds 1 2 3

Each run writes ``<out>/<method>_<arch><width>_w<w>[_replay]_s<seed>/stream.jsonl`` (the task's
record format, so ``alma-score`` reads it); a finished run is not run again, so an interrupted
sweep continues where it stopped.  The directory name holds only a few settings: a run is reused
or continued only when its ``run.json`` fingerprint is the one this sweep would write (epochs,
optimizer, members, data, ...); a directory holding a run with other settings is refused before
anything trains (``stream/held_run.py``).  ``summary.json`` holds the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import UsageError
from ..out_paths import check_dir_path
from ..stream.atomic import atomic_write_json
from ..stream.held_run import held_run_records
from ..stream.metrics import cumulative, cumulative_error_rate
from ..stream.progress import AUTO, StreamPlan, wait_order
from ..stream.records import ArrivalRecord
from ..stream.run_dir import RunDirectory
from ..text_table import format_table as layout
from .data import load_vision_data
from .dataset import VisionData
from .devices import resolve_device
from .fingerprint import vision_fingerprint
from .learners import LearnerSpec, paper_backbone, parse_mixture_layers
from .models_moe import mixture_layer_count
from .runner import VisionRun, data_digest, run_vision_stream
from .stage_trainer import OptimizerSpec, StageTrainConfig


@dataclass(frozen=True)
class RunSummary:
    """One stream's totals: CER (Eq. 1), final error, Mem and Comp (Eq. 2)."""

    method: str
    arch: str
    width: int
    wait: int | str  # or auto
    replay: bool
    seed: int
    cer: float
    final_error: float
    mem: float
    comp: float


def run_name(run: VisionRun) -> str:
    spec, replay = run.learner, "_replay" if run.plan.replay else ""
    return f"{spec.method}_{spec.arch}{spec.width}_w{run.plan.wait}{replay}_s{spec.seed}"


# where a sweep's refusal of a run directory sends the user: the sweep's own flag
OTHER_OUT = "use another --out"


def held_records(run: VisionRun, out_dir: str, data_sha256: str) -> list[ArrivalRecord] | None:
    """The records of ``run`` when ``out_dir/<run>`` holds it finished; None when it is to be
    trained (or continued); one line when that directory holds a run with other settings."""
    return held_run_records(os.path.join(out_dir, run_name(run)),
                            vision_fingerprint(run, data_sha256), run.plan.num_megabatches,
                            OTHER_OUT)


def run_or_reuse(data: VisionData, run: VisionRun, out_dir: str, quiet: bool = False,
                 data_sha256: str | None = None) -> RunSummary:
    """Run (or continue) one stream in ``out_dir/<run>``; a finished one with this run's
    fingerprint is only read, one with another is refused (``held_records``).  ``data_sha256``:
    ``runner.data_digest(data)``, when the caller has it."""
    digest = data_sha256 if data_sha256 is not None else data_digest(data)
    with RunDirectory.for_training(os.path.join(out_dir, run_name(run))) as run_dir:
        records = held_records(run, out_dir, digest)  # again, now that the directory is ours
        if records is None:
            records = run_vision_stream(run, run_dir, data)
    errors = [r.test_error for r in records]
    spec = run.learner
    summary = RunSummary(
        method=spec.method, arch=spec.arch, width=spec.width, wait=run.plan.wait,
        replay=run.plan.replay, seed=spec.seed, cer=cumulative_error_rate(errors),
        final_error=errors[-1], mem=cumulative([r.params_active for r in records])[-1],
        comp=records[-1].train_flops_cum)
    if not quiet:
        print(f"[{run_name(run)}] CER {summary.cer:.3f}, final error {summary.final_error:.4f}, "
              f"params {records[-1].params_active}, FLOPs {summary.comp:.3g}", flush=True)
    return summary


def format_sweep_table(runs: Sequence[RunSummary]) -> str:
    """CER per (method, size, w): mean ± stdev over seeds, plus final error, Mem, Comp."""
    groups: dict[tuple, list[RunSummary]] = {}
    for run in runs:
        groups.setdefault((run.method, run.arch, run.width, run.replay, run.wait), []).append(run)
    rows = []
    for key in sorted(groups, key=lambda key: (*key[:4], wait_order(key[4]))):
        group = groups[key]
        cers = [run.cer for run in group]
        # one seed measures no spread: "-", never a 0.000 that reads as "no variation"
        spread = f"{statistics.stdev(cers):.3f}" if len(cers) > 1 else "-"
        rows.append([key[0], f"{key[1]}{key[2]}", "yes" if key[3] else "no", str(key[4]),
                     str(len(group)), f"{statistics.mean(cers):.3f}", spread,
                     f"{statistics.mean(r.final_error for r in group):.3f}",
                     f"{statistics.mean(r.mem for r in group):.3g}",
                     f"{statistics.mean(r.comp for r in group):.3g}"])
    header = ["method", "model", "replay", "w", "seeds", "CER", "±", "final err", "Mem",
              "Comp (FLOPs)"]
    return layout(header, rows, left=3)


def _check_lists(args: argparse.Namespace) -> None:
    # in the sweep's own flag names, before any run directory is made (the learner's checks
    # name fairseq-train's --vision-* flags, and ran after a run had taken its lock)
    if args.dataset != "digits" and not args.data_path:
        raise UsageError(f"--dataset {args.dataset} needs a path (--data-path)")
    if args.amp == "fp16" and resolve_device(args.device) != "cuda":
        raise UsageError("--amp fp16 needs a CUDA device; use --amp bf16 or off on CPU")
    if min(args.widths) < 1:
        raise UsageError(f"--widths must all be >= 1, got {args.widths}")
    if args.num_megabatches < 1:
        raise UsageError(f"--num-megabatches must be >= 1, got {args.num_megabatches}")
    if not all(wait == AUTO or 1 <= wait <= args.num_megabatches for wait in args.waits):
        raise UsageError(f"--waits must all be between 1 and --num-megabatches "
                         f"({args.num_megabatches}), got {args.waits}")
    if min(args.seeds) < 0:
        raise UsageError(f"--seeds must all be >= 0, got {args.seeds}")
    for flag, values in (("methods", args.methods), ("widths", args.widths),
                         ("waits", args.waits), ("seeds", args.seeds)):
        # a repeated value would be one run counted twice: "seeds 2, ± 0.000" from one stream
        if len(set(values)) != len(values):
            raise UsageError(f"--{flag} {values} repeat a value; list each {flag[:-1]} once")
    if args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    if args.members < 1:
        raise UsageError(f"--members must be >= 1 (the N of ens and umix), got {args.members}")
    layers = parse_mixture_layers(args.mixture_layers, "--mixture-layers") or ()
    beyond = [layer for layer in layers if layer >= mixture_layer_count(_arch(args))]
    if beyond:
        raise UsageError(f"--mixture-layers {args.mixture_layers}: layer {beyond[0]} is not in "
                         f"the {_arch(args)} backbone (layers "
                         f"0-{mixture_layer_count(_arch(args)) - 1})")
    check_dir_path(args.out, "--out")


def _arch(args: argparse.Namespace) -> str:
    """The backbone: ``--arch``, or the paper's for the data set (``paper_backbone``)."""
    return args.arch or paper_backbone(args.dataset)


def _runs(args: argparse.Namespace, data: VisionData) -> list[VisionRun]:
    cifar = args.dataset == "cifar10"
    layers = parse_mixture_layers(args.mixture_layers, "--mixture-layers")
    name = args.optimizer or ("sgd" if cifar else "adadelta")
    optimizer = OptimizerSpec.paper_cifar() if name == "sgd" else OptimizerSpec.paper_mnist()
    training = StageTrainConfig(epochs=args.epochs_per_stage, optimizer=optimizer, augment=cifar,
                                amp=args.amp)
    device = resolve_device(args.device)
    return [
        VisionRun(dataset=args.dataset, data_path=args.data_path,
                  plan=StreamPlan(args.num_megabatches, wait, args.replay),
                  learner=LearnerSpec(method, _arch(args), width, members=args.members,
                                      gating=args.gating, mixture_layers=layers, seed=seed),
                  training=training, seed=seed, device=device)
        for method in args.methods for width in args.widths for wait in args.waits
        for seed in args.seeds
    ]


def run_sweep(args: argparse.Namespace) -> list[RunSummary]:
    """Every run of the sweep the arguments describe (``alma-vision-sweep``), in order."""
    _check_lists(args)
    torch.set_num_threads(args.threads)
    data = load_vision_data(args.dataset, args.data_path)
    digest = data_digest(data)
    planned = _runs(args, data)
    for run in planned:  # every directory checked before the first run trains
        held_records(run, args.out, digest)
    runs = [run_or_reuse(data, run, args.out, args.quiet, digest) for run in planned]
    atomic_write_json(os.path.join(args.out, "summary.json"), {
        "dataset": data.name, "epochs": args.epochs_per_stage,
        "num_megabatches": args.num_megabatches, "runs": [run.__dict__ for run in runs]})
    return runs
