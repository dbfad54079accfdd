"""CER (Eq. 1), Mem / Comp (Eq. 2) and the LM average perplexity (§6.2) on hand-made curves."""

import math

import pytest

from fairseq_alma.stream.metrics import (
    anytime_nll_bits,
    cumulative,
    cumulative_error_rate,
    perplexity_from_nll,
    running_anytime_nll_bits,
    running_trained_average_perplexity,
    trained_average_perplexity,
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
        trained_average_perplexity([50000.0, 28.5, 27.5, 27.0, 26.0], [False, True, True, True, True])
        == 27.25
    )
    # SM_w3 of B = 4: untrained arrivals 1, 2 have real (huge) perplexities, which must be ignored;
    # arrival 4 counts (the stage-1 model is still answering)
    assert (
        trained_average_perplexity([900.0, 800.0, 700.0, 25.5, 25.0], [False, False, False, True, False])
        == 25.25
    )
    # SM_w4: only the last arrival; untrained entries may be None
    assert (
        trained_average_perplexity([None, None, None, None, 22.75], [False, False, False, False, True])
        == 22.75
    )


def test_running_average_gives_the_fig5_trajectory():
    assert running_trained_average_perplexity([None, None, 30.0, 20.0], [False, False, True, False]) == [
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
        trained_average_perplexity(ppl, mask)


def test_anytime_metric_charges_waiting_in_bits():
    # B = 4, V ~ 2**12: SM_w1 trains at every arrival, SM_w4 answers arrivals 1-3 with its
    # initialised model and ends lower.  The paper's average hides the waiting (SM_w4 looks best);
    # the anytime metric charges it: (3 x 12 + 4) / 4 = 10 bits against SM_w1's 5.
    sm_w1 = [4096.0, 64.0, 32.0, 32.0, 16.0]
    sm_w4 = [4096.0, 4096.0, 4096.0, 4096.0, 16.0]
    assert trained_average_perplexity(sm_w4, [False, False, False, False, True]) == 16.0
    assert trained_average_perplexity(sm_w1, [False, True, True, True, True]) == 36.0
    assert anytime_nll_bits(sm_w1) == pytest.approx((6 + 5 + 5 + 4) / 4)
    assert anytime_nll_bits(sm_w4) == pytest.approx(10.0)
    # arrival 0 never counts, and the running values give an anytime trajectory
    assert anytime_nll_bits([1e9, 8.0, 8.0]) == pytest.approx(3.0)
    assert running_anytime_nll_bits([1e9, 8.0, 2.0]) == [None, pytest.approx(3.0), pytest.approx(2.0)]
    # a geometric, not arithmetic, mean of perplexities: one untrained arrival at V = 50,000
    # does not drown the trained ones
    assert 2 ** anytime_nll_bits([5e4, 5e4, 20.0, 20.0, 20.0]) == pytest.approx((5e4 * 20**3) ** 0.25)


def test_anytime_metric_needs_every_arrival():
    with pytest.raises(ValueError, match=r"ppl_by_arrival\[1\] is None: the anytime metric charges"):
        anytime_nll_bits([None, None, 20.0])
    assert running_anytime_nll_bits([None, 20.0, None, 10.0]) == [None, pytest.approx(math.log2(20)), None, None]
    with pytest.raises(ValueError, match="below 1"):
        anytime_nll_bits([5.0, 0.5])
    with pytest.raises(ValueError, match="1 entries"):
        anytime_nll_bits([5.0])


def test_perplexity_from_nll():
    assert perplexity_from_nll(3 * math.log(8.0), 3) == pytest.approx(8.0, rel=1e-12)
    assert perplexity_from_nll(0.0, 5) == 1.0
    with pytest.raises(ValueError, match="at least 1 scored token"):
        perplexity_from_nll(1.0, 0)
    with pytest.raises(ValueError, match="is negative"):
        perplexity_from_nll(-1.0, 2)
    with pytest.raises(ValueError, match="overflows exp"):
        perplexity_from_nll(1e6, 10)
