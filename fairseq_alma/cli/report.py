"""Render stream results the way the paper shows them: Table 2 (App. D), Figs. 2, 3 and 5.

Rendering only: the numbers come from ``stream.jsonl`` records or from ``alma-score``'s own
evaluation, as ``ReportSeries`` — one per run (or ensemble) — holding per-arrival lists indexed by
arrival t = 0 … B (t = 0 is the model before any data).

Naming of arrivals: Table 2 labels the perplexity after the first mega-batch "t0", so the LM table
and CSV columns t0 … t(B-1) are arrivals 1 … B; Eq. 1 (vision, CER) counts t = 0 … B with t = 0
the untrained model, so the vision CSV columns error_t0 … error_tB are arrivals 0 … B.  The JSON
always says ``arrival`` explicitly.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence

from ..stream.atomic import atomic_write_bytes, atomic_write_json, atomic_write_text
from ..stream.series import ReportSeries, series_from_records
from ..tables import format_table as _format_cells

__all__ = [
    "ReportSeries",
    "format_table",
    "plot_cer_tradeoffs",
    "plot_error_curves",
    "plot_tradeoffs",
    "report_dict",
    "series_from_records",
    "write_csv",
    "write_json",
]


def _same_shape(series: Sequence[ReportSeries]) -> tuple[str, int]:
    if not series:
        raise ValueError("no series to report; pass at least one run")
    kinds = {(s.metric, s.num_megabatches) for s in series}
    if len(kinds) != 1:
        raise ValueError(
            f"series mix metrics or stream lengths {sorted(kinds)}; report them separately"
        )
    return kinds.pop()


def _millions(count: float) -> str:
    value = count / 1e6
    return f"{value:.3g}M" if value < 1000 else f"{value:.0f}M"


def _number(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


def _lm_rows(series: Sequence[ReportSeries]) -> tuple[list[str], list[list[str]]]:
    _, b = _same_shape(series)
    header = ["setting", "#experts", "params"] + [f"t{i}" for i in range(b)]
    header += ["avg ppl", "cum TFLOPs", "cum params"]
    rows = []
    for s in series:
        summary = s.summary()
        ppl = [f"{s.metric_by_arrival[t]:.2f}" if s.seen[t] else "*" for t in range(1, b + 1)]
        rows.append(
            [s.setting, s.num_experts, _millions(s.params)]
            + ppl
            + [
                f"{summary['avg_ppl']:.2f}",
                _number(summary["train_tflops_cum"]),
                _millions(summary["params_cum"]),
            ]
        )
    return header, rows


def _vision_rows(series: Sequence[ReportSeries]) -> tuple[list[str], list[list[str]]]:
    header = ["setting", "size", "params", "final error", "CER", "cum TFLOPs", "cum params"]
    rows = []
    for s in series:
        summary = s.summary()
        rows.append(
            [
                s.setting,
                s.num_experts,
                _millions(s.params),
                f"{summary['final_error']:.4f}",
                f"{summary['cer']:.3f}",
                _number(summary["train_tflops_cum"]),
                _millions(summary["params_cum"]),
            ]
        )
    return header, rows


def format_table(series: Sequence[ReportSeries]) -> str:
    """Table 2's layout for LMs ('*' = not yet trained at that arrival; average over the trained
    arrivals), or the CER table for vision (§3.1), plus cumulative TFLOPs and parameters."""
    metric, _ = _same_shape(series)
    header, rows = _lm_rows(series) if metric == "ppl" else _vision_rows(series)
    return _format_cells(header, rows, left=2)


def report_dict(series: Sequence[ReportSeries]) -> dict:
    """Everything the table and plots show, per arrival, as plain JSON-able data."""
    metric, b = _same_shape(series)
    out = []
    for s in series:
        averages = s.average_by_arrival() if metric == "ppl" else [None] * (b + 1)
        arrivals = [
            {
                "arrival": t,
                "trained": s.trained[t],
                "trained_so_far": s.seen[t],
                metric: s.metric_by_arrival[t],
                "train_flops_cum": s.train_flops_cum[t],
                "params": s.params_by_arrival[t],
                "params_cum": s.params_cum[t],
            }
            | ({"avg_ppl_so_far": averages[t]} if metric == "ppl" else {})
            for t in range(b + 1)
        ]
        out.append(
            {
                "setting": s.setting,
                "num_experts": s.num_experts,
                "params": s.params,
                "summary": s.summary(),
                "arrivals": arrivals,
            }
        )
    return {"metric": metric, "num_megabatches": b, "series": out}


def write_json(series: Sequence[ReportSeries], path: str | os.PathLike) -> None:
    """``report_dict`` as JSON, written atomically."""
    atomic_write_json(path, report_dict(series))


def write_csv(series: Sequence[ReportSeries], path: str | os.PathLike) -> None:
    """One row per series, the table's columns with full precision (see module doc for t names)."""
    metric, b = _same_shape(series)
    if metric == "ppl":
        arrival_columns = [f"ppl_t{i}" for i in range(b)]
        summary_keys = ["avg_ppl", "train_tflops_cum", "params_cum"]
    else:
        arrival_columns = [f"error_t{i}" for i in range(b + 1)]
        summary_keys = ["final_error", "cer", "train_tflops_cum", "params_cum"]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    size_column = "num_experts" if metric == "ppl" else "size"
    writer.writerow(["setting", size_column, "params"] + arrival_columns + summary_keys)
    for s in series:
        if metric == "ppl":
            values = [repr(s.metric_by_arrival[t]) if s.seen[t] else "" for t in range(1, b + 1)]
        else:
            values = [repr(v) for v in s.metric_by_arrival]
        summary = s.summary()
        writer.writerow(
            [s.setting, s.num_experts, s.params]
            + values
            + [repr(float(summary[key])) for key in summary_keys]
        )
    atomic_write_text(path, buffer.getvalue())


