"""Switch Transformer top-1 routing as pure functions over router logits.

Why pure functions: the maths of routing (which token goes where, which tokens overflow, the
balance loss) is what users and reviewers want to check against the Switch paper (Fedus et al.
2021, §2.1-2.2) and the ALMA paper (§5, App. B.2). Keeping it free of module state makes it
testable on hand-made logits and lets the layer (``switch_ffn.py``) only gather and scatter.

Nothing here builds a tokens x experts x capacity tensor: assignments are (expert, slot) index
pairs computed with one stable sort, as in MegaBlocks / Tutel's "fast dispatch".

Nothing here reads a tensor back to the host either (no ``.item()``, ``.tolist()``, ``int()``,
boolean-mask indexing or ``torch.bincount``, which on CUDA reads its largest id to size the
output): the capacity comes from the token count in the shape, padding is masked with tensors,
so on a GPU routing and its losses queue behind the forward without a stall.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class Top1Routing:
    """Where every token goes.  T = number of token positions handed to the router.

    Attributes:
        expert: (T,) long, the chosen expert of each token (argmax of the router); for padding
            positions the value is ``num_experts`` (an id no expert has).
        slot: (T,) long, 0-based rank of the token among the tokens choosing the same expert:
            in token order (the order of the flattened input), or by decreasing gate with
            batch-prioritised routing.
        keep: (T,) bool, token is not padding and ``slot < capacity``.
        gate: (T,) float32, router probability of the chosen expert (0 for padding).
        probs: (T, E) float32 router probabilities (rows of padding are not used anywhere).
        capacity: slots per expert from all T positions, padding included (see
            ``expert_capacity``), or None for "no limit" (evaluation default).
    """

    expert: Tensor
    slot: Tensor
    keep: Tensor
    gate: Tensor
    probs: Tensor
    capacity: Optional[int]

    @property
    def rank(self) -> Tensor:
        """(T,) 1-based slot, as ``router_kernel.RoutedTokens.rank``."""
        return self.slot + 1

    @property
    def counts(self) -> Tensor:
        """(E + 1,) tokens whose argmax is each expert; the last entry counts padding."""
        return expert_counts(self.expert, self.probs.shape[-1] + 1)


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: Optional[float]) -> Optional[int]:
    """Slots per expert: ``C = int(capacity_factor * ceil(tokens / E))`` (Switch eq. 3).

    ``num_tokens`` is every token position handed to the router, padding included, as in
    fairseq's own MoE gate (``top1gating`` on the ``moe`` branch sizes it from the gate's shape).
    Why padding counts: the shape is a Python int, while the number of real tokens lives in the
    (GPU) padding mask and would have to be read back to the host, stalling the GPU queue on
    every MoE layer.  Padding still takes no slot, so a padded batch only gives its real tokens
    more room than the same tokens unpadded would get.  ``None`` means unlimited capacity.
    """
    if capacity_factor is None:
        return None
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 (got {capacity_factor})")
    return int(capacity_factor * math.ceil(num_tokens / num_experts))


def route_top1(
    logits: Tensor,
    capacity_factor: Optional[float],
    valid: Optional[Tensor] = None,
    batch_prioritized: bool = False,
) -> Top1Routing:
    """Top-1 routing with a hard capacity per expert; first come, first served in token order.

    Args:
        logits: (T, E) router logits; computed and kept in float32 by the caller.
        capacity_factor: multiplies the uniform share ``ceil(T / E)`` of all T positions,
            padding included (``expert_capacity`` says why); None = no limit.
        valid: (T,) bool, False at padding positions.  Padding takes no slot and no part in
            the balance loss or the diagnostics; it only counts towards T in the capacity.
        batch_prioritized: slots go to the tokens with the highest gate first instead of the
            earliest (batch-prioritised routing, Riquelme et al. 2021 §3.1): when an expert
            overflows, the tokens it is least sure about are the ones dropped.  Ties keep token
            order.  Which tokens are kept then depends on later tokens, so the layer uses it in
            training only (evaluation stays causal).
    """
    num_tokens, num_experts = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)  # (T, E) fp32
    if valid is None:
        valid = torch.ones(num_tokens, dtype=torch.bool, device=logits.device)
    else:  # padding rows become 0, not NaN*0: whatever padding holds never reaches a loss
        valid = valid.reshape(num_tokens)
        probs = torch.where(valid.unsqueeze(-1), probs, torch.zeros_like(probs))
    gate, expert = probs.max(dim=-1)  # (T,), (T,)
    expert = torch.where(valid, expert, torch.full_like(expert, num_experts))
    capacity = expert_capacity(num_tokens, num_experts, capacity_factor)

    if batch_prioritized:
        priority = torch.argsort(-gate, stable=True)  # (T,) most confident first; padding gate 0
        slot = torch.empty_like(expert)
        slot[priority] = arrival_slots(expert[priority], num_experts + 1)
    else:
        slot = arrival_slots(expert, num_experts + 1)
    keep = valid if capacity is None else valid & (slot < capacity)
    return Top1Routing(expert=expert, slot=slot, keep=keep, gate=gate, probs=probs, capacity=capacity)


def arrival_slots(expert: Tensor, num_bins: int) -> Tensor:
    """0-based rank of each token among earlier tokens with the same expert id.

    One stable sort groups tokens by expert while keeping token order inside each group; a
    token's slot is its position in the sorted order minus the start of its group.
    """
    order = torch.argsort(expert, stable=True)  # (T,)
    counts = expert_counts(expert, num_bins)  # (bins,)
    starts = torch.cumsum(counts, 0) - counts  # (bins,) first sorted position of each expert
    rank_sorted = torch.arange(expert.numel(), device=expert.device) - starts[expert[order]]
    slot = torch.empty_like(expert)
    slot[order] = rank_sorted
    return slot


def expert_counts(expert: Tensor, num_bins: int) -> Tensor:
    """(num_bins,) long: how many tokens carry each id in ``[0, num_bins)``.

    ``scatter_add_`` into a fixed-size vector rather than ``torch.bincount``, which on CUDA reads
    the largest id back to the host to size its output (a synchronisation per call)."""
    counts = torch.zeros(num_bins, dtype=torch.long, device=expert.device)
    return counts.scatter_add_(0, expert, torch.ones_like(expert))


def _expert_loads(routing: Top1Routing, valid: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(valid (T,) bool, counts (E,) long): the tokens whose argmax is each expert, padding
    excluded by sending it to a spare bin (no boolean indexing: that would sync on CUDA)."""
    num_experts = routing.probs.shape[-1]
    if valid is None:
        valid = routing.expert < num_experts
    expert = torch.where(valid, routing.expert, num_experts)  # (T,) padding -> spare bin E
    return valid, expert_counts(expert, num_experts + 1)[:num_experts]


