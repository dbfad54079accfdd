"""alma-report's inputs on tiny real vision runs (two digits sweeps, B = 2, one epoch a stage):
what it refuses in one line before anything changes, and what it puts in one row.

Each case is a defect a user met: an input JSON saved in --out under a report's file name was
deleted or overwritten; a run that started but recorded no arrival was left out of its row
without a word; a vision run's ``alma-score --from-log`` JSON was labelled as an LM evaluation
and kept apart from its own seeds; runs on another data set shared one CER table; settings SM
does not read (``--members``) split its seeds into rows and hid Fig. 4's pairs; a score JSON
without ``scoring`` (or without series) was let in."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from lm_fixtures import run, tool

from fairseq_alma.cli import report as report_cli
from fairseq_alma.cli import vision_sweep


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("report_inputs")
    common = ["--methods", "sm", "--widths", "4", "--waits", "1", "--seeds", "1", "2",
              "--num-megabatches", "2", "--epochs-per-stage", "1", "--quiet"]
    assert vision_sweep.main(["--out", str(root / "plain"), *common]) == 0
    # the replay twins, made with another --members, which SM does not read
    assert vision_sweep.main(["--out", str(root / "replay"), *common, "--replay", "--members", "2"]) == 0
    run([tool("alma-score"), str(root / "plain" / "sm_mlp4_w1_s1"), "--from-log", "--json",
         str(root / "s1.json")])
    return root


def _report(capsys, *argv: str | Path) -> tuple[int, str, str]:
    capsys.readouterr()
    code = report_cli.main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _refused(capsys, *argv: str | Path) -> str:
    code, _, err = _report(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("alma-report: error: "), err
    return lines[0]


def _rows(out: Path) -> list[tuple[str, list | None]]:
    series = json.loads((out / "cer_table.json").read_text())["series"]
    return [(s["setting"], s.get("seeds")) for s in series]


def test_an_input_in_out_under_a_report_name_is_never_removed_or_overwritten(sweeps, tmp_path, capsys):
    out = tmp_path / "report"
    out.mkdir()
    for name in ("cer_table.json", "table2.json"):  # a vision report deleted it, an LM one overwrote it
        shutil.copy(sweeps / "s1.json", out / name)
        before = (out / name).read_bytes()
        line = _refused(capsys, out / name, sweeps / "plain" / "sm_mlp4_w1_s2", "--out", out)
        assert f"--out {out} would overwrite or remove the input {out / name}" in line
        assert "use another --out" in line
        assert (out / name).read_bytes() == before and sorted(p.name for p in out.iterdir()) == [name]
        (out / name).unlink()
    # given through a link from elsewhere: the file in --out is still the input
    shutil.copy(sweeps / "s1.json", out / "cer_table.json")
    (tmp_path / "link.json").symlink_to(out / "cer_table.json")
    assert "would overwrite or remove the input" in _refused(capsys, tmp_path / "link.json", "--out", out)
    # another name in --out is no output of the report: read, and left alone
    (out / "cer_table.json").rename(out / "s1.json")
    code, _, err = _report(capsys, out / "s1.json", "--out", out)
    assert code == 0, err
    assert json.loads((out / "s1.json").read_text()) == json.loads((sweeps / "s1.json").read_text())


def test_a_run_that_started_but_recorded_no_arrival_is_refused(sweeps, tmp_path, capsys):
    sweep = tmp_path / "sweep"
    shutil.copytree(sweeps / "plain", sweep)
    (sweep / "sm_mlp4_w1_s2" / "stream.jsonl").unlink()  # killed before arrival 0 was recorded
    for given in (sweep, sweep / "sm_mlp4_w1_s2"):
        line = _refused(capsys, given, "--out", tmp_path / "out")
        assert f"{sweep / 'sm_mlp4_w1_s2' / 'stream.jsonl'}: training not finished: no arrival " \
               f"recorded yet" in line
        assert "run the same training command again to finish it" in line
    assert not (tmp_path / "out").exists()


def test_a_from_log_json_is_its_run_and_groups_with_the_other_seed(sweeps, tmp_path, capsys):
    code, out, err = _report(capsys, sweeps / "s1.json", sweeps / "plain" / "sm_mlp4_w1_s2",
                             "--out", tmp_path / "r")
    assert code == 0, err
    assert _rows(tmp_path / "r") == [("sm_w1", [[1], [2]])], out


def test_vision_runs_on_other_data_are_refused(sweeps, tmp_path, capsys):
    other = tmp_path / "sm_mlp4_w1_s2"
    shutil.copytree(sweeps / "plain" / "sm_mlp4_w1_s2", other)
    held = json.loads((other / "run.json").read_text())
    held["fingerprint"]["data"] = "f" * 64  # trained and tested on another data set
    (other / "run.json").write_text(json.dumps(held))
    line = _refused(capsys, sweeps / "plain" / "sm_mlp4_w1_s1", other, "--out", tmp_path / "r")
    assert "were evaluated on different data" in line and "report them separately" in line
    assert not (tmp_path / "r").exists()


def test_settings_sm_does_not_read_split_no_row_and_hide_no_replay_pair(sweeps, tmp_path, capsys):
    """The replay sweep ran with --members 2 (SM reads no --members); a copy of seed 2 holds the
    run.json of an earlier version, with every learner setting in it."""
    code, _, err = _report(capsys, sweeps / "plain", sweeps / "replay", "--out", tmp_path / "r")
    assert code == 0, err
    assert _rows(tmp_path / "r") == [("sm_w1", [[1], [2]]), ("sm_w1 replay", [[1], [2]])]
    assert (tmp_path / "r" / "fig4_replay.png").is_file()
    old = tmp_path / "old" / "sm_mlp4_w1_s2"
    shutil.copytree(sweeps / "plain" / "sm_mlp4_w1_s2", old)
    held = json.loads((old / "run.json").read_text())
    held["fingerprint"]["settings"]["learner"] |= {"members": 5, "gating": "soft",
                                                   "ff_new_candidates": 70}
    (old / "run.json").write_text(json.dumps(held))
    code, _, err = _report(capsys, sweeps / "plain" / "sm_mlp4_w1_s1", old, "--out", tmp_path / "r2")
    assert code == 0, err
    assert _rows(tmp_path / "r2") == [("sm_w1", [[1], [2]])]


def test_a_score_json_without_scoring_or_series_is_refused(sweeps, tmp_path, capsys):
    data = json.loads((sweeps / "s1.json").read_text())
    data["series"][0].pop("scoring")
    (tmp_path / "noscoring.json").write_text(json.dumps(data))
    line = _refused(capsys, tmp_path / "noscoring.json", "--out", tmp_path / "r")
    assert f"{tmp_path / 'noscoring.json'}: series 'sm_w1' has no \"scoring\"" in line
    assert "score the runs again with alma-score --json" in line
    data["series"] = []
    (tmp_path / "empty.json").write_text(json.dumps(data))
    line = _refused(capsys, tmp_path / "empty.json", sweeps / "plain", "--out", tmp_path / "r")
    assert f"{tmp_path / 'empty.json'}: no series in it" in line
    assert not (tmp_path / "r").exists()


def test_a_json_of_fewer_arrivals_than_its_run_is_refused(sweeps, tmp_path, capsys):
    """alma-score --from-log before 2026-11-29 scored an unfinished vision run as a shorter
    stream: its JSON's CER (3.577 for a run whose whole stream gives 5.298) was published."""
    data = json.loads((sweeps / "s1.json").read_text())
    data["series"][0]["arrivals"] = data["series"][0]["arrivals"][:2]  # arrivals 0..1 of B = 2
    short = tmp_path / "short.json"
    short.write_text(json.dumps(data))
    line = _refused(capsys, short, "--out", tmp_path / "o")
    assert "covers arrivals 0..1 but" in line and "trains on B = 2 mega-batches" in line, line
    assert line.endswith("finish the run and score it again with alma-score --json")
    assert not (tmp_path / "o").exists()
