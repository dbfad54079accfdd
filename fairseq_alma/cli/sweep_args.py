"""``alma-sweep``'s own flags, checked before the config is read or fairseq imported.

Why here and not in ``sweep.py``: the subcommands share these flags, and each check must run
before anything is planned or written, so a bad value is one line naming the flag at once
instead of a default silently taking its place (``--max-parallel 0`` used to mean "no limit").
"""

from __future__ import annotations

from ..errors import UsageError


def check_max_parallel(value: int | None) -> None:
    """``--max-parallel M`` bounds the array tasks running at once: M >= 1, or not given
    (then every task may run at once)."""
    if value is not None and value < 1:
        raise UsageError(f"--max-parallel must be >= 1 (got {value}); leave it out to let every "
                         "task of the array run at once")
