"""Run configs, resource profiles and sweep planning for launching ALMA runs on Slurm (issue 5).

Importing this package does not import fairseq; only flag checking (``load_run_config`` with
``check_flags=True``) does, lazily. User mistakes raise ``fairseq_alma.errors.UsageError``.
"""

from .profile import ResourceProfile, load_profile, resolve_profile
from .run_config import RunConfig, load_run_config
from .sweep_plan import SweepJob, parse_grid_option, parse_seeds_option, plan_sweep, run_dir_name

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
