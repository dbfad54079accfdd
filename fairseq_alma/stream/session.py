"""One training run of a stream, owned by one object: ``StreamSession``.

Why one owner: an LM learner (driven by fairseq's hooks, ``fairseq_glue/stream_training.py``)
and a vision learner (its own loop, ``vision/runner.py``) live through the same run: take the
run directory, make sure it holds this run, restore where the run stands, end stages, start
stages, stop early.  Written twice, the two copies drift; here the session owns the run
directory (and its lock), the fingerprint, the progress and its records, the stage clock, the
stop signal and stage limit and the growth log, and the learner reports a few events:

  open(...)              rank 0 locks the directory; ``prepare`` (fingerprint, claim) runs on
                         every rank and the ranks agree before anything is trained
  restore(state)         the state the learner's checkpoint held (None: a checkpoint of 0.1),
                         upgraded to today's form (``upgrade.py``); ``start()`` when none came;
                         ``restore_records`` for a learner that resumes at stage boundaries
  stage_boundary(s)      stage s is over: the clock must have its counted updates, then
                         ``StreamProgress.close_stage(s)`` keeps, measures and records.  A
                         boundary met before the state is known waits for it
  stage_to_start(n)      the stage whose start actions are due at update counter n (once each)
  after_update(n)        one update attempt; True when the stage's budget is complete
  grew(stage, info)      one growth step, written to ``growth.jsonl``
  stages_to_train(done)  the stages a loop trains in this process, stopping on a signal
  decide(error, n)       --wait auto: train or wait at the next arrival (``wait_policy.py``)
  state_dict()           what the learner's checkpoint keeps

The learner answers three questions (``measure``, ``record``, ``keep_checkpoint``) and is told
of new records (``recorded``).  Nothing here imports fairseq or torch: the rank agreement is
passed in (``ranks.raise_unless_all_ok``).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ..errors import AlmaError, Preempted
from .fingerprint_forms import comparable_form
from .progress import StreamPlan, StreamProgress
from .records import ArrivalRecord
from .run_dir import RunDirectory, fingerprint_differences, same_run
from .schedule import ArrivalInfo, Stage
from .stage_clock import StageClock
from .stop import StopSignal
from .upgrade import clock_from_counter, upgrade_training_state
from .wait_decisions import WaitDecisions

logger = logging.getLogger(__name__)


class Learner(Protocol):
    """What the session asks the learner at a stage's end."""

    def measure(self) -> Any: ...

    def record(self, info: ArrivalInfo, measured: Any) -> ArrivalRecord: ...


