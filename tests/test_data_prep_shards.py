"""``alma-data-prep`` in shards: by hand and as Slurm jobs, byte-identical to one process.

The sharded run and the single-process run of the same command must write the same bytes: every
output file (dict.txt, spm.*, every .bin/.idx) and the manifest except the fields that say how
and when it ran (EXCLUDED).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from slurm_cluster import slurm  # noqa: F401  (module-scoped cluster fixture)

from data_prep.slurm_jobs import strip_slurm_flags

ARGS = ["--vocab-size", "300", "--valid-size", "0.1", "--seed", "2", "-B", "3"]
PERIODS = ["--order", "given", "--eval-per-megabatch", "0.2"]  # 3 more splits: evalmb0..2
EXCLUDED = {"step_seconds", "created", "command"}  # how and when it ran
EXCLUDED_OPTIONS = {"num_shards", "workers", "out"}  # flags that change speed, not bytes


def run_prep(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "data_prep.cli", *args], capture_output=True,
                          text=True, timeout=300, check=False, env=env)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    words = ["river", "stone", "alma", "switch", "expert", "token", "naïve", "über", "x", "of"]
    docs = []
    for i in range(40):
        lines = [f"doc {i} opens"] + [" ".join(words[(i * 7 + j * 3 + k) % len(words)]
                                                for k in range(3 + (i + j) % 6))
                                       for j in range(1 + i % 4)]
        docs.append("\n".join(lines))
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def prep(forked_prep):
    """``alma-data-prep ARGS`` in the fork server (conftest ``forked_prep``): these runs are ~1 s
    of work after ~7 s of importing fairseq, so they skip the imports; the Slurm jobs do not."""
    return forked_prep


@pytest.fixture(scope="module")
def singles(corpus, prep, tmp_path_factory):
    """The single-process stream of ARGS, and of ARGS + each extra flag set, made on demand."""
    made: dict[tuple[str, ...], str] = {}

    def get(*extra: str) -> str:
        if extra not in made:
            out = str(tmp_path_factory.mktemp("single") / "out")
            result = prep(corpus, "--out", out, *ARGS, *extra)
            assert result.returncode == 0, result.stderr
            made[extra] = out
        return made[extra]
    return get


def outputs(out: str) -> dict[str, bytes]:
    names = sorted(f for f in os.listdir(out) if os.path.isfile(os.path.join(out, f))
                   and f.endswith((".bin", ".idx", ".txt", ".model", ".vocab")))
    return {name: open(os.path.join(out, name), "rb").read() for name in names}


def comparable_manifest(out: str) -> dict:
    with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    for field in EXCLUDED:
        del manifest[field]
    for option in EXCLUDED_OPTIONS:
        del manifest["options"][option]
    return manifest


def assert_same_stream(out: str, reference: str, splits: int = 5) -> None:
    assert outputs(out) == outputs(reference)
    assert len(outputs(out)) == 2 * splits + 3  # the splits, dict.txt, spm.model, spm.vocab
    assert comparable_manifest(out) == comparable_manifest(reference)


def _one_line_error(result: subprocess.CompletedProcess, *named: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("alma-data-prep: error: "), result.stderr
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr
    for text in named:
        assert text in lines[-1], lines[-1]


@pytest.mark.parametrize("extra, splits", [((), 5), (tuple(PERIODS), 8)])
def test_shards_run_by_hand_give_the_single_runs_bytes(corpus, singles, prep, tmp_path, extra, splits):
    out = str(tmp_path / "sharded")
    shard = [corpus, "--out", out, *ARGS, *extra, "--num-shards", "3"]
    prepared = prep(*shard, "--prepare-only")
    assert prepared.returncode == 0, prepared.stderr
    assert "encode" not in prepared.stderr  # extraction and tokenizer only
    for index, workers in (("2", "1"), ("0", "2")):
        result = prep(*shard, "--shard-index", index, "--workers", workers)
        assert result.returncode == 0, result.stderr
        assert f"encode-shard-{index}-of-3: building" in result.stderr
    again = prep(*shard, "--shard-index", "2")
    assert again.returncode == 0 and "building" not in again.stderr, again.stderr
    merged = prep(*shard)  # shard 1 was never run: the merge encodes it itself
    assert merged.returncode == 0, merged.stderr
    for index, state in (("0", "up to date, reused"), ("1", "building"),
                         ("2", "up to date, reused")):
        assert f"encode-shard-{index}-of-3: {state}" in merged.stderr
    assert_same_stream(out, singles(*extra), splits)
    # The merged stream is an ordinary one: the same command without shards reuses it all.
    plain = prep(corpus, "--out", out, *ARGS, *extra)
    assert plain.returncode == 0 and "building" not in plain.stderr, plain.stderr


def test_shard_flags_fail_with_one_line(forked_prep, corpus, tmp_path):
    out = ["--out", str(tmp_path / "o")]
    _one_line_error(forked_prep(corpus, *out, *ARGS, "--num-shards", "2", "--shard-index", "0"),
                    "--prepare-only")  # the tokenizer is not there yet
    assert not os.path.exists(tmp_path / "o" / "work" / "docs.txt")  # nothing extracted
    _one_line_error(forked_prep(corpus, *out, "--num-shards", "2", "--shard-index", "2"),
                    "--shard-index 2", "--num-shards 2")
    _one_line_error(forked_prep(corpus, *out, "--shard-index", "0", "--num-shards", "2",
                             "--prepare-only"), "--prepare-only", "--shard-index")
    _one_line_error(forked_prep(corpus, *out, "--slurm-shards", "2", "--num-shards", "2"),
                    "--num-shards")
    _one_line_error(forked_prep(corpus, *out, "--profile", "local-cpu"), "--profile",
                    "--slurm-shards")
    _one_line_error(forked_prep(corpus, *out, "--slurm-shards", "2", "--profile", "nope"),
                    "nope")
    _one_line_error(forked_prep("--from-binarized", str(tmp_path), *out, "--num-shards", "2"),
                    "--from-binarized")
    _one_line_error(forked_prep(corpus, *out, "--num-shards", "0"), "--num-shards")


def test_dry_run_writes_the_three_job_scripts(corpus, prep, tmp_path):
    out = tmp_path / "o"
    result = prep(corpus, "--out", str(out), *ARGS, "--slurm-shards", "4", "--dry-run")
    assert result.returncode == 0, result.stderr
    printed = result.stdout.splitlines()
    assert len(printed) == 4 and "nothing submitted" in printed[-1]
    assert "--dependency" not in printed[0] and "--dependency=afterok:<prepare>" in printed[1]
    assert "--dependency=afterok:<shards>" in printed[2]
    shards = (out / "slurm" / "shards.sbatch").read_text()
    assert "#SBATCH --array=0-3" in shards and '--shard-index "$SLURM_ARRAY_TASK_ID"' in shards
    merge = (out / "slurm" / "merge.sbatch").read_text().rstrip().splitlines()[-1]
    assert merge.startswith("exec ") and merge.endswith("--num-shards 4")
    assert "--slurm-shards" not in merge and "--dry-run" not in merge
    assert "--prepare-only" in (out / "slurm" / "prepare.sbatch").read_text()
    assert "--signal" not in shards  # no handler here: USR1 would kill the job before its limit
    assert not (out / "work").exists()  # nothing ran


@pytest.mark.parametrize("argv, kept", [
    (["c.txt", "--slurm-shards", "3", "--out", "o"], ["c.txt", "--out", "o"]),
    (["--slurm-shards=3", "--profile=gpu-1", "c.txt"], ["c.txt"]),
    (["--slurm", "3", "--prof", "x", "--dry", "--seed", "4"], ["--seed", "4"]),
    (["--workers", "2", "--dry-run", "--", "--slurm-shards"], ["--workers", "2", "--",
                                                               "--slurm-shards"]),
])
def test_strip_slurm_flags_removes_them_however_given(argv, kept):
    from data_prep.cli import build_parser

    options = [o for action in build_parser()._actions for o in action.option_strings]
    assert strip_slurm_flags(argv, options) == kept


@pytest.mark.slurm
@pytest.mark.parametrize("extra, splits", [((), 5), (tuple(PERIODS), 8)])
def test_slurm_shards_give_the_single_runs_bytes(slurm, corpus, singles, tmp_path,  # noqa: F811
                                                  extra, splits):
    out = tmp_path / "slurm_out"
    result = run_prep(corpus, "--out", str(out), *ARGS, *extra, "--slurm-shards", "3",
                      env=slurm.env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("submitted: prepare job ")
    slurm.wait_until(lambda: (out / "manifest.json").exists() or not slurm.queued_job_ids(),
                     240, "the merge job")
    slurm.wait_queue_empty(60)
    logs = {p.name: p.read_text() for p in (out / "slurm" / "logs").iterdir()}
    assert (out / "manifest.json").exists(), logs
    shard_logs = sorted(name for name in logs if name.startswith("shard-"))
    assert len(shard_logs) == 3, logs
    for name in shard_logs:  # each array task encoded its own shard
        assert "building" in logs[name] and "encoded" in logs[name], logs[name]
    merge = next(text for name, text in logs.items() if name.startswith("merge-"))
    assert "encode-shard-" in merge and "encode-shard-0-of-3: building" not in merge, merge
    assert_same_stream(str(out), singles(*extra), splits)

