"""The fingerprint a vision stream writes to its ``run.json``: what a driver compares before it
reuses a run directory (``stream/held_run.py``).

Why here: ``runner.run_vision_session`` claims its directory with this mapping, and the sweep and
the demo must build exactly the same one to know whether a finished run is the run they would
train now (any difference refuses every reuse).  Their tests check it against the ``run.json``
a real run wrote.

Learner settings a method never reads (``--members`` for SM, ``--gating`` for Ens, the Firefly
settings for gMoE, ...) are left out (``stream/fingerprint_forms.comparable_form``): recorded, they made an SM
run trained with ``--members 2`` another run than the same SM run with the default 5, so the
sweep refused to reuse it, ``alma-report`` split one setting's seeds into rows and Fig. 4 found
no replay twin, though the numbers are bit-identical.  Run directories written before that hold
those keys: every comparison (``stream/run_dir.same_run``, ``report/seeds.py``) drops them from
both sides, so such a run still resumes and still groups with new ones.  Nothing here imports
torch: reports read fingerprints anywhere.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..stream.fingerprint_forms import comparable_form


class _Settled(Protocol):
    """A ``runner.VisionRun`` (named by shape: the runner imports this module)."""

    def settings(self) -> dict[str, Any]: ...


def vision_fingerprint(run: _Settled, data_sha256: str) -> dict[str, Any]:
    """``run.json``'s fingerprint of ``run`` on the data whose ``runner.data_digest`` is
    ``data_sha256``: the settings that change its results (those its method reads), and the
    data (not where it lives)."""
    return comparable_form({"settings": run.settings(), "data": data_sha256})
