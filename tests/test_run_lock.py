"""The run directory's owner: one writer at a time (flock + a heartbeat record that also works
where flock is node-local, and across Slurm requeues), and one run per directory (run.json's
fingerprint; --restart-stream moves the old run aside, never deletes it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fairseq_alma.errors import RunDirError
from fairseq_alma.stream.lock import HOLDER_FILE, RunLock
from fairseq_alma.stream.run_dir import RunDirectory, discard_unstarted

HOLD = ("import sys, time\n"
        "from fairseq_alma.stream.lock import RunLock\n"
        "RunLock(sys.argv[1]).acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n")


def _holder(path, **changes) -> None:
    record = {"host": "other-node", "pid": 4242, "slurm_job": "", "started": time.time(),
              "heartbeat": time.time()} | changes
    (path / HOLDER_FILE).write_text(json.dumps(record))


def test_a_second_writer_is_stopped_naming_the_holder_and_kill9_frees_the_directory(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError) as caught:
            RunDirectory.for_training(tmp_path)
        message = str(caught.value)
        assert f"is in use by pid {proc.pid} on {os.uname().nodename}" in message
        assert "use another --save-dir" in message and "\n" not in message
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with RunDirectory.for_training(tmp_path) as run_dir:  # the kernel dropped the dead holder's flock
        assert run_dir.lock.read_holder().pid == os.getpid()


@pytest.mark.parametrize("record, taken_over", [
    ({}, False),  # another node, beating: flock may be node-local there (NFS, Lustre)
    ({"heartbeat": time.time() - 3600}, True),  # its heartbeat expired
    ({"slurm_job": "77_3"}, True),  # an earlier run of this very (requeued) job
])
def test_holder_on_another_node(tmp_path, monkeypatch, record, taken_over):
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    _holder(tmp_path, **record)
    if not taken_over:
        with pytest.raises(RunDirError, match="in use by pid 4242 on other-node, last heartbeat"):
            RunLock(tmp_path).acquire()
        return
    lock = RunLock(tmp_path).acquire()
    try:
        holder = lock.read_holder()
        assert (holder.pid, holder.slurm_job) == (os.getpid(), "77_3")
    finally:
        lock.release()
    assert not (tmp_path / HOLDER_FILE).exists()


def test_heartbeat_is_refreshed(tmp_path):
    lock = RunLock(tmp_path, heartbeat_seconds=0.05).acquire()
    try:
        first = lock.read_holder().heartbeat
        time.sleep(0.3)
        assert lock.read_holder().heartbeat > first
    finally:
        lock.release()


def test_another_run_is_refused_and_restart_moves_it_aside(tmp_path):
    run_dir = RunDirectory.for_training(tmp_path / "run")
    try:
        first = {"model": {"moe_experts": 4}, "task": {"wait": 1}, "data": "abc"}
        run_dir.claim(first)
        (run_dir.path / "stream.jsonl").write_text("{}\n")
        (run_dir.path / "checkpoint_stage1.pt").write_bytes(b"stage 1 of the old run")
        run_dir.check_fingerprint(first)  # the same run: fine
        second = {"model": {"moe_experts": 8}, "task": {"wait": 1}, "data": "abc"}
        with pytest.raises(RunDirError) as caught:
            run_dir.check_fingerprint(second)
        message = str(caught.value)
        assert "holds another run (model.moe_experts: 4 -> 8)" in message
        assert "--restart-stream" in message and "\n" not in message
        run_dir.check_fingerprint(second, restart=True)
        moved = run_dir.claim(second, restart=True)
        assert moved.name.startswith("replaced-")
        assert (moved / "checkpoint_stage1.pt").read_bytes() == b"stage 1 of the old run"
        assert json.loads((moved / "run.json").read_text())["fingerprint"] == first
        assert sorted(p.name for p in run_dir.run_files()) == ["run.json"]
        assert run_dir.read_fingerprint() == second
    finally:
        run_dir.close()


def test_a_run_requeued_on_another_process_layout_is_told_to_keep_its_layout(tmp_path):
    """An expert-parallel run requeued on 2 processes instead of 4 was told to use another
    --save-dir or --restart-stream, both of which give up its progress."""
    run_dir = RunDirectory.for_training(tmp_path / "run")
    try:
        def layout(world: int, group: int) -> dict:
            return {"config": {"distributed_training": {"distributed_world_size": world},
                               "model": {"moe_expert_parallel_size": group, "moe_experts": 4}}}

        run_dir.claim(layout(4, 2))
        (run_dir.path / "stream.jsonl").write_text("{}\n")
        with pytest.raises(RunDirError) as caught:
            run_dir.check_fingerprint(layout(2, 2))
        assert "holds this run, started on another process layout (config.distributed_training." \
               "distributed_world_size: 4 -> 2); a run keeps the processes it started on" in str(caught.value)
        other = layout(4, 2)
        other["config"]["model"]["moe_experts"] = 8
        with pytest.raises(RunDirError, match="holds another run"):
            run_dir.check_fingerprint(other)
    finally:
        run_dir.close()


def test_a_refused_commands_directory_gives_way_and_goes_at_exit(tmp_path):
    """What a command refused after it claimed its --save-dir leaves (run.json,
    data_verified.json, the lock file) stops no corrected command and, where the command made
    the directory, is removed at its exit; anything a run trained is never touched."""
    run_dir = RunDirectory.for_training(tmp_path / "run")
    try:
        run_dir.claim({"warmup": 3})
        (run_dir.path / "data_verified.json").write_text('"0123"')
        run_dir.check_fingerprint({"warmup": 2})  # it never trained: no refusal
        run_dir.claim({"warmup": 2})
        assert run_dir.read_fingerprint() == {"warmup": 2}
        (run_dir.path / "growth.jsonl").write_text("{}\n")  # anything else a run writes
        with pytest.raises(RunDirError, match="holds another run"):
            run_dir.check_fingerprint({"warmup": 1})
        discard_unstarted(run_dir.path)
        assert (run_dir.path / "growth.jsonl").exists()  # more than bookkeeping: kept
        (run_dir.path / "growth.jsonl").unlink()
        discard_unstarted(run_dir.path)
        assert (run_dir.path / "run.json").exists()  # its lock is held: kept
    finally:
        run_dir.close()
    discard_unstarted(run_dir.path)
    assert not run_dir.path.exists()


def test_unreadable_run_json_is_one_line(tmp_path):
    (tmp_path / "run.json").write_text("{oops")
    with pytest.raises(RunDirError, match="run.json: unreadable .* --restart-stream"):
        RunDirectory.for_reading(tmp_path).check_fingerprint({"a": 1})
