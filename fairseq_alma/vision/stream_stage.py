"""One stage of a vision stream: its data, its input statistics, growth, training (§3, §5).

Split from ``runner`` (the whole stream, records and checkpoints) so that what one stage may
see is in one place: the stage trains on ``stage.train_megabatches`` (the new mega-batches, or
all arrived ones with replay), selects epochs on their validation parts, and normalises its
inputs with the statistics of the mega-batches arrived by ``stage.arrival``, and plans the next
growth on its own validation data — nothing of a later arrival reaches it (§3: "the learner
cannot have access to future mega-batches").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import UsageError
from ..stream.partition import Megabatch, partition_indices
from ..stream.progress import StreamPlan
from ..stream.schedule import Stage
from .dataset import VisionData
from .learners import Learner
from .normalization import ArrivedStatistics
from .stage_trainer import StageResult, StageTrainConfig, train_stage


@dataclass
class StageOutcome:
    """``train_one_stage``'s result: the growth done before training, the training, and the
    next growth planned after it (on this stage's validation data)."""

    growth: dict[str, Any]
    result: StageResult
    plan: dict[str, Any]

    @property
    def flops(self) -> float:
        return self.growth.get("flops", 0.0) + self.result.flops + self.plan.get("flops", 0.0)


def make_partition(data: VisionData, plan: StreamPlan, seed: int,
                   valid_fraction: float) -> list[Megabatch]:
    """Seeded split of the training set into mega-batches with their validation parts."""
    if plan.num_megabatches > data.x_train.shape[0]:
        raise UsageError(f"--num-megabatches {plan.num_megabatches} is larger than the training "
                         f"set of {data.name} ({data.x_train.shape[0]} examples)")
    return partition_indices(data.x_train.shape[0], plan.num_megabatches, seed, valid_fraction)


def arrived_statistics(data: VisionData, partition: list[Megabatch]) -> ArrivedStatistics:
    """Per-mega-batch input sums of the stream (training and validation parts), for the
    statistics of any prefix of arrivals."""
    whole = [np.concatenate([megabatch.train, megabatch.valid]) for megabatch in partition]
    return ArrivedStatistics(data.x_train, whole, per_channel=data.is_image)


def stage_data(data: VisionData, partition: list[Megabatch],
               megabatch_ids: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(train_x, train_y, valid_x, valid_y) of the union of ``megabatch_ids``."""
    train = torch.from_numpy(np.concatenate([partition[i].train for i in megabatch_ids]))
    valid = torch.from_numpy(np.concatenate([partition[i].valid for i in megabatch_ids]))
    device = data.x_train.device
    train, valid = train.to(device), valid.to(device)
    return data.x_train[train], data.y_train[train], data.x_train[valid], data.y_train[valid]


def train_one_stage(learner: Learner, stage: Stage, data: VisionData, partition: list[Megabatch],
                    statistics: ArrivedStatistics, config: StageTrainConfig, seed: int,
                    plans_growth: bool,
                    progress: Callable[[int, float, list[float]], None] | None = None,
                    should_stop: Callable[[], bool] | None = None) -> StageOutcome:
    """Adopt the arrived data's statistics, grow (stages after the first), train on
    ``stage.train_megabatches``, then, when ``plans_growth`` (another stage follows), let the
    learner plan its next growth on this stage's validation data.  ``should_stop`` is asked
    after every epoch (the stage then raises ``Preempted``)."""
    train_x, train_y, valid_x, valid_y = stage_data(data, partition, stage.train_megabatches)
    learner.set_input_statistics(*statistics.after(stage.arrival))
    growth = learner.before_stage(stage.index, train_x, train_y, valid_x, valid_y)
    result = train_stage(learner, train_x, train_y, valid_x, valid_y, config,
                         seed=seed * 1_000_003 + stage.index, progress=progress,
                         should_stop=should_stop, stage=stage.index)
    plan = learner.plan_growth(stage.index, valid_x, valid_y) if plans_growth else {"flops": 0.0}
    return StageOutcome(growth=growth, result=result, plan=plan)
