"""A real single-node Slurm cluster (munged, slurmctld, slurmd) in a temp dir, for tests.

Follows the recipe in /work/shared/slurm-local.md (Slurm 22.05, Debian 12): everything lives in
one temp dir, nothing goes to /etc or /run, and every client command only needs ``SLURM_CONF``.
The settings that make tests fast and safe come from its pitfalls: munged runs as root with
``--force`` (temp dirs are 0700), ``cred_expire=5`` (a requeued job restarts after ~6 s, not
124 s), ``sched_interval=1``/``batch_sched_delay=0`` (jobs start in ~1 s), ``DefMemPerCPU`` (jobs
do not each claim all memory), ``config_overrides`` with 8 CPUs (array tasks run side by side on
a 2-core machine), ``kill_invalid_depend``, a deadline on every wait, and a teardown that cancels
jobs and waits for an empty queue before stopping slurmd, slurmctld and munged one by one.

Ports are chosen free at start, so two clusters (two test sessions) can share a machine.

    with slurm_cluster() as cluster:
        subprocess.run(["sbatch", ...], env=cluster.env)

or, in a test module, ``from slurm_cluster import slurm  # noqa: F401`` (a module-scoped fixture).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import pytest

T = TypeVar("T")
_CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
_DAEMONS = ("munged", "slurmctld", "slurmd")
INSTALL_HINT = "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client"


def find_command(name: str) -> str | None:
    """``name`` on PATH or in the sbin folders (daemons live there; PATH may lack them)."""
    found = shutil.which(name)
    if found:
        return found
    for folder in ("/usr/sbin", "/usr/local/sbin", "/sbin"):
        candidate = Path(folder) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def slurm_missing_reason() -> str | None:
    """Why no cluster can be started here, or None when Slurm and munge are installed."""
    missing = [name for name in (*_DAEMONS, *_CLIENTS) if find_command(name) is None]
    if missing:
        return f"Slurm is not installed (missing {', '.join(missing)}); {INSTALL_HINT}"
    return None


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports that are free now (all probes held open together)."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


class SlurmCluster:
    """A running cluster: ``env`` for client commands, helpers that wait with deadlines."""

    def __init__(self, root: Path, cpus: int) -> None:
        self.root = root
        self.cpus = cpus
        self.conf = root / "slurm.conf"
        self.host = socket.gethostname().split(".")[0]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        self.env: dict[str, str] = {**env, "SLURM_CONF": str(self.conf)}
        self._daemons: list[subprocess.Popen] = []

    # -- client helpers -------------------------------------------------------------------
    def run(
        self, *command: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """Run a client command against this cluster; raise with its stderr when it fails."""
        done = subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr}")
        return done

    def wait_until(self, check: Callable[[], T], timeout: float, what: str) -> T:
        """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            result = check()
            if result:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout} s\n{self.log_tail()}")
            time.sleep(0.2)

    def queued_job_ids(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%A").stdout.split()

    def wait_queue_empty(self, timeout: float = 60) -> None:
        self.wait_until(lambda: not self.queued_job_ids(), timeout, "empty queue")

    def job_info(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` as a dict (kept MinJobAge=300 s after the job ends)."""
        line = self.run("scontrol", "show", "job", "-o", job_id).stdout.strip().splitlines()[0]
        info = {}
        for field in line.split():
            key, _, value = field.partition("=")
            info[key] = value
        return info

    def log_tail(self, lines: int = 15) -> str:
        parts = []
        for log in sorted((self.root / "log").glob("*")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(parts)

    # -- lifecycle ------------------------------------------------------------------------
    def _spawn(self, command: list[str], log_name: str) -> subprocess.Popen:
        log = open(self.root / "log" / log_name, "w")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        self._daemons.append(process)
        return process

    def _write_conf(self) -> None:
        root, host = self.root, self.host
        ctld_port, slurmd_port = _free_ports(2)
        self.conf.write_text(
            f"""ClusterName=alma-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.sock,cred_expire=5
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
SlurmdParameters=config_overrides
ReturnToService=2
DependencyParameters=kill_invalid_depend
SchedulerParameters=batch_sched_delay=0,sched_interval=1
MinJobAge=300
KillWait=5
InactiveLimit=0
NodeName={host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={1000 * self.cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def start(self) -> None:
        for sub in ("state", "spool", "log", "munge/key"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge" / "key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        (self.root / "munge" / "key").chmod(0o700)
        key.chmod(0o400)
        munge = self.root / "munge"
        self._spawn(
            [find_command("munged"), "--force", "--foreground",
             f"--socket={munge}/munge.sock", f"--key-file={key}",
             f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
             f"--seed-file={munge}/munged.seed"],
            "munged.out",
        )
        self.wait_until(lambda: (munge / "munge.sock").exists(), 10, "munged socket")
        self._write_conf()
        self._spawn([find_command("slurmctld"), "-D", "-f", str(self.conf)], "slurmctld.out")
        self._spawn([find_command("slurmd"), "-D", "-f", str(self.conf)], "slurmd.out")

        def node_idle() -> bool:
            for daemon in self._daemons:
                if daemon.poll() is not None:
                    raise RuntimeError(f"{daemon.args[0]} exited\n{self.log_tail()}")
            try:
                out = self.run("sinfo", "-h", "-N", "-o", "%t", check=False, timeout=5).stdout
            except subprocess.TimeoutExpired:
                return False
            return out.strip() == "idle"

        self.wait_until(node_idle, 30, "node idle")

    def stop(self) -> None:
        """Cancel every job, wait for an empty queue, then stop slurmd, slurmctld, munged."""
        try:
            if len(self._daemons) == 3 and all(d.poll() is None for d in self._daemons):
                job_ids = self.queued_job_ids()
                if job_ids:
                    self.run("scancel", "--full", "--signal=KILL", *job_ids, check=False)
                self.wait_queue_empty(timeout=30)
        finally:
            for daemon in reversed(self._daemons):  # slurmd, slurmctld, munged
                if daemon.poll() is None:
                    daemon.terminate()
                    try:
                        daemon.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        daemon.kill()
                        daemon.wait(timeout=5)
            self._daemons.clear()


@contextmanager
def slurm_cluster(cpus: int = 8) -> Iterator[SlurmCluster]:
    """Start a cluster in a fresh temp dir, yield it, tear it down and remove the dir."""
    reason = slurm_missing_reason()
    if reason is not None:
        raise RuntimeError(reason)
    root = Path(tempfile.mkdtemp(prefix="alma-slurm-"))
    cluster = SlurmCluster(root, cpus)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    """One cluster for the whole test module; skips (only) when Slurm is not installed."""
    reason = slurm_missing_reason()
    if reason is not None:
        pytest.skip(reason)
    with slurm_cluster() as cluster:
        yield cluster
