"""What an ``alma-demo --out`` directory was made with: the flags that shape its corpus, its
streams and its runs, recorded in ``OUT/demo_flags.json``.

Why: each step of a demo reuses what an earlier run left in OUT, and each tool decides that from
its own inputs only.  Re-run with another ``--corpus-mb``, step 1 rewrites ``OUT/corpus``, step 2
(``alma-data-prep``) re-prepares ``OUT/data`` from it, and only step 3 (``fairseq-train``) refuses
the finished run directories: by then those runs have lost the stream they were trained and are
scored on.  So the demo records the flags each step was built from, and a command with other
values is refused before step 1, while nothing in OUT has changed.

Which flags: ``--corpus-mb`` (``OUT/corpus``, shared by ``alma-demo`` and ``alma-demo --drift``),
and per demo ``--vocab-size`` (its data) and ``--updates-per-stage`` (its runs).  ``--workers``
changes speed, never bytes (``data_prep/pipeline.py``), so it may change.  A flag is recorded once
something is built from it: ``--corpus-mb`` and ``--vocab-size`` when their step has finished (a
first run that fails at data preparation, e.g. a ``--vocab-size`` too small for the corpus, leaves
the flag free to correct); ``--updates-per-stage`` when the first training starts (a run directory
that has started is bound to it).

A demo made before this record existed has no ``demo_flags.json``; what its files say stands in
for it (the manifest's vocabulary, a run's ``run.json``, and for the corpus whether this command
would build the same text), so an old OUT is protected too and a same-flags re-run still reuses it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import AlmaError, UsageError
from ..stream.atomic import atomic_write_json
from ..stream.run_view import RunView

RECORD_NAME = "demo_flags.json"
CORPUS_SECTION = "corpus"  # OUT/corpus: both demos' step 1
CORPUS_FLAGS = ("--corpus-mb",)
STREAM_FLAGS = ("--vocab-size", "--updates-per-stage")
DEMOS = ("main", "drift")


def demo_root(out: Path, demo: str) -> Path:
    """Where a demo's data, runs and logs live: OUT itself (main) or OUT/drift."""
    return out if demo == "main" else out / "drift"


def corpus_path(out: Path) -> Path:
    return out / "corpus" / "demo_corpus.txt"


def flag_values(corpus_mb: float, vocab_size: int, updates_per_stage: int) -> dict[str, float | int]:
    """The recorded flags of one command, by flag name."""
    return {"--corpus-mb": corpus_mb, "--vocab-size": vocab_size,
            "--updates-per-stage": updates_per_stage}


@dataclass(frozen=True)
class DemoFlagsRecord:
    """``OUT/demo_flags.json`` as one demo (``main`` or ``drift``) reads and writes it."""

    out: Path
    demo: str

    @property
    def path(self) -> Path:
        return self.out / RECORD_NAME

    def _section(self, flag: str) -> str:
        return CORPUS_SECTION if flag in CORPUS_FLAGS else self.demo

    def read(self) -> dict[str, dict[str, float | int]]:
        """The record (empty when there is none); an unreadable one is refused, not guessed."""
        if not self.path.exists():
            return {}
        try:
            record = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(record, dict) or not all(isinstance(v, dict) for v in record.values()):
                raise ValueError("not a JSON object of sections")
        except (OSError, ValueError) as err:
            raise UsageError(f"{self.path}: unreadable ({err}); restore it, or use another "
                             "--out") from None
        return record

    def note(self, flag: str, value: float | int) -> None:
        """Record that something in OUT is now built from ``flag``'s ``value``."""
        record = self.read()
        section = record.setdefault(self._section(flag), {})
        if section.get(flag) != value:
            section[flag] = value
            self.out.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.path, record)

    def conflicts(self, values: dict[str, float | int]) -> list[tuple[str, float | int | None]]:
        """(flag, the value OUT was made with; None when only its files say it differs) for
        every flag of ``values`` that OUT was built with another value of."""
        record = self.read()
        found = []
        for flag, value in values.items():
            old = record.get(self._section(flag), {}).get(flag)
            if old is None:
                same, old = self._legacy_same(flag, value)
                if same:
                    continue
            elif old == value:
                continue
            found.append((flag, old))
        return found

    def problem(self, values: dict[str, float | int]) -> str | None:
        """One line when OUT holds a demo made with other values of these flags, else None."""
        changed = self.conflicts(values)
        if not changed:
            return None
        made = ", ".join(f"{flag} {_shown(old)} (not {_shown(values[flag])})" if old is not None
                         else f"another {flag} (not {_shown(values[flag])})" for flag, old in changed)
        same = " ".join(f"{flag} {_shown(old)}" for flag, old in changed if old is not None)
        again = f", or run again with {same}" if same else ""
        return f"--out {self.out} holds a demo made with {made}; use another --out for the new values{again}"

    # -- OUT made before demo_flags.json existed: its files stand in for the record ----------

    def _legacy_same(self, flag: str, value: float | int) -> tuple[bool, float | int | None]:
        """(whether OUT's files agree with ``value`` or hold nothing built from ``flag``,
        the value they show when they show one)."""
        root = demo_root(self.out, self.demo)
        if flag == "--vocab-size":
            old = _manifest_vocab_size(root / "data")
            return old is None or old == value, old
        if flag == "--updates-per-stage":
            old = _runs_updates_per_stage(root / "runs")
            return old is None or old == value, old
        return _same_corpus(self.out, float(value)), None


def _shown(value: float | int) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _manifest_vocab_size(data: Path) -> int | None:
    try:
        manifest = json.loads((data / "manifest.json").read_text(encoding="utf-8"))
        return int(manifest["sentencepiece"]["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _runs_updates_per_stage(runs: Path) -> int | None:
    if not runs.is_dir():
        return None
    for run in sorted(runs.iterdir()):
        try:
            fingerprint = RunView(run).fingerprint or {}
            return int(fingerprint["config"]["lr_scheduler"]["updates_per_stage"])
        except (OSError, ValueError, KeyError, TypeError, AlmaError):
            continue
    return None


def _same_corpus(out: Path, corpus_mb: float) -> bool:
    """Whether step 1 would leave ``OUT/corpus`` as it is (what ``alma-demo-corpus`` checks
    before writing), or nothing was built from it yet; builds the text in memory (seconds)."""
    corpus = corpus_path(out)
    built_on = [demo_root(out, demo) / "data" / "manifest.json" for demo in DEMOS]
    if not corpus.is_file() or not any(path.is_file() for path in built_on):
        return True
    from data_prep.demo_corpus import build_demo_corpus  # the tool step 1 runs

    text, _, _ = build_demo_corpus(int(corpus_mb * 1e6))
    return hashlib.sha256(text).hexdigest() == hashlib.sha256(corpus.read_bytes()).hexdigest()
