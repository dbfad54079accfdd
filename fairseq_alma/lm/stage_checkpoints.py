"""``checkpoint_stage{s}.pt``: the model at the end of stage s, kept for scoring (alma-score,
fairseq-eval-lm, gEns members); ``checkpoint_stage0.pt`` the initialised model, kept when it
answers arrivals (--wait > 1), so that scoring can charge those arrivals (the anytime metric).

fairseq saves ``checkpoint_last.pt`` at the end of every epoch (= stage) before it asks the task
for the next stage's data; the task then copies it here without the optimizer state (a scoring
checkpoint does not need it, and Adam's moments would triple its size).  A copy that is missing
after a crash is made again on restart: fairseq's checkpoint_last is still that stage's end until
the next stage trains, which cannot happen before this copy.  The write goes through the run
directory (writer only, atomic).

Each stage checkpoint's stamp (``alma``: run hash, stage, dictionary) also holds the digest of
its model tensors (``weights_sha256``, ``weights_digest``), so that alma-score can tell the
weights training kept from another file put under the name: fairseq's
``scripts/average_checkpoints.py`` keeps its first input's stamp, so an average of stages 2 and
3 of a grown run (an expert count neither had) passed the stamp check and scored in stage 2's
column.  sha256, not blake2b: with the SHA extensions of current CPUs it is about twice as fast
(1.4 GB/s against 0.7 on one core), so a stage checkpoint of 1 GB costs about 0.7 s at the save
and again when alma-score checks it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
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


WEIGHTS_DIGEST_KEY = "weights_sha256"  # in a stage checkpoint's ``alma`` stamp (module doc)


def weights_digest(weights: Mapping[str, Any]) -> str:
    """sha256 of a checkpoint's model tensors in state-dict order: each tensor's name, dtype,
    shape and bytes, so that a renamed, reshaped, recast or averaged tensor changes it.

    Why the bytes and not the values: the check asks "is this the file training kept", and the
    file holds these bytes (half precision stays half); memory-mapped tensors are read in place."""
    digest = hashlib.sha256()
    for name, value in weights.items():
        if not isinstance(value, torch.Tensor):
            digest.update(f"{name}={value!r};".encode("utf-8"))
            continue
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{flat.dtype}:{tuple(value.shape)};".encode("utf-8"))
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()


def stamped(alma_info: dict[str, Any], weights: Mapping[str, Any]) -> dict[str, Any]:
    """The stamp of a stage checkpoint holding ``weights``: training's ``alma_info`` and the
    digest of the weights (module doc)."""
    return {**alma_info, WEIGHTS_DIGEST_KEY: weights_digest(weights)}


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
    state["alma"] = stamped(alma_info, state["model"])
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
    model_state = {key: value.detach().cpu() for key, value in weights.items()}
    state = {
        "args": None,
        "cfg": cfg,
        "model": model_state,
        "criterion": None,
        "optimizer_history": [{"criterion_name": names["criterion"], "optimizer_name": names["optimizer"],
                               "lr_scheduler_state": {}, "num_updates": 0}],
        "task_state": task_state,
        "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 0}},
        "last_optimizer_state": None,
        "alma": stamped(alma_info, model_state),
    }
    run_dir.write_file(target.name, lambda handle: torch.save(state, handle))
    logger.info("kept the initialised model as %s (it answers the arrivals before the first training)", target)
    return target
