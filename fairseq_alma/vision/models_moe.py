"""gMoE backbones: the SM architectures with mixture-of-experts layers (§4.2, §5, App. A).

"gMoE also starts off as SM and adds modules (at the first two layers) that have the same size as
the original layer of SM" (§5, MNIST).  Each mixture layer here is a ``MixtureBlock``: E experts
with exactly the shape of the SM layer (Linear+ReLU, or conv+BN+ReLU), combined by a
``TreeGating``.  With one expert it is the SM layer.  Layers outside ``mixture_layers`` stay at
one expert forever.  Soft gating runs all experts as one wide layer; hard gating runs only the
expert each example is routed to and trains the gates with a straight-through estimator
(Bengio et al. 2013): output = h_sel + (p_sel − stopgrad(p_sel))·h_sel, whose value is h_sel
exactly and whose gradient reaches the gates through p_sel.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .models import VGG19_CONV_LAYERS, VGG19_POOL_AFTER
from .moe_tree import TreeGating
from .stacked_layers import StackedBatchNorm2d, StackedConv2d, StackedLinear

GATINGS = ("soft", "hard")
_ROUTED_CHUNK = 128  # bounds the gathered per-example weights at test time


class MixtureBlock(nn.Module):
    """One gMoE layer: ``kind`` is ``linear`` ((B, in) -> (B, out)) or ``conv`` ((B, in, H, W) ->
    (B, out, H, W)); experts are members of stacked layers, so a split copies a slice."""

    def __init__(
        self, kind: str, in_size: int, out_size: int, gating: str, generator: torch.Generator | None
    ) -> None:
        super().__init__()
        if gating not in GATINGS:
            raise ValueError(f"gating must be one of {GATINGS}, got {gating!r}")
        self.kind = kind
        self.gating = gating
        if kind == "linear":
            self.expert_layers = nn.ModuleList([StackedLinear(1, in_size, out_size, generator)])
        else:
            self.expert_layers = nn.ModuleList(
                [StackedConv2d(1, in_size, out_size, generator), StackedBatchNorm2d(1, out_size)]
            )
        self.gate = TreeGating(in_size)
        self.sampler: torch.Generator | None = None  # hard routing samples from it in training
        self.routing_log: list[Tensor] | None = None  # set to [] to record (B, E) routing weights

    @property
    def num_experts(self) -> int:
        return self.gate.num_experts

    def _gate_input(self, x: Tensor) -> Tensor:
        return x if self.kind == "linear" else x.mean(dim=(2, 3))  # conv: global average pool

    def _all_experts(self, x: Tensor) -> Tensor:
        """(E, B, out) or (E, B, out, H, W): every expert on the shared input."""
        if self.kind == "linear":
            # One GEMM per expert (batched), not one wide GEMM: an expert's result then does not
            # depend on how many experts sit beside it, so splits stay bit-exact.
            return F.relu(self.expert_layers[0](x.expand(self.num_experts, -1, -1)))
        conv, norm = self.expert_layers
        out = F.relu(norm(conv(x)))  # (B, E*out, H, W)
        return out.view(out.shape[0], self.num_experts, -1, *out.shape[2:]).transpose(0, 1)

    def _one_expert(self, x: Tensor, expert: int) -> Tensor:
        if self.kind == "linear":
            return F.relu(self.expert_layers[0].forward_member(x, expert))
        conv, norm = self.expert_layers
        return F.relu(norm.forward_member(conv.forward_member(x, expert), expert))

    def _routed(self, x: Tensor, leaf: Tensor) -> Tensor:
        """Test-time hard routing, each example with its own expert's gathered weights.

        Every example is computed alone (a batch of 1-row products), so its result does not
        depend on how many examples share its expert: grouping would let the matmul kernel
        change with the group size and break the bit-exact split guarantee.
        """
        if self.kind == "linear":
            layer = self.expert_layers[0]
            out = torch.baddbmm(layer.bias[leaf].unsqueeze(1), x.unsqueeze(1), layer.weight[leaf])
            return F.relu(out.squeeze(1))  # (B, out)
        conv, norm = self.expert_layers
        batch, channels, height, width = x.shape
        weight = conv.weight[leaf]  # (B, out, in, 3, 3)
        out = F.conv2d(
            x.reshape(1, batch * channels, height, width),
            weight.flatten(0, 1),
            padding=1,
            groups=batch,
        )
        out = out.view(batch, -1, height, width)
        scale = norm.weight[leaf] / torch.sqrt(norm.running_var[leaf] + norm.eps)  # (B, out)
        shift = norm.bias[leaf] - norm.running_mean[leaf] * scale
        return F.relu(out * scale[:, :, None, None] + shift[:, :, None, None])

    def forward(self, x: Tensor) -> Tensor:
        left = self.gate.left_probs(self._gate_input(x))  # (B, internal nodes)
        if self.gating == "soft":
            outputs = self._all_experts(x)
            result = self.gate.combine(left, lambda expert: outputs[expert])
            weights = self.gate.leaf_probs(left) if self.routing_log is not None else None
        else:
            leaf = self.gate.choose_leaf(left, self.sampler, sample=self.training)  # (B,)
            if self.training:  # group examples by expert: batch-norm statistics per expert
                order = torch.argsort(leaf, stable=True)
                # The groups' sizes decide the shapes, so they must reach the host: one read
                # of the counts per layer and step, then contiguous slices of the sorted order.
                counts = torch.bincount(leaf, minlength=self.num_experts).tolist()
                groups = torch.split(order, counts)
                pieces = [
                    self._one_expert(x[group], e) for e, group in enumerate(groups) if counts[e]
                ]
                result = torch.cat(pieces)[torch.argsort(order)]  # back to input order
            else:
                result = torch.cat(
                    [
                        self._routed(x[i : i + _ROUTED_CHUNK], leaf[i : i + _ROUTED_CHUNK])
                        for i in range(0, x.shape[0], _ROUTED_CHUNK)
                    ]
                )
            chosen = self.gate.leaf_probs(left).gather(1, leaf[:, None]).squeeze(1)  # (B,)
            gain = (chosen - chosen.detach()).view(-1, *([1] * (result.dim() - 1)))
            result = result + gain * result  # value: exactly h_sel; gradient: reaches the gates
            weights = (
                F.one_hot(leaf, self.num_experts).float() if self.routing_log is not None else None
            )
        if weights is not None:
            self.routing_log.append(weights.detach())
        return result

    def split_expert(self, expert: int, generator: torch.Generator | None) -> int:
        """Copy expert ``expert`` into a new expert under a new gate (Eq. 3); returns its index."""
        new_expert = self.num_experts
        for layer in self.expert_layers:
            for name, tensor in list(layer.named_parameters(recurse=False)) + list(
                layer.named_buffers(recurse=False)
            ):
                grown = torch.cat([tensor.detach(), tensor.detach()[expert : expert + 1]])
                setattr(
                    layer, name, nn.Parameter(grown) if isinstance(tensor, nn.Parameter) else grown
                )
        self.gate.split(expert, new_expert, generator)
        return new_expert

    def forward_macs(self, inputs: tuple, output: Tensor) -> int:
        """Multiply-adds of this call: every expert (soft) or one per example (hard), plus gates."""
        x = inputs[0]
        batch = x.shape[0]
        experts_run = self.num_experts if self.gating == "soft" else 1
        if self.kind == "linear":
            weight = self.expert_layers[0].weight
            per_expert = weight.shape[1] * weight.shape[2]
        else:
            weight = self.expert_layers[0].weight
            spatial = output.shape[2] * output.shape[3]
            per_expert = weight.shape[1] * weight.shape[2] * 9 * spatial + weight.shape[1] * spatial
        gates = self.gate.num_internal * self.gate.gate_features
        combine = (
            (self.num_experts - 1) * math.prod(output.shape[1:]) if self.gating == "soft" else 0
        )
        return batch * (experts_run * per_expert + gates + combine)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Resize expert tensors to the saved expert count first (grown checkpoints)."""
        for index, layer in enumerate(self.expert_layers):
            for name, tensor in list(layer.named_parameters(recurse=False)) + list(
                layer.named_buffers(recurse=False)
            ):
                saved = state_dict.get(f"{prefix}expert_layers.{index}.{name}")
                if saved is not None and saved.shape != tensor.shape:
                    fresh = torch.empty(saved.shape, dtype=tensor.dtype, device=tensor.device)
                    setattr(
                        layer,
                        name,
                        nn.Parameter(fresh) if isinstance(tensor, nn.Parameter) else fresh,
                    )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def mixture_layer_count(arch: str) -> int:
    """Layers a gMoE backbone has (what ``--moe-mixture-layers`` may name): the MLP's two
    hidden layers, or reduced VGG19's convolutions."""
    return 2 if arch == "mlp" else VGG19_CONV_LAYERS


