"""fairseq's Trainer with expert-parallel Switch layers: gradients, checkpoints, optimizer state.

Why this file exists: fairseq 0.12 assumes every rank holds the same parameters.  Expert shards
break three of its assumptions, each fixed here at the point fairseq offers for it:

- Gradient averaging.  legacy_ddp already skips parameters with ``param.expert`` (set by the
  layer); torch DDP (``--ddp-backend pytorch_ddp``/``c10d``) skips the names listed in
  ``model._ddp_params_and_buffers_to_ignore``, which ``prepare_expert_parallel`` fills.
- Saving (the Trainer patch is in ``patches.py``).  Only rank 0 writes checkpoints, but
  the expert shards are spread over the ranks, so ``state_dict()`` is a collective (the layer
  gathers the full [E, ...] tensors).  fairseq lets every rank call ``state_dict()`` during a
  save when ``Trainer.always_call_state_dict_during_save_checkpoint`` is true (made for FSDP);
  we make it true for models with expert shards.
- Optimizer state.  Adam's moments of an expert shard live on its rank.  The optimizer's own
  state_dict hooks gather them to full [E, ...] tensors on save and keep this rank's rows on load,
  so a resumed run continues exactly (an ``alma_stream`` run on the processes it started on:
  their number is in its ``run.json`` fingerprint).

Limits, refused with a one-line error: ``--zero-sharding os`` (fairscale's OSS broadcasts each
whole parameter from one owner rank, which would merge the ranks' different experts),
``--fp16`` without ``--memory-efficient-fp16``
(their flat fp32 copy mixes expert and shared gradients), sharded DDP backends, and
``--no-last-checkpoints`` (rank 0 could then skip a save the other ranks join).

- Gradient norm.  fairseq's ``clip_grad_norm_`` leaves ``param.expert`` out of the norm (then
  scales those gradients by the same factor): clipped by the shared gradients' norm alone, a run
  drifted from one process's (``--clip-norm``), and its logged ``gnorm`` left the experts out.
  ``norm_with_experts`` adds the squared norms of every rank's expert shards.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import require
from ..modules.expert_parallel import ExpertParallelSwitchFFN

DDP_BACKENDS = ("legacy_ddp", "no_c10d", "pytorch_ddp", "c10d")


def expert_parallel_layers(model: nn.Module) -> list[ExpertParallelSwitchFFN]:
    return [m for m in model.modules() if isinstance(m, ExpertParallelSwitchFFN)]


def prepare_expert_parallel(model: nn.Module) -> None:
    """Call once on the built model (before fairseq wraps it in DDP); no-op without shards."""
    if not expert_parallel_layers(model):
        return
    names = [name for name, param in model.named_parameters() if getattr(param, "expert", False)]
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    model._ddp_params_and_buffers_to_ignore = ignored + [n for n in names if n not in ignored]


def check_training_setup(cfg: Any) -> None:
    """One-line errors for fairseq options that cannot work with expert shards (module doc)."""
    common, training, checkpoint = cfg.common, cfg.distributed_training, cfg.checkpoint
    flat_master = common.fp16 and not (common.memory_efficient_fp16 or common.amp)
    require(
        not flat_master,
        "--moe-expert-parallel-size > 1 needs --memory-efficient-fp16 (or --amp) instead of plain "
        "--fp16: its flat fp32 copy mixes expert and shared gradients",
    )
    require(  # the same master copy under bf16 (flat or per parameter: the optimizer's state and
        # weights are the master's, which the expert shards' gathering and slicing do not see)
        not (common.bf16 and not common.memory_efficient_bf16),
        "--moe-expert-parallel-size > 1 needs --memory-efficient-bf16 instead of plain --bf16: its "
        "fp32 master copy is not kept per expert shard",
    )
    require(
        str(training.ddp_backend) in DDP_BACKENDS,
        f"--moe-expert-parallel-size > 1 works with --ddp-backend {' or '.join(DDP_BACKENDS)} "
        f"(got {training.ddp_backend})",
    )
    require(
        getattr(training, "zero_sharding", "none") == "none",
        "--moe-expert-parallel-size > 1 cannot be combined with --zero-sharding os: fairscale's OSS "
        "gives each whole parameter to one rank and broadcasts it, overwriting the other ranks' "
        "experts; use one of them",
    )
    require(
        not checkpoint.no_last_checkpoints,
        "--moe-expert-parallel-size > 1 cannot be used with --no-last-checkpoints: "
        "every rank takes part in each save",
    )


def norm_with_experts(layers: list[ExpertParallelSwitchFFN], shared_norm: torch.Tensor) -> torch.Tensor:
    """The gradient norm one process holding every expert would compute, from fairseq's norm of
    the shared gradients (``utils.clip_grad_norm_``'s ``aggregate_norm_fn``; the same scale as
    ``p.grad``): each expert lives on one rank of its group (replicas hold equal, already
    averaged gradients), so the shards' squared norms are summed over the group.  Collective:
    fairseq's Trainer clips (or measures, at ``--clip-norm 0``) on every rank at every step."""
    import torch.distributed as dist

    squares = torch.zeros((), dtype=torch.float32, device=shared_norm.device)
    for layer in layers:
        for param in layer.expert_parameters():
            if param.grad is not None:
                squares += param.grad.detach().float().pow(2).sum().to(squares.device)
    dist.all_reduce(squares, group=layers[0].groups.group)
    return (shared_norm.float() ** 2 + squares).sqrt()


