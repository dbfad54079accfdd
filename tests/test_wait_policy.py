"""``--wait auto``'s rule (``stream/wait_policy.py``) and the plan it grows
(``StreamPlan.with_decision``): pure Python, exact."""

from __future__ import annotations

import math
import random

import pytest

from fairseq_alma.errors import UsageError
from fairseq_alma.stream.progress import AUTO, StreamPlan, parse_wait, wait_flag, wait_from_flag
from fairseq_alma.stream.wait_policy import (
    RETENTION_GRID,
    LearningCurve,
    ModelPoint,
    decide,
    fit_curves,
    plan_cost,
)


def _models(curve: LearningCurve, stages: list[int], examples: int = 1) -> list[ModelPoint]:
    """The untrained model and one model per stage of the given sizes, errors on the curve,
    each measured on ``examples`` validation examples."""
    points, seen = [ModelPoint(0, 0, curve(0, 0), examples)], 0
    for size in stages:
        seen += size
        points.append(ModelPoint(seen, size, curve(seen, size), examples))
    return points


@pytest.mark.parametrize("retention", [0.0, 0.3, 1.0])
def test_the_belief_centres_on_the_curve_that_made_the_points(retention):
    truth = LearningCurve(scale=0.9, exponent=0.4, retention=retention)
    belief = fit_curves(_models(truth, [1, 1, 2, 1, 3], examples=1000))
    assert belief.most_likely.retention == pytest.approx(retention)
    assert belief.most_likely.exponent == pytest.approx(0.4)
    assert belief.most_likely.scale == pytest.approx(0.9)
    assert sum(belief.beliefs) == pytest.approx(1.0)
    assert belief.mean_retention == pytest.approx(retention, abs=0.15)
    # the same curve seen on one example per model: the same best fit, a belief still spread
    vague = fit_curves(_models(truth, [1, 1, 2, 1, 3]))
    assert vague.most_likely.retention == pytest.approx(retention)
    assert max(vague.beliefs) < 0.2


def test_a_few_noisy_models_leave_the_belief_spread():
    """Three models, the last no better than the one before, then two noisy ones: no evidence
    of forgetting or of keeping, so no retention is believed much more than another."""
    points = [ModelPoint(0, 0, 0.9, 10), ModelPoint(1, 1, 0.6, 20), ModelPoint(2, 1, 0.6, 30)]
    assert max(fit_curves(points).beliefs) < 0.2
    noisy = points + [ModelPoint(3, 1, 0.45, 40), ModelPoint(4, 1, 0.5, 50)]
    assert max(fit_curves(noisy).beliefs) < 0.2
    # an LM's validation NLL: a drop, then a plateau; it reads as forgetting, but an LM stage
    # reads half a mega-batch (its U batches), so waiting gains nothing and it trains
    plateau = [ModelPoint(t / 2, min(t, 1) / 2, nll, 5000, rate=False)
               for t, nll in enumerate([7.54, 5.89, 5.80, 5.76])]
    assert fit_curves(plateau).mean_retention < 0.5
    assert decide(4, 8, plateau, pending=1, capacity=0.5).train


def test_six_wrong_of_six_is_not_a_certainty():
    """An error rate of 1 on a handful of examples weighs like its Jeffreys estimate, not like
    a measurement without noise (the binomial variance of log e vanishes as e -> 1)."""
    few = ModelPoint(1, 1, 1.0, 6)
    assert few.weight == pytest.approx(6 * (6.5 / 7) / (0.5 / 7))
    assert ModelPoint(1, 1, 0.0, 6).weight == pytest.approx(6 * (0.5 / 7) / (6.5 / 7))
    assert few.weight < ModelPoint(9, 1, 0.15, 600).weight


def test_priors_while_the_points_cannot_tell():
    lone = fit_curves([ModelPoint(0, 0, 0.8)])
    assert lone.beliefs == pytest.approx([1 / len(RETENTION_GRID)] * len(RETENTION_GRID))
    assert lone.most_likely == LearningCurve(0.8, 0.5, 1.0)  # a tie: the larger retention
    one_stage = fit_curves([ModelPoint(0, 0, 0.8), ModelPoint(1, 1, 0.5)])
    assert max(one_stage.beliefs) == pytest.approx(min(one_stage.beliefs))
    assert one_stage.most_likely.exponent == pytest.approx(math.log(1.6, 2))


def _brute_force(curve, current, gap, pending, arrival, num_megabatches, replay, capacity):
    """plan_cost arrival by arrival, as its docstring says: a stage learns from its new
    mega-batches (all arrived with replay), at most ``capacity`` of them."""
    calibration = current.error / curve(current.trained, current.stage)
    total, error, waiting, learnt = 0.0, current.error, pending, current.trained
    for arrived in range(arrival, num_megabatches + 1):
        if waiting >= gap:
            stage = min(arrived if replay else waiting, capacity)
            learnt = min(arrived, learnt + (capacity if replay else stage))
            error = calibration * curve(learnt, stage)
            waiting = 0
        total += error
        waiting += 1
    return total


