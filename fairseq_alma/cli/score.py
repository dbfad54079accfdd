"""``alma-score``: perplexity over an ALMA stream for single models, Ens and gEns (paper §6.2).

Reads run directories of ``fairseq-train --task alma_stream`` (``stream.jsonl`` and
``checkpoint_stage{s}.pt``), scores every stage checkpoint once on the evaluation mega-batch and
prints Table 2's layout (App. D): setting, #experts, |θ|, perplexity after each arrival
t0..t(B-1) ('*' before the first training), average perplexity over the stream, cumulative
training TFLOPs and parameters (Comp, Mem: Eq. 2); ``--json``/``--csv``/``--plot`` (Fig. 5).

Modes (§4.1, Table 2):
  single  each run dir is a series; an arrival is answered by the last stage trained by then.
  ens     the run dirs are N members (one stream, different seeds); at each arrival the predictor
          averages the members' probabilities; |θ| and FLOPs are summed over members ("4@N").
  gens    one run trained with --stage-init scratch and no --replay: its stage checkpoints are the
          members; after s stages the predictor averages members 1..s ("4@s", |θ| = s members).

``--matrix`` (single mode) also scores every stage checkpoint on every period's held-out slice
of the mega-batches (splits ``evalmb{k}``, lm/eval_matrix.py): the stage x period matrix and its
in-period, backward and forward summaries (stream/period_matrix.py), printed and in ``--json``.

Data-parallel: under ``torchrun --nproc_per_node N -m fairseq_alma.cli.score ...`` or ``srun``
(with MASTER_ADDR/MASTER_PORT exported) the N processes share every checkpoint's evaluation
batches and add their sums (lm/score_distributed.py); rank 0 alone prints and writes, and the
numbers equal a single process's.  ``--from-log`` evaluates nothing and is refused there.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from typing import Any

from ..errors import UsageError
from ..lm.score_distributed import ScoreWorld, choose_backend, scoring_group, world_from_env
from ..report.inputs import expand_run_dirs
from ..stream.metrics import perplexity_from_nll
from ..stream.period_matrix import PeriodMatrix, format_matrix
from ..stream.series import ReportSeries, flops_convention
from ..console import OneLineArgumentParser, run_console
from ..out_paths import check_file_path
from .score_runs import StreamRun, check_members, load_run

logger = logging.getLogger("fairseq_alma.cli.score")


def settings_for(run: StreamRun, args: argparse.Namespace) -> Any:
    """The evaluation the task itself ran after each arrival, unless flags say otherwise."""
    from ..lm.ensemble_eval import EvalSettings

    return EvalSettings.from_config(run.cfg, data=args.data, subset=args.subset,
                                    tokens_per_sample=args.tokens_per_sample,
                                    batch_size=args.batch_size,
                                    max_eval_tokens=args.max_eval_tokens)


def _ppl(nll: float, ntokens: int, what: str) -> float:
    if ntokens < 1:
        raise UsageError(f"{what}: no token scored; check --subset and --tokens-per-sample")
    try:
        return perplexity_from_nll(nll, ntokens)
    except ValueError as err:
        raise UsageError(f"{what}: {err}") from None


def _costs(members: list[StreamRun], mode: str) -> tuple[list[float], list[int], str]:
    """Comp, |θ_t| per arrival and the #experts label: Ens sums its members ("4@N"); gEns holds
    the s members trained so far ("4@s"), its FLOPs already summed by the stream."""
    records, label = members[0].records, members[0].experts_label()
    arrivals = range(len(records))
    flops = [sum(run.records[t].train_flops_cum for run in members) for t in arrivals]
    params = [sum(run.records[t].params_active for run in members) for t in arrivals]
    if mode == "ens":
        label = f"{'+'.join(sorted({run.experts_label() for run in members}))}@{len(members)}"
    elif mode == "gens":
        member = {r.stage: r.params_active for r in records if r.trained}
        params = [sum(member[s] for s in range(1, r.stage + 1)) or r.params_active for r in records]
        label = f"{label}@{len(members[0].stages)}"
    return flops, params, label


def initial_predictor(members: list[StreamRun], mode: str) -> list[str]:
    """What the learner offers at the arrivals before its first training (--wait > 1): the
    initialised model of each member (Ens: all of them; gEns: the run's own), from
    ``checkpoint_stage0.pt``.  Empty when the run does not wait or a member has no such file."""
    if not members[0].waits:
        return []
    runs = members[:1] if mode == "gens" else members
    if all(run.initial for run in runs):
        return [run.initial for run in runs]
    return []


def _charge_untrained(values: list[float | None], members: list[StreamRun], mode: str,
                      settings: Any, evaluated: bool, whole_split: bool) -> str:
    """How the arrivals before the first training were scored, filling ``values`` in place.

    Runs written before fairseq-alma 0.3 have no ``checkpoint_stage0.pt``; for a single model
    scored with the run's own evaluation (data, whole split, block length) stream.jsonl's
    arrival-0 perplexity is that same number.  Otherwise (a --max-eval-tokens slice included) the
    anytime metric is left undefined (never guessed), and a warning says why."""
    first = members[0]
    if evaluated:
        return "evaluated: checkpoint_stage0.pt (the initialised model)"
    own = settings_for(first, argparse.Namespace(data=None, subset=None, tokens_per_sample=None,
                                                 batch_size=settings.batch_size,
                                                 max_eval_tokens=None))
    same = whole_split and (os.path.realpath(own.data) == os.path.realpath(settings.data)
            and (own.subset, own.tokens_per_sample) == (settings.subset, settings.tokens_per_sample))
    if mode == "single" and same:
        for record in first.records:
            if record.stage == 0:
                values[record.arrival] = record.eval_ppl
        return "stream.jsonl: the initialised model's perplexity, logged at arrival 0"
    logger.warning("%s has no checkpoint_stage0.pt (trained before fairseq-alma 0.3)%s: the "
                   "arrivals before its first training are not scored, so anytime_nll is "
                   "undefined; train the stream again to get it", first.path,
                   "" if mode == "single" else f" and --mode {mode} needs every member's")
    return "not scored: no checkpoint_stage0.pt"


def build_series(runs: list[StreamRun], args: argparse.Namespace,
                 scorer: Any) -> list[tuple[ReportSeries, dict]]:
    """One (series, JSON extras) per run (single) or one for the ensemble (ens, gens)."""
    from ..lm.ensemble_eval import score_predictors

    out = []
    for members in [[run] for run in runs] if args.mode == "single" else [runs]:
        first, records = members[0], members[0].records
        if args.mode == "gens":  # members 1..s after stage s
            predictors = {s: [first.checkpoints[m] for m in first.stages[:i + 1]]
                          for i, s in enumerate(first.stages)}
        else:  # each member's stage-s checkpoint (vision logs have none)
            predictors = {s: [run.checkpoints[s] for run in members if s in run.checkpoints]
                          for s in first.stages}
        extra: dict[str, Any] = {"mode": args.mode, "runs": [str(run.path) for run in members]}
        if args.from_log:
            values = first.logged_metric()
            extra["source"] = str(first.path / "stream.jsonl")
        else:
            settings = settings_for(first, args)
            untrained = initial_predictor(members, args.mode)
            if untrained:
                predictors[0] = untrained
            nll = score_predictors(scorer, predictors, settings)
            stage_ppl = {s: _ppl(*nll[s], f"stage {s} of {first.path}") for s in nll}
            values = [stage_ppl.get(r.stage) for r in records]
            scored = scorer.eval_slice(settings)
            extra |= {"source": "evaluated", "settings": vars(settings),
                      "precision": "fp16" if scorer.fp16 else "fp32", **scored.as_json(),
                      "nll_tokens_by_stage": {str(s): list(v) for s, v in nll.items()}}
            if args.max_eval_tokens:
                extra["eval_slice_note"] = scored.describe(settings.subset)
            if first.waits:
                extra["untrained_arrivals"] = _charge_untrained(
                    values, members, args.mode, settings, bool(untrained), scored.whole)
            if args.matrix:
                extra["eval_matrix"] = _eval_matrix(first, scorer, settings)
        extra["members_by_arrival"] = [predictors.get(r.stage, []) for r in records]
        flops, params, label = _costs(members, args.mode)
        prefix = {"ens": "Ens", "gens": "gEns"}.get(args.mode)
        series = ReportSeries(
            setting=args.setting or first.default_setting(prefix), num_experts=label,
            metric_by_arrival=values, train_flops_cum=flops, params_by_arrival=params,
            trained=[r.trained for r in records], metric=first.metric,
            flops_convention=flops_convention(records))
        out.append((series, extra))
    return out


def _eval_matrix(run: StreamRun, scorer: Any, settings: Any) -> dict[str, Any]:
    """--matrix: the run's stage checkpoints on every period (lm/eval_matrix.py), as JSON."""
    from ..lm.eval_matrix import check_period_splits, score_matrix

    b = len(run.records) - 1
    facts = check_period_splits(settings.data, b)
    arrivals = {r.stage: r.arrival for r in run.records if r.trained}
    matrix, scored = score_matrix(scorer, {s: run.checkpoints[s] for s in run.stages}, arrivals,
                                  settings, b)
    return {**matrix.as_json(), **scored, **facts}


_FLAGS: list[tuple[str, dict]] = [
    ("--mode", {"choices": ("single", "ens", "gens"), "default": "single",
                "help": "single: a series per run; ens: the runs are one ensemble's members; gens: "
                        "one --stage-init scratch run whose stage checkpoints are the members"}),
    ("--data", {"help": "stream directory to score on (default: each run's cfg.task.data)"}),
    ("--subset", {"help": "split to score (default: the run's --eval-subset, 'eval')"}),
    ("--from-log", {"action": "store_true",
                    "help": "single mode: reuse stream.jsonl's eval_ppl instead of evaluating "
                            "(fast; also renders vision runs' test_error)"}),
    ("--batch-size", {"type": int, "help": "sequences per evaluation batch (default: the run's "
                      "own evaluation batching: --batch-size-valid, --batch-size, else 8)"}),
    ("--tokens-per-sample", {"type": int, "help": "block length scored, as given to "
                             "fairseq-eval-lm (default: the run's)"}),
    ("--max-eval-tokens", {"type": int, "metavar": "N",
                           "help": "score a fixed slice of the split: its first blocks in index "
                                   "order (the order of its text), as many whole blocks as hold "
                                   "at most N tokens together; the same blocks for every "
                                   "checkpoint and member; N at least the split's size scores "
                                   "all of it. Recorded in --json (eval_tokens, "
                                   "eval_tokens_total, max_eval_tokens) and under the table "
                                   "(default: the whole split)"}),
    ("--fp16", {"action": "store_true",
                "help": "score in half precision on CUDA (weights in fp16; log-probabilities "
                        "in fp32, sums in fp64); refused on CPU"}),
    ("--matrix", {"action": "store_true",
                  "help": "--mode single: also score every stage checkpoint on every period's "
                          "held-out slice (splits evalmb0..evalmb{B-1} of a stream prepared with "
                          "alma-data-prep --eval-per-megabatch SIZE): the stage x period matrix "
                          "and its in-period, backward (forgetting) and forward summaries, "
                          "printed and under each series' eval_matrix in --json"}),
    ("--setting", {"help": "series name in the table (default from the run's flags, e.g. "
                           "'SM_w1', 'Ens_w4 (4x steps)', 'gEns_w1')"}),
    ("--json", {"metavar": "FILE", "help": "write every number per arrival as JSON"}),
    ("--csv", {"metavar": "FILE", "help": "write the table as CSV (full precision)"}),
    ("--plot", {"metavar": "FILE.png",
                "help": "Fig. 5: average perplexity vs cumulative compute and vs parameters"}),
    ("--cpu", {"action": "store_true", "help": "score on CPU even if CUDA is available"}),
    ("--trust-checkpoint", {"action": "store_true",
                            "help": "unpickle checkpoints fully (a pickle can run code when it is "
                                    "loaded): only for files from a source you trust; by default "
                                    "only tensors and plain values are read, and a checkpoint "
                                    "holding anything else is refused naming the type"}),
    ("--distributed-backend", {"choices": ("gloo", "nccl"),
                               "help": "under torchrun/srun with several processes: how they add "
                                       "their sums (default: nccl on CUDA, gloo on CPU)"}),
]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="alma-score", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="--save-dir of an "
                        "alma_stream training (stream.jsonl, checkpoint_stage{s}.pt), or a "
                        "directory of them (an alma-sweep --sweep-dir)")
    for flag, options in _FLAGS:
        parser.add_argument(flag, **options)
    return parser


