"""Planning ``alma-sweep score``: which scoring tasks a sweep has, and which of them are due.

A sweep of G grid points x S seeds has G x S runs to score one by one and, with S >= 2, G
ensembles (Ens, paper §4.1: the runs that differ only by their seed, their probabilities averaged
at scoring time). A run trained with ``--stage-init scratch`` and no ``--replay`` is also a
growing ensemble (gEns, paper §4.1: its stage checkpoints are the members), scored once more with
``--mode gens``: its single-model series alone would hide the number the paper reports for it.  Each is one independent ``alma-score`` call, so together they are one Slurm
job array; this module decides what goes in it, and never Slurm-specific details (see
score_script.py).

Why a finished check: scoring a stream that stopped half way would print perplexities for
arrivals it never reached (alma-score refuses it, but only once the task runs).  Here a run is
scored only when its ``stream.jsonl`` holds arrivals 0..B for its data's B and every trained
stage's checkpoint is on disk; every other run, and every ensemble waiting for one, is skipped
with the reason.

Why signatures: a task is done when its outputs carry the signature of what it scored: the
size and modification time of every member's ``run.json``, ``stream.jsonl`` and
``checkpoint_stage*.pt``, the mode and alma-score's options.  Retraining a run, or scoring with
other options, makes its tasks due again; otherwise ``alma-sweep score`` run twice submits
nothing the second time.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import DataError, UsageError
from ..report.seeds import SEED_KEYS, canonical, without_keys
from ..stream.eval_batching import batch_size_problem
from ..stream.manifest import load_manifest
from ..stream.run_view import RunView
from .train_records import read_json

PLAN_FILE = "score_jobs.json"  # the scoring tasks and every submission of them
SCRIPT_FILE = "score.sbatch"
SCORES_DIR = "scores"  # SWEEP_DIR/scores/TASK/: one directory of outputs per task
OUTPUTS = ("score.json", "score.csv", "score.txt")  # alma-score --json, --csv, its table
SCORED_FILE = "scored.json"  # written last by a task that succeeded: what it scored


@dataclass(frozen=True)
class ScoreTask:
    """One array task: ``alma-score`` of one run (single) or of one seed group (ens)."""

    index: int
    name: str
    mode: str  # "single", "ens" or "gens"
    runs: tuple[str, ...]  # run names (jobs.json), in seed order
    run_dirs: tuple[str, ...]
    out_dir: Path
    signature: str
    argv: tuple[str, ...]  # alma-score's arguments, without --json/--csv (the task adds them)

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "mode": self.mode,
                "runs": list(self.runs), "run_dirs": list(self.run_dirs),
                "out_dir": str(self.out_dir), "signature": self.signature,
                "argv": list(self.argv)}


@dataclass(frozen=True)
class Skipped:
    """A run or ensemble that is not scored now, and why (printed one line each)."""

    name: str
    reason: str


def unfinished_reason(job: Mapping[str, Any]) -> str | None:
    """Why the run of ``job`` (a jobs.json entry) cannot be scored yet; None when it can (the
    rule every reader of a run directory uses: ``stream/run_view.py``)."""
    view = RunView(job["run_dir"])
    if not view.stream_log.is_file():
        return f"{view.stream_log} does not exist (not trained yet)"
    try:
        if view.metric == "error":
            return "a vision stream (test_error): alma-score scores language models; use alma-report"
        data = str(job["argv"][0]).split(os.pathsep)[0]  # fairseq-train's DATA, made absolute
        try:
            megabatches = int(load_manifest(data)["num_megabatches"])
        except DataError as err:
            return f"cannot tell whether the stream is complete: {err}"
        reason = view.unfinished_reason(megabatches)
        if reason is not None:
            return reason
        view.trained_checkpoints()
    except UsageError as err:
        return str(err)
    return None


def grows_ensemble(job: Mapping[str, Any]) -> bool:
    """True for a run whose stages form a gEns (``--stage-init scratch``, no ``--replay``), read
    from its run.json, the settings it really trained with (alma-score checks the same)."""
    fingerprint = RunView(job["run_dir"]).fingerprint or {}
    task = (fingerprint.get("config") or {}).get("task") or {}
    return task.get("stage_init") == "scratch" and not task.get("replay")


GENS_SUFFIX = ".gens"  # a gEns task's name: the run's name plus this


def input_signature(run_dirs: Sequence[str], mode: str, options: Sequence[str]) -> str:
    """A short hash of what a task scores (module doc): changes when a member is retrained."""
    files = []
    for run_dir in run_dirs:
        for file in RunView(run_dir).signature_files():
            try:
                stat = file.stat()
            except FileNotFoundError:
                continue
            files.append([str(file), stat.st_size, stat.st_mtime_ns])
    text = json.dumps({"mode": mode, "options": list(options), "files": files}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _seed_groups(jobs: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """Jobs that differ only by seed (same grid point), in sweep order; each group by seed."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for job in jobs:
        groups.setdefault(canonical(job["overrides"]), []).append(job)
    return [sorted(group, key=lambda job: job["seed"]) for group in groups.values()]


