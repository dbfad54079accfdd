"""Training of one ALMA stage for a vision learner (§3, App. B.1); its evaluation is in
``evaluation`` and re-exported here.

A stage trains ``epochs`` epochs (paper: 100) over the stage's training tensors in mini-batches
of 128 and keeps the parameters of the epoch with the lowest loss on the stage's validation
tensors (10% of each mega-batch it trains on: the only data the learner may select on, §3.1;
never the test set).  Epoch 0, the parameters the stage started from, is a candidate too, so a
stage never leaves a learner worse on its own validation data. Ens members are independent runs
(their losses are summed, so each gets exactly its own gradient) and each keeps its own best
epoch; they see the same mini-batches unless the learner asks for one data order per member.
Optimizers (App. B.1): MNIST AdaDelta lr 1.0; CIFAR SGD lr 0.01, momentum 0.9, weight decay
1e-4; one fresh optimizer per stage, built after any growth so it always holds the current
parameters.

Devices and precision: a stage runs where the learner's parameters are (``learner.to``), on data
that may already live there.  The data order and the augmentation draws come from a CPU
generator seeded per stage, so CPU numbers never change and a CUDA run sees the same batches.
The hot loop never reads a device value back on the host: the training loss, the validation
losses and the best-epoch snapshots stay on the device and are read once per epoch.  ``amp``
runs the forward passes under autocast (fp16 with loss scaling, CUDA only; bf16 anywhere) and
computes every loss in float32.  A run that must stop (preemption) passes ``should_stop``: it is
asked between epochs, and the stage then restarts from its beginning when the run continues.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import Preempted, UsageError
from .augment import random_crop_flip
from .devices import AMP_MODES, autocast, check_amp, optimizer_step, to_device, upcast
from .evaluation import EvalResult, evaluate, validation_losses
from .learners import Learner
from .mac_count import inference_flops, training_flops

# evaluation's names stay importable from here, where the runner and tests import them
__all__ = [
    "EvalResult",
    "OptimizerSpec",
    "StageResult",
    "StageTrainConfig",
    "evaluate",
    "train_stage",
    "validation_losses",
]

OPTIMIZERS = ("adadelta", "sgd")


@dataclass(frozen=True)
class OptimizerSpec:
    """Optimizer of a stage (App. B.1 values via ``paper_mnist`` / ``paper_cifar``)."""

    name: str = "adadelta"
    lr: float = 1.0
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise UsageError(f"--vision-optimizer {self.name!r} is unknown; use adadelta or sgd")
        if not self.lr > 0:
            raise UsageError(f"--lr must be > 0, got {self.lr}")

    @staticmethod
    def paper_mnist() -> OptimizerSpec:
        return OptimizerSpec("adadelta", 1.0)

    @staticmethod
    def paper_cifar() -> OptimizerSpec:
        return OptimizerSpec("sgd", 0.01, momentum=0.9, weight_decay=1e-4)

    def build(self, parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
        if self.name == "adadelta":
            return torch.optim.Adadelta(
                parameters, lr=self.lr, weight_decay=self.weight_decay, foreach=True
            )
        return torch.optim.SGD(
            parameters,
            lr=self.lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            foreach=True,
        )


@dataclass(frozen=True)
class StageTrainConfig:
    """How every stage trains.  ``augment_fill``: padded-border value per channel for the crop
    augmentation; None pads with 0, a black pixel (the learner normalises its inputs itself,
    after augmentation, as a torchvision pipeline would).  ``amp``: mixed precision of the
    forward passes, off, fp16 (CUDA only) or bf16."""

    epochs: int = 100
    batch_size: int = 128
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec.paper_mnist)
    augment: bool = False
    augment_fill: tuple[float, ...] | None = None
    eval_batch_size: int = 1024
    amp: str = "off"

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise UsageError(f"--epochs-per-stage must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.amp not in AMP_MODES:
            raise UsageError(
                f"--vision-amp {self.amp!r} is unknown; use one of {', '.join(AMP_MODES)}"
            )


@dataclass
class StageResult:
    """What training one stage did.  ``valid_losses[e][g]``: group g after epoch e (0 = start)."""

    epochs: int
    best_epoch: list[int]
    best_valid_loss: list[float]
    valid_losses: list[list[float]]
    train_examples: int
    flops: float
    wall_time: float


def _snapshot(module: nn.Module) -> dict[str, Tensor]:
    return {key: value.detach().clone() for key, value in module.state_dict().items()}


def _keep_group(best: dict[str, Tensor], module: nn.Module, group: int, groups: int) -> None:
    """Copy member ``group`` of every (member-first) tensor into ``best``."""
    for key, value in module.state_dict().items():
        if groups == 1:
            best[key] = value.detach().clone()
        else:
            best[key][group] = value[group]


def _loss(logits: Tensor, target: Tensor) -> Tensor:
    """Training loss of (G, B, C) logits: one group's mean, or the sum over groups of each
    group's mean, so independent members get exactly the gradient they would get alone."""
    if logits.shape[0] == 1:
        return F.cross_entropy(logits[0], target)
    target = target.expand(logits.shape[0], -1) if target.dim() == 1 else target
    return F.cross_entropy(logits.flatten(0, 1), target.flatten()) * logits.shape[0]


