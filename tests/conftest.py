"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
REPO = Path(__file__).resolve().parent.parent

from lm_fixtures import RESUMABLE, prepare_stream, preprocess_lm, run, stream_cmd  # noqa: E402


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_lm_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fairseq-preprocessed tiny corpus (train/valid/test + dict.txt)."""
    return preprocess_lm(tmp_path_factory.mktemp("tiny_lm"))


@pytest.fixture(scope="session")
def stream_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    return prepare_stream(root, root / "data")


@pytest.fixture(scope="session")
def reference_run(stream_dir, tmp_path_factory):
    """An uninterrupted 2-stage stream (periodic saves do not change results)."""
    save = tmp_path_factory.mktemp("reference") / "run"
    proc = run(stream_cmd(stream_dir, save, *RESUMABLE))
    return save, proc.stdout + proc.stderr
