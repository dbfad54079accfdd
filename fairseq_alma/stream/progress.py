"""Where a stream stands, and what happens at the end of every stage (paper §3, §3.1).

``StreamPlan`` is the stream a learner sees: B mega-batches, waiting time w, replay (full, or a
fixed fraction of each stage's updates: ``stream/replay.py``).  From it the
schedule (``schedule.py``) says which stages train on which mega-batches, and the arrival table
says which stage answers the evaluation after each arrival t = 0..B.

``StreamProgress`` holds the records written so far and runs the stage-end protocol that every
learner shares (LM through fairseq, vision through its own loop):

    the learner trains stage s  ->  close_stage(s):  keep the stage checkpoint (s = 0: the
                                                     initialised model, when it answers
                                                     arrivals before the first training),
                                                     measure the model once,
                                                     record every arrival stage s answers,
                                                     rewrite stream.jsonl atomically

Arrival 0 (the untrained model) is ``close_stage(0)``.  The records travel in the learner's
checkpoint (``state_dict``), so a run killed anywhere and resumed by the same command records
exactly the arrivals that are still missing: never one twice, never one lost.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import UsageError
from .records import ArrivalRecord
from .replay import check_replay_ratio, replay_slots
from .run_dir import RunDirectory
from .schedule import ArrivalInfo, Stage, arrival_table, build_schedule, schedule_at

Measured = TypeVar("Measured")


AUTO = "auto"  # --wait auto: decided at each arrival (``wait_policy.py``)


def parse_wait(text: str) -> int | str:
    """A waiting time on the command line: a whole number of mega-batches >= 1, or ``auto``."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a waiting time is a whole number of mega-batches >= 1 "
                                         f"or auto, got {text!r}")
    return value


# What --wait auto cannot honour, with the reason (fairseq-train refuses these before anything
# is trained, alma-sweep before it submits)
AUTO_CONFLICTS = {
    "scale-updates-by-wait": "every stage gets --updates-per-stage updates, whatever the "
                             "arrivals it covers",
    "grow-experts": "growth is planned per stage in advance",
    "replay-ratio": "the replayed share of a stage of unknown size",
    "update-freq": "a per-stage list: the policy weighs what one stage can read, the same for every stage",
}


# the split an LM's --wait auto decisions read (``StreamTraining.measure``'s validation NLL)
DECISION_SUBSET = "valid"


def auto_wait_conflict(flags: Mapping[str, Any]) -> str | None:
    """The one-line refusal for the first flag in ``flags`` (name without dashes -> value)
    that ``--wait auto`` cannot honour, or None."""
    for flag, why in AUTO_CONFLICTS.items():
        if flags.get(flag):
            return f"--wait auto with --{flag}: not supported ({why}); use a fixed --wait"
    if str(flags.get("eval-subset") or "").strip() == DECISION_SUBSET:
        # the scored split would be the one every decision read: a schedule picked on its test
        return (f"--wait auto with --eval-subset {DECISION_SUBSET}: its decisions read "
                f"'{DECISION_SUBSET}', which would then be scored; score another split "
                "(the default, eval) or use a fixed --wait")
    return None


def wait_flag(text: str) -> int | None:
    """fairseq-train's ``--wait``: any whole number as before (``StreamPlan`` says which are
    allowed, in one line), ``auto`` as None: the field stays an integer, so the fingerprints
    of existing runs do not change."""
    if text.strip().lower() == AUTO:
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a waiting time is a whole number of mega-batches >= 1 "
                                         f"or auto, got {text!r}") from None


def wait_from_flag(value: int | str | None) -> int | str:
    """The plan's waiting time from the integer field (``wait_flag``: None is auto)."""
    return AUTO if value is None or value == AUTO else int(value)


def wait_order(wait: int | str) -> float:
    """Sort key: fixed waiting times in order, ``auto`` after them."""
    return float("inf") if wait == AUTO else float(wait)


