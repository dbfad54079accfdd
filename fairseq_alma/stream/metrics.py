"""Stream metrics of the ALMA paper as pure functions over per-arrival values (§3.1, §6.2).

Every list is indexed by arrival t = 0 … B (length B + 1), the layout of ``stream.jsonl``:
entry 0 is the model before any data.  The paper's metrics:

* CER (Eq. 1) = sum over t = 0..B of the test error rate of the model at time t: small only if
  the error is small throughout the stream, so a tardy learner pays for the arrivals it waited.
* Mem and Comp (Eq. 2) = sums over t of |θ_t| and of the FLOPs spent; ``cumulative`` gives the
  running sums, so the value at arrival t is the budget spent up to t.
* Language models (§6.2, Table 2, Fig. 5) report the *average* perplexity over the stream
  instead, averaged over the arrivals 1..B at which the model has been trained at least once
  (Table 2 prints '*' for the others): ``trained_average_perplexity``.  It never charges a
  learner for waiting: SM_w4's average is its final perplexity, so waiting looks free.
* The anytime LM metric (ours, the LM analogue of CER): ``anytime_nll_bits`` = the mean over
  ALL arrivals 1..B of the per-token cross-entropy in bits, an arrival before the first training
  charged with the model the learner has then (the initialised one).  It lives in the log
  domain because an untrained LM's perplexity is about the vocabulary size (50,000 at the
  paper's BPE): an arithmetic mean of perplexities would be that number over B and nothing
  else; a mean of log-losses weighs one untrained arrival as ~log2(V) bits against ~4-5 bits of
  a trained model, a real but bounded penalty.  ``anytime_ppl`` = 2 ** anytime_nll_bits is the
  geometric mean of the per-arrival perplexities.

Range checks raise ``ValueError`` with one line that says which entry is wrong and how to fix
the call (the habit of Continuum's metrics).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence


def _finite(value: object, name: str, index: int | None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        where = name if index is None else f"{name}[{index}]"
        raise ValueError(f"{where} = {value!r} is not a finite number; pass a float")
    return float(value)


def cumulative_error_rate(errors_by_arrival: Sequence[float]) -> float:
    """CER, Eq. 1: the sum of the test error rates at arrivals t = 0 … B.

    >>> cumulative_error_rate([0.9, 0.5, 0.25])
    1.65
    """
    if len(errors_by_arrival) < 2:
        raise ValueError(
            f"errors_by_arrival has {len(errors_by_arrival)} entries; pass the test error at every "
            f"arrival t = 0..B (B + 1 >= 2 entries, t = 0 is the untrained model)"
        )
    total = 0.0
    for t, value in enumerate(errors_by_arrival):
        error = _finite(value, "errors_by_arrival", t)
        if not 0.0 <= error <= 1.0:
            raise ValueError(
                f"errors_by_arrival[{t}] = {error} is not an error rate in [0, 1]; pass fractions "
                f"(0.25), not percentages (25)"
            )
        total += error
    return total


def cumulative(values: Sequence[float]) -> list[float]:
    """Running sums of per-arrival costs: Mem = Σ|θ_t| and Comp = Σ FLOPs (Eq. 2).

    The last entry is the paper's total; entry t is what has been spent up to arrival t.

    >>> cumulative([10, 10, 20])
    [10.0, 20.0, 40.0]
    """
    if len(values) == 0:
        raise ValueError(
            "values is empty; pass one cost (parameters or FLOPs) per arrival t = 0..B"
        )
    sums, total = [], 0.0
    for t, value in enumerate(values):
        cost = _finite(value, "values", t)
        if cost < 0:
            raise ValueError(
                f"values[{t}] = {cost} is negative; parameter and FLOP counts are >= 0"
            )
        total += cost
        sums.append(total)
    return sums


def trained_so_far(trained_mask: Sequence[bool]) -> list[bool]:
    """Whether the model has been trained at least once by each arrival (prefix OR)."""
    if len(trained_mask) == 0:
        raise ValueError("trained_mask is empty; pass one bool per arrival t = 0..B")
    if trained_mask[0]:
        raise ValueError(
            "trained_mask[0] is True, but arrival 0 comes before any data; lists are indexed by "
            "arrival t = 0..B (did you drop the t = 0 entry?)"
        )
    seen, out = False, []
    for flag in trained_mask:
        seen = seen or bool(flag)
        out.append(seen)
    return out


def running_trained_average_perplexity(
    ppl_by_arrival: Sequence[float | None], trained_mask: Sequence[bool]
) -> list[float | None]:
    """Average perplexity over the trained arrivals 1..t, for every t (None until the first
    training).  One point per arrival of a Fig. 5 trajectory; the last entry is the stream's
    average perplexity."""
    if len(ppl_by_arrival) != len(trained_mask):
        raise ValueError(
            f"ppl_by_arrival has {len(ppl_by_arrival)} entries but trained_mask has "
            f"{len(trained_mask)}; pass both for every arrival t = 0..B"
        )
    seen = trained_so_far(trained_mask)
    out: list[float | None] = []
    total, count = 0.0, 0
    for t, value in enumerate(ppl_by_arrival):
        if t > 0 and seen[t]:
            if value is None:
                raise ValueError(
                    f"ppl_by_arrival[{t}] is None but the model is trained by arrival {t}; "
                    f"evaluate it there"
                )
            ppl = _finite(value, "ppl_by_arrival", t)
            if ppl < 1.0:
                raise ValueError(
                    f"ppl_by_arrival[{t}] = {ppl} is below 1, not a perplexity; pass exp(mean NLL)"
                )
            total += ppl
            count += 1
        out.append(total / count if count else None)
    return out


def trained_average_perplexity(
    ppl_by_arrival: Sequence[float | None], trained_mask: Sequence[bool]
) -> float:
    """The paper's average perplexity over the stream (§6.2, Fig. 5, Table 2): the arithmetic
    mean over arrivals 1..B at which the model has been trained at least once (Table 2's
    non-'*' entries).

    >>> trained_average_perplexity([None, None, 30.0, 20.0], [False, False, True, False])
    25.0
    """
    averages = running_trained_average_perplexity(ppl_by_arrival, trained_mask)
    if averages[-1] is None:
        raise ValueError(
            "trained_mask has no True entry: the model is never trained, so the "
            "average perplexity is undefined"
        )
    return averages[-1]


def running_anytime_nll_bits(ppl_by_arrival: Sequence[float | None]) -> list[float | None]:
    """The anytime cross-entropy (module doc) over arrivals 1..t, for every t: the mean of
    log2(perplexity) over arrivals 1..t, trained or not (None at t = 0, and from the first
    arrival that was not evaluated on).  One point per arrival of an anytime trajectory."""
    if len(ppl_by_arrival) < 2:
        raise ValueError(
            f"ppl_by_arrival has {len(ppl_by_arrival)} entries; pass the perplexity at every "
            f"arrival t = 0..B (B + 1 >= 2 entries, t = 0 is the untrained model)"
        )
    out: list[float | None] = [None]
    total, missing = 0.0, False
    for t in range(1, len(ppl_by_arrival)):
        value = ppl_by_arrival[t]
        if value is None:
            missing = True
        if missing:
            out.append(None)
            continue
        ppl = _finite(value, "ppl_by_arrival", t)
        if ppl < 1.0:
            raise ValueError(
                f"ppl_by_arrival[{t}] = {ppl} is below 1, not a perplexity; pass exp(mean NLL)"
            )
        total += math.log2(ppl)
        out.append(total / t)
    return out


def anytime_nll_bits(ppl_by_arrival: Sequence[float | None]) -> float:
    """The anytime LM metric (module doc): mean over arrivals 1..B of the per-token
    cross-entropy in bits, every arrival charged, the untrained ones with the initial model.

    >>> anytime_nll_bits([4096.0, 4096.0, 16.0, 16.0])  # wait 2: one untrained arrival of 3
    6.666666666666667
    """
    running = running_anytime_nll_bits(ppl_by_arrival)
    if running[-1] is None:
        missing = next(t for t in range(1, len(ppl_by_arrival)) if ppl_by_arrival[t] is None)
        raise ValueError(
            f"ppl_by_arrival[{missing}] is None: the anytime metric charges every arrival 1..B, "
            f"so evaluate the model the learner had at arrival {missing} (the initial model "
            f"before the first training)"
        )
    return running[-1]


def perplexity_from_nll(nll_sum_nats: float, ntokens: int) -> float:
    """exp(mean negative log-likelihood per token).  Takes nats: fairseq logs losses in base 2,
    multiply those by ln 2 first.

    >>> round(perplexity_from_nll(2 * math.log(4.0), 2), 6)
    4.0
    """
    if isinstance(ntokens, bool) or not isinstance(ntokens, numbers.Integral) or ntokens < 1:
        raise ValueError(f"ntokens = {ntokens!r}; the perplexity needs at least 1 scored token")
    nll = _finite(nll_sum_nats, "nll_sum_nats", None)
    if nll < 0:
        raise ValueError(f"nll_sum_nats = {nll} is negative; pass the summed NLL in nats (>= 0)")
    mean = nll / int(ntokens)
    if mean > 700.0:
        raise ValueError(f"mean NLL {mean:.1f} nats/token overflows exp(); the model has diverged")
    return math.exp(mean)
