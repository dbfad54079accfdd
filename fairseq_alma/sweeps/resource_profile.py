"""Resource profiles: what one run asks Slurm for, kept apart from what the run computes.

A run config says *what* to train (paper values); a profile in ``slurm/profiles/NAME.yaml`` says
*where*: nodes, GPUs per node, CPUs, memory, time limit, partition... and how long before the time
limit Slurm warns the job (SIGUSR1) so the trainer can save and the job can requeue itself
(issue 5: preemption). Nothing cluster-specific lives in Python; a new cluster is a new profile.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .yaml_files import read_yaml_mapping

# The repository's slurm/ folder (scripts and profiles), next to the fairseq_alma package.
SLURM_DIR = Path(__file__).resolve().parents[2] / "slurm"
PROFILES_DIR = SLURM_DIR / "profiles"

_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
_MEM = re.compile(r"^\d+[KMGT]?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class ResourceProfile:
    """One Slurm resource request; see slurm/profiles/*.yaml for documented examples."""

    name: str
    description: str = ""
    nodes: int = 1
    gpus_per_node: int = 0
    ntasks_per_node: int | None = None  # CPU profiles only; on GPUs it is one task per GPU
    cpus_per_task: int = 1
    mem: str | None = None  # per node, Slurm syntax (64G); None = the cluster's default
    time: str = "01:00:00"
    partition: str | None = None
    constraint: str | None = None
    account: str | None = None
    signal_seconds: int = 120  # SIGUSR1 this long before the time limit
    save_grace_seconds: int = 90  # how long the job waits for the trainer to save
    extra_sbatch: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    # where it was read (a file's resolved path, or ``CONFIG: resources``): not a setting
    source: str = field(default="", compare=False)

    @property
    def device(self) -> str:
        """``gpu`` (NCCL, one task per GPU) or ``cpu`` (gloo, --cpu)."""
        return "gpu" if self.gpus_per_node > 0 else "cpu"

    @property
    def tasks_per_node(self) -> int:
        """Processes per node: one per GPU, or ``ntasks_per_node`` on CPU nodes."""
        if self.gpus_per_node > 0:
            return self.gpus_per_node
        return self.ntasks_per_node or 1

    @property
    def world_size(self) -> int:
        """Total number of training processes of one run."""
        return self.nodes * self.tasks_per_node

    def sbatch_options(self) -> list[str]:
        """The ``#SBATCH`` options (without the prefix) this profile asks for."""
        options = [
            f"--nodes={self.nodes}",
            f"--ntasks-per-node={self.tasks_per_node}",
            f"--cpus-per-task={self.cpus_per_task}",
            f"--time={self.time}",
        ]
        if self.gpus_per_node:
            options.append(f"--gpus-per-node={self.gpus_per_node}")
        for option, value in (
            ("mem", self.mem),
            ("partition", self.partition),
            ("constraint", self.constraint),
            ("account", self.account),
        ):
            if value is not None:
                options.append(f"--{option}={value}")
        options.append(f"--signal=B:USR1@{self.signal_seconds}")
        return options + list(self.extra_sbatch)

    def settings(self) -> dict[str, Any]:
        """The profile as the keys of its YAML file: what ``jobs.json`` keeps, so
        ``alma-sweep score`` reloads the very profile a sweep trained with (``parse_profile``),
        not whatever file of that name is found later."""
        values = {f.name: getattr(self, f.name) for f in fields(self)
                  if f.name not in _NOT_SETTINGS}
        return {**values, "extra_sbatch": list(self.extra_sbatch), "env": dict(self.env)}

    def time_limit_seconds(self) -> int:
        """``time`` in seconds (Slurm's forms: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS)."""
        return slurm_time_seconds(self.time)


# ResourceProfile fields that are not keys of a profile file
_NOT_SETTINGS = ("name", "source")


def slurm_time_seconds(text: str) -> int:
    """Seconds of a Slurm time limit in a form ``_TIME`` accepts (sbatch(1), --time)."""
    days, _, rest = text.rpartition("-")
    parts = [int(part) for part in rest.split(":")]
    if days:  # D-HH, D-HH:MM, D-HH:MM:SS
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:  # HH:MM:SS
        hours, minutes, seconds = parts
    else:  # MM, MM:SS
        hours, minutes, seconds = 0, parts[0], (parts[1] if len(parts) == 2 else 0)
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def check_warning_before_limit(profile: ResourceProfile) -> None:
    """Refuse a profile whose early warning (``signal_seconds``) is not before its time limit:
    Slurm would send SIGUSR1 as soon as each job starts, so every attempt saves and requeues
    again (a loop that makes no progress on a long run)."""
    limit = profile.time_limit_seconds()
    if 0 < limit <= profile.signal_seconds:  # time 0 is Slurm's "no limit"
        raise UsageError(
            f"{profile.source or profile.name}: signal_seconds ({profile.signal_seconds}) must be "
            f"smaller than the time limit (time '{profile.time}' = {limit} s): Slurm would warn "
            f"each job as it starts and it would requeue over and over; lower signal_seconds "
            f"or raise time")


def _positive_int(where: str, key: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_profile(data: dict[str, Any], name: str, where: str) -> ResourceProfile:
    """Validate a profile mapping (from a file or a config's inline ``resources:``)."""
    allowed = {f.name for f in fields(ResourceProfile)} - set(_NOT_SETTINGS)
    for key in data:
        if key not in allowed:
            raise UsageError(
                f"{where}: unknown profile key '{key}' (allowed: {', '.join(sorted(allowed))})"
            )
    values = dict(data)
    for key in ("nodes", "cpus_per_task", "signal_seconds", "save_grace_seconds"):
        if key in values:
            _positive_int(where, key, values[key])
    if "gpus_per_node" in values:
        _positive_int(where, "gpus_per_node", values["gpus_per_node"], minimum=0)
    if values.get("ntasks_per_node") is not None:
        _positive_int(where, "ntasks_per_node", values["ntasks_per_node"])
        if values.get("gpus_per_node"):
            raise UsageError(
                f"{where}: ntasks_per_node is for CPU profiles; GPU runs use one task per GPU"
            )
    for key in ("description", "mem", "time", "partition", "constraint", "account"):
        if values.get(key) is not None and not isinstance(values[key], str):
            raise UsageError(f"{where}: {key} must be text (quote it), got {values[key]!r}")
    if "time" in values and not _TIME.match(values["time"]):
        raise UsageError(f"{where}: time '{values['time']}' is not Slurm syntax (HH:MM:SS)")
    if values.get("mem") is not None and not _MEM.match(values["mem"]):
        raise UsageError(f"{where}: mem '{values['mem']}' is not Slurm syntax (e.g. 64G)")
    extra = values.get("extra_sbatch") or []
    if not isinstance(extra, list) or not all(
        isinstance(line, str) and line.startswith("--") and "\n" not in line for line in extra
    ):
        raise UsageError(f"{where}: extra_sbatch must be a list of sbatch options like --qos=high")
    values["extra_sbatch"] = tuple(extra)
    env = values.get("env") or {}
    if not isinstance(env, dict) or not all(_ENV_NAME.match(str(k)) for k in env):
        raise UsageError(f"{where}: env must map variable names to values")
    values["env"] = {str(k): str(v) for k, v in env.items()}
    profile = ResourceProfile(name=name, source=where, **values)
    if profile.save_grace_seconds >= profile.signal_seconds:
        raise UsageError(
            f"{where}: save_grace_seconds ({profile.save_grace_seconds}) must be smaller than "
            f"signal_seconds ({profile.signal_seconds}) so the job requeues before its time limit"
        )
    return profile


def check_required_keys(data: dict[str, Any], where: str) -> None:
    """A profile must say how long a job may run (``time``) and where its processes run
    (``gpus_per_node``, or ``ntasks_per_node`` on CPU nodes): a default would silently give a
    GPU sweep CPU jobs, or every run a one-hour limit."""
    missing = [key for key in ("time",) if data.get(key) is None]
    if data.get("gpus_per_node") is None and data.get("ntasks_per_node") is None:
        missing.append("gpus_per_node or ntasks_per_node")
    if missing:
        raise UsageError(f"{where}: missing {', and '.join(missing)}; set them as in "
                         f"{PROFILES_DIR / 'local-cpu.yaml'}")


def profile_path(name_or_path: str) -> Path:
    """``gpu-node-8`` -> slurm/profiles/gpu-node-8.yaml; a path (with / or .yaml) stays as is."""
    if "/" in name_or_path or name_or_path.endswith((".yaml", ".yml")):
        return Path(name_or_path)
    return PROFILES_DIR / f"{name_or_path}.yaml"


def load_profile(name_or_path: str | Path) -> ResourceProfile:
    """Load a profile by name (from slurm/profiles/) or by path."""
    path = profile_path(str(name_or_path))
    if not path.is_file():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
        raise UsageError(
            f"resource profile {path} not found (profiles in {PROFILES_DIR}: {', '.join(known)})"
        )
    data = read_yaml_mapping(path, "resource profile")
    check_required_keys(data, str(path))
    return replace(parse_profile(data, path.stem, str(path)), source=str(path.resolve()))


def resolve_profile(
    cli_profile: str | None, resources: str | dict[str, Any] | None, config_path: Path
) -> ResourceProfile:
    """The profile of a sweep: ``--profile`` wins over the config's ``resources:``."""
    if cli_profile is not None:
        return load_profile(cli_profile)
    if isinstance(resources, str):
        return load_profile(resources)
    if isinstance(resources, dict):
        check_required_keys(resources, f"{config_path}: resources")
        return parse_profile(resources, "inline", f"{config_path}: resources")
    raise UsageError(
        f"{config_path}: no resources: set 'resources: PROFILE' or pass --profile "
        f"slurm/profiles/NAME.yaml"
    )
