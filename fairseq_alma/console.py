"""What every console entry point does with errors: one line on stderr and an exit status.

Library code raises ``AlmaError``s (``fairseq_alma/errors.py``); the entry points in ``cli/`` and ``data_prep/``,
and the wrapper around fairseq's own commands (``fairseq_glue/patches.py``), are the only places that
print them.  A user sees ``<prog>: error: <what is wrong and what to do>``, exit status 2 (the
argparse convention) or the error's own status (a preempted run exits with the requeue status),
and no traceback.  Anything that is not an ``AlmaError`` is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from .errors import AlmaError, OutputError, Preempted
from .loader_threads import stop_background_loaders

INTERRUPTED_EXIT_STATUS = 130  # the shell's status for Ctrl-C
READER_GONE_EXIT_STATUS = 141  # the shell's status for a process ended by SIGPIPE


def error_line(prog: str, err: AlmaError) -> str:
    """The one line a user sees for ``err``."""
    if isinstance(err, Preempted):
        return f"{prog}: {err}"
    return f"{prog}: error: {err}"


def run_console(prog: str, main: Callable[[], int | None]) -> int:
    """Run ``main``; turn fairseq-alma errors and Ctrl-C into one line and an exit status; stop
    fairseq's batch-prefetching threads whatever the exit (``loader_threads``: one caught
    inside a torch op at exit aborts the process instead of returning the status)."""
    try:
        status = main()
    except AlmaError as err:
        print(error_line(prog, err), file=sys.stderr, flush=True)
        return err.exit_status
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; run the same command again to continue", file=sys.stderr)
        return INTERRUPTED_EXIT_STATUS
    except BrokenPipeError:
        # the reader of stdout left (| head, a pager quit): no traceback, no message, the
        # status of a Unix tool ended by SIGPIPE; what the command writes to files came first
        _stdout_to_devnull()
        return READER_GONE_EXIT_STATUS
    finally:
        stop_background_loaders()
    return 0 if status is None else int(status)


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null: Python's flush of a closed pipe at exit would print another
    BrokenPipeError (the Python docs' recipe, ``signal`` module notes)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, ValueError, OSError):
        pass


def write_stdout(text: str) -> None:
    """``text`` on stdout, all of it, or one ``OutputError`` naming stdout; a reader that left
    (``BrokenPipeError``) is left to ``run_console``, which ends quietly.

    Why not ``print``: a table redirected to a file (``alma-score RUN > table.txt``, the
    ``score.txt`` of ``alma-sweep score``) under a file-size limit or on a full disk was cut
    short mid-number with exit 0: CPython's buffered writer takes the kernel's short write and
    drops the rest without an error.  ``os.write`` in a loop gets the error on the write after
    the short one.  A stdout without a file descriptor (a test's capture) is written as usual."""
    stream = sys.stdout
    try:
        fd = stream.fileno()
    except (AttributeError, ValueError, OSError):
        stream.write(text)
        stream.flush()
        return
    stream.flush()
    # an ASCII-only stdout (PYTHONIOENCODING=ascii) gets \xe9 for é, not a traceback
    errors = getattr(stream, "errors", None)
    errors = "backslashreplace" if errors in (None, "strict") else errors
    data = memoryview(text.encode(stream.encoding or "utf-8", errors))
    try:
        while data:
            data = data[os.write(fd, data):]
    except BrokenPipeError:
        raise
    except OSError as err:
        raise OutputError(f"stdout: cannot write ({err.strerror or err}); free space or give "
                          "another path, and run the same command again") from None


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse prints the whole usage block on a bad flag; this prints one line, exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
