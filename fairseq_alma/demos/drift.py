"""``alma-demo --drift``: a stream that drifts, and what replay does about forgetting.

The embedded corpus (``alma-demo-corpus``) lists the standard library's prose module by module
in sorted path order (``__future__``, ``_*`` ... ``asyncio`` ... ``email`` ... ``tkinter``,
``unittest``, ``xml``, ``zipfile``), so cutting it in that order instead of shuffling gives a
stream whose topic and vocabulary change from one mega-batch to the next: a small, real drift.
Steps, each a real command (printed before it runs; finished steps are reused on a re-run):

  1. ``alma-demo-corpus`` (shared with the main demo);
  2. ``alma-data-prep --order given --eval-per-megabatch 0.1``: mega-batch k = the k-th quarter
     of the corpus in module order, with 10% of each held out as period k+1's evaluation slice;
  3. ``fairseq-train --task alma_stream`` three times with the same model, seed and updates per
     stage: no replay, ``--replay-ratio 0.25`` and full replay (``--replay``);
  4. ``alma-score --matrix`` of each: every stage checkpoint on every period;
  5. ``alma-report`` of the three (eval_matrix.md/csv/json, the heatmaps fig_eval_matrix.png,
     and Fig. 4's replay arrows), then each matrix, a table of compute, in-period, backward and
     forward perplexity and forgetting, and the verdict in plain words
     (``report/drift_verdict.py`` says how it is decided).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..report.drift_verdict import DriftSetting, drift_verdict, format_drift_table
from ..stream.period_matrix import PeriodMatrix, format_matrix
from .demo_flags import DemoFlagsRecord, corpus_path, demo_root
from .lm_stream import LmDemoSettings, prepare_stream, train_settings
from .steps import step, tool

# (name, flags): the three ways of treating old data, everything else the same
SAME = ["--moe-experts", "4", "--seed", "1"]  # the main demo's SM_w1
REPLAY_SETTINGS = [
    ("no_replay", SAME),
    ("replay_0.25", SAME + ["--replay-ratio", "0.25"]),
    ("full_replay", SAME + ["--replay"]),
]
EVAL_PER_MEGABATCH = "0.1"


def run_drift_demo(settings: LmDemoSettings) -> int:
    """The drift demo's steps (module doc); a failed step raises one line (``steps.failure_message``)."""
    out = Path(settings.out).resolve()
    root = demo_root(out, "drift")
    logs, data, runs, reports = root / "logs", root / "data", root / "runs", root / "report"
    for directory in (logs, reports):
        directory.mkdir(parents=True, exist_ok=True)
    corpus = corpus_path(out)
    corpus.parent.mkdir(parents=True, exist_ok=True)
    record = DemoFlagsRecord(out, "drift")
    total = 2 + 2 * len(REPLAY_SETTINGS) + 1

    prepare_stream(settings, record, corpus, data, logs, total,
                   "a drifting 4-period stream (corpus order, a held-out slice per period)",
                   ("--order", "given", "--eval-per-megabatch", EVAL_PER_MEGABATCH))
    train_settings(settings, record, data, runs, logs, REPLAY_SETTINGS, 3, total)
    jsons = []
    for i, (name, _) in enumerate(REPLAY_SETTINGS, start=3 + len(REPLAY_SETTINGS)):
        target = reports / f"{name}.json"
        step(f"{i}/{total} score {name} on every period (alma-score --matrix)",
             [tool("alma-score"), str(runs / name), "--mode", "single", "--setting", name, "--matrix",
              "--tokens-per-sample", "128", "--batch-size", "16", "--cpu", "--json", str(target)],
             logs / f"score_{name}.log")
        jsons.append(target)
    step(f"{total}/{total} report: matrix table, heatmaps, replay arrows",
         [tool("alma-report"), *map(str, jsons), "--out", str(reports)], logs / "report.log")

    scored = [load_setting(path) for path in jsons]
    print(f"\n== the stage x period matrices ({len(scored)} settings, seed 1, "
          f"{settings.updates_per_stage} updates per stage)\n")
    for s in scored:
        print(format_matrix(s.matrix, s.name))
    print(format_drift_table(scored))
    print("\nin-period: each stage on its new periods; backward: on the older ones (the forgetting);\n"
          "forward: on the next period, not yet seen; forgetting: the last stage's perplexity on each\n"
          "old period divided by that of the stage that learned it (README, Streams that drift).\n")
    print(drift_verdict(scored))
    print(f"\nreport: {reports / 'eval_matrix.md'}, heatmaps: {reports / 'fig_eval_matrix.png'}")
    return 0


def load_setting(path: Path) -> DriftSetting:
    """One ``alma-score --matrix --json`` file as a ``DriftSetting`` (its only series)."""
    series = json.loads(path.read_text(encoding="utf-8"))["series"]
    if len(series) != 1 or "eval_matrix" not in series[0]:
        raise ValueError(f"{path}: expected one series scored with --matrix")
    entry = series[0]
    return DriftSetting(entry["setting"], PeriodMatrix.from_json(entry["eval_matrix"]),
                        float(entry["arrivals"][-1]["train_flops_cum"]))
