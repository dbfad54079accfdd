"""Steps 1-3 shared by both LM demos: the embedded corpus, ``alma-data-prep``, and one
``fairseq-train --task alma_stream`` over the whole stream per setting.

The main demo (``table2``) and the drift demo (``drift``) differ only in how the corpus is cut
and which settings they train; the corpus, the data preparation flags and the tiny Switch LM
they train are the same, so a run of one is comparable with a run of the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..fairseq_glue.user_dir import PLUGIN_DIR
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


def prepare_stream(settings: LmDemoSettings, corpus: Path, data: Path, logs: Path, total: int,
                   what: str, prep_flags: tuple[str, ...] = ()) -> None:
    """Steps 1 and 2 of both demos: the embedded corpus, then ``alma-data-prep`` into ``data``
    (4 mega-batches, 4% evaluation, 2% validation; ``prep_flags`` add to that)."""
    step(f"1/{total} build the demo corpus (Python stdlib prose, module by module)",
         [tool("alma-demo-corpus"), "--out", str(corpus), "--max-mb", str(settings.corpus_mb)],
         logs / "corpus.log")
    step(f"2/{total} prepare {what}",
         [tool("alma-data-prep"), str(corpus), "--out", str(data), "--vocab-size", str(settings.vocab_size),
          "--num-megabatches", "4", "--eval-size", "0.04", "--valid-size", "0.02",
          "--workers", str(settings.workers), *prep_flags],
         logs / "data_prep.log")


def train_settings(settings: LmDemoSettings, data: Path, runs: Path, logs: Path,
                   named_flags: list[tuple[str, list[str]]], first: int, total: int) -> None:
    """One ``fairseq-train --task alma_stream`` over the whole stream per (name, flags)."""
    warmup = str(max(1, settings.updates_per_stage // 10))
    for i, (name, flags) in enumerate(named_flags, start=first):
        step(f"{i}/{total} train {name}: the whole stream in one fairseq-train",
             [tool("fairseq-train"), str(data), "--user-dir", str(PLUGIN_DIR), *COMMON_TRAIN,
              "--updates-per-stage", str(settings.updates_per_stage), "--warmup-updates", warmup,
              "--save-dir", str(runs / name), *flags],
             logs / f"train_{name}.log")
