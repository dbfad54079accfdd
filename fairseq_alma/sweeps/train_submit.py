"""``alma-sweep submit``: from a request to a planned job array, and submitting it.

Four steps, so the caller can say what happens between them: ``load_sweep_config`` (the config
with the request's grid and seeds, cheap), ``sweep_profile`` (cheap: a bad profile is refused
before the slow step), ``check_config_flags`` (``run_config.py``: imports fairseq, seconds; with
the profile also each grid point's values, ``point_values.py``) and
``plan_submission`` (program, jobs, the sbatch script). Nothing
is written before ``submit_links``, which submits only the runs that are not done: running it
again on the same directory resumes each unfinished run from its checkpoint.
"""

from __future__ import annotations

import re
import shlex
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import ClusterError, UsageError
from ..out_paths import check_dir_path
from ..stream.atomic import atomic_write_json, atomic_write_text
from ..stream.run_view import RunView
from .global_batch import apply_global_batch
from .held_runs import held_runs, holds_trained_run
from .resource_profile import ResourceProfile, check_warning_before_limit, resolve_profile
from .run_config import RunConfig, load_run_config
from .slurm_commands import require_queue, run_slurm
from .train_plan import SweepJob, parse_grid_option, parse_seeds_option, plan_sweep
from .train_records import load_jobs, load_submissions, record_submission, run_status
from .train_script import (
    array_spec,
    check_max_parallel,
    check_sbatch_path,
    render_sweep_script,
    sbatch_command,
)
from .undo_writes import UndoWrites


@dataclass(frozen=True)
class SubmitRequest:
    """What ``alma-sweep submit`` was asked, as given (``grid``: ``FLAG=V1,V2`` texts)."""

    config: str
    sweep_dir: Path
    grid: tuple[str, ...] = ()
    seeds: str | None = None
    profile: str | None = None
    max_parallel: int | None = None
    chain_stages: int = 1
    stages_per_link: int | None = None
    program: str = "fairseq-train"


@dataclass(frozen=True)
class Link:
    """One job of a chain: ``link`` of ``links``; ``stop_after_stage`` None runs to the end."""

    link: int
    stop_after_stage: int | None


@dataclass(frozen=True)
class TrainSubmission:
    """A planned sweep: its jobs, the array script and the chain of jobs per run."""

    sweep_dir: Path
    config: RunConfig
    profile: ResourceProfile
    program: list[str]
    jobs: list[SweepJob]
    script: str
    links: list[Link]
    max_parallel: int

    @property
    def script_path(self) -> Path:
        return self.sweep_dir / "sweep.sbatch"


@dataclass(frozen=True)
class Submitted:
    """One sbatch call that succeeded."""

    job_id: str
    array: str
    link: Link
    links: int


def load_sweep_config(request: SubmitRequest) -> RunConfig:
    """The request's config with its ``--grid`` and ``--seeds``; flags not yet checked."""
    check_sbatch_path(request.sweep_dir, "--sweep-dir")
    check_dir_path(request.sweep_dir, "--sweep-dir")
    check_max_parallel(request.max_parallel)
    if request.chain_stages < 1:
        raise UsageError("--chain-stages must be >= 1")
    if request.stages_per_link is not None and request.stages_per_link < 1:
        raise UsageError(f"--stages-per-link {request.stages_per_link}: N must be >= 1 (each "
                         "job of a chain trains N more stages)")
    if request.chain_stages > 1 and request.stages_per_link is None:
        raise UsageError(
            f"--chain-stages {request.chain_stages} needs --stages-per-link N "
            "(each job trains N more stages; the last one runs to the end)"
        )
    if request.stages_per_link is not None and request.chain_stages == 1:
        raise UsageError("--stages-per-link N needs --chain-stages K > 1")
    grid: dict[str, list] = {}
    for text in request.grid:
        flag, values = parse_grid_option(text)
        if flag in grid:
            raise UsageError(f"--grid {flag} given twice; list all its values in one --grid")
        grid[flag] = values
    config = load_run_config(request.config, check_flags=False).with_grid(grid)
    if request.seeds is not None:  # --seeds= (empty) is refused, not the config's seeds
        config = config.with_seeds(parse_seeds_option(request.seeds))
    return config


