"""Data-parallel alma-score: two gloo processes on CPU print the same table and write the same
JSON as one process (--mode single and --mode ens), rank 1 writes nothing; the launch
environment (torchrun's or srun's variables) is read as documented and an incomplete one, or
--from-log under several processes, is one line.

The runs are test_score.py's (a 3-mega-batch stream; two --wait 2 members, one scratch run).
Subprocesses get PYTHONPATH = this checkout, so they score with the code under test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from test_score import ENV, REPO, _score, train_runs

from fairseq_alma.errors import UsageError
from fairseq_alma.lm.score_distributed import ScoreWorld, choose_backend, world_from_env

SCORE = [sys.executable, "-m", "fairseq_alma.cli.score"]


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    return train_runs(tmp_path_factory.mktemp("score_distributed"))


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), ENV.get("PYTHONPATH")) if p)
    clean = {k: v for k, v in ENV.items() if not k.startswith(("SLURM_", "WORLD_SIZE", "RANK",
                                                                 "LOCAL_RANK", "MASTER_"))}
    return {**clean, "PYTHONPATH": path, **extra}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _one_process(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*SCORE, *argv], capture_output=True, text=True, env=_env(),
                          timeout=600)


def _two_ranks(argv: list[str], json_of_rank) -> list[tuple[int, str, str]]:
    """Two processes with torchrun's variables set by hand (as srun users export them)."""
    port = str(_free_port())
    procs = [subprocess.Popen([*SCORE, *argv, "--json", str(json_of_rank(rank))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for rank in (0, 1)]
    return [(p.wait(timeout=600), *p.communicate()) for p in procs]


def _torchrun(argv: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "-m", "fairseq_alma.cli.score", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("mode, runs", [("single", ["ens1", "scratch"]),
                                        ("ens", ["ens1", "ens2"])])
def test_two_gloo_ranks_equal_one_process(stream, tmp_path, mode, runs):
    argv = [str(stream / r) for r in runs] + ["--mode", mode, "--cpu"]
    alone = _one_process([*argv, "--json", str(tmp_path / "one.json")])
    assert alone.returncode == 0, alone.stderr[-3000:]
    ranks = _two_ranks(argv, lambda rank: tmp_path / f"rank{rank}.json")
    for rank, (code, _, err) in enumerate(ranks):
        assert code == 0, f"rank {rank}:\n{err[-3000:]}"
    assert ranks[0][1] == alone.stdout  # the printed table, digit for digit
    assert ranks[1][1] == ""  # rank 1 prints nothing ...
    assert not (tmp_path / "rank1.json").exists()  # ... and writes nothing
    assert "checkpoint 1/" not in ranks[1][2]  # progress is logged by rank 0 only
    one = json.loads((tmp_path / "one.json").read_text())
    # every number to the last bit: the ranks' batch sums are added in one process's order
    assert json.loads((tmp_path / "rank0.json").read_text()) == one
    assert one["series"][0]["scoring"]["eval_tokens"] > 0


@pytest.mark.slow
def test_torchrun_launch_equals_one_process(stream, tmp_path):
    """The documented launch line: torchrun sets every variable itself."""
    argv = [str(stream / "ens1"), str(stream / "ens2"), "--mode", "ens", "--cpu"]
    alone = _one_process([*argv, "--csv", str(tmp_path / "one.csv")])
    both = _torchrun([*argv, "--csv", str(tmp_path / "two.csv")])
    assert alone.returncode == 0 and both.returncode == 0, both.stderr[-3000:]
    assert alone.stdout in both.stdout and both.stdout.count("Ens_w2") == 1
    assert (tmp_path / "one.csv").read_text() == (tmp_path / "two.csv").read_text()


def test_world_from_torchrun_and_srun_variables():
    assert world_from_env({}) == ScoreWorld()
    assert world_from_env({"WORLD_SIZE": "1", "RANK": "0"}) == ScoreWorld()
    rendezvous = {"MASTER_ADDR": "node1", "MASTER_PORT": "29500"}
    torchrun = world_from_env({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0", **rendezvous})
    assert (torchrun.size, torchrun.rank, torchrun.local_rank, torchrun.launcher) == \
        (4, 2, 0, "torchrun")
    assert not torchrun.is_main
    srun = world_from_env({"SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
                           "SLURM_LOCALID": "1", **rendezvous})
    assert (srun.size, srun.rank, srun.local_rank, srun.master_port, srun.launcher) == \
        (2, 1, 1, 29500, "srun")
    # an sbatch script running alma-score as one process has SLURM_NTASKS but no srun step
    assert world_from_env({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}) == ScoreWorld()


@pytest.mark.parametrize("env, needle", [
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, "MASTER_ADDR, MASTER_PORT are not set"),
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
      "MASTER_ADDR": "node1"}, "MASTER_PORT is not set"),
    ({"WORLD_SIZE": "2", "RANK": "5", "LOCAL_RANK": "0", "MASTER_ADDR": "a",
      "MASTER_PORT": "1"}, "RANK=5 is outside 0..1"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
])
def test_incomplete_launch_environment_is_one_line(env, needle):
    with pytest.raises(UsageError, match=needle):
        world_from_env(env)


def test_incomplete_environment_and_from_log_under_ranks_exit_2(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "stream.jsonl").write_text("")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code, out, err = _score(capsys, str(run_dir), "--from-log")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not set" in err
    for name, value in {"LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    code, out, err = _score(capsys, str(run_dir), "--from-log")
    assert code == 2 and "--from-log evaluates nothing" in err and err.count("\n") == 1


def test_backend_follows_the_device():
    assert choose_backend(use_cuda=False) == "gloo"
    assert choose_backend(use_cuda=True) == "nccl"
    assert choose_backend(use_cuda=True, override="gloo") == "gloo"
    with pytest.raises(UsageError, match="nccl needs CUDA"):
        choose_backend(use_cuda=False, override="nccl")


@pytest.mark.slow
def test_an_expert_parallel_runs_checkpoints_score_with_whole_experts_on_two_ranks(stream, tmp_path):
    """A checkpoint of an expert-parallel run (full [E, ...] experts, moe_expert_parallel_size 2
    in its config) was rebuilt sharded by two scoring ranks: a rank with one batch fewer waited
    in all_to_all forever (--max-eval-tokens 96: 3 blocks of 32 over 2 ranks), and the numbers
    differed from one process's. Scoring now builds every expert on every rank."""
    import shutil

    import torch

    run = tmp_path / "ep"
    shutil.copytree(stream / "ens1", run)
    for path in run.glob("checkpoint_stage*.pt"):
        state = torch.load(path, map_location="cpu", weights_only=False)
        state["cfg"]["model"]["moe_expert_parallel_size"] = 2  # as an expert-parallel run saves it
        torch.save(state, path)
    argv = [str(run), "--mode", "single", "--cpu", "--max-eval-tokens", "96"]
    alone = _one_process([*argv, "--json", str(tmp_path / "one.json")])
    assert alone.returncode == 0, alone.stderr[-3000:]
    port = str(_free_port())
    procs = [subprocess.Popen([*SCORE, *argv, "--json", str(tmp_path / f"rank{rank}.json")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for rank in (0, 1)]
    try:
        results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    finally:
        for proc in procs:
            proc.kill()
    for rank, (code, _, err) in enumerate(results):
        assert code == 0, f"rank {rank}:\n{err[-3000:]}"
    assert json.loads((tmp_path / "rank0.json").read_text()) == \
        json.loads((tmp_path / "one.json").read_text())


@pytest.mark.slow
def test_ranks_given_different_requests_are_refused(stream, tmp_path):
    """Rank 0 printed its --max-eval-tokens slice's label over numbers partly from rank 1's
    whole split: the ranks share the batches of what each was asked."""
    port = str(_free_port())
    argv = [str(stream / "ens1"), "--mode", "single", "--cpu"]
    procs = [subprocess.Popen([*SCORE, *argv, *extra], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=_env(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for rank, extra in ((0, ["--max-eval-tokens", "96"]), (1, []))]
    try:
        results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    finally:
        for proc in procs:
            proc.kill()
    for code, out, err in results:
        lines = [line for line in err.splitlines() if line.startswith("alma-score: error:")]
        assert code == 2 and out == "" and "Traceback" not in err, err[-3000:]
        assert len(lines) == 1 and "scoring processes were given different requests " \
            "(--max-eval-tokens: " in lines[0], err[-3000:]
