"""Vision streams through ``fairseq-train --task alma_stream --vision-dataset``: a thin entry into
the vision runner, the code the sweep runs too (same records), checkpoints that resume the
learner, kill -9 and SIGUSR1 then the same command continue to identical records, 2 ranks write
the single-process records, and bad flags end in one line naming the flag.  Embedded digits, an
MLP of width 8, B = 4."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from lm_fixtures import run, tool, wait_for

REPO = Path(__file__).resolve().parent.parent
USER_DIR = str(REPO / "fairseq_alma")
B, WIDTH, EPOCHS = 4, 8, 20


def vision_cmd(save_dir: Path, *extra: str, method: str = "sm", wait: int = 1) -> list[str]:
    return [
        tool("fairseq-train"), "digits", "--user-dir", USER_DIR, "--task", "alma_stream",
        "--vision-dataset", "digits", "--arch", "alma_vision",
        "--vision-method", method, "--vision-width", str(WIDTH), "--num-megabatches", str(B),
        "--wait", str(wait), "--epochs-per-stage", str(EPOCHS), "--batch-size", "128",
        "--save-dir", str(save_dir), "--cpu", "--num-workers", "0",
        "--log-format", "simple", "--seed", "1", *extra,
    ]


def in_process(method: str, wait: int | str, save_dir: Path, epochs: int = EPOCHS) -> list[dict]:
    """The same stream through the sweep's in-process path (``run_vision_stream``)."""
    from fairseq_alma.stream.progress import StreamPlan
    from fairseq_alma.stream.run_dir import RunDirectory
    from fairseq_alma.vision.learners import LearnerSpec
    from fairseq_alma.vision.runner import VisionRun, run_vision_stream
    from fairseq_alma.vision.stage_trainer import StageTrainConfig

    torch.set_num_threads(1)
    run_spec = VisionRun(dataset="digits", data_path=None, plan=StreamPlan(B, wait),
                         learner=LearnerSpec(method, "mlp", WIDTH, seed=1),
                         training=StageTrainConfig(epochs=epochs, batch_size=128), seed=1)
    with RunDirectory.for_training(save_dir) as run_dir:
        return [r.to_json() for r in run_vision_stream(run_spec, run_dir)]


def comparable(records: list[dict]) -> list[dict]:
    """Records without the wall-clock field."""
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in records]


def load_state(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def read(save: Path) -> list[dict]:
    from fairseq_alma.stream.records import read_records

    return [r.to_json() for r in read_records(save / "stream.jsonl")]


@pytest.fixture(autouse=True)
def keep_signal_handlers():
    """Runs started in this process install SIGUSR1/SIGTERM handlers; keep pytest's own."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="module")
def sm_run(tmp_path_factory):
    save = tmp_path_factory.mktemp("vision") / "sm"
    proc = run(vision_cmd(save, "--keep-stage-checkpoints"))
    return save, proc.stdout + proc.stderr


@pytest.mark.slow
def test_sm_stream_equals_in_process_run_and_checkpoints_resume_the_learner(sm_run, tmp_path):
    save, log = sm_run
    records = read(save)
    assert [r["arrival"] for r in records] == list(range(B + 1))
    assert [r["trained"] for r in records] == [False] + [True] * B
    assert comparable(records) == comparable(in_process("sm", 1, tmp_path / "in_process"))
    assert records[-1]["test_error"] < records[0]["test_error"] - 0.3  # it learned the digits
    flops = [r["train_flops_cum"] for r in records]
    assert flops[0] == 0 < flops[1] < flops[2] < flops[3] < flops[4]
    assert "vision stream: 5 of 5 arrivals recorded" in log
    # no fairseq trainer was involved: no fairseq checkpoint, no placeholder optimizer
    assert "Saving checkpoint" not in log and "num. shared model params" not in log
    # a stage checkpoint holds the learner as it was after that stage
    from fairseq_alma.vision.data import load_vision_data
    from fairseq_alma.vision.learner_builder import build_learner
    from fairseq_alma.vision.learners import LearnerSpec
    from fairseq_alma.vision.stage_trainer import evaluate

    data = load_vision_data("digits")
    for stage in range(1, B + 1):
        state = load_state(save / f"checkpoint_stage{stage}.pt")
        spec = LearnerSpec(**{**state["learner"]["spec"], "mixture_layers": None})
        learner = build_learner(spec, data.input_shape, data.num_classes)
        learner.load_checkpoint_state({**state["learner"], "spec": spec})
        assert evaluate(learner, data.x_test, data.y_test).error == records[stage]["test_error"]
    assert load_state(save / "checkpoint_last.pt")["progress"] == state["progress"]


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
    assert comparable(records) == comparable(in_process("gmoe", 2, tmp_path / "in_process"))
    state = load_state(save / "checkpoint_last.pt")
    assert state["learner"]["spec"]["method"] == "gmoe" and set(state["stages"]) == {1, 2}
    assert not (save / "checkpoint_stage1.pt").exists()  # only with --keep-stage-checkpoints


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill9", "sigusr1"])
def test_interrupted_stream_continues_to_identical_records(sm_run, tmp_path, how):
    """kill -9, or SIGUSR1 (exit with the requeue status), after stage 1; the same command
    continues and every record and the final learner equal the uninterrupted run's."""
    from fairseq_alma.errors import REQUEUE_EXIT_STATUS

    reference, _ = sm_run
    save = tmp_path / "sm"
    cmd = vision_cmd(save)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    wait_for(save / "checkpoint_last.pt", proc)
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL if how == "kill9" else signal.SIGUSR1)
    out, _ = proc.communicate(timeout=600)
    if how == "sigusr1":
        assert proc.returncode == REQUEUE_EXIT_STATUS, out[-2000:]
        assert re.search(r"fairseq-alma: preempted (by SIGUSR1 before|in) stage \d", out), out[-2000:]
    assert len(read(save)) < B + 1, "the run finished before the signal; nothing was resumed"
    run(cmd)
    assert comparable(read(save)) == comparable(read(reference))
    assert not list(save.glob("*.tmp*")) and not list(save.glob(".*.tmp")), "a temporary file was left"
    a, b = load_state(save / "checkpoint_last.pt"), load_state(reference / "checkpoint_last.pt")
    assert a["learner"]["model"].keys() == b["learner"]["model"].keys()
    assert all(torch.equal(a["learner"]["model"][k], b["learner"]["model"][k]) for k in a["learner"]["model"])
    assert torch.equal(a["learner"]["generator"], b["learner"]["generator"])


