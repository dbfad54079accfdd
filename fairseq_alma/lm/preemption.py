"""Save and exit on SIGUSR1/SIGTERM: the training side of the Slurm requeue contract.

Slurm sends SIGUSR1 some time before a job's time limit (``--signal=B:USR1@N``, forwarded to the
tasks by ``slurm/sweep.sbatch.in``) and SIGTERM on preemption.  fairseq has no hook to save on a
signal, but its ``validate_and_save`` re-reads ``--max-update`` after every update and, once the
update count reaches it, validates, saves ``checkpoint_last.pt`` and ends training cleanly.  So on
a signal we set ``max_update`` to the update in progress + 1: the current update finishes, fairseq
saves and returns, and the same command resumes from that checkpoint.  With several
data-parallel workers the flag is all-reduced every ``CHECK_EVERY`` updates (a one-element
all-reduce; not every update, since reading it back synchronises the GPU), so every rank stops at
the same update.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class PreemptionStop:
    """Installs the signal handlers and turns a received signal into a clean fairseq stop."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
    CHECK_EVERY = 10

    def __init__(self, root_cfg: Any) -> None:
        self.root_cfg = root_cfg
        self.requested = False
        self.applied = False
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        self.requested = True
        logger.warning("received %s: saving a checkpoint after the current update, then exiting", signal.Signals(signum).name)

    def _anyone_requested(self, update_num: int) -> bool:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.requested
        if update_num % self.CHECK_EVERY != 0:
            return False
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag)
        return bool(flag.item() > 0)

    def check(self, update_num: int) -> None:
        """Call at every training step; after a signal, make fairseq stop after this update."""
        if self.applied or not self._anyone_requested(update_num):
            return
        optimization = self.root_cfg.get("optimization") if hasattr(self.root_cfg, "get") else None
        if optimization is None:
            return
        optimization.max_update = update_num + 1
        self.applied = True
