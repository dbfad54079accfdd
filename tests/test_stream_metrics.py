"""CER (Eq. 1), Mem / Comp (Eq. 2) and the LM average perplexity (§6.2) on hand-made curves."""

import math

import pytest

from fairseq_alma.stream.metrics import (
    average_perplexity,
    cumulative,
    cumulative_error_rate,
    perplexity_from_nll,
    running_average_perplexity,
    trained_so_far,
)


def test_cer_sums_error_rates_including_the_untrained_model():
    # greedy: trains at every arrival; tardy: waits for both mega-batches (B = 2)
    assert cumulative_error_rate([0.875, 0.5, 0.25]) == 1.625
    assert cumulative_error_rate([0.875, 0.875, 0.125]) == 1.875  # better end, worse area


@pytest.mark.parametrize(
    "errors, pattern",
    [
        ([0.5], "pass the test error at every arrival t = 0..B"),
        (
            [0.9, 25.0],
            r"errors_by_arrival\[1\] = 25.0 is not an error rate in \[0, 1\]; pass fractions",
        ),
        ([0.9, None], r"errors_by_arrival\[1\] = None is not a finite number"),
        ([0.9, float("nan")], r"errors_by_arrival\[1\] = nan"),
        ([-0.1, 0.2], r"errors_by_arrival\[0\] = -0.1 is not an error rate"),
    ],
)
def test_cer_range_checks(errors, pattern):
    with pytest.raises(ValueError, match=pattern):
        cumulative_error_rate(errors)


def test_cumulative_mem_and_comp():
    # |θ_t| of a model that grows from 10 to 20 parameters after arrival 1 -> Mem = 50
    assert cumulative([10, 10, 20, 10]) == [10.0, 20.0, 40.0, 50.0]
    assert cumulative([0, 0, 3e12]) == [0.0, 0.0, 3e12]
    with pytest.raises(ValueError, match=r"values\[1\] = -1.0 is negative"):
        cumulative([1, -1])
    with pytest.raises(ValueError, match="values is empty"):
        cumulative([])


def test_average_perplexity_table2_rows():
    # SM_w1 style: trained at every arrival; arrival 0 (untrained) never counts
    assert (
        average_perplexity([50000.0, 28.5, 27.5, 27.0, 26.0], [False, True, True, True, True])
        == 27.25
    )
    # SM_w3 of B = 4: untrained arrivals 1, 2 have real (huge) perplexities, which must be ignored;
    # arrival 4 counts (the stage-1 model is still answering)
    assert (
        average_perplexity([900.0, 800.0, 700.0, 25.5, 25.0], [False, False, False, True, False])
        == 25.25
    )
    # SM_w4: only the last arrival; untrained entries may be None
    assert (
        average_perplexity([None, None, None, None, 22.75], [False, False, False, False, True])
        == 22.75
    )


def test_running_average_gives_the_fig5_trajectory():
    assert running_average_perplexity([None, None, 30.0, 20.0], [False, False, True, False]) == [
        None,
        None,
        30.0,
        25.0,
    ]
    assert trained_so_far([False, False, True, False]) == [False, False, True, True]


@pytest.mark.parametrize(
    "ppl, mask, pattern",
    [
        (
            [None, 20.0],
            [True, True],
            r"trained_mask\[0\] is True, but arrival 0 comes before any data",
        ),
        ([None, 20.0], [False, False], "never trained"),
        ([None, 20.0, 19.0], [False, True], "ppl_by_arrival has 3 entries but trained_mask has 2"),
        (
            [None, 20.0, None],
            [False, True, False],
            r"ppl_by_arrival\[2\] is None but the model is trained",
        ),
        ([None, 0.5], [False, True], "below 1, not a perplexity"),
    ],
)
def test_average_perplexity_checks(ppl, mask, pattern):
    with pytest.raises(ValueError, match=pattern):
        average_perplexity(ppl, mask)


def test_perplexity_from_nll():
    assert perplexity_from_nll(3 * math.log(8.0), 3) == pytest.approx(8.0, rel=1e-12)
    assert perplexity_from_nll(0.0, 5) == 1.0
    with pytest.raises(ValueError, match="at least 1 scored token"):
        perplexity_from_nll(1.0, 0)
    with pytest.raises(ValueError, match="is negative"):
        perplexity_from_nll(-1.0, 2)
    with pytest.raises(ValueError, match="overflows exp"):
        perplexity_from_nll(1e6, 10)
