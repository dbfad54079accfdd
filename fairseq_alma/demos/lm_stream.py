"""Steps 1-3 shared by both LM demos: the embedded corpus, ``alma-data-prep``, and one
``fairseq-train --task alma_stream`` over the whole stream per setting.

The main demo (``table2``) and the drift demo (``drift``) differ only in how the corpus is cut
and which settings they train; the corpus, the data preparation flags and the tiny Switch LM
they train are the same, so a run of one is comparable with a run of the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import AlmaError
from ..fairseq_glue.user_dir import PLUGIN_DIR
from ..stream.manifest import data_identity, load_manifest
from .demo_flags import DemoFlagsRecord, flag_values
from .steps import step, tool

COMMON_TRAIN = [
    "--task", "alma_stream", "--arch", "switch_transformer_lm_tiny", "--criterion", "switch_cross_entropy",
    "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "0.003", "--lr-scheduler", "alma_stage_linear",
    "--tokens-per-sample", "128", "--batch-size", "8", "--dropout", "0.1", "--cpu", "--num-workers", "0",
    "--log-format", "simple", "--log-interval", "50", "--save-interval-updates", "50", "--no-epoch-checkpoints",
]


@dataclass(frozen=True)
class LmDemoSettings:
    """What ``alma-demo``'s flags set (``cli/demo.py`` checks them)."""

    out: Path
    corpus_mb: float = 3.0
    vocab_size: int = 2000
    updates_per_stage: int = 100
    workers: int = 2

    def flag_values(self) -> dict[str, float | int]:
        """The flags that shape OUT's corpus, streams and runs (``demo_flags.py``)."""
        return flag_values(self.corpus_mb, self.vocab_size, self.updates_per_stage)


def file_state(path: Path) -> tuple[int, int] | None:
    """A step's output file as it is now (None: absent): the same before and after a step
    means the tool found it finished and left it alone."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


def stream_state(data: Path) -> dict | None:
    """A prepared stream's identity (its tokens, not the manifest's timings, which a re-run
    rewrites); None while there is none."""
    try:
        return data_identity(load_manifest(str(data)))
    except AlmaError:
        return None


def prepare_stream(settings: LmDemoSettings, record: DemoFlagsRecord, corpus: Path, data: Path,
                   logs: Path, total: int, what: str, prep_flags: tuple[str, ...] = ()) -> None:
    """Steps 1 and 2 of both demos: the embedded corpus, then ``alma-data-prep`` into ``data``
    (4 mega-batches, 4% evaluation, 2% validation; ``prep_flags`` add to that).  Each finished
    step records the flag it was built from in ``record`` (``demo_flags.py``)."""
    step(f"1/{total} build the demo corpus (Python stdlib prose, module by module)",
         [tool("alma-demo-corpus"), "--out", str(corpus), "--max-mb", str(settings.corpus_mb)],
         logs / "corpus.log", lambda: file_state(corpus))
    record.note("--corpus-mb", settings.corpus_mb)
    step(f"2/{total} prepare {what}",
         [tool("alma-data-prep"), str(corpus), "--out", str(data), "--vocab-size", str(settings.vocab_size),
          "--num-megabatches", "4", "--eval-size", "0.04", "--valid-size", "0.02",
          "--workers", str(settings.workers), *prep_flags],
         logs / "data_prep.log", lambda: stream_state(data))
    record.note("--vocab-size", settings.vocab_size)


def train_settings(settings: LmDemoSettings, record: DemoFlagsRecord, data: Path, runs: Path,
                   logs: Path, named_flags: list[tuple[str, list[str]]], first: int, total: int) -> None:
    """One ``fairseq-train --task alma_stream`` over the whole stream per (name, flags)."""
    warmup = str(max(1, settings.updates_per_stage // 10))
    record.note("--updates-per-stage", settings.updates_per_stage)
    for i, (name, flags) in enumerate(named_flags, start=first):
        step(f"{i}/{total} train {name}: the whole stream in one fairseq-train",
             [tool("fairseq-train"), str(data), "--user-dir", str(PLUGIN_DIR), *COMMON_TRAIN,
              "--updates-per-stage", str(settings.updates_per_stage), "--warmup-updates", warmup,
              "--save-dir", str(runs / name), *flags],
             logs / f"train_{name}.log", lambda name=name: file_state(runs / name / "stream.jsonl"))
