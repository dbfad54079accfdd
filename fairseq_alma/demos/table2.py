"""``alma-demo`` (``make demo``): Table 2 at toy scale, end to end on the embedded default data.

The steps (corpus, data preparation, one ``fairseq-train`` per Table 2 setting, ``alma-score``
per setting, then the table, CSV/JSON and the Fig. 5 plot) are listed for users in
``alma-demo --help`` (``cli/demo.py``'s docstring); this module runs them.
"""

from __future__ import annotations

from pathlib import Path

from ..report.figures import plot_tradeoffs
from ..report.result_tables import format_series_table, load_report_json, write_csv, write_json
from .demo_flags import DemoFlagsRecord, corpus_path
from .lm_stream import LmDemoSettings, prepare_stream, train_settings
from .steps import step, tool

# (name, extra flags, alma-score mode, run dirs for scoring) — Table 2's rows at demo scale
RUNS = [
    ("SM_w1", ["--moe-experts", "4", "--seed", "1"]),
    ("SM_w1_seed2", ["--moe-experts", "4", "--seed", "2"]),
    ("SM_w4_4x", ["--moe-experts", "4", "--wait", "4", "--scale-updates-by-wait", "--seed", "1"]),
    ("gEns_w1", ["--moe-experts", "4", "--stage-init", "scratch", "--seed", "3"]),
    ("gMoE_w1", ["--moe-experts", "4", "--moe-max-experts", "12", "--grow-experts", "2,2,4", "--seed", "1"]),
    ("SM_wauto", ["--moe-experts", "4", "--wait", "auto", "--seed", "1"]),  # beyond the paper
]
SCORES = [
    ("SM_w1", "single", ["SM_w1"]),
    ("SM_w4 (4x steps)", "single", ["SM_w4_4x"]),
    ("Ens_w1", "ens", ["SM_w1", "SM_w1_seed2"]),
    ("gEns_w1", "gens", ["gEns_w1"]),
    ("gMoE_w1", "single", ["gMoE_w1"]),
    ("SM_wauto", "single", ["SM_wauto"]),
]


def run_table2_demo(settings: LmDemoSettings) -> int:
    """The demo's steps (module doc); a failed step raises one line (``steps.failure_message``)."""
    out = Path(settings.out).resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    corpus = corpus_path(out)
    corpus.parent.mkdir(parents=True, exist_ok=True)
    record = DemoFlagsRecord(out, "main")
    data = out / "data"
    runs = out / "runs"
    reports = out / "report"
    reports.mkdir(parents=True, exist_ok=True)
    total = 2 + len(RUNS) + len(SCORES) + 1

    prepare_stream(settings, record, corpus, data, logs, total,
                   "a 4-mega-batch stream (BPE, seeded split, binarize, manifest)")
    train_settings(settings, record, data, runs, logs, RUNS, 3, total)
    jsons = []
    for i, (setting, mode, dirs) in enumerate(SCORES, start=3 + len(RUNS)):
        target = reports / f"{setting.split()[0]}.json"
        step(f"{i}/{total} score {setting} ({mode})",
             [tool("alma-score"), *[str(runs / d) for d in dirs], "--mode", mode, "--setting", setting,
              "--tokens-per-sample", "128", "--batch-size", "16", "--cpu", "--json", str(target)],
             logs / f"score_{setting.split()[0]}.log")
        jsons.append(target)

    series = [s for path in jsons for s in load_report_json(path)]
    write_json(series, reports / "table2.json")
    write_csv(series, reports / "table2.csv")
    plot_tradeoffs(series, reports / "fig5_tradeoffs.png")
    print(f"\n== {total}/{total} Table 2 at demo scale (perplexity on the evaluation mega-batch)\n")
    print(format_series_table(series))
    print("avg ppl (trained): the paper's Table 2 average, over the arrivals after the first training.\n"
          "anytime ppl: 2 ** (mean cross-entropy in bits over every arrival 1..B), the arrivals before\n"
          "the first training charged with the initialised model, so waiting is not free (README).")
    print(f"\nreport: {reports / 'table2.json'}, {reports / 'table2.csv'}, plot: {reports / 'fig5_tradeoffs.png'}")
    return 0
