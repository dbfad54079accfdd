"""When a training process stops before the stream's end, and how it tells the scheduler why.

Two reasons, both ending with "run the same command again to continue":

* ``ALMA_STOP_AFTER_STAGE=t`` (``alma-sweep --chain-stages``): train up to stage t, save, exit 0;
  the next job of the chain continues with stage t+1.  ``stage_limit`` turns it (and a user's
  ``--max-epoch``) into the number of stages this process trains.
* SIGUSR1 / SIGTERM (Slurm's time-limit warning ``--signal=B:USR1@N``, preemption, scancel):
  ``StopSignal`` records the request; the learner saves where it is and raises ``Preempted``,
  whose exit status ``REQUEUE_EXIT_STATUS`` tells ``slurm/sweep.sbatch.in`` to requeue the job
  (and a person at a terminal that the run did not finish).  Handlers are installed only by
  training processes: a process that only reads a run directory never touches signals.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Mapping
from types import FrameType

from ..errors import UsageError

logger = logging.getLogger(__name__)

STOP_AFTER_STAGE_ENV = "ALMA_STOP_AFTER_STAGE"


def stage_limit(num_stages: int, max_epoch: int | None = None,
                env: Mapping[str, str] | None = None) -> int:
    """How many stages this process trains: all, fewer with ``--max-epoch`` (fairseq's flag: one
    epoch is one stage) or ``ALMA_STOP_AFTER_STAGE``; the smaller one wins."""
    env = os.environ if env is None else env
    limit = num_stages
    if max_epoch:
        if max_epoch > num_stages:
            raise UsageError(f"--max-epoch must be <= {num_stages} (the stream's stages); got "
                             f"{max_epoch} (one fairseq epoch is one stage)")
        limit = max_epoch
    text = env.get(STOP_AFTER_STAGE_ENV, "").strip()
    if text:
        if not text.isdigit() or int(text) < 1:
            raise UsageError(f"{STOP_AFTER_STAGE_ENV} must be a stage number >= 1 (got {text!r})")
        limit = min(limit, int(text))
    return limit


class StopSignal:
    """Records SIGUSR1/SIGTERM; the learner checks ``requested`` at safe points (module doc)."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    def install(self) -> StopSignal:
        """Take over SIGUSR1/SIGTERM (main thread only: Python delivers signals there)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:  # noqa: ARG002
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        logger.warning("received %s: saving at the next safe point, then exiting to be requeued",
                       self.signal_name)
