"""Expert growth for Switch LMs (ALMA §5 "growing setting", Table 2 gMoE: 4 -> 6 -> 8 -> 12).

At a stage boundary, in every MoE block, the k experts with the largest total validation loss
(summed NLL of the validation tokens routed to them) are copied into free expert slots: expert
weights, their router row, and their optimizer moments.  Slots were allocated up front
(``--moe-max-experts``), so fairseq's optimizer and data-parallel gradient synchronisation
already cover the new experts: they are the same parameter tensors, now with more active rows.
Under ``--fp16``/``--bf16`` the rows are copied inside the fp32 master copy too, and nothing else
in it changes: every other weight keeps the fp32 digits its half-precision value cannot hold.

An exact copy of the router row would tie with its source: top-1 argmax always picks the lower
index, so the copy would never receive a token and never train (a 2-rank test caught this).  The
copied row therefore gets a small seeded perturbation +eps and the source -eps (relative size
``ROUTER_TIE_BREAK``), which splits the source's tokens between the two while their gates stay
almost unchanged; the softmax still shares the source's probability mass, so the loss changes a
little (the paper notes this flat-mixture growth is slightly worse than the tree split of App. A
but easier at scale).  ``grow_experts`` returns the validation loss right before and right after.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List

import torch

from ..errors import UsageError
from ..modules.switch_ffn import SwitchFFN
from ..ranks import world
from ..stream.growth_plan import parse_growth_plan  # its home is stream/ (torch-free comparisons)
from .nll import Batching, needs_lockstep, scored_batches
from .stage_start import master_param_like, optimizer_state_like

logger = logging.getLogger(__name__)
EXPERT_PARAMS = ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")
ROUTER_TIE_BREAK = 1e-2  # perturbation of a copied router row, relative to the row's RMS


@contextmanager
def recorded_routing(layers: List[SwitchFFN]) -> Iterator[List[List[torch.Tensor]]]:
    """Collect each layer's per-token expert ids (B*T order) for the forwards in the block."""
    records: List[List[torch.Tensor]] = [[] for _ in layers]
    handles = []
    for i, layer in enumerate(layers):
        def hook(module: SwitchFFN, args: tuple, output: tuple, i: int = i) -> None:
            records[i].append(output[1].expert_ids)
        handles.append(layer.register_forward_hook(hook))
        layer.record_expert_ids = True
    try:
        yield records
    finally:
        for layer, handle in zip(layers, handles):
            handle.remove()
            layer.record_expert_ids = False


def expert_validation_losses(model: Any, task: Any, dataset: Any, batch_size: int) -> tuple[List[torch.Tensor], float]:
    """Per MoE block, the summed NLL (nats) of validation tokens routed to each active expert;
    and the mean validation NLL per token (over every data-parallel worker)."""
    import torch.distributed as dist

    if needs_lockstep(model):
        raise UsageError("--grow-experts does not support --moe-expert-parallel-size > 1")
    layers = model.moe_layers()
    device = next(model.parameters()).device
    size, rank = world()
    sums = [torch.zeros(layer.num_experts + 1, dtype=torch.float64, device=device) for layer in layers]
    total = torch.zeros(2, dtype=torch.float64, device=device)
    with recorded_routing(layers) as records:
        for batch in scored_batches(model, task, dataset, Batching(batch_size), num_shards=size, shard_id=rank):
            nll = -batch.token_log_probs.reshape(-1).double()  # (B*T,), 0 at padding
            total[0] += nll.sum()
            total[1] += batch.mask.sum()
            for layer_sums, rec in zip(sums, records):
                layer_sums.index_add_(0, rec[-1], nll)  # padding goes to the extra last bin
                rec.clear()
    if size > 1:
        for layer_sums in sums:
            dist.all_reduce(layer_sums)
        dist.all_reduce(total)
    return [s[:-1] for s in sums], float(total[0] / total[1].clamp(min=1))


def _copy_optimizer_rows(optimizer: Any, param: torch.nn.Parameter, src: List[int], dst: List[int]) -> None:
    """Copy the optimizer state rows (Adam's moments) of expert ``src`` slots into ``dst``, in
    whatever layout the precision flags keep them (``stage_start.optimizer_state_like``)."""
    for value in optimizer_state_like(optimizer, param):
        value[dst] = value[src]


