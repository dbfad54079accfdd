"""Run configs: one YAML file describes one experiment of the paper and the runs it expands to.

A run config (issue 5, train_configs/) is::

    include: base.yaml            # optional; merged first, this file wins
    description: SM_w1 base, 8 experts (paper §5, Table 2)
    data: data-bin/wikitext       # fairseq-train's positional DATA (relative to the cwd)
    args: {moe-experts: 8, lr: 0.0005, fp16: true}   # fairseq-train flags, no leading dashes
    grid: {wait: [1, 3, 4]}       # each combination is one run
    seeds: [1, 2, 3]              # ... times each seed
    resources: gpu-node-8         # a profile in slurm/profiles/, or an inline mapping
    global_batch: 192             # optional: sequences per update on any profile (global_batch.py)

Booleans become bare flags (``true``) or are left out (``false``); ``null`` removes a flag set by
an included config. Flags the launcher owns (seed, save dir, distributed wiring) are refused so a
config cannot silently disagree with the sweep that runs it.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Union

from ..errors import AlmaError, UsageError
from ..fairseq_glue.user_dir import PLUGIN_DIR
from .fairseq_train_flags import argv_flag_problem
from .resource_profile import ResourceProfile
from .yaml_files import load_with_includes, read_yaml_mapping

Scalar = Union[str, int, float, bool, None]

TOP_LEVEL_KEYS = ("include", "description", "data", "args", "grid", "seeds", "resources",
                  "global_batch")

# Flags a config may not set, with the reason shown to the user.
LAUNCHER_FLAGS = {
    "seed": "list seeds under seeds: (or pass alma-sweep --seeds)",
    "save-dir": "alma-sweep gives every run its own directory",
    "user-dir": "the launcher always passes --user-dir for fairseq_alma",
    "distributed-world-size": "slurm/launch_task.sh sets it from the Slurm allocation",
    "distributed-rank": "slurm/launch_task.sh sets it from SLURM_PROCID",
    "device-id": "slurm/launch_task.sh sets it from SLURM_LOCALID",
    "distributed-init-method": "slurm/launch_task.sh sets it from the job's first node",
    "distributed-no-spawn": "slurm/launch_task.sh starts one process per task",
    "distributed-port": "slurm/launch_task.sh derives the port from the job id",
    "cpu": "the resource profile decides (a profile without GPUs adds --cpu)",
    "restart-stream": "a sweep trains each of its run directories once and resubmits only "
                      "the unfinished ones; use a new --sweep-dir for a fresh sweep (or "
                      "fairseq-train --restart-stream on one run by hand)",
}

# a flag named in a training check's message (``--wait 5 ...``), to find the file that sets it
_FLAG = re.compile(r"--([a-z0-9][a-z0-9-]*)")


def flag_argv(flag: str, value: Scalar) -> list[str]:
    """fairseq-train tokens of one entry: ``true`` -> bare flag, ``false``/``null`` -> nothing."""
    if value is None or value is False:
        return []
    if value is True:
        return [f"--{flag}"]
    return [f"--{flag}", str(value)]


@dataclass(frozen=True)
class RunConfig:
    """A validated run config; ``sources`` lists the files merged into it, base first."""

    path: Path
    data: str
    args: dict[str, Scalar]
    grid: dict[str, list[Scalar]] = field(default_factory=dict)
    seeds: tuple[int, ...] = (1,)
    description: str = ""
    resources: str | dict[str, Any] | None = None
    sources: tuple[Path, ...] = ()
    global_batch: int | None = None  # sequences per update (global_batch.py)
    command_line_grid: tuple[str, ...] = ()  # grid flags given with --grid (with_grid)
    command_line_seeds: bool = False  # seeds given with --seeds (with_seeds)

    def grid_points(self) -> list[dict[str, Scalar]]:
        """Every combination of grid values, first grid key varying slowest (config order)."""
        keys = list(self.grid)
        return [dict(zip(keys, values)) for values in itertools.product(*self.grid.values())]

    def covering_points(self) -> list[dict[str, Scalar]]:
        """As few grid points as hold every value of every grid flag at least once: point i
        takes value i mod n of each flag of n values, so there are as many as the longest
        flag has values, and each is a point of the grid. Checking these catches a bad value
        of any one flag without checking every combination."""
        longest = max((len(values) for values in self.grid.values()), default=1)
        return [{flag: values[i % len(values)] for flag, values in self.grid.items()}
                for i in range(longest)]

    def to_argv(
        self, overrides: Mapping[str, Scalar], seed: int, save_dir: str | Path
    ) -> list[str]:
        """fairseq-train's argv (without the program name) for one run of this config.

        ``overrides`` (a grid point) replace ``args`` entries in place; new flags follow them.
        """
        merged: dict[str, Scalar] = dict(self.args)
        merged.update(overrides)
        argv = [self.data, "--user-dir", str(PLUGIN_DIR)]
        for flag, value in merged.items():
            argv += flag_argv(flag, value)
        return argv + ["--seed", str(seed), "--save-dir", str(save_dir)]

    def with_grid(self, grid: Mapping[str, list[Scalar]]) -> "RunConfig":
        """A copy whose grid has ``grid``'s entries (a flag already in the grid is replaced)."""
        merged = dict(self.grid)
        for flag, values in grid.items():
            _check_flag_name(flag, "--grid")
            _check_grid_values(flag, values, "--grid")
            merged[flag] = list(values)
        given = tuple(dict.fromkeys((*self.command_line_grid, *grid)))
        return replace(self, grid=merged, command_line_grid=given)

    def with_seeds(self, seeds: list[int]) -> "RunConfig":
        """A copy with ``seeds`` instead of the config's seeds."""
        return replace(self, seeds=_check_seeds(seeds, "--seeds"), command_line_seeds=True)

    def flag_origin(self, flag: str) -> Path:
        """The file that sets ``flag`` (the last of the include chain that mentions it);
        ``seed`` comes from a file's ``seeds:``."""
        origin = self.path
        for source in self.sources:
            data = read_yaml_mapping(source, "run config")
            if flag == "seed" and "seeds" in data:
                origin = source
            elif flag in (data.get("args") or {}) or flag in (data.get("grid") or {}):
                origin = source
        return origin


