"""The two vision backbones of §5, with a member dimension (N = 1 is the single model, SM).

- MLP (MNIST): "a three layer fully connected neural network with ReLU units", two hidden layers
  of width h in 4 … 64 (App. B.1.1).
- Reduced VGG19 (CIFAR-10): VGG19's 16 conv layers and 5 max-pools with batch norm, every conv
  layer with the same channel count c in 4 … 64 (App. B.1.2, the reduced VGG of Firefly, Wu et
  al. 2020), then one linear classifier.

Both return logits ``(N, B, classes)`` for input ``(B, ...)`` shared by the members, or
``(N, B, ...)`` with one input per member (``per_member=True``; Ens members see their own data
order).  Widths are per hidden layer so Firefly (FF) can grow them; ``growable_layers`` tells
the grower which tensors hold each hidden unit's incoming and outgoing weights.  FF also grows
depth: ``residuals`` holds the residual blocks it inserted behind hidden layers (``residual``),
empty for every other learner, whose computation it leaves untouched.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UsageError
from .growable import GrowableLayer, UnitTensor, constant_fill, uniform_fill
from .residual import ResidualChains, ResidualConv, ResidualLinear
from .stacked_layers import StackedBatchNorm2d, StackedConv2d, StackedLinear

VGG19_CONV_LAYERS = 16
VGG19_POOL_AFTER = frozenset({1, 3, 7, 11, 15})  # cfg 64,64,M,128,128,M,256x4,M,512x4,M,512x4,M


class StackedMLP(nn.Module):
    """MLP with hidden widths ``hidden`` (paper: two layers of width h), ReLU, N members."""

    def __init__(
        self,
        in_features: int,
        hidden: Sequence[int],
        num_classes: int,
        members: int = 1,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        sizes = [in_features, *hidden, num_classes]
        self.layers = nn.ModuleList(
            StackedLinear(members, a, b, generator) for a, b in itertools.pairwise(sizes)
        )
        self.residuals = ResidualChains()

    @property
    def members(self) -> int:
        return self.layers[0].members

    @property
    def widths(self) -> list[int]:
        return [layer.weight.shape[2] for layer in self.layers[:-1]]

    @property
    def depth(self) -> int:
        """Layers with weights: hidden layers, inserted residual blocks and the classifier."""
        return len(self.layers) + len(self.residuals)

    def forward(self, x: Tensor, per_member: bool = False) -> Tensor:
        h = x.flatten(2) if per_member else x.flatten(1)  # (N, B, D) or (B, D)
        for index, layer in enumerate(self.layers[:-1]):
            h = self.residuals.run(index, F.relu(layer(h)))  # (N, B, width)
        return self.layers[-1](h)  # (N, B, classes)

    def new_residual(self, after: int, generator: torch.Generator | None) -> ResidualLinear:
        """A residual block for the stream of hidden layer ``after`` (not attached)."""
        return ResidualLinear(self.members, self.widths[after], generator)

    def growable_layers(self) -> list[GrowableLayer]:
        grown = []
        for index, layer in enumerate(self.layers[:-1]):
            fan_in = layer.weight.shape[1]
            block_producers, block_consumers = self.residuals.unit_tensors(index)
            grown.append(
                GrowableLayer(
                    producers=(
                        UnitTensor(layer, "weight", 2, uniform_fill(fan_in)),
                        UnitTensor(layer, "bias", 1, uniform_fill(fan_in)),
                        *block_producers,
                    ),
                    consumers=(*block_consumers, UnitTensor(self.layers[index + 1], "weight", 1)),
                )
            )
        return grown


class StackedVGG(nn.Module):
    """Reduced VGG19 with batch norm: 16 conv(3x3)-BN-ReLU layers, 5 max-pools, linear head."""

    def __init__(
        self,
        in_channels: int,
        image_size: tuple[int, int],
        widths: Sequence[int],
        num_classes: int,
        members: int = 1,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if len(widths) != VGG19_CONV_LAYERS:
            raise ValueError(
                f"the reduced VGG19 has {VGG19_CONV_LAYERS} conv layers, got {len(widths)} widths"
            )
        height, width = image_size
        if height % 32 or width % 32:
            raise UsageError(
                f"the VGG backbone halves the image 5 times and needs sides divisible by 32, got "
                f"{height}x{width}; use --vision-arch mlp for this data set"
            )
        self.spatial = (height // 32) * (width // 32)
        channels = [in_channels, *widths]
        self.convs = nn.ModuleList(
            StackedConv2d(members, a, b, generator) for a, b in itertools.pairwise(channels)
        )
        self.norms = nn.ModuleList(StackedBatchNorm2d(members, c) for c in widths)
        self.classifier = StackedLinear(members, widths[-1] * self.spatial, num_classes, generator)
        self.residuals = ResidualChains()

    @property
    def members(self) -> int:
        return self.convs[0].members

    @property
    def widths(self) -> list[int]:
        return [conv.weight.shape[1] for conv in self.convs]

    @property
    def depth(self) -> int:
        """Layers with weights: conv layers, inserted residual blocks and the classifier."""
        return len(self.convs) + len(self.residuals) + 1

    def forward(self, x: Tensor, per_member: bool = False) -> Tensor:
        if per_member:  # (N, B, C, H, W) -> (B, N*C, H, W): member-major channels, grouped conv
            x = x.transpose(0, 1).flatten(1, 2)
        for index, (conv, norm) in enumerate(zip(self.convs, self.norms)):
            x = F.relu(norm(conv(x)))  # (B, N*c, H, W)
            if index in VGG19_POOL_AFTER:
                x = F.max_pool2d(x, 2)
            x = self.residuals.run(index, x)
        batch = x.shape[0]
        features = x.reshape(batch, self.members, -1).transpose(0, 1)  # (N, B, c*h*w)
        return self.classifier(features)  # (N, B, classes)

    def new_residual(self, after: int, generator: torch.Generator | None) -> ResidualConv:
        """A residual block for conv layer ``after``'s output, after its pooling (ties of the
        max-pool, common among ReLU zeros, would break the block's first-order score)."""
        return ResidualConv(self.members, self.widths[after], generator)

    def growable_layers(self) -> list[GrowableLayer]:
        if self.spatial != 1:
            raise UsageError(
                "Firefly growth of the VGG needs 32x32 inputs (one feature per channel)"
            )
        grown = []
        for index, (conv, norm) in enumerate(zip(self.convs, self.norms)):
            fan_in = conv.weight.shape[2] * 9
            consumer = self.convs[index + 1] if index + 1 < len(self.convs) else self.classifier
            consumer_dim = 2 if index + 1 < len(self.convs) else 1
            block_producers, block_consumers = self.residuals.unit_tensors(index)
            grown.append(
                GrowableLayer(
                    producers=(
                        UnitTensor(conv, "weight", 1, uniform_fill(fan_in)),
                        UnitTensor(norm, "weight", 1, constant_fill(1.0)),
                        UnitTensor(norm, "bias", 1, constant_fill(0.0)),
                        UnitTensor(norm, "running_mean", 1, constant_fill(0.0)),
                        UnitTensor(norm, "running_var", 1, constant_fill(1.0)),
                        *block_producers,
                    ),
                    consumers=(*block_consumers, UnitTensor(consumer, "weight", consumer_dim)),
                )
            )
        return grown


def build_backbone(
    arch: str,
    input_shape: tuple[int, ...],
    width: int,
    num_classes: int,
    members: int,
    generator: torch.Generator | None,
) -> nn.Module:
    """``mlp`` (two hidden layers of ``width``) or ``vgg`` (16 conv layers of ``width``)."""
    if arch == "mlp":
        return StackedMLP(math.prod(input_shape), [width, width], num_classes, members, generator)
    if arch == "vgg":
        if len(input_shape) != 3:
            raise UsageError(
                "--vision-arch vgg needs image inputs (N, C, H, W); use mlp for feature vectors"
            )
        return StackedVGG(
            input_shape[0],
            input_shape[1:],
            [width] * VGG19_CONV_LAYERS,
            num_classes,
            members,
            generator,
        )
    raise UsageError(f"--vision-arch {arch!r} is unknown; use mlp or vgg")
