"""When a learner with waiting time ``w`` trains, and on which mega-batches (paper §3, Algorithm 1).

The stream delivers B mega-batches D_1 … D_B one after another ("arrivals").  A learner with
waiting time w aggregates w consecutive mega-batches, then trains once (a "stage") on them, or on
everything seen so far with replay.  It is evaluated after every arrival, trained on or not
(§3.1), including arrival 0, before any data (the untrained model, the t = 0 term of Eq. 1).

Algorithm 1 as printed loops ``while t < B`` starting from t = 1 and stepping by w.  With w = 1
and B = 4 that trains only 3 times, yet Table 2 (App. D) reports SM_w1 trained after each of the
4 mega-batches, and SM_w4 trained once after the 4th.  The loop must run while t + w - 1 <= B,
i.e. stages s = 1 … floor(B / w), stage s training at arrival s·w.  The B mod w mega-batches
that arrive after the last full group are never trained on (e.g. B = 4, w = 3: one stage at
arrival 3, mega-batch 4 is only evaluated past) — Table 2's SM_w3 row has no 4th training point.

Partial replay (``--replay-ratio r``, ``stream/replay.py``): a stage also replays mega-batches
that arrived *before* its new ones (``replay_megabatches``); stage 1 has none, so it trains on
its new data only.

Mega-batch ids are 0-based (D_1 is id 0); arrivals and stages are counted from 1.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """One training stage of Algorithm 1.

    Attributes:
        index: 1-based stage number (fairseq's epoch number in the ``alma_stream`` task).
        arrival: number of mega-batches arrived when this stage trains (1..B).
        new_megabatches: 0-based ids of the mega-batches arrived since the previous stage.
        train_megabatches: ids this stage trains on: ``new_megabatches``, or with replay every
            mega-batch seen so far (0 … arrival - 1).
        replay_megabatches: with partial replay (``--replay-ratio r > 0``), the ids that arrived
            before ``new_megabatches`` (0 … arrival - wait - 1), from which the stage's replayed
            updates draw; empty otherwise, and always for stage 1.
    """

    index: int
    arrival: int
    new_megabatches: tuple[int, ...]
    train_megabatches: tuple[int, ...]
    replay_megabatches: tuple[int, ...] = ()


@dataclass(frozen=True)
class ArrivalInfo:
    """What the learner looks like right after ``arrival`` mega-batches have arrived.

    Attributes:
        arrival: 0..B; 0 is before any data (the untrained model).
        stage: number of stages trained so far (0 if none): the index of the stage checkpoint
            that answers the evaluation at this arrival.
        trained: True if a stage trained at this very arrival.
        megabatches_seen: mega-batches arrived so far (equals ``arrival``).
    """

    arrival: int
    stage: int
    trained: bool
    megabatches_seen: int


def _check_stream_size(num_megabatches: int) -> None:
    if (
        isinstance(num_megabatches, bool)
        or not isinstance(num_megabatches, int)
        or num_megabatches < 1
    ):
        raise ValueError(f"--num-megabatches must be an integer >= 1 (got {num_megabatches!r})")


def build_schedule(num_megabatches: int, wait: int, replay: bool,
                   partial_replay: bool = False) -> list[Stage]:
    """The stages of Algorithm 1 (with the loop bound fixed to ``t + w - 1 <= B``, see module doc).

    ``partial_replay``: give every stage the mega-batches that arrived before its new ones as
    ``replay_megabatches`` (the ratio itself is ``stream/replay.py``'s business).

    >>> [s.arrival for s in build_schedule(4, 1, replay=False)]
    [1, 2, 3, 4]
    >>> build_schedule(4, 3, replay=False)
    [Stage(index=1, arrival=3, new_megabatches=(0, 1, 2), train_megabatches=(0, 1, 2), replay_megabatches=())]
    """
    _check_stream_size(num_megabatches)
    if isinstance(wait, bool) or not isinstance(wait, int) or not 1 <= wait <= num_megabatches:
        raise ValueError(
            f"--wait must be an integer between 1 and the number of mega-batches "
            f"({num_megabatches}), got {wait!r}"
        )
    stages = []
    for index in range(1, num_megabatches // wait + 1):
        arrival = index * wait
        new = tuple(range(arrival - wait, arrival))
        train = tuple(range(arrival)) if replay else new
        earlier = tuple(range(arrival - wait)) if partial_replay else ()
        stages.append(Stage(index=index, arrival=arrival, new_megabatches=new,
                            train_megabatches=train, replay_megabatches=earlier))
    return stages


def schedule_at(arrivals: list[int], replay: bool) -> list[Stage]:
    """The stages of a learner that trained at ``arrivals`` (increasing, 1-based; ``--wait
    auto`` decides them one by one): each on the mega-batches arrived since the one before, or
    on all arrived ones with replay.

    >>> [(s.arrival, s.new_megabatches) for s in schedule_at([2, 3], replay=False)]
    [(2, (0, 1)), (3, (2,))]
    """
    stages, previous = [], 0
    for index, arrival in enumerate(arrivals, start=1):
        if arrival <= previous:
            raise ValueError(f"training arrivals must increase, got {arrivals}")
        new = tuple(range(previous, arrival))
        stages.append(Stage(index=index, arrival=arrival, new_megabatches=new,
                            train_megabatches=tuple(range(arrival)) if replay else new))
        previous = arrival
    return stages


def untrained_megabatches(schedule: list[Stage], num_megabatches: int) -> tuple[int, ...]:
    """Ids of the mega-batches no stage ever trains on (the trailing ``B mod w``)."""
    _check_stream_size(num_megabatches)
    used = {mb for stage in schedule for mb in stage.train_megabatches}
    return tuple(mb for mb in range(num_megabatches) if mb not in used)


def arrival_table(schedule: list[Stage], num_megabatches: int) -> list[ArrivalInfo]:
    """One entry per arrival 0..B: which stage answers the evaluation after that arrival.

    >>> [(a.arrival, a.stage, a.trained) for a in arrival_table(build_schedule(4, 3, False), 4)]
    [(0, 0, False), (1, 0, False), (2, 0, False), (3, 1, True), (4, 1, False)]
    """
    _check_stream_size(num_megabatches)
    trained_at = {}
    previous_arrival = 0
    for expected_index, stage in enumerate(schedule, start=1):
        if stage.index != expected_index or not previous_arrival < stage.arrival <= num_megabatches:
            raise ValueError(
                f"schedule does not fit a stream of {num_megabatches} mega-batches (stage "
                f"{stage.index} at arrival {stage.arrival}); build it with build_schedule()"
            )
        trained_at[stage.arrival] = stage.index
        previous_arrival = stage.arrival
    table = []
    stages_done = 0
    for arrival in range(num_megabatches + 1):
        trained = arrival in trained_at
        if trained:
            stages_done = trained_at[arrival]
        table.append(
            ArrivalInfo(
                arrival=arrival, stage=stages_done, trained=trained, megabatches_seen=arrival
            )
        )
    return table
