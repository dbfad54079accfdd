"""Reuse of finished steps: each step leaves a small stamp of what its outputs depend on.

A stamp (``DIR/.stamps/<step>.json``) holds the step's *key* -- its arguments plus the keys or
checksums of what it reads -- the sizes of its outputs and a few facts about them (counts,
checksums) that later steps and the manifest use. A step is skipped when its key is unchanged
and, if its outputs are needed, they exist with the recorded sizes. Stamps survive ``--clean``:
the intermediate files under ``DIR/work`` are rebuilt only when a later step must run again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from fairseq_alma.errors import DataError
from fairseq_alma.stream.atomic import atomic_write_json

from .progress_lines import log

STAMP_DIR = ".stamps"


class StepRunner:
    def __init__(self, out_dir: str,
                 before_first_build: Callable[[], None] | None = None) -> None:
        """``before_first_build`` runs once, before this run changes any output (the pipeline
        uses it to withdraw the manifest, which must never describe files being replaced)."""
        self.out_dir = out_dir
        self.before_first_build = before_first_build
        self.stamp_dir = os.path.join(out_dir, STAMP_DIR)
        os.makedirs(self.stamp_dir, exist_ok=True)
        self.seconds: dict[str, float] = {}  # time spent building each step in this run
        # Steps this run must not build (name -> the error to raise instead): a Slurm shard
        # task needs the extraction and the tokenizer finished by the job before it.
        self.frozen: dict[str, str] = {}
        self._nested = 0.0  # time spent in steps built from inside the current build

    def _stamp_path(self, name: str) -> str:
        return os.path.join(self.stamp_dir, f"{name}.json")

    def _read(self, name: str) -> dict | None:
        try:
            with open(self._stamp_path(name), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _outputs_intact(self, stamp: dict) -> bool:
        for rel, size in stamp.get("outputs", {}).items():
            path = os.path.join(self.out_dir, rel)
            if not os.path.isfile(path) or os.path.getsize(path) != size:
                return False
        return True

    def ensure(self, name: str, key: dict, outputs: list[str], build: Callable[[], dict],
               need_outputs: bool = True) -> dict:
        """Return the step's facts, building it first unless its stamp says it is current.

        ``outputs`` are paths relative to the output directory; ``build`` writes them and
        returns the facts to stamp. With ``need_outputs=False`` a current key suffices (the
        caller only needs the facts, e.g. a checksum of an intermediate file since cleaned)."""
        key = json.loads(json.dumps(key))  # compare as stored: tuples become lists, etc.
        stamp = self._read(name)
        if stamp is not None and stamp.get("key") == key and (
                not need_outputs or self._outputs_intact(stamp)):
            if name not in self.seconds:
                log(f"{name}: up to date, reused")
                self.seconds[name] = 0.0
            return stamp["info"]
        if name in self.frozen:
            raise DataError(self.frozen[name])
        if self.before_first_build is not None:
            self.before_first_build()
            self.before_first_build = None
        log(f"{name}: building")
        outer_nested, self._nested = self._nested, 0.0
        started = time.monotonic()
        info = build()
        elapsed = time.monotonic() - started
        self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - self._nested
        self._nested = outer_nested + elapsed
        sizes = {rel: os.path.getsize(os.path.join(self.out_dir, rel)) for rel in outputs}
        atomic_write_json(self._stamp_path(name), {"key": key, "outputs": sizes, "info": info})
        return info
