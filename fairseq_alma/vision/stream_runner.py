"""A whole vision ALMA stream in one process (Algorithm 1, §3.1), for small sweeps and tests.

The ``alma_stream`` fairseq task drives the same three public steps per stage, so both paths
train and score identically:

1. ``stage_data``: the stage's training and validation tensors (its mega-batches, §5);
2. ``train_one_stage``: growth hook, then ``train_stage`` with best-validation selection;
3. ``evaluate``: test error of the learner's predictor after an arrival.

``run_stream`` evaluates after *every* arrival t = 0 … B (t = 0: the untrained model; arrivals
without training re-use the unchanged model's error) and returns one ``stream.jsonl`` record per
arrival, cumulative training FLOPs included (growth scoring and validation passes count too).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import UsageError
from ..stream.partition import Megabatch, partition_indices
from ..stream.records import ArrivalRecord, write_records
from ..stream.schedule import Stage, arrival_table, build_schedule
from .data import VisionData
from .learners import Learner, LearnerSpec, build_learner
from .stage_trainer import StageResult, StageTrainConfig, evaluate, train_stage


@dataclass(frozen=True)
class StreamSpec:
    """The stream: B mega-batches, waiting time w, replay, validation share, partition seed."""

    num_megabatches: int
    wait: int = 1
    replay: bool = False
    valid_fraction: float = 0.1
    seed: int = 1

    def __post_init__(self) -> None:
        if self.num_megabatches < 1:
            raise UsageError(f"--num-megabatches must be >= 1, got {self.num_megabatches}")
        if not 1 <= self.wait <= self.num_megabatches:
            raise UsageError(
                f"--wait must be between 1 and --num-megabatches ({self.num_megabatches}), "
                f"got {self.wait}"
            )


@dataclass
class StageOutcome:
    """``train_one_stage``'s result: the growth done before training, and the training."""

    growth: dict[str, Any]
    result: StageResult

    @property
    def flops(self) -> float:
        return self.growth.get("flops", 0.0) + self.result.flops


def make_partition(data: VisionData, stream: StreamSpec) -> list[Megabatch]:
    """Seeded split of the training set into mega-batches with their validation parts."""
    if stream.num_megabatches > data.x_train.shape[0]:
        raise UsageError(
            f"--num-megabatches {stream.num_megabatches} is larger than the training set of "
            f"{data.name} ({data.x_train.shape[0]} examples)"
        )
    return partition_indices(
        data.x_train.shape[0], stream.num_megabatches, stream.seed, stream.valid_fraction
    )


def stage_data(
    data: VisionData, partition: list[Megabatch], megabatch_ids: tuple[int, ...]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(train_x, train_y, valid_x, valid_y) of the union of ``megabatch_ids``."""
    train = torch.from_numpy(np.concatenate([partition[i].train for i in megabatch_ids]))
    valid = torch.from_numpy(np.concatenate([partition[i].valid for i in megabatch_ids]))
    return data.x_train[train], data.y_train[train], data.x_train[valid], data.y_train[valid]


def train_one_stage(
    learner: Learner,
    stage: Stage,
    data: VisionData,
    partition: list[Megabatch],
    config: StageTrainConfig,
    seed: int,
    progress: Callable[[int, float, list[float]], None] | None = None,
) -> StageOutcome:
    """Grow (stages after the first), then train on ``stage.train_megabatches``."""
    train_x, train_y, valid_x, valid_y = stage_data(data, partition, stage.train_megabatches)
    growth = learner.before_stage(stage.index, train_x, train_y, valid_x, valid_y)
    result = train_stage(
        learner,
        train_x,
        train_y,
        valid_x,
        valid_y,
        config,
        seed=seed * 1_000_003 + stage.index,
        progress=progress,
    )
    return StageOutcome(growth=growth, result=result)


def run_stream(
    data: VisionData,
    spec: LearnerSpec,
    stream: StreamSpec,
    config: StageTrainConfig,
    log: Callable[[str], None] | None = print,
    jsonl_path: str | None = None,
) -> list[dict[str, Any]]:
    """Run the stream for one learner; return (and optionally write) one record per arrival."""
    started = time.perf_counter()
    partition = make_partition(data, stream)
    schedule = build_schedule(stream.num_megabatches, stream.wait, stream.replay)
    stages = {stage.arrival: stage for stage in schedule}
    learner = build_learner(spec, data.input_shape, data.num_classes)
    records: list[ArrivalRecord] = []
    flops_cum = 0.0
    last_eval = None
    for info in arrival_table(schedule, stream.num_megabatches):
        stage_info: dict[str, Any] = {}
        if info.trained:
            outcome = train_one_stage(
                learner, stages[info.arrival], data, partition, config, stream.seed
            )
            flops_cum += outcome.flops
            stage_info = {
                "best_epoch": outcome.result.best_epoch,
                "stage_wall_time": outcome.result.wall_time,
            }
            last_eval = None
        if last_eval is None:
            last_eval = evaluate(learner, data.x_test, data.y_test, config.eval_batch_size)
        record = ArrivalRecord(
            arrival=info.arrival,
            stage=info.stage,
            trained=info.trained,
            megabatches_seen=info.megabatches_seen,
            params_active=learner.params_active(),
            train_flops_cum=flops_cum,
            infer_flops_per_example=learner.infer_flops_per_example(),
            test_error=last_eval.error,
            wall_time=time.perf_counter() - started,
            extra={
                "method": spec.method,
                "arch": spec.arch,
                "width": spec.width,
                "wait": stream.wait,
                "replay": stream.replay,
                **learner.describe(),
                **stage_info,
            },
        )
        records.append(record)
        if log is not None and (info.trained or info.arrival in (0, stream.num_megabatches)):
            log(
                f"[{spec.method} {spec.arch}{spec.width} w={stream.wait}] arrival {info.arrival}/"
                f"{stream.num_megabatches} stage {info.stage} test_error {last_eval.error:.4f} "
                f"params {record.params_active} flops {flops_cum:.3g}"
            )
    if jsonl_path is not None:
        write_records(jsonl_path, records)
    return [record.to_json() for record in records]
