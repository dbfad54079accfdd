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


def test_a_run_with_other_settings_is_refused_before_training(tmp_path, capsys):
    """The run directory's name has no epochs: a run trained with other --epochs-per-stage was
    reused as it was (a finished one) or ended the demo with a 10-line log tail advising
    fairseq-train's --save-dir (an unfinished one).  One line, the demo's own flag, nothing run."""
    from pathlib import Path

    from fairseq_alma.demos.vision_waiting import (
        Run,
        VisionDemoSettings,
        command_fingerprint,
        train_command,
    )

    out = tmp_path / "out"
    other = VisionDemoSettings(out=out, num_megabatches=2, waits=(1,), widths=(4,), seeds=(1,),
                               epochs_per_stage=7, jobs=1)
    save_dir = out / "runs" / "sm_mlp4_w1_s1"
    held = command_fingerprint(train_command(Run(1, 4, 1), other, save_dir), {})
    save_dir.mkdir(parents=True)
    (save_dir / "run.json").write_text(json.dumps({"fingerprint": held, "hash": "x"}))
    (save_dir / "stream.jsonl").write_text("")  # it trained: the directory is not free
    status = main(["--out", str(out), "--num-megabatches", "2", "--waits", "1", "--widths", "4",
                   "--seeds", "1", "--epochs-per-stage", "2"])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    assert captured.err == (f"alma-vision-demo: error: {Path(out) / 'runs' / 'sm_mlp4_w1_s1'} holds "
                            f"a run with other settings (--epochs-per-stage: 7 -> 2); use another "
                            f"--out\n")
    assert sorted(p.name for p in out.iterdir()) == ["runs"]  # no logs, no report


def test_a_failed_run_is_one_line_with_the_demos_own_advice(tmp_path):
    """A fairseq-train refusal after fairseq's config dump: its line, not a 10-line tail, and
    the demo's way out instead of fairseq-train's --save-dir / --restart-stream."""
    from fairseq_alma.demos.vision_waiting import Run, _failure

    attempt = ("2026 | INFO | fairseq_cli.train | {'_name': None, 'common': {...}}\n"
               "fairseq-alma: error: R holds another run (settings.--epochs-per-stage: 7 -> 2); use "
               "another --save-dir, or add --restart-stream to move the old run aside\n")
    assert _failure(Run(1, 4, 1), 2, attempt, tmp_path / "x.log") == (
        f"sm_mlp4_w1_s1: fairseq-train refused it (exit 2): R holds another run "
        f"(settings.--epochs-per-stage: 7 -> 2); use another --out (log: {tmp_path / 'x.log'})")


@pytest.mark.parametrize("flag", ["--waits", "--widths", "--seeds"])
def test_repeated_values_are_refused(tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as caught:
        main(["--out", str(tmp_path / "out"), "--waits", "1", flag, "4", "4", "--num-megabatches", "4"])
    assert caught.value.code == 2
    assert f"error: {flag} [4, 4] repeat a value; list each {flag[2:-1]} once" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_reattempts_keep_the_log_of_the_training_that_made_the_run(tmp_path, monkeypatch):
    cmd = [tool("alma-vision-demo"), "--out", str(tmp_path), "--num-megabatches", "2",
           "--waits", "1", "--widths", "4", "--seeds", "1", "--epochs-per-stage", "1"]
    log = tmp_path / "logs" / "sm_mlp4_w1_s1.log"
    monkeypatch.setenv("ALMA_STOP_AFTER_STAGE", "x")  # fairseq-train refuses it: its one line
    refused = run(cmd, check=False)
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [
        f"alma-vision-demo: error: sm_mlp4_w1_s1: fairseq-train refused it (exit 2): "
        f"ALMA_STOP_AFTER_STAGE must be a stage number >= 1 (got 'x') (log: {log})"]
    monkeypatch.setenv("ALMA_STOP_AFTER_STAGE", "1")  # stops after stage 1 of 2: unfinished
    assert run(cmd, check=False).returncode == 2
    monkeypatch.delenv("ALMA_STOP_AFTER_STAGE")
    run(cmd)  # continues the run to its end
    text = log.read_text()
    attempts = text.split("alma-vision-demo run sm_mlp4_w1_s1\n$ ")[1:]
    assert len(attempts) == 3 and "ALMA_STOP_AFTER_STAGE must be" in attempts[0]
    assert "up to stage 1 of 2" in attempts[1] and "up to stage 2 of 2" in attempts[2]
    again = run(cmd)  # reused: the log is not touched
    assert "complete, reused" in again.stdout and log.read_text() == text
    other = run(cmd[:-1] + ["3"], check=False)  # another --epochs-per-stage: refused, log kept
    assert other.returncode == 2 and "(--epochs-per-stage: 1 -> 3); use another --out" in other.stderr
    assert "fairseq-train digits" not in other.stdout and log.read_text() == text
