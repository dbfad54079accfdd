"""Training of one ALMA stage for a vision learner, and its evaluation (§3, App. B.1).

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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UsageError
from .augment import random_crop_flip
from .flops import inference_flops, training_flops
from .learners import Learner

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
    augmentation (the normalised black pixel, ``-mean/std``); None pads with 0."""

    epochs: int = 100
    batch_size: int = 128
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec.paper_mnist)
    augment: bool = False
    augment_fill: tuple[float, ...] | None = None
    eval_batch_size: int = 1024

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise UsageError(f"--epochs-per-stage must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {self.batch_size}")


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


def validation_losses(learner: Learner, x: Tensor, y: Tensor, batch_size: int) -> Tensor:
    """(G,): mean cross-entropy of each selection group of ``learner.train_logits`` on (x, y)."""
    module = learner.trainable()
    was_training = module.training
    module.eval()
    total = None
    with torch.no_grad():
        for start in range(0, x.shape[0], batch_size):
            logits = learner.train_logits(x[start : start + batch_size])  # (G, B, C)
            target = y[start : start + batch_size].expand(logits.shape[0], -1)
            losses = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
            part = losses.view(logits.shape[0], -1).double().sum(dim=1)
            total = part if total is None else total + part
    module.train(was_training)
    return total / x.shape[0]


def _snapshot(module: nn.Module) -> dict[str, Tensor]:
    return {key: value.detach().clone() for key, value in module.state_dict().items()}


def _keep_group(best: dict[str, Tensor], module: nn.Module, group: int, groups: int) -> None:
    """Copy member ``group`` of every (member-first) tensor into ``best``."""
    for key, value in module.state_dict().items():
        if groups == 1:
            best[key] = value.detach().clone()
        else:
            best[key][group] = value[group]


def train_stage(
    learner: Learner,
    train_x: Tensor,
    train_y: Tensor,
    valid_x: Tensor,
    valid_y: Tensor,
    config: StageTrainConfig,
    seed: int,
    progress: Callable[[int, float, list[float]], None] | None = None,
) -> StageResult:
    """Train ``learner`` for one stage and restore its best-validation epoch (see module doc)."""
    if train_x.shape[0] == 0:
        raise UsageError(
            "a stage has no training examples; use fewer mega-batches (--num-megabatches)"
        )
    if config.augment and train_x.dim() != 4:
        raise UsageError(
            "crop/flip augmentation needs image inputs (N, C, H, W); "
            "drop --augment for feature vectors"
        )
    started = time.perf_counter()
    module = learner.trainable()
    optimizer = config.optimizer.build([p for p in module.parameters() if p.requires_grad])
    generator = torch.Generator().manual_seed(seed)
    fill = torch.tensor(config.augment_fill) if config.augment_fill is not None else None
    members = learner.independent_members
    has_valid = valid_x.shape[0] > 0
    curve: list[list[float]] = []
    best = _snapshot(module)
    groups = learner.selection_groups
    if has_valid:
        best_loss = validation_losses(learner, valid_x, valid_y, config.eval_batch_size)
        curve.append(best_loss.tolist())
    else:
        best_loss = torch.full((groups,), float("inf"), dtype=torch.float64)
    best_epoch = [0] * groups
    n = train_x.shape[0]
    for epoch in range(1, config.epochs + 1):
        module.train()
        order = (
            torch.stack([torch.randperm(n, generator=generator) for _ in range(members)])
            if members
            else torch.randperm(n, generator=generator)
        )
        running = torch.zeros(())
        for start in range(0, n, config.batch_size):
            index = order[..., start : start + config.batch_size]  # (B,) or (N, B)
            xb, yb = train_x[index], train_y[index]
            if config.augment:
                xb = random_crop_flip(xb.flatten(0, xb.dim() - 4), generator, fill=fill).view(
                    xb.shape
                )
            logits = learner.train_logits(xb, per_member=bool(members))  # (G, B, C)
            if logits.shape[0] == 1:
                loss = F.cross_entropy(logits[0], yb)
            else:
                # Sum over groups of each group's mean loss: independent members get exactly
                # the gradient they would get alone.
                target = yb.expand(logits.shape[0], -1) if yb.dim() == 1 else yb
                loss = F.cross_entropy(logits.flatten(0, 1), target.flatten()) * logits.shape[0]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            running += loss.detach() * index.shape[-1]
        if has_valid:
            losses = validation_losses(learner, valid_x, valid_y, config.eval_batch_size)
            curve.append(losses.tolist())
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
    module.load_state_dict(best)
    macs = learner.train_macs_per_example()
    examples = n * config.epochs
    # macs covers every member (an Ens step runs all N on one example each).
    flops = training_flops(macs, examples) + inference_flops(macs, valid_x.shape[0] * len(curve))
    return StageResult(
        epochs=config.epochs,
        best_epoch=best_epoch,
        best_valid_loss=best_loss.tolist(),
        valid_losses=curve,
        train_examples=examples,
        flops=flops,
        wall_time=time.perf_counter() - started,
    )


@dataclass(frozen=True)
class EvalResult:
    """Test error rate (the metric of Eq. 1), mean loss and example count."""

    error: float
    loss: float
    examples: int


def evaluate(learner: Learner, x: Tensor, y: Tensor, batch_size: int = 1024) -> EvalResult:
    """Error of the learner's predictor (the averaged ensemble for Ens/gEns) on (x, y)."""
    was_training = learner.training
    learner.eval()
    wrong, loss = 0, 0.0
    with torch.no_grad():
        for start in range(0, x.shape[0], batch_size):
            log_probs = learner.predict_log_probs(x[start : start + batch_size])
            target = y[start : start + batch_size]
            wrong += int((log_probs.argmax(dim=-1) != target).sum())
            loss += float(F.nll_loss(log_probs, target, reduction="sum"))
    learner.train(was_training)
    return EvalResult(error=wrong / x.shape[0], loss=loss / x.shape[0], examples=x.shape[0])
