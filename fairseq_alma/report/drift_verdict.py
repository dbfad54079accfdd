"""Which replay setting forgets least per unit of compute: the drift demo's table and verdict.

Why a module of its own: ``alma-demo --drift`` must say in plain words what its matrices show,
and the words must follow from the numbers whatever they turn out to be (another corpus,
another seed, a user's own runs), never from what we expect replay to do.  Input: one entry per
setting, its stage x period matrix (``stream/period_matrix.py``) and its training compute;
output: a table and sentences.  Nothing here imports fairseq or torch.

The rule, stated so that a reader can check it against the table:

* forgetting is measured by ``backward`` (perplexity of each stage on the periods older than
  its new ones; lower = forgets less); ``forgetting`` (the last stage's rise since it learned
  each period) is shown beside it as the second opinion;
* per unit of compute: when every setting spent the same training FLOPs (within 1%; replay in
  ``alma_stream`` changes which data an update sees, not how many updates a stage makes), the
  ranking per unit of compute IS the ranking by ``backward``; otherwise the setting with the
  lowest ``backward`` is the answer only if no setting that forgets less costs less, and the
  sentence gives the compute ratio instead of pretending the costs are equal;
* the price is stated too: the winner's ``in_period`` perplexity against the others' (replay
  spends updates on old data that the new periods do not get);
* settings whose ``backward`` perplexities differ by less than ``SAME_PPL`` (one unit of the
  printed digit) forget alike: the verdict names them together and declares no winner among
  them, since an order the printed numbers cannot show would follow the input order; per unit
  of compute the cheapest of them is then the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..stream.period_matrix import PeriodMatrix
from ..text_table import format_table

SAME_COMPUTE = 0.01  # relative spread of training FLOPs under which costs count as equal
SAME_PPL = 0.01  # backward perplexities closer than this (the printed digit) count as equal


@dataclass(frozen=True)
class DriftSetting:
    """One trained stream of the comparison: its label, matrix and total training FLOPs."""

    name: str
    matrix: PeriodMatrix
    train_flops: float

    def ppl(self, summary: str) -> float:
        value = self.matrix.summary()[summary]["ppl"]
        if value is None:
            raise ValueError(f"{self.name}: its matrix has no {summary} summary (a stream of one "
                             f"stage cannot show forgetting); train at least two stages")
        return value


def format_drift_table(settings: Sequence[DriftSetting]) -> str:
    """Compute and the four numbers of every setting, one row each."""
    header = ["setting", "train TFLOPs", "in-period ppl", "backward ppl", "forward ppl",
              "forgetting (ppl x)"]
    rows = []
    for s in settings:
        forward = s.matrix.summary()["forward"]["ppl"]
        lost = s.matrix.forgetting()["ppl_ratio"]
        rows.append([s.name, f"{s.train_flops / 1e12:.3g}", f"{s.ppl('in_period'):.2f}",
                     f"{s.ppl('backward'):.2f}", "n/a" if forward is None else f"{forward:.2f}",
                     "n/a" if lost is None else f"{lost:.3f}"])
    return format_table(header, rows, left=1)


def drift_verdict(settings: Sequence[DriftSetting]) -> str:
    """The plain-words answer (module doc for the rule)."""
    if len(settings) < 2:
        raise ValueError("a verdict compares at least two settings")
    ranked = sorted(settings, key=lambda s: s.ppl("backward"))
    leaders = [s for s in ranked if s.ppl("backward") - ranked[0].ppl("backward") < SAME_PPL]
    rest = [s for s in ranked if s not in leaders]
    flops = [s.train_flops for s in settings]
    equal = (max(flops) - min(flops)) <= SAME_COMPUTE * max(flops)
    # of those forgetting least: the cheapest, and at equal cost the best on the new periods
    best = min(leaders, key=lambda s: (0.0 if equal else s.train_flops, s.ppl("in_period")))
    others = ", ".join(f"{s.ppl('backward'):.2f} with {s.name}" for s in rest)
    if len(leaders) == 1:
        lines = [f"{best.name} forgets least: on the periods older than each stage's new data its "
                 f"stages score a perplexity of {best.ppl('backward'):.2f}, against {others}."]
    else:
        alike = ", ".join(f"{s.name} {s.ppl('backward'):.2f}" for s in leaders)
        lines = [f"{_joined([s.name for s in leaders])} forget alike, and least"
                 f"{'' if rest else ' (every setting)'}: on the periods older than each stage's "
                 f"new data their stages score perplexities within {SAME_PPL} of each other "
                 f"({alike})" + (f", against {others}." if rest else ".")]
    if equal:
        who = f"{best.name} also forgets least" if len(leaders) == 1 else "they also forget alike"
        lines.append(f"All {len(settings)} settings trained with the same compute "
                     f"({best.train_flops / 1e12:.3g} TFLOPs: the same updates per stage; replay "
                     f"changes which data an update sees, not how many), so per unit of compute "
                     f"{who}.")
    else:
        if len(leaders) > 1:
            lines.append(f"Of these, {best.name} spent the least training compute "
                         f"({best.train_flops / 1e12:.3g} TFLOPs).")
        cheaper = [s for s in rest if s.train_flops < best.train_flops]
        if cheaper:
            c = min(cheaper, key=lambda s: s.ppl("backward"))
            lines.append(f"It is not the cheapest: it spent {best.train_flops / c.train_flops:.2f}x "
                         f"the training compute of {c.name} ({best.train_flops / 1e12:.3g} vs "
                         f"{c.train_flops / 1e12:.3g} TFLOPs), which forgets more "
                         f"({c.ppl('backward'):.2f}); per unit of compute neither dominates.")
        else:
            lines.append(f"It also spent no more training compute than the others "
                         f"({best.train_flops / 1e12:.3g} TFLOPs), so per unit of compute it "
                         f"forgets least.")
    ratios = [(s.name, s.matrix.forgetting()["ppl_ratio"]) for s in ranked]
    ratios = [(name, ratio) for name, ratio in ratios if ratio is not None]
    if ratios:
        line = ("The last stage against the stage that learned each old period: "
                + ", ".join(f"{name} x{ratio:.3f}" for name, ratio in ratios)
                + " in perplexity (above 1: lost since learned).")
        if all(ratio < 1 for _, ratio in ratios):
            line += (" All are below 1: at this scale every setting still improves on old periods "
                     "as it trains on, so general progress outweighs the drift; the backward "
                     "perplexities rank how much of the old periods each keeps.")
        lines.append(line)
    price = best.ppl("in_period") - min(s.ppl("in_period") for s in settings)
    if price > 0:
        lines.append(f"The price: on each stage's new periods {best.name} scores "
                     f"{best.ppl('in_period'):.2f}, {price:.2f} worse than the best in-period "
                     f"setting; the updates it spends on old data are updates the new data does not get.")
    else:
        lines.append(f"{'It' if len(leaders) == 1 else best.name} pays nothing on the new "
                     f"periods: its in-period perplexity "
                     f"({best.ppl('in_period'):.2f}) is the lowest too.")
    if rest:
        most = ranked[-1]
        lines.append(f"{most.name} forgets most ({most.ppl('backward'):.2f} on older periods).")
    return "\n".join(lines)


def _joined(names: Sequence[str]) -> str:
    """'a and b', 'a, b and c'."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
