"""Per-stage LR schedule of ALMA's LM runs (App. B.2): warmup, then linear decay to 0, restarted
at the start of every stage.

Every stage of an ``alma_stream`` run has the same update budget B_u (``--updates-per-stage``,
times ``--wait`` with ``--scale-updates-by-wait``), so the position inside the current stage is
``num_updates mod B_u`` and the schedule is a pure function of fairseq's update counter: a run
resumed from any checkpoint gets exactly the learning rates of an uninterrupted run.
"""

from dataclasses import dataclass, field
from typing import List

from fairseq.dataclass import FairseqDataclass
from fairseq.optim.lr_scheduler import FairseqLRScheduler, register_lr_scheduler
from omegaconf import II

from ..errors import require


@dataclass
class AlmaStageLinearConfig(FairseqDataclass):
    warmup_updates: int = field(default=500, metadata={"help": "warmup updates at the start of every stage (paper: 500-4000)"})
    warmup_init_lr: float = field(default=0.0, metadata={"help": "learning rate at the first warmup step's start"})
    lr: List[float] = II("optimization.lr")
    updates_per_stage: int = II("task.updates_per_stage")
    scale_updates_by_wait: bool = II("task.scale_updates_by_wait")
    wait: int = II("task.wait")


def stage_budget(updates_per_stage: int, wait: int, scale_updates_by_wait: bool) -> int:
    """Updates in one stage: U, or U x w for the paper's "w3 (3x steps)" settings."""
    return updates_per_stage * (wait if scale_updates_by_wait else 1)


def stage_lr(position: int, budget: int, warmup: int, peak: float, init: float = 0.0) -> float:
    """LR for the update at 0-based ``position`` inside a stage of ``budget`` updates.

    Warmup reaches ``peak`` at position ``warmup - 1``; afterwards the LR falls linearly and
    would reach exactly 0 at position ``budget`` (the first update of the next stage restarts).
    """
    if position < warmup:
        return init + (peak - init) * (position + 1) / warmup
    return peak * (budget - position) / max(1, budget - warmup)


@register_lr_scheduler("alma_stage_linear", dataclass=AlmaStageLinearConfig)
class AlmaStageLinearSchedule(FairseqLRScheduler):
    """Warmup + linear decay to 0 within each ALMA stage (use with --task alma_stream)."""

    def __init__(self, cfg: AlmaStageLinearConfig, optimizer) -> None:  # noqa: ANN001
        super().__init__(cfg, optimizer)
        require(len(cfg.lr) == 1, "--lr must be a single value with --lr-scheduler alma_stage_linear")
        self.peak = cfg.lr[0]
        self.budget = stage_budget(cfg.updates_per_stage, cfg.wait, cfg.scale_updates_by_wait)
        require(
            0 <= cfg.warmup_updates < self.budget,
            f"--warmup-updates must be in [0, {self.budget}) (the stage's update budget); got {cfg.warmup_updates}",
        )
        self.warmup = cfg.warmup_updates
        self.step_update(0)

    def step(self, epoch: int, val_loss: float = None) -> float:  # noqa: RUF013
        super().step(epoch, val_loss)
        return self.optimizer.get_lr()

    def step_update(self, num_updates: int) -> float:
        lr = stage_lr(num_updates % self.budget, self.budget, self.warmup, self.peak, self.cfg.warmup_init_lr)
        self.optimizer.set_lr(lr)
        return lr
