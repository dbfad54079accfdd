"""Misuse and faults, through the real console commands: each case gives a one-line error that
names the file or flag and what to do, a nonzero exit status, and leaves every file it was
given exactly as it was (hashed before and after).  Never a traceback, never exit 0.

The cases run two at a time (each is mostly fairseq's start-up).  Fixtures: one tiny prepared
stream, one finished 2-stage run on it, and small vision .npz files.
"""

from __future__ import annotations

import hashlib
import json
import os
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


def lm(ctx: Ctx, data: Path, save: Path, *extra: str) -> list[str]:
    return [tool("fairseq-train"), str(data), *LM_FLAGS, "--save-dir", str(save), *extra]


def vision(ctx: Ctx, data: str, save: Path, *extra: str) -> list[str]:
    return [tool("fairseq-train"), data, *VISION_FLAGS, "--save-dir", str(save), *extra]


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
    Case("bad stop-after-stage", lambda c: (lm(c, c.data, c.tmp / "r"), []), r"ALMA_STOP_AFTER_STAGE must be a stage number", env={"ALMA_STOP_AFTER_STAGE": "first"}),
    Case("growth without slots", lambda c: (lm(c, c.data, c.tmp / "r", "--grow-experts", "2"), []), r"--moe-max-experts must be >= 4"),
    Case("growth not integers", lambda c: (lm(c, c.data, c.tmp / "r", "--grow-experts", "two"), []), r"--grow-experts/--grow-at-stages take comma-separated integers"),
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
         r"checkpoint_last.pt: damaged \(record .* fails its CRC check\); move it aside"),
]


def _with(ctx: Ctx, name: str, text: str) -> Path:
    save = ctx.copy(ctx.done, "r")
    (save / name).write_text(text)
    return save


