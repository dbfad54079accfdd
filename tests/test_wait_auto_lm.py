"""``--wait auto`` on an LM stream through fairseq-train: one decision per arrival in
stream.jsonl (the learner that restarts each stage from scratch learns to wait), the stream
ends when its arrivals run out, and a run stopped after a stage or killed with -9 mid-stage
continues to the same decisions, records and stage weights (SIGUSR1 takes the same path as
fixed waiting times: test_vision_task, test_resume_points)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from lm_fixtures import RESUMABLE, assert_same_stream, prepare_stream, run, stream_cmd

from fairseq_alma.stream.records import read_records

B = 8
# 30 updates of 8 x 32 tokens read about 2.4 of these mega-batches: a bigger stage can help
AUTO = ("--wait", "auto", "--stage-init", "scratch", "--updates-per-stage", "30")


@pytest.fixture(scope="module")
def stream8(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto_lm")
    return prepare_stream(root, root / "data", num_megabatches=B, lines=2400)


@pytest.fixture(scope="module")
def reference(stream8, tmp_path_factory):
    save = tmp_path_factory.mktemp("auto_reference") / "run"
    proc = run(stream_cmd(stream8, save, *AUTO))
    return save, proc.stdout + proc.stderr


@pytest.mark.slow
def test_every_arrival_is_decided_and_recorded(reference):
    save, log = reference
    records = read_records(save / "stream.jsonl")
    assert [r.arrival for r in records] == list(range(B + 1))
    decisions = [r.extra.get("decision") for r in records]
    assert decisions[0] is None and [d["arrival"] for d in decisions[1:]] == list(range(1, B + 1))
    trains = [d["train"] for d in decisions[1:]]
    assert [r.trained for r in records[1:]] == trains
    assert [r.stage for r in records] == [sum(trains[:t]) for t in range(B + 1)]
    assert any(trains) and not all(trains), "a learner that starts every stage afresh waits"
    for decision in decisions[1:]:
        assert decision["remaining"] == B - decision["arrival"] and decision["pending"] >= 1
    stages = sum(trains)
    assert sorted(p.name for p in save.glob("checkpoint_stage*.pt")) == sorted(
        f"checkpoint_stage{s}.pt" for s in range(1, stages + 1))
    # each stage trained the U = 6 updates of the flags, whatever the arrivals it covered
    assert records[-1].train_flops_cum > 0 and f"({stages} stages trained); the stream is over" in log


@pytest.mark.slow
def test_stop_after_a_stage_then_the_same_command(reference, stream8, tmp_path):
    save = tmp_path / "stopped"
    cmd = stream_cmd(stream8, save, *AUTO)
    env = {**os.environ, "ALMA_STOP_AFTER_STAGE": "2", "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, capture_output=True, text=True, env=env, check=True, timeout=600)
    assert len(read_records(save / "stream.jsonl")) < B + 1
    run(cmd)
    assert_same_stream(reference[0], save, stages=range(1, _stages(reference[0]) + 1))


@pytest.mark.slow
def test_killed_mid_stage_continues_to_the_same_decisions(reference, stream8, tmp_path):
    """kill -9 after arrival 4 is recorded, with a checkpoint every 2 updates: the next start
    resumes inside a stage, from a checkpoint that holds the decisions so far."""
    save = tmp_path / "killed"
    cmd = stream_cmd(stream8, save, *AUTO, *RESUMABLE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    output = tmp_path / "first.log"  # a file, not a pipe: nobody reads it while the run goes on
    with open(output, "w") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env)
        log = save / "stream.jsonl"
        while proc.poll() is None and not (log.exists() and len(log.read_text().splitlines()) >= 5):
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=600)
    assert proc.returncode == -9, output.read_text()[-2000:]
    assert len(read_records(log)) < B + 1, "the run finished before the signal"
    run(cmd)
    assert_same_stream(reference[0], save, stages=range(1, _stages(reference[0]) + 1))


def _stages(save) -> int:
    return read_records(save / "stream.jsonl")[-1].stage