# ---------------------------------------------------------------- plots (matplotlib, no pyplot)


def _figure(columns: int):
    """A figure drawn by the Agg canvas directly: no pyplot global state, no display needed."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.0 * columns, 4.5), dpi=110, layout="constrained")
    return figure, [figure.add_subplot(1, columns, i + 1) for i in range(columns)]


def _save(figure, path: str | os.PathLike) -> None:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    atomic_write_bytes(path, buffer.getvalue())


def _label(axis, text: str, x: float, y: float, color: str) -> None:
    axis.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8, color=color)


def _finish(figure, axes_xlabels, ylabel: str, title: str, path: str | os.PathLike) -> None:
    """Shared styling: x labels, log x where the points span over a decade (model sizes and
    budgets grow geometrically), y label, grid, legend on the last panel, title; then save."""
    for axis, xlabel, xs in axes_xlabels:
        axis.set_xlabel(xlabel)
        if xs is not None and min(xs) > 0 and max(xs) / min(xs) > 10:
            axis.set_xscale("log")
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
    axes_xlabels[-1][0].legend(fontsize=8)
    figure.suptitle(title)
    _save(figure, path)


_MARKERS = "osD^vP*Xph<>"


def _check_metric(series: Sequence[ReportSeries], wanted: str, what: str, instead: str) -> int:
    metric, b = _same_shape(series)
    if metric != wanted:
        raise ValueError(f"{what}; use {instead} for these series")
    return b


def plot_tradeoffs(series: Sequence[ReportSeries], path: str | os.PathLike) -> None:
    """Fig. 5: average perplexity vs cumulative training compute and vs parameters.

    One trajectory per series, a point per arrival once the model has been trained (the average
    over the trained arrivals so far, §6.2), the last point labelled with the #experts.
    """
    _check_metric(series, "ppl", "plot_tradeoffs draws LM perplexity", "plot_cer_tradeoffs")
    figure, (by_compute, by_params) = _figure(2)
    all_flops, all_params = [], []
    for i, s in enumerate(series):
        points = [
            (s.train_flops_cum[t] / 1e12, s.params_by_arrival[t] / 1e6, avg)
            for t, avg in enumerate(s.average_by_arrival())
            if avg is not None
        ]
        flops, params, averages = zip(*points, strict=True)
        all_flops += flops
        all_params += params
        style = {"marker": _MARKERS[i % len(_MARKERS)], "label": f"{s.setting} ({s.num_experts})"}
        for axis, xs in ((by_compute, flops), (by_params, params)):
            line = axis.plot(xs, averages, **style)[0]
            _label(axis, s.num_experts, xs[-1], averages[-1], line.get_color())
    panels = [
        (by_compute, "cumulative training compute (TFLOPs)", all_flops),
        (by_params, "parameters |θ| (millions)", all_params),
    ]
    title = "Language modelling trade-offs (ALMA Fig. 5)"
    _finish(figure, panels, "average perplexity over the stream", title, path)


def plot_error_curves(series: Sequence[ReportSeries], path: str | os.PathLike) -> None:
    """Fig. 3: test error rate after every arrival t = 0 … B, one line per series."""
    from matplotlib.ticker import MaxNLocator

    b = _check_metric(series, "error", "plot_error_curves draws test error", "plot_tradeoffs")
    figure, (axis,) = _figure(1)
    for i, s in enumerate(series):
        marker = _MARKERS[i % len(_MARKERS)] if b <= 30 else None
        label = f"{s.setting} ({s.num_experts})"
        axis.plot(range(b + 1), s.metric_by_arrival, marker=marker, markersize=4, label=label)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_ylim(0, 1)
    panels = [(axis, "mega-batches arrived (t)", None)]
    _finish(figure, panels, "test error rate", "Error rate over the stream (ALMA Fig. 3)", path)


def plot_cer_tradeoffs(series: Sequence[ReportSeries], path: str | os.PathLike) -> None:
    """Fig. 2: CER vs cumulative training compute and vs memory (Σ|θ_t|), one point per series.

    Points of the same ``setting`` (method and waiting time) share a colour and are joined in
    order of cost, so each line shows the effect of model size; points are labelled with the size.
    """
    _check_metric(series, "error", "plot_cer_tradeoffs draws vision CER", "plot_tradeoffs")
    figure, (by_compute, by_memory) = _figure(2)
    groups: dict[str, list[ReportSeries]] = {}
    for s in series:
        groups.setdefault(s.setting, []).append(s)
    for i, (setting, members) in enumerate(groups.items()):
        summaries = [(m.summary(), m.num_experts) for m in members]
        for axis, key, scale in (
            (by_compute, "train_tflops_cum", 1),
            (by_memory, "params_cum", 1e-6),
        ):
            points = sorted((sm[key] * scale, sm["cer"], label) for sm, label in summaries)
            xs, ys, _ = zip(*points, strict=True)
            line = axis.plot(xs, ys, marker=_MARKERS[i % len(_MARKERS)], label=setting)[0]
            for x, y, label in points:
                _label(axis, label, x, y, line.get_color())
    summaries = [s.summary() for s in series]
    panels = [
        (
            by_compute,
            "cumulative training compute (TFLOPs)",
            [m["train_tflops_cum"] for m in summaries],
        ),
        (
            by_memory,
            "memory: cumulative parameters Σ|θ_t| (millions)",
            [m["params_cum"] for m in summaries],
        ),
    ]
    title = "CER vs compute and memory (ALMA Fig. 2)"
    _finish(figure, panels, "cumulative error rate (CER)", title, path)


def load_report_json(path: str | os.PathLike) -> list[ReportSeries]:
    """Series back from a ``write_json`` file (so several alma-score outputs share one table)."""
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    series = []
    for entry in data["series"]:
        arrivals = entry["arrivals"]
        series.append(
            ReportSeries(
                setting=entry["setting"],
                num_experts=entry["num_experts"],
                metric_by_arrival=[a[data["metric"]] for a in arrivals],
                train_flops_cum=[a["train_flops_cum"] for a in arrivals],
                params_by_arrival=[a["params"] for a in arrivals],
                trained=[a["trained"] for a in arrivals],
                metric=data["metric"],
            )
        )
    return series
