"""fairseq's half-precision optimizers save all the state they train with, so a resume is exact.

Why: under ``--fp16`` and ``--bf16`` fairseq's ``FP16Optimizer`` trains an fp32 master copy of
the weights and copies its rounding into the half-precision model after every step.  Its
``state_dict`` saves Adam's state and the loss scale, but not the master copy: a resumed run
(``checkpoint_last.pt`` after a kill, ``ALMA_STOP_AFTER_STAGE``, a SIGUSR1 requeue) rebuilt it
from the half-precision weights (``Trainer.load_checkpoint`` rebuilds the optimizer after
loading the model), every fp32 digit they cannot hold was lost, and the resumed stream's stage
checkpoints and records differed from the uninterrupted run's (about 0.01 in eval_ppl after one
stage of a tiny model).  Likewise ``DynamicLossScaler`` saves its scale but not its counters, so
a resumed run grew the scale (``--fp16-scale-window``) at other updates than the uninterrupted
one, under ``--memory-efficient-fp16`` too.

The patch adds two entries to the optimizer state fairseq checkpoints and restores them when
fairseq loads it (after it rebuilt the optimizer):

* ``fp32_params``: the master copy, as a list of tensors (one flat tensor per device, or one per
  parameter with ``--fp16-no-flatten-grads`` and fairseq's own ``--bf16`` layout; the device
  keys are left out, so a rank restores rank 0's copy onto its own device).  An expert-parallel
  shard's copy is None (each rank holds other experts, and rank 0 saves): it is rebuilt from the
  model as before.  Each restored tensor must have its saved shape, or the load ends in one line;
  it changes the master copy only (the half-precision model loaded from the checkpoint is
  already its rounding).
* ``loss_scaler``: ``DynamicLossScaler``'s counters (``--fp16``, ``--memory-efficient-fp16``).
* ``amp_grad_scaler`` (``--amp``): torch's ``GradScaler`` state, of which fairseq saves nothing.

A checkpoint without them (one written before this patch) resumes as it did.  ``--reset-optimizer``
still resets both: fairseq then never loads the optimizer state.  The entries cost 4 bytes per
parameter in ``checkpoint_last.pt`` (stage checkpoints keep no optimizer state).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..errors import CheckpointError

MASTER_KEY = "fp32_params"
SCALER_KEY = "loss_scaler"
SCALER_COUNTERS = ("_iter", "_last_overflow_iter", "_last_rescale_iter", "_overflows_since_rescale")


def master_tensors(optimizer: Any) -> list[torch.Tensor]:
    """FP16Optimizer's fp32 master copy as a list: the values of {device: flat}, the one flat
    tensor, or the per-parameter copies, in the order fairseq builds them."""
    master = optimizer.fp32_params
    if torch.is_tensor(master):
        return [master]
    if isinstance(master, dict):
        return list(master.values())
    return list(master)


def _sharded(optimizer: Any, master: torch.Tensor) -> bool:
    """Whether ``master`` holds an expert-parallel shard (``param.expert``, which fairseq copies
    onto a per-parameter master; a flat master holding one mixes shards with shared weights)."""
    if getattr(master, "expert", False):
        return True
    flat = torch.is_tensor(optimizer.fp32_params) or isinstance(optimizer.fp32_params, dict)
    return flat and any(getattr(p, "expert", False) for p in optimizer.fp16_params)


def saved_master(optimizer: Any) -> list[Optional[torch.Tensor]]:
    """What the checkpoint keeps of the master copy (module doc)."""
    return [None if _sharded(optimizer, master) else master.detach() for master in master_tensors(optimizer)]


def check_saved_master(optimizer: Any, saved: Any) -> None:
    """Refuse, before anything is loaded, a saved master copy that does not fit this optimizer's.

    fairseq loads the model strictly first, so a mismatch means other precision flags (a flat
    copy against per-parameter copies), not another model."""
    current = master_tensors(optimizer)
    fits = isinstance(saved, (list, tuple)) and len(saved) == len(current) and all(
        value is None or (torch.is_tensor(value) and value.shape == master.shape)
        for value, master in zip(saved, current))
    if not fits:
        def shapes(tensors: Any) -> str:
            if not isinstance(tensors, (list, tuple)):
                return type(tensors).__name__
            listed = ", ".join(str(tuple(t.shape)) if torch.is_tensor(t) else "None" for t in tensors[:3])
            return f"{len(tensors)} tensor(s): {listed}{', ...' if len(tensors) > 3 else ''}"
        raise CheckpointError(f"the checkpoint's fp32 master weights ({shapes(saved)}) do not fit this "
                              f"run's --fp16/--bf16 optimizer ({shapes(current)}): the run was trained "
                              f"with other precision flags (e.g. --fp16-no-flatten-grads); resume it with "
                              f"the flags it was trained with")


def restore_master(optimizer: Any, saved: list[Optional[torch.Tensor]]) -> None:
    """Copy the saved master copy into the rebuilt one, in place (the torch optimizer's state is
    keyed by these very tensors)."""
    with torch.no_grad():
        for value, master in zip(saved, master_tensors(optimizer)):
            if value is not None:
                master.data.copy_(value)


def saved_scaler(scaler: Any) -> Optional[dict[str, int]]:
    """``DynamicLossScaler``'s counters (None without a loss scaler: ``--bf16``)."""
    if scaler is None or not all(hasattr(scaler, name) for name in SCALER_COUNTERS):
        return None
    return {name: int(getattr(scaler, name)) for name in SCALER_COUNTERS}