def _check_flags(args: argparse.Namespace) -> None:
    for flag in ("batch_size", "tokens_per_sample", "max_eval_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1 (got {getattr(args, flag)})")
    for flag in ("json", "csv", "plot"):  # refused now, not after the scoring they would record
        if getattr(args, flag):
            check_file_path(getattr(args, flag), f"--{flag}")
    if len({os.path.realpath(d) for d in args.run_dirs}) != len(args.run_dirs):
        raise UsageError("a RUN_DIR is given twice; pass each run once")
    if args.from_log:
        if args.mode != "single":
            raise UsageError(f"--from-log works with --mode single only: --mode {args.mode} "
                             f"averages the members' token probabilities, which needs evaluation")
        given = [f for f in ("batch_size", "tokens_per_sample", "subset", "max_eval_tokens",
                             "fp16") if getattr(args, f)]
        if given:
            raise UsageError(f"--from-log reuses the run's own evaluation; drop "
                             f"--{given[0].replace('_', '-')} or --from-log")
    if args.matrix and (args.mode != "single" or args.from_log):
        raise UsageError(f"--matrix scores single models on every period; it does not combine "
                         f"with {'--from-log' if args.from_log else f'--mode {args.mode}'}: "
                         f"score each run with --mode single --matrix")
    if args.mode == "gens" and len(args.run_dirs) != 1:
        raise UsageError(
            f"--mode gens takes ONE run dir (its stages are the members), got {len(args.run_dirs)}"
        )
    if args.mode == "ens" and len(args.run_dirs) < 2:
        raise UsageError("--mode ens needs at least 2 run dirs (the members)")


