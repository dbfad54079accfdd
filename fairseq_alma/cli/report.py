"""``alma-report``: the paper's tables and figures for your own runs and sweeps.

Reads run directories (``stream.jsonl`` + ``run.json``), sweep directories of them and
``alma-score --json`` files (the way to include Ens and gEns), groups the runs that differ only
by their seed (same ``run.json`` fingerprint once the seed is removed) and writes to --out:

  language models                          vision
  table2.md, table2.csv, table2.json       cer_table.md, cer_table.csv, cer_table.json
    (Table 2: perplexity after each          (CER, Eq. 1, final error, compute, memory)
    arrival, the paper's average over
    trained arrivals AND the anytime
    perplexity, compute, memory)
  fig5_tradeoffs.png  (Fig. 5: average     fig2_cer_tradeoffs.png  (Fig. 2: CER vs compute
    perplexity vs compute, parameters        and vs memory)
    and #experts; bottom row: anytime)     fig3_error_curves[_SIZE].png  (Fig. 3: test error
  fig3_perplexity_curves.png  (perplexity    after each arrival, one file per model size)
    after each arrival)
  fig4_replay.png  (Fig. 4: an arrow from each run without replay to the same run with replay;
    drawn when such pairs are given)
  eval_matrix.md, eval_matrix.csv, eval_matrix.json  (alma-score --matrix JSON inputs: the
    in-period, backward (forgetting) and forward perplexities of each setting; the JSON keeps
    the stage x period matrices)
  fig_eval_matrix.png  (each setting's stage x period matrix as a heatmap: rows = stages,
    columns = periods, colour = log perplexity, values annotated)

With several seeds a cell reads ``mean ± std`` (sample standard deviation), a ``seeds`` column
counts them and the figures draw error bars; the JSON keeps every seed's numbers.
"""

from __future__ import annotations

import argparse
import fnmatch
import logging
import os
import re
import signal
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..console import OneLineArgumentParser, run_console, write_stdout
from ..errors import UsageError
from ..out_paths import check_dir_path
from ..stream.staged_outputs import StagedOutputs

logger = logging.getLogger("fairseq_alma.cli.report")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="alma-report", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", metavar="RUN_OR_SWEEP_DIR",
                        help="a --save-dir of an alma_stream run, a sweep directory of them, or "
                             "an alma-score --json file")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="directory for the tables and figures (created if needed)")
    parser.add_argument("--no-seed-groups", action="store_true",
                        help="one row per run even where runs differ only by seed")
    return parser


def _file_tag(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.@-]+", "_", label)


def write_report(args: argparse.Namespace) -> list[str]:
    """Read, group, check, render; returns what was written, in order.  Bad input:
    ``UsageError``, before any file in --out changes.

    Why every file is drawn into a staging folder inside --out (``StagedOutputs``) and moved
    into place only once all of them are: a check that failed after the first file (seeds of one
    setting with and without an eval matrix) overwrote the earlier report's table and figures
    and left its Fig. 4 beside them, a mix that no command made.  The staging folder's name
    holds this process's id, so the next report removes it if this one was killed."""
    from ..report import figures, matrix_table, result_tables
    from ..report.inputs import common_eval_slice, common_split, read_inputs
    from ..report.seeds import group_by_seed, replay_pairs

    check_dir_path(args.out, "--out")
    refuse_inputs_among_outputs(args.inputs, args.out)
    runs = read_inputs(args.inputs)
    notes = [note for note in (common_split(runs), common_eval_slice(runs)) if note]
    try:
        groups = group_by_seed(runs, by_seed=not args.no_seed_groups)
        metric, _ = result_tables.same_shape(groups)
        matrices = matrix_table.matrix_groups(groups)
        table = result_tables.format_series_table(groups)
    except ValueError as err:
        raise UsageError(str(err)) from None
    pairs = replay_pairs(groups)
    out = Path(args.out)
    stem = "table2" if metric == "ppl" else "cer_table"
    note = "".join(f"{line}\n" for line in notes)  # under the table, and in the Markdown copy
    planned: list[tuple[str, Callable[[str], object]]] = [
        (f"{stem}.md", lambda path: Path(path).write_text(
            result_tables.format_markdown(groups) + (f"\n{note}" if note else ""), "utf-8")),
        (f"{stem}.csv", lambda path: result_tables.write_csv(groups, path)),
        (f"{stem}.json", lambda path: result_tables.write_json(groups, path)),
    ]
    if metric == "ppl":
        planned += [("fig5_tradeoffs.png", lambda path: figures.plot_tradeoffs(groups, path)),
                    ("fig3_perplexity_curves.png", lambda path: figures.plot_error_curves(groups, path))]
    else:
        planned.append(("fig2_cer_tradeoffs.png", lambda path: figures.plot_cer_tradeoffs(groups, path)))
        sizes = list(dict.fromkeys(g.first.num_experts for g in groups))
        for size in sizes:
            name = "fig3_error_curves.png" if len(sizes) == 1 else \
                f"fig3_error_curves_{_file_tag(size)}.png"
            members = [g for g in groups if g.first.num_experts == size]
            planned.append((name, lambda path, members=members: figures.plot_error_curves(members, path)))
    if matrices:
        planned += [
            ("eval_matrix.md", lambda path: Path(path).write_text(
                matrix_table.format_summary(matrices, markdown=True), "utf-8")),
            ("eval_matrix.csv", lambda path: matrix_table.write_csv(matrices, path)),
            ("eval_matrix.json", lambda path: matrix_table.write_json(matrices, path)),
            ("fig_eval_matrix.png", lambda path: figures.plot_eval_matrix(matrices, path))]
    if pairs:
        planned.append(("fig4_replay.png", lambda path: figures.plot_replay(pairs, path)))
    refuse_non_files_among_outputs(out, [name for name, _ in planned])
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--out {out}: cannot create ({err.strerror})") from None
    names = [name for name, _ in planned]
    try:
        with StagedOutputs(STAGING_PREFIX) as staged:
            for name, write in planned:
                try:
                    write(staged.path_for(out / name))
                except OSError as err:
                    raise UsageError(f"{out / name}: cannot write ({err.strerror or err})") from None
            try:  # all drawn: only now does --out change (all files, or none on a failure)
                staged.publish()
            except OSError as err:
                raise UsageError(f"{err.filename}: cannot replace it ({err.strerror}); --out is as "
                                 f"it was: remove or rename that entry, or use another --out") from None
    finally:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # a report that failed leaves no empty --out behind
    write_stdout(table + note)
    if matrices:
        print("\nEach stage on every period (alma-score --matrix; README, Streams that drift)\n"
              + matrix_table.format_summary(matrices), end="", flush=True)
    elif metric == "ppl":
        print("eval matrix not drawn: no input was scored with alma-score --matrix", flush=True)
    if not pairs:
        print("Fig. 4 not drawn: no two runs differ only by --replay (measured alike)", flush=True)
    written = [str(out / name) for name in names]
    _remove_stale_outputs(out, written)
    return written


