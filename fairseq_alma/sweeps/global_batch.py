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


def _spelling(argv: list[str], spellings: tuple[str, ...]) -> str | None:
    """The one of ``spellings`` (an option and its aliases) that ``argv`` uses."""
    return next((flag for flag in spellings if flag in argv), None)


def _set(argv: list[str], flag: str, value: int) -> list[str]:
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = str(value)
    else:
        argv += [flag, str(value)]
    return argv


def apply_global_batch(jobs: list[SweepJob], global_batch: int | None, workers: int,
                       source: str) -> list[SweepJob]:
    """Every job's argv with the --batch-size / --update-freq that reach ``global_batch``.

    The batch may be set under any spelling of fairseq-train's --batch-size (``max-sentences``
    is its alias): the one the config uses is the one changed, or the config's value would
    win over the one set here (the check of the config refuses two spellings of one flag).
    """
    if global_batch is None:
        return jobs
    from .fairseq_train_flags import option_spellings  # fairseq's parser: only with global_batch

    batch_spellings = option_spellings("batch-size")
    out = []
    for job in jobs:
        flag = _spelling(job.argv, batch_spellings)
        if flag is None:
            raise UsageError(f"{source}: global_batch counts sequences: set batch-size (the most "
                             f"sequences one GPU holds), not max-tokens")
        batch, update_freq = per_step_layout(global_batch, workers,
                                             int(job.argv[job.argv.index(flag) + 1]))
        argv = _set(_set(job.argv, flag, batch), "--update-freq", update_freq)
        out.append(SweepJob(job.index, job.name, job.overrides, job.seed, job.run_dir, argv))
    return out
