"""The ``stream.jsonl`` contract (DESIGN.md): one JSON object per arrival t = 0 … B.

The paper's results are curves over arrivals (Eq. 1-2, Figs. 2, 3, 5, Table 2), so the training
task writes one record after every arrival — trained on or not — holding what ``alma-score`` needs
to draw them: the metric on the fixed evaluation set, |θ_t| and the FLOPs spent so far.

Fields (JSON keys):
  arrival, stage, trained, megabatches_seen      where in the stream (see ``schedule.ArrivalInfo``)
  params_active                                  |θ_t|: parameters in use (grown experts count
                                                 only once active) — summed over t this is Mem
  train_flops_cum                                training FLOPs spent up to this arrival (Comp)
  infer_flops_per_token                          LM: forward FLOPs of one token (``flops.py``);
                                                 ``infer_flops_per_sequence`` (extra) is that
                                                 times --tokens-per-sample, §6.2's "per input"
  infer_flops_per_image                          vision: forward FLOPs of one image
  eval_ppl, eval_nll, eval_tokens                LM: perplexity, mean NLL in nats per token, tokens
  test_error                                     vision: error rate in [0, 1]
  valid_*                                        optional metrics on the learner's validation data
  wall_time                                      wall-clock seconds the run has spent so far (time
                                                 queued or stopped between resumes not counted)
Any other key is kept verbatim in ``extra`` so newer writers do not break older readers.
Files of fairseq-alma <= 0.2 named the FLOPs ``infer_flops_per_example``; reading upgrades them
(``upgrade.py``).

Why ``write_records`` rewrites the whole file instead of appending: the task keeps its records in
its checkpointed state and re-materialises the file from them, so a run killed between writing a
record and saving the checkpoint (or the reverse) never duplicates or loses an arrival when the
same command resumes it.
"""

from __future__ import annotations

import itertools
import json
import math
import numbers
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import RunDirError
from .atomic import atomic_write_text
from .upgrade import LEGACY_INFER_FLOPS, upgrade_record_json

_INT_FIELDS = ("arrival", "stage", "megabatches_seen", "params_active")
_FLOAT_FIELDS = ("train_flops_cum", "wall_time")
_REQUIRED = (
    "arrival",
    "stage",
    "trained",
    "megabatches_seen",
    "params_active",
    "train_flops_cum",
    "wall_time",
)
_INFER_FLOPS = ("infer_flops_per_token", "infer_flops_per_image")  # LM, vision: one of them
_METRICS = ("eval_ppl", "eval_nll", "eval_tokens", "test_error")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class ArrivalRecord:
    """What the learner looked like right after ``arrival`` mega-batches (see module doc)."""

    arrival: int
    stage: int
    trained: bool
    megabatches_seen: int
    params_active: int
    train_flops_cum: float
    wall_time: float
    infer_flops_per_token: float | None = None
    infer_flops_per_image: float | None = None
    eval_ppl: float | None = None
    eval_nll: float | None = None
    eval_tokens: int | None = None
    test_error: float | None = None
    valid: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"{name} = {value!r} must be an integer >= 0")
            setattr(self, name, int(value))
        if not isinstance(self.trained, bool):
            raise TypeError(f"trained = {self.trained!r} must be true or false")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not _is_real(value) or value < 0:
                raise ValueError(f"{name} = {value!r} must be a finite number >= 0")
            setattr(self, name, float(value))
        if self.eval_ppl is None and self.test_error is None:
            raise ValueError(
                "a record needs its metric: eval_ppl (language model) or test_error (vision)"
            )
        if self.eval_ppl is not None and not (_is_real(self.eval_ppl) and self.eval_ppl >= 1.0):
            raise ValueError(f"eval_ppl = {self.eval_ppl!r} must be a finite perplexity >= 1")
        if self.eval_nll is not None and not (_is_real(self.eval_nll) and self.eval_nll >= 0.0):
            raise ValueError(f"eval_nll = {self.eval_nll!r} must be a mean NLL in nats >= 0")
        if self.eval_tokens is not None and not (
            _is_int(self.eval_tokens) and self.eval_tokens > 0
        ):
            raise ValueError(f"eval_tokens = {self.eval_tokens!r} must be an integer > 0")
        if self.test_error is not None and not (
            _is_real(self.test_error) and 0.0 <= self.test_error <= 1.0
        ):
            raise ValueError(f"test_error = {self.test_error!r} must be an error rate in [0, 1]")
        unit = "infer_flops_per_token" if self.eval_ppl is not None else "infer_flops_per_image"
        other = _INFER_FLOPS[1] if unit == _INFER_FLOPS[0] else _INFER_FLOPS[0]
        if getattr(self, other) is not None:
            raise ValueError(f"{other} given for a {'language model' if self.eval_ppl is not None else 'vision'} "
                             f"record; its inference FLOPs are {unit}")
        value = getattr(self, unit)
        if not _is_real(value) or value < 0:
            raise ValueError(f"{unit} = {value!r} must be a finite number >= 0")
        setattr(self, unit, float(value))
        for key, value in self.valid.items():
            if not key.startswith("valid_") or not _is_real(value):
                raise ValueError(
                    f"valid metric {key!r} = {value!r}: keys start with 'valid_', values are finite"
                )
        # One representation per value, so a resumed run's file is byte-identical (bar wall_time).
        for name in ("eval_ppl", "eval_nll", "test_error"):
            if getattr(self, name) is not None:
                setattr(self, name, float(getattr(self, name)))
        if self.eval_tokens is not None:
            self.eval_tokens = int(self.eval_tokens)
        self.valid = {key: float(value) for key, value in self.valid.items()}
        clash = set(self.extra) & (set(_REQUIRED) | set(_METRICS) | set(_INFER_FLOPS)
                                   | {LEGACY_INFER_FLOPS} | set(self.valid))
        if clash or any(key.startswith("valid_") for key in self.extra):
            raise ValueError(
                f"extra keys {sorted(self.extra)} clash with record fields; use other names"
            )

    def to_json(self) -> dict[str, Any]:
        """The JSON object for one line, keys in a fixed order (stable diffs between runs)."""
        obj: dict[str, Any] = {name: getattr(self, name) for name in _REQUIRED[:-1]}
        obj.update({name: getattr(self, name) for name in _INFER_FLOPS
                    if getattr(self, name) is not None})
        for name in _METRICS:
            if getattr(self, name) is not None:
                obj[name] = getattr(self, name)
        obj.update(sorted(self.valid.items()))
        obj["wall_time"] = self.wall_time
        obj.update(self.extra)
        return obj

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> ArrivalRecord:
        """Inverse of ``to_json``; unknown keys land in ``extra``, ``valid_*`` keys in ``valid``."""
        if not isinstance(obj, dict):
            raise TypeError(f"expected a JSON object, got {type(obj).__name__}")
        missing = [name for name in _REQUIRED if name not in obj]
        if missing:
            raise ValueError(f"missing key(s) {', '.join(missing)}")
        obj = upgrade_record_json(obj)
        known = {name: obj[name] for name in _REQUIRED + _INFER_FLOPS + _METRICS if name in obj}
        valid = {k: v for k, v in obj.items() if k.startswith("valid_")}
        extra = {k: v for k, v in obj.items() if k not in known and k not in valid}
        return cls(**known, valid=valid, extra=extra)


