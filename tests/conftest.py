"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
REPO = Path(__file__).resolve().parent.parent

from lm_fixtures import preprocess_lm  # noqa: E402


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_lm_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fairseq-preprocessed tiny corpus (train/valid/test + dict.txt)."""
    return preprocess_lm(tmp_path_factory.mktemp("tiny_lm"))
