"""stream/held_run.py: what the vision sweep and demo do with a run directory they find (reuse,
train, or refuse in one line naming their own --out), without training anything."""

from __future__ import annotations

import json

import pytest

from fairseq_alma.errors import UsageError
from fairseq_alma.stream.held_run import held_run_records

WANTED = {"settings": {"--epochs-per-stage": 5, "--seed": 1, "learner": {"members": 5}},
          "data": "a" * 64}


def _run_dir(tmp_path, fingerprint, *files):
    path = tmp_path / "sm_mlp4_w1_s1"
    path.mkdir()
    if fingerprint is not None:
        (path / "run.json").write_text(json.dumps({"fingerprint": fingerprint, "hash": "x"}))
    for name in files:
        (path / name).write_text("{}\n")
    return path


def test_nothing_there_or_never_trained_is_free(tmp_path):
    assert held_run_records(tmp_path / "absent", WANTED, 2, "use another --out") is None
    other = {**WANTED, "settings": {**WANTED["settings"], "--epochs-per-stage": 1}}
    # a refused command's bookkeeping and its lock: the run that trains takes the directory
    path = _run_dir(tmp_path, other, "run.lock")
    assert held_run_records(path, WANTED, 2, "use another --out") is None


def test_another_run_is_refused_naming_what_differs(tmp_path):
    other = {"settings": {"--epochs-per-stage": 1, "--seed": 1, "learner": {"members": 3}},
             "data": "b" * 64}
    path = _run_dir(tmp_path, other, "stream.jsonl")
    with pytest.raises(UsageError) as caught:
        held_run_records(path, WANTED, 2, "use another --out")
    assert str(caught.value) == (
        f"{path} holds a run with other settings (data: another data set, sha256 bbbbbbbbbbbb -> "
        f"aaaaaaaaaaaa; --epochs-per-stage: 1 -> 5; learner.members: 3 -> 5); use another --out")


def test_a_language_model_run_is_named_as_such(tmp_path):
    path = _run_dir(tmp_path, {"config": {"task": {"wait": 1}}}, "stream.jsonl")
    with pytest.raises(UsageError, match="holds a run with other settings \\(a language-model "
                                         "stream's, not this command's kind of stream\\)"):
        held_run_records(path, WANTED, 2, "use another --out")


def test_runs_whose_settings_cannot_be_read_are_refused(tmp_path):
    path = _run_dir(tmp_path, None, "stream.jsonl")
    with pytest.raises(UsageError, match="holds run files but no run.json, so the settings that "
                                         "trained them cannot be checked; use another --out$"):
        held_run_records(path, WANTED, 2, "use another --out")
    (path / "run.json").write_text("{not json")
    with pytest.raises(UsageError, match="run.json is unreadable, .*; use another --out$"):
        held_run_records(path, WANTED, 2, "use another --out")
