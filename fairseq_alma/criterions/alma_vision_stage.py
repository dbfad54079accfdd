"""``alma_vision_stage``: fairseq's logging for vision ALMA stages (paper §5, App. B.1).

In a vision stream (``--task alma_stream --vision-dataset ...``) one fairseq update trains a whole
stage with the learner's own loop: epochs over the stage's mega-batches, the epoch with the best
validation loss kept (App. B.1).  There is nothing left for a criterion to differentiate, so this
one computes no loss: it passes the numbers the task measured (``sample["alma_log"]``) to fairseq
and turns them into the progress log's columns, losses in base 2 like fairseq's cross_entropy:

  train:  loss (last epoch's training cross-entropy), stage_valid_loss (the kept epoch's loss on
          the stage's validation data), best_epoch, stage, gflops (the stage's training FLOPs),
          params (|θ| after the stage);
  valid:  loss and error of the learner's predictor on the validation data of the last stage.
"""

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.dataclass import FairseqDataclass
from fairseq.logging import metrics

from ..errors import UsageError


@dataclass
class AlmaVisionStageConfig(FairseqDataclass):
    """No flags: what a stage trains is set by the task's --epochs-per-stage, --vision-* flags."""


@register_criterion("alma_vision_stage", dataclass=AlmaVisionStageConfig)
class AlmaVisionStageCriterion(FairseqCriterion):
    """Passes the task's stage log through (see module doc); the returned loss is a constant 0."""

    def forward(self, model: Any, sample: Dict[str, Any],
                reduce: bool = True) -> Tuple[torch.Tensor, int, Dict[str, Any]]:
        log = sample.get("alma_log") if isinstance(sample, dict) else None
        if log is None:
            raise UsageError("--criterion alma_vision_stage only works in vision streams: "
                             "--task alma_stream --vision-dataset ... --arch alma_vision")
        return torch.zeros(()), 1, {"sample_size": 1, **log}

    @staticmethod
    def reduce_metrics(logging_outputs: List[Dict[str, Any]]) -> None:
        """Every value is a sum over workers (and updates): the per-stage numbers are divided by
        ``stage_logs``, one per worker and stage, so data-parallel runs show the same values."""

        def total(key: str) -> float:
            return float(sum(log.get(key, 0) for log in logging_outputs))

        examples = total("loss_examples")
        loss = total("loss_sum") / examples / math.log(2) if examples else 0.0
        metrics.log_scalar("loss", loss, max(examples, 1.0), round=3)
        if any("wrong" in log for log in logging_outputs) and examples:
            metrics.log_scalar("error", total("wrong") / examples, examples, round=4)
        count = total("stage_logs")
        if not count:
            return
        valid = total("valid_examples")
        if valid:
            valid_loss = total("valid_loss_sum") / valid / math.log(2)
            metrics.log_scalar("stage_valid_loss", valid_loss, valid, round=3)
        for key, digits in (("best_epoch", 1), ("stage", 0), ("gflops", 3), ("params", 0)):
            metrics.log_scalar(key, total(key) / count, count, round=digits)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True  # sums across workers (see reduce_metrics); works with gloo on CPU too
