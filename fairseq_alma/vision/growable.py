"""What Firefly (FF, §4.2) grows: the tensors indexed by one hidden layer's units.

A backbone describes each hidden layer as a ``GrowableLayer``: the tensors holding its units'
incoming weights and per-unit values (``producers``) and those holding their outgoing weights
(``consumers``).  The width grower (``firefly``) only needs this description to add, split or
score units, whatever the layer kind (Linear, conv + batch norm, the residual blocks behind a
layer).  Fresh values come from CPU generators (the same draws on every device).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .stacked_layers import uniform_init

Fill = Callable[[tuple[int, ...], torch.Generator | None], Tensor]


@dataclass(frozen=True)
class UnitTensor:
    """A tensor whose dimension ``dim`` indexes the hidden units of one layer.

    ``init(shape, generator)`` returns fresh values of ``shape`` for new units (None for
    outgoing weights, which the grower sets itself).
    """

    module: nn.Module
    name: str
    dim: int
    init: Fill | None = None

    @property
    def tensor(self) -> Tensor:
        return getattr(self.module, self.name)


@dataclass(frozen=True)
class GrowableLayer:
    """Incoming (``producers``) and outgoing (``consumers``) tensors of one hidden layer."""

    producers: tuple[UnitTensor, ...]
    consumers: tuple[UnitTensor, ...]

    @property
    def width(self) -> int:
        first = self.producers[0]
        return first.tensor.shape[first.dim]


def uniform_fill(fan_in: int) -> Fill:
    """New units' incoming weights, drawn like a fresh layer's (PyTorch's default init)."""
    return lambda shape, generator: uniform_init(shape, fan_in, generator)


def constant_fill(value: float) -> Fill:
    """New units' batch-norm values: the fresh layer's constants."""
    return lambda shape, generator: torch.full(shape, value)
