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
import tempfile
from collections.abc import Sequence

from .errors import AlmaError, UsageError


def check_dir_path(path: str | os.PathLike, flag: str,
                   error: type[AlmaError] = UsageError) -> None:
    """Refuse ``path`` as the directory ``flag`` names unless it is a directory or can become
    one: it must not be empty, a file, nor lie under one."""
    given = os.fspath(path)
    _check_not_empty(given, flag, error)
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


def _check_not_empty(given: str, flag: str, error: type[AlmaError]) -> None:
    """An empty path (``--out ""``, an unset shell variable) would otherwise mean the current
    directory, or no file at all."""
    if not given.strip():
        raise error(f"{flag} is an empty path (it would mean the current directory, or no file); give a path")


def check_file_path(path: str | os.PathLike, flag: str) -> None:
    """Refuse ``path`` as the file ``flag`` writes if it is a directory or its folder cannot
    be one (the write would fail only after the work it records)."""
    given = os.fspath(path)
    _check_not_empty(given, flag, UsageError)
    if os.path.isdir(given):
        raise UsageError(f"{flag} {given}: is a directory; give the path of a file to write")
    folder = os.path.dirname(os.path.abspath(given))
    check_dir_path(folder, f"{flag} {given}: its folder")


def check_output_files(outputs: Sequence[tuple[str, str | os.PathLike | None]],
                       inputs: Sequence[str | os.PathLike], what: str = "run directory") -> None:
    """Refuse, before any work, the files a command is asked to write (``(flag, path)``, path
    None: not asked) when one would replace an input or another output: a path inside one of
    the ``inputs`` directories (``--json RUN/stream.jsonl`` would destroy the run it reports),
    the same path given to two flags (the second write would replace the first), or a folder
    that cannot be written (found otherwise only after the work, naming a temporary file).
    Each path is also checked as ``check_file_path`` does."""
    taken: dict[str, str] = {}
    roots = [os.path.realpath(path) for path in inputs]
    for flag, path in outputs:
        if path is None:
            continue
        given = os.fspath(path)
        check_file_path(given, flag)
        real = os.path.realpath(given)
        for root, name in zip(roots, inputs, strict=True):
            if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
                raise UsageError(f"{flag} {given}: inside the {what} {os.fspath(name)}, whose "
                                 f"files it would replace; write it outside the {what}")
        if real in taken:
            raise UsageError(f"{flag} {given}: also given to {taken[real]}; give each output "
                             f"its own path")
        taken[real] = flag
        check_writable(os.path.dirname(real), f"{flag} {given}")


def check_writable(folder: str | os.PathLike, what: str, error: type[AlmaError] = UsageError) -> None:
    """Refuse ``folder`` (or, when it does not exist yet, the nearest folder above it, where
    it would be made) unless a file can be written in it: a read-only mount or a folder of
    another user fails here, in one line, not after the work or inside a library's traceback.
    A probe file, not ``os.access``: root passes ``os.access`` on a read-only file system."""
    folder = os.path.realpath(folder)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    try:
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".write-probe-")
        os.close(handle)
        os.unlink(probe)
    except OSError as err:
        raise error(f"{what}: cannot write in {folder} ({err.strerror}); give a path in a "
                    f"writable folder") from None
