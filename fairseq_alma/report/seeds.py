"""Runs that differ only by their seed, combined: mean ± standard deviation over seeds.

Why: the paper's conclusions rest on comparing close numbers (Table 2's perplexities differ by
a few tenths), so a table or figure that shows one seed cannot say whether a difference is real.
``group_by_seed`` puts together the series for which everything that changes the numbers
agrees but the seed: the run fingerprint (``run.json``: every setting that changes results, and
the data's identity) once the seed is removed, and how the numbers were obtained (``scoring``:
the split, block length, slice, data and precision they were evaluated on); each
``SeedGroup`` then gives every number of Table 2 and of the figures as a ``Stat`` over its
members.  A run without a fingerprint (written before fairseq-alma 0.2) stays alone: nothing is
grouped on a guess.  Rows that would carry the same name but differ get the differing keys in
their name (``label_collisions``), so a table never shows two rows it cannot tell apart.

The standard deviation is the sample one (n - 1 in the denominator); with one seed it is None,
never 0, so a table cannot suggest a spread that was not measured.

The anytime metric of a group (one rule for the table, CSV, JSON and figures): ``anytime_nll``
is the mean over seeds of each seed's anytime cross-entropy in bits, with its sample standard
deviation; ``anytime_ppl`` is 2 ** that mean (``BitsAsPerplexity``), never a mean of
perplexities, so the two fields always say the same thing.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..stream.fingerprint_forms import comparable_form
from ..stream.progress import AUTO, wait_from_flag
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


def waits_auto(fingerprint: Any) -> bool:
    """Whether a run decided when to train (``--wait auto``): its seeds then train at
    different arrivals by design, and are still seeds of one setting.  An LM's fingerprint
    holds the task's ``wait`` (None for auto), a vision run's its ``--wait`` flag; an
    ensemble's lists its members'."""
    if not isinstance(fingerprint, Mapping):
        return False
    if "members" in fingerprint:  # an ensemble, as alma-score's JSON gives it
        return any(waits_auto(member) for member in fingerprint["members"] or ())
    task = (fingerprint.get("config") or {}).get("task") or {}
    if "wait" in task:
        return wait_from_flag(task["wait"]) == AUTO
    return str((fingerprint.get("settings") or {}).get("--wait")) == AUTO


def comparable_fingerprint(fingerprint: Any, keys: frozenset[str]) -> Any:
    """``fingerprint`` without ``keys`` (the seed; for Fig. 4 also replay) and without the
    settings a vision method does not read (``vision/fingerprint.comparable_form``),
    so an SM run trained with ``--members 2`` and one with the default 5 are one setting, as
    their bit-identical numbers are."""
    return without_keys(comparable_form(fingerprint), keys)


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


@dataclass(frozen=True)
class BitsAsPerplexity:
    """A group's anytime perplexity: 2 ** the mean over seeds of their anytime cross-entropy in
    bits (module doc).  Its spread is the bits' (``bits.std``), not a perplexity's."""

    bits: Stat

    @property
    def n(self) -> int:
        return self.bits.n

    @property
    def mean(self) -> float:
        return 2.0 ** self.bits.mean

    @property
    def std(self) -> None:
        return None

    @property
    def values(self) -> tuple[float, ...]:
        return tuple(2.0 ** v for v in self.bits.values)

    def to_json(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": None, "n": self.n, "values": list(self.values),
                "bits_std": self.bits.std}


@dataclass
class ReportedRun:
    """One series and where it came from, as ``report/inputs.py`` reads it."""

    series: ReportSeries
    source: str  # run dir or alma-score JSON it was read from
    fingerprint: dict[str, Any] | None = None  # run.json's (Ens: its members', in order)
    seed: tuple[int, ...] | None = None  # the run's seed; an ensemble's members' seeds
    eval_slice: tuple[int, int] | None = None  # (scored, available) tokens; None: every token
    eval_matrix: dict[str, Any] | None = None  # alma-score --matrix's (stage x period) entry
    scoring: dict[str, Any] | None = None  # how its numbers were obtained (module doc)
    runs: tuple[str, ...] = ()  # the run directories behind it (real paths)
    mode: str = "single"  # single, ens or gens

    @property
    def comparable(self) -> dict[str, Any] | None:
        """Everything that changes its numbers but the seed (None: unknown, never grouped);
        a vision run's learner settings that its method does not read are no part of it (a
        ``run.json`` written before they were left out holds them: ``comparable_fingerprint``)."""
        if self.fingerprint is None:
            return None
        return {"run": comparable_fingerprint(self.fingerprint, SEED_KEYS),
                "scoring": self.scoring or {}}

    @property
    def group_key(self) -> str | None:
        """``comparable`` with the row's name; None: never grouped."""
        comparable = self.comparable
        if comparable is None:
            return None
        return canonical([self.series.setting, self.series.num_experts, comparable])


