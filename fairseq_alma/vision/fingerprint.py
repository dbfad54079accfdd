"""The fingerprint a vision stream writes to its ``run.json``: what a driver compares before it
reuses a run directory (``stream/held_run.py``).

Why here: ``runner.run_vision_session`` claims its directory with this mapping, and the sweep and
the demo must build exactly the same one to know whether a finished run is the run they would
train now (any difference refuses every reuse).  Their tests check it against the ``run.json``
a real run wrote.
"""

from __future__ import annotations

from typing import Any, Protocol


class _Settled(Protocol):
    """A ``runner.VisionRun`` (named by shape: the runner imports this module)."""

    def settings(self) -> dict[str, Any]: ...


def vision_fingerprint(run: _Settled, data_sha256: str) -> dict[str, Any]:
    """``run.json``'s fingerprint of ``run`` on the data whose ``runner.data_digest`` is
    ``data_sha256``: the settings that change its results, and the data (not where it lives)."""
    return {"settings": run.settings(), "data": data_sha256}
