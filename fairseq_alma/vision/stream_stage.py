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
from ..stream.partition import Megabatch, partition_indices, valid_count
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


def check_validation_parts(data: VisionData, partition: list[Megabatch], plan: StreamPlan,
                           valid_fraction: float, method: str) -> None:
    """Refuse, before anything trains, a stream that would need validation examples where the
    partition has none.  Without this a stage with no validation data quietly keeps its last
    epoch instead of its best one, gMoE splits expert 0 for want of losses, and ``--wait auto``
    divides by zero at its first decision.

    Which validation parts are read: every stage selects its epoch (and gMoE plans its next
    split) on the union of the validation parts of the mega-batches it trains on; ``--wait
    auto`` decides at arrival t on those of mega-batches 0..t-1 and may train a stage on any
    one mega-batch alone (all arrived ones with --replay, which include mega-batch 0).
    ``--valid-fraction 0`` says there is no validation data: stages with a fixed --wait then
    keep their last epoch (no refusal), but --wait auto and gMoE cannot do without it.
    """
    if valid_fraction == 0:
        if plan.adaptive:
            raise UsageError("--wait auto decides on the validation parts of the arrived "
                             "mega-batches, but --valid-fraction 0 holds none back; use "
                             "--valid-fraction 0.1 (the paper's) or a fixed --wait")
        if method == "gmoe" and plan.num_stages > 1:
            raise UsageError("--vision-method gmoe picks the expert to split on each stage's "
                             "validation data, but --valid-fraction 0 holds none back; use "
                             "--valid-fraction 0.1 (the paper's)")
        return
    if plan.adaptive:
        needed = [(0,)] if plan.replay else [(i,) for i in range(len(partition))]
    else:
        needed = [stage.train_megabatches for stage in plan.schedule]
    for index, ids in enumerate(needed, start=1):
        if sum(partition[i].valid.size for i in ids) > 0:
            continue
        if plan.adaptive and ids == (0,):
            user = "--wait auto would have none to decide on at arrival 1"
        elif plan.adaptive:
            user = (f"a --wait auto stage on mega-batch {ids[0]} alone would have none for its "
                    f"best-epoch selection")
        else:
            user = (f"stage {index} (mega-batches {list(ids)}) would have none for its "
                    f"best-epoch selection")
        size = min(partition[i].size for i in ids)
        raise UsageError(
            f"--num-megabatches {plan.num_megabatches} cuts the {data.x_train.shape[0]} training "
            f"examples of {data.name} into mega-batches of {size}, where --valid-fraction "
            f"{valid_fraction:g} rounds to 0 validation examples: {user}; "
            f"{_validation_advice(data.x_train.shape[0], size, valid_fraction)}")


def _validation_advice(n: int, size: int, valid_fraction: float) -> str:
    """What would give every mega-batch a validation example: fewer mega-batches, or a larger
    fraction (the smallest 2-decimal one that rounds to 1 example of ``size``)."""
    options = []
    # the smallest mega-batch with a validation example: about 0.5 / valid_fraction examples
    start = max(2, int(0.5 / valid_fraction) - 2)
    smallest = next((s for s in range(start, n + 1) if valid_count(s, valid_fraction) >= 1), None)
    if smallest is not None:
        options.append(f"--num-megabatches {n // smallest} or fewer")
    fraction = next((f / 100 for f in range(1, 100) if valid_count(size, f / 100) >= 1), None)
    if fraction is not None:
        options.append(f"--valid-fraction {fraction:g} or more")
    return "use " + (", or ".join(options) if options else "fewer --num-megabatches")


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
