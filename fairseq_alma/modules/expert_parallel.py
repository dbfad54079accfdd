"""Expert parallelism for the Switch FFN: each rank of a group of G ranks holds E/G experts.

Why: the paper's large Switch LMs (§5, Table 2: up to 12 experts of ~28M parameters each) do not
need every GPU to hold every expert.  With expert parallelism each rank keeps only its shard of
experts (and their optimizer state) and tokens travel to their expert instead:

1. every rank routes its *own* tokens with the replicated router (``route_top1``, capacity
   ``int(cf * ceil(T_local / E))`` exactly as the single-process layer on the same tokens);
2. kept tokens are sorted by owner rank and sent with ``all_to_all_single`` (counts first);
3. the owner runs its local experts, a second ``all_to_all_single`` returns the results, which
   are gate-scaled and scattered back to token order.

Autograd flows through both exchanges (``_AllToAll``: the backward is the reverse exchange), so
input and router gradients are those of the single-process layer.  Expert e lives on rank
``e % G`` at local slot ``e // G`` (round-robin), so growth that switches on slots 0..n-1
(gMoE, 4 -> 6 -> 8 -> 12 experts) keeps the ranks' loads even.

Gradients.  fairseq averages gradients over the W data-parallel ranks and multiplies by
W / sample_size.  Expert parameters are kept out of that average (``param.expert = True``, the
attribute fairseq's legacy_ddp and ``clip_grad_norm_`` already honour; torch DDP is told by
``fairseq_glue/expert_parallel.prepare_expert_parallel``).  An expert's gradient already sums the
tokens of all G ranks of its group, so it is scaled by 1/G in the backward (``_ScaleGrad``), and
the W/G copies of a shard (one per expert-parallel group) are averaged at the end of backward.
The result equals the gradient of one process holding all experts and all tokens.

Checkpoints.  ``state_dict()`` gathers the full ``[E, ...]`` expert tensors (a collective: every
rank of the group must call it, see fairseq_glue/expert_parallel.py), and loading takes this rank's
rows.  A checkpoint thus has the layout of ``SwitchFFN``: a single process (or any number of
scoring ranks) evaluates it, and a group of any size can load it; save -> load -> save is exact.
An ``alma_stream`` run still resumes only on the processes it started on: their number is in
its ``run.json`` fingerprint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..errors import UsageError, require
from .switch_ffn import SwitchFFN
from .switch_ffn_config import SwitchFFNConfig
from .switch_routing import Top1Routing

logger = logging.getLogger(__name__)

EXPERT_PARAMETERS = ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")


@dataclass(frozen=True)
class ExpertParallelGroups:
    """Where this process sits: G consecutive ranks form an expert-parallel group; the ranks with
    the same position in every group (``rank % G``) hold the same shard and form its replica
    group.  ``group``/``replica_group`` None means the default (whole-world) group / no replicas."""

    size: int
    rank: int
    group: Any
    replicas: int
    replica_group: Any

    def __deepcopy__(self, memo: dict) -> "ExpertParallelGroups":
        return self  # process groups are per-process singletons


_GROUPS: dict[tuple[int, int], ExpertParallelGroups] = {}  # one set of groups per (G, world)


def distributed_world_size() -> int:
    """Number of training processes; 1 when torch.distributed is not initialised."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def expert_parallel_groups(size: int) -> ExpertParallelGroups:
    """Create (once per process, on every rank in the same order) the groups for group size G."""
    world, rank = dist.get_world_size(), dist.get_rank()
    require(
        world % size == 0,
        f"--moe-expert-parallel-size ({size}) must divide the number of training processes "
        f"(--distributed-world-size {world})",
    )
    key = (size, world)
    if key not in _GROUPS:
        group = replica_group = None
        if size < world:  # new_group is collective: all ranks create all groups, in one order
            for start in range(0, world, size):
                created = dist.new_group(list(range(start, start + size)))
                group = created if start <= rank < start + size else group
            for position in range(size):
                created = dist.new_group(list(range(position, world, size)))
                replica_group = created if rank % size == position else replica_group
        _GROUPS[key] = ExpertParallelGroups(size, rank % size, group, world // size, replica_group)
    return _GROUPS[key]


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows; backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(  # noqa: ANN001
        ctx, rows: Tensor, recv_splits: list, send_splits: list, group: Any, on_backward: Optional[Callable]
    ) -> Tensor:
        ctx.splits, ctx.group, ctx.on_backward = (recv_splits, send_splits), group, on_backward
        out = rows.new_empty((sum(recv_splits),) + tuple(rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple:  # noqa: ANN001
        recv_splits, send_splits = ctx.splits
        if ctx.on_backward is not None:
            ctx.on_backward()
        out = grad.new_empty((sum(send_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient: 1/G for expert weights (module doc)."""

    @staticmethod
    def forward(ctx, tensor: Tensor, scale: float) -> Tensor:  # noqa: ANN001
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple:  # noqa: ANN001
        return grad * ctx.scale, None


class ExpertParallelSwitchFFN(SwitchFFN):
    """``SwitchFFN`` whose experts are sharded over an expert-parallel group of G ranks.

    SwitchFFN's config plus ``expert_parallel_size`` (G).  ``max_experts`` and
    ``num_experts`` stay global counts; ``fc1_weight`` etc. hold this rank's
    ``max_experts / G`` slots (global expert ``e`` = local slot ``e // G`` of rank ``e % G``).
    The router is replicated; routing, capacity and auxiliary losses are SwitchFFN's on this
    rank's tokens (only ``dispatch`` differs).  Needs torch.distributed initialised with a world
    size that G divides; every rank of the group must call forward (and backward) for every batch.
    """

    def __init__(self, cfg: SwitchFFNConfig, expert_parallel_size: int) -> None:
        super().__init__(cfg)  # full-size init, so rank shards equal one process's
        size = expert_parallel_size
        require(size >= 2, f"--moe-expert-parallel-size must be >= 2 to shard experts (got {size})")
        require(cfg.expert_kernel != "compiled",
                "--moe-expert-kernel compiled runs every expert on this rank; with "
                "--moe-expert-parallel-size use --moe-expert-kernel batched or auto")
        require(
            self.max_experts % size == 0,
            f"expert slots ({self.max_experts}, --moe-max-experts or --moe-experts) must be divisible by "
            f"--moe-expert-parallel-size ({size})",
        )
        self.groups = expert_parallel_groups(size)
        self.local_slots = self.max_experts // size
        with torch.no_grad():
            for name in EXPERT_PARAMETERS:
                shard = nn.Parameter(getattr(self, name).data[self.groups.rank :: size].clone())
                shard.expert = True  # fairseq: skip in the data-parallel all-reduce and grad norm
                setattr(self, name, shard)

    def expert_parameters(self) -> list[nn.Parameter]:
        return [getattr(self, name) for name in EXPERT_PARAMETERS]

    def reset_parameters(self) -> None:
        """SwitchFFN's init of all ``max_experts`` slots, then keep this rank's rows (in place, so
        the optimizer's tensors stay the same; ``--stage-init scratch`` relies on that)."""
        if self.fc1_weight.shape[0] == self.max_experts:  # inside SwitchFFN.__init__: full-size
            super().reset_parameters()
            return
        shards = {name: self._parameters[name] for name in EXPERT_PARAMETERS}
        try:
            for name, shard in shards.items():
                full_shape = (self.max_experts,) + tuple(shard.shape[1:])
                self._parameters[name] = nn.Parameter(shard.new_empty(full_shape))
            super().reset_parameters()
            full = {name: self._parameters[name].data for name in EXPERT_PARAMETERS}
        finally:
            self._parameters.update(shards)
        with torch.no_grad():
            for name, shard in shards.items():
                shard.copy_(full[name][self.groups.rank :: self.groups.size])

    # ---- checkpoints: full [E, ...] tensors, like SwitchFFN ------------------------------------
    def gather_full(self, shard: Tensor) -> Tensor:
        """(E/G, ...) shard of every rank -> (E, ...) in global expert order (collective)."""
        pieces = [torch.empty_like(shard) for _ in range(self.groups.size)]
        dist.all_gather(pieces, shard.detach().contiguous(), group=self.groups.group)
        return torch.stack(pieces, dim=1).reshape((self.max_experts,) + tuple(shard.shape[1:]))

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in EXPERT_PARAMETERS:
            destination[prefix + name] = self.gather_full(getattr(self, name))

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        for name in EXPERT_PARAMETERS:
            full = state_dict.get(prefix + name)
            if full is not None and full.shape[0] != self.max_experts:
                raise UsageError(
                    f"checkpoint tensor {prefix + name} has {full.shape[0]} experts but the model has "
                    f"{self.max_experts} slots: use the same --moe-experts / --moe-max-experts"
                )
            if full is not None:
                state_dict[prefix + name] = full[self.groups.rank :: self.groups.size]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ---- forward: SwitchFFN.forward (routing, aux losses of this rank's tokens) + this dispatch
    def dispatch(self, tokens: Tensor, routing: Top1Routing) -> Tensor:
        """Send kept tokens to their experts' ranks, run the local experts, bring results back."""
        return self.exchange(tokens, routing)

    def exchange(self, tokens: Tensor, routing: Top1Routing) -> Tensor:
        """(T, d) tokens -> (T, d) gate-scaled expert outputs; 0 for dropped and padding tokens."""
        size, slots, group = self.groups.size, self.local_slots, self.groups.group
        kept = routing.keep.nonzero().squeeze(1)  # (K,)
        expert = routing.expert.index_select(0, kept)  # (K,) global ids
        destination = (expert % size) * slots + expert // size  # (K,) owner rank * slots + slot
        index = kept.index_select(0, torch.argsort(destination, stable=True))  # (K,) send order
        send_counts = torch.bincount(destination, minlength=size * slots).view(size, slots)
        recv_counts = torch.empty_like(send_counts)  # (G, L): [source rank, my local slot]
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()

        sent = tokens.index_select(0, index)  # (K, d)
        received = _AllToAll.apply(sent, recv_splits, send_splits, group, None)  # (R, d)
        results = self.run_local_experts(received, recv_counts)  # (R, d)
        replicated = self.groups.replicas > 1 and torch.is_grad_enabled()
        sync = self._average_replica_grads if replicated else None
        returned = _AllToAll.apply(results, send_splits, recv_splits, group, sync)  # (K, d)
        gate = routing.gate.index_select(0, index).to(tokens.dtype).unsqueeze(-1)  # (K, 1)
        return tokens.new_zeros(tokens.shape).index_copy(0, index, returned * gate)  # (T, d)

    def run_local_experts(self, received: Tensor, recv_counts: Tensor) -> Tensor:
        """Rows arrive grouped by (source rank, local slot); run each local expert on its rows."""
        size, slots = recv_counts.shape
        slot_ids = torch.arange(slots, device=received.device).repeat(size)  # (G * L,)
        slot_of_row = slot_ids.repeat_interleave(recv_counts.flatten())  # (R,)
        order = torch.argsort(slot_of_row, stable=True)  # (R,) expert-major
        rows = received.index_select(0, order)  # (R, d)
        weights = self.expert_parameters()
        needs_grad = torch.is_grad_enabled() and self.fc1_weight.requires_grad
        if needs_grad:  # each expert's gradient sums the tokens of all G ranks: see module doc
            weights = [_ScaleGrad.apply(w, 1.0 / size) for w in weights]
        out = self._run_experts(rows, weights, recv_counts.sum(0).tolist())  # (R, d)
        if needs_grad and not self._segment_kernel(rows):  # the fused kernel already gives idle
            # slots zero gradients; with autograd, every local expert still gets a (possibly zero)
            # gradient on every rank, as the stacked tensors of one SwitchFFN do
            out = out + 0.0 * sum(w.sum() for w in weights)
        return received.new_zeros(received.shape).index_copy(0, order, out)  # (R, d)

    def _average_replica_grads(self) -> None:
        """At the end of backward, average the gradients of the W/G copies of this shard.

        Averaging is idempotent on already-equal parts, so it is correct after every backward of
        a gradient accumulation (--update-freq) too.
        """

        def average() -> None:
            for param in self.expert_parameters():
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad, group=self.groups.replica_group)
                param.grad.div_(self.groups.replicas)

        torch.autograd.Variable._execution_engine.queue_callback(average)


def check_expert_parallel_size(num_experts: int, expert_parallel_size: int) -> None:
    """``--moe-expert-parallel-size`` the experts can be split by: every rank holds the same
    number of experts (checked when the model is built, and by fairseq-train before that)."""
    require(
        expert_parallel_size >= 1,
        f"--moe-expert-parallel-size must be an integer >= 1 (got {expert_parallel_size})",
    )
    if expert_parallel_size > 1:
        require(
            num_experts % expert_parallel_size == 0,
            f"--moe-experts ({num_experts}) must be divisible by --moe-expert-parallel-size "
            f"({expert_parallel_size}): every rank holds the same number of experts",
        )


_EXPERTS_WHOLE = [False]  # set in a scoring process (``build_experts_whole``)


def build_experts_whole() -> None:
    """From now on every rank of this process's job builds every expert: fairseq's scoring
    commands on several processes (``fairseq_glue/scoring_commands.py``).  Scoring gives ranks
    unequal numbers of batches, so a sharded layer's all_to_all would wait forever on the rank
    with one batch more; a checkpoint holds whole experts, so nothing else changes."""
    _EXPERTS_WHOLE[0] = True


def build_switch_ffn(cfg: SwitchFFNConfig, expert_parallel_size: int = 1) -> SwitchFFN:
    """``SwitchFFN(cfg)``, sharded over ``expert_parallel_size`` ranks when training runs on
    several processes.  A single process (e.g. fairseq-eval-lm on a checkpoint of an
    expert-parallel run), or a scoring job (``build_experts_whole``), holds all experts: the
    checkpoint layout is the same."""
    check_expert_parallel_size(cfg.num_experts, expert_parallel_size)
    if expert_parallel_size == 1 or distributed_world_size() == 1 or _EXPERTS_WHOLE[0]:
        return SwitchFFN(cfg)
    return ExpertParallelSwitchFFN(cfg, expert_parallel_size)
