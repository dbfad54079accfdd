"""``alma-score``: perplexity over an ALMA stream for single models, Ens and gEns (paper §6.2).

Reads run directories of ``fairseq-train --task alma_stream`` (``stream.jsonl`` and
``checkpoint_stage{s}.pt``), scores every stage checkpoint once on the evaluation mega-batch and
prints Table 2's layout (App. D): setting, #experts, |θ|, perplexity after each arrival
t0..t(B-1) ('*' before the first training), the two stream averages (the paper's over the
arrivals trained by then, and the anytime one over every arrival, which charges waiting),
cumulative training TFLOPs and parameters (Comp, Mem: Eq. 2); ``--json``/``--csv``/``--plot``
(Fig. 5).

Modes (§4.1, Table 2):
  single  each run dir is a series; an arrival is answered by the last stage trained by then.
  ens     the run dirs are N members (one stream, different seeds); at each arrival the predictor
          averages the members' probabilities; |θ| and FLOPs are summed over members ("4@N").
  gens    one run trained with --stage-init scratch and no --replay: its stage checkpoints are the
          members; after s stages the predictor averages members 1..s ("4@s", |θ| = s members).

``--matrix`` (single mode) also scores every stage checkpoint on every period's held-out slice
of the mega-batches (splits ``evalmb{k}``, lm/score_matrix.py): the stage x period matrix and its
in-period, backward and forward summaries (stream/period_matrix.py), printed and in ``--json``.

Data-parallel: under ``torchrun --nproc_per_node N -m fairseq_alma.cli.score ...`` or ``srun``
(with MASTER_ADDR/MASTER_PORT exported) the N processes share every checkpoint's evaluation
batches and add their sums (lm/score_distributed.py); rank 0 alone prints and writes, and the
numbers equal a single process's.  ``--from-log`` evaluates nothing and is refused there.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import warnings

from ..console import OneLineArgumentParser, run_console, write_stdout
from ..out_paths import check_output_files
from ..report.figures import check_plot_path
from ..report.inputs import expand_run_dirs
from ..scoring import LOGGER_NAME
from ..scoring.flags import SCORE_FLAGS
from ..scoring.outputs import results_text, write_results
from ..scoring.request import ScoreRequest

OUTPUT_FLAGS = ("json", "csv", "plot")  # every file alma-score writes


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="alma-score", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="--save-dir of an "
                        "alma_stream training (stream.jsonl, checkpoint_stage{s}.pt), or a "
                        "directory of them (an alma-sweep --sweep-dir)")
    for flag, options in SCORE_FLAGS:
        parser.add_argument(flag, **options)
    return parser


def request_from_args(args: argparse.Namespace,
                      run_dirs: list[str] | None = None) -> ScoreRequest:
    """The scoring ``args`` ask for, checked (one line naming the flag otherwise); ``run_dirs``
    replaces the RUN_DIRs as given (a sweep directory expanded to its runs)."""
    settings = {field.name: getattr(args, field.name)
                for field in dataclasses.fields(ScoreRequest) if field.name != "run_dirs"}
    return ScoreRequest(run_dirs=tuple(args.run_dirs if run_dirs is None else run_dirs),
                        **settings)


def stream_dirs(data: str) -> list[str]:
    """The directories of a ``--data`` (or ``cfg.task.data``) value: fairseq's data path may
    list several, separated by ``os.pathsep``."""
    return [part for part in data.split(os.pathsep) if part]


def own_stream_dirs(run_dir: str, trust: bool = False) -> list[str]:
    """The stream a run trained on (``cfg.task.data`` of its last stage checkpoint: scored on
    it without ``--data``, and trained on it again by the same command; ``trust``:
    ``--trust-checkpoint``); none when that cannot be read here (scoring then refuses the
    run with its own one line, before writing anything).

    Why read it now: without it an ``--json DATA/manifest.json`` replaced the stream's manifest
    after scoring (exit 0), and every later training or scoring on that stream was refused.
    Only the checkpoint's pickle is read (memory-mapped), not its tensors, nor its CRCs, which
    scoring checks.  Read as scoring reads it without ``--data`` (relative to the current
    directory), absolute, and only where it exists: with ``--data`` that is the stream read,
    and a moved stream's old place or a folder of the same relative name elsewhere is none."""
    import torch

    from ..checkpoint_load import trusted
    from ..stream.run_view import RunView

    try:
        checkpoints = RunView.open(run_dir).stage_checkpoints()
        if not checkpoints:
            return []
        state = torch.load(checkpoints[max(checkpoints)], map_location="cpu", mmap=True,
                           weights_only=not (trust or trusted()))
        data = state["cfg"]["task"]["data"]
    except Exception:  # noqa: BLE001 - unreadable here: load_run refuses it in one line
        return []
    return [os.path.abspath(part) for part in stream_dirs(str(data)) if os.path.isdir(part)] \
        if data else []


def _configure_logging(main_rank: bool = True) -> None:
    """fairseq's wav2vec2 module sets the root logger to DEBUG at import: pin levels here.
    Ranks other than 0 of a data-parallel scoring keep warnings only (rank 0 logs progress)."""
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        datefmt="%H:%M:%S", level=logging.WARNING, stream=sys.stderr, force=True)
    for name in (LOGGER_NAME, "fairseq_alma.lm.ensemble_eval"):
        logging.getLogger(name).setLevel(logging.INFO if main_rank else logging.WARNING)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*'pin_memory' argument is set as true")
    warnings.filterwarnings("ignore", message="Support for mismatched key_padding_mask")


def main(argv: list[str] | None = None) -> int:
    """Console entry point ``alma-score``; exit status 2 with one line on bad input.  Rank 0
    alone prints and writes (other ranks would race on the same paths)."""
    args = build_parser().parse_intermixed_args(argv)

    def start() -> int:
        request = request_from_args(args, expand_run_dirs(args.run_dirs))
        outputs = [(f"--{flag}", getattr(args, flag)) for flag in OUTPUT_FLAGS]
        # refused now, not after the scoring they record; never onto a run's own files, nor
        # onto the stream it is scored on (its manifest, dictionary, shards)
        check_output_files(outputs, request.run_dirs)
        if request.data is not None:
            check_output_files(outputs, stream_dirs(request.data), what="stream directory")
        if args.plot:
            check_plot_path("--plot", args.plot)
        from .. import register  # fairseq and torch only now: --help and a bad flag at once

        register()
        if request.data is None and any(path for _, path in outputs):  # the runs' own streams
            own = [data for run_dir in request.run_dirs
                   for data in own_stream_dirs(run_dir, request.trust_checkpoint)]
            check_output_files(outputs, own, what="stream directory")
        from ..lm.score_distributed import world_from_env
        from ..scoring.score import score

        world = world_from_env()  # an incomplete torchrun/srun environment: one line
        _configure_logging(world.is_main)
        results = score(request, world)
        if world.is_main:  # the files first: a reader of stdout that quits early loses nothing
            write_results(results, args.json, args.csv, args.plot)
            write_stdout(results_text(results))
        return 0

    return run_console("alma-score", start)


if __name__ == "__main__":
    sys.exit(main())
