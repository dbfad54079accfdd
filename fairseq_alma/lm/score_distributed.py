"""Data-parallel ``alma-score``: several processes share the evaluation batches of every checkpoint.

Why: scoring every stage checkpoint of every run on the paper's evaluation mega-batch (§6.2, about
440M words) is the slow part of a report; the batches are independent, so N processes on N GPUs
(or CPU cores) each score a disjoint share and add their sums.

How the work is split: every process builds the *same* batches in the same fixed order as a
single process (same ``--max-eval-tokens`` slice, same batch size), and batch i goes to rank
i % world (fairseq's ``ShardedIterator``).  Each batch is thus padded and scored exactly as in a
single process, so every token's float32 log-probability is the same, and the float64 sums are
added in the order one process adds them (``ensemble_eval.all_ranks_joint``: every rank's
per-batch float64 terms are gathered and summed in global batch order), so every number, to the
last bit, is one process's.  Every rank scores its share with every member and checkpoint and
holds the totals; only rank 0 prints and writes outputs.

Launch: ``torchrun`` sets WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.  Under
``srun`` the world is SLURM_STEP_NUM_TASKS (set by srun for its own step; SLURM_NTASKS is not
used because an sbatch script that runs alma-score as one process also has it), the rank
SLURM_PROCID and the local rank SLURM_LOCALID; MASTER_ADDR and MASTER_PORT must be exported by
the user.  The backend is gloo on CPU and nccl on CUDA unless ``--distributed-backend`` says
otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import UsageError

_TORCHRUN = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
_SLURM = ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID")
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class ScoreWorld:
    """This process's place among the scoring processes; (1, 0, 0) for a plain single run."""

    size: int = 1
    rank: int = 0
    local_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = "single"  # "torchrun", "srun" or "single"

    @property
    def is_main(self) -> bool:
        """Rank 0 alone prints and writes files (other ranks would race on the same paths)."""
        return self.rank == 0


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise UsageError(f"{name}={env[name]!r} is not an integer; launch with torchrun or "
                         f"srun, which set it") from None


def world_from_env(env: Mapping[str, str] = os.environ) -> ScoreWorld:
    """The scoring world described by torchrun's variables, else srun's, else a single process.

    A world of more than one process with an incomplete rendezvous (no MASTER_ADDR/PORT, no
    rank) is refused in one line: guessing would leave processes waiting for each other."""
    if "WORLD_SIZE" in env:
        names, launcher = _TORCHRUN, "torchrun"
    elif "SLURM_STEP_NUM_TASKS" in env:
        names, launcher = _SLURM, "srun"
    else:
        return ScoreWorld()
    size = _int(env, names[0])
    if size <= 1:
        return ScoreWorld()
    missing = [name for name in (*names[1:], *_RENDEZVOUS) if not env.get(name)]
    if missing:
        raise UsageError(f"{names[0]}={size} ({launcher}) but {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not set; launch with torchrun, "
                         f"or under srun export MASTER_ADDR and MASTER_PORT (README, alma-score)")
    rank = _int(env, names[1])
    if not 0 <= rank < size:
        raise UsageError(f"{names[1]}={rank} is outside 0..{size - 1} ({names[0]}={size})")
    return ScoreWorld(size, rank, _int(env, names[2]), env["MASTER_ADDR"],
                      _int(env, "MASTER_PORT"), launcher)


def choose_backend(use_cuda: bool, override: str | None = None) -> str:
    """nccl between GPUs, gloo between CPU processes (nccl cannot reduce CPU tensors)."""
    if override:
        if override == "nccl" and not use_cuda:
            raise UsageError("--distributed-backend nccl needs CUDA; drop it (gloo is used on CPU)")
        return override
    return "nccl" if use_cuda else "gloo"


@contextmanager
def scoring_group(world: ScoreWorld, backend: str,
                  timeout_minutes: float = 30.0) -> Iterator[None]:
    """torch.distributed set up for ``world`` (nothing for a single process), torn down after.

    On CUDA each process takes the GPU of its LOCAL_RANK before the group exists, so nccl and
    the scorer's ``cuda`` device agree."""
    if world.size == 1:
        yield
        return
    if backend == "nccl":
        torch.cuda.set_device(world.local_rank)
    dist.init_process_group(backend, init_method=f"tcp://{world.master_addr}:{world.master_port}",
                            world_size=world.size, rank=world.rank,
                            timeout=timedelta(minutes=timeout_minutes))
    try:
        yield
    finally:
        dist.destroy_process_group()


def check_same_request(settings: dict) -> None:
    """Refuse, on every rank, scoring processes given different requests (``settings``: this
    rank's, paths resolved).  Why: the ranks share the batches of what each was asked, so rank
    0 printed the slice its own flags named under numbers partly from another rank's whole
    split.  srun and torchrun give every rank one command line; a wrapper may not."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, settings)
    for rank, other in enumerate(gathered):
        if other != settings:
            key = next(k for k in sorted(set(settings) | set(other))
                       if settings.get(k) != other.get(k))
            flag = "RUN_DIRS" if key == "run_dirs" else f"--{key.replace('_', '-')}"
            raise UsageError(f"the {len(gathered)} scoring processes were given different "
                             f"requests ({flag}: {settings.get(key)!r} here, {other.get(key)!r} "
                             f"on rank {rank}); give every process the same alma-score flags")


def _reduce_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")


def all_gather_rows(rows: torch.Tensor) -> list[list[list[float]]]:
    """Every rank's ``rows`` (n_r, width) float64, as Python floats on every rank, rank by
    rank (ranks may hold different counts of rows).  ``[rows]`` outside torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [rows.tolist()]
    device = _reduce_device()
    count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=device)
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, count)
    most = int(max(c.item() for c in counts))
    padded = torch.zeros(most, rows.shape[1], dtype=torch.float64, device=device)
    padded[: rows.shape[0]] = rows.to(device)
    gathered = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(gathered, padded)
    return [g[: int(c.item())].cpu().tolist() for g, c in zip(gathered, counts)]


def rows_in_batch_order(rows: torch.Tensor) -> Iterator[list[float]]:
    """Every rank's per-batch ``rows`` (``all_gather_rows``) in global batch order: rank r's
    k-th row is batch k * N + r (fairseq's ``ShardedIterator``), so adding them in this order
    adds them as one process scoring every batch does."""
    per_rank = all_gather_rows(rows)
    for k in range(max(len(rank_rows) for rank_rows in per_rank)):
        for rank_rows in per_rank:
            if k < len(rank_rows):
                yield rank_rows[k]


def all_reduce_sums(values: Sequence[float],
                    maxima: Sequence[float] = ()) -> tuple[list[float], list[float]]:
    """``values`` summed over every rank in float64 (NLL sums; token counts are exact integers
    below 2^53) and ``maxima`` maxed (wall time: the slowest rank's); unchanged outside
    torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values), list(maxima)
    device = _reduce_device()
    sums = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    peak = torch.tensor(list(maxima) or [0.0], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return sums.tolist(), peak.tolist()[: len(maxima)]
