"""A stage's batches: exactly its update budget, drawn from reshuffled passes over its data.

ALMA's LM runs train every stage for a fixed number of updates (paper §5: 120,000) whatever the
stage's data size, so the batch list is built ahead: pass p over the stage's examples is
shuffled with the seed (seed, stage, p), passes are concatenated until the budget is reached,
and the list is truncated.  Because the list is a pure function of (seed, stage, sizes, batch
flags), a resumed run re-creates it and fairseq's iterator state skips what was done.

With partial replay (``--replay-ratio``, ``stream/replay.py``) the list is assembled slot by slot
(one slot = one update's batches for every worker): new slots from passes over the stage's new
mega-batches (the same passes, in the same order, as without replay), replay slots from passes
over all earlier examples, drawn with their own seeds ``(seed, stage, pass, 1)``.
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
    source: int = 0,
) -> List[np.ndarray]:
    """Return exactly ``needed`` batches of example indices.

    Args:
        num_examples: examples in the stage's dataset.
        make_batches: groups an index order into batches (fairseq's batch_by_size with the
            run's --max-tokens/--batch-size), keeping the order it is given.
        needed: batches the stage must yield (updates x update_freq x data-parallel workers).
        seed, stage: the pass order is drawn with ``numpy_seed(seed, stage, pass)``.
        source: 0 for the stage's own data; another number draws an independent order
            (``numpy_seed(seed, stage, pass, source)``), for replayed data.
    """
    if num_examples < 1:
        raise ValueError(f"stage {stage} has no training examples")
    batches: List[np.ndarray] = []
    passes = 0
    while len(batches) < needed:
        seeds = (seed, stage, passes) if source == 0 else (seed, stage, passes, source)
        with data_utils.numpy_seed(*seeds):
            order = np.random.permutation(num_examples)
        batches.extend(make_batches(order))
        passes += 1
    return batches[:needed]


def spare_updates(budget: int) -> int:
    """Batches (in updates) a stage keeps beyond its budget, for steps the trainer skips:
    fp16's dynamic loss scaling skips tens to hundreds of steps in a 120k-update stage; a stage
    that needs more than 5% (at least 20) spare updates raises at its end (``StageClock``)."""
    return max(20, -(-budget // 20))


def interleave_slots(
    replay: Sequence[bool],
    per_slot: int,
    new_batches: Callable[[int], Sequence[np.ndarray]],
    replay_batches: Callable[[int], Sequence[np.ndarray]],
) -> List[np.ndarray]:
    """The stage's batch list, slot by slot: ``per_slot`` batches (one update of every worker)
    from ``replay_batches(n)`` where ``replay[slot]`` is True, else from ``new_batches(n)``.

    Each callable is asked once, for exactly the batches its slots take, so the new slots get
    the same batches, in the same order, whatever the ratio (and all of them when it is 0)."""
    replayed = sum(1 for flag in replay if flag) * per_slot
    new = list(new_batches(len(replay) * per_slot - replayed))
    old = list(replay_batches(replayed)) if replayed else []
    out: List[np.ndarray] = []
    taken_new = taken_old = 0
    for flag in replay:
        if flag:
            out.extend(old[taken_old:taken_old + per_slot])
            taken_old += per_slot
        else:
            out.extend(new[taken_new:taken_new + per_slot])
            taken_new += per_slot
    return out
