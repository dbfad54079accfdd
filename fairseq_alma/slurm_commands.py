"""Running Slurm's client commands (sbatch, squeue, scancel...) with one-line errors.

Shared by ``alma-sweep`` (``cli/sweep.py``) and ``alma-data-prep --slurm-shards``
(``data_prep/slurm_jobs.py``).
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from .errors import ClusterError


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
