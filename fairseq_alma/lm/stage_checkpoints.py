"""``checkpoint_stage{s}.pt``: the model at the end of stage s, kept for scoring (alma-score,
fairseq-eval-lm, gEns members).

fairseq saves ``checkpoint_last.pt`` at the end of every epoch (= stage) before it asks the task
for the next stage's data; the task then copies it here without the optimizer state (a scoring
checkpoint does not need it, and Adam's moments would triple its size).  A copy that is missing
after a crash is made again on restart: fairseq's checkpoint_last is still that stage's end until
the next stage trains, which cannot happen before this copy.  Writes are atomic (temp + rename).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

logger = logging.getLogger(__name__)


def stage_checkpoint_path(save_dir: str, stage: int) -> str:
    return os.path.join(save_dir, f"checkpoint_stage{stage}.pt")


def _is_end_of_stage(state: dict, stage: int) -> bool:
    itr = (state.get("extra_state") or {}).get("train_iterator") or {}
    # fairseq stores the *next* epoch with 0 iterations once an epoch is finished
    return itr.get("epoch") == stage + 1 and itr.get("iterations_in_epoch", 0) == 0


def materialize_stage_checkpoint(save_dir: str, stage: int, alma_info: dict) -> Optional[str]:
    """Copy checkpoint_last.pt (if it is the end of ``stage``) to checkpoint_stage{stage}.pt."""
    target = stage_checkpoint_path(save_dir, stage)
    if os.path.exists(target):
        return target
    source = os.path.join(save_dir, "checkpoint_last.pt")
    if not os.path.exists(source):
        logger.warning("no %s to keep as the end of stage %d", source, stage)
        return None
    state = torch.load(source, map_location="cpu", weights_only=False)
    if not _is_end_of_stage(state, stage):
        logger.warning("%s is not the end of stage %d; stage checkpoint not written", source, stage)
        return None
    state["last_optimizer_state"] = None
    state["alma"] = alma_info
    tmp = f"{target}.tmp{os.getpid()}"
    torch.save(state, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, target)
    logger.info("kept the end of stage %d as %s", stage, target)
    return target