@dataclass(frozen=True)
class StreamPlan:
    """The stream a learner sees: B mega-batches arriving one by one, waiting time w, replay
    (``replay``: everything seen; ``replay_ratio``: that fraction of each stage's updates from
    the mega-batches that arrived before the stage's new ones).

    ``wait="auto"``: no schedule in advance; ``decisions`` holds train (True) or wait at each
    arrival decided so far (1 … len), and the schedule and arrival table cover those arrivals
    (``with_decision`` adds the next)."""

    num_megabatches: int
    wait: int | str = 1
    replay: bool = False
    replay_ratio: float = 0.0
    decisions: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.num_megabatches, bool) or not isinstance(self.num_megabatches, int) \
                or self.num_megabatches < 1:
            raise UsageError(f"--num-megabatches must be an integer >= 1 (got "
                             f"{self.num_megabatches!r})")
        if self.adaptive:
            self._check_adaptive()
            return
        if isinstance(self.wait, bool) or not isinstance(self.wait, int) \
                or not 1 <= self.wait <= self.num_megabatches:
            raise UsageError(f"--wait must be in [1, {self.num_megabatches}] (the stream's "
                             f"mega-batches); got {self.wait}")
        check_replay_ratio(self.replay_ratio, self.replay)
        if self.replay_ratio > 0 and self.num_megabatches // self.wait < 2:
            raise UsageError(f"--replay-ratio {self.replay_ratio:g} has nothing to replay: with "
                             f"--wait {self.wait} the stream of {self.num_megabatches} mega-batches "
                             f"trains one stage, and a stage replays only earlier stages' data")

    def _check_adaptive(self) -> None:
        if self.num_megabatches < 2:
            raise UsageError("--wait auto: a stream of one mega-batch leaves nothing to decide; "
                             "use --wait 1")
        conflict = auto_wait_conflict({"replay-ratio": self.replay_ratio})
        if conflict:
            raise UsageError(conflict)
        if len(self.decisions) > self.num_megabatches:
            raise ValueError(f"{len(self.decisions)} decisions for {self.num_megabatches} arrivals")

    @property
    def adaptive(self) -> bool:
        return self.wait == AUTO

    @property
    def decided(self) -> int:
        """Arrivals whose schedule is known: all of them, unless ``--wait auto``."""
        return len(self.decisions) if self.adaptive else self.num_megabatches

    def with_decision(self, train: bool) -> StreamPlan:
        """This plan with the next arrival's decision (``--wait auto``)."""
        assert self.adaptive and len(self.decisions) < self.num_megabatches
        return dataclasses.replace(self, decisions=(*self.decisions, bool(train)))

    @functools.cached_property
    def schedule(self) -> list[Stage]:
        if self.adaptive:
            arrivals = [t for t, train in enumerate(self.decisions, start=1) if train]
            return schedule_at(arrivals, self.replay)
        return build_schedule(self.num_megabatches, self.wait, self.replay,
                              partial_replay=self.replay_ratio > 0)

    @functools.cached_property
    def arrivals(self) -> list[ArrivalInfo]:
        if self.decided == 0:  # --wait auto before its first decision: the untrained model
            return [ArrivalInfo(arrival=0, stage=0, trained=False, megabatches_seen=0)]
        return arrival_table(self.schedule, self.decided)

    @property
    def initial_model_answers(self) -> bool:
        """True when arrivals 1.. come before the first training (--wait > 1): the initialised
        model is what the learner offers there, and the anytime metric charges it."""
        return any(info.stage == 0 and info.arrival >= 1 for info in self.arrivals)

    @property
    def num_stages(self) -> int:
        return len(self.schedule)

    @property
    def max_stages(self) -> int:
        """The most stages the stream can have: its schedule's, or B with ``--wait auto``."""
        return self.num_megabatches if self.adaptive else self.num_stages

    def stage(self, index: int) -> Stage:
        """Stage ``index`` (1-based)."""
        return self.schedule[index - 1]

    def replay_slots(self, index: int, budget: int) -> int:
        """Replay slots of stage ``index`` with ``budget`` updates: round(r x budget), or 0 for
        a stage with no earlier mega-batches (stage 1) or without partial replay."""
        return replay_slots(budget, self.replay_ratio) if self.stage(index).replay_megabatches else 0


class StreamProgress:
    """Records written so far and the stage-end protocol (module doc)."""

    def __init__(self, plan: StreamPlan, run_dir: RunDirectory) -> None:
        self.plan = plan
        self.run_dir = run_dir
        self.records: dict[int, ArrivalRecord] = {}

    def pending(self, stages_done: int) -> list[ArrivalInfo]:
        """Arrivals answered by the model after ``stages_done`` stages, not recorded yet."""
        return [info for info in self.plan.arrivals
                if info.stage == stages_done and info.arrival not in self.records]

    def ordered(self) -> list[ArrivalRecord]:
        return [self.records[arrival] for arrival in sorted(self.records)]

    @property
    def complete(self) -> bool:
        return len(self.records) == self.plan.num_megabatches + 1

    def close_stage(
        self,
        stages_done: int,
        measure: Callable[[], Measured],
        record: Callable[[ArrivalInfo, Measured], ArrivalRecord],
        keep_checkpoint: Callable[[int], Any] | None = None,
    ) -> list[ArrivalRecord]:
        """The stage-end protocol for the model after ``stages_done`` stages (module doc).

        ``keep_checkpoint(s)`` keeps the end of stage s (every process calls it, the run
        directory decides who writes); s = 0, the initialised model, only while it is still the
        model (its arrival not yet recorded) and only if it answers arrivals >= 1 (--wait > 1),
        so scoring can charge the arrivals a waiting learner had nothing trained for; ``measure()`` evaluates the model once, however many
        arrivals it answers; ``record(info, measured)`` builds one arrival's record.
        """
        pending = self.pending(stages_done)
        if keep_checkpoint is not None and (stages_done >= 1 or (
                pending and self.plan.initial_model_answers)):
            keep_checkpoint(stages_done)
        if not pending:
            return []
        measured = measure()
        new = [record(info, measured) for info in pending]
        for item in new:
            self.records[item.arrival] = item
        self.run_dir.write_records(self.ordered())
        return new

    # ---- checkpointing -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (checkpoints may be loaded with ``weights_only``)."""
        return {"records": [r.to_json() for r in self.ordered()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.records = {}
        for obj in state.get("records", []):
            item = ArrivalRecord.from_json(obj)
            self.records[item.arrival] = item
