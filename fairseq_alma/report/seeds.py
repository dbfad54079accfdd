"""Runs that differ only by their seed, combined: mean ± standard deviation over seeds.

Why: the paper's conclusions rest on comparing close numbers (Table 2's perplexities differ by
a few tenths), so a table or figure that shows one seed cannot say whether a difference is real.
``group_by_seed`` puts together the series whose run fingerprint (``run.json``: every setting
that changes results, and the data's identity) is the same once the seed is removed; each
``SeedGroup`` then gives every number of Table 2 and of the figures as a ``Stat`` over its
members.  A run without a fingerprint (written before fairseq-alma 0.2) stays alone: nothing is
grouped on a guess.

The standard deviation is the sample one (n - 1 in the denominator); with one seed it is None,
never 0, so a table cannot suggest a spread that was not measured.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..stream.series import ReportSeries

SEED_KEYS = frozenset({"seed", "--seed"})


def without_keys(value: Any, keys: frozenset[str]) -> Any:
    """``value`` (JSON-like) with every mapping entry whose key is in ``keys`` removed, at any
    depth: a fingerprint minus its seeds (LM: ``config.common.seed``; vision: ``--seed`` and the
    learner's ``seed``)."""
    if isinstance(value, Mapping):
        return {k: without_keys(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, (list, tuple)):
        return [without_keys(v, keys) for v in value]
    return value


def find_key(value: Any, keys: Iterable[str]) -> Any:
    """The first value stored under one of ``keys`` anywhere in ``value`` (depth first)."""
    wanted = set(keys)
    if isinstance(value, Mapping):
        for key, item in value.items():
            if key in wanted:
                return item
        for item in value.values():
            found = find_key(item, wanted)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for item in value:
            found = find_key(item, wanted)
            if found is not None:
                return found
    return None


def canonical(value: Any) -> str:
    """A stable text form of a JSON-like value, usable as a grouping key."""
    return json.dumps(value, sort_keys=True, default=str)


@dataclass(frozen=True)
class Stat:
    """One number over seeds: mean, sample standard deviation (None for one seed), values."""

    values: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return math.fsum(self.values) / len(self.values)

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.values) if len(self.values) > 1 else None

    def to_json(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "n": self.n, "values": list(self.values)}


def stat(values: Sequence[float | None]) -> Stat | None:
    """A ``Stat``, or None when any seed lacks the number (a mean of some seeds is not shown)."""
    if not values or any(v is None for v in values):
        return None
    return Stat(tuple(float(v) for v in values))


@dataclass
class ReportedRun:
    """One series and where it came from, as ``report/inputs.py`` reads it."""

    series: ReportSeries
    source: str  # run dir or alma-score JSON it was read from
    fingerprint: dict[str, Any] | None = None  # run.json's (Ens: its members', in order)
    seed: tuple[int, ...] | None = None  # the run's seed; an ensemble's members' seeds
    eval_slice: tuple[int, int] | None = None  # (scored, available) tokens; None: every token
    eval_matrix: dict[str, Any] | None = None  # alma-score --matrix's (stage x period) entry

    @property
    def group_key(self) -> str | None:
        """The fingerprint minus the seed; None: never grouped."""
        if self.fingerprint is None:
            return None
        return canonical([self.series.setting, self.series.num_experts,
                          without_keys(self.fingerprint, SEED_KEYS)])


@dataclass
class SeedGroup:
    """Runs that differ only by seed (module doc); a single run is a group of one."""

    runs: list[ReportedRun]

    def __post_init__(self) -> None:
        first = self.runs[0].series
        for run in self.runs[1:]:
            s = run.series
            if (s.metric, s.num_megabatches, s.trained) != (first.metric, first.num_megabatches,
                                                            first.trained):
                raise ValueError(f"{run.source} and {self.runs[0].source} share a fingerprint "
                                 f"but not their stream (metric, B or trained arrivals)")

    @property
    def members(self) -> list[ReportSeries]:
        return [run.series for run in self.runs]

    @property
    def first(self) -> ReportSeries:
        return self.runs[0].series

    @property
    def n(self) -> int:
        return len(self.runs)

    @property
    def seeds(self) -> list[tuple[int, ...] | None]:
        return [run.seed for run in self.runs]

    def over_seeds(self, number: Callable[[ReportSeries], float | None]) -> Stat | None:
        """``number(series)`` for every member, as a ``Stat``."""
        return stat([number(s) for s in self.members])

    def summary(self) -> dict[str, Stat | None]:
        """Every stream-level number of ``ReportSeries.summary`` over seeds."""
        summaries = [s.summary() for s in self.members]
        return {key: stat([m[key] for m in summaries]) for key in summaries[0]}

    def by_arrival(self, values: Callable[[ReportSeries], Sequence[float | None]]) -> list[Stat | None]:
        """A per-arrival list (metric, running averages, costs) over seeds, arrival by arrival."""
        lists = [values(s) for s in self.members]
        return [stat([v[t] for v in lists]) for t in range(len(lists[0]))]


def group_by_seed(runs: Sequence[ReportedRun]) -> list[SeedGroup]:
    """Groups in order of first appearance; members ordered by seed."""
    groups: dict[str, list[ReportedRun]] = {}
    for index, run in enumerate(runs):
        key = run.group_key or f"alone:{index}"
        groups.setdefault(key, []).append(run)
    out = []
    for members in groups.values():
        seeds = [run.seed for run in members]
        if len(members) > 1 and len(set(seeds)) != len(seeds):
            sources = ", ".join(run.source for run in members)
            raise ValueError(f"{sources} have the same fingerprint and seed: the same run given "
                             f"twice, or copies; pass each run once")
        out.append(SeedGroup(sorted(members, key=lambda r: (r.seed is None, r.seed or ()))))
    return out


REPLAY_KEYS = frozenset({"replay", "--replay"})


def replay_pairs(groups: Sequence[SeedGroup]) -> list[tuple[SeedGroup, SeedGroup]]:
    """(without replay, with replay) for every two groups whose fingerprints differ only by
    replay (and seed): Fig. 4's arrows.  Groups without a fingerprint are never paired."""
    by_key: dict[str, dict[bool, SeedGroup]] = {}
    for group in groups:
        fingerprint = group.runs[0].fingerprint
        replay = find_key(fingerprint, REPLAY_KEYS) if fingerprint is not None else None
        if replay is None:
            continue
        key = canonical([group.first.num_experts,
                         without_keys(fingerprint, SEED_KEYS | REPLAY_KEYS)])
        by_key.setdefault(key, {})[bool(replay)] = group
    return [(pair[False], pair[True]) for pair in by_key.values() if len(pair) == 2]
