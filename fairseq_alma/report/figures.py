"""The paper's figures from stream results: Figs. 2, 3, 4 and 5 (matplotlib, no pyplot).

Each function takes ``ReportSeries`` or ``SeedGroup``s (runs that differ only by seed,
``report/seeds.py``) and writes one PNG atomically.  A group is drawn at its mean over seeds,
with error bars (or a band) of one standard deviation; a single run has none.

  Fig. 2  CER vs cumulative training compute and vs memory (Σ|θ_t|), vision (§6.1)
  Fig. 3  the metric after every arrival t = 0..B, one line per run (§6.1; for LMs perplexity)
  Fig. 4  replay: an arrow from each run without replay to the same run with replay (§6.1)
  Fig. 5  LMs: average perplexity vs cumulative compute, vs parameters and vs number of experts
          (§6.2); the top row is the paper's average over trained arrivals, the bottom row the
          anytime perplexity, which charges the arrivals before the first training
  issue 14  the stage x period matrix of ``alma-score --matrix`` as heatmaps (plot_eval_matrix)
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..stream.atomic import atomic_write_bytes
from ..stream.series import ReportSeries
from .matrix_table import MatrixGroup
from .result_tables import Rows, as_groups, same_shape
from .seeds import SeedGroup, Stat, seeds_text

_MARKERS = "osD^vP*Xph<>"


def _figure(rows: int, columns: int) -> tuple[Any, list[list[Any]]]:
    """A figure drawn by the Agg canvas directly: no pyplot global state, no display needed."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.0 * columns, 4.5 * rows), dpi=110, layout="constrained")
    axes = [[figure.add_subplot(rows, columns, r * columns + c + 1) for c in range(columns)]
            for r in range(rows)]
    return figure, axes


# the formats a figure is written in, chosen by the file's extension (a paper wants PDF or SVG)
PLOT_FORMATS = ("png", "pdf", "svg")


def plot_format(path: str | os.PathLike) -> str | None:
    """The format ``path``'s extension asks for, or None when it names none of PLOT_FORMATS."""
    extension = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
    return extension if extension in PLOT_FORMATS else None


def check_plot_path(flag: str, path: str | os.PathLike) -> None:
    """Refuse, before any work, a figure path whose extension names no format we write: the
    file would otherwise hold a PNG under another name (a ``fig.svg`` that is not SVG)."""
    if plot_format(path) is None:
        from ..errors import UsageError

        raise UsageError(f"{flag} {path}: give a file ending in "
                         f"{', '.join('.' + f for f in PLOT_FORMATS)} (the format follows the extension)")


def _save(figure: Any, path: str | os.PathLike) -> None:
    buffer = io.BytesIO()
    figure.savefig(buffer, format=plot_format(path) or "png")
    atomic_write_bytes(path, buffer.getvalue())


def _label(axis: Any, text: str, x: float, y: float, color: str) -> None:
    axis.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8, color=color)


def _style_axis(axis: Any, xlabel: str, ylabel: str, xs: Sequence[float] | None) -> None:
    """x label, log x where the points span over a decade (model sizes and budgets grow
    geometrically), y label, grid."""
    axis.set_xlabel(xlabel)
    if xs and min(xs) > 0 and max(xs) / min(xs) > 10:
        axis.set_xscale("log")
    axis.set_ylabel(ylabel)
    axis.grid(alpha=0.3)


def _check_metric(rows: Rows, wanted: str, what: str, instead: str) -> int:
    metric, b = same_shape(rows)
    if metric != wanted:
        raise ValueError(f"{what}; use {instead} for these series")
    return b


def _name(group: SeedGroup) -> str:
    seeds = f", {group.n} seeds" if group.n > 1 else ""
    return f"{group.first.setting} ({group.first.num_experts}{seeds})"


