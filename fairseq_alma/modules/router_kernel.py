"""The Switch router as one autograd node: logits, top-1 choice, arrival slots and both losses.

Why a hand-written autograd function when ``switch_routing.py`` already has the maths: on a GPU
a Switch block costs what it launches, not what it computes.  Written with plain tensor ops and
autograd, routing, the balance loss, the z-loss and the diagnostics took ~300 kernel launches per
forward+backward (each a few microseconds of CPU time for a few microseconds of GPU work), which
made the whole layer 3-5x a dense FFN on an H100 whatever the expert count.  Here the forward is
~30 launches and the backward ~14, written out once:

- slots come from one cumulative sum over a tokens x (E + 1) one-hot, not a sort (the padding
  column E keeps padding out of every expert's count);
- the z-loss reuses the softmax: ``logsumexp(l) = l_top - log(p_top)``, exact, one gather;
- the backward is the closed form of all three terms through the softmax (see ``backward``);
- the router input is not kept in float32 for the backward: it is recast from the layer input
  (one cast instead of a float32 copy of every token per Switch block in memory);
- nothing is read back to the host (the capacity is a Python int from the shape).

Semantics are exactly ``switch_routing.route_top1`` + ``balance_loss`` + ``router_z_loss``
(tests/test_router_kernel.py compares values and every gradient with them, in float64 too):
router in float32 under every precision (Switch §2.4), first come first served in token order
(or by decreasing gate with batch-prioritised routing), padding takes no slot and never reaches
a loss, even when it holds NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable


@dataclass
class RoutedTokens:
    """Where every token goes (T token positions, E active experts).

    Attributes:
        gate: (T,) float32, router probability of the chosen expert; 0 at padding.  Carries the
            router's gradient (the experts' output is scaled by it).
        expert: (T,) long, the chosen expert; ``E`` at padding (an id no expert has).
        rank: (T,) int, 1-based arrival rank among the tokens choosing the same expert.
        keep: (T,) bool, not padding and ``rank <= capacity``.
        counts: (E + 1,) int, tokens whose argmax is each expert (before capacity); the last
            entry counts padding.
        capacity: slots per expert, or None for no limit.
        balance_loss, z_loss: the Switch balance loss and the router z-loss (0-dim float32).
        entropy_sum: summed router entropy over non-padding tokens (detached; a diagnostic).
    """

    gate: Tensor
    expert: Tensor
    rank: Tensor
    keep: Tensor
    counts: Tensor
    capacity: Optional[int]
    balance_loss: Tensor
    z_loss: Tensor
    entropy_sum: Tensor

    @property
    def slot(self) -> Tensor:
        """(T,) 0-based slot, as ``switch_routing.Top1Routing.slot``."""
        return self.rank - 1


class Top1Router(torch.autograd.Function):
    """(tokens, router weight) -> gate, balance loss, z-loss (differentiable) + routing (not).

    ``weight`` is the whole ``(E_max, d)`` router weight; only its first ``num_experts`` rows
    are used, and the gradient of the others is 0 (growth slots), as slicing under autograd
    would give, without autograd's extra full-size copy.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        tokens: Tensor,
        weight: Tensor,
        padding: Optional[Tensor],
        num_experts: int,
        capacity: Optional[int],
        jitter_eps: float,
        prioritized: bool,
    ) -> tuple[Tensor, ...]:
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

        # arrival rank: a cumulative count of each expert's tokens in token order (or by
        # decreasing gate: batch-prioritised routing); column E gathers the padding
        order = torch.argsort(gate, descending=True, stable=True) if prioritized else None
        ordered = expert if order is None else expert.index_select(0, order)
        onehot = torch.zeros(num_tokens, experts + 1, dtype=torch.int32, device=tokens.device)
        onehot.scatter_(1, ordered.unsqueeze(1), 1)
        cumulative = torch.cumsum(onehot, dim=0, dtype=torch.int32)  # (T, E + 1)
        rank = cumulative.gather(1, ordered.unsqueeze(1)).squeeze(1)  # (T,) 1-based
        if order is not None:
            rank = torch.empty_like(rank).index_copy_(0, order, rank)
        counts = cumulative[-1].clone()  # (E + 1,) tokens per expert; last: padding (a copy: the
        # caller keeps it until the step's diagnostics, the (T, E + 1) cumulative need not live)
        keep = rank <= capacity if capacity is not None else torch.ones_like(rank, dtype=torch.bool)
        if padding is not None:
            keep.masked_fill_(padding, False)

        # losses over the n non-padding tokens (probs rows of padding are 0 already)
        if padding is None:
            inv_n = 1.0 / num_tokens
            balance_scale = experts * inv_n * inv_n
        else:  # an int tensor: its reciprocal is float32
            inv_n = (num_tokens - counts[experts]).clamp_(min=1).reciprocal()
            balance_scale = inv_n * inv_n * experts
        counts_f = counts[:experts].float()  # (E,)
        balance = torch.dot(counts_f, probs.sum(0)) * balance_scale  # E * sum_i f_i P_i
        lse = logits.gather(1, top.unsqueeze(1)).squeeze(1) - torch.log(gate)  # (T,) logsumexp
        if padding is not None:
            lse.masked_fill_(padding, 0.0)
        z_loss = torch.dot(lse, lse) * inv_n
        entropy_sum = torch.special.entr(probs).sum()  # padding rows are 0: entr(0) = 0

        ctx.save_for_backward(tokens, w, noise, probs, top, gate, lse, counts_f)
        ctx.inv_n, ctx.balance_scale = inv_n, balance_scale
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        ctx.mark_non_differentiable(expert, rank, keep, counts, entropy_sum)
        return gate, balance, z_loss, expert, rank, keep, counts, entropy_sum

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_gate: Optional[Tensor], grad_balance: Optional[Tensor],  # type: ignore[override]
                 grad_z: Optional[Tensor], *_: Any) -> tuple[Optional[Tensor], ...]:
        """dL/dlogits for gate g_t = p_t,e(t), balance B = (E/n^2) sum_i c_i sum_t p_ti (counts
        c constant, as in the Switch reference) and Z = (1/n) sum_t lse_t^2:

            dL/dl_tj = p_tj (a_j + s_t) + [j = e(t)] u_t,
            u_t = dL/dg_t * g_t,  a_j = dL/dB * E c_j / n^2,  s_t = dL/dZ * 2 lse_t / n - u_t - p_t . a

        Padding rows have p = 0, g = 0 and lse = 0, so they get exactly 0."""
        tokens, w, noise, probs, top, gate, lse, counts_f = ctx.saved_tensors
        experts = w.shape[0]
        shift = None  # s_t
        if grad_z is not None:
            shift = lse * (grad_z * (2.0 * ctx.inv_n))
        if grad_gate is not None:
            u = grad_gate * gate  # (T,)
            shift = -u if shift is None else shift.sub_(u)
        if grad_balance is not None:
            a = counts_f * (grad_balance * ctx.balance_scale)  # (E,)
            pa = torch.mv(probs, a)  # (T,)
            shift = pa.neg_() if shift is None else shift.sub_(pa)
        if shift is None:
            return (None,) * 7
        grad_logits = probs * (shift.unsqueeze(1) if grad_balance is None else shift.unsqueeze(1) + a)  # (T, E)
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
        return grad_tokens, grad_weight, None, None, None, None, None