def restore_scaler(scaler: Any, saved: Any) -> None:
    if scaler is not None and isinstance(saved, dict):
        for name in SCALER_COUNTERS:
            if name in saved:
                setattr(scaler, name, int(saved[name]))


def _replace(cls: Any, state_dict: Any, load_state_dict: Any) -> None:
    """Put the wrappers in place of ``cls``'s two methods, marked (never wrapped twice) and
    keeping the originals as ``__wrapped__``."""
    for function, original in ((state_dict, cls.state_dict), (load_state_dict, cls.load_state_dict)):
        function._alma_patch = True  # type: ignore[attr-defined]
        function.__wrapped__ = original  # type: ignore[attr-defined]
    cls.state_dict, cls.load_state_dict = state_dict, load_state_dict


def _patch(cls: Any, with_master: bool) -> None:
    original_state_dict, original_load = cls.state_dict, cls.load_state_dict
    if getattr(original_state_dict, "_alma_patch", False):
        return

    def state_dict(self: Any) -> dict:
        state = original_state_dict(self)
        if with_master:
            state[MASTER_KEY] = saved_master(self)
        counters = saved_scaler(self.scaler)
        if counters is not None:
            state[SCALER_KEY] = counters
        return state

    def load_state_dict(self: Any, state_dict: Any, optimizer_overrides: Any = None) -> None:
        if not isinstance(state_dict, dict):
            return original_load(self, state_dict, optimizer_overrides)
        master = state_dict.get(MASTER_KEY) if with_master else None
        if master is not None:
            check_saved_master(self, master)
        fairseq_state = {key: value for key, value in state_dict.items() if key not in (MASTER_KEY, SCALER_KEY)}
        original_load(self, fairseq_state, optimizer_overrides)
        if master is not None:
            restore_master(self, master)
        restore_scaler(self.scaler, state_dict.get(SCALER_KEY))

    _replace(cls, state_dict, load_state_dict)


AMP_SCALER_KEY = "amp_grad_scaler"


def _patch_amp(cls: Any) -> None:
    """``AMPOptimizer``: its ``GradScaler``'s state (scale and growth tracker), which fairseq
    saves none of, so a resumed ``--amp`` run restarted at ``--amp-init-scale`` and skipped or
    grew at other updates than the uninterrupted one."""
    original_state_dict, original_load = cls.state_dict, cls.load_state_dict
    if getattr(original_state_dict, "_alma_patch", False):
        return

    def state_dict(self: Any) -> dict:
        state = dict(original_state_dict(self))
        scaler = self._grad_scaler.state_dict()
        if scaler:  # empty for a disabled scaler (no CUDA): nothing to keep
            state[AMP_SCALER_KEY] = scaler
        return state

    def load_state_dict(self: Any, state_dict: Any, optimizer_overrides: Any = None) -> None:
        if not isinstance(state_dict, dict):
            return original_load(self, state_dict, optimizer_overrides)
        original_load(self, {k: v for k, v in state_dict.items() if k != AMP_SCALER_KEY},
                      optimizer_overrides)
        saved = state_dict.get(AMP_SCALER_KEY)
        if saved and self._grad_scaler.is_enabled():
            self._grad_scaler.load_state_dict(saved)

    _replace(cls, state_dict, load_state_dict)


def install_fp16_master_in_checkpoints() -> None:
    """``FP16Optimizer``'s and ``MemoryEfficientFP16Optimizer``'s ``state_dict`` and
    ``load_state_dict`` with the state fairseq leaves out (module doc), and ``AMPOptimizer``'s
    with its grad scaler's; idempotent.  The memory-efficient one has no master copy (it steps
    the half-precision weights themselves)."""
    from fairseq.optim.amp_optimizer import AMPOptimizer
    from fairseq.optim.fp16_optimizer import FP16Optimizer, MemoryEfficientFP16Optimizer

    _patch(FP16Optimizer, with_master=True)
    _patch(MemoryEfficientFP16Optimizer, with_master=False)
    _patch_amp(AMPOptimizer)
