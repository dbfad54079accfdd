"""Firefly width growth (FF, §4.2; Wu et al. 2020), linear in parameters (App. B.1).

Firefly grows a network by looking, around the current network, at a neighbourhood of wider ones
and keeping the candidates that decrease the loss fastest to first order:

- split an existing unit i: add a copy of it whose incoming weights move by ε·δ_i, halving the
  outgoing weights between the two copies.  At ε = 0 the function is unchanged; to first order
  the loss moves by ε·½·∇_{θ_i}L·δ_i, steepest for δ_i = −g_i/|g_i|: the score is ½|g_i|.
- add a new unit j with random incoming weights v_j and outgoing weights ε·u_j.  At ε = 0 the
  function is unchanged; the loss moves by ε·G_j·u_j with G_j = ∂L/∂u_j at u_j = 0, steepest
  for u_j = −G_j/|G_j|, so the score is |G_j|.

One forward/backward pass over a network holding all new candidates with zero outgoing weights
(the same function as the current one) gives every g_i and G_j at once.  As in Firefly's public
code, every layer offers its existing units as splits plus ``NEW_CANDIDATES`` (its ``K = 70``)
new units, ε defaults to its 1e-2, and the candidates of all layers compete for one budget;
App. B.1's linear growth turns Firefly's share of neurons into a parameter budget
(``firefly_budget``).  Depth growth (new layers) is ``firefly_depth``; the residual blocks it
inserts widen with the layer they sit behind (``residual``).

New units' random weights are drawn on the CPU generator (the same draws on every device) and
then placed on the device and in the dtype of the tensor they extend.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .firefly_budget import choose_within_budget
from .growable import UnitTensor
from .mac_count import count_forward_macs, count_parameters, training_flops

SCORE_CHUNK = 128
NEW_CANDIDATES = 70  # Firefly's public code: K = 70 new-neuron candidates per layer


@dataclass(frozen=True)
class FireflyReport:
    """What one growth step did: units added per hidden layer (split copies + new units)."""

    splits: tuple[int, ...]
    new_units: tuple[int, ...]
    params_before: int
    params_after: int
    flops: float  # spent scoring the candidates (one forward + backward over the examples)
    predicted_decrease: float  # ε × Σ chosen scores: the first-order loss decrease on (x, y)


def _fit(values: Tensor, shape: tuple[int, ...], dim: int) -> Tensor:
    """Zero-pad ``values`` (prefix extents) to ``shape`` on every dim but ``dim``: rows and
    columns that appeared since (earlier layers already grew) get 0."""
    pad = []
    for axis in reversed(range(values.dim())):
        pad += [0, 0] if axis == dim else [0, shape[axis] - values.shape[axis]]
    return F.pad(values, pad)


def _append(unit: UnitTensor, values: Tensor) -> None:
    tensor = unit.tensor
    values = _fit(values.to(tensor.device, tensor.dtype), tuple(tensor.shape), unit.dim)
    grown = torch.cat([tensor.detach(), values], dim=unit.dim)
    setattr(
        unit.module, unit.name, nn.Parameter(grown) if isinstance(tensor, nn.Parameter) else grown
    )


def _prefix(tensor: Tensor, shape: tuple[int, ...], dim: int, units: slice) -> Tensor:
    index = tuple(units if axis == dim else slice(0, size) for axis, size in enumerate(shape))
    return tensor[index]


def _unit_rows(parts: list[Tensor], dims: list[int]) -> Tensor:
    """Concatenate per-unit slices of several tensors into (units, features)."""
    return torch.cat([p.movedim(d, 0).flatten(1) for p, d in zip(parts, dims)], dim=1)


def _split_rows(rows: Tensor, parts: list[Tensor], dims: list[int]) -> list[Tensor]:
    """Inverse of ``_unit_rows``: (units, features) back to per-tensor slices."""
    out, start = [], 0
    for part, dim in zip(parts, dims):
        moved = part.movedim(dim, 0)
        width = moved[0].numel() if moved.shape[0] else moved.flatten(1).shape[1]
        out.append(
            rows[:, start : start + width].reshape(rows.shape[0], *moved.shape[1:]).movedim(0, dim)
        )
        start += width
    return out


def _candidate_gradients(
    model: nn.Module,
    shapes: list[list[tuple[int, ...]]],
    x: Tensor,
    y: Tensor,
    candidates: list[int],
    generator: torch.Generator | None,
):
    """Gradients at a copy of ``model`` holding ``candidates[l]`` new units per layer with zero
    outgoing weights.  A candidate's incoming weights from the previous layer's candidates are 0,
    as they will be in the grown network (whatever is chosen there), so each score is the
    first-order effect of that candidate alone.  Returns the copy's layers and its MACs/example."""
    wide = copy.deepcopy(model)
    wide_layers = wide.growable_layers()
    for layer, layer_shapes, count in zip(wide_layers, shapes, candidates):
        for unit, original in zip(layer.producers, layer_shapes):
            shape = list(original)
            shape[unit.dim] = count
            _append(unit, unit.init(tuple(shape), generator))  # zero-padded to the current rows
        for unit in layer.consumers:
            shape = list(unit.tensor.shape)
            shape[unit.dim] = count
            _append(unit, unit.tensor.new_zeros(shape))
    macs = loss_gradients(wide, x, y)
    return wide_layers, macs


