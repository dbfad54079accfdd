"""Make fairseq's checkpoint copies atomic.

fairseq 0.12 writes the first checkpoint of a save atomically (``.tmp`` + rename), then *copies*
it to the other names (``checkpoint_last.pt``, ``checkpoint_best.pt``, epoch files) with
``PathManager.copy``, a plain ``shutil.copyfile``.  A process killed during that copy (kill -9,
OOM, node failure) leaves a truncated ``checkpoint_last.pt``, and the same command then fails to
resume.  We replace ``PathManager.copy`` for local paths by copy-to-temp + fsync + rename; remote
(iopath) paths keep fairseq's behaviour.  This is the one place we patch fairseq: it has no hook.
"""

from __future__ import annotations

import glob
import os
import shutil


def _atomic_local_copy(original):  # noqa: ANN001, ANN202
    def copy(src_path: str, dst_path: str, overwrite: bool = False) -> bool:
        if "://" in str(dst_path) or "://" in str(src_path):
            return original(src_path, dst_path, overwrite)
        if os.path.exists(dst_path) and not overwrite:
            return False
        tmp = f"{dst_path}.tmp{os.getpid()}"
        shutil.copyfile(src_path, tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, dst_path)
        return True

    copy._alma_atomic = True  # type: ignore[attr-defined]
    return copy


def install() -> None:
    """Idempotent: patch fairseq.file_io.PathManager.copy once per process."""
    from fairseq.file_io import PathManager

    if getattr(PathManager.copy, "_alma_atomic", False):
        return
    PathManager.copy = staticmethod(_atomic_local_copy(PathManager.copy))


def remove_stale_temporaries(save_dir: str) -> list[str]:
    """Delete ``*.pt.tmp*`` left by writes that a crash interrupted (never complete files)."""
    stale = sorted(glob.glob(os.path.join(save_dir, "*.pt.tmp*")))
    for path in stale:
        os.remove(path)
    return stale
