"""Stage-start actions that change weights or optimizer state under fairseq's feet.

They act on the same parameter tensors fairseq's optimizer already holds (values only, never the
parameter list), and resynchronise the fp32 master copy that --fp16/--bf16 training keeps, so the
next optimizer step starts from the new values instead of overwriting them with stale ones.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import torch


def reinitialize(model: Any, seed: int) -> None:
    """Fresh initialisation (``--stage-init scratch``, gEns members), seeded by (seed, stage).

    ``Module.apply`` visits children before parents, so a parent's ``reset_parameters`` (e.g. the
    decoder's embedding init) wins over its children's generic one.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.no_grad():
            model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") and m is not model else None)


def _torch_optimizer(optimizer: Any) -> Optional[torch.optim.Optimizer]:
    """The innermost torch optimizer behind fairseq's wrappers (FP16Optimizer, FairseqOptimizer)."""
    seen = 0
    while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and seen < 5:
        optimizer = getattr(optimizer, "fp32_optimizer", None) or getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
        seen += 1
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def sync_master_params(optimizer: Any, model: Any) -> None:
    """Copy model weights into FP16Optimizer's fp32 master params (flat or per-parameter)."""
    master = getattr(optimizer, "fp32_params", None)
    if master is None:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        if torch.is_tensor(master) or isinstance(master, dict):
            flats = master.values() if isinstance(master, dict) else [master]
            for flat in flats:
                offset = 0
                for p in params:
                    if flat.device != p.device and len(flats) > 1:
                        continue
                    n = p.numel()
                    flat.data[offset : offset + n].copy_(p.data.view(-1))
                    offset += n
        else:
            for dst, src in zip(master, params):
                dst.data.copy_(src.data)


def reset_optimizer_state(optimizer: Any, model: Any = None) -> None:
    """Forget moments/momenta (Adam, SGD): the new stage starts like a new run's first step."""
    inner = _torch_optimizer(optimizer)
    if inner is not None:
        inner.state = defaultdict(dict)
    if model is not None:
        sync_master_params(optimizer, model)