def innermost_torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind fairseq's wrappers (FairseqOptimizer, MemoryEfficientFP16)."""
    for _ in range(5):
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    raise TypeError("expert parallelism: no torch optimizer found behind the fairseq optimizer")


def _indexed_params(optimizer: torch.optim.Optimizer) -> Iterator[tuple[int, torch.Tensor]]:
    """(index, param) as torch's Optimizer.state_dict numbers them."""
    seen, start = set(), 0
    for group in optimizer.param_groups:
        for index, param in enumerate(group["params"], start):
            if id(param) not in seen:
                seen.add(id(param))
                yield index, param
        start += len(group["params"])


def register_optimizer_hooks(optimizer: torch.optim.Optimizer, layers: list[ExpertParallelSwitchFFN]) -> None:
    """Optimizer state of expert shards as full [E, ...] tensors in checkpoints (module doc)."""
    owner = {id(p): layer for layer in layers for p in layer.expert_parameters()}
    optimizer.register_state_dict_post_hook(functools.partial(_map_state, owner=owner, convert=_gather))
    optimizer.register_load_state_dict_pre_hook(functools.partial(_map_state, owner=owner, convert=_slice))


def _map_state(optimizer: torch.optim.Optimizer, state_dict: dict, owner: dict, convert: Any) -> dict:
    """state_dict with ``convert(layer, param, value)`` applied to the expert parameters' state
    tensors (new dicts: the optimizer's live state is not touched)."""
    state = dict(state_dict["state"])
    for index, param in _indexed_params(optimizer):
        if id(param) in owner and index in state:
            entry = state[index]
            state[index] = {key: convert(owner[id(param)], param, entry[key]) for key in sorted(entry)}
    return {**state_dict, "state": state}


def _gather(layer: ExpertParallelSwitchFFN, param: torch.Tensor, value: Any) -> Any:
    """Collective: every rank's optimizer.state_dict() runs it in the same parameter order."""
    return layer.gather_full(value) if torch.is_tensor(value) and value.shape == param.shape else value


def _slice(layer: ExpertParallelSwitchFFN, param: torch.Tensor, value: Any) -> Any:
    full_shape = (layer.max_experts,) + tuple(param.shape[1:])
    if torch.is_tensor(value) and tuple(value.shape) == full_shape:
        return value[layer.groups.rank :: layer.groups.size]
    return value
