"""Vision streams through ``fairseq-train --task alma_stream`` (issue 4, item 5): one record per
arrival and stage checkpoints, the same numbers as the in-process ``run_stream`` (both call
``train_one_stage``/``evaluate``), kill -9 then the same command continues to identical records,
and bad flags end in one line naming the flag.  Embedded digits, an MLP of width 8, B = 4."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from lm_fixtures import run, tool
from test_alma_stream import wait_for  # the LM stream's kill -9 helper

REPO = Path(__file__).resolve().parent.parent
USER_DIR = str(REPO / "fairseq_alma")
B, WIDTH, EPOCHS = 4, 8, 20


def vision_cmd(save_dir: Path, *extra: str, method: str = "sm", wait: int = 1) -> list[str]:
    return [
        tool("fairseq-train"), "digits", "--user-dir", USER_DIR, "--task", "alma_stream",
        "--vision-dataset", "digits", "--arch", "alma_vision", "--criterion", "alma_vision_stage",
        "--vision-method", method, "--vision-width", str(WIDTH), "--num-megabatches", str(B),
        "--wait", str(wait), "--epochs-per-stage", str(EPOCHS), "--batch-size", "128",
        "--save-dir", str(save_dir), "--cpu", "--num-workers", "0", "--no-epoch-checkpoints",
        "--log-format", "simple", "--seed", "1", *extra,
    ]


def in_process(method: str, wait: int) -> list[dict]:
    """The same stream through ``run_stream`` (the sweep's in-process path)."""
    from fairseq_alma.vision.data import load_vision_data
    from fairseq_alma.vision.learners import LearnerSpec
    from fairseq_alma.vision.stage_trainer import StageTrainConfig
    from fairseq_alma.vision.stream_runner import StreamSpec, run_stream

    torch.set_num_threads(1)
    spec = LearnerSpec(method, "mlp", WIDTH, seed=1)
    config = StageTrainConfig(epochs=EPOCHS, batch_size=128)
    stream = StreamSpec(B, wait, seed=1)
    return run_stream(load_vision_data("digits"), spec, stream, config, log=None)


def comparable(records: list[dict]) -> list[dict]:
    """Records without the wall-clock fields (stage_wall_time is only in run_stream's)."""
    clocks = ("wall_time", "stage_wall_time")
    return [{k: v for k, v in r.items() if k not in clocks} for r in records]


def load_model_state(save: Path, stage: int) -> dict:
    path = save / f"checkpoint_stage{stage}.pt"
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


def read(save: Path) -> list[dict]:
    from fairseq_alma.stream.records import read_records

    return [r.to_json() for r in read_records(save / "stream.jsonl")]


@pytest.fixture(autouse=True)
def keep_signal_handlers():
    """setup_task installs the SIGUSR1/SIGTERM save-and-exit handlers; keep pytest's own."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="module")
def sm_run(tmp_path_factory):
    save = tmp_path_factory.mktemp("vision") / "sm"
    proc = run(vision_cmd(save))
    return save, proc.stdout + proc.stderr


@pytest.mark.slow
def test_sm_stream_equals_in_process_run_and_stage_checkpoints_load(sm_run):
    save, log = sm_run
    records = read(save)
    assert [r["arrival"] for r in records] == list(range(B + 1))
    assert [r["trained"] for r in records] == [False] + [True] * B
    assert comparable(records) == comparable(in_process("sm", 1))
    assert records[-1]["test_error"] < records[0]["test_error"] - 0.3  # it learned the digits
    flops = [r["train_flops_cum"] for r in records]
    assert flops[0] == 0 < flops[1] < flops[2] < flops[3] < flops[4]
    # fairseq's progress log carries the stage's numbers through the alma_vision_stage criterion
    assert "stage_valid_loss" in log and "best_epoch" in log and "| error " in log
    # a stage checkpoint loads with fairseq's own loader and scores what the record says
    from fairseq import checkpoint_utils, utils

    from fairseq_alma.vision.stage_trainer import evaluate

    utils.import_user_module(argparse.Namespace(user_dir=USER_DIR))
    for stage in range(1, B + 1):
        assert (save / f"checkpoint_stage{stage}.pt").is_file()
    paths = [str(save / "checkpoint_stage2.pt")]
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(paths)
    error = evaluate(models[0].learner, task.data.x_test, task.data.y_test).error
    assert error == records[2]["test_error"]


@pytest.mark.slow
def test_gmoe_stream_grows_and_equals_in_process_run(tmp_path):
    save = tmp_path / "gmoe"
    run(vision_cmd(save, method="gmoe", wait=2))
    records = read(save)
    assert [(r["arrival"], r["stage"], r["trained"]) for r in records] == [
        (0, 0, False), (1, 0, False), (2, 1, True), (3, 1, False), (4, 2, True)]
    # one split of the losing expert per mixture layer, at stage 2
    assert [r["experts"] for r in records] == [[1, 1]] * 4 + [[2, 2]]
    assert records[4]["params_active"] > records[2]["params_active"]
    assert comparable(records) == comparable(in_process("gmoe", 2))
    state = load_model_state(save, 2)
    assert state["spec"]["method"] == "gmoe" and set(state["stages"]) == {1, 2}


@pytest.mark.slow
def test_kill9_mid_stream_then_same_command_continues_to_identical_records(sm_run, tmp_path):
    reference, _ = sm_run
    save = tmp_path / "sm"
    cmd = vision_cmd(save)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wait_for(save / "checkpoint_stage1.pt", proc)
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(read(save)) < B + 1, "the run finished before the kill; nothing was resumed"
    run(cmd)
    assert comparable(read(save)) == comparable(read(reference))
    assert not list(save.glob("*.tmp*")), "a temporary file was left behind"
    for stage in range(1, B + 1):
        a, b = load_model_state(save, stage), load_model_state(reference, stage)
        assert a["learner"].keys() == b["learner"].keys()
        assert all(torch.equal(a["learner"][k], b["learner"][k]) for k in a["learner"])
        assert torch.equal(a["generator"], b["generator"])


@pytest.mark.slow
def test_two_data_parallel_ranks_write_the_single_process_records(sm_run, tmp_path):
    """One sample per worker and stage: each gloo rank trains the same learner (same seeds), the
    criterion's logs sum across ranks, rank 0 writes the records and stage checkpoints."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    save = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs = [subprocess.Popen(vision_cmd(
        save, "--distributed-world-size", "2", "--distributed-rank", str(rank),
        "--distributed-no-spawn", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp",
        "--distributed-init-method", f"tcp://127.0.0.1:{port}"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for rank in (0, 1)]
    logs = [proc.communicate(timeout=600)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    assert comparable(read(save)) == comparable(read(sm_run[0]))
    assert "| stage 4 |" in logs[0]  # per-stage values averaged over the ranks, not summed


def test_wait_out_of_range_is_one_line(tmp_path):
    proc = run(vision_cmd(tmp_path / "bad", wait=B + 1), check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fairseq-alma: error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-1500:]
    expected = f"--wait must be between 1 and --num-megabatches ({B}), got {B + 1}"
    assert errors[0] == f"fairseq-alma: error: {expected}"
    assert "Traceback" not in proc.stderr


def parse(*extra: str, arch: str = "alma_vision", criterion: str = "alma_vision_stage"):
    """fairseq-train's own parsing of a vision command (plugin loaded), as its config."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_alma.configs.fairseq_flags import load_plugin

    load_plugin()
    argv = vision_cmd(Path("unused"))[1:] + list(extra)
    argv[argv.index("--arch") + 1], argv[argv.index("--criterion") + 1] = arch, criterion
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    return convert_namespace_to_omegaconf(args)


@pytest.mark.parametrize("extra, needle", [
    (["--num-megabatches", "5000"],  # 1,797 digits, 359 of them held out as the test set
     "--num-megabatches 5000 is larger than the training set of digits (1438 examples)"),
    (["--vision-width", "0"], "--vision-width must be >= 1, got 0"),
    (["--vision-dataset", "imagenet"], "--vision-dataset 'imagenet' is unknown"),
    (["--vision-dataset", "mnist", "--vision-data-path", "/nowhere/mnist"], "/nowhere/mnist"),
    (["--moe-mixture-layers", "a,b"], "--moe-mixture-layers takes comma-separated layer indices"),
    (["--max-epoch", "9"], "--max-epoch must be <= 4 (the stream's stages); got 9"),
])
def test_bad_vision_flags_name_the_flag(extra, needle):
    from fairseq import tasks

    cfg = parse(*extra)
    with pytest.raises(SystemExit) as caught:
        tasks.setup_task(cfg.task)
    message = str(caught.value.code)
    assert message.startswith("fairseq-alma: error:") and needle in message and "\n" not in message


def test_wrong_arch_criterion_and_resume_flags_are_refused():
    from fairseq import tasks

    cfg = parse(arch="transformer_lm", criterion="cross_entropy")
    task = tasks.setup_task(cfg.task)
    with pytest.raises(SystemExit, match="--arch transformer_lm is not a vision model"):
        task.build_model(cfg.model)
    with pytest.raises(SystemExit, match="--criterion cross_entropy does not apply to vision"):
        task.build_criterion(cfg.criterion)
    # a checkpoint written with other stream flags is refused on resume, naming them
    saved = tasks.setup_task(parse("--wait", "2", "--vision-width", "4").task)
    state = saved.build_model(None).state_dict()
    model = tasks.setup_task(parse().task).build_model(None)
    with pytest.raises(SystemExit) as caught:
        model.load_state_dict(state)
    message = str(caught.value.code)
    assert "--vision-width 4 (now 8)" in message and "--wait 2 (now 1)" in message
