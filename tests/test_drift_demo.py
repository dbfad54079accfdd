"""The drifting-stream demo (issue 14, item 5): forgetting, the verdict's rule, the train configs,
and ``alma-demo --drift`` end to end through the real CLIs on a tiny corpus.

The verdict must follow from the numbers, so its tests feed matrices where each setting wins in
turn (a verdict that always named full replay would fail), with equal and with unequal compute.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fairseq_alma.report.drift_verdict import DriftSetting, drift_verdict, format_drift_table
from fairseq_alma.stream.period_matrix import PeriodMatrix
from fairseq_alma.sweeps import load_run_config

REPO = Path(__file__).resolve().parent.parent
DRIFT_CONFIGS = REPO / "train_configs" / "drift"


def test_forgetting_is_the_last_stages_rise_on_each_learned_period():
    bits = [[5.0, 8.0, 9.0], [6.0, 6.0, 8.0], [7.0, 6.5, 5.5]]
    lost = PeriodMatrix([1, 2, 3], [1, 2, 3], bits).forgetting()
    assert lost["periods"] == [1, 2] and lost["nll_bits"] == ((7 - 5) + (6.5 - 6)) / 2
    assert lost["ppl_ratio"] == 2 ** 1.25
    waited = PeriodMatrix([1, 2], [2, 3], [[5.0, 6.0, 9.0], [5.5, 7.0, 6.0]]).forgetting()
    assert waited["periods"] == [1, 2] and waited["nll_bits"] == (0.5 + 1.0) / 2  # stage 1 learned both
    assert PeriodMatrix([1], [3], [[5.0, 6.0, 7.0]]).forgetting() == \
        {"nll_bits": None, "ppl_ratio": None, "periods": []}
    entry = PeriodMatrix([1, 2, 3], [1, 2, 3], bits).as_json()
    assert entry["forgetting"] == lost


def _setting(name: str, old_bits: float, new_bits: float, flops: float = 1e12) -> DriftSetting:
    """A 3-stage, 3-period matrix: ``new_bits`` on the diagonal, ``old_bits`` below it."""
    rows = [[new_bits, 9.0, 9.0], [old_bits, new_bits, 9.0], [old_bits, old_bits, new_bits]]
    return DriftSetting(name, PeriodMatrix([1, 2, 3], [1, 2, 3], rows), flops)


@pytest.mark.parametrize("winner", ["no_replay", "replay_0.25", "full_replay"])
def test_the_verdict_names_whichever_setting_the_numbers_favour(winner):
    old = {"no_replay": 7.0, "replay_0.25": 7.2, "full_replay": 7.4}
    old[winner] = 6.5
    settings = [_setting(name, bits, 6.0) for name, bits in old.items()]
    text = drift_verdict(settings)
    assert text.startswith(f"{winner} forgets least: ")
    assert f"per unit of compute {winner} also forgets least" in text
    assert f"{2 ** 6.5:.2f}" in text.splitlines()[0]
    worst = max(old, key=old.get)
    assert f"{worst} forgets most" in text


def test_unequal_compute_is_not_called_equal():
    cheap = _setting("no_replay", 7.0, 6.0, flops=1e12)
    costly = _setting("full_replay", 6.5, 6.2, flops=2e12)
    text = drift_verdict([cheap, costly])
    assert text.startswith("full_replay forgets least")
    assert "same compute" not in text
    assert "2.00x the training compute of no_replay" in text and "neither dominates" in text
    assert f"{2 ** 6.2:.2f}" in text and "worse than the best in-period" in text
    text = drift_verdict([_setting("no_replay", 6.5, 6.0, 1e12), _setting("full_replay", 7.0, 6.2, 2e12)])
    assert "also spent no more training compute" in text and "pays nothing on the new periods" in text


def test_equal_backward_perplexities_are_a_tie_whatever_the_input_order():
    """Two settings scoring alike (89.93 and 89.93) were ranked by input order: one 'forgets
    least', the other 'forgets most'."""
    for order in ((0, 1, 2), (1, 0, 2), (2, 1, 0)):
        made = [_setting("no_replay", 6.5, 6.0), _setting("replay_0.25", 6.5 + 1e-6, 6.1),
                _setting("full_replay", 7.0, 6.2)]
        text = drift_verdict([made[i] for i in order])
        assert text.startswith("no_replay and replay_0.25 forget alike, and least"), text
        assert "no_replay forgets most" not in text and "replay_0.25 forgets most" not in text
        assert "full_replay forgets most" in text
        assert "per unit of compute they also forget alike" in text
    text = drift_verdict([_setting("a", 6.5, 6.0, 2e12), _setting("b", 6.5, 6.0, 1e12)])
    assert text.startswith("a and b forget alike, and least (every setting)")
    assert "Of these, b spent the least training compute" in text and "forgets most" not in text