def write_records(path: str | os.PathLike, records: Iterable[ArrivalRecord]) -> None:
    """Rewrite ``path`` with exactly ``records`` (temp file, fsync, os.replace; see module doc)."""
    records = list(records)
    for before, after in itertools.pairwise(records):
        if after.arrival <= before.arrival:
            raise ValueError(
                f"records must have increasing arrivals (arrival {after.arrival} after "
                f"{before.arrival}); the task must not record an arrival twice"
            )
    lines = [json.dumps(record.to_json(), allow_nan=False) + "\n" for record in records]
    atomic_write_text(path, "".join(lines))


def read_records(path: str | os.PathLike) -> list[ArrivalRecord]:
    """All records of a ``stream.jsonl``; a bad line raises ``RunDirError`` naming file:line."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.readlines()
    except FileNotFoundError:
        raise RunDirError(
            f"{path}: no such file; run the stream (fairseq-train --task alma_stream) first"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise RunDirError(f"{path}: cannot read ({err})") from None
    records: list[ArrivalRecord] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = ArrivalRecord.from_json(json.loads(line))
        except (ValueError, TypeError) as err:  # json.JSONDecodeError is a ValueError
            raise RunDirError(
                f"{path}:{number}: malformed stream record ({err}); re-run the same training "
                f"command to rewrite it from the checkpoint"
            ) from None
        if records and record.arrival <= records[-1].arrival:
            raise RunDirError(
                f"{path}:{number}: arrival {record.arrival} follows arrival {records[-1].arrival}; "
                f"re-run the same training command to rewrite it from the checkpoint"
            )
        records.append(record)
    return records


def records_equal(
    a: Sequence[ArrivalRecord], b: Sequence[ArrivalRecord], ignore: Sequence[str] = ("wall_time",)
) -> bool:
    """True if both streams hold the same arrivals with identical values, except ``ignore`` keys
    (wall time differs between an interrupted-and-resumed run and an uninterrupted one)."""
    if len(a) != len(b):
        return False
    skip = set(ignore)
    for left, right in zip(a, b, strict=True):
        left_obj = {k: v for k, v in left.to_json().items() if k not in skip}
        right_obj = {k: v for k, v in right.to_json().items() if k not in skip}
        if left_obj != right_obj:
            return False
    return True