def check_chain_length(request: SubmitRequest, stages: list[tuple[dict, int | None]]) -> None:
    """Refuse a chain with links that can never train anything: link k of K starts after stage
    (k-1) x N, so when every run trains at most S stages, the links after the ceil(S / N)-th
    would start, find every stream trained and exit (a queue slot and a job each).  ``stages``:
    each grid point with the stages its runs train (``run_config.check_config_flags``); nothing
    is refused when a point's is not known here (None: a vision grid, data not there yet).
    A link idle for some runs only (a grid over --wait) is not refused: the longer runs need it.
    """
    links, per_link = request.chain_stages, request.stages_per_link
    if links == 1 or per_link is None or not stages or any(n is None for _, n in stages):
        return
    point, most = max(stages, key=lambda item: item[1] or 0)
    assert most is not None
    if (links - 1) * per_link < most:
        return
    useful = -(-most // per_link)
    runs = "its runs train" if len(stages) == 1 else \
        "its longest runs (grid point " + ", ".join(f"{k}={v}" for k, v in point.items()) + \
        ") train"
    idle = f"link {links}" if useful + 1 == links else f"links {useful + 1}-{links}"
    advice = (f"use --chain-stages {useful}" if useful > 1 else
              "leave out --chain-stages (one job trains it all), or use a smaller "
              "--stages-per-link")
    raise UsageError(f"--chain-stages {links} --stages-per-link {per_link}: {runs} {most} "
                     f"stage(s), so {idle} of each chain would find nothing left to train; "
                     f"{advice}")


def resolve_program(text: str) -> list[str]:
    """``--program`` as absolute tokens: a bare name is looked up next to this Python first (the
    venv's console scripts), then on PATH, so jobs run the same installation as alma-sweep."""
    tokens = shlex.split(text)
    if not tokens:
        raise UsageError("--program is empty; give a command such as fairseq-train")
    head = tokens[0]
    if "/" in head:
        found = Path(head).resolve() if Path(head).exists() else None
    else:
        beside = Path(sys.executable).parent / head
        found = beside if beside.exists() else (Path(p) if (p := shutil.which(head)) else None)
    if found is None:
        raise UsageError(f"--program: '{head}' not found next to {sys.executable} nor on PATH")
    return [str(found)] + tokens[1:]


def sweep_profile(request: SubmitRequest, config: RunConfig) -> ResourceProfile:
    """The resource profile the jobs get (``--profile``, else the config's ``resources``):
    resolved before fairseq is imported to check the flags, so a bad profile is refused at
    once."""
    profile = resolve_profile(request.profile, config.resources, config.path)
    check_warning_before_limit(profile)
    return profile


def plan_submission(request: SubmitRequest, config: RunConfig,
                    profile: ResourceProfile) -> TrainSubmission:
    """Program, jobs (with the global batch laid out) and the array script."""
    sweep_dir = request.sweep_dir
    program = resolve_program(request.program)
    jobs = apply_global_batch(plan_sweep(config, sweep_dir), config.global_batch,
                              profile.world_size, str(config.path))
    max_parallel = request.max_parallel or len(jobs)
    job_name = "alma-" + re.sub(r"[^A-Za-z0-9._-]", "_", sweep_dir.name)
    script = render_sweep_script(
        jobs, profile, program=program, sweep_dir=sweep_dir, workdir=Path.cwd(),
        job_name=job_name, max_parallel=max_parallel, source=str(config.path),
    )
    links = [
        Link(link, link * request.stages_per_link if link < request.chain_stages else None)
        for link in range(1, request.chain_stages + 1)
    ]
    return TrainSubmission(sweep_dir, config, profile, program, jobs, script, links,
                           max_parallel)


def missing_data(plan: TrainSubmission) -> Path | None:
    """The first data directory of the config that its runs read and that does not exist here
    (``submit`` refuses it; ``--dry-run`` says which checks it could therefore not make)."""
    for part in plan.config.data.split(":") if any(map(reads_data, plan.jobs)) else ():
        if not Path(part).exists():
            return Path(part).resolve()
    return None


def runs_to_submit(plan: TrainSubmission) -> list[int]:
    """Indices of the runs not done; refuses missing data, another sweep in the same directory,
    runs of this one still in the queue (or a queue that cannot be asked), and a run directory
    that holds another run (``held_runs.py``).  A run is done when its Slurm events say
    ``completed`` and, where it keeps a ``run.json``, its records say it finished."""
    sweep_dir, config, jobs = plan.sweep_dir, plan.config, plan.jobs
    missing = missing_data(plan)
    if missing is not None:
        raise UsageError(f"{config.path}: data directory {missing} not found")
    if (sweep_dir / "jobs.json").exists():
        old = load_jobs(sweep_dir)
        # Same runs = same names and flags; the program may change (a fixed wrapper, say).
        if [(j["name"], j["argv"]) for j in old["jobs"]] != [(j.name, j.argv) for j in jobs]:
            raise UsageError(
                f"{sweep_dir} holds a different sweep (its jobs.json has other runs or flags); "
                "use a new --sweep-dir, or delete the old one"
            )
        submitted_jobs = {str(s["job_id"]) for s in load_submissions(sweep_dir)}
        queued = require_queue(
            submitted_jobs, f"whether runs of {sweep_dir} are still queued or running is unknown "
            "(submitting now could queue them twice)", "retry alma-sweep submit when squeue "
            "answers") if submitted_jobs else {}
        if queued:
            raise UsageError(
                f"{sweep_dir} still has {len(queued)} run(s) queued or running; "
                "wait (alma-sweep status) or alma-sweep cancel first"
            )
    trained = [job for job in jobs if holds_trained_run(job.run_dir)]
    for job in trained:  # a finished run on another layout is another run's too
        check_world_size(job, plan.profile)
    finished = held_runs(trained, plan.profile, sweep_dir)
    submitted = bool(load_submissions(sweep_dir)) if sweep_dir.exists() else False
    todo = [job.index for job in jobs
            if run_status(job.to_json(), submitted, {}).state != "done"
            or not finished.get(job.index, True)]
    for index in todo:
        check_world_size(jobs[index], plan.profile)
    return todo


def reads_data(job: SweepJob) -> bool:
    """Whether ``job``'s training reads the config's ``data``: every run but a vision stream on
    the embedded digits, whose DATA is the word fairseq-train needs and nothing more
    (``fairseq_glue/vision_entry.vision_run``: --dry-run and fairseq-train accept any word)."""
    given = dict(zip(job.argv, job.argv[1:]))
    return not (given.get("--arch") == "alma_vision" and given.get("--vision-dataset") == "digits")


def check_world_size(job: SweepJob, profile: ResourceProfile) -> None:
    """Refuse to resume a run on another number of processes: its task would refuse it
    (``run.json``'s fingerprint holds the world size), but only after queueing, with advice
    (another --save-dir, --restart-stream) that alma-sweep does not take."""
    view = RunView(job.run_dir)
    if not (view.stream_log.is_file() or view.last_checkpoint.is_file()
            or view.stage_checkpoints()):
        return  # nothing trained there yet: any profile may start it
    fingerprint = view.fingerprint or {}
    trained = ((fingerprint.get("config") or {}).get("distributed_training") or {}).get(
        "distributed_world_size")
    if isinstance(trained, int) and trained != profile.world_size:
        raise UsageError(
            f"{job.run_dir} trained on {trained} process(es) (its run.json) and profile "
            f"{profile.name} runs {profile.world_size}: a run continues on as many processes "
            f"as it started on; resubmit with a profile of {trained} process(es) per run, or "
            f"use a new --sweep-dir")


def submit_links(plan: TrainSubmission, todo: list[int]) -> Iterator[Submitted]:
    """Write jobs.json and the script, then submit the chain for the runs ``todo``; yields each
    job as Slurm accepts it (a later sbatch may still fail).  When the first sbatch fails the
    sweep directory is left as it was (``UndoWrites``), so the corrected command is not taken
    for another sweep."""
    sweep_dir, profile = plan.sweep_dir, plan.profile
    table = {
        "config": str(plan.config.path),
        "sources": [str(p) for p in plan.config.sources],
        "program": plan.program,
        "profile": profile.name,
        # the profile itself: alma-sweep score's default (a name alone finds slurm/profiles/)
        "profile_source": profile.source,
        "profile_settings": profile.settings(),
        "sbatch_options": profile.sbatch_options(),
        "jobs": [job.to_json() for job in plan.jobs],
    }
    logs = sweep_dir / "logs"
    undo = UndoWrites([sweep_dir / "jobs.json", plan.script_path], [logs])
    logs.mkdir(parents=True, exist_ok=True)
    atomic_write_json(sweep_dir / "jobs.json", table)
    atomic_write_text(plan.script_path, plan.script)
    plan.script_path.chmod(0o755)  # a script, executable as before (atomic writes follow the umask)
    array = array_spec(todo, plan.max_parallel)
    previous = None
    for link in plan.links:
        command = sbatch_command(plan.script_path, array, previous, link.stop_after_stage)
        try:
            job_id = run_slurm(command).strip().split(";")[0]
        except ClusterError:
            if previous is None:  # nothing was submitted: nothing of this call is kept
                undo.undo()
            raise
        record_submission(sweep_dir, {"job_id": job_id, "array": array, "link": link.link,
                                      "links": len(plan.links),
                                      "stop_after_stage": link.stop_after_stage,
                                      "after": previous, "command": command})
        yield Submitted(job_id, array, link, len(plan.links))
        previous = job_id
