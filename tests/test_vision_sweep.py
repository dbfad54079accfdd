"""The sweep CLI end to end on the embedded digits: table, summary, resume, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CMD = [sys.executable, "-m", "fairseq_alma.cli.vision_sweep"]  # as alma-vision-sweep


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        CMD + list(args), capture_output=True, text=True, timeout=120, check=False
    )


def test_sweep_table_summary_and_resume(tmp_path, capsys):
    args = [
        "--out",
        str(tmp_path),
        "--widths",
        "4",
        "--waits",
        "1",
        "3",
        "--num-megabatches",
        "3",
        "--epochs-per-stage",
        "1",
        "--quiet",
    ]
    first = run(*args)
    assert first.returncode == 0, first.stderr
    assert first.stderr == ""  # --quiet: only the table (no per-stage INFO lines)
    lines = first.stdout.strip().splitlines()
    assert lines[0].split()[:4] == ["method", "model", "replay", "w"] and len(lines) == 4
    assert set(lines[1]) <= {"-", " "}  # the rule under the header
    assert lines[2].split()[4:7][0] == "1" and lines[2].split()[6] == "-"  # one seed: no spread
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["wait"] for r in summary["runs"]] == [1, 3]
    # CER sums B + 1 = 4 error rates, so it lies in [0, 4]; w = B is untrained until the end.
    assert all(0 <= r["cer"] <= 4 for r in summary["runs"])
    jsonl = tmp_path / "sm_mlp4_w3_s1" / "stream.jsonl"
    assert len(jsonl.read_text().splitlines()) == 4
    stamp = os.stat(jsonl).st_mtime_ns
    from fairseq_alma.cli.vision_sweep import main

    assert main(args) == 0  # the same sweep again, in process: nothing is re-run
    assert capsys.readouterr().out == first.stdout
    assert os.stat(jsonl).st_mtime_ns == stamp
    # other settings into the same --out: refused before anything trains, nothing changed (the
    # run directory's name has no epochs or optimizer: these runs were once reused as they were)
    summary_text = (tmp_path / "summary.json").read_text()
    epochs = args.index("--epochs-per-stage") + 1
    for changed, shown in (
        (args[:epochs] + ["2"] + args[epochs + 1:], "--epochs-per-stage: 1 -> 2"),
        (args + ["--optimizer", "sgd"], "--vision-lr: 1.0 -> 0.01; "
                                        "--vision-optimizer: 'adadelta' -> 'sgd'"),
    ):
        assert main(changed) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err == (f"alma-vision-sweep: error: {tmp_path / 'sm_mlp4_w1_s1'} holds a "
                                f"run with other settings ({shown}); use another --out\n")
    assert os.stat(jsonl).st_mtime_ns == stamp
    assert (tmp_path / "summary.json").read_text() == summary_text
    # settings SM does not read (vision/fingerprint.py): the runs found are the runs it would
    # train, so they are reused (this was refused: "learner.members: 5 -> 3")
    assert main(args + ["--members", "3", "--gating", "hard"]) == 0
    assert capsys.readouterr().out == first.stdout
    assert os.stat(jsonl).st_mtime_ns == stamp


@pytest.mark.parametrize("flag, values", [("--seeds", ["1", "1"]), ("--waits", ["1", "auto", "1"]),
                                          ("--widths", ["4", "4"]), ("--methods", ["sm", "sm"])])
def test_sweep_refuses_repeated_values(tmp_path, capsys, flag, values):
    """A repeated value was one run counted twice in the table ("seeds 2", spread 0.000)."""
    from fairseq_alma.cli.vision_sweep import main

    out = tmp_path / "out"
    assert main(["--out", str(out), "--waits", "1", flag, *values, "--num-megabatches", "2"]) == 2
    parsed = [v if v in ("sm", "auto") else int(v) for v in values]
    assert capsys.readouterr().err == (f"alma-vision-sweep: error: {flag} {parsed} repeat a value; "
                                       f"list each {flag[2:-1]} once\n")
    assert not out.exists()


def test_sweep_bad_flags_are_one_line(tmp_path):
    bad = run(
        "--out", str(tmp_path), "--waits", "5", "--num-megabatches", "3", "--epochs-per-stage", "1"
    )
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "alma-vision-sweep: error: --waits must all be between 1 and --num-megabatches (3), got [5]"
    )


def test_sweep_missing_data_dir_in_process(tmp_path, capsys):
    from fairseq_alma.cli.vision_sweep import main

    assert (
        main(
            ["--out", str(tmp_path), "--dataset", "mnist", "--data-path", str(tmp_path / "nowhere")]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nowhere: not a directory" in err


def test_sweep_backbone_follows_the_data_set_as_the_optimizer_does():
    """``--dataset cifar10`` alone trained an MLP with the paper's CIFAR optimizer and
    augmentation; the backbone now follows the data set too (§5: VGG on CIFAR-10)."""
    from fairseq_alma.cli.vision_sweep import build_parser
    from fairseq_alma.vision.sweep_runs import _arch

    parse = build_parser().parse_args
    assert _arch(parse(["--out", "o", "--dataset", "cifar10"])) == "vgg"
    assert _arch(parse(["--out", "o", "--dataset", "cifar10", "--arch", "mlp"])) == "mlp"
    assert _arch(parse(["--out", "o", "--dataset", "mnist"])) == "mlp"
    assert _arch(parse(["--out", "o"])) == "mlp"