def ensemble_name(members: Sequence[Mapping[str, Any]]) -> str:
    """``lr0.001.seed1`` + ``lr0.001.seed2`` -> ``lr0.001.ens-seeds1-2``: the members' name
    with the seed part replaced (a digest of the names when it cannot be, e.g. a long name)."""
    seeds = "-".join(str(job["seed"]) for job in members)
    prefixes = {job["name"].removesuffix(f"seed{job['seed']}") for job in members}
    if len(prefixes) == 1 and all(job["name"].endswith(f"seed{job['seed']}") for job in members):
        return f"{prefixes.pop()}ens-seeds{seeds}"
    digest = hashlib.sha1(" ".join(job["name"] for job in members).encode()).hexdigest()[:8]
    return f"ens-seeds{seeds}-{digest}"


def _fingerprint_mismatch(members: Sequence[Mapping[str, Any]]) -> str | None:
    """Members of a seed group must agree on run.json's fingerprint once seeds are removed (the
    way alma-report groups seeds); names the first two that do not."""
    keys = []
    for job in members:
        fingerprint = RunView(job["run_dir"]).fingerprint
        keys.append(None if fingerprint is None else canonical(without_keys(fingerprint,
                                                                            SEED_KEYS)))
    for job, key in zip(members[1:], keys[1:]):
        if None not in (key, keys[0]) and key != keys[0]:
            return (f"{job['name']} and {members[0]['name']} differ in more than the seed "
                    f"(their run.json); score them apart")
    return None


def plan_scoring(
    sweep_dir: Path, jobs: Sequence[Mapping[str, Any]], options: Sequence[str]
) -> tuple[list[ScoreTask], list[Skipped]]:
    """Every task the sweep's finished runs allow: one single-model task per run, one gEns task
    per finished run that grows an ensemble, then one Ens task per group of >= 2 seeds whose
    members have all finished; and what is skipped, why."""
    unfinished = {job["name"]: unfinished_reason(job) for job in jobs}
    skipped = [Skipped(name, why) for name, why in unfinished.items() if why is not None]
    batch_size = options[options.index("--batch-size") + 1] if "--batch-size" in options else None
    for job in jobs:  # what each task's alma-score would refuse, refused before any task queues
        if unfinished[job["name"]] is None:
            view = RunView(job["run_dir"])
            view.require_trusted_records()
            problem = batch_size_problem((view.fingerprint or {}).get("config") or {}, batch_size,
                                         view.path)
            if problem is not None:
                raise UsageError(problem)
    wanted: list[tuple[str, str, list[Mapping[str, Any]]]] = [
        (job["name"], "single", [job]) for job in jobs if unfinished[job["name"]] is None]
    wanted += [(job["name"] + GENS_SUFFIX, "gens", [job]) for job in jobs
               if unfinished[job["name"]] is None and grows_ensemble(job)]
    for members in _seed_groups(jobs):
        if len({job["seed"] for job in members}) < 2:
            continue
        name = ensemble_name(members)
        waiting = [job["name"] for job in members if unfinished[job["name"]] is not None]
        why = (f"waits for {', '.join(waiting)} (not finished)" if waiting
               else _fingerprint_mismatch(members))
        if why is not None:
            skipped.append(Skipped(name, why))
        else:
            wanted.append((name, "ens", members))
    tasks = []
    for index, (name, mode, members) in enumerate(wanted):
        run_dirs = tuple(str(job["run_dir"]) for job in members)
        argv = (*run_dirs, "--mode", mode, *options)
        tasks.append(ScoreTask(index, name, mode, tuple(job["name"] for job in members),
                               run_dirs, sweep_dir / SCORES_DIR / name,
                               input_signature(run_dirs, mode, options), argv))
    names = [task.name for task in tasks]
    if len(set(names)) != len(names):  # cannot happen with alma-sweep's run names
        raise UsageError(f"{sweep_dir}: two scoring tasks would share an output directory "
                         f"({', '.join(sorted(n for n in names if names.count(n) > 1))})")
    return tasks, skipped


def scored_signature(out_dir: Path) -> str | None:
    """The signature a finished task left in ``out_dir`` (None: never scored, or unreadable)."""
    try:
        record = json.loads((out_dir / SCORED_FILE).read_text("utf-8"))
    except (OSError, ValueError):
        return None
    if not all((out_dir / name).is_file() for name in OUTPUTS) or not isinstance(record, dict):
        return None
    return record.get("signature")


def task_state(task: ScoreTask | Mapping[str, Any]) -> str:
    """``scored`` (outputs of these very inputs), ``stale`` (scored, but a member or the options
    changed since) or ``not scored``; the queue is the caller's business."""
    data = task.to_json() if isinstance(task, ScoreTask) else task
    found = scored_signature(Path(data["out_dir"]))
    if found is None:
        return "not scored"
    options = list(data["argv"])[list(data["argv"]).index("--mode") + 2:]
    current = input_signature(data["run_dirs"], data["mode"], options)
    return "scored" if found == current == data["signature"] else "stale"


def load_plan(sweep_dir: Path) -> dict[str, Any] | None:
    """``SWEEP_DIR/score_jobs.json`` (None before the first ``alma-sweep score``)."""
    path = sweep_dir / PLAN_FILE
    return read_json(path, "scoring plan") if path.exists() else None