def _train_epoch(
    learner: Learner,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    train_x: Tensor,
    train_y: Tensor,
    config: StageTrainConfig,
    generator: torch.Generator,
    fill: Tensor | None,
) -> Tensor:
    """One pass over the training tensors; returns the example-weighted loss sum, left on the
    device (reading it would stall the host once per mini-batch)."""
    device = learner.device
    cast = autocast(config.amp, device)
    members = learner.independent_members
    n = train_x.shape[0]
    order = (
        torch.stack([torch.randperm(n, generator=generator) for _ in range(members)])
        if members
        else torch.randperm(n, generator=generator)
    )
    order = to_device(order, train_x.device)  # drawn on the CPU, indexes the data where it is
    running = torch.zeros((), device=device)
    for start in range(0, n, config.batch_size):
        index = order[..., start : start + config.batch_size]  # (B,) or (N, B)
        xb, yb = to_device(train_x[index], device), to_device(train_y[index], device)
        if config.augment:
            xb = random_crop_flip(xb.flatten(0, xb.dim() - 4), generator, fill=fill).view(
                xb.shape
            )
        with cast:
            logits = learner.train_logits(xb, per_member=bool(members))  # (G, B, C)
        loss = _loss(upcast(logits), yb)  # float32 outside autocast
        optimizer_step(loss, optimizer, scaler)
        running += loss.detach() * index.shape[-1]
    return running


def train_stage(
    learner: Learner,
    train_x: Tensor,
    train_y: Tensor,
    valid_x: Tensor,
    valid_y: Tensor,
    config: StageTrainConfig,
    seed: int,
    progress: Callable[[int, float, list[float]], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    stage: int | None = None,
) -> StageResult:
    """Train ``learner`` for one stage and restore its best-validation epoch (see module doc).

    ``should_stop`` is asked after every epoch but the last (a finished stage is worth keeping:
    the caller checks again before the next one).  When it answers True the learner gets the
    best parameters seen so far, so it stays usable, and ``Preempted`` is raised; nothing of the
    stage is saved and it reruns from its beginning.  ``stage`` only names it in that message.
    """
    if train_x.shape[0] == 0:
        raise UsageError(
            "a stage has no training examples; use fewer mega-batches (--num-megabatches)"
        )
    if config.augment and train_x.dim() != 4:
        raise UsageError(
            "crop/flip augmentation needs image inputs (N, C, H, W); "
            "drop --augment for feature vectors"
        )
    device = learner.device
    check_amp(config.amp, device)
    started = time.perf_counter()
    module = learner.trainable()
    optimizer = config.optimizer.build([p for p in module.parameters() if p.requires_grad])
    scaler = torch.amp.GradScaler(device.type) if config.amp == "fp16" else None
    generator = torch.Generator().manual_seed(seed)  # CPU: the same draws on every device
    fill = (
        torch.tensor(config.augment_fill, device=device)
        if config.augment_fill is not None
        else None
    )
    has_valid = valid_x.shape[0] > 0
    curve: list[list[float]] = []
    best = _snapshot(module)
    groups = learner.selection_groups
    if has_valid:
        best_loss = validation_losses(
            learner, valid_x, valid_y, config.eval_batch_size, config.amp
        ).tolist()
        curve.append(list(best_loss))
    else:
        best_loss = [float("inf")] * groups
    best_epoch = [0] * groups
    n = train_x.shape[0]
    for epoch in range(1, config.epochs + 1):
        module.train()
        running = _train_epoch(
            learner, optimizer, scaler, train_x, train_y, config, generator, fill
        )
        if has_valid:
            losses = validation_losses(
                learner, valid_x, valid_y, config.eval_batch_size, config.amp
            ).tolist()  # the epoch's one read of a device value
            curve.append(losses)
            for group in range(groups):
                if losses[group] < best_loss[group]:
                    best_loss[group] = losses[group]
                    best_epoch[group] = epoch
                    _keep_group(best, module, group, groups)
        else:  # no validation data: keep the last epoch
            best = _snapshot(module)
            best_epoch = [epoch] * groups
        if progress is not None:
            progress(epoch, float(running) / n, curve[-1] if curve else [])
        if should_stop is not None and epoch < config.epochs and should_stop():
            module.load_state_dict(best)
            where = f"stage {stage}" if stage is not None else "a stage"
            raise Preempted(
                f"preempted in {where} at epoch {epoch}: the stage restarts from its beginning; "
                "run the same command to continue"
            )
    module.load_state_dict(best)
    macs = learner.train_macs_per_example()
    examples = n * config.epochs
    # macs covers every member (an Ens step runs all N on one example each).
    flops = training_flops(macs, examples) + inference_flops(macs, valid_x.shape[0] * len(curve))
    return StageResult(
        epochs=config.epochs,
        best_epoch=best_epoch,
        best_valid_loss=list(best_loss),
        valid_losses=curve,
        train_examples=examples,
        flops=flops,
        wall_time=time.perf_counter() - started,
    )