VISION_CASES = [
    Case("vision without dataset", lambda c: (vision(c, "digits", c.tmp / "r"), []), r"--arch alma_vision needs --vision-dataset"),
    Case("vision unknown dataset", lambda c: (vision(c, "x", c.tmp / "r", "--vision-dataset", "imagenet"), []), r"--vision-dataset 'imagenet' is unknown"),
    Case("vision mnist dir missing", lambda c: (vision(c, str(c.tmp / "nowhere"), c.tmp / "r", "--vision-dataset", "mnist"), []), r"nowhere"),
    Case("npz stray label", lambda c: (vision(c, npz(c, "d", y_train=np.where(np.arange(40) == 5, 255, np.arange(40) % 3)), c.tmp / "r", "--vision-dataset", "npz"), []),
         r"labels go up to 255 but classes 3, 4, 5, 6, 7 \.\.\. never occur"),
    Case("npz NaN", lambda c: (vision(c, npz(c, "d", x_test=np.full((9, 6), np.nan)), c.tmp / "r", "--vision-dataset", "npz"), []), r"x_test holds NaN or inf in 9 example"),
    Case("npz counts differ", lambda c: (vision(c, npz(c, "d", y_train=np.arange(39) % 3), c.tmp / "r", "--vision-dataset", "npz"), []), r"x_train has 40 examples but y_train 39 labels"),
    Case("npz strings", lambda c: (vision(c, npz(c, "d", x_train=np.array([["a"] * 6] * 40)), c.tmp / "r", "--vision-dataset", "npz"), []), r"x_train has dtype <U1"),
    Case("vision B too large", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--num-megabatches", "5000"), []), r"--num-megabatches 5000 is larger than the training set"),
    Case("vision width 0", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--vision-width", "0"), []), r"--vision-width must be >= 1"),
    Case("ff new layers negative", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--vision-method", "ff", "--ff-new-layers", "-1"), []), r"--ff-new-layers must be >= 0 \(0: width growth only\)"),
    Case("vision fp16 flag", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--fp16"), []), r"--fp16 does not apply to vision streams"),
    Case("vision amp fp16 on cpu", lambda c: (vision(c, "digits", c.tmp / "r", "--vision-dataset", "digits", "--vision-amp", "fp16"), []), r"--vision-amp fp16 needs a CUDA device"),
]

SCORE_CASES = [
    Case("score not a dir", lambda c: ([tool("alma-score"), str(c.tmp / "nowhere")], []), r"RUN_DIR .*nowhere: not a directory", prog="alma-score"),
    Case("score no stream.jsonl", lambda c: ([tool("alma-score"), str(c.tmp)], []), r"stream.jsonl: missing", prog="alma-score"),
    Case("score gens of a continue run", lambda c: ([tool("alma-score"), str(c.done), "--mode", "gens"], [c.done]), r"--mode gens: .*--stage-init continue", prog="alma-score"),
    Case("score with another dictionary", lambda c: ([tool("alma-score"), str(c.done), "--data", str(data_copy(c, "d", reordered_dict))], [c.done, c.tmp / "d"]),
         r"trained with another dictionary .*score it on the stream it was trained on", prog="alma-score"),
    Case("score ens of two streams", lambda c: ([tool("alma-score"), str(c.done), str(_other_stream_run(c)), "--mode", "ens"], [c.done]),
         r"--mode ens: .* was trained on another stream", prog="alma-score"),
    Case("score damaged stage checkpoint", lambda c: ([tool("alma-score"), str(_damaged_stage(c))], [c.tmp / "r"]), r"checkpoint_stage2.pt: not a readable checkpoint", prog="alma-score"),
    Case("score checkpoint of another run", lambda c: ([tool("alma-score"), str(other_run_checkpoint(c))], [c.tmp / "mixed"]),
         r"checkpoint_stage1.pt belongs to another run than .*run.json", prog="alma-score"),
    Case("score bad batch size", lambda c: ([tool("alma-score"), str(c.done), "--batch-size", "0"], [c.done]), r"--batch-size must be >= 1", prog="alma-score"),
]


def _damaged_stage(ctx: Ctx) -> Path:
    save = ctx.copy(ctx.done, "r")
    (save / "checkpoint_stage2.pt").write_bytes(b"PK\x03\x04 not really a checkpoint")
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


def gpt2_flags(ctx: Ctx, vocab_bpe: str, extra_symbols: tuple[str, ...] = ()) -> list[str]:
    """--bpe gpt2 with an encoder.json of every byte symbol (plus ``extra_symbols``) and the
    given vocab.bpe text, both written to the case's scratch dir."""
    from fairseq.data.encoders.gpt2_bpe_utils import bytes_to_unicode

    symbols = [*bytes_to_unicode().values(), *extra_symbols]
    (ctx.tmp / "encoder.json").write_text(json.dumps({s: i for i, s in enumerate(symbols)}), encoding="utf-8")
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
    Case("prep out holds another stream", lambda c: (prep(c, c.copy(c.data, "d")), [c.tmp]),
         r"--out .*d holds another stream, prepared from .*corpus.txt .*add --clean to replace", prog="alma-data-prep"),
    Case("prep out holds other files", lambda c: (prep(c, c.tmp), [c.tmp]),
         r"--out .* holds files that are not an alma-data-prep stream \(x.txt\); choose a new or empty directory", prog="alma-data-prep"),
    Case("prep out is a file", lambda c: (prep(c, c.tmp / "x.txt"), [c.tmp]), r"--out .*x.txt: exists and is not a directory", prog="alma-data-prep"),
    Case("prep absurd mega-batches", lambda c: (prep(c, c.copy(c.data, "d"), "--num-megabatches", str(10**12)), [c.tmp]),
         r"--num-megabatches 1000000000000 needs at least 1,000,000,000,002 documents .* can hold at most 13; lower it", prog="alma-data-prep"),
]

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


def _run_case(case: Case, ctx: Ctx) -> tuple[Case, subprocess.CompletedProcess, dict, dict]:
    argv, watched = case.setup(ctx)
    before = {str(p): _tree_hash(p) for p in watched}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ctx.tmp,
                          env={**ENV, **case.env})
    after = {str(p): _tree_hash(p) for p in watched}
    return case, proc, before, after


def test_every_case_is_one_line_and_changes_nothing(fixtures, tmp_path):
    data, other, done = fixtures
    assert len(CASES) >= 40
    contexts = []
    for i, _ in enumerate(CASES):
        scratch = tmp_path / f"case{i}"
        scratch.mkdir()
        (scratch / "x.txt").write_text("one document\n")
        contexts.append(Ctx(data, other, done, scratch))
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_run_case, CASES, contexts))
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
