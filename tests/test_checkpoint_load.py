"""Loading checkpoints never runs their pickle (checkpoint_load.py): every kind of checkpoint the
toolkit writes loads with ``weights_only``; a checkpoint whose pickle would create a file when
loaded is refused, through alma-score, fairseq-eval-lm and a vision stream's resume, and no file
appears; ``--trust-checkpoint`` is the explicit way out."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from lm_fixtures import USER_DIR, run, tool

from fairseq_alma.checkpoint_load import load_checkpoint, trust_checkpoints
from fairseq_alma.errors import CheckpointError


class _CreatesAFile:
    """Unpickling this calls ``open(path, "w")``: a stand-in for any code a pickle can run."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def _malicious(path: Path, marker: Path) -> Path:
    torch.save({"model": {"w": torch.zeros(2)}, "cfg": _CreatesAFile(marker)}, path)
    return path


def test_every_checkpoint_a_stream_writes_loads_without_unpickling_code(reference_run):
    save, _ = reference_run
    names = [p.name for p in sorted(save.glob("checkpoint*.pt"))]
    assert "checkpoint_last.pt" in names and "checkpoint_stage1.pt" in names
    for name in names:
        state = load_checkpoint(save / name)
        assert {"model", "cfg"} <= set(state)


def test_a_pickle_that_runs_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "created_by_the_pickle"
    path = _malicious(tmp_path / "evil.pt", marker)
    with pytest.raises(CheckpointError, match=r"evil.pt: holds a io.open, .*--trust-checkpoint"):
        load_checkpoint(path)
    assert not marker.exists()
    trust_checkpoints(True)
    try:
        load_checkpoint(path)  # the user vouched for the file: it is unpickled fully
    finally:
        trust_checkpoints(False)
    assert marker.exists()


def test_the_console_commands_refuse_it_in_one_line(reference_run, stream_dir, tmp_path):
    save = tmp_path / "run"
    shutil.copytree(reference_run[0], save)
    marker = tmp_path / "created_by_the_pickle"
    _malicious(save / "checkpoint_stage1.pt", marker)
    for argv in ([tool("alma-score"), str(save), "--cpu"],
                 [tool("fairseq-eval-lm"), str(stream_dir), "--user-dir", USER_DIR, "--path",
                  str(save / "checkpoint_stage1.pt"), "--gen-subset", "eval", "--cpu"]):
        proc = run(argv, check=False)
        errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
        assert "checkpoint_stage1.pt: holds a io.open" in errors[0]
        assert "Traceback" not in proc.stderr and not marker.exists()


def test_a_quoted_library_message_is_cut_at_a_word_not_mid_word():
    from fairseq_alma.errors import first_line

    long = RuntimeError("Weights only load failed. " + "please torch.save your checkpoint again " * 8 + "\nnext")
    quoted = first_line(long)
    assert quoted.endswith("...") and len(quoted) <= 163 and quoted[:-3].split()[-1] in long.args[0].split()
    assert first_line(RuntimeError("short\nsecond line")) == "short"
    assert first_line(EOFError()) == "EOFError"
