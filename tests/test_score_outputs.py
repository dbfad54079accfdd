"""What alma-score and alma-report leave in their output folders when something goes wrong:
a failure while drawing or moving outputs leaves every earlier output as it was (all or none),
names the file, and leaves no staging folder behind; a report killed outright (SIGKILL) has its
staging folder removed by the next one, never a live writer's.

Fast: a vision stream's records (``--from-log`` reads them, no training) scored into a JSON,
which alma-report takes as its input."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fairseq_alma.cli.report import main as report_main
from fairseq_alma.cli.score import main as score_main
from fairseq_alma.stream.records import ArrivalRecord, write_records
from fairseq_alma.stream.staged_outputs import StagedOutputs, remove_stale_staging

EXTRA = {"method": "sm", "arch": "mlp", "width": 8, "wait": 1, "replay": False}


def _vision_run(run_dir: Path, errors: list[float]) -> Path:
    write_records(run_dir / "stream.jsonl", [
        ArrivalRecord(arrival=t, stage=t, trained=t > 0, megabatches_seen=t, params_active=100,
                      train_flops_cum=1e9 * t, infer_flops_per_image=10.0, wall_time=1.0,
                      test_error=error, extra=EXTRA)
        for t, error in enumerate(errors)])
    return run_dir


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _outputs(tmp_path: Path) -> list[str]:
    return ["--json", str(tmp_path / "o" / "s.json"), "--csv", str(tmp_path / "o" / "s.csv"),
            "--plot", str(tmp_path / "o" / "s.png")]


def test_a_failed_figure_leaves_the_earlier_scores_and_names_its_file(tmp_path, capsys, monkeypatch):
    """The figure failed after the JSON and CSV were replaced: a JSON/CSV of this scoring beside
    the previous one's Fig. 5, and the line said 'cannot write None'."""
    from fairseq_alma.report import figures

    assert score_main([str(_vision_run(tmp_path / "a", [0.9, 0.5, 0.3])), "--from-log",
                       *_outputs(tmp_path)]) == 0
    before = _contents(tmp_path / "o")
    assert set(before) == {"s.json", "s.csv", "s.png"}

    def disk_full(series, path):
        Path(path).write_bytes(b"half a figure")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(figures, "plot_error_curves", disk_full)
    capsys.readouterr()
    assert score_main([str(_vision_run(tmp_path / "b", [0.8, 0.4, 0.2])), "--from-log",
                       *_outputs(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"alma-score: error: {tmp_path / 'o' / 's.png'}: cannot write (No space left "
                   f"on device); free space or give another path, and run the same command again"]
    assert _contents(tmp_path / "o") == before and sorted(os.listdir(tmp_path / "o")) == sorted(before)


def test_score_outputs_inside_the_stream_scored_on_are_refused(tmp_path, capsys):
    """``--json DATA/manifest.json`` replaced the stream's manifest after scoring, exit 0."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("the stream's manifest")
    run_dir = _vision_run(tmp_path / "a", [0.9, 0.5, 0.3])
    assert score_main([str(run_dir), "--data", str(data), "--json", str(data / "manifest.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"alma-score: error: --json {data / 'manifest.json'}: inside the stream directory "
                   f"{data}, whose files it would replace; write it outside the stream directory"]
    assert (data / "manifest.json").read_text() == "the stream's manifest"


def test_staged_outputs_are_all_moved_or_none(tmp_path):
    """A move that fails puts back the files already moved, and names its target."""
    (tmp_path / "a.txt").write_text("old a")
    (tmp_path / "b.txt").mkdir()  # the move onto it fails after a.txt was moved
    (tmp_path / "b.txt" / "x").write_text("")
    with StagedOutputs(".test-") as staged:
        for name in ("a.txt", "b.txt", "c.txt"):
            Path(staged.path_for(tmp_path / name)).write_text(f"new {name}")
        with pytest.raises(OSError) as caught:
            staged.publish()
    assert caught.value.filename == str(tmp_path / "b.txt")
    assert (tmp_path / "a.txt").read_text() == "old a" and not (tmp_path / "c.txt").exists()
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt"]  # no staging folder left


def _report_input(tmp_path: Path, errors: list[float], name: str) -> Path:
    assert score_main([str(_vision_run(tmp_path / f"run_{name}", errors)), "--from-log",
                       "--json", str(tmp_path / f"{name}.json")]) == 0
    return tmp_path / f"{name}.json"


def test_report_refuses_a_directory_under_an_output_name_before_drawing(tmp_path, capsys):
    """The final move failed on it with a traceback, after the tables had been replaced."""
    first, second = _report_input(tmp_path, [0.9, 0.5, 0.3], "a"), _report_input(tmp_path, [0.8, 0.4, 0.2], "b")
    out = tmp_path / "r"
    assert report_main([str(first), "--out", str(out)]) == 0
    (out / "fig3_error_curves.png").unlink()
    (out / "fig3_error_curves.png").mkdir()
    before = _contents(out)
    capsys.readouterr()
    assert report_main([str(first), str(second), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"alma-report: error: {out / 'fig3_error_curves.png'}: not a file, and alma-report writes "
        f"fig3_error_curves.png there; remove or rename it, or use another --out"]
    assert _contents(out) == before and sorted(os.listdir(out)) == sorted([*before, "fig3_error_curves.png"])


def test_report_on_sigterm_is_one_line_and_leaves_out_as_it_was(tmp_path, capsys, monkeypatch):
    """SIGTERM ended the process by signal, leaving its staging folder in --out forever."""
    from fairseq_alma.report import figures

    source = _report_input(tmp_path, [0.9, 0.5, 0.3], "a")
    out = tmp_path / "r"
    assert report_main([str(source), "--out", str(out)]) == 0
    before = _contents(out)

    def terminated(*args):
        os.kill(os.getpid(), signal.SIGTERM)

    def survived(signum, frame):  # without alma-report's own handler: no killed test session
        pass

    monkeypatch.setattr(figures, "plot_error_curves", terminated)
    previous = signal.signal(signal.SIGTERM, survived)
    try:
        capsys.readouterr()
        assert report_main([str(source), "--out", str(out)]) == 130
        assert signal.getsignal(signal.SIGTERM) is survived  # put back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert capsys.readouterr().err.strip().splitlines() == [
        "alma-report: interrupted; run the same command again to continue"]
    assert sorted(os.listdir(out)) == sorted(before) and _contents(out) == before


def test_a_killed_reports_staging_folder_is_removed_by_the_next_never_a_live_ones(tmp_path):
    source = _report_input(tmp_path, [0.9, 0.5, 0.3], "a")
    out = tmp_path / "r"
    out.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    host = socket.gethostname()
    kept = [out / f".alma-report-{live.pid}@{host}-abcdefgh", out / ".alma-report-1@other.host-abcdefgh"]
    try:
        for folder in kept:
            (folder / "new").mkdir(parents=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
        killed = subprocess.Popen([sys.executable, "-m", "fairseq_alma.cli.report", str(source), "--out",
                                   str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        staging = []
        while not staging and killed.poll() is None and time.monotonic() < deadline:
            staging = [p for p in out.glob(f".alma-report-{killed.pid}@*")]
            time.sleep(0.005)
        killed.kill()
        killed.wait()
        assert staging and staging[0].is_dir(), "the report ended before it staged anything"
        assert remove_stale_staging(out, ".alma-report-") == [str(staging[0])]
        assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == sorted(p.name for p in kept)
        (staging[0] / "new").mkdir(parents=True)  # again, left by a process that is gone
        assert report_main([str(source), "--out", str(out)]) == 0
        assert not staging[0].exists() and all(folder.is_dir() for folder in kept)
    finally:
        live.kill()
        live.wait()


def test_a_runs_own_stream_is_read_as_scoring_reads_it(tmp_path, monkeypatch):
    """A relative ``cfg.task.data`` protected a folder of that name under any directory
    alma-score ran from (an unrelated ``w/d1`` refused), and the message named the bare ``d1``."""
    import torch

    from fairseq_alma.cli.score import own_stream_dirs

    (tmp_path / "run").mkdir()
    (tmp_path / "d1").mkdir()
    (tmp_path / "run" / "stream.jsonl").write_text("")
    torch.save({"cfg": {"task": {"data": "d1"}}}, tmp_path / "run" / "checkpoint_stage1.pt")
    monkeypatch.chdir(tmp_path)
    assert own_stream_dirs("run") == [str(tmp_path / "d1")]  # absolute, as scoring opens it
    (tmp_path / "w").mkdir()
    monkeypatch.chdir(tmp_path / "w")
    assert own_stream_dirs("../run") == []  # no w/d1: nothing there is the stream


def test_a_reader_that_quits_early_loses_no_file_and_sees_no_traceback(tmp_path):
    """``alma-score RUN --json s.json | head -1``: the table went first, the EPIPE was 'cannot
    write ... free space' and the JSON was never written; alma-report's later lines were a
    BrokenPipeError traceback.  An ASCII-only stdout with a non-ASCII setting: a traceback."""
    import json

    run = _vision_run(tmp_path / "runs" / "sm_w1", [0.9, 0.5, 0.4])
    command = [sys.executable, "-m", "fairseq_alma.cli.score", str(run), "--from-log",
               "--setting", "SMé", "--json", str(tmp_path / "s.json")]
    reader_gone = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reader_gone.stdout.close()  # the reader left before the first byte
    _, err = reader_gone.communicate(timeout=120)
    assert reader_gone.returncode == 141 and b"Traceback" not in err, err
    assert json.loads((tmp_path / "s.json").read_text())["series"]
    ascii_only = subprocess.run(command, capture_output=True, timeout=120,
                                env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert ascii_only.returncode == 0 and b"SM\\xe9" in ascii_only.stdout, ascii_only.stderr
