"""One log line per arrival of an LM stream, in fairseq's own format (``--log-format``).

Why: fairseq's log shows the training loss of every stage (an epoch), but an ``alma_stream`` run
turns fairseq's validation off and measures the model after every arrival itself
(``stream.jsonl``), so a user watching a run (its Slurm ``.out`` file, ``--log-file``) saw no
evaluation at all.  Printed through fairseq's progress bar with the tag ``stream``, the line is
what a fairseq user expects next to ``train | epoch ...``:
``stream | arrival 002 | stage 2 | ... | eval_ppl 113.63 | valid_ppl 116.66 | ...``, one JSON
object under ``--log-format json`` (keys ``stream_...``), and copied to ``--log-file``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional, Sequence

from ..stream.records import ArrivalRecord


def arrival_stats(record: ArrivalRecord) -> "OrderedDict[str, Any]":
    """What the line shows, perplexities rounded as fairseq rounds its own (2 decimals)."""
    stats: OrderedDict[str, Any] = OrderedDict()
    stats["stage"] = record.stage
    stats["megabatches_seen"] = record.megabatches_seen
    stats["trained"] = int(record.trained)
    if record.eval_ppl is not None:
        stats["eval_ppl"] = round(record.eval_ppl, 2)
    for key, value in record.valid.items():
        if key.endswith("_ppl"):
            stats[key] = round(value, 2)
    stats["train_tflops_cum"] = float(f"{record.train_flops_cum / 1e12:.4g}")
    stats["params_active"] = record.params_active
    return stats


def print_arrivals(records: Sequence[ArrivalRecord], log_format: Optional[str],
                   log_file: Optional[str] = None, no_progress_bar: bool = False) -> None:
    """Log ``records`` (this process just wrote them) as fairseq logs its end-of-epoch stats.

    ``log_file`` is fairseq's ``--log-file``: fairseq's progress bar adds a handler for it at
    every call (``fairseq_glue/patches.install_one_log_file_handler`` makes that once); the
    default format is fairseq-train's (``--no-progress-bar``: simple, else tqdm when a terminal)."""
    from fairseq.logging import progress_bar

    for record in records:
        bar = progress_bar.progress_bar([], log_format=log_format, log_file=log_file,
                                        prefix=f"arrival {record.arrival:03d}",
                                        default_log_format="simple" if no_progress_bar else "tqdm")
        stats = arrival_stats(record)
        if isinstance(bar, progress_bar.JsonProgressBar):  # no prefix in JSON: the arrival is a key
            stats = OrderedDict([("arrival", record.arrival), *stats.items()])
        bar.print(stats, tag="stream", step=record.arrival)
