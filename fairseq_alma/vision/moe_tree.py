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
internal node the root is expert 0.  The forward pass walks the tree in Python, so it reads a
host copy of the codes, refreshed only when the buffer changes (a split, a load, a move): on a
GPU, reading the buffer itself would stall every forward pass on a device-to-host copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .devices import to_device
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
        """Host copy of ``children_codes``, re-read only when the buffer is replaced (split,
        ``.to``) or written in place (``load_state_dict``: its version counter moves)."""
        codes = self.children_codes
        cached = self.__dict__.get("_codes_cache")
        if cached is None or cached[0] is not codes or cached[1] != codes._version:
            rows = [tuple(row) for row in codes.tolist()]
            # Holding the buffer itself (not its id) keeps the identity test sound.
            cached = (codes, codes._version, rows, _depth(rows))
            self.__dict__["_codes_cache"] = cached
        return cached[2]

    def _depth(self) -> int:
        """Internal nodes on the longest root-to-leaf path."""
        self._codes()
        return self.__dict__["_codes_cache"][3]

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
        batch, device = left_probs.shape[0], left_probs.device
        codes = self.children_codes
        if codes.shape[0] == 0:
            return torch.zeros(batch, dtype=torch.long, device=device)
        if sample:  # drawn on the CPU generator, then moved: the same draws on every device
            draws = to_device(torch.rand(left_probs.shape, generator=generator), device)
            go_left = draws < left_probs.detach()
        else:
            go_left = left_probs.detach() >= 0.5
        current = torch.zeros(batch, dtype=torch.long, device=device)
        rows = torch.arange(batch, device=device)
        # Exactly as many steps as the tree is deep (known on the host): an example that
        # reached its leaf stays there, and no step asks the device whether all are done.
        for _ in range(self._depth()):
            internal = current >= 0
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
        row = torch.tensor([[leaf_code, -(new_expert + 1)]], device=codes.device)
        self.children_codes = torch.cat([codes, row])
        # Drawn on the CPU generator, then placed like the existing gates.
        like = {"device": self.weight.device, "dtype": self.weight.dtype}
        fresh_weight = uniform_init((1, self.gate_features), self.gate_features, generator)
        fresh_bias = uniform_init((1,), self.gate_features, generator)
        fresh_weight, fresh_bias = fresh_weight.to(**like), fresh_bias.to(**like)
        self.weight = nn.Parameter(torch.cat([self.weight.detach(), fresh_weight]))
        self.bias = nn.Parameter(torch.cat([self.bias.detach(), fresh_bias]))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Resize to the saved tree first, so a grown gMoE checkpoint loads into a fresh model."""
        for name in ("weight", "bias", "children_codes"):
            saved = state_dict.get(prefix + name)
            current = getattr(self, name)
            if saved is not None and saved.shape != current.shape:
                resized = torch.empty(saved.shape, dtype=current.dtype, device=current.device)
                setattr(
                    self,
                    name,
                    nn.Parameter(resized) if isinstance(current, nn.Parameter) else resized,
                )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _depth(codes: list[tuple[int, int]]) -> int:
    """Internal nodes on the longest root-to-leaf path of the tree encoded by ``codes``."""
    if not codes:
        return 0
    deepest, stack = 0, [(0, 1)]
    while stack:
        code, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in codes[code] if child >= 0)
    return deepest
