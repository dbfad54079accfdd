"""alma-sweep against a real single-node Slurm (tests/slurm_cluster.py starts one per module).

The runs use slurm/contract_trainer.py as the training program: it keeps the trainer's side of
the contract (save dir, stream.jsonl, SIGUSR1 -> save and exit, resume, ALMA_STOP_AFTER_STAGE)
in a second, so these tests exercise the launcher, not training. Swapping ``--program`` for the
default fairseq-train and the example config's task for alma_stream runs real tiny streams.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_cluster import slurm  # noqa: F401  (module-scoped cluster fixture)

from fairseq_alma.cli.sweep import main
from fairseq_alma.sweeps.train_records import read_jsonl
from fairseq_alma.sweeps.train_script import LAUNCH_TASK

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "train_configs" / "examples"
CONTRACT = REPO / "slurm" / "contract_trainer.py"
CHECK_DISTRIBUTED = REPO / "slurm" / "check_distributed.py"


@pytest.fixture
def workdir(slurm, tmp_path, monkeypatch):  # noqa: F811
    """Run alma-sweep in-process (fairseq is imported once) against the test cluster."""
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    return tmp_path


def write_config(folder: Path, text: str) -> Path:
    path = folder / "run.yaml"
    path.write_text(f"include: {EXAMPLES / 'tiny_base.yaml'}\ndata: data\n{text}")
    return path


def program(*options: str) -> str:
    return f"python {CONTRACT} " + " ".join(options)


def submit(*args: str) -> list[dict]:
    assert main(["submit", *args]) == 0
    sweep_dir = Path(args[args.index("--sweep-dir") + 1])
    return json.loads((sweep_dir / "submissions.json").read_text())


def status(sweep_dir: Path, capsys) -> list[dict]:
    capsys.readouterr()
    assert main(["status", str(sweep_dir), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def events(run_dir: Path) -> list[tuple]:
    return [(e["event"], e["restart"], e["stop_after_stage"])
            for e in read_jsonl(run_dir / "slurm_events.jsonl")]


def arrivals(run_dir: Path) -> list[int]:
    return [record["arrival"] for record in read_jsonl(run_dir / "stream.jsonl")]


def checkpoint(run_dir: Path) -> dict:
    return json.loads((run_dir / "checkpoint_last.json").read_text())


def test_two_job_array_from_example_config(slurm, tmp_path, capsys, monkeypatch):  # noqa: F811
    (tmp_path / "data-bin" / "tiny-lm").mkdir(parents=True)
    command = [str(Path(sys.executable).parent / "alma-sweep"), "submit",
               str(EXAMPLES / "tiny_sweep.yaml"), "--sweep-dir", "sw",
               "--program", program("--stage-seconds", "0.3")]
    done = subprocess.run(command, cwd=tmp_path, env=slurm.env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    assert "submitted job" in done.stdout and "(array 0-1%2, link 1/1)" in done.stdout
    slurm.wait_queue_empty(timeout=60)
    sweep_dir = tmp_path / "sw"
    job_id = json.loads((sweep_dir / "submissions.json").read_text())[0]["job_id"]
    for index, layers in ((0, "1"), (1, "2")):
        run_dir = sweep_dir / f"decoder-layers{layers}.seed1"
        assert arrivals(run_dir) == [1, 2, 3]
        assert events(run_dir) == [("started", 0, None), ("completed", 0, None)]
        start = checkpoint(run_dir)["starts"][0]
        assert (start["world_size"], start["cpu"], start["init_method"]) == (1, True, None)
        argv = start["argv"]
        assert argv[argv.index("--decoder-layers") + 1] == layers
        assert argv[argv.index("--save-dir") + 1] == str(run_dir)
        assert "rank 0 stops after stage 3" in (run_dir / "train.log").read_text()
        assert slurm.job_info(f"{job_id}_{index}")["JobState"] == "COMPLETED"
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    assert [(r["state"], r["last_arrival"], r["best"]) for r in status(sweep_dir, capsys)] == [
        ("done", 3, 21.0), ("done", 3, 21.0)]  # eval_ppl = 60 / 3 + seed 1
    monkeypatch.chdir(tmp_path)  # submitting again finds every run done
    assert main(["submit", str(EXAMPLES / "tiny_sweep.yaml"), "--sweep-dir", "sw",
                 "--program", program("--stage-seconds", "0.3")]) == 0
    assert "all 2 run(s)" in capsys.readouterr().out
    assert len(json.loads((sweep_dir / "submissions.json").read_text())) == 1


def test_srun_two_tasks_all_reduce_through_launch_task(slurm):  # noqa: F811
    done = slurm.run("srun", "-n", "2", str(LAUNCH_TASK), "--cpu", sys.executable,
                     str(CHECK_DISTRIBUTED), timeout=120)
    reports = sorted((json.loads(line) for line in done.stdout.splitlines()),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1]
    port = 20000 + int(reports[0]["slurm_job_id"]) % 20000
    for report in reports:
        assert (report["world_size"], report["sum"], report["backend"]) == (2, 3.0, "gloo")
        assert report["init_method"] == f"tcp://{slurm.host}:{port}"
    assert [r["device_id"] for r in reports] == [0, 1]  # SLURM_LOCALID on one node


def test_usr1_saves_requeues_and_resumes(slurm, workdir, capsys):  # noqa: F811
    config = write_config(workdir, "args: {max-epoch: 3}\n")
    job_id = submit(str(config), "--sweep-dir", "rq",
                    "--program", program("--stage-seconds", "2"))[0]["job_id"]
    run_dir = workdir / "rq" / "seed1"
    slurm.wait_until(lambda: arrivals(run_dir), 60, "first arrival")
    # what Slurm does signal_seconds before the time limit (#SBATCH --signal=B:USR1@...)
    slurm.run("scancel", "--batch", "--signal=USR1", f"{job_id}_0")
    slurm.wait_queue_empty(timeout=60)
    assert events(run_dir) == [("started", 0, None), ("usr1", 0, None), ("requeued", 0, None),
                               ("started", 1, None), ("completed", 1, None)]
    state = checkpoint(run_dir)
    assert state["saved_on_signal"] == 1
    first, second = state["starts"]
    assert (first["restart"], first["resumed_from_stage"]) == (0, 0)
    assert second["restart"] == 1 and 1 <= second["resumed_from_stage"] < 3  # resumed, not redone
    assert arrivals(run_dir) == [1, 2, 3]  # none lost, none duplicated
    info = slurm.job_info(f"{job_id}_0")
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1")
    [run] = status(workdir / "rq", capsys)
    assert (run["state"], run["restarts"], run["last_arrival"], run["best"]) == ("done", 1, 3, 21.0)


def test_chain_stages_run_in_order_with_two_tasks(slurm, workdir, capsys):  # noqa: F811
    profile = workdir / "two-tasks.yaml"
    profile.write_text("ntasks_per_node: 2\ntime: '00:05:00'\nsignal_seconds: 30\n"
                       "save_grace_seconds: 10\n")
    config = write_config(workdir, "args: {max-epoch: 4}\n")
    first, second = submit(str(config), "--sweep-dir", "ch", "--profile", str(profile),
                           "--chain-stages", "2", "--stages-per-link", "2",
                           "--program", program("--stage-seconds", "0.3"))
    assert (first["stop_after_stage"], second["stop_after_stage"]) == (2, None)
    assert second["after"] == first["job_id"]
    slurm.wait_queue_empty(timeout=60)
    run_dir = workdir / "ch" / "seed1"
    assert events(run_dir) == [("started", 0, 2), ("stopped_after_stage", 0, 2),
                               ("started", 0, None), ("completed", 0, None)]
    starts = checkpoint(run_dir)["starts"]
    assert [(s["resumed_from_stage"], s["stop_after_stage"]) for s in starts] == [(0, 2), (2, None)]
    assert all(s["world_size"] == 2 and s["init_method"].startswith("tcp://") for s in starts)
    assert arrivals(run_dir) == [1, 2, 3, 4]
    link1 = slurm.job_info(f"{first['job_id']}_0")
    link2 = slurm.job_info(f"{second['job_id']}_0")
    assert link1["JobState"] == link2["JobState"] == "COMPLETED"
    assert link2["StartTime"] >= link1["EndTime"]  # ISO timestamps compare as text
    [run] = status(workdir / "ch", capsys)
    assert (run["state"], run["last_arrival"], run["best"]) == ("done", 4, 16.0)


def test_a_failed_link_cancels_only_its_own_run(slurm, workdir, capsys):  # noqa: F811
    config = write_config(workdir, "args: {max-epoch: 3}\ngrid: {lr: [0.1, 0.2]}\n")
    ahead = workdir / "fl" / "lr0.2.seed1"  # this run already finished stage 2 earlier
    ahead.mkdir(parents=True)
    (ahead / "checkpoint_last.json").write_text('{"stage": 2}')
    (ahead / "stream.jsonl").write_text('{"arrival": 1}\n{"arrival": 2}\n')
    first, second = submit(str(config), "--sweep-dir", "fl", "--chain-stages", "2",
                           "--stages-per-link", "2",
                           "--program", program("--stage-seconds", "0.2", "--fail-at-stage", "2"))
    slurm.wait_queue_empty(timeout=60)
    assert events(workdir / "fl" / "lr0.1.seed1") == [("started", 0, 2), ("failed", 0, 2)]
    assert slurm.job_info(f"{second['job_id']}_0")["JobState"] == "CANCELLED"
    assert slurm.job_info(f"{second['job_id']}_1")["JobState"] == "COMPLETED"
    assert arrivals(ahead) == [1, 2, 3]
    runs = status(workdir / "fl", capsys)
    assert [(r["state"], r["last_arrival"]) for r in runs] == [("failed", 1), ("done", 3)]
    # the same command again (the bug fixed) submits only the failed run, which resumes
    again = submit(str(config), "--sweep-dir", "fl", "--chain-stages", "2",
                   "--stages-per-link", "2", "--program", program("--stage-seconds", "0.2"))
    assert [s["array"] for s in again[2:]] == ["0%2", "0%2"]
    slurm.wait_queue_empty(timeout=60)
    assert [s["resumed_from_stage"] for s in checkpoint(workdir / "fl" / "lr0.1.seed1")["starts"]
            ] == [0, 1, 2]
    runs = status(workdir / "fl", capsys)
    assert [(r["state"], r["last_arrival"]) for r in runs] == [("done", 3), ("done", 3)]


def test_status_while_running_then_cancel(slurm, workdir, capsys):  # noqa: F811
    config = write_config(workdir, "grid: {lr: [0.1, 0.2]}\n")
    submit(str(config), "--sweep-dir", "cx", "--max-parallel", "1",
           "--program", program("--stage-seconds", "60"))
    run_dir = workdir / "cx" / "lr0.1.seed1"
    slurm.wait_until(lambda: (run_dir / "checkpoint_last.json").exists(), 60, "run 0 started")
    assert [r["state"] for r in status(workdir / "cx", capsys)] == ["running", "pending"]
    assert main(["submit", str(config), "--sweep-dir", "cx", "--program", program()]) == 2
    assert "still has 2 run(s) queued or running" in capsys.readouterr().err
    assert main(["cancel", str(workdir / "cx")]) == 0
    slurm.wait_queue_empty(timeout=60)
    assert [r["state"] for r in status(workdir / "cx", capsys)] == ["interrupted", "not started"]
    assert events(run_dir)[-1][0] == "terminated"
    assert checkpoint(run_dir)["saved_on_signal"] == 1  # the trainer saved on SIGTERM


@pytest.mark.slow
def test_real_fairseq_train_two_cpu_processes(slurm, workdir, tiny_lm_bin):  # noqa: F811
    """The default program: fairseq-train itself, data parallel over 2 gloo processes, with
    exactly the flags launch_task.sh derives (the template for tests of alma_stream runs)."""
    profile = workdir / "two-tasks.yaml"
    profile.write_text("ntasks_per_node: 2\ntime: '00:10:00'\n")
    config = workdir / "run.yaml"
    config.write_text(f"include: {EXAMPLES / 'tiny_base.yaml'}\ndata: {tiny_lm_bin}\n"
                      "args: {max-update: 3, max-epoch: 1, tokens-per-sample: 16}\n")
    submit(str(config), "--sweep-dir", "ft", "--profile", str(profile))
    slurm.wait_queue_empty(timeout=240)
    run_dir = workdir / "ft" / "seed1"
    log = (run_dir / "train.log").read_text()
    assert events(run_dir)[-1][0] == "completed", log[-3000:]
    assert "distributed init (rank 1)" in log and "training on 2 devices" in log
    assert "num_updates 3" in log
    assert (run_dir / "checkpoint_last.pt").is_file()
