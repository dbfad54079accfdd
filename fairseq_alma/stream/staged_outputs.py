"""Several output files that change together: all of them, or none.

Why its own module: a command that writes several files (alma-report's tables and figures,
alma-score's --json/--csv/--plot) one after another, each atomically (``atomic.py``), left the
earlier ones replaced and the later ones from the previous run when one failed (full disk, a
directory under a file's name, Ctrl-C): a mix that no command made.  Here each is drawn into a
staging directory next to it and all are moved into place together; a writer killed before
that leaves its staging directory, which the next writer removes once its process is gone
(``lock.py`` says whether it is).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile

from .atomic import fsync_dir
from .lock import pid_alive, try_flock

# A staging directory is named ``<prefix><pid>@<host>-<random>``: a later run on the same host
# can tell that its writer is gone (``remove_stale_staging``) without a record file.
_STAGING_NAME = re.compile(r"(?P<pid>\d+)@(?P<host>.+)-[a-z0-9_]+")
_STAGING_LOCK = ".lock"  # held (flock) by the writer for as long as it stages
_NEW, _OLD = "new", "old"  # staged files; the files they replace, kept until all are moved


def remove_stale_staging(folder: str | os.PathLike, prefix: str) -> list[str]:
    """Remove the staging directories (``StagedOutputs(prefix)``) in ``folder`` whose writer is
    gone, and return them.

    Why: a writer killed by SIGKILL (or a SIGTERM it does not handle) cannot remove its staging
    directory, and one per interruption piled up in an output folder forever.  One is stale only
    when its name says it was made on this host by a process that no longer exists and nobody
    holds its lock: a directory of a live writer (of this host, of another node of a shared file
    system, or of another pid namespace of this host) is never touched."""

    removed = []
    host = socket.gethostname()
    with contextlib.suppress(OSError):
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            found = _STAGING_NAME.fullmatch(entry.name[len(prefix):]) \
                if entry.name.startswith(prefix) else None
            if found is None or found["host"] != host or not entry.is_dir(follow_symlinks=False):
                continue
            if int(found["pid"]) == os.getpid() or pid_alive(int(found["pid"])):
                continue
            try:
                held = try_flock(os.path.join(entry.path, _STAGING_LOCK))
            except OSError:
                continue
            if held is None:  # its writer lives (a pid of another namespace)
                continue
            os.close(held[0])
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


class StagedOutputs:
    """Files drawn first into a staging directory next to each, then moved into place together
    (``publish``): a failure while drawing or moving leaves every target as it was.

    Why: a command that writes several files (a table, its CSV and JSON, figures) one after
    another, each atomically, left the earlier ones replaced and the later ones from the
    previous run when one failed (full disk, a directory under a file's name, Ctrl-C): a mix
    that no command made.  Use as a context manager; leaving it removes the staging
    directories (``discard``), whatever happened."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix  # e.g. ".alma-report-": hidden, and names the command
        self._scratch: dict[str, tuple[str, int]] = {}  # folder -> staging dir, its lock's fd
        self._staged: list[tuple[str, str]] = []  # (staged file, target)

    def __enter__(self) -> StagedOutputs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()

    def path_for(self, target: str | os.PathLike) -> str:
        """Where to draw ``target`` (same base name, so its extension still names its format);
        the first call for a folder removes its stale staging directories and makes one."""
        target = os.path.abspath(os.fspath(target))
        folder = os.path.dirname(target)
        if folder not in self._scratch:
            os.makedirs(folder, exist_ok=True)
            remove_stale_staging(folder, self._prefix)
            scratch = tempfile.mkdtemp(prefix=f"{self._prefix}{os.getpid()}@{socket.gethostname()}-",
                                       dir=folder)
            self._scratch[folder] = (scratch, -1)
            held = try_flock(os.path.join(scratch, _STAGING_LOCK))
            self._scratch[folder] = (scratch, held[0] if held else -1)
            for sub in (_NEW, _OLD):
                os.mkdir(os.path.join(scratch, sub))
        staged = os.path.join(self._scratch[folder][0], _NEW, os.path.basename(target))
        self._staged.append((staged, target))
        return staged

    def publish(self) -> None:
        """Move every staged file onto its target, in the order they were staged.  When a move
        fails (or is interrupted), those already made are undone (the earlier files put back)
        and the ``OSError`` is raised with the target as its ``filename``."""
        done: list[tuple[str, str | None]] = []  # target, the earlier file's copy (None: none)
        target = ""
        try:
            for staged, target in self._staged:
                backup = None
                if os.path.lexists(target):
                    backup = os.path.join(os.path.dirname(os.path.dirname(staged)), _OLD,
                                          os.path.basename(target))
                    try:
                        os.link(target, backup, follow_symlinks=False)
                    except OSError:  # a file system without hard links, or not a file
                        shutil.copy2(target, backup, follow_symlinks=False)
                os.replace(staged, target)
                done.append((target, backup))
        except BaseException as err:
            for moved, backup in reversed(done):
                with contextlib.suppress(OSError):
                    if backup is None:
                        os.unlink(moved)
                    else:
                        os.replace(backup, moved)
            if isinstance(err, OSError):
                raise OSError(err.errno, err.strerror, target) from None
            raise
        for folder in self._scratch:
            fsync_dir(folder)

    def discard(self) -> None:
        """Remove the staging directories (and whatever is still staged in them)."""
        for scratch, fd in self._scratch.values():
            shutil.rmtree(scratch, ignore_errors=True)
            if fd >= 0:
                os.close(fd)
        self._scratch.clear()
        self._staged.clear()
