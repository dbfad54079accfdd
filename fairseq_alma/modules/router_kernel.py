"""The Switch router as one autograd node: logits, top-1 choice, arrival slots, loss sums.

Why a hand-written autograd function when ``switch_routing.py`` already has the maths: on a GPU
a Switch block costs what it launches, not what it computes.  Written with plain tensor ops and
autograd, routing, the balance loss, the z-loss and the diagnostics took ~140 kernel launches per
forward+backward (each some microseconds of host time for a few microseconds of GPU work), which
made the whole layer 3-5x a dense FFN on an H100 whatever the expert count.  Here the forward is
~20 launches and the backward ~12, written out once:

- slots come from one 1-D cumulative sum over an (E + 1) x tokens grid of marks, not a sort
  (row E keeps padding out of every expert's count).  A scan down the token axis of a
  tokens x (E + 1) one-hot is parallel only across its E + 1 columns: 0.7 ms (E = 1) to 2 ms
  (E = 8) per block on an H100, more than the experts' matmuls; the 1-D scan is microseconds;
- the node returns the loss *sums* (router probability mass per expert, summed squared
  logsumexp) and the expert counts; the balance loss ``E * sum_i f_i P_i``, the z-loss and the
  diagnostics are formed from them once per step for every block together
  (``switch_routing.moe_losses``), so normalising costs no launches per block;
- the z-loss reuses the softmax: ``logsumexp(l) = l_top - log(p_top)``, exact, one gather;
- the backward is the closed form of every term through the softmax (see ``backward``);
- the router input is not kept in float32 for the backward: it is recast from the layer input
  (one cast instead of a float32 copy of every token per Switch block in memory);
- nothing is read back to the host (the capacity is a Python int from the shape).

Semantics are exactly ``switch_routing.route_top1`` + ``balance_loss`` + ``router_z_loss``
(tests/test_router_kernel.py compares values and every gradient with them, in float64 too):
router in float32 under every precision (Switch §2.4), first come first served in routing order
(or by decreasing gate with batch-prioritised routing), padding takes no slot and never reaches
a loss, even when it holds NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable


@dataclass
class RoutedTokens:
    """Where every token goes (T token positions, E active experts), and the loss sums.

    Attributes:
        gate: (T,) float32, router probability of the chosen expert; 0 at padding.  Carries the
            router's gradient (the experts' output is scaled by it).
        expert: (T,) long, the chosen expert; ``E`` at padding (an id no expert has).
        rank: (T,) int, 1-based arrival rank among the tokens choosing the same expert.
        keep: (T,) bool, not padding and ``rank <= capacity``.
        counts: (E + 1,) int, tokens whose argmax is each expert (before capacity); the last
            entry counts padding.
        capacity: slots per expert, or None for no limit.
        prob_sums: (E,) float32, router probabilities summed over non-padding tokens (the P_i of
            the balance loss times n); differentiable.
        lse_square_sum: () float32, sum over non-padding tokens of logsumexp(logits)^2 (the
            z-loss times n); differentiable; None when not asked for.
        probs: (T, E) float32 router probabilities, 0 rows at padding (for the entropy
            diagnostic; not differentiable).
    """

    gate: Tensor
    expert: Tensor
    rank: Tensor
    keep: Tensor
    counts: Tensor
    capacity: Optional[int]
    prob_sums: Tensor
    lse_square_sum: Optional[Tensor]
    probs: Tensor

    @property
    def slot(self) -> Tensor:
        """(T,) 0-based slot, as ``switch_routing.Top1Routing.slot``."""
        return self.rank - 1


_PLACES: dict[tuple[int, torch.device], Tensor] = {}


def row_places(count: int, device: torch.device) -> Tensor:
    """``arange(count)`` on ``device``, made once per size (a training run routes one or two
    sizes of batch): one launch less per block and step."""
    key = (count, device)
    places = _PLACES.get(key)
    if places is None:
        places = _PLACES[key] = torch.arange(count, device=device)
    return places


class Top1Router(torch.autograd.Function):
    """(tokens, router weight) -> gate and loss sums (differentiable) + routing (not).

    ``weight`` is the whole ``(E_max, d)`` router weight; only its first ``num_experts`` rows
    are used, and the gradient of the others is 0 (growth slots), as slicing under autograd
    would give, without autograd's extra full-size copy.  ``positions`` (T,) is each token's
    place in the routing order (None: the order of the rows).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        tokens: Tensor,
        weight: Tensor,
        padding: Optional[Tensor],
        positions: Optional[Tensor],
        num_experts: int,
        capacity: Optional[int],
        jitter_eps: float,
        prioritized: bool,
        with_z: bool,
    ) -> tuple[Optional[Tensor], ...]:
        ctx.set_materialize_grads(False)  # unused outputs: None in backward, no zero tensors
        num_tokens, experts = tokens.shape[0], num_experts
        x = tokens if tokens.dtype == torch.float32 else tokens.float()  # (T, d)
        noise = None
        if jitter_eps > 0:  # multiplicative input jitter (Switch §2.4), training only (caller)
            noise = torch.empty_like(x).uniform_(1.0 - jitter_eps, 1.0 + jitter_eps)
            x = x * noise
        w = weight if experts == weight.shape[0] else weight[:experts]
        w = w if w.dtype == torch.float32 else w.float()  # (E, d)
        logits = torch.mm(x, w.t())  # (T, E) float32
        probs = torch.softmax(logits, dim=1)  # (T, E)
        if padding is not None:  # padding rows: 0, not NaN * 0, whatever padding holds
            probs.masked_fill_(padding.unsqueeze(1), 0.0)
        gate, top = probs.max(dim=1)  # (T,), (T,); padding: 0 and 0
        expert = top if padding is None else top.masked_fill(padding, experts)  # padding -> E

        # arrival rank: each token marks the cell (its expert, its place in the routing order)
        # of an (E + 1) x T grid; one 1-D cumulative sum in expert-major order then counts, at a
        # token's own mark, the tokens of lower experts plus its expert's tokens up to it (its
        # position in a stable sort by expert).  With batch-prioritised routing the place is
        # the rank by decreasing gate, ties in routing order.  Row E is padding's.
        place = positions if positions is not None else row_places(num_tokens, tokens.device)
        if prioritized:
            by_place = gate if positions is None else torch.empty_like(gate).index_copy_(0, place, gate)
            most_sure = torch.argsort(by_place, descending=True, stable=True)  # routing places
            priority = torch.empty_like(place).index_copy_(0, most_sure, row_places(num_tokens, tokens.device))
            place = priority if positions is None else priority.index_select(0, place)
        marks = torch.add(place, expert, alpha=num_tokens)  # (T,)
        grid = torch.zeros((experts + 1) * num_tokens, dtype=torch.int32, device=tokens.device)
        cumulative = torch.cumsum(grid.index_fill_(0, marks, 1), dim=0, dtype=torch.int32)
        ends = cumulative.view(experts + 1, num_tokens)[:, -1]  # (E + 1,) tokens of experts <= e
        starts = F.pad(ends[:-1], (1, 0))  # (E + 1,) tokens of experts < e
        counts = ends - starts  # (E + 1,) tokens per expert; last: padding
        rank = cumulative.gather(0, marks) - starts.index_select(0, expert)  # (T,) 1-based
        keep = rank <= capacity if capacity is not None else torch.ones_like(rank, dtype=torch.bool)
        if padding is not None:
            keep.masked_fill_(padding, False)

        # loss sums over the non-padding tokens (probs rows of padding are 0 already)
        prob_sums = probs.sum(0)  # (E,)
        lse = lse_square_sum = None
        if with_z:
            lse = logits.gather(1, top.unsqueeze(1)).squeeze(1) - torch.log(gate)  # (T,) logsumexp
            if padding is not None:
                lse.masked_fill_(padding, 0.0)
            lse_square_sum = torch.dot(lse, lse)

        ctx.save_for_backward(tokens, w, noise, probs, top, gate, lse)
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        ctx.mark_non_differentiable(expert, rank, keep, counts, probs)
        return gate, prob_sums, lse_square_sum, expert, rank, keep, counts, probs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_gate: Optional[Tensor], grad_prob_sums: Optional[Tensor],  # type: ignore[override]
                 grad_lse_square_sum: Optional[Tensor], *_: Any) -> tuple[Optional[Tensor], ...]:
        """dL/dlogits for gate g_t = p_t,e(t), probability sums S_j = sum_t p_tj and
        Z = sum_t lse_t^2 (padding excluded):

            dL/dl_tj = p_tj (a_j + s_t) + [j = e(t)] u_t,
            u_t = dL/dg_t * g_t,  a_j = dL/dS_j,  s_t = 2 lse_t dL/dZ - u_t - p_t . a

        Padding rows have p = 0, g = 0 and lse = 0, so they get exactly 0."""
        tokens, w, noise, probs, top, gate, lse = ctx.saved_tensors
        experts = w.shape[0]
        shift = None  # s_t
        if grad_lse_square_sum is not None:
            shift = lse * (2.0 * grad_lse_square_sum)
        if grad_gate is not None:
            u = grad_gate * gate  # (T,)
            shift = -u if shift is None else shift.sub_(u)
        if grad_prob_sums is not None:
            pa = torch.mv(probs, grad_prob_sums)  # (T,)
            shift = pa.neg_() if shift is None else shift.sub_(pa)
        if shift is None:
            return (None,) * 9
        inner = shift.unsqueeze(1) if grad_prob_sums is None else shift.unsqueeze(1) + grad_prob_sums
        grad_logits = probs * inner  # (T, E)
        if grad_gate is not None:
            grad_logits.scatter_add_(1, top.unsqueeze(1), u.unsqueeze(1))

        grad_tokens = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(grad_logits, w)  # (T, d) float32
            if noise is not None:
                grad_x.mul_(noise)
            grad_tokens = grad_x if tokens.dtype == torch.float32 else grad_x.to(tokens.dtype)
        if ctx.needs_input_grad[1]:
            x = tokens if tokens.dtype == torch.float32 else tokens.float()
            x = x if noise is None else x * noise
            rows = torch.mm(grad_logits.t(), x)  # (E, d)
            if experts == ctx.weight_shape[0]:
                grad_weight = rows if ctx.weight_dtype == torch.float32 else rows.to(ctx.weight_dtype)
            else:  # inactive growth slots get 0
                grad_weight = rows.new_zeros(ctx.weight_shape, dtype=ctx.weight_dtype)
                grad_weight[:experts] = rows
        return grad_tokens, grad_weight, None, None, None, None, None, None, None


