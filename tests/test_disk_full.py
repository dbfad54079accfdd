"""A full disk during training: one line that says so, a nonzero exit, and every checkpoint
written before stays readable (fairseq's own save and our copies are atomic).  The save
directory is a small tmpfs mounted for the test (root only; skipped with the reason otherwise)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from lm_fixtures import stream_cmd


@pytest.fixture
def small_disk(tmp_path, reference_run):
    """A tmpfs with room for about two full checkpoints of the reference run."""
    last = reference_run[0] / "checkpoint_last.pt"
    size_kb = int(last.stat().st_size * 2.5 / 1024) + 64
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({proc.stderr.strip() or 'not root'}); the "
                    f"full-disk path needs one")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.slow
def test_full_disk_is_one_line_and_keeps_earlier_checkpoints(stream_dir, small_disk):
    save = small_disk / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(stream_cmd(stream_dir, save, "--save-interval-updates", "1"),
                          capture_output=True, text=True, env=env, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fairseq-alma: error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "no space left on the device of" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    checkpoints = [p for p in Path(save).glob("*.pt")]
    assert checkpoints, "nothing was saved before the disk filled"
    for path in checkpoints:  # complete files only: every one of them loads
        torch.load(path, map_location="cpu", weights_only=False)
