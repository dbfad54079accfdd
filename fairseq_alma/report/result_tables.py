"""Table 2 (App. D) for language models, and the CER table (§3.1, Eq. 1) for vision: text,
Markdown, CSV and JSON.

Rendering only: the numbers come from ``stream.jsonl`` records or from ``alma-score``'s own
evaluation, as ``ReportSeries`` (one per run or ensemble), or as ``SeedGroup``s (runs that
differ only by seed, ``report/seeds.py``).  A series is a group of one, so every table goes
through one path; cells of groups with several seeds read ``mean ± std`` and a ``seeds`` column
says how many; with one seed per row the layout is exactly the paper's.

Naming of arrivals: Table 2 labels the perplexity after the first mega-batch "t0", so the LM table
and CSV columns t0 … t(B-1) are arrivals 1 … B; Eq. 1 (vision, CER) counts t = 0 … B with t = 0
the untrained model, so the vision CSV columns error_t0 … error_tB are arrivals 0 … B.  The JSON
always says ``arrival`` explicitly.

LM summary columns, both labelled (``stream/metrics.py``): "avg ppl (trained)" is the paper's
average over the arrivals after the first training; "anytime ppl" = 2 ** the mean cross-entropy
in bits over every arrival, the waiting ones charged with the initialised model.  For a seed
group every number is the mean over seeds of each seed's number, with its sample standard
deviation, except the anytime perplexity: 2 ** (the mean over seeds of ``anytime_nll``), its
spread given in bits (``seeds.BitsAsPerplexity``).  One field per unit, the same in the table,
CSV, JSON and Fig. 5: ``anytime_nll`` (bits) and ``anytime_ppl`` = 2 ** ``anytime_nll``; per
arrival, ``anytime_nll_so_far``.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from typing import Any

from ..stream.atomic import atomic_write_json, atomic_write_text
from ..stream.series import ReportSeries
from ..text_table import format_table as _format_cells
from .seeds import BitsAsPerplexity, ReportedRun, SeedGroup, Stat, canonical

Rows = Sequence[ReportSeries] | Sequence[SeedGroup]
LM_SUMMARY = ("trained_avg_ppl", "anytime_nll", "anytime_ppl", "train_tflops_cum", "params_cum")
VISION_SUMMARY = ("final_error", "cer", "train_tflops_cum", "params_cum")


def as_groups(rows: Rows) -> list[SeedGroup]:
    """Series become groups of one; groups pass through."""
    return [row if isinstance(row, SeedGroup) else SeedGroup([ReportedRun(row, row.setting)])
            for row in rows]


def same_shape(rows: Rows) -> tuple[str, int]:
    """(metric, B) shared by every row; rows that cannot share a table are refused: other
    metrics or stream lengths, other FLOPs conventions, or numbers measured on other streams
    (a perplexity depends on the dictionary and the evaluation split; a vision test error on
    the data set, whose sha256 is its identity, ``inputs.logged_scoring``)."""
    if not rows:
        raise ValueError("no series to report; pass at least one run")
    runs = [run for group in as_groups(rows) for run in group.runs]
    first = runs[0]
    for run in runs[1:]:
        if (run.series.metric, run.series.num_megabatches) != (first.series.metric,
                                                               first.series.num_megabatches):
            def kind(one: ReportedRun) -> str:
                metric = "perplexity" if one.series.metric == "ppl" else "test error"
                return f"{metric}, B = {one.series.num_megabatches}"

            raise ValueError(f"{first.source} ({kind(first)}) and {run.source} ({kind(run)}) are "
                             f"not one stream's results; report them separately")
    evaluated_on: dict[str, str] = {}  # stream identity (canonical) -> a source scored on it
    for group in as_groups(rows):
        for run in group.runs:
            data = (run.scoring or {}).get("data")
            if isinstance(data, dict):  # a verified identity (a path: the stream is gone, unknown)
                evaluated_on.setdefault(canonical(data), run.source)
    if len(evaluated_on) > 1:
        first, second = list(evaluated_on.values())[:2]
        if runs[0].series.metric == "error":
            raise ValueError(f"{first} and {second} were evaluated on different data (their data "
                             f"sets' sha256 differ: another data set or test set); their test "
                             f"errors are not comparable, report them separately")
        raise ValueError(
            f"{first} and {second} were evaluated on different streams (their data identities "
            f"differ: another corpus, split or dictionary); their perplexities are not comparable, "
            f"report them separately"
        )
    conventions = {run.series.flops_convention for run in runs}
    if len(conventions) > 1:
        raise ValueError(
            f"series count FLOPs with different --flops-convention {sorted(map(str, conventions))}; "
            f"report them separately (their compute is not comparable)"
        )
    return first.series.metric, first.series.num_megabatches


def _millions(count: float) -> str:
    value = count / 1e6
    return f"{value:.3g}M" if value < 1000 else f"{value:.0f}M"


def _number(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


def _cell(value: Stat | None, fmt: str = ".2f") -> str:
    """``mean`` for one seed, ``mean ± std`` for several, ``n/a`` where undefined."""
    if value is None:
        return "n/a"
    if value.std is None:
        return format(value.mean, fmt)
    return f"{value.mean:{fmt}} ± {value.std:{fmt}}"


def _anytime_cell(value: BitsAsPerplexity | Stat | None) -> str:
    """The anytime perplexity; a group's with the spread of its bits (module doc)."""
    if isinstance(value, BitsAsPerplexity) and value.bits.std is not None:
        return f"{value.mean:.2f} ± {value.bits.std:.3f} bits"
    return _cell(value)


