"""The run's owner (``fairseq_alma/stream/session.py``): the events a learner reports, without
fairseq or torch.  A boundary met before the checkpoint's state is back waits for it, stage
starts happen once, the clock must be full at a stage's end, a stop signal ends a loop with
``Preempted``, and a rank's refused directory stops every rank."""

from __future__ import annotations

import pytest

from fairseq_alma.errors import Preempted, RunDirError
from fairseq_alma.stream.progress import StreamPlan
from fairseq_alma.stream.records import ArrivalRecord
from fairseq_alma.stream.session import StreamSession
from fairseq_alma.stream.stop import StopSignal


class _Learner:
    def __init__(self) -> None:
        self.kept, self.news, self.measured = [], [], 0

    def measure(self) -> float:
        self.measured += 1
        return 0.5

    def record(self, info, error: float) -> ArrivalRecord:
        return ArrivalRecord(arrival=info.arrival, stage=info.stage, trained=info.trained,
                             megabatches_seen=info.megabatches_seen, params_active=1,
                             train_flops_cum=0.0, infer_flops_per_image=1.0, wall_time=0.0,
                             test_error=error)

    def keep_checkpoint(self, stage: int) -> None:
        self.kept.append(stage)

    def recorded(self, new) -> None:
        self.news.append([r.arrival for r in new])


def _session(path, **options) -> tuple[StreamSession, _Learner]:
    session = StreamSession.open(StreamPlan(2), path, **options)
    session.learner = _Learner()
    return session, session.learner


def test_a_boundary_before_the_restored_state_waits_for_it(tmp_path):
    first, learner = _session(tmp_path / "run", budget=2)
    first.claim({"a": 1})
    first.start()
    assert first.stage_boundary(0) and learner.news == [[0]]  # fresh: arrival 0 at once
    assert first.stage_to_start(0) == 1 and first.stage_to_start(0) is None  # stage 1 starts once
    assert not first.after_update(1) and first.after_update(2)
    state = first.state_dict()
    first.close()

    second, learner = _session(tmp_path / "run", budget=2)
    second.claim({"a": 1})
    assert second.stage_boundary(1) == [] and learner.measured == 0  # the state is not back yet
    second.restore(state)
    assert learner.news == [[1]] and learner.kept == [1]  # arrival 1 recorded after the restore
    assert second.stage_to_start(2) == 2 and second.clock.stage == 2
    second.close()


def test_a_stage_ending_before_its_budget_is_refused(tmp_path):
    session, _ = _session(tmp_path / "run", budget=3)
    session.claim({"a": 1})
    session.start()
    session.stage_boundary(0)
    session.stage_to_start(0)
    session.after_update(1)
    with pytest.raises(RunDirError, match="stage 1 ended after 1 of 3 counted updates"):
        session.stage_boundary(1)
    session.close()


def test_growth_steps_are_replaced_never_duplicated(tmp_path):
    session, _ = _session(tmp_path / "run")
    session.claim({"a": 1})
    session.grew(2, {"stage": 2, "experts": 4})
    session.grew(2, {"stage": 2, "experts": 4})
    assert session.run_dir.read_growth() == [{"stage": 2, "experts": 4}]
    session.close()


def test_a_stop_signal_ends_the_stage_loop_and_the_limit_bounds_it(tmp_path):
    stop = StopSignal()
    session, _ = _session(tmp_path / "run", stop=stop, stop_after=1)
    assert [s.index for s in session.stages_to_train(0)] == [1]  # ALMA_STOP_AFTER_STAGE=1
    stop.requested, stop.signal_name = True, "SIGUSR1"
    with pytest.raises(Preempted, match="preempted by SIGUSR1 before stage 1"):
        list(session.stages_to_train(0))
    session.close()


def test_a_run_that_never_trained_gives_way_with_the_new_fingerprint(tmp_path):
    """A command refused after it claimed the directory (only run.json there) must not stop
    the corrected command, and run.json then describes the corrected run, not the refused one."""
    session, _ = _session(tmp_path / "run")
    session.claim({"a": 1})
    session.close()
    corrected, _ = _session(tmp_path / "run")
    corrected.claim({"a": 2})
    assert corrected.fingerprint == corrected.run_dir.read_fingerprint() == {"a": 2}
    corrected.close()


def test_a_finished_run_is_not_claimed_and_a_refused_rank_stops_every_rank(tmp_path):
    session, _ = _session(tmp_path / "run")
    session.claim({"a": 1})
    (tmp_path / "run" / "stream.jsonl").write_text("")  # it trained: another run is refused
    session.close()
    again, _ = _session(tmp_path / "run")
    again.claim({"a": 1}, finished=lambda: True)
    assert again.finished
    again.close()
    agreed = []

    def agree(error) -> None:
        agreed.append(error)
        if error is not None:
            raise error

    with pytest.raises(RunDirError, match="holds another run"):
        StreamSession.open(StreamPlan(2), tmp_path / "run", agree=agree,
                           prepare=lambda s: s.claim({"a": 2}))
    assert len(agreed) == 1 and isinstance(agreed[0], RunDirError)
