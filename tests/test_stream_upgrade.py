"""Older run formats read as today's (``fairseq_alma/stream/upgrade.py``), one test per format:
a 0.1 run directory (no run.json), a 0.1 checkpoint (no training state), a 0.2 checkpoint (no
stage clock), a clock from before partial replay (no skipped slots), a fingerprint from before
--replay-ratio / --stage-lr-schedule.  (<= 0.2 records: tests/test_stream_records.py.)"""

from __future__ import annotations

import json
import logging

from fairseq_alma.stream.progress import StreamPlan, StreamProgress
from fairseq_alma.stream.records import ArrivalRecord
from fairseq_alma.stream.run_dir import RunDirectory
from fairseq_alma.stream.stage_clock import StageClock
from fairseq_alma.stream.upgrade import (
    clock_from_counter,
    drop_added_defaults,
    upgrade_clock_state,
    upgrade_training_state,
)


def _record(arrival: int, stage: int) -> ArrivalRecord:
    return ArrivalRecord(arrival=arrival, stage=stage, trained=stage > 0, megabatches_seen=arrival,
                         params_active=10, train_flops_cum=float(stage), infer_flops_per_token=1.0,
                         wall_time=0.0, eval_ppl=5.0, eval_nll=1.6, eval_tokens=3)


def _run_of_0_1(path) -> RunDirectory:
    """A 0.1 run directory: records and growth only in their files, no run.json."""
    run_dir = RunDirectory.for_training(path)
    run_dir.write_records([_record(0, 0), _record(1, 1), _record(2, 2)])
    run_dir.write_growth([{"stage": 2, "experts": 4}])
    return run_dir


def test_run_directory_of_0_1_is_continued_and_gets_run_json(tmp_path, caplog):
    run_dir = _run_of_0_1(tmp_path / "run")
    assert run_dir.read_fingerprint() is None
    with caplog.at_level(logging.WARNING):
        run_dir.claim({"config": {"seed": 1}})
    assert "a run of fairseq-alma 0.1" in caplog.text
    assert run_dir.read_fingerprint() == {"config": {"seed": 1}}
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        run_dir.claim({"config": {"seed": 1}})  # upgraded: nothing more to say
    assert "0.1" not in caplog.text
    run_dir.close()


def test_checkpoint_of_0_1_takes_the_finished_stages_records_and_growth_from_the_files(tmp_path):
    run_dir = _run_of_0_1(tmp_path / "run")
    state = upgrade_training_state(None, run_dir, stages_done=1)
    assert state["clock"] is None and state["growth"] == [{"stage": 2, "experts": 4}]
    progress = StreamProgress(StreamPlan(2), run_dir)
    progress.load_state_dict(state["progress"])
    assert progress.ordered() == [_record(0, 0), _record(1, 1)]  # stage 2's record is not the checkpoint's
    empty = RunDirectory.for_training(tmp_path / "fresh")
    assert upgrade_training_state(None, empty, stages_done=0)["progress"] == {"records": []}
    run_dir.close()
    empty.close()


def test_checkpoint_of_0_2_keeps_its_progress_and_growth_with_an_unknown_clock(tmp_path):
    run_dir = RunDirectory.for_reading(tmp_path)
    old = {"progress": {"records": [_record(0, 0).to_json()]}, "growth": [{"stage": 2}]}
    state = upgrade_training_state(old, run_dir, stages_done=0)
    assert state == {"progress": old["progress"], "growth": [{"stage": 2}], "clock": None,
                     "started_stage": None}


def test_clock_from_before_partial_replay_has_no_skipped_slots(tmp_path):
    clock = StageClock(budget=4)
    clock.attempt(1)
    old = clock.state_dict()
    del old["skipped_slots"]
    current = {"progress": {"records": []}, "growth": [], "clock": old, "started_stage": 1}
    state = upgrade_training_state(current, RunDirectory.for_reading(tmp_path), stages_done=0)
    restored = StageClock(budget=4)
    restored.load_state_dict(state["clock"])
    assert restored == clock and restored.skipped_slots == {}
    assert upgrade_clock_state(clock.state_dict()) == clock.state_dict()  # today's: unchanged


def test_unknown_clock_is_rebuilt_from_the_update_counter():
    """Releases without a clock skipped no step: the counter is the position; a stage whose
    first update comes next has not started."""
    assert clock_from_counter(0, 3) == (StageClock(3).state_dict(), 0)
    state, started = clock_from_counter(7, 3)
    assert (state["stage"], state["counted"], started) == (3, 1, 3)
    state, started = clock_from_counter(6, 3)
    assert (state["stage"], state["counted"], started) == (3, 0, 2)
    clock = StageClock(3)
    clock.load_state_dict(state)
    assert clock.expected_updates() == 6


def test_fingerprint_from_before_added_settings_still_matches():
    """A setting at its default is left out (a run written before it existed resumes); any
    other value stays, so a command without it is refused."""
    old = {"task": {"wait": 1}, "lr_scheduler": {"warmup_updates": 2}}
    today = {"task": {"wait": 1, "replay_ratio": 0.0},
             "lr_scheduler": {"warmup_updates": 2, "stage_lr_schedule": "restart"}}
    assert drop_added_defaults(json.loads(json.dumps(today))) == old
    used = {"task": {"wait": 1, "replay_ratio": 0.25}, "lr_scheduler": {"stage_lr_schedule": "cyclic"}}
    assert drop_added_defaults(json.loads(json.dumps(used))) == used
