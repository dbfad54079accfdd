"""Misuse and faults, through the real console commands: each case gives a one-line error that
names the file or flag and what to do, a nonzero exit status, and leaves every file it was
given exactly as it was (hashed before and after).  Never a traceback, never exit 0.

Every case fails before any training or model build, so it costs one start of its command:
console-script cases (fairseq-train, alma-train) run two at a time, each in its own fork of a
process that already imported torch and fairseq (``forked_commands``: the script's own entry
point, atexit handlers included, without seven seconds of imports per case); the other
commands' cases meanwhile in this process through their console ``main(argv)``
(``IN_PROCESS``).  Fixtures: one tiny prepared stream, one finished 2-stage run on it, and
small vision .npz files.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import shutil
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from forked_commands import ForkedCommands
from lm_fixtures import prepare_stream, run, tool

REPO = Path(__file__).resolve().parent.parent
USER_DIR = str(REPO / "fairseq_alma")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
LM_FLAGS = [
    "--user-dir", USER_DIR, "--task", "alma_stream", "--arch", "switch_transformer_lm_tiny",
    "--moe-experts", "2", "--criterion", "switch_cross_entropy", "--optimizer", "adam", "--lr",
    "0.003", "--lr-scheduler", "alma_stage_linear", "--warmup-updates", "1",
    "--updates-per-stage", "3", "--tokens-per-sample", "32", "--batch-size", "8", "--cpu",
    "--num-workers", "0", "--seed", "1", "--dropout", "0", "--log-format", "simple",
]
VISION_FLAGS = [
    "--user-dir", USER_DIR, "--task", "alma_stream", "--arch", "alma_vision", "--vision-width",
    "4", "--num-megabatches", "2", "--epochs-per-stage", "1", "--batch-size", "32", "--cpu",
]
HOLD_LOCK = ("import sys, time\nfrom fairseq_alma.stream.lock import RunLock\n"
             "RunLock(sys.argv[1]).acquire()\nprint('held', flush=True)\ntime.sleep(120)\n")


@dataclass
class Ctx:
    """What every case may use: a prepared stream, a finished run on it, and a scratch dir."""

    data: Path
    other_data: Path  # another stream: same sizes, another seed
    done: Path  # a finished 2-stage run (module-scoped: copy before changing)
    tmp: Path

    def copy(self, what: Path, name: str) -> Path:
        target = self.tmp / name
        shutil.copytree(what, target, symlinks=True)
        return target


@dataclass
class Case:
    """argv from ``setup(ctx)``; ``watch`` are the files or dirs that must not change."""

    name: str
    setup: Callable[[Ctx], tuple[list[str], list[Path]]]
    needle: str  # regex the one error line must match
    status: int = 2
    prog: str = "fairseq-alma"
    env: dict[str, str] = field(default_factory=dict)


def lm(ctx: Ctx, data: Path | str, save: Path, *extra: str) -> list[str]:
    return [tool("fairseq-train"), str(data), *LM_FLAGS, "--save-dir", str(save), *extra]


def dense_lm(ctx: Ctx, arch: str, *extra: str) -> list[str]:
    """A training command of one of fairseq's own LMs (``arch``) on the stream, into a new --save-dir."""
    argv = lm(ctx, ctx.data, ctx.tmp / "r", *extra)
    del argv[argv.index("--moe-experts"):argv.index("--moe-experts") + 2]
    argv[argv.index("switch_transformer_lm_tiny")] = arch
    argv[argv.index("switch_cross_entropy")] = "cross_entropy"
    return argv


def fresh_run_case(flags: tuple[str, ...], needle: str) -> Case:
    """A training command on the stream, into a new --save-dir, with ``flags`` added."""
    return Case(" ".join(flags), lambda c: (lm(c, c.data, c.tmp / "r", *flags), []), needle)


def scorer(ctx: Ctx, prog: str, checkpoint: Path, *extra: str) -> list[str]:
    """One of fairseq's scoring commands (``prog``) of ``checkpoint`` on the stream."""
    return [tool(prog), str(ctx.data), "--user-dir", USER_DIR, "--path", str(checkpoint), "--cpu", *extra]


def eval_lm(ctx: Ctx, *extra: str) -> list[str]:
    """fairseq-eval-lm of the finished run's last checkpoint on the stream's eval split
    (``extra`` last: fairseq's parser keeps a flag's last value)."""
    return scorer(ctx, "fairseq-eval-lm", ctx.done / "checkpoint_last.pt", "--gen-subset", "eval",
                  "--tokens-per-sample", "32", "--batch-size", "8", *extra)


def vision(ctx: Ctx, data: str, save: Path, *extra: str) -> list[str]:
    return [tool("fairseq-train"), data, *VISION_FLAGS, "--save-dir", str(save), *extra]


