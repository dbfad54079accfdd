"""The time-stratified evaluation matrix (issue 14): every stage checkpoint on every period.

A stream prepared with ``alma-data-prep --eval-per-megabatch SIZE`` holds out a slice of every
mega-batch k (split ``evalmb{k}``); mega-batch k arrives at arrival k + 1, so we call its slice
**period k + 1**.  ``alma-score --matrix`` scores the model at the end of each trained stage s
(rows, s = 1..S) on every period p (columns, p = 1..B).  One number per stage, as the
single-split evaluation gives, cannot tell forgetting from learning; the matrix can: the cells
left of a row's new periods measure what the stage still knows of older data, the cell right of
them how well it predicts the period it has not seen yet.

Why the log domain: as the anytime metric (``stream/metrics.py``), every summary averages the
per-token cross-entropy in bits and is reported as a perplexity, 2 ** bits (a geometric mean of
perplexities).  The summaries, for a row s trained at arrival a_s on its new periods
N(s) = a_{s-1}+1 .. a_s (the w mega-batches that arrived since the previous stage, a_0 = 0):

* ``in_period``: mean over every row of (mean over p in N(s) of bits[s][p]);
* ``backward``: mean over the rows with an older period of (mean over p < min N(s) of
  bits[s][p]), the forgetting side; rows with no older period (stage 1) are excluded;
* ``forward``: mean over the rows with a next period of bits[s][a_s + 1], the period right after
  the stage's arrival, which no stage up to s trained on; rows at the end of the stream
  (a_s = B) are excluded.

and, beside them, ``forgetting``: how much the LAST stage has lost on each period since the
stage that trained on it as new, mean over those periods of bits[S][p] - bits[s_p][p]
(Lopez-Paz & Ranzato 2017's backward transfer, negated, in bits; reported also as the ratio of
perplexities 2 ** that).  ``backward`` says how well old periods are known; ``forgetting`` says
how much of what was once known of them went, whatever the stage's general progress.

Each row weighs the same whatever its number of periods, and each period of a row the same
whatever its token count (the slices are of one requested size).  With ``--replay`` or
``--replay-ratio`` a stage also trained on its older periods; ``backward`` still means those
periods, which is how replay's effect on forgetting shows.  A summary that no row defines is
None, never a number.  Nothing here imports fairseq or torch: reports read matrices anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..text_table import format_table

SUMMARIES = ("in_period", "backward", "forward")


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


@dataclass(frozen=True)
class PeriodMatrix:
    """Stage checkpoints (rows) scored on every period (columns), in bits per token."""

    stages: list[int]  # row s: stage index (1..S)
    arrivals: list[int]  # a_s: the arrival at which row s's stage trained
    nll_bits: list[list[float]]  # [row][period - 1]: cross-entropy in bits per token

    def __post_init__(self) -> None:
        if not self.stages or len(self.stages) != len(self.arrivals) \
                or len(self.nll_bits) != len(self.stages):
            raise ValueError(f"a period matrix needs one arrival and one row of bits per stage; "
                             f"got {len(self.stages)} stages, {len(self.arrivals)} arrivals, "
                             f"{len(self.nll_bits)} rows")
        widths = {len(row) for row in self.nll_bits}
        if len(widths) != 1:
            raise ValueError(f"rows of the period matrix have different lengths {sorted(widths)}")
        if list(self.arrivals) != sorted(set(self.arrivals)) or self.arrivals[0] < 1 \
                or self.arrivals[-1] > self.num_periods:
            raise ValueError(f"stage arrivals {self.arrivals} must increase within 1..B "
                             f"(B = {self.num_periods})")
        for row in self.nll_bits:
            for bits in row:
                if not (isinstance(bits, float) and math.isfinite(bits) and bits >= 0):
                    raise ValueError(f"{bits!r} is not a cross-entropy in bits (finite, >= 0)")

    @property
    def num_periods(self) -> int:
        return len(self.nll_bits[0])

    @property
    def periods(self) -> list[int]:
        return list(range(1, self.num_periods + 1))

    @property
    def ppl(self) -> list[list[float]]:
        return [[2.0 ** bits for bits in row] for row in self.nll_bits]

    def new_periods(self, row: int) -> list[int]:
        """N(s): the periods that arrived since the previous stage (module doc)."""
        start = self.arrivals[row - 1] + 1 if row > 0 else 1
        return list(range(start, self.arrivals[row] + 1))

    def _bits(self, row: int, period: int) -> float:
        return self.nll_bits[row][period - 1]

    def summary(self) -> dict[str, dict[str, Any]]:
        """``in_period``, ``backward``, ``forward`` (module doc): each its ``nll_bits``, ``ppl``
        (None when no row defines it) and the ``rows`` (stage indices) it averages over."""
        per_row: dict[str, list[tuple[int, float]]] = {name: [] for name in SUMMARIES}
        for row, stage in enumerate(self.stages):
            new = self.new_periods(row)
            per_row["in_period"].append((stage, _mean([self._bits(row, p) for p in new])))
            if new[0] > 1:
                older = [self._bits(row, p) for p in range(1, new[0])]
                per_row["backward"].append((stage, _mean(older)))
            if self.arrivals[row] < self.num_periods:
                per_row["forward"].append((stage, self._bits(row, self.arrivals[row] + 1)))
        out = {}
        for name, values in per_row.items():
            bits = _mean([v for _, v in values]) if values else None
            out[name] = {"nll_bits": bits, "ppl": None if bits is None else 2.0 ** bits,
                         "rows": [stage for stage, _ in values]}
        return out

    def forgetting(self) -> dict[str, Any]:
        """``forgetting`` (module doc): ``nll_bits`` (mean rise, bits per token; negative = the
        last stage knows the old periods better than when it learned them), ``ppl_ratio`` and
        the ``periods`` it averages over (None and [] when only one stage trained)."""
        last = len(self.stages) - 1
        rises = [(p, self._bits(last, p) - self._bits(row, p))
                 for row in range(last) for p in self.new_periods(row)]
        bits = _mean([rise for _, rise in rises]) if rises else None
        return {"nll_bits": bits, "ppl_ratio": None if bits is None else 2.0 ** bits,
                "periods": [p for p, _ in rises]}

    def as_json(self) -> dict[str, Any]:
        """What ``alma-score --json`` records under a series' ``eval_matrix``."""
        return {"rows": list(self.stages), "arrivals": list(self.arrivals),
                "periods": self.periods,
                "new_periods": [self.new_periods(r) for r in range(len(self.stages))],
                "ppl": self.ppl, "nll_bits": [list(row) for row in self.nll_bits],
                "summary": self.summary(), "forgetting": self.forgetting()}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> PeriodMatrix:
        """A matrix back from ``as_json`` (its summaries are recomputed, never trusted)."""
        return cls(list(entry["rows"]), list(entry["arrivals"]),
                   [[float(bits) for bits in row] for row in entry["nll_bits"]])


