"""Tiny real corpora and fairseq-preprocessed data for end-to-end tests.

The text is generated from a small grammar with a fixed seed: enough structure for a tiny model
to show a falling loss within a few dozen updates, and no download.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

VENV_BIN = Path(sys.executable).parent

SUBJECTS = ["the model", "a learner", "the stream", "every expert", "the router", "our data", "a mega-batch"]
VERBS = ["reads", "routes", "waits for", "learns from", "forgets", "predicts", "grows with"]
OBJECTS = ["the tokens", "new chunks", "old shards", "the capacity", "each stage", "the loss", "its experts"]
ENDINGS = ["today .", "over time .", "at scale .", "again .", "slowly .", "in order ."]


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}" for _ in range(n)
    ]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def tool(name: str) -> str:
    """Path of a console script installed in the same environment as the test interpreter."""
    return str(VENV_BIN / name)


def run(cmd: list[str], cwd: Path | None = None, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def preprocess_lm(dest: Path, train_sentences: int = 1200, valid_sentences: int = 120) -> Path:
    """fairseq-preprocess a generated corpus into ``dest`` (train/valid/test, one dict)."""
    raw = dest / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    write_lines(raw / "train.txt", sentences(train_sentences, seed=1))
    write_lines(raw / "valid.txt", sentences(valid_sentences, seed=2))
    write_lines(raw / "test.txt", sentences(valid_sentences, seed=3))
    run([
        tool("fairseq-preprocess"), "--only-source",
        "--trainpref", str(raw / "train.txt"), "--validpref", str(raw / "valid.txt"),
        "--testpref", str(raw / "test.txt"), "--destdir", str(dest / "bin"), "--workers", "1",
    ])
    return dest / "bin"
