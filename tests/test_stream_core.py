"""The stream core (fairseq_alma/stream): it imports without fairseq, owns the run directory
(who may write, atomic writes, stale temporaries), and runs the stage-end protocol that every
learner shares, with a progress that round-trips through a checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fairseq_alma.errors import RunDirError, UsageError
from fairseq_alma.stream.progress import StreamPlan, StreamProgress
from fairseq_alma.stream.records import ArrivalRecord
from fairseq_alma.stream.run_dir import RunDirectory
from fairseq_alma.stream.stop import StopSignal, stage_limit

# Every module of the core, so a new one is held to the rule too.
CORE = sorted(path.stem for path in (Path(__file__).resolve().parent.parent / "fairseq_alma" / "stream")
              .glob("*.py") if path.stem != "__init__")


def test_core_imports_with_fairseq_and_torch_blocked():
    code = (
        "import sys\n"
        "sys.modules['fairseq'] = None\n"  # import fairseq -> ImportError
        "sys.modules['torch'] = None\n"
        + "".join(f"import fairseq_alma.stream.{name}\n" for name in CORE)
        + "import fairseq_alma.errors\n"
        "loaded = [m for m in sys.modules if m.startswith(('fairseq.', 'torch.'))]\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def _record(info, value: float) -> ArrivalRecord:
    return ArrivalRecord(arrival=info.arrival, stage=info.stage, trained=info.trained,
                         megabatches_seen=info.megabatches_seen, params_active=10,
                         train_flops_cum=float(info.stage), infer_flops_per_image=1.0,
                         wall_time=0.0, test_error=value)


def test_close_stage_records_each_arrival_once_and_round_trips(tmp_path):
    run_dir = RunDirectory.for_training(tmp_path / "run")
    progress = StreamProgress(StreamPlan(5, wait=2), run_dir)  # stages at arrivals 2 and 4
    measured, kept = [], []

    def measure() -> float:
        measured.append(1)
        return 0.5 / (len(measured))

    assert [r.arrival for r in progress.close_stage(0, measure, _record, kept.append)] == [0, 1]
    assert kept == [0]  # the initialised model answers arrival 1: kept for scoring
    assert progress.close_stage(0, measure, _record, kept.append) == [] and kept == [0]  # not twice
    assert [r.arrival for r in progress.close_stage(1, measure, _record, kept.append)] == [2, 3]
    assert progress.close_stage(1, measure, _record, kept.append) == []  # nothing twice
    assert len(measured) == 2 and kept == [0, 1, 1]  # a stage's checkpoint is kept (idempotent) each time
    assert [r.arrival for r in run_dir.read_records()] == [0, 1, 2, 3]
    restored = StreamProgress(StreamPlan(5, wait=2), run_dir)
    restored.load_state_dict(progress.state_dict())
    assert restored.ordered() == progress.ordered() and not restored.complete
    restored.close_stage(2, measure, _record)
    assert restored.complete and [r.stage for r in restored.ordered()] == [0, 0, 1, 1, 2, 2]


def test_no_initial_checkpoint_when_every_arrival_is_trained(tmp_path):
    """--wait 1: the initialised model answers only arrival 0, which no metric charges."""
    progress = StreamProgress(StreamPlan(3, wait=1), RunDirectory.for_training(tmp_path / "run"))
    kept: list[int] = []
    assert [r.arrival for r in progress.close_stage(0, lambda: 0.9, _record, kept.append)] == [0]
    assert kept == [] and not StreamPlan(3).initial_model_answers
    assert StreamPlan(3, wait=3).initial_model_answers and StreamPlan(4, wait=2).initial_model_answers


def test_only_the_writer_writes(tmp_path):
    path = tmp_path / "run"
    writer = RunDirectory.for_training(path, rank=0)
    follower = RunDirectory.for_training(path, rank=1)
    reader = RunDirectory.for_reading(path)
    info = StreamPlan(1).arrivals[0]
    follower.write_records([_record(info, 0.5)])
    assert not writer.stream_log.exists()
    writer.write_records([_record(info, 0.5)])
    assert [r.test_error for r in reader.read_records()] == [0.5]
    with pytest.raises(RuntimeError, match="a reading process tried to write stream.jsonl"):
        reader.write_records([_record(info, 0.1)])
    with pytest.raises(RuntimeError):
        reader.remove_stale_temporaries()


def test_writer_clears_temporaries_of_killed_writes_only(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    stale = ["checkpoint_last.pt.tmp", "checkpoint_last.pt.tmp4242", ".stream.jsonl.ab12.tmp"]
    kept = ["checkpoint_last.pt", "checkpoint_stage1.pt", "stream.jsonl", "notes.tmp.txt"]
    for name in stale + kept:
        (path / name).write_text("x")
    RunDirectory.for_reading(path)  # a reader touches nothing
    assert sorted(os.listdir(path)) == sorted(stale + kept)
    RunDirectory.for_training(path, rank=1)  # nor does a follower
    assert sorted(os.listdir(path)) == sorted(stale + kept)
    with RunDirectory.for_training(path, rank=0):
        assert sorted(os.listdir(path)) == sorted(kept + ["run.lock", "run.lock.json"])
    assert sorted(os.listdir(path)) == sorted(kept + ["run.lock"])  # the holder record goes


def test_stream_plan_and_stage_limit():
    plan = StreamPlan(4, wait=3)
    assert plan.num_stages == 1 and plan.stage(1).train_megabatches == (0, 1, 2)
    with pytest.raises(UsageError, match=r"--wait must be in \[1, 4\]"):
        StreamPlan(4, wait=5)
    assert stage_limit(4, None, {}) == 4
    assert stage_limit(4, 2, {}) == 2
    assert stage_limit(4, None, {"ALMA_STOP_AFTER_STAGE": "3"}) == 3
    assert stage_limit(4, 2, {"ALMA_STOP_AFTER_STAGE": "3"}) == 2
    with pytest.raises(UsageError, match="--max-epoch must be <= 4"):
        stage_limit(4, 5, {})
    with pytest.raises(UsageError, match="ALMA_STOP_AFTER_STAGE must be a stage number"):
        stage_limit(4, None, {"ALMA_STOP_AFTER_STAGE": "two"})


def test_stop_signal_records_the_request():
    saved = {sig: signal.getsignal(sig) for sig in StopSignal.SIGNALS}
    try:
        stop = StopSignal().install()
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested and stop.signal_name == "SIGUSR1"
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_unreadable_growth_log_is_one_line(tmp_path):
    run_dir = RunDirectory.for_training(tmp_path / "run")
    run_dir.growth_log.write_text("{not json\n")
    with pytest.raises(RunDirError, match="growth.jsonl: unreadable"):
        run_dir.read_growth()
