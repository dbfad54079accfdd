"""An expert-growth plan (``--grow-experts`` / ``--grow-at-stages``): its parse, and the one form
in which two run fingerprints compare it.

Why its own module, without fairseq or torch (``stream/`` rule): the plan is read by training
(``tasks/alma_stream.py``, ``lm/growth.py``) and compared wherever run fingerprints are (resume:
``run_dir.same_run``; Ens members: ``scoring/runs.py``; alma-report's seed grouping:
``report/seeds.py``), and those comparisons must not import torch.

Why a comparison form: one plan has several spellings.  ``--grow-experts 2`` means the same k at
every growth stage (``2,2`` on a 3-stage stream), and leaving out ``--grow-at-stages`` means
every stage after the first (``2,3``).  ``run.json`` stores the flags as typed, so the same run
requeued by a script that spells its plan the other way was refused as "another run" (and told
to --restart-stream, which starts it over), two seeds of one plan were refused as Ens members,
and alma-report showed them as two settings.  Comparisons therefore read the parsed plan;
``run.json`` keeps the flags as typed (its hash is stamped in every stage checkpoint, so
rewriting it would orphan them), which also leaves the files of earlier releases as they are.
"""

from __future__ import annotations

from typing import Any

from ..errors import UsageError


def parse_growth_plan(grow_experts: str, grow_at_stages: str, num_stages: int) -> dict[int, int]:
    """{stage: experts to copy per MoE block} from --grow-experts / --grow-at-stages.

    ``--grow-experts 2,2,4`` with the default stages (every stage after the first) is Table 2's
    gMoE 4 -> 6 -> 8 -> 12; one k means the same k at every growth stage.
    """
    if not grow_experts.strip():
        return {}
    try:
        counts = [int(k) for k in grow_experts.split(",")]
        stages = [int(s) for s in grow_at_stages.split(",")] if grow_at_stages.strip() else None
    except ValueError:
        raise UsageError(f"--grow-experts/--grow-at-stages take comma-separated integers (got "
                         f"{grow_experts!r} / {grow_at_stages!r})") from None
    stages = stages or list(range(2, num_stages + 1))
    if not all(2 <= s <= num_stages for s in stages):
        raise UsageError(f"--grow-at-stages must list stages in [2, {num_stages}] (got "
                         f"{grow_at_stages!r})")
    if len(counts) == 1:
        counts = counts * len(stages)
    if len(counts) != len(stages) or not all(k >= 1 for k in counts):
        raise UsageError(f"--grow-experts needs one k >= 1, or one per growth stage "
                         f"({len(stages)}); got {grow_experts!r}")
    return dict(zip(stages, counts))


def _stream_stages(task: dict[str, Any], num_megabatches: Any) -> int | None:
    """Stages of the stream a fingerprint's task settings train (None: not known from it)."""
    from .schedule import build_schedule

    wait = task.get("wait", 1)
    if num_megabatches is None or wait is None or isinstance(wait, str):  # --wait auto never grows
        return None
    try:
        replay_ratio = float(task.get("replay_ratio") or 0.0)  # left out at its default (upgrade.py)
        return len(build_schedule(int(num_megabatches), int(wait), bool(task.get("replay")),
                                  partial_replay=replay_ratio > 0))
    except (TypeError, ValueError):
        return None


def with_parsed_growth_plan(fingerprint: Any, num_megabatches: int | None = None) -> Any:
    """``fingerprint`` (``{"config": {"task": ...}, "data": ...}``, as ``run.json`` holds it)
    with its growth plan written one way (module doc): ``grow_experts`` one k per growth stage
    and ``grow_at_stages`` those stages, e.g. ``'2,2'`` and ``'2,3'`` for ``--grow-experts 2``
    on a 3-stage stream.  ``num_megabatches``: the stream's B when the fingerprint lacks the data
    identity (a run of fairseq-alma 0.1, compared by its checkpoint's config).  A fingerprint
    without growth, or whose plan cannot be read, is returned as it is."""
    config = fingerprint.get("config") if isinstance(fingerprint, dict) else None
    task = config.get("task") if isinstance(config, dict) else None
    grow = task.get("grow_experts") if isinstance(task, dict) else None
    if not isinstance(grow, str) or not grow.strip():
        return fingerprint
    data = fingerprint.get("data")
    if num_megabatches is None and isinstance(data, dict):
        num_megabatches = data.get("num_megabatches")
    stages = _stream_stages(task, num_megabatches)
    at = task.get("grow_at_stages") or ""
    if stages is None or not isinstance(at, str):
        return fingerprint
    try:
        plan = parse_growth_plan(grow, at, stages)
    except UsageError:  # not a plan training accepts: compared as written
        return fingerprint
    ordered = sorted(plan)
    task = {**task, "grow_experts": ",".join(str(plan[stage]) for stage in ordered),
            "grow_at_stages": ",".join(str(stage) for stage in ordered)}
    return {**fingerprint, "config": {**config, "task": task}}