def _check_flag_name(flag: Any, where: str) -> None:
    if not isinstance(flag, str) or not flag:
        raise UsageError(f"{where}: flag names must be non-empty strings, got {flag!r}")
    if flag.startswith("-"):
        raise UsageError(
            f"{where}: write '{flag.lstrip('-')}', not '{flag}' (flags have no leading dashes)"
        )
    if flag in LAUNCHER_FLAGS:
        raise UsageError(f"{where}: '{flag}' cannot be set here: {LAUNCHER_FLAGS[flag]}")


def _check_scalar(flag: str, value: Any, where: str) -> None:
    if value is not None and not isinstance(value, (str, int, float, bool)):
        raise UsageError(
            f"{where}: '{flag}' must be a single value (string, number, true/false), "
            f"got {type(value).__name__}; put alternatives under grid:"
        )


def _grid_value_key(value: Scalar) -> tuple[str, Any]:
    """What fairseq-train sees of a grid value: 0.1 and 0.10, 4 and 4.0, and the text 1e-3 (YAML
    keeps it text; --grid reads '0.001' as text) and the number 0.001 are one value to it."""
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        try:
            number = float(str(value))
        except ValueError:
            return ("text", value)
    return ("number", number) if number == number else ("text", "nan")  # nan != nan


def _check_grid_values(flag: str, values: Any, where: str) -> None:
    if not isinstance(values, list) or not values:
        raise UsageError(f"{where}: grid '{flag}' must be a non-empty list of values")
    seen: dict[tuple[str, Any], Scalar] = {}
    for value in values:
        _check_scalar(flag, value, where)
        if value is None:
            raise UsageError(f"{where}: grid '{flag}' has an empty (null) value; remove it")
        # one value twice would be two points training one run twice (two tasks on one run
        # directory, or two directories of the same run)
        key = _grid_value_key(value)
        if key in seen:
            first = seen[key]
            if str(first) == str(value):
                raise UsageError(f"{where}: grid '{flag}' lists the value {value!r} twice; list "
                                 f"each value once")
            raise UsageError(f"{where}: grid '{flag}' lists {first} and {value}, the same value "
                             f"to fairseq-train (two points would train one run twice); list it "
                             f"once")
        seen[key] = value


def _check_seeds(seeds: Any, where: str) -> tuple[int, ...]:
    if not isinstance(seeds, list) or not seeds:
        raise UsageError(f"{where}: seeds must be a non-empty list of integers")
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise UsageError(f"{where}: seed {seed!r} is not a non-negative integer")
    if len(set(seeds)) != len(seeds):
        raise UsageError(f"{where}: seeds {seeds} repeat a value; list each seed once")
    return tuple(seeds)


