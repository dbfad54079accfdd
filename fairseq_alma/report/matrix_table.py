"""The stage x period matrices of ``alma-score --matrix`` in ``alma-report``: the summary table.

Each input series scored with ``--matrix`` carries its matrix (``stream/period_matrix.py``: the
definitions of ``in_period``, ``backward``, ``forward`` and, beside them, ``forgetting``).  Runs
that differ only by seed form one row, as in Table 2: every cell and every summary is the mean
over seeds of the seeds' own numbers (perplexities; for ``forgetting`` its perplexity ratio and
its bits), ± the sample standard deviation, and the JSON keeps each seed's matrix.  The
summaries are recomputed from each seed's bits, never copied from the file.

Refused with one line (``ValueError``; the entry point makes it a ``UsageError``): a seed group
where only some seeds were scored with ``--matrix`` (a mean over the others would be presented
as the group's), seeds whose matrices have other rows or periods, and matrices scored on
different ``--max-eval-tokens`` slices of their period splits (not comparable).  Nothing here
imports fairseq or torch.
"""

from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from typing import Any

from ..stream.atomic import atomic_write_json, atomic_write_text
from ..stream.period_matrix import SUMMARIES, PeriodMatrix
from ..text_table import format_table as _format_cells
from .result_tables import _cell
from .seeds import SeedGroup, Stat, stat

FORGETTING = ("ppl_ratio", "nll_bits")  # PeriodMatrix.forgetting's numbers, as the JSON names them


@dataclass
class MatrixGroup:
    """A seed group whose every member has a matrix; ``matrices`` in the group's seed order."""

    group: SeedGroup
    matrices: list[PeriodMatrix]

    @property
    def shape(self) -> PeriodMatrix:
        return self.matrices[0]

    def cells(self) -> list[list[Stat]]:
        """Perplexity over seeds of every (stage row, period) cell."""
        first = self.shape
        return [[Stat(tuple(m.ppl[r][p] for m in self.matrices)) for p in range(first.num_periods)]
                for r in range(len(first.stages))]

    def summary(self) -> dict[str, Stat | None]:
        """Each summary's perplexity over seeds (None where no row defines it)."""
        summaries = [m.summary() for m in self.matrices]
        return {name: stat([s[name]["ppl"] for s in summaries]) for name in SUMMARIES}

    def forgetting(self) -> dict[str, Stat | None]:
        """``forgetting`` over seeds: each seed's ``PeriodMatrix.forgetting`` (its perplexity
        ratio and its bits), averaged as the other summaries are (None with one stage).

        Why here: README promises it beside the three summaries; a report showed it only
        inside each seed's matrix, so a group's row had no forgetting number."""
        lost = [m.forgetting() for m in self.matrices]
        return {key: stat([one[key] for one in lost]) for key in FORGETTING}


def _slice(entry: dict[str, Any]) -> tuple:
    return tuple(entry.get("eval_tokens") or ()), tuple(entry.get("eval_tokens_total") or ())


def matrix_groups(groups: list[SeedGroup]) -> list[MatrixGroup]:
    """The groups scored with ``--matrix`` (module doc for what is refused), in table order."""
    out, slices = [], {}
    for group in groups:
        entries = [run.eval_matrix for run in group.runs]
        if all(entry is None for entry in entries):
            continue
        missing = [run.source for run in group.runs if run.eval_matrix is None]
        if missing:
            raise ValueError(f"{missing[0]} has no eval matrix but seeds of the same setting "
                             f"have one; score every seed with alma-score --matrix, or pass "
                             f"--no-seed-groups")
        try:
            matrices = [PeriodMatrix.from_json(entry) for entry in entries]
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{group.runs[0].source}: eval_matrix unreadable ({err}); score it "
                             f"again with alma-score --matrix") from None
        first = matrices[0]
        for run, matrix in zip(group.runs[1:], matrices[1:], strict=True):
            if (matrix.stages, matrix.arrivals, matrix.periods) != \
                    (first.stages, first.arrivals, first.periods):
                raise ValueError(f"{run.source} and {group.runs[0].source} share a setting but "
                                 f"not their eval matrix's stages or periods")
        for run, entry in zip(group.runs, entries, strict=True):
            slices.setdefault(_slice(entry), run.source)
        out.append(MatrixGroup(group, matrices))
    if len(slices) > 1:
        (a, source_a), (b, source_b) = list(slices.items())[:2]
        raise ValueError(f"{source_a} scored the period splits on {a[0]} of {a[1]} tokens, "
                         f"{source_b} on {b[0]} of {b[1]}; score them with the same alma-score "
                         f"--max-eval-tokens to compare their matrices")
    return out


