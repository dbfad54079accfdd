"""Stop fairseq's batch-prefetching threads before the process exits.

Why: fairseq's ``BufferedIterator`` (``--data-buffer-size``, 10 by default) collates the next
batches in a daemon thread (``BackgroundConsumer``).  When fairseq-train leaves in the middle
of an epoch (a preemption's save-and-exit with the requeue status, an error), that thread may
be inside a torch op, which released the GIL.  Python then finalizes, the thread tries to take
the GIL back and is ended by ``pthread_exit`` while C++ frames are on its stack: the process
aborts ("terminate called without an active exception", SIGABRT) instead of exiting with its
status, and Slurm does not requeue a preempted job.  Seen once in the test suite; reproduced
every time by a thread collating in torch when the main thread exits.

fairseq 0.12 gives the thread no stop: this sets its length limit (``_max_len``) so that it
ends after the item it is making, and empties its queue (``_queue``) so that its last puts do
not block.  The prefetched batches are dropped; nothing of them was trained on.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time

logger = logging.getLogger(__name__)


def stop_background_loaders(timeout: float = 60.0) -> None:
    """End every live ``BackgroundConsumer`` of this process (module doc), waiting at most
    ``timeout`` seconds in all for the item each is collating."""
    iterators = sys.modules.get("fairseq.data.iterators")
    if iterators is None:  # never imported: no such thread, and no import of fairseq at exit
        return
    BackgroundConsumer = iterators.BackgroundConsumer  # noqa: N806 - fairseq's class
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if not isinstance(thread, BackgroundConsumer) or thread is threading.current_thread():
            continue
        thread._max_len = 0  # ends after the put of the item in hand
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                while True:
                    thread._queue.get_nowait()
            except queue.Empty:
                pass
            thread.join(0.01)
        if thread.is_alive():
            logger.warning("a batch-prefetching thread did not stop within %.0f s", timeout)
