"""Putting a sweep directory back as it was when the sbatch call that its new files were
written for fails.

Why: ``alma-sweep submit`` and ``score`` write their records and script before they call
sbatch (Slurm reads the script from the file).  Left behind after a refused sbatch (a bad
partition, an unreachable controller), those files made the corrected command a "different
sweep" and ``status`` report runs that were never submitted.  Both commands take a snapshot of
what they will write first and, when sbatch fails, restore it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ..stream.atomic import atomic_write_bytes


class UndoWrites:
    """The files and directories a submission is about to write, as they are now."""

    def __init__(self, files: Iterable[Path], directories: Iterable[Path]) -> None:
        self.files: dict[Path, tuple[bytes, int] | None] = {}
        for path in files:
            self.files[path] = ((path.read_bytes(), path.stat().st_mode & 0o7777)
                                if path.exists() else None)
        missing: list[Path] = []  # every directory to be made, parents included, deepest first
        for directory in directories:
            for path in (directory, *directory.parents):
                if path.exists():
                    break
                if path not in missing:
                    missing.append(path)
        self.new_directories = sorted(missing, key=lambda p: len(p.parts), reverse=True)

    def undo(self) -> None:
        """Restore every file (or remove it, when it was not there) and remove the directories
        made since, when empty (anything else found in one is left where it is)."""
        for path, before in self.files.items():
            if before is None:
                path.unlink(missing_ok=True)
            else:
                content, mode = before
                atomic_write_bytes(path, content)
                os.chmod(path, mode)
        for directory in self.new_directories:
            try:
                directory.rmdir()
            except OSError:
                pass
