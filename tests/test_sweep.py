"""alma-sweep without a cluster: grid x seeds expansion, run-dir names, --dry-run, CLI errors,
and `status` from the run directories alone."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fairseq_alma.cli.sweep import main
from fairseq_alma.errors import UsageError
from fairseq_alma.stream.atomic import atomic_write_json
from fairseq_alma.stream.manifest import MANIFEST_FORMAT, expected_splits, sha256_file
from fairseq_alma.sweeps import load_run_config, parse_grid_option, plan_sweep, run_dir_name
from fairseq_alma.sweeps.train_script import LAUNCH_TASK, array_spec

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "train_configs" / "examples" / "tiny_sweep.yaml"
GRID_CONFIG = f"""\
include: {REPO}/train_configs/examples/tiny_base.yaml
data: corpus
grid:
  decoder-layers: [1, 2]
  lr: [0.001, 0.01]
seeds: [1, 2]
"""


def test_grid_times_seeds_in_order_with_stable_names(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text(GRID_CONFIG)
    jobs = plan_sweep(load_run_config(path, check_flags=False), tmp_path / "sweep")
    assert [job.name for job in jobs] == [
        "decoder-layers1.lr0.001.seed1", "decoder-layers1.lr0.001.seed2",
        "decoder-layers1.lr0.01.seed1", "decoder-layers1.lr0.01.seed2",
        "decoder-layers2.lr0.001.seed1", "decoder-layers2.lr0.001.seed2",
        "decoder-layers2.lr0.01.seed1", "decoder-layers2.lr0.01.seed2",
    ]
    assert [job.index for job in jobs] == list(range(8))
    job = jobs[5]
    assert (job.overrides, job.seed) == ({"decoder-layers": 2, "lr": 0.001}, 2)
    assert job.run_dir == (tmp_path / "sweep" / job.name).resolve()
    argv = job.argv
    assert argv[0] == str((Path.cwd() / "corpus").resolve())  # data made absolute
    assert argv[argv.index("--decoder-layers") + 1] == "2"
    assert argv[argv.index("--lr") + 1] == "0.001"
    assert argv[-4:] == ["--seed", "2", "--save-dir", str(job.run_dir)]


def test_cli_grid_replaces_a_dimension_and_adds_one(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text(GRID_CONFIG)
    config = load_run_config(path, check_flags=False)
    grid = dict([parse_grid_option("lr=0.5"), parse_grid_option("fp16=true,false")])
    config = config.with_grid(grid)
    config = config.with_seeds([3])
    names = [job.name for job in plan_sweep(config, tmp_path)]
    assert names == [
        "decoder-layers1.lr0.5.fp16.seed3", "decoder-layers1.lr0.5.no-fp16.seed3",
        "decoder-layers2.lr0.5.fp16.seed3", "decoder-layers2.lr0.5.no-fp16.seed3",
    ]


def test_run_dir_names_are_filesystem_safe_and_never_collide(tmp_path):
    name = run_dir_name({"restore-file": "a/b c", "fp16": True}, 3)
    assert name == "restore-filea_b_c.fp16.seed3"
    long_name = run_dir_name({"tag": "x" * 300}, 1)
    assert len(long_name) == 180 + 9 and long_name == run_dir_name({"tag": "x" * 300}, 1)
    path = tmp_path / "c.yaml"
    path.write_text(GRID_CONFIG.replace("  decoder-layers: [1, 2]\n  lr: [0.001, 0.01]\n",
                                        "  restore-file: [a/b, a_b]\n").replace("[1, 2]", "[1]"))
    names = [job.name for job in plan_sweep(load_run_config(path, check_flags=False), tmp_path)]
    assert len(set(names)) == 2
    assert all(name.startswith("restore-filea_b.seed1-") for name in names)


def test_parse_grid_option_values_and_errors():
    assert parse_grid_option("wait=1,3") == ("wait", [1, 3])
    assert parse_grid_option("fp16=true,false") == ("fp16", [True, False])
    assert parse_grid_option("arch=switch_lm_base, switch_lm_large") == (
        "arch", ["switch_lm_base", "switch_lm_large"])
    for bad in ("wait", "wait=", "=1,2", "wait=1,,2"):
        with pytest.raises(UsageError, match="--grid"):
            parse_grid_option(bad)


def test_array_spec_compresses_indices():
    assert array_spec([0, 1, 2, 5, 7, 8], 3) == "0-2,5,7-8%3"
    assert array_spec([4], 1) == "4%1"
    assert array_spec(list(range(10)), 10) == "0-9%10"


def _dry_run(tmp_path, capsys, *extra: str) -> str:
    sweep_dir = tmp_path / "sw"
    assert main(["submit", str(EXAMPLE), "--sweep-dir", str(sweep_dir), "--dry-run", *extra]) == 0
    assert not sweep_dir.exists()  # --dry-run writes nothing
    return capsys.readouterr().out


def test_dry_run_without_the_data_says_which_checks_it_could_not_make(tmp_path, capsys,
                                                                       monkeypatch):
    """Every shipped config passed --dry-run, exit 0, while its data was missing (a --grid
    wait=7 too), and the real submit then refused it."""
    monkeypatch.chdir(tmp_path)  # the config's data-bin/tiny-stream is not here
    assert main(["submit", str(STREAM_EXAMPLE), "--sweep-dir", "sw", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert (f"alma-sweep: note: data directory {tmp_path}/data-bin/tiny-stream not found here, so "
            "the checks that read the stream (each run's --wait within its B, ...) were not "
            "made; submit refuses until it exists") in err, err


def test_dry_run_prints_table_commands_script_and_chain(tmp_path, capsys):
    out = _dry_run(tmp_path, capsys, "--max-parallel", "1", "--chain-stages", "3",
                   "--stages-per-link", "2")
    sweep_dir = tmp_path / "sw"
    assert "2 run(s) of tiny_sweep.yaml on profile local-cpu" in out
    assert (
        "#    run                    seed    overrides\n"
        "---  ---------------------  ------  ----------------\n"
        "0    decoder-layers1.seed1  1       decoder-layers=1\n"
        "1    decoder-layers2.seed1  1       decoder-layers=2\n"
    ) in out
    train = Path(sys.executable).parent / "fairseq-train"
    assert (
        f"[1] srun --kill-on-bad-exit=1 --cpus-per-task=1 {LAUNCH_TASK} --cpu {train} "
        f"{Path.cwd() / 'data-bin' / 'tiny-lm'} --user-dir {REPO / 'fairseq_alma'} "
        "--task language_modeling --arch transformer_lm --decoder-layers 2"
    ) in out
    assert f"--seed 1 --save-dir {sweep_dir}/decoder-layers2.seed1\n" in out
    for line in ("#SBATCH --array=0-1%1", f"#SBATCH --output={sweep_dir}/logs/%A_%a.out",
                 "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 "#SBATCH --signal=B:USR1@60", "#SBATCH --ntasks-per-node=1",
                 "export OMP_NUM_THREADS=1"):
        assert line + "\n" in out
    script = out.split(f"# {sweep_dir}/sweep.sbatch\n")[1].split("# would submit:")[0]
    syntax = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert syntax.returncode == 0, syntax.stderr
    submits = out.split("# would submit:\n")[1].strip().splitlines()
    assert submits == [
        f"sbatch --parsable --array=0-1%1 {sweep_dir}/sweep.sbatch --stop-after-stage 2",
        f"sbatch --parsable --array=0-1%1 '--dependency=aftercorr:<job id of link 1>' "
        f"{sweep_dir}/sweep.sbatch --stop-after-stage 4",
        f"sbatch --parsable --array=0-1%1 '--dependency=aftercorr:<job id of link 2>' "
        f"{sweep_dir}/sweep.sbatch",
    ]


def test_dry_run_gpu_profile_has_no_cpu_flags(tmp_path, capsys):
    out = _dry_run(tmp_path, capsys, "--profile", "gpu-node-8")
    assert "#SBATCH --gpus-per-node=8\n" in out and "#SBATCH --ntasks-per-node=8\n" in out
    assert " --cpu " not in out and "gloo" not in out
    assert '"$LAUNCH_TASK" "${CMD[@]}" &' in out
    assert "(8 process(es) per run" in out


def run_cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "fairseq_alma.cli.sweep", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def assert_one_line_error(done: subprocess.CompletedProcess, expected: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("alma-sweep: error:")]
    assert len(errors) == 1 and expected in errors[0], done.stderr


def test_cli_user_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text() + "sedes: [1]\n")
    sweep = ["--sweep-dir", str(tmp_path / "sw")]
    assert_one_line_error(run_cli("submit", str(bad), *sweep, "--dry-run", cwd=tmp_path),
                          f"{bad}: unknown top-level key 'sedes'")
    assert_one_line_error(
        run_cli("submit", str(EXAMPLE), *sweep, "--grid", "decoder-layer=1,2", cwd=tmp_path),
        "unknown fairseq-train flag 'decoder-layer'; did you mean 'decoder-layers'?")


@pytest.mark.parametrize(
    "args, expected",
    [
        (["submit", str(EXAMPLE), "--sweep-dir", "sw", "--chain-stages", "2"],
         "--chain-stages 2 needs --stages-per-link N"),
        (["submit", str(EXAMPLE), "--sweep-dir", "s w", "--dry-run"], "contains whitespace"),
        (["submit", str(EXAMPLE), "--sweep-dir", "sw", "--profile", "nope"],
         "resource profile"),
        (["status", "."], "not a sweep directory (run alma-sweep submit)"),
        (["cancel", "."], "not a sweep directory"),
    ],
)
def test_cli_errors_in_process(tmp_path, monkeypatch, capsys, args, expected):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("alma-sweep: error: ") and expected in err[-1], err


def fake_sbatch(tmp_path: Path, monkeypatch) -> None:
    """A fake sbatch on PATH that prints job id 77 and appends its arguments to tmp_path/calls,
    and a squeue whose queue is empty; the test then runs in tmp_path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\necho 77\n')
    (bin_dir / "squeue").write_text("#!/bin/sh\n")
    for tool in ("sbatch", "squeue"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.delenv("SLURM_CONF", raising=False)
    monkeypatch.chdir(tmp_path)


def test_submit_writes_records_and_an_executable_script(tmp_path, monkeypatch, capsys):
    fake_sbatch(tmp_path, monkeypatch)
    (tmp_path / "data-bin" / "tiny-lm").mkdir(parents=True)
    assert main(["submit", str(EXAMPLE), "--sweep-dir", "sw"]) == 0
    sweep_dir = tmp_path / "sw"
    assert "submitted job 77 (array 0-1%2, link 1/1)" in capsys.readouterr().out
    assert (sweep_dir / "sweep.sbatch").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "calls").read_text().split()[-1] == str(sweep_dir / "sweep.sbatch")
    jobs = json.loads((sweep_dir / "jobs.json").read_text())["jobs"]
    assert [job["name"] for job in jobs] == ["decoder-layers1.seed1", "decoder-layers2.seed1"]
    [submission] = json.loads((sweep_dir / "submissions.json").read_text())
    assert (submission["job_id"], submission["array"]) == ("77", "0-1%2")
    assert sorted(p.name for p in sweep_dir.iterdir()) == [
        "jobs.json", "logs", "submissions.json", "sweep.sbatch"]  # no temp files left


