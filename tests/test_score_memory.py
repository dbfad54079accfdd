"""alma-score's scoring loop without fairseq around it: ensemble members scored batch by batch
(every prefix 1..k averaged in probability space, checked by hand in float64), memory that does
not grow with the evaluation set, and the --max-eval-tokens slice (which blocks, in which order).

The models are bigram tables (logits of the next token given the current one): enough of a
fairseq LM for ``score_jointly`` and small enough that every test runs in about a second.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from fairseq_alma.errors import UsageError
from fairseq_alma.lm.ensemble_eval import predictor_chains, score_jointly
from fairseq_alma.lm.eval_slice import PrefixDataset, first_blocks

VOCAB, PAD, ROWS, LENGTH = 12, 1, 8, 64


class Bigram(torch.nn.Module):
    """Next-token logits looked up from the current token."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.logits = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=generator))

    def forward(self, src_tokens: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.logits[src_tokens],)  # (B, T, V)

    def get_normalized_probs(self, output: tuple[torch.Tensor], log_probs: bool) -> torch.Tensor:
        return torch.log_softmax(output[0], dim=-1)


def samples(count: int, seed: int = 0, probe=None) -> Iterator[dict]:
    """``count`` fresh batches (the last row of each ends in padding); ``probe(i)`` runs before
    batch i is made, i.e. while the scorer holds whatever it keeps from batches 0..i-1."""
    generator = torch.Generator().manual_seed(seed)
    for i in range(count):
        if probe is not None:
            probe(i)
        tokens = torch.randint(2, VOCAB, (ROWS, LENGTH + 1), generator=generator)
        target = tokens[:, 1:].clone()
        target[-1, LENGTH // 2:] = PAD
        yield {"net_input": {"src_tokens": tokens[:, :-1]}, "target": target}


def reference_nll(models: list[Bigram], count: int) -> tuple[float, int]:
    """-Σ log((1/k) Σ_i p_i(target)) over non-padding targets, in probability space (float64)."""
    nll, ntokens = 0.0, 0
    with torch.no_grad():
        for sample in samples(count):
            probs = [torch.softmax(m(**sample["net_input"])[0].double(), -1) for m in models]
            target = sample["target"]
            p = torch.stack(probs).mean(0).gather(-1, target.unsqueeze(-1)).squeeze(-1)
            mask = target.ne(PAD)
            nll -= p[mask].log().sum().item()
            ntokens += int(mask.sum())
    return nll, ntokens


def test_every_prefix_is_its_members_probability_average():
    models = [Bigram(seed) for seed in (1, 2, 3)]
    scored = score_jointly(models, samples(5), PAD)
    assert scored.ntokens == 5 * (ROWS * LENGTH - LENGTH // 2)
    for k in (1, 2, 3):
        expected, ntokens = reference_nll(models[:k], 5)
        assert ntokens == scored.ntokens
        assert scored.prefix_nll[k - 1] == pytest.approx(expected, rel=1e-6)
    for i, model in enumerate(models):
        assert scored.member_nll[i] == pytest.approx(reference_nll([model], 5)[0], rel=1e-6)
    assert scored.prefix_nll[0] == scored.member_nll[0]  # one member: the plain sum, exactly


def _live_bytes() -> tuple[int, int]:
    """(bytes of every live tensor storage but parameters, bytes Python has allocated)."""
    gc.collect()
    python = tracemalloc.get_traced_memory()[0]
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and type(obj) is not torch.nn.Parameter:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()), python


def _peak_while_scoring(batches: int) -> tuple[int, int]:
    models = [Bigram(1), Bigram(2)]
    peaks = [0, 0]

    def probe(i: int) -> None:
        if i % 5 == 4:
            tensors, python = _live_bytes()
            peaks[0], peaks[1] = max(peaks[0], tensors), max(peaks[1], python)

    tracemalloc.start()
    try:
        score_jointly(models, samples(batches, probe=probe), PAD)
    finally:
        tracemalloc.stop()
    return peaks[0], peaks[1]


def test_memory_does_not_grow_with_the_evaluation_set():
    """Four times the batches, the same memory: a per-token vector kept for each member (the
    old design: 4 bytes a token, 30 batches × 512 tokens × 2 members = 120 KiB more here), or a
    list of Python floats, would exceed the bounds (one batch's sample, 8 KiB; 64 KiB of Python
    objects)."""
    small_tensors, small_python = _peak_while_scoring(10)
    large_tensors, large_python = _peak_while_scoring(40)
    one_batch = 2 * ROWS * (LENGTH + 1) * 8  # int64 tokens and targets
    assert large_tensors - small_tensors <= one_batch
    assert large_python - small_python <= 64 * 1024


def test_nested_predictors_form_one_chain():
    """gEns (members 1..s) is one chain, each checkpoint loaded once; Ens and single models
    restart at every stage; an initial model that later predictors do not extend is its own."""
    gens = {0: ["init"], 1: ["a"], 2: ["a", "b"], 3: ["a", "b", "c"]}
    assert predictor_chains(gens) == [(["init"], [0]), (["a", "b", "c"], [1, 2, 3])]
    ens = {1: ["m1/s1", "m2/s1"], 2: ["m1/s2", "m2/s2"]}
    assert predictor_chains(ens) == [(["m1/s1", "m2/s1"], [1]), (["m1/s2", "m2/s2"], [2])]


@pytest.mark.parametrize("limit, blocks, tokens", [
    (64, 2, 64),  # exactly two blocks
    (95, 2, 64),  # whole blocks only: the third would pass the limit
    (96, 3, 96),
    (97, 4, 97),  # the whole split
    (10**9, 4, 97),  # more than the split: the whole split
])
def test_slice_is_the_first_whole_blocks(limit, blocks, tokens):
    chosen = first_blocks(np.array([32, 32, 32, 1]), limit)
    assert (chosen.blocks, chosen.tokens, chosen.total_tokens) == (blocks, tokens, 97)
    assert chosen.whole == (blocks == 4)
    assert chosen.as_json()["max_eval_tokens"] == limit


def test_slice_smaller_than_a_block_is_refused():
    with pytest.raises(UsageError, match=r"--max-eval-tokens 10 is smaller than the split's "
                                         r"first block \(32 tokens\); pass at least 32"):
        first_blocks(np.array([32, 32]), 10)


class _Blocks:
    """A dataset of five blocks whose batch order is a fixed permutation."""

    sizes = np.array([3, 3, 3, 3, 2])

    def __getitem__(self, index: int) -> int:
        return index

    def __len__(self) -> int:
        return 5

    def ordered_indices(self) -> np.ndarray:
        return np.array([4, 1, 3, 0, 2])


def test_prefix_dataset_keeps_the_batch_order_of_its_blocks():
    prefix = PrefixDataset(_Blocks(), 3)
    assert len(prefix) == 3 and prefix.sizes.tolist() == [3, 3, 3]
    assert prefix.ordered_indices().tolist() == [1, 0, 2]
    assert prefix[2] == 2
    with pytest.raises(IndexError):
        prefix[3]
