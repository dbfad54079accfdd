"""lm/tensorboard.py: each run rewrites only its own events file in ``<logdir>/stream``, with
every number its records hold."""

from __future__ import annotations

import struct
from pathlib import Path

from tensorboardX.proto import event_pb2

from fairseq_alma.lm.tensorboard import log_arrivals
from fairseq_alma.stream.records import ArrivalRecord


def _scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of one events file (TFRecord framing: length, crc, data, crc)."""
    out: dict[str, list[tuple[int, float]]] = {}
    data, at = path.read_bytes(), 0
    while at < len(data):
        size = struct.unpack("<Q", data[at:at + 8])[0]
        event = event_pb2.Event()
        event.ParseFromString(data[at + 12:at + 12 + size])
        at += 12 + size + 4
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, round(value.simple_value, 4)))
    return out


def _record(arrival: int, ppl: float) -> ArrivalRecord:
    return ArrivalRecord(arrival=arrival, stage=arrival // 2, trained=arrival % 2 == 0,
                         megabatches_seen=arrival, params_active=100, train_flops_cum=2e12 * arrival,
                         wall_time=0.0, infer_flops_per_token=10.0, eval_ppl=ppl, eval_nll=1.5,
                         eval_tokens=9, valid={"valid_ppl": ppl + 1}, extra={"infer_flops_per_sequence": 320.0})


def test_two_runs_share_a_logdir_and_each_keeps_its_curves(tmp_path):
    """The second run given the same --tensorboard-logdir deleted the first's stream curves;
    and stage, trained, mega-batches seen, eval NLL and inference FLOPs were not logged.  A run
    is known by its run.json hash (a moved run directory still replaces its own file)."""
    logdir = str(tmp_path / "tb")
    log_arrivals(logdir, [_record(0, 9.0)], "a" * 16)
    log_arrivals(logdir, [_record(0, 7.0)], "b" * 16)
    log_arrivals(logdir, [_record(0, 9.0), _record(1, 5.0)], "a" * 16)  # a resumes
    files = sorted((tmp_path / "tb" / "stream").iterdir())
    assert len(files) == 2
    curves = sorted((_scalars(path) for path in files), key=lambda s: len(s["stream/eval_ppl"]))
    assert curves[0]["stream/eval_ppl"] == [(0, 7.0)]
    assert curves[1]["stream/eval_ppl"] == [(0, 9.0), (1, 5.0)]
    assert curves[1]["stream/trained"] == [(0, 1.0), (1, 0.0)]
    for tag, value in (("stage", 0.0), ("megabatches_seen", 1.0), ("eval_nll", 1.5),
                       ("valid_ppl", 6.0), ("params_active", 100.0), ("train_tflops_cum", 2.0),
                       ("infer_flops_per_token", 10.0), ("infer_flops_per_sequence", 320.0)):
        assert curves[1][f"stream/{tag}"][-1] == (1, value), tag
