"""Seeded mega-batch partition (paper §5 "Datasets", App. B.1): local RNG, equal sizes."""

import numpy as np
import pytest

from fairseq_alma.stream.partition import partition_indices, valid_count


def _all_indices(megabatches):
    return np.concatenate([np.concatenate([mb.train, mb.valid]) for mb in megabatches])


def test_sizes_differ_by_at_most_one_first_megabatches_take_the_remainder():
    megabatches = partition_indices(10, 3, seed=0)
    assert [mb.size for mb in megabatches] == [4, 3, 3]
    assert [mb.index for mb in megabatches] == [0, 1, 2]


def test_disjoint_and_complete_and_sorted():
    megabatches = partition_indices(103, 7, seed=5, valid_fraction=0.1)
    everything = _all_indices(megabatches)
    assert len(everything) == 103
    assert sorted(everything.tolist()) == list(range(103))
    for mb in megabatches:
        assert mb.train.dtype == np.int64 and mb.valid.dtype == np.int64
        assert np.all(np.diff(mb.train) > 0) and np.all(np.diff(mb.valid) > 0)


def test_split_is_the_documented_permutation():
    # The contract that keeps existing streams reproducible: permutation of a local
    # default_rng(seed), cut in order with array_split, first 10% of each block held out.
    megabatches = partition_indices(20, 2, seed=3, valid_fraction=0.1)
    order = np.random.default_rng(3).permutation(20)
    assert megabatches[0].valid.tolist() == sorted(order[:1].tolist())
    assert megabatches[0].train.tolist() == sorted(order[1:10].tolist())
    assert megabatches[1].valid.tolist() == sorted(order[10:11].tolist())
    assert megabatches[1].train.tolist() == sorted(order[11:20].tolist())


def test_same_seed_same_split_different_seed_different_split():
    first = partition_indices(50, 5, seed=11, valid_fraction=0.1)
    again = partition_indices(50, 5, seed=11, valid_fraction=0.1)
    other = partition_indices(50, 5, seed=12, valid_fraction=0.1)
    assert all(
        np.array_equal(a.train, b.train) and np.array_equal(a.valid, b.valid)
        for a, b in zip(first, again, strict=True)
    )
    assert any(not np.array_equal(a.train, b.train) for a, b in zip(first, other, strict=True))


def test_global_numpy_rng_is_neither_used_nor_touched():
    np.random.seed(1234)
    before = np.random.get_state()
    first = partition_indices(40, 4, seed=7)
    after = np.random.get_state()
    assert before[0] == after[0] and np.array_equal(before[1], after[1]) and before[2:] == after[2:]
    np.random.seed(99)  # a different global state must not change the split
    second = partition_indices(40, 4, seed=7)
    assert all(np.array_equal(a.train, b.train) for a, b in zip(first, second, strict=True))


def test_validation_share_rounds_half_up():
    # 100 examples / 4 = 25 per mega-batch; 10% of 25 = 2.5 -> 3 held out.
    megabatches = partition_indices(100, 4, seed=0, valid_fraction=0.1)
    assert [(mb.train.size, mb.valid.size) for mb in megabatches] == [(22, 3)] * 4
    assert valid_count(40, 0.1) == 4
    assert valid_count(1, 0.5) == 0  # a single example is always trained on
    assert valid_count(2, 0.9) == 1  # never hold out the whole mega-batch


def test_more_megabatches_than_examples_names_the_flag():
    with pytest.raises(
        ValueError, match=r"^--num-megabatches 11 is larger than the training set \(10"
    ):
        partition_indices(10, 11, seed=0)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"n": 0, "num_megabatches": 1, "seed": 0}, "at least 1 example"),
        ({"n": 5, "num_megabatches": 0, "seed": 0}, "^--num-megabatches must be"),
        ({"n": 5, "num_megabatches": 2, "seed": -1}, "^--seed must be"),
        (
            {"n": 5, "num_megabatches": 2, "seed": 0, "valid_fraction": 1.0},
            r"validation fraction .*\[0, 1\)",
        ),
    ],
)
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        partition_indices(**kwargs)
