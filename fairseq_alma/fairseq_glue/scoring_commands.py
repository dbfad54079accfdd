"""What fairseq-eval-lm and fairseq-validate need to score our checkpoints right.

* Under any ``--task``, a checkpoint is scored only against the dictionary it was trained with
  (``install_dictionary_check``).
* A checkpoint of an expert-parallel run is built with every expert on every rank
  (``modules/expert_parallel.build_experts_whole``), as ``alma-score`` builds it: rebuilt
  sharded, ranks with unequal batch counts waited in all_to_all forever, and 3 ranks of a
  checkpoint trained on groups of 2 were refused naming training flags.
* fairseq's hub interface (``from_pretrained``: ``score``, ``sample``, ``generate``), in every
  process, routes a model trained with ``--eval-capacity-factor`` without the limit
  (``install_hub_routing``): the limit is set by the tokens of one forward, which the hub makes
  of whatever sentences it is given together, so a sentence's score depended on its neighbours'
  (``models/switch_transformer_lm.py`` says why decoding never uses it either).

Why the dictionary: an ``alma_stream`` checkpoint records the sha256 of its dictionary (``task_state``) and
``AlmaStreamTask.load_state_dict`` refuses another one, but fairseq-eval-lm builds the task of
its own command line, ``language_modeling`` unless ``--task`` is given, whose
``load_state_dict`` ignores it.  A stream prepared again with another ``--seed`` has a
dictionary of the same size in another order: every id then named another piece and
fairseq-eval-lm printed a perplexity (360.79) with exit 0; a dictionary of another size ended
in a size-mismatch traceback.  fairseq calls ``task.load_state_dict`` before it builds the
model, so the check runs before either.
"""

from __future__ import annotations

import os
from typing import Any


def install_scoring_command_patches() -> None:
    """The patches of the module doc: the hub's in every process, the others in
    fairseq-eval-lm and fairseq-validate only."""
    from .patch_marks import running as _running

    install_hub_routing()
    if not _running(SCORING_PROGRAMS, SCORING_MODULES):
        return
    from ..modules.expert_parallel import build_experts_whole

    build_experts_whole()
    install_dictionary_check()


SCORING_PROGRAMS = ("fairseq-eval-lm", "fairseq-validate")
SCORING_MODULES = ("fairseq_cli.eval_lm", "fairseq_cli.validate")


HUB_ROUTING_REASON = ("the hub scores and samples the sentences it is given together, so the limit "
                      "would be set by which sentences share a forward")


def install_hub_routing() -> None:
    """Patch ``GeneratorHubInterface.__init__``: its models route without
    ``--eval-capacity-factor`` (module doc), with a one-time warning."""
    from fairseq import hub_utils

    from .patch_marks import is_patched as _patched
    from .patch_marks import mark as _mark

    original = hub_utils.GeneratorHubInterface.__init__
    if _patched(original):
        return

    def __init__(self: Any, cfg: Any, task: Any, models: Any) -> None:
        original(self, cfg, task, models)
        for model in self.models:
            drop = getattr(model, "drop_eval_capacity", None)
            if drop is not None:
                drop(HUB_ROUTING_REASON)

    hub_utils.GeneratorHubInterface.__init__ = _mark(__init__)


def install_dictionary_check() -> None:
    """Patch ``FairseqTask.load_state_dict`` (tasks that do not define their own; the stream
    task checks itself) in fairseq-eval-lm and fairseq-validate only."""
    from fairseq.tasks import FairseqTask

    from .patch_marks import is_patched as _patched
    from .patch_marks import mark as _mark
    from .patch_marks import running as _running

    original = FairseqTask.load_state_dict
    if _patched(original) or not _running(SCORING_PROGRAMS, SCORING_MODULES):
        return

    def load_state_dict(self: Any, state_dict: Any) -> None:
        settings = getattr(self, "cfg", None) or getattr(self, "args", None)  # legacy tasks: args
        check_trained_dictionary(getattr(settings, "data", None),
                                 (state_dict or {}).get("dictionary_sha256"))
        original(self, state_dict)

    FairseqTask.load_state_dict = _mark(load_state_dict)


def check_trained_dictionary(data: Any, trained: str | None) -> None:
    """``DataError`` when ``data``'s ``dict.txt`` is not the dictionary of sha256 ``trained``
    (None: a checkpoint that does not record one, nothing to check)."""
    if not trained or not isinstance(data, str) or not data:
        return
    from ..stream.manifest import check_same_dictionary, sha256_file

    path = os.path.join(data.split(os.pathsep)[0], "dict.txt")
    if os.path.isfile(path):
        check_same_dictionary(trained, sha256_file(path), path)