def test_submit_refuses_missing_data_before_calling_sbatch(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # data-bin/tiny-lm does not exist here
    assert main(["submit", str(EXAMPLE), "--sweep-dir", "sw"]) == 2
    assert f"data directory {tmp_path}/data-bin/tiny-lm not found" in capsys.readouterr().err
    assert not (tmp_path / "sw").exists()


STREAM_EXAMPLE = REPO / "train_configs" / "examples" / "tiny_stream.yaml"


def write_stream_skeleton(data: Path, megabatches: int = 2) -> None:
    """What `alma-sweep submit` reads of a stream (manifest.json, dict.txt, the shards' sizes),
    in milliseconds: alma-data-prep takes seconds and the check reads no token."""
    data.mkdir(parents=True)
    (data / "dict.txt").write_text("the 3\nend 2\n")
    splits = expected_splits(megabatches)
    for name in splits:
        for ext in ("bin", "idx"):
            (data / f"{name}.{ext}").touch()
    atomic_write_json(data / "manifest.json", {
        "format": MANIFEST_FORMAT, "num_megabatches": megabatches, "order": "shuffle",
        "splits": {name: {"bin_bytes": 0, "idx_bytes": 0} for name in splits},
        "dictionary": {"file": "dict.txt", "sha256": sha256_file(str(data / "dict.txt"))}})


@pytest.fixture
def stream_submit(tmp_path, monkeypatch):
    """`alma-sweep submit` of tiny_stream.yaml on a 2-mega-batch stream, with a fake sbatch
    that records its calls (``fake_sbatch``); returns its exit status."""
    fake_sbatch(tmp_path, monkeypatch)
    write_stream_skeleton(tmp_path / "data-bin" / "tiny-stream")
    return lambda *args: main(["submit", str(STREAM_EXAMPLE), "--sweep-dir", "sw", *args])


@pytest.mark.parametrize("args, point, expected", [
    (["--grid", "wait=1,5"], "wait=5",
     "--wait must be in [1, 2] (the stream's mega-batches); got 5"),
    (["--grid", "capacity-factor=0"], "capacity-factor=0", "--capacity-factor must be > 0"),
    (["--grid", "wait=1,auto", "--grid", "eval-subset=valid"], "wait=auto, eval-subset=valid",
     "--wait auto with --eval-subset valid: its decisions read 'valid', which would then be scored"),
    (["--grid", "moe-max-experts=8", "--grid", "grow-experts=3"],
     "moe-max-experts=8, grow-experts=3", "--grow-experts 3: stage 2 would copy 3 experts but the model has 2 then"),
    (["--grid", "wait=2", "--grid", "replay=true"], "wait=2, replay=True",
     "--replay has nothing to replay: with --wait 2 the stream of 2 mega-batches trains one stage"),
    # local-cpu: the launcher adds --cpu to every task, which refuses --fp16 (not this machine)
    (["--grid", "fp16=true"], "fp16=True", "--fp16 trains on CUDA GPUs only"),
    (["--grid", "bf16=true", "--grid", "fp16=true"], "bf16=True, fp16=True",
     "--bf16 and --fp16 are two precisions: use one"),  # fairseq's parser: a ValueError
])
def test_submit_refuses_values_every_task_would_refuse(stream_submit, tmp_path, capsys, args,
                                                       point, expected):
    assert stream_submit(*args) == 2
    err = capsys.readouterr().err.splitlines()
    named = f"--grid {expected.split()[0][2:]}"  # set on the command line, not in a file
    assert err[-1].startswith(f"alma-sweep: error: {named} (grid point {point}): "), err
    assert expected in err[-1] and not any("DEBUG" in line for line in err), err
    assert not (tmp_path / "sw").exists() and not (tmp_path / "calls").exists()


@pytest.mark.parametrize("flag", ["fp16", "bf16"])
def test_submit_checks_precision_on_the_profile_not_this_machine(stream_submit, capsys, flag):
    """A GPU sweep submitted from a login node without GPUs (as here): not refused."""
    assert stream_submit("--profile", "gpu-1", "--grid", f"{flag}=true", "--dry-run") == 0, \
        capsys.readouterr().err
    assert f"--{flag} " in capsys.readouterr().out


def test_covering_points_hold_every_grid_value_in_as_many_points_as_the_longest_flag(tmp_path):
    config = load_run_config(REPO / "train_configs" / "vision" / "mnist.yaml", check_flags=False)
    points = config.covering_points()
    assert len(points) == max(len(values) for values in config.grid.values())
    assert all(point in config.grid_points() for point in points)
    for flag, values in config.grid.items():
        assert {point[flag] for point in points} == set(values)
    assert dataclasses.replace(config, grid={}).covering_points() == [{}]  # one point, no grid


@pytest.mark.parametrize("args, refused", [
    (["--grid", "wait=1,9"], "--grid wait (grid point vision-method=gmoe, wait=9): --wait must be "
     "in [1, 4] (the stream's mega-batches); got 9"),
    (["--grid", "vision-amp=off,fp16"], "--grid vision-amp (grid point vision-method=gmoe, wait=4, "
     "vision-amp=fp16): --vision-amp fp16 needs a CUDA device"),  # local-cpu: the tasks get --cpu
    (["--grid", "vision-amp=fp16", "--profile", "gpu-1", "--dry-run"], None),
])
def test_submit_checks_the_values_of_a_vision_grid(tmp_path, monkeypatch, capsys, args, refused):
    """Every value of every grid flag, on the few points that hold them all (covering_points)."""
    fake_sbatch(tmp_path, monkeypatch)
    smoke = REPO / "train_configs" / "vision" / "digits_smoke.yaml"
    status = main(["submit", str(smoke), "--sweep-dir", "sw", *args])
    err = capsys.readouterr().err.splitlines()
    if refused is None:
        assert status == 0, err
        return
    assert status == 2 and err[-1].startswith(f"alma-sweep: error: {refused}"), err
    assert not (tmp_path / "sw").exists() and not (tmp_path / "calls").exists()


def _jsonl(path: Path, records: list[dict], torn_tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn_tail)


def test_status_from_run_directories_only(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))  # squeue cannot be found
    jobs = [{"index": i, "name": f"run{i}", "run_dir": str(tmp_path / f"run{i}")} for i in range(4)]
    atomic_write_json(tmp_path / "jobs.json", {"jobs": jobs})
    atomic_write_json(tmp_path / "submissions.json", [{"job_id": "41", "link": 1}])
    event = {"job_id": 42, "array_job_id": 41, "restart": 0}
    _jsonl(tmp_path / "run0" / "slurm_events.jsonl", [
        {**event, "event": "started", "array_task_id": 0},
        {**event, "event": "usr1", "array_task_id": 0},
        {**event, "event": "started", "array_task_id": 0, "restart": 1},
        {**event, "event": "completed", "array_task_id": 0, "restart": 1}])
    _jsonl(tmp_path / "run0" / "stream.jsonl",
           [{"arrival": t, "eval_ppl": 60 / t + 1} for t in (1, 2, 3)])
    _jsonl(tmp_path / "run1" / "slurm_events.jsonl", [
        {**event, "event": "started", "array_task_id": 1},
        {**event, "event": "failed", "array_task_id": 1, "rc": 3}])
    _jsonl(tmp_path / "run1" / "stream.jsonl", [{"arrival": 0, "test_error": 0.9},
                                               {"arrival": 1, "test_error": 0.25}])
    _jsonl(tmp_path / "run2" / "slurm_events.jsonl", [{**event, "event": "started",
                                                      "array_task_id": 2}])
    _jsonl(tmp_path / "run2" / "stream.jsonl", [{"arrival": 1, "eval_ppl": 90.0}],
           torn_tail='{"arrival": 2, "eval_p')
    assert main(["status", str(tmp_path), "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)
    summary = [(r["state"], r["last_arrival"], r["metric"], r["best"], r["restarts"],
                r["slurm_job"]) for r in runs]
    assert summary == [
        ("done", 3, "eval_ppl", 21.0, 1, "41_0"),
        ("failed", 1, "test_error", 0.25, 0, "41_1"),
        ("running", 1, "eval_ppl", 90.0, 0, "41_2"),  # best guess without the queue
        ("pending", None, None, None, 0, None),
    ]
    assert main(["status", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert text == (
        f"{tmp_path}: 4 run(s): done 1, failed 1, pending 1, running 1\n"
        "(squeue not reachable: states come from the run directories only)\n"
        "#    run    state      arrival             best    restarts    slurm job\n"
        "---  -----  -------  ---------  ---------------  ----------  -----------\n"
        "0    run0   done             3      eval_ppl 21           1         41_0\n"
        "1    run1   failed           1  test_error 0.25           0         41_1\n"
        "2    run2   running          1      eval_ppl 90           0         41_2\n"
        "3    run3   pending          -                -           0            -\n"
    )


GB_ALIAS_CONFIG = f"""\
include: {STREAM_EXAMPLE}
global_batch: 16
args: {{batch-size: null, max-sentences: 4}}
"""


@pytest.mark.parametrize("args, expected", [
    # one value in two spellings would be two grid points training one run twice
    (["--grid", "lr=1e-3,0.001"], "grid 'lr' lists 1e-3 and 0.001, the same value"),
    (["--grid", "lr=5E-4,0.0005"], "grid 'lr' lists 5E-4 and 0.0005, the same value"),
    (["--grid", "lr=0.001,'0.001'"], "grid 'lr' lists the value '0.001' twice"),
    # fairseq's eval_str_list raises a SyntaxError argparse does not catch: was a traceback
    (["--grid", "lr=0.001=2"], "--grid lr (grid point lr=0.001=2): fairseq-train rejects a "
     "value: --lr '0.001=2' is not a valid value (SyntaxError"),
    (["--seeds="], "--seeds '': write integers separated by commas"),  # was silently ignored
    (["--grid", "adam-betas=(0.9, 0.98),(0.9, 0.999)"],
     "--grid splits values at every comma, so a value holding one cannot be given here; list "
     "the values under grid: in the config file"),
    # every seed's value is checked (the largest), and --seeds is named, not the config file
    (["--seeds", "1,99999999999999999999"], "--seeds: --seed must be in [0, 4294967295]"),
    (["--chain-stages", "2", "--stages-per-link", "0"], "--stages-per-link 0: N must be >= 1"),
    # the stream has 2 stages: link 1 trains stage 1, link 2 the rest, link 3 nothing
    (["--chain-stages", "3", "--stages-per-link", "1"], "--chain-stages 3 --stages-per-link 1: "
     "its runs train 2 stage(s), so link 3 of each chain would find nothing left to train; use "
     "--chain-stages 2"),
    (["--chain-stages", "5", "--stages-per-link", "3"], "links 2-5 of each chain would find "
     "nothing left to train; leave out --chain-stages"),
])
def test_submit_refuses_in_one_line(stream_submit, tmp_path, capsys, args, expected):
    assert stream_submit(*args, "--dry-run") == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("alma-sweep: error: ") and expected in err[-1], err
    assert not (tmp_path / "sw").exists()


def test_a_chain_link_needed_by_the_longest_runs_only_is_accepted(stream_submit, capsys):
    """wait=2 trains 1 stage, wait=1 two: link 2 is idle for some runs, needed by others."""
    assert stream_submit("--grid", "wait=1,2", "--chain-stages", "2", "--stages-per-link", "1",
                         "--dry-run") == 0, capsys.readouterr().err


@pytest.mark.parametrize("config, expected", [
    # two spellings of fairseq-train's --batch-size: the last would win silently
    ("grid: {max-sentences: [2, 4]}\n", "(grid point max-sentences=2): 'batch-size' and "
     "'max-sentences' are two spellings of fairseq-train's --batch-size"),
    # --local_rank is fairseq-train's alias of the launcher's --device-id
    ("args: {local_rank: 1}\n", "'local_rank' (fairseq-train's --device-id) cannot be set here: "
     "slurm/launch_task.sh sets it from SLURM_LOCALID"),
])
def test_flag_aliases_are_one_flag(stream_submit, tmp_path, capsys, config, expected):
    path = tmp_path / "alias.yaml"
    path.write_text(f"include: {STREAM_EXAMPLE}\n{config}")
    assert main(["submit", str(path), "--sweep-dir", "sw", "--dry-run"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"alma-sweep: error: {path}") and expected in err[-1], err


def test_global_batch_sets_the_batch_under_the_configs_spelling(stream_submit, tmp_path, capsys):
    """max-sentences is --batch-size: global_batch sets it, not a second --batch-size that the
    config's --max-sentences would override (4 x 2 sequences instead of 16)."""
    path = tmp_path / "gb.yaml"
    path.write_text(GB_ALIAS_CONFIG)
    assert main(["submit", str(path), "--sweep-dir", "sw", "--dry-run"]) == 0
    [command] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[0] ")]
    argv = command.split()
    assert "--batch-size" not in argv
    assert int(argv[argv.index("--max-sentences") + 1]) * \
        int(argv[argv.index("--update-freq") + 1]) == 16


def _sweep_records(sweep_dir: Path, names: list[str]) -> None:
    """jobs.json and submissions.json of a sweep whose runs are sweep_dir/NAME (job 41)."""
    jobs = [{"index": i, "name": name, "run_dir": str(sweep_dir / name), "overrides": {},
             "seed": i + 1, "argv": []} for i, name in enumerate(names)]
    atomic_write_json(sweep_dir / "jobs.json", {"jobs": jobs})
    atomic_write_json(sweep_dir / "submissions.json", [{"job_id": "41", "link": 1}])


@pytest.mark.parametrize("command", ["status", "cancel", "score"])
def test_a_copied_or_moved_sweep_is_refused_not_read_from_the_original(tmp_path, monkeypatch,
                                                                      capsys, command):
    """jobs.json names the original's run directories and Slurm jobs: a copy read them (status,
    score and cancel of another directory's runs), a moved one said 'not started'."""
    import shutil

    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    original = tmp_path / "real"
    _sweep_records(original, ["seed1", "seed2"])
    _jsonl(original / "seed2" / "stream.jsonl", [{"arrival": 1, "eval_ppl": 9.0}])
    shutil.copytree(original, tmp_path / "copy")
    assert main([command, str(tmp_path / "copy")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (
        f"alma-sweep: error: {tmp_path}/copy/jobs.json: its runs are in {original}, not here: "
        f"{tmp_path}/copy is a copy of the sweep {original}, whose Slurm jobs and run directories "
        f"its records name; use alma-sweep on {original}, or submit a new sweep with another "
        "--sweep-dir"), err
    original.rename(tmp_path / "moved")
    assert main([command, str(tmp_path / "moved")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"alma-sweep: error: {tmp_path}/moved/jobs.json: its runs are in "
                              f"{original}, not here: the sweep was moved from {original}"), err
    assert f"move it back to {original}" in err[-1]


def test_resubmitting_a_moved_sweep_says_it_moved(stream_submit, tmp_path, capsys):
    assert stream_submit() == 0
    (tmp_path / "sw").rename(tmp_path / "sw2")
    assert main(["submit", str(STREAM_EXAMPLE), "--sweep-dir", "sw2"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert f"the sweep was moved from {tmp_path}/sw" in err[-1], err
    assert "delete" not in err[-1]


def test_resubmit_on_another_process_count_is_refused(stream_submit, tmp_path, capsys):
    """The run's task would refuse it after queueing (run.json's world size), advising flags
    alma-sweep refuses; submit knows it from run.json and the profile."""
    assert stream_submit() == 0
    run = tmp_path / "sw" / "seed1"
    atomic_write_json(run / "run.json", {"fingerprint": {"config": {
        "distributed_training": {"distributed_world_size": 2}, "task": {}, "model": {}}}})
    _jsonl(run / "stream.jsonl", [{"arrival": 1, "eval_ppl": 90.0}])
    assert stream_submit() == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (
        f"alma-sweep: error: {run} trained on 2 process(es) (its run.json) and profile local-cpu "
        "runs 1: a run continues on as many processes as it started on; resubmit with a profile "
        "of 2 process(es) per run, or use a new --sweep-dir"), err
    assert (tmp_path / "calls").read_text().count("sweep.sbatch") == 1  # not submitted again


@pytest.mark.parametrize("in_queue, printed, cancelled", [
    ("", "nothing to cancel: no job of {sw} is queued or running (its job(s) 41 have all left "
         "the queue)", None),
    ("41|41_0\n", "cancelled Slurm job(s) 41 of {sw}", "41"),
])
def test_cancel_says_what_it_cancelled(tmp_path, monkeypatch, capsys, in_queue, printed,
                                       cancelled):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(f"#!/bin/sh\nprintf '{in_queue}'\n")
    (bin_dir / "scancel").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scancelled\n')
    for tool in ("squeue", "scancel"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.delenv("SLURM_CONF", raising=False)
    sweep_dir = tmp_path / "sw"
    _sweep_records(sweep_dir, ["seed1"])
    assert main(["cancel", str(sweep_dir)]) == 0
    assert capsys.readouterr().out.strip() == printed.format(sw=sweep_dir)
    scancelled = tmp_path / "scancelled"
    assert (scancelled.read_text().strip() if scancelled.exists() else None) == cancelled


def _fail(bin_dir: Path, tool: str, message: str) -> None:
    """Make the fake ``tool`` fail as Slurm's clients do: one line on stderr, exit 1."""
    (bin_dir / tool).write_text(f'#!/bin/sh\necho "{message}" >&2\nexit 1\n')


def test_a_failed_sbatch_leaves_the_sweep_directory_as_it_was(stream_submit, tmp_path, capsys):
    """jobs.json and sweep.sbatch were left behind: the corrected command was then refused as
    'a different sweep', and status counted runs never submitted."""
    _fail(tmp_path / "bin", "sbatch", "sbatch: error: invalid partition specified: nosuch")
    assert stream_submit("--grid", "wait=1") == 2
    assert "invalid partition specified: nosuch" in capsys.readouterr().err
    assert not (tmp_path / "sw").exists()
    (tmp_path / "bin" / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\necho 77\n')
    assert stream_submit("--grid", "wait=2") == 0, capsys.readouterr().err  # the fixed command
    table = json.loads((tmp_path / "sw" / "jobs.json").read_text())
    assert [job["name"] for job in table["jobs"]] == ["wait2.seed1"]
    # a failed resubmit puts back the records of the sweep already there, byte for byte
    before = {p.name: p.read_bytes() for p in (tmp_path / "sw").iterdir() if p.is_file()}
    _fail(tmp_path / "bin", "sbatch", "sbatch: error: Batch job submission failed")
    (tmp_path / "sw" / "sweep.sbatch").write_text("edited\n")
    before["sweep.sbatch"] = b"edited\n"
    assert stream_submit("--grid", "wait=2") == 2
    assert {p.name: p.read_bytes() for p in (tmp_path / "sw").iterdir() if p.is_file()} == before


def test_a_resubmit_when_squeue_does_not_answer_is_refused(stream_submit, tmp_path, capsys):
    """Read as an empty queue, a silent squeue queued every run of the sweep a second time."""
    assert stream_submit() == 0
    _fail(tmp_path / "bin", "squeue", "slurm_load_jobs error: Socket timed out")
    assert stream_submit() == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("alma-sweep: error: squeue did not answer ("), err
    assert "Socket timed out), so whether runs of " in err[-1]
    assert err[-1].endswith("retry alma-sweep submit when squeue answers"), err
    assert (tmp_path / "calls").read_text().count("sweep.sbatch") == 1  # not submitted again


def test_a_profile_warning_at_or_after_its_time_limit_is_refused(stream_submit, tmp_path, capsys):
    profile = tmp_path / "short.yaml"
    profile.write_text('time: "00:01:00"\nntasks_per_node: 1\nsignal_seconds: 60\n'
                       'save_grace_seconds: 30\n')
    assert stream_submit("--profile", str(profile), "--dry-run") == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (
        f"alma-sweep: error: {profile}: signal_seconds (60) must be smaller than the time limit "
        "(time '00:01:00' = 60 s): Slurm would warn each job as it starts and it would requeue "
        "over and over; lower signal_seconds or raise time"), err
    assert not (tmp_path / "sw").exists()


def test_seeds_help_has_no_stray_colon(capsys):
    with pytest.raises(SystemExit):
        main(["submit", "--help"])
    assert "seeds instead of the config's seeds:" not in " ".join(capsys.readouterr().out.split())


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """One run of tiny_stream.yaml (seed 1), trained by fairseq-train as its array task would
    train it (the job's argv and the launcher's flags): the run.json every fingerprint check
    below compares with is the real trainer's."""
    import os

    from test_distributed_stream import build_tiny_stream

    from fairseq_alma.cli.sweep import _register_with_fairseq
    from fairseq_alma.sweeps import train_submit
    from fairseq_alma.sweeps.point_values import launcher_flags

    root = tmp_path_factory.mktemp("trained")
    data = build_tiny_stream(root)
    config = root / "tiny.yaml"
    config.write_text(f"include: {STREAM_EXAMPLE}\ndata: {data}\n")
    request = train_submit.SubmitRequest(config=str(config), sweep_dir=root / "sw", seeds="1")
    run_config = train_submit.load_sweep_config(request)
    profile = train_submit.sweep_profile(request, run_config)
    _register_with_fairseq()
    [job] = train_submit.plan_submission(request, run_config, profile).jobs
    done = subprocess.run([str(Path(sys.executable).parent / "fairseq-train"), *job.argv,
                           *launcher_flags(profile)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    _jsonl(job.run_dir / "slurm_events.jsonl", [{"event": "completed", "job_id": 5,
                                                "array_job_id": 5, "array_task_id": 0}])
    return root


def _copied_run(trained_run: Path, tmp_path: Path, args: str = "") -> Path:
    """The trained run copied into tmp_path/sw (a run directory from another sweep), and a
    config of the same data with ``args``."""
    import shutil

    shutil.copytree(trained_run / "sw" / "seed1", tmp_path / "sw" / "seed1")
    config = tmp_path / "c.yaml"
    config.write_text((trained_run / "tiny.yaml").read_text() + (f"args:\n  {args}\n" if args else ""))
    return config


def test_a_finished_run_of_the_same_config_is_done(trained_run, tmp_path, monkeypatch, capsys):
    """The fingerprint submit expects is the one the trainer wrote: a finished run is done."""
    fake_sbatch(tmp_path, monkeypatch)
    config = _copied_run(trained_run, tmp_path)
    assert main(["submit", str(config), "--sweep-dir", "sw"]) == 0, capsys.readouterr().err
    assert "all 1 run(s) in " in capsys.readouterr().out
    assert not (tmp_path / "calls").exists()


def test_a_run_of_another_config_is_refused_not_called_done(trained_run, tmp_path, monkeypatch,
                                                             capsys):
    """Its slurm_events.jsonl said completed: the lr 0.003 run was 'done' for a config of lr
    0.001, nothing trained, and alma-report published its numbers under the new config."""
    fake_sbatch(tmp_path, monkeypatch)
    config = _copied_run(trained_run, tmp_path, "lr: 0.001")
    before = sorted(str(p) for p in (tmp_path / "sw").rglob("*"))
    assert main(["submit", str(config), "--sweep-dir", "sw"]) == 2
    err = capsys.readouterr().err.splitlines()
    run = tmp_path / "sw" / "seed1"
    assert err[-1].startswith(f"alma-sweep: error: {run} holds a run with other settings ("), err
    assert "lr: [0.003] -> [0.001]" in err[-1]
    assert err[-1].endswith(f"use a new --sweep-dir, or move that run directory out of "
                            f"{tmp_path / 'sw'} to train this config's run there"), err
    assert sorted(str(p) for p in (tmp_path / "sw").rglob("*")) == before
    assert not (tmp_path / "calls").exists()


def test_done_needs_the_runs_own_records_to_say_finished(trained_run, tmp_path, monkeypatch,
                                                        capsys):
    """A completed Slurm event over an unfinished stream.jsonl (arrival 2 missing) is not done:
    the run is submitted again and continues from its checkpoint."""
    fake_sbatch(tmp_path, monkeypatch)
    config = _copied_run(trained_run, tmp_path)
    stream = tmp_path / "sw" / "seed1" / "stream.jsonl"
    stream.write_text("".join(stream.read_text().splitlines(keepends=True)[:2]))
    assert main(["submit", str(config), "--sweep-dir", "sw"]) == 0, capsys.readouterr().err
    assert "submitted job 77 (array 0%1, link 1/1)" in capsys.readouterr().out


def test_a_run_stopped_by_its_max_epoch_is_done_when_its_job_completed(trained_run, tmp_path,
                                                                       monkeypatch, capsys):
    """A --max-epoch run never records every arrival: it was submitted again at every call,
    each job training nothing, while status called it done."""
    fake_sbatch(tmp_path, monkeypatch)
    config = _copied_run(trained_run, tmp_path, "max-epoch: 1")
    stream = tmp_path / "sw" / "seed1" / "stream.jsonl"
    stream.write_text("".join(stream.read_text().splitlines(keepends=True)[:2]))  # stage 1's end
    assert main(["submit", str(config), "--sweep-dir", "sw"]) == 0, capsys.readouterr().err
    assert "all 1 run(s) in " in capsys.readouterr().out
    assert not (tmp_path / "calls").exists()


def test_a_vision_sweep_on_the_embedded_digits_needs_no_data_directory():
    """Its DATA is the word fairseq-train needs: --dry-run accepted it, submit refused it."""
    from fairseq_alma.sweeps.train_plan import SweepJob
    from fairseq_alma.sweeps.train_submit import reads_data

    def job(*argv: str) -> SweepJob:
        return SweepJob(0, "x", {}, 1, Path("x"), ["digits", "--task", "alma_stream", *argv])

    assert not reads_data(job("--vision-dataset", "digits", "--arch", "alma_vision"))
    assert reads_data(job("--vision-dataset", "mnist", "--arch", "alma_vision"))
    assert reads_data(job("--arch", "switch_transformer_lm_tiny"))


def test_status_shows_a_failed_rescore_as_failed_and_json_has_the_scoring_tasks(
        tmp_path, monkeypatch, capsys):
    """A rescore that failed left the earlier outputs: status said `stale`, never `failed`;
    and --json printed the runs only, though the table shows the scoring tasks too."""
    from fairseq_alma.sweeps.score_plan import input_signature

    fake_sbatch(tmp_path, monkeypatch)  # squeue answers: nothing queued
    sweep_dir = tmp_path / "sw"
    _sweep_records(sweep_dir, ["seed1", "seed2", "seed3", "seed4"])
    tasks = []
    for index, (name, planned, scored) in enumerate([
            ("seed1", "now", "old"),     # rescored (inputs changed), the task failed
            ("seed2", "now", "now"),     # scored from the current inputs
            ("seed3", "then", "then")]):  # scored, then its inputs changed: stale, not failed
        run_dir, out_dir = sweep_dir / name, sweep_dir / "scores" / name
        current = input_signature([str(run_dir)], "single", [])
        signatures = {"now": current, "old": "0" * 16, "then": "1" * 16}
        out_dir.mkdir(parents=True)
        for output in ("score.json", "score.csv", "score.txt"):
            (out_dir / output).write_text("{}")
        atomic_write_json(out_dir / "scored.json", {"signature": signatures[scored]})
        tasks.append({"index": index, "name": name, "mode": "single", "runs": [name],
                      "run_dirs": [str(run_dir)], "out_dir": str(out_dir),
                      "signature": signatures[planned],
                      "argv": [str(run_dir), "--mode", "single"]})
    # seed4: submitted, cancelled while pending (Slurm never opened its output): "not run"
    run_dir, out_dir = sweep_dir / "seed4", sweep_dir / "scores" / "seed4"
    tasks.append({"index": 3, "name": "seed4", "mode": "single", "runs": ["seed4"],
                  "run_dirs": [str(run_dir)], "out_dir": str(out_dir),
                  "signature": input_signature([str(run_dir)], "single", []),
                  "argv": [str(run_dir), "--mode", "single"]})
    atomic_write_json(sweep_dir / "score_jobs.json", {"tasks": tasks, "submissions": [
        {"job_id": "60", "tasks": [0, 1, 3]}]})
    (sweep_dir / "logs").mkdir()
    (sweep_dir / "logs" / "score_60_0.out").write_text("")  # seed1's task ran, and failed
    assert main(["status", str(sweep_dir)]) == 0
    text = capsys.readouterr().out
    assert "4 task(s): failed 1, not run 1, scored 1, stale 1\n" in text, text
    assert "3    seed4   single  not run         60_3\n" in text, text
    assert "tasks not run: cancelled before they started" in text, text
    assert "0    seed1   single  failed          60_0\n" in text, text
    assert "2    seed3   single  stale              -\n" in text, text
    assert (f"failed tasks: see {sweep_dir}/scores/TASK/score.log; alma-sweep score submits them "
            "again\n(the outputs of seed1 are an earlier scoring's, of inputs changed since: "
            "stale until a rescore succeeds)\n") in text, text
    assert main(["status", str(sweep_dir), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(row["kind"], row["name"]) for row in rows] == [
        ("training", "seed1"), ("training", "seed2"), ("training", "seed3"), ("training", "seed4"),
        ("scoring", "seed1"), ("scoring", "seed2"), ("scoring", "seed3"), ("scoring", "seed4")]
    assert rows[4] == {"kind": "scoring", "index": 0, "name": "seed1", "mode": "single",
                       "state": "failed", "slurm_job": "60_0",
                       "score_log": f"{sweep_dir}/scores/seed1/score.log", "stale_outputs": True}
    assert [row["state"] for row in rows[5:]] == ["scored", "stale", "not run"]
