"""One run's (or ensemble's) results over the stream, with the paper's summaries.

``alma-score`` fills a ``ReportSeries`` per row of Table 2 (App. D) — from ``stream.jsonl`` with
``series_from_records`` or from its own evaluation of stage checkpoints — and
``fairseq_alma.cli.report`` renders them.  Lists are indexed by arrival t = 0 … B (t = 0 is the
model before any data), the layout of ``stream.jsonl``; the summaries are the paper's: average
perplexity over trained arrivals (§6.2, Fig. 5), CER (Eq. 1), Comp and Mem (Eq. 2); and for
language models the anytime cross-entropy, which charges every arrival (``metrics.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from .metrics import (
    cumulative,
    cumulative_error_rate,
    running_anytime_nll_bits,
    running_trained_average_perplexity,
    trained_so_far,
)
from .records import ArrivalRecord

METRICS = ("ppl", "error")


@dataclass
class ReportSeries:
    """One row of Table 2 / one line of Figs. 3 and 5 / one point of Fig. 2.

    Attributes:
        setting: e.g. "SM_w1", "Ens_w4 (4x steps)".
        num_experts: label of the model size: "8", "4@2" (2 members of 4 experts), or for vision
            e.g. "h32".
        metric_by_arrival: perplexity ("ppl") or test error rate ("error") at arrivals 0..B;
            an LM's arrivals before its first training hold the initial model's perplexity, or
            None where it was not evaluated (then the anytime metric is undefined).
        trained: True at the arrivals where a stage trained (``stream.jsonl``'s ``trained``);
            None: trained from the first arrival >= 1 whose metric is not None.
        train_flops_cum: training FLOPs spent up to each arrival (Comp, Eq. 2).
        params_by_arrival: |θ_t| at each arrival; its running sum is Mem (Eq. 2).
        metric: "ppl" (language model) or "error" (vision).
        flops_convention: LM runs: the ``--flops-convention`` their FLOPs were counted with
            ("full" for runs that predate the flag); series counted differently are never put
            on one compute axis.  None for vision (its FLOPs are counted from the model).
    """

    setting: str
    num_experts: str
    metric_by_arrival: list[float | None]
    train_flops_cum: list[float]
    params_by_arrival: list[int]
    trained: list[bool] | None = None
    metric: str = "ppl"
    flops_convention: str | None = None  # LM: how attention FLOPs count (stream/transformer_flops.py)

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"{self.setting}: metric {self.metric!r} must be one of {METRICS}")
        n = len(self.metric_by_arrival)
        if n < 2:
            raise ValueError(f"{self.setting}: need values for arrivals 0..B (B >= 1), got {n}")
        if self.trained is None:
            self.trained = [False] + [value is not None for value in self.metric_by_arrival[1:]]
        for name in ("train_flops_cum", "params_by_arrival", "trained"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"{self.setting}: {name} has {len(getattr(self, name))} entries, "
                    f"metric_by_arrival has {n}; give every list one entry per arrival 0..B"
                )
        trained_so_far(self.trained)  # checks arrival 0 is untrained
        # Plain Python numbers (callers may hand numpy / torch scalars): JSON and CSV stay exact.
        self.metric_by_arrival = [None if v is None else float(v) for v in self.metric_by_arrival]
        self.train_flops_cum = [float(v) for v in self.train_flops_cum]
        self.params_by_arrival = [int(v) for v in self.params_by_arrival]
        self.trained = [bool(v) for v in self.trained]
        cumulative(self.params_by_arrival)  # checks |θ_t| >= 0
        if self.train_flops_cum[0] < 0:
            raise ValueError(f"{self.setting}: train_flops_cum[0] is negative; FLOPs are >= 0")
        if any(later < earlier for earlier, later in itertools.pairwise(self.train_flops_cum)):
            raise ValueError(
                f"{self.setting}: train_flops_cum decreases; pass cumulative FLOPs per arrival"
            )
        if self.metric == "error" and None in self.metric_by_arrival:
            missing = self.metric_by_arrival.index(None)
            raise ValueError(
                f"{self.setting}: no test error at arrival {missing}; CER (Eq. 1) needs every "
                f"arrival 0..B, the untrained model included"
            )

    @property
    def seen(self) -> list[bool]:
        """Whether the model has been trained at least once by each arrival."""
        return trained_so_far(self.trained)

    @property
    def params_cum(self) -> list[float]:
        """Mem up to each arrival: the running sum of |θ_t| (Eq. 2)."""
        return cumulative(self.params_by_arrival)

    @property
    def num_megabatches(self) -> int:
        """B, the number of mega-batches in the stream."""
        return len(self.metric_by_arrival) - 1

    @property
    def params(self) -> int:
        """|θ| at the end of the stream (Table 2's |θ| column)."""
        return int(self.params_by_arrival[-1])

    def average_by_arrival(self) -> list[float | None]:
        """LM: the paper's average perplexity over trained arrivals up to each t (Fig. 5)."""
        return running_trained_average_perplexity(self.trained_metric(), self.trained)

    def trained_metric(self) -> list[float | None]:
        """The metric where Table 2 shows it: None at arrivals before the first training."""
        return [v if seen else None for v, seen in zip(self.metric_by_arrival, self.seen,
                                                        strict=True)]

    def anytime_by_arrival(self) -> list[float | None]:
        """LM: anytime cross-entropy in bits over arrivals 1..t, every arrival charged."""
        return running_anytime_nll_bits(self.metric_by_arrival)

    def summary(self) -> dict[str, float | None]:
        """The stream-level numbers: for an LM the paper's average perplexity over trained
        arrivals (``trained_avg_ppl``) and the anytime cross-entropy over all arrivals
        (``anytime_nll`` in bits, ``anytime_ppl`` = 2 ** it; None where an untrained arrival
        was not evaluated); for vision CER and final error; then Comp and Mem."""
        out: dict[str, float | None] = {}
        if self.metric == "ppl":
            out["trained_avg_ppl"] = self.average_by_arrival()[-1]
            if out["trained_avg_ppl"] is None:
                raise ValueError(
                    f"{self.setting}: never trained, the average perplexity is undefined"
                )
            anytime = self.anytime_by_arrival()[-1]
            out["anytime_nll"] = anytime
            out["anytime_ppl"] = None if anytime is None else 2.0 ** anytime
        else:
            out["cer"] = cumulative_error_rate(self.metric_by_arrival)
            out["final_error"] = float(self.metric_by_arrival[-1])
        out["train_tflops_cum"] = self.train_flops_cum[-1] / 1e12
        out["params_cum"] = self.params_cum[-1]
        return out


def series_from_records(
    setting: str, num_experts: str, records: Sequence[ArrivalRecord]
) -> ReportSeries:
    """A series from one run's ``stream.jsonl`` (``read_records``); an LM if it has eval_ppl."""
    arrivals = [record.arrival for record in records]
    if arrivals != list(range(len(records))) or len(records) < 2:
        raise ValueError(
            f"{setting}: stream.jsonl must hold arrivals 0..B in order, found {arrivals}"
        )
    metric = "ppl" if records[0].eval_ppl is not None else "error"
    values = [r.eval_ppl if metric == "ppl" else r.test_error for r in records]  # every arrival
    return ReportSeries(
        setting=setting,
        num_experts=num_experts,
        metric_by_arrival=values,
        train_flops_cum=[r.train_flops_cum for r in records],
        params_by_arrival=[r.params_active for r in records],
        trained=[r.trained for r in records],
        metric=metric,
        flops_convention=flops_convention(records),
    )


def flops_convention(records: Sequence[ArrivalRecord]) -> str | None:
    """The FLOP-counting convention of an LM run's records (module doc of ``flops.py``)."""
    if records[0].eval_ppl is None:
        return None
    found = {r.extra.get("flops_convention", "full") for r in records}
    if len(found) != 1:
        raise ValueError(f"stream.jsonl mixes FLOP conventions {sorted(found)}; re-run the stream")
    return found.pop()
