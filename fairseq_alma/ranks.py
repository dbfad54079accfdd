"""What every data-parallel rank of a training process must agree on.

Each rank runs the same code on its own: a signal reaches each one separately (Slurm signals
every task), maybe between two different updates, and only rank 0 takes the run directory's
lock and writes its files.  Whenever the ranks' paths could part (one stops, the others train on
and wait forever in the next all-reduce; rank 0 is refused the directory, the others train
alone), they decide together with a one-element all-reduce.  Outside torch.distributed (one
process) each function just answers for that process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import AlmaError, RunDirError


def world() -> tuple[int, int]:
    """(data-parallel world size, this rank); (1, 0) outside torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _all_reduce_max(value: float) -> float:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    flag = torch.tensor([value], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return float(flag.item())


def any_rank(flag: bool) -> bool:
    """True on every rank when it is True on any (one all-reduce; the flag alone on one rank):
    ``--wait auto``'s decisions, which every rank makes from its own evaluation, agree."""
    if world()[0] == 1:
        return flag
    return _all_reduce_max(1.0 if flag else 0.0) > 0


def all_ranks_stop(requested: bool) -> bool:
    """True on every rank, after the same update, once any rank has ``requested`` a stop.

    Asked after every update, so a signal is acted on at the next update boundary, inside
    Slurm's grace period.  With several ranks it costs one one-element all-reduce per update
    (reading it back synchronises a GPU, as fairseq's own per-update logging already does)."""
    return any_rank(requested)


def raise_unless_all_ok(error: AlmaError | None) -> None:
    """Raise ``error`` on the rank that had it, and a one-line pointer to it on the others."""
    failed = error is not None
    if world()[0] > 1:
        failed = _all_reduce_max(1.0 if failed else 0.0) > 0
    if error is not None:
        raise error
    if failed:
        raise RunDirError("another rank could not set up the run directory (its error, on "
                          "rank 0's output, says why); nothing was trained")
