"""Tree-structured gating for the growing mixture of experts (gMoE, §4.2, App. A, Fig. 6).

A layer's experts are the leaves of a binary tree; internal node k holds a linear gate whose
sigmoid a_k(z) is the probability of going left.  An expert's gate value is the product of the
probabilities on its root-to-leaf path, so Σ_leaves g(leaf|z) = 1 at every depth.

Splitting the losing expert s (App. A, Eq. 3) turns leaf s into an internal node with a new,
randomly initialised gate and two children holding identical parameters.  To make the split
leave outputs *bit for bit* unchanged (not just up to rounding), a node combines its children as

    out = right + a * (left - right)          (= a·left + (1-a)·right)

which for identical children is ``right + a * 0 = right`` exactly, in any floating point format.
Hard gating follows one branch per node (sampled in training, the more probable one at test
time), which after a split reaches one of two identical experts: again the same output.

Tree encoding (a buffer, so it is saved in checkpoints): ``children[k] = (left, right)`` with a
code >= 0 for internal node k and ``-(e + 1)`` for expert e.  Node 0 is the root; with no
internal node the root is expert 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .stacked_layers import uniform_init


def _leaf(code: int) -> int:
    return -code - 1


class TreeGating(nn.Module):
    """Binary gating tree over ``num_experts = internal nodes + 1`` experts."""

    def __init__(self, gate_features: int) -> None:
        super().__init__()
        self.gate_features = gate_features
        self.weight = nn.Parameter(torch.empty(0, gate_features))
        self.bias = nn.Parameter(torch.empty(0))
        self.register_buffer("children_codes", torch.empty(0, 2, dtype=torch.long))

    @property
    def num_internal(self) -> int:
        return self.children_codes.shape[0]

    @property
    def num_experts(self) -> int:
        return self.num_internal + 1

    def _codes(self) -> list[tuple[int, int]]:
        return [tuple(row) for row in self.children_codes.tolist()]

    def left_probs(self, gate_input: Tensor) -> Tensor:
        """(B, gate_features) -> (B, internal nodes): probability of the left child per node."""
        return torch.sigmoid(gate_input @ self.weight.t() + self.bias)

    def combine(self, left_probs: Tensor, expert_output: Callable[[int], Tensor]) -> Tensor:
        """Σ_leaves g(leaf|z) h_leaf(z), evaluated bottom-up as right + a·(left − right)."""
        codes = self._codes()
        if not codes:
            return expert_output(0)

        def node(code: int) -> Tensor:
            if code < 0:
                return expert_output(_leaf(code))
            left, right = node(codes[code][0]), node(codes[code][1])
            a = left_probs[:, code].view(-1, *([1] * (left.dim() - 1)))
            return right + a * (left - right)

        return node(0)

    def leaf_probs(self, left_probs: Tensor) -> Tensor:
        """(B, experts): the gate value of every expert (product along its path)."""
        batch = left_probs.shape[0]
        probs = [None] * self.num_experts
        codes = self._codes()
        if not codes:
            return left_probs.new_ones(batch, 1)
        stack = [(0, left_probs.new_ones(batch))]
        while stack:
            code, mass = stack.pop()
            if code < 0:
                probs[_leaf(code)] = mass
                continue
            a = left_probs[:, code]
            stack.append((codes[code][0], mass * a))
            stack.append((codes[code][1], mass * (1 - a)))
        return torch.stack(probs, dim=1)

    def choose_leaf(
        self, left_probs: Tensor, generator: torch.Generator | None, sample: bool
    ) -> Tensor:
        """(B,) expert index: walk from the root, at each node sampling (training) or taking
        the more probable branch (test time)."""
        batch = left_probs.shape[0]
        codes = self.children_codes
        if codes.shape[0] == 0:
            return torch.zeros(batch, dtype=torch.long)
        if sample:
            go_left = torch.rand(left_probs.shape, generator=generator) < left_probs.detach()
        else:
            go_left = left_probs.detach() >= 0.5
        current = torch.zeros(batch, dtype=torch.long)
        rows = torch.arange(batch)
        for _ in range(codes.shape[0]):  # depth <= number of internal nodes
            internal = current >= 0
            if not internal.any():
                break
            node = current.clamp(min=0)
            step = torch.where(go_left[rows, node], codes[node, 0], codes[node, 1])
            current = torch.where(internal, step, current)
        return -current - 1

    def split(self, expert: int, new_expert: int, generator: torch.Generator | None) -> None:
        """Replace leaf ``expert`` by a node with children (``expert``, ``new_expert``) and a new
        gate drawn like a fresh Linear layer (App. A: "initialized at random")."""
        codes = self.children_codes.clone()
        new_node = codes.shape[0]
        leaf_code = -(expert + 1)
        if new_node > 0:
            position = (codes == leaf_code).nonzero()
            if position.shape[0] != 1:
                raise ValueError(f"expert {expert} is not a leaf of this tree")
            codes[position[0, 0], position[0, 1]] = new_node
        row = torch.tensor([[leaf_code, -(new_expert + 1)]])
        self.children_codes = torch.cat([codes, row])
        fresh_weight = uniform_init((1, self.gate_features), self.gate_features, generator)
        fresh_bias = uniform_init((1,), self.gate_features, generator)
        self.weight = nn.Parameter(torch.cat([self.weight.detach(), fresh_weight]))
        self.bias = nn.Parameter(torch.cat([self.bias.detach(), fresh_bias]))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Resize to the saved tree first, so a grown gMoE checkpoint loads into a fresh model."""
        for name in ("weight", "bias", "children_codes"):
            saved = state_dict.get(prefix + name)
            current = getattr(self, name)
            if saved is not None and saved.shape != current.shape:
                resized = torch.empty_like(saved)
                setattr(
                    self,
                    name,
                    nn.Parameter(resized) if isinstance(current, nn.Parameter) else resized,
                )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
