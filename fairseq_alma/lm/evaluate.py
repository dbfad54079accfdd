"""Perplexity of a model on a dataset: the stream's per-arrival metric (paper §6.2).

Shared by the ``alma_stream`` task (after every arrival) and ``alma-score``.  Tokens are scored
exactly as ``fairseq-eval-lm`` scores them with the same --tokens-per-sample and no context
window: summed NLL of every non-padding target over the dataset's blocks.
"""

from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.distributed as dist
from fairseq import utils


def needs_lockstep(model: Any) -> bool:
    """True when every rank must run every forward (experts sharded with all_to_all)."""
    from ..modules.expert_parallel import ExpertParallelSwitchFFN

    return any(isinstance(m, ExpertParallelSwitchFFN) for m in model.modules())


def _world() -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


@torch.no_grad()
def evaluate_nll(model: Any, task: Any, dataset: Any, batch_size: int, max_tokens: int | None = None) -> Tuple[float, int]:
    """Summed NLL in nats and the number of scored tokens, over every data-parallel worker.

    Every worker scores its shard of the batches; sums are all-reduced so all get the total.
    The model is put in eval mode (no dropout, evaluation capacity) and restored afterwards.
    """
    world, rank = _world()
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    itr = task.get_batch_iterator(
        dataset=dataset, max_tokens=max_tokens, max_sentences=batch_size,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=True, num_shards=world, shard_id=rank, num_workers=0, seed=1,
    ).next_epoch_itr(shuffle=False)
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    pad = task.target_dictionary.pad()
    lockstep = needs_lockstep(model)
    last = None
    for sample in itr:
        if not sample or "net_input" not in sample:
            if lockstep and last is not None:  # expert-parallel peers wait for this rank's tokens
                model(**last["net_input"])
            continue
        last = sample
        sample = utils.move_to_cuda(sample, device=device) if device.type == "cuda" else sample
        net_output = model(**sample["net_input"])
        lprobs = model.get_normalized_probs(net_output, log_probs=True).float()
        target = sample["target"]
        nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        mask = target.ne(pad)
        totals[0] += nll[mask].sum().double()
        totals[1] += mask.sum()
    if world > 1:
        dist.all_reduce(totals)
    if was_training:
        model.train()
    return float(totals[0]), int(totals[1])