def without(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value."""
    at = argv.index(flag)
    return argv[:at] + argv[at + 2:]


def flip_byte(path: Path, offset: int = 40) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


def npz(ctx: Ctx, name: str, **changes: np.ndarray) -> str:
    rng = np.random.default_rng(0)
    arrays = {"x_train": rng.random((40, 6)), "y_train": np.arange(40) % 3,
              "x_test": rng.random((9, 6)), "y_test": np.arange(9) % 3} | changes
    path = ctx.tmp / f"{name}.npz"
    np.savez(path, **arrays)
    return str(path)


def data_copy(ctx: Ctx, name: str, change: Callable[[Path], None]) -> Path:
    copy = ctx.copy(ctx.data, name)
    change(copy)
    return copy


def reordered_dict(path: Path) -> None:
    lines = (path / "dict.txt").read_text().splitlines()
    (path / "dict.txt").write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["dictionary"]["sha256"] = hashlib.sha256((path / "dict.txt").read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))


def damaged_checkpoint(ctx: Ctx, name: str, truncate: bool) -> Path:
    save = ctx.copy(ctx.done, name)
    last = save / "checkpoint_last.pt"
    if truncate:
        last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    else:
        flip_byte(last, last.stat().st_size // 2)
    return save


def other_run_checkpoint(ctx: Ctx) -> Path:
    save = ctx.copy(ctx.done, "mixed")
    state = torch.load(save / "checkpoint_stage1.pt", weights_only=False)
    state["alma"]["run"] = "0" * 16
    torch.save(state, save / "checkpoint_stage1.pt")
    return save


def _drifting(path: Path) -> None:
    """The stream as ``alma-data-prep --order given`` would describe it."""
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "order": "given"}))


def bad_config(ctx: Ctx, text: str) -> Path:
    path = ctx.tmp / "bad.yaml"
    path.write_text(text)
    return path


LM_CASES = [
    Case("no manifest", lambda c: (lm(c, c.tmp, c.tmp / "r"), []), r"manifest.json: missing; prepare the data with alma-data-prep"),
    Case("manifest not json", lambda c: (lm(c, data_copy(c, "d", lambda p: (p / "manifest.json").write_text("{")), c.tmp / "r"), [c.tmp / "d"]),
         r"manifest.json: unreadable .*re-run alma-data-prep"),
    Case("dictionary swapped", lambda c: (lm(c, data_copy(c, "d", lambda p: shutil.copy(c.other_data / "dict.txt", p / "dict.txt")), c.tmp / "r"), [c.tmp / "d"]),
         r"dict.txt: sha256 differs from .*manifest.json"),
    Case("shard truncated", lambda c: (lm(c, data_copy(c, "d", lambda p: (p / "megabatch1.bin").write_bytes((p / "megabatch1.bin").read_bytes()[:-8])), c.tmp / "r"), [c.tmp / "d"]),
         r"megabatch1.bin: \d+ bytes, .* says \d+ \(truncated or replaced\)"),
    Case("shard missing", lambda c: (lm(c, data_copy(c, "d", lambda p: (p / "megabatch0.idx").unlink()), c.tmp / "r"), [c.tmp / "d"]),
         r"megabatch0.idx: missing \(listed in .*manifest.json\)"),
    Case("shard byte flipped", lambda c: (lm(c, data_copy(c, "d", lambda p: flip_byte(p / "megabatch0.bin")), c.tmp / "r"), [c.tmp / "d"]),
         r"megabatch0.bin: sha256 differs from .*manifest.json"),
    Case("wait 0", lambda c: (lm(c, c.data, c.tmp / "r", "--wait", "0"), []), r"--wait must be in \[1, 2\]"),
    Case("wait > B", lambda c: (lm(c, c.data, c.tmp / "r", "--wait", "3"), []), r"--wait must be in \[1, 2\] \(the stream's mega-batches\); got 3"),
    Case("no updates", lambda c: (lm(c, c.data, c.tmp / "r", "--updates-per-stage", "0"), []), r"--updates-per-stage must be >= 1"),
    Case("max-epoch > stages", lambda c: (lm(c, c.data, c.tmp / "r", "--max-epoch", "5"), []), r"--max-epoch must be <= 2"),
    Case("compiled kernel without a C compiler", lambda c: (lm(c, c.data, c.tmp / "r", "--moe-expert-kernel", "compiled"), []),
         r"--moe-expert-kernel compiled: no C compiler \(no-such-cc or gcc\) on PATH.*--moe-expert-kernel batched",
         env={"CC": "no-such-cc", "PATH": "/nonexistent"}),
    Case("bad stop-after-stage", lambda c: (lm(c, c.data, c.tmp / "r"), []), r"ALMA_STOP_AFTER_STAGE must be a stage number", env={"ALMA_STOP_AFTER_STAGE": "first"}),
    Case("growth without slots", lambda c: (lm(c, c.data, c.tmp / "r", "--grow-experts", "2"), []), r"--moe-max-experts must be >= 4"),
    Case("growth not integers", lambda c: (lm(c, c.data, c.tmp / "r", "--grow-experts", "two"), []), r"--grow-experts/--grow-at-stages take comma-separated integers"),
    Case("growth with expert parallelism", lambda c: (lm(c, c.data, c.tmp / "r", "--moe-max-experts", "4", "--grow-experts", "2", "--moe-expert-parallel-size", "2", "--distributed-world-size", "2", "--distributed-backend", "gloo", "--distributed-init-method", "tcp://127.0.0.1:9", "--distributed-rank", "0", "--distributed-no-spawn", "--ddp-backend", "legacy_ddp"), [c.tmp]),
         r"--grow-experts does not support --moe-expert-parallel-size > 1"),
    Case("growth stages without growth", lambda c: (lm(c, c.data, c.tmp / "r", "--moe-max-experts", "4", "--grow-at-stages", "2"), [c.tmp]),
         r"--grow-at-stages 2 without --grow-experts grows nothing"),
    Case("growth at stage 1", lambda c: (lm(c, c.data, c.tmp / "r", "--moe-max-experts", "4", "--grow-experts", "2", "--grow-at-stages", "1"), []),
         r"--grow-at-stages must list stages in \[2, 2\]"),
    Case("no experts", lambda c: (lm(c, c.data, c.tmp / "r", "--moe-experts", "0"), []), r"--moe-experts must be an integer >= 1"),
    Case("capacity 0", lambda c: (lm(c, c.data, c.tmp / "r", "--capacity-factor", "0"), []), r"--capacity-factor must be > 0"),
    Case("moe-freq 0", lambda c: (lm(c, c.data, c.tmp / "r", "--moe-freq", "0"), []), r"--moe-freq must be an integer >= 1"),
    Case("moe-freq > layers", lambda c: (lm(c, c.data, c.tmp / "r", "--moe-freq", "3"), []), r"--moe-freq 3 .*2 .*layers"),
    Case("bf16 on CPU", lambda c: (lm(c, c.data, c.tmp / "r", "--bf16"), []), r"--bf16 trains on CUDA GPUs only .*drop --bf16"),
    Case("memory-efficient bf16 on CPU", lambda c: (lm(c, c.data, c.tmp / "r", "--memory-efficient-bf16"), []),
         r"--memory-efficient-bf16 trains on CUDA GPUs only"),
    Case("bf16 with fp16", lambda c: (lm(c, c.data, c.tmp / "r", "--bf16", "--fp16"), []), r"--bf16 and --fp16 are two precisions: use one"),
    # what fairseq's trainer and optimizer wrappers refuse only on a GPU, after the run directory was taken
    Case("fp16 with amp", lambda c: (lm(c, c.data, c.tmp / "r", "--fp16", "--amp"), []), r"--fp16 with --amp: fairseq trains one of them .*drop one$"),
    Case("bf16 update-freq list", lambda c: (lm(c, c.data, c.tmp / "r", "--bf16", "--update-freq", "1,2"), []),
         r"--bf16 with an --update-freq per stage needs --fp16-scale-window N"),
    Case("fp16 flat adagrad", lambda c: (lm(c, c.data, c.tmp / "r", "--fp16", "--optimizer", "adagrad"), []),
         r"--fp16 keeps one flat fp32 master copy, which --optimizer adagrad cannot step; add --fp16-no-flatten-grads"),
    Case("memory-efficient fp16 sgd", lambda c: (lm(c, c.data, c.tmp / "r", "--memory-efficient-fp16", "--optimizer", "sgd"), []),
         r"--memory-efficient-fp16 cannot wrap --optimizer sgd .*use --fp16, or --optimizer adam$"),
    Case("bf16 with amp", lambda c: (lm(c, c.data, c.tmp / "r", "--amp", "--memory-efficient-bf16"), []),
         r"--memory-efficient-bf16 and --amp are two precisions: use one"),
    Case("tpu", lambda c: (lm(c, c.data, c.tmp / "r", "--tpu"), []), r"--tpu \(fairseq's TPU mode\) needs torch_xla"),
    Case("fsdp in a stream", lambda c: (lm(c, c.data, c.tmp / "r", "--ddp-backend", "fully_sharded"), []),
         r"--ddp-backend fully_sharded cannot train an alma_stream run: .*use --ddp-backend pytorch_ddp"),
    Case("zero sharding of flat fp16", lambda c: (lm(c, c.data, c.tmp / "r", "--zero-sharding", "os", "--fp16"), []),
         r"--zero-sharding os cannot shard --fp16's flat fp32 copy"),
    Case("wrong criterion", lambda c: (lm(c, c.data, c.tmp / "r", "--criterion", "cross_entropy"), []), r"--criterion cross_entropy ignores the Switch balance loss"),
    Case("warmup >= budget", lambda c: (lm(c, c.data, c.tmp / "r", "--warmup-updates", "3"), []), r"--warmup-updates must be in \[0, 3\)"),
    Case("experts not divisible", lambda c: (lm(c, c.data, c.tmp / "r", "--moe-expert-parallel-size", "3"), []), r"--moe-expert-parallel-size"),
    Case("another run in save-dir", lambda c: (lm(c, c.data, c.copy(c.done, "r"), "--moe-experts", "4"), [c.tmp / "r"]),
         r"holds another run \(config.model.moe_experts: 2 -> 4\); use another --save-dir, or add --restart-stream"),
    Case("other data in save-dir", lambda c: (lm(c, c.other_data, c.copy(c.done, "r")), [c.tmp / "r"]), r"holds another run \(data\."),
    Case("run.json unreadable", lambda c: (lm(c, c.data, _with(c, "run.json", "{")), [c.tmp / "r"]),
         r"run.json: unreadable .*--restart-stream"),
    Case("checkpoint truncated", lambda c: (lm(c, c.data, damaged_checkpoint(c, "r", True)), [c.tmp / "r"]),
         r"checkpoint_last.pt: not a readable checkpoint .*move it aside and run the same command"),
    Case("checkpoint damaged", lambda c: (lm(c, c.data, damaged_checkpoint(c, "r", False)), [c.tmp / "r"]),
         r"checkpoint_last.pt: damaged \(record .* fails its CRC check\); move it aside"),    Case("tokens-per-sample 0", lambda c: (lm(c, c.data, c.tmp / "r", "--tokens-per-sample", "0"), []), r"--tokens-per-sample must be >= 1 .*got 0"),
    Case("tokens-per-sample negative", lambda c: (lm(c, c.data, c.tmp / "r", "--tokens-per-sample", "-4"), []), r"--tokens-per-sample must be >= 1 .*got -4"),
    Case("tokens-per-sample beyond the model", lambda c: (lm(c, c.data, c.tmp / "r", "--tokens-per-sample", "64", "--max-target-positions", "32"), []),
         r"--tokens-per-sample 64 .*--max-target-positions 32"),
    Case("wait auto with scaled updates", lambda c: (lm(c, c.data, c.tmp / "r", "--wait", "auto", "--scale-updates-by-wait"), []),
         r"--wait auto with --scale-updates-by-wait: not supported \(every stage gets --updates-per-stage updates"),
    Case("wait auto with growth", lambda c: (lm(c, c.data, c.tmp / "r", "--wait", "auto", "--moe-max-experts", "4", "--grow-experts", "2"), []),
         r"--wait auto with --grow-experts: not supported"),
    Case("wait auto with a per-stage update-freq", lambda c: (lm(c, c.data, c.tmp / "r", "--wait", "auto", "--update-freq", "1,2"), []),
         r"--wait auto with --update-freq: not supported \(a per-stage list"),
    Case("wait auto scored on its decisions' split", lambda c: (lm(c, c.data, c.tmp / "r", "--wait", "auto", "--eval-subset", "valid"), []),
         r"--wait auto with --eval-subset valid: its decisions read 'valid', which would then be scored"),
    Case("wait auto with partial replay", lambda c: (lm(c, c.data, c.tmp / "r", "--wait", "auto", "--replay-ratio", "0.25"), []),
         r"--wait auto with --replay-ratio: not supported"),
    Case("wait auto on a drifting stream", lambda c: (lm(c, data_copy(c, "d", _drifting), c.tmp / "r", "--wait", "auto"), [c.tmp / "d"]),
         r"--wait auto on a stream prepared with --order given: not supported"),
    Case("wait not a number", lambda c: (lm(c, c.data, c.tmp / "r", "--wait", "soon"), []),
         r"argument --wait: a waiting time is a whole number of mega-batches >= 1 or auto, got 'soon'", prog="fairseq-train"),
    Case("batch-size 0", lambda c: (lm(c, c.data, c.tmp / "r", "--batch-size", "0"), []), r"--batch-size must be >= 1 .*got 0"),
    Case("batch-size negative", lambda c: (lm(c, c.data, c.tmp / "r", "--batch-size", "-8"), []), r"--batch-size must be >= 1 .*got -8"),
    Case("batch-size-valid 0", lambda c: (lm(c, c.data, c.tmp / "r", "--batch-size-valid", "0"), []), r"--batch-size-valid must be >= 1 .*got 0"),
    Case("max-tokens 0", lambda c: (lm(c, c.data, c.tmp / "r", "--max-tokens", "0"), []), r"--max-tokens must be >= 1 .*got 0"),
    Case("max-tokens below a block", lambda c: (lm(c, c.data, c.tmp / "r", "--max-tokens", "16"), []), r"--max-tokens 16 .*--tokens-per-sample 32"),
    Case("no batch size", lambda c: (without(lm(c, c.data, c.tmp / "r"), "--batch-size"), []),
         r"--batch-size N or --max-tokens N is required"),
    Case("vision without batch size", lambda c: (without(vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits"), "--batch-size"), []),
         r"--batch-size N or --max-tokens N is required"),
    Case("valid-subset without fairseq validation", lambda c: (lm(c, c.data, c.tmp / "r", "--valid-subset", "eval"), []),
         r"--valid-subset eval sets fairseq's own validation, which an alma_stream run does not run: .*--eval-subset eval"),
    Case("valid-subset the stream lacks", lambda c: (lm(c, c.data, c.tmp / "r", "--fairseq-validation", "--valid-subset", "nope"), []),
         r"the stream has no split 'nope' .*it holds .*eval, valid and megabatch0\.\.1"),
    Case("eval-lm of the test split a stream lacks", lambda c: (scorer(c, "fairseq-eval-lm", c.done / "checkpoint_last.pt", "--tokens-per-sample", "32"), [c.done]),
         r"Dataset not found: test .*an ALMA stream holds eval .*--gen-subset eval"),
    Case("world size with no launcher", lambda c: (lm(c, c.data, c.tmp / "r", "--distributed-world-size", "64"), []),
         r"--distributed-world-size 64: fairseq would start one process per GPU of this machine, which has \d+"),
    Case("dropout above 1", lambda c: (lm(c, c.data, c.tmp / "r", "--dropout", "1.5"), []), r"--dropout must be in \[0, 1\] .*got 1.5"),
    Case("eval-lm of a checkpoint that is not there", lambda c: (scorer(c, "fairseq-eval-lm", c.tmp / "nope.pt", "--gen-subset", "eval"), []),
         r"Model file not found: .*nope\.pt; give the path of a checkpoint file \(--path\)"),
    Case("eval-lm of blocks longer than the model", lambda c: (eval_lm(c, "--tokens-per-sample", "64"), [c.done]),
         r"of the \d+ blocks to score are longer than the model's 32 positions .*\(all of them: nothing would be scored\): "
         r"pass --tokens-per-sample 32 or less"),
    Case("eval-lm context window as long as the block", lambda c: (eval_lm(c, "--context-window", "32"), [c.done]),
         r"--context-window 32 leaves no token to score in blocks of --tokens-per-sample 32: pass a window below 32"),
    Case("eval-lm negative softmax batch", lambda c: (eval_lm(c, "--softmax-batch", "-5"), [c.done]), r"--softmax-batch must be >= 0 \(got -5\)"),
    Case("eval-lm negative workers", lambda c: (eval_lm(c, "--num-workers", "-1"), [c.done]), r"--num-workers must be >= 0 \(got -1\)"),
    Case("eval-lm negative context window", lambda c: (eval_lm(c, "--context-window", "-4"), [c.done]), r"--context-window must be >= 0 \(got -4\)"),
    Case("eval-lm max-tokens below a block", lambda c: (eval_lm(c, "--max-tokens", "10"), [c.done]),
         r"--max-tokens 10 holds no block of --tokens-per-sample 32; use --max-tokens >= 32"),
    Case("eval-lm post-process it cannot do", lambda c: (eval_lm(c, "--post-process", "sentencepiece"), [c.done]),
         r"--post-process sentencepiece: fairseq-eval-lm merges sub-words into words only for subword_nmt"),
    Case("eval-lm model overrides not a dict", lambda c: (eval_lm(c, "--model-overrides", "eval_capacity_factor=2"), [c.done]),
         r"--model-overrides 'eval_capacity_factor=2' is not a Python dict of model options"),
    Case("eval-lm under an evaluation capacity, other batches", lambda c: (
        eval_lm(c, "--batch-size", "2", "--model-overrides", "{'eval_capacity_factor': 1.0}"), [c.done]),
         r"--batch-size 2: \S+checkpoint_last.pt evaluates with --eval-capacity-factor 1, so its perplexity depends "
         r"on how the tokens are batched; score it with its own evaluation batching \(pass --batch-size 8\)$"),
    Case("validate under an evaluation capacity, no batch size", lambda c: (
        scorer(c, "fairseq-validate", c.done / "checkpoint_stage1.pt", "--valid-subset", "eval", "--task", "alma_stream",
               "--tokens-per-sample", "32", "--max-tokens", "96", "--model-overrides", "{'eval_capacity_factor': 2.0}"), [c.done]),
         r"--max-tokens 96 \(3 blocks of 32 tokens a batch\): \S+checkpoint_stage1.pt evaluates with --eval-capacity-factor 2"),
    Case("validate blocks longer than the model, skipping them", lambda c: (
        scorer(c, "fairseq-validate", c.done / "checkpoint_stage1.pt", "--valid-subset", "eval", "--task", "alma_stream", "--tokens-per-sample", "48",
               "--batch-size", "8", "--skip-invalid-size-inputs-valid-test"), [c.done]),
         r"of the \d+ blocks to score are longer than the model's 32 positions .*they would be left out of the perplexity"),
    Case("validate without a task", lambda c: (scorer(c, "fairseq-validate", c.done / "checkpoint_stage1.pt", "--valid-subset", "eval"), [c.done]),
         r"--task is required: the task the checkpoint was trained with, e.g. --task alma_stream"),
    Case("eval-lm of a vision run's checkpoint", lambda c: (scorer(c, "fairseq-eval-lm", _vision_run(c) / "checkpoint_last.pt", "--gen-subset", "eval"), [c.tmp / "v"]),
         r"checkpoint_last.pt: a vision stream's checkpoint \(--arch alma_vision\), not a language model's"),
    Case("language model into a vision run's directory", lambda c: (lm(c, c.data, _vision_run(c)), [c.tmp / "v"]),
         r"holds another run \(a vision stream's; this command trains a language-model stream\)"),
    Case("eval-lm of a run directory", lambda c: (scorer(c, "fairseq-eval-lm", c.done, "--gen-subset", "eval"), [c.done]),
         r"a directory, not a checkpoint file; give a checkpoint in it \(e.g. .*checkpoint_last.pt\)"),
    Case("eval-lm of run.json", lambda c: (scorer(c, "fairseq-eval-lm", c.done / "run.json", "--gen-subset", "eval"), [c.done]),
         r"run.json: not a torch checkpoint \(a JSON file\); give a checkpoint file"),
    Case("max-tokens-valid below a block", lambda c: (lm(c, c.data, c.tmp / "r", "--max-tokens-valid", "10"), []),
         r"--max-tokens-valid 10 holds no block of --tokens-per-sample 32; use --max-tokens-valid >= 32 or --batch-size-valid"),
    Case("update-freq 0", lambda c: (lm(c, c.data, c.tmp / "r", "--update-freq", "0"), []), r"--update-freq must be >= 1 .*got 0"),
    Case("update-freq negative", lambda c: (lm(c, c.data, c.tmp / "r", "--update-freq", "-2"), []), r"--update-freq must be >= 1 .*got -2"),
    Case("required-batch-size-multiple 0", lambda c: (lm(c, c.data, c.tmp / "r", "--required-batch-size-multiple", "0"), []),
         r"--required-batch-size-multiple must be >= 1"),
    Case("fp16 on CPU", lambda c: (lm(c, c.data, c.tmp / "r", "--fp16"), []), r"--fp16 trains on CUDA GPUs only .*drop --fp16"),
    Case("memory-efficient fp16 on CPU", lambda c: (lm(c, c.data, c.tmp / "r", "--memory-efficient-fp16"), []), r"--memory-efficient-fp16 trains on CUDA GPUs only"),
    Case("amp on CPU", lambda c: (lm(c, c.data, c.tmp / "r", "--amp"), []), r"--amp trains on CUDA GPUs only"),
    Case("zero sharding in one process", lambda c: (lm(c, c.data, c.tmp / "r", "--zero-sharding", "os"), []),
         r"--zero-sharding os shards the optimizer state over the processes of a run; this one has 1"),
    Case("expert parallel above world size", lambda c: (lm(c, c.data, c.tmp / "r", "--moe-expert-parallel-size", "2"), []),
         r"--moe-expert-parallel-size 2 must divide the number of processes \(1\)"),
    Case("expert parallel 0", lambda c: (lm(c, c.data, c.tmp / "r", "--moe-expert-parallel-size", "0"), []), r"--moe-expert-parallel-size must be an integer >= 1"),
    Case("expert parallel not dividing experts", lambda c: (lm(c, c.data, c.tmp / "r", "--moe-experts", "3", "--moe-expert-parallel-size", "2"), []),
         r"--moe-experts \(3\) must be divisible by --moe-expert-parallel-size \(2\)"),
    Case("max-update cuts the stream", lambda c: (lm(c, c.data, c.tmp / "r", "--max-update", "4"), []),
         r"--max-update 4 stops the stream before its end \(2 stages x 3 updates = 6\)"),
    Case("max-epoch negative", lambda c: (lm(c, c.data, c.tmp / "r", "--max-epoch", "-1"), []), r"--max-epoch must be >= 0 \(got -1\)"),
    Case("save-dir is a file", lambda c: (lm(c, c.data, c.tmp / "x.txt"), [c.tmp / "x.txt"]), r"--save-dir .*x.txt: exists and is not a directory"),
    Case("save-dir under a file", lambda c: (lm(c, c.data, c.tmp / "x.txt" / "r"), [c.tmp / "x.txt"]), r"--save-dir .*x.txt/r: .*x.txt is a file"),
    Case("save-dir not writable", lambda c: (lm(c, c.data, Path("/proc/alma-run")), []),
         r"--save-dir /proc/alma-run: cannot write in /proc .*give a path in a writable folder"),
    Case("log-file in a missing folder", lambda c: (lm(c, c.data, c.tmp / "r", "--log-file", str(c.tmp / "no" / "x.log")), []),
         r"--log-file .*no/x.log: its folder .*no does not exist \(fairseq creates none\); create it"),
    Case("log-file a directory", lambda c: (lm(c, c.data, c.tmp / "r", "--log-file", str(c.tmp)), []),
         r"--log-file .*: is a directory; give the path of a file to write"),
    Case("eval subset missing", lambda c: (lm(c, c.data, c.tmp / "r", "--eval-subset", "test"), []), r"--eval-subset test: .*test.bin.* missing"),
    Case("checkpoint of another architecture", lambda c: (lm(c, c.data, _last_only(c), "--decoder-layers", "4"), [c.tmp / "r"]),
         r"checkpoint_last.pt holds another model \(model.decoder_layers: 2 -> 4\); move it aside"),
    Case("fairseq validation turned on and off", lambda c: (lm(c, c.data, c.tmp / "r", "--fairseq-validation", "--disable-validation"), []),
         r"--fairseq-validation with --disable-validation: one runs fairseq's own validation"),
    Case("checkpoint of stock fairseq-train", lambda c: (lm(c, c.data, _last_only(c, task="language_modeling")), [c.tmp / "r"]),
         r"checkpoint_last.pt is a checkpoint of a --task language_modeling run, not of a stream; move it aside"),
    Case("checkpoint of another seed", lambda c: (lm(c, c.data, _last_only(c, "stream.jsonl"), "--seed", "2"), [c.tmp / "r"]),
         r"checkpoint_last.pt holds a run with other settings \(common.seed: 1 -> 2"),
    Case("another run's stage checkpoint", lambda c: (lm(c, c.data, _only(c, "checkpoint_stage1.pt")), [c.tmp / "r"]),
         r"checkpoint_stage1.pt has neither run.json nor stream.jsonl beside it"),
    Case("checkpoint of another expert count", lambda c: (lm(c, c.data, _last_only(c), "--moe-experts", "4"), [c.tmp / "r"]),
         r"checkpoint_last.pt .*another model .*moe_experts: 2 -> 4.*move it aside"),
    Case("DATA of two directories", lambda c: (lm(c, f"{c.data}:{c.other_data}", c.tmp / "r"), [c.data, c.other_data]),
         r"DATA .*:.*: an alma_stream run reads one prepared stream; give one directory"),
    Case("DATA is a file", lambda c: (lm(c, c.tmp / "x.txt", c.tmp / "r"), [c.tmp / "x.txt"]), r"DATA .*x.txt: not a directory; give the --out directory of alma-data-prep"),
    Case("wait negative", lambda c: (lm(c, c.data, c.tmp / "r", "--wait", "-1"), []), r"--wait must be in \[1, 2\]"),
    Case("updates-per-stage negative", lambda c: (lm(c, c.data, c.tmp / "r", "--updates-per-stage", "-3"), []), r"--updates-per-stage must be >= 1"),
    Case("replay-ratio 1", lambda c: (lm(c, c.data, c.tmp / "r", "--replay-ratio", "1"), []), r"--replay-ratio"),
    Case("replay with replay-ratio", lambda c: (lm(c, c.data, c.tmp / "r", "--replay", "--replay-ratio", "0.5"), []), r"--replay-ratio"),
    Case("capacity negative", lambda c: (lm(c, c.data, c.tmp / "r", "--capacity-factor", "-1"), []), r"--capacity-factor must be > 0"),
    Case("max experts below experts", lambda c: (lm(c, c.data, c.tmp / "r", "--moe-max-experts", "1"), []), r"--moe-max-experts"),
    Case("growth past the last stage", lambda c: (lm(c, c.data, c.tmp / "r", "--moe-max-experts", "4", "--grow-experts", "2", "--grow-at-stages", "3"), []),
         r"--grow-at-stages must list stages in \[2, 2\]"),
    # --wait auto evaluates and records arrival 0 before fairseq builds the scheduler: the refusal
    # left that record, and the corrected command's --save-dir was then "another run"
    Case("warmup >= budget, wait auto", lambda c: (lm(c, c.data, c.tmp / "r", "--wait", "auto", "--warmup-updates", "3"), [c.tmp]),
         r"--warmup-updates must be in \[0, 3\)"),
    Case("two lrs, wait auto", lambda c: (lm(c, c.data, c.tmp / "r", "--wait", "auto", "--lr", "0.003,0.001"), [c.tmp]),
         r"--lr must be a single value with --lr-scheduler alma_stage_linear"),
    Case("warmup negative", lambda c: (lm(c, c.data, c.tmp / "r", "--warmup-updates", "-1"), []), r"--warmup-updates must be in \[0, 3\)"),
    Case("restore-file of another run", lambda c: (lm(c, c.data, c.tmp / "r", "--restore-file", str(c.done / "checkpoint_last.pt")), [c.done]),
         r"--restore-file .*checkpoint_last.pt: an alma_stream run resumes only from its own --save-dir .*give that run's directory as --save-dir"),
    Case("finetune-from-model", lambda c: (lm(c, c.data, c.tmp / "r", "--finetune-from-model", str(c.done / "checkpoint_last.pt")), [c.done]),
         r"--finetune-from-model .*checkpoint_last.pt: an alma_stream run starts from a fresh model .*drop it"),
    Case("no-save", lambda c: (lm(c, c.data, c.tmp / "r", "--no-save"), []), r"--no-save: an alma_stream run needs its checkpoints .*drop --no-save"),
    Case("stop-time-hours", lambda c: (lm(c, c.data, c.tmp / "r", "--stop-time-hours", "0.001"), []),
         r"--stop-time-hours 0.001 would end the stream mid-stage with exit 0; drop it: --max-epoch N"),
    Case("reset-optimizer on resume", lambda c: (lm(c, c.data, c.copy(c.done, "r"), "--reset-optimizer"), [c.tmp / "r"]),
         r"--reset-optimizer: an alma_stream run resumes .*drop --reset-optimizer \(--reset-optimizer-each-stage clears"),
    Case("reset-lr-scheduler", lambda c: (lm(c, c.data, c.tmp / "r", "--reset-lr-scheduler"), []), r"--reset-lr-scheduler: .*drop --reset-lr-scheduler$"),
    Case("reset-dataloader", lambda c: (lm(c, c.data, c.tmp / "r", "--reset-dataloader"), []), r"--reset-dataloader: .*drop --reset-dataloader$"),
    Case("reset-meters", lambda c: (lm(c, c.data, c.tmp / "r", "--reset-meters"), []), r"--reset-meters: .*drop --reset-meters$"),
    *(fresh_run_case(flags, needle) for flags, needle in (
        (("--sample-break-mode", "eos", "--tokens-per-sample", "4"),
         r"split megabatch0 of .*: [\d,]+ of its lines are longer than --tokens-per-sample 4 \(up to \d+ tokens\), and --sample-break-mode eos makes each such line a block of its own"),
        (("--shorten-method", "truncate", "--shorten-data-split-list", "train"),
         r"--shorten-data-split-list train: this stream has no split 'train', so fairseq would cut nothing there; name its splits \(eval, valid, megabatch0\.\.megabatch\d+\)"),
        (("--shorten-data-split-list", "megabatch0"),
         r"--shorten-data-split-list megabatch0 does nothing without --shorten-method"),
        (("--no-last-checkpoints",), r"--no-last-checkpoints: an alma_stream run keeps each stage's model from the checkpoint_last.pt .*drop it"),
        (("--save-interval", "2"), r"--save-interval 2: an alma_stream run saves at the end of every stage .*--save-interval-updates"),
        (("--log-interval", "0"), r"--log-interval must be >= 1 \(got 0\)"),
        (("--fairseq-validation", "--patience", "1"), r"--patience 1 would end the stream with exit 0 when validation stops improving; drop it"),
        (("--stop-min-lr", "0"), r"--stop-min-lr 0 would end the stream with exit 0 when the LR falls to it"),
        (("--store-ema",), r"--store-ema: an alma_stream run evaluates and keeps the trained weights .*drop --store-ema"),
        (("--clip-norm", "nan"), r"--clip-norm nan: every number a run is given must be finite"),
        (("--capacity-factor", "inf"), r"--capacity-factor inf: every number a run is given must be finite"),
        (("--lr", "-1"), r"--lr must be >= 0 \(got -1\)"),
        (("--fp16-init-scale", "0"), r"--fp16-init-scale must be > 0 \(got 0\): the loss scale of the first update"),
        (("--amp-scale-window", "0"), r"--amp-scale-window must be >= 1 \(got 0\)"),
        (("--max-update", "-1"), r"--max-update must be >= 0 \(got -1\)"),
        (("--lr-scheduler", "polynomial_decay", "--total-num-update", "nan"), r"--total-num-update nan: every number a run is given must be finite"),
        (("--num-workers", "-1"), r"--num-workers must be >= 0 \(got -1\)"),
        (("--clip-norm", "-1"), r"--clip-norm must be >= 0 \(got -1\): the largest gradient norm, 0 for no clipping"),
        (("--weight-decay", "-0.1"), r"--weight-decay must be >= 0 \(got -0.1\)"),
        (("--adam-eps", "0"), r"--adam-eps must be > 0 \(got 0\): it keeps the update finite where a gradient is 0"),
        (("--adam-betas", "(0.9,1.5)"), r"--adam-betas \(0.9,1.5\): two decay rates in \[0, 1\) are needed"),
        (("--warmup-init-lr", "-1"), r"--warmup-init-lr must be >= 0 \(got -1\): every stage's warmup starts there"),
        (("--lr-scheduler", "reduce_lr_on_plateau"), r"--lr-scheduler reduce_lr_on_plateau lowers the LR when fairseq's validation loss stops improving, .*the LR would never change"),
        (("--lr-scheduler", "cosine"), r"--lr-scheduler cosine spans the run's --max-update, which an alma_stream run leaves unset .*add --max-update \d+ \(the stream's \d+ stages x 3 updates"),
        (("--lr-scheduler", "polynomial_decay"), r"--lr-scheduler polynomial_decay needs --total-num-update N"),
        (("--lr-scheduler", "polynomial_decay", "--total-num-update", "2"), r"--total-num-update 2 ends --lr-scheduler polynomial_decay before the stream does .*use --total-num-update \d+$"),
        (("--optimizer", "lamb"), r"--optimizer lamb is NVIDIA apex's fused LAMB, and apex is not installed"),
        (("--max-valid-steps", "2"), r"--max-valid-steps 2 belongs to fairseq's own validation, which an alma_stream run does not run .*drop it, or add --fairseq-validation$"),
        (("--azureml-logging",), r"--azureml-logging: azureml.core is not installed in this Python, so fairseq would log nothing there; pip install azureml-core"),
        (("--optimizer", "adafactor", "--moe-max-experts", "4", "--grow-experts", "2"), r"--grow-experts with --optimizer adafactor: Adafactor keeps factored second moments"),
        (("--checkpoint-suffix=_x",), r"--checkpoint-suffix _x: an alma_stream run keeps each stage from checkpoint_last.pt"),
        (("--continue-once", "elsewhere/checkpoint_last.pt"), r"--continue-once elsewhere/checkpoint_last.pt: an alma_stream run starts from a fresh model"),
        (("--use-bmuf",), r"--use-bmuf: BMUF lets every process train its own copy between syncs"),
        (("--ddp-backend", "slowmo"), r"--ddp-backend slowmo: SlowMo lets every process take its own steps between syncs"),
        (("--pipeline-model-parallel",), r"--pipeline-model-parallel: fairseq's pipeline parallelism .*is not supported by alma_stream"),
        (("--optimizer-overrides", "{'adam_eps': 1e-6}"), r"--optimizer-overrides .*: an alma_stream run resumes its optimizer as checkpointed"),
        (("--dataset-impl", "lazy"), r"--dataset-impl lazy: a stream's splits are the mmap binaries alma-data-prep writes"),
        (("--model-parallel-size", "2"), r"--model-parallel-size 2: Megatron model parallelism .*is not supported by alma_stream"),
        (("--quantization-config-path", "q.yaml"), r"--quantization-config-path q.yaml: fairseq's iterative product quantization .*not supported"),
        (("--no-save-optimizer-state",), r"--no-save-optimizer-state: an alma_stream run resumes its optimizer"),
        (("--save-dir", ""), r"--save-dir: an empty path; give the run's directory"),
        (("--train-subset", "valid"), r"--train-subset valid: an alma_stream run trains on its mega-batches .*drop it"),
        (("--num-shards", "2", "--shard-id", "1"), r"--num-shards 2: an alma_stream run shares each stage's batches out"),
        (("--curriculum", "1"), r"--curriculum 1: an alma_stream run orders each stage's data itself"),
        (("--stage-init", "scratch", "--moe-max-experts", "4", "--grow-experts", "2"),
         r"--grow-experts 2 with --stage-init scratch: every stage starts from a fresh model"),
        (("--grouped-shuffling",), r"--grouped-shuffling: an alma_stream run orders each stage's batches itself"),
        (("--skip-remainder-batch",), r"--skip-remainder-batch: an alma_stream stage's batches are whole groups of --update-freq"),
        (("--update-epoch-batch-itr", "True"), r"--update-epoch-batch-itr: an alma_stream run builds each stage's batches anew"),
        (("--fix-batches-to-gpus",), r"--fix-batches-to-gpus: an alma_stream run deals each stage's batches out to its processes"),
        (("--add-bos-token",), r"--add-bos-token: fairseq 0.12 then makes <s> the first target of every block too"),
        (("--output-dictionary-size", "50"), r"--output-dictionary-size 50: an alma_stream model predicts every symbol of the stream's dictionary"),
        (("--decoder-layers", "0"), r"--decoder-layers must be an integer >= 1 \(got 0\)"),
    )),
    Case("growth step above the experts", lambda c: (lm(c, c.data, c.tmp / "r", "--moe-max-experts", "8", "--grow-experts", "3"), []),
         r"--grow-experts 3: stage 2 would copy 3 experts but the model has 2 then .*use k <= 2"),
    Case("growth stage repeated", lambda c: (lm(c, c.data, c.tmp / "r", "--moe-max-experts", "6", "--grow-experts", "2,2", "--grow-at-stages", "2,2"), []),
         r"--grow-at-stages 2,2 must list each stage once, in increasing order"),
    Case("growth on a one-stage stream", lambda c: (lm(c, c.data, c.tmp / "r", "--wait", "2", "--moe-max-experts", "4", "--grow-experts", "2"), []),
         r"--grow-experts 2 has no stage to grow at: the stream trains 1 stage\(s\)"),
    Case("replay on a one-stage stream", lambda c: (lm(c, c.data, c.tmp / "r", "--wait", "2", "--replay"), []),
         r"--replay has nothing to replay: with --wait 2 the stream of 2 mega-batches trains one stage"),
    Case("alma-train batch-size 0", lambda c: ([tool("alma-train"), str(c.data), *LM_FLAGS[4:], "--save-dir", str(c.tmp / "r"), "--batch-size", "0"], []),
         r"--batch-size must be >= 1"),
    Case("training that diverges", lambda c: (lm(c, c.data, _existing_dir(c), "--lr", "1e20", "--clip-norm", "0"), []),
         r"training diverged: gradients are Nan/Inf .*train in a new --save-dir with a lower --lr", status=1),
    Case("alma-train fp16 on CPU", lambda c: ([tool("alma-train"), str(c.data), *LM_FLAGS[4:], "--save-dir", str(c.tmp / "r"), "--fp16"], []),
         r"--fp16 trains on CUDA GPUs only"),
]


def _vision_run(ctx: Ctx) -> Path:
    """A finished two-stage vision run (digits), made for the case."""
    save = ctx.tmp / "v"
    subprocess.run(vision(ctx, "digits", save, "--vision-dataset", "digits"), check=True, capture_output=True,
                   env=ENV, timeout=600)
    return save


def _existing_dir(ctx: Ctx) -> Path:
    """An empty --save-dir made beforehand: a run that started and failed keeps its directory."""
    (ctx.tmp / "r").mkdir()
    return ctx.tmp / "r"


def _only(ctx: Ctx, *names: str) -> Path:
    """A --save-dir holding only these files of the finished run (no run.json to compare)."""
    save = ctx.tmp / "r"
    save.mkdir()
    for name in names:
        shutil.copy(ctx.done / name, save / name)
    return save


def _last_only(ctx: Ctx, *more: str, task: str | None = None) -> Path:
    """The finished run's checkpoint_last.pt (and ``more`` files) alone; ``task``: as if
    written by a fairseq-train of that task (stock fairseq also saves to checkpoints/)."""
    save = _only(ctx, "checkpoint_last.pt", *more)
    if task is not None:
        state = torch.load(save / "checkpoint_last.pt", weights_only=False)
        state["cfg"]["task"]["_name"] = task
        torch.save(state, save / "checkpoint_last.pt")
    return save


def _edited_run_json(ctx: Ctx, section: str, value: object) -> Path:
    """A copy of the finished run whose run.json has config.<section> replaced (a hand edit)."""
    save = ctx.copy(ctx.done, "r")
    run_file = json.loads((save / "run.json").read_text())
    run_file["fingerprint"]["config"][section] = value
    (save / "run.json").write_text(json.dumps(run_file))
    return save


def _with(ctx: Ctx, name: str, text: str) -> Path:
    save = ctx.copy(ctx.done, "r")
    (save / name).write_text(text)
    return save


VISION_CASES = [
    Case("vision wait auto on one mega-batch", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--num-megabatches", "1", "--wait", "auto"), []),
         r"--wait auto: a stream of one mega-batch leaves nothing to decide; use --wait 1"),
    Case("stream of an lstm_lm", lambda c: (dense_lm(c, "lstm_lm"), []),
         r"--arch lstm_lm: an alma_stream run counts the FLOPs of transformer decoders"),
    Case("transformer_lm narrower than its embeddings", lambda c: (dense_lm(c, "transformer_lm", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2"), []),
         r"--decoder-embed-dim 32 with --decoder-input-dim 512 \(fairseq's default is 512, whatever --decoder-embed-dim says\).* add --decoder-input-dim 32 --decoder-output-dim 32$"),
    Case("vision tensorboard", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--tensorboard-logdir", str(c.tmp / "tb")), []),
         r"--tensorboard-logdir is fairseq's trainer's; a vision stream's learner does not read it \(a vision stream records its stages in stream.jsonl .*\); drop it"),
    Case("vision stage-init scratch", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--stage-init", "scratch"), []),
         r"--stage-init is for language-model streams; a vision stream uses --vision-method gens"),
    Case("vision token blocks", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--tokens-per-sample", "64"), []),
         r"--tokens-per-sample is for language-model streams \(a vision stream's inputs are images, not token blocks\); drop it"),
    Case("vision grouped shuffling", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--grouped-shuffling"), []),
         r"--grouped-shuffling is fairseq's trainer's; a vision stream's learner does not read it"),
    Case("vision epoch batch iterator", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--update-epoch-batch-itr", "True"), []),
         r"--update-epoch-batch-itr is fairseq's trainer's; a vision stream's learner does not read it \(the learner builds its own batches\); drop it"),
    Case("vision fix batches to gpus", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--fix-batches-to-gpus"), []),
         r"--fix-batches-to-gpus is fairseq's trainer's; a vision stream's learner does not read it \(the learner builds its own batches\); drop it"),
    Case("vision without dataset", lambda c: (vision(c, "digits", c.tmp / "r"), []), r"--arch alma_vision needs --vision-dataset"),
    Case("vision unknown dataset", lambda c: (vision(c, "x", c.tmp / "r", "--vision-dataset", "imagenet"), []), r"--vision-dataset 'imagenet' is unknown"),
    Case("vision mnist dir missing", lambda c: (vision(c, str(c.tmp / "nowhere"), c.tmp / "r", "--vision-dataset", "mnist"), []), r"nowhere"),
    Case("npz stray label", lambda c: (vision(c, npz(c, "d", y_train=np.where(np.arange(40) == 5, 255, np.arange(40) % 3)), c.tmp / "r", "--vision-dataset", "npz"), []),
         r"labels go up to 255 but classes 3, 4, 5, 6, 7 \.\.\. never occur"),
    Case("npz NaN", lambda c: (vision(c, npz(c, "d", x_test=np.full((9, 6), np.nan)), c.tmp / "r", "--vision-dataset", "npz"), []), r"x_test holds NaN or inf in 9 example"),
    Case("npz uint8 train, float test", lambda c: (vision(c, npz(c, "d", x_train=np.zeros((40, 6), np.uint8)), c.tmp / "r", "--vision-dataset", "npz"), []),
         r"x_train is uint8 but x_test float\d+; uint8 pixels are scaled to \[0, 1\] and other inputs are not"),
    Case("npz counts differ", lambda c: (vision(c, npz(c, "d", y_train=np.arange(39) % 3), c.tmp / "r", "--vision-dataset", "npz"), []), r"x_train has 40 examples but y_train 39 labels"),
    Case("npz strings", lambda c: (vision(c, npz(c, "d", x_train=np.array([["a"] * 6] * 40)), c.tmp / "r", "--vision-dataset", "npz"), []), r"x_train has dtype <U1"),
    Case("vision B too large", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--num-megabatches", "5000"), []), r"--num-megabatches 5000 is larger than the training set"),
    Case("vision width 0", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--vision-width", "0"), []), r"--vision-width must be >= 1"),
    Case("ff new layers negative", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--vision-method", "ff", "--ff-new-layers", "-1"), []), r"--ff-new-layers must be >= 0 \(0: width growth only\)"),
    Case("vision fp16 flag", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--fp16"), []), r"--fp16 does not apply to vision streams"),
    Case("vision amp fp16 on cpu", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--vision-amp", "fp16"), []), r"--vision-amp fp16 needs a CUDA device"),    Case("vision batch-size 0", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--batch-size", "0"), []), r"--batch-size must be >= 1 .*got 0"),
    Case("vision batch-size negative", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--batch-size", "-5"), []), r"--batch-size must be >= 1 .*got -5"),
    Case("vision growth layer beyond the model", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--vision-method", "gmoe", "--moe-mixture-layers", "0,7"), []),
         r"--moe-mixture-layers 0,7: layer 7 is not in the mlp backbone \(layers 0-\d\)"),
    Case("vision growth layer not a number", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--vision-method", "gmoe", "--moe-mixture-layers", "first"), []),
         r"--moe-mixture-layers takes comma-separated layer indices"),
    Case("vision epochs 0", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--epochs-per-stage", "0"), []), r"--epochs-per-stage must be >= 1"),
    Case("vision B 0", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--num-megabatches", "0"), []), r"--num-megabatches must be an integer >= 1 \(got 0\)"),
    Case("vision wait > B", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--wait", "3"), []), r"--wait must be in \[1, 2\]"),
    Case("vision valid fraction 1", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--valid-fraction", "1.5"), []), r"--valid-fraction must be in \[0, 1\)"),
    Case("vision members 0", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--vision-method", "ens", "--ensemble-members", "0"), []), r"--ensemble-members must be >= 1"),
    Case("vision growth rate negative", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--vision-method", "ff", "--ff-growth-rate", "-0.5"), []), r"--ff-growth-rate must be > 0"),
    Case("vision threads 0", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--vision-threads", "0"), []), r"--vision-threads must be >= 1"),
    Case("vision lr negative", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--vision-lr", "-1"), []), r"--vision-lr must be >= 0"),
    Case("vision fairseq lr", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--lr", "0.5"), []),
         r"--lr is fairseq's trainer's; a vision stream's learner does not read it: use --vision-lr"),
    Case("vision fairseq optimizer", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--optimizer", "adam"), []),
         r"--optimizer adam: a vision stream's learner has its own optimizer .*use --vision-optimizer"),
    Case("vision replay-ratio", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--replay-ratio", "0.5"), []), r"--replay-ratio 0.5 is for language-model streams"),
    Case("vision save-dir is a file", lambda c: (vision(c, "digits", c.tmp / "x.txt", "--vision-dataset", "digits"), [c.tmp / "x.txt"]), r"--save-dir .*x.txt: exists and is not a directory"),
]

SCORE_CASES = [
    Case("score not a dir", lambda c: ([tool("alma-score"), str(c.tmp / "nowhere")], []), r"RUN_DIR .*nowhere: not a directory", prog="alma-score"),
    Case("score no stream.jsonl", lambda c: ([tool("alma-score"), str(c.tmp)], []), r"stream.jsonl: missing", prog="alma-score"),
    Case("score gens of a continue run", lambda c: ([tool("alma-score"), str(c.done), "--mode", "gens"], [c.done]), r"--mode gens: .*--stage-init continue", prog="alma-score"),
    Case("score with another dictionary", lambda c: ([tool("alma-score"), str(c.done), "--data", str(data_copy(c, "d", reordered_dict))], [c.done, c.tmp / "d"]),
         r"trained with another dictionary .*score it on the stream it was trained on", prog="alma-score"),
    Case("eval-lm of a directory that is no data-bin", lambda c: (eval_lm(c)[:1] + [str(c.tmp / "nowhere")] + eval_lm(c)[2:], [c.done]),
         r"nowhere/dict.txt: missing, so .*nowhere is no data-bin; pass the stream the checkpoint was trained on"),
    Case("eval-lm on two processes", lambda c: (eval_lm(c, "--distributed-world-size", "2"), [c.done]),
         r"fairseq-eval-lm on 2 processes scores each its share of the split .*alma-score \(torchrun\)$"),
    Case("eval-lm with another dictionary", lambda c: (eval_lm(c)[:1] + [str(data_copy(c, "d", reordered_dict))] + eval_lm(c)[2:], [c.done, c.tmp / "d"]),
         r"trained with another dictionary .*score it on the stream it was trained on"),
    Case("score ens of two streams", lambda c: ([tool("alma-score"), str(c.done), str(_other_stream_run(c)), "--mode", "ens"], [c.done]),
         r"--mode ens: .* was trained on another stream", prog="alma-score"),
    Case("score stage checkpoint with a NaN weight", lambda c: ([tool("alma-score"), str(_nan_weight_stage(c))], [c.tmp / "r"]),
         r"checkpoint_stage2.pt, scored on --subset eval: its loss is nan: 1 of its weights are NaN", prog="alma-score"),
    Case("score damaged stage checkpoint", lambda c: ([tool("alma-score"), str(_damaged_stage(c))], [c.tmp / "r"]), r"checkpoint_stage2.pt: not a readable checkpoint", prog="alma-score"),
    Case("score checkpoint of another run", lambda c: ([tool("alma-score"), str(other_run_checkpoint(c))], [c.tmp / "mixed"]),
         r"checkpoint_stage1.pt belongs to another run than .*run.json", prog="alma-score"),
    Case("score bad batch size", lambda c: ([tool("alma-score"), str(c.done), "--batch-size", "0"], [c.done]), r"--batch-size must be >= 1", prog="alma-score"),    Case("score tokens-per-sample 0", lambda c: ([tool("alma-score"), str(c.done), "--tokens-per-sample", "0"], [c.done]), r"--tokens-per-sample must be >= 1", prog="alma-score"),
    Case("score max-eval-tokens 0", lambda c: ([tool("alma-score"), str(c.done), "--max-eval-tokens", "0"], [c.done]), r"--max-eval-tokens must be >= 1", prog="alma-score"),
    Case("score subset missing", lambda c: ([tool("alma-score"), str(c.done), "--subset", "test"], [c.done]), r"--subset test: no such split in .*data \(the stream's evaluation mega-batch is 'eval'\)", prog="alma-score"),
    Case("score json empty path", lambda c: ([tool("alma-score"), str(c.done), "--from-log", "--json", ""], [c.done]),
         r"--json is an empty path \(it would mean the current directory, or no file\); give a path", prog="alma-score"),
    Case("report of a run.json whose model is null",
         lambda c: ([tool("alma-report"), str(_edited_run_json(c, "model", None)), "--out", str(c.tmp / "o")], [c.tmp / "r"]),
         r"run.json: unreadable \(its config.model is null, not a mapping\)", prog="alma-report"),
    Case("score of a run.json whose task is a string",
         lambda c: ([tool("alma-score"), str(_edited_run_json(c, "task", "x")), "--from-log"], [c.tmp / "r"]),
         r"run.json: unreadable \(its config.task is \"x\", not a mapping\)", prog="alma-score"),
    Case("report out empty path", lambda c: ([tool("alma-report"), str(c.done), "--out", ""], [c.done]),
         r"--out is an empty path", prog="alma-report"),
    Case("sweep dir empty path", lambda c: ([tool("alma-sweep"), "submit", str(SWEEP_CONFIG), "--sweep-dir", "", "--dry-run"], []),
         r"argument --sweep-dir: an empty path \(it would mean the current directory\)", prog="alma-sweep submit"),
    Case("score plot of no image format", lambda c: ([tool("alma-score"), str(c.done), "--from-log", "--plot", str(c.tmp / "fig.txt")], [c.done, c.tmp]),
         r"--plot .*fig.txt: give a file ending in .png, .pdf, .svg", prog="alma-score"),
    Case("score run given twice", lambda c: ([tool("alma-score"), str(c.done), str(c.done)], [c.done]), r"a RUN_DIR is given twice", prog="alma-score"),
    Case("score from-log with ens", lambda c: ([tool("alma-score"), str(c.done), "--from-log", "--mode", "ens"], [c.done]), r"--from-log works with --mode single only", prog="alma-score"),
    Case("score fp16 on CPU", lambda c: ([tool("alma-score"), str(c.done), "--fp16", "--cpu"], [c.done]), r"--fp16", prog="alma-score"),
    Case("score json is a directory", lambda c: ([tool("alma-score"), str(c.done), "--from-log", "--json", str(c.tmp)], [c.done, c.tmp]), r"--json .*: is a directory; give the path of a file to write", prog="alma-score"),
    Case("score csv inside the run's own stream", lambda c: ([tool("alma-score"), str(c.done), "--from-log", "--csv", str(c.data / "scores.csv")], [c.done, c.data]),
         r"--csv .*/scores.csv: inside the stream directory .*, whose files it would replace; write it outside the stream directory", prog="alma-score"),
    Case("score json onto the --data manifest", lambda c: ([tool("alma-score"), str(c.done), "--data", str(data_copy(c, "d", lambda p: None)), "--json", str(c.tmp / "d" / "manifest.json")], [c.done, c.tmp / "d"]),
         r"--json .*d/manifest.json: inside the stream directory .*/d, whose files it would replace", prog="alma-score"),
    Case("score unfinished run", lambda c: ([tool("alma-score"), str(_unfinished(c)), "--from-log"], [c.tmp / "r"]), r"stream.jsonl", prog="alma-score"),
]


def _unfinished(ctx: Ctx) -> Path:
    """A copy of the finished run stopped after its first arrival (stream.jsonl cut)."""
    save = ctx.copy(ctx.done, "r")
    lines = (save / "stream.jsonl").read_text().splitlines()
    (save / "stream.jsonl").write_text(lines[0] + "\n")
    return save


def _damaged_stage(ctx: Ctx) -> Path:
    save = ctx.copy(ctx.done, "r")
    (save / "checkpoint_stage2.pt").write_bytes(b"PK\x03\x04 not really a checkpoint")
    return save


def _nan_weight_stage(ctx: Ctx) -> Path:
    """A copy of the finished run whose stage-2 checkpoint holds one NaN weight (a diverged
    run, a bit flip in memory): alma-score would have printed perplexity nan."""
    save = ctx.copy(ctx.done, "r")
    state = torch.load(save / "checkpoint_stage2.pt", weights_only=False)
    state["model"]["decoder.embed_tokens.weight"][5, 3] = float("nan")
    from fairseq_alma.lm.stage_checkpoints import stamped  # as training stamps the weights it kept

    state["alma"] = stamped(state["alma"], state["model"])
    torch.save(state, save / "checkpoint_stage2.pt")
    return save


def _other_stream_run(ctx: Ctx) -> Path:
    """A copy of the finished run as if trained on the other stream (its stage checkpoints name
    the other dictionary; no run.json, as a run of fairseq-alma 0.1 would have)."""
    save = ctx.copy(ctx.done, "other")
    (save / "run.json").unlink()
    sha = json.loads((ctx.other_data / "manifest.json").read_text())["dictionary"]["sha256"]
    for stage in (1, 2):
        state = torch.load(save / f"checkpoint_stage{stage}.pt", weights_only=False)
        state["alma"]["dictionary"] = sha
        torch.save(state, save / f"checkpoint_stage{stage}.pt")
    return save


def gpt2_flags(ctx: Ctx, vocab_bpe: str, extra_symbols: tuple[str, ...] = (),
               last_id: int | None = None) -> list[str]:
    """--bpe gpt2 with an encoder.json of every byte symbol (plus ``extra_symbols``; the last
    symbol gets ``last_id`` when given) and the given vocab.bpe text, both written to the case's
    scratch dir."""
    from fairseq.data.encoders.gpt2_bpe_utils import bytes_to_unicode

    symbols = [*bytes_to_unicode().values(), *extra_symbols]
    encoder = {s: i for i, s in enumerate(symbols)}
    if last_id is not None:
        encoder[symbols[-1]] = last_id
    (ctx.tmp / "encoder.json").write_text(json.dumps(encoder), encoding="utf-8")
    (ctx.tmp / "vocab.bpe").write_text(vocab_bpe, encoding="utf-8")
    return ["--bpe", "gpt2", "--gpt2-encoder-json", str(ctx.tmp / "encoder.json"), "--gpt2-vocab-bpe", str(ctx.tmp / "vocab.bpe")]


def prep(ctx: Ctx, out: Path, *extra: str) -> list[str]:
    return [tool("alma-data-prep"), str(ctx.tmp / "x.txt"), "--out", str(out), *extra]


TOOL_CASES = [
    Case("prep missing input", lambda c: ([tool("alma-data-prep"), str(c.tmp / "none.txt"), "--out", str(c.tmp / "o")], []), r"none.txt", prog="alma-data-prep"),
    Case("prep zero mega-batches", lambda c: ([tool("alma-data-prep"), str(c.tmp / "x.txt"), "--out", str(c.tmp / "o"), "--num-megabatches", "0"], []),
         r"--num-megabatches.*must be >= 1", prog="alma-data-prep"),
    Case("prep verify flipped shard", lambda c: ([tool("alma-data-prep"), "--verify", str(data_copy(c, "d", lambda p: flip_byte(p / "valid.bin")))], [c.tmp / "d"]),
         r"valid.bin: sha256 differs from .*manifest.json", prog="alma-data-prep"),
    Case("prep verify and inputs", lambda c: ([tool("alma-data-prep"), "x.txt", "--verify", str(c.data)], [c.data]), r"--verify DIR checks a prepared stream: give no INPUT", prog="alma-data-prep"),
    Case("sweep missing config", lambda c: ([tool("alma-sweep"), "submit", str(c.tmp / "none.yaml"), "--sweep-dir", str(c.tmp / "s"), "--dry-run"], []), r"none.yaml not found", prog="alma-sweep"),
    Case("sweep unknown key", lambda c: ([tool("alma-sweep"), "submit", str(bad_config(c, "data: x\nargs: {arch: switch_transformer_lm_tiny}\nbogus: 1\n")), "--sweep-dir", str(c.tmp / "s"), "--dry-run"], []),
         r"unknown top-level key 'bogus'", prog="alma-sweep"),
    Case("vision sweep wait soon", lambda c: ([tool("alma-vision-sweep"), "--out", str(c.tmp / "s"), "--waits", "1", "soon"], []),
         r"argument --waits: a waiting time is a whole number of mega-batches >= 1 or auto, got 'soon'", prog="alma-vision-sweep"),
    Case("vision demo wait 0", lambda c: ([tool("alma-vision-demo"), "--out", str(c.tmp / "s"), "--waits", "0", "auto"], []),
         r"argument --waits: a waiting time is a whole number", prog="alma-vision-demo"),
    Case("vision sweep amp fp16 on cpu", lambda c: ([tool("alma-vision-sweep"), "--out", str(c.tmp / "s"), "--waits", "1", "--num-megabatches", "2", "--device", "cpu", "--amp", "fp16"], [c.tmp]),
         r"--amp fp16 needs a CUDA device; use --amp bf16 or off on CPU", prog="alma-vision-sweep"),
    Case("vision sweep growth layer beyond the model", lambda c: ([tool("alma-vision-sweep"), "--out", str(c.tmp / "s"), "--methods", "gmoe", "--mixture-layers", "0,5", "--waits", "1", "--num-megabatches", "2"], [c.tmp]),
         r"--mixture-layers 0,5: layer 5 is not in the mlp backbone \(layers 0-1\)", prog="alma-vision-sweep"),
    Case("vision sweep growth layer not a number", lambda c: ([tool("alma-vision-sweep"), "--out", str(c.tmp / "s"), "--methods", "gmoe", "--mixture-layers", "first", "--waits", "1", "--num-megabatches", "2"], [c.tmp]),
         r"--mixture-layers takes comma-separated layer indices", prog="alma-vision-sweep"),
    Case("vision sweep mnist without path", lambda c: ([tool("alma-vision-sweep"), "--out", str(c.tmp / "s"), "--dataset", "mnist", "--waits", "1", "--num-megabatches", "2"], [c.tmp]),
         r"--dataset mnist needs a path \(--data-path\)", prog="alma-vision-sweep"),
    Case("vision sweep wait > B", lambda c: ([tool("alma-vision-sweep"), "--out", str(c.tmp / "s"), "--waits", "9", "--num-megabatches", "3"], []),
         r"--waits must all be between 1 and --num-megabatches \(3\)", prog="alma-vision-sweep"),
    Case("prep gpt2 empty vocab.bpe", lambda c: (prep(c, c.tmp / "o", *gpt2_flags(c, "")), [c.tmp]),
         r"--gpt2-vocab-bpe .*vocab.bpe: empty; pass fairseq's GPT-2 vocab.bpe", prog="alma-data-prep"),
    Case("prep gpt2 no merges", lambda c: (prep(c, c.tmp / "o", *gpt2_flags(c, "#version: 0.2\n")), [c.tmp]),
         r"vocab.bpe: holds no merges \(the corpus would be encoded byte by byte\)", prog="alma-data-prep"),
    Case("prep gpt2 no #version", lambda c: (prep(c, c.tmp / "o", *gpt2_flags(c, "Ġ t\n", ("Ġt",))), [c.tmp]),
         r"vocab.bpe: line 1 is not the '#version' header", prog="alma-data-prep"),
    Case("prep gpt2 merge part not in encoder", lambda c: (prep(c, c.tmp / "o", *gpt2_flags(c, "#version: 0.2\nĠth e\n", ("Ġthe",))), [c.tmp]),
         r"encoder.json: no id for 1 symbol\(s\) of the bytes and the merges in .*vocab.bpe \(first: 'Ġth'\)", prog="alma-data-prep"),
    Case("prep gpt2 one id for two symbols", lambda c: (prep(c, c.tmp / "o", *gpt2_flags(c, "#version: 0.2\nĠ t\n", ("Ġt",), last_id=0)), [c.tmp]),
         r"encoder.json: id 0 is given to both '!' and 'Ġt' \(the stream would make them one token\)", prog="alma-data-prep"),
    Case("prep out holds another stream", lambda c: (prep(c, c.copy(c.data, "d")), [c.tmp]),
         r"--out .*d holds another stream, prepared from .*corpus.txt .*add --clean to replace", prog="alma-data-prep"),
    Case("prep out holds other files", lambda c: (prep(c, c.tmp), [c.tmp]),
         r"--out .* holds files that are not an alma-data-prep stream \(x.txt\); choose a new or empty directory", prog="alma-data-prep"),
    Case("prep out is a file", lambda c: (prep(c, c.tmp / "x.txt"), [c.tmp]), r"--out .*x.txt: exists and is not a directory", prog="alma-data-prep"),
    Case("prep absurd mega-batches", lambda c: (prep(c, c.copy(c.data, "d"), "--num-megabatches", str(10**12)), [c.tmp]),
         r"--num-megabatches 1000000000000 needs at least 1,000,000,000,002 documents .* can hold at most 13; lower it", prog="alma-data-prep"),    Case("prep out under a file", lambda c: (prep(c, c.tmp / "x.txt" / "o"), [c.tmp]), r"--out .*x.txt/o: .*x.txt is a file", prog="alma-data-prep"),
    Case("prep eval-size negative", lambda c: (prep(c, c.tmp / "o", "--eval-size", "-1"), [c.tmp]), r"--eval-size", prog="alma-data-prep"),
    Case("prep vocab 0", lambda c: (prep(c, c.tmp / "o", "--vocab-size", "0"), [c.tmp]), r"--vocab-size", prog="alma-data-prep"),
    Case("prep seed negative", lambda c: (prep(c, c.tmp / "o", "--seed", "-1"), [c.tmp]), r"--seed: must be >= 0, got -1", prog="alma-data-prep"),
    Case("prep workers 0", lambda c: (prep(c, c.tmp / "o", "--workers", "0"), [c.tmp]), r"--workers", prog="alma-data-prep"),
    Case("prep from-binarized missing", lambda c: ([tool("alma-data-prep"), "--from-binarized", str(c.tmp / "nowhere"), "--out", str(c.tmp / "o")], [c.tmp]),
         r"nowhere", prog="alma-data-prep"),
    Case("sweep restart-stream", lambda c: (sweep(c, "--grid", "restart-stream=true"), [c.tmp]),
         r"'restart-stream' cannot be set here: a sweep trains each of its run directories once", prog="alma-sweep"),
    Case("sweep grid value twice", lambda c: (sweep(c, "--grid", "lr=0.1,0.10"), [c.tmp]),
         r"grid 'lr' lists the value 0.1 twice; list each value once", prog="alma-sweep"),
    Case("sweep max-parallel 0", lambda c: (sweep(c, "--max-parallel", "0"), [c.tmp]), r"--max-parallel must be >= 1 \(got 0\)", prog="alma-sweep"),
    Case("sweep max-parallel negative", lambda c: (sweep(c, "--max-parallel", "-2"), [c.tmp]), r"--max-parallel must be >= 1 \(got -2\)", prog="alma-sweep"),
    Case("sweep profile missing fields", lambda c: (sweep(c, "--profile", str(_file(c, "p.yaml", "description: half a profile\nnodes: 1\n"))), [c.tmp]),
         r"p.yaml: missing time, and gpus_per_node or ntasks_per_node; set them as in .*local-cpu.yaml", prog="alma-sweep"),
    Case("sweep profile empty", lambda c: (sweep(c, "--profile", str(_file(c, "p.yaml", ""))), [c.tmp]), r"p.yaml", prog="alma-sweep"),
    Case("sweep profile warns at its time limit", lambda c: (sweep(c, "--profile", str(_file(c, "p.yaml", 'time: "00:01:00"\nntasks_per_node: 1\nsignal_seconds: 60\nsave_grace_seconds: 30\n'))), [c.tmp]),
         r"p.yaml: signal_seconds \(60\) must be smaller than the time limit \(time '00:01:00' = 60 s\)", prog="alma-sweep"),
    Case("sweep dir is a file", lambda c: ([tool("alma-sweep"), "submit", str(SWEEP_CONFIG), "--sweep-dir", str(c.tmp / "x.txt"), "--dry-run"], [c.tmp]),
         r"--sweep-dir .*x.txt: exists and is not a directory", prog="alma-sweep"),
    Case("sweep status not a sweep", lambda c: ([tool("alma-sweep"), "status", str(c.tmp)], [c.tmp]), r"jobs.json", prog="alma-sweep"),
    Case("sweep config not yaml", lambda c: ([tool("alma-sweep"), "submit", str(bad_config(c, "data: [x\n")), "--sweep-dir", str(c.tmp / "s"), "--dry-run"], []),
         r"bad.yaml", prog="alma-sweep"),
    Case("vision sweep out is a file", lambda c: ([tool("alma-vision-sweep"), "--out", str(c.tmp / "x.txt"), "--waits", "1", "--num-megabatches", "2"], [c.tmp]),
         r"--out .*x.txt: exists and is not a directory", prog="alma-vision-sweep"),
    Case("vision sweep epochs 0", lambda c: ([tool("alma-vision-sweep"), "--out", str(c.tmp / "s"), "--epochs-per-stage", "0"], []),
         r"--epochs-per-stage must be >= 1", prog="alma-vision-sweep"),
    Case("vision sweep members 0", lambda c: ([tool("alma-vision-sweep"), "--out", str(c.tmp / "s"), "--methods", "ens", "--members", "0"], []),
         r"--members must be >= 1", prog="alma-vision-sweep"),
    Case("vision sweep widths 0", lambda c: ([tool("alma-vision-sweep"), "--out", str(c.tmp / "s"), "--widths", "0"], []),
         r"--widths must all be >= 1", prog="alma-vision-sweep"),
    Case("vision demo out is a file", lambda c: ([tool("alma-vision-demo"), "--out", str(c.tmp / "x.txt")], [c.tmp]),
         r"--out .*x.txt: exists and is not a directory", prog="alma-vision-demo"),
    Case("vision demo B 0", lambda c: ([tool("alma-vision-demo"), "--out", str(c.tmp / "v"), "--num-megabatches", "0"], []),
         r"--num-megabatches must be >= 1", prog="alma-vision-demo"),
    Case("vision demo jobs 0", lambda c: ([tool("alma-vision-demo"), "--out", str(c.tmp / "v"), "--jobs", "0"], []), r"--jobs", prog="alma-vision-demo"),
    Case("report input missing", lambda c: ([tool("alma-report"), str(c.tmp / "nowhere"), "--out", str(c.tmp / "o")], []), r"nowhere", prog="alma-report"),
    Case("report out is a file", lambda c: ([tool("alma-report"), str(c.done), "--out", str(c.tmp / "x.txt")], [c.done, c.tmp]),
         r"--out .*x.txt: exists and is not a directory", prog="alma-report"),
    Case("report unfinished run", lambda c: ([tool("alma-report"), str(_unfinished(c)), "--out", str(c.tmp / "o")], [c.tmp / "r"]), r"stream.jsonl", prog="alma-report"),
    Case("report json unreadable", lambda c: ([tool("alma-report"), str(_file(c, "s.json", "{")), "--out", str(c.tmp / "o")], [c.tmp]), r"s.json", prog="alma-report"),
    Case("report input in out", lambda c: ([tool("alma-report"), str(_in_out(c, "table2.json")), str(c.done), "--out", str(c.tmp / "o")], [c.tmp / "o", c.done]),
         r"--out .*/o would overwrite or remove the input .*/o/table2.json .*use another --out", prog="alma-report"),
    Case("report out entry under an output name is a directory", lambda c: ([tool("alma-report"), str(c.done), "--out", str(_dir_in_out(c, "table2.csv"))], [c.done, c.tmp / "o"]),
         r"o/table2.csv: not a file, and alma-report writes table2.csv there; remove or rename it, or use another --out", prog="alma-report"),
    Case("report run without records", lambda c: ([tool("alma-report"), str(_started(c)), "--out", str(c.tmp / "o")], [c.tmp / "r"]),
         r"r/stream.jsonl: training not finished: no arrival recorded yet .*run the same training command again", prog="alma-report"),
    Case("report json without scoring", lambda c: ([tool("alma-report"), str(_file(c, "s.json", '{"metric": "ppl", "series": [{"setting": "SM_w1"}]}')), "--out", str(c.tmp / "o")], [c.tmp]),
         r"s.json: series 'SM_w1' has no \"scoring\" .*alma-score --json", prog="alma-report"),
    Case("report json no series", lambda c: ([tool("alma-report"), str(_file(c, "s.json", '{"metric": "ppl", "series": []}')), str(c.done), "--out", str(c.tmp / "o")], [c.tmp, c.done]),
         r"s.json: no series in it; score the runs again with alma-score --json", prog="alma-report"),
    Case("demo out is a file", lambda c: ([tool("alma-demo"), "--out", str(c.tmp / "x.txt")], [c.tmp]), r"--out .*x.txt: exists and is not a directory", prog="alma-demo"),
    Case("demo few updates", lambda c: ([tool("alma-demo"), "--out", str(c.tmp / "d"), "--updates-per-stage", "5"], []), r"--updates-per-stage must be >= 20", prog="alma-demo"),
    Case("demo corpus 0", lambda c: ([tool("alma-demo"), "--out", str(c.tmp / "d"), "--corpus-mb", "0"], []), r"--corpus-mb must be a finite number > 0", prog="alma-demo"),
    Case("demo corpus inf", lambda c: ([tool("alma-demo"), "--out", str(c.tmp / "d"), "--corpus-mb", "inf"], []), r"--corpus-mb must be a finite number > 0 \(got inf\)", prog="alma-demo"),
    Case("demo vocab 0", lambda c: ([tool("alma-demo"), "--out", str(c.tmp / "d"), "--vocab-size", "0"], []), r"--vocab-size must be >= 1", prog="alma-demo"),
    Case("demo workers 0", lambda c: ([tool("alma-demo"), "--out", str(c.tmp / "d"), "--workers", "0"], []), r"--workers must be >= 1", prog="alma-demo"),
]

SWEEP_CONFIG = REPO / "train_configs" / "examples" / "tiny_stream.yaml"


def sweep(ctx: Ctx, *extra: str) -> list[str]:
    return [tool("alma-sweep"), "submit", str(SWEEP_CONFIG), "--sweep-dir", str(ctx.tmp / "s"), "--dry-run", *extra]


def _in_out(ctx: Ctx, name: str) -> Path:
    """An alma-score JSON saved in the report's --out under a name the report writes."""
    (ctx.tmp / "o").mkdir()
    return _file(ctx, f"o/{name}", '{"metric": "ppl", "series": []}')


def _dir_in_out(ctx: Ctx, name: str) -> Path:
    """A report's --out (with an earlier table in it) where a directory has a report file's name."""
    (ctx.tmp / "o" / name).mkdir(parents=True)
    (ctx.tmp / "o" / name / "kept").write_text("mine")
    (ctx.tmp / "o" / "table2.md").write_text("an earlier report's table")
    return ctx.tmp / "o"


def _started(ctx: Ctx) -> Path:
    """A copy of the finished run as a run killed before it recorded arrival 0 leaves it."""
    save = ctx.copy(ctx.done, "r")
    (save / "stream.jsonl").unlink()
    return save


def _file(ctx: Ctx, name: str, text: str) -> Path:
    (ctx.tmp / name).write_text(text)
    return ctx.tmp / name

CASES = LM_CASES + VISION_CASES + SCORE_CASES + TOOL_CASES


def _tree_hash(path: Path) -> dict[str, str]:
    if path.is_file():
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and p.name != "run.lock"}