class _Twins:
    """Legend labels that name a series drawn exactly on top of an earlier one.

    Why: two settings that made the same decisions (``--wait auto`` choosing every arrival, as
    ``--wait 1`` does) give the same points, and the one drawn last hides the other: the legend
    lists a series the plot does not show. Its label then says ``= <the hidden one>``."""

    def __init__(self) -> None:
        self._first: dict[tuple, str] = {}

    def label(self, name: str, points: Sequence[Sequence[float]]) -> str:
        """``name``, or ``name = <earlier>`` when an earlier series had the same ``points``."""
        key = tuple(tuple(float(f"{value:.6g}") for value in point) for point in points)
        earlier = self._first.setdefault(key, name)
        return name if earlier == name else f"{name} = {earlier}"


def _errorbar(axis: Any, xs: Sequence[float], stats: Sequence[Stat], **style: Any) -> Any:
    """Means with one standard deviation as error bars (none for single seeds)."""
    ys = [s.mean for s in stats]
    errors = [s.std or 0.0 for s in stats]
    if any(errors):
        return axis.errorbar(xs, ys, yerr=errors, capsize=3, **style).lines[0]
    return axis.plot(xs, ys, **style)[0]


def _trajectory(group: SeedGroup, values: Callable[[ReportSeries], Sequence[float | None]]
                ) -> list[tuple[float, float, Stat]]:
    """(mean cumulative TFLOPs, mean parameters in millions, value over seeds) at every arrival
    where the value is defined for every seed."""
    flops = group.by_arrival(lambda s: s.train_flops_cum)
    params = group.by_arrival(lambda s: s.params_by_arrival)
    return [(f.mean / 1e12, p.mean / 1e6, v)
            for f, p, v in zip(flops, params, group.by_arrival(values), strict=True)
            if v is not None and f is not None and p is not None]


def experts_in_total(label: str) -> int | None:
    """Experts a predictor holds, from its label: "8" -> 8, "4@3" (3 members of 4) -> 12,
    "dense" -> 1 (one FFN); None for labels that are not expert counts (vision sizes)."""
    if label == "dense":
        return 1
    match = re.fullmatch(r"(\d+)(?:@(\d+))?", label)
    if not match:
        return None
    return int(match.group(1)) * int(match.group(2) or 1)


@dataclass(frozen=True)
class _Spread:
    """A value drawn with asymmetric error bars: centre, and how far below and above it."""

    mean: float
    below: float = 0.0
    above: float = 0.0


def _as_perplexity(value: Stat) -> _Spread:
    """The paper's average over seeds: mean perplexity ± one standard deviation."""
    return _Spread(value.mean, value.std or 0.0, value.std or 0.0)


def _bits_as_perplexity(bits: Stat) -> _Spread:
    """The anytime metric over seeds (``seeds.BitsAsPerplexity``): 2 ** the mean bits, the
    bar one standard deviation of the bits either side (2 ** (mean ± std))."""
    centre, spread = 2.0 ** bits.mean, bits.std or 0.0
    return _Spread(centre, centre - 2.0 ** (bits.mean - spread), 2.0 ** (bits.mean + spread) - centre)


def _spreadbar(axis: Any, xs: Sequence[float], values: Sequence[_Spread], **style: Any) -> Any:
    ys = [v.mean for v in values]
    if any(v.below or v.above for v in values):
        errors = [[v.below for v in values], [v.above for v in values]]
        return axis.errorbar(xs, ys, yerr=errors, capsize=3, **style).lines[0]
    return axis.plot(xs, ys, **style)[0]


