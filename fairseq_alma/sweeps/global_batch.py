"""The paper's global batch as an invariant of a sweep: sequences per update, whatever the GPUs.

The paper's language models train on 192 sequences of 512 tokens per update (App. B.2: eight
GPUs x 8 sequences x 3 accumulated batches).  A config that hard-codes ``update-freq`` silently
doubles the batch on 16 GPUs and divides it by 8 on one.  A config that states
``global_batch: 192`` instead gets, for every run, the ``--batch-size`` (at most the config's
``batch-size``: the most sequences one GPU holds) and ``--update-freq`` that reach exactly 192
on the resource profile's processes; a layout that cannot is refused with one line.
"""

from __future__ import annotations

from ..errors import UsageError
from .train_plan import SweepJob


def per_step_layout(global_batch: int, workers: int, max_batch: int) -> tuple[int, int]:
    """(batch per process, update-freq) with batch x update-freq x workers == global_batch and
    the largest batch <= ``max_batch`` (fewest accumulation steps)."""
    if global_batch % workers:
        raise UsageError(f"global_batch {global_batch} cannot be split over {workers} processes "
                         f"(not a divisor): use a profile whose GPUs per run divide {global_batch}")
    share = global_batch // workers
    for batch in range(min(max_batch, share), 0, -1):
        if share % batch == 0:
            return batch, share // batch
    raise UsageError(f"global_batch {global_batch}: batch-size must be >= 1")  # max_batch < 1


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _set(argv: list[str], flag: str, value: int) -> list[str]:
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = str(value)
    else:
        argv += [flag, str(value)]
    return argv


def apply_global_batch(jobs: list[SweepJob], global_batch: int | None, workers: int,
                       source: str) -> list[SweepJob]:
    """Every job's argv with the --batch-size / --update-freq that reach ``global_batch``."""
    if global_batch is None:
        return jobs
    out = []
    for job in jobs:
        given = _value(job.argv, "--batch-size")
        if given is None:
            raise UsageError(f"{source}: global_batch counts sequences: set batch-size (the most "
                             f"sequences one GPU holds), not max-tokens")
        batch, update_freq = per_step_layout(global_batch, workers, int(given))
        argv = _set(_set(job.argv, "--batch-size", batch), "--update-freq", update_freq)
        out.append(SweepJob(job.index, job.name, job.overrides, job.seed, job.run_dir, argv))
    return out
