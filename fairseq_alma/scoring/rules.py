"""The single / Ens / gEns rules (paper §4.1, Table 2): who predicts at each arrival, what it costs.

  single  each run is a series; an arrival is answered by the last stage trained by then.
  ens     the runs are N members (one stream, different seeds); at each arrival the predictor
          averages the members' probabilities; |θ| and FLOPs are summed over members ("4@N").
  gens    one run trained with --stage-init scratch and no --replay: its stage checkpoints are the
          members; after s stages the predictor averages members 1..s ("4@s", |θ| = s members).

Pure functions of the loaded runs: nothing here evaluates a model.
"""

from __future__ import annotations

from .runs import StreamRun

SERIES_PREFIX = {"ens": "Ens", "gens": "gEns"}  # single: the run's own name (SM, gMoE, ...)


def member_groups(runs: list[StreamRun], mode: str) -> list[list[StreamRun]]:
    """The predictors' member runs: one group per run (single), or all runs in one (ens, gens)."""
    return [[run] for run in runs] if mode == "single" else [runs]


def predictors_by_stage(members: list[StreamRun], mode: str) -> dict[int, list[str]]:
    """Stage s -> the checkpoints that predict after it: gEns members 1..s of its one run;
    otherwise each member's stage-s checkpoint (vision logs have none)."""
    first = members[0]
    if mode == "gens":
        return {s: [first.checkpoints[m] for m in first.stages[:i + 1]]
                for i, s in enumerate(first.stages)}
    return {s: [run.checkpoints[s] for run in members if s in run.checkpoints]
            for s in first.stages}


def initial_predictor(members: list[StreamRun], mode: str) -> list[str]:
    """What the learner offers at the arrivals before its first training (--wait > 1): the
    initialised model of each member (Ens: all of them; gEns: the run's own), from stage 0's
    checkpoint.  Empty when the run does not wait or a member has no such file."""
    if not members[0].waits:
        return []
    runs = members[:1] if mode == "gens" else members
    if all(run.initial for run in runs):
        return [run.initial for run in runs]
    return []


def checkpoints_to_score(runs: list[StreamRun], mode: str) -> int:
    """How many checkpoints one scoring evaluates (each once: gEns's nested predictors share
    one pass over the data with all its members), the initialised models included."""
    total = sum(len(initial_predictor(group, mode)) for group in member_groups(runs, mode))
    return total + (len(runs[0].stages) if mode == "gens" else sum(len(r.stages) for r in runs))


def costs(members: list[StreamRun], mode: str) -> tuple[list[float], list[int], str]:
    """Comp, |θ_t| per arrival and the #experts label: Ens sums its members ("4@N"); gEns holds
    the s members trained so far ("4@s"), its FLOPs already summed by the stream."""
    records, label = members[0].records, members[0].experts_label()
    arrivals = range(len(records))
    flops = [sum(run.records[t].train_flops_cum for run in members) for t in arrivals]
    params = [sum(run.records[t].params_active for run in members) for t in arrivals]
    if mode == "ens":
        member = "+".join(sorted({run.experts_label() for run in members}))
        label = f"({member})@{len(members)}" if "@" in member else f"{member}@{len(members)}"
    elif mode == "gens":
        member = {r.stage: r.params_active for r in records if r.trained}
        params = [sum(member[s] for s in range(1, r.stage + 1)) or r.params_active for r in records]
        label = f"{label}@{len(members[0].stages)}"
    return flops, params, label
