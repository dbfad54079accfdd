"""Running Slurm's client commands (sbatch, squeue, scancel...) with one-line errors, and
asking the queue where a sweep's array tasks are.

Shared by ``alma-sweep`` (``sweeps/``) and ``alma-data-prep --slurm-shards``
(``data_prep/slurm_jobs.py``).
"""

from __future__ import annotations

import getpass
import os
import shlex
import subprocess
from pathlib import Path

from ..errors import ClusterError


def run_slurm(command: list[str], timeout: float = 120) -> str:
    """Run a Slurm client command; return its stdout or raise ``ClusterError`` in one line."""
    conf = os.environ.get("SLURM_CONF")
    if conf and not Path(conf).is_file():  # Slurm clients would retry for a minute
        raise ClusterError(f"SLURM_CONF={conf} does not exist; fix or unset it")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise ClusterError(f"{command[0]} not found: run this on a Slurm login node") from None
    except subprocess.TimeoutExpired:
        raise ClusterError(
            f"{command[0]}: no answer in {timeout:.0f} s; is slurmctld up?"
        ) from None
    if done.returncode != 0:
        message = " ".join(done.stderr.split()) or f"exit status {done.returncode}"
        raise ClusterError(f"{shlex.join(command)} failed: {message}")
    return done.stdout


def query_queue(array_job_ids: set[str]) -> dict[int, tuple[str, str]] | None:
    """Array task index -> (state, job id) for this sweep's jobs in squeue; None if unreachable
    (``status`` then shows what the run directories say)."""
    try:
        return require_queue(array_job_ids, "", "")
    except ClusterError:
        return None


def require_queue(array_job_ids: set[str], unknown: str, retry: str) -> dict[int, tuple[str, str]]:
    """``query_queue`` for a command that would submit again what is still queued: when squeue
    does not answer, a ``ClusterError`` in one line ("squeue did not answer (why), so
    ``unknown``; ``retry``") rather than an empty queue, which would queue every run twice."""
    try:
        out = run_slurm(["squeue", "-h", "-r", "-u", getpass.getuser(), "-o", "%F|%K|%T|%i"],
                        30)
    except ClusterError as err:
        raise ClusterError(f"squeue did not answer ({err}), so {unknown}; {retry}") from None
    queue: dict[int, tuple[str, str]] = {}
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4 or parts[0] not in array_job_ids or not parts[1].isdigit():
            continue
        index, state = int(parts[1]), parts[2]
        if index not in queue or state == "RUNNING":  # a running link outranks a pending one
            queue[index] = (state, parts[3])
    return queue


def queued_jobs(job_ids: set[str]) -> set[str] | None:
    """Which of ``job_ids`` (array or plain job ids) still have a task in squeue; None if it
    could not be asked."""
    try:
        out = run_slurm(["squeue", "-h", "-r", "-u", getpass.getuser(), "-o", "%F|%i"], 30)
    except ClusterError:
        return None
    found = set()
    for line in out.splitlines():
        parts = line.strip().split("|")
        found.update(part for part in parts[:1] if part in job_ids)
        found.update(part.split("_")[0] for part in parts[1:] if part.split("_")[0] in job_ids)
    return found
