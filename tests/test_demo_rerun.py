"""``alma-demo`` run again into the same --out: refused before step 1 when OUT was made with
other flags (the finished runs would lose their stream), earlier logs kept, skipped steps called
skipped, a failed step told in one line and in the demo's terms, and sizes that are no number
refused in one line.  All without training: a demo's OUT is faked where the check reads it, and
steps run tiny commands (``test_drift_demo.py`` runs the real demo twice end to end)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from data_prep import demo_corpus
from fairseq_alma.cli import demo as demo_cli
from fairseq_alma.demos.demo_flags import DemoFlagsRecord
from fairseq_alma.demos.steps import step
from fairseq_alma.errors import AlmaError, Preempted

MADE_WITH = ["--corpus-mb", "0.3", "--vocab-size", "500", "--updates-per-stage", "20"]


def _tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _problem(out: Path, *flags: str) -> str | None:
    return demo_cli.demo_problem(demo_cli.build_parser().parse_args(["--out", str(out), *flags]))


def _made_demo(out: Path) -> Path:
    """An OUT as a finished ``alma-demo`` with MADE_WITH leaves it, where the check reads it."""
    record = DemoFlagsRecord(out, "main")
    for flag, value in (("--corpus-mb", 0.3), ("--vocab-size", 500), ("--updates-per-stage", 20)):
        record.note(flag, value)
    for name, text in (("corpus/demo_corpus.txt", "old corpus\n"), ("data/manifest.json", "{}"),
                       ("logs/train_SM_w1.log", "the whole training log\n")):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    return out


@pytest.mark.parametrize("flags, said", [
    (["--corpus-mb", "0.4", "--vocab-size", "500", "--updates-per-stage", "20"], "--corpus-mb 0.3 (not 0.4)"),
    (["--corpus-mb", "0.3", "--vocab-size", "600", "--updates-per-stage", "20"], "--vocab-size 500 (not 600)"),
    (["--corpus-mb", "0.3", "--vocab-size", "500", "--updates-per-stage", "30"],
     "--updates-per-stage 20 (not 30)"),
    (["--drift", "--corpus-mb", "0.4", "--vocab-size", "500", "--updates-per-stage", "20"],
     "--corpus-mb 0.3 (not 0.4)"),  # OUT/corpus is shared with the drift demo
])
def test_other_flags_into_a_made_out_are_refused_before_step_1(tmp_path, capsys, flags, said):
    out = _made_demo(tmp_path / "demo")
    before = _tree(out)
    with pytest.raises(SystemExit) as exit_:
        demo_cli.main(["--out", str(out), "--workers", "1", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert said in err and "use another --out" in err and "or run again with" in err
    assert _tree(out) == before


def test_same_flags_and_the_other_demos_own_flags_go_ahead(tmp_path):
    out = _made_demo(tmp_path / "demo")
    assert _problem(out, *MADE_WITH) is None
    assert _problem(out, *MADE_WITH, "--workers", "1") is None  # speed, never bytes
    # the drift demo has a stream and runs of its own: only the corpus is shared
    assert _problem(out, "--drift", "--corpus-mb", "0.3", "--vocab-size", "600") is None


def test_an_out_made_before_the_record_is_read_from_its_files(tmp_path):
    out = tmp_path / "old"
    (out / "data").mkdir(parents=True)
    (out / "data" / "manifest.json").write_text(json.dumps({"sentencepiece": {"vocab_size": 500}}))
    (out / "runs" / "SM_w1").mkdir(parents=True)
    (out / "runs" / "SM_w1" / "run.json").write_text(json.dumps(
        {"fingerprint": {"config": {"lr_scheduler": {"updates_per_stage": 20}}}, "hash": "x"}))
    (out / "corpus").mkdir()
    (out / "corpus" / "demo_corpus.txt").write_text("a corpus another --corpus-mb built\n")
    small = ["--corpus-mb", "0.01", "--vocab-size", "500", "--updates-per-stage", "20"]
    assert "made with another --corpus-mb (not 0.01)" in _problem(out, *small)
    text, _, _ = demo_corpus.build_demo_corpus(int(0.01e6))  # what step 1 would write
    (out / "corpus" / "demo_corpus.txt").write_bytes(text)
    assert _problem(out, *small) is None
    assert "--vocab-size 500 (not 600)" in _problem(out, *small[:2], "--vocab-size", "600")
    assert "--updates-per-stage 20 (not 30)" in _problem(out, *small[:4], "--updates-per-stage", "30")


@pytest.mark.parametrize("size", ["inf", "nan"])
def test_a_size_that_is_no_finite_number_is_one_line(tmp_path, capsys, size):
    assert _problem(tmp_path / "d", "--corpus-mb", size) == \
        f"--corpus-mb must be a finite number > 0 (got {size}); the default is 3"
    with pytest.raises(SystemExit) as exit_:
        demo_corpus.main(["--out", str(tmp_path / "c.txt"), "--max-mb", size])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert "--max-mb: must be a finite number > 0" in err and not (tmp_path / "c.txt").exists()
    with pytest.raises(AlmaError, match="must be a finite number > 0"):
        demo_corpus.write_demo_corpus(str(tmp_path / "c.txt"), float(size))


def test_a_rerun_keeps_the_earlier_log_and_says_skipped(tmp_path, capsys):
    log, made = tmp_path / "train.log", tmp_path / "made.txt"

    def command(text: str) -> list[str]:  # makes ``made`` once, as a tool reuses finished work
        return [sys.executable, "-c", f"import pathlib; p = pathlib.Path({str(made)!r}); "
                f"p.exists() or p.write_text('x'); print({text!r})"]

    def state() -> float | None:
        return made.stat().st_mtime_ns if made.exists() else None

    step("3/9 train", command("the whole training log"), log, state)
    assert "done in" in capsys.readouterr().out
    step("3/9 train", command("finished: nothing to train"), log, state)
    assert "skipped: done earlier" in capsys.readouterr().out
    text = log.read_text()
    assert "the whole training log" in text and "finished: nothing to train" in text
    assert text.count("alma-demo step '3/9 train'") == 2


def test_a_failed_step_is_one_line_in_the_demos_terms(tmp_path):
    config = "2026-11-29 | INFO | fairseq_cli.train | {'_name': None, 'common': {" + "'x': 1, " * 400 + "}}"
    refusal = ("fairseq-alma: error: /o/runs/SM_w1 holds another run (config.lr_scheduler.updates_per_stage: "
               "20 -> 30; config.task.updates_per_stage: 20 -> 30); use another --save-dir, or add "
               "--restart-stream to move the old run aside (nothing is deleted)")
    script = f"import sys; print({config!r}); print({refusal!r}); sys.exit(2)"
    with pytest.raises(AlmaError) as err:
        step("3/15 train SM_w1", [sys.executable, "-c", script], tmp_path / "t.log")
    message = str(err.value)
    assert "\n" not in message and "'_name'" not in message, message
    assert "holds another run (config.lr_scheduler.updates_per_stage: 20 -> 30; config.task" in message
    assert "--save-dir" not in message and "--restart-stream" not in message
    assert "use another --out" in message and message.startswith("step '3/15 train SM_w1' failed (exit 2): ")
    crash = "import sys; print('Traceback (most recent call last):'); print('  File x'); " \
            "print('OSError: [Errno 28] No space left on device'); sys.exit(1)"
    with pytest.raises(AlmaError) as err:
        step("2/15 prepare", [sys.executable, "-c", crash], tmp_path / "p.log")
    assert "failed (exit 1): OSError: [Errno 28] No space left on device; fix that and run the same " \
           "alma-demo command again" in str(err.value)
    busy = ("fairseq-alma: error: /o/runs/SM_w1 is in use by pid 7 on vm, last heartbeat 3s ago; "
            "wait for that run to end or stop it, or use another --save-dir")
    with pytest.raises(AlmaError) as err:
        step("3/15 train SM_w1", [sys.executable, "-c", f"print({busy!r}); raise SystemExit(2)"],
             tmp_path / "b.log")
    message = str(err.value)
    assert "wait for that run to end or stop it; fix that and run the same alma-demo command" in message
    assert "--save-dir" not in message, message


def test_a_stop_sent_to_the_demo_stops_the_running_step(tmp_path):
    """SIGTERM to the demo's pid alone (a batch system, `kill PID`) killed only the demo: its
    training step trained on with no parent, holding the run's lock, and the re-run was refused.
    The stop is passed on, the step saves and exits, and the demo ends in one line (exit 75)."""
    log = tmp_path / "t.log"
    child = ("import signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
             "print('rea' + 'dy', flush=True)\n"  # the log echoes the command: not 'ready' there
             "time.sleep(120)\n")

    def stop_when_ready() -> None:
        deadline = time.time() + 60
        while "ready" not in (log.read_text() if log.exists() else "") and time.time() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=stop_when_ready, daemon=True).start()
    started = time.time()
    with pytest.raises(Preempted, match=r"step 'x' stopped on SIGTERM \(passed on to it, exit 75"):
        step("x", [sys.executable, "-c", child], log)
    assert time.time() - started < 60 and signal.getsignal(signal.SIGTERM) is before
