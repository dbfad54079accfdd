"""``--wait auto``: at every arrival, train now or wait for the next mega-batch (beyond the paper).

The paper finds no formula for the best waiting time: it depends on the horizon, the model,
how fast it learns and where it starts.  A fixed ``w`` is chosen in hindsight; this rule
decides at each arrival t from what the learner has there, and nothing else:

  v_now     the current model's error on the validation data that has arrived (vision: the
            validation parts of the arrived mega-batches, never trained on, a stage only picks
            its epoch on its own part; LM: the validation NLL per token)
  models    for every model the learner has had (the untrained one, then one per stage): n,
            the mega-batches trained on so far, m, those of the stage that made it, and its
            error, measured like v_now (refreshed at each arrival while it is the current model)
  k, R      the mega-batches waiting to be trained on, and R = B - t arrivals still to come
            (B is known in ALMA)

**The learning curve.**  A model's error is fitted as a power law in the data it effectively
learnt from:

    e(n, m) = a (1 + m + rho (n - m))^(-alpha)

m is the stage's own data and n - m what earlier stages saw; rho in [0, 1] is how much of that
the learner keeps.  rho = 1: it keeps all (a fine-tuned learner that does not forget: the error
falls with n, and frequent stages pay); rho = 0: only the last stage counts (a learner that
forgets, or starts each stage from scratch: small stages make poor models, and waiting pays).
With ``--replay`` a stage trains on everything arrived, m = n.  A stage learns from no more
than its updates read: an LM stage gets U updates whatever it is given, so m is at most the
mega-batches U batches cover (``capacity``, ``after_stage``) and waiting for more gains it
nothing; a vision stage reads all its data every epoch.

**What the learner believes about rho.**  For each rho of a grid, (a, alpha) are weighted least
squares in log space, each model weighted by the inverse variance of its log error (an error
rate measured on N examples: binomial, with Jeffreys' half example so that 0 of 6 or 6 of 6 is
not taken as certain; a loss: its N tokens).  The models rarely tell rho apart: stages of one
size show it only through how the error falls with n, which alpha can explain too.  So the rule
does not bet on one rho (an earlier version kept rho = 1 unless an F-test rejected it, and
trained at every arrival on a stream where waiting for two mega-batches was 20% better).  It
weighs every rho of the grid by how well it explains the models, a posterior from a flat
prior: exp(-(residual - least residual) / 2 s^2), s^2 the least residual per degree of freedom
left (models - 3) and at least 1 (the quasi-likelihood scale: a curve that fits worse than
sampling noise spreads the belief instead of sharpening it).  alpha = ``PRIOR_EXPONENT`` (0.5,
the middle of the exponents reported for classification error in "Deep learning scaling is
predictable", Hestness et al. 2017) while there is one distinct data size.

**The decision.**  For every gap g (train when g mega-batches wait, and every g arrivals after
that, up to B; the last g never trains again), each curve predicts the error at each arrival
t … B (scaled to match v_now for the current model), and the anytime metric charges their
sum (v_now until the first stage); the plan's cost is that sum averaged over the belief.  The
learner trains now iff the cheapest plan trains at this arrival (g <= k).  Averaging hedges:
while the models cannot tell a learner that forgets from one that keeps, waiting a few
arrivals costs little if it keeps and saves much if it forgets, so the rule waits; as its
models pin rho down, it follows the curve.  A tie trains: a model of the newest data is never
predicted worse, and a misfitted curve that says no stage can help must not stop the learner
for good.  This looks ahead over the whole horizon: early on a learner that forgets waits for
bigger stages; near the end a stage must pay for itself over the few arrivals left, and at
t = B it trains unless the curves predict a worse model than the current one.  Compute is not
priced: a vision stage costs its data times its epochs (the same for any schedule that trains
on the same data), an LM stage its ``--updates-per-stage`` (fewer stages, less compute).

Pure Python: no torch, so the decisions are exact, cheap and testable anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

PRIOR_EXPONENT = 0.5
EXPONENT_RANGE = (0.01, 3.0)  # a fit outside it is noise from a handful of points
RETENTION_GRID = tuple(i / 10 for i in range(11))
FLOOR = 1e-4  # errors are floored here before taking logs (an error of 0 is a point too)
NEGLIGIBLE = 1e-6  # a curve with less belief than this is left out of the plans' costs


@dataclass(frozen=True)
class ModelPoint:
    """One model the learner has had: mega-batches trained on so far (n), those of the stage
    that made it (m; 0 for the untrained model), and its error on arrived validation data."""

    trained: float
    stage: float
    error: float
    examples: int = 1  # validation examples (or tokens) behind ``error``: its weight in the fit
    rate: bool = True  # an error rate in [0, 1] (vision); False: a loss (LM: NLL per token)

    @property
    def weight(self) -> float:
        """The inverse variance of log(error): for an error rate measured on N examples
        (binomial) var log e ~ (1 - e) / (e N), e with Jeffreys' half example, (k + 1/2) /
        (N + 1), so that 6 wrong of 6 is not a certainty that outweighs every other model; for
        a mean loss over N tokens ~ 1 / N."""
        examples = max(self.examples, 1)
        if not self.rate:
            return float(examples)
        error = (min(max(self.error, 0.0), 1.0) * examples + 0.5) / (examples + 1)
        return examples * error / (1.0 - error)


@dataclass(frozen=True)
class LearningCurve:
    """e(n, m) = scale (1 + m + retention (n - m))^(-exponent) (module doc)."""

    scale: float
    exponent: float
    retention: float

    def __call__(self, trained: float, stage: float) -> float:
        effective = stage + self.retention * (trained - stage)
        return self.scale * (1.0 + effective) ** (-self.exponent)


def _fit_power_law(xs: list[float], ys: list[float],
                   weights: list[float]) -> tuple[float, float, float]:
    """(log scale, exponent, weighted squared residual) of y = log scale - exponent x."""
    total = sum(weights)
    mean_x = sum(w * x for w, x in zip(weights, xs)) / total
    mean_y = sum(w * y for w, y in zip(weights, ys)) / total
    spread = sum(w * (x - mean_x) ** 2 for w, x in zip(weights, xs))
    if spread < 1e-12:
        exponent = PRIOR_EXPONENT
    else:
        slope = sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(weights, xs, ys)) / spread
        exponent = min(max(-slope, EXPONENT_RANGE[0]), EXPONENT_RANGE[1])
    log_scale = mean_y + exponent * mean_x
    residual = sum(w * (y - log_scale + exponent * x) ** 2 for w, x, y in zip(weights, xs, ys))
    return log_scale, exponent, residual


@dataclass(frozen=True)
class CurveBelief:
    """The curve of each retention of the grid, with how much the learner believes it."""

    curves: tuple[LearningCurve, ...]
    beliefs: tuple[float, ...]  # sums to 1

    @property
    def most_likely(self) -> LearningCurve:
        """The curve believed most (a tie: the larger retention)."""
        return max(zip(self.beliefs, self.curves), key=lambda bc: (bc[0], bc[1].retention))[1]

    @property
    def mean_retention(self) -> float:
        return sum(b * c.retention for b, c in zip(self.beliefs, self.curves))

    def expected(self, cost: Callable[[LearningCurve], float]) -> float:
        """``cost`` averaged over the belief (curves with a negligible belief left out)."""
        kept = [(b, c) for b, c in zip(self.beliefs, self.curves) if b >= NEGLIGIBLE]
        return sum(b * cost(c) for b, c in kept) / sum(b for b, _ in kept)


def fit_curves(points: Sequence[ModelPoint]) -> CurveBelief:
    """The power law of each retention of the grid and its posterior (module doc): weighted
    least squares in log space; belief exp(-(residual - least) / 2 s^2) from a flat prior, s^2
    the least residual per degree of freedom left, at least 1."""
    if not points:
        raise ValueError("fit_curves needs at least the untrained model's point")
    ys = [math.log(max(p.error, FLOOR)) for p in points]
    weights = [p.weight for p in points]
    curves, residuals = [], []
    for retention in RETENTION_GRID:
        xs = [math.log1p(p.stage + retention * (p.trained - p.stage)) for p in points]
        log_scale, exponent, residual = _fit_power_law(xs, ys, weights)
        curves.append(LearningCurve(math.exp(log_scale), exponent, retention))
        residuals.append(residual)
    least = min(residuals)
    freedom = len(points) - 3  # three parameters: scale, exponent, retention
    scale = max(least / freedom, 1.0) if freedom > 0 else 1.0
    likelihoods = [math.exp(-(r - least) / (2.0 * scale)) for r in residuals]
    total = sum(likelihoods)
    return CurveBelief(tuple(curves), tuple(lk / total for lk in likelihoods))


def after_stage(trained: float, waiting: int, arrived: int, replay: bool,
                capacity: float = math.inf) -> tuple[float, float]:
    """(n, m) of the model a stage makes: m is what the stage learns from, its new mega-batches
    (all arrived ones with replay) but at most ``capacity``, the mega-batches its updates can
    read (an LM stage reads U batches whatever it is given: ``--updates-per-stage``); n adds
    it to what earlier stages learnt from, at most everything arrived."""
    stage = min(arrived if replay else waiting, capacity)
    return min(float(arrived), trained + (stage if not replay else capacity)), stage


def plan_cost(curve: LearningCurve, current: ModelPoint, gap: int, pending: int, arrival: int,
              num_megabatches: int, replay: bool, capacity: float = math.inf) -> float:
    """Predicted sum of the errors at arrivals ``arrival`` … B when the learner trains as soon
    as ``gap`` mega-batches wait (now, if ``pending`` >= gap) and every ``gap`` arrivals after
    that.  The curve predicts changes from the ``current`` model, whose error is measured: a
    model the curve rates e' is expected at current.error x e' / e(current)."""
    steps = num_megabatches - arrival + 1
    delay = max(0, gap - pending)  # arrivals until the first stage
    if delay >= steps:
        return steps * current.error
    calibration = current.error / curve(current.trained, current.stage)
    total, waiting, trained = delay * current.error, pending + delay, current.trained
    arrived, steps = arrival + delay, steps - delay
    while steps > 0:  # a stage now; its model answers ``gap`` arrivals (or up to B)
        trained, stage = after_stage(trained, waiting, arrived, replay, capacity)
        span = min(gap, steps)
        total += span * calibration * curve(trained, stage)
        steps -= span
        waiting, arrived = gap, arrived + gap
    return total


@dataclass(frozen=True)
class Decision:
    """One arrival's choice and the numbers it was made from (written to ``stream.jsonl``)."""

    arrival: int
    train: bool
    pending: int  # k: mega-batches arrived and not trained on
    remaining: int  # R = B - t
    error_now: float  # v_now
    best_gap: int  # g of the cheapest plan (> pending + remaining: never train again)
    cost_train_now: float  # expected error sum t..B of the cheapest plan that trains now
    cost_wait: float  # ... of the cheapest plan that waits
    curve_scale: float  # the most likely curve's
    curve_exponent: float
    curve_retention: float
    retention_mean: float  # the retention averaged over the belief
    models: int  # points the curves were fitted to
    stage_capacity: float | None = None  # mega-batches a stage can learn from (None: all)

    def to_json(self) -> dict[str, Any]:
        return {key: (round(value, 6) if isinstance(value, float) else value)
                for key, value in asdict(self).items()}


