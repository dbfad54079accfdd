"""One-line user errors for the data_prep command-line tools.

A user error (a bad path, a flag value, a corpus too small for the requested split) is a
``DataPrepError`` whose message names the file or flag and says what to do; the CLIs print it as
one line on stderr and exit with status 2. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

USER_ERROR_EXIT = 2
INTERRUPTED_EXIT = 130


class DataPrepError(Exception):
    """A problem with the user's input or flags; the message is one line."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse prints the whole usage block on a bad flag; we print one line and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(USER_ERROR_EXIT, f"{self.prog}: error: {message} (see --help)\n")


def run_cli(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    action: Callable[[argparse.Namespace], object],
) -> int:
    """Parse ``argv`` and run ``action``; turn user errors and Ctrl-C into one line + status."""
    args = parser.parse_args(argv)
    try:
        action(args)
    except DataPrepError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted; run the same command again to continue",
              file=sys.stderr)
        return INTERRUPTED_EXIT
    return 0
