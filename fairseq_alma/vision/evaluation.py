"""Forward passes without gradients: validation losses (best-epoch selection) and test error.

Split from ``stage_trainer`` (which re-exports both) because the stream evaluates a learner
after every arrival, not only inside a stage.  Both run where the learner's parameters are,
accept data on the CPU or already on that device, optionally under autocast (``amp``), compute
losses in float32, and keep their sums on the device: nothing is read back on the host before
the end, which on a GPU would stall every batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .devices import autocast, to_device, upcast
from .learners import Learner


def validation_losses(
    learner: Learner, x: Tensor, y: Tensor, batch_size: int, amp: str = "off"
) -> Tensor:
    """(G,) on the learner's device: mean cross-entropy (float32, summed in float64) of each
    selection group of ``learner.train_logits`` on (x, y)."""
    module = learner.trainable()
    device = learner.device
    cast = autocast(amp, device)
    was_training = module.training
    module.eval()
    total = None
    with torch.no_grad():
        for start in range(0, x.shape[0], batch_size):
            with cast:
                logits = learner.train_logits(to_device(x[start : start + batch_size], device))
            logits = upcast(logits)  # (G, B, C)
            target = to_device(y[start : start + batch_size], device)
            target = target.expand(logits.shape[0], -1)
            losses = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
            part = losses.view(logits.shape[0], -1).double().sum(dim=1)
            total = part if total is None else total + part
    module.train(was_training)
    return total / x.shape[0]


@dataclass(frozen=True)
class EvalResult:
    """Test error rate (the metric of Eq. 1), mean loss and example count."""

    error: float
    loss: float
    examples: int


def evaluate(
    learner: Learner, x: Tensor, y: Tensor, batch_size: int = 1024, *, amp: str = "off"
) -> EvalResult:
    """Error of the learner's predictor (the averaged ensemble for Ens/gEns) on (x, y).

    The counts are summed on the device (float64 for the loss, as exact as summing on the host)
    and read once at the end."""
    device = learner.device
    cast = autocast(amp, device)
    was_training = learner.training
    learner.eval()
    wrong = torch.zeros((), dtype=torch.long, device=device)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for start in range(0, x.shape[0], batch_size):
            with cast:
                log_probs = learner.predict_log_probs(
                    to_device(x[start : start + batch_size], device)
                )
            log_probs = upcast(log_probs)
            target = to_device(y[start : start + batch_size], device)
            wrong += (log_probs.argmax(dim=-1) != target).sum()
            loss += F.nll_loss(log_probs, target, reduction="sum").double()
    learner.train(was_training)
    examples = x.shape[0]
    return EvalResult(error=int(wrong) / examples, loss=float(loss) / examples, examples=examples)
