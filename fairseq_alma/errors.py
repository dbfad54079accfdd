"""The errors of fairseq-alma: one small hierarchy, raised by library code, printed by entry points.

Why typed errors and not prints or ``sys.exit``: library code (the task, the learners, the data
readers) cannot know whether it runs under ``fairseq-train``, ``alma-score``, a test or a
notebook.  It raises one of the classes below with a one-line message that names the file or
flag at fault and says what to do next.  Only console entry points (``cli/``, and the wrapper
around fairseq's own commands in ``fairseq_glue/patches.py``) turn an ``AlmaError`` into
``<prog>: error: <message>`` on stderr and exit with ``exit_status``; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager

# sysexits.h EX_TEMPFAIL: "a temporary failure, the user is invited to retry".  A preempted
# training exits with it after saving, and slurm/sweep.sbatch.in requeues on it.
REQUEUE_EXIT_STATUS = 75


class AlmaError(Exception):
    """Base class: a problem the user can fix.  ``str(err)`` is the one-line message."""

    exit_status = 2  # argparse's status for a usage error

    @property
    def message(self) -> str:
        return str(self)


class UsageError(AlmaError):
    """A bad flag, option, config file value or flag combination."""


class DataError(AlmaError):
    """Input data that cannot be used: a stream directory, manifest, shard, corpus or data set."""


class MissingSplit(DataError):
    """A split that a stream directory does not hold was asked for (its tools name the flag)."""


class RunDirError(AlmaError):
    """A run directory that cannot be used as asked: unreadable records, missing stage
    checkpoints, another run's files."""


class CheckpointError(AlmaError):
    """A checkpoint that cannot be read or does not belong where it was found."""


class ClusterError(AlmaError):
    """A Slurm command failed or the cluster refused a request."""


class Preempted(AlmaError):
    """Not a fault: training stopped on SIGUSR1/SIGTERM after saving where it was; the same
    command continues.  Exits with ``REQUEUE_EXIT_STATUS`` so a scheduler requeues the job."""

    exit_status = REQUEUE_EXIT_STATUS


class OutputError(AlmaError):
    """An output that cannot be written for lack of room: a full disk, a file-size limit, a quota."""


# what a write reports when there is no room for it (ENOSPC; EFBIG under `ulimit -f`; EDQUOT)
NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


@contextmanager
def no_room_named(where: str, again: str = "run the same command again") -> Iterator[None]:
    """A write that finds no room becomes one ``OutputError`` naming the file (or ``where``,
    when the error names none: a write to an open file) instead of a traceback.  The writers
    (``stream/atomic.py``) have removed their temporaries by then, so ``again`` gives the
    uninterrupted result once there is room."""
    try:
        yield
    except OSError as err:
        if err.errno not in NO_ROOM_ERRNOS:
            raise
        raise OutputError(f"{err.filename or where}: cannot write ({err.strerror}); free space "
                          f"(or raise the file-size limit, ulimit -f) and {again}") from None


class StreamFinished(Exception):
    """Not an error: a ``--wait auto`` stream decided its last arrival and has no stage left to
    train, before fairseq's epoch loop reached its bound (B stages); fairseq-train ends with
    status 0 (``fairseq_glue/patches.py``)."""


def require(condition: bool, message: str) -> None:
    """Raise ``UsageError(message)`` unless ``condition`` holds."""
    if not condition:
        raise UsageError(message)


def first_line(err: BaseException, limit: int = 160) -> str:
    """The first line of ``err``'s message (its type name when empty), cut at a word boundary
    with "..." when longer than ``limit``: one-line errors quote library exceptions whose
    messages run to paragraphs, and a quote cut mid-word reads as a garbled message."""
    line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if len(line) <= limit:
        return line
    cut = line[:limit].rsplit(" ", 1)[0] if " " in line[:limit] else line[:limit]
    return cut.rstrip(" ,;:(") + "..."
