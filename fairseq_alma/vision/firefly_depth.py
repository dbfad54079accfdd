"""Firefly depth growth: new layers where they decrease the loss fastest (FF, §4.2).

§4.2: "Growth includes both a width expansion by adding new hidden units (or feature maps) as
well as a depth expansion by adding new layers."  Firefly (Wu et al. 2020) grows deeper by
inserting ``z -> z + ε·h(z)`` behind a layer and selecting, among candidate positions, those
whose first-order loss decrease is largest.  Here every hidden layer offers one candidate: a
residual block of the backbone's own kind with its per-unit ``scale`` at 0 (``residual``), so a
network holding all candidates computes exactly the current function, and one forward/backward
pass gives every candidate's gradient ``g_p = ∂L/∂scale_p``.  The ``layers`` candidates with the
largest ``|g_p|`` are inserted with ``scale_p = -ε·g_p/|g_p|``: the loss falls by ``ε·|g_p|`` to
first order, and at ε = 0 the function is exactly kept.

Firefly's public code has no depth growth, so how many layers a growth phase adds is ours to
choose (``--ff-new-layers``, default 1); the parameters they add count towards the growth
phase's budget, and width growth gets the rest (``FireflyLearner``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .devices import placement
from .firefly import loss_gradients
from .mac_count import count_parameters, training_flops


@dataclass(frozen=True)
class DepthReport:
    """What one depth step did: hidden layers a new block was inserted behind, and its cost."""

    inserted_after: tuple[int, ...]
    params_before: int
    params_after: int
    flops: float  # one forward + backward over the examples, every candidate in place
    predicted_decrease: float  # ε × Σ chosen |g_p|: the first-order loss decrease on (x, y)


def grow_depth(model: nn.Module, x: Tensor, y: Tensor, layers: int, epsilon: float = 1e-2,
               generator: torch.Generator | None = None) -> DepthReport:
    """Insert ``layers`` residual blocks into ``model`` (N = 1) behind the hidden layers whose
    candidate has the largest first-order score on (x, y) (module doc)."""
    params_before = count_parameters(model)
    hidden = len(model.widths)
    if layers <= 0:
        return DepthReport((), params_before, params_before, 0.0, 0.0)
    device, dtype = placement(model)
    wide = copy.deepcopy(model)
    candidates = []
    for position in range(hidden):  # drawn in layer order, on the CPU generator, then placed
        block = wide.new_residual(position, generator).to(device=device, dtype=dtype)
        wide.residuals.attach(position, block)
        candidates.append(block)
    macs = loss_gradients(wide, x, y)
    grads = [block.scale.grad for block in candidates]
    scores = torch.stack([grad.norm() for grad in grads])
    chosen = sorted(torch.topk(scores, min(layers, hidden)).indices.tolist())
    for position in chosen:
        # A ResidualConv's batch norm keeps the running statistics of the scoring pass: those
        # of the data the block will see, not the fresh (0, 1).
        block = copy.deepcopy(candidates[position]).train(model.training)
        block.zero_grad(set_to_none=True)
        with torch.no_grad():
            block.scale.copy_(-epsilon * grads[position] / scores[position].clamp(min=1e-12))
        model.residuals.attach(position, block)
    return DepthReport(
        inserted_after=tuple(chosen),
        params_before=params_before,
        params_after=count_parameters(model),
        flops=training_flops(macs, x.shape[0]),
        predicted_decrease=epsilon * float(scores[chosen].sum()),
    )
