"""Which Firefly width candidates to keep under a parameter budget (App. B.1: linear growth).

Firefly's public code ranks the candidates of all layers together and keeps those above one
threshold (a global greedy choice by score), growing by a fixed share of the neurons, which is
exponential in parameters.  App. B.1 asks for "approximately a quarter of the initial number
of parameters" per growth phase instead, so the greedy choice here walks the candidates of every
layer in score order and keeps one when it brings the added parameter count nearer to the
budget.  A unit costs its layer's per-unit slice of every learnable tensor it indexes, and that
slice widens with the units kept in neighbouring layers: the count is exact, not estimated.
"""

from __future__ import annotations

from torch import Tensor, nn

from .growable import GrowableLayer


class UnitCosts:
    """Parameters added by one more unit in a layer, given the units already kept."""

    def __init__(self, layers: list[GrowableLayer]) -> None:
        # tensor -> (shape, {dim: layers whose units that dim indexes})
        self._tensors: dict[int, tuple[list[int], dict[int, list[int]]]] = {}
        self._of_layer: list[list[int]] = [[] for _ in layers]
        self.added = [0] * len(layers)
        for index, layer in enumerate(layers):
            for unit in layer.producers + layer.consumers:
                if not isinstance(unit.tensor, nn.Parameter):
                    continue  # buffers (batch-norm statistics) are not parameters
                key = id(unit.tensor)
                shape, dims = self._tensors.setdefault(key, (list(unit.tensor.shape), {}))
                dims.setdefault(unit.dim, []).append(index)
                if key not in self._of_layer[index]:
                    self._of_layer[index].append(key)

    def _numel(self, key: int, extra: int | None = None) -> int:
        shape, dims = self._tensors[key]
        count = 1
        for dim, size in enumerate(shape):
            grown = sum(self.added[m] + (m == extra) for m in dims.get(dim, ()))
            count *= size + grown
        return count

    def marginal(self, layer: int) -> int:
        """Parameters one more unit in ``layer`` adds now."""
        return sum(self._numel(key, layer) - self._numel(key) for key in self._of_layer[layer])

    def keep(self, layer: int) -> int:
        """Count one more unit in ``layer``; returns what it added."""
        cost = self.marginal(layer)
        self.added[layer] += 1
        return cost


def choose_within_budget(
    scores: list[Tensor], layers: list[GrowableLayer], budget: float
) -> tuple[list[list[int]], int]:
    """Per layer, the indices of the candidates kept (``scores[l]``: that layer's candidate
    scores), and the parameters they add.  Candidates with no first-order descent (score 0)
    are never kept; ties go to the earlier layer and candidate."""
    costs = UnitCosts(layers)
    ranked = sorted(
        ((-score, layer, index)
         for layer, values in enumerate(scores)
         for index, score in enumerate(values.tolist())
         if score > 0)
    )
    kept: list[list[int]] = [[] for _ in layers]
    spent = 0
    for _, layer, index in ranked:
        remaining = budget - spent
        if remaining <= 0:
            break
        if costs.marginal(layer) < 2 * remaining:  # nearer the budget with it than without
            spent += costs.keep(layer)
            kept[layer].append(index)
    return kept, spent
