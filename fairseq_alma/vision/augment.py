"""CIFAR training augmentation on tensors: random crop with 4-pixel padding + horizontal flip.

App. B.1.2: "During training, we apply random horizontal flips and select random image crops with
padding of 4 pixels."  Done on whole mini-batches at once (no per-image Python loop, no
torchvision) and driven by an explicit ``torch.Generator`` so a stage replays identically.  The
generator is a CPU one whatever device the images are on: the draws are the same on CPU and
CUDA (a CPU run keeps its numbers), and only the few offsets and flips cross to the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .devices import to_device


def random_crop_flip(
    images: Tensor, generator: torch.Generator, padding: int = 4, fill: Tensor | None = None
) -> Tensor:
    """Pad each image by ``padding`` pixels, crop it back at a random offset, flip half of them.

    Args:
        images: (B, C, H, W).
        generator: source of the crop offsets and flips (a CPU generator; the draws move to
            the images' device).
        padding: pixels added on every side before cropping (paper: 4).
        fill: (C,) value of the padded border; default 0 (black: the stream's images are not
            normalised yet, the learner does that after augmentation).
    Returns:
        (B, C, H, W), a new tensor on the images' device.
    """
    batch, channels, height, width = images.shape
    device = images.device
    padded = F.pad(images, (padding, padding, padding, padding))
    if fill is not None:
        border = torch.ones(1, 1, height, width, dtype=images.dtype, device=device)
        border = 1.0 - F.pad(border, (padding, padding, padding, padding))  # 1 on the border
        padded = padded + border * fill.view(1, channels, 1, 1).to(device, images.dtype)
    offsets = to_device(torch.randint(0, 2 * padding + 1, (2, batch), generator=generator), device)
    rows = offsets[0, :, None] + torch.arange(height, device=device)  # (B, H)
    cols = offsets[1, :, None] + torch.arange(width, device=device)  # (B, W)
    flip = to_device(torch.rand(batch, generator=generator) < 0.5, device)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    batch_index = torch.arange(batch, device=device)[:, None, None]
    # Advanced indexing on dims 0, 2, 3 puts the channel dim last: (B, H, W, C).
    cropped = padded.permute(0, 2, 3, 1)[batch_index, rows[:, :, None], cols[:, None, :]]
    return cropped.permute(0, 3, 1, 2).contiguous()
