"""A stage's batches: exactly its update budget, drawn from reshuffled passes over its data.

ALMA's LM runs train every stage for a fixed number of updates (paper §5: 120,000) whatever the
stage's data size, so the batch list is built ahead: pass p over the stage's examples is
shuffled with the seed (seed, stage, p), passes are concatenated until the budget is reached,
and the list is truncated.  Because the list is a pure function of (seed, stage, sizes, batch
flags), a resumed run re-creates it and fairseq's iterator state skips what was done.
"""

from __future__ import annotations

from typing import Callable, List, Sequence

import numpy as np
from fairseq.data import data_utils


def fixed_budget_batches(
    num_examples: int,
    make_batches: Callable[[np.ndarray], Sequence[np.ndarray]],
    needed: int,
    seed: int,
    stage: int,
) -> List[np.ndarray]:
    """Return exactly ``needed`` batches of example indices.

    Args:
        num_examples: examples in the stage's dataset.
        make_batches: groups an index order into batches (fairseq's batch_by_size with the
            run's --max-tokens/--batch-size), keeping the order it is given.
        needed: batches the stage must yield (updates x update_freq x data-parallel workers).
        seed, stage: the pass order is drawn with ``numpy_seed(seed, stage, pass)``.
    """
    if num_examples < 1:
        raise ValueError(f"stage {stage} has no training examples")
    batches: List[np.ndarray] = []
    passes = 0
    while len(batches) < needed:
        with data_utils.numpy_seed(seed, stage, passes):
            order = np.random.permutation(num_examples)
        batches.extend(make_batches(order))
        passes += 1
    return batches[:needed]


def spare_updates(budget: int) -> int:
    """Batches (in updates) a stage keeps beyond its budget, for steps the trainer skips:
    fp16's dynamic loss scaling skips tens to hundreds of steps in a 120k-update stage; a stage
    that needs more than 5% (at least 20) spare updates raises at its end (``StageClock``)."""
    return max(20, -(-budget // 20))