def _mean(value: Stat | None) -> float:
    if value is None:
        raise ValueError("a cost is undefined for a run; every run records its FLOPs and |θ|")
    return value.mean


def _lm_rows(groups: list[SeedGroup], b: int, seeds: bool) -> tuple[list[str], list[list[str]]]:
    header = ["setting", "#experts"] + (["seeds"] if seeds else []) + ["params"]
    header += [f"t{i}" for i in range(b)]
    header += ["avg ppl (trained)", "anytime ppl", "cum TFLOPs", "cum params"]
    rows = []
    for g in groups:
        summary, ppl = g.summary(), g.by_arrival(lambda s: s.metric_by_arrival)
        cells = [_cell(ppl[t]) if g.seen[t] else "*" for t in range(1, b + 1)]
        rows.append(
            [g.first.setting, g.first.num_experts] + ([str(g.n)] if seeds else [])
            + [_millions(_mean(g.over_seeds(lambda s: s.params)))]
            + cells
            + [
                _cell(summary["trained_avg_ppl"]),
                _anytime_cell(summary["anytime_ppl"]),
                _number(_mean(summary["train_tflops_cum"])),
                _millions(_mean(summary["params_cum"])),
            ]
        )
    return header, rows


def _vision_rows(groups: list[SeedGroup], seeds: bool) -> tuple[list[str], list[list[str]]]:
    header = ["setting", "size"] + (["seeds"] if seeds else [])
    header += ["params", "final error", "CER", "cum TFLOPs", "cum params"]
    rows = []
    for g in groups:
        summary = g.summary()
        rows.append(
            [g.first.setting, g.first.num_experts] + ([str(g.n)] if seeds else [])
            + [
                _millions(_mean(g.over_seeds(lambda s: s.params))),
                _cell(summary["final_error"], ".4f"),
                _cell(summary["cer"], ".3f"),
                _number(_mean(summary["train_tflops_cum"])),
                _millions(_mean(summary["params_cum"])),
            ]
        )
    return header, rows


def _cells(rows: Rows) -> tuple[list[str], list[list[str]]]:
    metric, b = same_shape(rows)
    groups = as_groups(rows)
    seeds = any(g.n > 1 for g in groups)
    return _lm_rows(groups, b, seeds) if metric == "ppl" else _vision_rows(groups, seeds)


def format_series_table(rows: Rows) -> str:
    """Table 2's layout for LMs ('*' = not yet trained at that arrival), with both stream
    averages (module doc); or the CER table for vision; plus cumulative TFLOPs and parameters."""
    header, cells = _cells(rows)
    return _format_cells(header, cells, left=2)


def format_markdown(rows: Rows) -> str:
    """``format_series_table`` as a GitHub Markdown table (for READMEs, papers' supplements)."""
    header, cells = _cells(rows)
    return _format_cells(header, cells, left=2, markdown=True)


def _series_entry(s: ReportSeries) -> dict[str, Any]:
    """One series, every number per arrival."""
    averages = s.average_by_arrival() if s.metric == "ppl" else [None] * len(s.trained)
    anytime = s.anytime_by_arrival() if s.metric == "ppl" else [None] * len(s.trained)
    arrivals = [
        {
            "arrival": t,
            "trained": s.trained[t],
            "trained_so_far": s.seen[t],
            s.metric: s.metric_by_arrival[t],
            "train_flops_cum": s.train_flops_cum[t],
            "params": s.params_by_arrival[t],
            "params_cum": s.params_cum[t],
        }
        | ({"trained_avg_ppl_so_far": averages[t], "anytime_nll_so_far": anytime[t]}
           if s.metric == "ppl" else {})
        for t in range(len(s.trained))
    ]
    return {
        "setting": s.setting,
        "num_experts": s.num_experts,
        "flops_convention": s.flops_convention,
        "params": s.params,
        "summary": s.summary(),
        "arrivals": arrivals,
    }


def mean_series(group: SeedGroup) -> ReportSeries:
    """The per-arrival means of a group, as one series (what its figures and JSON draw)."""
    if group.n == 1:
        return group.first

    def means(values: list[Stat | None]) -> list[float | None]:
        return [None if v is None else v.mean for v in values]

    first = group.first
    return ReportSeries(
        setting=first.setting, num_experts=first.num_experts,
        metric_by_arrival=means(group.by_arrival(lambda s: s.metric_by_arrival)),
        train_flops_cum=[_mean(v) for v in group.by_arrival(lambda s: s.train_flops_cum)],
        params_by_arrival=[round(_mean(v)) for v in group.by_arrival(lambda s: s.params_by_arrival)],
        trained=group.trained, metric=first.metric, flops_convention=first.flops_convention)