def plot_tradeoffs(rows: Rows, path: str | os.PathLike) -> None:
    """Fig. 5 (module doc): trajectories with a point per arrival (the running average so far)
    against compute and parameters, the last point labelled with the #experts; and the final
    average against the number of experts, runs of one setting joined.  Groups of seeds are
    drawn by the tables' rule: the paper's average as mean ± std of perplexity, the anytime
    perplexity as 2 ** (mean ± std of bits)."""
    _check_metric(rows, "ppl", "plot_tradeoffs draws LM perplexity", "plot_cer_tradeoffs")
    groups = as_groups(rows)
    figure, axes = _figure(2, 3)
    averages = (
        ("average perplexity over trained arrivals (paper)",
         lambda s: s.average_by_arrival(), _as_perplexity),
        ("anytime perplexity, every arrival charged",
         lambda s: s.anytime_by_arrival(), _bits_as_perplexity),
    )
    all_flops, all_params, all_experts = [], [], []
    for row, (ylabel, running, drawn) in enumerate(averages):
        by_compute, by_params, by_experts = axes[row]
        lines: dict[str, list[tuple[int, _Spread]]] = {}
        twins = _Twins()
        for i, group in enumerate(groups):
            points = [(f, p, drawn(stat)) for f, p, stat in _trajectory(group, running)]
            if not points:
                continue
            flops, params, values = zip(*points, strict=True)
            all_flops += flops
            all_params += params
            label = twins.label(_name(group), [(f, p, v.mean) for f, p, v in points])
            style = {"marker": _MARKERS[i % len(_MARKERS)], "label": label}
            for axis, xs in ((by_compute, flops), (by_params, params)):
                line = _spreadbar(axis, xs, values, **style)
                _label(axis, group.first.num_experts, xs[-1], values[-1].mean, line.get_color())
            experts = experts_in_total(group.first.num_experts)
            if experts is not None:
                lines.setdefault(group.first.setting, []).append((experts, values[-1]))
                all_experts.append(experts)
        twins = _Twins()
        for i, (setting, points) in enumerate(lines.items()):
            points.sort(key=lambda point: point[0])
            _spreadbar(by_experts, [x for x, _ in points], [v for _, v in points],
                       marker=_MARKERS[i % len(_MARKERS)],
                       label=twins.label(setting, [(x, v.mean) for x, v in points]))
        _style_axis(by_compute, "cumulative training compute (TFLOPs)", ylabel, all_flops)
        _style_axis(by_params, "parameters |θ| (millions)", ylabel, all_params)
        _style_axis(by_experts, "experts in total (E × members)", ylabel, all_experts)
        if row == 1:  # an untrained arrival costs ~log2(V) bits: perplexities span decades
            for axis in axes[row]:
                axis.set_yscale("log")
        by_compute.legend(fontsize=7)
        if lines:
            by_experts.legend(fontsize=7)
    figure.suptitle("Language modelling trade-offs (ALMA Fig. 5); bottom: anytime variant")
    _save(figure, path)


def plot_error_curves(rows: Rows, path: str | os.PathLike) -> None:
    """Fig. 3: the metric after every arrival t = 0 … B, one line per run, with a band of one
    standard deviation over seeds; test error for vision, perplexity (log scale) for LMs, whose
    arrivals before the first training show the initialised model where it was evaluated."""
    from matplotlib.ticker import MaxNLocator

    metric, b = same_shape(rows)
    figure, ((axis,),) = _figure(1, 1)
    twins = _Twins()
    for i, group in enumerate(as_groups(rows)):
        stats = group.by_arrival(lambda s: s.metric_by_arrival)
        points = [(t, s) for t, s in enumerate(stats) if s is not None]
        if not points:
            continue
        ts = [t for t, _ in points]
        means = [s.mean for _, s in points]
        marker = _MARKERS[i % len(_MARKERS)] if b <= 30 else None
        label = twins.label(_name(group), list(zip(ts, means, strict=True)))
        line = axis.plot(ts, means, marker=marker, markersize=4, label=label)[0]
        if group.n > 1:
            spread = [s.std or 0.0 for _, s in points]
            axis.fill_between(ts, [m - e for m, e in zip(means, spread, strict=True)],
                              [m + e for m, e in zip(means, spread, strict=True)],
                              color=line.get_color(), alpha=0.15)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    if metric == "error":
        axis.set_ylim(0, 1)
        ylabel, title = "test error rate", "Error rate over the stream (ALMA Fig. 3)"
    else:
        axis.set_yscale("log")
        ylabel, title = f"perplexity ({_measured_on(as_groups(rows))})", "Perplexity over the stream"
    _style_axis(axis, "mega-batches arrived (Table 2's t0 is 1)" if metric == "ppl" else
                "arrival t (Eq. 1; t = 0: the untrained model)", ylabel, None)
    axis.legend(fontsize=8)
    figure.suptitle(title)
    _save(figure, path)