@dataclass
class SeedGroup:
    """Runs that differ only by seed (module doc); a single run is a group of one."""

    runs: list[ReportedRun]

    def __post_init__(self) -> None:
        first = self.runs[0].series
        decides = waits_auto(self.runs[0].fingerprint)
        for run in self.runs[1:]:
            s = run.series
            if (s.metric, s.num_megabatches) != (first.metric, first.num_megabatches):
                raise ValueError(f"{run.source} and {self.runs[0].source} share a fingerprint "
                                 f"but not their stream (metric or B)")
            if s.trained != first.trained and not decides:
                # a fixed --wait trains at the same arrivals whatever the seed: files that say
                # otherwise were edited or mixed, and their mean would average other schedules
                raise ValueError(f"{run.source} and {self.runs[0].source} share a fixed --wait "
                                 f"but trained at different arrivals, which training never does; "
                                 f"score them again, or pass --no-seed-groups")
        # seeds of one setting are independent runs: two ensembles sharing a member are not
        # (the spread over them would be understated), nor is a run beside an ensemble of it
        owner: dict[str, str] = {}
        for run in self.runs:
            for member in run.runs:
                if member in owner:
                    raise ValueError(f"{owner[member]} and {run.source} share the run {member}, so "
                                     f"they are not independent seeds of one setting; pass series "
                                     f"of disjoint runs (or --no-seed-groups)")
                owner[member] = run.source

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

    @property
    def seen(self) -> list[bool]:
        """Whether any seed had trained by each arrival: a cell is "*" (not yet trained) only
        where none had.  Seeds of a ``--wait auto`` setting train where each decided, so one
        arrival's mean may average trained and waiting seeds, which is what the anytime
        metric charges; with a fixed wait every seed trains at the same arrivals."""
        return [any(column) for column in zip(*(s.seen for s in self.members), strict=True)]

    @property
    def trained(self) -> list[bool]:
        """Whether any seed trained at each arrival (``seen``'s rule)."""
        return [any(column) for column in zip(*(s.trained for s in self.members), strict=True)]

    def over_seeds(self, number: Callable[[ReportSeries], float | None]) -> Stat | None:
        """``number(series)`` for every member, as a ``Stat``."""
        return stat([number(s) for s in self.members])

    def summary(self) -> dict[str, Stat | BitsAsPerplexity | None]:
        """Every stream-level number of ``ReportSeries.summary`` over seeds; the anytime
        perplexity by the module doc's rule."""
        summaries = [s.summary() for s in self.members]
        out: dict[str, Stat | BitsAsPerplexity | None] = {
            key: stat([m[key] for m in summaries]) for key in summaries[0]}
        if "anytime_ppl" in out:
            bits = out["anytime_nll"]
            out["anytime_ppl"] = None if bits is None else BitsAsPerplexity(bits)
        return out

    def by_arrival(self, values: Callable[[ReportSeries], Sequence[float | None]]) -> list[Stat | None]:
        """A per-arrival list (metric, running averages, costs) over seeds, arrival by arrival."""
        lists = [values(s) for s in self.members]
        return [stat([v[t] for v in lists]) for t in range(len(lists[0]))]


def group_by_seed(runs: Sequence[ReportedRun], by_seed: bool = True) -> list[SeedGroup]:
    """Groups in order of first appearance; members ordered by seed; groups that would share a
    name get the keys they differ by in it (``label_collisions``).  ``by_seed`` False
    (``--no-seed-groups``): a group per run, still labelled."""
    groups: dict[str, list[ReportedRun]] = {}
    same: dict[tuple[str, Any], str] = {}  # (group key, seed) -> the first source: copies, either way
    for index, run in enumerate(runs):
        if run.group_key is not None:
            if (run.group_key, run.seed) in same:
                raise ValueError(f"{same[run.group_key, run.seed]}, {run.source} have the same fingerprint "
                                 f"and seed: the same run given twice, or copies; pass each run once")
            same[run.group_key, run.seed] = run.source
        key = (run.group_key if by_seed else None) or f"alone:{index}"
        groups.setdefault(key, []).append(run)
    out = [SeedGroup(sorted(members, key=lambda r: (r.seed is None, r.seed or ())))
           for members in groups.values()]
    label_collisions(out)
    return out


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A JSON-like value as {dotted key: leaf}."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out |= flatten(item, f"{prefix}.{key}" if prefix else str(key))
        return out
    return {prefix: value}


