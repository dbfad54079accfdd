"""User-facing errors that end a command with one clear line instead of a traceback."""

from __future__ import annotations


class UsageError(SystemExit):
    """A bad flag, file or config value.

    Subclassing SystemExit makes ``fairseq-train``/``fairseq-eval-lm`` (whose main functions we
    do not own) print just ``fairseq-alma: error: <message>`` on stderr and exit with status 2,
    the argparse convention, instead of a traceback that hides the one line users need.
    """

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(f"fairseq-alma: error: {message}")
        self.code = f"fairseq-alma: error: {message}"


def require(condition: bool, message: str) -> None:
    """Raise UsageError(message) unless condition holds."""
    if not condition:
        raise UsageError(message)
