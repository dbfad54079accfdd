"""What a scoring publishes: Table 2 and its notes as text, the JSON, the CSV and Fig. 5.

Why here and not in the command: the JSON (the report's dict plus how each number was obtained)
is what ``alma-report`` and ``alma-sweep score`` read back, so a library caller must be able to
write exactly what ``alma-score --json`` writes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

from ..errors import UsageError
from ..stream.period_matrix import PeriodMatrix, format_matrix
from ..stream.series import ReportSeries
from .series import ScoredSeries


def results_text(results: list[ScoredSeries]) -> str:
    """Table 2, one line per distinct --max-eval-tokens slice (runs may differ in block length),
    and each --matrix; ``UsageError`` when the series cannot share a table (e.g. runs of
    different stream lengths)."""
    from ..report import result_tables

    try:
        text = result_tables.format_series_table(displayed(results))
        notes = dict.fromkeys(extra[key] for key in ("split_note", "eval_slice_note")
                              for _, extra in results if key in extra)
        text += "".join(f"{note}\n" for note in notes)
        for one, extra in results:
            if "eval_matrix" in extra:
                matrix = PeriodMatrix.from_json(extra["eval_matrix"])
                text += "\n" + format_matrix(matrix, f"{one.setting} ({extra['runs'][0]})")
    except ValueError as err:
        raise UsageError(str(err)) from None
    return text


def displayed(results: list[ScoredSeries]) -> list[ReportSeries]:
    """The series as the table, CSV and figure show them: rows that would share a name and size
    (two runs whose flags give one setting name, seeds of one setting, or one --setting for
    several runs) get their run directory in the name, since a table of two 'SM_w1' rows does
    not say which is which.  The JSON keeps the names (alma-report groups seeds by them and
    names the settings they differ by)."""
    names = Counter((series.setting, series.num_experts) for series, _ in results)
    return [replace(series, setting=f"{series.setting} [{extra['runs'][0]}]")
            if names[series.setting, series.num_experts] > 1 else series for series, extra in results]


def results_json(results: list[ScoredSeries]) -> dict[str, Any]:
    """The report's dict, plus each arrival's members and each series' ``scoring`` extras."""
    from ..report import result_tables

    payload = result_tables.report_dict([series for series, _ in results])
    payload["written_by"] = "alma-score"  # an input of alma-report, which a report's table is not
    for entry, (_, extra) in zip(payload["series"], results, strict=True):
        extra = dict(extra)
        members = extra.pop("members_by_arrival")
        for arrival, used in zip(entry["arrivals"], members, strict=True):
            arrival["members"] = used
        if "eval_matrix" in extra:
            entry["eval_matrix"] = extra.pop("eval_matrix")
        entry["scoring"] = extra
    return payload


def write_results(results: list[ScoredSeries], json_path: str | None = None,
                  csv_path: str | None = None, plot_path: str | None = None) -> None:
    """The files asked for (None: not written); one line (``UsageError``) naming the file when
    one cannot be.

    Why all are drawn first (``StagedOutputs``) and moved into place only once every one is:
    written one after another, a failure of the figure (full disk, a file-size limit, Ctrl-C)
    left a JSON and CSV of this scoring beside the Fig. 5 of the previous one."""
    from ..report import figures, result_tables
    from ..stream.atomic import atomic_write_json
    from ..stream.staged_outputs import StagedOutputs

    series = displayed(results)
    ppl = bool(series) and series[0].metric == "ppl"
    writers = [  # the series' own names in the JSON: alma-report groups seeds by them
        (json_path, lambda path: atomic_write_json(path, results_json(results))),
        (csv_path, lambda path: result_tables.write_csv(series, path)),
        (plot_path, lambda path: (figures.plot_tradeoffs if ppl else figures.plot_error_curves)(
            series, path)),
    ]
    with StagedOutputs(STAGING_PREFIX) as staged:
        for target, write in writers:
            if not target:
                continue
            path = target
            try:
                path = staged.path_for(target)
                write(path)
            except ValueError as err:  # the message names the staged file: name the target
                raise UsageError(str(err).replace(path, target)) from None
            except OSError as err:
                raise cannot_write(err, target) from None
        try:
            staged.publish()
        except OSError as err:
            raise cannot_write(err, err.filename) from None


STAGING_PREFIX = ".alma-score-"  # write_results' staging directories, next to each output


def cannot_write(err: OSError, path: str | None = None) -> UsageError:
    """The one line for an output that could not be written (a file, or stdout): ``path``, the
    file being written (an error of a write to an open file names none)."""
    what = path or err.filename or "the output"
    return UsageError(f"{what}: cannot write ({err.strerror or err}); free space or give "
                      f"another path, and run the same command again")