def label_collisions(groups: Sequence[SeedGroup]) -> None:
    """Groups with the same name (setting and size) are told apart in the name: each gets
    ``[key=value, ...]`` with the keys that differ between them (at most three; ``+N`` more),
    e.g. ``SM_w1 [config.task.updates_per_stage=200]``.  How the numbers were measured
    (``scoring``: split, block length, slice, precision) comes first, so a row scored on another
    split never hides it behind ``+N``; the seeds tell apart the rows of ``--no-seed-groups``
    that nothing else does; groups without a fingerprint are named by their source and the
    scoring keys that differ.

    How the numbers were measured is named in EVERY row when it differs anywhere in the table
    (``measured_apart``), whatever the names: ``SM_w1`` on the validation split beside
    ``SM_w1 replay`` on the evaluation mega-batch read as replay gaining 8 perplexity points
    where it gained 0.4."""
    apart = measured_apart(groups)
    by_name: dict[tuple[str, str], list[SeedGroup]] = {}
    for group in groups:
        by_name.setdefault((group.first.setting, group.first.num_experts), []).append(group)
    for colliding in by_name.values():
        if len(colliding) < 2 and not apart:
            continue
        known = all(g.runs[0].comparable is not None for g in colliding)
        flat = [flatten(g.runs[0].comparable if known else {"scoring": g.runs[0].scoring or {}})
                | {"seed": _seeds_text(g)} for g in colliding]
        keys = sorted({k for f in flat for k in f} | set(apart), key=_label_order)
        differing = [k for k in keys if k in apart or len({canonical(f.get(k)) for f in flat}) > 1]
        named = _telling_keys(differing, flat)
        for group, values in zip(colliding, flat, strict=True):
            shown = [f"{k.replace('scoring.', '').replace('run.', '')}={values.get(k)}" for k in named]
            hidden = len([k for k in differing if k not in named and k != "seed"])
            more = [f"+{hidden}"] if hidden else []
            if group.runs[0].comparable is None:
                shown.insert(0, group.runs[0].source)
            tag = f"[{', '.join(shown + more)}]"
            for member in group.members:
                member.setting = f"{member.setting} {tag}"


def measured_apart(groups: Sequence[SeedGroup]) -> list[str]:
    """The ``scoring.*`` keys (split, block length, slice, precision) whose values differ
    between rows of one table; the stream's identity is left out (streams that differ are
    refused, and an unverifiable one is a path)."""
    flat = [flatten({"scoring": {k: v for k, v in (g.runs[0].scoring or {}).items() if k != "data"}})
            for g in groups]
    keys = sorted({k for f in flat for k in f})
    return [k for k in keys if len({canonical(f.get(k)) for f in flat}) > 1]


def _label_order(key: str) -> tuple[int, str]:
    """How the numbers were measured first, then the run's settings, then its seeds (which tell
    apart only the rows of ``--no-seed-groups``)."""
    return (0 if key.startswith("scoring.") else 2 if key == "seed" else 1, key)


def _seeds_text(group: SeedGroup) -> str:
    return ",".join("?" if run.seed is None else ",".join(map(str, run.seed)) for run in group.runs)


def _telling_keys(differing: list[str], flat: list[dict[str, Any]], most: int = 3) -> list[str]:
    """The keys a label shows: every differing scoring key (how the numbers were measured), then
    the first run keys that tell apart rows the keys so far do not (so two rows never get the
    same label while a key could part them), then the next differing keys, ``most`` in all
    unless scoring needs more; in ``differing``'s order."""
    chosen = [k for k in differing if k.startswith("scoring.")]

    def distinct(keys: list[str]) -> int:
        return len({tuple(canonical(f.get(k)) for k in keys) for f in flat})

    for key in differing:
        if distinct(chosen) == len(flat) or len(chosen) >= most:
            break
        if key not in chosen and distinct(chosen + [key]) > distinct(chosen):
            chosen.append(key)
    fill = [k for k in differing if k not in chosen and k != "seed"]  # seeds only where they part rows
    chosen += fill[:max(0, most - len(chosen))]
    return sorted(chosen, key=differing.index)


REPLAY_KEYS = frozenset({"replay", "--replay"})


def replay_pairs(groups: Sequence[SeedGroup]) -> list[tuple[SeedGroup, SeedGroup]]:
    """(without replay, with replay) for every two groups whose fingerprints differ only by
    replay (and seed), measured alike (``scoring``): Fig. 4's arrows.  Groups without a
    fingerprint are never paired.  Where one setting has several groups a side (a row per
    run, ``--no-seed-groups``), a group is paired with the one of the same seeds: pairing the
    last of each side drew one seed's run against another seed's replay and dropped the rest."""
    by_key: dict[str, dict[bool, list[SeedGroup]]] = {}
    for group in groups:
        fingerprint = group.runs[0].fingerprint
        replay = find_key(fingerprint, REPLAY_KEYS) if fingerprint is not None else None
        if replay is None:
            continue
        key = canonical([group.first.num_experts, group.runs[0].scoring or {},
                         comparable_fingerprint(fingerprint, SEED_KEYS | REPLAY_KEYS)])
        by_key.setdefault(key, {False: [], True: []})[bool(replay)].append(group)
    pairs = []
    for sides in by_key.values():
        plain, replayed = sides[False], sides[True]
        if len(plain) == 1 and len(replayed) == 1:
            pairs.append((plain[0], replayed[0]))  # one setting each: its seeds are named
            continue
        for group in plain:
            twin = [other for other in replayed if other.seeds == group.seeds]
            if len(twin) == 1:
                pairs.append((group, twin[0]))
    return pairs


def seeds_text(group: SeedGroup) -> str:
    """``seeds 1,2,3`` (for a legend whose two ends average different seeds)."""
    return "seeds " + _seeds_text(group)
