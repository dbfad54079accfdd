"""Output paths a command is given (``--out``, ``--save-dir``, ``--sweep-dir``, ``--json``),
checked before any work.

Why one module: every command that writes results takes such a path, and without a check a
path that is a file (or lies under one) ends in ``mkdir``'s ``NotADirectoryError`` traceback,
or in a vague "cannot create", after minutes of work or after other files were already
written.  Each command calls these with its own flag name, so the one line a user sees names
the flag, the path and what to give instead.
"""

from __future__ import annotations

import os

from .errors import AlmaError, UsageError


def check_dir_path(path: str | os.PathLike, flag: str,
                   error: type[AlmaError] = UsageError) -> None:
    """Refuse ``path`` as the directory ``flag`` names unless it is a directory or can become
    one: it must not be a file, nor lie under one."""
    given = os.fspath(path)
    real = os.path.realpath(given)
    if os.path.exists(real) and not os.path.isdir(real):
        raise error(f"{flag} {given}: exists and is not a directory; give the path of a "
                    "directory (a new one is created)")
    above = os.path.dirname(real)
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise error(f"{flag} {given}: {above} is a file, not a directory; give the path of a "
                    "directory (a new one is created)")


def check_file_path(path: str | os.PathLike, flag: str) -> None:
    """Refuse ``path`` as the file ``flag`` writes if it is a directory or its folder cannot
    be one (the write would fail only after the work it records)."""
    given = os.fspath(path)
    if os.path.isdir(given):
        raise UsageError(f"{flag} {given}: is a directory; give the path of a file to write")
    folder = os.path.dirname(os.path.abspath(given))
    check_dir_path(folder, f"{flag} {given}: its folder")
