"""``ScoreRequest``: the settings of one scoring, checked once when the request is made.

Why checked here: ``alma-score`` and ``alma-sweep score`` (which checks its tasks' options before
it writes anything) must refuse the same flag combinations with the same line, before any run
is loaded.  The order of the checks is the order a user meets them in; keep it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import UsageError

MODES = ("single", "ens", "gens")


@dataclass(frozen=True)
class ScoreRequest:
    """What to score (``run_dirs``: run directories, a sweep directory already expanded) and
    how; every field is an alma-score flag of the same name (``flags.py``)."""

    run_dirs: tuple[str, ...]
    mode: str = "single"  # single: a series per run; ens: the runs are members; gens: one run
    data: str | None = None  # stream directory to score on (default: each run's)
    subset: str | None = None  # split (default: the run's --eval-subset)
    from_log: bool = False  # reuse the logged metric instead of evaluating
    batch_size: int | None = None
    tokens_per_sample: int | None = None
    max_eval_tokens: int | None = None  # score the split's first whole blocks only
    fp16: bool = False
    matrix: bool = False  # also every stage on every period's split (single mode)
    setting: str | None = None  # series name in the table
    cpu: bool = False
    trust_checkpoint: bool = False  # unpickle checkpoints fully
    distributed_backend: str | None = None  # gloo or nccl under torchrun/srun

    def __post_init__(self) -> None:
        """Refuse flag combinations with one line (``UsageError``) naming the flag to drop."""
        if self.mode not in MODES:  # alma-score's parser refuses it first; a library caller here
            raise UsageError(f"--mode {self.mode}: choose one of {', '.join(MODES)}")
        for flag in ("batch_size", "tokens_per_sample", "max_eval_tokens"):
            if getattr(self, flag) is not None and getattr(self, flag) < 1:
                raise UsageError(f"--{flag.replace('_', '-')} must be >= 1 "
                                 f"(got {getattr(self, flag)})")
        if len({os.path.realpath(d) for d in self.run_dirs}) != len(self.run_dirs):
            raise UsageError("a RUN_DIR is given twice; pass each run once")
        if self.from_log:
            if self.mode != "single":
                raise UsageError(f"--from-log works with --mode single only: --mode {self.mode} "
                                 f"averages the members' token probabilities, which needs "
                                 f"evaluation")
            # --data too: the logged metric is of the run's own stream, whatever --data says
            given = [f for f in ("data", "batch_size", "tokens_per_sample", "subset",
                                 "max_eval_tokens", "fp16") if getattr(self, f)]
            if given:
                raise UsageError(f"--from-log reuses the run's own evaluation; drop "
                                 f"--{given[0].replace('_', '-')} or --from-log")
        if self.matrix and (self.mode != "single" or self.from_log):
            raise UsageError(f"--matrix scores single models on every period; it does not "
                             f"combine with "
                             f"{'--from-log' if self.from_log else f'--mode {self.mode}'}: "
                             f"score each run with --mode single --matrix")
        if self.mode == "gens" and len(self.run_dirs) != 1:
            raise UsageError(f"--mode gens takes ONE run dir (its stages are the members), got "
                             f"{len(self.run_dirs)}")
        if self.mode == "ens" and len(self.run_dirs) < 2:
            raise UsageError("--mode ens needs at least 2 run dirs (the members)")