def loss_gradients(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Gradients of the mean training-mode cross-entropy on (x, y) in ``model``'s ``.grad``
    (in chunks: a 16-layer VGG on 1024 images at once would not fit); returns the model's
    forward MACs per example, for the FLOPs of the pass."""
    model.train()
    model.zero_grad(set_to_none=True)
    for start in range(0, x.shape[0], SCORE_CHUNK):
        xb, yb = x[start : start + SCORE_CHUNK], y[start : start + SCORE_CHUNK]
        loss = F.cross_entropy(model(xb)[0], yb, reduction="sum") / x.shape[0]
        loss.backward()
    return count_forward_macs(model, lambda: model.eval()(x[:2]), 2)


def grow_width(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    budget: float,
    epsilon: float = 1e-2,
    generator: torch.Generator | None = None,
    new_candidates: int = NEW_CANDIDATES,
) -> FireflyReport:
    """Add about ``budget`` parameters of units to ``model``'s hidden layers (N = 1): splits of
    the existing units and ``new_candidates`` random new ones per layer, kept in the order of
    their first-order score on (x, y) across all layers (``choose_within_budget``).  ``epsilon``
    = 0 leaves the function unchanged (up to rounding), but then split copies stay identical
    forever; small ε breaks the symmetry.  A budget <= 0 grows nothing and costs nothing."""
    was_training = model.training
    params_before = count_parameters(model)
    layers = model.growable_layers()
    if budget <= 0:
        zeros = (0,) * len(layers)
        return FireflyReport(zeros, zeros, params_before, params_before, 0.0, 0.0)
    widths = [layer.width for layer in layers]
    shapes = [
        [tuple(u.tensor.shape) for u in layer.producers + layer.consumers] for layer in layers
    ]
    candidates = [new_candidates] * len(layers)
    wide_layers, wide_macs = _candidate_gradients(model, shapes, x, y, candidates, generator)

    scored = []  # per layer: split gradients, new-unit gradients and the tensors they cover
    for index, (layer, wide) in enumerate(zip(layers, wide_layers)):
        width = widths[index]
        producer_shapes = shapes[index][: len(layer.producers)]
        consumer_shapes = shapes[index][len(layer.producers) :]
        learnable = [i for i, u in enumerate(wide.producers) if isinstance(u.tensor, nn.Parameter)]
        grads = [
            _prefix(wide.producers[i].tensor.grad, producer_shapes[i], wide.producers[i].dim,
                    slice(0, width))
            for i in learnable
        ]
        g = _unit_rows(grads, [wide.producers[i].dim for i in learnable])  # (width, P)
        new_grads = [
            _prefix(u.tensor.grad, s, u.dim, slice(width, width + new_candidates))
            for u, s in zip(wide.consumers, consumer_shapes)
        ]
        big_g = _unit_rows(new_grads, [u.dim for u in wide.consumers])  # (new_candidates, Q)
        scored.append((learnable, grads, g, new_grads, big_g))
    scores = [torch.cat([0.5 * g.norm(dim=1), big_g.norm(dim=1)]) for _, _, g, _, big_g in scored]
    kept, _ = choose_within_budget(scores, layers, budget)

    splits, news, gain = [], [], 0.0
    for index, (layer, wide) in enumerate(zip(layers, wide_layers)):
        width, count = widths[index], new_candidates
        learnable, grads, g, new_grads, big_g = scored[index]
        producer_shapes = shapes[index][: len(layer.producers)]
        chosen = torch.tensor(sorted(kept[index]), dtype=torch.long, device=g.device)
        gain += epsilon * float(scores[index][chosen].sum())
        split_ids = chosen[chosen < width]
        new_ids = chosen[chosen >= width] - width
        splits.append(len(split_ids))
        news.append(len(new_ids))

        # Split copies: incoming weights θ_i + ε δ_i (buffers copied), outgoing weights halved.
        directions = -g / g.norm(dim=1).clamp(min=1e-12)[:, None]
        delta = _split_rows(
            directions[split_ids], grads, [wide.producers[i].dim for i in learnable]
        )
        delta_by_tensor = dict(zip(learnable, delta))
        new_dirs = -big_g / big_g.norm(dim=1).clamp(min=1e-12)[:, None]
        out_new = _split_rows(new_dirs[new_ids], new_grads, [u.dim for u in wide.consumers])
        for i, (unit, wide_unit) in enumerate(zip(layer.producers, wide.producers)):
            copies = unit.tensor.detach().index_select(unit.dim, split_ids)
            if i in delta_by_tensor:
                copies = copies + epsilon * _fit(delta_by_tensor[i], tuple(copies.shape), unit.dim)
            fresh = _prefix(
                wide_unit.tensor.detach(), producer_shapes[i], unit.dim, slice(width, width + count)
            )
            fresh = fresh.index_select(unit.dim, new_ids)
            _append(
                unit, torch.cat([copies, _fit(fresh, tuple(copies.shape), unit.dim)], dim=unit.dim)
            )
        for unit, direction in zip(layer.consumers, out_new):
            with torch.no_grad():
                halves = unit.tensor.index_select(unit.dim, split_ids) / 2
                unit.tensor.index_copy_(unit.dim, split_ids, halves)
            shape = tuple(halves.shape)
            _append(
                unit, torch.cat([halves, _fit(epsilon * direction, shape, unit.dim)], dim=unit.dim)
            )
    model.train(was_training)
    return FireflyReport(
        splits=tuple(splits),
        new_units=tuple(news),
        params_before=params_before,
        params_after=count_parameters(model),
        flops=training_flops(wide_macs, x.shape[0]),
        predicted_decrease=gain,
    )