def _prepare(root: Path, name: str, seed: int) -> Path:
    return prepare_stream(root, root / name, lines=600, vocab_size=300, seed=seed)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_inputs")
    data, other = _prepare(root, "data", 1), _prepare(root, "other", 2)
    done = root / "done"
    run([tool("fairseq-train"), str(data), *LM_FLAGS, "--save-dir", str(done)])
    (root / "x.txt").write_text("one document\n")
    return data, other, done


# Commands whose console entry is a ``main(argv)`` that leaves no state behind: their cases run
# in this process (the same function the installed script calls), one at a time in the main
# thread, while the fairseq-train cases (fairseq's own entry, with --user-dir) run in forked
# processes beside them.  Saves a process start (torch, fairseq) per case.
IN_PROCESS = {
    "alma-data-prep": "data_prep.cli", "alma-score": "fairseq_alma.cli.score",
    "alma-sweep": "fairseq_alma.cli.sweep", "alma-vision-sweep": "fairseq_alma.cli.vision_sweep",
    "alma-vision-demo": "fairseq_alma.cli.vision_demo", "alma-report": "fairseq_alma.cli.report",
    "alma-demo": "fairseq_alma.cli.demo",
}


def _call_main(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``main(argv[1:])`` of the command, as its console script runs it: the exit status it
    returns or exits with, what it printed, and any exception's traceback on stderr."""
    import contextlib
    import importlib
    import io
    import traceback

    main = importlib.import_module(IN_PROCESS[os.path.basename(argv[0])]).main
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(argv[1:]) or 0
            except SystemExit as exit_:
                status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            except Exception:  # noqa: BLE001 - a bug: shown as the traceback a user would see
                traceback.print_exc()
                status = 1
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(argv, status, out.getvalue(), err.getvalue())


def _run_case(case: Case, ctx: Ctx, forked: ForkedCommands | None = None
              ) -> tuple[Case, subprocess.CompletedProcess, dict, dict]:
    argv, watched = case.setup(ctx)
    before = {str(p): _tree_hash(p) for p in watched}
    new_save_dir = None  # a --save-dir the command was given that does not exist yet
    if "--save-dir" in argv and not os.path.exists(ctx.tmp / argv[argv.index("--save-dir") + 1]):
        new_save_dir = ctx.tmp / argv[argv.index("--save-dir") + 1]
    if case.prog in IN_PROCESS:
        assert not case.env and os.path.basename(argv[0]) == case.prog, case.name
        proc = _call_main(argv, ctx.tmp)
    elif forked is not None:
        proc = forked.run(argv, cwd=ctx.tmp, env=case.env)
    else:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ctx.tmp,
                              env={**ENV, **case.env})
    after = {str(p): _tree_hash(p) for p in watched}
    if new_save_dir is not None and os.path.exists(new_save_dir):
        after["left behind"] = str(new_save_dir)  # a refused command leaves no --save-dir
    return case, proc, before, after