class StreamSession:
    """The run of one stream in one training process (module doc)."""

    def __init__(self, plan: StreamPlan, run_dir: RunDirectory, *, budget: int | None = None,
                 stop: StopSignal | None = None, stop_after: int | None = None,
                 metric_is_rate: bool = True) -> None:
        self.plan, self.run_dir = plan, run_dir
        # --wait auto: the decisions and the learner's models (``wait_decisions.py``)
        self.waits = WaitDecisions(rate=metric_is_rate) if plan.adaptive else None
        self.learner: Learner | None = None
        self.fingerprint: dict[str, Any] = {}
        self.finished = False  # the directory holds this run, finished: nothing to train
        self.progress = StreamProgress(plan, run_dir)
        self.clock = StageClock(budget) if budget else None  # counted / skipped updates
        self.stop = stop
        self.last_stage = min(plan.max_stages, stop_after or plan.max_stages)
        self.growth: list[dict[str, Any]] = []
        self.started_stage = 0  # the last stage whose start actions ran
        self.resuming = run_dir.last_checkpoint.exists()  # the learner will restore it
        self.live = False  # False until the session knows the progress (fresh, or restored)
        self.deferred: int | None = None  # a stage boundary met before that
        self.clock_unknown = False  # restored from a checkpoint without a clock

    @classmethod
    def open(cls, plan: StreamPlan, path: str | os.PathLike, *, rank: int = 0,
             agree: Callable[[AlmaError | None], None] | None = None,
             prepare: Callable[[StreamSession], None] | None = None,
             **options: Any) -> StreamSession:
        """Take the run directory (rank 0 locks it) and run ``prepare`` (fingerprint, claim);
        ``agree(error)`` makes every rank stop if any rank failed, before anything is trained."""
        error, session = None, None
        try:
            session = cls(plan, RunDirectory.for_training(path, rank), **options)
            if prepare is not None:
                prepare(session)
        except AlmaError as err:
            error = err
        if agree is not None:
            agree(error)
        elif error is not None:
            raise error
        return session

    def claim(self, fingerprint: dict[str, Any], restart: bool = False,
              finished: Callable[[], bool] | None = None) -> None:
        """Refuse another run here (every rank; nothing written); then, unless the directory
        holds this run already ``finished()`` (the same command on a finished run changes no
        byte of it), make it this run's."""
        if restart and self._holds_unfinished(fingerprint, finished):
            logger.warning("--restart-stream: %s holds this run, unfinished: continuing it (the "
                           "same command after a preemption or a crash must not start it over; "
                           "to start it over, move the directory away)", self.run_dir.path)
            restart = False
        self.run_dir.check_fingerprint(fingerprint, restart)
        old = None if restart else self.run_dir.read_fingerprint()
        if old is not None and old != fingerprint and same_run(old, fingerprint):
            # only how it computes (settings its method never reads are no change at all)
            changed = fingerprint_differences(comparable_form(old),
                                              comparable_form(fingerprint))
            if changed:
                logger.info("continuing the run in %s with other execution settings (%s): the "
                            "same computation, to floating-point rounding", self.run_dir.path,
                            "; ".join(changed))
            fingerprint = old  # the run keeps its fingerprint, and its checkpoints their run hash
        elif old is not None and old != fingerprint:  # check_fingerprint let another run in
            logger.info("%s: its run.json is a run's that never trained (a command refused before "
                        "its first arrival left it); this run takes the directory", self.run_dir.path)
        self.fingerprint = fingerprint
        self.finished = (not restart and finished is not None
                         and self.run_dir.read_fingerprint() == fingerprint and finished())
        if not self.finished:
            self.run_dir.claim(fingerprint, restart)  # --restart-stream moves the old run aside
            self.resuming = self.run_dir.last_checkpoint.exists()

    def _holds_unfinished(self, fingerprint: dict[str, Any],
                          finished: Callable[[], bool] | None) -> bool:
        """Whether the directory holds this run (``same_run``), trained and not ``finished()``.

        Why: ``--restart-stream`` moves another run, or a finished one, aside. A command that
        carries it is also the command a requeued job (or a user told "run the same command
        to continue") runs again: moving this run's own progress aside there restarted it from
        update 0 at every preemption, so a run longer than one job never finished."""
        old = self.run_dir.read_fingerprint()
        if old is None or not same_run(old, fingerprint) or self.run_dir.never_trained():
            return False
        if finished is None:  # a vision stream: finished when every arrival is recorded
            from .run_view import RunView

            return RunView(self.run_dir.path).finished_records(self.plan.num_megabatches) is None
        return not finished()

    def close(self) -> None:
        self.run_dir.close()

    # ---- where the run stands --------------------------------------------------------------
    def restore(self, state: dict[str, Any] | None) -> None:
        """The state the learner's checkpoint held, in today's form (``upgrade.py``)."""
        state = upgrade_training_state(state, self.run_dir, self.deferred)
        self.progress.load_state_dict(state["progress"])
        self.restore_waits(state.get("waits"))
        self.growth = list(state["growth"])
        if state["clock"] is not None and self.clock is not None:
            self.clock.load_state_dict(state["clock"])
            self.started_stage = int(state["started_stage"])
        else:
            self.clock_unknown = self.clock is not None
        self.live = True
        self._resolve_deferred()

    def restore_records(self, progress: dict[str, Any] | None) -> None:
        """For a learner that resumes at stage boundaries (vision: ``checkpoint_last.pt`` holds
        the learner after its last finished stage): the records its checkpoint held, if any;
        no clock, no boundary waits."""
        if progress is not None:
            self.progress.load_state_dict(progress)
        self.live = True

    def restore_waits(self, state: dict[str, Any] | None) -> None:
        """``--wait auto``: the decisions and models a checkpoint held, and the plan they make."""
        if self.waits is not None and state is not None:
            self.waits.load_state_dict(state)
            self.plan = self.progress.plan = self.waits.plan_with_decisions(self.plan)

    def start(self) -> None:
        """Before the first update: no state was restored (a fresh run, or a checkpoint of 0.1,
        whose state lived only in the run directory's files)."""
        if self.live:
            return
        if self.resuming and self.deferred is not None:
            self.restore(None)
            return
        self.live = True
        self._resolve_deferred()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"progress": self.progress.state_dict(), "growth": list(self.growth)}
        if self.clock is not None:
            state.update(clock=self.clock.state_dict(), started_stage=self.started_stage)
        if self.waits is not None:
            state["waits"] = self.waits.state_dict()
        return state

    def decide(self, error: float, examples: int, agree: Callable[[bool], bool] | None = None,
               capacity: float = math.inf) -> bool:
        """``--wait auto``: train at the next arrival, or wait (``wait_policy.py``), from the
        current model's ``error`` on the arrived validation data; the plan grows by it and the
        arrival's record (written by the next ``stage_boundary``) will carry it."""
        assert self.waits is not None, "decide() is for --wait auto"
        self.plan = self.progress.plan = self.waits.decide(self.plan, error, examples, agree,
                                                           capacity)
        return self.plan.decisions[-1]

    # ---- stage end ---------------------------------------------------------------------
    def stage_boundary(self, stages_done: int) -> list[ArrivalRecord]:
        """Stage ``stages_done`` is over: close it (``StreamProgress.close_stage``).  The first
        boundary of a resumed process may come before its state is back: it waits for it."""
        if not self.live:
            self.deferred = stages_done
            return []
        return self._end_stage(stages_done)

    def _resolve_deferred(self) -> None:
        if self.deferred is not None:
            stages_done, self.deferred = self.deferred, None
            self._end_stage(stages_done)

    def _end_stage(self, stages_done: int) -> list[ArrivalRecord]:
        self._advance_clock(stages_done)
        learner = self.learner
        assert learner is not None, "StreamSession.learner is set before the first stage ends"
        keep = getattr(learner, "keep_checkpoint", None)
        new = self.progress.close_stage(min(stages_done, self.plan.num_stages), learner.measure,
                                        learner.record, keep_checkpoint=keep)
        recorded = getattr(learner, "recorded", None)
        if new and recorded is not None:
            recorded(new)
        return new

    def _advance_clock(self, stages_done: int) -> None:
        """The stage that just ended must have all its counted updates; the next one starts."""
        clock = self.clock
        if clock is None or self.clock_unknown or stages_done < clock.stage:
            return  # no clock, a fresh start (stage 0 done), a boundary passed, or an old checkpoint
        if stages_done < self.plan.max_stages or not clock.done:
            clock.next_stage(stages_done + 1)  # after the last stage: raises, its data ran out

    # ---- updates and stage start -----------------------------------------------------------
    def stage_to_start(self, update_num: int) -> int | None:
        """The stage whose start actions are due before update ``update_num`` (fairseq's
        counter), or None; each stage's once (the clock and ``started_stage`` travel in the
        checkpoint: a resume never repeats them)."""
        self.start()
        assert self.clock is not None
        if self.clock_unknown:  # an old checkpoint without a clock (``upgrade.py``)
            self.clock_unknown = False
            clock, self.started_stage = clock_from_counter(update_num, self.clock.budget)
            self.clock.load_state_dict(clock)
        if self.started_stage < self.clock.stage:
            self.started_stage = self.clock.stage
            return self.clock.stage
        return None

    def after_update(self, num_updates: int) -> bool:
        """One update attempt, with fairseq's counter after it: True when the stage's budget of
        counted updates is complete (the trainer ends the stage there, however many skipped)."""
        clock = self.clock
        assert clock is not None
        skipped_before = clock.skipped
        done = clock.attempt(num_updates)
        if clock.skipped > skipped_before:  # this attempt, not an earlier one of the stage
            logger.info("stage %d: update %d skipped by the trainer (%d skipped in this stage)",
                        clock.stage, num_updates + 1, clock.skipped)
        return done

    def grew(self, stage: int, info: dict[str, Any]) -> None:
        """A growth step of ``stage``; a resumed run may redo one: replaced, never duplicated."""
        self.growth = [entry for entry in self.growth if entry["stage"] < stage] + [info]
        self.run_dir.write_growth(self.growth)

    # ---- stopping ------------------------------------------------------------------------
    @property
    def stop_requested(self) -> bool:
        return self.stop is not None and self.stop.requested

    def stages_to_train(self, stages_done: int) -> Iterator[Stage]:
        """The stages after ``stages_done`` up to the stage limit, for a loop that resumes at
        stage boundaries; a stop signal raises ``Preempted`` before the next one."""
        for stage in self.plan.schedule[stages_done:self.last_stage]:
            if self.stop_requested:
                raise Preempted(f"preempted by {self.stop.signal_name} before stage {stage.index}; "
                                f"{self.run_dir.last_checkpoint} holds stage {stages_done}; run the "
                                f"same command to continue")
            yield stage
            stages_done = stage.index