def test_table_and_refusals():
    settings = [_setting("a", 7.0, 6.0), _setting("b", 6.5, 6.1)]
    table = format_drift_table(settings)
    assert "backward ppl" in table and f"{2 ** 6.5:.2f}" in table and "1" in table
    with pytest.raises(ValueError, match="at least two"):
        drift_verdict(settings[:1])
    one_stage = DriftSetting("c", PeriodMatrix([1], [1], [[6.0, 7.0]]), 1e12)
    with pytest.raises(ValueError, match="c: its matrix has no backward summary"):
        drift_verdict([one_stage, settings[0]])


def test_drift_configs_load_and_hold_the_three_replay_settings():
    partial = load_run_config(str(DRIFT_CONFIGS / "replay_base.yaml"))
    full = load_run_config(str(DRIFT_CONFIGS / "full_replay_base.yaml"))
    assert [p["replay-ratio"] for p in partial.grid_points()] == [0.0, 0.25]
    assert not partial.args.get("replay")
    assert full.args["replay"] is True and [p["replay-ratio"] for p in full.grid_points()] == [0.0]
    for config in (partial, full):
        assert config.args["task"] == "alma_stream" and config.args["wait"] == 1
        assert config.data == full.data  # the same drifting stream


@pytest.mark.slow
def test_alma_demo_drift_end_to_end(tmp_path):
    """The real command on a tiny corpus: three trainings, three matrices, report, verdict; the
    printed table is the scoring JSONs' numbers."""
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "fairseq_alma.cli.demo", "--drift", "--out", str(out),
           "--corpus-mb", "0.3", "--updates-per-stage", "20", "--vocab-size", "500", "--workers", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    manifest = json.loads((out / "drift" / "data" / "manifest.json").read_text())
    assert manifest["order"] == "given" and manifest["eval_per_megabatch"] == "0.1"
    report = out / "drift" / "report"
    for name in ("eval_matrix.md", "eval_matrix.json", "fig_eval_matrix.png", "fig4_replay.png"):
        assert (report / name).stat().st_size > 0, name
    for name in ("no_replay", "replay_0.25", "full_replay"):
        entry = json.loads((report / f"{name}.json").read_text())["series"][0]
        matrix = PeriodMatrix.from_json(entry["eval_matrix"])
        assert len(matrix.stages) == 4 and matrix.num_periods == 4
        row = re.search(rf"^{re.escape(name)} +\S+ +(\S+) +(\S+) +(\S+)", text, re.M)
        summary = matrix.summary()
        assert row and [float(v) for v in row.groups()] == pytest.approx(
            [summary[k]["ppl"] for k in ("in_period", "backward", "forward")], abs=0.006)
        assert f"{name}: perplexity of each stage checkpoint" in text
    assert re.search(r"^(no_replay|replay_0\.25|full_replay) forgets least: ", text, re.M)
    assert "per unit of compute" in text

    # Run again: the corpus, the stream and the three trainings are skipped, and said to be; the
    # training logs keep the trainings; the matrices and verdict are the same.
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("   skipped: done earlier, its output reused") == 5, again.stdout
    matrices = "== the stage x period matrices"
    assert again.stdout[again.stdout.index(matrices):] == text[text.index(matrices):]
    for name in ("no_replay", "replay_0.25", "full_replay"):
        log = (out / "drift" / "logs" / f"train_{name}.log").read_text()
        assert "done training" in log and "nothing to train" in log
    # ... and with another --corpus-mb: refused in one line before step 1, OUT as it was
    corpus = (out / "corpus" / "demo_corpus.txt").read_bytes()
    other = subprocess.run([*cmd[:cmd.index("--corpus-mb") + 1], "0.4", *cmd[cmd.index("--corpus-mb") + 2:]],
                           capture_output=True, text=True, timeout=300)
    assert other.returncode == 2 and "--corpus-mb 0.3 (not 0.4)" in other.stderr, other.stderr
    assert len(other.stderr.splitlines()) == 1 and "\n== 1/" not in other.stdout
    assert (out / "corpus" / "demo_corpus.txt").read_bytes() == corpus


def test_forgetting_below_one_is_called_progress_not_forgetting():
    gained = drift_verdict([_setting("a", 5.5, 6.0), _setting("b", 5.8, 6.0)])
    assert "a x0.707, b x0.871" in gained and "All are below 1" in gained
    lost = drift_verdict([_setting("a", 6.5, 6.0), _setting("b", 5.8, 6.0)])
    assert "All are below 1" not in lost and "a x1.414" in lost
