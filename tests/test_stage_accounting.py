"""A stage is a budget of *counted* updates, however many steps the trainer skips.

fairseq skips an update whose fp16 gradients overflow and does not count it.  Here the overflow
is injected on CPU: a test-only ``sitecustomize.py`` makes the optimizer step raise
``OverflowError`` (exactly what FP16Optimizer raises) at chosen updates, and patches
``torch.Tensor.cuda`` to a no-op on CPU, because fairseq's overflow branch runs
``torch.tensor(0.0).cuda()`` - that is the only thing patched.  A growth stream with two skipped
steps must then have the stage boundaries, the growth point, the LR at every counted update and
the accounting in stream.jsonl of the same stream without skips, plus ``skipped_updates``; and a
run killed after a skip and resumed must equal the uninterrupted run with the same skips.
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

OVERFLOW_HOOK = '''
import builtins, os, sys

AT = {int(u) for u in os.environ.get("ALMA_TEST_OVERFLOW_AT", "").split(",") if u}
MARKERS = os.environ.get("ALMA_TEST_OVERFLOW_DIR", "")
_import = builtins.__import__
_done = []


def _patch():
    import torch
    from fairseq.tasks.fairseq_task import FairseqTask

    original = FairseqTask.optimizer_step

    def optimizer_step(self, optimizer, model, update_num):
        marker = os.path.join(MARKERS, f"overflow-{update_num}")
        if update_num in AT and not os.path.exists(marker):
            open(marker, "w").close()
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
ACCOUNTING = ("arrival", "stage", "trained", "megabatches_seen", "params_active",
              "train_flops_cum", "infer_flops_per_token", "infer_flops_per_sequence", "flops_convention", "train_tokens_cum")


def _run(cmd: list[str], tmp: Path, overflow_at: str = "", kill_after: Path | None = None) -> str:
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
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _lr_by_update(log: str) -> list[tuple[int, str]]:
    return [(int(u), lr) for u, lr in re.findall(r"num_updates=(\d+), lr=([0-9.e-]+)", log)]


def _records(save: Path) -> list[dict]:
    lines = (save / "stream.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.slow
def test_skipped_steps_move_no_stage_boundary(stream_dir, tmp_path):
    plain = _run(stream_cmd(stream_dir, tmp_path / "plain", *GROWTH), tmp_path / "a")
    skipping = _run(stream_cmd(stream_dir, tmp_path / "skip", *GROWTH), tmp_path / "b",
                    overflow_at="2,8")  # attempts after update 2 (stage 1) and 8 (stage 2)
    assert skipping.count("gradient overflow detected") == 2
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
