"""Algorithm 1's stage schedule (paper §3), with the loop bound that Table 2 implies."""

import pytest

from fairseq_alma.stream.schedule import (
    ArrivalInfo,
    Stage,
    arrival_table,
    build_schedule,
    untrained_megabatches,
)


def test_wait_1_trains_after_every_megabatch_as_table2_sm_w1():
    # Table 2: SM_w1 has a perplexity at all 4 arrivals of a B = 4 stream, so 4 stages
    # (Algorithm 1's printed `while t < B` would give only 3).
    assert build_schedule(4, 1, replay=False) == [
        Stage(1, 1, (0,), (0,)),
        Stage(2, 2, (1,), (1,)),
        Stage(3, 3, (2,), (2,)),
        Stage(4, 4, (3,), (3,)),
    ]


def test_wait_1_with_replay_trains_on_everything_seen():
    stages = build_schedule(4, 1, replay=True)
    assert [s.train_megabatches for s in stages] == [(0,), (0, 1), (0, 1, 2), (0, 1, 2, 3)]
    assert [s.new_megabatches for s in stages] == [(0,), (1,), (2,), (3,)]


def test_wait_3_of_4_leaves_the_last_megabatch_untrained():
    stages = build_schedule(4, 3, replay=False)
    assert stages == [Stage(1, 3, (0, 1, 2), (0, 1, 2))]
    assert untrained_megabatches(stages, 4) == (3,)
    assert build_schedule(4, 3, replay=True) == stages  # one stage: replay changes nothing


def test_wait_equal_to_stream_length_is_one_stage_at_the_end():
    stages = build_schedule(4, 4, replay=False)
    assert stages == [Stage(1, 4, (0, 1, 2, 3), (0, 1, 2, 3))]
    assert untrained_megabatches(stages, 4) == ()


def test_leftovers_with_replay():
    stages = build_schedule(5, 2, replay=True)
    assert [(s.arrival, s.new_megabatches, s.train_megabatches) for s in stages] == [
        (2, (0, 1), (0, 1)),
        (4, (2, 3), (0, 1, 2, 3)),
    ]
    assert untrained_megabatches(stages, 5) == (4,)
    no_replay = build_schedule(5, 2, replay=False)
    assert [s.train_megabatches for s in no_replay] == [(0, 1), (2, 3)]


def test_arrival_table_wait_3():
    table = arrival_table(build_schedule(4, 3, replay=False), 4)
    assert table == [
        ArrivalInfo(0, 0, False, 0),
        ArrivalInfo(1, 0, False, 1),
        ArrivalInfo(2, 0, False, 2),
        ArrivalInfo(3, 1, True, 3),
        ArrivalInfo(4, 1, False, 4),
    ]


def test_arrival_table_wait_1():
    table = arrival_table(build_schedule(4, 1, replay=False), 4)
    assert [(a.stage, a.trained) for a in table] == [
        (0, False),
        (1, True),
        (2, True),
        (3, True),
        (4, True),
    ]


@pytest.mark.parametrize("wait", [0, -1, 5, 1.5, True, "2"])
def test_bad_wait_names_the_flag(wait):
    with pytest.raises(ValueError, match=r"^--wait must be an integer between 1 and .*\(4\)"):
        build_schedule(4, wait, replay=False)


@pytest.mark.parametrize("megabatches", [0, -3, 2.0])
def test_bad_stream_length_names_the_flag(megabatches):
    with pytest.raises(ValueError, match=r"^--num-megabatches must be an integer >= 1"):
        build_schedule(megabatches, 1, replay=False)


def test_arrival_table_rejects_a_schedule_for_another_stream():
    with pytest.raises(ValueError, match="does not fit a stream of 3 mega-batches"):
        arrival_table(build_schedule(4, 1, replay=False), 3)
    shuffled = list(reversed(build_schedule(4, 1, replay=False)))
    with pytest.raises(ValueError, match="build it with build_schedule"):
        arrival_table(shuffled, 4)
