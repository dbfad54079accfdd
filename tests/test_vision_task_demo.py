"""alma-vision-demo (issue 4, item 6): fairseq-train runs for several waiting times, the CER table,
the §6.1 verdict and the plots; re-running reuses finished runs; bad flags are refused."""

from __future__ import annotations

import json

import pytest
from lm_fixtures import run, tool

from fairseq_alma.cli.vision_demo import main
from fairseq_alma.demos.vision_waiting import verdict

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_verdict_compares_intermediate_waits_with_both_ends():
    assert verdict({1: [5.0, 7.0], 2: [4.0, 4.0], 4: [9.0, 9.0]}, 4).startswith(
        "HOLDS: best intermediate w=2 CER 4.000 vs w=1 6.000 and w=4 9.000")
    assert verdict({1: [3.0], 2: [4.0], 4: [9.0]}, 4).startswith("does NOT hold")
    assert verdict({1: [3.0], 4: [9.0]}, 4).startswith("not tested")


def test_waits_outside_the_stream_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["--out", str(tmp_path), "--num-megabatches", "4", "--waits", "1", "9"])
    assert caught.value.code == 2
    assert "--waits must all be in [1, 4] (B), got [1, 9]" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_prints_table_and_verdict_writes_plots_and_reuses_runs(tmp_path):
    cmd = [tool("alma-vision-demo"), "--out", str(tmp_path), "--num-megabatches", "4",
           "--waits", "1", "4", "--widths", "4", "--seeds", "1", "--epochs-per-stage", "2"]
    first = run(cmd).stdout
    assert first.count("fairseq-train digits") == 2  # each run is a printed fairseq-train command
    rows = [line.split() for line in first.splitlines() if line.startswith("SM_w")]
    assert [row[:2] for row in rows] == [["SM_w1", "h4"], ["SM_w4", "h4"]]
    summary = json.loads((tmp_path / "summary.json").read_text())
    cers = summary["cer"]["h4"]
    assert [float(row[4]) for row in rows] == [round(cers[w][0], 3) for w in ("1", "4")]
    assert float(rows[1][4]) > float(rows[0][4])  # w = B: untrained (high error) for 4 arrivals
    assert "h4: not tested" in first and summary["finding"]["h4"].startswith("not tested")
    for name in ("error_curves_h4.png", "cer_tradeoffs.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC
    again = run(cmd).stdout
    assert again.count("complete, reused") == 2 and "fairseq-train digits" not in again
    table = [line for line in again.splitlines() if line.startswith("SM_w")]
    assert table == [line for line in first.splitlines() if line.startswith("SM_w")]