@torch.no_grad()
def copy_experts(layer: SwitchFFN, sources: List[int], optimizer: Any = None, seed: int = 0) -> List[int]:
    """Copy experts ``sources`` of ``layer`` into its next free slots; returns the new slot ids."""
    start = layer.num_experts
    if start + len(sources) > layer.max_experts:
        raise ValueError(
            f"growing to {start + len(sources)} experts needs --moe-max-experts >= {start + len(sources)} "
            f"(allocated: {layer.max_experts})"
        )
    new = list(range(start, start + len(sources)))
    for name in EXPERT_PARAMS:
        param = getattr(layer, name)
        param.data[new] = param.data[sources]
        if optimizer is not None:
            _copy_optimizer_rows(optimizer, param, sources, new)
            master = master_param_like(optimizer, param)
            if master is not None:  # the model's rows are its rounding: copy the exact ones
                master[new] = master[sources]
    router = layer.router.weight
    master = master_param_like(optimizer, router) if optimizer is not None else None
    rows = (master if master is not None else router.data)[sources].float()  # (k, d)
    generator = torch.Generator().manual_seed(seed)  # same on every data-parallel rank
    noise = torch.randn(rows.shape, generator=generator).to(rows.device)
    noise = noise * ROUTER_TIE_BREAK * rows.pow(2).mean(dim=1, keepdim=True).sqrt()
    router.data[new] = (rows + noise).to(router.dtype)
    router.data[sources] = (rows - noise).to(router.dtype)
    if master is not None:
        master[new] = rows + noise
        master[sources] = rows - noise
    if optimizer is not None:
        _copy_optimizer_rows(optimizer, router, sources, new)
    layer.set_num_experts(start + len(sources))
    return new


def grow_experts(model: Any, task: Any, dataset: Any, k: int, batch_size: int, optimizer: Any = None,
                 seed: int = 0) -> Dict[str, Any]:
    """One growth step over every MoE block; returns what was copied and the validation loss
    (mean NLL per token, nats) right before and right after."""
    losses, before = expert_validation_losses(model, task, dataset, batch_size)
    copied: Dict[int, List[int]] = {}
    for i, (layer, layer_losses) in enumerate(zip(model.moe_layers(), losses)):
        top = torch.topk(layer_losses, min(k, layer.num_experts)).indices.tolist()
        copied[i] = top
        copy_experts(layer, top, optimizer, seed=seed * 1000 + i)
    _, after = expert_validation_losses(model, task, dataset, batch_size)
    experts = model.moe_layers()[0].num_experts if model.moe_layers() else 0
    logger.info("grew to %d experts per MoE block (copied %s); valid nll %.4f -> %.4f", experts, copied, before, after)
    return {"experts": experts, "copied": copied, "valid_nll_before": before, "valid_nll_after": after}


def check_growth_schedule(grow_experts: str, grow_at_stages: str, num_stages: int, experts: int,
                          stage_init: str = "continue") -> None:
    """Growth requests that ``parse_growth_plan`` would shrink or drop, refused before a training
    run takes its run directory (not in ``parse_growth_plan``: a run already trained is still
    scored with its own flags).

    * no stage to grow at: growth happens at the start of stage 2 or later, so a stream of one
      stage (e.g. ``--wait`` = B) would train an SM model and report it as gMoE;
    * ``--grow-at-stages`` not strictly increasing: a repeated stage collapses into one growth;
    * a step larger than the experts at that point: a step copies the top-k experts by validation
      loss (the paper's LM setup: "copy the expert weights and gating network weights
      corresponding to the top-k experts incurring the largest loss"), so k experts
      need k to choose from; ``grow_experts`` would copy fewer.
    * ``--stage-init scratch``: each stage starts from a freshly initialised model, so the
      experts a growth step copies (and the validation losses that chose them, which its record
      reports) would be thrown away at once.
    * ``--grow-at-stages`` without ``--grow-experts``: no step to take, so the run trained an SM
      model with its stages recorded as a growth schedule in ``run.json``.
    ``experts``: experts per MoE block before the first growth."""
    if not grow_experts.strip():
        if grow_at_stages.strip():
            raise UsageError(f"--grow-at-stages {grow_at_stages} without --grow-experts grows "
                             f"nothing; add --grow-experts k (experts copied per MoE block at each "
                             f"of those stages), or drop --grow-at-stages")
        return
    if str(getattr(stage_init, "value", stage_init)) == "scratch":
        raise UsageError(f"--grow-experts {grow_experts} with --stage-init scratch: every stage starts "
                         f"from a fresh model, so the experts a growth step copies would be discarded; "
                         f"drop one of them (a larger fresh model is another run: raise --moe-experts)")
    plan = parse_growth_plan(grow_experts, grow_at_stages, num_stages)
    if not plan:
        raise UsageError(f"--grow-experts {grow_experts} has no stage to grow at: the stream trains "
                         f"{num_stages} stage(s) and experts grow at the start of stage 2 or later; "
                         f"lower --wait, or drop --grow-experts")
    stages = [int(s) for s in grow_at_stages.split(",")] if grow_at_stages.strip() else sorted(plan)
    if any(later <= earlier for earlier, later in zip(stages, stages[1:])):
        raise UsageError(f"--grow-at-stages {grow_at_stages} must list each stage once, in increasing "
                         f"order (a repeated stage would grow once); give one stage per step, e.g. "
                         f"--grow-at-stages 2,3")
    for stage in stages:
        k = plan[stage]
        if k > experts:
            raise UsageError(f"--grow-experts {grow_experts}: stage {stage} would copy {k} experts but "
                             f"the model has {experts} then (a growth step copies the top-k experts "
                             f"by validation loss); use k <= {experts} at that stage, or more --moe-experts")
        experts += k