class MoEBackbone(nn.Module):
    """MLP or reduced VGG19 whose layers are MixtureBlocks; returns logits (1, B, classes)."""

    def __init__(
        self,
        arch: str,
        input_shape: tuple[int, ...],
        width: int,
        num_classes: int,
        gating: str,
        mixture_layers: Sequence[int],
        generator: torch.Generator | None,
    ) -> None:
        super().__init__()
        self.arch = arch
        if arch == "mlp":
            sizes = [math.prod(input_shape), width, width]
            self.blocks = nn.ModuleList(
                MixtureBlock("linear", a, b, gating, generator)
                for a, b in itertools.pairwise(sizes)
            )
            head_in = width
        else:
            sizes = [input_shape[0]] + [width] * VGG19_CONV_LAYERS
            self.blocks = nn.ModuleList(
                MixtureBlock("conv", a, b, gating, generator) for a, b in itertools.pairwise(sizes)
            )
            head_in = width * (input_shape[1] // 32) * (input_shape[2] // 32)
        bad = [i for i in mixture_layers if not 0 <= i < len(self.blocks)]
        if bad:
            raise ValueError(
                f"mixture layers {bad} out of range: this backbone has {len(self.blocks)} layers"
            )
        self.mixture_layers = tuple(sorted(set(mixture_layers)))
        self.head = StackedLinear(1, head_in, num_classes, generator)

    def forward(self, x: Tensor, per_member: bool = False) -> Tensor:
        h = x.flatten(1) if self.arch == "mlp" else x
        for index, block in enumerate(self.blocks):
            h = block(h)
            if self.arch == "vgg" and index in VGG19_POOL_AFTER:
                h = F.max_pool2d(h, 2)
        return self.head(h.flatten(1))  # (1, B, classes)

    def growing_blocks(self) -> list[MixtureBlock]:
        return [self.blocks[i] for i in self.mixture_layers]
