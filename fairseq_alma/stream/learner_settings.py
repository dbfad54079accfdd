"""Which learner settings each vision method reads: what makes two vision fingerprints the same
run.

Why in ``stream/``: ``run_dir.same_run`` (resume, and every driver's reuse of a finished run)
and ``held_run`` compare fingerprints of both kinds of stream, and a run directory written before
the unread settings were left out of ``run.json`` holds them; the comparison must drop them on
both sides, so the rule lives below everything that compares (``vision/fingerprint.py`` writes
fingerprints with it, ``report/seeds.py`` groups seeds with it).  Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# the learner settings (``LearnerSpec`` fields, ``run.settings()["learner"]``) that only some
# methods read; every method reads the others (method, arch, width, seed).  Checked against
# the learners' code: StackedLearner reads ``members`` for ens/umix only (SM is one member)
# and ``ens_member_data_order`` for ens only; GrowingEnsemble none of these; GrowingMoE
# ``gating`` and ``mixture_layers``; FireflyLearner the growth rate and the ``ff_*`` settings.
METHOD_SETTINGS = frozenset({"members", "ens_member_data_order", "gating", "mixture_layers",
                             "growth_rate", "ff_new_layers", "ff_new_candidates", "ff_epsilon",
                             "ff_score_examples"})
READ_BY_METHOD: dict[str, frozenset[str]] = {
    "sm": frozenset(),
    "ens": frozenset({"members", "ens_member_data_order"}),
    "umix": frozenset({"members"}),
    "gens": frozenset(),
    "gmoe": frozenset({"gating", "mixture_layers"}),
    "ff": frozenset({"growth_rate", "ff_new_layers", "ff_new_candidates", "ff_epsilon",
                     "ff_score_examples"}),
}


def without_unread_settings(fingerprint: Any) -> Any:
    """``fingerprint`` without the learner settings its method does not read (module doc); an
    ensemble's (``{"mode": ..., "members": [...]}``, as ``alma-score --json`` keeps it) with
    each member's so.  Anything else (an LM's fingerprint, a method this version does not
    know) is returned as it is: nothing is dropped on a guess."""
    if not isinstance(fingerprint, Mapping):
        return fingerprint
    if "mode" in fingerprint and isinstance(fingerprint.get("members"), list):
        return {**fingerprint, "members": [without_unread_settings(m) for m in fingerprint["members"]]}
    settings = fingerprint.get("settings")
    learner = settings.get("learner") if isinstance(settings, Mapping) else None
    method = learner.get("method") if isinstance(learner, Mapping) else None
    read = READ_BY_METHOD.get(method) if isinstance(method, str) else None
    if read is None:
        return fingerprint
    learner = {key: value for key, value in learner.items()
               if key not in METHOD_SETTINGS or key in read}
    return {**fingerprint, "settings": {**settings, "learner": learner}}
