"""Firefly's new layers: residual blocks that start with no effect (FF, §4.2; Wu et al. 2020).

Firefly grows depth by inserting a layer h behind hidden layer p as ``z -> z + ε·h(z)`` and
keeping the candidates that decrease the loss fastest to first order.  Here
``h(z) = scale ⊙ φ(z)`` with ``φ`` a fresh layer of the backbone's own kind (Linear+ReLU for the
MLP, 3x3 conv+BN+ReLU for the VGG, drawn like a new layer) and ``scale`` one factor per unit,
zero at insertion: the network computes exactly the same function, in training and in eval
mode (the new batch norm is multiplied by zero), and the loss is linear in ``scale``, so its
gradient there is the exact first-order effect of the layer (a near-identity ``W = I`` layer
would sit on ReLU's kink at every inactive unit instead).  The grower then sets
``scale = -ε·g/|g|``.

A block maps the stream of hidden layer p to itself, so its units *are* layer p's units: when
Firefly widens layer p, every block behind it widens with it (``unit_tensors``): a split unit's
block row and scale are copied and its block inputs halved like any outgoing weight.

Cost (``flops``): a block counts as its layer (and batch norm); the scale is not a separate
multiply, because ``s ⊙ relu(u) = sign(s) ⊙ relu(|s| ⊙ u)`` folds ``|s|`` into the layer's
weights and leaves a signed addition, like the additions and ReLUs the counts ignore.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .growable import UnitTensor, constant_fill, uniform_fill
from .stacked_layers import StackedBatchNorm2d, StackedConv2d, StackedLinear


def _zeros(shape: tuple[int, ...], generator: torch.Generator | None) -> Tensor:
    """A new unit's scale: 0, so the unit's residual adds nothing until it is trained."""
    return torch.zeros(shape)


class ResidualLinear(nn.Module):
    """``h + scale ⊙ relu(W h + b)`` on the MLP's hidden stream ``(N, B, width)``."""

    def __init__(self, members: int, width: int, generator: torch.Generator | None) -> None:
        super().__init__()
        self.layer = StackedLinear(members, width, width, generator)
        self.scale = nn.Parameter(torch.zeros(members, width))

    def forward(self, h: Tensor) -> Tensor:
        return h + self.scale.unsqueeze(1) * F.relu(self.layer(h))  # (N, B, width)

    def unit_tensors(self) -> tuple[list[UnitTensor], list[UnitTensor]]:
        """(tensors indexed by the stream's units as outputs, ... as inputs)."""
        fan_in = self.layer.weight.shape[1]
        producers = [
            UnitTensor(self.layer, "weight", 2, uniform_fill(fan_in)),
            UnitTensor(self.layer, "bias", 1, uniform_fill(fan_in)),
            UnitTensor(self, "scale", 1, _zeros),
        ]
        return producers, [UnitTensor(self.layer, "weight", 1)]


class ResidualConv(nn.Module):
    """``h + scale ⊙ relu(BN(conv3x3(h)))`` on the VGG's stream ``(B, N*c, H, W)``."""

    def __init__(self, members: int, channels: int, generator: torch.Generator | None) -> None:
        super().__init__()
        self.conv = StackedConv2d(members, channels, channels, generator)
        self.norm = StackedBatchNorm2d(members, channels)
        self.scale = nn.Parameter(torch.zeros(members, channels))

    def forward(self, h: Tensor) -> Tensor:
        return h + self.scale.reshape(1, -1, 1, 1) * F.relu(self.norm(self.conv(h)))

    def unit_tensors(self) -> tuple[list[UnitTensor], list[UnitTensor]]:
        fan_in = self.conv.weight.shape[2] * 9
        producers = [
            UnitTensor(self.conv, "weight", 1, uniform_fill(fan_in)),
            UnitTensor(self.norm, "weight", 1, constant_fill(1.0)),
            UnitTensor(self.norm, "bias", 1, constant_fill(0.0)),
            UnitTensor(self.norm, "running_mean", 1, constant_fill(0.0)),
            UnitTensor(self.norm, "running_var", 1, constant_fill(1.0)),
            UnitTensor(self, "scale", 1, _zeros),
        ]
        return producers, [UnitTensor(self.conv, "weight", 2)]


class ResidualChains(nn.Module):
    """The residual blocks behind a backbone's hidden layers, in insertion order.

    ``after[k]`` is the hidden layer block k sits behind; blocks behind the same layer run in
    the order they were inserted.  Empty for every learner but FF, where it holds the layers
    Firefly added (``FireflyLearner`` keeps ``after`` in its checkpoint to rebuild them)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList()
        self.after: list[int] = []

    def __len__(self) -> int:
        return len(self.blocks)

    def behind(self, layer: int) -> list[nn.Module]:
        return [block for block, p in zip(self.blocks, self.after) if p == layer]

    def attach(self, layer: int, block: nn.Module) -> None:
        self.blocks.append(block)
        self.after.append(layer)

    def run(self, layer: int, h: Tensor) -> Tensor:
        """Hidden layer ``layer``'s output through the blocks behind it."""
        for block in self.behind(layer):
            h = block(h)
        return h

    def unit_tensors(self, layer: int) -> tuple[list[UnitTensor], list[UnitTensor]]:
        """The blocks' tensors indexed by hidden layer ``layer``'s units."""
        producers, consumers = [], []
        for block in self.behind(layer):
            block_producers, block_consumers = block.unit_tensors()
            producers += block_producers
            consumers += block_consumers
        return producers, consumers