def _measured_on(groups: Sequence[SeedGroup]) -> str:
    """What the perplexities were measured on, for an axis: the evaluation mega-batch unless
    every row was scored on one other split (rows of different splits name theirs)."""
    splits = {(g.runs[0].scoring or {}).get("split") for g in groups}
    if len(splits) > 1:
        return "split in each row's name"
    split = splits.pop()
    return "evaluation mega-batch" if split in (None, "eval") else f"{split} split"


def _cost_panels(axes: list[Any]) -> list[tuple[Any, str, str, float]]:
    return [(axes[0], "train_tflops_cum", "cumulative training compute (TFLOPs)", 1.0),
            (axes[1], "params_cum", "memory: cumulative parameters Σ|θ_t| (millions)", 1e-6)]


def plot_cer_tradeoffs(rows: Rows, path: str | os.PathLike) -> None:
    """Fig. 2: CER vs cumulative training compute and vs memory (Σ|θ_t|), a point per run.

    Points of the same ``setting`` (method and waiting time) share a colour and are joined in
    order of cost, so each line shows the effect of model size; points are labelled with the size.
    """
    _check_metric(rows, "error", "plot_cer_tradeoffs draws vision CER", "plot_tradeoffs")
    figure, ((by_compute, by_memory),) = _figure(1, 2)
    by_setting: dict[str, list[SeedGroup]] = {}
    for group in as_groups(rows):
        by_setting.setdefault(group.first.setting, []).append(group)
    for axis, key, xlabel, scale in _cost_panels([by_compute, by_memory]):
        xs_all = []
        twins = _Twins()
        for i, (setting, groups) in enumerate(by_setting.items()):
            points = sorted(((g.summary()[key].mean * scale, g.summary()["cer"], g.first.num_experts)
                             for g in groups), key=lambda point: point[0])
            xs = [x for x, _, _ in points]
            xs_all += xs
            line = _errorbar(axis, xs, [c for _, c, _ in points], marker=_MARKERS[i % len(_MARKERS)],
                             label=twins.label(setting, [(x, c.mean) for x, c, _ in points]))
            for x, cer, label in points:
                _label(axis, label, x, cer.mean, line.get_color())
        _style_axis(axis, xlabel, "cumulative error rate (CER)", xs_all)
    by_memory.legend(fontsize=8)
    figure.suptitle("CER vs compute and memory (ALMA Fig. 2)")
    _save(figure, path)


def _stream_score(group: SeedGroup) -> tuple[str, Stat]:
    """What Fig. 4 puts on its y axis: CER for vision, the paper's average perplexity for LMs."""
    if group.first.metric == "error":
        return "cumulative error rate (CER)", group.summary()["cer"]
    return "average perplexity over trained arrivals", group.summary()["trained_avg_ppl"]