# every file name write_report can write; {tag}: a model size (fig3_error_curves_{tag}.png)
REPORT_OUTPUTS = ("table2.md", "table2.csv", "table2.json", "cer_table.md", "cer_table.csv",
                  "cer_table.json", "fig5_tradeoffs.png", "fig3_perplexity_curves.png",
                  "fig2_cer_tradeoffs.png", "fig3_error_curves.png", "fig3_error_curves_*.png",
                  "eval_matrix.md", "eval_matrix.csv", "eval_matrix.json", "fig_eval_matrix.png",
                  "fig4_replay.png")


def _is_report_output(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in REPORT_OUTPUTS)


def refuse_inputs_among_outputs(inputs: list[str], out: str) -> None:
    """One line (``UsageError``), before anything is read or written, when an input file sits
    in ``out`` under a name this command writes or removes there (``REPORT_OUTPUTS``).

    Why: an ``alma-score --json`` saved as ``report/table2.json`` and given with ``--out
    report`` was replaced by the report's table (and the same command then refused its own
    output), or deleted as "left by an earlier report": the scored numbers were lost, exit 0.
    The entry compared is the one the report would touch (its folder resolved) and the file
    it points to, so a symbolic link either way is caught too."""
    folder = os.path.realpath(out)
    for given in inputs:
        path = Path(given)
        if not path.is_file():
            continue
        entries = {os.path.join(os.path.realpath(path.parent), path.name), os.path.realpath(path)}
        for entry in entries:
            if os.path.dirname(entry) == folder and _is_report_output(os.path.basename(entry)):
                raise UsageError(f"--out {out} would overwrite or remove the input {given} "
                                 f"({os.path.basename(entry)} is a file alma-report writes there); "
                                 f"use another --out, or move that file out of it")


STAGING_PREFIX = ".alma-report-"  # write_report's staging folder in --out (StagedOutputs)


def refuse_non_files_among_outputs(out: Path, names: list[str]) -> None:
    """One line (``UsageError``), before anything is drawn, when an entry of ``out`` under a name
    the report is about to write is not a file (a directory, a socket): the move into place
    would fail only after the other files were drawn.  A symbolic link is replaced, as a file."""
    for name in names:
        try:
            mode = os.lstat(out / name).st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            raise UsageError(f"{out / name}: not a file, and alma-report writes {name} there; "
                             f"remove or rename it, or use another --out")


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (kill, a scheduler's stop) handled as Ctrl-C while the block runs: the staging
    folder is removed and ``run_console`` prints its one line, instead of an exit by signal that
    left the staging folder in --out.  Only the main thread can take signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:  # noqa: ARG001
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _remove_stale_outputs(out: Path, written: list[str]) -> None:
    """Delete what an earlier report left in ``out`` that this one did not write (say a Fig. 4
    of runs no longer given): beside the new tables it would pass for part of this report.
    Only file names this command writes are touched."""
    kept = {Path(path).name for path in written}
    for pattern in REPORT_OUTPUTS:
        for path in sorted(out.glob(pattern)):
            if path.name not in kept and path.is_file():
                try:
                    path.unlink()
                except OSError as err:
                    raise UsageError(f"{path}: left by an earlier report and cannot be removed "
                                     f"({err.strerror}); remove it or use another --out") from None
                print(f"removed {path.name}, left in --out by an earlier report", flush=True)


def run(args: argparse.Namespace) -> int:
    with _sigterm_as_interrupt():
        written = write_report(args)
    print("wrote " + ", ".join(written), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Console entry point ``alma-report``; exit status 2 with one line on bad input."""
    args = build_parser().parse_args(argv)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    return run_console("alma-report", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
