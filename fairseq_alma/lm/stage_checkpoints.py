"""``checkpoint_stage{s}.pt``: the model at the end of stage s, kept for scoring (alma-score,
fairseq-eval-lm, gEns members).

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
    state = torch.load(source, map_location="cpu", weights_only=False)
    if not _is_end_of_stage(state, stage):
        logger.warning("%s is not the end of stage %d; stage checkpoint not written", source, stage)
        return None
    state["last_optimizer_state"] = None
    state["alma"] = alma_info
    run_dir.write_file(target.name, lambda handle: torch.save(state, handle))
    logger.info("kept the end of stage %d as %s", stage, target)
    return target
