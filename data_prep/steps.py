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


def in_stream(rel: str) -> bool:
    """Whether output ``rel`` (relative to DIR) is one of the stream's own files -- those lie
    directly in DIR, where ``manifest.json`` describes them -- rather than work in progress
    under ``DIR/work``, which no reader of the stream opens."""
    return os.path.dirname(rel) == ""


class StepRunner:
    def __init__(self, out_dir: str,
                 before_stream_change: Callable[[], None] | None = None) -> None:
        """``before_stream_change`` runs once, right before this run first replaces one of the
        stream's own files (``in_stream``): the pipeline uses it to withdraw the manifest, which
        must never describe files being replaced.

        Why not before the first build of any step, as it once ran: a re-run with other split
        flags rebuilds work files first and may then be refused (a --valid-size the corpus
        cannot give), and the finished stream it was pointed at lost its manifest for nothing.
        Work files changing under a manifest harm no one: readers never open them, and reuse
        is decided by the stamps alone, so an interrupted run still resumes to exactly what an
        uninterrupted one gives."""
        self.out_dir = out_dir
        self.before_stream_change = before_stream_change
        self.stream_changed = False
        self.stamp_dir = os.path.join(out_dir, STAMP_DIR)
        os.makedirs(self.stamp_dir, exist_ok=True)
        self.seconds: dict[str, float] = {}  # time spent building each step in this run
        # Steps this run must not build (name -> the error to raise instead): a Slurm shard
        # task needs the extraction and the tokenizer finished by the job before it.
        self.frozen: dict[str, str] = {}
        self._nested = 0.0  # time spent in steps built from inside the current build

    def changing_stream(self) -> None:
        """Say that the stream's own files are about to change (``before_stream_change``, the
        first time). A step whose build can still refuse its input after reading it calls this
        itself, once its checks have passed (``ensure``'s ``checks_first``)."""
        if self.before_stream_change is not None:
            self.before_stream_change()
            self.before_stream_change = None
        self.stream_changed = True

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
               need_outputs: bool = True, checks_first: bool = False) -> dict:
        """Return the step's facts, building it first unless its stamp says it is current.

        ``outputs`` are paths relative to the output directory; ``build`` writes them and
        returns the facts to stamp. With ``need_outputs=False`` a current key suffices (the
        caller only needs the facts, e.g. a checksum of an intermediate file since cleaned).
        A step with outputs in the stream (``in_stream``) says so before its build runs, or,
        with ``checks_first``, its build calls ``changing_stream`` itself after the checks
        that may refuse the run and before its first write."""
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
        in_dir = [rel for rel in outputs if in_stream(rel)]
        if in_dir and not checks_first:
            self.changing_stream()
        log(f"{name}: building")
        outer_nested, self._nested = self._nested, 0.0
        started = time.monotonic()
        info = build()
        if in_dir and not self.stream_changed:  # a build that forgot: its outputs are written
            raise RuntimeError(f"step {name} wrote {in_dir[0]} without calling changing_stream")
        elapsed = time.monotonic() - started
        self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - self._nested
        self._nested = outer_nested + elapsed
        sizes = {rel: os.path.getsize(os.path.join(self.out_dir, rel)) for rel in outputs}
        atomic_write_json(self._stamp_path(name), {"key": key, "outputs": sizes, "info": info})
        return info
