"""Planning ALMA runs on Slurm (issue 5): run configs, resource profiles, the training and
scoring job arrays of a sweep, their records, and the Slurm commands and queue queries.

The console entry ``alma-sweep`` (``cli/sweep.py``) turns its arguments into typed requests
(``train_submit.SubmitRequest``, ``score_submit.ScoreArrayRequest``) and prints what these modules
return (``sweep_text.py``). ``train_*`` modules are about training runs, ``score_*`` about
scoring them. Importing this package does not import fairseq; only flag checking
(``load_run_config`` with ``check_flags=True``, ``check_config_flags``) does, lazily. User
mistakes raise ``fairseq_alma.errors.UsageError``.
"""

from .resource_profile import ResourceProfile, load_profile, resolve_profile
from .run_config import RunConfig, load_run_config
from .train_plan import SweepJob, parse_grid_option, parse_seeds_option, plan_sweep, run_dir_name

__all__ = [
    "ResourceProfile",
    "RunConfig",
    "SweepJob",
    "load_profile",
    "load_run_config",
    "parse_grid_option",
    "parse_seeds_option",
    "plan_sweep",
    "resolve_profile",
    "run_dir_name",
]