def decide(arrival: int, num_megabatches: int, models: Sequence[ModelPoint], pending: int,
           replay: bool = False, capacity: float = math.inf) -> Decision:
    """Train now or wait, at ``arrival`` (module doc), with ``pending`` mega-batches waiting.
    ``models`` holds every model the learner has had, the current one last (its error
    measured at this arrival); ``capacity``: the mega-batches a stage can learn from
    (``after_stage``)."""
    current = models[-1] if models else None
    if current is None or not 1 <= arrival <= num_megabatches or not 1 <= pending <= arrival:
        raise ValueError(f"no decision to make at arrival {arrival} of {num_megabatches} with "
                         f"{pending} mega-batches waiting")
    belief = fit_curves(models)
    remaining = num_megabatches - arrival

    never = pending + remaining + 1  # a gap this long never trains again
    cost = {gap: belief.expected(lambda curve, gap=gap: plan_cost(
        curve, current, gap, pending, arrival, num_megabatches, replay, capacity))
        for gap in range(1, never + 1)}
    train_now = min(range(1, pending + 1), key=lambda gap: (cost[gap], gap))
    wait = min(range(pending + 1, never + 1), key=lambda gap: (cost[gap], gap))
    cost_now, cost_wait = cost[train_now], cost[wait]
    train = cost_now <= cost_wait  # a tie trains (module doc)
    likely = belief.most_likely
    return Decision(arrival=arrival, train=train, pending=pending, remaining=remaining,
                    error_now=current.error, best_gap=train_now if train else wait,
                    cost_train_now=cost_now, cost_wait=cost_wait, curve_scale=likely.scale,
                    curve_exponent=likely.exponent, curve_retention=likely.retention,
                    retention_mean=belief.mean_retention, models=len(models),
                    stage_capacity=capacity if math.isfinite(capacity) else None)
