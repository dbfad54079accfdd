"""Per-arrival scalars in tensorboard, with the arrival as the step (next to fairseq's logs)."""

from __future__ import annotations

import os
from typing import Optional, Sequence

from ..stream.records import ArrivalRecord


def log_arrivals(logdir: Optional[str], records: Sequence[ArrivalRecord]) -> None:
    """Rewrite the ``stream`` run of ``logdir`` from all records (idempotent across resumes)."""
    if not logdir:
        return
    try:
        from tensorboardX import SummaryWriter
    except ImportError:  # a run without it is refused at its start (train_flags.check_logging_backends)
        return
    path = os.path.join(logdir, "stream")
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        if name.startswith("events.out"):
            os.remove(os.path.join(path, name))
    writer = SummaryWriter(path)
    for r in records:
        writer.add_scalar("stream/eval_ppl", r.eval_ppl, r.arrival)
        for key, value in r.valid.items():
            writer.add_scalar(f"stream/{key}", value, r.arrival)
        writer.add_scalar("stream/params_active", r.params_active, r.arrival)
        writer.add_scalar("stream/train_tflops_cum", r.train_flops_cum / 1e12, r.arrival)
    writer.close()