@pytest.mark.slow
def test_two_data_parallel_ranks_write_the_single_process_records(sm_run, tmp_path):
    """Each gloo rank runs the same stream (same seeds); rank 0 alone writes the run dir."""
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


def test_wait_out_of_range_is_one_line(tmp_path):
    proc = run(vision_cmd(tmp_path / "bad", wait=B + 1), check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fairseq-alma: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-1500:]
    assert errors[0] == f"fairseq-alma: error: --wait must be in [1, {B}] (the stream's mega-batches); got {B + 1}"
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "bad" / "stream.jsonl").exists()


def parse(*extra: str, arch: str = "alma_vision"):
    """fairseq-train's own parsing of a vision command (plugin loaded), as its config."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_alma.fairseq_glue.user_dir import load_plugin

    load_plugin()
    argv = vision_cmd(Path("unused"))[1:] + list(extra)
    argv[argv.index("--arch") + 1] = arch
    if arch != "alma_vision":  # the learner's flags belong to --arch alma_vision's group
        for flag in ("--vision-dataset", "--vision-method", "--vision-width", "--num-megabatches",
                     "--epochs-per-stage"):
            del argv[argv.index(flag):argv.index(flag) + 2]
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
    (["--fp16"], "--fp16 does not apply to vision streams"),
    (["--vision-device", "cuda"] if not torch.cuda.is_available() else ["--vision-threads", "0"],
     "--vision-device cuda: no CUDA device" if not torch.cuda.is_available() else "--vision-threads"),
])
def test_bad_vision_flags_name_the_flag(extra, needle, tmp_path):
    from fairseq import tasks

    from fairseq_alma.errors import AlmaError, UsageError

    cfg = parse(*extra, "--save-dir", str(tmp_path / "run"))
    with pytest.raises(AlmaError) as caught:
        tasks.setup_task(cfg.task).build_model(cfg.model)
    message = str(caught.value)
    assert needle in message and "\n" not in message
    assert not (tmp_path / "run" / "stream.jsonl").exists()
    del UsageError


def test_wrong_arch_and_resume_with_other_flags_are_refused(tmp_path):
    from fairseq import tasks

    from fairseq_alma.errors import DataError, RunDirError, UsageError

    cfg = parse(arch="transformer_lm")  # a language-model stream: DATA must be alma-data-prep's
    with pytest.raises(DataError, match="digits/manifest.json: missing; prepare the data with alma-data-prep"):
        tasks.setup_task(cfg.task)
    with pytest.raises(UsageError, match="use it with --task alma_stream --vision-dataset"):
        tasks.get_task("alma_stream")  # noqa: B018 - the registry works
        from fairseq_alma.models.alma_vision import AlmaVisionFlags

        AlmaVisionFlags.build_model(cfg.model, None)
    # a run dir written with other stream flags is refused on resume, naming them
    save = tmp_path / "run"
    first = parse("--wait", "2", "--vision-width", "4", "--epochs-per-stage", "1", "--max-epoch", "1",
                  "--save-dir", str(save))
    with pytest.raises(SystemExit) as done:
        tasks.setup_task(first.task).build_model(first.model)
    assert done.value.code == 0 and (save / "checkpoint_last.pt").exists()
    again = parse("--epochs-per-stage", "1", "--save-dir", str(save))
    with pytest.raises(RunDirError) as caught:
        tasks.setup_task(again.task).build_model(again.model)
    message = str(caught.value)
    assert "settings.--wait: 2 -> 1" in message and "settings.learner.width: 4 -> 8" in message
    assert "--restart-stream" in message


@pytest.mark.slow
def test_wait_auto_records_its_decisions_and_resumes_them_after_kill9(tmp_path):
    """``--wait auto``: one decision per arrival in stream.jsonl, the schedule it makes, the
    sweep's in-process path gives the same; kill -9 after the first arrival's checkpoint and
    the same command continues to identical decisions and records."""
    reference, save = tmp_path / "reference", tmp_path / "killed"
    slow = ("--epochs-per-stage", "150")  # a stage long enough to be killed inside
    cmd = vision_cmd(save, *slow, wait="auto")
    run(vision_cmd(reference, *slow, wait="auto"))
    records = read(reference)
    decisions = [r.get("decision") for r in records]
    assert decisions[0] is None and all(d["arrival"] == t for t, d in enumerate(decisions) if t)
    stages = [0]
    for decision in decisions[1:]:
        stages.append(stages[-1] + decision["train"])
        assert decision["pending"] >= 1 and decision["remaining"] == B - decision["arrival"]
        assert decision["cost_train_now"] > 0 and decision["cost_wait"] > 0
    assert [r["stage"] for r in records] == stages and stages[-1] >= 1
    assert [r["trained"] for r in records[1:]] == [d["train"] for d in decisions[1:]]
    assert comparable(records) == comparable(in_process("sm", "auto", tmp_path / "in_process", 150))
    assert load_state(reference / "checkpoint_last.pt")["settings"]["--wait"] == "auto"

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    wait_for(save / "checkpoint_last.pt", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=600)
    assert len(read(save)) < B + 1, "the run finished before the signal; nothing was resumed"
    run(cmd)
    assert comparable(read(save)) == comparable(records)


def test_data_given_twice_and_differently_is_refused(tmp_path):
    """DATA and --vision-data-path naming two existing datasets: --vision-data-path won without
    a word.  DATA as a placeholder (``digits``, a name that is not there) stays accepted."""
    from fairseq import tasks

    from fairseq_alma.errors import UsageError

    (tmp_path / "a.npz").write_bytes(b"")
    cfg = parse("--vision-dataset", "npz", "--vision-data-path", str(tmp_path / "b.npz"),
                "--save-dir", str(tmp_path / "run"))
    cfg.task.data = str(tmp_path / "a.npz")
    with pytest.raises(UsageError, match=r"--vision-data-path .*b.npz and fairseq-train's DATA "
                                         r".*a.npz name different data"):
        tasks.setup_task(cfg.task).build_model(cfg.model)
    assert not (tmp_path / "run" / "stream.jsonl").exists()


def test_the_backbone_follows_the_data_set_unless_given():
    """``--vision-dataset cifar10`` alone trained the MLP with the paper's CIFAR-10 optimizer
    and augmentation; ``--vision-arch auto`` (the default) is the paper's backbone (§5)."""
    from fairseq_alma.fairseq_glue.vision_entry import vision_run

    def arch(*extra: str) -> str:
        cfg = parse(*extra)
        return vision_run(cfg.task, cfg.model, machine_checks=False).learner.arch

    cifar = ("--vision-dataset", "cifar10", "--vision-data-path", "/nowhere/cifar")
    assert arch() == "mlp" and arch(*cifar) == "vgg"
    assert arch(*cifar, "--vision-arch", "mlp") == "mlp"
