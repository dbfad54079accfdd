"""Format version of the Switch LMs' state dicts, and the upgrade of older checkpoints.

Why: a checkpoint outlives the code that wrote it (stage checkpoints are scored weeks later,
runs resume after upgrades).  Like fairseq's own transformer (``decoder.version``), each
decoder keeps a ``version`` buffer in its state dict, and fairseq calls
``upgrade_state_dict_named`` on every submodule before it loads a checkpoint
(``BaseFairseqModel.load_state_dict(state, strict=True, model_cfg=cfg)``).  So an old layout is
rewritten in place to the current one and loads strictly, and a checkpoint from newer code is
refused with one line instead of a page of missing/unexpected keys.

History of ``SWITCH_DECODER_VERSION`` (``decoder.version``; ``decoder.members.<i>.version`` in UMix):
  1: no ``version`` entry (every checkpoint written before versions were recorded).
  2: the ``version`` entry is recorded; tensors otherwise unchanged.
History of ``UMIX_DECODER_VERSION`` (``decoder.version`` of ``umix_switch_transformer_lm``):
  1: no ``version`` entry; 2: recorded, otherwise unchanged.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from ..errors import CheckpointError

SWITCH_DECODER_VERSION = 2
UMIX_DECODER_VERSION = 2

# Upgrades from version v to v + 1, applied in order: fn(state_dict, prefix) rewrites in place.
# Version 1 -> 2 only adds the entry itself, so there is nothing to rewrite.
Upgrade = Callable[[dict, str], None]
SWITCH_DECODER_UPGRADES: dict[int, Upgrade] = {1: lambda state_dict, prefix: None}
UMIX_DECODER_UPGRADES: dict[int, Upgrade] = {1: lambda state_dict, prefix: None}


def register_version(module: nn.Module, version: int) -> None:
    """Give ``module`` its persistent ``version`` buffer (long, so ``.half()`` leaves it exact)."""
    module.register_buffer("version", torch.tensor([version], dtype=torch.long))


def upgrade_state_dict(
    state_dict: dict[str, Tensor], name: str, current: int, upgrades: dict[int, Upgrade], model: str
) -> None:
    """Bring the entries under ``name`` (a module's state-dict prefix, "" at the root) from the
    checkpoint's format version to ``current``, in place; refuse versions newer than ``current``."""
    prefix = f"{name}." if name else ""
    key = prefix + "version"
    found = state_dict.get(key)
    version = 1 if found is None else int(found.reshape(-1)[0].item())
    if version < 1:
        raise CheckpointError(f"{model} checkpoint entry {key} has format version {version}; versions start at 1")
    if version > current:
        raise CheckpointError(
            f"{model} checkpoint entry {key} has format version {version}, newer than this fairseq-alma "
            f"reads ({current}): load it with the fairseq-alma version that wrote it, or upgrade"
        )
    for step in range(version, current):
        upgrades[step](state_dict, prefix)
    state_dict[key] = torch.tensor([current], dtype=torch.long)
