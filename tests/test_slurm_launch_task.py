"""slurm/launch_task.sh without a cluster: the exact fairseq flags it derives from Slurm's
environment (the real-Slurm check of the same wiring is in test_slurm_cluster.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

LAUNCH = Path(__file__).resolve().parents[1] / "slurm" / "launch_task.sh"
CPU_FLAGS = ["--cpu", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"]


def launch(*args: str, **slurm_env: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(slurm_env)
    # printf prints each argument it receives on its own line: the exact argv of the program
    return subprocess.run([str(LAUNCH), *args, "printf", "%s\\n", "DATA", "--lr", "0.1"],
                          env=env, capture_output=True, text=True, timeout=30)


def argv_of(done: subprocess.CompletedProcess) -> list[str]:
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_multi_task_flags_from_slurm_environment():
    done = launch("--cpu", SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="1",
                  SLURM_JOB_ID="20517", MASTER_ADDR="node07")
    assert argv_of(done) == [
        "DATA", "--lr", "0.1",
        "--distributed-world-size", "4", "--device-id", "1",
        "--distributed-rank", "3", "--distributed-no-spawn",
        "--distributed-init-method", "tcp://node07:20517",  # 20000 + 20517 % 20000
        *CPU_FLAGS,
    ]


def test_gpu_launch_keeps_nccl_and_explicit_port_wins():
    done = launch(SLURM_PROCID="0", SLURM_NTASKS="16", SLURM_LOCALID="0", SLURM_JOB_ID="7",
                  MASTER_ADDR="gpu001", MASTER_PORT="29500")
    argv = argv_of(done)
    assert "tcp://gpu001:29500" in argv
    assert "--cpu" not in argv and "--distributed-backend" not in argv  # fairseq default: nccl


def test_single_task_gets_world_size_one_and_no_process_group():
    argv = argv_of(launch("--cpu", SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_JOB_ID="5"))
    assert argv == ["DATA", "--lr", "0.1", "--distributed-world-size", "1", "--device-id", "0",
                    *CPU_FLAGS]


def test_outside_srun_or_without_program_is_a_usage_error():
    done = launch()
    assert done.returncode == 2 and "start it with srun" in done.stderr
    done = subprocess.run([str(LAUNCH), "--cpu"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "usage: srun slurm/launch_task.sh" in done.stderr