def route_tokens(
    tokens: Tensor,
    weight: Tensor,
    num_experts: int,
    capacity: Optional[int],
    padding: Optional[Tensor] = None,
    jitter_eps: float = 0.0,
    prioritized: bool = False,
    positions: Optional[Tensor] = None,
    with_z: bool = True,
) -> RoutedTokens:
    """Route (T, d) ``tokens`` with the first ``num_experts`` rows of the router ``weight``.

    ``padding``: (T,) bool, True at padding positions.  ``capacity``: slots per expert (from the
    token count in the shape, ``switch_routing.expert_capacity``), or None for no limit.
    ``jitter_eps``: multiplicative input noise (the caller passes 0 outside training).
    ``prioritized``: batch-prioritised routing (slots by decreasing gate).  ``positions``: (T,)
    long, each row's place in the order "first come, first served" follows (a permutation of
    0..T-1; None: row order), so a caller can route (seq, batch)-ordered rows batch-major
    without moving them.  ``with_z``: also the z-loss sum (else ``lse_square_sum`` is None).
    """
    if padding is not None:
        padding = padding.reshape(-1)
    device = tokens.device.type
    arguments = (tokens, weight, padding, positions, num_experts, capacity, jitter_eps, prioritized, with_z)
    if torch.is_autocast_enabled(device):  # the router is float32 under --amp too (module doc)
        with torch.autocast(device, enabled=False):
            outputs = Top1Router.apply(*arguments)
    else:
        outputs = Top1Router.apply(*arguments)
    gate, prob_sums, lse_square_sum, expert, rank, keep, counts, probs = outputs
    return RoutedTokens(gate=gate, expert=expert, rank=rank, keep=keep, counts=counts, capacity=capacity,
                        prob_sums=prob_sums, lse_square_sum=lse_square_sum, probs=probs)
