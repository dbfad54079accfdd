"""Where vision tensors live and in which precision the forward passes run.

Why one module: growth (gEns members, gMoE splits, Firefly units), augmentation, hard routing
and the stage trainer all draw their random numbers from CPU ``torch.Generator``s, so a CPU run
keeps its exact numbers and a CUDA run makes the very same draws, and then move what they drew
to the learner's device.  Doing that move inside the training loop without making the host wait
for the GPU needs pinned memory, and mixed precision needs one checked mapping from the
``--vision-amp`` value to an autocast context; both live here so every caller does it alike.
"""

from __future__ import annotations

import contextlib
import itertools
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn

from ..errors import UsageError

AMP_MODES = ("off", "fp16", "bf16")
_AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` on ``device`` (itself when already there).

    A CPU tensor bound for CUDA goes through pinned memory with ``non_blocking``: a plain
    ``.to("cuda")`` from pageable memory waits for the GPU's queue to drain, which in the hot
    loop would be one host sync per mini-batch.
    """
    if tensor.device == device:
        return tensor
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def placement(module: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Device and floating dtype of ``module``'s first floating tensor (CPU and the default
    dtype for a module without one): where and in what a grown tensor must be created."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.is_floating_point():
            return tensor.device, tensor.dtype
    return torch.device("cpu"), torch.get_default_dtype()


def planned_device(choice: str, cpu_flag: bool = False) -> str:
    """The device a run of these flags trains on, judged without asking this machine: a GPU
    unless --vision-device cpu or fairseq's --cpu says otherwise. ``alma-sweep submit`` checks
    with it on a login node, which has no GPU while the nodes that train do."""
    if choice not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--vision-device {choice!r} is unknown; use auto, cpu or cuda")
    if choice == "cuda" and cpu_flag:
        raise UsageError("--vision-device cuda contradicts --cpu; drop one of them")
    return "cpu" if choice == "cpu" or cpu_flag else "cuda"


def resolve_device(choice: str, cpu_flag: bool = False) -> str:
    """``--vision-device auto|cpu|cuda`` (with fairseq's ``--cpu``) as a torch device name:
    auto is the GPU when torch sees one and --cpu is not given."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("--vision-device cuda: no CUDA device is visible to torch here; use "
                         "--vision-device cpu (or auto)")
    device = planned_device(choice, cpu_flag)
    return "cpu" if device == "cuda" and not torch.cuda.is_available() else device  # auto


def check_amp(amp: str, device: torch.device) -> None:
    """Refuse an unknown mode, and fp16 off CUDA (no loss scaling or fast fp16 kernels there)."""
    if amp not in AMP_MODES:
        raise UsageError(f"--vision-amp {amp!r} is unknown; use one of {', '.join(AMP_MODES)}")
    if amp == "fp16" and device.type != "cuda":
        raise UsageError("--vision-amp fp16 needs a CUDA device; use bf16 or off on CPU")


def autocast(amp: str, device: torch.device) -> AbstractContextManager:
    """The context the forward passes run in: nothing for ``off`` (bit-identical numbers),
    else ``torch.autocast`` in fp16 or bf16 on ``device``'s type."""
    check_amp(amp, device)
    if amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_AMP_DTYPES[amp])


def upcast(tensor: Tensor) -> Tensor:
    """fp16/bf16 logits as float32, so losses and log-probabilities are computed in float32;
    float32 and float64 tensors are returned as they are."""
    return tensor.float() if tensor.dtype in _HALF_DTYPES else tensor


def optimizer_step(loss: Tensor, optimizer: torch.optim.Optimizer,
                   scaler: torch.amp.GradScaler | None) -> None:
    """One update from ``loss``: plain, or through fp16's loss scaler (which may skip it)."""
    optimizer.zero_grad(set_to_none=True)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
