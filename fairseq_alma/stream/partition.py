"""Seeded split of a training set into B mega-batches, each with its own validation part.

Paper §5 "Datasets": "we randomly partition the training set into B mega-batches with equal
number of training examples (B = 100 for CIFAR, B = 500 for MNIST ...), from each mega-batch we
extract 10% of the data to build the mega-batch validation set" (App. B.1: "For each megabatch
received, we keep 10% of the data to perform cross-validation").  The learner may only select
hyper-parameters / epochs on the validation part of the data it has (§3.1), never the test set.

Randomness comes from a local ``numpy.random.Generator`` seeded with ``seed``: the split is a pure
function of (n, B, seed, valid_fraction), and nothing else in the process (global numpy RNG,
torch, fairseq) changes it or is changed by it.  Continuum's ALMA scenario seeds the *global*
numpy RNG instead, which silently couples the split to every other random draw.

Remainder: when B does not divide n, the first ``n mod B`` mega-batches hold one example more
than the others (sizes differ by at most 1; no example is dropped), as ``numpy.array_split``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Megabatch:
    """Indices into the full training set for one mega-batch.

    Attributes:
        index: 0-based mega-batch id (D_{index+1} in the paper).
        train: sorted int64 indices the learner trains on.
        valid: sorted int64 indices held out for the learner's own model selection.
    """

    index: int
    train: np.ndarray
    valid: np.ndarray

    @property
    def size(self) -> int:
        """Examples in this mega-batch (train + valid)."""
        return int(self.train.size + self.valid.size)


def valid_count(size: int, valid_fraction: float) -> int:
    """Examples held out from a mega-batch of ``size``: round-half-up of ``valid_fraction * size``,
    at most ``size - 1`` so the learner always has something to train on."""
    if size <= 1:
        return 0
    return min(size - 1, math.floor(valid_fraction * size + 0.5))


def partition_indices(
    n: int, num_megabatches: int, seed: int, valid_fraction: float = 0.0
) -> list[Megabatch]:
    """Randomly partition ``range(n)`` into ``num_megabatches`` disjoint, complete mega-batches.

    >>> [mb.size for mb in partition_indices(10, 3, seed=0)]
    [4, 3, 3]
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"the training set must hold at least 1 example (got n={n!r})")
    if (
        isinstance(num_megabatches, bool)
        or not isinstance(num_megabatches, (int, np.integer))
        or num_megabatches < 1
    ):
        raise ValueError(f"--num-megabatches must be an integer >= 1 (got {num_megabatches!r})")
    if num_megabatches > n:
        raise ValueError(
            f"--num-megabatches {num_megabatches} is larger than the training set ({n} examples); "
            f"use at most {n}"
        )
    if not (isinstance(valid_fraction, (int, float)) and 0.0 <= valid_fraction < 1.0):
        raise ValueError(
            f"the validation fraction must be in [0, 1) (got {valid_fraction!r}); "
            f"the paper uses 0.1"
        )
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"--seed must be an integer >= 0 (got {seed!r})")
    rng = np.random.default_rng(int(seed))
    order = rng.permutation(int(n)).astype(np.int64)
    megabatches = []
    for index, block in enumerate(np.array_split(order, int(num_megabatches))):
        # ``block`` is already a uniformly random subset in random order: its first k entries are
        # a uniformly random validation subset, no second draw needed.
        k = valid_count(block.size, float(valid_fraction))
        megabatches.append(
            Megabatch(index=index, train=np.sort(block[k:]), valid=np.sort(block[:k]))
        )
    return megabatches