def _run_all(cases: list[Case], contexts: list[Ctx]) -> list[tuple]:
    """Console-script cases two at a time in threads, each thread with its own fork server
    (``forked_commands``); in-process cases meanwhile in this thread."""
    jobs = list(zip(cases, contexts))
    local = [job for job in jobs if job[0].prog in IN_PROCESS]
    servers: queue.Queue[ForkedCommands] = queue.Queue()

    def run_forked(case: Case, ctx: Ctx) -> tuple:
        server = servers.get()
        try:
            return _run_case(case, ctx, server)
        finally:
            servers.put(server)

    with ThreadPoolExecutor(max_workers=2) as pool:
        for started in [pool.submit(ForkedCommands, ENV) for _ in range(2)]:
            servers.put(started.result())
        futures = {id(job[0]): pool.submit(run_forked, *job) for job in jobs if job not in local}
        done = {id(job[0]): _run_case(*job) for job in local}
        done |= {key: future.result() for key, future in futures.items()}
    while not servers.empty():
        servers.get().close()
    return [done[id(case)] for case in cases]


def test_every_case_is_one_line_and_changes_nothing(fixtures, tmp_path):
    data, other, done = fixtures
    assert len(CASES) >= 100
    contexts = []
    for i, _ in enumerate(CASES):
        scratch = tmp_path / f"case{i}"
        scratch.mkdir()
        (scratch / "x.txt").write_text("one document\n")
        contexts.append(Ctx(data, other, done, scratch))
    results = _run_all(CASES, contexts)
    failures = []
    for case, proc, before, after in results:
        lines = [line for line in proc.stderr.splitlines() if line.startswith(f"{case.prog}: ")]
        problems = []
        if proc.returncode != case.status:
            problems.append(f"exit {proc.returncode}, expected {case.status}")
        if len(lines) != 1 or not re.search(case.needle, lines[0]):
            problems.append(f"error lines {lines!r} do not match {case.needle!r}")
        if "Traceback" in proc.stderr:
            problems.append("a traceback was printed")
        if before != after:
            problems.append("a file it was given changed")
        if problems:
            failures.append(f"[{case.name}] {'; '.join(problems)}\n    {proc.stderr[-800:]}")
    assert not failures, "\n".join(failures)