def route_tokens(
    tokens: Tensor,
    weight: Tensor,
    num_experts: int,
    capacity: Optional[int],
    padding: Optional[Tensor] = None,
    jitter_eps: float = 0.0,
    prioritized: bool = False,
) -> RoutedTokens:
    """Route (T, d) ``tokens`` with the first ``num_experts`` rows of the router ``weight``.

    ``padding``: (T,) bool, True at padding positions.  ``capacity``: slots per expert (from the
    token count in the shape, ``switch_routing.expert_capacity``), or None for no limit.
    ``jitter_eps``: multiplicative input noise (the caller passes 0 outside training).
    ``prioritized``: batch-prioritised routing (slots by decreasing gate).
    """
    if padding is not None:
        padding = padding.reshape(-1)
    device = tokens.device.type
    if torch.is_autocast_enabled(device):  # the router is float32 under --amp too (module doc)
        with torch.autocast(device, enabled=False):
            outputs = Top1Router.apply(tokens, weight, padding, num_experts, capacity, jitter_eps, prioritized)
    else:
        outputs = Top1Router.apply(tokens, weight, padding, num_experts, capacity, jitter_eps, prioritized)
    gate, balance, z_loss, expert, rank, keep, counts, entropy_sum = outputs
    return RoutedTokens(gate=gate, expert=expert, rank=rank, keep=keep, counts=counts, capacity=capacity,
                        balance_loss=balance, z_loss=z_loss, entropy_sum=entropy_sum)
