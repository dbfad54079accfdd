"""Older run formats turned into today's on load, in one place (as fairseq's
``upgrade_state_dict_named`` does for model weights).

Why one module: a run directory lives for days and outlives releases, so a run written by an
older fairseq-alma must resume (and be scored) as if today's code had written it.  If each live
path checked "is this an old file?" the resume logic would fork at every such spot and nobody
could say which formats are still read.  Here every older form is named with the release that
wrote it and turned into the current form as it is read; the live code sees one format.

  where                       older form                          today's form
  stream.jsonl record         <= 0.2: ``infer_flops_per_example``  ``infer_flops_per_token`` (LM) /
                                                                  ``infer_flops_per_image`` (vision)
  run directory               0.1: no ``run.json``                 ``run.json`` written at the claim
                                                                  (the settings cannot be checked)
  fingerprint (``run.json``)  before ``--replay-ratio`` /          the setting is in the fingerprint
                              ``--stage-lr-schedule`` existed     only when not at its default
  LM training state (the      0.1: absent (records only in         records of the finished stages
  task's entry of fairseq's   ``stream.jsonl``, growth only in     from ``stream.jsonl``, growth from
  checkpoint)                 ``growth.jsonl``, no stage clock)    ``growth.jsonl``, clock unknown
                              0.2: no stage clock                  clock unknown
  stage clock                 before partial replay: no            no skipped slots
                              ``skipped_slots``
  clock unknown               (either form above)                  rebuilt from fairseq's update
                                                                  counter at the first update
                                                                  (those releases skipped no step)

Nothing here imports fairseq or torch (``stream/`` rule).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from ..errors import RunDirError


class RunFiles(Protocol):
    """What an upgrade reads of a run directory (``run_dir.RunDirectory`` is one): declared
    here, not imported, because ``run_dir`` and ``records`` upgrade what they load with this
    module, which must therefore sit below them."""

    stream_log: Path

    def read_records(self) -> list[Any]: ...

    def read_growth(self) -> list[dict[str, Any]]: ...

logger = logging.getLogger(__name__)

LEGACY_INFER_FLOPS = "infer_flops_per_example"  # <= 0.2
INFER_FLOPS_LM, INFER_FLOPS_VISION = "infer_flops_per_token", "infer_flops_per_image"

# Settings added after run directories were written, by fingerprint section, with their default:
# in the fingerprint only when not at it, so a run directory written before a setting existed
# still resumes, and one that used a setting refuses a command without it (or with another value).
ADDED_SETTINGS = {"task": {"replay_ratio": 0.0}, "lr_scheduler": {"stage_lr_schedule": "restart"}}


def upgrade_record_json(obj: dict[str, Any]) -> dict[str, Any]:
    """A ``stream.jsonl`` object in today's keys: files of <= 0.2 named the FLOPs
    ``infer_flops_per_example`` although the LM wrote per-token numbers (an LM record has
    ``eval_ppl``; a vision record's number is per image)."""
    if LEGACY_INFER_FLOPS not in obj:
        return obj
    unit = INFER_FLOPS_LM if obj.get("eval_ppl") is not None else INFER_FLOPS_VISION
    return {(unit if key == LEGACY_INFER_FLOPS else key): value for key, value in obj.items()}


def note_run_without_fingerprint(path: Path) -> None:
    """A 0.1 run directory has run files but no ``run.json``: it is continued (the claim writes
    ``run.json`` from now on), but its settings could not be checked, which the user is told."""
    logger.warning("%s has no run.json (a run of fairseq-alma 0.1): its settings cannot be "
                   "checked; continuing it", path)


def drop_added_defaults(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """``fingerprint`` without the settings of ``ADDED_SETTINGS`` that are at their default, so
    it equals the fingerprint a release before those settings wrote for the same run."""
    for name, defaults in ADDED_SETTINGS.items():
        part = fingerprint.get(name)
        for key, default in defaults.items():
            if isinstance(part, dict) and key in part and part[key] == default:
                del part[key]
    return fingerprint


def upgrade_clock_state(state: dict[str, Any]) -> dict[str, Any]:
    """A ``StageClock`` state in today's form: before partial replay no skipped slots were kept
    (no replay then, so there is nothing to place)."""
    return state if "skipped_slots" in state else {**state, "skipped_slots": {}}


def upgrade_training_state(state: dict[str, Any] | None, run_dir: RunFiles,
                           stages_done: int | None) -> dict[str, Any]:
    """The LM training state of a checkpoint in today's form: ``progress``, ``growth``, and
    ``clock`` + ``started_stage`` (``clock`` None: unknown, ``clock_from_counter`` rebuilds it at
    the first update).

    ``state`` None is a checkpoint of 0.1, whose records lived only in ``stream.jsonl``: the
    records of the stages <= ``stages_done`` (the stages the checkpoint had finished) are taken
    from there, the growth steps from ``growth.jsonl``."""
    if state is None:
        return {"progress": {"records": records_from_log(run_dir, stages_done or 0)},
                "growth": run_dir.read_growth(), "clock": None, "started_stage": None}
    if "clock" not in state:  # 0.2: progress and growth, no clock
        return {"progress": state["progress"], "growth": list(state.get("growth", [])),
                "clock": None, "started_stage": None}
    return {**state, "clock": upgrade_clock_state(state["clock"])}


def records_from_log(run_dir: RunFiles, upto_stage: int) -> list[dict[str, Any]]:
    """The records of stages <= ``upto_stage`` in ``stream.jsonl`` (JSON objects), for a
    checkpoint written before records travelled in checkpoints."""
    if not run_dir.stream_log.is_file():
        return []
    try:
        logged = run_dir.read_records()
    except RunDirError as err:
        raise RunDirError(f"cannot resume: {err}") from None
    return [record.to_json() for record in logged if record.stage <= upto_stage]


def clock_from_counter(update_num: int, budget: int) -> tuple[dict[str, Any], int]:
    """(clock state, last started stage) at fairseq's update counter ``update_num``, for a
    checkpoint without a clock: the releases that wrote one skipped no step, so the counter is
    the position (a stage whose first update is next has not started yet)."""
    stage, counted = divmod(update_num, budget)
    stage += 1
    state = {"budget": budget, "stage": stage, "counted": counted, "skipped": 0,
             "skipped_by_stage": {}, "skipped_slots": {}}
    return state, stage - (1 if counted == 0 else 0)
