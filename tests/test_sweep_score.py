"""``alma-sweep score``: a sweep's runs and seed ensembles scored as ONE Slurm array (issue 18).

A real 2-seed sweep of ``train_configs/examples/tiny_stream.yaml`` is trained on the local Slurm
(tests/slurm_cluster.py); ``alma-sweep score`` then plans 3 tasks (seed1, seed2, and their
ensemble), the array runs them, and every printed digit and every JSON number must equal what
``alma-score`` prints and writes when run directly on the same runs with the same options (1e-12,
and in practice bit for bit: same batches, same thread count). Then: a second call submits
nothing; a retrained (touched) checkpoint makes its run and ensemble due again; an unfinished
run is skipped with its reason; bad input is one line, exit 2, nothing written.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_cluster import slurm  # noqa: F401  (module-scoped cluster fixture)
from test_distributed_stream import build_tiny_stream, free_port
from test_slurm_streams import cli

from fairseq_alma.cli.report import main as report_main
from fairseq_alma.cli.score import main as score_main
from fairseq_alma.cli.sweep import main as sweep_main
from fairseq_alma.stream.atomic import atomic_write_json

REPO = Path(__file__).resolve().parents[1]
TINY_STREAM = REPO / "train_configs" / "examples" / "tiny_stream.yaml"
OPTIONS = ("--max-eval-tokens", "600")  # passed through to every task (a 19-block slice)
TASKS = {"seed1": ["seed1"], "seed2": ["seed2"], "ens-seeds1-2": ["seed1", "seed2"]}


def slurm_test(test):
    """The tests that need the cluster (and a trained sweep): marked like the other Slurm tests."""
    return pytest.mark.slurm(pytest.mark.slow(test))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep_score")
    build_tiny_stream(root)  # data-bin/tiny-stream: the config's relative data:
    return root


@pytest.fixture(scope="module")
def sweep(slurm, workdir) -> Path:  # noqa: F811
    """tiny_stream.yaml with seeds 1 and 2, trained to the end as one 2-task array."""
    cli(slurm, workdir, "alma-sweep", "submit", str(TINY_STREAM), "--sweep-dir", "sw",
        "--seeds", "1,2")
    slurm.wait_queue_empty(timeout=300)
    return workdir / "sw"


@pytest.fixture(scope="module")
def scored(slurm, workdir, sweep) -> str:  # noqa: F811
    """``alma-sweep score sw --max-eval-tokens 600``, run to the end on the cluster; a task's
    folder holds what a cancelled earlier job left (its task removes it)."""
    (sweep / "scores" / "ens-seeds1-2" / ".partial-1").mkdir(parents=True)
    out = cli(slurm, workdir, "alma-sweep", "score", "sw", *OPTIONS)
    slurm.wait_queue_empty(timeout=300)
    return out


def direct_score(tmp: Path, run_dirs: list[Path], mode: str) -> tuple[str, dict, str]:
    """alma-score itself on ``run_dirs`` (stdout, JSON, CSV), one intra-op thread like the
    Slurm task (the profile exports OMP_NUM_THREADS=1; torch's thread count changes float
    summation order, hence the last bits of a perplexity)."""
    import torch

    threads = torch.get_num_threads()
    out = io.StringIO()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = score_main([*map(str, run_dirs), "--mode", mode, *OPTIONS, "--cpu",
                               "--json", str(tmp / "d.json"), "--csv", str(tmp / "d.csv")])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    return out.getvalue(), json.loads((tmp / "d.json").read_text()), (tmp / "d.csv").read_text()


def assert_same_json(got, want, where: str = "") -> None:
    """Equal structure and strings; every number within 1e-12 (relative above 1)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            assert_same_json(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_json(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(want, bool):
        assert isinstance(got, (int, float)), where
        assert math.isfinite(want) == math.isfinite(got), where
        assert abs(got - want) <= 1e-12 * max(1.0, abs(want)), (where, got, want)
    else:
        assert got == want, (where, got, want)


@slurm_test
def test_dry_run_plans_every_run_and_the_ensemble_and_writes_nothing(
        slurm, workdir, sweep):  # noqa: F811
    out = cli(slurm, workdir, "alma-sweep", "score", "sw", "--dry-run", *OPTIONS)
    assert out.startswith(f"3 scoring task(s) for 2 finished run(s) of {sweep} on profile "
                          "local-cpu (1 process(es) per task); 3 to submit\n"), out
    assert ("0    seed1         single  seed1        to score\n"
            "1    seed2         single  seed2        to score\n"
            "2    ens-seeds1-2  ens     seed1 seed2  to score\n") in out, out
    assert (f"[2] srun --kill-on-bad-exit=1 --cpus-per-task=1 {sys.executable} -m "
            f"fairseq_alma.cli.score {sweep}/seed1 {sweep}/seed2 --mode ens --max-eval-tokens "
            f"600 --cpu --json '{sweep}/scores/ens-seeds1-2/.partial-$SLURM_JOB_ID/score.json'"
            ) in out, out
    script = out.split(f"# {sweep}/score.sbatch\n")[1].split("# would submit:")[0]
    for line in ("#SBATCH --array=0-2%3", f"#SBATCH --output={sweep}/logs/score_%A_%a.out",
                 "#SBATCH --ntasks-per-node=1", "export OMP_NUM_THREADS=1"):
        assert line + "\n" in script
    assert "--signal" not in script  # scoring cannot save and resume: no early warning
    syntax = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert syntax.returncode == 0, syntax.stderr
    assert out.rstrip().endswith(f"sbatch --parsable {sweep}/score.sbatch")
    for name in ("score_jobs.json", "score.sbatch", "scores"):
        assert not (sweep / name).exists()


@slurm_test
def test_array_results_equal_alma_score_run_directly(
        slurm, workdir, sweep, scored, tmp_path):  # noqa: F811
    assert "submitted job " in scored and "(array 0-2%3)" in scored, scored
    plan = json.loads((sweep / "score_jobs.json").read_text())
    assert [(t["name"], t["mode"], t["runs"]) for t in plan["tasks"]] == [
        (name, "ens" if len(runs) > 1 else "single", runs) for name, runs in TASKS.items()]
    [submission] = plan["submissions"]
    for task in plan["tasks"]:
        out_dir = sweep / "scores" / task["name"]
        log = (out_dir / "score.log").read_text() if (out_dir / "score.log").exists() else ""
        info = slurm.job_info(f"{submission['job_id']}_{task['index']}")
        assert info["JobState"] == "COMPLETED", log[-3000:]
        assert sorted(p.name for p in out_dir.iterdir()) == [
            "score.csv", "score.json", "score.log", "score.txt", "scored.json"]  # no partials
        stamp = json.loads((out_dir / "scored.json").read_text())
        assert stamp["signature"] == task["signature"] and stamp["task"] == task["name"]
        mode = "ens" if task["mode"] == "ens" else "single"
        text, payload, csv = direct_score(tmp_path, [sweep / r for r in task["runs"]], mode)
        assert (out_dir / "score.txt").read_text() == text  # every printed digit
        assert "perplexity on the first 576 of " in text  # the option reached alma-score
        assert_same_json(json.loads((out_dir / "score.json").read_text()), payload)
        assert (out_dir / "score.csv").read_text() == csv
    ens = json.loads((sweep / "scores" / "ens-seeds1-2" / "score.json").read_text())
    assert ens["series"][0]["setting"] == "Ens_w1" and ens["series"][0]["num_experts"] == "2@2"
    # alma-report takes the outputs as they are (the ensemble, and the 2 seeds as mean ± std)
    files = sorted(str(p) for p in (sweep / "scores").glob("*/score.json"))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert report_main([*files, "--out", str(tmp_path / "report")]) == 0
    table = (tmp_path / "report" / "table2.md").read_text()
    assert "Ens_w1" in table and "±" in table, table


@slurm_test
def test_second_call_submits_nothing_and_status_shows_scoring(
        slurm, workdir, sweep, scored):  # noqa: F811
    out = cli(slurm, workdir, "alma-sweep", "score", "sw", *OPTIONS)
    assert "; 0 to submit\n" in out and "nothing to submit" in out, out
    assert len(json.loads((sweep / "score_jobs.json").read_text())["submissions"]) == 1
    status = cli(slurm, workdir, "alma-sweep", "status", "sw")
    assert f"scoring ({sweep}/score_jobs.json): 3 task(s): scored 3\n" in status, status
    # the tables' scoring tasks are in --json too, after the runs
    rows = json.loads(cli(slurm, workdir, "alma-sweep", "status", "sw", "--json"))
    assert [(row["kind"], row["state"]) for row in rows] == [("training", "done")] * 2 + [
        ("scoring", "scored")] * 3, rows
    # the fingerprint submit expects of each run is the one its task wrote (through
    # launch_task.sh): the trained sweep is done
    out = cli(slurm, workdir, "alma-sweep", "submit", str(TINY_STREAM), "--sweep-dir", "sw",
              "--seeds", "1,2")
    assert f"all 2 run(s) in {sweep} are done; nothing to submit" in out, out
    # other options are another scoring: every task is due again
    other = cli(slurm, workdir, "alma-sweep", "score", "sw", "--dry-run", "--max-eval-tokens",
                "300")
    assert other.count("rescore (inputs changed)") == 3, other


@slurm_test
def test_a_retrained_run_is_due_again_with_its_ensemble(
        slurm, workdir, sweep, scored):  # noqa: F811
    ckpt = sweep / "seed2" / "checkpoint_stage2.pt"
    before = ckpt.stat()
    os.utime(ckpt, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    try:
        out = cli(slurm, workdir, "alma-sweep", "score", "sw", "--dry-run", *OPTIONS)
        status = cli(slurm, workdir, "alma-sweep", "status", "sw")
    finally:
        os.utime(ckpt, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert ("0    seed1         single  seed1        scored\n"
            "1    seed2         single  seed2        rescore (inputs changed)\n"
            "2    ens-seeds1-2  ens     seed1 seed2  rescore (inputs changed)\n") in out, out
    assert out.rstrip().splitlines()[-1] == f"sbatch --parsable {sweep}/score.sbatch"
    assert "#SBATCH --array=1-2%2\n" in out
    assert "3 task(s): scored 1, stale 2" in status, status


def _copy_sweep(sweep: Path, dest: Path, runs: tuple[str, ...] = ("seed1", "seed2")) -> Path:
    """The trained sweep's ``runs`` and their job table under ``dest`` (run_dir rewritten)."""
    table = json.loads((sweep / "jobs.json").read_text())
    table["jobs"] = [job for job in table["jobs"] if job["name"] in runs]
    for job in table["jobs"]:
        shutil.copytree(job["run_dir"], dest / job["name"])
        job["run_dir"] = str(dest / job["name"])
    atomic_write_json(dest / "jobs.json", table)
    return dest


@slurm_test
def test_unfinished_run_is_skipped_with_its_ensemble(
        slurm, workdir, sweep, tmp_path):  # noqa: F811
    copy = _copy_sweep(sweep, tmp_path / "half")
    stream = copy / "seed2" / "stream.jsonl"
    stream.write_text("".join(stream.read_text().splitlines(keepends=True)[:2]))  # arrivals 0, 1
    out = cli(slurm, workdir, "alma-sweep", "score", str(copy), "--dry-run")
    assert "1 scoring task(s) for 1 finished run(s)" in out, out
    assert (f"skipped seed2: {stream}: training not finished: arrivals 0..1 of B = 2 (arrival 2 "
            "missing); run the same training command again to finish it\n"
            "skipped ens-seeds1-2: waits for seed2 (not finished)\n") in out, out
    assert "#SBATCH --array=0%1\n" in out


@slurm_test
def test_two_processes_per_task_score_the_same_numbers(
        slurm, workdir, sweep, scored, tmp_path, monkeypatch):  # noqa: F811
    """A profile of 2 CPU processes: srun starts alma-score twice (MASTER_ADDR from the node
    list), they share the evaluation batches, and rank 0's outputs equal the 1-process task's
    (float64 sums added in another order: 1e-12)."""
    copy = _copy_sweep(sweep, tmp_path / "dp", runs=("seed1",))
    profile = tmp_path / "two.yaml"
    profile.write_text((REPO / "slurm" / "profiles" / "local-cpu.yaml").read_text()
                       .replace("ntasks_per_node: 1 ", "ntasks_per_node: 2 "))
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # two test clusters both count from 1
    out = cli(slurm, workdir, "alma-sweep", "score", str(copy), "--profile", str(profile),
              *OPTIONS)
    assert "on profile two (2 process(es) per task); 1 to submit" in out, out
    slurm.wait_queue_empty(timeout=300)
    out_dir = copy / "scores" / "seed1"
    log = (out_dir / "score.log").read_text()
    assert "2 process(es)" in log and (out_dir / "scored.json").is_file(), log[-3000:]
    # one world of 2 ranks (only rank 0 logs progress), not 2 single-process scorings
    assert log.count("| fairseq_alma.cli.score | scoring ") == 1, log[-3000:]
    reference = (sweep / "scores" / "seed1" / "score.txt").read_text()
    assert (out_dir / "score.txt").read_text() == reference
    got = json.loads((out_dir / "score.json").read_text().replace(str(copy), str(sweep)))
    assert_same_json(got, json.loads((sweep / "scores" / "seed1" / "score.json").read_text()))


def _error(capsys, *args: str) -> tuple[str, str]:
    """The one stderr line of ``alma-sweep ARGS`` run in process (which must exit 2), and
    what it printed on stdout."""
    assert sweep_main(list(args)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("alma-sweep: error: "), captured.err
    return lines[0], captured.out


@pytest.mark.parametrize("args, expected", [
    (["--max-eval-tokens", "0"], "--max-eval-tokens must be >= 1 (got 0)"),
    (["--json", "x.json"], "--json: alma-sweep score sets it (each task writes "
                           "SWEEP_DIR/scores/TASK/score.json); drop --json"),
    (["--mode", "gens"], "--mode: alma-sweep score sets it"),
    (["--matrix"], "--matrix: alma-sweep score sets it (not for sweeps: their Ens and gEns "
                   "tasks cannot score one;"),
    (["--fp16"], "--fp16 needs a CUDA device, but profile local-cpu has no GPUs"),
    (["--max-parallel", "0"], "--max-parallel must be >= 1"),
    (["--profile", "nope"], "resource profile"),
    (["--data", "no/such/dir"], "no/such/dir: not a directory"),
])
def test_bad_options_are_one_line_and_write_nothing(tmp_path, monkeypatch, capsys, args,
                                                    expected):
    """Checked before the sweep's runs are even looked at (they do not exist here)."""
    monkeypatch.chdir(tmp_path)
    job = {"index": 0, "name": "seed1", "overrides": {}, "seed": 1,
           "run_dir": str(tmp_path / "seed1"), "argv": [str(tmp_path / "data")]}
    atomic_write_json(tmp_path / "jobs.json", {"profile": "local-cpu", "jobs": [job]})
    before = sorted(os.listdir(tmp_path))
    assert expected in _error(capsys, "score", str(tmp_path), *args)[0]
    assert sorted(os.listdir(tmp_path)) == before


def test_sweep_without_finished_runs_or_known_profile(tmp_path, capsys):
    line, _ = _error(capsys, "score", str(tmp_path))
    assert "not a sweep directory (run alma-sweep submit)" in line
    job = {"index": 0, "name": "seed1", "overrides": {}, "seed": 1,
           "run_dir": str(tmp_path / "seed1"), "argv": [str(tmp_path / "data")]}
    atomic_write_json(tmp_path / "jobs.json", {"profile": "inline", "jobs": [job]})
    line, _ = _error(capsys, "score", str(tmp_path))
    assert "trained with profile 'inline', which is not in slurm/profiles/; pass --profile" in line
    line, out = _error(capsys, "score", str(tmp_path), "--profile", "local-cpu")
    assert f"no run of {tmp_path} has finished training" in line
    assert f"skipped seed1: {tmp_path}/seed1/stream.jsonl does not exist (not trained yet)\n" \
        in out  # on stdout, before the error
    assert sorted(os.listdir(tmp_path)) == ["jobs.json"]


@slurm_test
def test_failed_sbatch_leaves_the_sweep_as_it_was(sweep, tmp_path, monkeypatch, capsys):
    """A Slurm client that fails (here: SLURM_CONF names no file) is one line, and neither the
    plan nor the script of the sweep is changed; the same error from a real process."""
    copy = _copy_sweep(sweep, tmp_path / "copy")
    before = sorted(os.listdir(copy))
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "nowhere.conf"))
    line, _ = _error(capsys, "score", str(copy))
    assert f"SLURM_CONF={tmp_path}/nowhere.conf does not exist" in line
    assert sorted(os.listdir(copy)) == before
    done = subprocess.run([sys.executable, "-m", "fairseq_alma.cli.sweep", "score", str(copy),
                           "--batch-size", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "alma-sweep: error: --batch-size must be >= 1 (got 0)"], done.stderr


@slurm_test
def test_a_growing_ensemble_run_is_also_scored_as_gens(
        slurm, workdir, tmp_path):  # noqa: F811
    """A run trained with --stage-init scratch is a gEns (its stages are the members): the array
    scores it once as a single model and once with --mode gens, and the gEns outputs equal
    alma-score --mode gens run directly."""
    cli(slurm, workdir, "alma-sweep", "submit", str(TINY_STREAM), "--sweep-dir", "swg",
        "--seeds", "1", "--grid", "stage-init=scratch")
    slurm.wait_queue_empty(timeout=300)
    sweep = workdir / "swg"
    [job] = json.loads((sweep / "jobs.json").read_text())["jobs"]
    out = cli(slurm, workdir, "alma-sweep", "score", "swg", *OPTIONS)
    assert "2 scoring task(s) for 1 finished run(s)" in out, out
    slurm.wait_queue_empty(timeout=300)
    plan = json.loads((sweep / "score_jobs.json").read_text())
    assert [(t["name"], t["mode"]) for t in plan["tasks"]] == [
        (job["name"], "single"), (job["name"] + ".gens", "gens")]
    out_dir = sweep / "scores" / (job["name"] + ".gens")
    assert (out_dir / "scored.json").is_file(), (out_dir / "score.log").read_text()[-3000:]
    text, payload, csv = direct_score(tmp_path, [Path(job["run_dir"])], "gens")
    assert (out_dir / "score.txt").read_text() == text
    assert payload["series"][0]["setting"].startswith("gEns")
    assert_same_json(json.loads((out_dir / "score.json").read_text()), payload)
    assert (out_dir / "score.csv").read_text() == csv


def test_scoring_defaults_to_the_very_profile_the_sweep_trained_with(tmp_path, monkeypatch,
                                                                      capsys):
    """jobs.json kept the profile's name only: a user's myprof/local-cpu.yaml (15 minutes)
    became the shipped local-cpu for scoring, and a profile file named otherwise was refused."""
    from test_sweep import fake_sbatch, write_stream_skeleton

    from fairseq_alma.sweeps.score_submit import ScoreArrayRequest, prepare_scoring

    fake_sbatch(tmp_path, monkeypatch)
    write_stream_skeleton(tmp_path / "data-bin" / "tiny-stream")
    shipped = (REPO / "slurm" / "profiles" / "local-cpu.yaml").read_text()
    assert 'time: "00:15:00"' not in shipped
    for name in ("myprof/local-cpu.yaml", "cpu2.yaml"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(re.sub(r"(?m)^time: .*$", 'time: "00:15:00"', shipped))
        sweep_dir = tmp_path / Path(name).stem
        assert sweep_main(["submit", str(TINY_STREAM), "--sweep-dir", str(sweep_dir),
                           "--profile", name]) == 0, capsys.readouterr().err
        setup = prepare_scoring(ScoreArrayRequest(sweep_dir))
        assert (setup.profile.name, setup.profile.time) == (Path(name).stem, "00:15:00")
        assert "--time=00:15:00" in setup.profile.sbatch_options()
    # a jobs.json written before the profile was kept: the name, found in slurm/profiles/
    table = json.loads((tmp_path / "local-cpu" / "jobs.json").read_text())
    del table["profile_settings"], table["profile_source"]
    atomic_write_json(tmp_path / "local-cpu" / "jobs.json", table)
    setup = prepare_scoring(ScoreArrayRequest(tmp_path / "local-cpu"))
    assert setup.profile.time != "00:15:00"


def test_scoring_again_when_squeue_does_not_answer_is_refused(tmp_path, monkeypatch, capsys):
    """Read as an empty queue, a silent squeue scored the queued tasks a second time."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text('#!/bin/sh\necho "slurm_load_jobs error: Socket timed out" '
                                    '>&2\nexit 1\n')
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.delenv("SLURM_CONF", raising=False)
    job = {"index": 0, "name": "seed1", "overrides": {}, "seed": 1,
           "run_dir": str(tmp_path / "seed1"), "argv": [str(tmp_path / "data")]}
    atomic_write_json(tmp_path / "jobs.json", {"profile": "local-cpu", "jobs": [job]})
    atomic_write_json(tmp_path / "score_jobs.json", {"tasks": [], "submissions": [
        {"job_id": "60", "tasks": [0]}]})
    line, _ = _error(capsys, "score", str(tmp_path))
    assert line.startswith("alma-sweep: error: squeue did not answer (") and \
        "Socket timed out), so whether scoring job 60 of " in line, line
    assert line.endswith("retry alma-sweep score when squeue answers"), line
