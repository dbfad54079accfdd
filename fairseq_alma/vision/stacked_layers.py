"""Layers holding N independent copies ("members") of their weights, run as one operation.

Why: Ens and UMix (§4.1, N = 5) must not cost N times one model's wall time on small models,
where per-op overhead dominates.  A member dimension in front of every tensor turns N small
matmuls into one batched matmul and N convolutions into one grouped convolution.  gMoE experts
(App. A) reuse the same layers: E experts applied to the same input are E members with a shared
input.  Every parameter and buffer has the member dimension first, so one member can be copied,
selected or snapshotted with ``tensor[n]`` (best-epoch selection per member, expert splits).

Each layer also reports its multiply-accumulates for a call (``forward_macs``), which
``flops.count_forward_macs`` uses for Comp and inference cost (§3.1, Eq. 2).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def uniform_init(shape: tuple[int, ...], fan_in: int, generator: torch.Generator | None) -> Tensor:
    """PyTorch's default Linear/Conv init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), from a generator."""
    bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


class StackedLinear(nn.Module):
    """N Linear layers: ``(B, in)`` shared or ``(N, B, in)`` per member -> ``(N, B, out)``."""

    def __init__(
        self,
        members: int,
        in_features: int,
        out_features: int,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            uniform_init((members, in_features, out_features), in_features, generator)
        )
        self.bias = nn.Parameter(uniform_init((members, out_features), in_features, generator))

    @property
    def members(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        members, in_features, out_features = self.weight.shape
        if x.dim() == 3:  # one input per member: a batched matmul
            return torch.baddbmm(self.bias.unsqueeze(1), x, self.weight)  # (N, B, out)
        if members == 1:
            return torch.addmm(self.bias[0], x, self.weight[0]).unsqueeze(0)  # (1, B, out)
        # Shared input: one GEMM against all members' weights side by side, bias fused.
        flat = self.weight.transpose(0, 1).reshape(in_features, members * out_features)
        out = torch.addmm(self.bias.reshape(-1), x, flat)  # (B, N*out)
        return out.view(x.shape[0], members, out_features).transpose(0, 1)  # (N, B, out)

    def forward_member(self, x: Tensor, member: int) -> Tensor:
        """Only member ``member`` on ``(B, in)`` -> ``(B, out)`` (hard-gated experts)."""
        return torch.addmm(self.bias[member], x, self.weight[member])

    def forward_macs(self, inputs: tuple, output: Tensor) -> int:
        members, in_features, out_features = self.weight.shape
        return members * output.shape[1] * in_features * out_features


class StackedConv2d(nn.Module):
    """N 3x3 'same' convolutions without bias (batch norm follows), channels member-major.

    Input ``(B, in, H, W)`` is shared by all members; ``(B, N*in, H, W)`` holds one input per
    member and runs as a grouped convolution.  Output is ``(B, N*out, H, W)``.
    """

    def __init__(
        self,
        members: int,
        in_channels: int,
        out_channels: int,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        fan_in = in_channels * 9
        self.weight = nn.Parameter(
            uniform_init((members, out_channels, in_channels, 3, 3), fan_in, generator)
        )

    @property
    def members(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        members, out_channels, in_channels = self.weight.shape[:3]
        groups = 1 if x.shape[1] == in_channels else members
        return F.conv2d(
            x,
            self.weight.reshape(members * out_channels, in_channels, 3, 3),
            padding=1,
            groups=groups,
        )

    def forward_member(self, x: Tensor, member: int) -> Tensor:
        return F.conv2d(x, self.weight[member], padding=1)

    def forward_macs(self, inputs: tuple, output: Tensor) -> int:
        members, _out_channels, in_channels = self.weight.shape[:3]
        per_member_out = output.shape[1] // members
        return (
            members
            * output.shape[0]
            * per_member_out
            * in_channels
            * 9
            * output.shape[2]
            * output.shape[3]
        )


class StackedBatchNorm2d(nn.Module):
    """Batch norm over ``(B, N*C, H, W)`` with per-member ``(N, C)`` affine params and statistics.

    Batch norm is per channel, so stacking members along channels is exactly N separate batch
    norms.  No ``num_batches_tracked`` (momentum is fixed), keeping every tensor member-first.
    """

    def __init__(
        self, members: int, channels: int, momentum: float = 0.1, eps: float = 1e-5
    ) -> None:
        super().__init__()
        self.momentum = momentum
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(members, channels))
        self.bias = nn.Parameter(torch.zeros(members, channels))
        self.register_buffer("running_mean", torch.zeros(members, channels))
        self.register_buffer("running_var", torch.ones(members, channels))

    @property
    def members(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        # .view(-1) of the (N, C) buffers are views: F.batch_norm's in-place running-stat update
        # lands in the member-first buffers.
        return F.batch_norm(
            x,
            self.running_mean.view(-1),
            self.running_var.view(-1),
            self.weight.view(-1),
            self.bias.view(-1),
            self.training,
            self.momentum,
            self.eps,
        )

    def forward_member(self, x: Tensor, member: int) -> Tensor:
        return F.batch_norm(
            x,
            self.running_mean[member],
            self.running_var[member],
            self.weight[member],
            self.bias[member],
            self.training,
            self.momentum,
            self.eps,
        )

    def forward_macs(self, inputs: tuple, output: Tensor) -> int:
        return output.numel()  # one multiply-add per element (scale and shift folded)
