"""The paper's global batch (192 sequences of 512 tokens per update) as an invariant of a sweep:
on 1, 8 and 16 GPUs per run every generated command trains on exactly 192 sequences per update,
and a layout that cannot reach it is refused with one line."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fairseq_alma.errors import UsageError
from fairseq_alma.sweeps.global_batch import per_step_layout

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "train_configs" / "lm" / "SM_w1_base.yaml"


def _profile(tmp_path: Path, nodes: int, gpus: int) -> Path:
    path = tmp_path / f"gpus{nodes * gpus}.yaml"
    path.write_text(f"description: {nodes} x {gpus} GPUs\nnodes: {nodes}\ngpus_per_node: {gpus}\n"
                    f"cpus_per_task: 2\ntime: '01:00:00'\n")
    return path


def _dry_run(tmp_path: Path, profile: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fairseq_alma.cli.sweep", "submit", str(CONFIG),
                           "--sweep-dir", str(tmp_path / "sweep"), "--profile", str(profile),
                           "--dry-run"], capture_output=True, text=True, timeout=300, cwd=tmp_path)


@pytest.mark.parametrize("nodes, gpus", [(1, 1), (1, 8), (2, 8)], ids=["1gpu", "8gpus", "16gpus"])
def test_every_command_reaches_the_papers_192_sequences(tmp_path, nodes, gpus):
    done = _dry_run(tmp_path, _profile(tmp_path, nodes, gpus))
    assert done.returncode == 0, done.stderr
    commands = [line for line in done.stdout.splitlines() if re.match(r"\[\d+\] ", line)]
    assert len(commands) == 3  # 4, 8 and 12 experts
    for line in commands:
        argv = shlex.split(line.split("] ", 1)[1])
        batch, update_freq = (int(argv[argv.index(flag) + 1]) for flag in ("--batch-size", "--update-freq"))
        assert batch <= 8 and batch * update_freq * nodes * gpus == 192
        assert "--fp16" in argv  # V100 class


def test_layouts():
    assert per_step_layout(192, 8, 8) == (8, 3)
    assert per_step_layout(192, 16, 8) == (6, 2)  # 8 sequences per GPU would overshoot
    assert per_step_layout(192, 1, 8) == (8, 24)
    with pytest.raises(UsageError, match="global_batch 192 cannot be split over 5 processes"):
        per_step_layout(192, 5, 8)


def test_a_layout_that_cannot_reach_it_is_one_line(tmp_path):
    done = _dry_run(tmp_path, _profile(tmp_path, 1, 5))
    errors = [line for line in done.stderr.splitlines() if line.startswith("alma-sweep: error:")]
    assert done.returncode == 2 and len(errors) == 1 and "cannot be split over 5 processes" in errors[0]