def format_matrix(matrix: PeriodMatrix, title: str) -> str:
    """The matrix as a text table (perplexities; ``[x]``: the stage's new periods) and one line
    per summary, saying which rows it averages and which it excludes."""
    header = ["stage", "arrival"] + [f"p{p}" for p in matrix.periods]
    rows = []
    for r, (stage, arrival) in enumerate(zip(matrix.stages, matrix.arrivals, strict=True)):
        new = set(matrix.new_periods(r))
        rows.append([str(stage), str(arrival)]
                    + [f"[{ppl:.2f}]" if p in new else f"{ppl:.2f}"
                       for p, ppl in zip(matrix.periods, matrix.ppl[r], strict=True)])
    lines = [f"{title}: perplexity of each stage checkpoint (row) on each period's held-out "
             f"slice (column p = mega-batch p - 1); [ ] = the periods the stage trained on as new",
             format_table(header, rows, left=0).rstrip("\n")]
    for name, value in matrix.summary().items():
        excluded = [s for s in matrix.stages if s not in value["rows"]]
        why = {"backward": "no older period", "forward": "no next period"}.get(name)
        shown = "n/a" if value["ppl"] is None else f"{value['ppl']:.2f}"
        note = f"; excluded {', '.join(map(str, excluded))}: {why}" if excluded else ""
        lines.append(f"  {name} ppl {shown} (rows {', '.join(map(str, value['rows'])) or 'none'}"
                     f"{note})")
    lost = matrix.forgetting()
    if lost["periods"]:
        lines.append(f"  forgetting: stage {matrix.stages[-1]} on periods "
                     f"{', '.join(map(str, lost['periods']))} vs the stage that learned each: "
                     f"{lost['nll_bits']:+.3f} bits/token (ppl x{lost['ppl_ratio']:.3f})")
    return "\n".join(lines) + "\n"
