"""Real ``alma_stream`` runs on a real single-node Slurm (issue 5, items 3-4 and Reliability).

test_slurm_cluster.py checks the launcher with a stand-in trainer; here every job trains the tiny
stream of ``train_configs/examples/tiny_stream*.yaml`` with fairseq-train: a 2-task sweep array,
a 2-task ``srun`` data-parallel stream through ``slurm/launch_task.sh``, and a stream that is
interrupted twice while training (the sbatch script's USR1 save-and-requeue path, then
``scontrol requeue``, which SIGTERMs the step) and must end exactly like an uninterrupted run,
down to its ``alma-score`` table. Stage weights are compared bit for bit everywhere; so are the
per-arrival records, except that the 2-rank stream's evaluation sums are allowed 1e-12 (see
test_distributed_stream.py for why a 2-rank stream equals 1 process with --update-freq 2).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from pathlib import Path

import pytest
from slurm_cluster import slurm  # noqa: F401  (module-scoped cluster fixture)
from test_distributed_stream import (
    CROSS_TOPOLOGY_REL_TOL,
    LOADED,
    assert_same_stream,
    build_tiny_stream,
    free_port,
    tiny_stream_argv,
)

from fairseq_alma.cli.sweep import main as sweep_main
from fairseq_alma.sweeps.train_records import read_jsonl
from fairseq_alma.sweeps.train_script import LAUNCH_TASK

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "train_configs" / "examples"
TASK_LINE = "task: AlmaStreamTask"  # fairseq-train logs it after setup_task (signal handlers set)


def cli(slurm, cwd: Path, *args: str) -> str:  # noqa: F811
    """Run ``alma-sweep``/``alma-score`` in this process (fairseq is imported once, not once per
    call) from ``cwd`` against the test cluster; assert exit status 0; return what it printed."""
    if args[0] == "alma-score":
        from fairseq_alma.cli.score import main
    else:
        main = sweep_main
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
        patch.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args[1:]))
    assert code == 0, f"{' '.join(args)} exited {code}:\n{out.getvalue()}\n{err.getvalue()}"
    return out.getvalue()


def events(run_dir: Path) -> list[tuple[str, int]]:
    return [(e["event"], e["restart"]) for e in read_jsonl(run_dir / "slurm_events.jsonl")]


def arrivals(run_dir: Path) -> list[int]:
    return [record["arrival"] for record in read_jsonl(run_dir / "stream.jsonl")]


def stage_checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("checkpoint_stage*.pt"))


def train_log(run_dir: Path) -> str:
    path = run_dir / "train.log"
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """Where alma-sweep runs: data-bin/tiny-stream is the configs' relative ``data:``."""
    root = tmp_path_factory.mktemp("slurm_streams")
    build_tiny_stream(root)
    return root


@pytest.fixture(scope="module")
def array_sweep(slurm, workdir) -> tuple[Path, str]:  # noqa: F811
    """tiny_stream_sweep.yaml (update-freq 1 and 2) submitted as one array and run to the end."""
    out = cli(slurm, workdir, "alma-sweep", "submit", str(EXAMPLES / "tiny_stream_sweep.yaml"),
              "--sweep-dir", "sw")
    slurm.wait_queue_empty(timeout=300)
    return workdir / "sw", out


def test_two_job_array_of_streams_from_train_config(slurm, workdir, array_sweep):  # noqa: F811
    sweep_dir, out = array_sweep
    assert "(array 0-1%2, link 1/1)" in out, out
    job_id = json.loads((sweep_dir / "submissions.json").read_text())[0]["job_id"]
    flops = {}
    for index, freq in enumerate((1, 2)):
        run_dir = sweep_dir / f"update-freq{freq}.seed1"
        assert events(run_dir) == [("started", 0), ("completed", 0)], train_log(run_dir)[-3000:]
        assert arrivals(run_dir) == [0, 1, 2]  # B + 1 records, B = 2 mega-batches
        assert stage_checkpoints(run_dir) == ["checkpoint_stage1.pt", "checkpoint_stage2.pt"]
        assert re.search(r"num_updates 12\b", train_log(run_dir))  # 6 per stage at any batch
        assert slurm.job_info(f"{job_id}_{index}")["JobState"] == "COMPLETED"
        flops[freq] = read_jsonl(run_dir / "stream.jsonl")[-1]["train_flops_cum"]
    # twice the sequences per update (the last batch of a pass over a stage may be short)
    assert 1.9 * flops[1] < flops[2] <= 2 * flops[1], flops
    runs = json.loads(cli(slurm, workdir, "alma-sweep", "status", "sw", "--json"))
    for run in runs:
        best = min(r["eval_ppl"] for r in read_jsonl(sweep_dir / run["name"] / "stream.jsonl"))
        assert (run["state"], run["last_arrival"], run["best"]) == ("done", 2, best)
    text = cli(slurm, workdir, "alma-sweep", "status", "sw")
    assert "2 run(s): done 2" in text, text
    assert len(re.findall(r"update-freq[12]\.seed1\s+done\s+2\s+eval_ppl", text)) == 2, text


