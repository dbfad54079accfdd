"""Interrupted anywhere, the same command continues to exactly the uninterrupted stream.

One LM stream (2 stages x 6 updates, interval saves every 2 updates) is started afresh for each
of six points and each of two signals, interrupted there by kill -9 (a crash, an OOM kill) or by
SIGTERM (preemption: save and exit with the requeue status), and then the same command is run
to the end:

  inside stage 1            when checkpoint_1_2.pt is written
  during validation         inside fairseq's validation of a mid-stage save
  during checkpoint writing after checkpoint_last.pt.tmp is written, before its rename
  between stages            when checkpoint_stage1.pt is written
  during scoring            inside stage 1's end-of-stage evaluation (for stream.jsonl)
  inside the last stage     when checkpoint_2_8.pt is written

The pauses come from a test-only ``sitecustomize.py`` put on the subprocess's PYTHONPATH: it
wraps the named fairseq / fairseq-alma function to print a marker and sleep 3 s when it runs
(after letting ``ALMA_TEST_PAUSE_AFTER`` calls through), so the signal arrives exactly there.  At the end the stage checkpoints and
``stream.jsonl`` equal the uninterrupted run's (bar wall time), and no temporary file is left.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from forked_commands import ForkedCommands
from lm_fixtures import RESUMABLE, assert_same_stream, stream_cmd

from fairseq_alma.errors import REQUEUE_EXIT_STATUS

PAUSE_HOOK = '''
import builtins, os, sys, time

POINT, MARKER = os.environ.get("ALMA_TEST_PAUSE"), os.environ.get("ALMA_TEST_PAUSE_MARKER")
AFTER = int(os.environ.get("ALMA_TEST_PAUSE_AFTER") or 0)
_import = builtins.__import__
_done = set()
_calls = [0]


def _pause(function, name):
    def paused(*args, **kwargs):
        _calls[0] += 1
        if _calls[0] > AFTER and not os.path.exists(MARKER):
            open(MARKER, "w").close()
            print("ALMA_TEST_PAUSED " + name, file=sys.stderr, flush=True)
            time.sleep(3)
        return function(*args, **kwargs)
    return paused


def _patch():
    if "validation" == POINT and "fairseq_cli.train" in sys.modules and POINT not in _done:
        module = sys.modules["fairseq_cli.train"]
        if hasattr(module, "validate"):
            module.validate = _pause(module.validate, POINT); _done.add(POINT)
    if "checkpoint-write" == POINT and "fairseq.file_io" in sys.modules and POINT not in _done:
        manager = getattr(sys.modules["fairseq.file_io"], "PathManager", None)
        if manager is not None:
            manager.rename = staticmethod(_pause(manager.rename, POINT)); _done.add(POINT)
    if "scoring" == POINT and "fairseq_alma.fairseq_glue.stream_training" in sys.modules and POINT not in _done:
        module = sys.modules["fairseq_alma.fairseq_glue.stream_training"]
        if hasattr(module, "total_nll"):
            module.total_nll = _pause(module.total_nll, POINT); _done.add(POINT)


def _hooked_import(name, *args, **kwargs):
    module = _import(name, *args, **kwargs)
    if POINT and POINT not in _done:
        _patch()
    return module


if POINT:
    builtins.__import__ = _hooked_import
'''

# (name, "file" written or "pause" reached, which, calls to let through first)
POINTS = [
    ("inside stage 1", "file", "checkpoint_1_2.pt", 0),
    ("during validation", "pause", "validation", 0),  # of the save at update 2
    ("during checkpoint writing", "pause", "checkpoint-write", 0),  # checkpoint_1_2.pt.tmp
    ("between stages", "file", "checkpoint_stage1.pt", 0),
    ("during scoring", "pause", "scoring", 1),  # arrival 0 is the first; stage 1's the second
    ("inside the last stage", "file", "checkpoint_2_8.pt", 0),
]


class _Stderr(threading.Thread):
    """Reads a process's merged output, noting when the pause marker shows up."""

    def __init__(self, proc: subprocess.Popen) -> None:
        super().__init__(daemon=True)
        self.proc, self.text, self.paused = proc, [], threading.Event()
        self.start()

    def run(self) -> None:
        for line in self.proc.stdout:
            self.text.append(line)
            if line.startswith("ALMA_TEST_PAUSED"):
                self.paused.set()


def _interrupt(cmd: list[str], save: Path, hooks: Path, point: tuple, how: signal.Signals,
               tmp: Path) -> None:
    name, kind, target, after = point
    marker = tmp / f"paused-{target}-{how.name}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")])),
           "ALMA_TEST_PAUSE": target if kind == "pause" else "", "ALMA_TEST_PAUSE_MARKER": str(marker),
           "ALMA_TEST_PAUSE_AFTER": str(after)}
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    output = _Stderr(proc)
    deadline = started + 300
    while True:
        assert proc.poll() is None, f"{name}: the run ended first:\n{''.join(output.text)[-3000:]}"
        assert time.time() < deadline, f"{name}: never reached"
        if kind == "pause" and output.paused.is_set():
            break
        if kind == "file" and (save / target).exists() and (save / target).stat().st_mtime > started:
            break
        time.sleep(0.02)
    proc.send_signal(how)
    proc.wait(timeout=300)
    output.join(timeout=10)
    expected = -signal.SIGKILL if how == signal.SIGKILL else REQUEUE_EXIT_STATUS
    assert proc.returncode == expected, f"{name}: exit {proc.returncode}\n{''.join(output.text)[-3000:]}"
    if how == signal.SIGTERM:
        assert any("preempted at update" in line for line in output.text), name


def _interrupt_then_finish(stream_dir: Path, reference: Path, hooks: Path, tmp: Path,
                           point: tuple, how: signal.Signals, servers: queue.Queue) -> None:
    """Interrupt a fresh process at ``point``, then finish with the same command in a fork
    server's child (a real process forked after fairseq's ~7 s of imports: conftest
    ``forked``), whose stream must equal the fresh uninterrupted reference run's."""
    save = tmp / f"run-{point[2]}-{how.name}"
    cmd = stream_cmd(stream_dir, save, *RESUMABLE)
    _interrupt(cmd, save, hooks, point, how, tmp)
    server = servers.get()
    try:
        finished = server.run(cmd, cwd=Path.cwd(), timeout=600)
    finally:
        servers.put(server)
    assert finished.returncode == 0, f"{point[0]}: {finished.stderr[-3000:]}"
    assert not list(save.glob("*.tmp*")) and not list(save.glob(".*.tmp")), point[0]
    assert_same_stream(save, reference)


@pytest.mark.slow
def test_interrupted_at_six_points_ends_like_an_uninterrupted_run(stream_dir, reference_run,
                                                                   tmp_path, forked):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(PAUSE_HOOK)
    jobs = [(point, how) for point in POINTS for how in (signal.SIGKILL, signal.SIGTERM)]
    second = ForkedCommands({**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    servers: queue.Queue = queue.Queue()
    for server in (forked, second):  # one call at a time each: one per worker thread
        servers.put(server)
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [pool.submit(_interrupt_then_finish, stream_dir, reference_run[0], hooks,
                                   tmp_path, point, how, servers) for point, how in jobs]
            for future in futures:
                future.result()
    finally:
        second.close()
