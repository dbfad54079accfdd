"""Where training stands inside a stream: the stage, its counted updates, its skipped steps.

Why the core keeps its own clock: a stage is a budget of *counted* updates (paper §5: 120,000,
App. B.2: the LR restarts every stage), but a trainer may take a step that does not count.
fairseq skips an update whose fp16 gradients overflow (dynamic loss scaling) and does not
advance ``num_updates``; with ``--amp`` it retries the batch and may skip it too.  A stage that
ended after a fixed number of *batches* would then end early, and everything keyed on the
stage (growth, fresh initialisation, the optimizer reset, the LR restart, the records) would
drift into the previous stage's data.  The clock counts every update attempt, tells the trainer
when the stage's budget of counted updates is done, checks that fairseq's update counter agrees
with it, and is saved in the checkpoint so a resumed run continues it exactly.

Because the clock stops the run whenever fairseq's counter is not ``expected_updates()``, the
counter *is* the clock's position: ``stage_position(num_updates, budget)`` turns it back into
(stage, counted updates), which is how the LR scheduler, which fairseq only hands the counter,
keys on the stream's stage (``optim/alma_stage_linear.py``).  The clock also keeps *which*
attempts of a stage were skipped (``skipped_slots``): with partial replay an attempt's batches
are fixed by its slot, so the replayed counted updates follow from them (``stream/replay.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import RunDirError


@dataclass
class StageClock:
    """Counted and skipped updates of the current stage (1-based), and skips per stage."""

    budget: int  # counted updates per stage
    stage: int = 1
    counted: int = 0
    skipped: int = 0
    skipped_by_stage: dict[int, int] = field(default_factory=dict)
    skipped_slots: dict[int, list[int]] = field(default_factory=dict)  # 0-based attempt numbers

    @property
    def done(self) -> bool:
        """The stage has all its counted updates."""
        return self.counted >= self.budget

    def expected_updates(self) -> int:
        """fairseq's ``num_updates`` where the clock stands: stages before times the budget,
        plus this stage's counted updates (skipped steps do not count)."""
        return (self.stage - 1) * self.budget + self.counted

    def attempt(self, num_updates: int) -> bool:
        """Record one update attempt, given fairseq's counter after it; True once the stage's
        budget is complete.  Raises if the counter moved other than by 0 or 1."""
        before = self.expected_updates()
        if num_updates == before + 1:
            self.counted += 1
        elif num_updates == before:
            self.skipped_slots.setdefault(self.stage, []).append(self.counted + self.skipped)
            self.skipped += 1
            self.skipped_by_stage[self.stage] = self.skipped
        else:
            raise RunDirError(f"stage {self.stage}: fairseq's update counter is {num_updates} but "
                              f"the stream expected {before} or {before + 1}; the checkpoint does "
                              f"not belong to this stream's position (use --restart-stream)")
        return self.done

    def can_finish(self, slots: int) -> bool:
        """Whether the stage can still get its budget of counted updates from ``slots`` update
        slots (the batches of its list, in updates): every skipped step used one up."""
        return self.skipped + self.budget <= slots

    def next_stage(self, stage: int) -> None:
        """Start ``stage`` after the previous one finished its budget.

        A training process stops (and saves) mid-stage before a stage's batches run out
        (``tasks/alma_stream.py``), so a stage that ended short comes from a checkpoint that an
        earlier release saved at such a stage's end: fairseq's iterator there is past the
        stage, which cannot be continued."""
        if stage != self.stage + 1 or not self.done:
            raise RunDirError(
                f"stage {self.stage} ended after {self.counted} of {self.budget} counted updates "
                f"({self.skipped} steps skipped, e.g. fp16 overflows): its batches ran out and "
                f"checkpoint_last.pt was saved after them, so the run cannot continue that stage; "
                f"train the stream again in another --save-dir (a lower --fp16-init-scale skips "
                f"fewer steps)")
        self.stage, self.counted, self.skipped = stage, 0, 0

    def state_dict(self) -> dict[str, Any]:
        state = asdict(self)
        state["skipped_by_stage"] = {str(k): v for k, v in self.skipped_by_stage.items()}
        state["skipped_slots"] = {str(k): list(v) for k, v in self.skipped_slots.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["budget"]) != self.budget:
            raise RunDirError(f"the checkpoint's stages have {state['budget']} updates, this run "
                              f"{self.budget}: continue with the same --updates-per-stage")
        self.stage, self.counted, self.skipped = (int(state[k]) for k in ("stage", "counted",
                                                                           "skipped"))
        self.skipped_by_stage = {int(k): int(v) for k, v in state["skipped_by_stage"].items()}
        self.skipped_slots = {int(k): [int(u) for u in v] for k, v in state["skipped_slots"].items()}


def counted_slots(budget: int, skipped_slots: Iterable[int]) -> list[int]:
    """The update slots (0-based attempt numbers) whose batches a finished stage's ``budget``
    counted updates trained on: the first ``budget`` that ``skipped_slots`` (``StageClock``)
    does not hold.  Why: a skipped step's batches were not trained (its gradients were thrown
    away), and the next slot's were trained in its place, so the stage's trained tokens are
    these slots' tokens, wherever the skips fell and whichever process took them."""
    skipped = set(skipped_slots)
    return [slot for slot in range(budget + len(skipped)) if slot not in skipped]


def stage_position(num_updates: int, budget: int) -> tuple[int, int]:
    """(stage, counted updates done in it) for the next update, given fairseq's counter after
    ``num_updates`` counted updates: the inverse of ``StageClock.expected_updates``.  After a
    stage's last update this is (next stage, 0): the next update is the next stage's first."""
    stage, counted = divmod(num_updates, budget)
    return stage + 1, counted
