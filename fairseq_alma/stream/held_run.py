"""What a driver that trains many streams into one output directory may do with a run directory
it finds there: reuse the finished run, continue it, or refuse it (``alma-vision-sweep``,
``alma-vision-demo``).

Why: such a driver names each run directory by a few of its settings (method, width, wait,
seed) and reused any directory whose ``stream.jsonl`` held B + 1 records, so a run trained with
other epochs, optimizer, members or data was reported under the new settings.  ``fairseq-train``
never lets that happen (``RunDirectory.check_fingerprint``), but a driver that reuses a finished
run never gets that far, and that check's advice (``--save-dir``, ``--restart-stream``) names
flags the drivers do not have.  Here the driver asks the same question with the same comparison
(``run.json``'s fingerprint, ``same_run``; a directory whose run never trained is free) before
it trains anything, and the answer names the driver's own way out.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import RunDirError, UsageError
from .fingerprint_forms import comparable_form
from .records import ArrivalRecord
from .run_dir import RunDirectory, fingerprint_differences, same_run
from .run_view import RunView

SHOWN_DIFFERENCES = 4  # as many as fairseq-train's refusal names
DIGEST_CHARACTERS = 12  # a data set's sha256, shortened in a message


def held_run_records(path: str | os.PathLike, fingerprint: dict[str, Any], num_megabatches: int,
                     advice: str) -> list[ArrivalRecord] | None:
    """The records of the finished run in ``path`` when it is the run ``fingerprint`` describes
    (the run the driver would train now: reuse it).  None when the driver should train: nothing
    is there, the run there never trained, or it is this run, unfinished (the same command
    continues it).  ``UsageError`` (one line ending in ``advice``, e.g. "use another --out") when
    ``path`` holds another run, or a run whose settings cannot be read; nothing is written."""
    path = Path(path)
    if not path.is_dir():
        return None
    run_dir = RunDirectory.for_reading(path)
    try:
        held = run_dir.read_fingerprint()
    except RunDirError:
        raise UsageError(f"{path / 'run.json'} is unreadable, so which run {path} holds is "
                         f"unknown; {advice}") from None
    if held is None:
        if not run_dir.run_files():
            return None  # only a lock: a run that stopped before it claimed the directory
        raise UsageError(f"{path} holds run files but no run.json, so the settings that trained "
                         f"them cannot be checked; {advice}")
    if not same_run(held, fingerprint):
        if run_dir.never_trained():
            return None  # a refused command's bookkeeping: the run that trains takes it over
        shown = _differences(held, fingerprint)
        raise UsageError(f"{path} holds a run with other settings ({shown}); {advice}")
    return RunView(path).finished_records(num_megabatches)


def _differences(held: dict[str, Any], wanted: dict[str, Any]) -> str:
    """``setting: held -> wanted``, for the first few settings that differ (the fingerprint's
    ``settings.`` prefix dropped, a data set's sha256 shortened)."""
    if ("settings" in held) != ("settings" in wanted):
        kind = "a vision stream" if "settings" in held else "a language-model stream"
        return f"{kind}'s, not this command's kind of stream"
    shown = []  # settings its method does not read are not differences (same_run)
    for line in fingerprint_differences(comparable_form(held), comparable_form(wanted)):
        name, _, change = line.partition(": ")
        if name == "data":
            old, _, new = change.partition(" -> ")
            change = (f"another data set, sha256 {old.strip(chr(39))[:DIGEST_CHARACTERS]} -> "
                      f"{new.strip(chr(39))[:DIGEST_CHARACTERS]}")
        shown.append(f"{name.removeprefix('settings.')}: {change}")
    more = len(shown) - SHOWN_DIFFERENCES
    return "; ".join(shown[:SHOWN_DIFFERENCES]) + (f"; and {more} more" if more > 0 else "")