def _group_entry(group: SeedGroup) -> dict[str, Any]:
    """A group's JSON: its mean series (the layout of one series), and for several seeds the
    summary over seeds (``summary`` = the means, ``summary_std``), seeds, runs and members."""
    entry = _series_entry(mean_series(group))
    if group.n == 1:
        return entry
    summary = group.summary()
    metric = group.first.metric
    spread = group.by_arrival(lambda s: s.metric_by_arrival)
    for arrival, value in zip(entry["arrivals"], spread, strict=True):
        arrival[f"{metric}_std"] = None if value is None else value.std
    if metric == "ppl":  # running summaries: each seed's, averaged (the summary's rule)
        for key, running in (("trained_avg_ppl_so_far", lambda s: s.average_by_arrival()),
                             ("anytime_nll_so_far", lambda s: s.anytime_by_arrival())):
            for arrival, value in zip(entry["arrivals"], group.by_arrival(running), strict=True):
                arrival[key] = None if value is None else value.mean
    entry["summary"] = {key: None if v is None else v.mean for key, v in summary.items()}
    entry["summary_std"] = {key: None if v is None else v.std for key, v in summary.items()}
    entry["seeds"] = [None if run.seed is None else list(run.seed) for run in group.runs]
    entry["runs"] = [run.source for run in group.runs]
    entry["members"] = [_series_entry(s) for s in group.members]
    return entry


# marks a report's JSON: its rows are means over seeds without the runs behind them, so a
# report is never an input of another (``report/inputs.read_score_json``)
REPORT_WRITER = "alma-report"


def report_dict(rows: Rows) -> dict:
    """Everything the table and figures show, per arrival, as plain JSON-able data."""
    metric, b = same_shape(rows)
    return {"written_by": REPORT_WRITER, "metric": metric, "num_megabatches": b,
            "series": [_group_entry(g) for g in as_groups(rows)]}


def write_json(rows: Rows, path: str | os.PathLike) -> None:
    """``report_dict`` as JSON, written atomically."""
    atomic_write_json(path, report_dict(rows))


def write_csv(rows: Rows, path: str | os.PathLike) -> None:
    """One row per series or group, the table's columns with full precision (see module doc
    for t names); with several seeds in any row, a ``seeds`` column and ``<number>_std``
    columns follow the means."""
    metric, b = same_shape(rows)
    groups = as_groups(rows)
    seeds = any(g.n > 1 for g in groups)
    if metric == "ppl":
        arrival_columns = [f"ppl_t{i}" for i in range(b)]
        keys, first_arrival = LM_SUMMARY, 1
    else:
        arrival_columns = [f"error_t{i}" for i in range(b + 1)]
        keys, first_arrival = VISION_SUMMARY, 0

    def number(value: Stat | None, part: str = "mean") -> str:
        value = None if value is None else getattr(value, part)
        return "" if value is None else repr(float(value))

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    size_column = "num_experts" if metric == "ppl" else "size"
    header = ["setting", size_column] + (["seeds"] if seeds else []) + ["params"]
    header += arrival_columns + list(keys)
    if seeds:
        header += [f"{c}_std" for c in arrival_columns] + [f"{k}_std" for k in keys]
    writer.writerow(header)
    for g in groups:
        values = g.by_arrival(lambda s: s.metric_by_arrival)[first_arrival:]
        shown = [v if metric == "error" or g.seen[t] else None
                 for t, v in enumerate(values, start=first_arrival)]
        summary = g.summary()
        params = g.over_seeds(lambda s: s.params)
        row = [g.first.setting, g.first.num_experts] + ([str(g.n)] if seeds else [])
        row += [str(round(_mean(params)))] + [number(v) for v in shown]
        row += [number(summary[key]) for key in keys]
        if seeds:
            row += [number(v, "std") for v in shown] + [number(summary[k], "std") for k in keys]
        writer.writerow(row)
    atomic_write_text(path, buffer.getvalue())


def load_report_json(path: str | os.PathLike) -> list[ReportSeries]:
    """Series back from a ``write_json`` file (so several alma-score outputs share one table);
    a group's entry gives its mean series."""
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    return [series_from_entry(entry, data["metric"]) for entry in data["series"]]


def series_from_entry(entry: dict[str, Any], metric: str) -> ReportSeries:
    """One ``report_dict`` series entry back as a ``ReportSeries``."""
    arrivals = entry["arrivals"]
    return ReportSeries(
        setting=entry["setting"],
        num_experts=entry["num_experts"],
        metric_by_arrival=[a[metric] for a in arrivals],
        train_flops_cum=[a["train_flops_cum"] for a in arrivals],
        params_by_arrival=[a["params"] for a in arrivals],
        trained=[a["trained"] for a in arrivals],
        metric=metric,
        flops_convention=entry.get("flops_convention", "full" if metric == "ppl" else None),
    )
