"""LR meta-schedules across the stages of a stream (``--stage-lr-schedule``): pure functions of
(stage, position in the stage), so a resumed run gets exactly the learning rates of an
uninterrupted one.

Why several: ALMA restarts the same schedule at every stage (App. B.2: warmup, then linear
decay to 0).  Continual-pretraining work finds that how each round re-warms and re-decays the
LR, and how high its peak is, decides the balance between learning the new data and forgetting
the old (Gupta et al. 2023, arXiv:2308.04014, "Continual Pre-Training of LLMs: How to (re)warm
your model?"; Ibrahim et al. 2024, arXiv:2403.08763), and TiC-LM (Li et al., ACL 2025,
arXiv:2504.02107) compares per-round schedules and meta-schedules over 114 monthly rounds.

  restart  ALMA's (App. B.2), today's default, unchanged: every stage warms up linearly from
           --warmup-init-lr to --lr over --warmup-updates, then falls linearly to reach 0 at
           the stage's end.
  cyclic   TiC-LM's "Cyclic Cosine": the same warmup to the same peak every stage, then a
           cosine decay to 0 at the stage's end:
             lr = peak * (1 + cos(pi * (p - W) / (U - W))) / 2      for W <= p < U
           (apple/ml-tic-lm, training/utils.py ``cosine_decay``: warmup max_lr*(p+1)/W, then
           this cosine; TiC-LM decays to a floor, ``--lr-cooldown-end``, 3e-5 in its example;
           here the floor is 0, as in ``restart``, so the two differ only in the decay's shape).
  decay    ``restart`` with a peak that falls across stages: stage s peaks at --lr / sqrt(s)
           (1, 0.707, 0.577, 0.5, ... of --lr).  The 1/sqrt(s) rule is issue 14's; it is the
           stage-level analogue of the inverse-square-root schedule, and plays the role of
           TiC-LM's "autoregressive meta-schedule" (``--use-ar-schedule``, training/utils.py
           ``cosine_plus_ar_max_lr``: each round's peak is the value, one warmup into the round,
           of a single cosine spanning every round up to and including it, so it falls round
           by round).

p is the 0-based position of the update in the stage, U the stage's budget, W the warmup.
"""

from __future__ import annotations

import math

STAGE_LR_SCHEDULES = ("restart", "cyclic", "decay")


def stage_lr(position: int, budget: int, warmup: int, peak: float, init: float = 0.0) -> float:
    """LR for the update at 0-based ``position`` inside a stage of ``budget`` updates.

    Warmup reaches ``peak`` at position ``warmup - 1``; afterwards the LR falls linearly and
    would reach exactly 0 at position ``budget`` (the first update of the next stage restarts).
    """
    if position < warmup:
        return init + (peak - init) * (position + 1) / warmup
    return peak * (budget - position) / max(1, budget - warmup)


def cosine_stage_lr(position: int, budget: int, warmup: int, peak: float, init: float = 0.0) -> float:
    """``stage_lr``'s warmup, then a cosine from ``peak`` (at position ``warmup``) that would
    reach 0 at position ``budget`` (TiC-LM's per-round cosine with a floor of 0)."""
    if position < warmup:
        return init + (peak - init) * (position + 1) / warmup
    return peak * 0.5 * (1.0 + math.cos(math.pi * (position - warmup) / max(1, budget - warmup)))


def stage_peak(peak: float, stage: int, schedule: str) -> float:
    """Peak LR of 1-based ``stage``: ``peak`` / sqrt(stage) for ``decay``, else ``peak``."""
    if schedule not in STAGE_LR_SCHEDULES:
        raise ValueError(f"stage LR schedule {schedule!r} is not one of {STAGE_LR_SCHEDULES}")
    if stage < 1:
        raise ValueError(f"stages are counted from 1 (got {stage})")
    return peak / math.sqrt(stage) if schedule == "decay" else peak


def scheduled_lr(schedule: str, stage: int, position: int, budget: int, warmup: int, peak: float,
                 init: float = 0.0) -> float:
    """LR of the update at ``position`` (0-based) of 1-based ``stage`` (module doc)."""
    top = stage_peak(peak, stage, schedule)
    if schedule == "cyclic":
        return cosine_stage_lr(position, budget, warmup, top, init)
    return stage_lr(position, budget, warmup, top, init)


def describe_schedule(schedule: str, peak: float, stages: int) -> str:
    """One line for the log at start: the schedule and the peaks it gives the first stages."""
    shape = {"restart": "warmup then linear decay to 0 in every stage, same peak (ALMA App. B.2)",
             "cyclic": "warmup then cosine decay to 0 in every stage, same peak (TiC-LM's Cyclic Cosine)",
             "decay": "warmup then linear decay to 0 in every stage, peak --lr/sqrt(stage) (issue 14)"}[schedule]
    shown = min(stages, 4)
    peaks = ", ".join(f"{stage_peak(peak, s, schedule):.4g}" for s in range(1, shown + 1))
    more = ", ..." if stages > shown else ""
    return f"--stage-lr-schedule {schedule}: {shape}; stage peaks {peaks}{more}"
