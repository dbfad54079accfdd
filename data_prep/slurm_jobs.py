"""``alma-data-prep ... --slurm-shards N``: the same preparation as three Slurm jobs.

1. ``prepare``: the command with ``--num-shards N --prepare-only`` (extraction, tokenizer);
2. ``shards``: an array of N tasks, task K the command with ``--num-shards N --shard-index K``
   (each encodes one byte range of the extracted text; they run side by side);
3. ``merge``: the command with ``--num-shards N`` (joins the shards' ids in corpus order, then
   split, dictionary, binaries and manifest as always),

each submitted with ``--dependency=afterok`` on the one before. Sharding changes where the
encoding runs, never the bytes: the merge's outputs equal a single-process run's (tested on a
local Slurm cluster). The scripts (``DIR/slurm/*.sbatch``, readable, re-submittable by hand)
run this Python with ``-m data_prep.cli`` in the directory the command was given in; the
resources come from a profile in ``slurm/profiles`` (as for ``alma-sweep``).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from fairseq_alma.sweeps.resource_profile import load_profile
from fairseq_alma.sweeps.slurm_commands import run_slurm
from fairseq_alma.sweeps.train_script import check_sbatch_path

SLURM_FLAGS = {"--slurm-shards": True, "--profile": True, "--dry-run": False}  # takes a value?


def strip_slurm_flags(argv: list[str], option_strings: list[str]) -> list[str]:
    """``argv`` without the Slurm flags (and their values), however argparse accepted them:
    ``--flag value``, ``--flag=value`` or an unambiguous abbreviation."""
    kept, skip = [], False
    for position, token in enumerate(argv):
        if skip:
            skip = False
            continue
        if token == "--":  # only INPUTs follow
            return kept + argv[position:]
        name, has_value = token.split("=", 1)[0], "=" in token
        if token.startswith("--"):
            matches = [o for o in option_strings if o.startswith(name)]
            resolved = name if name in option_strings else (
                matches[0] if len(matches) == 1 else name)
            if resolved in SLURM_FLAGS:
                skip = SLURM_FLAGS[resolved] and not has_value
                continue
        kept.append(token)
    return kept


def _script(name: str, command: str, options: list[str], env: dict[str, str]) -> str:
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    return ("#!/bin/bash\n"
            f"# alma-data-prep --slurm-shards: the {name} job (see data_prep/slurm_jobs.py)\n"
            + "".join(f"#SBATCH {option}\n" for option in options)
            + "set -euo pipefail\n" + exports + f"exec {command}\n")


def submit_jobs(argv: list[str], option_strings: list[str], out: str, shards: int,
                profile_name: str, dry_run: bool) -> None:
    """Write and submit the three jobs; ``option_strings`` are every flag alma-data-prep
    knows (so the Slurm flags can be told from the values of other flags in ``argv``)."""
    profile = load_profile(profile_name)
    base = [sys.executable, "-m", "data_prep.cli",
            *strip_slurm_flags(argv, option_strings), "--num-shards", str(shards)]
    out_dir, cwd = Path(out).resolve(), Path.cwd()
    check_sbatch_path(out_dir, "--out")
    check_sbatch_path(cwd, "the current directory")
    logs = out_dir / "slurm" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # the profile's early-warning signal is for training, which saves and requeues on it: data
    # prep has no handler, so USR1's default action killed the job 60 s before its time limit
    # with nothing in its log; without it Slurm's own limit stops the job and says so, and the
    # same command continues from the steps done
    options = [o for o in profile.sbatch_options() if not o.startswith("--signal=")]
    common = [f"--chdir={cwd}", "--kill-on-invalid-dep=yes", *options]
    jobs = [
        ("prepare", shlex.join([*base, "--prepare-only"]), [f"--output={logs}/prepare-%j.out"]),
        ("shards", shlex.join([*base, "--shard-index"]) + ' "$SLURM_ARRAY_TASK_ID"',
         [f"--array=0-{shards - 1}", f"--output={logs}/shard-%A_%a.out"]),
        ("merge", shlex.join(base), [f"--output={logs}/merge-%j.out"]),
    ]
    job_ids: list[str] = []
    for name, command, options in jobs:
        path = out_dir / "slurm" / f"{name}.sbatch"
        text = _script(name, command, [f"--job-name=alma-prep-{name}", *options, *common],
                       profile.env)
        path.write_text(text, encoding="utf-8")
        submit = ["sbatch", "--parsable"]
        if job_ids:
            submit.append(f"--dependency=afterok:{job_ids[-1]}")
        submit.append(str(path))
        if dry_run:
            print(shlex.join(submit))
            job_ids.append(f"<{name}>")
            continue
        job_ids.append(run_slurm(submit).strip().split(";")[0])
    if dry_run:
        print(f"dry run: job scripts in {out_dir / 'slurm'}; nothing submitted")
        return
    print(f"submitted: prepare job {job_ids[0]}, shards array {job_ids[1]} ({shards} tasks), "
          f"merge job {job_ids[2]}; logs in {logs}; when job {job_ids[2]} has finished, "
          f"{os.path.relpath(out_dir)} holds the stream (alma-data-prep --verify checks it)")
