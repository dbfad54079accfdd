"""Multiply-accumulate counting for Comp, inference cost and |θ| (§3.1, Eq. 2).

Comp sums the training FLOPs spent on every mega-batch.  We count the multiply-adds (MACs) of
one forward pass from the layers that actually ran (forward hooks), per example, and convert:
one MAC is 2 FLOPs, and a training step costs forward + backward ≈ 3 forwards (the backward
computes gradients for both inputs and weights), so a trained example costs 6 × MACs FLOPs and
an evaluated one 2 × MACs.  ReLU, pooling and additions are not multiply-adds and are ignored.

A module that defines ``forward_macs(inputs, output) -> int`` is asked directly (our stacked
layers and mixture blocks: they know how many experts or members really ran) and its children
are not counted again; plain ``nn.Linear``, ``nn.Conv2d`` and batch norms are counted by formula.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

FLOPS_PER_MAC = 2
TRAIN_PASSES = 3  # forward + backward (input grads + weight grads)


def _torch_layer_macs(module: nn.Module, inputs: tuple, output: Tensor) -> int:
    if isinstance(module, nn.Linear):
        return output.numel() // output.shape[-1] * module.in_features * module.out_features
    if isinstance(module, nn.Conv2d):
        kernel = module.kernel_size[0] * module.kernel_size[1]
        return output.numel() * (module.in_channels // module.groups) * kernel
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return output.numel()
    return 0


def count_forward_macs(module: nn.Module, run: Callable[[], Any], batch_size: int) -> float:
    """MACs per example of the forward pass ``run()`` (which calls ``module`` on a batch of
    ``batch_size`` examples).  Runs under ``no_grad`` in the module's current mode."""
    total = [0]
    handles = []

    def hook(counter: Callable[[nn.Module, tuple, Tensor], int]):
        def record(mod: nn.Module, inputs: tuple, output: Tensor) -> None:
            total[0] += counter(mod, inputs, output)

        return record

    def visit(mod: nn.Module) -> None:
        if hasattr(mod, "forward_macs"):
            handles.append(mod.register_forward_hook(hook(lambda m, i, o: m.forward_macs(i, o))))
            return
        if isinstance(mod, (nn.Linear, nn.Conv2d, nn.modules.batchnorm._BatchNorm)):
            handles.append(mod.register_forward_hook(hook(_torch_layer_macs)))
            return
        for child in mod.children():
            visit(child)

    visit(module)
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return total[0] / batch_size


def count_parameters(modules: list[nn.Module] | nn.Module) -> int:
    """|θ|: number of parameters (trainable or frozen) the predictor holds (§3.1, Mem)."""
    if isinstance(modules, nn.Module):
        modules = [modules]
    seen: set[int] = set()
    count = 0
    for module in modules:
        for parameter in module.parameters():
            if id(parameter) not in seen:
                seen.add(id(parameter))
                count += parameter.numel()
    return count


def training_flops(macs_per_example: float, examples: int) -> float:
    """FLOPs of training steps over ``examples`` examples (forward + backward)."""
    return FLOPS_PER_MAC * TRAIN_PASSES * macs_per_example * examples


def inference_flops(macs_per_example: float, examples: int = 1) -> float:
    """FLOPs of forward passes over ``examples`` examples (evaluation, validation)."""
    return FLOPS_PER_MAC * macs_per_example * examples
