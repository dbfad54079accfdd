"""A full disk during training: one line that says so, a nonzero exit, and every checkpoint
written before stays readable (fairseq's own save and our copies are atomic).  The save
directory is a small tmpfs mounted for the test (root only; skipped with the reason otherwise)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from lm_fixtures import stream_cmd, tool


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


def _file_size_limit(kib: int):
    """preexec_fn: writes past ``kib`` KiB fail with EFBIG (Python ignores SIGXFSZ), as on a
    full disk; needs no mount, so it runs everywhere."""
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (kib * 1024, kib * 1024))


@pytest.mark.parametrize("name", ["alma-demo-corpus", "alma-data-prep"])
def test_preparing_data_with_no_room_is_one_line_and_leaves_nothing(tmp_path, name):
    """alma-data-prep and alma-demo-corpus ended in a traceback (OSError EFBIG / ENOSPC)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"document {i} says words and more words.\n\n" for i in range(4000)))
    out = tmp_path / "out"
    argv = ([tool(name), "--out", str(out), "--max-mb", "0.3"] if name == "alma-demo-corpus" else
            [tool(name), str(corpus), "--out", str(out), "--vocab-size", "100",
             "--num-megabatches", "2", "--workers", "1"])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          preexec_fn=_file_size_limit(64))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert lines[-1].startswith(f"{name}: error: --out {out}: cannot write (File too large); "
                                "free space"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    left = [p.name for p in out.rglob("*") if p.is_file()] if out.is_dir() else []
    assert not any(name.endswith(".tmp") or ".tmp" in name for name in left), left


def test_a_table_printed_into_a_file_with_no_room_is_an_error_not_cut_short(tmp_path):
    """``alma-score RUN > table.txt`` under a file-size limit ended mid-number with exit 0:
    print's buffered writer drops what the kernel's short write did not take."""
    import sys

    code = "from fairseq_alma.console import write_stdout; write_stdout('257.28 ' * 400)"
    with open(tmp_path / "table.txt", "w") as out:
        proc = subprocess.run([sys.executable, "-c", code], stdout=out, stderr=subprocess.PIPE,
                              text=True, timeout=60, preexec_fn=_file_size_limit(1))
    assert proc.returncode != 0 and "File too large" in proc.stderr
