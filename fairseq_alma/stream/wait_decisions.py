"""``--wait auto``'s memory: every model the learner has had and every arrival's decision.

Why a class of its own: the decision at an arrival (``wait_policy.decide``) needs the learner's
history, and a run killed anywhere must resume to the same decisions.  The history lives in the
learner's checkpoint (``state_dict``) beside the records, so a resumed run holds exactly what
the uninterrupted one held at that arrival; the LM learner and the vision learner share it
through their ``StreamSession``.  Each decision, with the numbers it was made from, also goes
into its arrival's record in ``stream.jsonl``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from . import wait_policy
from .progress import StreamPlan


class WaitDecisions:
    """Models as [n learnt from, m of its stage (mega-batches), error (None: not measured
    yet), examples] and decisions by arrival (JSON-able)."""

    def __init__(self, rate: bool = True) -> None:
        self.rate = rate  # the learner's metric is an error rate (vision), else a loss (LM)
        self.models: list[list[Any]] = [[0, 0, None, 0]]
        self.decisions: dict[int, dict[str, Any]] = {}

    def decide(self, plan: StreamPlan, error: float, examples: int,
               agree: Callable[[bool], bool] | None = None,
               capacity: float = math.inf) -> StreamPlan:
        """The next arrival's decision, from the current model's ``error`` on the arrived
        validation data (``examples`` examples or tokens); ``agree`` makes every rank take the
        same one (any rank that would train makes all train); ``capacity``: the mega-batches a
        stage can learn from (``wait_policy.after_stage``).  Returns the plan with it."""
        arrival = plan.decided + 1
        pending = arrival - (plan.schedule[-1].arrival if plan.schedule else 0)
        self.models[-1][2:] = [float(error), int(examples)]
        points = [wait_policy.ModelPoint(*model, rate=self.rate) for model in self.models
                  if model[2] is not None]
        decision = wait_policy.decide(arrival, plan.num_megabatches, points, pending,
                                      replay=plan.replay, capacity=capacity)
        train = agree(decision.train) if agree is not None else decision.train
        self.decisions[arrival] = {**decision.to_json(), "train": bool(train)}
        if train:
            trained, stage = wait_policy.after_stage(self.models[-1][0], pending, arrival,
                                                     plan.replay, capacity)
            self.models.append([trained, stage, None, 0])
        return plan.with_decision(train)

    def record_extra(self, arrival: int) -> dict[str, Any]:
        """What ``stream.jsonl`` says of the decision at ``arrival`` (nothing at arrival 0)."""
        return {"decision": self.decisions[arrival]} if arrival in self.decisions else {}

    def plan_with_decisions(self, plan: StreamPlan) -> StreamPlan:
        """``plan`` with the decisions held here (after ``load_state_dict``)."""
        return StreamPlan(plan.num_megabatches, plan.wait, plan.replay, plan.replay_ratio,
                          tuple(self.decisions[t]["train"] for t in sorted(self.decisions)))

    def state_dict(self) -> dict[str, Any]:
        return {"models": [list(model) for model in self.models],
                "decisions": {t: dict(d) for t, d in self.decisions.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.models = [list(model) for model in state["models"]]
        self.decisions = {int(t): dict(d) for t, d in state["decisions"].items()}
        if sorted(self.decisions) != list(range(1, len(self.decisions) + 1)):
            raise ValueError(f"--wait auto: decisions of arrivals {sorted(self.decisions)} are "
                             f"not 1 .. {len(self.decisions)}")