def plot_replay(pairs: Sequence[tuple[SeedGroup, SeedGroup]], path: str | os.PathLike) -> None:
    """Fig. 4: for each pair (the run without replay, the same run with replay), an arrow from
    the first to the second in the compute-vs-score plane: replay buys a better score with more
    compute; parallel arrows mean the methods gain alike (§6.1).  An arrow drawn exactly
    under an earlier one (``--wait auto`` choosing every arrival, as ``--wait 1`` does) says
    so in the legend (``_Twins``), as in Figs. 2, 3 and 5."""
    if not pairs:
        raise ValueError("no pair of runs that differ only by --replay; Fig. 4 needs one")
    same_shape([g for pair in pairs for g in pair])
    figure, ((axis,),) = _figure(1, 1)
    xs_all = []
    ylabel = ""
    twins = _Twins()
    for i, (plain, replay) in enumerate(pairs):
        points = []
        for group in (plain, replay):
            ylabel, score = _stream_score(group)
            points.append((group.summary()["train_tflops_cum"].mean, score))
        (x0, s0), (x1, s1) = points
        xs_all += [x0, x1]
        label = f"{plain.first.setting} ({plain.first.num_experts})"
        if plain.seeds != replay.seeds:  # the two ends are other runs than each other's twins
            label += f", {seeds_text(plain)} -> {seeds_text(replay).removeprefix('seeds ')}"
        label = twins.label(label, [(x0, s0.mean), (x1, s1.mean)])
        line = _errorbar(axis, [x0, x1], [s0, s1], marker=_MARKERS[i % len(_MARKERS)], label=label)
        axis.annotate("", xy=(x1, s1.mean), xytext=(x0, s0.mean),
                      arrowprops={"arrowstyle": "->", "color": line.get_color(), "lw": 1.5})
    _style_axis(axis, "cumulative training compute (TFLOPs)", ylabel, xs_all)
    axis.legend(fontsize=8)
    figure.suptitle("Impact of replay: without (arrow tail) and with replay (head) (ALMA Fig. 4)")
    _save(figure, path)


def plot_eval_matrix(groups: Sequence[MatrixGroup], path: str | os.PathLike) -> None:
    """The stage x period matrices (``alma-score --matrix``) as heatmaps, one panel per setting:
    rows = stage checkpoints, columns = periods (mega-batch p - 1's held-out slice), colour =
    perplexity on a log scale (the summaries' log domain), every cell annotated (mean over
    seeds, ± std with several), the periods each stage trained on as new outlined.  Every panel
    shares one colour scale: the panels are there to be compared side by side, and with a
    range of its own per panel one colour meant 74.7 in one and 77.3 in the next."""
    import math

    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle

    if not groups:
        raise ValueError("no series scored with alma-score --matrix; nothing to draw")
    columns = min(3, len(groups))
    figure, axes = _figure(math.ceil(len(groups) / columns), columns)
    panels = [axis for row in axes for axis in row]
    every = [c.mean for g in groups for row in g.cells() for c in row]
    low, high = min(every), max(every)
    for axis, g in zip(panels, groups):
        cells, shape = g.cells(), g.shape
        means = [[c.mean for c in row] for row in cells]
        image = axis.imshow(means, cmap="viridis_r", aspect="auto",
                            norm=LogNorm(vmin=low, vmax=high if high > low else low * 1.0001))
        figure.colorbar(image, ax=axis, label="perplexity (log colour scale, shared)")
        if shape.num_periods <= 24:
            for r, row in enumerate(cells):
                for p, cell in enumerate(row):
                    text = f"{cell.mean:.1f}" + (f"\n±{cell.std:.1f}" if cell.std else "")
                    # viridis_r draws high perplexities dark: white text on them
                    dark = math.log(cell.mean) > (math.log(low) + math.log(high)) / 2
                    axis.text(p, r, text, ha="center", va="center", fontsize=7,
                              color="white" if dark else "black")
        for r in range(len(shape.stages)):
            for period in shape.new_periods(r):
                axis.add_patch(Rectangle((period - 1.46, r - 0.46), 0.92, 0.92, fill=False,
                                         edgecolor="red", linewidth=1.5))  # inside the cell
        axis.set_xticks(range(shape.num_periods), [str(p) for p in shape.periods])
        axis.set_yticks(range(len(shape.stages)),
                        [f"{s} (arrival {a})" for s, a in zip(shape.stages, shape.arrivals, strict=True)])
        axis.set_xlabel("period p (held-out slice of mega-batch p − 1)")
        axis.set_ylabel("stage checkpoint (arrival)")
        axis.set_title(_name(g.group), fontsize=9)
    for axis in panels[len(groups):]:
        axis.set_visible(False)
    figure.suptitle("Each stage on every period (red: the stage's new periods)")
    _save(figure, path)
