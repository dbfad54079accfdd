"""A stage is a budget of *counted* updates, however many steps the trainer skips.

fairseq skips an update whose fp16 gradients overflow and does not count it.  Here the overflow
is injected on CPU: a test-only ``sitecustomize.py`` makes the optimizer step raise
``OverflowError`` (exactly what FP16Optimizer raises) at chosen updates, and patches
``torch.Tensor.cuda`` to a no-op on CPU, because fairseq's overflow branch runs
``torch.tensor(0.0).cuda()`` - that is the only thing patched.  A growth stream with two skipped
steps must then have the stage boundaries, the growth point, the LR at every counted update and
the accounting in stream.jsonl of the same stream without skips, plus ``skipped_updates``, with
``train_tokens_cum`` the tokens of the batches its counted updates trained on (a skipped step's
batch is not trained; the next one is); a run killed after a skip and resumed must equal the
uninterrupted run with the same skips; and a stage whose skips use up its spare batches stops
mid-stage and the same command finishes it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from lm_fixtures import assert_same_stream, stream_cmd, wait_for

from fairseq_alma.stream.progress import StreamPlan
from fairseq_alma.stream.session import StreamSession
from fairseq_alma.stream.stage_clock import StageClock, counted_slots

OVERFLOW_HOOK = '''
import builtins, os, sys

# "2,8": one skipped attempt at update 2 and one at 8; "3:25": 25 skipped attempts at update 3
AT = {int(u.split(":")[0]): int(u.split(":")[1]) if ":" in u else 1
      for u in os.environ.get("ALMA_TEST_OVERFLOW_AT", "").split(",") if u}
MARKERS = os.environ.get("ALMA_TEST_OVERFLOW_DIR", "")
_import = builtins.__import__
_done = []


def _patch():
    import torch
    from fairseq.tasks.fairseq_task import FairseqTask

    original = FairseqTask.optimizer_step

    def optimizer_step(self, optimizer, model, update_num):
        done = sum(1 for f in os.listdir(MARKERS) if f.startswith(f"overflow-{update_num}-"))
        if done < AT.get(update_num, 0):  # markers: a resumed run does not skip them again
            open(os.path.join(MARKERS, f"overflow-{update_num}-{done}"), "w").close()
            raise OverflowError("injected by the test")
        return original(self, optimizer, model, update_num)

    FairseqTask.optimizer_step = optimizer_step
    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *args, **kwargs: self  # fairseq's overflow branch


def _hooked_import(name, *args, **kwargs):
    module = _import(name, *args, **kwargs)
    if not _done and "fairseq.tasks.fairseq_task" in sys.modules and hasattr(
            sys.modules["fairseq.tasks.fairseq_task"], "FairseqTask"):
        _done.append(1)
        _patch()
    return module


if AT:
    builtins.__import__ = _hooked_import
'''
GROWTH = ("--moe-max-experts", "4", "--grow-experts", "2", "--log-interval", "1",
          "--save-interval-updates", "2")
VARYING = ("--sample-break-mode", "eos")  # batches of different sizes: a skip changes the tokens
ACCOUNTING = ("arrival", "stage", "trained", "megabatches_seen", "params_active",
              "infer_flops_per_token", "infer_flops_per_sequence", "flops_convention")


def _run(cmd: list[str], tmp: Path, overflow_at: str = "", kill_after: Path | None = None,
         status: int = 0) -> str:
    hooks = tmp / "hooks"
    hooks.mkdir(parents=True, exist_ok=True)
    (hooks / "sitecustomize.py").write_text(OVERFLOW_HOOK)
    (tmp / "markers").mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")])),
           "ALMA_TEST_OVERFLOW_AT": overflow_at, "ALMA_TEST_OVERFLOW_DIR": str(tmp / "markers")}
    if kill_after is not None:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        wait_for(kill_after, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return ""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == status, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _lr_by_update(log: str) -> list[tuple[int, str]]:
    return [(int(u), lr) for u, lr in re.findall(r"num_updates=(\d+), lr=([0-9.e-]+)", log)]


def _counted_tokens_cum(log: str, budget: int = 6) -> list[int]:
    """train_tokens_cum after each stage, from fairseq's own log: the tokens (``wpb``) of every
    counted update (``--log-interval 1``: one line per counted update; a skipped step logs none)."""
    wpb = dict((int(u), int(w)) for w, u in re.findall(r"wpb=(\d+), .*?num_updates=(\d+),", log))
    stages = max(wpb) // budget
    assert sorted(wpb) == list(range(1, stages * budget + 1))
    return [0] + [sum(wpb[u] for u in range(1, s * budget + 1)) for s in range(1, stages + 1)]


def test_counted_slots_step_over_the_skipped_ones():
    assert counted_slots(4, []) == [0, 1, 2, 3]
    assert counted_slots(4, [1, 2, 5]) == [0, 3, 4, 6]
    clock = StageClock(budget=3)
    assert not clock.attempt(0) and not clock.attempt(1) and clock.can_finish(4)  # a skip, an update
    assert not clock.attempt(1) and not clock.can_finish(4) and clock.can_finish(5)  # a second skip
    assert not clock.attempt(2) and clock.attempt(3) and clock.skipped_slots == {1: [0, 2]}


def test_one_log_line_per_skipped_step(tmp_path, caplog):
    session = StreamSession.open(StreamPlan(2), tmp_path / "run", budget=4)
    session.claim({"a": 1})
    session.start()
    session.stage_to_start(0)
    with caplog.at_level("INFO", logger="fairseq_alma.stream.session"):
        for counter in (1, 1, 2, 3, 3, 4):  # the 2nd and 5th attempts are skipped
            session.after_update(counter)
    skipped = [r.getMessage() for r in caplog.records if "skipped by the trainer" in r.getMessage()]
    assert skipped == ["stage 1: update 2 skipped by the trainer (1 skipped in this stage)",
                       "stage 1: update 4 skipped by the trainer (2 skipped in this stage)"]
    session.close()


def _records(save: Path) -> list[dict]:
    lines = (save / "stream.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.slow
def test_skipped_steps_move_no_stage_boundary(stream_dir, tmp_path):
    plain = _run(stream_cmd(stream_dir, tmp_path / "plain", *GROWTH, *VARYING), tmp_path / "a")
    skipping = _run(stream_cmd(stream_dir, tmp_path / "skip", *GROWTH, *VARYING), tmp_path / "b",
                    overflow_at="2,8")  # attempts after update 2 (stage 1) and 8 (stage 2)
    assert skipping.count("gradient overflow detected") == 2
    assert skipping.count("skipped by the trainer") == 2  # one line per skip, none after it
    # the LR at every counted update, and the total of counted updates, are the same
    assert _lr_by_update(skipping) == _lr_by_update(plain) and _lr_by_update(plain)[-1][0] == 12
    # growth happened at the start of stage 2 (after update 6) in both
    for log in (plain, skipping):
        grew = log.index("grew to 4 experts")
        assert log.rfind("num_updates=6,", 0, grew) > log.rfind("num_updates=7,", 0, grew)
        assert "num_updates=7," in log[grew:]
    grown = [json.loads(line)["stage"] for line in (tmp_path / "skip" / "growth.jsonl").read_text().splitlines()]
    assert grown == [2]
    plain_records, skip_records = _records(tmp_path / "plain"), _records(tmp_path / "skip")
    for a, b in zip(plain_records, skip_records, strict=True):
        assert {k: a.get(k) for k in ACCOUNTING} == {k: b.get(k) for k in ACCOUNTING}
    # the tokens of the counted updates' batches: the skipped batches' are left out, the spare
    # batches trained in their place counted (here they differ, so the plain run's numbers do too)
    for log, records in ((plain, plain_records), (skipping, skip_records)):
        assert [r["train_tokens_cum"] for r in records] == _counted_tokens_cum(log)
    assert skip_records[1]["train_tokens_cum"] != plain_records[1]["train_tokens_cum"]
    flops_per_token = [r["train_flops_cum"] / r["train_tokens_cum"] for r in plain_records[1:]]
    assert [r["train_flops_cum"] for r in skip_records[1:]] == pytest.approx(
        [f * r["train_tokens_cum"] for f, r in zip(flops_per_token, skip_records[1:])])
    assert [r["skipped_updates"] for r in skip_records] == [0, 1, 1]
    assert [r["skipped_updates"] for r in plain_records] == [0, 0, 0]


@pytest.mark.slow
def test_resume_after_a_skipped_step_equals_the_uninterrupted_run(stream_dir, tmp_path):
    reference = tmp_path / "reference"
    _run(stream_cmd(stream_dir, reference, *GROWTH), tmp_path / "r", overflow_at="2,8")
    save = tmp_path / "resumed"
    cmd = stream_cmd(stream_dir, save, *GROWTH)
    _run(cmd, tmp_path / "k", overflow_at="2,8", kill_after=save / "checkpoint_1_4.pt")
    _run(cmd, tmp_path / "k", overflow_at="2,8")  # the skip at 2 happened before the kill
    assert_same_stream(save, reference)
    assert [r["skipped_updates"] for r in _records(save)] == [0, 1, 1]


@pytest.mark.slow
def test_a_stage_whose_skips_use_up_its_spares_stops_and_continues(stream_dir, tmp_path):
    """25 skipped steps at update 3 of a 6-update stage, which keeps 20 spare batches: the run
    stops mid-stage (saving checkpoint_last.pt, the requeue status), and the same command
    finishes the stream; it used to save the short stage's end and fail the same way forever."""
    save = tmp_path / "run"
    cmd = stream_cmd(stream_dir, save, "--log-interval", "1", *VARYING)
    first = _run(cmd, tmp_path / "k", overflow_at="3:25", status=75)
    assert "20 steps skipped by the trainer (e.g. fp16 overflows) leave its batches too few" in first
    assert "fairseq-alma: stopped: the stage's batches ran out at update" in first
    assert not (save / "checkpoint_stage1.pt").exists() and (save / "checkpoint_last.pt").exists()
    second = _run(cmd, tmp_path / "k", overflow_at="3:25")
    assert "fairseq's progress counts to 46 (40 spares" in second  # 20 more
    records = _records(save)
    assert [r["skipped_updates"] for r in records] == [0, 25, 0]
    assert [r["train_tokens_cum"] for r in records] == _counted_tokens_cum(first + second)
    plain = _run(stream_cmd(stream_dir, tmp_path / "plain", "--log-interval", "1", *VARYING), tmp_path / "p")
    assert _lr_by_update(first + second) == _lr_by_update(plain)  # 6 counted updates per stage