def _rows(groups: list[MatrixGroup]) -> tuple[list[str], list[list[str]]]:
    seeds = any(g.group.n > 1 for g in groups)
    header = ["setting", "#experts"] + (["seeds"] if seeds else []) + ["stages"]
    header += [f"{name.replace('_', '-')} ppl" for name in SUMMARIES] + ["forgetting (ppl ×)"]
    rows = []
    for g in groups:
        summary = g.summary()
        rows.append([g.group.first.setting, g.group.first.num_experts]
                    + ([str(g.group.n)] if seeds else []) + [str(len(g.shape.stages))]
                    + [_cell(summary[name]) for name in SUMMARIES]
                    + [_cell(g.forgetting()["ppl_ratio"], ".3f")])
    return header, rows


def format_summary(groups: list[MatrixGroup], markdown: bool = False) -> str:
    """One row per setting: the in-period, backward and forward perplexities, and the
    forgetting as a perplexity ratio (above 1: lost since learned)."""
    header, rows = _rows(groups)
    return _format_cells(header, rows, left=2, markdown=markdown)


def write_csv(groups: list[MatrixGroup], path: str | os.PathLike) -> None:
    """The summary table at full precision; with several seeds, ``seeds`` and ``*_std``."""
    seeds = any(g.group.n > 1 for g in groups)
    keys = [f"{name}_ppl" for name in SUMMARIES] + [f"forgetting_{key}" for key in FORGETTING]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["setting", "num_experts"] + (["seeds"] if seeds else []) + ["stages"] + keys
                    + ([f"{key}_std" for key in keys] if seeds else []))
    for g in groups:
        summary = [g.summary()[name] for name in SUMMARIES]
        summary += [g.forgetting()[key] for key in FORGETTING]
        writer.writerow([g.group.first.setting, g.group.first.num_experts]
                        + ([str(g.group.n)] if seeds else []) + [str(len(g.shape.stages))]
                        + ["" if s is None else repr(s.mean) for s in summary]
                        + (["" if s is None or s.std is None else repr(s.std) for s in summary]
                           if seeds else []))
    atomic_write_text(path, buffer.getvalue())


def write_json(groups: list[MatrixGroup], path: str | os.PathLike) -> None:
    """Every group's mean matrix (± std), summaries over seeds, and each seed's matrix."""
    out = []
    for g in groups:
        cells = g.cells()
        out.append({
            "setting": g.group.first.setting, "num_experts": g.group.first.num_experts,
            "runs": [run.source for run in g.group.runs],
            "seeds": [None if run.seed is None else list(run.seed) for run in g.group.runs],
            "rows": g.shape.stages, "arrivals": g.shape.arrivals, "periods": g.shape.periods,
            "ppl": [[c.mean for c in row] for row in cells],
            "ppl_std": [[c.std for c in row] for row in cells],
            "summary": {name: None if s is None else s.to_json()
                        for name, s in g.summary().items()},
            "forgetting": {key: None if s is None else s.to_json()
                           for key, s in g.forgetting().items()}
            | {"periods": g.shape.forgetting()["periods"]},
            "members": [m.as_json() for m in g.matrices],
        })
    atomic_write_json(path, {"definitions": "fairseq_alma/stream/period_matrix.py; README, "
                                            "Streams that drift", "groups": out})