def test_plan_cost_is_the_arrival_by_arrival_sum():
    rng = random.Random(0)
    for _ in range(300):
        curve = LearningCurve(rng.uniform(0.1, 1), rng.uniform(0.01, 2), rng.choice([0, 0.5, 1]))
        trained = rng.randint(0, 20)
        current = ModelPoint(trained, rng.randint(0, trained), rng.uniform(0.05, 0.9))
        pending, replay = rng.randint(1, 9), rng.random() < 0.5
        arrival = trained + pending
        num_megabatches = arrival + rng.randint(0, 30)
        capacity = rng.choice([math.inf, 0.5, 2.0, 3.0])
        for gap in range(1, num_megabatches - arrival + pending + 3):
            args = (curve, current, gap, pending, arrival, num_megabatches, replay, capacity)
            assert plan_cost(*args) == pytest.approx(_brute_force(*args))


def test_a_stage_that_reads_one_megabatch_gains_nothing_by_waiting():
    """An LM stage reads U batches whatever it is given: when they cover one mega-batch, a
    bigger stage is no better, so waiting is never predicted to pay, even for a learner whose
    curve is in the stage's data alone (one that forgets)."""
    forgets = _models(LearningCurve(0.9, 0.5, 0.0), [1, 1, 1, 1])
    unbounded = decide(5, 20, forgets, pending=1)
    assert not unbounded.train and unbounded.cost_wait < unbounded.cost_train_now
    capped = decide(5, 20, forgets, pending=1, capacity=1.0)
    assert capped.cost_wait >= capped.cost_train_now - 1e-12
    keeps = _models(LearningCurve(0.9, 0.5, 1.0), [1, 1, 1, 1])
    assert decide(5, 20, keeps, pending=1, capacity=1.0).train


def test_a_learner_that_keeps_what_it_learnt_trains_at_every_arrival():
    """Once its models show it keeps what it learnt; while they cannot tell, it hedges."""
    keeps = LearningCurve(0.9, 0.5, 1.0)
    decision = decide(4, 20, _models(keeps, [1, 1, 1], examples=1000), pending=1)
    assert decision.train and decision.best_gap == 1 and decision.curve_retention == 1.0
    assert decision.retention_mean > 0.8
    hedge = decide(4, 20, _models(keeps, [1, 1, 1]), pending=1)
    assert not hedge.train and 1 < hedge.best_gap < 17 and 0.3 < hedge.retention_mean < 0.7


def test_a_learner_that_forgets_waits_for_a_bigger_stage_then_trains():
    models = _models(LearningCurve(0.9, 0.5, 0.0), [1, 1, 1])
    early = decide(4, 20, models, pending=1)
    assert not early.train and early.best_gap > 1
    assert early.cost_wait < early.cost_train_now
    # the same learner at the last arrival, 5 mega-batches waiting: a stage of 5 beats its
    # model of 1, and nothing is left to wait for
    last = decide(8, 8, models, pending=5)
    assert last.train and last.pending == 5 and last.remaining == 0


def test_the_last_arrival_trains_iff_the_curve_predicts_a_better_model():
    models = [ModelPoint(0, 0, 0.9), ModelPoint(1, 1, 0.5)]
    assert decide(2, 2, models, pending=1).train
    # a learner that forgets, its model from a stage of 4: one mega-batch would make it worse
    forgets = _models(LearningCurve(0.9, 0.5, 0.0), [4, 4, 4, 4])
    assert fit_curves(forgets).most_likely.retention == 0.0
    assert not decide(17, 17, forgets, pending=1).train
    assert decide(20, 20, forgets, pending=4).train  # 4 waiting: as good as its model (a tie trains)
    assert decide(21, 21, forgets, pending=5).train  # 5 waiting: a bigger stage than any before


def test_decide_refuses_what_is_not_a_decision():
    with pytest.raises(ValueError):
        decide(2, 5, [ModelPoint(0, 0, 0.9), ModelPoint(2, 2, 0.5)], pending=0)  # nothing
    with pytest.raises(ValueError):
        decide(6, 5, [ModelPoint(0, 0, 0.9)], pending=6)


def test_the_plan_grows_one_decision_at_a_time():
    plan = StreamPlan(5, AUTO)
    assert plan.max_stages == 5 and plan.num_stages == 0
    assert [a.arrival for a in plan.arrivals] == [0]
    for train in (False, True, True, False):
        plan = plan.with_decision(train)
    assert [(s.index, s.arrival, s.train_megabatches) for s in plan.schedule] == [
        (1, 2, (0, 1)), (2, 3, (2,))]
    assert [(a.arrival, a.stage, a.trained) for a in plan.arrivals] == [
        (0, 0, False), (1, 0, False), (2, 1, True), (3, 2, True), (4, 2, False)]
    assert plan.initial_model_answers
    replayed = StreamPlan(5, AUTO, replay=True, decisions=(False, True, True))
    assert replayed.stage(2).train_megabatches == (0, 1, 2)


def test_wait_values_on_the_command_line():
    assert parse_wait("auto") == AUTO and parse_wait("3") == 3
    assert wait_flag("auto") is None and wait_from_flag(None) == AUTO and wait_from_flag(2) == 2
    assert wait_flag("0") == 0  # refused by StreamPlan, in fairseq-alma's one line
    for bad in ("0", "-1", "soon", "1.5"):
        with pytest.raises(Exception, match="whole number of mega-batches >= 1 or auto"):
            parse_wait(bad)
    with pytest.raises(Exception, match="whole number of mega-batches >= 1 or auto"):
        wait_flag("soon")
    with pytest.raises(UsageError, match="one mega-batch leaves nothing to decide"):
        StreamPlan(1, AUTO)
    with pytest.raises(UsageError, match="--replay-ratio: not supported"):
        StreamPlan(4, AUTO, replay_ratio=0.25)
