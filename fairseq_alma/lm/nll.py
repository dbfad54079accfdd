"""The one loop that scores a language model token by token (paper §6.2: perplexity).

Three users share it: the ``alma_stream`` task after every arrival (eval and valid perplexity),
``alma-score`` (single models and ensemble members) and LM growth (the validation loss of the
tokens each expert received).  Every one of them scores exactly the tokens ``fairseq-eval-lm``
scores with the same ``--tokens-per-sample`` and no context window: every non-padding target of
the dataset's blocks, in the dataset's fixed batch order, with the model in eval mode (no
dropout, evaluation capacity).  Sums are taken in float64, so a perplexity does not depend on
how the tokens were batched beyond float32 rounding of each token's log-probability.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from fairseq import utils
from torch import Tensor

from ..ranks import world
from .block_lengths import check_blocks_fit


@dataclass(frozen=True)
class Batching:
    """How evaluation batches are made (the run's --batch-size-valid / --max-tokens-valid)."""

    batch_size: int | None
    max_tokens: int | None = None


@dataclass
class ScoredBatch:
    """One batch's scores: ``token_log_probs[b, t]`` = log p(target) (0 at padding)."""

    sample: dict[str, Any]
    token_log_probs: Tensor  # (B, T) float32
    mask: Tensor  # (B, T) bool: scored (non-padding) targets


def needs_lockstep(model: Any) -> bool:
    """True when every rank must run every forward (experts sharded with all_to_all)."""
    from ..modules.expert_parallel import ExpertParallelSwitchFFN

    return any(isinstance(m, ExpertParallelSwitchFFN) for m in model.modules())


def scored_batches(model: Any, task: Any, dataset: Any, batching: Batching, num_shards: int = 1,
                   shard_id: int = 0, prefetch: int = 0) -> Iterator[ScoredBatch]:
    """Score ``dataset`` batch by batch (this shard's batches), model in eval mode meanwhile.

    ``prefetch`` > 0 collates that many batches ahead in a background thread (as
    ``fairseq-eval-lm``).  The batch iterator is built here, before the first ``next``, so a
    caller that times the loop times scoring only.
    """
    batches = eval_batches([model], task, dataset, batching, num_shards, shard_id, prefetch)
    return _score(model, batches, task.target_dictionary.pad())


def eval_batches(models: list[Any], task: Any, dataset: Any, batching: Batching,
                 num_shards: int = 1, shard_id: int = 0, prefetch: int = 0) -> Iterator[dict]:
    """The evaluation samples of ``dataset`` in their fixed order (no shuffling, seed 1): the same
    batches whichever model scores them. Every block must fit every one of ``models``
    (``block_lengths``): one that does not is refused, not left out of the score."""
    positions = utils.resolve_max_positions(task.max_positions(),
                                            *(model.max_positions() for model in models))
    split = next((name for name, held in task.datasets.items() if held is dataset), "the split scored")
    check_blocks_fit(dataset, positions, split)  # ignore_invalid_inputs below then drops nothing
    return task.get_batch_iterator(
        dataset=dataset, max_tokens=batching.max_tokens, max_sentences=batching.batch_size,
        max_positions=positions, ignore_invalid_inputs=True, num_shards=num_shards,
        shard_id=shard_id, num_workers=0, seed=1, data_buffer_size=prefetch,
    ).next_epoch_itr(shuffle=False)


def target_log_probs(model: Any, sample: dict[str, Any], pad: int) -> tuple[Tensor, Tensor]:
    """log p(target) of every target of ``sample`` (0 at padding) and the non-padding mask,
    both (B, T); float32 whatever the model's precision (fairseq's log_softmax upcasts)."""
    output = model(**sample["net_input"])
    lprobs = model.get_normalized_probs(output, log_probs=True).float()  # (B, T, V)
    target = sample["target"]  # (B, T)
    mask = target.ne(pad)
    token = lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1).masked_fill(~mask, 0.0)
    return token, mask


@torch.no_grad()
def _score(model: Any, batches: Any, pad: int) -> Iterator[ScoredBatch]:
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    lockstep = needs_lockstep(model)
    last = None
    try:
        for sample in batches:
            if not sample or "net_input" not in sample:  # a rank with no batch left
                if lockstep and last is not None:  # expert-parallel peers wait for its tokens
                    model(**last["net_input"])
                continue
            if device.type == "cuda":
                sample = utils.move_to_cuda(sample, device=device)
            last = sample
            yield ScoredBatch(sample, *target_log_probs(model, sample, pad))
    finally:
        model.train(was_training)


def total_nll(model: Any, task: Any, dataset: Any, batching: Batching) -> tuple[float, int]:
    """Summed NLL in nats and the number of scored tokens, over every data-parallel worker:
    each scores its shard of the batches (batch i is rank i % N's), and every rank adds all of
    the batches' sums in batch order, as one process does, so the total is one process's to the
    last bit (rank sums added together associate the float64 additions differently)."""
    from .score_distributed import rows_in_batch_order

    size, rank = world()
    device = next(model.parameters()).device
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    rows: list[Tensor] = []
    for batch in scored_batches(model, task, dataset, batching, num_shards=size, shard_id=rank):
        nll, count = -batch.token_log_probs.double().sum(), batch.mask.sum()
        if size > 1:
            rows.append(torch.stack([nll, count.double()]))
        else:
            totals[0] += nll
            totals[1] += count
    if size == 1:
        return float(totals[0]), int(totals[1])
    nll_sum, tokens = 0.0, 0
    for nll, count in rows_in_batch_order(torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64)):
        nll_sum += nll
        tokens += int(count)
    return nll_sum, tokens


def non_finite_loss(nll_sum: float, model: Any) -> str | None:
    """Why a summed loss is not a number (None when it is), said about ``model``'s weights.

    Why: a NaN or infinite loss becomes a NaN perplexity in a table, and the stream's averages
    spread it to every number they touch; refusing it with its cause says what to do.  The
    weights tell the causes apart: NaN or infinite ones (a damaged file, a run that diverged, or
    values beyond half precision's range once halved) or finite ones whose log-probabilities
    overflow (half precision)."""
    if math.isfinite(nll_sum):
        return None
    bad = sum(int((~torch.isfinite(p)).sum()) for p in model.parameters())
    half = next(model.parameters()).dtype in (torch.float16, torch.bfloat16)
    where = " in half precision" if half else ""
    if bad:
        return f"its loss is {nll_sum}: {bad:,} of its weights are NaN or infinite{where}"
    return f"its loss is {nll_sum} although its weights are finite: a log-probability overflows{where}"
