"""Stage-start actions that change weights or optimizer state under fairseq's feet.

They act on the same parameter tensors fairseq's optimizer already holds (values only, never the
parameter list), and keep the fp32 master copy that --fp16/--bf16 training keeps in step with them,
so the next optimizer step starts from the new values instead of overwriting them with stale ones:
a fresh initialisation resynchronises the whole master copy from the model
(``sync_master_params``); growth writes only the rows it changes, into the model and into the
master copy alike (``master_param_like``), since the master copy's low bits are what mixed
precision trains with.
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
    """Copy model weights into FP16Optimizer's fp32 master params (flat or per-parameter).

    For a model whose every weight was just replaced (``--stage-init scratch``): it overwrites
    every fp32 digit the half-precision weights cannot hold, so a change to a few rows (growth)
    writes those rows into the master copy instead (``master_param_like``)."""
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


def optimizer_state_like(optimizer: Any, param: torch.Tensor) -> list[torch.Tensor]:
    """Views, shaped like ``param``, of the optimizer's per-element state of it (Adam's two
    moments), wherever fairseq keeps that state:

    * per parameter: plain fp32 training and ``--memory-efficient-fp16`` (state keyed by the
      model's own parameter);
    * ``--fp16`` (FP16Optimizer): in the fp32 master copy, keyed by the master parameter, which
      is one flat tensor of every trainable parameter in order (``fp16_params``), or one copy per
      parameter with ``--fp16-no-flatten-grads``.

    Empty before the first step (no state yet).  Growth writes into these views, so copied
    experts keep their moments under every precision flag."""
    inner = _torch_optimizer(optimizer)
    if inner is None:
        return []
    if getattr(optimizer, "fp32_params", None) is None or getattr(optimizer, "fp16_params", None) is None:
        key, offset = param, None
    else:
        slot = _master_slot(optimizer, param)
        if slot is None:
            return []
        key, offset = slot
    state = inner.state.get(key) or {}
    views = []
    for value in state.values():
        if not torch.is_tensor(value) or value.shape != key.shape:
            continue
        views.append(value.view(param.shape) if offset is None
                     else value[offset : offset + param.numel()].view(param.shape))
    return views


def _master_slot(optimizer: Any, param: torch.Tensor) -> Optional[tuple[torch.Tensor, Optional[int]]]:
    """Where FP16Optimizer keeps ``param``'s fp32 master copy: (the master tensor, the offset of
    ``param`` in it when it is flat, else None); None when ``param`` is not one it optimizes.

    The master copy is one flat tensor of every trainable parameter in order (``fp16_params``) per
    device ({device: flat}), or one copy per parameter with ``--fp16-no-flatten-grads`` (and
    fairseq's own ``--bf16`` layout)."""
    master, ordered = optimizer.fp32_params, optimizer.fp16_params
    index = next((i for i, p in enumerate(ordered) if p is param), None)
    if index is None:
        return None
    if isinstance(master, (list, tuple)):
        return master[index], None
    if torch.is_tensor(master):
        master = {None: master}
    flats = list(master.values())  # {device: flat}: offsets of the parameters on the same device
    key = flats[0] if len(flats) == 1 else master[param.device.index]
    same = [p for p in ordered[:index] if len(flats) == 1 or p.device == param.device]
    return key, sum(p.numel() for p in same)


def master_param_like(optimizer: Any, param: torch.Tensor) -> Optional[torch.Tensor]:
    """A view, shaped like ``param``, of its fp32 master copy under ``--fp16``/``--bf16``
    (FP16Optimizer); None where there is none (fp32 training, ``--memory-efficient-fp16``, AMP).

    Writing into it changes what the next optimizer step starts from: the half-precision model
    is only the rounding of the master copy, which fairseq copies back after every step."""
    if getattr(optimizer, "fp32_params", None) is None or getattr(optimizer, "fp16_params", None) is None:
        return None
    slot = _master_slot(optimizer, param)
    if slot is None:
        return None
    key, offset = slot
    data = key.data
    return data.view(param.shape) if offset is None else data[offset : offset + param.numel()].view(param.shape)


def reset_optimizer_state(optimizer: Any, model: Any = None) -> None:
    """Forget moments/momenta (Adam, SGD): the new stage starts like a new run's first step."""
    inner = _torch_optimizer(optimizer)
    if inner is not None:
        inner.state = defaultdict(dict)
    if model is not None:
        sync_master_params(optimizer, model)
