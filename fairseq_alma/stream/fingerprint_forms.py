"""One form for fingerprints that describe the same run: what every comparison of ``run.json``
fingerprints compares.

Two settings are written more than one way without changing the run:

* a vision method's learner settings that it never reads (``--members`` for SM, ``--gating``
  for all but gMoE): recorded, they made an SM run trained with ``--members 2`` another run than
  the same SM run with the default 5 (the sweep refused to reuse it, ``alma-report`` split one
  setting's seeds into rows), though the numbers are bit-identical.  New ``run.json`` files
  leave them out (``vision/fingerprint.py``); directories written before hold them;
* a vision gMoE's growing layers: run directories written before 2026-11-29 record none when
  ``--moe-mixture-layers`` was left out, which meant every conv layer of a VGG (the first two
  of an MLP, its only two); the default is now the first two for both backbones (§5: "adds
  modules (at the first two layers)"; CIFAR-10's "methods ... are the same") and every new
  record names its layers.  An old VGG record reads as its sixteen layers, so it is never
  taken for a new default run (``recorded_mixture_layers``);
* an LM's growth plan: ``--grow-experts 2`` and ``2,2`` (and ``--grow-at-stages`` left out or
  given as its default) are one plan (``growth_plan.py``); ``run.json`` keeps the flags as typed,
  since its hash is stamped in every stage checkpoint.

Why in ``stream/``: ``run_dir.same_run`` (resume, and every driver's reuse of a finished run),
``held_run`` and the session compare fingerprints of both kinds of stream, and the comparison
must normalise both sides, so the rule lives below everything that compares
(``report/seeds.py`` groups seeds with it too).  Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .growth_plan import with_parsed_growth_plan

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


# what ``--moe-mixture-layers`` means when left out (``LearnerSpec``), and what it meant for a
# VGG before 2026-11-29: all of reduced VGG19's convolutions (``models_moe.VGG19_CONV_LAYERS``)
PAPER_MIXTURE_LAYERS = (0, 1)
OLD_VGG_MIXTURE_LAYERS = tuple(range(16))


def recorded_mixture_layers(arch: Any, recorded: Any) -> list[int]:
    """The layers a gMoE learner record (``run.json``, a checkpoint's spec) grew: the ones it
    names, or for a record that names none (written before the default was the paper's) the
    default of its day: the first two of an MLP, every conv layer of a VGG."""
    if recorded:
        return [int(layer) for layer in recorded]
    return list(OLD_VGG_MIXTURE_LAYERS if arch == "vgg" else PAPER_MIXTURE_LAYERS)


def comparable_form(fingerprint: Any) -> Any:
    """``fingerprint`` without the learner settings its method does not read (module doc); an
    ensemble's (``{"mode": ..., "members": [...]}``, as ``alma-score --json`` keeps it) with
    each member's so.  Anything else (an LM's fingerprint, a method this version does not
    know) is returned as it is: nothing is dropped on a guess; only an LM's growth plan is
    written one way (``--grow-experts 2`` and ``2,2`` are one plan: ``growth_plan.py``), as
    every comparison of fingerprints goes through here."""
    if not isinstance(fingerprint, Mapping):
        return fingerprint
    if "mode" in fingerprint and isinstance(fingerprint.get("members"), list):
        return {**fingerprint, "members": [comparable_form(m) for m in fingerprint["members"]]}
    settings = fingerprint.get("settings")
    learner = settings.get("learner") if isinstance(settings, Mapping) else None
    method = learner.get("method") if isinstance(learner, Mapping) else None
    read = READ_BY_METHOD.get(method) if isinstance(method, str) else None
    if read is None:
        return with_parsed_growth_plan(fingerprint)
    learner = {key: value for key, value in learner.items()
               if key not in METHOD_SETTINGS or key in read}
    if "mixture_layers" in learner:
        learner["mixture_layers"] = recorded_mixture_layers(learner.get("arch"),
                                                            learner["mixture_layers"])
    return {**fingerprint, "settings": {**settings, "learner": learner}}
