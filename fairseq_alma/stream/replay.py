"""Partial replay (``--replay-ratio r``): which of a stage's updates train on earlier mega-batches.

Why: on a stream whose distribution drifts, training only on the newest mega-batches forgets
the old ones, and the paper's full replay (``--replay``, §4, Fig. 4) makes a stage's data grow
with the stream.  TiC-LM (Li et al., ACL 2025, arXiv:2504.02107, 114 monthly Common Crawl
dumps) finds that a *fixed ratio* of old data in every round, with a fixed token budget per
round, comes close to re-training from scratch at a fraction of the compute.  Ibrahim et al.
2024 (arXiv:2403.08763, "Simple and Scalable Strategies to Continually Pre-train LLMs") reach
the same conclusion with a fixed replay percentage plus LR re-warming.

Semantics (one stage of budget U counted updates):

* exactly ``R = round(r * U)`` of the stage's U update slots are *replay slots* (halves round
  up: ``floor(r * U + 1/2)``, in exact arithmetic on the decimal r the user typed, so
  r = 0.145 of U = 100 is 15 -- in floating point 0.145 * 100 + 0.5 is just below 15); the
  others train on the stage's new mega-batches (the w that arrived since the last stage);
* a slot is one update's worth of batches (``--update-freq`` x data-parallel workers), drawn
  wholly from one side, so an update is either all-new or all-replayed;
* replay slots are spread evenly through the stage (slot u is a replay slot when
  ``floor((u + 1) R / U) > floor(u R / U)``), so replayed data sees every phase of the stage's
  LR schedule rather than, say, only its warmup;
* stage 1 has no earlier mega-batches: it trains on new data only, ``R = 0`` there;
* the spare slots a stage keeps for steps the trainer skips (fp16 overflow, ``lm/budget.py``)
  repeat the same pattern.

Which replayed examples are drawn, and from which earlier mega-batches, is the learner's
business (LM: ``lm/budget.py``, uniformly over all earlier examples, seeded).  ``r = 0`` is
today's stream, bit for bit; ``--replay`` (everything seen, every update) is another flag and
cannot be combined with this one.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from fractions import Fraction

from ..errors import UsageError


def check_replay_ratio(ratio: object, full_replay: bool) -> float:
    """``ratio`` as a float in [0, 1); a one-line ``UsageError`` naming the flag otherwise.

    r = 1 is refused: a stage that never trains on its new data is not a learner of the stream
    (and ``--replay`` already means "everything seen")."""
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not math.isfinite(ratio) \
            or not 0 <= ratio < 1:
        raise UsageError(f"--replay-ratio must be in [0, 1) (the fraction of a stage's updates "
                         f"drawn from earlier mega-batches); got {ratio!r}")
    if ratio > 0 and full_replay:
        raise UsageError(f"--replay-ratio {ratio:g} cannot be combined with --replay (which "
                         f"trains every update on everything seen); use one of them")
    return float(ratio)


def replay_slots(budget: int, ratio: float) -> int:
    """R: replayed updates in a stage of ``budget`` updates that has earlier data.

    ``round(r * U)`` with halves up, computed on the decimal the user typed: a float's
    shortest repr is that decimal (``0.145``, not the binary 0.14499999...), and a Fraction of
    it is exact, so a ratio that lands on a half rounds up as documented, whatever the float
    error of ``r * U`` (which makes ``floor(0.145 * 100 + 0.5)`` 14)."""
    exact = Fraction(repr(float(ratio))) * budget
    return math.floor(exact + Fraction(1, 2))


def check_replay_budget(ratio: float, budget: int) -> None:
    """Refuse a ratio the stage budget cannot honour: one that rounds to no replayed update
    (the run would silently be r = 0) or to every update (the stage would never see its new
    mega-batches)."""
    if ratio <= 0:
        return
    replayed = replay_slots(budget, ratio)
    if not 0 < replayed < budget:
        raise UsageError(f"--replay-ratio {ratio:g} of a stage's {budget} updates rounds to {replayed} "
                         f"replayed updates; choose a ratio that gives between 1 and {budget - 1} "
                         f"(or more updates per stage)")


def is_replay_slot(slot: int, budget: int, replayed: int) -> bool:
    """Whether update slot ``slot`` (0-based, may run past the budget into the spare slots) of a
    stage with ``replayed`` replay slots out of ``budget`` draws from earlier mega-batches."""
    u = slot % budget
    return (u + 1) * replayed // budget > u * replayed // budget


def slot_pattern(slots: int, budget: int, replayed: int) -> list[bool]:
    """``is_replay_slot`` for slots 0 .. ``slots`` - 1 (True = replay)."""
    return [is_replay_slot(u, budget, replayed) for u in range(slots)]


def counted_replays(budget: int, replayed: int, skipped_slots: Iterable[int]) -> int:
    """Replayed *counted* updates of a finished stage: the replay slots among the slots its
    ``budget`` counted updates consumed.  A step the trainer skipped (``skipped_slots``, from
    ``StageClock``) trained on nothing and pushed the counted updates one slot on, so with skips
    this can differ from ``replayed`` by at most their number; without skips it equals it."""
    skipped = set(skipped_slots)
    consumed = range(budget + len(skipped))
    return sum(1 for u in consumed if u not in skipped and is_replay_slot(u, budget, replayed))
