"""Expanding a run config into a sweep: grid points x seeds -> jobs with stable run directories.

Each job of an ``alma-sweep`` array is one run (one learner on one stream, paper §3) with its own
directory, named from what makes it different (``wait3.moe-experts8.seed2``), so a directory
listing reads like the paper's tables and re-running the same sweep finds the same directories
again (that is how finished runs are skipped and interrupted ones resume).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .run_config import RunConfig, Scalar
from .yaml_files import parse_yaml_scalar

_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")
_MAX_NAME = 180


@dataclass(frozen=True)
class SweepJob:
    """One array task: a grid point and a seed, run in ``run_dir`` with ``argv``."""

    index: int
    name: str
    overrides: dict[str, Scalar]
    seed: int
    run_dir: Path
    argv: list[str]

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "overrides": self.overrides,
            "seed": self.seed,
            "run_dir": str(self.run_dir),
            "argv": self.argv,
        }


def _name_part(flag: str, value: Scalar) -> str:
    if value is True:
        return flag
    if value is False:
        return f"no-{flag}"
    return f"{flag}{value}"


def run_dir_name(overrides: dict[str, Scalar], seed: int) -> str:
    """``{flag}{value}`` for each grid flag, then ``seed{N}``, joined by dots, filesystem-safe."""
    parts = [_name_part(flag, value) for flag, value in overrides.items()] + [f"seed{seed}"]
    name = ".".join(_UNSAFE.sub("_", part).strip("._") or "_" for part in parts)
    if len(name) > _MAX_NAME:
        name = f"{name[:_MAX_NAME]}-{_digest(overrides, seed)}"
    return name


def _digest(overrides: dict[str, Scalar], seed: int) -> str:
    text = json.dumps([overrides, seed], sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def parse_grid_option(text: str) -> tuple[str, list[Scalar]]:
    """``--grid flag=v1,v2`` -> (flag, [v1, v2]); values read as config values (3, 1e-3, true)."""
    flag, sep, values_text = text.partition("=")
    flag = flag.strip()
    if not sep or not flag or not values_text.strip():
        raise UsageError(f"--grid '{text}': write --grid FLAG=VALUE1,VALUE2 (e.g. wait=1,3)")
    values: list[Scalar] = []
    items = values_text.split(",")
    if len(items) > 1 and any(_split_inside(item) for item in items):
        raise UsageError(f"--grid '{text}': --grid splits values at every comma, so a value "
                         f"holding one cannot be given here; list the values under grid: in "
                         f"the config file (quoted: {flag}: ['(0.9, 0.98)', ...])")
    for item in items:
        value = parse_yaml_scalar(item.strip()) if item.strip() else None
        if value is None or isinstance(value, (list, dict)):
            raise UsageError(f"--grid '{text}': value '{item}' is not a single value")
        values.append(value)
    return flag, values


def _split_inside(item: str) -> bool:
    """Whether a comma-split piece of a --grid value is half of a value holding a comma: an
    unclosed bracket or quote, ``(0.9`` of ``(0.9, 0.98)``."""
    pairs = ("()", "[]", "{}")
    return any(item.count(a) != item.count(b) for a, b in pairs) or \
        item.count("'") % 2 == 1 or item.count('"') % 2 == 1


def parse_seeds_option(text: str) -> list[int]:
    """``--seeds 1,2,3`` -> [1, 2, 3]."""
    try:
        return [int(item) for item in text.split(",")]
    except ValueError:
        raise UsageError(f"--seeds '{text}': write integers separated by commas (1,2,3)") from None


def plan_sweep(config: RunConfig, sweep_dir: Path) -> list[SweepJob]:
    """All jobs of ``config`` (grid points, then seeds, in order), run dirs under ``sweep_dir``.

    Two grid points whose names sanitise to the same text (``a/b`` and ``a_b``) get a short
    digest of their exact values appended, so run directories never collide.
    """
    sweep_dir = sweep_dir.resolve()
    data = ":".join(str(Path(part).resolve()) for part in config.data.split(":"))
    absolute = replace(config, data=data)
    pairs = [(point, seed) for point in config.grid_points() for seed in config.seeds]
    names = [run_dir_name(point, seed) for point, seed in pairs]
    taken: dict[str, int] = {}
    for name in names:
        taken[name] = taken.get(name, 0) + 1
    jobs = []
    for index, ((point, seed), name) in enumerate(zip(pairs, names)):
        if taken[name] > 1:
            name = f"{name}-{_digest(point, seed)}"
        run_dir = sweep_dir / name
        argv = absolute.to_argv(point, seed, run_dir)
        jobs.append(SweepJob(index, name, dict(point), seed, run_dir, argv))
    return jobs
