"""``alma_vision_stage``: a criterion name kept so that vision commands written for fairseq-alma
0.1 still parse (``--criterion alma_vision_stage``).

A vision learner trains each stage with its own cross-entropy loop (``vision/stage_trainer.py``),
reached from ``fairseq-train`` through ``fairseq_glue/vision_entry.py`` before fairseq builds any
criterion, so the flag is not needed; this registration only keeps old commands valid.  Built
anywhere else, it refuses with one line.
"""

from dataclasses import dataclass
from typing import Any

from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.dataclass import FairseqDataclass

from ..errors import UsageError


@dataclass
class AlmaVisionStageConfig(FairseqDataclass):
    """No flags."""


@register_criterion("alma_vision_stage", dataclass=AlmaVisionStageConfig)
class AlmaVisionStageCriterion(FairseqCriterion):
    """Never built in a vision stream (module doc)."""

    def __init__(self, task: Any) -> None:
        raise UsageError("--criterion alma_vision_stage belongs to vision streams (--task alma_stream "
                         "--vision-dataset ...), where it is optional; drop it here")