def _write_outputs(results: list[tuple[ReportSeries, dict]], args: argparse.Namespace) -> None:
    from ..report import figures, tables
    from ..stream.atomic import atomic_write_json

    series = [s for s, _ in results]
    try:
        print(tables.format_table(series), end="", flush=True)
        notes = dict.fromkeys(extra["eval_slice_note"] for _, extra in results
                              if "eval_slice_note" in extra)
        for note in notes:  # one line per distinct slice (runs may differ in block length)
            print(note, flush=True)
        for one, extra in results:
            if "eval_matrix" in extra:
                matrix = PeriodMatrix.from_json(extra["eval_matrix"])
                print("\n" + format_matrix(matrix, f"{one.setting} ({extra['runs'][0]})"),
                      end="", flush=True)
        if args.json:  # the report's dict, plus how each number was obtained
            payload = tables.report_dict(series)
            for entry, (_, extra) in zip(payload["series"], results, strict=True):
                extra = dict(extra)
                members = extra.pop("members_by_arrival")
                for arrival, used in zip(entry["arrivals"], members, strict=True):
                    arrival["members"] = used
                if "eval_matrix" in extra:
                    entry["eval_matrix"] = extra.pop("eval_matrix")
                entry["scoring"] = extra
            atomic_write_json(args.json, payload)
        if args.csv:
            tables.write_csv(series, args.csv)
        if args.plot:
            draw = figures.plot_tradeoffs if series[0].metric == "ppl" else figures.plot_error_curves
            draw(series, args.plot)
    except ValueError as err:  # e.g. runs of different stream lengths in one table
        raise UsageError(str(err)) from None
    except OSError as err:
        raise UsageError(f"cannot write {err.filename}: {err.strerror}") from None


