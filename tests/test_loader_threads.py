"""A process that leaves while fairseq's batch-prefetching thread is inside a torch op exits
with its own status (``fairseq_alma/loader_threads.py``): before, Python's finalization ended
that thread mid-op and the process aborted (SIGABRT, "terminate called without an active
exception"), so a preempted training job exited 134 instead of the requeue status 75."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from fairseq_alma.errors import REQUEUE_EXIT_STATUS

# fairseq's BufferedIterator over batches that each take a while in torch (GIL released); the
# main thread takes one and leaves as a preempted run does, through ``run_console``.
SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from fairseq.data.iterators import BufferedIterator
    from fairseq_alma.console import run_console
    from fairseq_alma.errors import Preempted

    torch.set_num_threads(1)
    weights = torch.randn(400, 400)

    def slow_batches():
        for _ in range(10_000):
            x = weights
            for _ in range(30):
                x = torch.mm(x, weights).tanh_()
            yield x

    class Batches:
        def __len__(self):
            return 10_000

        def __iter__(self):
            return slow_batches()

    def main():
        batches = BufferedIterator(2, Batches())
        next(batches)
        raise Preempted("preempted at update 1, checkpoint saved; run the same command")

    sys.exit(run_console("t", main))
""")


def test_a_prefetching_thread_inside_torch_does_not_abort_the_exit():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == REQUEUE_EXIT_STATUS, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr
    assert "t: preempted at update 1" in proc.stderr
