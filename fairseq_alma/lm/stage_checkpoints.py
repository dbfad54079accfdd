"""``checkpoint_stage{s}.pt``: the model at the end of stage s, kept for scoring (alma-score,
fairseq-eval-lm, gEns members); ``checkpoint_stage0.pt`` the initialised model, kept when it
answers arrivals (--wait > 1), so that scoring can charge those arrivals (the anytime metric).

fairseq saves ``checkpoint_last.pt`` at the end of every epoch (= stage) before it asks the task
for the next stage's data; the task then copies it here without the optimizer state (a scoring
checkpoint does not need it, and Adam's moments would triple its size).  A copy that is missing
after a crash is made again on restart: fairseq's checkpoint_last is still that stage's end until
the next stage trains, which cannot happen before this copy.  The write goes through the run
directory (writer only, atomic).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from ..checkpoint_load import load_checkpoint
from ..stream.run_dir import RunDirectory

logger = logging.getLogger(__name__)


def _is_end_of_stage(state: dict, stage: int) -> bool:
    itr = (state.get("extra_state") or {}).get("train_iterator") or {}
    # fairseq stores the *next* epoch with 0 iterations once an epoch is finished
    return itr.get("epoch") == stage + 1 and itr.get("iterations_in_epoch", 0) == 0


def keep_stage_checkpoint(run_dir: RunDirectory, stage: int, alma_info: dict[str, Any]) -> Path | None:
    """Copy checkpoint_last.pt (if it is the end of ``stage``) to checkpoint_stage{stage}.pt."""
    target = run_dir.stage_checkpoint(stage)
    if not run_dir.writes or target.exists():
        return target if target.exists() else None
    source = run_dir.last_checkpoint
    if not source.exists():
        logger.warning("no %s to keep as the end of stage %d", source, stage)
        return None
    state = load_checkpoint(source)  # this run's own file, read as any checkpoint is
    if not _is_end_of_stage(state, stage):
        logger.warning("%s is not the end of stage %d; stage checkpoint not written", source, stage)
        return None
    state["last_optimizer_state"] = None
    state["alma"] = alma_info
    run_dir.write_file(target.name, lambda handle: torch.save(state, handle))
    logger.info("kept the end of stage %d as %s", stage, target)
    return target


def keep_initial_checkpoint(run_dir: RunDirectory, model: Any, fairseq_cfg: Any, task_state: dict[str, Any],
                            alma_info: dict[str, Any]) -> Path | None:
    """Write ``checkpoint_stage0.pt``: the model before any training, in fairseq's checkpoint
    layout (``cfg``, ``model``, ``optimizer_history``, ``extra_state``, ``task_state``), so that
    alma-score, fairseq-eval-lm and ensembles load it like every other stage checkpoint.

    Why not fairseq's own save: fairseq writes its first checkpoint at the end of stage 1; the
    initial weights exist only before the first update.  Every process calls this (a sharded
    model's ``state_dict`` is collective); the run directory decides who writes.
    """
    target = run_dir.stage_checkpoint(0)
    weights = model.state_dict()
    if not run_dir.writes or target.exists():
        return target if target.exists() else None
    cfg = OmegaConf.to_container(fairseq_cfg, resolve=True, enum_to_str=True) \
        if OmegaConf.is_config(fairseq_cfg) else fairseq_cfg
    # a pre-dataclass component (--optimizer sgd, ...) keeps its config as a Namespace
    names = {key: part.get("_name") if isinstance(part, dict) else getattr(part, "_name", None)
             for key, part in ((key, cfg.get(key)) for key in ("criterion", "optimizer", "lr_scheduler"))}
    state = {
        "args": None,
        "cfg": cfg,
        "model": {key: value.detach().cpu() for key, value in weights.items()},
        "criterion": None,
        "optimizer_history": [{"criterion_name": names["criterion"], "optimizer_name": names["optimizer"],
                               "lr_scheduler_state": {}, "num_updates": 0}],
        "task_state": task_state,
        "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 0}},
        "last_optimizer_state": None,
        "alma": alma_info,
    }
    run_dir.write_file(target.name, lambda handle: torch.save(state, handle))
    logger.info("kept the initialised model as %s (it answers the arrivals before the first training)", target)
    return target