def _configure_logging(main_rank: bool = True) -> None:
    """fairseq's wav2vec2 module sets the root logger to DEBUG at import: pin levels here.
    Ranks other than 0 of a data-parallel scoring keep warnings only (rank 0 logs progress)."""
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        datefmt="%H:%M:%S", level=logging.WARNING, stream=sys.stderr, force=True)
    for name in ("fairseq_alma.cli.score", "fairseq_alma.lm.ensemble_eval"):
        logging.getLogger(name).setLevel(logging.INFO if main_rank else logging.WARNING)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*'pin_memory' argument is set as true")
    warnings.filterwarnings("ignore", message="Support for mismatched key_padding_mask")


def run(args: argparse.Namespace, world: ScoreWorld | None = None) -> int:
    """Check the runs, score them (sharing the batches among ``world``'s processes), render on
    rank 0; every user mistake raises ``UsageError``."""
    import torch

    from ..checkpoint_load import trust_checkpoints

    world = world or ScoreWorld()
    trust_checkpoints(getattr(args, "trust_checkpoint", False))
    args.run_dirs = expand_run_dirs(args.run_dirs)
    _check_flags(args)
    use_cuda = torch.cuda.is_available() and not args.cpu
    if args.fp16 and not use_cuda:
        raise UsageError("--fp16 needs a CUDA device; drop it to score in fp32 on CPU")
    if world.size > 1 and args.from_log:
        raise UsageError(f"--from-log evaluates nothing, so there is nothing to share among "
                         f"{world.size} processes; run it as one process (no torchrun/srun)")
    backend = choose_backend(use_cuda, args.distributed_backend)
    with scoring_group(world, backend):
        results = _score_runs(args, use_cuda)
        if world.is_main:
            _write_outputs(results, args)
    return 0


