"""Input normalisation from the mega-batches that have arrived (App. B.1 with §3's rule).

App. B.1: "We apply data normalization for each dataset considered."  §3: "the learner cannot
have access to future mega-batches".  Statistics of the whole training set would leak the
mega-batches of later arrivals into the first stages (a stream whose late data drifts would
change how stage 1 sees its inputs), so the statistics a stage trains with are those of the
mega-batches arrived by then (their training and validation parts: the whole mega-batch has
arrived).  They live in the learner (``InputNormalizer``, a pair of buffers applied at the start
of every forward pass), so the model that answers the evaluation after arrival t uses the
statistics of its own time, its checkpoint carries them, and a gEns member keeps those of the
stage it was trained in.  Before any data (arrival 0) the normaliser is the identity.

Images get one mean/std per channel (CIFAR's RGB channels differ); feature vectors one global
mean/std, which keeps constant pixels (MNIST borders) constant instead of dividing by 0.
Sums are taken once per mega-batch in float64, so the statistics after any arrival cost a sum
of B small vectors, not a pass over everything arrived.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

_SUM_CHUNK = 2048  # examples per float64 chunk (CIFAR: 50 MB)


@dataclass(frozen=True)
class MomentSums:
    """Per channel (images) or overall (features): how many values, their sum and sum of squares
    (float64, on the CPU)."""

    count: int
    total: Tensor
    squares: Tensor

    def __add__(self, other: MomentSums) -> MomentSums:
        return MomentSums(self.count + other.count, self.total + other.total,
                          self.squares + other.squares)


def moment_sums(x: Tensor, per_channel: bool) -> MomentSums:
    """Sums over the examples of ``x`` ((N, C, H, W) per channel, else all values together)."""
    channels = x.shape[1] if per_channel else 1
    total = torch.zeros(channels, dtype=torch.float64, device=x.device)
    squares = torch.zeros_like(total)
    for start in range(0, x.shape[0], _SUM_CHUNK):
        chunk = x[start : start + _SUM_CHUNK].double()
        # (C, values): channel-major for images, one row for feature vectors
        values = chunk.transpose(0, 1) if per_channel else chunk
        values = values.reshape(channels, -1)
        total += values.sum(dim=1)
        squares += values.square().sum(dim=1)
    count = x[:1].numel() // channels * x.shape[0]
    return MomentSums(count, total.cpu(), squares.cpu())


def mean_and_std(sums: MomentSums) -> tuple[Tensor, Tensor]:
    """Mean and (unbiased) standard deviation; a constant input gets std 1, not a division by 0."""
    mean = sums.total / sums.count
    if sums.count < 2:
        return mean, torch.ones_like(mean)
    variance = ((sums.squares - sums.count * mean.square()) / (sums.count - 1)).clamp(min=0.0)
    std = variance.sqrt()
    return mean, torch.where(std > 0, std, torch.ones_like(std))


class ArrivedStatistics:
    """Mean and std of the first ``arrival`` mega-batches of a stream (module doc)."""

    def __init__(self, x: Tensor, megabatches: Sequence[np.ndarray], per_channel: bool) -> None:
        """``megabatches[i]``: indices into ``x`` of mega-batch i (training and validation)."""
        self._sums = []
        for indices in megabatches:
            index = torch.from_numpy(np.asarray(indices, dtype=np.int64)).to(x.device)
            self._sums.append(moment_sums(x[index], per_channel))

    def after(self, arrival: int) -> tuple[Tensor, Tensor]:
        """Statistics of mega-batches 0 … ``arrival`` - 1 (those arrived by then)."""
        if not 1 <= arrival <= len(self._sums):
            raise ValueError(f"arrival {arrival} is outside the stream (1 … {len(self._sums)})")
        total = self._sums[0]
        for sums in self._sums[1:arrival]:
            total = total + sums
        return mean_and_std(total)


class InputNormalizer(nn.Module):
    """``(x - mean) / std`` with the statistics of the learner's time (identity until set).

    Shapes broadcast over any leading dimensions: ``(C, 1, 1)`` for images ``(..., C, H, W)``,
    ``(1,)`` for feature vectors."""

    def __init__(self, input_shape: tuple[int, ...]) -> None:
        super().__init__()
        shape = (input_shape[0], 1, 1) if len(input_shape) == 3 else (1,)
        self.register_buffer("mean", torch.zeros(shape))
        self.register_buffer("std", torch.ones(shape))

    def set_statistics(self, mean: Tensor, std: Tensor) -> None:
        """Adopt new statistics, kept in the buffers' own device and dtype."""
        with torch.no_grad():
            self.mean.copy_(mean.reshape(self.mean.shape))
            self.std.copy_(std.reshape(self.std.shape))

    def forward(self, x: Tensor) -> Tensor:
        return (x - self.mean) / self.std