def test_srun_two_task_stream_through_launch_task(slurm, workdir, array_sweep):  # noqa: F811
    """2 gloo processes started by srun + launch_task.sh (rank, world size, init method from
    Slurm) train the stream of one process with twice the batch, bit for bit."""
    save = workdir / "srun2"
    command = ["srun", "-n", "2", str(LAUNCH_TASK), "--cpu",
               *tiny_stream_argv(workdir / "data-bin" / "tiny-stream", save)]
    # an explicit port: two test clusters on one machine both number their jobs from 1. No
    # OMP_NUM_THREADS: launch_task.sh must set it (to 1 here), or each task's torch would use
    # every core and the stream would differ from the 1-thread sweep run in its last bits.
    env = {k: v for k, v in slurm.env.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["MASTER_PORT"] = str(free_port())
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "distributed init (rank 1)" in log and "training on 2 devices" in log
    assert arrivals(save) == [0, 1, 2]
    assert stage_checkpoints(save) == ["checkpoint_stage1.pt", "checkpoint_stage2.pt"]
    assert_same_stream(save, array_sweep[0] / "update-freq2.seed1",
                       metric_rel_tol=CROSS_TOPOLOGY_REL_TOL)


def test_requeued_stream_scores_like_an_uninterrupted_one(
        slurm, workdir, array_sweep):  # noqa: F811
    """Interrupted twice while training: USR1 to the batch script (what Slurm sends before the
    time limit: the script forwards it, the trainer saves and exits, the script requeues), then
    ``scontrol requeue`` (SIGTERM to the step: save and exit). Each restart resumes; the run's
    records, stage weights and alma-score table equal the uninterrupted update-freq1 run's."""
    cli(slurm, workdir, "alma-sweep", "submit", str(EXAMPLES / "tiny_stream.yaml"),
        "--sweep-dir", "rq")
    job = json.loads((workdir / "rq" / "submissions.json").read_text())[0]["job_id"] + "_0"
    run_dir = workdir / "rq" / "seed1"

    def started(attempts: int) -> bool:
        return train_log(run_dir).count(TASK_LINE) >= attempts

    slurm.wait_until(lambda: started(1), 120, "first attempt set up")
    slurm.run("scancel", "--batch", "--signal=USR1", job)
    slurm.wait_until(lambda: started(2), 120, "requeued attempt set up")
    slurm.run("scontrol", "requeue", job)
    slurm.wait_queue_empty(timeout=300)

    log = train_log(run_dir)
    assert events(run_dir) == [("started", 0), ("usr1", 0), ("requeued", 0), ("started", 1),
                               ("terminated", 1), ("started", 2), ("completed", 2)], log[-3000:]
    assert "received SIGUSR1" in log and "received SIGTERM" in log
    resumed = [int(m.group(2)) for m in LOADED.finditer(log)]
    assert len(resumed) == 2 and 1 <= resumed[0] < resumed[1] < 12, resumed  # mid-stream, twice
    info = slurm.job_info(job)
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "2")
    [status] = json.loads(cli(slurm, workdir, "alma-sweep", "status", "rq", "--json"))
    assert (status["state"], status["restarts"], status["last_arrival"]) == ("done", 2, 2)

    reference = array_sweep[0] / "update-freq1.seed1"  # same flags (update-freq 1 is the default)
    assert arrivals(run_dir) == [0, 1, 2]
    assert stage_checkpoints(run_dir) == stage_checkpoints(reference)
    assert_same_stream(run_dir, reference)
    table = cli(slurm, workdir, "alma-score", str(run_dir), str(reference), "--mode", "single",
                "--json", "score.json", "--cpu")
    # the two rows share a name, so the table names each by its run directory; the numbers match
    rows = [line.split("]", 1)[1].split() for line in table.splitlines() if line.startswith("SM_w1 [")]
    assert len(rows) == 2 and rows[0] == rows[1], table
    series = json.loads((workdir / "score.json").read_text())["series"]
    got, want = ([{k: v for k, v in a.items() if k != "members"} for a in s["arrivals"]]
                 for s in series)
    assert [a["arrival"] for a in got] == [0, 1, 2]
    for mine, theirs in zip(got, want, strict=True):
        if mine["ppl"] is not None:
            assert abs(mine["ppl"] - theirs["ppl"]) <= 1e-9, (mine, theirs)
    assert got == want and series[0]["summary"] == series[1]["summary"]
