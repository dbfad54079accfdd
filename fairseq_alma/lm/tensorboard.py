"""Per-arrival scalars in tensorboard, with the arrival as the step (next to fairseq's logs)."""

from __future__ import annotations

import os
from typing import Optional, Sequence

from ..stream.records import ArrivalRecord


def run_suffix(run_id: str) -> str:
    """The events-file suffix of the run ``run_id`` (its ``run.json`` hash): its own files are
    the ones it rewrites.  Two runs given one ``--tensorboard-logdir`` (as fairseq allows: both
    write ``train/``) each keep their curves, where the second deleted the first's; the hash,
    not the directory's path, so that a run moved, or requeued where the file system is
    mounted elsewhere, still replaces its own file."""
    return "." + run_id[:12]


def log_arrivals(logdir: Optional[str], records: Sequence[ArrivalRecord], run_id: str) -> None:
    """Rewrite this run's file in the ``stream`` run of ``logdir`` from all its records
    (idempotent across resumes): what ``stream.jsonl`` records per arrival, as scalars."""
    if not logdir:
        return
    try:
        from tensorboardX import SummaryWriter
    except ImportError:  # a run without it is refused at its start (train_flags.check_logging_backends)
        return
    path = os.path.join(logdir, "stream")
    os.makedirs(path, exist_ok=True)
    suffix = run_suffix(run_id)
    for name in os.listdir(path):
        if name.startswith("events.out") and name.endswith(suffix):
            os.remove(os.path.join(path, name))
    writer = SummaryWriter(path, filename_suffix=suffix)
    for r in records:
        scalars = {"stage": r.stage, "trained": int(r.trained), "megabatches_seen": r.megabatches_seen,
                   "eval_ppl": r.eval_ppl, "eval_nll": r.eval_nll, **r.valid,
                   "params_active": r.params_active, "train_tflops_cum": r.train_flops_cum / 1e12,
                   "infer_flops_per_token": r.infer_flops_per_token,
                   "infer_flops_per_sequence": r.extra.get("infer_flops_per_sequence")}
        for key, value in scalars.items():
            if value is not None:
                writer.add_scalar(f"stream/{key}", value, r.arrival)
    writer.close()
