"""What every patch of fairseq needs: a mark on what it replaced (so it is never wrapped twice,
e.g. when the plugin is imported again under ``--user-dir``) and which command this process is
(a patch for fairseq-eval-lm must not change fairseq-train).  Its own module so that patch
modules beside ``patches.py`` use them without importing it (which imports them)."""

from __future__ import annotations

import os
import sys
from typing import Any


def mark(function: Any) -> Any:
    """``function``, marked as the plugin's replacement."""
    function._alma_patch = True
    return function


def is_patched(function: Any) -> bool:
    return getattr(function, "_alma_patch", False)


def running(programs: tuple[str, ...], modules: tuple[str, ...]) -> bool:
    """Whether this process is one of ``programs`` (its console script's name) or runs one of
    ``modules`` with ``python -m``."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return os.path.basename(sys.argv[0] if sys.argv else "") in programs or (
        main_spec is not None and main_spec.name in modules)
