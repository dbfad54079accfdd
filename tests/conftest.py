"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
REPO = Path(__file__).resolve().parent.parent

from lm_fixtures import RESUMABLE, fork_server, prepare_stream, preprocess_lm, run, stream_cmd  # noqa: E402

NO_CUDA = "needs a CUDA GPU; none is visible to torch here"


# The longest test files (``make test`` prints the slowest tests), started first: with one file
# per worker process (pytest-xdist ``--dist loadfile``), a long file started last would run alone
# at the end while the other worker idles.  xdist would order files by their number of tests
# (most first: these single long tests last); ``make test`` passes --no-loadscope-reorder.
LONGEST_FIRST = ("test_resume_points.py", "test_data_prep_shards.py", "test_bad_inputs.py",
                 "test_drift_demo.py", "test_alma_report.py", "test_data_prep_sources.py",
                 "test_eval_matrix.py", "test_distributed_stream.py", "test_wait_auto_lm.py",
                 "test_vision_task.py", "test_slurm_streams.py", "test_benchmarks.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (``LONGEST_FIRST``), the rest in their order; a test marked
    ``cuda`` skips, saying why, wherever torch sees no GPU (``make gpu-check``)."""
    import torch

    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order kept within

    if not torch.cuda.is_available():
        for item in items:
            if item.get_closest_marker("cuda"):
                item.add_marker(pytest.mark.skip(reason=NO_CUDA))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ANN001
    """One visible line when the GPU tests did not run here, so a skip is never read as a pass."""
    import torch

    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "cuda" in r.keywords]
    if skipped and not torch.cuda.is_available():
        count = len(skipped)
        line = f"no CUDA device: {count} tests marked cuda skipped (`make gpu-check` on a GPU)"
        terminalreporter.write_line(line, yellow=True, bold=True)


@pytest.fixture(scope="session")
def forked():
    """The fork server for fairseq-train (``lm_fixtures.fork_server``), one per test worker:
    for calls that need its ``run`` directly (extra environment variables, stdout and stderr
    apart)."""
    return fork_server("fairseq-train")


@pytest.fixture(scope="session")
def forked_prep():
    """``alma-data-prep ARGS`` run in the fork server of our scripts, as a CompletedProcess."""
    server = fork_server("alma-data-prep")
    return lambda *args: server.run(["alma-data-prep", *args], cwd=Path.cwd(), timeout=300)


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