def parse_run_config(merged: dict[str, Any], path: Path, sources: tuple[Path, ...]) -> RunConfig:
    """Type-check a merged config mapping (see the module docstring for its shape)."""
    where = str(path)
    description = merged.get("description", "")
    if not isinstance(description, str):
        raise UsageError(f"{where}: description: must be text")
    data = merged.get("data")
    if not isinstance(data, str) or not data.strip():
        raise UsageError(f"{where}: data: is required (fairseq-train's DATA directory)")
    args = merged.get("args") or {}
    if not isinstance(args, dict):
        raise UsageError(f"{where}: args: must be a mapping of flag: value")
    for flag, value in args.items():
        _check_flag_name(flag, f"{where}: args")
        _check_scalar(flag, value, f"{where}: args")
    raw_grid = merged.get("grid") or {}
    if not isinstance(raw_grid, dict):
        raise UsageError(f"{where}: grid: must be a mapping of flag: [values]")
    grid = {flag: values for flag, values in raw_grid.items() if values is not None}
    for flag, values in grid.items():
        _check_flag_name(flag, f"{where}: grid")
        _check_grid_values(flag, values, f"{where}: grid")
    seeds = _check_seeds(merged.get("seeds", [1]), f"{where}: seeds")
    resources = merged.get("resources")
    if resources is not None and not isinstance(resources, (str, dict)):
        raise UsageError(f"{where}: resources: must be a profile name or an inline mapping")
    global_batch = merged.get("global_batch")
    if global_batch is not None:
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
            raise UsageError(f"{where}: global_batch: must be a number of sequences >= 1")
        for flag in ("update-freq", "max-tokens"):
            if args.get(flag) is not None or flag in grid:
                raise UsageError(f"{where}: global_batch sets {flag.replace('max-tokens', 'the batch')} "
                                 f"for every profile; remove '{flag}' (batch-size is the most "
                                 f"sequences one GPU holds)")
    return RunConfig(
        path=path,
        data=data,
        args=dict(args),
        grid=grid,
        seeds=seeds,
        description=description,
        resources=resources,
        sources=sources,
        global_batch=global_batch,
    )


def load_run_config(path: str | Path, check_flags: bool = True) -> RunConfig:
    """Load, merge and validate a run config.

    With ``check_flags`` every grid point is parsed by the real fairseq-train parser (with the
    fairseq_alma plugin loaded), so a misspelt flag fails here, at submit time, and not hours
    later on the cluster.
    """
    path = Path(path).resolve()
    merged, sources = load_with_includes(path, TOP_LEVEL_KEYS, "run config")
    config = parse_run_config(merged, path, sources)
    if check_flags:
        check_config_flags(config)
    return config


def refused_flags(config: RunConfig) -> dict[str, str]:
    """Flags ``config`` may not set, with the reason, checked against every spelling of a flag
    (``fairseq_train_flags``: ``local_rank`` is ``device-id``)."""
    refused = dict(LAUNCHER_FLAGS)
    if config.global_batch is not None:
        for flag in ("update-freq", "max-tokens"):
            refused[flag] = (f"global_batch: {config.global_batch} sets "
                             f"{flag.replace('max-tokens', 'the batch')} for every profile "
                             f"(batch-size is the most sequences one GPU holds)")
    return refused


def check_config_flags(config: RunConfig,
                       profile: ResourceProfile | None = None) -> list[tuple[dict, int | None]]:
    """Parse every grid point of ``config`` with fairseq-train's parser (fairseq_train_flags.py);
    raise ``UsageError`` naming the file (and grid point) that sets the flag at fault.

    With the ``profile`` the runs train on (``alma-sweep submit``), also check every point's
    values as its array task would before training (point_values.py): raise that check's own
    error, naming the file (and grid point) that sets the flag it names.  Without a profile the
    values are not checked: the processes of a run and its device (``--cpu``) come from it.
    A vision grid's values are checked on its ``covering_points`` only: each point costs about
    a second (point_values.py) and such grids run to hundreds of points.  The values are those
    of the largest seed: seeds are checked >= 0 when read, so it is the one out of range if any.

    Returns each checked point with the stages its runs train (None when not known here: no
    profile, a vision stream, or data not there yet), for the chain check of ``alma-sweep
    submit``.
    """
    if profile is not None:
        from .point_values import check_run_values  # imports fairseq's training code
    covering = config.covering_points()
    refused = refused_flags(config)
    stages: list[tuple[dict, int | None]] = []
    for point in config.grid_points():
        argv = config.to_argv(point, max(config.seeds), "alma-sweep-flag-check")
        flags = {**config.args, **point}
        problem = argv_flag_problem(argv, flags, refused)
        if problem is not None:
            raise UsageError(f"{_origin(config, problem.flag, point)}: {problem.message}")
        if profile is None or (flags.get("arch") == "alma_vision" and point not in covering):
            continue
        try:
            stages.append((point, check_run_values(argv, profile)))
        except AlmaError as err:
            names = _FLAG.findall(str(err))
            flag = next((name for name in names if name in flags),
                        "seed" if "seed" in names else None)
            raise type(err)(f"{_origin(config, flag, point)}: {err}") from None
    return stages


def _origin(config: RunConfig, flag: str | None, point: dict) -> str:
    """Where ``flag`` was set: the command line's ``--grid FLAG`` (not a file that also
    mentions it), or the file of the include chain that sets it; with the grid point."""
    if flag == "seed" and config.command_line_seeds:
        where = "--seeds"
    else:
        where = f"--grid {flag}" if flag in config.command_line_grid else \
            str(config.flag_origin(flag) if flag else config.path)
    if not point:
        return where
    shown = ", ".join(f"{k}={v}" for k, v in point.items())
    return f"{where} (grid point {shown})"
