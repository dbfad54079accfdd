"""A fixed slice of the evaluation mega-batch for ``alma-score --max-eval-tokens`` (paper §6.2).

Why a slice: the paper's evaluation mega-batch holds about 440M words, and scoring every stage
checkpoint of every run on all of it costs more than a cluster job may take.  A perplexity on a
subset is only comparable with another on the *same* subset, so the slice is not sampled: it is
the split's first blocks in index order (the order the split's text was written in; alma-data-prep
already shuffled documents into mega-batches), as many whole blocks as fit in N tokens.  Every
checkpoint and every ensemble member therefore scores the very same tokens, and the numbers
recorded here (``EvalSlice``) say which, so reports can refuse to mix slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from fairseq.data import BaseWrapperDataset

from ..errors import UsageError


@dataclass(frozen=True)
class EvalSlice:
    """Which part of a split is scored: blocks ``0..blocks-1`` of ``total_blocks``."""

    blocks: int
    tokens: int  # scored targets in those blocks
    total_blocks: int
    total_tokens: int
    max_tokens: int | None  # the --max-eval-tokens asked for (None: the whole split)

    @property
    def whole(self) -> bool:
        return self.blocks == self.total_blocks

    def as_json(self) -> dict[str, Any]:
        """The fields ``alma-score --json`` records (and ``alma-report`` compares)."""
        return {"eval_tokens": self.tokens, "eval_tokens_total": self.total_tokens,
                "eval_blocks": self.blocks, "eval_blocks_total": self.total_blocks,
                "max_eval_tokens": self.max_tokens}

    def describe(self, subset: str) -> str:
        """One line for under a table: what the perplexities were computed on."""
        if self.whole:
            return (f"--max-eval-tokens {self.max_tokens:,} covers the whole '{subset}' split "
                    f"({self.total_tokens:,} tokens): every token scored")
        return (f"perplexity on the first {self.tokens:,} of {self.total_tokens:,} tokens of "
                f"'{subset}' (blocks 0..{self.blocks - 1} of {self.total_blocks}, "
                f"--max-eval-tokens {self.max_tokens:,})")


def first_blocks(sizes: np.ndarray, max_tokens: int | None) -> EvalSlice:
    """The longest prefix of blocks (index order) holding at most ``max_tokens`` tokens.

    ``sizes[i]`` is block i's number of scored targets.  ``max_tokens`` None, or at least the
    split's size, gives the whole split.  A first block larger than ``max_tokens`` is refused:
    a slice of no token would give no perplexity.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    if max_tokens is None or max_tokens >= total:
        return EvalSlice(len(sizes), total, len(sizes), total, max_tokens)
    blocks = int(np.searchsorted(np.cumsum(sizes), max_tokens, side="right"))
    if blocks == 0:
        raise UsageError(f"--max-eval-tokens {max_tokens} is smaller than the split's first "
                         f"block ({int(sizes[0])} tokens); pass at least {int(sizes[0])}")
    return EvalSlice(blocks, int(sizes[:blocks].sum()), len(sizes), total, max_tokens)


class PrefixDataset(BaseWrapperDataset):
    """The first ``blocks`` items of a fairseq dataset, batched as the whole one would be:
    ``ordered_indices`` keeps the wrapped dataset's (seeded) order, restricted to the prefix."""

    def __init__(self, dataset: Any, blocks: int) -> None:
        super().__init__(dataset)
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.blocks:
            raise IndexError(f"block {index} is outside the scored slice 0..{self.blocks - 1}")
        return self.dataset[index]

    @property
    def sizes(self) -> np.ndarray:
        return self.dataset.sizes[: self.blocks]

    def ordered_indices(self) -> np.ndarray:
        indices = self.dataset.ordered_indices()
        return indices[indices < self.blocks]


def slice_dataset(dataset: Any, max_tokens: int | None) -> tuple[Any, EvalSlice]:
    """``dataset`` cut to ``first_blocks`` (itself when the slice is the whole split)."""
    chosen = first_blocks(dataset.sizes, max_tokens)
    return (dataset if chosen.whole else PrefixDataset(dataset, chosen.blocks)), chosen