def _score_runs(args: argparse.Namespace, use_cuda: bool) -> list[tuple[ReportSeries, dict]]:
    runs = [load_run(path, args) for path in args.run_dirs]
    if args.mode != "single":
        check_members(runs, args.mode)
    scorer = None
    if not args.from_log:
        from ..lm.ensemble_eval import CheckpointScorer

        groups = [[run] for run in runs] if args.mode == "single" else [runs]
        total = sum(len(initial_predictor(group, args.mode)) for group in groups)
        total += len(runs[0].stages) if args.mode == "gens" else sum(len(r.stages) for r in runs)
        if args.matrix:  # before anything is scored: a stream without period splits stops here
            from ..lm.eval_matrix import check_period_splits

            for run in runs:
                check_period_splits(settings_for(run, args).data, len(run.records) - 1)
                total += len(run.stages) * (len(run.records) - 1)
        scorer = CheckpointScorer(use_cuda=use_cuda, total=total, fp16=args.fp16)
        logger.info("scoring %d checkpoint(s) on %s", total, scorer.device)
    results = build_series(runs, args, scorer)
    if scorer is not None and scorer.seconds > 0:
        rate = f"{scorer.tokens / scorer.seconds:,.0f}"
        logger.info("scored %s tokens in %.2fs: %s tokens/s", f"{scorer.tokens:,}", scorer.seconds,
                    rate)
    return results


def main(argv: list[str] | None = None) -> int:
    """Console entry point ``alma-score``; exit status 2 with one line on bad input."""
    args = build_parser().parse_intermixed_args(argv)

    def start() -> int:
        world = world_from_env()  # an incomplete torchrun/srun environment: one line
        _configure_logging(world.is_main)
        return run(args, world)

    return run_console("alma-score", start)


if __name__ == "__main__":
    sys.exit(main())