def balance_loss(routing: Top1Routing, valid: Optional[Tensor] = None) -> Tensor:
    """Switch load-balancing loss ``E * sum_i f_i * P_i`` over non-padding tokens.

    f_i is the fraction of tokens whose argmax is expert i (before capacity is applied, as in
    the Switch reference implementation) and P_i the mean router probability of expert i.
    It equals 1.0 for perfectly uniform routing and grows as the load concentrates.
    """
    probs = routing.probs
    num_experts = probs.shape[-1]
    valid, counts = _expert_loads(routing, valid)
    n = valid.sum().clamp(min=1).to(probs.dtype)
    counts = counts.to(probs.dtype)
    f = counts / n  # (E,)
    p_mean = torch.where(valid.unsqueeze(-1), probs, torch.zeros_like(probs)).sum(0) / n  # (E,)
    return num_experts * torch.sum(f * p_mean)


def router_z_loss(logits: Tensor, valid: Optional[Tensor] = None) -> Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2 (Zoph et al. 2022)."""
    z = torch.logsumexp(logits.float(), dim=-1) ** 2  # (T,)
    if valid is None:
        return z.mean()
    valid = valid.reshape(-1)
    return torch.where(valid, z, torch.zeros_like(z)).sum() / valid.sum().clamp(min=1)


def routing_diagnostics(routing: Top1Routing, valid: Optional[Tensor] = None) -> dict[str, Tensor]:
    """Summable statistics of one routing call (detached, float32).

    Values are sums or per-layer numbers so that fairseq can add them across batches and
    workers: ``tokens`` and ``dropped`` are counts, ``entropy_sum`` is the summed router
    entropy, ``load_max``/``load_min`` are the most/least loaded expert's share of the tokens
    times E (1.0 = perfectly balanced), ``unused`` counts experts that received no token.
    """
    probs = routing.probs.detach()
    num_experts = probs.shape[-1]
    valid, counts = _expert_loads(routing, valid)
    n = valid.sum()
    counts = counts.float()
    share = counts * num_experts / n.clamp(min=1).float()
    entropy = -(probs * torch.log(probs.clamp(min=1e-9))).sum(-1)  # (T,)
    return {
        "tokens": n.float(),
        "dropped": (valid & ~routing.keep).sum().float(),
        "entropy_sum": torch.where(valid, entropy, torch.zeros_like(entropy)).sum().float(),
        "load_max": share.max(),
        "load_min": share.min(),
        "unused": (counts == 0).sum().float(),
    }


DIAGNOSTIC_KEYS = ("tokens", "dropped", "entropy_sum", "load_max", "load_min", "unused")


def moe_losses(counts: Tensor, prob_sums: Tensor, lse_square_sums: Tensor) -> tuple[Tensor, Tensor]:
    """(balance, z-loss), each (L,), of L routing calls from the sums the fused router keeps
    (``router_kernel.RoutedTokens``): ``counts`` (L, E + 1) tokens per expert with padding last,
    ``prob_sums`` (L, E) router probabilities summed over non-padding tokens, ``lse_square_sums``
    (L,) summed squared logsumexp.  Over n non-padding tokens, balance = E * sum_i f_i P_i with
    f_i = counts_i / n and P_i = prob_sums_i / n (``balance_loss``), z = lse_square_sums / n
    (``router_z_loss``).  Gradients flow through the sums; counts are constants, as in the
    Switch reference."""
    loads = counts[:, :-1].float()  # (L, E)
    tokens = loads.sum(1).clamp(min=1)  # (L,) n
    balance = (loads * prob_sums).sum(1) * (loads.shape[1] / tokens.square())
    return balance, lse_square_sums / tokens


def diagnostic_sums(counts: Tensor, entropy_sum: Tensor, capacity: Optional[int]) -> Tensor:
    """``routing_diagnostics`` of L routing calls at once, summed over them, as one (6,) tensor
    in ``DIAGNOSTIC_KEYS`` order, from what the fused router keeps (``router_kernel.RoutedTokens``):
    ``counts`` (L, E + 1), tokens per expert with padding last; ``entropy_sum`` (L,); one
    ``capacity`` for all (None: no limit).

    Why from counts: every diagnostic but the entropy is a function of the per-expert counts, so
    a model's MoE blocks (same E, same T) get theirs in ~15 small ops per step instead of ~12 per
    block.  Why one tensor: it travels through fairseq's logging (and its all-reduce) as one
    entry, not six.  They are only logged, so nothing here needs a gradient.
    """
    loads = counts[:, :-1].float()  # (L, E)
    experts = loads.shape[1]
    tokens = loads.sum(1)  # (L,)
    kept = tokens if capacity is None else loads.clamp(max=capacity).sum(1)
    low, high = torch.aminmax(loads, dim=1)
    share = experts / tokens.clamp(min=1)
    stats = torch.stack([tokens, tokens - kept, entropy_sum.float(), high * share, low * share,
                         (loads == 0).sum(1).float()])  # (6, L)
    return stats.sum(1).detach()


def summed_diagnostics(counts: Tensor, entropy_sum: Tensor, capacity: Optional[int]) -> dict[str, Tensor]:
    """``diagnostic_sums`` by name (one block's ``SwitchAux.diagnostics``; tests)."""
    return dict(zip(DIAGNOSTIC_KEYS, diagnostic_sums(counts, entropy_sum, capacity).unbind()))
