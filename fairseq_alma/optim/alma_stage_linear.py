"""Per-stage LR schedule of ALMA's LM runs (App. B.2): warmup, then linear decay to 0, restarted
at the start of every stage; ``--stage-lr-schedule`` chooses a meta-schedule across stages
(``stage_lr_schedules.py``: ``restart``, the default and App. B.2's, ``cyclic``, ``decay``).

The LR is a pure function of the stream core's stage position (stage, counted updates done in
it).  fairseq hands a scheduler only its counter of counted updates; the core's ``StageClock``
stops the run whenever that counter is not the clock's position, so ``stage_position`` reads the
position back from it exactly, fp16-skipped steps included (they advance neither), and a run
resumed from any checkpoint gets exactly the learning rates of an uninterrupted run.
"""

import logging
from dataclasses import dataclass, field
from typing import List, Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.optim.lr_scheduler import FairseqLRScheduler, register_lr_scheduler
from omegaconf import II

from ..errors import require
from ..stream.stage_clock import stage_position
from .stage_lr_schedules import STAGE_LR_SCHEDULES, scheduled_lr, stage_lr  # noqa: F401 (stage_lr: API)

logger = logging.getLogger(__name__)


@dataclass
class AlmaStageLinearConfig(FairseqDataclass):
    warmup_updates: int = field(default=500, metadata={"help": "warmup updates at the start of every stage (paper: 500-4000)"})
    warmup_init_lr: float = field(default=0.0, metadata={"help": "learning rate at the first warmup step's start"})
    stage_lr_schedule: ChoiceEnum(list(STAGE_LR_SCHEDULES)) = field(default="restart", metadata={"help": (
        "LR meta-schedule across stages (fairseq_alma/optim/stage_lr_schedules.py): restart = every stage warms up "
        "to --lr then decays linearly to 0 (ALMA App. B.2); cyclic = the same warmup, then a cosine decay to 0 "
        "(TiC-LM's Cyclic Cosine); decay = restart with stage s peaking at --lr/sqrt(s)")})
    lr: List[float] = II("optimization.lr")
    updates_per_stage: int = II("task.updates_per_stage")
    scale_updates_by_wait: bool = II("task.scale_updates_by_wait")
    wait: Optional[int] = II("task.wait")  # None: --wait auto, refused for LM streams


def stage_budget(updates_per_stage: int, wait: int, scale_updates_by_wait: bool) -> int:
    """Updates in one stage: U, or U x w for the paper's "w3 (3x steps)" settings."""
    return updates_per_stage * (wait if scale_updates_by_wait else 1)


def check_stage_schedule(lr: List[float], warmup_updates: int, budget: int) -> None:
    """One peak LR, and every stage warms up then decays within its budget. The stream checks
    this before it takes its run directory (``train_flags.check_stream_start``): under ``--wait
    auto`` arrival 0 is evaluated and recorded before fairseq builds this scheduler, and that
    record made the corrected command's directory "another run"."""
    require(len(lr) == 1, "--lr must be a single value with --lr-scheduler alma_stage_linear")
    require(
        0 <= warmup_updates < budget,
        f"--warmup-updates must be in [0, {budget}) (the stage's update budget); got {warmup_updates}",
    )


@register_lr_scheduler("alma_stage_linear", dataclass=AlmaStageLinearConfig)
class AlmaStageLinearSchedule(FairseqLRScheduler):
    """Warmup + decay to 0 within each ALMA stage, peak per ``--stage-lr-schedule`` (use with
    --task alma_stream)."""

    def __init__(self, cfg: AlmaStageLinearConfig, optimizer) -> None:  # noqa: ANN001
        super().__init__(cfg, optimizer)
        self.budget = stage_budget(cfg.updates_per_stage, cfg.wait, cfg.scale_updates_by_wait)
        check_stage_schedule(list(cfg.lr), cfg.warmup_updates, self.budget)
        self.peak = cfg.lr[0]
        self.warmup = cfg.warmup_updates
        self.schedule = str(getattr(cfg.stage_lr_schedule, "value", cfg.stage_lr_schedule))
        self.step_update(0)

    def step(self, epoch: int, val_loss: float = None) -> float:  # noqa: RUF013
        super().step(epoch, val_loss)
        return self.optimizer.get_lr()

    def step_update(self, num_updates: int) -> float:
        stage, position = stage_position(num_updates, self.budget)
        lr = scheduled_lr(self.schedule, stage, position, self.budget, self.warmup, self.peak, self.cfg.warmup_init_lr)
        self.optimizer.set_lr(lr)
        return lr
