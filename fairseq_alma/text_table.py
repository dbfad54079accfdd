"""Plain-text tables for the terminal: the one table helper of fairseq-alma (on tabulate).

Cells arrive already formatted (each caller knows its units and precision); the helper only
aligns them: text columns left, number columns right, a rule under the header.
"""

from __future__ import annotations

from collections.abc import Sequence

from tabulate import tabulate


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1,
                 markdown: bool = False) -> str:
    """``rows`` under ``header``; the first ``left`` columns are left-aligned, the rest right;
    ``markdown``: a GitHub Markdown table instead of plain text.

    >>> print(format_table(["run", "ppl"], [["a", "12.5"], ["bb", "9.0"]]), end="")
    run      ppl
    -----  -----
    a       12.5
    bb       9.0
    """
    align = ["left" if i < left else "right" for i in range(len(header))]
    text = tabulate([list(row) for row in rows], headers=list(header),
                    tablefmt="github" if markdown else "simple",
                    colalign=align, disable_numparse=True)
    return text + "\n"
